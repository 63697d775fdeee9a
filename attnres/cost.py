"""What a model costs beside another of the same architecture: training steps timed in interleaved pairs (A B A B
...), after warm-up, so that the machine's load and clock weigh on both alike, and the median of the per-pair ratios;
the peak memory of a training step where the device tells it (CUDA). `benchmarks/overhead.py` measures the rules
against their source with these, and `attnres compare` each arm against its baseline on the user's architecture.

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


def step_peak_memory(step: Callable, device: str) -> int | None:
    """Peak bytes allocated on the device during one call of `step` (after its optimizer state exists: call it once
    before), or None where the device keeps no such count (the CPU, whose resident set is the whole process's)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()
