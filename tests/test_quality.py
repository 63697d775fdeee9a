"""The quality benchmark's smoke mode, run as users run it: every variant of both studies trains, is scored and is
evaluated, and the variants differ only where they should (same start, same data order, same initial weights)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "quality.py"
SEEDS = 2


def load_benchmark():
    spec = importlib.util.spec_from_file_location("quality", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quality = load_benchmark()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("quality") / "run"
    subprocess.run(
        [sys.executable, str(BENCHMARK), "--output", str(output), "--smoke", "--seeds", str(SEEDS)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return output


def test_every_variant_runs_and_is_reported(smoke):
    results = json.loads((smoke / "results.json").read_text())
    scratch = results["scratch"]["runs"]
    assert sorted((run["variant"], run["seed"]) for run in scratch) == sorted(
        (variant, seed) for variant in quality.SCRATCH_VARIANTS for seed in range(SEEDS)
    )
    for run in scratch:
        assert run["final"] < run["curve"][0][1], run  # trained: the held-out loss fell
    cpt = results["cpt"]["runs"]
    assert cpt.keys() == {"source", *quality.CPT_VARIANTS, *quality.RECIPES}
    for name in quality.HUMANEVAL_VARIANTS:
        assert 0.0 <= cpt[name]["humaneval_pass_at_1"] <= 1.0, name
    for name, run in cpt.items():
        assert run["unseen_loss"] > 0, name
    summary = (smoke / "summary.md").read_text()
    for label in [*quality.SCRATCH_VARIANTS.values()] + [label for label, _ in quality.CPT_VARIANTS.values()]:
        assert f"| {label} |" in summary, label
    for picture in ("scratch_loss_curves.png", "cpt_loss_curves.png", "recipe_loss_curves.png"):
        assert (smoke / picture).stat().st_size > 0
    assert (smoke / "scratch" / "analysis-block" / "depth_weights.png").is_file()
    assert (smoke / "cpt" / "converted" / "analysis" / "depth_weights.png").is_file()


def test_continued_pretraining_variants_start_from_the_source(smoke):
    """Conversion is exact and LoRA starts as a no-op: every variant's first held-out loss is the source's; training
    then takes them apart (the converted model's AttnRes parameters move)."""
    runs = json.loads((smoke / "results.json").read_text())["cpt"]["runs"]
    plain = runs["plain"]
    for name in [*quality.CPT_VARIANTS, *quality.RECIPES]:
        assert runs[name]["start"] == pytest.approx(plain["start"], abs=1e-5), name
    assert abs(runs["converted"]["final"] - plain["final"]) > 1e-6
    assert runs["plain"]["final"] < plain["start"]


def test_from_scratch_variants_share_data_order_and_initial_weights(smoke):
    configs = {}
    for variant in quality.SCRATCH_VARIANTS:
        for seed in range(SEEDS):
            config = json.loads((smoke / "scratch" / f"{variant}-seed{seed}" / "training_config.json").read_text())
            configs[variant, seed] = {k: v for k, v in config.items() if k not in ("model", "output_dir")}
    for (variant, seed), config in configs.items():  # same seed, data and hyperparameters: the same data order
        assert config == configs["prenorm", seed], (variant, seed)
    assert configs["prenorm", 0] != configs["prenorm", 1]

    weights = {
        (variant, seed): load_file(smoke / "scratch" / f"init-{variant}-seed{seed}" / "model.safetensors")
        for variant in quality.SCRATCH_VARIANTS
        for seed in range(SEEDS)
    }
    for seed in range(SEEDS):
        prenorm = weights["prenorm", seed]
        for variant in ("block", "full"):
            attnres = weights[variant, seed]
            shared = {name: tensor for name, tensor in attnres.items() if "_res_" not in name}
            assert shared.keys() == prenorm.keys()
            for name, tensor in shared.items():
                assert torch.equal(tensor, prenorm[name]), (variant, seed, name)
            queries = [tensor for name, tensor in attnres.items() if "_res_proj" in name]
            assert queries and all(not query.any() for query in queries)  # zero pseudo-queries, as the paper says
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(weights["prenorm", 0][name], weights["prenorm", 1][name])  # seeds differ
