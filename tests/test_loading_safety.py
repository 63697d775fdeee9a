"""No model's code runs unasked: `import attnres` registers the model classes, so that AttnRes folders load through the
Auto classes with the installed code; every command loads them so, never the folder's copy of that code; and a folder
that needs code of its own (an `auto_map` in its config.json, for a model type transformers does not know) is refused
unless the user passes --trust-remote-code. As in transformers, a folder with an `auto_map` whose model type
transformers knows loads with transformers' class, and its code does not run.

Each folder's code here appends its path to a marker file when it runs, so that a test can tell whether it ran."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import MODEL_CODE, attnres_twin, run_cli, tiny_source_model, tiny_tokenizer
from transformers import LlamaForCausalLM, PreTrainedModel

from attnres.modeling_attnres import AUTO_MAP

MARKER_CODE = 'from pathlib import Path\n\nPath({marker!r}).open("a").write(__file__ + "\\n")\n'
# A folder's own code: transformers' Llama classes under other names, for the folder's model type
MARKER_CONFIGURATION = (
    "from transformers import LlamaConfig\n\n\nclass MarkerConfig(LlamaConfig):\n    model_type = {model_type!r}\n"
)
MARKER_MODELING = (
    "from transformers import LlamaForCausalLM\n\nfrom .configuration_marker import MarkerConfig\n\n\n"
    "class MarkerForCausalLM(LlamaForCausalLM):\n    config_class = MarkerConfig\n"
)
MARKER_AUTO_MAP = {
    "AutoConfig": "configuration_marker.MarkerConfig",
    "AutoModelForCausalLM": "modeling_marker.MarkerForCausalLM",
}
OFFLINE_EVAL = ("--offline", "--data-dir", "fixtures", "--tasks", "gpqa", "--limit", "1")


@pytest.fixture(scope="module")
def source():
    return tiny_source_model("llama", num_layers=3)


def tampered_attnres_folder(source, folder: Path, marker: Path) -> Path:
    """A saved AttnRes model whose copies of the model code write `marker`, then raise, when they run."""
    attnres_twin(source, seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    for name in MODEL_CODE:
        assert (folder / name).is_file(), f"save_pretrained wrote no {name} to tamper with"
        code = MARKER_CODE.format(marker=str(marker)) + "raise RuntimeError('the folder\\'s copy of the code ran')\n"
        (folder / name).write_text(code)
    return folder


def folder_with_code(source, folder: Path, marker: Path, model_type: str = "llama") -> Path:
    """A saved plain Llama model whose config.json maps the Auto classes to code in the folder that writes `marker`,
    under `model_type`: "llama", which transformers knows (as official Phi-3 and DeepSeek-V3 checkpoints carry an
    auto_map for model types transformers knows), or one it does not, whose model needs the folder's code."""
    source.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    configuration = MARKER_CONFIGURATION.format(model_type=model_type)
    (folder / "configuration_marker.py").write_text(MARKER_CODE.format(marker=str(marker)) + configuration)
    (folder / "modeling_marker.py").write_text(MARKER_CODE.format(marker=str(marker)) + MARKER_MODELING)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": model_type, "auto_map": MARKER_AUTO_MAP}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_import_attnres_registers_the_installed_classes(source, tmp_path):
    """In a fresh Python, `import attnres` alone lets the Auto classes load an AttnRes folder without
    trust_remote_code, with the installed classes (not a copy from the folder, whose code would write the marker)."""
    marker = tmp_path / "code-ran.txt"
    folder = tampered_attnres_folder(source, tmp_path / "attnres-model", marker)
    script = """
import sys

import attnres
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

folder = sys.argv[1]
loaded = [AutoConfig.from_pretrained(folder), AutoModel.from_pretrained(folder)]
loaded += [AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)]
installed = sys.modules["attnres.configuration_attnres"], sys.modules["attnres.modeling_attnres"]
expected = [installed[0].AttnResConfig, installed[1].AttnResModel, installed[1].AttnResForCausalLM]
assert [type(thing) for thing in loaded[:3]] == expected, [type(thing).__module__ for thing in loaded]
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

print(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["attnres"])
"""
    # A working folder of its own, so that no folder named attnres there stands in for the package; no stdin, so
    # that transformers' question "run the custom code?" would fail rather than wait
    child = subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == "['q_proj', 'v_proj']"
    assert not marker.exists()


@pytest.mark.parametrize("trust", [[], ["--trust-remote-code"]], ids=["plain", "trust-remote-code"])
def test_a_tampered_attnres_folder_runs_the_installed_code(trust, source, tmp_path):
    """`analyze` and `eval` run an AttnRes folder whose code was replaced, with the installed classes: the folder's
    code never runs, not even with --trust-remote-code."""
    marker = tmp_path / "code-ran.txt"
    folder = tampered_attnres_folder(source, tmp_path / "attnres-model", marker)
    text = tmp_path / "text.txt"
    text.write_text("Where each sublayer looks in depth. " * 4)
    analysis = run_cli("analyze", folder, "--text", text, "--tokens", 16, "--output", tmp_path / "analysis", *trust)
    assert analysis[0] == 0, analysis[2]
    assert json.loads((tmp_path / "analysis" / "analysis.json").read_text())["tokens"] == 16
    evaluation = run_cli("eval", folder, *OFFLINE_EVAL, "--output", tmp_path / "eval", *trust)
    assert evaluation[0] == 0, evaluation[2]
    assert (tmp_path / "eval" / "results_attnres.json").is_file()
    assert not marker.exists()


# (command line, with {code} for the folder that brings code, {attnres} an AttnRes folder and {out} an output)
COMMANDS_THAT_LOAD = {
    "convert": ["convert", "{code}", "{out}"],
    "train": ["train", "--model", "{code}", "--output-dir", "{out}"],
    "analyze": ["analyze", "{attnres}", "--baseline", "{code}", "--output", "{out}"],
    "eval": ["eval", "{code}", *OFFLINE_EVAL, "--output", "{out}"],
    "eval-baseline": ["eval", "{attnres}", "--baseline", "{code}", *OFFLINE_EVAL, "--output", "{out}"],
    "push": ["push", "{code}", "me/model"],
    "demo": ["demo", "--source", "{code}", "--output", "{out}"],
}


@pytest.mark.parametrize("case", COMMANDS_THAT_LOAD)
def test_a_folder_that_needs_its_code_is_refused_in_one_line(case, source, tmp_path):
    """A model type transformers does not know, with an auto_map: its folder's code would load it, so without
    --trust-remote-code every command refuses it before anything loads."""
    marker = tmp_path / "code-ran.txt"
    code = folder_with_code(source, tmp_path / "model-with-code", marker, model_type="marker_model")
    attnres = tampered_attnres_folder(source, tmp_path / "attnres-model", marker)
    output = tmp_path / "out"
    argv = [arg.format(code=code, attnres=attnres, out=output) for arg in COMMANDS_THAT_LOAD[case]]
    exit_code, printed, error = run_cli(*argv)
    assert (exit_code, printed) == (1, ""), error
    assert error.startswith(f"attnres {argv[0]}: error: {code} brings code of its own") and error.count("\n") == 1
    assert "AutoModelForCausalLM -> modeling_marker.MarkerForCausalLM" in error and "--trust-remote-code" in error
    assert not output.exists() and not marker.exists()


def test_trust_remote_code_runs_the_folders_code(source, tmp_path):
    """With --trust-remote-code, as in transformers, the folder's classes load it (its code runs); the converted
    model is AttnRes around transformers' own Llama classes, and names only its own code."""
    marker = tmp_path / "code-ran.txt"
    code = folder_with_code(source, tmp_path / "llama-with-code", marker)
    exit_code, _, error = run_cli("convert", code, tmp_path / "out", "--no-verify", "--trust-remote-code")
    assert exit_code == 0, error
    assert {Path(line).name for line in marker.read_text().splitlines()} == {
        "configuration_marker.py",
        "modeling_marker.py",
    }
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and "auto_map" not in config["text_config"]


# (command line, with {code} for the Llama folder with an auto_map, {attnres} an AttnRes folder and {out} an output)
COMMANDS_THAT_LOAD_A_KNOWN_TYPE = {
    "convert": ["convert", "{code}", "{out}"],
    "eval": ["eval", "{code}", *OFFLINE_EVAL, "--output", "{out}"],
    "analyze-baseline": ["analyze", "{attnres}", "--baseline", "{code}", "--tokens", "16", "--output", "{out}"],
}


@pytest.mark.parametrize("case", COMMANDS_THAT_LOAD_A_KNOWN_TYPE)
def test_a_known_model_type_with_an_auto_map_loads_with_transformers_class(case, source, tmp_path, monkeypatch):
    """As in transformers with trust_remote_code=False: a folder whose model type transformers knows (llama) loads
    with transformers' own class although its config.json has an auto_map, and none of the folder's code runs."""
    marker = tmp_path / "code-ran.txt"
    code = folder_with_code(source, tmp_path / "llama-with-code", marker)
    attnres = tampered_attnres_folder(source, tmp_path / "attnres-model", marker)
    text = tmp_path / "text.txt"
    text.write_text("Where each sublayer looks in depth. " * 4)
    loaded = []  # (class, folder) of each model that loads
    from_pretrained = PreTrainedModel.from_pretrained.__func__

    def recording_from_pretrained(cls, name, *args, **kwargs):
        loaded.append((cls, None if name is None else Path(name)))
        return from_pretrained(cls, name, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(recording_from_pretrained))
    output = tmp_path / "out"
    argv = [arg.format(code=code, attnres=attnres, out=output) for arg in COMMANDS_THAT_LOAD_A_KNOWN_TYPE[case]]
    if case == "analyze-baseline":
        argv += ["--text", str(text)]
    exit_code, _, error = run_cli(*argv)
    assert exit_code == 0, error
    assert [cls for cls, folder in loaded if folder == code] == [LlamaForCausalLM]
    assert not marker.exists()
    if case == "convert":
        config = json.loads((output / "config.json").read_text())
        assert config["auto_map"] == AUTO_MAP and config["text_config"]["model_type"] == "llama"
        assert "auto_map" not in config["text_config"]
