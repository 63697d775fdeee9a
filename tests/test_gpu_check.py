"""`scripts/gpu_check.sh` cannot rot while no GPU is at hand: its dry run runs every stage on the CPU at toy sizes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the fast tier skips this file; CI runs it

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_check.sh"


def run_check(*arguments: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(SCRIPT), *arguments], capture_output=True, text=True, env=environment)


@pytest.mark.slow
def test_dry_run_runs_every_stage_and_prints_one_table(tmp_path):
    child = run_check("--dry-run", "--work", str(tmp_path))
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-5000:]
    table = [line for line in child.stdout.splitlines() if line.startswith("| ")]
    checks = [line.split(" | ")[0].removeprefix("| ") for line in table]
    assert checks[0] == "check"  # the header, then one row per figure
    assert checks.count("saved activations, block") == checks.count("saved activations, full") == 1
    for check in (
        "tiny block, float32",
        "conversion verified",
        "fla backend vs two_phase",
        "device map",
        "fsdp2 training",
        "compare",
    ):
        assert check in checks, child.stdout
    assert any(check.startswith("ZeRO-3") or check == "deepspeed_zero3 training" for check in checks)
    assert "vLLM Transformers backend" in checks
    assert "FAILED" not in child.stdout
    conversions = [line for line in table if line.startswith("| conversion verified")]
    assert len(conversions) == 2 and all("greedy 64/64" in line for line in conversions), conversions


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_a_gpu_it_says_how_to_run_it():
    child = run_check()
    assert child.returncode == 2
    assert "no CUDA device" in child.stderr and "--dry-run" in child.stderr
    assert child.stdout == ""
