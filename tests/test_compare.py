"""`attnres compare` as a user runs it: a tiny random Llama saved to a folder and a folder of text documents, three
rules x two seeds. Its results recompute from its runs (paired t-intervals and Holm's p, checked against scipy), the
same command again trains nothing, from-scratch arms of one seed start from the same weights, and every mistake is
one line with nothing written."""

import dataclasses
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy import stats
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from attnres.compare import comparisons, holm
from attnres.options import TrainingConfig

STUDY = (
    "--rules prenorm,block,full --seeds 2 --tokens 7680 --seq-len 64 --batch-size 4 --evaluations 3 --eval-sequences 8 "
    "--held-out-documents 4 --held-out-bytes 4000"
).split()


def attnres_command(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnres_cli.command", "compare", *arguments], capture_output=True, text=True, cwd=cwd
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder with `model/` (a tiny random byte-level Llama with its tokenizer) and `docs/` (200 documents of
    random words, sharing no 32-byte window)."""
    folder = tmp_path_factory.mktemp("compare")
    tokenizer = ByT5Tokenizer(extra_ids=0)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rng = random.Random(0)
    (folder / "docs").mkdir()
    for index in range(200):
        words = ("".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(2, 7))) for _ in range(200))
        (folder / "docs" / f"doc{index:03d}.txt").write_text(" ".join(words))
    return folder


@pytest.fixture(scope="module")
def study(inputs) -> Path:
    done = attnres_command("model", "--data", "docs", "--output-dir", "study", *STUDY, cwd=inputs)
    assert done.returncode == 0, done.stderr[-2000:]
    return inputs / "study"


@pytest.mark.slow
def test_results_recompute_from_the_runs(study):
    results = json.loads((study / "results.json").read_text())
    runs = results["runs"]
    assert sorted((run["rule"], run["seed"]) for run in runs) == [
        (rule, seed) for rule in ("block", "full", "prenorm") for seed in (0, 1)
    ]
    for run in runs:
        assert run["tokens"] == 7680 and run["lr"] == 1e-3 and math.isfinite(run["test_loss"])
        assert [point[0] for point in run["curve"]] == [0, 2560, 5120, 7680] and run["cpu_seconds_per_step"] > 0
    test_losses = {(run["rule"], run["seed"]): run["test_loss"] for run in runs}
    p_values = []
    for comparison in results["comparisons"]:
        rule = comparison["rule"]
        differences = [test_losses[rule, seed] - test_losses["prenorm", seed] for seed in (0, 1)]
        t = stats.ttest_rel([test_losses[rule, s] for s in (0, 1)], [test_losses["prenorm", s] for s in (0, 1)])
        low, high = t.confidence_interval(0.95)
        assert comparison["mean"] == pytest.approx(sum(differences) / 2, abs=1e-12)
        assert comparison["ci95"] == pytest.approx([low, high], rel=1e-9)
        assert comparison["p"] == pytest.approx(t.pvalue, rel=1e-9)
        p_values.append(comparison["p"])
    smaller, larger = sorted(p_values)
    expected = {smaller: min(1, 2 * smaller), larger: min(1, max(2 * smaller, larger))}  # Holm, m = 2
    assert [c["p_holm"] for c in results["comparisons"]] == pytest.approx([expected[p] for p in p_values])
    for seed, split in results["splits"].items():
        assert split["test"]["documents"] >= 4 and split["test"]["bytes"] >= 4000, seed
        assert split["shared_with_train"] == {"validation": 0.0, "test": 0.0}
    report = (study / "report.md").read_text()
    assert "| block | 2 | 0.001 |" in report and (study / "curves.png").stat().st_size > 0


@pytest.mark.slow
def test_the_same_command_again_trains_nothing(study, inputs):
    before = {path: path.stat().st_mtime_ns for path in (study / "runs").rglob("*") if path.is_file()}
    results = (study / "results.json").read_text()
    done = attnres_command("model", "--data", "docs", "--output-dir", "study", *STUDY, cwd=inputs)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {path: path.stat().st_mtime_ns for path in (study / "runs").rglob("*") if path.is_file()} == before
    assert (study / "results.json").read_text() == results


def test_holm_and_the_comparisons_follow_their_definitions():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    runs = [{"rule": rule, "seed": seed, "test_loss": loss} for rule, seed, loss in (
        ("prenorm", 0, 2.0), ("prenorm", 1, 2.2), ("prenorm", 2, 2.1),
        ("block", 0, 1.9), ("block", 1, 2.15), ("block", 2, 2.02),
        ("full", 0, 2.0),
    )]  # fmt: skip
    block, full = comparisons(runs, "prenorm")
    t = stats.ttest_rel([1.9, 2.15, 2.02], [2.0, 2.2, 2.1])
    assert block["pairs"] == 3 and block["p"] == pytest.approx(t.pvalue) and block["p_holm"] == pytest.approx(t.pvalue)
    assert full["pairs"] == 1 and math.isnan(full["p"]) and math.isnan(full["p_holm"])  # one pair: no test


def test_from_scratch_arms_of_a_seed_start_from_the_same_weights(inputs):
    """What `--from-scratch` rests on: two rules of one seed share every parameter they both have, the seed's."""
    from transformers import set_seed

    from attnres.training.recipe import load_model

    models = {}
    for rule in ("prenorm", "block", "mhc"):
        set_seed(3)  # as `attnres train` does before it builds the model
        config = TrainingConfig(output_dir="unused", model=str(inputs / "model"), convert=True, mode=rule,
                                from_scratch=True, seed=3)  # fmt: skip
        models[rule] = dict(load_model(config).named_parameters())
    for rule in ("block", "mhc"):
        shared = models["prenorm"].keys() & models[rule].keys()
        assert len(shared) == len(models["prenorm"])
        for name in shared:
            assert torch.equal(models["prenorm"][name], models[rule][name]), (rule, name)
    set_seed(4)
    other = load_model(dataclasses.replace(config, seed=4, mode="prenorm"))
    assert not torch.equal(dict(other.named_parameters())["model.embed_tokens.weight"],
                           models["prenorm"]["model.embed_tokens.weight"])  # fmt: skip


MISTAKES = {
    "a rule that cannot start as the checkpoint": (
        ["--rules", "prenorm,highway"], "highway cannot start as the source computes"),
    "the baseline not among the rules": (["--rules", "block,full"], "--baseline prenorm is not among --rules"),
    "an unknown rule": (["--rules", "prenorm,blok"], "no rule blok"),
    "a budget below one step": (["--tokens", "10"], "less than one step"),
    "too few documents to hold out": (["--held-out-documents", "150"], "too few documents to hold out"),
}  # fmt: skip


@pytest.mark.parametrize(
    "mistake", [pytest.param(name, marks=[pytest.mark.slow] * (index > 0)) for index, name in enumerate(MISTAKES)]
)
def test_each_mistake_is_one_line_and_nothing_is_written(mistake, inputs):
    arguments, words = MISTAKES[mistake]
    done = attnres_command("model", "--data", "docs", "--output-dir", "mistake", *arguments, cwd=inputs)
    assert done.returncode == 1 and words in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (inputs / "mistake").exists()


def test_an_output_inside_the_data_is_refused(inputs):
    done = attnres_command("model", "--data", "docs", "--output-dir", "docs/study", cwd=inputs)
    assert done.returncode == 1 and "lies inside the data" in done.stderr
    assert not (inputs / "docs" / "study").exists()


@pytest.mark.slow
def test_other_settings_on_an_existing_study_are_refused(study, inputs):
    listing = sorted(study.rglob("*"))
    done = attnres_command("model", "--data", "docs", "--output-dir", "study", *STUDY[:-1], "5000", cwd=inputs)
    assert done.returncode == 1 and "holds a study with other settings (held_out_bytes)" in done.stderr
    assert sorted(study.rglob("*")) == listing
