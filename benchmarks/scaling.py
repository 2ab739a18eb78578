"""Data-parallel scaling, simulated: rpcompile's round-robin pipeline on each of 1, 2, 4 and 8 machines.

Llama-3-8B at its published shape (meta device, analytic ``rtx4090`` costs in bf16, sequence 4096, one sequence
per microbatch, 16 microbatches) is planned once for one machine of 8 RTX 4090s (``ilp``, the LM head split when
that is faster, token embedding on the host); the simulator (:mod:`rpcompile.runtime.sim.simulator`) then plays that
plan with the machines' gradient all-reduce (:func:`rpcompile.tools.simulation.scaling`): after each grad stage's
gradients are added on the host, their fp32 sum goes round a ring over each machine's network link — ``2(n−1)/n``
of 4 bytes per parameter — in stage order, overlapped with the later stages (what the runtime does,
:mod:`rpcompile.runtime.reduce`) or all after the pipeline (``after``); the token-embedding table, which only
the host reads, is reduced last. Every machine keeps its own batch (weak scaling), so tokens/s is ``n`` times one
machine's at efficiency ``T₁ / Tₙ``. All figures are predictions of the simulator, not measurements.

    python benchmarks/scaling.py [--nodes 1,2,4,8] [--network 25Gb/s,100Gb/s] [--time-limit 10]

Target (issue 22): tokens/s and efficiency for 1/2/4/8 nodes over 25 and 100 Gb/s, overlapped vs not.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch
from rich.console import Console

from rpcompile.cli.argtypes import network_rates, node_counts
from rpcompile.core.files import write_atomic
from rpcompile.models.registry import load_model
from rpcompile.tools.simulation import model_scenarios, scaling
from rpcompile.views.report import print_table, scaling_table

MODEL, SPEC, PRECISION, SEQ_LEN, GPUS, MICROBATCHES = "llama-8b", "rtx4090", "bf16", 4096, 8, 16
RESULTS = Path(__file__).parent / "results" / "scaling.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=node_counts, default=[1, 2, 4, 8])
    ap.add_argument("--network", type=network_rates, default=network_rates("25Gb/s,100Gb/s"))
    ap.add_argument("--time-limit", type=float, default=10.0, help="the ILP's time limit (s)")
    ap.add_argument("-o", "--output", type=Path, default=RESULTS)
    args = ap.parse_args()
    started = time.perf_counter()
    spec = load_model(MODEL, batch_size=MICROBATCHES, seq_len=SEQ_LEN)
    scenarios = model_scenarios(spec.model, spec.example_inputs, gpus=GPUS, spec=SPEC, microbatches=MICROBATCHES,
                                precision=PRECISION, schedules=["ilp"], time_limit_s=args.time_limit,
                                loss_fn=spec.loss_fn, example_target=spec.example_target)
    sc = scenarios["ilp"]
    planned = time.perf_counter() - started
    rows = scaling(sc, args.nodes, args.network)
    title = (f"{MODEL} on {GPUS} × {SPEC} per node, {MICROBATCHES} microbatches of {SEQ_LEN} tokens, {PRECISION}: "
             "data-parallel scaling (simulated)")
    print_table(scaling_table(rows, title=title), Console(width=140))
    grads = (sum(s.reduced_bytes for s in sc.stages) + sc.host.host_grad_bytes) * sc.host.reduce_bytes_per_grad_byte
    print(f"gradients all-reduced per iteration: {grads / 1e9:.1f} GB (fp32); plan: {sc.notes.get('stages')} stages, "
          f"LM head in {sc.notes.get('head_chunks')} chunk(s); planned in {planned:.0f} s")
    out = {
        "date": dt.date.today().isoformat(), "machine": platform.node(), "torch": torch.__version__,
        "kind": "simulated (predictions of rpcompile's simulator, analytic rtx4090 costs)",
        "model": MODEL, "spec": SPEC, "gpus_per_node": GPUS, "microbatches": MICROBATCHES, "seq_len": SEQ_LEN,
        "precision": PRECISION, "reduced_bytes_per_iteration": grads, "stages": sc.notes.get("stages"),
        "head_chunks": sc.notes.get("head_chunks"), "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.output, json.dumps(out, indent=1) + "\n")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
