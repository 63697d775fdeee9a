"""The package's reaches into DeepSpeed's private parts: the attributes ZeRO-3 gives each parameter it partitions
(its whole size and shape, whether every process holds all of it, this process's partition), which DeepSpeed has no
public reader of. Read without importing DeepSpeed, which only ZeRO-3 runs have loaded."""

import sys

import torch
from torch import nn

from . import require

ZERO3_ATTRIBUTES = ("ds_numel", "ds_shape", "ds_persist", "ds_tensor")


def full_shape(parameter: nn.Parameter) -> torch.Size:
    """The shape of the whole parameter: one that ZeRO-3 partitioned as it loaded holds an empty tensor."""
    return getattr(parameter, "ds_shape", parameter.shape)


def zero3_share(parameter: nn.Parameter) -> tuple[int, int]:
    """(elements this process holds, elements in all) of a parameter in a ZeRO-3 run: its partition, or all of it
    where DeepSpeed keeps a small parameter whole on every process ("persistent")."""
    present = all(hasattr(parameter, name) for name in ZERO3_ATTRIBUTES)
    require(present, sys.modules["deepspeed"], f"ZeRO-3 parameter attributes {', '.join(ZERO3_ATTRIBUTES)}")
    held = parameter.ds_numel if parameter.ds_persist else parameter.ds_tensor.numel()
    return held, parameter.ds_numel
