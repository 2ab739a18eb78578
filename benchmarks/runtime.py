"""Training step time under rpcompile vs plain eager PyTorch, side by side in one run.

CPU (always): the demo models on 1 logical CPU device (and 2), against eager forward+loss+backward on the same
batch. GPU (when CUDA is present): a LLaMA-shaped model in bf16 on 1 GPU with weights streamed from the CPU vs the
whole model resident on the GPU, with and without per-block activation checkpointing.

Prints a table of ratios and writes benchmarks/results/runtime.json.
    python benchmarks/runtime.py [--models llama-demo,gpt-demo,cnn-demo] [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import rpcompile
from rpcompile.models import load_model


def _paired(a, b, steps: int) -> tuple[float, float]:
    """Median step times of ``a`` and ``b`` measured alternately (so load changes hit both alike)."""
    for _ in range(3):  # warm-up (the first step of a saving plan also captures its AOT graphs)
        a(), b()
    ta, tb = [], []
    for _ in range(steps):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def cpu_rows(models: list[str], steps: int, batch: int) -> list[dict]:
    rows = []
    for name in models:
        spec = load_model(name, batch_size=batch)
        x, y = spec.example_inputs[0], spec.example_target
        eager = copy.deepcopy(spec.model)

        def eager_step() -> None:
            spec.loss_fn(eager(x), y).backward()
            eager.zero_grad(set_to_none=True)

        for k in (1, 2):
            pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu"] * k, time_limit_s=5.0)

            def pipe_step() -> None:
                pipe.forward_backward(x, target=y)
                spec.model.zero_grad(set_to_none=True)

            t_eager, t_pipe = _paired(eager_step, pipe_step, steps)
            rows.append({"model": name, "devices": k, "microbatches": pipe.microbatches,
                         "stages": len(pipe.plan.stages), "eager_step_s": t_eager, "rpcompile_step_s": t_pipe,
                         "ratio": t_pipe / t_eager, "predicted_iteration_s": pipe.plan.predicted.iteration_time_s})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-demo,gpt-demo,cnn-demo")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=12)
    args = ap.parse_args()
    rows = cpu_rows(args.models.split(","), args.steps, args.batch)
    table = Table(title=f"training step on the CPU ({torch.get_num_threads()} threads), batch {args.batch}: "
                        "rpcompile on logical CPU devices vs eager")
    for col in ("model", "devices", "mb", "stages", "eager", "rpcompile", "ratio", "predicted"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        table.add_row(r["model"], str(r["devices"]), str(r["microbatches"]), str(r["stages"]),
                      f"{r['eager_step_s'] * 1e3:.1f} ms", f"{r['rpcompile_step_s'] * 1e3:.1f} ms",
                      f"{r['ratio']:.2f}×", f"{r['predicted_iteration_s'] * 1e3:.1f} ms")
    Console().print(table)
    if torch.cuda.is_available():
        Console().print("[yellow]CUDA is present: the GPU comparison (1B LLaMA, bf16) is not written yet.")
    out = Path(__file__).parent / "results" / "runtime.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "device": "cpu", "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
