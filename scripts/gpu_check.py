"""The GPU check: everything this project can only measure on a GPU, in one run that prints one table.

    bash scripts/gpu_check.sh                    # on a CUDA machine: under 10 minutes on one H200
    bash scripts/gpu_check.sh --dry-run          # every stage on the CPU at toy sizes: proves the script still runs
    bash scripts/gpu_check.sh --stages memory,overhead --work /tmp/check

Stages, each in its own process with a time limit (a stage that fails or runs out of time is one FAILED row; the others
still run, and the exit status is non-zero):
- `memory`: saved-activation bytes AttnRes / source (Llama-shaped, d=256, 2 x 256 tokens), Block and Full, 8 and 32
  layers, in bf16 weights, fp32 under bf16 autocast and fp32, on the GPU: plain, with activation checkpointing (both
  kinds) and with `attnres_recompute`.
- `overhead`: SmolLM2-135M Block and Full against the source in bf16, eager and compiled: prefill, training step,
  decode per token, training peak memory, and the compile times (`benchmarks/overhead.py`).
- `conversion`: `attnres convert` of SmolLM2-135M verified on the GPU in bfloat16 and float32.
- `fla`: when flash-linear-attention imports, the `fla` depth-mix backend (its fused Triton kernel) against
  `two_phase` on the conversions with random pseudo-queries (Block, 4 x 512 tokens): logits, gradients, and the time
  of a training step, as interleaved pairs. The dry run puts fla's reference op in place of the kernel.
- `device_map`: the float32 conversion loaded with `device_map="auto"` over two GPUs (when there are two; on one GPU
  over the GPU and the CPU), logits against one device.
- `fsdp2`, `zero3`: a few training steps of the float32 conversion with the shipped Accelerate configs (bf16), on 2
  GPUs when there are 2.
- `compare`: a short `attnres compare` of PreNorm and Block on SmolLM2-135M, one seed, over the Python standard
  library's modules as documents: the runs, test loss and depth-mixing matrix on the GPU, and Block's training step
  and its peak memory against PreNorm's, timed in interleaved pairs.
- `vllm`: when `vllm` imports, greedy generation of the bf16 conversion through vLLM's Transformers backend against
  `generate`, on one GPU and, when there are two, at tensor-parallel size 2.

`--dry-run` runs the same stages on the CPU at toy sizes, in float32 (CPUs emulate bf16, slowly): a tiny random Llama
with SmolLM2's tokenizer, 2 layers in the memory table, Block eager only in the overhead; the figures mean nothing, the
code paths are the real ones. The test suite runs it.
"""

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
STAGES = ("memory", "overhead", "conversion", "fla", "device_map", "fsdp2", "zero3", "compare", "vllm")
STAGE_TIMEOUT_S = {"memory": 120, "overhead": 300, "conversion": 120, "device_map": 60, "fsdp2": 120, "zero3": 120,
                   "compare": 240}  # fmt: skip
DEFAULT_STAGE_TIMEOUT_S = 120
MODES = ("block", "full")
DRY_RUN_TOKENIZER_VOCAB = 49152  # SmolLM2's tokenizer: the dry run's tiny model shares it to train on real text


# --------------------------------------------------------------------------------------------------------------------
# Stages: each returns rows (what, setting, figure, status), run in a process of its own
# --------------------------------------------------------------------------------------------------------------------


def device_of(dry_run: bool) -> str:
    return "cpu" if dry_run else "cuda"


def gpu_count(dry_run: bool) -> int:
    import torch

    return 0 if dry_run else torch.cuda.device_count()


def source_folder(work: Path, dry_run: bool) -> tuple[str, str | None]:
    """(source, gguf_file): SmolLM2-135M-Instruct, or for the dry run a tiny random Llama saved with its tokenizer."""
    from attnres.sources import default_model_path

    folder, gguf_file = default_model_path()
    if not dry_run:
        return folder, gguf_file
    tiny = work / "tiny-source"
    if not (tiny / "config.json").is_file():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.for_model(
            "llama", vocab_size=DRY_RUN_TOKENIZER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
        )  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tiny)
        AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file).save_pretrained(tiny)
    return str(tiny), None


def converted_folder(work: Path, dtype: str, dry_run: bool) -> Path:
    """The conversion stage's output in `dtype`, made here when that stage did not run."""
    folder = work / f"converted-{dtype}"
    if not (folder / "config.json").is_file():
        from attnres.conversion import DTYPES, convert_checkpoint

        source, gguf_file = source_folder(work, dry_run)
        convert_checkpoint(source, folder, gguf_file, dtype=DTYPES[dtype], device=device_of(dry_run), overwrite=True)
    return folder


def stage_memory(work: Path, dry_run: bool) -> list[tuple]:
    from overhead import MEMORY_SETTINGS, PRECISIONS, saved_memory_ratio

    # The CPU emulates bf16, slowly: the dry run measures fp32 at 2 layers, without checkpointing
    layers, precisions, settings = ((2,), ("fp32",), ("plain",)) if dry_run else ((8, 32), PRECISIONS, MEMORY_SETTINGS)
    return [
        (f"saved activations, {mode}", f"{setting}; {precision}, {num_layers} layers",
         f"{saved_memory_ratio(num_layers, mode, precision, setting, device=device_of(dry_run)):.3f}x",
         "plain: <= 1.15 (Block), <= 1.30 (Full)")
        for setting in settings for mode in MODES for num_layers in layers for precision in precisions
    ]  # fmt: skip


def stage_overhead(work: Path, dry_run: bool) -> list[tuple]:
    import overhead

    args = argparse.Namespace(device=device_of(dry_run))
    args.reps, args.warmup = (5, 1) if dry_run else (7, 2)
    model, modes, worlds = ("tiny", ("block",), ("eager",)) if dry_run else ("smollm2", MODES, ("eager", "compiled"))
    # (weights, autocast): bf16 weights, and fp32 weights under bf16 autocast as mixed-precision training runs
    precisions = (("float32", "off"),) if dry_run else (("bfloat16", "off"), ("float32", "bf16"))
    rows = []
    for mode, world, (args.dtype, autocast) in itertools.product(modes, worlds, precisions):
        measured = overhead.benchmark_row(model, mode, world, autocast, args)
        figures = ", ".join(
            f"{name} {measured[key]['ratio']:.3f}x"
            for name, key in (("prefill", "prefill"), ("train", "train_step"), ("decode", "decode_per_token"),
                              ("peak memory", "train_peak_memory"))
        )  # fmt: skip
        operations = measured["decode_operations"]
        figures += f", decode ops / token {operations['source']} / {operations['attnres']}"
        if world == "compiled":
            first_calls = {key: measured[key]["first_call_s"] for key in ("prefill", "train_step", "decode_per_token")}
            figures += "; compile s (source / AttnRes): " + ", ".join(
                f"{key} {seconds['source']:.0f} / {seconds['attnres']:.0f}" for key, seconds in first_calls.items()
            )
        precision = overhead.precision_label(args.dtype, autocast)
        rows.append((f"{model} {mode}, {precision}", world, figures, "Block target <= 1.03 / 1.05 / 1.05 / 1.05"))
    return rows


def stage_conversion(work: Path, dry_run: bool) -> list[tuple]:
    from attnres.cards import read_origin

    rows = []
    for dtype in ("bfloat16", "float32"):
        verification = read_origin(converted_folder(work, dtype, dry_run))["conversion"]["verification"]
        figures = (
            f"max abs logit diff {verification['max_abs_logit_diff']:.2e}, "
            f"mean {verification['mean_abs_logit_diff']:.2e}"
            f" (source in {dtype}: mean {verification['source_mean_abs_logit_diff']:.2e}); greedy "
            f"{verification['greedy_tokens_agreeing']}/{verification['greedy_tokens']}"
        )
        rows.append(("conversion verified", f"{dtype} on {device_of(dry_run)}", figures, "passed"))
    return rows


def fla_op_in_place_of_the_kernel() -> None:
    """The dry run's `fla` backend: flash-linear-attention's reference op (loaded from its file: importing `fla.ops`
    loads Triton) where the kernel would run, so that the stage's code runs on a CPU."""
    import importlib.util

    from attnres import depth_mix_backends

    path = Path(importlib.util.find_spec("fla").submodule_search_locations[0]) / "ops" / "attnres" / "naive.py"
    spec = importlib.util.spec_from_file_location("fla_attnres_naive", path)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    depth_mix_backends.fused_attnres_for = lambda device: reference.naive_attnres


def fla_step(model, ids, implementation: str) -> tuple:
    """A forward and backward of `model` through the `implementation` backend -> fp32 logits, each parameter's grad"""
    model.config.attnres_implementation = implementation
    model.zero_grad()
    logits = model(ids.to(model.device)).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = {name: parameter.grad.float() for name, parameter in model.named_parameters() if parameter.grad is not None}
    return logits.detach().float(), grads


def stage_fla(work: Path, dry_run: bool) -> list[tuple]:
    import torch

    from attnres import AttnResForCausalLM
    from attnres.cost import interleaved_ratio

    if dry_run:
        fla_op_in_place_of_the_kernel()
    elif importlib.util.find_spec("fla") is None:
        return [("fla backend", "flash-linear-attention not installed", "not run", "pip install it to check")]
    device, rows = device_of(dry_run), []
    ids = torch.randint(0, 1000, (2, 32) if dry_run else (4, 512), generator=torch.Generator().manual_seed(0))
    for dtype in ("float32",) if dry_run else ("float32", "bfloat16"):
        model = AttnResForCausalLM.from_pretrained(converted_folder(work, dtype, dry_run)).to(device)
        with torch.no_grad():  # queries away from zero, so that the depth weights differ from source to source
            generator = torch.Generator().manual_seed(0)
            for name, parameter in model.named_parameters():
                if "_res_proj" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)

        (expected, expected_grads), (logits, grads) = (fla_step(model, ids, name) for name in ("two_phase", "fla"))
        logit_diff = (logits - expected).abs().max().item()
        grad_diff = max(((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in expected_grads.items())
        reps, warmup = (2, 1) if dry_run else (10, 2)
        timing = interleaved_ratio(
            partial(fla_step, model, ids, "two_phase"), partial(fla_step, model, ids, "fla"), reps, warmup, device
        )
        rows.append((
            "fla backend vs two_phase", f"{dtype}, Block, {tuple(ids.shape)}",
            f"max abs logit diff {logit_diff:.2e}, largest relative grad diff {grad_diff:.2e}; "
            f"train step {timing['ratio']:.3f}x two_phase",
            "logits within the conversion's own noise; step < 1x",
        ))  # fmt: skip
    return rows


def stage_device_map(work: Path, dry_run: bool) -> list[tuple]:
    import torch
    from transformers import AutoModelForCausalLM

    import attnres  # noqa: F401  (registers the AttnRes classes)

    folder = converted_folder(work, "float32", dry_run)
    device = device_of(dry_run)
    ids = torch.randint(0, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = AutoModelForCausalLM.from_pretrained(folder).to(device)
        expected = whole(ids.to(device)).logits.cpu()
        size = sum(parameter.numel() * parameter.element_size() for parameter in whole.parameters())
        del whole
        if dry_run:  # the toy model is mostly its embedding, which "auto" cannot split: half of the rest on disk
            device_map = {"model.embed_tokens": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu",
                         "model.layers.0": "cpu", "model.layers.1": "disk", "model.output_attn_res_proj": "disk",
                         "model.output_attn_res_norm": "cpu", "model.norm": "disk"}  # fmt: skip
            options = {"device_map": device_map}
        elif gpu_count(dry_run) >= 2:
            options = {"device_map": "auto", "max_memory": {0: size // 2, 1: 2 * size}}
        else:  # one GPU: the rest of the layers on the CPU
            options = {"device_map": "auto", "max_memory": {0: size // 2, "cpu": 2 * size}}
        spread = AutoModelForCausalLM.from_pretrained(folder, offload_folder=str(work / "offload"), **options)
        placement = sorted({str(where) for where in spread.hf_device_map.values()})
        logits = spread(ids.to(device)).logits.cpu()  # the first module's device: Accelerate moves the rest
    diff = (logits - expected).abs().max().item()
    return [("device map", " + ".join(placement), f"max abs logit diff {diff:.2e}", "<= 1e-4")]


def stage_distributed(work: Path, dry_run: bool, engine: str) -> list[tuple]:
    import importlib.util

    if engine == "deepspeed_zero3" and importlib.util.find_spec("deepspeed") is None:
        return [("ZeRO-3 training", "-", 'skipped: deepspeed not installed (pip install "attnres[deepspeed]")', "-")]
    folder = converted_folder(work, "float32", dry_run)
    output_dir = work / engine
    processes = 2 if dry_run or gpu_count(dry_run) >= 2 else 1
    options = ["--max-steps", "2", "--seq-len", "64", "--batch-size", "2", "--eval-every", "2", "--save-every", "2",
               "--max-eval-sequences", "4", "--log-every", "1"] if dry_run else \
              ["--max-steps", "20", "--seq-len", "1024", "--batch-size", "8", "--warmup-steps", "2", "--log-every", "5",
               "--eval-every", "20", "--save-every", "20", "--max-eval-sequences", "16"]  # fmt: skip
    precision = ["--mixed_precision", "no"] if dry_run else []  # the CPU dry run in fp32; on GPUs the configs' bf16
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPOSITORY / "examples" / "accelerate" / f"{engine}.yaml"), "--num_processes", str(processes),
               *precision, "-m", "attnres.training", "--model", str(folder), "--output-dir", str(output_dir),
               *options]  # fmt: skip
    shutil.rmtree(output_dir, ignore_errors=True)  # an earlier check's run in this work folder
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    evaluations = [record["eval_loss"] for record in records if "eval_loss" in record]
    figures = (
        f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}, held-out {evaluations[0]:.4f} -> "
        f"{evaluations[-1]:.4f}, {steps[-1]['tokens_per_second']:,.0f} tokens/s"
    )
    return [(f"{engine} training", f"{processes} process(es)", figures, "runs" if dry_run else "runs; loss falls")]


def stage_compare(work: Path, dry_run: bool) -> list[tuple]:
    import sysconfig

    from attnres.compare import compare

    source = source_folder(work, dry_run)[0] if dry_run else "default"  # the embedded SmolLM2, as a user names it
    documents = work / "compare-documents"  # the standard library's modules of 1 to 16 KB, one document each
    if not documents.is_dir():
        documents.mkdir()
        for module in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            if 1024 <= module.stat().st_size <= 16 * 1024:
                (documents / f"{module.stem}.txt").write_bytes(module.read_bytes())
    shape = dict(tokens=2 * 2 * 64, seq_len=64, batch_size=2, cost_pairs=2) if dry_run else \
        dict(tokens=40 * 8 * 256, seq_len=256, batch_size=8, cost_pairs=10)  # fmt: skip
    study = work / "compare"
    shutil.rmtree(study, ignore_errors=True)  # an earlier check's study in this work folder
    held_out = dict(evaluations=2, eval_sequences=8, held_out_documents=4, held_out_bytes=16 * 1024)
    results = compare(source=source, data=str(documents), output_dir=str(study), rules="prenorm,block", seeds=1,
                      **held_out, **shape)  # fmt: skip
    cost = results["cost"]["block"]
    comparison = results["comparisons"][0]
    figures = (
        f"step {cost['ratio']:.3f}x on {cost['device']}, step memory {cost['step_memory']['ratio']:.3f}x; test "
        f"loss block - prenorm {comparison['mean']:+.4f}; depth-mixing matrices {', '.join(results['mixing_matrices'])}"
    )
    return [("compare", f"prenorm vs block, 1 seed, {shape['tokens']:,} tokens", figures, "runs; step <= 1.05x")]


def stage_vllm(work: Path, dry_run: bool) -> list[tuple]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return [("vLLM Transformers backend", "-", "skipped: vllm not installed", "-")]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    import attnres  # noqa: F401
    from attnres.verification import leading_agreement

    folder = str(converted_folder(work, "bfloat16", dry_run))
    prompts = ["def fibonacci(n):", "The capital of France is"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device_of(dry_run))
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
        tokens = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
        expected.append(tokens.tolist())
    del model
    rows = []
    # Tensor-parallel size 2 where there are 2 GPUs: the engine shards by the source family's plan (AttnResConfig
    # hands on base_model_tp_plan), and must generate what one GPU does
    for tensor_parallel_size in (1, 2) if gpu_count(dry_run) >= 2 else (1,):
        # The folder is ours, written above: its remote code is this package's modeling file, which vLLM's engine
        # process (where `import attnres` did not run) loads to find the classes.
        engine = LLM(model=folder, model_impl="transformers", dtype="bfloat16", trust_remote_code=True,
                     enforce_eager=True, tensor_parallel_size=tensor_parallel_size)  # fmt: skip
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, min_tokens=32))
        agreeing = [
            leading_agreement(torch.tensor(output.outputs[0].token_ids), torch.tensor(reference))
            for output, reference in zip(outputs, expected, strict=True)
        ]
        setting = f"bf16, greedy 32 tokens, tensor parallel {tensor_parallel_size}"
        figure = f"leading tokens equal to generate: {agreeing}"
        rows.append(("vLLM Transformers backend", setting, figure, "32 each (bf16 kernels may differ late)"))
        del engine
    return rows


def run_stage(name: str, work: Path, dry_run: bool) -> list[tuple]:
    if name in ("fsdp2", "zero3"):
        return stage_distributed(work, dry_run, "fsdp2" if name == "fsdp2" else "deepspeed_zero3")
    return globals()[f"stage_{name}"](work, dry_run)


# --------------------------------------------------------------------------------------------------------------------
# The run: each stage in a child process, one table at the end
# --------------------------------------------------------------------------------------------------------------------


def run_in_child(name: str, work: Path, dry_run: bool) -> tuple[list[tuple], float]:
    result_file = work / f"{name}.rows.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--stage", name, "--work", str(work)] + (["--dry-run"] if dry_run else [])
    timeout = STAGE_TIMEOUT_S.get(name, DEFAULT_STAGE_TIMEOUT_S) * (3 if dry_run else 1)  # CI's 2 cores are slower
    start = time.perf_counter()
    try:
        subprocess.run(command, timeout=timeout, check=True)
        rows = [tuple(row) for row in json.loads(result_file.read_text())]
    except subprocess.TimeoutExpired:
        rows = [(name, "-", f"FAILED: no result after {timeout} s", "-")]
    except subprocess.CalledProcessError as error:
        rows = [(name, "-", f"FAILED: exit status {error.returncode} (its output is above)", "-")]
    return rows, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every stage on the CPU at toy sizes")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of: {', '.join(STAGES)}")
    parser.add_argument("--work", type=Path, help="folder for converted models and runs (default: a new temporary one)")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # a child process runs one stage
    args = parser.parse_args(argv)
    stages = args.stages.split(",")
    if unknown := sorted(set(stages) - set(STAGES)):
        parser.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    sys.path.insert(0, str(REPOSITORY / "benchmarks"))
    if args.stage is not None:
        rows = run_stage(args.stage, args.work, args.dry_run)
        (args.work / f"{args.stage}.rows.json").write_text(json.dumps(rows))
        return 0

    import tempfile

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --dry-run to run every stage on the CPU")
    work = args.work or Path(tempfile.mkdtemp(prefix="attnres-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    device = (
        "CPU (dry run: toy sizes)" if args.dry_run else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    )
    lines = ["| check | setting | measured | expected | stage s |", "|---|---|---|---|---|"]
    failed = False
    for name in stages:
        print(f"== {name}", file=sys.stderr, flush=True)
        rows, seconds = run_in_child(name, work, args.dry_run)
        failed |= any(str(row[2]).startswith("FAILED") for row in rows)
        lines += [f"| {' | '.join(map(str, row))} | {seconds:.0f} |" for row in rows]
    print(f"\nGPU check on {device}; torch {torch.__version__}; work folder {work}\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
