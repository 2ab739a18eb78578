"""benchmarks/floor.py --quick: the runtime floor's script runs on the CPU (llama-demo; its figures mean nothing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import floor  # noqa: E402  (benchmarks/ is scripts, not a package)


def test_the_floor_device_computes_nothing_and_lands_downloads_in_zeros():
    d = floor.FloorDevice()
    up = d.upload(torch.ones(3, 4), torch.bfloat16)
    assert up.is_meta and up.dtype == torch.bfloat16
    down = d.download(torch.empty(4, 3, device="meta").t())
    assert down.device.type == "cpu" and down.stride() == (1, 3) and not down.any()
    assert d.download(torch.empty(4, 3, device="meta").t()) is down  # kept per layout: no host work per copy


def test_quick_run_writes_both_rows_with_their_activities(tmp_path):
    out = tmp_path / "floor.json"
    assert floor.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["forward_backward", "forward_backward + pipe.step(SGD)"]
    for r in rows:
        assert r["activities_ms"]["compute"] > 0 and "grad sink" in r["activities_ms"]
        assert r["launch_actions"] >= r["microbatches"] * r["stages"]  # every stage on every microbatch
        assert abs(r["floor_s"] - (r["wall_s"] - r["compute_s"])) < 1e-9


def test_a_device_of_the_users_needs_a_memory_limit_or_a_spec_in_one_line():
    import pytest

    import rpcompile

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(rpcompile.ConfigError, match=r"^how much memory a meta device has is unknown: pass "
                                                    r"memory_limit= \(bytes\) or spec= \(a GPU spec name\)$"):
        rpcompile.compile(model, (torch.randn(4, 4),), loss_fn=torch.nn.functional.mse_loss,
                          devices=[floor.FloorDevice()])
