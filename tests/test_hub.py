"""`attnres push`: a converted or trained folder reaches a (stub) Hub byte for byte, with a model card that states the
source model, the block layout, the verification figures and the evaluation summary; bad input fails cleanly."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from hub_stub import HubStub
from huggingface_hub import constants
from tiny import run_cli, tiny_source_model, tiny_tokenizer

from attnres.conversion import convert_checkpoint
from attnres.training import train

ATTNRES_COMMAND = str(Path(sys.executable).with_name("attnres"))  # the console script
REPO_ID = "someone/tiny-attnres"
EVAL_SUMMARY = "| task | source | AttnRes |\n|---|---|---|\n| gpqa (fixture) | 0.25 | 0.50 |\n"
LAYOUT = "Block AttnRes, 2 decoder layer(s) per block: 2 blocks, opening at decoder layers 0, 2"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama source, its conversion (with an evaluation summary in `eval/`), and a short training run on it."""
    root = tmp_path_factory.mktemp("models")
    folders = {name: root / name for name in ("source", "converted", "trained")}
    tiny_source_model("llama", num_layers=4).save_pretrained(folders["source"])
    tiny_tokenizer().save_pretrained(folders["source"])
    convert_checkpoint(folders["source"], folders["converted"], block_size=2)
    (folders["converted"] / "eval").mkdir()
    (folders["converted"] / "eval" / "summary.md").write_text(EVAL_SUMMARY)

    texts = root / "texts"
    texts.mkdir()
    for index in range(6):
        (texts / f"{index}.txt").write_text(f"def f{index}(x):\n    return x * {index} + 1\n" * 20)
    with pytest.MonkeyPatch.context() as patch:  # a datasets cache of this module's own
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "datasets-cache"))
        train(
            output_dir=str(folders["trained"]),
            model=str(folders["converted"]),
            dataset=str(texts),
            seq_len=32,
            batch_size=2,
            max_steps=2,
            eval_size=2,
            max_eval_sequences=2,
            save_every=1,  # leaves checkpoints/ in the folder, which push must not upload
        )
    return folders


@pytest.fixture
def hub(monkeypatch):
    """A stub Hub that this process's huggingface_hub talks to."""
    with HubStub() as stub:
        monkeypatch.setattr(constants, "ENDPOINT", stub.endpoint)
        monkeypatch.setenv("HF_TOKEN", "hf_fake_token")
        yield stub


def files_on_disk(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_console_script_pushes_every_file_and_a_card_with_the_evaluation(folders):
    folder = folders["converted"]
    before = files_on_disk(folder)
    with HubStub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_fake_token", "HF_HUB_DISABLE_TELEMETRY": "1"}
        child = subprocess.run(
            [ATTNRES_COMMAND, "push", folder, REPO_ID], env=env, capture_output=True, text=True, timeout=300
        )
    assert child.returncode == 0, child.stderr[-3000:]
    assert "Uploaded" in child.stdout and REPO_ID in child.stdout
    assert hub.created_repos == [REPO_ID] and hub.create_requests[0].get("visibility") != "private"
    uploaded = hub.files[REPO_ID]
    assert uploaded.keys() == before.keys() and "eval/summary.md" in uploaded
    assert all(uploaded[name] == content for name, content in before.items() if name != "README.md")
    assert files_on_disk(folder) == before  # the card was built in memory

    card = uploaded["README.md"].decode()
    assert card.startswith(before["README.md"].decode().rstrip())  # the conversion card, then the evaluation
    assert card.startswith("---\nlibrary_name: transformers\n") and "\n# source with Attention Residuals\n" in card
    assert "Converted from `source` into Attention Residuals" in card and LAYOUT in card
    assert "## Verification" in card and "| max abs logit diff, converted vs source" in card
    assert "attention sdpa vs eager" in card  # the calibration of the logit limit
    assert card.endswith(f"## Evaluation\n\n{EVAL_SUMMARY}")
    assert str(folders["source"].parent) not in card  # names, not paths of this machine


def test_trained_export_card_names_the_source_and_what_was_done(folders, hub):
    folder = folders["trained"]
    origin = json.loads((folder / "attnres_origin.json").read_text())
    assert origin["source"] == "source" and origin["conversion"]["converted_by"] == "attnres convert"
    [run] = origin["training"]
    assert run["steps"] == 2 and run["tokens"] == 2 * 2 * 32 and run["dataset"] == "local files (texts)"
    assert [step for step, _ in run["held_out_loss"]] == [0, 2]
    shutil.rmtree(folders["converted"].parent / "renamed", ignore_errors=True)
    folders["converted"].rename(folders["converted"].parent / "renamed")  # the card needs only the trained folder
    try:
        exit_code, output, error = run_cli("push", folder, REPO_ID)
    finally:
        (folders["converted"].parent / "renamed").rename(folders["converted"])
    assert exit_code == 0, error

    uploaded = hub.files[REPO_ID]
    kept = {name: content for name, content in files_on_disk(folder).items() if not name.startswith("checkpoints/")}
    assert uploaded.keys() == kept.keys()
    assert all(uploaded[name] == content for name, content in kept.items())  # its card was written with the model

    card = uploaded["README.md"].decode()
    assert "\n# source with Attention Residuals\n" in card and "trained with Attention Residuals" not in card
    assert "Converted from `source` into Attention Residuals" in card
    assert "then trained for 128 tokens on local files (texts) with `attnres train`." in card and LAYOUT in card
    assert "Before training, run on the same fixed sample text" in card and "| greedy tokens identical | " in card
    assert (
        "## Training\n\n- `attnres train --train all` on local files (texts): 128 tokens in 2 optimizer steps" in card
    )
    assert "held-out loss" in card and "at step 0" in card and "at step 2." in card
    assert "## Evaluation" not in card  # no summary in this folder
    assert str(folders["source"].parent) not in card


def test_private_reaches_create_repo(folders, hub):
    exit_code, _, error = run_cli("push", folders["converted"], REPO_ID, "--private")
    assert exit_code == 0, error
    assert hub.create_requests[-1].get("visibility") == "private"


@pytest.mark.parametrize("kind", ["missing", "not a model"])
def test_a_folder_that_is_not_a_model_is_refused(kind, hub, tmp_path):
    folder = tmp_path / "folder"
    if kind == "not a model":
        folder.mkdir()
        (folder / "notes.txt").write_text("no model here")
    exit_code, _, error = run_cli("push", folder, REPO_ID)
    assert exit_code == 1 and "Traceback" not in error
    expected = "is not a folder" if kind == "missing" else "is not a model folder: it needs config.json and the weights"
    assert error.startswith(f"attnres push: error: {folder} {expected}")
    assert hub.created_repos == [] and hub.files == {}


def test_unreachable_endpoint_is_an_upload_error(folders, monkeypatch):
    with socket.socket() as unused:  # a port that nothing listens on once closed
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token")
    exit_code, _, error = run_cli("push", folders["converted"], REPO_ID)
    assert exit_code == 1 and error == (
        f"attnres push: error: uploading to {REPO_ID} needs the Hub, and http://127.0.0.1:{port} cannot be reached: "
        "check the network (or HF_ENDPOINT), or leave out the upload and run `attnres push` later\n"
    )


def test_plain_model_card_keeps_the_folders_own_readme(folders, hub, tmp_path):
    folder = tmp_path / "plain"
    shutil.copytree(folders["source"], folder)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n\n# My tiny Llama\n\nNotes of my own.\n")
    exit_code, _, error = run_cli("push", folder, REPO_ID)
    assert exit_code == 0, error
    card = hub.files[REPO_ID]["README.md"].decode()
    assert card.startswith("---\nlicense: mit\n---\n\n# plain\n")
    assert "`plain`: a plain `llama` model, without AttnRes." in card and "## Verification" not in card
    assert card.endswith("# My tiny Llama\n\nNotes of my own.\n")
