"""benchmarks/gpu.py --smoke: the GPU benchmark's code path on the CPU (a tiny model; its times mean nothing)."""

from __future__ import annotations

import copy
import json
import sys
import weakref
from pathlib import Path

import pytest

import rpcompile
from rpcompile.runtime.optim import BACKEND_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu  # noqa: E402  (benchmarks/ is scripts, not a package)


def test_the_smoke_run_writes_every_row(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")  # the optimizer rows' AdamW without building its C++ kernel here
    out = tmp_path / "gpu.json"
    gpu.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"].startswith("cpu (smoke")
    rows = result["rows"]
    assert [(r["system"], r["variant"]) for r in rows] == [
        ("eager", "fp32 weights + bf16 autocast"),
        ("eager", "fp32 weights + bf16 autocast, per-layer checkpointing"),
        ("eager", "bf16 weights, per-layer checkpointing"),
        ("rpcompile", "bf16, 1 device"),
        ("rpcompile", "bf16, 1 device, rpcompile AdamW step synchronous"),
        ("rpcompile", "bf16, 1 device, rpcompile AdamW step overlapped (one step stale)"),
        ("rpcompile", "bf16, 1 device, rpcompile AdamW iterations overlapped (one step stale)"),
        ("rpcompile", "bf16, 2 logical devices on one GPU"),
    ]
    assert all(r["error"] is None and r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert result["dispatch_probe"]["forward_s_per_node"] > 0 and result["dispatch_probe"]["backward_s_per_node"] > 0
    for r in rows[3:6] + rows[7:]:  # (a plan made synchronous predicts no overlapped iterations)
        assert r["predicted_s"] > 0 and r["predicted_over_measured"] == r["predicted_s"] / r["step_s"]
        # what calibrating the timing model needs: the plan, what it was priced on, each stage predicted and measured
        plan = rpcompile.Plan.load(r["plan_file"])
        assert r["priced_on"]["spec"] == plan.hardware.spec.name == "cpu" and not r["priced_on"]["resident_handoffs"]
        assert [st["stage"] for st in r["stages"]] == [st.name for st in plan.stages]
        assert all(st["measured_action_s"] > 0 and st["measured_span_s"] >= st["measured_action_s"]
                   and st["predicted_s"] == next(x.time_s for x in plan.stages if x.name == st["stage"])
                   for st in r["stages"])
        passes = r["compile_passes"]  # where compile's time went, pass by pass
        assert {"trace", "shape", "cost", "partition", "lower", "pipeline", "other"} <= passes.keys(), passes
        assert sum(passes.values()) == pytest.approx(r["setup_s"], rel=0.05, abs=0.05)
        parts = r["compile_parts"]  # the pipeline's build, part by part: within its pass
        assert {"pipeline.lower", "pipeline.host memory check", "pipeline.executor"} <= parts.keys(), parts
        assert sum(v for k, v in parts.items() if k.startswith("pipeline.")) <= passes["pipeline"] + 0.01
    plain, synchronous, overlapped = rows[3:6]
    host = synchronous["predicted_s"] - plain["predicted_s"]
    assert host > 0, "the synchronous step's prediction adds the host's optimizer step and copy refresh"
    assert overlapped["predicted_s"] == pytest.approx(max(plain["predicted_s"], host))
    assert rows[6]["predicted_s"] is None and rows[6]["predicted_over_measured"] is None
    assert result["markdown"].count("\n") == len(rows) + 1
    assert "| llama-demo | rpcompile | bf16, 1 device |" in capsys.readouterr().out


def test_the_warm_compile_runs_after_the_measured_pipeline_is_released_and_cannot_lose_its_rows(monkeypatch):
    """The capped rows compile the model a second time (a warm compile's time). Two pipelines of the 8B shape do not
    fit the host together (an H200 session lost both side-by-side rows to it): the first is released before the
    second compile, the measured rows are saved before it, and a failing warm compile is a field of the row."""
    from rpcompile.models.registry import load_model

    spec = load_model("llama-demo")
    alive = []
    real = rpcompile.compile

    def compile(*args, **kwargs):
        if kwargs.get("devices") == ["cpu"] and len(alive) == 1 and alive[0]() is not None:
            raise AssertionError("the warm compile ran while the measured pipeline was alive")
        pipe = real(*args, **kwargs)
        alive.append(weakref.ref(pipe))
        return pipe

    monkeypatch.setattr(rpcompile, "compile", compile)
    saved = []
    options = dict(section="capped", microbatches=2, memory_limit=None, cost_spec="cpu", profile=None, recompile=True)
    rows = gpu.rpcompile_row(spec, ["cpu"], "bf16, 1 device", 1, save=lambda r: saved.append(copy.deepcopy(r)),
                             **options)
    assert [r["error"] for r in rows] == [None] and rows[0]["step_s"] > 0
    assert "recompile_s" not in saved[0][0] and saved[0][0]["step_s"] == rows[0]["step_s"]
    assert rows[0]["recompile_s"] > 0 and rows[0]["same_plan_again"] is True

    def refuse(*args, **kwargs):
        if alive:
            raise MemoryError("host memory: this pipeline needs more\nsecond line")
        alive.append(lambda: None)
        return real(*args, **kwargs)

    alive.clear()
    monkeypatch.setattr(rpcompile, "compile", refuse)
    rows = gpu.rpcompile_row(spec, ["cpu"], "bf16, 1 device", 1, **options)
    assert rows[0]["step_s"] > 0 and rows[0]["recompile_error"] == "MemoryError: host memory: this pipeline needs more"
