"""Overlapped iterations as the runtime runs them, without a GPU: measured period beside the simulator's.

- **sleeping devices**: the runtime (executor, threads, weight copies, gradient sink, optimizer step) runs for real
  on N :class:`floor.FloorDevice`\\ s, and each stage's microbatch *sleeps* until its planned compute time has
  passed since its dispatch began — as a GPU computes while the host waits for it. The optimizer step sleeps too.
- **period**: the median time between the starts of consecutive steps over ``--steps`` steps after two warm-up
  steps, as the simulator's period is the steady state of consecutive iterations.

Modes: ``synchronous`` (``pipe.step(optimizer)``), ``step overlapped`` (``overlap=True``) and ``iterations
overlapped`` (``pipe.overlap_iterations = True`` too); :func:`main` gives them and the model in full.

    python benchmarks/overlap_run.py [--gpus 8] [--layers 8] [--dim 1024] [--microbatches 8] [--slow 60] [--steps 6]
    python benchmarks/overlap_run.py --quick   # checks the script (CI); its figures mean nothing

Writes ``benchmarks/results/overlap_run.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import rpcompile
from rpcompile.core.files import write_atomic
from rpcompile.core.schedule import OVERLAP_ITERATIONS
from rpcompile.core.stages import HostLoad
from rpcompile.models.llama import Llama, LlamaConfig
from rpcompile.runtime.executor import Executor
from rpcompile.runtime.sim.simulator import simulate
from rpcompile.tools.scenarios import from_plan

from floor import FloorDevice  # benchmarks/

RESULTS = Path(__file__).parent / "results" / "overlap_run.json"
MODES = (("synchronous", False, False), ("step overlapped", True, False), ("iterations overlapped", True, True))


class SleepStep:
    """An optimizer whose step takes ``seconds`` and changes nothing (``pipe.step`` takes any object with
    ``param_groups``, ``step()`` and ``zero_grad()``): the host's step as time alone."""

    def __init__(self, params: Any, seconds: float) -> None:
        self.param_groups = [{"params": list(params)}]
        self.seconds = seconds

    def step(self) -> None:
        time.sleep(self.seconds)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None


@contextlib.contextmanager
def sleeping(seconds: dict[int, float]) -> Iterator[None]:
    """Every stage's microbatch on the executor takes ``seconds[stage]`` (the device computing), or its host
    dispatch where that is longer."""
    real = Executor._compute

    def compute(self: Executor, device: Any, prog: Any, state: Any, mb: int) -> None:
        t0 = time.perf_counter()
        real(self, device, prog, state, mb)
        # a GPU runs the kernels while the host launches them: the microbatch takes the longer of the two;
        # time.sleep releases the GIL, so the host's threads go on meanwhile, as they do beside a GPU
        time.sleep(max(0.0, seconds[prog.index] - (time.perf_counter() - t0)))

    Executor._compute = compute  # type: ignore[method-assign]
    try:
        yield
    finally:
        Executor._compute = real  # type: ignore[method-assign]


def build(layers: int, dim: int, seq: int, batch: int) -> tuple[Llama, torch.Tensor, torch.Tensor]:
    """A LLaMA-shaped decoder on the host, every value constant (nothing is computed with them)."""
    cfg = LlamaConfig(vocab_size=32_000, dim=dim, ffn_dim=3 * dim, n_layers=layers, n_heads=max(1, dim // 128),
                      n_kv_heads=max(1, dim // 256), max_seq_len=seq)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.02)
        for b in model.buffers():
            b.fill_(1.0) if b.is_floating_point() else b.zero_()
    x = torch.zeros(batch, seq, dtype=torch.long)
    return model, x, torch.zeros(batch, seq, dtype=torch.long)


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def predicted(plan: Any, slow: float, step_s: float, overlap: bool, iterations: bool) -> float:
    """The simulator's period for the plan as run here: stage compute times scaled by ``slow``, copies free, the
    step ``step_s`` — synchronous, step overlapped or iterations overlapped."""
    sc = from_plan(plan)
    stages = [dataclasses.replace(s, compute_s=s.compute_s * slow) for s in sc.stages]
    host = HostLoad(optimizer_s=step_s, overlap_step=overlap, overlap_iterations=iterations)
    res = simulate(sc.lists, stages, link_bytes_per_s=math.inf, host=host, iterations=OVERLAP_ITERATIONS)
    return res.iteration_time_s


def measure(pipe: Any, x: torch.Tensor, y: torch.Tensor, optimizer: SleepStep, steps: int, *, overlap: bool,
            iterations: bool) -> float:
    """The steady-state period: the median time between the starts of consecutive steps, after two warm-up
    steps (a step that returns before its work is done is timed by when the next one can start)."""
    pipe.overlap_iterations = iterations
    starts = []
    for _ in range(steps + 3):
        starts.append(time.perf_counter())
        pipe.forward_backward(x, target=y)
        pipe.step(optimizer, overlap=overlap)
    pipe.synchronize()
    return statistics.median(b - a for a, b in zip(starts[2:], starts[3:]))


def main(argv: list[str] | None = None) -> int:
    """The modes and the model in full.

    The runtime — executor, threads, weight copies, gradient sink, optimizer step — runs for real on N devices whose
    kernels cost nothing (:class:`floor.FloorDevice`: compute on ``meta``, copies free as DMA), and each stage's
    microbatch then *sleeps* until its planned compute time has passed since its dispatch began: ``time.sleep`` releases
    the GIL, so a device's worker is busy while the host's threads go on, as a GPU computes while the host waits for it,
    and a microbatch takes the longer of its compute and its dispatch, as on a GPU. The optimizer step sleeps too (a
    fixed time, leaving the weights alone: no copy to remake). What is measured is then the schedule the runtime keeps
    around GPU-like compute, set beside what the simulator predicts for the same plan, stage times and step:

    - ``synchronous``: ``pipe.step(optimizer)``: every iteration pays the pipeline's fill and drain, then the step;
    - ``step overlapped``: ``pipe.step(optimizer, overlap=True)``: the step beside the next iteration, whose
      ``forward_backward`` still waits for the whole pipeline;
    - ``iterations overlapped``: the same with ``pipe.overlap_iterations = True``: each call returns at its loss and the
      devices go on into the next iteration while the last stages drain.

    Period: the median time between the starts of consecutive steps over ``--steps`` steps after two warm-up steps, as
    the simulator's period is the steady state of consecutive iterations (the run's one-off fill and drain apart). The
    model: a LLaMA-shaped decoder (host storage, constant values: nothing is computed), planned with analytic costs for
    ``--spec`` (compute times scaled by ``--slow``: a slower GPU, so that the host work of this 2-core machine hides
    behind compute as a real host's does behind a real GPU's).
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--spec", default="rtx4090")
    ap.add_argument("--slow", type=float, default=60.0, help="stage compute times x this (a slower GPU)")
    ap.add_argument("--step-s", type=float, default=None, help="the optimizer step's time (default: a third of "
                                                                   "the predicted synchronous pipeline)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="a tiny run that checks the script")
    args = ap.parse_args(argv)
    if args.quick:
        args.gpus, args.layers, args.dim, args.seq, args.microbatches, args.steps = 2, 2, 128, 64, 3, 1
    model, x, y = build(args.layers, args.dim, args.seq, args.microbatches)
    devices = [FloorDevice(i) for i in range(args.gpus)]
    pipe = rpcompile.compile(model, (x,), loss_fn=lm_loss, devices=devices, spec=args.spec, precision="bf16",
                             microbatches=args.microbatches, example_target=y, allow_save=False,
                             time_limit_s=10.0, overlap=True)
    plan = pipe.plan
    pipeline = predicted(plan, args.slow, 0.0, False, False)
    step_s = args.step_s if args.step_s is not None else pipeline / 3
    seconds = {k: s.compute_s * args.slow for k, s in enumerate(plan.stages)}
    optimizer = SleepStep(model.parameters(), step_s)
    rows = []
    with sleeping(seconds):
        for label, overlap, iterations in MODES:
            measured = measure(pipe, x, y, optimizer, args.steps, overlap=overlap, iterations=iterations)
            pred = predicted(plan, args.slow, step_s, overlap, iterations)
            rows.append({"mode": label, "measured_s": measured, "predicted_s": pred, "ratio": measured / pred})
    base = rows[0]["measured_s"]
    for r in rows:
        r["speedup"] = base / r["measured_s"]
    table = Table(title=f"overlapped iterations run: {args.layers} layers dim {args.dim}, {args.gpus} sleeping "
                        f"devices, {len(plan.stages)} stages, m={args.microbatches}, step {step_s * 1e3:.0f} ms")
    for col in ("mode", "measured period", "simulated", "measured / simulated", "vs synchronous"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        table.add_row(r["mode"], f"{r['measured_s'] * 1e3:.0f} ms", f"{r['predicted_s'] * 1e3:.0f} ms",
                      f"{r['ratio']:.2f}", f"{r['speedup']:.2f}x")
    Console(width=120).print(table)
    out = {"date": dt.date.today().isoformat(), "machine": platform.node(), "torch": torch.__version__,
           "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "stages": len(plan.stages), "step_s": step_s, "rows": rows}
    write_atomic(args.out, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
