"""The runtime's own floor, without a GPU: rpcompile's real host machinery at a real parameter count, with compute
that costs nothing.

- **host's part**: a training step under rpcompile is the GPU's work plus the host's: dispatching every stage's
  operators, the weights' bf16 copies, uploads and downloads issued from their threads, the gradient sink, saved
  activations and hand-offs on the offloader threads.
- **floor**: the step's wall time on a :class:`FloorDevice` (kernels on ``meta``, copies free to the host), which
  leaves the host's part alone — the least any GPU can take under this runtime.

Reported per step (median of ``--steps`` after a warm-up step): wall and host CPU seconds (each also per billion
parameters), the host threads' time by activity, and the stage launch (the device thread's time per action and per
graph node). Rows: ``forward_backward`` alone, then with a synchronous ``pipe.step`` of plain SGD. :func:`main`
says how the model is built and planned.

    python benchmarks/floor.py [--model llama-1.7b] [--batch 8] [--seq 2048] [--steps 3] [--spec h100-sxm]
    python benchmarks/floor.py --quick      # llama-demo: checks the script (CI), figures mean nothing

Writes ``benchmarks/results/floor.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import rpcompile
from rpcompile.core.files import write_atomic
from rpcompile.models.registry import load_model
from rpcompile.runtime.activity import ACTIVITIES
from rpcompile.runtime.devices import Device

import trace_table  # benchmarks/

GiB = 1 << 30


class FloorDevice(Device):
    """A device whose kernels cost nothing (they run on ``meta``) and whose copies cost the host nothing, as a DMA
    does: an upload is free, a download lands in a zero-filled host buffer kept per layout and handed out again
    (no host work per copy). Zeros, not fresh uninitialised memory: stray bits can be denormals or NaNs, which
    make the host's adds (the gradient sink, the embedding's ``index_add_``) many times slower than real values
    do. Its saved activations and hand-offs go down on offloader threads, as a GPU's do."""

    def __init__(self, index: int = 0):
        super().__init__(torch.device("meta"), index)
        self._landing: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()

    def upload(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return t.to(device="meta", dtype=cast)

    def download(self, t: torch.Tensor) -> torch.Tensor:
        key = (tuple(t.shape), t.stride(), t.dtype)
        with self._lock:  # several offloader threads download at once
            if key not in self._landing:
                self._landing[key] = torch.zeros_like(t, device="cpu")
            return self._landing[key]


def build(name: str, batch: int, seq: int) -> Any:
    """``name``'s model on the host without an initialiser (every value 0.02: nothing is computed with them)."""
    spec = load_model(name, device="meta", batch_size=batch, seq_len=seq)
    spec.model.to_empty(device="cpu")
    with torch.no_grad():
        for p in spec.model.parameters():
            p.fill_(0.02)
        for b in spec.model.buffers():
            b.fill_(1.0) if b.is_floating_point() else b.zero_()
    (x,), y = spec.example_inputs, spec.example_target
    return dataclasses.replace(spec, example_inputs=(torch.zeros_like(x, device="cpu"),),
                               example_target=torch.zeros_like(y, device="cpu"))


def _stage_launch(pipe: Any) -> dict[str, float]:
    """The device thread's time per action of the last call, and per graph node of the stage it ran."""
    nodes = {prog.name: sum(1 for n in prog.gm.graph.nodes if n.op in ("call_function", "call_module", "call_method"))
             for prog in pipe.program.stages}
    per_action = [e.end - e.start for e in pipe.executor.timeline]
    per_node = [(e.end - e.start) / nodes[e.stage] for e in pipe.executor.timeline if nodes.get(e.stage)]
    return {"actions": len(per_action), "action_ms": 1e3 * statistics.median(per_action) if per_action else None,
            "node_us": 1e6 * statistics.median(per_node) if per_node else None}


def _profiled(step: Any, top: int) -> dict[str, Any]:
    """One profiled ``step()``: its wall seconds, the runtime's host work by activity (``rpcompile::`` spans,
    every thread) and each thread's outermost operators."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=trace_table.profiler_config()) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = trace_table.load(path)
    return {"profiled_wall_s": wall, "activities_ms": trace_table.activities(events),
            "threads": trace_table.host_threads(events, top=top)}


def measure(pipe: Any, spec: Any, params: int, *, label: str, optimizer: Any, steps: int, top: int) -> dict[str, Any]:
    """``label``'s row: the median step of ``steps`` after a warm-up, then one profiled step's breakdown. The
    floor is the wall time less the compute's dispatch (on ``meta``: shape functions, some of them Python, that a
    GPU's kernel launches replace), measured on the device's thread in the profiled step."""
    (x,), y = spec.example_inputs, spec.example_target

    def step() -> None:
        pipe.forward_backward(x, target=y)
        if optimizer is not None:
            pipe.step(optimizer)
        else:
            spec.model.zero_grad(set_to_none=True)

    step()  # warm-up: the bf16 copies, the gradient buffers, a saving plan's captures
    walls, cpus = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    launch = _stage_launch(pipe)
    prof = _profiled(step, top)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    # the compute's share of the profiled step, applied to the unprofiled one (the profiler slows every span alike)
    compute = prof["activities_ms"].get("compute", 0.0) / 1e3 * wall / prof["profiled_wall_s"]
    floor = wall - compute
    b = params / 1e9
    return {"variant": label, "wall_s": wall, "cpu_s": cpu, "compute_s": compute, "floor_s": floor,
            "floor_s_per_b": floor / b, "wall_s_per_b": wall / b, "cpu_s_per_b": cpu / b,
            "floor_per_action_ms": 1e3 * floor / launch["actions"] if launch["actions"] else None,
            **{f"launch_{k}": v for k, v in launch.items()}, **prof}


def main(argv: list[str] | None = None) -> int:
    """The rows, what each reports, and the model.

    Reported per step (median of ``--steps`` after a warm-up step):

    - **wall** and **host CPU** seconds (all threads: ``time.process_time``), each also per billion parameters, so
      machines and models compare;
    - **by activity**: the host threads' outermost torch operators in one profiled step, by name (the stages' forward
      and backward operators, copies, gradient accumulation, the optimizer);
    - **stage launch**: the device thread's time per action (one stage on one microbatch) — the median, and per graph
      node of the stage, the cost of dispatching one operator.

    Rows: ``forward_backward`` alone, then with a synchronous ``pipe.step`` of plain SGD (no state: it fits this host's
    memory at 1.7B parameters, and makes the runtime remake every weight's bf16 copy, as any optimizer does).

    The model is built on ``meta`` and given host storage of a constant value (its values cannot matter: nothing is
    computed), planned with analytic costs for ``--spec`` under ``--cap-gib``, as ``gpu.py``'s capped section plans for
    the GPU.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1.7b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=None, help="default: --batch (one sequence each)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--spec", default="h100-sxm", help="the GPU spec the plan is made for (analytic costs)")
    ap.add_argument("--cap-gib", type=float, default=20.0, help="the GPU memory the plan may use (as gpu.py's cap)")
    ap.add_argument("--top", type=int, default=6, help="operators per thread in the activity breakdown")
    ap.add_argument("--quick", action="store_true", help="llama-demo, 2 steps: checks the script")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "floor.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.batch, args.seq, args.steps = "llama-demo", 4, 16, 2
    microbatches = args.microbatches or args.batch

    t0 = time.perf_counter()
    spec = build(args.model, args.batch, args.seq)
    params = sum(p.numel() for p in spec.model.parameters() if p.requires_grad)
    print(f"built {args.model} ({params / 1e9:.3f}B parameters) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    (x,), y = spec.example_inputs, spec.example_target
    device = FloorDevice()
    device.enable_offload(int(args.cap_gib * GiB))  # as a GPU's: saves and hand-offs behind the "compute"
    device.enable_async_handoff()
    t0 = time.perf_counter()
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=[device], precision="bf16",
                             microbatches=microbatches, spec=args.spec, memory_limit=int(args.cap_gib * GiB * 0.9),
                             example_target=y, allow_save=True)
    compile_s = time.perf_counter() - t0
    print(f"compiled in {compile_s:.1f} s: {len(pipe.plan.stages)} stages", file=sys.stderr)
    base = {"model": args.model, "params": params, "tokens": x.numel(), "microbatches": pipe.microbatches,
            "stages": len(pipe.plan.stages)}
    rows = [base | measure(pipe, spec, params, label="forward_backward", optimizer=None, steps=args.steps,
                           top=args.top)]
    sgd = torch.optim.SGD(spec.model.parameters(), lr=1e-9)
    rows.append(base | measure(pipe, spec, params, label="forward_backward + pipe.step(SGD)", optimizer=sgd,
                               steps=args.steps, top=args.top))

    table = Table(title=f"runtime floor: {args.model} ({params / 1e9:.2f}B), {x.numel():,} tokens in "
                        f"{pipe.microbatches} microbatches, {len(pipe.plan.stages)} stages; compute on meta")
    for c in ("variant", "wall", "compute (meta)", "floor", "floor / B params", "host CPU / B params",
              "runtime per action", "action", "per node"):
        table.add_column(c, justify="left" if c == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], f"{r['wall_s']:.3f} s", f"{r['compute_s']:.3f} s", f"{r['floor_s']:.3f} s",
                      f"{r['floor_s_per_b']:.3f} s", f"{r['cpu_s_per_b']:.3f} s", f"{r['floor_per_action_ms']:.2f} ms",
                      f"{r['launch_action_ms']:.2f} ms", f"{r['launch_node_us']:.0f} µs")
    console = Console(width=160)
    console.print(table)
    acts = Table(title="host seconds by activity (one profiled step, all threads; rpcompile.runtime.activity)")
    acts.add_column("activity")
    for r in rows:
        acts.add_column(r["variant"], justify="right")
    for a in ACTIVITIES:
        acts.add_row(a, *(f"{r['activities_ms'].get(a, 0.0) / 1e3:.3f} s" for r in rows))
    console.print(acts)
    for r in rows:
        trace_table.render_threads(r["threads"], console, title=f"host threads, {r['variant']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    header = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {_cpus()} CPUs",
              "torch": torch.__version__, "compile_s": compile_s, "args": {k: str(v) for k, v in vars(args).items()}}
    write_atomic(args.out, json.dumps(header | {"rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


if __name__ == "__main__":
    sys.exit(main())
