"""The runtime names its host work for the profiler (``rpcompile.runtime.activity``): a profiled step on logical CPU
devices shows each activity's spans; an unprofiled one pays for none."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import rpcompile
from rpcompile.models.registry import load_model
from rpcompile.runtime import activity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_table  # noqa: E402  (benchmarks/ is scripts, not a package)


def test_without_a_profiler_a_span_is_the_null_context():
    assert activity.span("compute", "F0 mb0") is activity.span("grad sink")


def test_a_profiled_step_names_the_runtime_s_host_work(tmp_path):
    spec = load_model("llama-demo", batch_size=4)
    (x,), y = spec.example_inputs, spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], microbatches=2, precision="bf16",
                             spec="rtx4090", time_limit_s=2.0, memory_limit=1 << 30)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1)
    pipe.forward_backward(x, target=y)
    pipe.step(opt)  # the next step's weights are remade from the masters
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=trace_table.profiler_config()) as prof:
        pipe.forward_backward(x, target=y)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = trace_table.load(path)
    names = {e["name"] for e in events if str(e.get("name", "")).startswith(activity.PREFIX)}
    stages = [s.name for s in pipe.plan.stages]
    assert f"rpcompile::compute {stages[0]} mb1" in names and f"rpcompile::inputs {stages[-1]} mb0" in names
    spent = trace_table.activities(events)
    # every thread's: device 1's worker, the prefetch threads (weights up, made fresh after the step: weights
    # refresh inside), the gradient sink's
    assert {"wait", "compute", "inputs", "outputs", "weights up", "grads out", "grad sink"} <= set(spent)
    threads = {e["tid"] for e in events if str(e.get("name", "")).startswith("rpcompile::compute")}
    assert len(threads) == 2  # both devices' workers
    assert set(spent) <= set(activity.ACTIVITIES)
    assert spent["compute"] > 0 and all(ms >= 0 for ms in spent.values())
    json.dumps(spent)
