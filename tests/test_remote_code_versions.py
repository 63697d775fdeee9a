"""Saved models meet whatever transformers a Hub user has. From `OLDEST_TRANSFORMERS` on, the remote code saved next to
the weights loads and generates the tokens this package generates (the main environment has the newest transformers,
which the rest of the suite covers); on an older one, loading stops at import with the version needed and the pip line,
instead of failing later inside a forward pass.

`.ci/run` makes an environment of each kind (a Hub user's: transformers and torch, without this package) and names
its Python in an environment variable. Without one the test skips, except in CI (`CI=true`), where it fails."""

import json
import os
import subprocess

import pytest
import torch
from packaging.version import Version
from tiny import attnres_twin, random_ids, tiny_source_model

from attnres.families import FAMILIES, OLDEST_TRANSFORMERS, SUPPORTED_FAMILIES

pytestmark = pytest.mark.slow  # the fast tier skips this file; CI runs it

NEW_TOKENS = 10


def families_on(version: str) -> list[str]:
    return [
        family for family in SUPPORTED_FAMILIES if Version(FAMILIES[family].oldest_transformers) <= Version(version)
    ]


def python_named_by(variable: str) -> str:
    python = os.environ.get(variable)
    if not python:
        reason = f"{variable} names no Python with another transformers (.ci/run makes one)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return python


def run_without_package(python: str, script: str, *args: str, tmp_path) -> subprocess.CompletedProcess:
    """`script` in `python`, offline, away from the working tree (whose `attnres` would be importable from there)."""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [python, "-c", script, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )


LOAD_CONFIG = """
import sys, transformers
print(transformers.__version__)
from transformers import AutoConfig
AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
"""


def test_older_transformers_stops_at_import_naming_the_version(tmp_path):
    python = python_named_by("ATTNRES_UNSUPPORTED_TRANSFORMERS_PYTHON")
    attnres_twin(tiny_source_model("llama", num_layers=2)).save_pretrained(tmp_path / "model")
    result = run_without_package(python, LOAD_CONFIG, str(tmp_path / "model"), tmp_path=tmp_path)
    old_version = result.stdout.split()[0]
    assert Version(old_version) < Version(OLDEST_TRANSFORMERS)
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert f"AttnRes models need transformers>={OLDEST_TRANSFORMERS}, found {old_version}" in message, message
    assert f'pip install -U "transformers>={OLDEST_TRANSFORMERS}"' in message


LOAD_CONFIGS = """
import json, sys
from transformers import AutoConfig
errors = {}
for family, folder in json.loads(sys.argv[1]).items():
    try:
        AutoConfig.from_pretrained(folder, trust_remote_code=True)
    except Exception as error:
        errors[family] = str(error).strip().splitlines()[-1]
print(json.dumps(errors))
"""


GENERATE = """
import json, sys, torch, transformers
sys.modules["attnres"] = None  # a Hub user's environment: the folders' own code only
from transformers import AutoModelForCausalLM
folders, prompt, new_tokens = json.loads(sys.argv[1]), torch.tensor(json.loads(sys.argv[2])), int(sys.argv[3])
generated = {}
for family, folder in folders.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False)
    generated[family] = output[:, prompt.shape[1]:].tolist()
print(json.dumps({"transformers": transformers.__version__, "generated": generated}))
"""


def test_oldest_supported_transformers_generates_the_same_tokens(tmp_path):
    """Every family, with trained (random) depth parameters and weights large enough to make the tokens differ, saved
    here and greedy-decoded (with the KV cache) by its remote code on the oldest transformers it supports."""
    python = python_named_by("ATTNRES_OLDEST_TRANSFORMERS_PYTHON")
    prompt, folders, expected = random_ids(length=8), {}, {}
    for family in families_on(OLDEST_TRANSFORMERS):
        source = tiny_source_model(family, num_layers=3, initializer_range=0.2)
        model = attnres_twin(source, seed=3, attnres_block_size=2)
        folders[family] = str(tmp_path / family)
        model.save_pretrained(folders[family])
        with torch.no_grad():
            output = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        expected[family] = output[:, prompt.shape[1] :].tolist()
    arguments = json.dumps(folders), json.dumps(prompt.tolist()), str(NEW_TOKENS)
    result = run_without_package(python, GENERATE, *arguments, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["transformers"] == OLDEST_TRANSFORMERS
    assert report["generated"] == expected
    assert "deprecated" not in result.stderr  # before 5.24 `generate` passes `past_key_values`: no warning for that


def test_hybrids_on_the_oldest_transformers_stop_naming_the_version_they_need(tmp_path):
    """The hybrids (their recurrent layers' calls), GPT-J and CodeGen (their rotary module) and Falcon (its attention
    without `alibi`) need a newer transformers than the other families: their saved config stops at load, naming it,
    rather than failing inside a forward pass."""
    python = python_named_by("ATTNRES_OLDEST_TRANSFORMERS_PYTHON")
    newer = sorted(set(SUPPORTED_FAMILIES) - set(families_on(OLDEST_TRANSFORMERS)))
    assert newer, "every family runs on the oldest transformers: this test has nothing left to check"
    folders = {family: str(tmp_path / family) for family in newer}
    for family, folder in folders.items():
        attnres_twin(tiny_source_model(family, num_layers=2)).save_pretrained(folder)
    # One process loads every folder: starting the environment's Python once per family took most of the test's time
    result = run_without_package(python, LOAD_CONFIGS, json.dumps(folders), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(errors) == newer, f"these loaded on transformers {OLDEST_TRANSFORMERS}: {set(newer) - set(errors)}"
    for family, message in errors.items():
        oldest = FAMILIES[family].oldest_transformers
        assert (
            f"'{family}' needs transformers>={oldest}" in message
            and f'pip install -U "transformers>={oldest}"' in message
        ), message
