"""The run: `train` starts it (model, data and Accelerator prepared together), runs the optimizer steps with their
logging, evaluations and checkpoints, and exports the trained model with its origin record and card.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import has_compiled_regions, is_compiled_module, set_seed
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..analysis import config_sublayer_names, depth_weight_entropy
from ..cards import conversion_record, model_card, origin_record, read_origin, write_origin
from ..errors import TrainingError
from ..folders import (
    CHECKPOINTS_FOLDER,
    METRICS_FILE,
    TRAINING_CONFIG_FILE,
    check_output_dir,
    disk_space_for,
    output_lock,
    read_metrics,
    remove,
    tensor_bytes,
    written_whole,
)
from ..hub import check_can_upload, push_folder
from ..options import TrainingConfig
from ..rules import ATTNRES_MODES
from ..sources import load_source_tokenizer
from .batches import TrainingProgress, build_datasets, make_data_loaders, training_batches
from .checkpoints import Checkpoints, MetricsLog, TerminationSignal
from .engine import allow_a_graph_per_layer, check_trackers, distribution, make_accelerator, unsharded_twin
from .recipe import (
    apply_resumed_options,
    is_attnres,
    load_model,
    make_optimizer,
    make_scheduler,
    make_trainable,
    model_location,
)

logger = get_logger(__name__)


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
    sublayers: list[str] = field(default_factory=list)  # the labels of the depth weights' sublayers (A0, M0, ...)

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)


@dataclass
class TrainingResult:
    output_dir: Path
    step: int  # optimizer steps done
    metrics: dict[str, Any]  # the latest of each figure logged: loss, eval_loss, depth_weight_entropy, ...
    interrupted: bool  # stopped by a signal or --stop-at-step: a checkpoint was saved, nothing exported; --resume
    model: nn.Module  # the trained model on this process (a PeftModel with --train lora)
    stopped_by: str | None = None  # "--stop-at-step", "SIGTERM" or "SIGINT" when interrupted


def start(config: TrainingConfig, accelerator: Accelerator) -> Run:
    """Load tokenizer, data and model, mark what trains, and let Accelerate prepare it all for this process."""
    set_seed(config.seed)
    model_path, gguf_file = model_location(config)
    tokenizer = load_source_tokenizer(model_path, gguf_file, config.trust_remote_code)
    with accelerator.main_process_first():  # the main process fills the datasets cache, the others read it
        train_sequences, held_out_sequences = build_datasets(config, tokenizer, accelerator.num_processes)
    model = load_model(config)
    # Block and Full AttnRes report their depth weights, a softmax over each sublayer's sources
    with_depth_weights = is_attnres(model) and model.config.attnres_mode in ATTNRES_MODES
    sublayers = config_sublayer_names(model.config) if with_depth_weights else []
    if config.activation_checkpointing:
        model.activation_checkpointing_enable()
    if config.attnres_recompute:
        if not with_depth_weights:
            raise TrainingError(
                f"--attnres-recompute applies to Block and Full AttnRes models, whose depth mix it recomputes; "
                f"{config.model} is not one: add --convert, or drop --attnres-recompute"
            )
        model.config.attnres_recompute = True
    if is_attnres(model):
        allow_a_graph_per_layer(accelerator, model.config.num_hidden_layers)
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
        sublayers=sublayers,
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
        names = run.sublayers + ["output"]
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
    stop_vote = torch.tensor(float(termination.received is not None), device=accelerator.device)
    loss_sum, stop_votes = accelerator.reduce(torch.stack([loss_sum, stop_vote]), reduction="sum").tolist()
    loss = loss_sum / accelerator.gradient_accumulation_steps / accelerator.num_processes
    overflow = grad_norm is not None and not math.isfinite(grad_norm)
    if not math.isfinite(loss) or (overflow and accelerator.scaler is None):  # fp16's scaler skips such steps itself
        raise NonFiniteStep(f"step {run.progress.step + 1}: the loss is {loss} and the gradient norm {grad_norm}")
    run.optimizer.step()
    if not run.optimizer.step_was_skipped:
        run.scheduler.step()
    run.optimizer.zero_grad()
    return loss, grad_norm, stop_votes > 0


class NonFiniteStep(Exception):
    """A step whose loss or gradient norm is not finite, found before it changed the weights."""


def stop_at_non_finite_step(run: Run, checkpoints: Checkpoints, failure: NonFiniteStep) -> TrainingError:
    """The error that ends a run at a non-finite step. The weights of the step before it already give a non-finite
    loss, so the checkpoints from that step on are set aside, and the message names the checkpoint that is left."""
    set_aside = checkpoints.set_aside_from(run.progress.step)
    good = checkpoints.latest()
    fix = "lower --lr / --attnres-lr or lengthen --warmup-steps"
    aside = f" (set aside as {', '.join(path.name for path in set_aside)})" if set_aside else ""
    if good is None:
        return TrainingError(
            f"{failure}; the run stopped before this step changed the weights, and no checkpoint before step "
            f"{run.progress.step} is left{aside}. Start again: {fix}, and pass --overwrite or a new --output-dir."
        )
    return TrainingError(
        f"{failure}; the run stopped before this step changed the weights. The checkpoints from step "
        f"{run.progress.step} on give it{aside}; the last good one is {good}: {fix}, then continue with --resume, "
        "which trains at the new rates."
    )


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """`lr` of the pretrained weights (or LoRA) and `attnres_lr`, as scheduled for the next step."""
    rates = {}
    for group in optimizer.param_groups:
        rates.setdefault("attnres_lr" if group["name"] == "attnres" else "lr", group["lr"])
    return rates


def run_steps(run: Run, checkpoints: Checkpoints, metrics_log: MetricsLog) -> tuple[dict[str, Any], str | None]:
    """Train up to `max_steps`, logging, evaluating and checkpointing on the way -> (latest metrics, what stopped the
    run early: "--stop-at-step", a signal's name, or None when it ran to the end)."""
    config, progress = run.config, run.progress
    latest: dict[str, Any] = {}
    if progress.step == 0:
        latest |= evaluate(run)
        metrics_log.write(0, latest)
    tokens_per_step = config.seq_len * config.batch_size * run.accelerator.gradient_accumulation_steps
    tokens_per_step *= run.accelerator.num_processes
    batches = training_batches(run.accelerator, run.train_loader, progress)
    # CPU seconds beside wall seconds: the process's own work, which other processes on the machine do not inflate
    interval_losses, interval_seconds, interval_cpu_seconds, interrupted = [], 0.0, 0.0, False
    bar = tqdm(total=config.max_steps, initial=progress.step, disable=not run.accelerator.is_main_process, unit="step")
    with TerminationSignal() as termination, bar, logging_redirect_tqdm():  # log lines above the bar, not inside
        run.model.train()
        while progress.step < config.max_steps and not interrupted:
            step_start, step_cpu_start = time.perf_counter(), time.process_time()
            try:
                loss, grad_norm, interrupted = optimizer_step(run, batches, termination)
            except NonFiniteStep as failure:
                raise stop_at_non_finite_step(run, checkpoints, failure) from None
            interval_seconds += time.perf_counter() - step_start
            interval_cpu_seconds += time.process_time() - step_cpu_start
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
                    "cpu_seconds_per_step": interval_cpu_seconds / len(interval_losses),
                }
                interval_losses, interval_seconds, interval_cpu_seconds = [], 0.0, 0.0
            if progress.step % config.eval_every == 0 or last_step:
                record |= evaluate(run)
            if record:
                metrics_log.write(progress.step, record)
                latest |= record
            if progress.step % config.save_every == 0 or interrupted:
                checkpoint = checkpoints.save(progress.step, run.model, run.optimizer)
                logger.info(f"Saved {checkpoint}")
    stopped_by = None
    if interrupted:  # a signal may have reached another process only
        stopped_by = termination.received or ("--stop-at-step" if progress.step == config.stop_at_step else "SIGTERM")
        logger.info(f"Stopped at step {progress.step} ({stopped_by})")
    return latest, stopped_by


def uncompiled(run: Run) -> nn.Module:
    """The prepared model as `get_state_dict` reads it: less what Accelerate's dynamo settings compiled out of place
    (the whole model, or each layer with regional compilation), whose weights would carry `_orig_mod.` in their names,
    but still the DeepSpeed engine that gathers ZeRO-3 shards (its regions compile in place, as FSDP2's do)."""
    if is_compiled_module(run.model) or has_compiled_regions(run.model):
        return run.accelerator.unwrap_model(run.model, keep_torch_compile=False)
    return run.model


def export(run: Run) -> None:
    """Save the trained model (an AttnRes one with its remote code), or the LoRA adapters, the tokenizer, the origin
    record (`attnres_origin.json`: the source, its conversion and this run added to the runs before it) and the card.

    `get_state_dict` gathers FSDP / ZeRO-3 shards, so every process takes part. Merging LoRA needs whole weights: the
    main process rebuilds the model on the CPU, loads the gathered weights into it and merges there.
    """
    accelerator = run.accelerator
    state_dict = accelerator.get_state_dict(uncompiled(run))  # whole on the main process
    if accelerator.is_main_process:
        # Written beside, then each file moved in: a kill or a full disk leaves the run folder as it was
        staging = run.output_dir / EXPORT_STAGING
        remove(staging)
        fix = "write the run to another disk (its checkpoints are intact: --resume exports from the last)"
        try:
            with disk_space_for(run.output_dir, tensor_bytes(state_dict.values()), TrainingError, fix):
                save_trained_model(run, state_dict, staging)
                for path in sorted(staging.iterdir()):
                    os.replace(path, run.output_dir / path.name)
        finally:
            remove(staging)
    accelerator.wait_for_everyone()


def save_trained_model(run: Run, state_dict: dict[str, torch.Tensor], folder: Path) -> None:
    """`export`'s files, written into `folder` by the main process."""
    config = run.config
    if config.train == "lora" and config.merge_lora:
        peft_model = make_trainable(load_model(config), config)
        peft_model.load_state_dict(state_dict)
        model = peft_model.merge_and_unload()
        model.save_pretrained(folder)
    else:
        model = run.accelerator.unwrap_model(run.model, keep_torch_compile=False)
        if isinstance(model, FSDPModule):
            model, state_dict = unsharded_twin(model, state_dict), None
        model.save_pretrained(folder, state_dict=state_dict)
    run.tokenizer.save_pretrained(folder)
    if isinstance(model, PreTrainedModel):  # a model, not LoRA adapters alone
        origin = trained_origin(run, model)
        write_origin(folder, origin)
        model_card(model.config, origin).save(folder / "README.md")


def trained_origin(run: Run, model: PreTrainedModel) -> dict[str, Any]:
    """The origin record of the trained model: that of the model the run started from (converted on the fly, or read
    from its folder) with this run added."""
    config, progress = run.config, run.progress
    path, gguf_file = model_location(config)
    origin = read_origin(Path(path)) if gguf_file is None and Path(path).is_dir() else None
    if origin is None:
        conversion = conversion_record(model, None, "attnres train --convert") if config.convert else None
        origin = origin_record(path, gguf_file, conversion)
    dataset = config.dataset or "the Python standard library's source files"
    if Path(dataset).exists():  # a local file or folder: its name, not a path of this machine
        dataset = f"local files ({Path(dataset).resolve().name})"
    metrics = read_metrics(run.output_dir)
    held_out = [[record["step"], record["eval_loss"]] for record in metrics if "eval_loss" in record]
    run_record = {"train": config.train, "dataset": dataset, "tokens": progress.tokens, "steps": progress.step}
    origin["training"] = origin.get("training", []) + [run_record | {"held_out_loss": held_out}]
    return origin


def train(config: TrainingConfig | None = None, *, keep_process_group: bool = False, **options) -> TrainingResult:
    """Continue pretraining as `config` (or `TrainingConfig` fields given as keywords) says; see `attnres train -h`.

    Every process that `accelerate launch` or `torchrun` starts runs this and returns. Raises `TrainingError`,
    `DataError` or `ConversionError` with a message that says what to change. `keep_process_group`: leave the
    launch's process group up when the run ends, for a caller that trains several runs in one launched process
    (`attnres compare`, which ends it after the last); by default the run ends it, as a script's end would.
    """
    config = dataclasses.replace(config, **options) if config is not None else TrainingConfig(**options)
    check_trackers(config.report_to)
    output_dir = Path(config.output_dir)
    fix = "choose a new --output-dir"
    if (output_dir / CHECKPOINTS_FOLDER).is_dir():
        fix = f"pass --resume to continue the run saved there, or {fix}"
    inputs = {"the model": model_location(config)[0], "the dataset": config.dataset}  # not --resume's: its own output
    check_output_dir(output_dir, TrainingError, inputs, None if config.resume else fix)
    if config.resume:
        check_run_folder(output_dir)
    if config.push_to_hub:
        check_can_upload(config.push_to_hub)  # before the run, not after it
    # One run per output folder; the launcher's first process holds it for all (they share the folder)
    first_process = os.environ.get("RANK", "0") == "0"
    with output_lock(output_dir, TrainingError) if first_process else contextlib.nullcontext():
        return run_training(config, output_dir, keep_process_group)


def run_training(config: TrainingConfig, output_dir: Path, keep_process_group: bool = False) -> TrainingResult:
    """`train` once its output folder is checked and held: every process's part of the run."""
    accelerator = make_accelerator(config)
    accelerator.wait_for_everyone()  # every process has checked OUTPUT_DIR before the first write to it
    try:
        run = start(config, accelerator)
        checkpoints = Checkpoints(output_dir, config.save_total_limit, accelerator)
        resume_from = checkpoints.load_latest() if config.resume else None
        resumed_with = {}
        if config.resume and resume_from is None:
            logger.info(f"Nothing to resume in {output_dir}: starting a new run")
        if resume_from is not None:
            logger.info(f"Resumed from {resume_from} at step {run.progress.step}")
            resumed_with = apply_resumed_options(run.optimizer, run.scheduler, config)
            if resumed_with:
                logger.info(f"Peak learning rates changed on resume (group: [before, now]): {resumed_with}")
        if accelerator.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            with written_whole(output_dir / TRAINING_CONFIG_FILE) as staging:
                staging.write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
        metrics_log = MetricsLog(output_dir / METRICS_FILE, accelerator, {"distribution": run.distribution})
        metrics_log.forget_from(run.progress.step + 1 if resume_from is not None else 0)
        if resumed_with:  # recorded at the first step it applies to, so that a resume from before it forgets it
            metrics_log.write(run.progress.step + 1, {"resumed_with_peak_lr": resumed_with})
        tracked_config = {k: str(v) for k, v in (dataclasses.asdict(config) | run.distribution).items()}
        accelerator.init_trackers("attnres-train", config=tracked_config)

        metrics, stopped_by = run_steps(run, checkpoints, metrics_log)
        if stopped_by is None:
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
        # DeepSpeed's engine lets go of its hooks and communication before the process group goes, not at the
        # interpreter's exit, where a ZeRO-3 rank once aborted after a finished run (std::terminate, in CI)
        accelerator.free_memory()
        if keep_process_group:  # the trackers end, as `end_training` ends them; the group stays for the next run
            for tracker in accelerator.trackers:
                tracker.finish()
        else:
            accelerator.end_training()
    model = accelerator.unwrap_model(run.model, keep_torch_compile=False)
    return TrainingResult(output_dir, run.progress.step, metrics, stopped_by is not None, model, stopped_by)


EXPORT_STAGING = ".export.partial"  # inside the run folder: the exported files move from it one by one
RUN_RECORDS = (CHECKPOINTS_FOLDER, METRICS_FILE, TRAINING_CONFIG_FILE)


def check_run_folder(output_dir: Path) -> None:
    """`--resume` continues a run of this tool, or starts one in a new or empty folder; it never trains into a folder
    of something else (a converted model, the user's files), whose files the run would mix with or replace."""
    holds_files = output_dir.is_dir() and any(output_dir.iterdir())
    if holds_files and not any((output_dir / name).exists() for name in RUN_RECORDS):
        raise TrainingError(
            f"--resume: {output_dir} holds no run of attnres train (no {', '.join(RUN_RECORDS)}), and a run would "
            "replace or mix with what it holds; choose a new --output-dir (to train that model, pass it as --model)"
        )


def train_from_args(args: argparse.Namespace) -> int:
    """Run `train` with the options parsed by `attnres_cli.command.train_parser` -> the exit status."""
    # Every field is an option of `attnres train` (`train_parser` makes one per field), so none is left behind
    result = train(
        TrainingConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(TrainingConfig)})
    )
    if not result.interrupted:
        print(f"Trained {result.step} steps; the model is in {result.output_dir}.")
        return 0
    print(
        f"Stopped at step {result.step} ({result.stopped_by}) with a checkpoint saved; rerun the command with --resume "
        "to continue."
    )
    # Stopped by a signal: 128 + its number, as a process the signal ended, so that a scheduler does not take the
    # run as finished (and requeues it where it is set to); a planned --stop-at-step pause is a success
    return 0 if result.stopped_by == "--stop-at-step" else 128 + signal.Signals[result.stopped_by].value
