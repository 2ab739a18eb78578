"""CPU optimizer step: torch.optim.AdamW implementations side by side (the runtime steps fp32 masters on the CPU).

The pipeline also needs a bf16 copy of every parameter refreshed after each step. Three rows do that: torch's fused
AdamW followed by a separate ``copy_`` cast (the baseline, two passes over memory), and
:class:`rpcompile.runtime.optim.AdamW` with a bf16 mirror on each backend (the C++ one pass; torch's fused kernel
plus ``copy_``). Prints a table (median and best time per step, parameters/s, ratios of the medians to the default and to fused +
``copy_``) and writes benchmarks/results/optimizer.json.
    python benchmarks/optimizer.py [--params 50e6] [--tensors 64] [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from rpcompile.core.files import write_atomic
from rpcompile.runtime.optim import BACKEND_ENV, AdamW

BASELINE = "fused + copy_ to bf16 (baseline)"
"""torch's fused AdamW, then a separate cast of every parameter into its bf16 copy: what the one pass replaces."""

VARIANTS = {
    "for-loop (foreach=False)": dict(foreach=False),
    "foreach (default on CUDA)": dict(foreach=True),
    "fused (fused=True)": dict(fused=True),
    # the rows below also leave a bf16 copy of every parameter equal to param.to(bf16) after each step
    BASELINE: dict(fused=True, mirror="copy_"),
    "rpcompile AdamW (cpp, bf16 mirror)": dict(backend="cpp"),
    "rpcompile AdamW (torch fallback, bf16 mirror)": dict(backend="torch"),
}


def _optimizer(params: list[torch.nn.Parameter], kw: dict) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """The optimizer a row times and the bf16 copies it keeps (none for the rows without a mirror)."""
    if "backend" in kw:
        os.environ[BACKEND_ENV] = kw["backend"]  # read when the first step resolves the backend
        opt = AdamW(params, lr=1e-3)
        copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
        for p, c in zip(params, copies):
            opt.mirror(p, c)
        return opt, copies
    torch_kw = {k: v for k, v in kw.items() if k != "mirror"}
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params] if "mirror" in kw else []
    return torch.optim.AdamW(params, lr=1e-3, **torch_kw), copies


def _step(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, copies: list[torch.Tensor],
          refresh: bool) -> None:
    opt.step()
    if refresh:  # the baseline's second pass: the cast the pipeline needs after every step
        with torch.no_grad():
            for p, c in zip(params, copies):
                c.copy_(p)


def bench(n_params: int, n_tensors: int, repeats: int) -> list[dict]:
    """Median step time of each variant; the variants take turns within each repeat, so a load that comes and goes on
    a shared machine touches them all alike."""
    size = n_params // n_tensors
    setups = {}
    for name, kw in VARIANTS.items():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(size)) for _ in range(n_tensors)]
        for p in params:
            p.grad = torch.randn(size)
        opt, copies = _optimizer(params, kw)
        setups[name] = (params, opt, copies, kw.get("mirror") == "copy_")
        _step(*setups[name])  # state allocation (and the C++ extension's load) out of the timing
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):
        for name, setup in setups.items():
            t0 = time.perf_counter()
            _step(*setup)
            samples[name].append(time.perf_counter() - t0)
    rows = []
    for name, (params, opt, copies, _) in setups.items():
        if copies:
            assert all(torch.equal(c, p.detach().bfloat16()) for p, c in zip(params, copies)), name
        row = {"variant": name, "kwargs": VARIANTS[name], "step_s": statistics.median(samples[name]),
               "best_s": min(samples[name]), "params": size * n_tensors}
        if isinstance(opt, AdamW):
            row["backend"] = opt.backend
        rows.append(row)
    os.environ.pop(BACKEND_ENV, None)
    base = rows[0]["step_s"]
    baseline = next(r["step_s"] for r in rows if r["variant"] == BASELINE)
    for r in rows:
        r["speedup_vs_for_loop"] = base / r["step_s"]
        r["speedup_vs_fused_copy"] = baseline / r["step_s"]
        r["params_per_s"] = r["params"] / r["step_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench(int(args.params), args.tensors, args.repeats)
    table = Table(title=f"AdamW step on the CPU, {int(args.params):,} fp32 parameters in {args.tensors} tensors, "
                        f"{torch.get_num_threads()} threads")
    for col in ("variant", "step", "best", "params/s", "vs for-loop", "vs fused + copy_"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], f"{r['step_s'] * 1e3:.1f} ms", f"{r['best_s'] * 1e3:.1f} ms",
                      f"{r['params_per_s'] / 1e6:.0f} M",
                      f"{r['speedup_vs_for_loop']:.2f}×", f"{r['speedup_vs_fused_copy']:.2f}×")
    Console(width=140).print(table)
    out = Path(__file__).parent / "results" / "optimizer.json"
    out.parent.mkdir(exist_ok=True)
    write_atomic(out, json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
