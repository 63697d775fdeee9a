"""The overhead benchmark runs end to end as users run it and reports every figure (its ratios are measured, not
asserted). A separate process: while timing, the benchmark changes how this process's malloc returns memory."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def test_overhead_benchmark_reports_every_figure(tmp_path):
    output = tmp_path / "o.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--models", "tiny", "--modes", "block,full", "--worlds", "eager",
         "--reps", "5", "--json", output],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    report = json.loads(output.read_text())
    assert {"machine", "dtype", "threads", "torch", "transformers", "malloc"} <= report["environment"].keys()
    if sys.platform.startswith("linux"):
        assert report["environment"]["malloc"] == "keeps freed memory"
    assert [(row["model"], row["mode"]) for row in report["rows"]] == [("tiny", "block"), ("tiny", "full")]
    for row in report["rows"]:
        for measure in ("prefill", "train_step", "decode_per_token", "train_peak_memory"):
            assert row[measure]["ratio"] > 0, measure
    assert "| tiny | block |" in result.stdout and "| tiny | full |" in result.stdout
