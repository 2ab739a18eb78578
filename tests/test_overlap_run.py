"""benchmarks/overlap_run.py --quick: the three step modes run on sleeping devices and are set beside the
simulator (a tiny model; its figures mean nothing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import overlap_run  # noqa: E402  (benchmarks/ is scripts, not a package)


def test_quick_run_measures_every_mode_beside_its_prediction(tmp_path):
    out = tmp_path / "overlap_run.json"
    assert overlap_run.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["mode"] for r in rows] == ["synchronous", "step overlapped", "iterations overlapped"]
    assert all(r["measured_s"] > 0 and r["ratio"] == r["measured_s"] / r["predicted_s"] for r in rows)
    sync, step, iterations = (r["predicted_s"] for r in rows)
    assert iterations <= step <= sync  # what each mode hides, as the simulator plays it
    assert rows[0]["speedup"] == 1.0 and result["step_s"] > 0


def test_the_sleep_step_changes_nothing_and_clears_gradients():
    import torch

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = overlap_run.SleepStep([p], 0.0)
    opt.step()
    opt.zero_grad()
    assert torch.equal(p.detach(), torch.ones(3)) and p.grad is None
