"""Past one process: FSDP2 and DeepSpeed ZeRO-3 train an AttnRes model exactly as one process does, on 2 CPU ranks
over gloo; each example Accelerate config runs the engine it names, in fp32 and in its bf16 (which the CPU runs, as
autocast, FSDP2 mixed precision and DeepSpeed bf16); a requested engine never silently becomes DDP.

Every launch is a subprocess with a timeout (a hang fails the test) and one thread per rank. The runs here take about
eight minutes on two busy cores, the bf16 launches two and a half of them.
"""

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import TINY_RUN, VOCAB, attnres_twin, tiny_source_model, tiny_tokenizer

from attnres import AttnResForCausalLM
from attnres.folders import read_metrics
from attnres.training import TrainingConfig, TrainingError, train
from attnres.training.recipe import make_optimizer

EXAMPLES = Path(__file__).parent.parent / "examples" / "accelerate"
NEEDS_DEEPSPEED = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason='DeepSpeed is not installed: pip install "attnres[deepspeed]"'
)
LAUNCH_TIMEOUT = 300  # seconds: a rank that hangs fails the test instead of stalling the suite
RANKS = 2
BATCH_PER_RANK = TINY_RUN["batch_size"]
# 3 optimizer steps of 2 ranks x 4 sequences (8 in the single process), a checkpoint after the second
RUN = {name: value for name, value in TINY_RUN.items() if name != "batch_size"} | dict(
    max_steps=3,
    save_every=2,
    mixed_precision="no",  # fp32 unless a test asks for bf16
)
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-5  # fp32 noise: sums reduced in another order, after 3 AdamW steps
# Against the single process in bf16 autocast: bf16 rounding, which FSDP2 (bf16 parameters in compute) and DeepSpeed
# (bf16 weights) add to the autocast's. AdamW turns rounding in near-zero gradients into steps of the full learning
# rate, so the losses after an update drift by as much as bf16 itself moves them: the single process's third loss is
# 2.2e-2 from its fp32 run. Measured (third loss, weights): DDP 1.7e-3, 1.7e-2; FSDP2 3.6e-2, 3.8e-2; ZeRO-3 2.6e-2,
# 3.7e-2. FSDP2 with Accelerate's own policy, which casts the fp32 depth state to bf16 between layers: 5.9e-2 in the
# weights (`keep_depth_state_precise`). The first loss, before any update, differs by the forward's rounding only:
# 1.0e-3 for FSDP2 and ZeRO-3.
BF16_FIRST_LOSS_TOLERANCE = 3e-3
BF16_LOSS_TOLERANCE = 6e-2
BF16_WEIGHT_TOLERANCE = 0.05
TOLERANCES = {"no": (LOSS_TOLERANCE, WEIGHT_TOLERANCE), "bf16": (BF16_LOSS_TOLERANCE, BF16_WEIGHT_TOLERANCE)}

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "datasets_cache")]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    """A few standard-library modules as JSON lines, one document per paragraph."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = [
        part
        for module in ("textwrap", "heapq", "bisect")
        for part in (stdlib / f"{module}.py").read_text().split("\n\n")
    ]
    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": document}) + "\n" for document in documents if document.strip()))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Block AttnRes model (4 layers, blocks of 2, random non-zero queries) and its tokenizer."""
    folder = tmp_path_factory.mktemp("model")
    attnres_twin(tiny_source_model("llama", num_layers=4), seed=0, attnres_block_size=2).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def single_process(checkpoint, corpus_file, tmp_path_factory) -> Path:
    """The reference: `attnres train` in this process, on both ranks' batches at once."""
    output_dir = tmp_path_factory.mktemp("single") / "out"
    train(
        output_dir=str(output_dir),
        model=str(checkpoint),
        dataset=str(corpus_file),
        batch_size=RANKS * BATCH_PER_RANK,
        **RUN,
    )
    return output_dir


@pytest.fixture(scope="module")
def single_process_bf16(checkpoint, corpus_file, datasets_cache, tmp_path_factory) -> Path:
    """The reference in bf16 autocast over float32 weights (Accelerate's `mixed_precision="bf16"` in one CPU process),
    in a process of its own: Accelerate's state keeps the precision of a process's first Accelerator."""
    output_dir = tmp_path_factory.mktemp("single-bf16") / "out"
    arguments = train_arguments(
        output_dir, checkpoint, corpus_file, batch_size=RANKS * BATCH_PER_RANK, mixed_precision="bf16"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(datasets_cache)}
    child = subprocess.run(
        [sys.executable, *arguments], env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return output_dir


def launch(
    config_file: Path,
    arguments: list[str],
    datasets_cache: Path,
    port: int,
    mixed_precision: str = "no",
    **environment: str,
) -> str:
    """`accelerate launch --config_file CONFIG_FILE` of 2 CPU ranks -> their output; fails the test if they fail."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    command += ["--num_processes", str(RANKS), "--main_process_port", str(port)]
    command += ["--mixed_precision", mixed_precision, *arguments]  # the example configs' bf16, or fp32
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(datasets_cache), **environment}
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-4000:]
    return child.stdout + child.stderr


def train_arguments(output_dir: Path, checkpoint: Path, corpus_file: Path, **extra) -> list[str]:
    options = {**RUN, "batch_size": BATCH_PER_RANK, "output_dir": output_dir, "model": checkpoint}
    options |= {"dataset": corpus_file, **extra}
    flags = {name: value for name, value in options.items() if value is not True}
    switches = [f"--{name.replace('_', '-')}" for name, value in options.items() if value is True]
    return ["-m", "attnres.training", *switches] + [
        f"--{name.replace('_', '-')}={value}" for name, value in flags.items()
    ]


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir) if "loss" in record]


def max_weight_diff(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys()
    return max((first[name].float() - second[name].float()).abs().max().item() for name in first)


def assert_trains_like_one_process(
    output_dir: Path, single_process: Path, label: str, mixed_precision: str = "no"
) -> None:
    """Same loss at every step, same exported weights (which load into AttnResForCausalLM), within the noise of the
    precision both ran in."""
    distributed, reference = losses(output_dir), losses(single_process)
    weight_diff = max_weight_diff(
        load_file(output_dir / "model.safetensors"), load_file(single_process / "model.safetensors")
    )
    loss_diff = max(abs(first - second) for first, second in zip(distributed, reference, strict=True))
    print(
        f"{label}: losses {distributed} vs one process {reference}; max loss difference {loss_diff:.2e}, "
        f"max weight difference {weight_diff:.2e}"
    )
    loss_tolerance, weight_tolerance = TOLERANCES[mixed_precision]
    first_loss_tolerance = LOSS_TOLERANCE if mixed_precision == "no" else BF16_FIRST_LOSS_TOLERANCE
    assert len(distributed) == RUN["max_steps"]
    assert abs(distributed[0] - reference[0]) <= first_loss_tolerance
    assert loss_diff <= loss_tolerance
    assert weight_diff <= weight_tolerance
    assert type(AttnResForCausalLM.from_pretrained(output_dir)) is AttnResForCausalLM


# --------------------------------------------------------------------------------------------------------------------
# FSDP2 and ZeRO-3: every rule, with and without activation checkpointing (FSDP2: the units the training command makes)
# --------------------------------------------------------------------------------------------------------------------

ENGINE_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from tiny import VOCAB, attnres_twin, tiny_source_model
from torch.distributed.fsdp import FSDPModule
from attnres.training import TrainingConfig
from attnres.training.engine import distribution, make_accelerator, unsharded_twin
from attnres.training.recipe import make_optimizer

cases, output_dir = json.loads(sys.argv[1]), Path(sys.argv[2])
# Built whole before the Accelerator exists: under its ZeRO-3 state transformers would build the source partitioned
models = {
    name: attnres_twin(tiny_source_model("llama", num_layers=4), seed=1, **settings["attnres"]).train()
    for name, settings in cases["models"].items()
}
config = TrainingConfig(output_dir=str(output_dir), mixed_precision="no")
accelerator = make_accelerator(config)  # as `attnres train` makes it: FSDP2 or DeepSpeed over gloo
rank, per_rank = accelerator.process_index, cases["batch_per_rank"]
if accelerator.state.deepspeed_plugin is not None:  # no data loader is prepared to fill in "auto"
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = per_rank
shape = (3, accelerator.num_processes * per_rank, 16)  # steps, sequences, tokens
batches = torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(0))
results = {"engine": accelerator.distributed_type.value, "world_size": accelerator.num_processes}
for name, settings in cases["models"].items():
    model = models[name]
    if settings["activation_checkpointing"]:
        model.activation_checkpointing_enable()
    optimizer = make_optimizer(model, config)
    model, optimizer = accelerator.prepare(model, optimizer)
    step_losses = []
    for batch in batches:
        input_ids = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step_losses.append(accelerator.reduce(loss.detach(), "mean").item())
    units = [name or "<root>" for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    share = distribution(accelerator, model)["parameter_share"]
    state_dict = accelerator.get_state_dict(model)  # whole on the main process
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        if isinstance(unwrapped, FSDPModule):
            unsharded_twin(unwrapped, state_dict).save_pretrained(output_dir / name)
        else:
            unwrapped.save_pretrained(output_dir / name, state_dict=state_dict)
    checkpointed = all(layer.gradient_checkpointing for layer in unwrapped.model.layers)
    results[name] = {"losses": step_losses, "units": units, "share": share, "checkpointed": checkpointed}
    accelerator.free_memory()  # forget this model: the Accelerator holds one at a time, as in `attnres train`
if accelerator.is_main_process:
    (output_dir / "results.json").write_text(json.dumps(results))
accelerator.wait_for_everyone()
"""
ENGINE_CASES = {
    "block": {"attnres": {"attnres_block_size": 2}, "activation_checkpointing": False},
    "block-checkpointed": {"attnres": {"attnres_block_size": 2}, "activation_checkpointing": True},
    "full": {"attnres": {"attnres_mode": "full"}, "activation_checkpointing": False},
    "full-checkpointed": {"attnres": {"attnres_mode": "full"}, "activation_checkpointing": True},
    "block-recomputed": {
        "attnres": {"attnres_block_size": 2, "attnres_recompute": True},
        "activation_checkpointing": True,
    },
    # The other residual rules, from their own init: their parameters (mHC's [24, 4d] projections, gates of one
    # element) shard and gather as AttnRes's do
    "mhc-checkpointed": {"attnres": {"attnres_mode": "mhc"}, "activation_checkpointing": True},
    "highway": {"attnres": {"attnres_mode": "highway"}, "activation_checkpointing": False},
    "layerscale": {"attnres": {"attnres_mode": "layerscale"}, "activation_checkpointing": False},
    "denseformer-sublayers-checkpointed": {
        "attnres": {"attnres_mode": "denseformer_sublayers"},
        "activation_checkpointing": True,
    },
    "rezero-prenorm": {"attnres": {"attnres_mode": "rezero_prenorm"}, "activation_checkpointing": False},
    "postnorm": {"attnres": {"attnres_mode": "postnorm"}, "activation_checkpointing": False},
    # Table 4's ablations: a [d, d] query projection over two channel groups; a logit per source with sigmoid scores
    "block-projected-checkpointed": {
        "attnres": {"attnres_block_size": 2, "attnres_query": "projected", "attnres_depth_heads": 2},
        "activation_checkpointing": True,
    },
    "full-scalars-sigmoid": {
        "attnres": {"attnres_mode": "full", "attnres_query": "scalars", "attnres_score": "sigmoid"},
        "activation_checkpointing": False,
    },
}


def one_process_reference(settings: dict, batches: torch.Tensor) -> tuple[list[float], AttnResForCausalLM]:
    """The same 3 steps in one process: the whole batch, AdamW as `attnres train` sets it up, clipping at 1."""
    model = attnres_twin(tiny_source_model("llama", num_layers=4), seed=1, **settings["attnres"]).train()
    optimizer = make_optimizer(model, TrainingConfig(output_dir="unused"))
    step_losses = []
    for input_ids in batches:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step_losses.append(loss.item())
    return step_losses, model


@pytest.mark.parametrize("engine", ["FSDP", pytest.param("DEEPSPEED", marks=NEEDS_DEEPSPEED)])
def test_sharding_engine_trains_every_rule_like_one_process(engine, datasets_cache, free_port, tmp_path):
    """FSDP2 and ZeRO-3 with every parameter partitioned (mHC's [24, 4d] projections, gates and scales of one element,
    the projected query's [d, d] matrix): gathered for each layer's forward and its recomputation, 3 steps equal to
    one process's."""
    script = tmp_path / "engine_ranks.py"
    script.write_text(ENGINE_SCRIPT)
    cases = {"batch_per_rank": 2, "models": ENGINE_CASES}
    tests_folder = str(Path(__file__).parent)
    if engine == "FSDP":
        config_file, placement = EXAMPLES / "fsdp2.yaml", {"ACCELERATE_USE_CPU": "1"}
    else:  # the script builds its models whole; DeepSpeed partitions them (the test of the training command below
        # builds its model partitioned, with zero3_init_flag)
        config_file, placement = zero3_accelerate_config(tmp_path, init_flag=False), {}
    launch(
        config_file,
        [str(script), json.dumps(cases), str(tmp_path)],
        datasets_cache,
        free_port,
        PYTHONPATH=os.pathsep.join([tests_folder, os.environ.get("PYTHONPATH", "")]),
        **placement,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["engine"], results["world_size"]) == (engine, RANKS)

    batches = torch.randint(3, VOCAB, (3, RANKS * 2, 16), generator=torch.Generator().manual_seed(0))
    for name, settings in ENGINE_CASES.items():
        result = results[name]
        if engine == "FSDP":
            # One unit per decoder layer; the final norm, (tied) embedding and LM head as one more; then the root
            units = [
                "<root>",
                "model.embed_tokens",
                *(f"model.layers.{index}" for index in range(4)),
                "model.norm",
                "lm_head",
            ]
            assert result["units"] == units
        assert 0.5 <= result["share"] < 0.51  # of the parameters, on rank 0
        assert result["checkpointed"] == settings["activation_checkpointing"]
        reference_losses, reference = one_process_reference(settings, batches)
        saved = AttnResForCausalLM.from_pretrained(tmp_path / name)
        weight_diff = max_weight_diff(dict(saved.named_parameters()), dict(reference.named_parameters()))
        print(
            f"{engine} {name}: losses {result['losses']} vs one process {reference_losses}; "
            f"max weight difference {weight_diff:.2e}; rank 0 holds {result['share']:.2%} of the parameters"
        )
        assert result["losses"] == pytest.approx(reference_losses, abs=LOSS_TOLERANCE)
        assert weight_diff <= WEIGHT_TOLERANCE
        assert saved.config.attnres_mode == reference.config.attnres_mode


# --------------------------------------------------------------------------------------------------------------------
# `attnres train` with each example config, and ZeRO-3 with every parameter partitioned
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize(
    "config_name, engine, sharded",
    [
        ("ddp.yaml", "DDP", False),
        ("fsdp2.yaml", "FSDP2", True),
        pytest.param("deepspeed_zero3.yaml", "DeepSpeed ZeRO-3", False, marks=NEEDS_DEEPSPEED),
    ],
)
def test_example_config_runs_its_engine_like_one_process(
    config_name, engine, sharded, mixed_precision, checkpoint, corpus_file, datasets_cache, free_port, tmp_path, request
):
    """As a user on a CPU machine would (ACCELERATE_USE_CPU=1): FSDP2 and ZeRO-3 run, not DDP in their place; in fp32
    and in the example configs' bf16, each against the single process in the same precision.

    The ZeRO-3 example keeps DeepSpeed's parameter persistence threshold (1e5 elements), under which every parameter
    of this tiny model stays whole on every rank (gradients and optimizer state are partitioned); the test below
    partitions the parameters too.
    """
    output_dir = tmp_path / "out"
    console = launch(
        EXAMPLES / config_name,
        train_arguments(output_dir, checkpoint, corpus_file, mixed_precision=mixed_precision),
        datasets_cache,
        free_port,
        mixed_precision,
        ACCELERATE_USE_CPU="1",
    )
    layout = read_metrics(output_dir)[0]["distribution"]
    assert (layout["engine"], layout["world_size"], layout["device"], layout["backend"], layout["mixed_precision"]) == (
        engine,
        RANKS,
        "cpu",
        "gloo",
        mixed_precision,
    )
    assert f"Training with {engine} on {RANKS} cpu process(es)" in console
    # Each rank holds about half of the weights when sharded (FSDP2 splits each along its first dimension)
    assert 0.5 <= layout["parameter_share"] < 0.51 if sharded else layout["parameter_share"] == 1
    reference = request.getfixturevalue("single_process_bf16" if mixed_precision == "bf16" else "single_process")
    assert_trains_like_one_process(output_dir, reference, f"{engine} ({mixed_precision})", mixed_precision)
    assert (output_dir / "modeling_attnres.py").exists() and (output_dir / "checkpoints" / "step-2").is_dir()


ZERO3_EVERY_PARAMETER = {
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,  # partition everything: pseudo-queries and key norms too
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_clipping": 1.0,
    "gradient_accumulation_steps": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
}


def zero3_accelerate_config(folder: Path, init_flag: bool) -> Path:
    """An Accelerate config for ZeRO-3 with every parameter partitioned; `init_flag`: built partitioned."""
    deepspeed_config = folder / "zero3.json"
    deepspeed_config.write_text(json.dumps(ZERO3_EVERY_PARAMETER))
    accelerate_config = folder / "zero3.yaml"
    accelerate_config.write_text(
        "distributed_type: DEEPSPEED\nnum_machines: 1\nmachine_rank: 0\nuse_cpu: false\n"
        f"deepspeed_config:\n  deepspeed_config_file: {deepspeed_config}\n  zero3_init_flag: {str(init_flag).lower()}\n"
    )
    return accelerate_config


@NEEDS_DEEPSPEED
def test_zero3_gathers_every_partitioned_attnres_parameter(
    checkpoint, corpus_file, single_process, datasets_cache, free_port, tmp_path
):
    """Every pseudo-query and key norm is partitioned; a layer reads them as tensors, and DeepSpeed gathers them for
    it in the forward and the backward, which recomputes the layer (activation checkpointing) and within it the mix
    with its norm (`--attnres-recompute`): the run equals the single process, which recomputes neither."""
    accelerate_config = zero3_accelerate_config(tmp_path, init_flag=True)
    output_dir = tmp_path / "out"
    arguments = train_arguments(
        output_dir, checkpoint, corpus_file, activation_checkpointing=True, attnres_recompute=True
    )
    launch(accelerate_config, arguments, datasets_cache, free_port)
    layout = read_metrics(output_dir)[0]["distribution"]
    assert (layout["engine"], layout["world_size"], layout["parameter_share"]) == ("DeepSpeed ZeRO-3", RANKS, 0.5)
    assert_trains_like_one_process(output_dir, single_process, "ZeRO-3, every parameter partitioned")


# --------------------------------------------------------------------------------------------------------------------
# A requested engine that cannot run
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variable, engine",
    [("ACCELERATE_USE_FSDP", "FSDP"), pytest.param("ACCELERATE_USE_DEEPSPEED", "DeepSpeed", marks=NEEDS_DEEPSPEED)],
)
def test_engine_requested_without_a_launcher_is_a_clear_error(
    variable, engine, checkpoint, corpus_file, tmp_path, monkeypatch
):
    monkeypatch.setenv(variable, "true")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    expected = (
        rf"{engine} was asked for .*not started by a launcher.* would train as one process alone .*accelerate launch"
    )
    with pytest.raises(TrainingError, match=expected):
        train(output_dir=str(tmp_path), model=str(checkpoint), dataset=str(corpus_file), **RUN)
    assert not any(tmp_path.iterdir())  # stopped before writing anything


# --------------------------------------------------------------------------------------------------------------------
# What FSDP2 on CPU processes rests on: Accelerate's state, set from outside
# --------------------------------------------------------------------------------------------------------------------

ACCELERATE_STATE_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from tiny import attnres_twin, tiny_source_model
from torch.distributed.fsdp import FSDPModule
from attnres.training.engine import distribution, shard_with_fsdp2

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
accelerator = Accelerator(cpu=True)
before = accelerator.distributed_type.value
shard_with_fsdp2(accelerator)
model = attnres_twin(tiny_source_model("llama", num_layers=2))
model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
print(json.dumps({
    "before": before,
    "states": [AcceleratorState().distributed_type.value, PartialState().distributed_type.value],
    "fsdp2": accelerator.is_fsdp2,
    "sharded": isinstance(model, FSDPModule),
    "engine": distribution(accelerator, model)["engine"],
}))
"""


def test_fsdp2_on_cpu_rests_on_accelerate_state_it_sets(free_port, tmp_path):
    """Accelerate enables FSDP for accelerators only and has no public way to ask for it on CPU processes, so
    `shard_with_fsdp2` sets Accelerate's state itself (its FSDP plugin and distributed type). Pinned in one process, in
    seconds: states made later read what it set, and `prepare` then shards with FSDP2. If Accelerate changes how it
    keeps or reads that state, this fails, and names it, before the launches above train as something else."""
    script = tmp_path / "accelerate_state.py"
    script.write_text(ACCELERATE_STATE_SCRIPT)
    tests_folder = str(Path(__file__).parent)
    env = {
        **os.environ,
        "FSDP_VERSION": "2",
        "PYTHONPATH": os.pathsep.join([tests_folder, os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.run(
        [sys.executable, str(script), str(free_port)], env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.strip().splitlines()[-1]) == {
        "before": "NO",
        "states": ["FSDP", "FSDP"],
        "fsdp2": True,
        "sharded": True,
        "engine": "FSDP2",
    }
