"""CPU optimizer step: torch.optim.AdamW implementations side by side (the runtime steps fp32 masters on the CPU).

Prints a table (time per step, parameters/s, ratio to the default) and writes benchmarks/results/optimizer.json.
    python benchmarks/optimizer.py [--params 50e6] [--tensors 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

VARIANTS = {
    "for-loop (foreach=False)": dict(foreach=False),
    "foreach (default on CUDA)": dict(foreach=True),
    "fused (fused=True)": dict(fused=True),
}


def bench(n_params: int, n_tensors: int, repeats: int) -> list[dict]:
    size = n_params // n_tensors
    rows = []
    for name, kw in VARIANTS.items():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(size)) for _ in range(n_tensors)]
        for p in params:
            p.grad = torch.randn(size)
        opt = torch.optim.AdamW(params, lr=1e-3, **kw)
        opt.step()  # state allocation out of the timing
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            samples.append(time.perf_counter() - t0)
        rows.append({"variant": name, "kwargs": kw, "step_s": statistics.median(samples), "params": size * n_tensors})
    base = rows[0]["step_s"]
    for r in rows:
        r["speedup_vs_for_loop"] = base / r["step_s"]
        r["params_per_s"] = r["params"] / r["step_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = bench(int(args.params), args.tensors, args.repeats)
    table = Table(title=f"AdamW step on the CPU, {int(args.params):,} fp32 parameters in {args.tensors} tensors, "
                        f"{torch.get_num_threads()} threads")
    for col in ("variant", "step", "params/s", "vs for-loop"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], f"{r['step_s'] * 1e3:.1f} ms", f"{r['params_per_s'] / 1e6:.0f} M",
                      f"{r['speedup_vs_for_loop']:.2f}×")
    Console().print(table)
    out = Path(__file__).parent / "results" / "optimizer.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
