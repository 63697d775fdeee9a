"""Nothing a user owns is lost: no command writes into, replaces or wraps what it reads (models, datasets, texts, data
folders) or the current or home folder, however the paths are spelled and with --overwrite too; every mistake a user
can fix is one line on stderr, with nothing written; and commands keep other libraries' notices to themselves."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import run_cli, tiny_source_model, tiny_tokenizer

ATTNRES_COMMAND = str(Path(sys.executable).with_name("attnres"))  # the console script
OFFLINE_EVAL = ("--tasks", "gpqa", "--offline", "--data-dir", "fixtures")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """`source` (a tiny Llama with its tokenizer), `notok` (the same without one), `empty` (no model), `data` (a text
    corpus that also holds the GPQA file `attnres eval` asks for) and `texts/sample.txt`."""
    root = tmp_path_factory.mktemp("inputs")
    model = tiny_source_model("llama", num_layers=2)
    model.save_pretrained(root / "source")
    tiny_tokenizer().save_pretrained(root / "source")
    model.save_pretrained(root / "notok")
    for folder, name in (("empty", "notes.txt"), ("data", "corpus.txt"), ("texts", "sample.txt")):
        (root / folder).mkdir()
        (root / folder / name).write_text("def add(a, b):\n    return a + b\n" * 50)
    (root / "data" / "gpqa_diamond.csv").write_text("Question,Correct Answer\n")
    damaged = {  # a broken copy of `source` each: what is broken in it
        "badjson": lambda folder: (folder / "config.json").write_text("{not json"),
        "notype": lambda folder: (folder / "config.json").write_text(json.dumps(without_model_type(folder))),
        "unknowntype": lambda folder: (folder / "config.json").write_text(json.dumps(with_model_type(folder))),
        "truncated": lambda folder: (folder / "model.safetensors").write_bytes(
            (folder / "model.safetensors").read_bytes()[:1000]
        ),
        "notgguf": lambda folder: (folder / "model.gguf").write_text("not a GGUF file"),
    }
    for name, damage in damaged.items():
        shutil.copytree(root / "source", root / name)
        damage(root / name)
    (root / "emptytxt").mkdir()
    for index in range(3):
        (root / "emptytxt" / f"{index}.txt").write_text("")
    (root / "afile").write_text("a file of the user's")
    return root


def without_model_type(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    return config


def with_model_type(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text()) | {"model_type": "banana"}


@pytest.fixture
def work(inputs, tmp_path) -> Path:
    """The user's working folder, which holds a file of theirs; beside it, links to each input (`../source`, ...)."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mine.txt").write_text("the user's own file")
    for name in ("source", "notok", "empty", "data", "texts", "badjson", "notype", "unknowntype", "truncated",
                 "notgguf", "emptytxt", "afile"):  # fmt: skip
        (tmp_path / name).symlink_to(inputs / name)
    (tmp_path / "work" / "source-link").symlink_to(inputs / "source")
    return tmp_path / "work"


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (links not followed) by its relative path, with its bytes."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


# --------------------------------------------------------------------------------------------------------------------
# Outputs never touch the inputs
# --------------------------------------------------------------------------------------------------------------------

# (argv run in `work`; the refusal's words). Inputs through links (`../source`) and spelled `m/`, `./m`, `../x/m`;
# outputs the same folder as an input (also through a link), one inside it, one around it.
REFUSALS = {
    "convert-onto-its-source": (["convert", "../source", "../source", "--overwrite"], "is the source model"),
    "convert-spelled-differently": (["convert", "../source/", "./.././source", "--overwrite"], "is the source model"),
    "convert-onto-a-link-to-it": (["convert", "../source", "source-link", "--overwrite"], "is the source model"),
    "convert-inside-its-source": (["convert", "../source", "../source/attnres"], "lies inside the source model"),
    "convert-around-its-source": (["convert", "../source", "{inputs}", "--overwrite"], "contains the source model"),
    "train-onto-its-model": (["train", "--model", "../source", "--output-dir", "source-link"], "is the model"),
    "train-resume-inside-its-model": (
        ["train", "--model", "../source", "--output-dir", "../source/run", "--resume"],
        "lies inside the model",
    ),
    "train-inside-its-dataset": (
        ["train", "--model", "../source", "--dataset", "../data", "--output-dir", "../data/run"],
        "lies inside the dataset",
    ),
    "demo-inside-its-source": (["demo", "--source", "../source", "--output", "../source/demo"], "lies inside"),
    "analyze-onto-its-model": (["analyze", "../source", "--output", "../source/"], "is the model"),
    "analyze-inside-its-baseline": (
        ["analyze", "../source", "--baseline", "../notok", "--output", "../notok/analysis"],
        "lies inside the baseline",
    ),
    "analyze-around-its-text": (
        ["analyze", "../source", "--text", "../texts/sample.txt", "--output", "../texts"],
        "contains the text",
    ),
    "eval-inside-its-model": (["eval", "../source", *OFFLINE_EVAL, "--output", "../source/eval"], "lies inside"),
    "eval-onto-its-baseline": (
        ["eval", "default", "--baseline", "../source", *OFFLINE_EVAL, "--output", "source-link"],
        "is the baseline",
    ),
    "eval-into-its-data": (
        ["eval", "../source", "--tasks", "gpqa", "--offline", "--data-dir", "../data", "--output", "../data"],
        "is the data folder",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_no_command_writes_onto_into_or_around_what_it_reads(case, inputs, work, monkeypatch):
    argv, refusal = REFUSALS[case]
    monkeypatch.chdir(work)
    before = files(inputs), files(work)
    exit_code, _, error = run_cli(*(arg.format(inputs=inputs) for arg in argv))
    assert exit_code == 1 and error.count("\n") == 1, error
    assert refusal in error and "choose another output folder" in error, error
    assert (files(inputs), files(work)) == before  # the same files with the same bytes, and nothing added


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "../source", "."],
        ["convert", "../source", ".", "--overwrite"],
        ["convert", "../source", "..", "--overwrite"],
        ["train", "--model", "../source", "--output-dir", ".", "--resume"],
        ["analyze", "../source", "--output", "."],
    ],
    ids=["convert", "convert-overwrite", "convert-around-it", "train-resume", "analyze"],
)
def test_the_current_folder_is_no_output(argv, inputs, work, monkeypatch):
    """Neither --overwrite nor --resume lets a command replace, fill or wrap the folder the user works in."""
    monkeypatch.chdir(work)
    before = files(work.parent)
    exit_code, _, error = run_cli(*argv)
    relation = "contains" if argv[2] == ".." else "is"
    assert exit_code == 1 and f"{relation} the current folder" in error and "name a new folder" in error, error
    assert files(work.parent) == before


def test_resume_writes_into_its_own_output(inputs, tmp_path):
    """A run's checkpoints are its own output, not an input: `--resume` passes the check."""
    from attnres.folders import check_output_dir

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    check_output_dir(tmp_path / "run", RuntimeError, {"the model": inputs / "source", "the dataset": None}, None)


# --------------------------------------------------------------------------------------------------------------------
# Every mistake is one line, and nothing is written
# --------------------------------------------------------------------------------------------------------------------

# (argv run in `work`, with HOME another folder of the user's; words of the one line)
MISTAKES = {
    "convert-into-the-current-folder": (["convert", "../source", ".", "--overwrite"], "is the current folder"),
    "convert-into-home": (["convert", "../source", "{home}", "--overwrite"], "is your home folder"),
    "demo-into-the-current-folder": (["demo", "--source", "../source", "--output", "."], "is the current folder"),
    "convert-onto-its-source": (["convert", "../source", "../source", "--overwrite"], "is the source model"),
    "convert-no-model": (["convert", "../empty", "out"], "../empty is not a model folder (it has no config.json)"),
    "analyze-no-model": (["analyze", "../empty", "--output", "out"], "is not a model folder"),
    "eval-no-model": (["eval", "../empty", *OFFLINE_EVAL, "--output", "out"], "is not a model folder"),
    "train-no-model": (["train", "--model", "../empty", "--output-dir", "out"], "is not a model folder"),
    "train-no-tokenizer": (["train", "--model", "../notok", "--output-dir", "out"], "../notok has no tokenizer"),
    "analyze-no-tokenizer": (["analyze", "../notok", "--output", "out"], "has no tokenizer"),
    "eval-no-tokenizer": (["eval", "../notok", *OFFLINE_EVAL, "--output", "out"], "has no tokenizer"),
    "train-negative-clipping": (["train", "--max-grad-norm", "-1", "--output-dir", "out"], "--max-grad-norm must be"),
    "train-infinite-lr": (["train", "--lr", "inf", "--output-dir", "out"], "--lr must be a positive number, got inf"),
    "train-block-size-without-convert": (["train", "--block-size", "2", "--output-dir", "out"], "add --convert"),
    "convert-full-with-blocks": (["convert", "../source", "out", "--mode", "full", "--block-size", "2"], "Full"),
    "convert-shard-size-lots": (["convert", "../source", "out", "--max-shard-size", "lots"], "pass a size such as"),
    "convert-shard-size-zero": (["convert", "../source", "out", "--max-shard-size", "0"], "pass a size such as"),
    "convert-device-banana": (["convert", "../source", "out", "--device", "banana"], "--device banana: not a device"),
    "analyze-negative-tokens": (["analyze", "../source", "--tokens", "-5", "--output", "out"], "--tokens must be at"),
    "analyze-missing-text": (["analyze", "../source", "--text", "missing.txt", "--output", "out"], "no such file"),
    "config-not-json": (["convert", "../badjson", "out"], "../badjson: its config.json is not valid JSON"),
    "config-without-model-type": (["convert", "../notype", "out"], "names no model_type"),
    "config-unknown-model-type": (["convert", "../unknowntype", "out"], "model_type 'banana' is not one"),
    "weights-truncated": (["convert", "../truncated", "out"], "model.safetensors does not load"),
    "not-a-gguf-file": (["convert", "../notgguf", "out", "--gguf-file", "model.gguf"], "is not a GGUF file"),
    "output-under-a-file": (["convert", "../source", "../afile/out"], "../afile is a file, not a folder"),
    "gguf-file-not-there": (
        ["convert", "../source", "out", "--gguf-file", "model.gguf"],
        "has no GGUF file model.gguf",
    ),
}


# Where libraries keep their caches (matplotlib, Hugging Face) when HOME is moved: where they were
CACHES = {
    "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")),
    "XDG_CONFIG_HOME": os.environ.get("XDG_CONFIG_HOME", str(Path.home() / ".config")),
}


# Mistakes found only once the documents are read: `datasets` shows its progress before the one line
DATA_MISTAKES = {
    "train-on-empty-texts": (["train", "--model", "../source", "--dataset", "../emptytxt", "--output-dir", "out"],
                             "packs into 0 training sequences"),  # fmt: skip
    "train-on-one-document": (["train", "--model", "../source", "--dataset", "../texts/sample.txt", "--output-dir",
                               "out"], "holds 1 document(s)"),  # fmt: skip
}


@pytest.mark.parametrize("case", {**MISTAKES, **DATA_MISTAKES})
def test_each_mistake_is_one_line_and_writes_nothing(case, inputs, work):
    argv, words = {**MISTAKES, **DATA_MISTAKES}[case]
    home = work.parent / "home"
    home.mkdir()
    (home / "mine.txt").write_text("the user's own file")
    argv = [arg.format(home=home) for arg in argv]
    env = {
        **os.environ,
        **CACHES,
        "HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "ATTNRES_DEBUG": "0",
    }
    before = files(work.parent), files(inputs)
    child = subprocess.run([ATTNRES_COMMAND, *argv], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 1 and child.stdout == "", child.stdout + child.stderr[-3000:]
    error = child.stderr if case in MISTAKES else child.stderr.splitlines(keepends=True)[-1]
    assert error.startswith(f"attnres {argv[0]}: error: ") and error.count("\n") == 1, child.stderr
    assert words in error and "Traceback" not in child.stderr
    assert (files(work.parent), files(inputs)) == before


# --------------------------------------------------------------------------------------------------------------------
# Quiet by default
# --------------------------------------------------------------------------------------------------------------------

NOTICES = ("Setting accelerator to CPU", "fatal: not a git repository")  # DeepSpeed's goes to stdout
DEEPSPEED_NOTICE_EXPECTED = importlib.util.find_spec("deepspeed") is not None and not torch.cuda.is_available()


def attnres(*argv, cwd: Path, debug: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ATTNRES_DEBUG": "1" if debug else "0"}
    child = subprocess.run(
        [ATTNRES_COMMAND, *map(str, argv)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return child


def test_commands_keep_other_libraries_notices_to_themselves(inputs, tmp_path):
    """Outside a git repository, with DeepSpeed installed on a machine without a GPU: neither DeepSpeed's notice
    that it found no GPU nor the failure of lm-eval's git probe reaches the terminal."""
    convert = attnres("convert", inputs / "source", "converted", cwd=tmp_path)
    evaluate = attnres("eval", "converted", *OFFLINE_EVAL, "--limit", "1", "--output", "results", cwd=tmp_path)
    for child in (convert, evaluate):
        output = child.stdout + child.stderr
        assert not any(notice in output for notice in NOTICES), output


@pytest.mark.skipif(not DEEPSPEED_NOTICE_EXPECTED, reason="DeepSpeed gives its notice on machines without a GPU")
def test_debug_shows_other_libraries_notices(inputs, tmp_path):
    child = attnres("convert", inputs / "source", "converted", "--no-verify", cwd=tmp_path, debug=True)
    assert "Setting accelerator to CPU" in child.stdout
