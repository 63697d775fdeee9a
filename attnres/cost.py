"""What a model costs beside another of the same architecture: training steps timed in interleaved pairs (A B A B
...), after warm-up, so that the machine's load and clock weigh on both alike, and the median of the per-pair ratios;
the memory of a training step: its peak where the device counts it (CUDA), else the bytes a step holds (its saved
activations, counted through `saved_tensors_hooks`, and the parameters, gradients and optimizer state), which depend
on shapes and dtypes only. `benchmarks/overhead.py` measures the rules against their source with these, and `attnres
compare` each arm against its baseline on the user's architecture.

torch and the standard library only.
"""

import contextlib
import ctypes
import ctypes.util
import statistics
import sys
import time
from collections.abc import Callable

import torch


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse instead of handing it back to the OS, as PyTorch's caching
    allocator does on a GPU. Otherwise every training step faults its large buffers in afresh, and how long that takes
    varies with the kernel's memory reclaim from run to run, by more than AttnRes costs. Returns whether it applied."""
    libc_path = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if libc_path is None:
        return False
    libc = ctypes.CDLL(libc_path)
    m_trim_threshold, m_mmap_max = -1, -4  # mallopt parameters, malloc.h
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved_ratio(source_step: Callable, attnres_step: Callable, reps: int, warmup: int, device: str) -> dict:
    """Median over reps of (`attnres_step` time / `source_step` time), each pair measured back to back: the model
    measured against its reference (the source, or a study's baseline). The first warm-up call of each is reported
    apart: in the compiled world it is the compilation."""

    def timed(step: Callable) -> float:
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        return time.perf_counter() - start

    first_calls = [timed(source_step), timed(attnres_step)]
    for _ in range(warmup - 1):
        timed(source_step), timed(attnres_step)
    pairs = [(timed(source_step), timed(attnres_step)) for _ in range(reps)]
    return {
        "first_call_s": {"source": first_calls[0], "attnres": first_calls[1]},
        "source_s": statistics.median(s for s, _ in pairs),
        "attnres_s": statistics.median(a for _, a in pairs),
        "ratio": statistics.median(a / s for s, a in pairs),
    }


def in_world(model: torch.nn.Module, world: str) -> Callable:
    return torch.compile(model, fullgraph=True) if world == "compiled" else model


def in_precision(autocast: bool, device: str) -> contextlib.AbstractContextManager:
    """bf16 autocast around the forward pass (the backward runs in the dtypes the forward chose), or nothing."""
    return torch.autocast(torch.device(device).type, torch.bfloat16) if autocast else contextlib.nullcontext()


def training_step(model: torch.nn.Module, ids: torch.Tensor, world: str, autocast: bool = False) -> Callable:
    """One AdamW step of `model` on `ids` as a call: forward with the loss, backward, update. The optimizer holds
    every parameter; those that do not train get no gradient, and AdamW leaves them (and their state) alone."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    forward = in_world(model, world)

    def step():
        with in_precision(autocast, str(ids.device)):
            loss = forward(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# How `step_memory` measured: on CUDA devices, and elsewhere
PEAK_ALLOCATED = "peak bytes allocated on the GPU during a step (torch.cuda.max_memory_allocated)"
HELD_BY_A_STEP = (
    "bytes a step holds: its saved activations (counted through saved_tensors_hooks), the parameters, their "
    "gradients and AdamW's state"
)


def step_memory(model: torch.nn.Module, ids: torch.Tensor, step: Callable) -> tuple[int, str]:
    """The memory of a training step of `model` on `ids` -> (bytes, how they were had): on a CUDA device the peak
    allocated during a call of `step` (after its optimizer state exists: call it once before); elsewhere, where no
    peak is counted (the CPU's resident set is the whole process's), `held_by_a_step`."""
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), PEAK_ALLOCATED
    return held_by_a_step(model, ids), HELD_BY_A_STEP


def held_by_a_step(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes one AdamW training step of `model` on `ids` holds at its height: the activations its forward saves for
    the backward, every parameter, the gradients and the optimizer's state (of the parameters that train). A count of
    tensors, the same on any device and under any load; it takes an optimizer step of its own."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    activations = saved_activation_bytes(model, ids)
    parameters = list(model.parameters())
    gradients = sum(p.grad.nbytes for p in parameters if p.grad is not None)
    optimizer.step()
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    optimizer.zero_grad(set_to_none=True)
    return activations + sum(p.nbytes for p in parameters) + gradients + state


def saved_activation_bytes(model: torch.nn.Module, input_ids: torch.Tensor, autocast: bool = False) -> int:
    """Bytes of the distinct non-parameter tensors that autograd saves in one training forward of `model` (the
    backward runs too, leaving the gradients)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        in_precision(autocast, str(input_ids.device)),
    ):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return sum(saved.values())
