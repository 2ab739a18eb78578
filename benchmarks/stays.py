"""Weights that stay on their device (issue 35, item 5): today's round robin against stays, side by side.

- **Measured** on logical CPU devices (this machine; llama-demo, fp32, batch 12, torch's fused AdamW): eager
  PyTorch against rpcompile with every stage uploading its weights (``allow_stay=False``) and with weights that
  stay (the default), on the same cuts. Per setup (``1 device, fits``, ``1 device, 4 MiB``, ``2 devices``,
  ``1 device, LoRA``): median step time, its ratio to eager, and the weight bytes uploaded per step, counted and
  as the plan predicts. On logical CPU devices an upload moves nothing, so the times show what stays cost the
  runtime and the bytes what they spare a GPU's link.
- **Predicted** (analytic ``h100-sxm`` costs, bf16): the Llama shapes of ``gpu.py`` on one GPU, uncapped and capped
  at 20 GiB, and the Llama-3-8B shape on 8 × rtx4090 (m = 16): stays, uploaded bytes, the predicted iteration with
  and without them, peak device memory, and the gradient sums under ``no_sync``.

:func:`main` gives the setups and the rows in full.

    python benchmarks/stays.py [--steps 10] [--quick]

Writes ``benchmarks/results/stays.json`` (``--quick``: ``stays-quick.json``, one short measured setup and no
predictions; ignored by git).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table

import rpcompile
from rpcompile.core.specs import get_spec
from rpcompile.core.units import fmt_bytes, fmt_time
from rpcompile.models.registry import load_model
from rpcompile.passes.formulate import partition_problem
from rpcompile.passes.solver.partition import solve
from rpcompile.passes.solver.stay_search import without_stays
from rpcompile.passes.solver.timing import host_times, iteration_time, no_sync_time, stage_costs
from rpcompile.planner.plan_options import PlanOptions, make_hardware
from rpcompile.planner.planning import prepare
from rpcompile.tools.lora import apply_lora

FINE = dataclasses.replace(get_spec("cpu"), name="cpu-fine-stages", stage_overhead_s=30e-6)
MIB, GIB = 2**20, 2**30
#: (label, devices, memory limit, LoRA rank or 0, spec) of the measured setups
SETUPS = (("1 device, fits", 1, None, 0, "cpu"), ("1 device, fits, fine stages", 1, None, 0, FINE),
          ("1 device, 4 MiB", 1, 4 * MIB, 0, FINE), ("2 devices", 2, None, 0, FINE),
          ("1 device, LoRA", 1, None, 4, "cpu"))
#: (label, model, batch, sequence, devices, spec, memory limit, microbatches) of the predicted rows
PREDICTED = (("1.7B, 1 GPU", "llama-1.7b", 4, 1024, 1, "h100-sxm", None, None),
             ("1.7B, 1 GPU, 20 GiB", "llama-1.7b", 4, 1024, 1, "h100-sxm", 20 * GIB, None),
             ("8B, 1 GPU, 20 GiB", "llama-8b", 8, 2048, 1, "h100-sxm", 20 * GIB, 8),
             ("8B, 8 × rtx4090", "llama-8b", 16, 4096, 8, "rtx4090", None, 16))
RESULTS = Path(__file__).parent / "results" / "stays.json"
console = Console(width=max(Console().width, 160))


def _timed(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Each step's times, the steps measured in turn, one round after the other (a load change hits a round's
    steps alike), after two warm-up rounds."""
    for _ in range(2):
        for fn in steps.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def measured(label: str, devices: int, memory: int | None, rank: int, spec_: Any, repeats: int) -> dict[str, Any]:
    spec = load_model("llama-demo", batch_size=12)
    if rank:
        apply_lora(spec.model, rank=rank)
    x, y = spec.example_inputs[0], spec.example_target
    models = {k: copy.deepcopy(spec.model) for k in ("eager", "today", "stays")}
    opts = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, fused=True)
            for k, m in models.items()}
    options = dict(loss_fn=spec.loss_fn, devices=["cpu"] * devices, spec=spec_, time_limit_s=5.0,
                   host_embedding=False, memory_limit=memory)
    pipes = {k: rpcompile.compile(models[k], (x,), allow_stay=k == "stays", **options) for k in ("today", "stays")}
    cuts = {k: [(s.kind, s.nodes[0], s.nodes[-1]) for s in p.plan.stages] for k, p in pipes.items()}
    assert cuts["today"] == cuts["stays"], "the plans should differ only in their stays"

    def eager() -> None:
        spec.loss_fn(models["eager"](x), y).backward()
        opts["eager"].step()
        opts["eager"].zero_grad()

    def step(k: str) -> Callable[[], None]:
        def run() -> None:
            pipes[k].forward_backward(x, target=y)
            pipes[k].step(opts[k])
        return run

    for k in pipes:  # the first step uploads every weight (frozen ones too); then steady state
        step(k)()
    before = {k: sum(p.executor.stays.uploaded) for k, p in pipes.items()}
    load = os.getloadavg()[0]
    times = _timed({"eager": eager, "today": step("today"), "stays": step("stays")}, repeats)
    runs = repeats + 2
    row: dict[str, Any] = {"setup": label, "devices": devices, "memory_limit": memory, "lora_rank": rank,
                           "stages": len(pipes["stays"].plan.stages), "resident": pipes["stays"].plan.resident,
                           "eager_step_s": statistics.median(times["eager"]), "load_average": load}
    for k, p in pipes.items():
        # the ratio of each round's steps, then the median: a load change between rounds cancels out
        ratios = [t / e for t, e in zip(times[k], times["eager"])]
        row[k] = {"step_s": statistics.median(times[k]), "ratio_to_eager": statistics.median(ratios),
                  "uploaded_bytes_per_step": (sum(p.executor.stays.uploaded) - before[k]) / runs,
                  "predicted_bytes_per_step": sum(s.weight_bytes for s in p.plan.stages),
                  "stages_keeping": sum(1 for s in p.plan.stages if s.keeps)}
    return row


def predicted(label: str, model: str, batch: int, seq: int, gpus: int, spec: str, memory: int | None,
              m: int | None, time_limit: float) -> dict[str, Any]:
    ms = load_model(model, batch_size=batch, seq_len=seq)
    gm, m = prepare(ms.model, ms.example_inputs, PlanOptions(gpus=gpus, spec=spec, microbatches=m, precision="bf16",
                    progress=False))
    pb = partition_problem(gm, hardware=make_hardware(gpus, spec, memory), microbatches=m, precision="bf16")
    plan = solve(pb, "ilp", time_limit_s=time_limit).plan
    assert plan is not None
    out: dict[str, Any] = {"setup": label, "model": model, "spec": spec, "devices": gpus, "microbatches": m,
                           "memory_limit": memory or get_spec(spec).usable_memory_bytes, "stages": plan.stage_count,
                           "resident": plan.resident, "segments_staying": sum(plan.stays),
                           "segments": pb.n}
    for k, p in (("today", without_stays(plan)), ("stays", plan)):
        costs = stage_costs(pb, p)
        out[k] = {"iteration_s": iteration_time(pb, p), "weight_bytes_per_step": sum(c.weight_bytes for c in costs),
                  "peak_memory_bytes": max(c.memory_bytes for c in costs),
                  "grad_bytes_per_call": sum(c.grad_bytes for c in costs)}
    # gradient sums (no_sync): a call under it sends the summed gradients nowhere
    deferred = stage_costs(pb, plan, deferred=True)
    out["sums"] = {"grad_stages_summing": sum(1 for c in stage_costs(pb, plan) if c.sum_bytes and c.kind != "forward"
                                              and any(plan.accumulates[c.start:c.stop])),
                   "no_sync_call_s": no_sync_time(pb, plan), "pipeline_s": host_times(pb, plan)["pipeline_s"],
                   "grad_bytes_per_no_sync_call": sum(c.grad_bytes for c in deferred)} if plan.accumulates else None
    return out


def _measured_table(rows: list[dict]) -> Table:
    table = Table(title=f"measured on {torch.get_num_threads()} CPU threads, logical devices (llama-demo, fp32, batch "
                        "12, AdamW): step time, ratio to eager, weight bytes up per step (counted / plan)")
    for col in ("setup", "stages", "resident", "load", "eager", "today", "× eager", "stays", "× eager", "up today",
                "up stays", "plan today", "plan stays"):
        table.add_column(col, justify="left" if col == "setup" else "right")
    for r in rows:
        t, s = r["today"], r["stays"]
        table.add_row(r["setup"], str(r["stages"]), "yes" if r["resident"] else "no", f"{r['load_average']:.1f}",
                      fmt_time(r["eager_step_s"]),
                      fmt_time(t["step_s"]), f"{t['ratio_to_eager']:.2f}", fmt_time(s["step_s"]),
                      f"{s['ratio_to_eager']:.2f}", fmt_bytes(t["uploaded_bytes_per_step"]),
                      fmt_bytes(s["uploaded_bytes_per_step"]), fmt_bytes(t["predicted_bytes_per_step"]),
                      fmt_bytes(s["predicted_bytes_per_step"]))
    return table


def _predicted_table(rows: list[dict]) -> Table:
    table = Table(title="predicted (analytic costs, bf16): weights up per step and iteration, today's round robin "
                        "vs stays")
    for col in ("setup", "stages", "stays", "up today", "up stays", "iteration today", "iteration stays",
                "peak today", "peak stays", "sums", "down a call", "down under no_sync", "no_sync call"):
        table.add_column(col, justify="left" if col == "setup" else "right")
    for r in rows:
        t, s = r["today"], r["stays"]
        what = "resident" if r["resident"] else f"{r['segments_staying']} of {r['segments']} segments"
        table.add_row(r["setup"], str(r["stages"]), what, fmt_bytes(t["weight_bytes_per_step"]),
                      fmt_bytes(s["weight_bytes_per_step"]), fmt_time(t["iteration_s"]), fmt_time(s["iteration_s"]),
                      fmt_bytes(t["peak_memory_bytes"]), fmt_bytes(s["peak_memory_bytes"]),
                      *((f"{u['grad_stages_summing']} stages", fmt_bytes(s["grad_bytes_per_call"]),
                         fmt_bytes(u["grad_bytes_per_no_sync_call"]), fmt_time(u["no_sync_call_s"]))
                        if (u := r["sums"]) else ("none", fmt_bytes(s["grad_bytes_per_call"]), "-", "-")))
    return table


def main() -> None:
    """The setups and rows in full.

    **Measured** on logical CPU devices (this machine): a model trained with torch's fused AdamW, one step at a time —
    eager PyTorch (``loss.backward(); opt.step(); opt.zero_grad()``) against rpcompile with today's plan (every stage
    uploads its weights: ``allow_stay=False``) and with weights that stay (the default), planned on the same cuts (stays
    are chosen on the solved cuts, so the two plans differ only in them). Per setup: median step time, its ratio to
    eager (the median of each round's ratio: the machine's load moves the times, less their ratio), and the weight bytes
    uploaded per step — counted by the runtime (``pipe.executor.stays.uploaded``, after a warm-up step) and as the plan
    predicts (the stages' ``weight_bytes``). On logical CPU devices an upload moves nothing (a stage reads the host
    copy), so the step times show what stays cost the runtime, and the bytes what they spare a GPU's link. Setups
    (llama-demo, fp32, batch 12, analytic ``cpu`` costs — with a 30 µs stage overhead instead of the preset's 0.4 ms
    where said, so that the planner cuts the model into stages of every kind):

    - ``1 device, fits``: one device with room for everything: the resident plan (each weight uploaded once, then only
      what the optimizer step changed), as the ``cpu`` preset plans it, and with fine stages;
    - ``1 device, 4 MiB``: one device under a 4 MiB limit: seven stages, the forward stages' weights staying only where
      they fit;
    - ``2 devices``: two devices (default memory): forward stages keep their weights for the backward stages on their
      device;
    - ``1 device, LoRA``: rank-4 adapters on a frozen base, one device with room: the frozen base goes up once.

    **Predicted** (analytic ``h100-sxm`` costs, bf16; what the issue's GPU target is about): the Llama shapes of the GPU
    benchmark (``gpu.py``) on one GPU, uncapped and capped at 20 GiB, and the Llama-3-8B shape on 8 × rtx4090 (m = 16):
    per row the plan's stays, the weight bytes uploaded per step and the predicted iteration with and without them, and
    the peak device memory.

    Per predicted row also the gradient sums (``no_sync``): the grad stages that sum on their devices, the gradient
    bytes a call sends home with and without ``no_sync``, and a call under it.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per pipeline and setup")
    ap.add_argument("--time-limit", type=float, default=10.0, help="the predicted rows' solve time limit")
    ap.add_argument("--quick", action="store_true", help="one measured setup, 2 steps, no predictions")
    args = ap.parse_args()
    setups = SETUPS[:1] if args.quick else SETUPS
    out: dict[str, Any] = {"date": dt.date.today().isoformat(), "machine": platform.node(), "torch": torch.__version__,
                           "cpu_threads": torch.get_num_threads(), "measured": [], "predicted": []}
    for setup in setups:
        out["measured"].append(measured(*setup, repeats=2 if args.quick else args.steps))
    console.print(_measured_table(out["measured"]))
    if not args.quick:
        for row in PREDICTED:
            out["predicted"].append(predicted(*row, time_limit=args.time_limit))
        console.print(_predicted_table(out["predicted"]))
    path = RESULTS.with_name(f"{RESULTS.stem}-quick.json") if args.quick else RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    console.print(f"written to {path}")


if __name__ == "__main__":
    main()
