"""The main job (``make demo`` / ``rpcompile demo``): rpcompile end to end on built-in models.

It grows with the compiler. Today:

1. trace a built-in model, cost every node for the devices at hand and print the per-module table: measured on
   the GPU when there is one; on a CPU-only machine from the ``cpu`` spec's analytic costs, so that the plan is
   the same on every run (node times measured on a CPU swing with the machine's load, and so would the plan;
   ``rpcompile profile llama-demo`` measures them);
2. partition it for the devices that exist (each GPU, or two logical CPU devices) and compare the ILP plan with the
   baselines under one timing model;
3. train **that plan** for a few steps with ``rpcompile.compile(..., plan=)`` on those devices (weights and AdamW
   state on the CPU), showing the loss fall, and set its measured step time beside the plan's prediction — saying
   plainly what the prediction is (and is not) on this machine;
4. plan the real LLaMA-8B shape for 8 × RTX 4090 on the meta device — the laptop side of an 8-GPU run — with the
   whole LM head and with the head and its loss split into sequence chunks (what ``head_chunks="auto"`` weighs).
   Everything there is predicted (analytic costs): nothing runs.
"""

from __future__ import annotations

import statistics
import time
import torch
from rich.console import Console

from rpcompile import compiler
from rpcompile.core.errors import InfeasibleError
from rpcompile.core.plan import Plan
from rpcompile.core.units import fmt_bytes, fmt_ms
from rpcompile.models.registry import ModelSpec, load_model
from rpcompile.planner.plan_options import AUTO_HEAD_CHUNKS, PlanOptions, make_hardware
from rpcompile.planner.planning import compare, prepare
from rpcompile.planner.planning import plan as plan_model
from rpcompile.planner.profiling import profile_graph
from rpcompile.views.report import compare_table, plan_table, print_table, profile_table

__all__ = ["run_demo"]

#: What a prediction is on logical CPU devices, said under the training steps.
CPU_NOTE = ("On this machine the prediction is not a forecast of these steps: the timing model is for devices that "
            "compute in parallel, each with its own link, while these two 'devices' are threads sharing the same CPU "
            "cores and handing tensors over in Python, and its costs are the cpu spec's analytic estimates. The "
            "prediction is what the planner optimised; the loss falling is what this section shows.")


def _devices() -> tuple[int, str]:
    if torch.cuda.is_available():
        return torch.cuda.device_count(), f"cuda:0..{torch.cuda.device_count() - 1}"
    return 2, "2 logical CPU devices"


def run_demo(model_name: str = "llama-demo", *, big_model: str = "llama-8b", big_gpus: int = 8, steps: int = 5,
             console: Console | None = None) -> int:
    # the tables are wide: never narrower than 120 columns, even in a narrow or piped terminal
    console = console or Console(width=max(Console().width, 120))
    n_dev, where = _devices()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    # enough rows for the default gpus + 1 microbatches at any device count
    ms = load_model(model_name, batch_size=4 * n_dev)
    plan, m = _plan_here(console, ms, model_name, n_dev, where, device)
    _train(console, ms, plan, model_name, n_dev, where, device, steps)
    if big_model:
        _plan_big(console, big_model, big_gpus)
    return 0


def _plan_here(console: Console, ms: ModelSpec, name: str, n_dev: int, where: str, device: str) -> tuple[Plan, int]:
    """Sections 1 and 2: cost the model on the device at hand, plan it for the devices here; the ILP's plan."""
    on_cpu = device == "cpu"
    costs = "predicted from the cpu spec's analytic costs" if on_cpu else f"measured on {device}"
    console.rule(f"[bold]1. {name}: trace and cost ({costs})")
    t0 = time.perf_counter()
    precision = "fp32" if on_cpu else "bf16"
    gm, m = prepare(ms.model, ms.example_inputs, PlanOptions(gpus=n_dev, spec="cpu" if on_cpu else None,
                    device=None if on_cpu else device, precision=precision))
    prof = profile_graph(gm)
    print_table(profile_table(prof, title=f"{name}: one microbatch, {costs} (traced with {prof.trace})"), console)
    console.print(f"traced, profiled and coarsened {prof.total.nodes} nodes in {time.perf_counter() - t0:.1f} s")

    console.rule(f"[bold]2. {name}: round-robin plan for {where}, {m} microbatches")
    hardware = make_hardware(n_dev, "cpu" if device == "cpu" else "rtx4090")
    with console.status("solving: ilp (up to 5 s), dp, roundpipe, uniform"):
        rows = compare(gm, hardware=hardware, microbatches=m, precision=precision, time_limit_s=5.0)
    chosen = rows["ilp"][1]
    if chosen is None:
        raise InfeasibleError(f"{name}: the ilp found no plan for {where} in 5 s; run rpcompile plan {name} --gpus {n_dev} "
                              "for the details")
    print_table(plan_table(chosen, title=f"{name}: the ilp plan, {len(chosen.stages)} stages on {where}, {m} microbatches "
                           "(trained in section 3)"), console)
    print_table(compare_table(rows), console)
    return chosen, m


def _train(console: Console, ms: ModelSpec, plan: Plan, name: str, n_dev: int, where: str, device: str, steps: int) -> None:
    """Section 3: train the plan of section 2, then its prediction beside the measured pipeline steps (the
    prediction is for ``forward_backward``; the optimizer runs on the CPU afterwards, timed apart)."""
    console.rule(f"[bold]3. {name}: train the plan above for {steps} steps on {where}")
    devices = [f"cuda:{i}" for i in range(n_dev)] if device != "cpu" else ["cpu"] * n_dev
    pipe = compiler.compile(ms.model, ms.example_inputs, loss_fn=ms.loss_fn, devices=devices, plan=plan,
                            precision=plan.precision)
    optimizer = torch.optim.AdamW(ms.model.parameters(), lr=3e-3, fused=True)  # the README's advice
    x, = ms.example_inputs
    took: list[float] = []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = pipe.forward_backward(x, target=ms.example_target)
        t1 = time.perf_counter()
        # the optimizer is left out of the timed span: the plan's prediction compared below is for forward_backward
        optimizer.step()
        optimizer.zero_grad()
        took.append(t1 - t0)
        first = " — includes capturing the saved segments' graphs, once" if step == 0 else ""
        console.print(f"step {step}: loss {loss.item():.4f}  (pipeline {fmt_ms(took[-1])}, optimizer "
                      f"{fmt_ms(time.perf_counter() - t1)}; {len(pipe.plan.stages)} stages, {pipe.microbatches} "
                      f"microbatches){first}")
    model_eval = ms.model.training
    ms.model.eval()  # evaluation as users run it: dropout off, the same microbatches, no gradients
    after = pipe.evaluate(x, target=ms.example_target)
    ms.model.train(model_eval)
    console.print(f"after {steps} steps: pipe.evaluate(x, target=y) = {after.item():.4f} (no gradients, "
                  f"the same {pipe.microbatches} microbatches)")
    # step 0 also captures the saved segments: left out of the median unless it is the only step
    _compare(console, plan, statistics.median(took[1:] or took), device, steps)


def _compare(console: Console, plan: Plan, measured: float, device: str, steps: int) -> None:
    predicted = plan.predicted.pipeline_s or plan.predicted.iteration_time_s  # the timed step has no optimizer
    costs = "the cpu spec's analytic costs" if device == "cpu" else f"costs measured per node on {device}"
    console.print(f"plan's prediction: {fmt_ms(predicted)} per pipeline step (timing model over {costs}); "
                  f"measured: {fmt_ms(measured)} (median of steps 1–{steps - 1}), {measured / predicted:.2g}× the "
                  "prediction.")
    if device == "cpu":
        console.print(CPU_NOTE)


def _plan_big(console: Console, big_model: str, big_gpus: int) -> None:
    """Section 4: the real LLaMA-8B shape planned for 8 GPUs on the meta device, whole and split LM head."""
    m8 = 2 * big_gpus
    console.rule(f"[bold]4. {big_model} on {big_gpus} × rtx4090, {m8} microbatches (meta device, analytic costs, "
                 "bf16, seq 4096): predicted, nothing runs")
    t0 = time.perf_counter()
    big = load_model(big_model, batch_size=m8)
    with console.status(f"costing {big_model} and solving (ilp up to 10 s)"):
        gm8, m8 = prepare(big.model, big.example_inputs, PlanOptions(gpus=big_gpus, spec="rtx4090", microbatches=m8,
                          precision="bf16", progress=False))
        rows8 = compare(gm8, hardware=make_hardware(big_gpus, "rtx4090"), microbatches=m8, precision="bf16",
                        time_limit_s=10.0)
    print_table(compare_table(rows8), console)
    whole = rows8["ilp"][1]
    with console.status(f"planning {big_model} with its LM head split into {AUTO_HEAD_CHUNKS} chunks as well"):
        split = plan_model(big.model, big.example_inputs, gpus=big_gpus, spec="rtx4090", microbatches=m8,
                           precision="bf16", time_limit_s=10.0, progress=False, loss_fn=big.loss_fn,
                           example_target=big.example_target, head_chunks=AUTO_HEAD_CHUNKS)
    if whole is not None:
        console.print(f"predicted: ilp with the LM head and its loss in {split.head_chunks} sequence chunks "
                      f"{fmt_ms(split.predicted.iteration_time_s)} per iteration (whole head "
                      f"{fmt_ms(whole.predicted.iteration_time_s)}), bubble {split.predicted.bubble_fraction:.1%}, "
                      f"peak memory {fmt_bytes(split.predicted.peak_memory_bytes)}; "
                      "rpcompile.compile(..., example_target=y) keeps the faster")
    console.print(f"planned {big_model} without allocating its weights in {time.perf_counter() - t0:.1f} s")
