"""The counts the docs state are the counts of the code: `scripts/facts.py --check` finds none stale."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "facts.py"


@pytest.mark.slow  # collects the suite twice
def test_the_counts_the_docs_state_are_current():
    child = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert child.returncode == 0, child.stdout + child.stderr
