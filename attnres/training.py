"""Continued pretraining with Accelerate, from one CPU to a GPU cluster: `attnres train`.

Accelerate owns devices, processes, mixed precision, gradient accumulation, distribution (DDP, FSDP2, DeepSpeed: pick
one with `accelerate launch --config_file examples/accelerate/<kind>.yaml`) and checkpoint contents (`save_state` /
`load_state`). On top of that, continued pretraining of AttnRes needs:

- its own learning rate, without weight decay, for the AttnRes parameters (pseudo-queries and key norms): on a
  converted model they start at zero and must move much further than the pretrained weights around them;
- `--train attnres` (only those parameters) and `--train lora` (LoRA on the projections, AttnRes parameters in full);
- checkpoints that are complete or absent (written to a temporary folder, then renamed) and that resume exactly:
  model, optimizer, scheduler, RNG and the position in the data;
- held-out loss and the entropy of the depth weights per sublayer (how far each sublayer has moved from the uniform
  mixture it starts with), in `metrics.jsonl` and Accelerate's trackers;
- a non-finite loss stops the run before it reaches the weights; SIGTERM saves a checkpoint and stops.

    accelerate launch --config_file examples/accelerate/ddp.yaml -m attnres.training --output-dir out --convert
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m attnres.training --output-dir out --convert   # CPUs
"""

import argparse
import dataclasses
import itertools
import json
import math
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from accelerate.tracking import get_available_trackers
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    LoggerType,
    ProjectConfiguration,
    is_deepspeed_available,
    parse_flag_from_env,
    set_seed,
)
from datasets import Dataset, IterableDataset
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    get_scheduler,
)
from transformers.integrations import is_deepspeed_zero3_enabled

from . import data
from .analysis import depth_weight_entropy, sublayer_names
from .conversion import (
    DEFAULT_SOURCE,
    conversion_record,
    convert_to_attnres,
    load_source,
    load_source_tokenizer,
    model_card,
    resolve_source,
    source_name,
)
from .folders import (
    CHECKPOINTS_FOLDER,
    METRICS_FILE,
    TRAINING_CONFIG_FILE,
    check_output_dir,
    put_in_place,
    read_metrics,
    read_origin,
    remove,
    staging_path,
    write_origin,
)
from .hub import push_folder
from .training_config import SCHEDULERS, TrainingConfig, TrainingError

logger = get_logger(__name__)

# AttnRes parameters are recognised by name: the pseudo-queries (`*_res_proj`) and key norms (`*_res_norm`) of every
# sublayer and of the output aggregation. PEFT's `modules_to_save` takes the module names.
ATTNRES_PARAMETER_MARKERS = ("_res_proj", "_res_norm")
ATTNRES_MODULES = [
    "self_attention_res_proj",
    "self_attention_res_norm",
    "mlp_res_proj",
    "mlp_res_norm",
    "output_attn_res_proj",
    "output_attn_res_norm",
]
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAM_BETAS = (0.9, 0.95)


# --------------------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------------------


def model_location(config: TrainingConfig) -> tuple[str, str | None]:
    return resolve_source(config.model or DEFAULT_SOURCE, config.gguf_file)


def is_attnres(model: nn.Module) -> bool:
    return model.config.model_type == "attnres"


def is_attnres_parameter(name: str) -> bool:
    return any(marker in name for marker in ATTNRES_PARAMETER_MARKERS)


def load_model(config: TrainingConfig) -> PreTrainedModel:
    """The model to train, in float32 (mixed precision is Accelerate's autocast): AttnRes, converted, or as is."""
    path, gguf_file = model_location(config)
    if AutoConfig.from_pretrained(path, gguf_file=gguf_file).model_type == "attnres":
        if config.convert:
            raise TrainingError(f"{path} is already an AttnRes model; drop --convert")
        return AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    if config.convert:
        if is_deepspeed_zero3_enabled():  # set by the Accelerator: from_pretrained now partitions what it loads
            raise TrainingError(
                "--convert cannot read the source's weights once DeepSpeed ZeRO-3 has partitioned them: convert first "
                "(attnres convert SOURCE DIR), then train DIR without --convert"
            )
        return convert_to_attnres(path, config.mode, config.block_size, dtype=torch.float32, gguf_file=gguf_file)
    return load_source(path, torch.float32, gguf_file)


def make_trainable(model: PreTrainedModel, config: TrainingConfig) -> nn.Module:
    """Mark what `--train` trains: every weight, the AttnRes parameters only, or LoRA adapters plus AttnRes."""
    if config.train == "attnres":
        if not is_attnres(model):
            raise TrainingError("--train attnres needs an AttnRes model: pass an AttnRes checkpoint, or add --convert")
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(is_attnres_parameter(name))
    elif config.train == "lora":
        lora_config = LoraConfig(
            task_type="CAUSAL_LM",
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=LORA_TARGET_MODULES,
            modules_to_save=ATTNRES_MODULES if is_attnres(model) else None,
        )
        model = get_peft_model(model, lora_config)
    return model


def make_optimizer(model: nn.Module, config: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only, and the AttnRes parameters in a group of their own (`--attnres-lr`)."""
    groups = {"weights": [], "vectors": [], "attnres": []}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            # A parameter that DeepSpeed ZeRO-3 partitioned as it loaded holds an empty tensor; `ds_shape` is its shape
            matrix = len(getattr(parameter, "ds_shape", parameter.shape)) >= 2
            group = "attnres" if is_attnres_parameter(name) else "weights" if matrix else "vectors"
            groups[group].append(parameter)
    settings = {
        "weights": {"weight_decay": config.weight_decay},
        "vectors": {"weight_decay": 0.0},
        "attnres": {"weight_decay": 0.0, "lr": config.attnres_lr},
    }
    param_groups = [{"name": name, "params": params, **settings[name]} for name, params in groups.items() if params]
    return torch.optim.AdamW(param_groups, lr=config.lr, betas=ADAM_BETAS)


def make_scheduler(optimizer: torch.optim.Optimizer, config: TrainingConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup, then cosine decay, a warmup-stable-decay schedule, or a constant rate, per optimizer step."""
    warmup_steps = config.max_steps // 20 if config.warmup_steps is None else config.warmup_steps
    specific = {
        "cosine": {"min_lr_rate": config.min_lr_ratio},
        "wsd": {
            "num_decay_steps": config.max_steps // 5 if config.decay_steps is None else config.decay_steps,
            "min_lr_ratio": config.min_lr_ratio,
        },
        "constant": {},
    }[config.lr_scheduler]
    return get_scheduler(
        SCHEDULERS[config.lr_scheduler],
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=config.max_steps,
        scheduler_specific_kwargs=specific,
    )


# --------------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------------


def build_datasets(
    config: TrainingConfig, tokenizer: PreTrainedTokenizerBase, num_processes: int
) -> tuple[Dataset | IterableDataset, Dataset]:
    """(training sequences, held-out sequences), checked to hold at least one batch for every process."""
    name = config.dataset or "the standard-library corpus"
    documents = data.load_documents(config.dataset, config.dataset_config, config.split, config.streaming)
    data.check_text_field(documents, config.text_field, name)
    if config.eval_split is not None:
        held_out = data.load_documents(config.dataset, config.dataset_config, config.eval_split, config.streaming)
        data.check_text_field(held_out, config.text_field, f"{name} [{config.eval_split}]")
    else:
        documents, held_out = data.split_held_out(documents, config.eval_size, config.seed)
    if config.streaming:  # a map-style dataset is shuffled by the data loader's sampler instead
        documents = documents.shuffle(seed=config.seed, buffer_size=config.shuffle_buffer)

    train_sequences = data.pack(documents, tokenizer, config.text_field, config.seq_len)
    held_out_sequences = data.pack(held_out, tokenizer, config.text_field, config.seq_len)
    # Scored again at every evaluation: a fixed, materialised set
    held_out_sequences = Dataset.from_list(list(itertools.islice(held_out_sequences, config.max_eval_sequences)))

    one_batch = config.batch_size * num_processes
    available = sum(1 for _ in itertools.islice(train_sequences, one_batch))
    if available < one_batch:
        raise data.DataError(
            f"{name} packs into {available} training sequences of {config.seq_len} tokens, fewer than one batch "
            f"({config.batch_size} per process x {num_processes} processes). Use more data, or lower --seq-len or "
            "--batch-size."
        )
    if len(held_out_sequences) == 0:
        raise data.DataError(
            f"the held-out documents of {name} pack into no sequence of {config.seq_len} tokens: raise --eval-size, "
            "name a larger --eval-split, or lower --seq-len."
        )
    return train_sequences, held_out_sequences


def make_data_loaders(
    config: TrainingConfig, train_sequences: Dataset | IterableDataset, held_out_sequences: Dataset
) -> tuple[DataLoader, DataLoader]:
    """A shuffled training loader (Accelerate reseeds its sampler from the seed at every epoch) and a held-out one.

    Each loader has a generator of its own so that creating its iterators leaves the global RNG (dropout) alone, which
    keeps a resumed run on the same random stream as an uninterrupted one.
    """
    train_loader = DataLoader(
        train_sequences.with_format("torch"),
        batch_size=config.batch_size,
        shuffle=not config.streaming,
        drop_last=True,
        generator=torch.Generator().manual_seed(config.seed),
    )
    held_out_loader = DataLoader(
        held_out_sequences.with_format("torch"),
        batch_size=config.batch_size,
        generator=torch.Generator().manual_seed(config.seed),
    )
    return train_loader, held_out_loader


@dataclass
class TrainingProgress:
    """Where the run stands; saved with every checkpoint (Accelerate's `register_for_checkpointing`)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` each process has consumed
    tokens: int = 0  # tokens trained on, all processes together

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def training_batches(accelerator: Accelerator, loader: DataLoader, progress: TrainingProgress) -> Iterator[dict]:
    """Micro-batches epoch after epoch, from the position in `progress` on (skipping what was already trained on)."""
    while True:
        loader.set_epoch(progress.epoch)
        epoch_loader = accelerator.skip_first_batches(loader, progress.batches_in_epoch)
        for batch in epoch_loader:
            progress.batches_in_epoch += 1
            yield batch
        if progress.batches_in_epoch == 0:
            raise data.DataError("the training data ran out before the first batch")
        progress.epoch, progress.batches_in_epoch = progress.epoch + 1, 0


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints, metrics, signals
# --------------------------------------------------------------------------------------------------------------------


class Checkpoints:
    """`OUTPUT_DIR/checkpoints/step-N`, each either complete or absent; the most recent `total_limit` are kept.

    `save_state` writes from every process (random states per rank, shards under FSDP and DeepSpeed) into one folder
    that only becomes `step-N` by a rename once all of them are done: an interrupted save leaves the previous
    checkpoint as the latest. Accelerate's own `automatic_checkpoint_naming` writes in place, hence this class.
    """

    def __init__(self, output_dir: Path, total_limit: int, accelerator: Accelerator):
        self.folder = output_dir / CHECKPOINTS_FOLDER
        self.total_limit = total_limit
        self.accelerator = accelerator

    def all(self) -> list[Path]:
        """Completed checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        completed = [path for path in self.folder.glob("step-*") if path.name.removeprefix("step-").isdigit()]
        return sorted(completed, key=lambda path: int(path.name.removeprefix("step-")))

    def latest(self) -> Path | None:
        return next(reversed(self.all()), None)

    def save(self, step: int) -> Path:
        accelerator, checkpoint = self.accelerator, self.folder / f"step-{step}"
        staging = staging_path(checkpoint)
        if accelerator.is_main_process:
            remove(staging)  # left over from a save that was interrupted
        accelerator.wait_for_everyone()
        accelerator.save_state(staging)
        accelerator.wait_for_everyone()  # save_state returns on each process when its own part is written
        if accelerator.is_main_process:
            put_in_place(staging, checkpoint)
            for old in self.all()[: -self.total_limit]:
                remove(old)
        accelerator.wait_for_everyone()
        return checkpoint


class MetricsLog:
    """One JSON record per logged step in `metrics.jsonl`, mirrored to Accelerate's trackers (main process only).

    `opening` (for example how the run is distributed) joins the first record this process writes.
    """

    def __init__(self, path: Path, accelerator: Accelerator, opening: dict[str, Any] | None = None):
        self.path = path
        self.accelerator = accelerator
        self.opening = opening or {}

    def forget_from(self, step: int) -> None:
        """Drop the records of `step` and later, which this run logs anew (after the checkpoint it resumed from)."""
        if self.accelerator.is_main_process and self.path.exists():
            records = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] < step]
            self.path.write_text("".join(line + "\n" for line in records))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        metrics, self.opening = self.opening | metrics, {}
        if self.accelerator.is_main_process:
            with self.path.open("a") as file:
                file.write(json.dumps({"step": step, **metrics}) + "\n")
        scalars = {}
        for name, value in metrics.items():
            if isinstance(value, dict):
                scalars |= {f"{name}/{key}": item for key, item in value.items() if isinstance(item, int | float)}
            elif isinstance(value, int | float):
                scalars[name] = value
        self.accelerator.log(scalars, step=step)


class TerminationSignal:
    """Turns SIGTERM into a request, so that the loop can checkpoint at the next step boundary and stop cleanly."""

    def __init__(self):
        self.received = False
        self.previous_handler = None

    def __enter__(self) -> "TerminationSignal":
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            self.previous_handler = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.received = True

    def __exit__(self, *exc_info) -> None:
        if self.previous_handler is not None:
            signal.signal(signal.SIGTERM, self.previous_handler)


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What a training run holds once Accelerate has prepared it."""

    config: TrainingConfig
    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: DataLoader
    held_out_loader: DataLoader
    with_depth_weights: bool  # an AttnRes model, which reports its depth weights
    distribution: dict[str, Any]  # engine, world size and sharding in use (`distribution`)
    progress: TrainingProgress = field(default_factory=TrainingProgress)

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)


@dataclass
class TrainingResult:
    output_dir: Path
    step: int  # optimizer steps done
    metrics: dict[str, Any]  # the latest of each figure logged: loss, eval_loss, depth_weight_entropy, ...
    interrupted: bool  # stopped by SIGTERM or --stop-at-step: a checkpoint was saved, nothing exported; --resume
    model: nn.Module  # the trained model on this process (a PeftModel with --train lora)


def resolve_mixed_precision(choice: str) -> str | None:
    """`auto`: what `accelerate launch` was configured with, else bf16 where the GPU supports it, else fp32."""
    if choice != "auto":
        return choice
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        return None  # the Accelerator reads it
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


# How the error messages name Accelerate's distributed types
ENGINE_NAMES = {
    DistributedType.FSDP: "FSDP",
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.NO: "one process alone",
    DistributedType.MULTI_CPU: "DDP over CPU processes",
    DistributedType.MULTI_GPU: "DDP over GPUs",
}


def requested_engine() -> DistributedType | None:
    """FSDP or DeepSpeed where `accelerate launch` (from its config file) or the environment asks for one, else None."""
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return DistributedType.DEEPSPEED
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return DistributedType.FSDP
    return None


def make_accelerator(config: TrainingConfig) -> Accelerator:
    """The Accelerator of this process, running the engine that was asked for or stopping with a `TrainingError`.

    Accelerate enables FSDP and DeepSpeed only on GPUs (and other accelerators); on CPUs it would quietly train the
    processes as DDP instead. Both engines run on CPU processes over gloo all the same, so there this process sets them
    up: DeepSpeed through Accelerate's own path (with DeepSpeed's CPU accelerator), which needs Accelerate not to be
    told to use the CPU; FSDP2 by handing Accelerate's multi-CPU state the FSDP plugin (`shard_with_fsdp2`).
    """
    unavailable = [name for name in config.report_to if LoggerType(name) not in get_available_trackers()]
    if unavailable:
        raise TrainingError(f"--report-to {' '.join(unavailable)}: pip install {' '.join(unavailable)}, or drop it")
    engine = requested_engine()
    if engine is DistributedType.DEEPSPEED and not is_deepspeed_available():
        raise TrainingError('DeepSpeed was asked for (ACCELERATE_USE_DEEPSPEED=true): pip install "attnres[deepspeed]"')
    placement: dict[str, Any] = {}
    if not torch.accelerator.is_available():
        if engine is DistributedType.DEEPSPEED and "LOCAL_RANK" in os.environ:  # started by a launcher
            os.environ["ACCELERATE_USE_CPU"] = "false"  # read by the Accelerator below: leave the device to DeepSpeed
            placement["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
        else:
            placement["cpu"] = True  # launched processes train together over gloo, without ACCELERATE_USE_CPU=1
    output_dir = Path(config.output_dir)
    accelerator = Accelerator(
        mixed_precision=resolve_mixed_precision(config.mixed_precision),
        # Steps are counted in optimizer steps across epochs: the end of an epoch does not cut an accumulation short.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=config.grad_accum, sync_with_dataloader=False
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        log_with=config.report_to or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        **placement,
    )
    if engine is DistributedType.FSDP and accelerator.distributed_type is DistributedType.MULTI_CPU:
        shard_with_fsdp2(accelerator)
    # Launched processes on an accelerator that Accelerate does not train across (MPS, say) would each run alone
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > accelerator.num_processes:
        raise TrainingError(
            f"{world_size} processes were launched, but each runs alone (Accelerate cannot join them on "
            f"{accelerator.device}): set ACCELERATE_USE_CPU=1 to train across CPU processes"
        )
    if engine is not None and accelerator.distributed_type is not engine:
        launch = "started by a launcher" if "WORLD_SIZE" in os.environ else "not started by a launcher"
        raise TrainingError(
            f"{ENGINE_NAMES[engine]} was asked for (ACCELERATE_USE_{engine.value}=true), but this process ({launch}, "
            f"ACCELERATE_USE_CPU={os.environ.get('ACCELERATE_USE_CPU', 'unset')}) would train as "
            f"{ENGINE_NAMES.get(accelerator.distributed_type, accelerator.distributed_type.value)} on "
            f"{accelerator.device}. Start the processes with `accelerate launch --config_file "
            "examples/accelerate/<fsdp2 or deepspeed_zero3>.yaml -m attnres.training ...` (where there are GPUs, "
            "without ACCELERATE_USE_CPU=1), or choose examples/accelerate/ddp.yaml for data parallel."
        )
    return accelerator


def shard_with_fsdp2(accelerator: Accelerator) -> None:
    """Let Accelerate prepare, clip, checkpoint and gather the model with FSDP2 over this multi-CPU (gloo) group.

    Accelerate keeps FSDP for GPUs (state.py enables it for MULTI_GPU and the like only), yet its FSDP2 code is device
    independent and `fully_shard` runs over gloo: the state gets the plugin that `accelerate launch` described in the
    environment (FSDP_* variables), as it would on GPUs.
    """
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise TrainingError("on CPU processes attnres train shards with FSDP2 only: set fsdp_version: 2")
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    # Both states, as Accelerate's own set-up does: an AcceleratorState made later copies the PartialState's type.
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP


def distribution(accelerator: Accelerator, model: nn.Module) -> dict[str, Any]:
    """How the prepared model is actually spread: engine, processes, device, and the share of the weights held here."""
    kind = accelerator.distributed_type
    if kind is DistributedType.FSDP:
        engine = f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
    elif kind is DistributedType.DEEPSPEED:
        engine = f"DeepSpeed ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}"
    else:
        engine = "DDP" if accelerator.num_processes > 1 else "single process"
    held = whole = 0
    for parameter in model.parameters():
        if isinstance(parameter, DTensor):  # FSDP2: this process's shard
            held, whole = held + parameter.to_local().numel(), whole + parameter.numel()
        elif hasattr(parameter, "ds_numel"):  # DeepSpeed ZeRO-3: this process's partition, or all of a persistent one
            held += parameter.ds_numel if parameter.ds_persist else parameter.ds_tensor.numel()
            whole += parameter.ds_numel
        else:
            held, whole = held + parameter.numel(), whole + parameter.numel()
    return {
        "engine": engine,
        "world_size": accelerator.num_processes,
        "device": accelerator.device.type,
        "backend": accelerator.state.backend,
        "mixed_precision": accelerator.mixed_precision,
        "parameter_share": round(held / whole, 4),  # of the model's parameters, held by each process
    }


def start(config: TrainingConfig, accelerator: Accelerator) -> Run:
    """Load tokenizer, data and model, mark what trains, and let Accelerate prepare it all for this process."""
    set_seed(config.seed)
    model_path, gguf_file = model_location(config)
    tokenizer = load_source_tokenizer(model_path, gguf_file)
    with accelerator.main_process_first():  # the main process fills the datasets cache, the others read it
        train_sequences, held_out_sequences = build_datasets(config, tokenizer, accelerator.num_processes)
    model = load_model(config)
    with_depth_weights = is_attnres(model)
    if config.activation_checkpointing:
        model.activation_checkpointing_enable()
    model = make_trainable(model, config)
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config)
    train_loader, held_out_loader = make_data_loaders(config, train_sequences, held_out_sequences)
    model, optimizer, train_loader, held_out_loader = accelerator.prepare(
        model, optimizer, train_loader, held_out_loader
    )
    run = Run(
        config,
        accelerator,
        tokenizer,
        model,
        optimizer,
        scheduler,
        train_loader,
        held_out_loader,
        with_depth_weights,
        distribution(accelerator, model),
    )
    shape = run.distribution
    logger.info(
        f"Training with {shape['engine']} on {shape['world_size']} {shape['device']} process(es) "
        f"({shape['backend'] or 'no process group'}, mixed precision: {shape['mixed_precision']}); each holds "
        f"{shape['parameter_share']:.0%} of the parameters"
    )
    # The scheduler is stepped here once per optimizer step, whatever the number of processes (a prepared one steps
    # once per process), and checkpointed with the progress through the data.
    accelerator.register_for_checkpointing(scheduler, run.progress)
    return run


@torch.no_grad()
def evaluate(run: Run) -> dict[str, Any]:
    """Mean held-out loss per token and, for AttnRes, the mean entropy (nats) of each sublayer's depth weights."""
    run.model.eval()
    extra_outputs = {"output_depth_weights": True} if run.with_depth_weights else {}
    losses, entropies = [], []
    for batch in run.held_out_loader:
        input_ids = batch["input_ids"]
        outputs = run.model(input_ids=input_ids, use_cache=False, **extra_outputs)
        logits = outputs.logits[:, :-1].float()
        token_losses = F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")
        losses.append(run.accelerator.gather_for_metrics(token_losses.mean(-1)))
        if run.with_depth_weights:
            entropies.append(run.accelerator.gather_for_metrics(depth_weight_entropy(outputs.depth_weights)))
    run.model.train()
    metrics: dict[str, Any] = {"eval_loss": torch.cat(losses).mean().item()}
    if run.with_depth_weights:
        mean_entropies = torch.cat(entropies).mean(0).tolist()
        names = sublayer_names((len(mean_entropies) - 1) // 2) + ["output"]
        metrics["depth_weight_entropy"] = dict(zip(names, mean_entropies, strict=True))
    return metrics


def optimizer_step(
    run: Run, batches: Iterator[dict], termination: TerminationSignal
) -> tuple[float, float | None, bool]:
    """One optimizer step over `grad_accum` micro-batches -> (loss, gradient norm, stop requested by any process).

    Loss, norm and stop requests are agreed on by all processes before the weights change, so a non-finite loss
    never reaches the weights (nor a checkpoint), and every process makes the same decision.
    """
    accelerator, model = run.accelerator, run.model
    loss_sum = torch.zeros((), device=accelerator.device)
    for _ in range(accelerator.gradient_accumulation_steps):
        input_ids = next(batches)["input_ids"]
        with accelerator.accumulate(model):
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            accelerator.backward(loss)
        loss_sum += loss.detach()
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), run.config.max_grad_norm or math.inf)
    grad_norm = None if grad_norm is None else float(grad_norm)  # None under DeepSpeed, which clips by its config
    stop_vote = torch.tensor(float(termination.received), device=accelerator.device)
    loss_sum, stop_votes = accelerator.reduce(torch.stack([loss_sum, stop_vote]), reduction="sum").tolist()
    loss = loss_sum / accelerator.gradient_accumulation_steps / accelerator.num_processes
    overflow = grad_norm is not None and not math.isfinite(grad_norm)
    if not math.isfinite(loss) or (overflow and accelerator.scaler is None):  # fp16's scaler skips such steps itself
        raise TrainingError(
            f"step {run.progress.step + 1}: the loss is {loss} and the gradient norm {grad_norm}; the run stopped "
            f"before this step changed the weights. The latest checkpoint in {run.output_dir / CHECKPOINTS_FOLDER} is "
            "the last good one: lower --lr / --attnres-lr or lengthen --warmup-steps, then continue with --resume."
        )
    run.optimizer.step()
    if not run.optimizer.step_was_skipped:
        run.scheduler.step()
    run.optimizer.zero_grad()
    return loss, grad_norm, stop_votes > 0


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """`lr` of the pretrained weights (or LoRA) and `attnres_lr`, as scheduled for the next step."""
    rates = {}
    for group in optimizer.param_groups:
        rates.setdefault("attnres_lr" if group["name"] == "attnres" else "lr", group["lr"])
    return rates


def run_steps(run: Run, checkpoints: Checkpoints, metrics_log: MetricsLog) -> tuple[dict[str, Any], bool]:
    """Train up to `max_steps`, logging, evaluating and checkpointing on the way -> (latest metrics, interrupted)."""
    config, progress = run.config, run.progress
    latest: dict[str, Any] = {}
    if progress.step == 0:
        latest |= evaluate(run)
        metrics_log.write(0, latest)
    tokens_per_step = config.seq_len * config.batch_size * run.accelerator.gradient_accumulation_steps
    tokens_per_step *= run.accelerator.num_processes
    batches = training_batches(run.accelerator, run.train_loader, progress)
    interval_losses, interval_seconds, interrupted = [], 0.0, False
    bar = tqdm(total=config.max_steps, initial=progress.step, disable=not run.accelerator.is_main_process, unit="step")
    with TerminationSignal() as termination, bar, logging_redirect_tqdm():  # log lines above the bar, not inside
        run.model.train()
        while progress.step < config.max_steps and not interrupted:
            step_start = time.perf_counter()
            loss, grad_norm, interrupted = optimizer_step(run, batches, termination)
            interval_seconds += time.perf_counter() - step_start
            interval_losses.append(loss)
            progress.step += 1
            interrupted = interrupted or progress.step == config.stop_at_step
            progress.tokens += tokens_per_step
            tokens_per_second = len(interval_losses) * tokens_per_step / interval_seconds
            bar.update()
            bar.set_postfix(loss=f"{loss:.4f}", tokens_per_s=f"{tokens_per_second:,.0f}")

            record: dict[str, Any] = {}
            last_step = progress.step == config.max_steps
            if progress.step % config.log_every == 0 or last_step or interrupted:
                record |= {
                    "epoch": progress.epoch,
                    "tokens": progress.tokens,
                    "loss": sum(interval_losses) / len(interval_losses),
                    **learning_rates(run.optimizer),
                    "grad_norm": grad_norm,
                    "tokens_per_second": tokens_per_second,
                }
                interval_losses, interval_seconds = [], 0.0
            if progress.step % config.eval_every == 0 or last_step:
                record |= evaluate(run)
            if record:
                metrics_log.write(progress.step, record)
                latest |= record
            if progress.step % config.save_every == 0 or interrupted:
                checkpoint = checkpoints.save(progress.step)
                logger.info(f"Saved {checkpoint}")
    if interrupted:
        reason = "--stop-at-step" if progress.step == config.stop_at_step else "SIGTERM"
        logger.info(f"Stopped at step {progress.step} ({reason})")
    return latest, interrupted


def export(run: Run) -> None:
    """Save the trained model (an AttnRes one with its remote code), or the LoRA adapters, the tokenizer, the origin
    record (`attnres_origin.json`: the source, its conversion and this run added to the runs before it) and the card.

    `get_state_dict` gathers FSDP / ZeRO-3 shards, so every process takes part. Merging LoRA needs whole weights: the
    main process rebuilds the model on the CPU, loads the gathered weights into it and merges there.
    """
    accelerator, config = run.accelerator, run.config
    state_dict = accelerator.get_state_dict(run.model)  # whole on the main process
    if accelerator.is_main_process:
        if config.train == "lora" and config.merge_lora:
            peft_model = make_trainable(load_model(config), config)
            peft_model.load_state_dict(state_dict)
            model = peft_model.merge_and_unload()
            model.save_pretrained(run.output_dir)
        else:
            model = accelerator.unwrap_model(run.model)
            if isinstance(model, FSDPModule):
                model, state_dict = unsharded_twin(model, state_dict), None
            model.save_pretrained(run.output_dir, state_dict=state_dict)
        run.tokenizer.save_pretrained(run.output_dir)
        if isinstance(model, PreTrainedModel):  # a model, not LoRA adapters alone
            origin = trained_origin(run, model)
            write_origin(run.output_dir, origin)
            model_card(model.config, origin).save(run.output_dir / "README.md")
    accelerator.wait_for_everyone()


def unsharded_twin(model: FSDPModule, state_dict: dict[str, torch.Tensor]) -> PreTrainedModel:
    """A model of the class `model` had before FSDP2 sharded it, holding the gathered `state_dict`, to save.

    `fully_shard` gives the model a subclass of its own (`FSDPAttnResForCausalLM`, defined in torch): saved as is, the
    config would name that class and the folder would ship torch's FSDP files as remote code, not modeling_attnres.py.
    The gathered weights are separate tensors, so the twin ties them again (one embedding in the file, not two).
    """
    model_class = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
    with torch.device("meta"):
        twin = model_class(model.config)
    twin.load_state_dict(state_dict, assign=True)
    twin.tie_weights()
    return twin


def trained_origin(run: Run, model: PreTrainedModel) -> dict[str, Any]:
    """The origin record of the trained model: that of the model the run started from (converted on the fly, or read
    from its folder) with this run added."""
    config, progress = run.config, run.progress
    path, gguf_file = model_location(config)
    origin = read_origin(Path(path)) if gguf_file is None and Path(path).is_dir() else None
    if origin is None:
        origin = {
            "source": source_name(path, gguf_file),
            "source_file": gguf_file,
            "conversion": conversion_record(model, None, "attnres train --convert") if config.convert else None,
            "training": [],
        }
    dataset = config.dataset or "the Python standard library's source files"
    if Path(dataset).exists():  # a local file or folder: its name, not a path of this machine
        dataset = f"local files ({Path(dataset).resolve().name})"
    metrics = read_metrics(run.output_dir)
    held_out = [[record["step"], record["eval_loss"]] for record in metrics if "eval_loss" in record]
    run_record = {"train": config.train, "dataset": dataset, "tokens": progress.tokens, "steps": progress.step}
    origin["training"] = origin.get("training", []) + [run_record | {"held_out_loss": held_out}]
    return origin


def train(config: TrainingConfig | None = None, **options) -> TrainingResult:
    """Continue pretraining as `config` (or `TrainingConfig` fields given as keywords) says; see `attnres train -h`.

    Every process that `accelerate launch` or `torchrun` starts runs this and returns. Raises `TrainingError`,
    `DataError` or `ConversionError` with a message that says what to change.
    """
    config = dataclasses.replace(config, **options) if config is not None else TrainingConfig(**options)
    output_dir = Path(config.output_dir)
    fix = "choose a new --output-dir"
    if (output_dir / CHECKPOINTS_FOLDER).is_dir():
        fix = f"pass --resume to continue the run saved there, or {fix}"
    inputs = {"the model": model_location(config)[0], "the dataset": config.dataset}  # not --resume's: its own output
    check_output_dir(output_dir, TrainingError, inputs, None if config.resume else fix)
    accelerator = make_accelerator(config)
    accelerator.wait_for_everyone()  # every process has checked OUTPUT_DIR before the first write to it
    try:
        run = start(config, accelerator)
        checkpoints = Checkpoints(output_dir, config.save_total_limit, accelerator)
        resume_from = checkpoints.latest() if config.resume else None
        if resume_from is not None:
            accelerator.load_state(resume_from)
            logger.info(f"Resumed from {resume_from} at step {run.progress.step}")
        if accelerator.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / TRAINING_CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
        metrics_log = MetricsLog(output_dir / METRICS_FILE, accelerator, {"distribution": run.distribution})
        metrics_log.forget_from(run.progress.step + 1 if resume_from is not None else 0)
        tracked_config = {k: str(v) for k, v in (dataclasses.asdict(config) | run.distribution).items()}
        accelerator.init_trackers("attnres-train", config=tracked_config)

        metrics, interrupted = run_steps(run, checkpoints, metrics_log)
        if not interrupted:
            export(run)
            logger.info(f"Saved the trained model to {output_dir}")
            if config.push_to_hub and accelerator.is_main_process:
                commit_url = push_folder(
                    output_dir,
                    config.push_to_hub,
                    "Upload AttnRes continued pretraining run",
                    ignore_patterns=[f"{CHECKPOINTS_FOLDER}/*"],
                )
                logger.info(f"Uploaded: {commit_url}")
    finally:
        accelerator.end_training()
    return TrainingResult(output_dir, run.progress.step, metrics, interrupted, accelerator.unwrap_model(run.model))


def train_from_args(args: argparse.Namespace) -> int:
    """Run `train` with the options parsed by `training_config.train_argument_parser` -> the exit status."""
    names = {spec.name for spec in dataclasses.fields(TrainingConfig)}
    result = train(TrainingConfig(**{name: value for name, value in vars(args).items() if name in names}))
    if result.interrupted:
        print(f"Stopped at step {result.step} with a checkpoint saved; rerun the command with --resume to continue.")
    else:
        print(f"Trained {result.step} steps; the model is in {result.output_dir}.")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m attnres.training ...`, for launchers that start a module: `torchrun -m`, `accelerate launch -m`."""
    from .cli import main as command_main  # `attnres train`: the same options, messages and error handling

    return command_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
