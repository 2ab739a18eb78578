"""rpcompile on a GPU, side by side with eager PyTorch on the same GPU, in one process.

Sections (each a table; all rows also in the JSON):

- **link** — host link bandwidth: pinned and pageable memory, host-to-device, device-to-host, and both at once.
- **resident** — a model that fits the GPU (default: the Qwen3-1.7B shape, 4 × 1024 tokens): eager PyTorch with the
  whole model on the GPU against rpcompile (``precision="bf16"``, weights in CPU memory).
- **capped** — the GPU capped at ``--cap-gib`` (20 GiB: the usable memory of an RTX 4090); rpcompile trains the
  Llama-3-8B shape, which eager cannot hold; ``--peer roundpipe`` adds the real RoundPipe on the same model.

Per row: tokens/s, step time, peak GPU memory, compile time, and for rpcompile rows the plan's predicted iteration
beside the measured one (:func:`main` says what else each row records). Only GPU rows are measurements of the
product; ``--smoke`` runs the same code on the CPU with a tiny model (CI checks the script; its times mean nothing).

    python benchmarks/gpu.py                       # on a GPU machine: every section
    python benchmarks/gpu.py --sections resident --model llama-1.7b --batch 16 --seq 2048
    python benchmarks/gpu.py --profile traces/     # + a torch profiler trace of one step of each rpcompile row
    python benchmarks/gpu.py --smoke               # the CPU check
    python benchmarks/gpu.py --sections capped --peer roundpipe   # rpcompile and RoundPipe side by side

Writes ``benchmarks/results/gpu.json`` (``--out``) and prints the rows as a Markdown table for RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import logging
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from rich.console import Console
from rich.table import Table
from torch.utils.checkpoint import checkpoint

import rpcompile
from rpcompile.core.files import write_atomic
import roundpipe_peer  # benchmarks/: RoundPipe itself is imported only when --peer roundpipe asks for it
import trace_table  # benchmarks/
from rpcompile.core.specs import get_spec
from rpcompile.models.llama import Llama, LlamaConfig
from rpcompile.models.registry import lm_loss, load_model
from rpcompile.planner.device_probe import probe_dispatch
from rpcompile.runtime.optim import AdamW as MirroringAdamW
from rpcompile.training.host_memory import release_pinned_cache

GiB = 1 << 30
SECTIONS = ("link", "resident", "capped", "seqlen")


# --------------------------------------------------------------------------------------------- timing helpers
_T0 = time.perf_counter()


def _say(msg: str) -> None:
    """Progress on stderr, with the seconds since start: a run cut short by a time limit shows where it was."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / GiB if device.startswith("cuda") else None


@contextlib.contextmanager
def _pass_times(row: dict) -> Any:
    """``row["compile_passes"]``: seconds per compile pass (trace, shape, cost, partition, ...; summed over the
    LM-head splits) from the ``rpcompile`` logger, and ``"other"``: what ``compile`` spent outside them. A compile
    that misses its time target then says where the time went. Parts (a dotted name: ``pipeline.executor`` of a
    pass, ``compile.host memory fit`` of compile, which holds a re-plan's passes) go to ``row["compile_parts"]``:
    they overlap the passes, so they are kept apart from them."""
    times: dict[str, float] = {}
    parts: dict[str, float] = {}

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg == "%s: %.2f s" and len(record.args or ()) == 2:
                name, seconds = record.args  # type: ignore[misc]
                into = parts if "." in str(name) else times
                into[str(name)] = into.get(str(name), 0.0) + float(seconds)

    logger, handler = logging.getLogger("rpcompile"), Collect(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        times["other"] = max(0.0, time.perf_counter() - t0 - sum(times.values()))
        row["compile_passes"] = {k: round(v, 3) for k, v in times.items()}
        row["compile_parts"] = {k: round(v, 3) for k, v in parts.items()}


def _timed(step: Callable[[], Any], steps: int, device: str) -> float:
    """Median wall time of ``step`` over ``steps`` runs after one warm-up run."""
    step()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _period(step: Callable[[], Any], steps: int, finish: Callable[[], None]) -> float:
    """Mean wall time of ``step`` over ``steps`` runs after one warm-up run, ``finish`` (the last drain) included:
    steps that return before their work is done, timed back to back."""
    step()
    finish()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    finish()
    return (time.perf_counter() - t0) / steps


# --------------------------------------------------------------------------------------------- link
def link_rows(size_mib: int = 256, repeats: int = 5) -> list[dict]:
    """Host link bandwidth (GB/s) per direction and memory kind, and both directions at once."""
    n = size_mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    rows = []
    for kind in ("pinned", "pageable"):
        host = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=kind == "pinned")
        host2 = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=kind == "pinned")
        up, down = torch.cuda.Stream(), torch.cuda.Stream()

        def h2d() -> None:
            with torch.cuda.stream(up):
                dev.copy_(host, non_blocking=True)
            up.synchronize()

        def d2h() -> None:
            with torch.cuda.stream(down):
                host.copy_(dev, non_blocking=True)
            down.synchronize()

        def both() -> None:
            with torch.cuda.stream(up):
                dev2.copy_(host2, non_blocking=True)
            with torch.cuda.stream(down):
                host.copy_(dev, non_blocking=True)
            up.synchronize(), down.synchronize()

        for name, fn, moved in (("host→device", h2d, n), ("device→host", d2h, n), ("both at once", both, 2 * n)):
            t = _timed(fn, repeats, "cuda")
            rows.append({"section": "link", "memory": kind, "direction": name, "bytes": moved,
                         "seconds": t, "GB_per_s": moved / t / 1e9})
    return rows


# --------------------------------------------------------------------------------------------- models
class _Checkpointed(nn.Module):
    """One layer recomputed in backward (torch.utils.checkpoint, non-reentrant): per-layer checkpointing."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.layer, *args, use_reentrant=False)


def _eager_variant(model: nn.Module, device: str, weights: torch.dtype, checkpointed: bool) -> nn.Module:
    m = copy.deepcopy(model).to(device=device, dtype=weights)
    if checkpointed:
        for i, layer in enumerate(m.layers):
            m.layers[i] = _Checkpointed(layer)
    return m


def eager_row(spec: Any, device: str, label: str, weights: torch.dtype, checkpointed: bool, steps: int) -> dict:
    (x,), y = spec.example_inputs, spec.example_target
    _peak_reset(device)
    t0 = time.perf_counter()
    model = _eager_variant(spec.model, device, weights, checkpointed)
    setup = time.perf_counter() - t0
    xd, yd = x.to(device), y.to(device)
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if weights == torch.float32 \
        else contextlib.nullcontext()

    def step() -> None:
        with autocast:
            loss = spec.loss_fn(model(xd), yd)
        loss.backward()
        model.zero_grad(set_to_none=True)

    try:
        t = _timed(step, steps, device)
        row = {"step_s": t, "peak_gib": _peak(device), "error": None}
    except torch.OutOfMemoryError as e:
        row = {"step_s": None, "peak_gib": _peak(device), "error": f"out of memory: {str(e).splitlines()[0]}"}
    del model
    gc.collect()
    return {"section": "resident", "system": "eager", "variant": label, "setup_s": setup, **row}


#: Host bytes per parameter an optimizer row needs: fp32 master, gradient and two Adam moments, the bf16 copy (and
#: its second buffer while the step overlaps), with 10% to spare.
_HOST_BYTES_PER_PARAM = (4 + 4 + 8 + 2 + 2) * 1.1

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "rpcompile": lambda ps: MirroringAdamW(ps, lr=1e-5),
    "torch": lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=True),
}


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def optimizer_rows(pipe: Any, spec: Any, base: dict, steps: int, device: str, optimizer: str) -> list[dict]:
    """``base``'s pipeline with ``optimizer`` stepping inside the loop: synchronous, then overlapped."""
    (x,), y = spec.example_inputs, spec.example_target
    params = sum(p.numel() for p in spec.model.parameters() if p.requires_grad)
    need, have = params * _HOST_BYTES_PER_PARAM, _host_memory()
    pred = pipe.plan.predicted
    rows = []
    opt = None
    for overlap, iterations in ((False, False), (True, False), (True, True)):
        mode = ("iterations overlapped (one step stale)" if iterations else "step overlapped (one step stale)"
                if overlap else "step synchronous")
        label = f"{base['variant']}, {optimizer} AdamW {mode}"
        predicted = (pred.iteration_time_s if pred.overlap_iterations else None) if iterations else \
            max(pred.pipeline_s, pred.host_s) if overlap else pred.pipeline_s + pred.host_s
        row = {**base, "variant": label, "profile": None, "loss": None, "predicted_s": predicted}
        if need > have:
            row.update(step_s=None, error=f"host memory: needs {need / GiB:.0f} GiB for masters, gradients, Adam "
                                          f"state and copies; the machine has {have / GiB:.0f} GiB")
            rows.append(row)
            continue
        if opt is None:
            opt = OPTIMIZERS[optimizer](spec.model.parameters())

        def step(overlap: bool = overlap) -> None:
            pipe.forward_backward(x, target=y)
            pipe.step(opt, overlap=overlap)

        try:
            pipe.overlap_iterations = iterations
            # overlapped iterations: a step returns while its last stages drain; the period over all the steps
            timed = _period(step, steps, pipe.synchronize) if iterations else _timed(step, steps, device)
            row.update(step_s=timed, peak_gib=_peak(device), error=None)
            pipe.synchronize()
            row["backend"] = getattr(opt, "backend", "torch")
            calibration_record(pipe, row, None)  # this row's stages (the plan file is the base row's)
        except Exception as e:  # noqa: BLE001 - reported in the table
            row.update(step_s=None, error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
        row["predicted_over_measured"] = row["predicted_s"] / row["step_s"] \
            if row["step_s"] and row["predicted_s"] else None
        rows.append(row)
    del opt
    spec.model.zero_grad(set_to_none=True)
    gc.collect()
    return rows


def rpcompile_row(spec: Any, devices: list[str], label: str, steps: int, *, section: str, microbatches: int | None,
                  memory_limit: int | None, cost_spec: str | None, profile: Path | None,
                  optimizer: str | None = None, recompile: bool = False, plans: Path | None = None,
                  save: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """rpcompile's row (forward+backward per step), then — given ``optimizer`` — :func:`optimizer_rows`.
    ``recompile``: compile the same model again once the steps ran, and record its time (``recompile_s``: with
    measured costs, the profile cache is warm then). ``plans``: where the row's plan file goes
    (:func:`calibration_record`). ``save(rows)``: called with the measured rows before the warm compile."""
    (x,), y = spec.example_inputs, spec.example_target
    device = devices[0]
    _peak_reset(device)
    _say(f"{section}: compiling {label}")
    passes: dict[str, Any] = {}
    t0 = time.perf_counter()
    with _pass_times(passes):
        # allow_save=True: these rows step no optimizer, so the plan need not leave host memory for AdamW's state
        # (rpcompile.training.host_memory); the AdamW rows below check the host themselves
        pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=devices, precision="bf16",
                                 microbatches=microbatches, memory_limit=memory_limit, spec=cost_spec,
                                 example_target=y, allow_save=True)
    compile_s = time.perf_counter() - t0
    _say(f"{section}: compiled in {compile_s:.1f} s; stepping")

    losses: list[float] = []

    def step() -> None:
        losses[:] = [float(pipe.forward_backward(x, target=y))]
        spec.model.zero_grad(set_to_none=True)

    row: dict[str, Any] = {"section": section, "system": "rpcompile", "variant": label, "setup_s": compile_s,
                           "stages": len(pipe.plan.stages), "microbatches": pipe.microbatches,
                           "head_chunks": pipe.plan.head_chunks, **passes,
                           # the pipeline's part of the prediction: these steps run no optimizer
                           "predicted_s": pipe.plan.predicted.pipeline_s or pipe.plan.predicted.iteration_time_s}
    # weights that stay on the device (issue 35 item 5): what the plan sends up a step, and what went up (no
    # optimizer steps here, so a resident plan's steps after the first upload nothing)
    row.update(resident=pipe.plan.resident, weights_up_gib_planned=sum(s.weight_bytes for s in pipe.plan.stages) / 2**30)
    uploaded = sum(pipe.executor.stays.uploaded)
    try:
        row.update(step_s=_timed(step, steps, device), peak_gib=_peak(device), error=None)
    except Exception as e:  # noqa: BLE001 - reported in the table: a failing row must not hide the others
        row.update(step_s=None, peak_gib=_peak(device), error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    row["weights_up_gib_per_step"] = (sum(pipe.executor.stays.uploaded) - uploaded) / (steps + 1) / 2**30
    if profile is not None and row["error"] is None:
        profile.mkdir(parents=True, exist_ok=True)
        with torch.profiler.profile(record_shapes=False,
                                    experimental_config=trace_table.profiler_config(cuda=device.startswith("cuda"))) as prof:
            step()
            _sync(device)
        path = profile / f"{section}-{re.sub(r'[^A-Za-z0-9.-]+', '_', label)}.json"  # a plain name: it travels
        prof.export_chrome_trace(str(path))
        row["profile"] = str(path)
    if row["step_s"]:
        row["predicted_over_measured"] = row["predicted_s"] / row["step_s"]
        calibration_record(pipe, row, plans)
    row["loss"] = losses[0] if losses else None
    rows = [row]
    if optimizer is not None and row["error"] is None:
        rows += optimizer_rows(pipe, spec, row, steps, device, optimizer)
    stages = pipe.plan.to_dict()["stages"]
    del pipe  # before the warm compile: two pipelines of a large model do not fit the host together
    gc.collect()
    if recompile:
        if save is not None:
            save(rows)
        _say(f"{section}: compiling again (warm cache)")
        release_pinned_cache()
        warm: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            with _pass_times(warm):
                again = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=devices, precision="bf16",
                                          microbatches=microbatches, memory_limit=memory_limit, spec=cost_spec,
                                          example_target=y, allow_save=True)
            row["recompile_s"] = time.perf_counter() - t0
            row["recompile_passes"] = warm["compile_passes"]
            row["same_plan_again"] = again.plan.to_dict()["stages"] == stages
            del again
        except Exception as e:  # noqa: BLE001 - the measured rows above must survive a failing warm compile
            row["recompile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        gc.collect()
    return rows


def calibration_record(pipe: Any, row: dict, plans: Path | None) -> None:
    """What checking the timing model against this row needs (module docstring): the plan's file, the hardware it
    was priced on, and per stage its predicted time and compute per microbatch beside the last call's measured
    actions (the median action and the stage's span from its first action's start to its last one's end)."""
    plan = pipe.plan
    spec = plan.hardware.spec
    row["priced_on"] = {"spec": spec.name, "link_bytes_per_s": plan.hardware.link_bytes_per_s,
                        "dispatch_s": spec.dispatch_s, "backward_dispatch_s": spec.backward_dispatch_s,
                        "stage_overhead_s": spec.stage_overhead_s, "resident_handoffs": plan.hardware.resident_handoffs}
    if plans is not None:
        plans.mkdir(parents=True, exist_ok=True)
        path = plans / f"{row['section']}-{re.sub(r'[^A-Za-z0-9.-]+', '_', row['variant'])}.json"
        plan.save(path)
        row["plan_file"] = str(path)
    actions: dict[str, list[Any]] = {}
    for e in pipe.timeline:
        if e.microbatch >= 0:
            actions.setdefault(e.stage, []).append(e)
    row["stages"] = [{"stage": st.name, "kind": st.kind, "predicted_s": st.time_s, "predicted_compute_s": st.compute_s,
                      "measured_action_s": statistics.median(e.end - e.start for e in acts) if acts else None,
                      "measured_span_s": max(e.end for e in acts) - min(e.start for e in acts) if acts else None}
                     for st in plan.stages for acts in [actions.get(st.name, [])]]


def _tokens(rows: list[dict], spec: Any) -> None:
    tokens = spec.example_inputs[0].numel()
    for r in rows:
        r["tokens"] = tokens
        r["tokens_per_s"] = tokens / r["step_s"] if r.get("step_s") else None


def resident_rows(args: argparse.Namespace, device: str) -> list[dict]:
    _say(f"resident: building {args.model}")
    spec = load_model(args.model, device="cpu", batch_size=args.batch, seq_len=args.seq)
    rows = []
    for label, weights, ckpt in (("fp32 weights + bf16 autocast", torch.float32, False),
                                 ("fp32 weights + bf16 autocast, per-layer checkpointing", torch.float32, True),
                                 ("bf16 weights, per-layer checkpointing", torch.bfloat16, True)):
        rows.append(eager_row(spec, device, label, weights, ckpt, args.steps))
    options = dict(section="resident", microbatches=None, memory_limit=None, cost_spec=args.spec, profile=args.profile,
                   plans=_plans(args))
    rows += rpcompile_row(spec, [device], "bf16, 1 device", args.steps, optimizer=args.optimizer, **options)
    rows += rpcompile_row(spec, [device, device], "bf16, 2 logical devices on one GPU", args.steps, **options)
    _tokens(rows, spec)
    base = next((r["step_s"] for r in rows if r["variant"].startswith("fp32 weights + bf16 autocast, per")), None)
    for r in rows:
        r["model"] = args.model
        r["vs_eager_checkpointed"] = base / r["step_s"] if base and r.get("step_s") else None
    return rows


def capped_rows(args: argparse.Namespace, device: str,
                save: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """rpcompile under the cap; with ``--peer roundpipe`` RoundPipe next, on the same spec (tokens, weights).
    ``save(rows)`` is called with the rows so far before the peer runs (a hung peer ends the process)."""
    total = torch.cuda.get_device_properties(0).total_memory
    cap = int(args.cap_gib * GiB)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    try:
        _say(f"capped: building {args.capped_model}")
        spec = load_model(args.capped_model, device="cpu", batch_size=args.capped_batch, seq_len=args.capped_seq)
        rows = rpcompile_row(spec, [device], f"bf16, 1 device, capped at {args.cap_gib:g} GiB", args.steps,
                             section="capped", microbatches=args.capped_batch, memory_limit=int(cap * 0.9),
                             cost_spec=args.spec, profile=args.profile, optimizer=args.optimizer, recompile=True,
                             plans=_plans(args), save=None if save is None else
                             lambda rows: save([{**r, "model": args.capped_model} for r in rows]))
        if args.peer == "roundpipe":
            spec.model.zero_grad(set_to_none=True)
            if save is not None:
                save([{**r, "model": args.capped_model} for r in rows])
            rows.append(roundpipe_peer.roundpipe_row(
                spec, device=device, microbatches=args.capped_batch, cap_gib=args.cap_gib, steps=args.steps,
                label=f"HF {'Qwen3' if getattr(spec.model.config, 'qk_norm', False) else 'Llama'}, bf16, 1 device, "
                      f"capped at {args.cap_gib:g} GiB", timeout_s=args.peer_timeout, release_source=True))
        for r in rows:
            r["model"] = args.capped_model
        _tokens(rows, spec)
        _versus_peer(rows)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return rows


def seqlen_rows(args: argparse.Namespace, device: str) -> list[dict]:
    """One training step of a ``--seqlen-layers``-layer slice of the Llama-3-8B shape at ``--seqlen-tokens`` (one
    sequence; default: the longest ``benchmarks/seqlen.py`` predicts for llama-8b on 8 × rtx4090), planned with the
    rtx4090 spec's analytic costs and memory, on the GPU capped at ``--cap-gib``: the measured peak against the
    plan's predicted peak. Out of memory under the cap, the same step runs again uncapped to measure the peak."""
    n = args.seqlen_tokens
    _say(f"seqlen: building the {args.seqlen_layers}-layer slice")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(max_seq_len=n, vocab_size=128_256, dim=4096, n_layers=args.seqlen_layers,
                                  n_heads=32, n_kv_heads=8, ffn_dim=14_336, rope_theta=500_000.0, norm_eps=1e-5))
        x, y = torch.randint(0, 128_256, (1, n)), torch.randint(0, 128_256, (1, n))
    _say("seqlen: compiling")
    passes: dict[str, Any] = {}
    t0 = time.perf_counter()
    # memory_limit: the 4090's usable memory; without it the plan takes the device's own (an H200's 126 GiB)
    with _pass_times(passes):
        pipe = rpcompile.compile(model, (x,), loss_fn=lm_loss, devices=[device], precision="bf16", microbatches=1,
                                 spec="rtx4090", memory_limit=get_spec("rtx4090").usable_memory_bytes,
                                 example_target=y, allow_save=True)
    base = {"section": "seqlen", "system": "rpcompile", "model": f"llama-8b, {args.seqlen_layers} layers",
            "tokens": n, "setup_s": time.perf_counter() - t0, **passes, "stages": len(pipe.plan.stages),
            "head_chunks": pipe.plan.head_chunks, "predicted_s": pipe.plan.predicted.pipeline_s,
            "predicted_peak_gib": pipe.plan.predicted.peak_memory_bytes / GiB,
            "plan_memory_limit_gib": pipe.plan.hardware.memory_bytes / GiB}
    cuda = device.startswith("cuda")
    total = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    rows = []
    for cap in (args.cap_gib, None):
        if cuda:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GiB / total) if cap else 1.0)
        row = {**base, "variant": f"bf16, 1 sequence of {n:,} tokens, " + (
            f"capped at {cap:g} GiB" if cap else "uncapped (to measure the peak)")}
        _peak_reset(device)
        _say(f"seqlen: one step, {row['variant']}")
        try:
            t0 = time.perf_counter()
            loss = float(pipe.forward_backward(x, target=y))
            _sync(device)
            row.update(step_s=time.perf_counter() - t0, loss=loss, error=None)
        except Exception as e:  # noqa: BLE001 - reported in the table
            row.update(step_s=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        row["peak_gib"] = _peak(device)
        row["peak_over_predicted"] = row["peak_gib"] / row["predicted_peak_gib"] if row["peak_gib"] else None
        model.zero_grad(set_to_none=True)
        gc.collect()
        rows.append(row)
        if row["error"] is None:
            break
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0)
    for r in rows:
        r["tokens_per_s"] = n / r["step_s"] if r.get("step_s") else None
    del pipe
    gc.collect()
    return rows


def _plans(args: argparse.Namespace) -> Path:
    """Where the rows' plan files go: ``plans-<stem of --out>/`` beside it."""
    return args.out.parent / f"plans-{args.out.stem}"


#: the relative difference between the peer's loss and rpcompile's above which the peer's row is flagged: both run
#: the same weights on the same tokens in bf16, so a larger gap means the two did not compute the same thing
PEER_LOSS_TOLERANCE = 0.02


def _versus_peer(rows: list[dict]) -> None:
    """``vs_peer``: each row's tokens/s over the peer's (RoundPipe's) in the same section. The peer's row also gets
    ``loss_vs_rpcompile`` (its loss over rpcompile's first row's) and, when that is off by more than
    ``PEER_LOSS_TOLERANCE``, an ``error`` saying the ratio is not a like-for-like comparison."""
    peer = next((r for r in rows if r["system"] in roundpipe_peer.PEERS), None)
    base = peer and peer.get("tokens_per_s")
    for r in rows:
        r["vs_peer"] = r["tokens_per_s"] / base if base and r.get("tokens_per_s") else None
    ours = next((r.get("loss") for r in rows if r["system"] == "rpcompile" and r.get("loss")), None)
    if peer is not None and ours and peer.get("loss"):
        peer["loss_vs_rpcompile"] = peer["loss"] / ours
        if abs(peer["loss_vs_rpcompile"] - 1) > PEER_LOSS_TOLERANCE and not peer.get("error"):
            peer["error"] = (f"loss {peer['loss']:.4g} against rpcompile's {ours:.4g} on the same weights and tokens: "
                             "not the same computation, so vs RoundPipe is not like for like")


# --------------------------------------------------------------------------------------------- output
def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.3f}{unit}" if v < 100 else f"{v:,.0f}{unit}"
    return f"{v}{unit}"


_COLUMNS = (("model", "model", ""), ("system", "system", ""), ("variant", "variant", ""),
            ("tokens/s", "tokens_per_s", ""), ("step", "step_s", " s"), ("vs eager ckpt", "vs_eager_checkpointed", "×"),
            ("predicted", "predicted_s", " s"), ("pred/meas", "predicted_over_measured", "×"),
            ("peak GPU", "peak_gib", " GiB"), ("predicted peak", "predicted_peak_gib", " GiB"),
            ("compile/setup", "setup_s", " s"), ("warm recompile", "recompile_s", " s"), ("error", "error", ""))
_PEER_COLUMN = ("vs RoundPipe", "vs_peer", "×")


def print_tables(rows: list[dict], header: dict) -> str:
    console = Console(width=200)
    link = [r for r in rows if r["section"] == "link"]
    if link:
        t = Table(title=f"host link ({header['device']})")
        for c in ("memory", "direction", "GB/s"):
            t.add_column(c)
        for r in link:
            t.add_row(r["memory"], r["direction"], f"{r['GB_per_s']:.1f}")
        console.print(t)
    runs = [r for r in rows if r["section"] != "link"]
    columns = _COLUMNS[:-1] + (_PEER_COLUMN,) + _COLUMNS[-1:] if any("vs_peer" in r for r in runs) else _COLUMNS
    t = Table(title=f"training step (forward+backward) on {header['device']}, {header['date']}")
    for name, _, _ in columns:
        t.add_column(name)
    md = ["| " + " | ".join(n for n, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in runs:
        cells = [_fmt(r.get(key), unit) for _, key, unit in columns]
        t.add_row(*cells)
        md.append("| " + " | ".join(cells) + " |")
    console.print(t)
    markdown = "\n".join(md)
    print(markdown)
    return markdown


def main(argv: list[str] | None = None) -> None:
    """The rows of each section, and what each row records.

    **resident**: one forward+backward per step; eager with the whole model on the GPU (fp32 weights + bf16 autocast;
    the same with per-layer activation checkpointing; bf16 weights with per-layer checkpointing) against rpcompile
    (``precision="bf16"``, weights in CPU memory) on one device and on two logical devices sharing the GPU.

    **capped**: the cap is set with ``torch.cuda.set_per_process_memory_fraction``; rpcompile trains the Llama-3-8B
    shape, 8 sequences of 2048 tokens in 8 microbatches. With ``--peer roundpipe`` the real RoundPipe (PyPI
    ``roundpipe`` 0.1.1) then trains an HF ``LlamaForCausalLM`` of the same shape with the same weights, the same tokens
    and microbatches under the same cap, in the same process (``roundpipe_peer.py``); both rows get ``vs_peer``, their
    tokens/s over RoundPipe's.

    Per row: tokens/s, step time (median of ``--steps`` after a warm-up step), peak GPU memory, compile time, and for
    rpcompile rows the plan's predicted iteration next to the measured one (predicted/measured), with what a later
    calibration needs (issue 35 item 6, ``calibration.py``): the plan itself (``plan_file``, beside ``--out``), the
    hardware it was priced on (``priced_on``: link, dispatch per node, cost per action) and per stage the prediction
    beside the last step's measured host time of its actions (``stages``; on a GPU the worker's time to issue them and
    what it waited for). The header holds the host's bare dispatch per graph node on the device (``dispatch_probe``,
    :func:`rpcompile.planner.device_probe.probe_dispatch`). The rpcompile rows of one device (resident and capped) are
    followed by the same pipeline with the optimizer inside the loop (``--optimizer``: rpcompile's AdamW by default):
    ``pipe.step(opt)`` synchronous, then ``overlap=True`` (the step beside the next iteration, one step stale) — each
    predicted as the plan prices it (pipeline + host step, or the longer of the two). A model whose masters, gradients,
    Adam moments and copies would not fit the host's memory gets the reason in its row instead.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--model", default="llama-1.7b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--capped-model", default="llama-8b")
    ap.add_argument("--capped-batch", type=int, default=8)
    ap.add_argument("--capped-seq", type=int, default=2048)
    ap.add_argument("--cap-gib", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seqlen-tokens", type=int, default=83_968,
                    help="seqlen section: the sequence length (default: benchmarks/seqlen.py's llama-8b prediction)")
    ap.add_argument("--seqlen-layers", type=int, default=4, help="seqlen section: layers of the Llama-3-8B slice")
    ap.add_argument("--spec", default=None, help="plan from analytic costs of this GPU spec (default: measured here)")
    ap.add_argument("--profile", type=Path, default=None, help="write a torch profiler trace per rpcompile row here")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the script, times mean nothing")
    ap.add_argument("--peer", choices=roundpipe_peer.PEERS, default=None,
                    help="also run this peer in the capped section, side by side (roundpipe: PyPI roundpipe 0.1.1 "
                         "on an HF Llama of the same shape and weights; needs CUDA; adds the capped section)")
    ap.add_argument("--peer-timeout", type=float, default=900.0,
                    help="seconds before a peer run that never returns ends the process (default 900)")
    ap.add_argument("--optimizer", choices=[*OPTIMIZERS, "none"], default="rpcompile",
                    help="AdamW for the rows with the optimizer step inside the loop (none: no such rows)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu.json")
    args = ap.parse_args(argv)
    args.optimizer = None if args.optimizer == "none" else args.optimizer
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    if args.peer:  # before any model is built: one line and a non-zero exit when the peer cannot run here
        try:
            if args.smoke:
                raise roundpipe_peer.PeerUnavailable(f"--peer {args.peer} needs a CUDA GPU; --smoke runs on the CPU")
            roundpipe_peer.check_roundpipe()  # imported for real only when it runs, after rpcompile's rows
        except roundpipe_peer.PeerUnavailable as e:
            print(e, file=sys.stderr)
            raise SystemExit(2) from None
        if "capped" not in sections:
            sections.append("capped")
    if args.smoke:
        device, sections = "cpu", ["resident"]
        # 6 rows: the 2-device pipeline's 3 microbatches are of 2 rows each (4 rows gave 2, 1, 1, and a symbolic
        # capture specialises size 1), so each saved segment is captured once, not twice
        args.model, args.batch, args.seq, args.steps = "llama-demo", 6, 32, 1
        args.spec = args.spec or "cpu"
    elif not torch.cuda.is_available():
        ap.error("no CUDA device: this benchmark measures a GPU (use --smoke to check the script on the CPU)")
    else:
        device = "cuda:0"
    header = {"device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu (smoke: not a measurement)",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "rpcompile": rpcompile.__version__ if hasattr(rpcompile, "__version__") else None,
              "costs": f"analytic {args.spec}" if args.spec else "measured on the device", "args": {
                  k: str(v) for k, v in vars(args).items()}}
    fwd, bwd = probe_dispatch(device)  # the host's bare dispatch per graph node here, beside what the runtime pays
    header["dispatch_probe"] = {"forward_s_per_node": fwd, "backward_s_per_node": bwd}
    rows: list[dict] = []

    def save(more: list[dict], markdown: str | None = None) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps({**header, "rows": rows + more, "markdown": markdown}, indent=1, default=str))

    # each section's rows are saved as soon as it ends: a run stopped by a time limit keeps what it measured
    if "link" in sections:
        rows += link_rows()
        save([])
    if "resident" in sections:
        rows += resident_rows(args, device)
        save([])
    if "capped" in sections:
        rows += capped_rows(args, device, save)
        save([])
    if "seqlen" in sections:
        rows += seqlen_rows(args, device)
    markdown = print_tables(rows, header)
    save([], markdown)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
