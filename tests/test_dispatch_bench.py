"""benchmarks/dispatch.py: the host cost at tiny shapes runs on the CPU (its figures are the benchmark's, not checked
here) and measures what it says: rows for eager, saving and recomputing, and a saved segment's backward calls."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the benchmark's model
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dispatch  # noqa: E402  (benchmarks/ is scripts, not a package)


def test_the_rows_are_measured_and_the_saving_plan_runs_saved_segments():
    rows = dispatch.measure(steps=1)
    assert list(rows) == ["eager", "rpcompile saving", "rpcompile recomputing"]
    assert all(r["step_s"] > 0 for r in rows.values())
    saving, recomputing = rows["rpcompile saving"], rows["rpcompile recomputing"]
    assert saving["saved_nodes"] > 0 and saving["segment_backward_calls"] > 0
    assert saving["segment_backward_self_us"] > 0
    assert recomputing["saved_nodes"] == 0 and "segment_backward_calls" not in recomputing


def test_threads_dispatching_at_once_are_measured():
    assert dispatch.threads_rate(1, calls=5) > 0 and dispatch.threads_rate(2, calls=5) > 0
