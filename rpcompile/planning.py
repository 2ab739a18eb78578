"""Planning: costed graph → segments → :class:`~rpcompile.passes.problem.PartitionProblem` → solver → Plan.

Microbatches: ``example_inputs`` is one full batch; it is split along dim 0 into ``microbatches`` pieces
(``torch.tensor_split``: sizes differ by at most one) and the graph is costed on the first (largest) piece, so every
time and byte in the problem is per microbatch. The default is ``gpus + 1`` microbatches (DESIGN.md §3), and 1 on a
single device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .core.errors import BatchSplitError, InfeasibleError
from .core.plan import Hardware, Plan, Prediction
from .core.specs import DeviceSpec, get_spec

__all__ = [
    "plan",
    "plan_graph",
    "compare",
    "partition_problem",
    "to_plan",
    "split_microbatches",
    "make_hardware",
    "default_spec",
    "STRATEGIES",
    "PRECISION_BYTES",
    "AUTO_HEAD_CHUNKS",
    "head_chunk_candidates",
    "fastest",
]

STRATEGIES = ("ilp", "dp", "roundpipe", "uniform")
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Sequence chunks ``head_chunks="auto"`` tries for the LM head (besides not splitting it): on the benchmark
#: models, 8 chunks beat 4 and 16 (benchmarks/RESULTS.md, schedules).
AUTO_HEAD_CHUNKS = 8


def head_chunk_candidates(head_chunks: "int | str", loss_fn: Any, example_target: Any) -> tuple[int, ...]:
    """The LM-head splits to plan for ``head_chunks``: an int is itself; ``"auto"`` is the whole head and
    :data:`AUTO_HEAD_CHUNKS` sequence chunks when a loss and a ``[batch, sequence]`` target are given (the split
    needs both), else the whole head only."""
    if head_chunks == "auto":
        seq = example_target.shape[1] if isinstance(example_target, torch.Tensor) and example_target.dim() >= 2 else 1
        return (1, min(AUTO_HEAD_CHUNKS, seq)) if loss_fn is not None and seq > 1 else (1,)
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks must be a positive integer or 'auto', got {head_chunks!r}")
    return (head_chunks,)


def fastest(candidates: Sequence[int], attempt: Any) -> Any:
    """Run ``attempt(k)`` for every candidate head split and return the payload of the fastest: ``attempt``
    returns ``(predicted iteration seconds, payload)`` (the first wins a tie). A split the graph refuses
    (``ValueError`` for ``k > 1``) or that has no feasible plan (the whole head may not fit where its chunks do)
    is skipped while another candidate remains."""
    best, errors = None, []
    for k in candidates:
        try:
            made = attempt(k)
        except (ValueError, InfeasibleError) as exc:
            if len(candidates) == 1 or (k == 1 and not isinstance(exc, InfeasibleError)):
                raise
            errors.append(exc)
            continue
        if best is None or made[0] < best[0]:
            best = made
    if best is None:
        raise errors[0]
    return best[1]


def split_microbatches(values: Sequence[Any], microbatches: int) -> list[tuple[Any, ...]]:
    """Split every tensor in ``values`` — also inside tuples, lists and dicts (a batch dict) — along dim 0 into
    ``microbatches`` pieces of the same structure (other values are repeated)."""
    values, spec = pytree.tree_flatten(list(values))
    sizes = {v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) > 1:
        raise BatchSplitError(f"inputs disagree on the batch size (dim 0): {sorted(sizes)}; pass tensors with one "
                              "batch dimension, or constants as non-tensor arguments")
    batch = sizes.pop() if sizes else 1
    if microbatches < 1 or batch < microbatches:
        raise BatchSplitError(
            f"a batch of {batch} cannot be split into {microbatches} microbatches; "
            f"use microbatches between 1 and {batch} (--microbatches) or a larger batch (--batch-size)"
        )
    pieces = [
        torch.tensor_split(v, microbatches, dim=0) if isinstance(v, torch.Tensor) and v.dim() > 0 else [v] * microbatches
        for v in values
    ]
    return [tuple(pytree.tree_unflatten([p[j] for p in pieces], spec)) for j in range(microbatches)]


def make_hardware(gpus: int, spec: "str | DeviceSpec", memory_limit: int | None = None) -> Hardware:
    spec = get_spec(spec)
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    memory = int(memory_limit) if memory_limit is not None else spec.usable_memory_bytes
    return Hardware(device_count=gpus, spec=spec, memory_bytes=memory, link_bytes_per_s=spec.host_link_bandwidth)


def partition_problem(
    gm: fx.GraphModule,
    *,
    hardware: Hardware,
    microbatches: int,
    precision: str = "fp32",
    stage_overhead_s: float | None = None,
    allow_save: bool = True,
):
    """Lower a coarsened graph to plain numbers. Parameters read by several segments (tied embeddings) become
    :class:`SharedParam`s: every stage that uses one receives it, and its gradient is summed over them."""
    from rpcompile.passes.coarsen import segments_of
    from rpcompile.passes.problem import PartitionProblem, SharedParam

    segs = segments_of(gm)
    elt = PRECISION_BYTES[precision]
    params = dict(gm.named_parameters())
    users: dict[str, list[int]] = {}
    for s in segs:
        for p in s.params:
            users.setdefault(p, []).append(s.index)
    own_bytes, own_grads = [0] * len(segs), [0] * len(segs)
    shared = []
    for name, segments in users.items():
        p = params[name]
        size, grad = p.numel() * elt, p.numel() * elt if p.requires_grad else 0
        if len(segments) == 1:
            own_bytes[segments[0]] += size
            own_grads[segments[0]] += grad
        else:
            shared.append(SharedParam(name=name, bytes=size, grad_bytes=grad, segments=tuple(segments)))
    return PartitionProblem(
        names=tuple(s.name for s in segs),
        layer=tuple(s.layer for s in segs),
        fwd_s=tuple(s.fwd_s for s in segs),
        bwd_s=tuple(s.bwd_s for s in segs),
        rec_s=tuple(s.fwd_s for s in segs),
        act_bytes=tuple(s.act_bytes for s in segs),
        peak_bytes=tuple(s.peak_bytes for s in segs),
        boundary_bytes=tuple(s.boundary_bytes for s in segs),
        input_bytes=int(gm.meta.get("rpcompile.input_bytes", 0)),
        input_grad_bytes=_host_grad_bytes(gm),
        param_bytes=tuple(own_bytes),
        grad_bytes=tuple(own_grads),
        shared=tuple(shared),
        device_count=hardware.device_count,
        memory_bytes=hardware.memory_bytes,
        link_bytes_per_s=hardware.link_bytes_per_s,
        microbatches=microbatches,
        stage_overhead_s=hardware.spec.stage_overhead_s if stage_overhead_s is None else stage_overhead_s,
        allow_save=allow_save,
    )


def _host_grad_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the gradients of the rows the host looks up in trainable tables (per microbatch)."""
    from rpcompile.passes.cost import DTYPE_KEY
    from rpcompile.passes.host import host_of
    from rpcompile.passes.shape import SHAPE_KEY, scaled_nbytes

    params = dict(gm.named_parameters())
    values = {h.value for h in host_of(gm) if params[h.weight].requires_grad}
    return sum(scaled_nbytes(n.meta[SHAPE_KEY], gm.meta.get(DTYPE_KEY), aliases=True)
               for n in gm.graph.find_nodes(op="placeholder") if n.name in values and SHAPE_KEY in n.meta)


def to_plan(gm: fx.GraphModule, problem: Any, result: Any, *, hardware: Hardware, precision: str) -> Plan:
    """Map a solver's SegmentPlan back to node names."""
    from rpcompile.passes.coarsen import segments_of
    from rpcompile.passes.timing import bubble_fraction, iteration_time, stage_costs

    from .lowering import plan_from_ranges

    segs = segments_of(gm)
    sp = result.plan

    def nodes_of(r: tuple[int, int]) -> tuple[int, int]:
        return segs[r[0]].start, segs[r[1] - 1].stop

    costs = stage_costs(problem, sp)
    saved = [n for s, keep in zip(segs, sp.saved) if keep for n in s.nodes]
    iteration = iteration_time(problem, sp)
    made = plan_from_ranges(
        gm,
        forward=[nodes_of(r) for r in sp.forward],
        fused=nodes_of(sp.fused),
        backward=[nodes_of(r) for r in sp.backward],
        hardware=hardware,
        microbatches=problem.microbatches,
        saved=saved,
        stage_times=[c.time_s for c in costs],
        stage_memory=[c.memory_bytes for c in costs],
        stage_figures=[_figures(c, problem.microbatches) for c in costs],
        predicted=Prediction(
            iteration_time_s=iteration,
            bubble_fraction=bubble_fraction(problem, sp),
            peak_memory_bytes=max(c.memory_bytes for c in costs),
            bound_s=float(result.stats.get("bound_s", 0.0) or 0.0),
        ),
        strategy=result.strategy,
        cost_model=str(gm.meta.get("rpcompile.cost_model", "")),
        precision=precision,
        stats={k: v for k, v in result.stats.items() if isinstance(v, (int, float, str, bool))}
        | {"solve_time_s": result.solve_time_s, "segments": len(segs)},
    )
    from rpcompile.passes.host import host_of
    from rpcompile.passes.loss_head import HEAD_CHUNKS_META

    return dataclasses.replace(made, head_chunks=int(gm.meta.get(HEAD_CHUNKS_META, 1)),
                               host=tuple(h.node for h in host_of(gm)))


def _figures(c: Any, microbatches: int) -> dict:
    """A StageCost's figures as Stage fields (the cost keeps weights amortised per microbatch; the plan's
    ``compute_s`` includes the fixed per-stage overhead)."""
    return {
        "compute_s": c.compute_s + c.overhead_s,
        "weight_bytes": c.weight_bytes,
        "grad_bytes": c.grad_bytes,
        "upload_bytes": round(c.upload_bytes - c.weight_bytes / microbatches - c.prefetch_bytes),
        "prefetch_bytes": c.prefetch_bytes,
        "download_bytes": round(c.download_bytes - c.grad_bytes / microbatches - c.offload_bytes),
        "offload_bytes": c.offload_bytes,
        "working_bytes": c.working_bytes,
    }


def default_spec(spec: "str | DeviceSpec | None", device: "str | torch.device | None", model_device: str) -> "str | DeviceSpec":
    """The hardware a plan is for: ``spec`` when given; the CPU when costs are measured there; else an RTX 4090
    (also for meta-device models, which can only be costed analytically)."""
    if spec is not None:
        return spec
    if model_device != "meta" and (device is None or torch.device(device).type == "cpu"):
        return "cpu"
    return "rtx4090"


def _infeasible(problem: Any, hardware: Hardware) -> InfeasibleError:
    from rpcompile.passes.segment_rules import format_bytes
    from rpcompile.passes.tables import min_feasible_memory

    need, seg = min_feasible_memory(problem)
    return InfeasibleError(
        f"no plan fits {format_bytes(hardware.memory_bytes)} per device: segment {seg} ({problem.names[seg]}) needs "
        f"at least {format_bytes(need)} (its weights, the prefetched next stage, gradients and one microbatch's "
        f"activations); allow at least {need} bytes per device (memory_limit= / --memory-limit), use more "
        "microbatches (smaller ones) or a lower precision"
    )


def plan_graph(
    gm: fx.GraphModule,
    *,
    hardware: Hardware,
    microbatches: int,
    strategy: str = "ilp",
    precision: str = "fp32",
    time_limit_s: float = 10.0,
    allow_save: bool = True,
) -> Plan:
    """Partition a costed, coarsened graph with one strategy; raise :class:`InfeasibleError` if nothing fits.
    ``allow_save=False`` makes every backward stage recompute (no activations kept in host memory)."""
    from rpcompile.passes.partition import solve

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    problem = partition_problem(gm, hardware=hardware, microbatches=microbatches, precision=precision,
                                allow_save=allow_save)
    result = solve(problem, strategy, time_limit_s=time_limit_s)
    if not result.feasible:
        raise _infeasible(problem, hardware)
    return to_plan(gm, problem, result, hardware=hardware, precision=precision)


def compare(
    gm: fx.GraphModule, *, hardware: Hardware, microbatches: int, precision: str = "fp32", time_limit_s: float = 10.0
) -> dict[str, tuple[Any, Plan | None]]:
    """Every strategy on the same problem: name -> (PartitionResult, Plan or None when infeasible)."""
    from rpcompile.passes.partition import solve

    problem = partition_problem(gm, hardware=hardware, microbatches=microbatches, precision=precision)
    out = {}
    for name in STRATEGIES:
        result = solve(problem, name, time_limit_s=time_limit_s)
        out[name] = (result, to_plan(gm, problem, result, hardware=hardware, precision=precision) if result.feasible else None)
    return out


def prepare(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    gpus: int,
    spec: "str | DeviceSpec | None" = None,
    device: "str | torch.device | None" = None,
    microbatches: int | None = None,
    precision: str = "fp32",
    example_kwargs: Mapping[str, Any] | None = None,
    max_segments: int | None = None,
    leaf_modules: Sequence[Any] = (),
    progress: bool | None = None,
    loss_fn: Any = None,
    example_target: Any = None,
    head_chunks: int = 1,
    segments_per_layer: int = 2,
    host_embedding: "bool | Sequence[str]" = True,
) -> tuple[fx.GraphModule, int]:
    """Trace, cost (on one microbatch), move token embeddings to the host and coarsen; returns the graph and the
    microbatch count.

    ``head_chunks > 1`` (which needs ``loss_fn`` and ``example_target``) puts the loss in the graph (its last input
    is ``target``) and splits the LM head along the sequence (:mod:`rpcompile.passes.loss_head`).
    ``host_embedding``: ``True`` moves the token embeddings whose tables are larger than what an iteration
    looks up to the host (:mod:`rpcompile.passes.host`), ``False`` none, node names exactly those (a plan's)."""
    from rpcompile.passes.coarsen import coarsen_pass
    from rpcompile.passes.host import host_embedding_pass

    from .profiling import analyze, make_cost_model

    # DESIGN.md §3: N + 1 is the fewest microbatches without a bubble between stages; one device has no
    # pipeline to fill, and splitting the batch would only shrink its kernels.
    m = microbatches or (gpus + 1 if gpus > 1 else 1)
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    with_loss = head_chunks > 1  # the loss joins the graph only to be split with the head
    if with_loss and (loss_fn is None or example_target is None):  # before the batch split's own errors
        raise ValueError(f"head_chunks={head_chunks} splits the LM head together with its loss: pass loss_fn= and "
                         "example_target= (a target for one batch), or use head_chunks=1")
    extra = (example_target,) if with_loss else ()
    piece = split_microbatches((*args, *kwargs.values(), *extra), m)[0]
    first, example_kwargs = piece[: len(args)], dict(zip(kwargs, piece[len(args):len(args) + len(kwargs)]))
    loss = (loss_fn, piece[-1]) if with_loss else None
    model_device = next((p.device.type for p in model.parameters()), "cpu")
    dtype = None if precision == "fp32" else {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    cost_model = make_cost_model(spec=spec, device=device, dtype=dtype, model_device=model_device)
    gm = analyze(model, first, example_kwargs=example_kwargs, cost_model=cost_model, leaf_modules=leaf_modules,
                 progress=progress, loss=loss, head_chunks=head_chunks)
    if host_embedding:
        host_embedding_pass(gm, microbatches=m, names=None if host_embedding is True else tuple(host_embedding))
    coarsen_pass(gm, max_segments=max_segments, segments_per_layer=segments_per_layer)
    return gm, m


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    gpus: int,
    spec: "str | DeviceSpec | None" = None,
    device: "str | torch.device | None" = None,
    microbatches: int | None = None,
    memory_limit: int | None = None,
    strategy: str = "ilp",
    precision: str = "fp32",
    example_kwargs: Mapping[str, Any] | None = None,
    time_limit_s: float = 10.0,
    max_segments: int | None = None,
    leaf_modules: Sequence[Any] = (),
    progress: bool | None = None,
    loss_fn: Any = None,
    example_target: Any = None,
    head_chunks: "int | str" = "auto",
    segments_per_layer: int = 2,
    host_embedding: "bool | Sequence[str]" = True,
) -> Plan:
    """Make a round-robin plan for ``model`` on ``gpus`` devices.

    Costs are analytic for ``spec`` (a :class:`DeviceSpec` or preset name) or measured on ``device``; with neither,
    measured on the CPU (analytic ``rtx4090`` for a meta-device model). The hardware is ``gpus`` devices of
    ``spec`` (``cpu`` when measuring on the CPU, else ``rtx4090``) with ``memory_limit`` usable bytes each.
    ``head_chunks > 1`` (with ``loss_fn`` and ``example_target``) plans the LM head and its cross-entropy as that
    many sequence chunks (:mod:`rpcompile.passes.loss_head`); ``"auto"`` (the default) plans the whole head and,
    when a loss and a target are given and the head can be split, :data:`AUTO_HEAD_CHUNKS` chunks too, and keeps
    the faster plan (so planning takes up to twice ``time_limit_s``). ``segments_per_layer`` (default 2: attention
    and MLP halves) above 2 lets the planner cut and save inside those halves: plans up to ~6% faster on the
    benchmark models, at two to three times the solve time (which may then overrun ``time_limit_s``).
    ``host_embedding`` (default on) lets the host run token embeddings whose tables are larger than what an
    iteration looks up (:mod:`rpcompile.passes.host`); ``False`` none, node names exactly those lookups.
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {precision!r}")
    model_device = next((p.device.type for p in model.parameters()), "cpu")
    hardware = make_hardware(gpus, default_spec(spec, device, model_device), memory_limit)

    def attempt(k: int) -> tuple[float, Plan]:
        gm, m = prepare(model, example_inputs, gpus=gpus, spec=spec, device=device, microbatches=microbatches,
                        precision=precision, example_kwargs=example_kwargs, max_segments=max_segments,
                        leaf_modules=leaf_modules, progress=progress, loss_fn=loss_fn, example_target=example_target,
                        head_chunks=k, segments_per_layer=segments_per_layer, host_embedding=host_embedding)
        made = plan_graph(gm, hardware=hardware, microbatches=m, strategy=strategy, precision=precision,
                          time_limit_s=time_limit_s)
        return made.predicted.iteration_time_s, made

    return fastest(head_chunk_candidates(head_chunks, loss_fn, example_target), attempt)
