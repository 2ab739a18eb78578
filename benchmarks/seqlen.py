"""The longest sequence that fits 8 RTX 4090s, predicted, against RoundPipe's published figures.

RoundPipe (Luo et al., 2026) reports the longest sequence it trains on 8x 24 GB RTX 4090s: 73K tokens for
Qwen3-1.7B, 49K for Llama-3.1-8B, 28K for Qwen3-32B. This script asks :func:`rpcompile.max_sequence_length`
the same question for the built-in meta presets of those shapes (``llama-1.7b``, ``llama-8b``, ``llama-32b``):
bisection over the analytic cost model to ``--granularity`` tokens, one sequence per microbatch, bf16. The
figures are predictions of rpcompile's memory model, not runs on GPUs. Prints a table and writes
benchmarks/results/seqlen.json.

    python benchmarks/seqlen.py [--models llama-1.7b,llama-8b] [--gpus 8] [--granularity 1024] [--head-chunks 1]

The default models are llama-1.7b and llama-8b: llama-32b's probes take about a minute each on the shared
2-core reference machine (``--models llama-1.7b,llama-8b,llama-32b`` runs it too).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rpcompile.core.files import write_atomic
from rpcompile.planner.seqlen import max_sequence_length

ROUNDPIPE = {"llama-1.7b": ("Qwen3-1.7B", 73_000), "llama-8b": ("Llama-3.1-8B", 49_000),
             "llama-32b": ("Qwen3-32B", 28_000)}
"""Preset -> (the paper's model, RoundPipe's longest trained sequence on 8x RTX 4090, tokens; "73K" read as 73,000)."""

OUT = Path(__file__).parent / "results" / "seqlen.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-1.7b,llama-8b")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--spec", default="rtx4090")
    ap.add_argument("--granularity", type=int, default=1024)
    ap.add_argument("--time-limit", type=float, default=5.0, help="ILP seconds for the plan at the answer")
    ap.add_argument("--head-chunks", default="auto", help="LM-head split: auto (default: 8 chunks where it fits) or K "
                                                           "(1: the whole head, as RoundPipe runs it)")
    ap.add_argument("-o", "--output", default=str(OUT))
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        t = time.perf_counter()
        r = max_sequence_length(name, gpus=args.gpus, spec=args.spec, granularity=args.granularity,
                                head_chunks=args.head_chunks if args.head_chunks == "auto" else int(args.head_chunks),
                                time_limit_s=args.time_limit, progress=lambda line, n=name: print(f"  {n}: {line}"))
        paper, theirs = ROUNDPIPE.get(name, (name, None))
        rows.append({"model": name, "paper_model": paper, "roundpipe_tokens": theirs,
                     "ratio": r.seq_len / theirs if theirs else None, "wall_s": time.perf_counter() - t, **r.to_dict()})
        print("\n".join(f"  {line}" for line in r.lines()))
    table = Table(title=f"Longest sequence per microbatch on {args.gpus} x {args.spec} (rpcompile: predicted)")
    for col in ("model", "rpcompile (predicted)", "RoundPipe (paper)", "ratio", "head chunks", "binding stage",
                "stage memory", "activations / weights", "next step refused by"):
        table.add_column(col)
    for row in rows:
        b, r = row["binding"], row["refused"]
        table.add_row(f"{row['model']} ({row['paper_model']})", f"{row['seq_len']:,}",
                      f"{row['roundpipe_tokens']:,}" if row["roundpipe_tokens"] else "-",
                      f"{row['ratio']:.2f}x" if row["ratio"] else "-", str(row["head_chunks"]), b["stage"],
                      f"{b['memory_bytes'] / 2**30:.2f} / {b['limit_bytes'] / 2**30:.2f} GiB",
                      f"{b['activation_bytes'] / 2**30:.2f} / {b['weight_bytes'] / 2**30:.2f} GiB",
                      f"{r['segment']} ({r['need_bytes'] / 2**30:.2f} GiB at {r['seq_len']:,})" if r else "-")
    Console(width=200).print(table)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(args.output), json.dumps({"date": "2026-11-26", "prediction": True, "gpus": args.gpus,
                                             "spec": args.spec, "granularity": args.granularity,
                                             "head_chunks": args.head_chunks, "rows": rows},
                                            indent=1) + "\n")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
