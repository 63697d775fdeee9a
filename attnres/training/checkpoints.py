"""What a run leaves on disk as it goes: checkpoints that are complete or absent, the records of `metrics.jsonl`
(mirrored to Accelerate's trackers), and SIGTERM or Ctrl-C turned into a checkpoint and a clean stop.
"""

import itertools
import json
import logging
import pickle
import signal
import sys
import threading
import types
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors import SafetensorError
from torch import nn

from ..errors import TrainingError
from ..folders import (
    CHECKPOINTS_FOLDER,
    disk_space_for,
    put_in_place,
    remove,
    staging_path,
    tensor_bytes,
    written_whole,
)

logger = logging.getLogger(__name__)
RESUME_FIX = "rerun with --resume from the checkpoints saved before it, which are intact"


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
        completed = [
            path
            for path in self.folder.glob("step-*")
            if path.name.removeprefix("step-").isdigit() and any(path.iterdir())  # an emptied one is no checkpoint
        ]
        return sorted(completed, key=lambda path: int(path.name.removeprefix("step-")))

    def latest(self) -> Path | None:
        return next(reversed(self.all()), None)

    def load_latest(self) -> Path | None:
        """Restore the newest checkpoint that loads; one that does not (truncated, damaged) is set aside as
        `damaged-step-N`, saying so, and the one before it is tried -> the checkpoint restored, or None."""
        for checkpoint in reversed(self.all()):
            try:
                self.accelerator.load_state(checkpoint)
                return checkpoint
            except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError) as error:
                target = checkpoint.with_name(f"damaged-{checkpoint.name}")
                logger.warning(f"{checkpoint} does not load ({type(error).__name__}: {error}); set aside as {target}")
                self.accelerator.wait_for_everyone()
                if self.accelerator.is_main_process:
                    remove(target)
                    checkpoint.rename(target)
                self.accelerator.wait_for_everyone()
        return None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
        """`save_state` into `step-N`, after checking the disk has room for `model`'s and `optimizer`'s state (the
        prepared ones, which `save_state` writes)."""
        accelerator, checkpoint = self.accelerator, self.folder / f"step-{step}"
        staging = staging_path(checkpoint)
        if accelerator.is_main_process:
            remove(staging)  # left over from a save that was interrupted
        accelerator.wait_for_everyone()
        with disk_space_for(checkpoint, state_bytes(model, optimizer), TrainingError, RESUME_FIX):
            try:
                accelerator.save_state(staging)
            except BaseException:
                if accelerator.is_main_process:
                    remove(staging)  # a half-written checkpoint would only keep the disk full
                raise
        accelerator.wait_for_everyone()  # save_state returns on each process when its own part is written
        if accelerator.is_main_process:
            put_in_place(staging, checkpoint)
            for old in self.all()[: -self.total_limit]:
                remove(old)
        accelerator.wait_for_everyone()
        return checkpoint

    def set_aside_from(self, step: int) -> list[Path]:
        """Rename the checkpoints of `step` and later to `failed-step-N`, so that --resume passes them by (they are
        kept: nothing of the user's is deleted) -> their new paths."""
        failed = [path for path in self.all() if int(path.name.removeprefix("step-")) >= step]
        moved = [path.with_name(f"failed-{path.name}") for path in failed]
        if self.accelerator.is_main_process:
            for path, target in zip(failed, moved, strict=True):
                remove(target)  # from an earlier failure at the same step
                path.rename(target)
        self.accelerator.wait_for_everyone()
        return moved


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """About what `save_state` writes: the weights of the prepared model and the optimizer's state. This process's
    part only (local shards under FSDP), read without any collective: the other processes may not be here."""
    weights = itertools.chain(model.parameters(), model.buffers())
    optimizer_state = (
        value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)
    )
    return tensor_bytes(itertools.chain(weights, optimizer_state))


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
            with written_whole(self.path) as staging:  # a kill here leaves the old records, never an empty file
                staging.write_text("".join(line + "\n" for line in records))

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
    """Turns SIGTERM and a first Ctrl-C (SIGINT) into a request, so that the loop can checkpoint at the next step
    boundary and stop cleanly; a second Ctrl-C interrupts at once. `received` is the signal's name, once one came."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self.previous_handlers: dict[int, Any] = {}

    def __enter__(self) -> "TerminationSignal":
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            self.previous_handlers = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        if signum == signal.SIGINT:  # the next Ctrl-C is the usual KeyboardInterrupt
            signal.signal(signal.SIGINT, self.previous_handlers[signal.SIGINT])
            print("Ctrl-C: stopping after this step with a checkpoint; Ctrl-C again stops at once", file=sys.stderr)

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self.previous_handlers.items():
            signal.signal(signum, handler)
