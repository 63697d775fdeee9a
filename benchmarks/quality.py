"""Does AttnRes help? Two studies, each against a plain control that differs only in the residual connection.

1. From scratch: a small Llama-shaped byte-level model trained as PreNorm, Block AttnRes (default block size) and Full
   AttnRes, on identical data order and hyperparameters, with the same initial weights outside AttnRes, per seed.
2. Continued pretraining (CPT) of the embedded SmolLM2-135M-Instruct at equal tokens: plain CPT of the source,
   converted + CPT, converted with only the AttnRes parameters trained, LoRA on the source; plus a few recipes for the
   converted model (AttnRes learning rate, its warm-up, AttnRes first and then everything). Held-out loss on the
   training domain and on an unseen one (forgetting), and offline HumanEval pass@1 on a fixed subset.

Every run is an `attnres train` run (`attnres.training.train`); HumanEval is `attnres eval` (`attnres.eval.evaluate`).
The training corpus is the Python documentation's reST sources (Debian: `apt-get install python3-doc`), split by
document into train and held-out; the unseen domain is the Python standard library's source code.

    python benchmarks/quality.py --output quality-run                      # both studies, about an hour on 2 cores
    python benchmarks/quality.py --output quality-run --device cuda --tokens 2000000 --scratch-tokens 50000000
    python benchmarks/quality.py --output smoke --smoke                    # seconds: tiny models, generated text

The folder receives each run's `attnres train` output, `results.json` (every figure), `summary.md` (the tables) and
the plots; an existing non-empty folder is refused.
"""

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from matplotlib.figure import Figure
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.analysis import analyze
from attnres.conversion import DEFAULT_SOURCE, SAMPLE_TEXT, load_source, load_source_tokenizer, resolve_source
from attnres.data import pack, stdlib_source_files
from attnres.eval import evaluate
from attnres.hub import read_training_run
from attnres.training import is_attnres_parameter, train

logger = logging.getLogger("quality")


def held_out_loss(model: PreTrainedModel, sequences: Dataset, batch_size: int, name: str) -> float:
    """Mean next-token loss over equal-length sequences (each batch weighted by its size), as training scores it."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in tqdm(DataLoader(sequences.with_format("torch"), batch_size=batch_size), desc=f"Held-out, {name}"):
            input_ids = batch["input_ids"]
            total += model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item() * len(input_ids)
            count += len(input_ids)
    return total / count


DOCS_CORPUS_GLOB = "/usr/share/doc/python3*/html/_sources"  # Debian's python3-doc: the docs' reST sources as .txt
SCRATCH_VARIANTS = {"prenorm": "PreNorm baseline", "block": "Block AttnRes", "full": "Full AttnRes"}
# Continued pretraining: each variant is one or more `attnres train` stages, (share of the steps, options); a later
# stage trains what the previous one wrote. `warmup_share` is the warm-up as a share of the stage's steps.
CPT_VARIANTS = {
    "plain": ("plain CPT of the source", [(1.0, {})]),
    "converted": ("converted + CPT (the defaults: --attnres-lr 1e-4)", [(1.0, {"convert": True})]),
    "attnres-only": ("converted, AttnRes parameters only", [(1.0, {"convert": True, "train": "attnres"})]),
    "lora": ("LoRA on the source", [(1.0, {"train": "lora", "merge_lora": True})]),
}
RECIPES = {
    "attnres-lr-1e-3": (
        "converted + CPT, --attnres-lr 1e-3 (the earlier default)",
        [(1.0, {"convert": True, "attnres_lr": 1e-3})],
    ),
    "attnres-lr-1e-5": ("converted + CPT, --attnres-lr 1e-5", [(1.0, {"convert": True, "attnres_lr": 1e-5})]),
    "warmup-quarter": (
        "converted + CPT, --attnres-lr 1e-3, warm-up a quarter of the steps",
        [(1.0, {"convert": True, "attnres_lr": 1e-3, "warmup_share": 0.25})],
    ),
    "staged": (
        "AttnRes only for a quarter of the steps, then everything",
        [(0.25, {"convert": True, "train": "attnres"}), (0.75, {})],
    ),
}
HUMANEVAL_VARIANTS = ("source", *CPT_VARIANTS)  # recipes are compared on held-out loss only (CPU time)


@dataclass
class Scale:
    """How big each study is; `--tokens` and friends override the defaults."""

    scratch_shape: dict  # LlamaConfig fields of the from-scratch model
    scratch_tokens: int
    scratch_seq_len: int
    scratch_batch: int
    scratch_lr: float
    scratch_eval_sequences: int
    cpt_tokens: int
    cpt_seq_len: int
    cpt_batch: int
    cpt_eval_sequences: int
    humaneval_problems: int
    max_gen_toks: int
    scratch_evaluations: int  # held-out evaluations per run, beside the one before training
    cpt_evaluations: int


# Sized for about an hour on an idle 2-core CPU: a from-scratch step of 16 x 256 bytes takes about 1.7 s, a SmolLM2
# step of 4 x 256 tokens about 7.5 s.
DEFAULT_SCALE = Scale(
    scratch_shape=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4),
    scratch_tokens=262_144,
    scratch_seq_len=256,
    scratch_batch=16,
    scratch_lr=2e-3,
    scratch_eval_sequences=64,
    cpt_tokens=24_576,
    cpt_seq_len=256,
    cpt_batch=4,
    cpt_eval_sequences=16,
    humaneval_problems=20,
    max_gen_toks=128,
    scratch_evaluations=8,
    cpt_evaluations=2,
)
SMOKE_SCALE = Scale(
    scratch_shape=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
    scratch_tokens=2 * 4 * 32,
    scratch_seq_len=32,
    scratch_batch=4,
    scratch_lr=2e-3,
    scratch_eval_sequences=4,
    cpt_tokens=4 * 2 * 32,
    cpt_seq_len=32,
    cpt_batch=2,
    cpt_eval_sequences=4,
    humaneval_problems=1,
    max_gen_toks=4,
    scratch_evaluations=2,
    cpt_evaluations=2,
)


class QualityError(RuntimeError):
    """A benchmark that cannot run as asked; the message says what to change."""


# --------------------------------------------------------------------------------------------------------------------
# Models and corpora
# --------------------------------------------------------------------------------------------------------------------


def byte_tokenizer() -> ByT5Tokenizer:
    """256 byte ids after pad, EOS and unknown: no vocabulary to learn, and a tiny embedding."""
    return ByT5Tokenizer(extra_ids=0)


def llama_config(shape: dict, tokenizer: ByT5Tokenizer, max_positions: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        num_key_value_heads=shape["num_attention_heads"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )


def scratch_models(config: LlamaConfig, seed: int) -> dict[str, PreTrainedModel]:
    """The three from-scratch variants of one seed: one PreNorm initialisation, whose weights the AttnRes variants
    take over (their own parameters start as the paper says: zero queries, unit key norms)."""
    torch.manual_seed(seed)
    prenorm = LlamaForCausalLM(config)
    models: dict[str, PreTrainedModel] = {"prenorm": prenorm}
    for mode in ("block", "full"):
        model = AttnResForCausalLM(AttnResConfig(text_config=config.to_dict(), attnres_mode=mode))
        missing = model.load_state_dict(prenorm.state_dict(), strict=False).missing_keys
        assert all(is_attnres_parameter(name) for name in missing), missing
        models[mode] = model
    return models


def docs_corpus(corpus: str | None) -> Path:
    """The training corpus: `--corpus`, or the Python documentation's reST sources from the python3-doc package."""
    if corpus is not None:
        return Path(corpus)
    found = sorted({path.resolve() for path in Path("/").glob(DOCS_CORPUS_GLOB.lstrip("/"))})  # Debian links some
    if not found:
        raise QualityError(
            f"no training corpus: {DOCS_CORPUS_GLOB} is missing. Install the Python documentation "
            "(Debian/Ubuntu: apt-get install python3-doc), or pass --corpus DIR (a folder of .txt documents)."
        )
    return found[-1]


def smoke_corpus(folder: Path) -> Path:
    """A few generated English documents, for `--smoke`: CI needs nothing installed."""
    folder.mkdir(parents=True)
    paragraphs = [p for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
    for index in range(12):
        text = "\n\n".join(paragraphs[(index + k) % len(paragraphs)] for k in range(3))
        (folder / f"document-{index:02d}.txt").write_text(text)
    return folder


def unseen_sequences(tokenizer, seq_len: int, count: int) -> Dataset:
    """The unseen domain: `count` sequences of Python standard-library source, every 25th file in sorted order."""
    files = stdlib_source_files()[::25]
    documents = Dataset.from_dict({"text": [Path(file).read_text(errors="replace") for file in files]})
    sequences = pack(documents, tokenizer, "text", seq_len)
    return sequences.select(range(min(count, len(sequences))))


# --------------------------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------------------------


def humaneval(model: str, output_dir: Path, eval_options: dict) -> dict[str, float | None]:
    """`attnres eval --tasks humaneval` of a model folder (or `default`): pass@1 and its standard error."""
    report = evaluate(model, tasks=["humaneval"], output_dir=output_dir, **eval_options)
    row = next(row for row in report.rows if row.metric.startswith("pass@1"))
    return {"humaneval_pass_at_1": row.attnres, "humaneval_stderr": row.attnres_stderr}


def run_stages(folder: Path, stages: list[tuple[float, dict]], common: dict[str, Any]) -> tuple[Any, list[dict], float]:
    """Train `stages` one after the other into `folder`/stage-N -> (last TrainingResult, metrics of all, seconds)."""
    total_steps, model, metrics, step_offset = common["max_steps"], common["model"], [], 0
    start = time.perf_counter()
    for number, (share, options) in enumerate(stages):
        options = dict(options)
        steps = max(1, round(share * total_steps))
        if "warmup_share" in options:
            options["warmup_steps"] = round(options.pop("warmup_share") * steps)
        output_dir = folder if len(stages) == 1 else folder / f"stage-{number}"
        result = train(**common | {"model": model, "max_steps": steps, "output_dir": str(output_dir)} | options)
        records = read_training_run(output_dir)[1]
        metrics += [r | {"step": r["step"] + step_offset} for r in records if number == 0 or r["step"] > 0]
        model, step_offset = str(output_dir), step_offset + steps
    return result, metrics, time.perf_counter() - start


def curve(metrics: list[dict], tokens_per_step: int, key: str = "eval_loss") -> list[tuple[int, float]]:
    """(training tokens, `key`) at each step that logged it."""
    return [(record["step"] * tokens_per_step, record[key]) for record in metrics if key in record]


def depth_picture(model: PreTrainedModel, tokenizer, folder: Path, tokens: int) -> None:
    """`attnres analyze` of a trained model on the built-in sample text: where each sublayer looks in depth."""
    input_ids = tokenizer(SAMPLE_TEXT, return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
    analyze(model.to("cpu", torch.float32), input_ids, folder)


@torch.no_grad()
def unseen_loss(model: PreTrainedModel, sequences: Dataset, name: str) -> float:
    return held_out_loss(model.to("cpu", torch.float32), sequences, 4, name)  # `.float()` refuses GGUF models


def scratch_study(output: Path, scale: Scale, corpus: Path, seeds: int, training: dict) -> dict:
    tokenizer = byte_tokenizer()
    config = llama_config(scale.scratch_shape, tokenizer, scale.scratch_seq_len)
    tokens_per_step = scale.scratch_seq_len * scale.scratch_batch
    steps = max(1, scale.scratch_tokens // tokens_per_step)
    common = training | {
        "dataset": str(corpus),
        "seq_len": scale.scratch_seq_len,
        "batch_size": scale.scratch_batch,
        "max_eval_sequences": scale.scratch_eval_sequences,
        "max_steps": steps,
        "lr": scale.scratch_lr,
        "attnres_lr": scale.scratch_lr,  # identical hyperparameters: AttnRes gets no learning rate of its own
        "eval_every": max(1, steps // scale.scratch_evaluations),
    }
    runs = []
    for seed in range(seeds):
        for variant, model in scratch_models(config, seed).items():
            initial = output / "scratch" / f"init-{variant}-seed{seed}"
            model.save_pretrained(initial)
            tokenizer.save_pretrained(initial)
            folder = output / "scratch" / f"{variant}-seed{seed}"
            logger.info("From scratch: %s, seed %d", SCRATCH_VARIANTS[variant], seed)
            result, metrics, seconds = run_stages(folder, [(1.0, {})], common | {"model": str(initial), "seed": seed})
            held_out = curve(metrics, tokens_per_step)
            runs.append(
                {"variant": variant, "seed": seed, "seconds": seconds, "curve": held_out, "final": held_out[-1][1]}
            )
            if seed == 0 and variant != "prenorm":
                depth_picture(
                    result.model, tokenizer, output / "scratch" / f"analysis-{variant}", scale.scratch_seq_len
                )
            save_partial(output / "scratch" / "runs.json", runs)
    return {
        "tokens": steps * tokens_per_step,
        "steps": steps,
        "parameters": {v: m.num_parameters() for v, m in scratch_models(config, 0).items()},
        "config": common | {"model_shape": scale.scratch_shape},
        "runs": runs,
    }


def cpt_study(
    output: Path, scale: Scale, corpus: Path, source: str, variants: list[str], training: dict, eval_options: dict
) -> dict:
    source_path, gguf_file = resolve_source(source)
    tokenizer = load_source_tokenizer(source_path, gguf_file)
    unseen = unseen_sequences(tokenizer, scale.cpt_seq_len, scale.cpt_eval_sequences)
    tokens_per_step = scale.cpt_seq_len * scale.cpt_batch
    steps = max(1, scale.cpt_tokens // tokens_per_step)
    common = training | {
        "model": source,
        "dataset": str(corpus),
        "seq_len": scale.cpt_seq_len,
        "batch_size": scale.cpt_batch,
        "max_eval_sequences": scale.cpt_eval_sequences,
        "max_steps": steps,
        "eval_every": max(1, steps // scale.cpt_evaluations),
        "seed": 0,
    }
    runs = {}
    source_model = load_source(source_path, torch.float32, gguf_file)
    runs["source"] = {"label": "the source, untrained", "unseen_loss": unseen_loss(source_model, unseen, "source")}
    del source_model
    for name in variants:
        label, stages = (CPT_VARIANTS | RECIPES)[name]
        logger.info("Continued pretraining: %s", label)
        folder = output / "cpt" / name
        result, metrics, seconds = run_stages(folder, stages, common)
        held_out = curve(metrics, tokens_per_step)
        runs[name] = {
            "label": label,
            "stages": [[share, options] for share, options in stages],
            "seconds": seconds,
            "curve": held_out,
            "training_curve": curve(metrics, tokens_per_step, "loss"),  # every variant sees the same batches
            "start": held_out[0][1],
            "final": held_out[-1][1],
            "unseen_loss": unseen_loss(result.model, unseen, name),
            "folder": str(folder if len(stages) == 1 else folder / f"stage-{len(stages) - 1}"),
        }
        if name in ("converted", "attnres-only"):
            depth_picture(result.model, tokenizer, folder / "analysis", 512)
        del result
        if name in HUMANEVAL_VARIANTS:
            runs[name] |= humaneval(runs[name]["folder"], output / "humaneval" / name, eval_options)
        save_partial(output / "cpt" / "runs.json", runs)
    runs["source"]["final"] = runs[variants[0]]["start"]  # every variant starts as the source: step 0 scores it
    runs["source"] |= humaneval(source, output / "humaneval" / "source", eval_options)
    return {"tokens": steps * tokens_per_step, "steps": steps, "config": common, "runs": runs}


# --------------------------------------------------------------------------------------------------------------------
# Tables and plots
# --------------------------------------------------------------------------------------------------------------------


def save_partial(path: Path, runs: Any) -> None:
    """The runs so far, should the benchmark be stopped before it writes results.json."""
    path.write_text(json.dumps(runs, indent=1) + "\n")


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def scratch_rows(study: dict) -> list[dict]:
    """Per variant: final held-out losses per seed, and differences to the PreNorm run of the same seed."""
    finals = {v: {r["seed"]: r["final"] for r in study["runs"] if r["variant"] == v} for v in SCRATCH_VARIANTS}
    rows = []
    for variant, label in SCRATCH_VARIANTS.items():
        seeds = sorted(finals[variant])
        deltas = [finals[variant][s] - finals["prenorm"][s] for s in seeds]
        seconds = [r["seconds"] for r in study["runs"] if r["variant"] == variant]
        rows.append(
            {
                "variant": label,
                "seeds": len(seeds),
                "losses": [finals[variant][s] for s in seeds],
                "deltas": deltas,
                "wins": sum(d < 0 for d in deltas),
                "seconds": statistics.mean(seconds),
            }
        )
    return rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def scratch_table(study: dict) -> str:
    rows = [
        [
            row["variant"],
            str(row["seeds"]),
            f"{study['tokens']:,}",
            spread(row["losses"]),
            f"{min(row['losses']):.4f} – {max(row['losses']):.4f}",
            "–" if row["variant"] == SCRATCH_VARIANTS["prenorm"] else spread(row["deltas"]),
            "–" if row["variant"] == SCRATCH_VARIANTS["prenorm"] else f"{row['wins']}/{row['seeds']}",
            f"{row['seconds']:.0f}",
        ]
        for row in scratch_rows(study)
    ]
    header = [
        "variant", "seeds", "tokens", "final held-out loss (mean ± sd)", "range",
        "Δ vs PreNorm, same seed (mean ± sd)", "seeds below PreNorm", "wall s per run",
    ]  # fmt: skip
    return markdown_table(header, rows)


def cpt_table(study: dict, names: list[str]) -> str:
    runs, plain = study["runs"], study["runs"].get("plain")
    rows = []
    for name in [name for name in names if name in runs]:
        run = runs[name]
        humaneval = run.get("humaneval_pass_at_1")
        rows.append(
            [
                run["label"],
                "0" if name == "source" else f"{study['tokens']:,}",
                f"{run['final']:.4f}",
                "–" if name == "source" or plain is None else f"{run['final'] - plain['final']:+.4f}",
                f"{run['unseen_loss']:.4f}",
                "–" if humaneval is None else f"{humaneval:.3f}",
                "–" if name == "source" else f"{run['seconds']:.0f}",
            ]
        )
    header = [
        "variant", "training tokens", "held-out loss, docs", "Δ vs plain CPT", "held-out loss, stdlib code (unseen)",
        "HumanEval pass@1", "wall s",
    ]  # fmt: skip
    return markdown_table(header, rows)


def plot_scratch(study: dict, path: Path) -> None:
    figure = Figure(figsize=(8, 4.5))
    axes = figure.subplots()
    for index, (variant, label) in enumerate(SCRATCH_VARIANTS.items()):
        curves = [r["curve"] for r in study["runs"] if r["variant"] == variant]
        tokens = [t for t, _ in curves[0]]
        losses = list(zip(*[[loss for _, loss in curve] for curve in curves], strict=True))
        axes.plot(tokens, [statistics.mean(x) for x in losses], "o-", color=f"C{index}", label=label, markersize=3)
        axes.fill_between(tokens, [min(x) for x in losses], [max(x) for x in losses], color=f"C{index}", alpha=0.2)
    axes.set_xlabel("training tokens (bytes)")
    axes.set_ylabel("held-out loss (nats/byte)")
    axes.set_title(f"From scratch: mean over seeds, band = min to max ({len(curves)} seeds)")
    tail = [loss for r in study["runs"] for _, loss in r["curve"][len(r["curve"]) // 2 :]]
    axes.set_ylim(min(tail) - 0.05, max(tail) + 0.1)  # the interesting part: where the variants separate
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_cpt(study: dict, names: list[str], path: Path) -> None:
    """Held-out loss at each evaluation (left) and training loss at every step (right; the same batches for all)."""
    figure = Figure(figsize=(12, 4.5))
    held_out_axes, training_axes = figure.subplots(1, 2)
    for index, name in enumerate(name for name in names if name in study["runs"]):
        run = study["runs"][name]
        held_out_axes.plot(*zip(*run["curve"], strict=True), "o-", color=f"C{index}", label=run["label"])
        training_axes.plot(*zip(*run["training_curve"], strict=True), ".-", color=f"C{index}", label=run["label"])
    held_out_axes.set_ylabel("held-out loss on the docs (nats/token)")
    training_axes.set_ylabel("training loss (nats/token)")
    for axes in (held_out_axes, training_axes):
        axes.set_xlabel("training tokens")
    held_out_axes.legend(fontsize=7)
    figure.suptitle("Continued pretraining of SmolLM2-135M-Instruct at equal tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_summary(output: Path, results: dict) -> None:
    parts = [f"# AttnRes quality benchmark\n\n`{results['command']}`\n"]
    if "scratch" in results:
        study = results["scratch"]
        plot_scratch(study, output / "scratch_loss_curves.png")
        parts += [
            f"## From scratch ({study['steps']} steps, {study['tokens']:,} byte tokens per run)\n",
            scratch_table(study),
            "\n![loss curves](scratch_loss_curves.png)\n",
        ]
    if "cpt" in results:
        study = results["cpt"]
        plot_cpt(study, list(CPT_VARIANTS), output / "cpt_loss_curves.png")
        plot_cpt(study, ["plain", "converted", *RECIPES], output / "recipe_loss_curves.png")
        parts += [
            f"## Continued pretraining ({study['steps']} steps, {study['tokens']:,} tokens per variant)\n",
            cpt_table(study, ["source", *CPT_VARIANTS]),
            "\n![loss curves](cpt_loss_curves.png)\n",
            "### Recipes for the converted model\n",
            cpt_table(study, ["plain", "converted", *RECIPES]),
            "\n![loss curves](recipe_loss_curves.png)\n",
        ]
    (output / "summary.md").write_text("\n".join(parts))


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="a new (or empty) folder for the runs and results")
    parser.add_argument("--studies", default="scratch,cpt", help="comma-separated: scratch, cpt (default: both)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the from-scratch study (default: 3)")
    parser.add_argument("--tokens", type=int, help="training tokens per continued-pretraining variant")
    parser.add_argument("--scratch-tokens", type=int, help="training tokens (bytes) per from-scratch run")
    parser.add_argument("--humaneval-problems", type=int, help="HumanEval problems, the first N of 164")
    parser.add_argument("--max-gen-toks", type=int, help="tokens each HumanEval answer may generate")
    parser.add_argument(
        "--variants",
        default=",".join([*CPT_VARIANTS, *RECIPES]),
        help="comma-separated continued-pretraining variants and recipes to run (default: all)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of Scale or of the from-scratch model shape, e.g. --set hidden_size=128",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="(default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="(default: float32)")
    parser.add_argument("--corpus", help="a folder of .txt documents to train on (default: the python3-doc sources)")
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="the model to continue pretraining (default: SmolLM2)")
    parser.add_argument("--smoke", action="store_true", help="tiny models and generated text: checks that all runs")
    return parser.parse_args(argv)


def scale_for(args: argparse.Namespace) -> Scale:
    scale = SMOKE_SCALE if args.smoke else DEFAULT_SCALE
    overrides = {
        "cpt_tokens": args.tokens,
        "scratch_tokens": args.scratch_tokens,
        "humaneval_problems": args.humaneval_problems,
        "max_gen_toks": args.max_gen_toks,
    }
    scale = dataclasses.replace(scale, **{k: v for k, v in overrides.items() if v is not None})
    fields = {spec.name: spec.type for spec in dataclasses.fields(Scale)}
    numbers = [name for name, kind in fields.items() if kind in (int, float)]
    for setting in args.set:
        name, _, value = setting.partition("=")
        if name in scale.scratch_shape:  # the from-scratch model's shape: hidden_size, num_hidden_layers, ...
            scale = dataclasses.replace(scale, scratch_shape=scale.scratch_shape | {name: int(value)})
        elif name in numbers:
            scale = dataclasses.replace(scale, **{name: fields[name](float(value))})
        else:
            raise QualityError(
                f"--set {setting}: expected FIELD=NUMBER, FIELD one of {', '.join(numbers + list(scale.scratch_shape))}"
            )
    return scale


def smoke_source(folder: Path) -> str:
    """A tiny random Llama with the byte tokenizer, standing in for SmolLM2 in `--smoke`."""
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(SMOKE_SCALE.scratch_shape, tokenizer, 512)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    studies = {study.strip() for study in args.studies.split(",")}
    if not studies <= {"scratch", "cpt"}:
        raise QualityError(f"--studies: expected scratch and/or cpt, got {args.studies}")
    if args.output.exists() and any(args.output.iterdir()):
        raise QualityError(f"{args.output} is not empty: choose a new --output")
    variants = [variant.strip() for variant in args.variants.split(",") if variant.strip()]
    unknown = set(variants) - {*CPT_VARIANTS, *RECIPES}
    if unknown or not variants:
        raise QualityError(f"--variants {args.variants}: expected some of {', '.join([*CPT_VARIANTS, *RECIPES])}")
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "1"  # Accelerate would take a GPU if there is one
    elif not torch.cuda.is_available():
        raise QualityError("--device cuda: no CUDA device is visible to PyTorch")
    scale = scale_for(args)
    output = args.output
    output.mkdir(parents=True, exist_ok=True)
    corpus = smoke_corpus(output / "corpus") if args.smoke else docs_corpus(args.corpus)
    source = smoke_source(output / "smoke-source") if args.smoke else args.source
    mixed_precision = {"float32": "no", "bfloat16": "bf16"}[args.dtype]
    training = {"mixed_precision": mixed_precision, "log_every": 1, "save_every": 10**9}  # no checkpoints
    eval_options = {
        "limit": scale.humaneval_problems,
        "batch_size": scale.humaneval_problems,
        "max_gen_toks": scale.max_gen_toks,
        "offline": True,
        "allow_code_execution": True,
        "dtype": args.dtype,
        "device": args.device,
    }
    results: dict[str, Any] = {
        "command": " ".join(["python benchmarks/quality.py", *(argv if argv is not None else sys.argv[1:])]),
        "corpus": str(corpus),
        "scale": dataclasses.asdict(scale),
        "torch_threads": torch.get_num_threads(),
    }
    start = time.perf_counter()
    if "scratch" in studies:
        results["scratch"] = scratch_study(output, scale, corpus, args.seeds, training)
        write_results(output, results, start)
    if "cpt" in studies:
        results["cpt"] = cpt_study(output, scale, corpus, source, variants, training, eval_options)
        write_results(output, results, start)
    print(f"Results: {output / 'results.json'}, {output / 'summary.md'} ({results['seconds']:.0f} s)")
    return 0


def write_results(output: Path, results: dict, start: float) -> None:
    results["seconds"] = time.perf_counter() - start
    (output / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_summary(output, results)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except QualityError as error:
        print(f"quality.py: error: {error}", file=sys.stderr)
        sys.exit(1)
