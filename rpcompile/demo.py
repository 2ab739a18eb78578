"""The main job (``make demo`` / ``rpcompile demo``): show rpcompile end to end on a built-in model.

It grows with the compiler. Today: trace a built-in model, cost every node on the device at hand (CUDA if
present, else the CPU) and print the per-module table; then cost the real LLaMA-8B shape analytically for an
RTX 4090 on the meta device — the laptop-side half of planning an 8-GPU run.
"""

from __future__ import annotations

import time

import torch
from rich.console import Console

__all__ = ["run_demo"]


def run_demo(model_name: str = "llama-demo") -> int:
    from rpcompile.models import load_model
    from rpcompile.profiling import profile
    from rpcompile.report import fmt_bytes, fmt_count, fmt_time, print_table, profile_table

    console = Console(width=max(Console().width, 120))
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    console.rule(f"[bold]rpcompile demo: {model_name} on {device}")
    ms = load_model(model_name)
    t0 = time.perf_counter()
    prof = profile(ms.model, ms.example_inputs, device=device)
    print_table(profile_table(prof, title=f"{model_name}: measured on {device} (traced with {prof.trace})"), console)
    console.print(f"traced and profiled {prof.total.nodes} nodes in {time.perf_counter() - t0:.1f} s")

    console.rule("[bold]llama-8b (Llama-3-8B shape) on the meta device, analytic rtx4090, seq 4096")
    t0 = time.perf_counter()
    big = load_model("llama-8b")
    prof8 = profile(big.model, big.example_inputs, spec="rtx4090", dtype=torch.bfloat16)
    t = prof8.total
    console.print(
        f"{fmt_count(t.params)} parameters ({fmt_bytes(t.param_bytes)} fp32), {fmt_count(t.fwd_flops)}FLOP forward per "
        f"sequence; predicted forward {fmt_time(t.fwd_time_s)}, backward {fmt_time(t.bwd_time_s)}, "
        f"activations {fmt_bytes(t.activation_bytes)} — costed in {time.perf_counter() - t0:.1f} s without allocating weights"
    )
    console.print("[dim]partitioning, code generation and training join this demo as the partitioner and runtime land.")
    return 0
