"""`attnres compare` as a user runs it: a tiny random Llama saved to a folder and a folder of text documents, three
rules x two seeds. Its results recompute from its runs (paired t-intervals and Holm's p, checked against scipy; the
validation gap along training), the same command again trains nothing, from-scratch arms of one seed start from the
same weights, and every mistake is one line with nothing written. A second study of training regimes (the source
with LoRA, only a rule's parameters) with a learning-rate grid is run by two workers at once, who share its runs;
`--status` lists them; a study file (`--config`) gives the options the flags do; 2 gloo ranks train an arm as one
process does."""

import argparse
import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from scipy import stats
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from attnres.compare import (
    ArmRun,
    comparisons,
    config_from,
    grid_of,
    hold_out_of,
    holm,
    paired_interval,
    read_study_file,
    status,
    training_config,
)
from attnres.errors import OptionError
from attnres.options import Arm, CompareConfig, TrainingConfig

STUDY = (
    "--rules prenorm,block,full --seeds 2 --tokens 7680 --seq-len 64 --batch-size 4 --evaluations 3 --eval-sequences 8 "
    "--held-out-documents 4 --held-out-bytes 4000"
).split()


def attnres_command(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnres_cli.command", "compare", *arguments], capture_output=True, text=True, cwd=cwd
    )


def started(*arguments: str, cwd: Path, log: Path) -> subprocess.Popen:
    """`attnres compare ARGUMENTS` started in the background, its messages into the file `log` (a pipe that nothing
    reads while it runs would fill with its progress bars and stop it)."""
    with log.open("w") as messages:
        return subprocess.Popen([sys.executable, "-m", "attnres_cli.command", "compare", *arguments], cwd=cwd,
                                stdout=subprocess.DEVNULL, stderr=messages)  # fmt: skip


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
    assert sorted((run["arm"], run["seed"]) for run in runs) == [
        (rule, seed) for rule in ("block", "full", "prenorm") for seed in (0, 1)
    ]
    for run in runs:
        assert run["tokens"] == 7680 and run["lr"] == 1e-3 and math.isfinite(run["test_loss"])
        assert [point[0] for point in run["curve"]] == [0, 2560, 5120, 7680] and run["cpu_seconds_per_step"] > 0
    test_losses = {(run["rule"], run["seed"]): run["test_loss"] for run in runs}
    p_values = []
    for comparison in results["comparisons"]:
        rule = comparison["arm"]
        differences = [test_losses[rule, seed] - test_losses["prenorm", seed] for seed in (0, 1)]
        t = stats.ttest_rel([test_losses[rule, s] for s in (0, 1)], [test_losses["prenorm", s] for s in (0, 1)])
        low, high = t.confidence_interval(0.95)
        assert comparison["mean"] == pytest.approx(sum(differences) / 2, abs=1e-12)
        assert comparison["ci95"] == pytest.approx([low, high], rel=1e-9)
        assert comparison["p"] == pytest.approx(t.pvalue, rel=1e-9)
        p_values.append(comparison["p"])
        curves = {(run["arm"], run["seed"]): run["curve"] for run in runs}
        for index, (tokens, mean, low, high) in enumerate(comparison["validation_gap"]):
            gaps = [curves[rule, seed][index][1] - curves["prenorm", seed][index][1] for seed in (0, 1)]
            assert tokens == curves["prenorm", 0][index][0] and mean == pytest.approx(sum(gaps) / 2, abs=1e-12)
            if index > 0:  # at the start every arm computes what the source computed: no spread to test
                assert [low, high] == pytest.approx(paired_interval(gaps)[1:3], rel=1e-9)
    smaller, larger = sorted(p_values)
    expected = {smaller: min(1, 2 * smaller), larger: min(1, max(2 * smaller, larger))}  # Holm, m = 2
    assert [c["p_holm"] for c in results["comparisons"]] == pytest.approx([expected[p] for p in p_values])
    for seed, split in results["splits"].items():
        assert split["test"]["documents"] >= 4 and split["test"]["bytes"] >= 4000, seed
        assert split["shared_with_train"] == {"validation": 0.0, "test": 0.0}
    report = (study / "report.md").read_text()
    assert "| block | 2 | 0.001 |" in report and (study / "curves.png").stat().st_size > 0
    assert (study / "gap.png").stat().st_size > 0 and "(gap.png)" in report
    for rule in ("block", "full"):  # timed against the baseline's step on the same batch, in interleaved pairs
        cost = results["cost"][rule]
        assert cost["ratio"] > 0 and cost["arm_s"] > 0 and cost["device"] == "cpu"
        assert cost["step_memory"]["measure"].startswith("bytes a step holds")  # not the peak: the CPU counts none
    for rule in ("prenorm", "block", "full"):  # the trained seed-0 model's depth-mixing matrix, drawn
        rows = results["mixing_matrices"][rule]["rows"]
        assert len(rows) == 2 * 2 + 1 and (study / f"mixing-{rule}.png").stat().st_size > 0
        assert f"(mixing-{rule}.png)" in report


@pytest.mark.slow
def test_the_same_command_again_trains_nothing(study, inputs):
    before = {path: path.stat().st_mtime_ns for path in (study / "runs").rglob("*") if path.is_file()}
    results = (study / "results.json").read_text()
    done = attnres_command("model", "--data", "docs", "--output-dir", "study", *STUDY, cwd=inputs)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {path: path.stat().st_mtime_ns for path in (study / "runs").rglob("*") if path.is_file()} == before
    assert (study / "results.json").read_text() == results
    # The study file it saved is the same study: the same again
    done = attnres_command("--config", "study/study.yaml", cwd=inputs)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {path: path.stat().st_mtime_ns for path in (study / "runs").rglob("*") if path.is_file()} == before
    assert (study / "results.json").read_text() == results


def test_holm_and_the_comparisons_follow_their_definitions():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    runs = [{"arm": arm, "seed": seed, "test_loss": loss, "curve": [[0, 5.0], [10, loss + 0.5]]}
            for arm, seed, loss in (
        ("prenorm", 0, 2.0), ("prenorm", 1, 2.2), ("prenorm", 2, 2.1),
        ("block", 0, 1.9), ("block", 1, 2.15), ("block", 2, 2.02),
        ("full", 0, 2.0),
    )]  # fmt: skip
    block, full = comparisons(runs, "prenorm")
    t = stats.ttest_rel([1.9, 2.15, 2.02], [2.0, 2.2, 2.1])
    assert block["pairs"] == 3 and block["p"] == pytest.approx(t.pvalue) and block["p_holm"] == pytest.approx(t.pvalue)
    assert full["pairs"] == 1 and math.isnan(full["p"]) and math.isnan(full["p_holm"])  # one pair: no test
    assert block["validation_gap"][1][:2] == [10, pytest.approx(block["mean"])]
    assert block["validation_gap"][1][2:] == pytest.approx(list(t.confidence_interval(0.95)))


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


# --------------------------------------------------------------------------------------------------------------------
# From scratch at a smaller scale: --layers, --hidden-size
# --------------------------------------------------------------------------------------------------------------------


def shrunk_from_scratch(inputs: Path, rule: str, seed: int = 3, **shrink) -> torch.nn.Module:
    """The initial model of `rule` at `seed`, from scratch, shrunk as `attnres train` builds it."""
    from transformers import set_seed

    from attnres.training.recipe import load_model

    set_seed(seed)  # as `attnres train` does before it builds the model
    return load_model(TrainingConfig(output_dir="unused", model=str(inputs / "model"), convert=True, mode=rule,
                                     from_scratch=True, seed=seed, **shrink))  # fmt: skip


def test_a_shrunk_model_has_the_asked_shape_and_parameters(inputs):
    from attnres.shrink import parameter_count, shrunk_config

    model = shrunk_from_scratch(inputs, "prenorm", layers=1, hidden_size=16)
    text = model.config.get_text_config()
    vocab = text.vocab_size
    assert (text.num_hidden_layers, text.hidden_size, text.head_dim, text.intermediate_size) == (1, 16, 8, 32)
    assert (text.num_attention_heads, text.num_key_value_heads) == (2, 2)  # the heads kept, each 16 / 2 wide
    assert len(model.model.layers) == 1 and model.get_input_embeddings().weight.shape == (vocab, 16)
    # The tied embedding, one layer (q, k, v, o of 16 x 16; gate, up, down of 16 x 32; two norms), the final norm
    expected = vocab * 16 + (4 * 16 * 16 + 3 * 16 * 32 + 2 * 16) + 16
    assert sum(p.numel() for p in model.parameters()) == expected == 6_752  # with the 259 bytes and marks of ByT5
    source = LlamaConfig.from_pretrained(inputs / "model")
    assert parameter_count(shrunk_config(source, 1, 16)) == expected  # PreNorm adds none: the Llama's own count
    assert shrunk_config(source, None, None).to_dict() == source.to_dict()  # no shrink asked: the source's


def test_the_shrunk_arms_of_a_seed_start_from_the_same_weights(inputs):
    prenorm = dict(shrunk_from_scratch(inputs, "prenorm", layers=1, hidden_size=16).named_parameters())
    full = dict(shrunk_from_scratch(inputs, "full", layers=1, hidden_size=16).named_parameters())
    assert prenorm.keys() < full.keys()  # Full adds its pseudo-queries and key norms
    for name in prenorm:
        assert torch.equal(prenorm[name], full[name]), name
    other_seed = shrunk_from_scratch(inputs, "prenorm", seed=4, layers=1, hidden_size=16)
    assert not torch.equal(dict(other_seed.named_parameters())["model.embed_tokens.weight"],
                           prenorm["model.embed_tokens.weight"])  # fmt: skip


def test_every_family_shrinks_its_per_layer_lists_or_is_refused_in_one_line():
    from transformers import AutoConfig

    from attnres.families import FAMILIES
    from attnres.shrink import shrunk_config

    refused = {}
    for model_type in FAMILIES:
        source = AutoConfig.for_model(model_type)
        try:
            shrunk = shrunk_config(source, 2, None)
        except OptionError as error:
            refused[model_type] = str(error)
            continue
        assert shrunk.num_hidden_layers == 2, model_type
        per_layer = [value for value in shrunk.to_dict().values() if isinstance(value, list) and len(value) > 2]
        assert not any(len(value) == source.num_hidden_layers for value in per_layer), model_type
        if getattr(shrunk, "layer_types", None) is not None:
            assert shrunk.layer_types == source.layer_types[:2], model_type
    # OLMo-Hybrid's first two layers are DeltaNet layers, and its config wants an attention layer
    assert refused == {"olmo_hybrid": "--layers 2: the source's config class (olmo_hybrid) refuses the shrunk "
                       "architecture: OLMoHybrid expects at least one attention layer; choose other sizes"}  # fmt: skip
    # Layer-index lists keep the indices below the new depth
    moe = shrunk_config(AutoConfig.for_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0, 3]), 2, None)
    assert moe.mlp_only_layers == [0]


SHRINK_MISTAKES = {
    "more layers than the source's": ({"layers": 3}, "--layers 3: the source has 2 layers; pass 1 to 2"),
    "a wider model": ({"hidden_size": 64}, "--hidden-size 64: the source's is 32; pass at most 32"),
    "a width the heads do not divide": ({"hidden_size": 10}, "pass a multiple of 4: 8 or 12"),
}


@pytest.mark.parametrize("mistake", SHRINK_MISTAKES)
def test_each_shrink_mistake_names_the_fix(mistake, inputs):
    shrink, words = SHRINK_MISTAKES[mistake]
    with pytest.raises(OptionError, match=words):
        shrunk_from_scratch(inputs, "prenorm", **shrink)


def test_a_shrink_is_refused_where_a_width_does_not_follow_the_hidden_size_or_a_list_is_unknown():
    from transformers import AutoConfig

    from attnres.errors import TrainingError
    from attnres.shrink import shrunk_config

    with pytest.raises(OptionError, match=r"\(deepseek_v3\) sets widths of its own \(q_lora_rank, kv_lora_rank"):
        shrunk_config(AutoConfig.for_model("deepseek_v3"), None, 256)
    unknown = LlamaConfig(num_hidden_layers=3, layer_scales=[1.0, 0.5, 0.25])
    with pytest.raises(OptionError, match="holds layer_scales, a list of one entry per layer"):
        shrunk_config(unknown, 2, None)
    with pytest.raises(TrainingError, match="add --convert --from-scratch"):
        TrainingConfig(output_dir="o", convert=True, layers=2)
    with pytest.raises(OptionError, match="add --from-scratch"):
        CompareConfig(source="m", data="d", output_dir="o", hidden_size=64)


SHRUNK_STUDY = (
    "--from-scratch --layers 1 --hidden-size 16 --rules prenorm,full --seeds 1 --tokens 512 --seq-len 64 "
    "--batch-size 4 --evaluations 1 --eval-sequences 4 --held-out-documents 4 --held-out-bytes 4000 --cost-pairs 2"
).split()


def direct_step_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """What a training step of `model` holds, counted here by hand: the storages autograd saves (not parameters'),
    then every parameter, and for each that trains its gradient, AdamW's two moments and its float32 step count."""
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids).loss.backward()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    trained = [p for p in model.parameters() if p.requires_grad]
    activations = sum(size for pointer, size in saved.items() if pointer not in parameters)
    return activations + sum(p.nbytes for p in model.parameters()) + sum(3 * p.nbytes + 4 for p in trained)


@pytest.mark.slow  # a study of 2 arms, 2 steps each: about 40 s of CPU
def test_a_shrunk_study_records_its_shape_and_each_arm_s_step_memory(inputs):
    done = attnres_command("model", "--data", "docs", "--output-dir", "shrunk", *SHRUNK_STUDY, cwd=inputs)
    assert done.returncode == 0, done.stderr[-2000:]
    study = inputs / "shrunk"
    results = json.loads((study / "results.json").read_text())
    parameters = sum(p.numel() for p in shrunk_from_scratch(inputs, "prenorm", layers=1, hidden_size=16).parameters())
    assert results["architecture"] == {"layers": 1, "hidden_size": 16, "parameters": parameters}
    trained = json.loads((study / "runs" / "full-seed0-lr0.001" / "config.json").read_text())["text_config"]
    assert (trained["num_hidden_layers"], trained["hidden_size"]) == (1, 16)
    report = (study / "report.md").read_text()
    assert f"shrunk (1 layer, hidden size 16, {parameters:,} parameters)" in report
    # Full saves more for the backward than PreNorm, and has parameters of its own: its step holds more
    memory = results["cost"]["full"]["step_memory"]
    assert memory == json.loads((study / "cost.json").read_text())["full"]["step_memory"]
    assert memory["measure"].startswith("bytes a step holds") and memory["measure"] in report
    ids = torch.zeros(4, 64, dtype=torch.long)  # the study's batch shape: the bytes depend on shapes alone
    direct = {rule: direct_step_bytes(shrunk_from_scratch(inputs, rule, seed=0, layers=1, hidden_size=16), ids)
              for rule in ("prenorm", "full")}  # fmt: skip
    assert (memory["baseline_bytes"], memory["arm_bytes"]) == (direct["prenorm"], direct["full"])
    assert memory["ratio"] == direct["full"] / direct["prenorm"] > 1
    assert f"| {memory['ratio']:.2f}x ({direct['full'] / 2**20:.1f} MiB) |" in report
    # Another shrink on the same folder is another study
    listing = sorted(study.rglob("*"))
    shrink = SHRUNK_STUDY.index("--hidden-size") + 1
    other = [*SHRUNK_STUDY[:shrink], "8", *SHRUNK_STUDY[shrink + 1 :]]
    done = attnres_command("model", "--data", "docs", "--output-dir", "shrunk", *other, cwd=inputs)
    assert done.returncode == 1 and "holds a study with other settings (hidden_size)" in done.stderr, done.stderr
    assert sorted(study.rglob("*")) == listing


MISTAKES = {
    "a rule that cannot start as the checkpoint": (
        ["--rules", "prenorm,highway"], "highway cannot start as the source computes"),
    "a shrink without --from-scratch": (["--layers", "1"], "--layers and --hidden-size shrink the source"),
    "a hidden size the heads do not divide": (
        ["--from-scratch", "--hidden-size", "18"], "each hidden_size / 2 wide, a multiple of 2 (an even width for the "
        "rotary embedding); pass a multiple of 4: 16 or 20"),
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


# --------------------------------------------------------------------------------------------------------------------
# Arms, the rate grid, the study file, --status
# --------------------------------------------------------------------------------------------------------------------

ARM_MISTAKES = {
    "a regime that does not exist": ({"rules": "prenorm,block:half"}, "no regime half"),
    "only the parameters of a rule that has none": ({"rules": "prenorm,rezero,prenorm:attnres"}, "no parameters"),
    "the source trained as it is from scratch": ({"rules": "prenorm,source", "from_scratch": True}, "prenorm is"),
    "part of random weights trained": ({"rules": "prenorm,block:lora", "from_scratch": True}, "leaves the rest"),
    "an arm named twice": ({"rules": "prenorm,block,block"}, "named twice"),
    "a grid budget without a grid": ({"grid_tokens": 4096}, "add --lr-grid"),
    "a grid of words": ({"lr_grid": "fast,slow"}, "pass comma-separated rates"),
    "a negative rate in the grid": ({"lr_grid": "1e-3,-1e-3"}, "--lr-grid must be a positive number"),
    "grid evaluations without a grid budget": ({"lr_grid": "1e-3,2e-3", "grid_evaluations": 4}, "add --grid-tokens"),
    "no grid evaluations": ({"lr_grid": "1e-3", "grid_tokens": 4096, "grid_evaluations": 0}, "at least 1"),
    "held-out documents longer than none": ({"shortest_held_out_document": 2048, "longest_held_out_document": 1024},
                                            "below --shortest-held-out-document"),
}  # fmt: skip


@pytest.mark.parametrize("mistake", ARM_MISTAKES)
def test_each_arm_mistake_names_the_fix(mistake):
    options, words = ARM_MISTAKES[mistake]
    with pytest.raises(OptionError, match=words):
        CompareConfig(source="model", data="docs", output_dir="study", **options)


def test_arms_name_a_rule_and_what_trains():
    config = CompareConfig(source="m", data="d", output_dir="o", rules="prenorm, block:attnres,source:lora,source")
    assert [(arm.name, arm.rule, arm.regime, arm.folder) for arm in config.arms()] == [
        ("prenorm", "prenorm", "all", "prenorm"), ("block:attnres", "block", "attnres", "block-attnres"),
        ("source:lora", None, "lora", "source-lora"), ("source", None, "all", "source"),
    ]  # fmt: skip


def record_grid(study: Path, arm: Arm, losses: dict[float, float], steps: int) -> None:
    for lr, loss in losses.items():
        path = ArmRun(arm, 0, lr, steps, "grid").record_path(study)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"validation_loss": loss}))


def test_the_grid_chooses_on_validation_and_grows_past_an_edge(tmp_path):
    config = CompareConfig(source="m", data="d", output_dir="o", rules="prenorm,block", lr_grid="2e-3,1e-3,4e-3",
                           tokens=2048 * 10, grid_tokens=2048 * 2)  # fmt: skip
    arm = config.arms()[1]
    runs, chosen = grid_of(config, tmp_path, arm)
    assert [run.lr for run in runs] == [1e-3, 2e-3, 4e-3] and chosen is None  # nothing trained yet
    assert {(run.seed, run.steps, run.place) for run in runs} == {(0, 2, "grid")}
    record_grid(tmp_path, arm, {1e-3: 3.0, 2e-3: 2.5, 4e-3: 2.6}, 2)
    assert grid_of(config, tmp_path, arm)[1] == 2e-3  # inside the grid: chosen
    record_grid(tmp_path, arm, {2e-3: 2.5, 4e-3: 2.4}, 2)
    runs, chosen = grid_of(config, tmp_path, arm)
    assert [run.lr for run in runs] == [1e-3, 2e-3, 4e-3, 8e-3] and chosen is None  # best at the edge: one more
    record_grid(tmp_path, arm, {8e-3: 2.3}, 2)
    record_grid(tmp_path, arm, {1.6e-2: 2.2}, 2)
    assert grid_of(config, tmp_path, arm) == (runs + [ArmRun(arm, 0, 1.6e-2, 2, "grid")], 1.6e-2)  # at most twice


def test_held_out_documents_and_grid_evaluations_are_settable(tmp_path):
    config = CompareConfig(source="m", data="d", output_dir="o", rules="prenorm,block", held_out_bytes=64 * 1024)
    assert hold_out_of(config).document_bytes == (256, 32 * 1024)  # by default: up to half a split
    config = dataclasses.replace(config, shortest_held_out_document=1024, longest_held_out_document=16 * 1024)
    assert hold_out_of(config).document_bytes == (1024, 16 * 1024)
    # A grid of 612 steps evaluated 12 times, the study's 2980 steps 20 times
    config = dataclasses.replace(config, lr_grid="1e-3", seq_len=256, batch_size=16, tokens=2980 * 4096,
                                 grid_tokens=612 * 4096, evaluations=20, grid_evaluations=12)  # fmt: skip
    arm = config.arms()[1]
    grid_run, study_run = ArmRun(arm, 0, 1e-3, 612, "grid"), ArmRun(arm, 0, 1e-3, 2980, "runs")
    assert training_config(config, grid_run, tmp_path, 1).eval_every == 51
    assert training_config(config, study_run, tmp_path, 1).eval_every == 149


def test_a_study_file_gives_the_options_and_the_flags_override_it(tmp_path):
    study_file = tmp_path / "study.yaml"
    study_file.write_text(
        "source: model\ndata: docs\noutput-dir: out\nrules: [prenorm, block:lora]\nlr-grid: [5e-4, 1e-3]\n"
        "tokens: 4096\nlr: 1e-3\nfrom_scratch: false\n"
    )
    args = argparse.Namespace(config=str(study_file), seeds=2, tokens=8192)  # given on the command line
    assert config_from(args) == CompareConfig(source="model", data="docs", output_dir="out", rules="prenorm,block:lora",
                                              lr_grid="5e-4,1e-3", tokens=8192, seeds=2, lr=1e-3)  # fmt: skip
    for text, words in (("seeds: two\n", "seeds: expected an integer"), ("colour: red\n", "no option colour"),
                        ("[1, 2]\n", "expected a mapping"), ("seeds: 2.5\n", "expected an integer")):  # fmt: skip
        study_file.write_text(text)
        with pytest.raises(OptionError, match=words):
            read_study_file(str(study_file))
    with pytest.raises(OptionError, match="needs SOURCE, --data"):
        config_from(argparse.Namespace(output_dir="out"))


@pytest.mark.slow  # the lock's holder is a process that imports attnres
def test_status_lists_each_run_done_running_or_left(tmp_path, lock_held_elsewhere):
    config = CompareConfig(source="m", data="d", output_dir=str(tmp_path), rules="prenorm,block", seeds=2,
                           tokens=4096, seq_len=64, batch_size=4)  # fmt: skip
    (tmp_path / "study.json").write_text(json.dumps(dataclasses.asdict(config) | {"data_sha256": "0"}))
    prenorm, block = config.arms()
    done = ArmRun(prenorm, 0, 1e-3, 16, "runs")
    done.record_path(tmp_path).parent.mkdir()
    done.record_path(tmp_path).write_text(json.dumps({"test_loss": 2.0}))
    with lock_held_elsewhere(ArmRun(block, 0, 1e-3, 16, "runs").claim_path(tmp_path)) as pid:
        lines = status(tmp_path).splitlines()
    assert lines[0] == f"{tmp_path}: 1 runs done, 1 running, 2 left"
    assert [line.split()[0] for line in lines[1:]] == [f"runs/{arm}-seed{seed}-lr0.001" for seed in (0, 1)
                                                       for arm in ("prenorm", "block")]  # fmt: skip
    assert lines[1].endswith("done") and lines[2].endswith(f"running (pid {pid})") and lines[3].endswith("left")


# --------------------------------------------------------------------------------------------------------------------
# Regimes, the grid and two workers on one study; 2 gloo ranks
# --------------------------------------------------------------------------------------------------------------------

REGIME_STUDY = (
    "--rules prenorm,block:attnres,source:lora --seeds 2 --tokens 2560 --seq-len 64 --batch-size 4 --evaluations 2 "
    "--eval-sequences 8 --held-out-documents 4 --held-out-bytes 4000 --lr-grid 2e-3,8e-3 --grid-tokens 256 "
    "--cost-pairs 2"
).split()


@pytest.fixture(scope="module")
def shared_study(inputs) -> tuple[Path, list[str]]:
    """The regime study run by two workers started together -> its folder, and each worker's log."""
    arguments = ["model", "--data", "docs", "--output-dir", "shared", *REGIME_STUDY]
    workers = {name: started(*arguments, cwd=inputs, log=inputs / f"worker-{name}.log") for name in "ab"}
    codes = [worker.wait(timeout=900) for worker in workers.values()]
    logs = [(inputs / f"worker-{name}.log").read_text() for name in workers]
    assert codes == [0, 0], [log[-2000:] for log in logs]
    return inputs / "shared", logs


@pytest.mark.slow
def test_two_workers_share_the_runs_of_a_study(shared_study):
    study, logs = shared_study
    results = json.loads((study / "results.json").read_text())
    trained = [{"/".join(Path(line.split(" to ")[-1]).parts[-2:]) for line in log.splitlines()
                if "Saved the trained model to" in line} for log in logs]  # fmt: skip
    every_run = {f"{place}/{path.name}" for place in ("grid", "runs") for path in (study / place).iterdir()
                 if path.is_dir()}  # fmt: skip
    assert not trained[0] & trained[1] and trained[0] | trained[1] == every_run  # each run trained once
    for folder in (study / "runs").iterdir():
        if folder.is_dir():
            steps = [record["step"] for record in json.loads("[" + ",".join(
                (folder / "metrics.jsonl").read_text().splitlines()) + "]") if "loss" in record]  # fmt: skip
            assert steps == list(range(1, 11)), folder.name  # one run, never two into one folder
    assert "2 seeds x 3 arms" in (study / "report.md").read_text()
    assert len(results["runs"]) == 6


@pytest.mark.slow
def test_each_arm_takes_the_rate_its_grid_chose_on_validation(shared_study):
    study, _ = shared_study
    results = json.loads((study / "results.json").read_text())
    assert set(results["lr_grid"]) == {"prenorm", "block:attnres", "source:lora"}
    for arm, grid in results["lr_grid"].items():
        records = {lr: json.loads((study / "grid" / f"{arm.replace(':', '-')}-seed0-lr{lr:g}.json").read_text())
                   for lr, _ in grid["tried"]}  # fmt: skip
        assert grid["tried"] == [[lr, record["validation_loss"]] for lr, record in records.items()]
        assert grid["chosen"] == min(records, key=lambda lr: records[lr]["validation_loss"])
        assert grid["tokens"] == 256 and all("test_loss" not in record for record in records.values())
        assert [run["lr"] for run in results["runs"] if run["arm"] == arm] == [grid["chosen"]] * 2
    regimes = {run["arm"]: (run["rule"], run["train"]) for run in results["runs"]}
    assert regimes == {"prenorm": ("prenorm", "all"), "block:attnres": ("block", "attnres"),
                       "source:lora": (None, "lora")}  # fmt: skip
    attnres_only = next(run for run in results["runs"] if run["arm"] == "block:attnres")
    assert attnres_only["attnres_lr"] == attnres_only["lr"]  # it trains only the rule's parameters: at its rate
    assert set(results["mixing_matrices"]) == {"prenorm", "block:attnres"}  # the source has no depth mix
    lines = status(study).splitlines()
    assert lines[0] == f"{study}: {len(lines) - 1} runs done, 0 running, 0 left; finished: {study / 'report.md'}"


@pytest.mark.slow
def test_two_gloo_ranks_train_an_arm_as_one_process_does(study, inputs, free_port):
    """`accelerate launch` of 2 CPU ranks runs the study's seed-0 arms, each trained by both ranks together (2
    sequences each per step): the same validation curve and test loss as the single process's arms."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(Path(__file__).parents[1] / "examples" / "accelerate" / "ddp.yaml"), "--num_processes", "2",
               "--main_process_port", str(free_port), "--mixed_precision", "no", "-m", "attnres_cli.command",
               "compare", "model", "--data", "docs", "--output-dir", "ranks", *STUDY, "--rules", "prenorm,block",
               "--seeds", "1"]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=inputs, env=environment, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "DDP on 2 cpu process(es)" in done.stderr
    one = {run["arm"]: run for run in json.loads((study / "results.json").read_text())["runs"] if run["seed"] == 0}
    two = {run["arm"]: run for run in json.loads((inputs / "ranks" / "results.json").read_text())["runs"]}
    assert set(two) == {"prenorm", "block"}
    for arm, run in two.items():
        assert [point[0] for point in run["curve"]] == [point[0] for point in one[arm]["curve"]]
        assert [point[1] for point in run["curve"]] == pytest.approx(
            [point[1] for point in one[arm]["curve"]], abs=1e-4
        )
        assert run["test_loss"] == pytest.approx(one[arm]["test_loss"], abs=1e-4)


@pytest.mark.slow
def test_ctrl_c_keeps_every_step_but_the_one_it_stops_in(inputs):
    """Ctrl-C stops the run at the end of its step with a checkpoint there; the same command resumes from it."""
    arguments = ["model", "--data", "docs", "--output-dir", "stopped", *STUDY, "--rules", "prenorm,block", "--seeds",
                 "1", "--cost-pairs", "0"]  # fmt: skip
    log = inputs / "stopped.log"
    worker = started(*arguments, cwd=inputs, log=log)
    metrics = inputs / "stopped" / "runs" / "prenorm-seed0-lr0.001" / "metrics.jsonl"
    while not (metrics.is_file() and '"loss"' in metrics.read_text()):
        assert worker.poll() is None, log.read_text()[-2000:]
        time.sleep(0.2)
    worker.send_signal(signal.SIGINT)
    assert worker.wait(timeout=300) == 130 and "attnres compare: interrupted" in log.read_text()
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    checkpoints = [path.name for path in (metrics.parent / "checkpoints").iterdir()]
    assert checkpoints == [f"step-{logged[-1]}"] and 0 < logged[-1] < 30  # saved at the step it stopped after
    done = attnres_command(*arguments, cwd=inputs)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"Resumed from stopped/runs/prenorm-seed0-lr0.001/checkpoints/{checkpoints[0]}" in done.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert steps == list(range(1, 31))
