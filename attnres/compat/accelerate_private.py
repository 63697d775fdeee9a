"""The package's reaches into Accelerate's private parts: its process state, which has no public way to run FSDP on
CPU processes, and the variable through which `accelerate launch --cpu` tells the Accelerator to use the CPU."""

import inspect
import os

import accelerate
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from . import require


def hand_fsdp_to_state(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Make Accelerate prepare, clip, checkpoint and gather with `plugin` (FSDP) where it chose another type.

    Both states, as Accelerate's own set-up does: an AcceleratorState made later copies the PartialState's type.
    """
    # the attributes Accelerate's states keep (and name in the error for one that is not set)
    present = {"fsdp_plugin", "distributed_type"} <= set(getattr(AcceleratorState, "_known_attrs", ()))
    require(present, accelerate, "AcceleratorState.fsdp_plugin and .distributed_type to set")
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP


def leave_device_to_deepspeed() -> None:
    """Tell the Accelerator made next not to place this process on the CPU itself (DeepSpeed's CPU accelerator does)."""
    set_use_cpu("false")


def use_the_cpu() -> None:
    """Tell the Accelerators of this process to run on the CPU whatever accelerator the machine has, as `accelerate
    launch --cpu` does (the quality study's runs: the same device, and so the same numbers, everywhere)."""
    set_use_cpu("1")


def set_use_cpu(value: str) -> None:
    read = '"ACCELERATE_USE_CPU"' in inspect.getsource(AcceleratorState)
    require(read, accelerate, "AcceleratorState that reads the ACCELERATE_USE_CPU variable")
    os.environ["ACCELERATE_USE_CPU"] = value
