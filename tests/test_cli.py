"""The `attnres` command: --help without heavy imports, options that agree with the modules behind them, model
arguments checked before anything loads (wrong folders, an unreachable Hub, offline), and the error policy."""

import argparse
import configparser
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import constants as hub_constants
from tiny import run_cli

import attnres
from attnres import conversion, demo, options, sources
from attnres.eval import harness
from attnres.options import TrainingConfig
from attnres.sources import SourceError
from attnres_cli import command as cli

HEAVY_MODULES = ("torch", "transformers", "lm_eval", "accelerate", "datasets", "peft", "matplotlib")


def model_folder(folder: Path) -> Path:
    """A folder that passes for a model until something loads it: it has a config.json that names a family."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if any model is loaded or evaluated."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before every model argument was checked")

    for module, name in ((sources, "load_source"), (conversion, "convert_checkpoint"), (harness, "load_model")):
        monkeypatch.setattr(module, name, refuse)


# --------------------------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------------------------


SETUP_CFG = Path(__file__).parents[1] / "setup.cfg"


def console_script() -> str:
    """The lines a fresh Python runs to be the `attnres` console script that setup.cfg declares, up to its `main`."""
    setup = configparser.ConfigParser()
    setup.read(SETUP_CFG)
    entry_points = dict(
        line.split(" = ") for line in setup["options.entry_points"]["console_scripts"].split("\n") if line
    )
    module, function = entry_points["attnres"].split(":")
    return f"import sys\nsys.argv[0] = 'attnres'\nfrom {module} import {function} as main\n"


def test_help_of_every_command_imports_nothing_heavy():
    """`attnres --help` and `attnres <command> --help` (but `train`, whose options are TrainingConfig's) in a fresh
    Python started as the `attnres` console script: no torch, transformers or lm-eval, so they answer in a fraction
    of a second."""
    commands = [[], *([name] for name in cli.COMMANDS if name != "train")]
    script = f"""{console_script()}
from contextlib import redirect_stdout
from io import StringIO
for argv in {commands!r}:
    try:
        with redirect_stdout(StringIO()):
            main([*argv, "--help"])
    except SystemExit as exit:
        assert exit.code == 0, argv
print(sorted(name for name in {HEAVY_MODULES!r} if name in sys.modules))
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[]"


def test_train_help_imports_only_the_argument_parser():
    """`attnres train --help` builds its options from TrainingConfig with transformers' HfArgumentParser: that much of
    transformers, and none of torch, Accelerate, PEFT, datasets or lm-eval (which took it to 14-29 s)."""
    heavy = tuple(name for name in HEAVY_MODULES if name != "transformers")
    script = f"""{console_script()}
from contextlib import redirect_stdout
from io import StringIO
try:
    with redirect_stdout(StringIO()) as help_text:
        main(["train", "--help"])
except SystemExit as exit:
    assert exit.code == 0
assert "--attnres-lr" in help_text.getvalue()
print(sorted(name for name in {heavy!r} if name in sys.modules))
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[]"


def test_import_attnres_registers_the_classes_whatever_the_program_is_called():
    """A host process whose program is named `attnres` (as the console script's is) gets the Auto classes too."""
    script = """
import sys
sys.argv[0] = "/usr/local/bin/attnres"
import attnres
from transformers import AutoConfig
print(type(AutoConfig.for_model("attnres")).__name__)
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == "AttnResConfig"


def test_the_command_and_the_library_share_one_declaration_of_rules_families_and_errors():
    """The command loads the light modules alone; the library, imported after, uses the same ones: one `RULES`, one
    `OptionError` class (which the command catches), one `TrainingConfig`."""
    script = (
        "import sys, attnres_cli.command\n"
        "from attnres.errors import OptionError\n"
        "from attnres.rules import RULES\n"
        "import attnres, attnres.training, attnres.configuration_attnres as configuration\n"
        "from attnres.training import TrainingConfig, TrainingError\n"
        "print(configuration.RULES is RULES, attnres.options.OptionError is OptionError,\n"
        "      attnres_cli.command.TrainingConfig is TrainingConfig,\n"
        "      issubclass(TrainingError, attnres.errors.AttnResInputError))"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split() == ["True"] * 4
    assert len(cli.SUPPORTED_FAMILIES) == 36 and cli.MODES == tuple(options.RULES)
    assert options.FROM_SCRATCH_ONLY == ("postnorm", "rezero", "highway")


def test_help_names_every_family_and_rule():
    convert = subparsers()["convert"].description
    assert re.findall(r"\w+", convert.partition("supported family (")[2].partition(")")[0]) == list(
        cli.SUPPORTED_FAMILIES
    )
    for parser in (subparsers()["convert"], cli.train_parser()):
        mode = next(action for action in parser._actions if action.dest == "mode")
        assert mode.choices == cli.MODES
        assert all(f"{name}, {rule.label}" in mode.help for name, rule in options.RULES.items())
        assert "postnorm, rezero, highway cannot start as the source computes" in mode.help


def test_train_help_shows_the_dashed_spellings_and_both_parse():
    parser = cli.train_parser()
    help_text = parser.format_help()
    assert "--output-dir DIR" in help_text and "--seq-len SEQ_LEN" in help_text
    assert "--output_dir" not in help_text and "--seq_len" not in help_text
    dashed = parser.parse_args(["--output-dir", "out", "--seq-len", "64"])
    underscored = parser.parse_args(["--output_dir", "out", "--seq_len", "64"])
    assert (dashed.output_dir, dashed.seq_len) == (underscored.output_dir, underscored.seq_len) == ("out", 64)


def test_an_unknown_tracker_is_refused_naming_the_known_ones(tmp_path):
    exit_code, _, error = run_cli("train", "--output-dir", tmp_path / "run", "--report-to", "tensorbored")
    assert exit_code == 1 and error.startswith("attnres train: error: --report-to tensorbored: not a tracker of")
    assert "tensorboard" in error and "wandb" in error and error.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_restated_choices_and_defaults_match_the_modules():
    assert cli.CONVERT_DTYPES == tuple(conversion.DTYPES)
    assert cli.EVAL_DTYPES == tuple(harness.DTYPES)
    assert tuple(cli.TASK_ALIASES) == tuple(harness.TASK_ALIASES)
    assert cli.DEFAULT_TASKS == harness.DEFAULT_TASKS
    assert (cli.FIXTURES, cli.DEFAULT_SOURCE) == (harness.FIXTURES, sources.DEFAULT_SOURCE)
    parameters = inspect.signature(demo.demo).parameters
    assert cli.DEMO_DEFAULTS == {
        "output": parameters["output_dir"].default,
        "steps": parameters["steps"].default,
        "eval_limit": parameters["eval_limit"].default,
        "max_gen_toks": parameters["max_gen_toks"].default,
    }


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(action for action in cli.build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    return {**action.choices, "train": cli.train_parser()}


def test_every_option_of_every_command_has_help():
    for name, parser in subparsers().items():
        undocumented = [action.dest for action in parser._actions if not action.help]
        assert not undocumented, (name, undocumented)


def test_train_options_are_training_config_fields():
    parser = cli.train_parser()
    options = [action for action in parser._actions if action.dest not in ("help", "debug")]
    assert sorted(action.dest for action in options) == sorted(TrainingConfig.__dataclass_fields__)
    help_text = parser.format_help()
    for option in ("--model", "--train {all,attnres,lora}", "--grad-accum", "--attnres-lr", "--resume", "--convert"):
        assert option in help_text
    args = cli.parse_args(["train", "--output-dir", "out", "--seq-len", "64", "--convert", "--debug"])
    assert (args.command, args.debug) == ("train", True)
    fields = {name: value for name, value in vars(args).items() if name in TrainingConfig.__dataclass_fields__}
    assert TrainingConfig(**fields) == TrainingConfig(output_dir="out", seq_len=64, convert=True)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out == f"attnres {attnres.__version__}\n"


ROOT = Path(__file__).parents[1]
# Where the commands are documented: the README, and a page of docs/ for each command (docs/convert.md, ...)
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `attnres COMMAND ...` (not `from attnres import`), or `-m attnres.training ...` (train), up to a comment or `&&`
DOCUMENTED_COMMAND = re.compile(
    r"(?:(?<![\w.-])(?<!from )attnres (?P<name>[a-z]+)|-m attnres\.training)(?P<rest>[^#&|;`]*)"
)
OPTION = re.compile(r"(?<![\w-])--[\w-]+")


def documented_flags() -> dict[str, set[str]]:
    """The options the README and docs/ show for each command, in their bash blocks and their inline code."""
    flags = {}
    for page in DOC_PAGES:
        text = page.read_text(encoding="utf-8")
        blocks = [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", text, re.S)]  # lines joined
        commands = [line for block in blocks for line in block.splitlines()]
        commands += [
            span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        ]
        for command in commands:
            for match in DOCUMENTED_COMMAND.finditer(command):
                flags.setdefault(match["name"] or "train", set()).update(OPTION.findall(match["rest"]))
    return flags


def test_every_option_the_docs_show_exists():
    parsers = subparsers()
    shown = documented_flags()
    assert set(shown) == set(parsers), "every command appears in the README or docs/, and no other"
    for name, flags in shown.items():
        unknown = flags - set(parsers[name]._option_string_actions)
        assert not unknown, (name, unknown)


def test_every_option_of_a_command_is_on_its_page():
    """docs/COMMAND.md names each option of COMMAND (in one of its spellings: train takes `--seq-len` and `--seq_len`);
    `--debug`, which every command takes, is on docs/errors.md."""
    for name, parser in subparsers().items():
        page = ROOT / "docs" / f"{name}.md"
        assert page.is_file(), f"`attnres {name}` has no page in docs/"
        named = set(OPTION.findall(page.read_text(encoding="utf-8")))
        missing = [
            action.option_strings[-1]
            for action in parser._actions
            if action.option_strings and action.dest not in ("help", "debug") and not named & set(action.option_strings)
        ]
        assert not missing, f"docs/{name}.md does not name {missing}"
    assert "--debug" in OPTION.findall((ROOT / "docs" / "errors.md").read_text(encoding="utf-8"))


def test_unknown_options_are_refused():
    with pytest.raises(SystemExit) as exit, redirect_stderr(StringIO()) as stderr:
        cli.parse_args(["convert", "a", "b", "--colour", "red"])
    assert exit.value.code == 2 and "unrecognized arguments: --colour red" in stderr.getvalue()


class ReadOptions(argparse.Namespace):
    """Parsed options that remember which of them the code reads."""

    def __init__(self, parsed: argparse.Namespace):
        super().__init__(**vars(parsed))
        self.read = set()

    def __getattribute__(self, name: str):
        if not name.startswith("_") and name != "read":
            super().__getattribute__("read").add(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize("command", ["convert", "eval", "train", "compare"])
def test_every_option_reaches_the_function_that_runs_the_command(command, monkeypatch, tmp_path):
    """The function that runs a command reads every option its parser makes: an option that reached nothing would be
    ignored without a word."""
    from attnres import compare
    from attnres.training import loop

    monkeypatch.setattr(compare, "compare", lambda config: {"runs": [], "comparisons": []})
    monkeypatch.setattr(conversion, "convert_checkpoint", lambda *args, **options: None)
    monkeypatch.setattr(harness, "evaluate", lambda *args, **options: SimpleNamespace(to_markdown=lambda: ""))
    monkeypatch.setattr(loop, "train", lambda config: loop.TrainingResult(tmp_path, 1, {}, False, None))
    argv = {
        "convert": ["convert", str(model_folder(tmp_path / "source")), str(tmp_path / "out")],
        "eval": ["eval", "default"],
        "train": ["train", "--output-dir", str(tmp_path / "run")],
        "compare": ["compare", str(model_folder(tmp_path / "model")), "--data", "docs", "--output-dir", "study"],
    }[command]
    args = ReadOptions(cli.parse_args(argv))
    module, function = cli.COMMANDS[command].run.split(":")
    assert getattr(importlib.import_module(module), function)(args) == 0
    assert sorted(set(vars(args)) - args.read - {"read", "command"}) == []


@pytest.mark.parametrize("command", ["convert", "demo"])
def test_device_reaches_the_code_that_runs_the_models(command, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(conversion, "convert_checkpoint", lambda *args, **options: calls.append(options))
    monkeypatch.setattr(demo, "demo", lambda *args, **options: calls.append(options))
    monkeypatch.setattr(demo, "results_summary", lambda result: "")
    model_folder(tmp_path / "source")
    arguments = [tmp_path / "source", tmp_path / "out"] if command == "convert" else ["--source", tmp_path / "source"]
    exit_code, _, error = run_cli(command, *arguments, "--device", "cuda:1")
    assert (exit_code, error) == (0, "")
    assert [options["device"] for options in calls] == ["cuda:1"]


# --------------------------------------------------------------------------------------------------------------------
# Model arguments
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["./my-llama", "/no/such/model", "~/no-such-model", "runs/exp1/model"])
def test_a_missing_folder_is_named(path, tmp_path, nothing_loads):
    exit_code, _, error = run_cli("convert", path, tmp_path / "out")
    assert exit_code == 1 and error == f"attnres convert: error: no such folder: {path}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("compared", [["./missing"], ["{model}", "/no/such/model"]])
def test_each_compared_model_of_analyze_is_checked_like_the_model(compared, tmp_path, nothing_loads):
    model = model_folder(tmp_path / "model")
    compared = [path.format(model=model) for path in compared]
    exit_code, _, error = run_cli("analyze", model, "--compare", *compared, "--output", tmp_path / "out")
    assert exit_code == 1 and error == f"attnres analyze: error: no such folder: {compared[-1]}\n"
    assert not (tmp_path / "out").exists()


def test_a_file_is_not_a_model_folder(tmp_path, nothing_loads):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    exit_code, _, error = run_cli("convert", tmp_path / "model.gguf", tmp_path / "out")
    assert exit_code == 1 and "is a file; a model is a folder" in error and "--gguf-file model.gguf" in error


def test_unreachable_hub_fails_once_before_anything_loads(monkeypatch, tmp_path, nothing_loads):
    attempts = []

    def refused_connection(address, timeout):
        attempts.append(address)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sources.socket, "create_connection", refused_connection)
    exit_code, _, error = run_cli("convert", "someone/my-llama", tmp_path / "out")
    assert exit_code == 1 and len(attempts) == 1
    assert "someone/my-llama is not a local folder and the Hub (" in error and ") is unreachable" in error


def no_network(*args, **kwargs):
    raise AssertionError("offline, the network was used")


@pytest.mark.parametrize("offline_by", ["--offline", "HF_HUB_OFFLINE"])
def test_offline_never_touches_the_network(offline_by, monkeypatch, tmp_path, nothing_loads):
    monkeypatch.setattr(sources.socket, "create_connection", no_network)
    monkeypatch.setattr(sources, "repo_exists", no_network)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", offline_by == "HF_HUB_OFFLINE")
    options = ["--offline"] if offline_by == "--offline" else []
    for argv in (
        ["convert", "someone/my-llama", tmp_path / "out", *options],
        ["eval", "someone/my-llama", "--tasks", "gpqa", "--output", tmp_path / "eval", *options],
        ["analyze", "someone/my-llama", "--output", tmp_path / "analysis", *options],
    ):
        exit_code, _, error = run_cli(*argv)
        assert exit_code == 1 and "someone/my-llama is not a local folder, and offline" in error, error
        assert "Hugging Face cache" in error and "Traceback" not in error
    assert not any((tmp_path / name).exists() for name in ("out", "eval", "analysis"))


def test_offline_hub_id_in_the_cache_is_accepted(monkeypatch, tmp_path):
    snapshot = tmp_path / "models--someone--my-llama" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "models--someone--my-llama" / "refs").mkdir()
    (tmp_path / "models--someone--my-llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(sources.socket, "create_connection", no_network)
    assert sources.resolve_source("someone/my-llama", offline=True) == ("someone/my-llama", None)
    with pytest.raises(SourceError, match="a copy is in the Hugging Face cache: pass --offline"):
        monkeypatch.setattr(sources, "hub_reachable", lambda: False)
        sources.resolve_source("someone/my-llama", offline=False)


@pytest.mark.parametrize("command", ["eval", "analyze"])
@pytest.mark.parametrize("missing", ["model", "baseline"])
def test_both_models_are_checked_before_either_loads(command, missing, tmp_path, nothing_loads):
    folder = model_folder(tmp_path / "model")
    model, baseline = (tmp_path / "missing", folder) if missing == "model" else (folder, tmp_path / "missing")
    exit_code, _, error = run_cli(command, model, "--baseline", baseline, "--output", tmp_path / "out")
    assert exit_code == 1 and error == f"attnres {command}: error: no such folder: {tmp_path / 'missing'}\n"


def test_evaluate_checks_its_models_before_loading(tmp_path, nothing_loads):
    with pytest.raises(SourceError, match="no such folder"):
        harness.evaluate(
            tmp_path,
            baseline="./missing",
            tasks=["gpqa"],
            output_dir=tmp_path / "out",
            offline=True,
            data_dir="fixtures",
        )


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


def test_a_bug_shows_its_traceback(monkeypatch, tmp_path):
    def broken(args):
        raise ValueError("a bug, not the user's mistake")

    monkeypatch.setattr("attnres.analysis.run_analyze", broken)
    with pytest.raises(ValueError, match="a bug"):
        run_cli("analyze", model_folder(tmp_path))


@pytest.mark.parametrize("debug_by", ["--debug", "ATTNRES_DEBUG"])
def test_debug_shows_the_traceback_of_user_errors_too(debug_by, monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNRES_DEBUG", "1" if debug_by == "ATTNRES_DEBUG" else "0")
    options = ["--debug"] if debug_by == "--debug" else []
    with pytest.raises(SourceError, match="no such folder"):
        run_cli("convert", "./my-llama", tmp_path / "out", *options)


@pytest.mark.parametrize(("command", "missing", "extra"), [("eval", "lm_eval", "eval"), ("demo", "peft", "all")])
def test_a_missing_extra_names_the_install_line(command, missing, extra, monkeypatch, tmp_path):
    def without_extra(args):
        raise ModuleNotFoundError(f"No module named '{missing}'", name=missing)

    module, function = cli.COMMANDS[command].run.split(":")
    monkeypatch.setattr(f"{module}.{function}", without_extra)
    model = ["default"] if command == "eval" else []
    exit_code, _, error = run_cli(command, *model, "--output", tmp_path / "out")
    assert exit_code == 1
    assert error == f'attnres {command}: error: {missing} is not installed: pip install "attnres[{extra}]"\n'


def test_missing_gguf_package_names_its_extra(monkeypatch):
    real_find_spec = sources.importlib.util.find_spec
    monkeypatch.setattr(
        sources.importlib.util, "find_spec", lambda name: None if name == "gguf" else real_find_spec(name)
    )
    with pytest.raises(SourceError, match=r'pip install "attnres\[gguf\]"'):
        sources.resolve_source(str(Path.cwd()), gguf_file="model.gguf")


def test_the_lean_core_converts_and_each_command_names_its_extra(tmp_path):
    """With no extra installed (their modules made unimportable in a fresh Python): a safetensors checkpoint
    converts, loads through the Auto classes, and each command that needs an extra names its pip line."""
    script = f"""
import sys
for name in {tuple(cli.EXTRAS)!r}:
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError; find_spec says it is not installed
from contextlib import redirect_stderr
from io import StringIO
from tiny import tiny_source_model, tiny_tokenizer
from attnres_cli import command as cli
tiny_source_model("llama").save_pretrained({str(tmp_path / "source")!r})
tiny_tokenizer().save_pretrained({str(tmp_path / "source")!r})
assert cli.main(["convert", {str(tmp_path / "source")!r}, {str(tmp_path / "converted")!r}]) == 0
from transformers import AutoModelForCausalLM
assert type(AutoModelForCausalLM.from_pretrained({str(tmp_path / "converted")!r})).__name__ == "AttnResForCausalLM"
for argv in (["train", "--output-dir", "run"], ["eval", "default"], ["analyze", {str(tmp_path / "converted")!r}]):
    stderr = StringIO()
    with redirect_stderr(stderr):
        assert cli.main(argv) == 1
    print(stderr.getvalue().strip())
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.splitlines()[-3:] == [
        'attnres train: error: accelerate is not installed: pip install "attnres[train]"',
        'attnres eval: error: lm_eval is not installed: pip install "attnres[eval]"',
        'attnres analyze: error: matplotlib is not installed: pip install "attnres[plots]"',
    ]
