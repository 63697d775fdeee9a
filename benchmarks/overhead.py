"""What AttnRes costs on top of its source model: prefill, training step, greedy decode and training-step memory.

Each row builds a source model and its converted AttnRes twin from the same weights and measures both in one run,
interleaved (A B A B ...) after warm-up, reporting the median of the per-pair ratios AttnRes / source. Two worlds:
`eager`, and `compiled`, where source and twin are each `torch.compile`d (fullgraph) and warmed up before timing, and
decode uses the static cache with a compiled forward; the compile time (the first call) is reported separately.

    python benchmarks/overhead.py                      # converted SmolLM2-135M and a tiny random model, Block and Full
    python benchmarks/overhead.py --models tiny --worlds eager --json overhead.json
    python benchmarks/overhead.py --models tiny --modes all --worlds eager   # every residual rule
    python benchmarks/overhead.py --device cuda --dtype bfloat16
    python benchmarks/overhead.py --device cuda --autocast off,bf16  # fp32 weights, and under bf16 autocast
    python benchmarks/overhead.py --saved-memory       # bytes kept for the backward pass: bf16, autocast, fp32
    python benchmarks/overhead.py --compile-time       # CPU seconds of the first compiled training step
"""

import argparse
import copy
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

import attnres
from attnres.compat.torch_private import dispatch_mode_base, tensor_leaves
from attnres.configuration_attnres import COMPILED_MIXES
from attnres.conversion import DTYPES, attnres_config_for, convert_to_attnres
from attnres.cost import (  # noqa: F401 (synchronize: the compile-time script reads it from here)
    in_precision,
    in_world,
    interleaved_ratio,
    keep_freed_memory,
    saved_activation_bytes,
    synchronize,
    training_step,
)
from attnres.modeling_attnres import CACHE_NAME
from attnres.rules import RULES
from attnres.sources import default_model_path, load_source


def source_model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    if name == "smollm2":
        folder, gguf_file = default_model_path()
        return load_source(folder, dtype, gguf_file)
    return tiny_model(8, dtype)  # "tiny", the other name parse_arguments lets through


def tiny_config(num_layers: int) -> transformers.PreTrainedConfig:
    return AutoConfig.for_model(
        "llama", vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip


def tiny_model(num_layers: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(num_layers), dtype=dtype).eval()


def attnres_twin(source: torch.nn.Module, mode: str) -> torch.nn.Module:
    """`source` converted to the rule `mode`; PostNorm and Highway, which cannot start as the source computes, are
    built as for training from scratch around the source's weights (what they cost does not depend on the start)."""
    if RULES[mode].converts is None:
        return convert_to_attnres(source, mode=mode)
    config = attnres_config_for(source.config, mode, exact_start=False)
    twin = attnres.AttnResForCausalLM(config).to(source.dtype)
    missing = twin.load_state_dict(source.state_dict(), strict=False).missing_keys
    assert all("_res_" in key for key in missing), missing  # only the rule's own parameters start fresh
    return twin.eval()


def precision_label(dtype: str, autocast: str) -> str:
    """How a row's figures were computed: the weights' dtype, and whether each forward ran under bf16 autocast."""
    return dtype + (" + bf16 autocast" if autocast == "bf16" else "")


MEMORY_SCRIPT = """
import sys, torch
sys.path.insert(0, {benchmarks_dir!r})
import overhead
name, mode, which, dtype, device, world, autocast = sys.argv[1:8]
model = overhead.source_model(name, overhead.DTYPES[dtype])
if which == "attnres":
    model = overhead.attnres_twin(model, mode)  # takes over the source's tensors
model = model.to(device).train()
ids = torch.randint(0, model.config.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0)).to(device)
step = overhead.training_step(model, ids, world, autocast == "bf16")
step()  # the optimizer states exist from here on (and the compiled graphs)
if device.startswith("cuda"):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    step(); torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated()
else:
    rss = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak resident set size (VmHWM)
    base = rss("VmRSS:"); step(); peak = rss("VmHWM:")
print(base, peak)
"""


def in_fresh_process(script: str, *args: str, **environment: str) -> list[str]:
    """Run `script` (a template that imports this module from {benchmarks_dir}) in a new Python process with `args`
    and these environment variables added; -> the words of the last line it printed."""
    script = script.format(benchmarks_dir=os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", **environment}
    result = subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True, text=True, env=env)
    return result.stdout.splitlines()[-1].split()


def training_peak_memory(
    name: str, mode: str, which: str, dtype: str, device: str, world: str, autocast: str
) -> tuple[int, int]:
    """(resident bytes before a training step, peak during it), measured in a fresh process for one model."""
    # Large blocks go straight back to the OS when freed, so the peak of the second step is the step's own.
    words = in_fresh_process(
        MEMORY_SCRIPT, name, mode, which, dtype, device, world, autocast, MALLOC_MMAP_THRESHOLD_="65536"
    )
    base, peak = map(int, words)
    return base, peak


def build_pair(name: str, mode: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    source = source_model(name, dtype)
    twin = attnres_twin(copy.deepcopy(source), mode)  # its own weights: both get trained below
    return source.to(device), twin.to(device)


def decode(model: torch.nn.Module, prompt: torch.Tensor, world: str) -> Callable:
    """Greedy decoding of 64 tokens; compiled: a compiled forward on the static cache."""
    settings = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    if world == "compiled":
        forward = torch.compile(model.forward, fullgraph=True)
        settings["cache_implementation"] = "static"

        def generate():
            model.forward = forward  # on the instance for the duration of the call: generate calls self(...)
            try:
                return model.generate(prompt, **settings)
            finally:
                del model.forward

        return generate
    return lambda: model.generate(prompt, **settings)


TorchDispatchMode = dispatch_mode_base()  # torch keeps it in a private module: through the seam


class OperationCounter(TorchDispatchMode):
    """Counts the aten operations run inside it: what an eager decode step pays per operation, whatever its size."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def counted_decode_step(model: torch.nn.Module, prompt: torch.Tensor, counter: TorchDispatchMode) -> None:
    """One eager greedy decode step (one token, on the KV cache of `prompt`) with `counter` seeing its operations."""
    with torch.no_grad():
        prefill = model(prompt, use_cache=True)
        next_token = prefill.logits[:, -1:].argmax(-1)
        with counter:
            model(next_token, use_cache=True, **{CACHE_NAME: getattr(prefill, CACHE_NAME)})


def decode_operations(model: torch.nn.Module, prompt: torch.Tensor) -> int:
    """aten operations of one eager greedy decode step."""
    counter = OperationCounter()
    counted_decode_step(model, prompt, counter)
    return counter.count


class TrafficCounter(TorchDispatchMode):
    """Bytes that the aten operations run inside it read and write, weights excluded: the activations' traffic."""

    def __init__(self, weights: set[int]):
        super().__init__()
        self.weights, self.bytes = weights, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        tensors = [t for t in tensor_leaves((args, kwargs, output)) if isinstance(t, torch.Tensor)]
        self.bytes += sum(t.nbytes for t in tensors if t.untyped_storage().data_ptr() not in self.weights)
        return output


def decode_traffic(model: torch.nn.Module, prompt: torch.Tensor) -> int:
    """Activation bytes read and written by one eager greedy decode step."""
    counter = TrafficCounter({p.untyped_storage().data_ptr() for p in model.parameters()})
    counted_decode_step(model, prompt, counter)
    return counter.bytes


def residual_traffic(source: torch.nn.Module, twin: torch.nn.Module, prompt: torch.Tensor) -> dict:
    """The depth mix's memory traffic per token and layer, in units of d elements: the twin's activation bytes beyond
    the source's, plus the 3d the source's residual add moves (read h and f, write h + f), as the paper counts
    (standard 3d, Block AttnRes 5.5d, mHC with m = 4 34d). Eager and unfused: every temporary counts."""
    config = source.config
    unit = config.num_hidden_layers * config.hidden_size * next(source.parameters()).element_size()
    extra = (decode_traffic(twin, prompt) - decode_traffic(source, prompt)) / unit
    return {"extra_d": extra, "total_d": 3 + extra}


PAPER_TRAFFIC_D = {"prenorm": 3, "block": 5.5, "mhc": 34}  # the paper's analytical residual traffic per layer


def benchmark_row(name: str, mode: str, world: str, autocast: str, args: argparse.Namespace) -> dict:
    """Every figure of one model, rule, world and precision (`autocast`: "off", or "bf16" around each forward)."""
    dtype, device = DTYPES[args.dtype], args.device
    source, twin = build_pair(name, mode, dtype, device)
    vocab = source.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    row = {"model": name, "mode": mode, "world": world, "dtype": args.dtype, "autocast": autocast,
           "block_size": twin.config.attnres_block_size, "num_layers": twin.config.num_hidden_layers,
           "output_sources": twin.config.num_sources()[-1]}  # fmt: skip
    bf16_autocast = autocast == "bf16"
    precision = functools.partial(in_precision, bf16_autocast, device)

    def in_inference(call: Callable) -> Callable:
        def run():
            with torch.no_grad(), precision():
                return call()

        return run

    prefill_ids = torch.randint(0, vocab, (1, 512), generator=generator).to(device)
    source_forward, twin_forward = in_world(source, world), in_world(twin, world)
    row["prefill"] = interleaved_ratio(
        in_inference(lambda: source_forward(prefill_ids)), in_inference(lambda: twin_forward(prefill_ids)),
        args.reps, args.warmup, device,
    )  # fmt: skip

    train_ids = torch.randint(0, vocab, (4, 256), generator=generator).to(device)
    source.train(), twin.train()
    row["train_step"] = interleaved_ratio(
        training_step(source, train_ids, world, bf16_autocast),
        training_step(twin, train_ids, world, bf16_autocast),
        args.reps, args.warmup, device,
    )  # fmt: skip
    source.eval(), twin.eval()

    prompt = torch.randint(0, vocab, (1, 64), generator=generator).to(device)
    row["decode_per_token"] = interleaved_ratio(
        in_inference(decode(source, prompt, world)), in_inference(decode(twin, prompt, world)),
        max(3, args.reps // 2), args.warmup, device,
    )  # fmt: skip
    for key in ("source_s", "attnres_s"):
        row["decode_per_token"][key] /= 64
    with precision():
        row["decode_operations"] = {
            "source": decode_operations(source, prompt),
            "attnres": decode_operations(twin, prompt),
        }
        row["residual_traffic"] = residual_traffic(source, twin, prompt)

    memory = {
        which: training_peak_memory(name, mode, which, args.dtype, device, world, autocast)
        for which in ("source", "attnres")
    }
    (source_base, source_peak), (twin_base, twin_peak) = memory["source"], memory["attnres"]
    row["train_peak_memory"] = {
        "source_bytes": source_peak,
        "attnres_bytes": twin_peak,
        "ratio": twin_peak / source_peak,
        "step_ratio": (twin_peak - twin_base) / max(source_peak - source_base, 1),
    }
    return row


# Saved activations: the bytes autograd keeps for the backward pass, counted through saved_tensors_hooks (distinct
# storages, parameters excluded: `attnres.cost.saved_activation_bytes`). They depend on shapes and dtypes only, not
# on the device or the machine's load.
PRECISIONS = {  # name -> (weights dtype, bf16 autocast)
    "bf16 weights": (torch.bfloat16, False),
    "fp32 weights, bf16 autocast": (torch.float32, True),
    "fp32": (torch.float32, False),
}
MEMORY_SETTINGS = ("plain", "gradient checkpointing", "gradient checkpointing (reentrant)", "attnres_recompute")


def saved_memory_ratio(
    num_layers: int, mode: str, precision: str, setting: str, tokens: tuple[int, int] = (2, 256), device: str = "cpu"
) -> float:
    """AttnRes / source saved activation bytes, Llama-shaped d=256, FFN 512, sdpa, `tokens` = (batch, length)."""
    config = AutoConfig.for_model(
        "llama", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(config)
    twin = attnres_twin(copy.deepcopy(source), mode)
    twin.config.attnres_recompute = setting == "attnres_recompute"
    dtype, autocast = PRECISIONS[precision]
    ids = torch.randint(0, config.vocab_size, tokens, generator=torch.Generator().manual_seed(0)).to(device)
    measured = []
    for model in (twin, source):
        model.to(device, dtype).train()
        if setting.startswith("gradient checkpointing"):
            reentrant = setting.endswith("(reentrant)")
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
        measured.append(saved_activation_bytes(model, ids, autocast))
    return measured[0] / measured[1]


def saved_memory_table(
    setting: str, modes: tuple[str, ...] = ("block", "full"), layers: tuple[int, ...] = (8, 32), device: str = "cpu"
) -> str:
    columns = [(mode, n) for mode in modes for n in layers]
    lines = [
        f"Saved activations, AttnRes / source, {setting}:",
        "| precision | " + " | ".join(f"{mode.capitalize()}, {n} layers" for mode, n in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for precision in PRECISIONS:
        ratios = [saved_memory_ratio(n, mode, precision, setting, device=device) for mode, n in columns]
        lines.append(f"| {precision} | " + " | ".join(f"{ratio:.3f}" for ratio in ratios) + " |")
    return "\n".join(lines)


# Compile time: CPU seconds of the first compiled fullgraph training step (forward and backward) of the tiny Llama,
# each model in a fresh process with an empty inductor cache and one thread, counting the compiler's child processes
# (the C++ or Triton compiles of the kernels). CPU seconds, unlike wall time, do not grow with the machine's load.
COMPILE_SCRIPT = """
import resource, sys, time, torch
sys.path.insert(0, {benchmarks_dir!r})
import overhead
mode, which, num_layers, dtype, device, backend, compiled_mix = sys.argv[1:8]
torch.set_num_threads(1)
model = overhead.tiny_model(int(num_layers), overhead.DTYPES[dtype])
if which == "attnres":
    model = overhead.attnres_twin(model, mode)
    model.config.attnres_compiled_mix = compiled_mix
model = model.to(device).train()
ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
compiled = torch.compile(model, fullgraph=True, backend=backend)

def cpu_seconds():
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime

own, children = cpu_seconds()
compiled(ids, labels=ids).loss.backward()
overhead.synchronize(device)
print(*(after - before for after, before in zip(cpu_seconds(), (own, children))))
"""
KERNEL_SUFFIXES = (".main.so", ".cubin", ".hsaco")  # a built C++ kernel, a built Triton kernel (CUDA, ROCm)


def first_compile(
    mode: str, which: str, num_layers: int, dtype: str, device: str, backend: str, compiled_mix: str
) -> dict:
    """CPU seconds of the first compiled training step of one model (of which in the compiler's child processes), and
    how many kernels the compiler built."""
    with tempfile.TemporaryDirectory(prefix="attnres-inductor-") as cache:
        words = in_fresh_process(
            COMPILE_SCRIPT, mode, which, str(num_layers), dtype, device, backend, compiled_mix,
            TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1",
        )  # fmt: skip
        kernels = sum(path.name.endswith(KERNEL_SUFFIXES) for path in Path(cache).rglob("*"))
    own, children = map(float, words)
    return {"cpu_s": own + children, "compiler_processes_s": children, "kernels": kernels}


def compile_time_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    for mode in args.modes.split(","):
        for num_layers in (int(n) for n in args.layers.split(",")):
            print(f"compiling tiny / {mode} / {num_layers} layers ...", file=sys.stderr, flush=True)
            figures = {
                which: first_compile(
                    mode, which, num_layers, args.dtype, args.device, args.compile_backend, args.compiled_mix
                )
                for which in ("source", "attnres")
            }
            block_size = attnres_config_for(tiny_config(num_layers), mode).attnres_block_size
            rows.append({"mode": mode, "num_layers": num_layers, "block_size": block_size, **figures,
                         "ratio": figures["attnres"]["cpu_s"] / figures["source"]["cpu_s"]})  # fmt: skip
    return rows


def block_layout(row: dict) -> str:
    if row["mode"] != "block":
        return "1 sublayer"
    return f"{row['block_size']} layer" + ("s" if row["block_size"] > 1 else "")


def compile_time_table(rows: list[dict]) -> str:
    lines = [
        "First compiled training step, CPU seconds (tiny Llama d=128, 2 x 64 tokens, fresh cache, one thread):",
        "| mode | layers | blocks of | source s | AttnRes s | AttnRes / source | of which compiler processes (source / "
        "AttnRes) | kernels built (source / AttnRes) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        source, twin = row["source"], row["attnres"]
        lines.append(
            f"| {row['mode']} | {row['num_layers']} | {block_layout(row)} | {source['cpu_s']:.1f} "
            f"| {twin['cpu_s']:.1f} | {row['ratio']:.2f} "
            f"| {source['compiler_processes_s']:.1f} / {twin['compiler_processes_s']:.1f} "
            f"| {source['kernels']} / {twin['kernels']} |"
        )
    return "\n".join(lines)


def environment(args: argparse.Namespace) -> dict:
    return {
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "malloc": args.malloc,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attnres": attnres.__version__,
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| model | mode | blocks of | world | precision | prefill | training step | decode / token "
        "| decode ops / token (source / AttnRes) | residual traffic / token / layer (eager; paper) "
        "| train peak memory (process) "
        "| train step memory (above weights + optimizer) | compile s (source / AttnRes: prefill, train, decode) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        memory = row["train_peak_memory"]
        paper = f"{PAPER_TRAFFIC_D[row['mode']]}d" if row["mode"] in PAPER_TRAFFIC_D else "-"
        layout = block_layout(row)
        precision = precision_label(row["dtype"], row["autocast"])
        compile_times = "-"
        if row["world"] == "compiled":
            measures = ("prefill", "train_step", "decode_per_token")
            compile_times = ", ".join(
                f"{row[m]['first_call_s']['source']:.0f} / {row[m]['first_call_s']['attnres']:.0f}" for m in measures
            )
        lines.append(
            f"| {row['model']} | {row['mode']} | {layout} | {row['world']} | {precision} "
            f"| {row['prefill']['ratio']:.3f} "
            f"| {row['train_step']['ratio']:.3f} | {row['decode_per_token']['ratio']:.3f} "
            f"| {row['decode_operations']['source']} / {row['decode_operations']['attnres']} "
            f"| {row['residual_traffic']['total_d']:.1f}d ({paper}) "
            f"| {memory['ratio']:.3f} | {memory['step_ratio']:.3f} | {compile_times} |"
        )
    return "\n".join(lines)


LIST_CHOICES = {
    "models": ("smollm2", "tiny"),
    "modes": tuple(RULES),
    "worlds": ("eager", "compiled"),
    "autocast": ("off", "bf16"),
}


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", default="smollm2,tiny", help="comma-separated: " + ", ".join(LIST_CHOICES["models"])
    )
    parser.add_argument(
        "--modes",
        default="block,full",
        help="comma-separated residual rules, or all: " + ", ".join(LIST_CHOICES["modes"]),
    )
    parser.add_argument(
        "--worlds", default="eager,compiled", help="comma-separated: " + ", ".join(LIST_CHOICES["worlds"])
    )
    parser.add_argument("--reps", type=int, default=7, help="measured pairs per figure (at least 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the weights' dtype")
    parser.add_argument(
        "--autocast",
        default="off",
        help="comma-separated: off (the weights' dtype throughout), bf16 (each forward under bf16 autocast, as mixed "
        "precision training runs; on a CPU without bf16 matrix units its matmuls are slow and dilute the ratios)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument(
        "--saved-memory",
        action="store_true",
        help="print only the saved-activation tables (plain, gradient checkpointing, attnres_recompute; --modes at 8 "
        "and 32 layers; bf16, fp32 under bf16 autocast, fp32): deterministic bytes, minutes on a CPU",
    )
    parser.add_argument(
        "--compile-time",
        action="store_true",
        help="measure only the CPU seconds of the first compiled training step of the tiny model, source and AttnRes, "
        "each in a fresh process with an empty compiler cache (--modes, --layers; minutes per model on a CPU)",
    )
    parser.add_argument("--layers", default="8,32", help="--compile-time: comma-separated decoder layer counts")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="--compile-time: torch.compile backend (eager measures tracing alone)",
    )
    parser.add_argument(
        "--compiled-mix",
        choices=COMPILED_MIXES,
        default="inline",
        help="--compile-time: AttnRes's attnres_compiled_mix (default: %(default)s)",
    )
    parser.add_argument(
        "--system-malloc", action="store_true", help="time with glibc's default malloc, which returns freed memory"
    )
    args = parser.parse_args(argv)
    if args.modes == "all":
        args.modes = ",".join(LIST_CHOICES["modes"])
    for option, choices in LIST_CHOICES.items():
        unknown = sorted(set(getattr(args, option).split(",")) - set(choices))
        if unknown:
            parser.error(f"--{option}: unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
    if args.reps < 5:
        parser.error("--reps: at least 5 repetitions")
    if args.warmup < 1:
        parser.error("--warmup: at least 1 (the first call is reported apart)")
    args.malloc = "system" if args.system_malloc or not keep_freed_memory() else "keeps freed memory"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    transformers.logging.set_verbosity_error()
    if args.saved_memory:
        for setting in MEMORY_SETTINGS:
            print(saved_memory_table(setting, tuple(args.modes.split(",")), device=args.device) + "\n", flush=True)
        return
    if args.compile_time:
        rows = compile_time_rows(args)
        print(compile_time_table(rows))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"environment": environment(args), "compile_time": rows}, handle, indent=2)
        return
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            for world in args.worlds.split(","):
                for autocast in args.autocast.split(","):
                    print(f"measuring {name} / {mode} / {world} / autocast {autocast} ...", file=sys.stderr, flush=True)
                    # Each row compiles its own models: dynamo's recompile limit (8) would otherwise count the
                    # compilations of every row's models together, and stop the third compiled row (`--modes all`)
                    torch.compiler.reset()
                    rows.append(benchmark_row(name, mode, world, autocast, args))
    result = {"environment": environment(args), "rows": rows}
    print(json.dumps(result["environment"]))
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
