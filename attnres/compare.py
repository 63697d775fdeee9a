"""`attnres compare`: which depth-mixing rule helps this model on this data, by how much, and at what cost.

    attnres compare SOURCE --data DATA --rules prenorm,block,full --seeds 3 --tokens 2000000 --output-dir DIR

A study is a set of arms, one per rule and seed, each an `attnres train --convert --mode RULE --seed S` run. Each
seed splits the documents three ways (`attnres.splits`): training, a validation split scored along every run (the
split every choice is made on), and a test split that shares little text with training, scored once, when an arm
ends. Within a seed every arm starts from the same weights where the rules share them (the checkpoint's, or with
`--from-scratch` the seed's random initialisation of the source's architecture) and sees the same batches in the
same order, so each seed pairs the arms, and every comparison is the paired difference of test losses against the
baseline rule: its mean, 95% t-interval and p-value, and the p-value adjusted by Holm's method over all the
comparisons of the study.

Everything lands in DIR: `study.json` (the settings, and the data's content hash), `data/seedS/` (the splits),
`runs/RULE-seedS/` (each arm's run folder, checkpointed at every evaluation) with `runs/RULE-seedS.json` (its record
once it has finished), `results.json`, `report.md` and `curves.png`. Running the same command again trains only what
is missing: a stopped arm resumes from its last checkpoint. Other settings on an existing DIR are refused unless
`--overwrite`.
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import re
import statistics
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import __version__
from .data import check_utf8_text
from .errors import DataError, OptionError
from .folders import check_output_dir, output_lock, read_metrics, remove, written_whole
from .options import CompareConfig, TrainingConfig
from .splits import DocumentSplit, HoldOut, split_documents, write_split

logger = logging.getLogger(__name__)

STUDY_FILE, RESULTS_FILE, REPORT_FILE, CURVES_FILE = "study.json", "results.json", "report.md", "curves.png"
# Documents shorter than this pack into little of a sequence; longer than this share of a held-out split, one could
# make up most of it
SHORTEST_HELD_OUT_DOCUMENT = 256
LONGEST_HELD_OUT_SHARE = 0.5
# A .txt file given as DATA holds its documents separated by blank lines
BLANK_LINES = re.compile(r"\n\s*\n")


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
    """Each rule against `baseline`, paired by seed on test loss: mean, 95% interval, p, and Holm's p over every
    comparison with at least 2 pairs."""
    by_rule: dict[str, dict[int, float]] = {}
    for run in runs:
        by_rule.setdefault(run["rule"], {})[run["seed"]] = run["test_loss"]
    made = []
    for rule, losses in by_rule.items():
        if rule == baseline:
            continue
        seeds = sorted(seed for seed in losses if seed in by_rule.get(baseline, {}))
        if not seeds:
            continue
        mean, low, high, p = paired_interval([losses[seed] - by_rule[baseline][seed] for seed in seeds])
        made.append(
            {"rule": rule, "baseline": baseline, "pairs": len(seeds), "mean": mean, "ci95": [low, high], "p": p}
        )
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
    return HoldOut(
        documents=config.held_out_documents,
        bytes=config.held_out_bytes,
        document_bytes=(SHORTEST_HELD_OUT_DOCUMENT, max(1, int(LONGEST_HELD_OUT_SHARE * config.held_out_bytes))),
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


# --------------------------------------------------------------------------------------------------------------------
# The arms
# --------------------------------------------------------------------------------------------------------------------


def arm_name(rule: str, seed: int) -> str:
    return f"{rule}-seed{seed}"


def steps_of(config: CompareConfig) -> int:
    return config.tokens // (config.seq_len * config.batch_size)


def training_config(config: CompareConfig, rule: str, seed: int, split: Path, folder: Path) -> TrainingConfig:
    """The arm's `attnres train` options: every rate stated by the study, none inherited."""
    steps = steps_of(config)
    eval_every = max(1, steps // config.evaluations)
    return TrainingConfig(
        output_dir=str(folder),
        model=config.source,
        trust_remote_code=config.trust_remote_code,
        convert=True,
        mode=rule,
        from_scratch=config.from_scratch,
        dataset=str(split),
        eval_split="validation",
        seed=seed,
        lr=config.lr,
        attnres_lr=config.lr if config.attnres_lr is None else config.attnres_lr,
        max_steps=steps,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        max_eval_sequences=config.eval_sequences,
        eval_every=eval_every,
        save_every=eval_every,
        save_total_limit=1,
        log_every=1,  # every step's CPU time, for the cost
        resume=folder.exists(),
    )


@torch.no_grad()
def held_out_loss(model, sequences, batch_size: int, name: str) -> float:
    """Mean next-token loss over equal-length sequences (each batch weighted by its size), as training scores it."""
    model.eval()
    total, count = 0.0, 0
    for batch in tqdm(DataLoader(sequences.with_format("torch"), batch_size=batch_size), desc=f"Held-out, {name}"):
        input_ids = batch["input_ids"]
        total += model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item() * len(input_ids)
        count += len(input_ids)
    return total / count


def test_loss(folder: Path, options: TrainingConfig) -> float:
    """The trained arm's mean next-token loss over every sequence its test split packs into."""
    from transformers import AutoModelForCausalLM

    from .sources import load_source_tokenizer
    from .training import build_datasets

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = load_source_tokenizer(str(folder))
    test_options = dataclasses.replace(options, eval_split="test", max_eval_sequences=10**9, resume=False)
    sequences = build_datasets(test_options, tokenizer, num_processes=1)[1]
    return held_out_loss(model, sequences, options.batch_size, "test")


def run_arm(config: CompareConfig, study: Path, rule: str, seed: int, split: Path) -> dict[str, Any] | None:
    """Train one arm (resuming it where it stopped) and score its test split -> its record, None if a signal
    stopped it (its checkpoint is saved)."""
    from .training import train

    record_path = study / "runs" / f"{arm_name(rule, seed)}.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    folder = study / "runs" / arm_name(rule, seed)
    options = training_config(config, rule, seed, split, folder)
    result = train(options)
    if result.interrupted:
        return None
    metrics = read_metrics(folder)
    tokens_per_step = config.seq_len * config.batch_size
    cpu_seconds = [record["cpu_seconds_per_step"] for record in metrics if "cpu_seconds_per_step" in record]
    record = {
        "rule": rule,
        "seed": seed,
        "lr": options.lr,
        "attnres_lr": options.attnres_lr,
        "tokens": options.max_steps * tokens_per_step,
        "test_loss": test_loss(folder, options),
        "curve": [[r["step"] * tokens_per_step, r["eval_loss"]] for r in metrics if "eval_loss" in r],
        "cpu_seconds_per_step": statistics.median(cpu_seconds) if cpu_seconds else None,
    }
    with written_whole(record_path) as staging:
        staging.write_text(json.dumps(record, indent=1) + "\n")
    return record


# --------------------------------------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------------------------------------


def study_settings(config: CompareConfig, documents: dict[str, bytes]) -> dict[str, Any]:
    """What makes a study this study: every setting but --overwrite, and the data's content."""
    settings = {name: value for name, value in dataclasses.asdict(config).items() if name != "overwrite"}
    return settings | {"data_sha256": content_hash(documents), "documents": len(documents)}


def check_study_folder(config: CompareConfig, study: Path, settings: dict[str, Any]) -> bool:
    """Refuse, before anything is written, a folder that holds something else, or a study with other settings
    unless --overwrite -> whether the folder holds a study that --overwrite replaces."""
    check_output_dir(study, OptionError, {"the model": config.source, "the data": config.data}, None)
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


def compare(config: CompareConfig | None = None, **options) -> dict[str, Any]:
    """Run the study `config` (or `CompareConfig` fields as keywords) describes, or what is missing of it -> its
    results (`results.json`): `runs` and `comparisons`. Raises KeyboardInterrupt where a signal stopped an arm (its
    checkpoint is saved: the same call resumes it)."""
    config = dataclasses.replace(config, **options) if config is not None else CompareConfig(**options)
    study = Path(config.output_dir)
    documents = load_corpus(config.data, config.text_field)
    settings = study_settings(config, documents)
    replaced = check_study_folder(config, study, settings)
    splits = {seed: study / "data" / f"seed{seed}" for seed in range(config.seeds)}
    # Split before anything is written: a corpus too small for the held-out splits is refused with nothing changed
    planned = {
        seed: split_documents(documents, seed, hold_out_of(config))
        for seed, folder in splits.items()
        if replaced or not (folder / "split.json").is_file()
    }
    with output_lock(study, OptionError):
        for entry in study.iterdir() if replaced else ():
            remove(entry)
        study.mkdir(parents=True, exist_ok=True)
        (study / STUDY_FILE).write_text(json.dumps(settings, indent=1) + "\n")
        for seed, split in planned.items():
            write_seed_split(documents, split, splits[seed])
        arms = [(rule, seed) for seed in range(config.seeds) for rule in config.rule_list()]
        runs = []
        for rule, seed in tqdm(arms, desc="Arms", unit="arm"):
            record = run_arm(config, study, rule, seed, splits[seed])
            if record is None:
                raise KeyboardInterrupt(f"stopped in {arm_name(rule, seed)} with a checkpoint saved")
            runs.append(record)
        results = {"runs": runs, "comparisons": comparisons(runs, config.baseline), "attnres_version": __version__}
        results["splits"] = {seed: json.loads((folder / "split.json").read_text()) for seed, folder in splits.items()}
        with written_whole(study / RESULTS_FILE) as staging:
            staging.write_text(json.dumps(results, indent=1) + "\n")
        write_report(config, results, study)
    return results


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


def write_report(config: CompareConfig, results: dict[str, Any], study: Path) -> None:
    """`report.md` (the settings, the splits, the table of comparisons) and `curves.png` (validation loss along
    training, each rule's mean over seeds)."""
    runs = results["runs"]
    by_rule: dict[str, list[dict]] = {}
    for run in runs:
        by_rule.setdefault(run["rule"], []).append(run)
    baseline_cpu = [r["cpu_seconds_per_step"] for r in by_rule[config.baseline] if r["cpu_seconds_per_step"]]
    rows = []
    for rule, group in by_rule.items():
        losses = [run["test_loss"] for run in group]
        spread = f"{statistics.mean(losses):.4f}" + (f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else "")
        cpu = [run["cpu_seconds_per_step"] for run in group if run["cpu_seconds_per_step"]]
        ratio = f" ({statistics.mean(cpu) / statistics.mean(baseline_cpu):.2f}x)" if cpu and baseline_cpu else ""
        comparison = next((c for c in results["comparisons"] if c["rule"] == rule), None)
        if comparison is None:
            cells = ["–", "–", "–", "baseline"]
        else:
            low, high = comparison["ci95"]
            interval = "" if math.isnan(low) else f" [{low:+.4f}, {high:+.4f}]"
            cells = [f"{comparison['mean']:+.4f}{interval}", f"{comparison['p']:.2g}", f"{comparison['p_holm']:.2g}",
                     verdict(comparison)]  # fmt: skip
        cpu_cell = f"{statistics.mean(cpu):.3f}{ratio}" if cpu else "–"
        rows.append([rule, str(len(group)), f"{group[0]['lr']:g}", spread, *cells, cpu_cell])
    header = ["rule", "seeds", "lr", "test loss (mean ± sd)", f"Δ vs {config.baseline}, same seed [95% CI]", "p",
              "p (Holm)", "reading", "CPU s per step"]  # fmt: skip
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    shared = [split["shared_with_train"] for split in results["splits"].values()]
    split_line = ", ".join(
        f"{name} {min(s[name] for s in shared):.1%} to {max(s[name] for s in shared):.1%}"
        for name in ("validation", "test")
    )
    start = "random weights of the source's architecture" if config.from_scratch else "the checkpoint"
    lines = [
        f"# {', '.join(config.rule_list())} on {config.source}",
        "",
        f"{config.seeds} seeds x {len(config.rule_list())} rules, each arm from {start}, {runs[0]['tokens']:,} "
        f"training tokens at learning rate {config.lr:g}; test loss scored once per arm, when it ended. "
        f"Data: {config.data} ({results['splits'][0]['train']['documents']} training documents for seed 0); "
        f"held-out text found verbatim in training (32-byte windows, over the seeds): {split_line}.",
        "",
        *table,
        "",
        "Each Δ is paired by seed (same initial weights where the rules share them, same batches); p is the paired "
        "t-test's, Holm's adjusts it over the study's comparisons, and the reading follows Holm's p.",
        "",
    ]
    if _plot_curves(by_rule, study / CURVES_FILE):
        lines += [f"![validation loss along training]({CURVES_FILE})", ""]
    with written_whole(study / REPORT_FILE) as staging:
        staging.write_text("\n".join(lines))


def _plot_curves(by_rule: dict[str, list[dict]], path: Path) -> bool:
    """Each rule's validation loss along training, the mean over its seeds -> whether matplotlib could draw it."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        return False
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for rule, group in by_rule.items():
        tokens = [point[0] for point in group[0]["curve"]]
        means = [statistics.mean(run["curve"][i][1] for run in group) for i in range(len(tokens))]
        axes.plot(tokens[1:], means[1:], "o-", ms=3, label=rule)  # from the first evaluation after the start
    axes.set_xlabel("training tokens")
    axes.set_ylabel("validation loss (mean over seeds)")
    axes.legend()
    figure.tight_layout()
    with written_whole(path) as staging:
        figure.savefig(staging, format="png", dpi=110)
    return True


def run_compare(args: argparse.Namespace) -> int:
    """`attnres compare`: the study the parsed options describe -> the exit status."""
    config = CompareConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(CompareConfig)})
    results = compare(config)
    study = Path(config.output_dir)
    print(f"{len(results['runs'])} arms; the report is {study / REPORT_FILE}, the figures {study / RESULTS_FILE}.")
    for comparison in results["comparisons"]:
        print(f"{comparison['rule']} - {comparison['baseline']}: {comparison['mean']:+.4f} ({verdict(comparison)})")
    return 0
