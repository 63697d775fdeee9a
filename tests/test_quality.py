"""The quality study's smoke mode, run as users run it: every run writes its JSON with the fields the study promises,
the variants differ only where they should (same start, same data order, same initial weights), a stopped run resumes
to the same curve, `--reproduce` prints the committed curve, and the report fills docs/quality.md from the files."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARK = BENCHMARKS / "quality.py"
SMOKE_RUNS = "scratch-small-*-seed0,scratch-small-*-seed1,convert-tiny-*-seed0,cpt-smollm2-*-seed0"
FIELDS = {"study", "variant", "size", "params", "seed", "tokens", "curve", "wall_s", "command", "code_version"}


def load_benchmark():
    spec = importlib.util.spec_from_file_location("quality", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quality = load_benchmark()


def run_benchmark(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", *arguments], capture_output=True, text=True, check=True
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """A smoke run of two seeds from scratch and one seed of each continued-pretraining study; its folders."""
    folder = tmp_path_factory.mktemp("quality")
    run_benchmark("--only", SMOKE_RUNS, "--work", str(folder / "runs"), "--results", str(folder / "results"))
    return folder


def results(smoke: Path) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in (smoke / "results").glob("*.json")}


def test_every_run_writes_its_json(smoke):
    runs = results(smoke)
    expected = [run.id for run in quality.select(quality.all_runs(smoke=True), SMOKE_RUNS)]
    assert sorted(runs) == sorted(expected)
    for name, run in runs.items():
        assert FIELDS <= run.keys(), name
        assert run["id"] == name and run["command"] == f"python benchmarks/quality.py --only {name} --smoke"
        assert run["tokens"] == run["curve"][-1][0] > 0 and run["wall_s"] > 0 and run["params"] > 0
        assert len(run["curve"]) >= 3 and run["curve"][0][0] == 0
    for study in quality.STUDIES:  # every variant of a study is scored at the same token counts
        counts = {json.dumps([t for t, _ in run["curve"]]) for run in runs.values() if run["study"] == study}
        assert len(counts) == 1, study
    for name, run in runs.items():
        if run["study"] == "scratch":
            assert run["curve"][-1][1] < run["curve"][0][1], name  # trained: the held-out loss fell
    assert runs["convert-tiny-plain-cpt-seed0"]["final"]["docs"] > 0  # the original domain, scored at the end
    assert runs["cpt-smollm2-converted-cpt-seed0"]["final"]["unseen-code"] > 0


def test_converted_arms_start_where_plain_cpt_starts(smoke):
    """Conversion is exact: every arm's first held-out loss is its source's; training then takes them apart."""
    runs = results(smoke)
    for study, arms in (("convert-tiny", quality.CONVERT_VARIANTS), ("cpt-smollm2", quality.CPT_VARIANTS)):
        plain = runs[f"{study}-plain-cpt-seed0"]
        for arm in arms:
            assert runs[f"{study}-{arm}-seed0"]["curve"][0][1] == pytest.approx(plain["curve"][0][1], abs=1e-5)
        converted = runs[f"{study}-converted-cpt-seed0"]
        assert converted["curve"][-1][1] != plain["curve"][-1][1]
    assert runs["convert-tiny-plain-cpt-seed0"]["parent"] == "scratch-small-prenorm-seed0"


def test_from_scratch_variants_share_data_order_and_initial_weights(smoke):
    configs = {}
    for variant in quality.SCRATCH_VARIANTS:
        for seed in (0, 1):
            config = json.loads(
                (smoke / "runs" / f"scratch-small-{variant}-seed{seed}" / "training_config.json").read_text()
            )
            configs[variant, seed] = {k: v for k, v in config.items() if k not in ("model", "output_dir")}
    for (variant, seed), config in configs.items():  # same seed, data and hyperparameters: the same data order
        assert config == configs["prenorm", seed], (variant, seed)
    assert configs["prenorm", 0] != configs["prenorm", 1]

    def initial(variant: str, seed: int) -> dict[str, torch.Tensor]:
        return load_file(smoke / "runs" / "init" / f"small-{variant}-seed{seed}" / "model.safetensors")

    for seed in (0, 1):
        prenorm = initial("prenorm", seed)
        for variant in ("block", "full"):
            attnres = initial(variant, seed)
            shared = {name: tensor for name, tensor in attnres.items() if "_res_" not in name}
            assert shared.keys() == prenorm.keys()
            for name, tensor in shared.items():
                assert torch.equal(tensor, prenorm[name]), (variant, seed, name)
            queries = [tensor for name, tensor in attnres.items() if "_res_proj" in name]
            assert queries and all(not query.any() for query in queries)  # zero pseudo-queries, as the paper says
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(initial("prenorm", 0)[name], initial("prenorm", 1)[name])  # seeds differ


def test_a_stopped_run_resumes_to_the_same_curve(smoke, tmp_path):
    """Stopped after its first checkpoint and started again, a run reaches the curve of the uninterrupted one."""
    run = next(spec for spec in quality.all_runs(smoke=True) if spec.id == "scratch-small-block-seed0")
    corpus = smoke / "runs" / "smoke-corpus"
    setting = quality.Setting(tmp_path, tmp_path / "results", corpus, smoke=True, threads=1, command=" --smoke")
    quality.train_run(setting, run, stop_at_step=run.options["eval_every"])
    assert not quality.is_trained(tmp_path / run.id)
    curve = quality.held_out_curve(quality.train_run(setting, run), run.tokens_per_step)
    assert curve == results(smoke)[run.id]["curve"]


def test_reproduce_prints_the_committed_curve_up_to_n_tokens(smoke):
    path = smoke / "results" / "convert-tiny-converted-cpt-seed0.json"
    committed = json.loads(path.read_text())["curve"]
    tokens = committed[1][0]
    output = run_benchmark("--work", str(smoke / "runs"), "--reproduce", str(path), "--reproduce-tokens", str(tokens))
    assert json.loads(output.stdout.strip().splitlines()[-1]) == committed[:2]


def test_a_run_held_by_a_live_process_is_left_to_it(tmp_path):
    setting = quality.Setting(tmp_path, tmp_path, tmp_path, smoke=True, threads=1, command="")
    with quality.claimed(setting, "some-run") as first:
        with quality.claimed(setting, "some-run") as second:
            assert first and not second
    (tmp_path / "held-run.lock").write_text(str(os.getppid()))  # a live process: the one that started pytest
    with quality.claimed(setting, "held-run") as taken:
        assert not taken
    (tmp_path / "other-run.lock").write_text("999999999")  # a process that is gone
    with quality.claimed(setting, "other-run") as taken:
        assert taken


def test_the_report_fills_the_page_from_the_files(smoke, tmp_path):
    page = "# Quality\n\n" + "".join(f"<!-- report: {name} -->\nold\n<!-- /report -->\n\n" for name in
                                     ("progress", "scratch", "convert-tiny", "cpt-smollm2"))  # fmt: skip
    (tmp_path / "quality.md").write_text(page)
    run_benchmark("--results", str(smoke / "results"), "--docs", str(tmp_path), "--report")
    filled = (tmp_path / "quality.md").read_text()
    assert "old" not in filled
    for label in ["PreNorm", "Block AttnRes", "Full AttnRes"] + [
        label for label, _ in quality.CONVERT_VARIANTS.values()
    ]:
        assert f"| {label} |" in filled, label
    assert "| scratch | 6 of 18 |" in filled
    for picture in ("quality_scratch_gap.png", "quality_convert_tiny.png", "quality_cpt_smollm2.png"):
        assert (tmp_path / picture).stat().st_size > 0


def test_the_committed_page_shows_the_committed_results(tmp_path):
    """docs/quality.md's generated blocks are what the report makes of benchmarks/results/ now."""
    docs = BENCHMARKS.parent / "docs"
    (tmp_path / "quality.md").write_text((docs / "quality.md").read_text())
    subprocess.run(
        [sys.executable, str(BENCHMARK), "--docs", str(tmp_path), "--report"], check=True, capture_output=True
    )
    assert (tmp_path / "quality.md").read_text() == (docs / "quality.md").read_text()
