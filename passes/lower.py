"""The lower pass: a solver's cuts → a :class:`~rpcompile.core.plan.Plan` of names.

Strategies decide *where* to cut (in segments or node indices); this module turns those cuts into a plan of
names: each stage's compute nodes, the parameters they read, the source modules they come from, the saved set and
the timing model's figures (:func:`to_plan`). Ranges are half-open intervals over the graph's compute nodes in
topological order (:func:`plan_from_ranges`, also the way to write a plan by hand).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Sequence

import torch.fx as fx

from rpcompile.core.errors import ConfigError
from rpcompile.core.plan import Hardware, Plan, Prediction, Stage
from rpcompile.core.schedule import weight_stays
from rpcompile.core.stages import StageKind

from .graph.fingerprint import fingerprint
from .graph.shape import SHAPE_KEY
from .graph.util import compute_nodes, module_path, node_params
from .plan_inputs import solve_inputs
from .rewrite.coarsen import segments_of
from .rewrite.host import host_of
from .rewrite.loss_head import HEAD_CHUNKS_META
from .solver.timing import bubble_fraction, host_times, iteration_time, no_sync_time, stage_costs

__all__ = ["plan_from_ranges", "to_plan", "input_tokens"]


def _modules(nodes: Sequence[fx.Node], paths: dict[fx.Node, str] | None = None) -> tuple[str, ...]:
    out: list[str] = []
    for n in nodes:
        if paths is None:
            path = module_path(n) or "(root)"
        else:
            # `paths` lives in the caller's facts: each node's module is looked up once across the plans of a graph
            path = paths.get(n) or paths.setdefault(n, module_path(n) or "(root)")
        if not out or out[-1] != path:
            out.append(path)
    return tuple(dict.fromkeys(out))


def input_tokens(gm: fx.GraphModule) -> int:
    """Elements of the first integer-typed input (token ids), else the first input's batch size; 0 if unknown."""
    shapes = [t for n in gm.graph.nodes if n.op == "placeholder" and SHAPE_KEY in n.meta for t in n.meta[SHAPE_KEY].tensors]
    for t in shapes:
        if t.dtype.startswith(("int", "uint")):
            # integer input: token ids, every element a token
            return math.prod(t.shape)
    return shapes[0].shape[0] if shapes and shapes[0].shape else 0


def plan_from_ranges(
    gm: fx.GraphModule,
    *,
    forward: Sequence[tuple[int, int]],
    fused: tuple[int, int],
    backward: Sequence[tuple[int, int]],
    hardware: Hardware,
    microbatches: int,
    saved: Sequence[str] = (),
    stage_times: Sequence[float] | None = None,
    stage_memory: Sequence[int] | None = None,
    stage_figures: Sequence[dict] | None = None,
    predicted: Prediction | None = None,
    strategy: str = "manual",
    cost_model: str = "",
    precision: str = "fp32",
    stats: dict | None = None,
    facts: dict | None = None,
) -> Plan:
    """Build a Plan whose stages are ``forward`` (F0.. ascending), ``fused`` and ``backward`` (B1.. descending)
    node-index ranges of ``gm``'s compute nodes. ``saved`` names nodes whose activations are saved to host;
    ``stage_times``/``stage_memory`` are per stage in execution order, and so are ``stage_figures`` (extra
    :class:`~rpcompile.Stage` fields such as ``compute_s`` and ``weight_bytes``). ``facts``: a dict kept across plans of
    the same graph (:func:`to_plan`'s), holding what they share: the fingerprint, each node's parameters and
    module."""
    facts = {} if facts is None else facts
    nodes = facts.get("nodes") or facts.setdefault("nodes", compute_nodes(gm))
    param_names: dict[fx.Node, tuple[str, ...]] = facts.setdefault("params", {})
    paths: dict[fx.Node, str] = facts.setdefault("paths", {})
    saved_set = set(saved)
    specs: list[tuple[StageKind, str, tuple[int, int]]] = [("forward", f"F{i}", r) for i, r in enumerate(forward)]
    specs += [("fused", "FB", fused)]
    specs += [("backward", f"B{i + 1}", r) for i, r in enumerate(backward)]
    n_stages = len(specs)
    times = list(stage_times) if stage_times is not None else [0.0] * n_stages
    memory = list(stage_memory) if stage_memory is not None else [0] * n_stages
    figures = list(stage_figures) if stage_figures is not None else [{}] * n_stages
    if len(times) != n_stages or len(memory) != n_stages or len(figures) != n_stages:
        raise ConfigError(f"need {n_stages} stage times, memories and figures, got {len(times)}, {len(memory)}, {len(figures)}")
    stages = []
    for (kind, name, (a, b)), t, mem, fig in zip(specs, times, memory, figures):
        run = nodes[a:b]
        params: dict[str, None] = {}
        for n in run:
            names = param_names.get(n)
            if names is None:
                names = param_names[n] = tuple(node_params(gm, n))
            params.update(dict.fromkeys(names))
        stages.append(
            Stage(
                name=name,
                kind=kind,
                nodes=tuple(n.name for n in run),
                params=tuple(params),
                # the fused stage runs forward and backward in one go: nothing of it is saved or recomputed
                saved=tuple(n.name for n in run if n.name in saved_set) if kind != "fused" else (),
                modules=_modules(run, paths),
                saved_modules=_modules([n for n in run if n.name in saved_set], paths) if kind == "forward" else (),
                time_s=float(t),
                memory_bytes=int(mem),
                **fig,
            )
        )
    model = facts.get("fingerprint") or facts.setdefault("fingerprint", fingerprint(gm))
    return Plan(
        model=model,
        hardware=hardware,
        microbatches=microbatches,
        stages=tuple(stages),
        predicted=predicted or Prediction(iteration_time_s=0.0, bubble_fraction=0.0, peak_memory_bytes=max(memory, default=0)),
        strategy=strategy,
        cost_model=cost_model,
        precision=precision,
        tokens_per_microbatch=input_tokens(gm),
        stats=stats or {},
    )


def to_plan(gm: fx.GraphModule, problem: Any, result: Any, *, hardware: Hardware, precision: str,
            facts: dict | None = None) -> Plan:
    """Map a solver's SegmentPlan back to node names. ``facts``: a dict the caller keeps across several plans of
    the same graph, problem, hardware and precision (:func:`rpcompile.planner.planning.compare`'s): what they share —
    the fingerprint, the record of what they were solved from, each node's parameters and module — is worked
    out once."""
    facts = {} if facts is None else facts
    segs = segments_of(gm)
    sp = result.plan

    def nodes_of(r: tuple[int, int]) -> tuple[int, int]:
        # a half-open range of segments -> the half-open range of node positions they cover
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
            overlap_step=problem.host.overlap_step,
            overlap_iterations=problem.host.overlap_iterations,
            no_sync_s=no_sync_time(problem, sp) if sp.accumulates else 0.0,
            **host_times(problem, sp),
        ),
        strategy=result.strategy,
        cost_model=str(gm.meta.get("rpcompile.cost_model", "")),
        precision=precision,
        # a plan is written as JSON: only plain scalars of the solver's stats are kept
        stats={k: v for k, v in result.stats.items() if isinstance(v, (int, float, str, bool))}
        | {"solve_time_s": result.solve_time_s, "segments": len(segs)},
        facts=facts,
    )
    inputs = facts.get("inputs")
    if inputs is None:
        inputs = facts["inputs"] = solve_inputs(gm, problem, hardware, strategy=result.strategy, precision=precision)
    else:  # the same record but for the strategy (the first option)
        inputs = {**inputs, "options": {**inputs["options"], "strategy": result.strategy}}
    if sp.stays or sp.resident or sp.accumulates:
        made = _with_stays(made, segs, sp, {n for n, p in gm.named_parameters() if p.requires_grad})
    return dataclasses.replace(made, head_chunks=int(gm.meta.get(HEAD_CHUNKS_META, 1)),
                               host=tuple(h.node for h in host_of(gm)), inputs=inputs)


def _with_stays(plan: Plan, segs: Sequence[Any], sp: Any, trainable: set[str]) -> Plan:
    """The parameters each stage keeps on its device and finds there (:func:`~rpcompile.core.schedule.weight_stays` over parameter names,
    as the runtime walks them): a stayed segment's own parameters (those no other segment reads), or with
    ``resident`` all of them; and those whose gradients a grad stage sums on its device (a flagged segment's own
    trainable parameters)."""
    readers = Counter(p for s in segs for p in set(s.params))
    # a parameter another segment reads too (a tied weight) is not this segment's own to keep
    staying = {p for s, flag in zip(segs, sp.stays) if flag for p in s.params if readers[p] == 1}
    summed = {p for s, flag in zip(segs, sp.accumulates) if flag for p in s.params
              if readers[p] == 1 and p in trainable}
    walk = weight_stays([s.params for s in plan.stages], plan.hardware.device_count, staying, resident=sp.resident)
    stages = tuple(dataclasses.replace(s, keeps=tuple(p for p in s.params if p in w.kept),
                                       finds=tuple(p for p in s.params if p in w.found),
                                       # a forward stage computes no gradients to sum
                                       accumulates=tuple(p for p in s.params if p in summed and s.kind != "forward"))
                   for s, w in zip(plan.stages, walk))
    return dataclasses.replace(plan, stages=stages, resident=sp.resident)


def _figures(c: Any, microbatches: int) -> dict:
    """A StageCost's figures as Stage fields (the cost keeps weights amortised per microbatch; the plan's
    ``compute_s`` includes the fixed per-stage overhead)."""
    return {
        "compute_s": c.compute_s + c.overhead_s,
        "weight_bytes": c.weight_bytes,
        "grad_bytes": c.grad_bytes,
        # the cost's per-microbatch upload also holds the amortised weights and the prefetch: listed apart here
        "upload_bytes": round(c.upload_bytes - c.weight_bytes / microbatches - c.prefetch_bytes),
        "prefetch_bytes": c.prefetch_bytes,
        # likewise the amortised gradients and the offloaded saved tensors
        "download_bytes": round(c.download_bytes - c.grad_bytes / microbatches - c.offload_bytes),
        "offload_bytes": c.offload_bytes,
        "working_bytes": c.working_bytes,
        "found_bytes": int(c.found_bytes),
        "kept_bytes": int(c.kept_bytes),
        "held_bytes": int(c.held_bytes),
        "sum_bytes": int(c.sum_bytes),
    }
