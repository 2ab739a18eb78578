"""Training step time under rpcompile vs plain eager PyTorch, side by side in one run.

CPU (always): the demo models on 1 logical CPU device (and 2), against eager forward+loss+backward on the same
batch. GPU (when CUDA is present): a LLaMA-shaped model in bf16 on 1 GPU with weights streamed from the CPU vs the
whole model resident on the GPU, with and without per-block activation checkpointing.

Host bytes per parameter per iteration (issue 19): what the host's threads read and write in parameter-sized
work — casts, staging copies, gradient accumulation — counted by the runtime (``pipe.host_traffic``, DMA not
counted; deterministic, so this CPU measures it for a GPU), bf16 on 2 logical CPU devices, with torch's fused
AdamW and with rpcompile's mirroring AdamW. ``BEFORE`` holds the same count for the code before issue 19 (a cast
of every weight at every upload, gradients cast, cloned and added out of place), measured at commit 73cf24a by
wrapping its executor with the same rules.

Prints tables of ratios and writes benchmarks/results/runtime.json.
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
from rpcompile.core.files import write_atomic
from rpcompile.models.registry import load_model
from rpcompile.runtime.optim import AdamW as MirroringAdamW

#: Host bytes per parameter per iteration before issue 19 (commit 73cf24a, bf16, 2 logical CPU devices, batch 12,
#: torch fused AdamW; module docstring): upload casts + gradients.
BEFORE = {"llama-demo": 23.40, "gpt-demo": 26.42}  # llama-demo: 23.34 for weights, 0.06 for buffers


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
                         "ratio": t_pipe / t_eager,
                         # the pipeline's part of the prediction: no optimizer step is timed here
                         "predicted_iteration_s": pipe.plan.predicted.pipeline_s})
    return rows


def host_bytes_rows(models: list[str], batch: int, steps: int = 3) -> list[dict]:
    """Host bytes per parameter per iteration, by kind, over ``steps`` iterations after a warm-up one."""
    rows = []
    for name in models:
        for label, make in (("torch fused AdamW", lambda ps: torch.optim.AdamW(ps, fused=True)),
                            ("rpcompile AdamW (mirrors)", MirroringAdamW)):
            spec = load_model(name, batch_size=batch)
            x, y = spec.example_inputs[0], spec.example_target
            pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu"] * 2, precision="bf16",
                                     spec="rtx4090")
            opt = make(spec.model.parameters())
            for _ in range(2):  # warm-up: a mirroring optimizer gets the copies at its first step
                pipe.forward_backward(x, target=y)
                pipe.step(opt)
            before = pipe.host_traffic
            for _ in range(steps):
                pipe.forward_backward(x, target=y)
                pipe.step(opt)
            after = pipe.host_traffic
            n = sum(p.numel() for p in spec.model.parameters())
            kinds = {k: (after.get(k, 0) - before.get(k, 0)) / steps / n for k in after}
            if isinstance(opt, MirroringAdamW):  # its pass writes each copy: 2 bytes a parameter, counted here
                kinds["optimizer's copy writes"] = 2.0 * sum(p.numel() for p in spec.model.parameters()
                                                            if p.requires_grad) / n
            total = sum(kinds.values())
            rows.append({"model": name, "optimizer": label, "bytes_per_param": kinds, "total": total,
                         "before": BEFORE.get(name), "ratio": total / BEFORE[name] if name in BEFORE else None})
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
    host = host_bytes_rows([m for m in args.models.split(",") if m in BEFORE], args.batch)
    table = Table(title="host bytes per parameter per iteration (bf16, 2 logical CPU devices; counted, not timed)")
    for col in ("model", "optimizer", "weight copies", "gradients", "other", "total", "before", "after/before"):
        table.add_column(col, justify="left" if col in ("model", "optimizer") else "right")
    for r in host:
        k = r["bytes_per_param"]
        other = r["total"] - k.get("weight copies", 0) - k.get("gradients", 0)
        table.add_row(r["model"], r["optimizer"], f"{k.get('weight copies', 0):.2f}", f"{k.get('gradients', 0):.2f}",
                      f"{other:.2f}", f"{r['total']:.2f}", f"{r['before']:.2f}", f"{r['ratio']:.0%}")
    Console().print(table)
    if torch.cuda.is_available():
        Console().print("[yellow]CUDA is present: the GPU comparison (1B LLaMA, bf16) is not written yet.")
    out = Path(__file__).parent / "results" / "runtime.json"
    out.parent.mkdir(exist_ok=True)
    write_atomic(out, json.dumps({"torch": torch.__version__, "device": "cpu", "rows": rows, "host_bytes": host},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
