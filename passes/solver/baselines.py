"""The reference strategies the ILP is measured against (and seeded with): ``uniform``, ``roundpipe``, ``dp``.

All take ``(problem, *, time_limit_s, seed)`` and return a :class:`.problem.PartitionResult` scored by the shared
timing model (:func:`.timing.iteration_time`), whatever model the strategy used to choose its cuts:

- ``uniform``: the classic static pipeline — ``N`` groups of (nearly) equal layer counts, forward stages on the
  first ``N−1``, the last group fused, backward stages mirroring the forward ranges; full recompute.
- ``roundpipe``: RoundPipe's greedy (Luo et al., arXiv 2604.27085; docs/architecture.md §4) at layer granularity.
- ``dp``: exact min-max balance at segment granularity for every stage count (:mod:`.balance`), nothing saved;
  then the stage count with the best iteration time among those whose bound ``c(S)·T*(S)`` is within 10% of the
  best bound (``stats["model_optimum_s"]`` is the proven least ``c(S)·T`` over plans that save nothing).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .balance import Balance, bound_values, exact_balance
from .problem import PartitionProblem, PartitionResult, SegmentPlan
from .recurrence import equal_time_factors
from .segment_rules import validate_segment_plan
from rpcompile.core.units import fmt_bytes
from .tables import RangeTables, min_memory
from .timing import iteration_time, stage_costs

__all__ = ["uniform", "roundpipe", "dp", "dp_of_balance", "layer_ranges", "make_result", "infeasible_result", "model_objective"]

#: dp re-scores every stage count whose bound is within this factor of the best bound.
DP_RESCORE_WINDOW = 1.10


def layer_ranges(pb: PartitionProblem) -> list[tuple[int, int]]:
    """Segment range of each layer, in order."""
    starts = [0] + [i for i in range(1, pb.n) if pb.layer[i] != pb.layer[i - 1]]
    return list(zip(starts, starts[1:] + [pb.n]))


def model_objective(pb: PartitionProblem, plan: SegmentPlan) -> float:
    """``c(S)·max_k t_k``: the bound the balance solvers minimise (never below the plan's stage recurrence,
    :func:`.timing.pipeline_time`; :func:`.timing.iteration_time` adds the exposed weight and gradient copies),
    in the solvers' per-stage model (saves copied out while their forward stage runs)."""
    costs = stage_costs(pb, plan, lazy_offload=False)
    c = equal_time_factors(len(costs), pb.device_count, pb.microbatches)[len(costs)]
    return c * max(s.time_s for s in costs)


def make_result(strategy: str, pb: PartitionProblem, plan: SegmentPlan, started: float,
                **stats: Any) -> PartitionResult:
    """A scored result; ``feasible=False`` (with the violations in ``stats``) when the plan breaks a rule."""
    problems = validate_segment_plan(pb, plan)
    # a plan that only breaks the memory limit ("needs") can still be costed; a broken chain cannot
    costs = stage_costs(pb, plan) if not problems or all("needs" in p for p in problems) else ()
    stats = {
        "stages_forward": len(plan.forward), "stages_backward": len(plan.backward), "stage_count": plan.stage_count,
        "saved_segments": tuple(i for i, s in enumerate(plan.saved) if s),
        "max_stage_s": max((c.time_s for c in costs), default=float("inf")),
        "peak_memory_bytes": max((c.memory_bytes for c in costs), default=0),
        "model_objective_s": model_objective(pb, plan) if costs else float("inf"),
        **stats,
    }
    if problems:
        stats["violations"] = problems
        return PartitionResult(strategy=strategy, feasible=False, plan=None, objective=float("inf"),
                               solve_time_s=time.perf_counter() - started, stats=stats)
    return PartitionResult(strategy=strategy, feasible=True, plan=plan, objective=iteration_time(pb, plan),
                           solve_time_s=time.perf_counter() - started, stats=stats)


def infeasible_result(strategy: str, pb: PartitionProblem, started: float,
                      tables: RangeTables | None = None) -> PartitionResult:
    """No plan fits: say by how much, and which segment is to blame."""
    need, seg = min_memory(tables or RangeTables.build(pb))
    reason = (f"no partition fits: the best plan needs {fmt_bytes(need)} per device but memory_bytes is "
              f"{fmt_bytes(pb.memory_bytes)}; add memory, lower the micro-batch size or split the segment "
              f"(segment: {pb.names[seg]})")
    return PartitionResult(strategy=strategy, feasible=False, plan=None, objective=float("inf"),
                           solve_time_s=time.perf_counter() - started,
                           stats={"reason": reason, "min_memory_bytes": need, "segment": pb.names[seg],
                                  "segment_index": seg})


def _full_recompute(pb: PartitionProblem, fwd: list[tuple[int, int]], fused_start: int,
                    bwd: list[tuple[int, int]]) -> SegmentPlan:
    return SegmentPlan(forward=tuple(fwd), fused=(fused_start, pb.n), backward=tuple(bwd), saved=(False,) * pb.n)


def uniform(pb: PartitionProblem, *, time_limit_s: float = 10.0, seed: int = 0) -> PartitionResult:
    """The classic static pipeline: ``N`` equal layer groups (the first ones one layer longer when uneven; one
    group per layer when there are fewer layers than devices)."""
    started = time.perf_counter()
    layers = layer_ranges(pb)
    groups = [g for g in np.array_split(np.arange(len(layers)), min(pb.device_count, len(layers))) if len(g)]
    ranges = [(layers[g[0]][0], layers[g[-1]][1]) for g in groups]
    # the last group is the fused stage; backward stages take the other groups' ranges, top down
    plan = _full_recompute(pb, ranges[:-1], ranges[-1][0], list(reversed(ranges[:-1])))
    return make_result("uniform", pb, plan, started, groups=len(groups))


def _roundpipe_candidates(f: np.ndarray, bwd: np.ndarray, fused: np.ndarray) -> list[float]:
    """Bottleneck candidates: contiguous-run sums of layer times within ``[Tmax, 1.1·Tmax]``."""
    # the last layer is always in the fused stage: it has no backward stage of its own
    t_max = float(max(f.max(), bwd[:-1].max(initial=0.0), fused[-1]))
    cands = {t_max}
    for costs in (f, bwd, fused):
        prefix = np.concatenate([[0.0], np.cumsum(costs)])
        sums = (prefix[None, :] - prefix[:, None])[np.triu_indices(len(prefix), 1)]
        # RoundPipe's candidate window, [Tmax, 1.1·Tmax] (docs/architecture.md §4)
        cands.update(float(x) for x in sums[(sums >= t_max) & (sums <= 1.1 * t_max)])
    return sorted(cands)


def _pack(costs: np.ndarray, weights: list[int], order: list[int], limit: float, w_cap: float) -> list[list[int]]:
    """Greedy: walk layers in ``order``, closing a stage when its time would pass ``limit`` or weights ``w_cap``."""
    stages: list[list[int]] = []
    t = w = 0.0
    for l in order:
        # a stage takes at least one layer, even one past the limits
        if stages and t + costs[l] <= limit and w + weights[l] <= w_cap:
            stages[-1].append(l)
            t, w = t + costs[l], w + weights[l]
        else:
            stages.append([l])
            t, w = costs[l], weights[l]
    return stages


def _roundpipe_plan(pb: PartitionProblem, layers: list[tuple[int, int]], T: float,
                    lt: dict[str, np.ndarray], weights: list[int]) -> SegmentPlan:
    top = len(layers) - 1
    acc = lt["fused"][top]
    # the fused stage takes top layers while its time stays within T
    while top > 0 and acc + lt["fused"][top - 1] <= T:
        top, acc = top - 1, acc + lt["fused"][top - 1]
    # half the memory for a stage's weights, the other half for the next stage's prefetch (§4)
    cap = pb.memory_bytes / 2
    # forward stages packed from the last layer downward, backward stages from layer 0 upward (§4)
    fwd = _pack(lt["fwd"], weights, list(range(top - 1, -1, -1)), T, cap)
    bwd = _pack(lt["bwd"], weights, list(range(top)), T, cap)
    span = lambda ls: (layers[min(ls)][0], layers[max(ls)][1])  # noqa: E731
    return _full_recompute(pb, sorted(span(s) for s in fwd), layers[top][0], [span(s) for s in reversed(bwd)])


def roundpipe(pb: PartitionProblem, *, time_limit_s: float = 10.0, seed: int = 0) -> PartitionResult:
    """RoundPipe's partitioner: per candidate bottleneck ``T``, greedy fused/forward/backward packing at layer
    granularity, transfers ignored, full recompute; cost ``max(#stages, N)·T``. The cheapest candidate whose plan
    fits the shared memory model wins (the paper's own limit is a weights-only rule)."""
    started = time.perf_counter()
    layers = layer_ranges(pb)
    per = lambda v: np.asarray([sum(v[i] for i in range(a, b)) for a, b in layers])  # noqa: E731
    f, r, b = per(pb.fwd_s), per(pb.rec_s), per(pb.bwd_s)
    lt = {"fwd": f, "bwd": r + b, "fused": f + b}
    weights = [pb.weight(a, z) for a, z in layers]
    scored = []
    for T in _roundpipe_candidates(f, r + b, f + b):
        plan = _roundpipe_plan(pb, layers, T, lt, weights)
        # RoundPipe's cost of a candidate: max(#stages, N)·T
        scored.append((max(plan.stage_count, pb.device_count) * T, T, plan))
    scored.sort(key=lambda x: (x[0], x[1]))
    for cost, T, plan in scored:
        if not validate_segment_plan(pb, plan):
            return make_result("roundpipe", pb, plan, started, bottleneck_s=T, roundpipe_cost_s=cost,
                               candidates_tried=len(scored))
    # no candidate fits: the cheapest one, returned infeasible with its violations
    return make_result("roundpipe", pb, scored[0][2], started, bottleneck_s=scored[0][1], candidates_tried=len(scored))


def dp(pb: PartitionProblem, *, time_limit_s: float = 10.0, seed: int = 0) -> PartitionResult:
    """Exact pure balance (nothing saved) at segment granularity; see the module docstring."""
    started = time.perf_counter()
    tables = RangeTables.build(pb)
    if min_memory(tables)[0] > pb.memory_bytes:
        return infeasible_result("dp", pb, started, tables)
    return dp_of_balance(pb, exact_balance(pb, tables), started)


def dp_of_balance(pb: PartitionProblem, bal: Balance, started: float) -> PartitionResult:
    """:func:`dp`'s result from its balance (:func:`.balance.exact_balance` over the problem's tables): the ILP
    seeds its pool with the same balance and need not solve it twice (~0.5 s at 128 layers)."""
    c = np.asarray(equal_time_factors(len(bal.t_star) - 1, pb.device_count, pb.microbatches), dtype=float)
    bound = bound_values(c, bal.t_star)
    best_bound = float(np.min(bound))
    # the stage counts whose bound is within DP_RESCORE_WINDOW of the best, re-scored by exact time
    shortlist = [s for s in np.argsort(bound, kind="stable") if bound[s] <= best_bound * DP_RESCORE_WINDOW]
    plans = [(iteration_time(pb, p), int(s), p) for s in shortlist for p in [bal.plan(int(s))]]
    _, stages, plan = min(plans, key=lambda x: (x[0], x[1]))
    return make_result("dp", pb, plan, started, model_optimum_s=best_bound, bound_s=best_bound,
                       stage_counts_rescored=len(plans))
