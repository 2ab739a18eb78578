"""benchmarks/checkpoint.py --quick: no saves, synchronous and background saves run on sleeping devices, each save
timed (a tiny model; its figures mean little)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import checkpoint as bench  # noqa: E402  (benchmarks/ is scripts, not a package)


def test_quick_run_times_every_mode_and_each_save(tmp_path):
    out = tmp_path / "checkpoint.json"
    assert bench.main(["--quick", "--out", str(out), "--dir", str(tmp_path / "ckpt")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["no saves", "synchronous", "background"]
    none, sync, background = rows
    assert not none["saves"] and len(sync["saves"]) == len(background["saves"]) == 2
    assert all(s["copy_s"] > 0 and s["write_s"] > 0 for s in background["saves"])
    assert sync["checkpoint_mb"] == background["checkpoint_mb"] > 0
    assert "hidden" in background and background["stall_per_save_s"] >= 0
