"""Nothing a user owns is lost: no command writes into, replaces or wraps what it reads (models, datasets, texts, data
folders) or the current or home folder, however the paths are spelled and with --overwrite too; every mistake a user
can fix is one line on stderr, with nothing written; and commands keep other libraries' notices to themselves."""

import errno
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from tiny import attnres_twin, random_ids, run_cli, tiny_source_model, tiny_tokenizer
from transformers import AutoModelForCausalLM

from attnres.configuration_attnres import AttnResConfigError
from attnres.data import first_non_text_byte
from attnres.folders import InterruptedReplaceError, format_size, put_in_place

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
    (root / "latin1").mkdir()
    (root / "latin1" / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 50)
    (root / "latin1" / "b.txt").write_bytes("# déjà vu\n".encode("latin-1"))
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
                 "notgguf", "emptytxt", "afile", "latin1"):  # fmt: skip
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
    "analyze-onto-a-compared-model": (
        ["analyze", "../source", "--compare", "../notok", "--output", "../notok", "--overwrite"],
        "is --compare model 1",
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
    "convert-full-with-blocks": (
        ["convert", "../source", "out", "--mode", "full", "--block-size", "2"],
        "--mode full has none",
    ),
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
    "train-on-empty-texts": (
        ["train", "--model", "../source", "--dataset", "../emptytxt", "--output-dir", "out"],
        "packs into 0 training sequences",
    ),  # fmt: skip
    "train-on-one-document": (
        ["train", "--model", "../source", "--dataset", "../texts/sample.txt", "--output-dir", "out"],
        "holds 1 document(s)",
    ),  # fmt: skip
    "train-on-latin-1": (
        ["train", "--model", "../source", "--dataset", "../latin1", "--output-dir", "out"],
        "../latin1/b.txt is not UTF-8 text: at byte offset 3, 0xe9 is no part of valid UTF-8; convert it to UTF-8",
    ),  # fmt: skip
}


# One command line a case, each a process of its own (about 5 s): the fast tier tries one mistake of each command
FAST_MISTAKES = (
    "convert-no-model", "train-no-model", "eval-no-model", "analyze-no-model", "demo-into-the-current-folder",
    "train-on-latin-1",
)  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        case if case in FAST_MISTAKES else pytest.param(case, marks=pytest.mark.slow)
        for case in {**MISTAKES, **DATA_MISTAKES}
    ],
)
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


@pytest.mark.slow  # starts the command (convert, eval) in processes of its own
def test_commands_keep_other_libraries_notices_to_themselves(inputs, tmp_path):
    """Outside a git repository, with DeepSpeed installed on a machine without a GPU: neither DeepSpeed's notice
    that it found no GPU nor the failure of lm-eval's git probe reaches the terminal."""
    convert = attnres("convert", inputs / "source", "converted", cwd=tmp_path)
    evaluate = attnres("eval", "converted", *OFFLINE_EVAL, "--limit", "1", "--output", "results", cwd=tmp_path)
    for child in (convert, evaluate):
        output = child.stdout + child.stderr
        assert not any(notice in output for notice in NOTICES), output


@pytest.mark.skipif(not DEEPSPEED_NOTICE_EXPECTED, reason="DeepSpeed gives its notice on machines without a GPU")
@pytest.mark.slow  # starts the command (convert, eval) in processes of its own
def test_debug_shows_other_libraries_notices(inputs, tmp_path):
    child = attnres("convert", inputs / "source", "converted", "--no-verify", cwd=tmp_path, debug=True)
    assert "Setting accelerator to CPU" in child.stdout


# --------------------------------------------------------------------------------------------------------------------
# Faults: a full disk, an --overwrite stopped halfway, an upload that cannot succeed, text that is not text
# --------------------------------------------------------------------------------------------------------------------

FREE_BYTES = 123_456  # what the stand-in of `shutil.disk_usage` says is free
DISK_FULL_ERRORS = {
    "oserror": lambda path: OSError(errno.ENOSPC, "No space left on device", str(path)),
    "safetensors": lambda path: SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    ),
}


@pytest.fixture
def little_free_space(monkeypatch):
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=FREE_BYTES))


def filling_the_disk(make_error, written_bytes: int = 100):
    """A writer that writes part of its file, as on a disk that fills up, then fails as `make_error` says."""

    def write(*args, **kwargs):
        path = Path(args[1])
        path.write_bytes(b"\0" * written_bytes)
        raise make_error(path)

    return write


def hidden_leftovers(folder: Path) -> list[str]:
    """Staging and set-aside folders and lock files under `folder`: what a failed write must not leave."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob(".*"))


@pytest.mark.parametrize("kind", DISK_FULL_ERRORS)
def test_a_full_disk_during_convert_is_one_line_and_leaves_nothing(kind, inputs, tmp_path, little_free_space,
                                                                    monkeypatch):  # fmt: skip
    """The converted model's weights are 277.2 kB, the size of the model.safetensors a conversion writes."""
    exit_code, _, error = run_cli("convert", inputs / "source", tmp_path / "whole", "--no-verify")
    assert exit_code == 0, error
    assert format_size((tmp_path / "whole" / "model.safetensors").stat().st_size) == "277.2 kB"
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", filling_the_disk(DISK_FULL_ERRORS[kind]))
    output = tmp_path / "out"
    exit_code, printed, error = run_cli("convert", inputs / "source", output, "--no-verify")
    assert (exit_code, printed) == (1, ""), error
    assert error.splitlines()[-1] == (
        f"attnres convert: error: the disk is full: writing {output} needs about 274.2 kB, and 123.5 kB is free there; "
        "free up space, or choose an output folder on another disk"
    )
    assert "Traceback" not in error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["whole"]  # no output, no `.out.partial`, no lock


def training_data(folder: Path) -> Path:
    folder.mkdir()
    for index in range(4):
        (folder / f"{index}.txt").write_text(f"def add_{index}(a, b):\n    return a + b\n" * 60)
    return folder


TRAIN_TWO_STEPS = ("--max-steps", "2", "--save-every", "1", "--seq-len", "32", "--batch-size", "2", "--eval-size", "1",
                   "--max-eval-sequences", "2", "--eval-every", "100", "--log-every", "1")  # fmt: skip


@pytest.mark.parametrize("kind", DISK_FULL_ERRORS)
def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_earlier_ones(
    kind, inputs, tmp_path, little_free_space, monkeypatch
):
    """The second checkpoint fails after writing its weights: the half-written checkpoint goes, the first stays."""
    import accelerate.checkpointing

    real_save = accelerate.checkpointing.save
    fail = filling_the_disk(DISK_FULL_ERRORS[kind])

    def save(obj, path, *args, **kwargs):
        second_optimizer_state = (Path(path).parent.name, Path(path).name) == (".step-2.partial", "optimizer.bin")
        return (fail if second_optimizer_state else real_save)(obj, path, *args, **kwargs)

    monkeypatch.setattr(accelerate.checkpointing, "save", save)
    output = tmp_path / "run"
    data = training_data(tmp_path / "data")
    argv = ("train", "--model", inputs / "source", "--dataset", data, "--output-dir", output, *TRAIN_TWO_STEPS)
    exit_code, printed, error = run_cli(*argv)
    assert exit_code == 1, error
    assert error.splitlines()[-1] == (
        f"attnres train: error: the disk is full: writing {output}/checkpoints/step-2 needs about 815.0 kB, and "
        "123.5 kB is free there; free up space, or rerun with --resume from the checkpoints saved before it, which "
        "are intact"
    )
    assert "Traceback" not in error
    assert [path.name for path in (output / "checkpoints").iterdir()] == ["step-1"]
    assert hidden_leftovers(output) == [] and not (tmp_path / ".run.lock").exists()


def test_a_full_disk_that_no_command_described_is_still_one_line(monkeypatch, tmp_path):
    def full(args):
        raise DISK_FULL_ERRORS["safetensors"](None)

    monkeypatch.setattr("attnres.hub.run_push", full)
    exit_code, _, error = run_cli("push", tmp_path, "me/model")
    assert exit_code == 1
    assert error == (
        "attnres push: error: the disk is full (Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
        'message: "No space left on device" })); free up space, or write to another disk\n'
    )


def stop_between_the_renames(monkeypatch):
    """A kill between `put_in_place`'s two renames: the staged folder never moves in."""
    real_rename = Path.rename

    def rename(self, target):
        if self.name.endswith(".partial"):
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)


def test_an_overwrite_stopped_halfway_keeps_the_old_output_and_says_where(inputs, tmp_path, monkeypatch):
    output, previous = tmp_path / "out", tmp_path / ".out.previous"
    assert run_cli("convert", inputs / "source", output, "--no-verify")[0] == 0
    (output / "mine.txt").write_text("the user's note")
    old_files = files(output)
    with monkeypatch.context() as patch:
        stop_between_the_renames(patch)
        exit_code, _, error = run_cli("convert", inputs / "source", output, "--no-verify", "--overwrite")
    assert exit_code == 130 and f"Replacing {output}: the old output is in {previous} until the new one is in" in error
    assert not output.exists() and files(previous) == old_files

    refusal = (
        f"attnres convert: error: {output} is missing: an earlier --overwrite was stopped while replacing it, and the "
        f"old output is in {previous}; restore it (mv {previous} {output}) or delete {previous}, then rerun\n"
    )
    for argv in (["--overwrite"], []):  # the next --overwrite deletes nothing; nor does a run without it write
        assert run_cli("convert", inputs / "source", output, "--no-verify", *argv) == (1, "", refusal)
        assert not output.exists() and files(previous) == old_files

    previous.rename(output)  # as the message says
    assert run_cli("convert", inputs / "source", output, "--no-verify", "--overwrite")[0] == 0
    assert "mine.txt" not in files(output) and sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def test_put_in_place_never_deletes_the_only_copy(tmp_path):
    (tmp_path / ".out.previous").mkdir()
    (tmp_path / ".out.previous" / "model.safetensors").write_text("the old model")
    (tmp_path / ".out.partial").mkdir()
    with pytest.raises(InterruptedReplaceError, match=r"out is missing: an earlier --overwrite was stopped"):
        put_in_place(tmp_path / ".out.partial", tmp_path / "out")
    assert (tmp_path / ".out.previous" / "model.safetensors").read_text() == "the old model"
    # A replacement killed after its second rename leaves the older output beside the newer one: that one goes
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("the newer model")
    (tmp_path / ".out.partial" / "model.safetensors").write_text("the newest model")
    put_in_place(tmp_path / ".out.partial", tmp_path / "out")
    assert files(tmp_path) == {"out/model.safetensors": b"the newest model"}


@pytest.mark.parametrize("command", ["analyze", "eval"])
def test_analyze_and_eval_refuse_an_earlier_output_and_replace_it_whole(command, inputs, tmp_path):
    model = inputs / "source"
    if command == "analyze":  # which needs an AttnRes model
        model = tmp_path.parent / f"{tmp_path.name}-converted"
        assert run_cli("convert", inputs / "source", model, "--no-verify")[0] == 0
    output = tmp_path / "out"
    output.mkdir()
    (output / "results_source.json").write_text("{}")  # from an earlier comparison, with a baseline
    argv = [command, model, "--output", output]
    argv += ["--limit", "1", "--max-gen-toks", "4", *OFFLINE_EVAL] if command == "eval" else ["--tokens", "8"]
    exit_code, _, error = run_cli(*argv)
    refusal = f"{output} exists and is not empty; pass --overwrite (overwrite=True) to replace it"
    assert (exit_code, error) == (1, f"attnres {command}: error: {refusal}\n")
    assert files(output) == {"results_source.json": b"{}"}
    exit_code, _, error = run_cli(*argv, "--overwrite")
    assert exit_code == 0, error
    expected = (
        ["results_attnres.json", "summary.md"]
        if command == "eval"
        else ["analysis.json", "depth_weights.png", "gradients.png", "magnitudes.png", "mixing_matrices.png"]
    )
    assert sorted(files(output)) == expected and sorted(path.name for path in tmp_path.iterdir()) == ["out"]


@pytest.fixture
def no_hub_calls(monkeypatch):
    """Stand-ins for the token lookup and the Hub check: nothing reaches the network."""
    state = {"token": None, "reachable": False, "checked": 0}

    def reachable():
        state["checked"] += 1
        return state["reachable"]

    monkeypatch.setattr("attnres.hub.get_token", lambda: state["token"])
    monkeypatch.setattr("attnres.hub.hub_reachable", reachable)
    return state


NO_TOKEN = (
    "uploading to me/model needs a Hugging Face token, and none is set: run `huggingface-cli login`, or set HF_TOKEN"
)


@pytest.mark.parametrize("command", ["push", "convert", "train"])
def test_an_upload_without_a_token_is_refused_before_any_work(command, inputs, tmp_path, no_hub_calls):
    output = tmp_path / "out"
    argv = {
        "push": ["push", inputs / "source", "me/model"],
        "convert": ["convert", inputs / "source", output, "--push-to-hub", "me/model"],
        "train": ["train", "--model", inputs / "source", "--output-dir", output, "--push-to-hub", "me/model"],
    }[command]
    assert run_cli(*argv) == (1, "", f"attnres {command}: error: {NO_TOKEN}\n")
    assert no_hub_calls["checked"] == 0 and list(tmp_path.iterdir()) == []


def test_an_upload_without_the_hub_is_refused_before_any_work(inputs, tmp_path, no_hub_calls):
    from huggingface_hub import constants

    no_hub_calls["token"] = "hf_stand_in"
    output = tmp_path / "out"
    assert run_cli("convert", inputs / "source", output, "--push-to-hub", "me/model") == (
        1,
        "",
        f"attnres convert: error: uploading to me/model needs the Hub, and {constants.ENDPOINT} cannot be reached: "
        "check the network (or HF_ENDPOINT), or leave out the upload and run `attnres push` later\n",
    )
    assert no_hub_calls["checked"] == 1 and list(tmp_path.iterdir()) == []
    assert run_cli("convert", inputs / "source", output, "--push-to-hub", "me/model", "--offline") == (
        1,
        "",
        "attnres convert: error: uploading to me/model needs the network, which offline mode (--offline or "
        "HF_HUB_OFFLINE=1) forbids: turn it off, or leave out the upload\n",
    )
    assert no_hub_calls["checked"] == 1 and list(tmp_path.iterdir()) == []


TEXT_THAT_IS_NOT_UTF8 = {  # file contents -> (offset of the first such byte in them, what it is)
    "latin-1": ("déjà vu".encode("latin-1"), 1, "0xe9 is no part of valid UTF-8"),
    "binary": (b"PK\x03\x04\x00\x00", 4, "a NUL byte, as in binary files"),
    "a character cut at the end": ("ok €".encode()[:-1], 3, "0xe2 is no part of valid UTF-8"),
}


@pytest.mark.parametrize("case", TEXT_THAT_IS_NOT_UTF8)
def test_a_text_file_that_is_not_utf8_is_refused_with_its_offset(case, tmp_path):
    from attnres.data import DataError, load_documents

    content, offset, what = TEXT_THAT_IS_NOT_UTF8[case]
    training_data(tmp_path / "data")
    (tmp_path / "data" / "2.txt").write_bytes("café ".encode() * 10 + content)  # 60 bytes of UTF-8 before it
    (tmp_path / "data" / "3.txt").write_bytes(content)  # sorted after the first such file, 2.txt
    expected = (
        f"{tmp_path / 'data' / '2.txt'} is not UTF-8 text: at byte offset {60 + offset}, {what}; convert it to UTF-8 "
        "(e.g. iconv -f latin1 -t utf-8) or remove it from the dataset"
    )
    for dataset in (tmp_path / "data", tmp_path / "data" / "2.txt"):  # a folder, and the file alone
        with pytest.raises(DataError) as refusal:
            load_documents(str(dataset), None, "train", streaming=False)
        assert str(refusal.value) == expected


def test_utf8_across_the_check_chunks_is_text(tmp_path, monkeypatch):
    monkeypatch.setattr("attnres.data.TEXT_CHECK_CHUNK", 3)
    (tmp_path / "text.txt").write_text("a€b€c€ — déjà vu", encoding="utf-8")  # characters cut by every chunk
    assert first_non_text_byte(tmp_path / "text.txt") is None
    (tmp_path / "text.txt").write_bytes("a€b€".encode() + b"\xff")
    assert first_non_text_byte(tmp_path / "text.txt") == (8, "0xff is no part of valid UTF-8")


@pytest.mark.parametrize(
    "edit, named",
    [
        (
            {"attnres_block_size": 1},
            "says attnres_block_size=1, but the weights saved with it were made with attnres_block_size=2",
        ),
        (
            {"attnres_mode": "rezero"},
            "says attnres_mode='rezero', but the weights saved with it were made with attnres_mode='block'",
        ),
    ],
    ids=["block-size", "rule"],
)
def test_a_config_edited_away_from_its_weights_is_refused_by_name(edit, named, tmp_path):
    """Editing a trained folder's depth layout in config.json would make the same weights compute something else
    (the block-size edit changes these logits by more than 0.1): loading refuses it, in Python and as one line from
    the command line; the same change asked for from Python is a deliberate choice and loads."""
    model = attnres_twin(tiny_source_model("llama", num_layers=4), seed=0, attnres_block_size=2)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    config_file = tmp_path / "model" / "config.json"
    saved = json.loads(config_file.read_text())
    assert saved["attnres_saved_layout"] == {"attnres_mode": "block", "attnres_block_size": 2}
    config_file.write_text(json.dumps(saved | edit))

    with pytest.raises(AttnResConfigError, match=re.escape(named)):
        AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    code, _, stderr = run_cli("analyze", tmp_path / "model", "--tokens", 8, "--output", tmp_path / "analysis")
    assert code == 1 and named in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "analysis").exists()

    config_file.write_text(json.dumps(saved))
    ids = random_ids()
    with torch.no_grad():
        saved_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "model")(ids).logits
        chosen = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attnres_block_size=1)
        assert chosen.config.attnres_block_size == 1
        assert (chosen(ids).logits - saved_logits).abs().max() > 0.1
