"""The overhead benchmark runs end to end and reports every figure (its ratios are measured, not asserted)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import overhead  # noqa: E402


def test_overhead_benchmark_reports_every_figure(tmp_path, capsys):
    overhead.main(["--models", "tiny", "--modes", "block,full", "--reps", "5", "--json", str(tmp_path / "o.json")])
    result = json.loads((tmp_path / "o.json").read_text())
    assert {"machine", "dtype", "threads", "torch", "transformers"} <= result["environment"].keys()
    assert [(row["model"], row["mode"]) for row in result["rows"]] == [("tiny", "block"), ("tiny", "full")]
    for row in result["rows"]:
        for measure in ("prefill", "train_step", "decode_per_token", "train_peak_memory"):
            assert row[measure]["ratio"] > 0, measure
    table = capsys.readouterr().out
    assert "| tiny | block |" in table and "| tiny | full |" in table
