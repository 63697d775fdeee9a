"""`attnres compare`: which depth-mixing rule helps this model on this data, by how much, and at what cost.

    attnres compare SOURCE --data DATA --rules prenorm,block,full --seeds 3 --tokens 2000000 --output-dir DIR

A study is a set of arms (`CompareConfig.arms`: a rule, the rule with only its own parameters or LoRA trained, or
the source as it is), each trained at every seed as an `attnres train` run (`--convert --mode RULE --seed S`, with
`--train` for the regime). Each seed splits the documents three ways (`attnres.splits`): training, a validation split
scored along every run (the split every choice is made on: `--lr-grid` picks each arm's rate there, at seed 0), and a
test split that shares little text with training, scored once, when an arm ends. Within a seed every arm starts from
the same weights where they share them (the checkpoint's, or with `--from-scratch` the seed's random initialisation
of the source's architecture) and sees the same batches in the same order, so each seed pairs the arms, and every
comparison is the paired difference of test losses against the baseline arm: its mean, 95% t-interval and p-value,
and the p-value adjusted by Holm's method over all the comparisons of the study.

Everything lands in DIR: `study.json` (the settings, and the data's content hash) and `study.yaml` (the settings as a
study file), `data/seedS/` (the splits), `runs/ARM-seedS-lrR/` (each run's folder, checkpointed at every evaluation)
with `runs/ARM-seedS-lrR.json` (its record once it has finished), `grid/` (the runs of a `--grid-tokens` grid),
`cost.json`, `mixing.json`, `results.json`, `report.md` and the figures. Running the same command again trains only
what is missing: a stopped run resumes from its last checkpoint. Several workers (processes started with the same
command, on one machine or on several that share DIR) share the runs: each claims a run with a lock file (`flock`)
while it trains it. Under a launcher (`accelerate launch`) every process of the launch trains each run together.
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import statistics
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import __version__
from .data import check_utf8_text
from .errors import AttnResInputError, DataError, OptionError
from .folders import check_output_dir, lock_held, read_metrics, remove, written_whole
from .options import ANALYSIS_TOKENS, Arm, CompareConfig, TrainingConfig
from .splits import DocumentSplit, HoldOut, split_documents, write_split

logger = logging.getLogger(__name__)

STUDY_FILE, STUDY_YAML, RESULTS_FILE, REPORT_FILE = "study.json", "study.yaml", "results.json", "report.md"
CURVES_FILE, GAP_FILE, COST_FILE, MIXING_FILE = "curves.png", "gap.png", "cost.json", "mixing.json"
# Without --longest-held-out-document: a document longer than this share of a held-out split could make up most of it
LONGEST_HELD_OUT_SHARE = 0.5
# A .txt file given as DATA holds its documents separated by blank lines
BLANK_LINES = re.compile(r"\n\s*\n")
# --lr-grid: a best rate at an edge of the grid extends it by this factor beyond that edge, at most this many times
GRID_FACTOR, GRID_EXTENSIONS = 2, 2
# A worker whose next runs are all held by other workers looks again after this long
WAIT_SECONDS = 10
# Steps timed before the interleaved pairs of the cost (the first call builds the optimizer's state)
COST_WARMUP = 2


# --------------------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------------------


def paired_interval(differences: list[float]) -> tuple[float, float, float, float]:
    """(mean, 95% low, 95% high, two-sided p) of paired differences, by Student's t; NaN where n < 2."""
    from scipy import stats

    n, mean = len(differences), statistics.mean(differences)
    if n < 2:
        return mean, math.nan, math.nan, math.nan
    sd = statistics.stdev(differences)
    if sd == 0:
        return mean, mean, mean, 0.0 if mean else 1.0
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    p = 2 * stats.t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1)
    return mean, mean - half, mean + half, float(p)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of `p_values` (one family of comparisons), in their order: the k-th smallest is
    multiplied by (m - k + 1), and no adjusted value is below a smaller p's."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [math.nan] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def comparisons(runs: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Each arm against `baseline`, paired by seed on test loss: mean, 95% interval, p, and Holm's p over every
    comparison with at least 2 pairs; with `validation_gap`, the same paired difference of validation losses at each
    evaluation along training: [[tokens, mean, low, high], ...]."""
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], {})[run["seed"]] = run
    made = []
    for arm, seeds_run in by_arm.items():
        if arm == baseline:
            continue
        seeds = sorted(seed for seed in seeds_run if seed in by_arm.get(baseline, {}))
        if not seeds:
            continue
        pairs = [(seeds_run[seed], by_arm[baseline][seed]) for seed in seeds]
        mean, low, high, p = paired_interval([run["test_loss"] - base["test_loss"] for run, base in pairs])
        gap = []
        for index, (tokens, _) in enumerate(pairs[0][1]["curve"]):
            gap_mean, gap_low, gap_high, _ = paired_interval(
                [run["curve"][index][1] - base["curve"][index][1] for run, base in pairs]
            )
            gap.append([tokens, gap_mean, gap_low, gap_high])
        made.append(
            {"arm": arm, "baseline": baseline, "pairs": len(seeds), "mean": mean, "ci95": [low, high], "p": p,
             "validation_gap": gap}
        )  # fmt: skip
    tested = [comparison for comparison in made if comparison["pairs"] > 1]
    for comparison, adjusted in zip(tested, holm([c["p"] for c in tested]), strict=True):
        comparison["p_holm"] = adjusted
    for comparison in made:
        comparison.setdefault("p_holm", math.nan)
    return made


# --------------------------------------------------------------------------------------------------------------------
# The data
# --------------------------------------------------------------------------------------------------------------------


def load_corpus(data: str, text_field: str) -> dict[str, bytes]:
    """The documents of DATA by name: a folder's files (one document each), a .jsonl file's records, a .txt file's
    blank-line-separated parts, or a `datasets` id's training split."""
    path = Path(data).expanduser()
    if path.is_dir():
        files = sorted(file for file in path.rglob("*") if file.is_file() and not file.name.startswith("."))
        for file in files:
            check_utf8_text(file)
        return {file.relative_to(path).as_posix(): file.read_bytes() for file in files}
    if path.suffix == ".jsonl" and path.is_file():
        documents = {}
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise DataError(f"{path}, line {number}: no text field {text_field!r}; name it with --text-field")
                documents[f"{number:08d}"] = record[text_field].encode()
        return documents
    if path.suffix == ".txt" and path.is_file():
        check_utf8_text(path)
        parts = [part for part in BLANK_LINES.split(path.read_text(encoding="utf-8")) if part.strip()]
        return {f"{index:08d}": part.encode() for index, part in enumerate(parts)}
    if path.exists():
        raise DataError(f"--data {data}: expected a folder of text files, a .jsonl file, a .txt file or a datasets id")
    from datasets import load_dataset

    try:
        dataset = load_dataset(data, split="train")
    except (OSError, ValueError) as error:
        raise DataError(f"--data {data}: not a folder or file here, and no datasets id that loads ({error})") from error
    if text_field not in dataset.column_names:
        raise DataError(f"--data {data} has no column {text_field!r} ({', '.join(dataset.column_names)}): --text-field")
    return {f"{index:08d}": text.encode() for index, text in enumerate(dataset[text_field])}


def content_hash(documents: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(documents):
        digest.update(name.encode() + b"\0" + hashlib.sha256(documents[name]).digest())
    return digest.hexdigest()


def hold_out_of(config: CompareConfig) -> HoldOut:
    longest = config.longest_held_out_document or max(1, int(LONGEST_HELD_OUT_SHARE * config.held_out_bytes))
    return HoldOut(
        documents=config.held_out_documents,
        bytes=config.held_out_bytes,
        document_bytes=(config.shortest_held_out_document, longest),
        max_shared=config.max_shared,
    )


def write_seed_split(documents: dict[str, bytes], split: DocumentSplit, folder: Path) -> Path:
    """`split` as `train/`, `validation/`, `test/` under `folder`, with `split.json` (what each holds, and how much of
    the held-out text occurs in training)."""
    with written_whole(folder) as staging:
        write_split(documents, split, staging)
        record = {
            name: {"documents": len(names), "bytes": sum(len(documents[n]) for n in names)}
            for name, names in split.splits().items()
        }
        record |= {"shared_with_train": split.shared_with_train, "too_shared": split.too_shared}
        (staging / "split.json").write_text(json.dumps(record, indent=1) + "\n")
    return folder


def split_folder(study: Path, seed: int) -> Path:
    return study / "data" / f"seed{seed}"


# --------------------------------------------------------------------------------------------------------------------
# The processes: one, or those of a launcher
# --------------------------------------------------------------------------------------------------------------------


class Processes:
    """The processes that run this study's command: this one alone, or every process a launcher started
    (`accelerate launch`, `torchrun`), which train each run together, one run after another. The main process writes
    what the study shares and decides for all which run they train next."""

    def __init__(self, study: Path):
        self.count = int(os.environ.get("WORLD_SIZE", "1"))
        self.accelerator = None
        if self.count > 1:
            from .training.engine import make_accelerator

            # The Accelerator each run makes: it joins the launch's processes (gloo on CPUs), as `attnres train` does
            self.accelerator = make_accelerator(TrainingConfig(output_dir=str(study)))
        self.is_main = self.accelerator is None or self.accelerator.is_main_process

    def wait(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def close(self) -> None:
        """End the launch's process group once the study is done (the runs keep it up for the next)."""
        if self.accelerator is not None:
            self.accelerator.end_training()

    def agree(self, value: Any) -> Any:
        """The main process's `value`, on every process."""
        if self.accelerator is None:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    def on_main(self, work: typing.Callable[[], Any]) -> None:
        """Run `work` on the main process while the others wait; a user's mistake found there is raised on all."""
        if self.accelerator is None:
            work()
            return
        error = None
        if self.is_main:
            try:
                work()
            except AttnResInputError as raised:
                error = raised
        error = self.agree(error)
        if error is not None:
            raise error


# --------------------------------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmRun:
    """One training run of a study: an arm at a seed and a rate, for `steps` optimizer steps, in `place` (`runs`,
    the study's budget, or `grid`, the --grid-tokens budget of the rate grid)."""

    arm: Arm
    seed: int
    lr: float
    steps: int
    place: str

    @property
    def name(self) -> str:
        return f"{self.arm.folder}-seed{self.seed}-lr{self.lr:g}"

    def folder(self, study: Path) -> Path:
        return study / self.place / self.name

    def record_path(self, study: Path) -> Path:
        return study / self.place / f"{self.name}.json"

    def claim_path(self, study: Path) -> Path:
        """The lock file of the worker that trains it (beside `attnres train`'s own `.NAME.lock`, which refuses a
        second run in one folder, where this one lets the other workers pass it by)."""
        return study / self.place / f".{self.name}.claim"


def tokens_per_step(config: CompareConfig) -> int:
    return config.seq_len * config.batch_size


def training_config(config: CompareConfig, run: ArmRun, study: Path, processes: int) -> TrainingConfig:
    """The run's `attnres train` options: every rate stated by the study, none inherited."""
    evaluations = config.grid_evaluations if run.place == "grid" and config.grid_evaluations else config.evaluations
    eval_every = max(1, run.steps // evaluations)
    folder, arm = run.folder(study), run.arm
    # An arm that trains only the rule's parameters trains them at its rate: what the grid chooses
    attnres_lr = run.lr if config.attnres_lr is None or arm.regime == "attnres" else config.attnres_lr
    return TrainingConfig(
        output_dir=str(folder),
        model=config.source,
        trust_remote_code=config.trust_remote_code,
        convert=arm.rule is not None,
        mode=arm.rule or "block",
        from_scratch=config.from_scratch,
        layers=config.layers,
        hidden_size=config.hidden_size,
        dataset=str(split_folder(study, run.seed)),
        eval_split="validation",
        seed=run.seed,
        lr=run.lr,
        attnres_lr=attnres_lr,
        train=arm.regime,
        merge_lora=arm.regime == "lora",  # a whole model, which the test split and the analysis load
        max_steps=run.steps,
        seq_len=config.seq_len,
        batch_size=config.batch_size // processes,
        max_eval_sequences=config.eval_sequences,
        eval_every=eval_every,
        save_every=eval_every,
        save_total_limit=1,
        log_every=1,  # every step's CPU time, for the cost
        resume=folder.exists(),
    )


def read_record(study: Path, run: ArmRun) -> dict[str, Any] | None:
    path = run.record_path(study)
    return json.loads(path.read_text()) if path.is_file() else None


def is_done(study: Path, run: ArmRun, scored: bool) -> bool:
    """Whether `run` is trained and recorded, and (`scored`) its test split scored."""
    record = read_record(study, run)
    return record is not None and (not scored or "test_loss" in record)


def write_record(study: Path, run: ArmRun, record: dict[str, Any]) -> None:
    with written_whole(run.record_path(study)) as staging:
        staging.write_text(json.dumps(record, indent=1) + "\n")


@torch.no_grad()
def held_out_loss(model, sequences, batch_size: int, name: str) -> float:
    """Mean next-token loss over equal-length sequences (each batch weighted by its size), as training scores it."""
    model.eval()
    total, count = 0.0, 0
    for batch in tqdm(DataLoader(sequences.with_format("torch"), batch_size=batch_size), desc=f"Held-out, {name}"):
        input_ids = batch["input_ids"].to(model.device)
        total += model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item() * len(input_ids)
        count += len(input_ids)
    return total / count


def device_here() -> torch.device:
    """Where the main process scores and measures: the accelerator it has, else the CPU."""
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


def trained_model(folder: Path):
    """The model a finished run exported, in float32, on `device_here()`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device_here())


def test_loss(folder: Path, options: TrainingConfig) -> float:
    """The trained run's mean next-token loss over every sequence its test split packs into."""
    from .sources import load_source_tokenizer
    from .training import build_datasets

    tokenizer = load_source_tokenizer(str(folder))
    test_options = dataclasses.replace(options, eval_split="test", max_eval_sequences=10**9, resume=False)
    sequences = build_datasets(test_options, tokenizer, num_processes=1)[1]
    return held_out_loss(trained_model(folder), sequences, options.batch_size, "test")


def train_and_record(config: CompareConfig, study: Path, run: ArmRun, scored: bool, processes: Processes) -> None:
    """Train `run` (resuming it where it stopped) and record it; with `scored`, score its test split once. Raises
    KeyboardInterrupt where a signal stopped it (its checkpoint is saved)."""
    from .training import train

    options = processes.agree(training_config(config, run, study, processes.count))  # one `resume` for all
    if processes.agree(read_record(study, run) is None):
        result = train(options, keep_process_group=processes.count > 1)
        if result.interrupted:
            raise KeyboardInterrupt(f"stopped in {run.name} with a checkpoint saved")
        if processes.is_main:
            metrics = read_metrics(run.folder(study))
            cpu_seconds = [record["cpu_seconds_per_step"] for record in metrics if "cpu_seconds_per_step" in record]
            curve = [[r["step"] * tokens_per_step(config), r["eval_loss"]] for r in metrics if "eval_loss" in r]
            record = {
                "arm": run.arm.name,
                "rule": run.arm.rule,
                "train": run.arm.regime,
                "seed": run.seed,
                "lr": options.lr,
                "attnres_lr": options.attnres_lr,
                "tokens": run.steps * tokens_per_step(config),
                "validation_loss": curve[-1][1],
                "curve": curve,
                "cpu_seconds_per_step": statistics.median(cpu_seconds) if cpu_seconds else None,
            }
            write_record(study, run, record)
    if scored and processes.is_main and "test_loss" not in (record := read_record(study, run)):
        write_record(study, run, record | {"test_loss": test_loss(run.folder(study), options)})
    processes.wait()


# --------------------------------------------------------------------------------------------------------------------
# The plan: each arm's rate (its grid), then its seeds
# --------------------------------------------------------------------------------------------------------------------


def study_steps(config: CompareConfig) -> int:
    return config.tokens // tokens_per_step(config)


def grid_steps(config: CompareConfig) -> int:
    return (config.grid_tokens or config.tokens) // tokens_per_step(config)


def grid_of(config: CompareConfig, study: Path, arm: Arm) -> tuple[list[ArmRun], float | None]:
    """The arm's runs of --lr-grid so far (seed 0, validation only) and the rate chosen: the lowest final validation
    loss, once every rate has a run and the best lies inside the grid (a best rate at an edge extends the grid beyond
    it, `GRID_EXTENSIONS` times at most); None until then."""
    rates, steps = config.grid(), grid_steps(config)
    place = "runs" if steps == study_steps(config) else "grid"  # a full-budget grid run is the seed-0 arm's run
    while True:
        runs = [ArmRun(arm, 0, rate, steps, place) for rate in rates]
        records = [read_record(study, run) for run in runs]
        if any(record is None for record in records):
            return runs, None
        losses = [record["validation_loss"] for record in records]
        best = losses.index(min(losses))
        if len(rates) >= len(config.grid()) + GRID_EXTENSIONS or 0 < best < len(rates) - 1:
            return runs, rates[best]
        rates = [rates[0] / GRID_FACTOR, *rates] if best == 0 else [*rates, rates[-1] * GRID_FACTOR]


def plan(config: CompareConfig, study: Path) -> list[tuple[ArmRun, bool]]:
    """Every run the study needs so far, with whether its test split is scored, in the order they are worked
    through: the rate grids, then the seeds, seed by seed. An arm whose rate is not chosen yet has no seed runs yet."""
    planned: dict[ArmRun, bool] = {}
    rates = {}
    for arm in config.arms():
        if config.grid():
            grid, rates[arm] = grid_of(config, study, arm)
            planned |= dict.fromkeys(grid, False)
        else:
            rates[arm] = config.lr
    for seed in range(config.seeds):
        for arm, rate in rates.items():
            if rate is not None:
                planned[ArmRun(arm, seed, rate, study_steps(config), "runs")] = True
    return list(planned.items())


@contextmanager
def claimed(study: Path, run: ArmRun, processes: Processes) -> Iterator[bool]:
    """Claim `run` for this worker -> whether it is ours (False: another worker's live process trains it)."""
    with lock_held(run.claim_path(study)) if processes.is_main else nullcontext(None) as owner:
        yield processes.agree(owner is None)


def work_through(
    config: CompareConfig,
    study: Path,
    processes: Processes,
    only: typing.Callable[[ArmRun], bool] | None = None,
    recorded: typing.Callable[[ArmRun], None] | None = None,
) -> None:
    """Train every run of the plan that no other worker holds, re-planning after each (a finished grid adds its arm's
    seeds); wait while the runs left are held by others, until every run is done. A caller that drives the study
    from Python (a preset) may pass `only`, the runs it wants (the others are left out of this call), and
    `recorded`, called on the main process with each run this worker has trained and recorded."""
    bar = tqdm(desc="Runs of the study", unit="run", disable=not processes.is_main)
    while True:
        # The main process's view, on every process: another worker may finish a run while they look
        planned = processes.agree([(run, scored) for run, scored in plan(config, study) if only is None or only(run)])
        pending = processes.agree([(run, scored) for run, scored in planned if not is_done(study, run, scored)])
        bar.total, bar.n = len(planned), len(planned) - len(pending)
        bar.refresh()
        if not pending:
            break
        for run, scored in pending:
            with claimed(study, run, processes) as ours:
                if ours:
                    train_and_record(config, study, run, scored, processes)
                    if recorded is not None and processes.is_main:
                        recorded(run)
                    break
        else:
            held = ", ".join(run.name for run, _ in pending)
            logger.info(f"Waiting {WAIT_SECONDS} s for the runs other workers hold: {held}")
            time.sleep(WAIT_SECONDS)
    bar.close()


# --------------------------------------------------------------------------------------------------------------------
# The study folder
# --------------------------------------------------------------------------------------------------------------------


def study_settings(config: CompareConfig, documents: dict[str, bytes]) -> dict[str, Any]:
    """What makes a study this study: every setting but --overwrite, and the data's content."""
    settings = {name: value for name, value in dataclasses.asdict(config).items() if name != "overwrite"}
    return settings | {"data_sha256": content_hash(documents), "documents": len(documents)}


def check_study_folder(config: CompareConfig, study: Path, settings: dict[str, Any]) -> bool:
    """Refuse, before anything is written, a folder that holds something else, or a study with other settings
    unless --overwrite -> whether the folder holds a study that --overwrite replaces."""
    if not study.is_dir() or not any(study.iterdir()):
        return False
    saved = study / STUDY_FILE
    if not saved.is_file():
        raise OptionError(f"{study} exists and holds no study ({STUDY_FILE}); choose a new --output-dir")
    before = json.loads(saved.read_text())
    changed = sorted(name for name in settings.keys() | before.keys() if settings.get(name) != before.get(name))
    if changed and not config.overwrite:
        raise OptionError(
            f"{study} holds a study with other settings ({', '.join(changed)}); rerun it with its own settings to "
            "finish it, choose a new --output-dir, or pass --overwrite to start afresh"
        )
    return bool(changed)


@contextmanager
def waiting_for(lock: Path) -> Iterator[None]:
    """Hold the lock file `lock`, waiting while another worker holds it."""
    while True:
        with lock_held(lock) as owner:
            if owner is None:
                yield
                return
        time.sleep(1)


def claim_owner(claim: Path) -> int | None:
    """The process id of the live worker that holds the claim file `claim`, None if none does (the file is left as
    it was, or removed where a killed worker left it)."""
    if not claim.exists():
        return None
    with lock_held(claim) as owner:
        return owner


def check_no_worker(study: Path) -> None:
    """Refuse to replace a study while a worker trains one of its runs."""
    for claim in sorted(study.glob("*/.*.claim")):
        if (owner := claim_owner(claim)) is not None:
            raise OptionError(
                f"{study}: another worker (pid {owner}) is training {claim.name[1:-6]}; stop it before --overwrite"
            )


def prepare(config: CompareConfig, study: Path) -> None:
    """Check the study folder and write what the runs read: the settings and each seed's split. Several workers
    starting together take turns here; the first writes, the others find its study."""
    check_output_dir(study, OptionError, {"the model": config.source, "the data": config.data}, None)
    architecture(config)  # a shrink the source cannot take is refused before anything is written
    documents = load_corpus(config.data, config.text_field)
    settings = study_settings(config, documents)
    study_lock = study.resolve().with_name(f".{study.resolve().name}.setup.lock")  # beside it: nothing inside yet
    with waiting_for(study_lock):
        replaced = check_study_folder(config, study, settings)
        # Split before anything is written: a corpus too small for the held-out splits is refused with nothing changed
        planned = {
            seed: split_documents(documents, seed, hold_out_of(config))
            for seed in range(config.seeds)
            if replaced or not (split_folder(study, seed) / "split.json").is_file()
        }
        if replaced:
            check_no_worker(study)
            for entry in study.iterdir():
                remove(entry)
        study.mkdir(parents=True, exist_ok=True)
        if not (study / STUDY_FILE).is_file():
            write_settings(config, settings, study)
        for seed, split in planned.items():
            write_seed_split(documents, split, split_folder(study, seed))


def write_settings(config: CompareConfig, settings: dict[str, Any], study: Path) -> None:
    """`study.json` (what `--status` and a rerun check against) and `study.yaml`, the same settings as a study file
    that `--config` reads."""
    import yaml

    with written_whole(study / STUDY_FILE) as staging:
        staging.write_text(json.dumps(settings, indent=1) + "\n")
    options = {name: value for name, value in dataclasses.asdict(config).items() if name != "overwrite"}
    with written_whole(study / STUDY_YAML) as staging:
        staging.write_text(
            f"# attnres compare --config {study / STUDY_YAML}\n" + yaml.safe_dump(options, sort_keys=False)
        )


def compare(config: CompareConfig | None = None, **options) -> dict[str, Any]:
    """Run the study `config` (or `CompareConfig` fields as keywords) describes, or what is missing of it, sharing
    its runs with the other workers on the same folder -> its results (`results.json`): `runs`, `comparisons`,
    `lr_grid`, `cost`, `mixing_matrices` and `splits`. Raises KeyboardInterrupt where a signal stopped a run (its
    checkpoint is saved: the same call resumes it)."""
    config = dataclasses.replace(config, **options) if config is not None else CompareConfig(**options)
    study = Path(config.output_dir)
    processes = Processes(study)
    if config.batch_size % processes.count:
        raise OptionError(
            f"--batch-size {config.batch_size} sequences per step do not divide among {processes.count} processes: "
            f"pass a multiple of {processes.count}"
        )
    processes.on_main(lambda: prepare(config, study))
    work_through(config, study, processes)
    processes.on_main(lambda: write_results(config, study))
    processes.close()
    return json.loads((study / RESULTS_FILE).read_text())


# --------------------------------------------------------------------------------------------------------------------
# The results: comparisons, grids, cost, depth-mixing matrices
# --------------------------------------------------------------------------------------------------------------------


def write_results(config: CompareConfig, study: Path) -> dict[str, Any]:
    """`results.json`, `report.md` and the figures, from the records of the finished study (the cost and the
    depth-mixing matrices measured once, and kept in `cost.json` and `mixing.json`)."""
    with waiting_for(study / ".results.lock"):  # one worker at a time writes them
        return results_written(config, study)


def results_written(config: CompareConfig, study: Path) -> dict[str, Any]:
    planned = plan(config, study)
    runs = [read_record(study, run) for run, scored in planned if scored]
    results: dict[str, Any] = {
        "runs": runs,
        "comparisons": comparisons(runs, config.baseline),
        "attnres_version": __version__,
        "architecture": architecture(config),
    }
    if config.grid():
        results["lr_grid"] = {}
        for arm in config.arms():
            grid, chosen = grid_of(config, study, arm)
            tried = [[run.lr, read_record(study, run)["validation_loss"]] for run in grid]
            results["lr_grid"][arm.name] = {"tokens": grid_steps(config) * tokens_per_step(config), "tried": tried,
                                            "chosen": chosen}  # fmt: skip
    results["cost"] = measured_once(study / COST_FILE, lambda: measure_cost(config, study))
    results["mixing_matrices"] = measured_once(study / MIXING_FILE, lambda: seed_zero_mixing(config, study, planned))
    results["splits"] = {
        seed: json.loads((split_folder(study, seed) / "split.json").read_text()) for seed in range(config.seeds)
    }
    with written_whole(study / RESULTS_FILE) as staging:
        staging.write_text(json.dumps(results, indent=1) + "\n")
    write_report(config, results, study)
    return results


def architecture(config: CompareConfig) -> dict[str, int]:
    """The shape the arms share: the source's architecture, shrunk as --layers and --hidden-size ask (as `attnres
    train` shrinks it) -> its layers, hidden size and parameters (the source family's own: each rule adds its few)."""
    from .shrink import parameter_count, shrunk_config
    from .sources import load_source_config, resolve_source

    path, gguf_file = resolve_source(config.source, None)
    source_config = load_source_config(path, gguf_file, config.trust_remote_code)
    shape = shrunk_config(source_config, config.layers, config.hidden_size)
    return {"layers": shape.num_hidden_layers, "hidden_size": shape.hidden_size,
            "parameters": parameter_count(shape, config.trust_remote_code)}  # fmt: skip


def measured_once(path: Path, measure: typing.Callable[[], Any]) -> Any:
    """What `path` holds, measured and written there the first time (a rerun repeats no measurement)."""
    if not path.is_file():
        with written_whole(path) as staging:
            staging.write_text(json.dumps(measure(), indent=1) + "\n")
    return json.loads(path.read_text())


def measure_cost(config: CompareConfig, study: Path) -> dict[str, Any]:
    """Each arm's training step against the baseline's, on this machine's device: the initial models of seed 0, one
    batch of the study's shape, `--cost-pairs` interleaved pairs after warm-up (`attnres.cost`) -> by arm, the
    median seconds of each and of their ratio, and the memory of a step of each and their ratio (the peak on a CUDA
    device, else the bytes a step holds: `attnres.cost.step_memory`)."""
    from .cost import interleaved_ratio, step_memory, training_step
    from .training.recipe import load_model, make_trainable

    if config.cost_pairs == 0:
        return {}
    device = device_here()

    def initial_model(arm: Arm) -> torch.nn.Module:
        options = training_config(config, ArmRun(arm, 0, config.lr, 1, "runs"), study, 1)
        torch.manual_seed(0)
        return make_trainable(load_model(options), options).to(device).train()

    baseline = initial_model(Arm.parse(config.baseline))
    vocab = baseline.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (config.batch_size, config.seq_len), generator=generator).to(device)
    baseline_step = training_step(baseline, ids, "eager")
    cost = {}
    for arm in tqdm(config.arms(), desc="Cost, interleaved pairs of steps"):
        if arm.name == config.baseline:
            continue
        model = initial_model(arm)
        step = training_step(model, ids, "eager")
        timed = interleaved_ratio(baseline_step, step, config.cost_pairs, COST_WARMUP, str(device))
        baseline_bytes, measure = step_memory(baseline, ids, baseline_step)
        arm_bytes, _ = step_memory(model, ids, step)
        cost[arm.name] = {
            "device": str(device),
            "baseline_s": timed["source_s"],
            "arm_s": timed["attnres_s"],
            "ratio": timed["ratio"],
            "step_memory": {
                "baseline_bytes": baseline_bytes,
                "arm_bytes": arm_bytes,
                "ratio": arm_bytes / baseline_bytes,
                "measure": measure,
            },  # fmt: skip
        }
        del model, step
    return cost


def seed_zero_mixing(config: CompareConfig, study: Path, planned: list[tuple[ArmRun, bool]]) -> dict[str, Any]:
    """Each arm's depth-mixing matrix (`attnres analyze`'s M: how much of each source enters each sublayer's input),
    of its trained seed-0 model on the first `ANALYSIS_TOKENS` tokens of seed 0's validation text -> by arm (those
    whose rule has a matrix: not the source, nor PostNorm), the matrix and its figure `mixing-ARM.png`."""
    from .analysis import mixing_matrix, plot_mixing_matrices, sublayer_names
    from .sources import load_source_tokenizer

    validation = sorted((split_folder(study, 0) / "validation").rglob("*.txt"))
    text = "\n\n".join(file.read_text(encoding="utf-8") for file in validation)
    matrices = {}
    for run, scored in planned:
        if not scored or run.seed != 0 or run.arm.rule is None:
            continue
        model = trained_model(run.folder(study))
        if model.model.rule.no_mixing_matrix is not None:
            continue
        tokenizer = load_source_tokenizer(str(run.folder(study)))
        input_ids = tokenizer(text, return_tensors="pt").input_ids[:, :ANALYSIS_TOKENS]
        rows = mixing_matrix(model, input_ids)
        figure = study / f"mixing-{run.arm.folder}.png"
        if plotting_available():
            with written_whole(figure) as staging:
                plot_mixing_matrices({f"{run.arm.name}, seed 0, trained": rows},
                                     sublayer_names(model.config.num_hidden_layers), staging)  # fmt: skip
        matrices[run.arm.name] = {"rows": rows, "figure": figure.name}
    return matrices


def plotting_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


# --------------------------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------------------------


def verdict(comparison: dict[str, Any]) -> str:
    """What a comparison shows, in words that follow its Holm-adjusted p."""
    if math.isnan(comparison["p_holm"]):
        return "too few pairs to tell"
    if comparison["p_holm"] >= 0.05:
        return "no difference shown (Holm p ≥ 0.05)"
    return "lower test loss" if comparison["mean"] < 0 else "higher test loss"


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def cost_cells(cost: dict[str, Any] | None) -> list[str]:
    """An arm's step time and step memory against the baseline's, as the table shows them."""
    if cost is None:
        return ["–", "–"]
    memory = cost.get("step_memory")  # a study whose cost was measured before step memory was
    memory_cell = "–" if memory is None else f"{memory['ratio']:.2f}x ({memory['arm_bytes'] / 2**20:.1f} MiB)"
    return [f"{cost['ratio']:.2f}x ({cost['arm_s'] * 1000:.1f} ms)", memory_cell]


def write_report(config: CompareConfig, results: dict[str, Any], study: Path) -> None:
    """`report.md` (the settings, the splits, the table of comparisons, the grids, the figures), `curves.png`
    (validation loss along training, each arm's mean over seeds) and `gap.png` (each arm's gap to the baseline along
    training, with its 95% interval)."""
    runs = results["runs"]
    by_arm: dict[str, list[dict]] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], []).append(run)
    baseline_cpu = [r["cpu_seconds_per_step"] for r in by_arm[config.baseline] if r["cpu_seconds_per_step"]]
    memory = next((cost["step_memory"] for cost in results["cost"].values() if "step_memory" in cost), None)
    baseline_cells = ["1.00x", "1.00x" + (f" ({memory['baseline_bytes'] / 2**20:.1f} MiB)" if memory else "")]
    rows = []
    for arm, group in by_arm.items():
        losses = [run["test_loss"] for run in group]
        spread = f"{statistics.mean(losses):.4f}" + (f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else "")
        cpu = [run["cpu_seconds_per_step"] for run in group if run["cpu_seconds_per_step"]]
        ratio = f" ({statistics.mean(cpu) / statistics.mean(baseline_cpu):.2f}x)" if cpu and baseline_cpu else ""
        comparison = next((c for c in results["comparisons"] if c["arm"] == arm), None)
        if comparison is None:
            cells = ["–", "–", "–", "baseline"]
        else:
            low, high = comparison["ci95"]
            interval = "" if math.isnan(low) else f" [{low:+.4f}, {high:+.4f}]"
            cells = [f"{comparison['mean']:+.4f}{interval}", f"{comparison['p']:.2g}", f"{comparison['p_holm']:.2g}",
                     verdict(comparison)]  # fmt: skip
        cpu_cell = f"{statistics.mean(cpu):.3f}{ratio}" if cpu else "–"
        row = [arm, str(len(group)), f"{group[0]['lr']:g}", spread, *cells, cpu_cell]
        rows.append(row + (cost_cells(results["cost"].get(arm)) if arm != config.baseline else baseline_cells))
    header = ["arm", "seeds", "lr", "test loss (mean ± sd)", f"Δ vs {config.baseline}, same seed [95% CI]", "p",
              "p (Holm)", "reading", "CPU s per step (runs)", "step time vs baseline (interleaved)",
              "step memory vs baseline"]  # fmt: skip
    shared = [split["shared_with_train"] for split in results["splits"].values()]
    split_line = ", ".join(
        f"{name} {min(s[name] for s in shared):.1%} to {max(s[name] for s in shared):.1%}"
        for name in ("validation", "test")
    )
    shape = results["architecture"]
    start = "random weights of the source's architecture" if config.from_scratch else "the checkpoint"
    if config.layers is not None or config.hidden_size is not None:
        start += " shrunk"
    layers = f"{shape['layers']} layer" + "s" * (shape["layers"] != 1)
    start += f" ({layers}, hidden size {shape['hidden_size']}, {shape['parameters']:,} parameters)"
    rates = "each arm at its own learning rate (chosen on validation, below)" if config.grid() else (
        f"learning rate {config.lr:g}")  # fmt: skip
    arm_names = [arm.name for arm in config.arms()]
    lines = [
        f"# {', '.join(arm_names)} on {config.source}",
        "",
        f"{config.seeds} seed{'s' * (config.seeds > 1)} x {len(arm_names)} arms, each arm from {start}, "
        f"{runs[0]['tokens']:,} training tokens, "
        f"{rates}; test loss scored once per arm, when it ended. Data: {config.data} "
        f"({results['splits'][0]['train']['documents']} training documents for seed 0); held-out text found verbatim "
        f"in training (32-byte windows, over the seeds): {split_line}.",
        "",
        *markdown_table(header, rows),
        "",
        "Each Δ is paired by seed (same initial weights where the arms share them, same batches); p is the paired "
        "t-test's, Holm's adjusts it over the study's comparisons, and the reading follows Holm's p. CPU s per step "
        "is the median of the runs' own CPU time per step; the step time is the median ratio of interleaved pairs of "
        f"training steps of the initial models against the baseline's ({config.cost_pairs} pairs on "
        f"{next(iter(results['cost'].values()), {}).get('device', 'no device')})"
        + (f"; the step memory, the {memory['measure']}." if memory else "."),
        "",
    ]
    if "lr_grid" in results:
        grid_rows = []
        for arm, grid in results["lr_grid"].items():
            edge = grid["chosen"] in (grid["tried"][0][0], grid["tried"][-1][0])
            tried = ", ".join(f"{lr:g}: {loss:.4f}" for lr, loss in grid["tried"])
            grid_rows.append([arm, tried, f"{grid['chosen']:g}" + (" (at the edge: widen the grid)" if edge else "")])
        tokens = next(iter(results["lr_grid"].values()))["tokens"]
        lines += [
            f"Learning rates: each arm at seed 0, {tokens:,} tokens per rate, final validation loss; the lowest is "
            "the arm's rate (the test split plays no part).",
            "",
            *markdown_table(["arm", "rate: final validation loss", "chosen"], grid_rows),
            "",
        ]
    if plotting_available():
        plot_curves(by_arm, study / CURVES_FILE)
        lines += [f"![validation loss along training]({CURVES_FILE})", ""]
        if plot_gaps(results["comparisons"], study / GAP_FILE):
            lines += [f"![gap to {config.baseline} along training, 95% interval]({GAP_FILE})", ""]
        lines += [f"![depth-mixing matrix of {arm}]({m['figure']})" for arm, m in results["mixing_matrices"].items()]
    with written_whole(study / REPORT_FILE) as staging:
        staging.write_text("\n".join(lines) + "\n")


def plot_curves(by_arm: dict[str, list[dict]], path: Path) -> None:
    """Each arm's validation loss along training, the mean over its seeds."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for arm, group in by_arm.items():
        tokens = [point[0] for point in group[0]["curve"]]
        means = [statistics.mean(run["curve"][i][1] for run in group) for i in range(len(tokens))]
        axes.plot(tokens[1:], means[1:], "o-", ms=3, label=arm)  # from the first evaluation after the start
    axes.set_xlabel("training tokens")
    axes.set_ylabel("validation loss (mean over seeds)")
    axes.legend()
    figure.tight_layout()
    with written_whole(path) as staging:
        figure.savefig(staging, format="png", dpi=110)


def plot_gaps(made: list[dict[str, Any]], path: Path) -> bool:
    """Each arm's paired gap in validation loss to the baseline along training, with its 95% interval where there
    are two seeds or more -> whether there was a comparison to draw."""
    from matplotlib.figure import Figure

    if not made:
        return False
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for comparison in made:
        tokens, means, lows, highs = zip(*comparison["validation_gap"][1:], strict=True)  # after the start
        (line,) = axes.plot(tokens, means, "o-", ms=3, label=comparison["arm"])
        if not any(math.isnan(low) for low in lows):
            axes.fill_between(tokens, lows, highs, color=line.get_color(), alpha=0.2)
    axes.axhline(0.0, color="black", linewidth=0.8)
    axes.set_xlabel("training tokens")
    axes.set_ylabel(f"validation loss − {made[0]['baseline']}'s, same seed")
    axes.legend()
    figure.tight_layout()
    with written_whole(path) as staging:
        figure.savefig(staging, format="png", dpi=110)
    return True


# --------------------------------------------------------------------------------------------------------------------
# --status, the study file, the command
# --------------------------------------------------------------------------------------------------------------------


def status(study: Path) -> str:
    """What `attnres compare --status DIR` prints: each run of the study so far, done, running (held by a worker's
    live process) or left, and what waits for a grid."""
    saved = study / STUDY_FILE
    if not saved.is_file():
        raise OptionError(f"--status {study}: no study there ({STUDY_FILE} is missing)")
    settings = json.loads(saved.read_text())
    config = CompareConfig(
        **{f.name: settings[f.name] for f in dataclasses.fields(CompareConfig) if f.name in settings}
    )
    lines, counts = [], {"done": 0, "running": 0, "left": 0}
    for run, scored in plan(config, study):
        if is_done(study, run, scored):
            state = "done"
        else:
            owner = claim_owner(run.claim_path(study))
            state = "left" if owner is None else f"running (pid {owner})"
        counts[state.split()[0]] += 1
        lines.append(f"{run.place}/{run.name:40} {'test' if scored else 'grid'}  {state}")
    waiting = [arm.name for arm in config.arms() if config.grid() and grid_of(config, study, arm)[1] is None]
    summary = f"{study}: {counts['done']} runs done, {counts['running']} running, {counts['left']} left"
    if waiting:
        summary += f"; the seeds of {', '.join(waiting)} wait for their learning-rate grid"
    finished = (study / RESULTS_FILE).is_file() and not counts["running"] + counts["left"] and not waiting
    return "\n".join([summary + ("; finished: " + str(study / REPORT_FILE) if finished else ""), *lines])


def read_study_file(path: str) -> dict[str, Any]:
    """The options of a study file (YAML: `CompareConfig` field names, dashes or underscores), checked by name and
    type -> {field: value}."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise OptionError(f"--config {path}: no such file")
    try:
        options = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise OptionError(f"--config {path}: not YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(options, dict):
        raise OptionError(f"--config {path}: expected a mapping of options (rules: prenorm,block ...)")
    fields = {f.name: f for f in dataclasses.fields(CompareConfig) if f.name != "overwrite"}
    read = {}
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise OptionError(f"--config {path}: no option {key}; the options are {', '.join(fields)}")
        read[name] = option_value(value, fields[name].type, f"--config {path}: {key}")
    return read


def option_value(value: Any, kind: Any, where: str) -> Any:
    """`value` of a study file as the field of type `kind` holds it: a list joined with commas for a text option,
    an integer or number for a numeric one (YAML reads 1e-3 as text)."""
    if value is None:
        return None
    base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
    if isinstance(value, list) and base is str:
        value = ",".join(str(item) for item in value)
    if base is bool:
        if not isinstance(value, bool):
            raise OptionError(f"{where}: expected true or false, got {value!r}")
        return value
    try:
        converted = base(float(value)) if base is int else base(value)
    except (TypeError, ValueError):
        converted = None
    if converted is None or isinstance(value, bool) or (base is int and converted != float(value)):
        raise OptionError(f"{where}: expected {'an integer' if base is int else 'a ' + base.__name__}, got {value!r}")
    return converted


def config_from(args: argparse.Namespace) -> CompareConfig:
    """The study the command line describes: the study file's options (`--config`), and over them the options given
    on the command line."""
    options = read_study_file(args.config) if getattr(args, "config", None) else {}
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(CompareConfig)}
    options |= {name: value for name, value in given.items() if value is not None}
    missing = [flag for name, flag in (("source", "SOURCE"), ("data", "--data"), ("output_dir", "--output-dir"))
               if name not in options]  # fmt: skip
    if missing:
        raise OptionError(f"attnres compare needs {', '.join(missing)}: give them on the command line or in --config")
    return CompareConfig(**options)


def run_compare(args: argparse.Namespace) -> int:
    """`attnres compare`: the study the parsed options describe, or with --status its state -> the exit status."""
    if getattr(args, "status", None) is not None:
        print(status(Path(args.status)))
        return 0
    config = config_from(args)
    results = compare(config)
    study = Path(config.output_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{len(results['runs'])} runs; the report is {study / REPORT_FILE}, the figures {study / RESULTS_FILE}.")
        for comparison in results["comparisons"]:
            print(f"{comparison['arm']} - {comparison['baseline']}: {comparison['mean']:+.4f} ({verdict(comparison)})")
    return 0
