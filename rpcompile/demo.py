"""The main job (``make demo`` / ``rpcompile demo``): rpcompile end to end on built-in models.

It grows with the compiler. Today:

1. trace a built-in model, cost every node on the device at hand (CUDA if present, else the CPU) and print the
   per-module table;
2. partition it for the devices that exist (each GPU, or two logical CPU devices) and compare the ILP plan with the
   baselines under one timing model;
3. train it for a few steps with ``rpcompile.compile`` on those devices (weights and AdamW state on the CPU),
   showing the loss fall;
4. plan the real LLaMA-8B shape for 8 × RTX 4090 on the meta device — the laptop side of an 8-GPU run — with the
   whole LM head and with the head and its loss split into sequence chunks (what ``head_chunks="auto"`` weighs).
"""

from __future__ import annotations

import time

import torch
from rich.console import Console

__all__ = ["run_demo"]


def _devices() -> tuple[int, str]:
    if torch.cuda.is_available():
        return torch.cuda.device_count(), f"cuda:0..{torch.cuda.device_count() - 1}"
    return 2, "2 logical CPU devices"


def run_demo(model_name: str = "llama-demo", *, big_model: str = "llama-8b", big_gpus: int = 8, steps: int = 5) -> int:
    import rpcompile
    from rpcompile.models import load_model
    from rpcompile.planning import AUTO_HEAD_CHUNKS, compare, make_hardware, plan, prepare
    from rpcompile.profiling import profile_graph
    from rpcompile.report import compare_table, fmt_bytes, plan_table, print_table, profile_table

    console = Console(width=max(Console().width, 120))
    n_dev, where = _devices()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"

    console.rule(f"[bold]1. {model_name}: trace and cost on {device}")
    ms = load_model(model_name)
    t0 = time.perf_counter()
    gm, m = prepare(ms.model, ms.example_inputs, gpus=n_dev, device=device)
    prof = profile_graph(gm)
    print_table(profile_table(prof, title=f"{model_name}: one microbatch measured on {device} (traced with {prof.trace})"), console)
    console.print(f"traced, profiled and coarsened {prof.total.nodes} nodes in {time.perf_counter() - t0:.1f} s")

    console.rule(f"[bold]2. {model_name}: round-robin plan for {where}, {m} microbatches")
    hardware = make_hardware(n_dev, "cpu" if device == "cpu" else "rtx4090")
    rows = compare(gm, hardware=hardware, microbatches=m, time_limit_s=5.0)
    print_table(plan_table(rows["ilp"][1]), console)
    print_table(compare_table(rows), console)

    console.rule(f"[bold]3. {model_name}: train {steps} steps on {where}")
    train = load_model(model_name, batch_size=4 * n_dev)
    devices = [f"cuda:{i}" for i in range(n_dev)] if device != "cpu" else ["cpu"] * n_dev
    pipe = rpcompile.compile(train.model, train.example_inputs, loss_fn=train.loss_fn, devices=devices,
                             precision="bf16" if device != "cpu" else "fp32", time_limit_s=5.0)
    optimizer = torch.optim.AdamW(train.model.parameters(), lr=3e-3)
    x, = train.example_inputs
    for step in range(steps):
        t0 = time.perf_counter()
        loss = pipe.forward_backward(x, target=train.example_target)
        optimizer.step()
        optimizer.zero_grad()
        console.print(f"step {step}: loss {loss.item():.4f}  ({time.perf_counter() - t0:.2f} s, "
                      f"{len(pipe.plan.stages)} stages, {pipe.microbatches} microbatches)")

    console.rule(f"[bold]4. {big_model} on {big_gpus} × rtx4090 (meta device, analytic costs, bf16, seq 4096)")
    t0 = time.perf_counter()
    big = load_model(big_model, batch_size=2 * big_gpus)
    gm8, m8 = prepare(big.model, big.example_inputs, gpus=big_gpus, spec="rtx4090", microbatches=2 * big_gpus,
                      precision="bf16", progress=False)
    rows8 = compare(gm8, hardware=make_hardware(big_gpus, "rtx4090"), microbatches=m8, precision="bf16", time_limit_s=10.0)
    print_table(compare_table(rows8), console)
    whole = rows8["ilp"][1]
    split = plan(big.model, big.example_inputs, gpus=big_gpus, spec="rtx4090", microbatches=2 * big_gpus,
                 precision="bf16", time_limit_s=10.0, progress=False, loss_fn=big.loss_fn,
                 example_target=big.example_target, head_chunks=AUTO_HEAD_CHUNKS)
    if whole is not None:
        console.print(f"ilp with the LM head and its loss in {split.head_chunks} sequence chunks: "
                      f"{split.predicted.iteration_time_s:.3f} s per iteration (whole head {whole.predicted.iteration_time_s:.3f} s), "
                      f"bubble {split.predicted.bubble_fraction:.1%}, peak memory {fmt_bytes(split.predicted.peak_memory_bytes)}; "
                      f"rpcompile.compile(..., example_target=y) keeps the faster")
    console.print(f"planned {big_model} without allocating its weights in {time.perf_counter() - t0:.1f} s")
    return 0
