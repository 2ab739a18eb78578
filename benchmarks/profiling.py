"""Measured profiling: every layer measured (the old path) against repeated blocks measured once, and a warm
profile cache.

For each model: the cost pass's wall time (``Compilation.times["cost"]``: the node-by-node run, the meta run that
counts FLOPs and saved bytes, and the measuring) with ``share_repeats=False`` (each layer measured), with
``share_repeats=True`` (each repeated block once) and from a warm cache (nothing measured); the fastest of
``--repeats`` alternating runs each, in one process after one untimed warm-up profile. Also the nodes measured.
Prints a table and writes benchmarks/results/profiling.json.

    python benchmarks/profiling.py [--models llama-demo,gpt-demo,llama-32x64] [--threads 1] [--repeats 2]

``--threads 1`` by default: on a loaded 2-core machine two intra-op threads wait ~20 ms at every barrier and
node times become noise.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from rpcompile.core.files import write_atomic
from rpcompile.models.registry import load_model
from rpcompile.passes.cost.measured import MeasuredCostModel
from rpcompile.planner.planning import FRONT, Compilation, run

OUT = Path(__file__).parent / "results" / "profiling.json"


def _cost_pass(name: str, *, share: bool, cache: bool) -> tuple[float, int]:
    ms = load_model(name)
    cm = MeasuredCostModel("cpu", share_repeats=share, cache=cache)
    c = run(Compilation(ms.model, tuple(ms.example_inputs), {}, cm, microbatches=1, progress=False), FRONT)
    return c.times["cost"], c.graph.meta["rpcompile.profiling"]["measured"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-demo,gpt-demo,llama-32x64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["RPCOMPILE_CACHE"] = tempfile.mkdtemp(prefix="rpcompile-bench-cache-")  # never the user's cache
    rows = []
    for name in args.models.split(","):
        _cost_pass(name, share=True, cache=False)  # warm-up: first-call costs of this process
        per_layer, shared = [], []
        for _ in range(args.repeats):
            per_layer.append(_cost_pass(name, share=False, cache=False))
            shared.append(_cost_pass(name, share=True, cache=False))
        _cost_pass(name, share=True, cache=True)  # fills the cache
        warm = [_cost_pass(name, share=True, cache=True) for _ in range(args.repeats)]
        row = {"model": name, "per_layer_s": min(t for t, _ in per_layer), "per_layer_measured": per_layer[0][1],
               "shared_s": min(t for t, _ in shared), "shared_measured": shared[0][1],
               "warm_cache_s": min(t for t, _ in warm), "warm_measured": warm[0][1]}
        row["shared_speedup"] = row["per_layer_s"] / row["shared_s"]
        row["warm_speedup"] = row["per_layer_s"] / row["warm_cache_s"]
        rows.append(row)
    table = Table(title=f"cost pass wall time, measured on this CPU ({args.threads} intra-op thread(s), fastest of "
                        f"{args.repeats})")
    for col in ("model", "every layer", "nodes measured", "repeats once", "nodes measured", "speed-up", "warm cache",
                "speed-up"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        table.add_row(r["model"], f"{r['per_layer_s']:.2f} s", str(r["per_layer_measured"]), f"{r['shared_s']:.2f} s",
                      str(r["shared_measured"]), f"{r['shared_speedup']:.2f}x", f"{r['warm_cache_s']:.2f} s",
                      f"{r['warm_speedup']:.2f}x")
    Console().print(table)
    OUT.parent.mkdir(exist_ok=True)
    write_atomic(OUT, json.dumps({"device": "cpu", "threads": args.threads, "torch": torch.__version__,
                               "repeats": args.repeats, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
