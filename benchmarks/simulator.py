"""The simulator against the executor it models: predicted vs measured per-stage and iteration times.

A LLaMA-shaped decoder is compiled with costs *measured on this machine* (``MeasuredCostModel``, calibrated to a
whole-graph step, at the intra-op thread count each logical device gets) and trained on 1 and 2 logical CPU
devices; the executor records every action's start and end, and :func:`rpcompile.tools.simulator_validation.validate` compares
them with the plan's stage times and with the simulator walking the same action lists. Where CUDA is present the
same runs on ``cuda:0`` (record those figures in RESULTS.md with the device and date).

    python benchmarks/simulator.py [--layers 4] [--dim 512] [--seq 256] [--batch 6] [--iterations 5]

Targets (issue 5): per-stage time within ±25% and iteration time within ±15%.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from rpcompile.core.files import write_atomic
from rpcompile.models.llama import Llama, LlamaConfig
from rpcompile.models.registry import lm_loss
from rpcompile.tools.simulator_validation import compile_for_validation, validate

RESULTS = Path(__file__).parent / "results" / "simulator.json"


def run(devices: list[str], args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, dim=args.dim, ffn_dim=3 * args.dim, n_layers=args.layers, n_heads=4,
                      n_kv_heads=2, max_seq_len=args.seq)
    model = Llama(cfg)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    pipe = compile_for_validation(model, (x,), devices=devices, loss_fn=lm_loss, microbatches=args.microbatches)
    v = validate(pipe, x, target=y, iterations=args.iterations)
    return {"devices": devices, "calibration": pipe.gm.meta.get("rpcompile.calibration"), **v.to_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=5)
    args = ap.parse_args()
    configs = [["cpu"], ["cpu", "cpu"]] + ([["cuda:0"]] if torch.cuda.is_available() else [])
    console = Console(width=max(Console().width, 120))
    out = {"date": dt.date.today().isoformat(), "machine": platform.node(), "torch": torch.__version__,
           "cpu_threads": torch.get_num_threads(), "config": vars(args), "runs": []}
    for devices in configs:
        r = run(devices, args)
        out["runs"].append(r)
        t = Table(title=f"{len(devices)} × {devices[0]}: iteration predicted {r['predicted_iteration_s'] * 1e3:.1f} ms, "
                        f"measured {r['measured_iteration_s'] * 1e3:.1f} ms (ratio {r['iteration_ratio']:.2f})")
        for col in ("stage", "predicted ms", "measured ms", "measured / predicted"):
            t.add_column(col, justify="left" if col == "stage" else "right")
        for s in r["stages"]:
            t.add_row(s["name"], f"{s['predicted_s'] * 1e3:.2f}", f"{s['measured_s'] * 1e3:.2f}", f"{s['ratio']:.2f}")
        console.print(t)
        within = sum(1 for s in r["stages"] if abs(s["ratio"] - 1) <= 0.25)
        console.print(f"  stages within ±25%: {within}/{len(r['stages'])}; iteration within ±15%: "
                      f"{'PASS' if abs(r['iteration_ratio'] - 1) <= 0.15 else 'FAIL'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(RESULTS, json.dumps(out, indent=1) + "\n")
    console.print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
