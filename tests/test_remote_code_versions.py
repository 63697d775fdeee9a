"""Saved models meet whatever transformers a Hub user has: on one older than the remote code supports, loading stops at
import with the version needed and the pip line, instead of failing later inside a forward pass. `.ci/run` makes a
second environment with an older transformers (and without this package or torch) and names its Python here."""

import os
import subprocess

import pytest
from packaging.version import Version
from tiny import attnres_twin, tiny_source_model

from attnres.configuration_attnres import OLDEST_TRANSFORMERS

OLD_PYTHON = os.environ.get("ATTNRES_OLD_TRANSFORMERS_PYTHON")

LOAD_CONFIG = """
import sys, transformers
print(transformers.__version__)
from transformers import AutoConfig
AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
"""


@pytest.mark.skipif(not OLD_PYTHON, reason="ATTNRES_OLD_TRANSFORMERS_PYTHON names no Python with an older transformers")
def test_older_transformers_stops_at_import_naming_the_version(tmp_path):
    attnres_twin(tiny_source_model("llama", num_layers=2)).save_pretrained(tmp_path / "model")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [OLD_PYTHON, "-c", LOAD_CONFIG, str(tmp_path / "model")], capture_output=True, text=True, env=env, timeout=300
    )
    old_version = result.stdout.split()[0]
    assert Version(old_version) < Version(OLDEST_TRANSFORMERS)
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert f"AttnRes models need transformers>={OLDEST_TRANSFORMERS}, found {old_version}" in message, message
    assert f'pip install -U "transformers>={OLDEST_TRANSFORMERS}"' in message
