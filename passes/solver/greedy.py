"""A fast save-aware heuristic: the ILP's hints, and the heart of the ``greedy`` strategy.

For a target slowest-stage time ``T`` and a fused start ``a``:

1. forward stages: the balanced ``f``-stage partition of ``[0, a)`` (no saves) for the least few feasible ``f``;
2. saves: segments in order of recompute removed per link second (``rec / α``), each saved while its forward
   stage's download still fits in ``T`` (Dantzig's greedy, per forward stage);
3. backward stages: the fewest ranges within ``T`` given those saves (a shortest path).

A second, *backward-driven* pass does the opposite: backward stages first, each saving just enough (least link
time) to fit ``T``, then the fewest forward stages that can download those saves. The better of the two counts,
over every feasible fused start, is the heuristic's fewest stages for ``T``; bisection on ``T`` then fits a stage
budget. docs/architecture.md §7 measured a similar greedy within 0.5% of the optimum on pure balance; with saving it lands
within a few percent, which the CP-SAT model then closes.
"""

from __future__ import annotations

import numpy as np

from .balance import BalanceTable
from .problem import PartitionProblem, SegmentPlan
from .tables import INF, RangeTables

__all__ = ["greedy_plan", "masks_for", "Masks"]

#: Forward stage costs, backward memory mask and fused times (memory relaxed: ``P`` = the range's own weight).
Masks = tuple[np.ndarray, np.ndarray, np.ndarray]
Attempt = tuple[int, "SegmentPlan | None"]

_BISECT_STEPS = 30
#: Forward-driven pass: how many forward stage counts to try, from the fewest feasible up (more forward stages
#: mean more download time for saves).
_FORWARD_COUNTS = 3
_NONE = 10**9  # "no cover" stage count


def _fewest(cost: np.ndarray, limit: float, stop: int) -> tuple[int, list[tuple[int, int]]]:
    """Fewest ranges with ``cost <= limit`` covering ``[0, stop)``, as ranges from the top down."""
    ok = cost[: stop + 1, : stop + 1] <= limit
    count = np.full(stop + 1, _NONE)
    prev = np.full(stop + 1, -1)
    count[0] = 0
    for b in range(1, stop + 1):
        cand = np.where(ok[:b, b], count[:b], _NONE)
        k = int(np.argmin(cand))
        # capped, so that a prefix with no cover stays at _NONE
        count[b], prev[b] = min(cand[k] + 1, _NONE), k
    if count[stop] >= _NONE:
        return _NONE, []
    out, p = [], stop
    while p > 0:
        out.append((int(prev[p]), p))
        p = int(prev[p])
    return int(count[stop]), out


def _ratio_rank(pb: PartitionProblem) -> list[int]:
    """Position of each segment when sorted by recompute removed per byte saved, best first."""
    # negated so that an ascending sort puts the best first; a segment of no bytes with recompute ranks first
    ratio = [-r / max(a, 1e-30) for r, a in zip(pb.rec_s, pb.act_bytes)]
    order = sorted(range(pb.n), key=ratio.__getitem__)
    rank = [0] * pb.n
    for pos, i in enumerate(order):
        rank[i] = pos
    return rank


def _saves(pb: PartitionProblem, forward: list[tuple[int, int]], limit: float) -> tuple[bool, ...]:
    """Ratio-greedy saves within each forward stage's spare download time."""
    link, ovh = pb.link_bytes_per_s, pb.stage_overhead_s
    saved = [False] * pb.n
    if not pb.allow_save:
        return tuple(saved)
    rank = _ratio_rank(pb)
    for a, b in forward:
        # what T leaves of the stage's download once its outputs are down
        room = (limit - ovh) - pb.link_out(b) / link
        ranked = sorted(range(a, b), key=rank.__getitem__)
        for i in ranked:
            cost = pb.act_bytes[i] / link
            # saving a segment with nothing to recompute gains nothing
            if pb.rec_s[i] > 0 and cost <= room:
                saved[i], room = True, room - cost
    return tuple(saved)


def _backward_times(pb: PartitionProblem, t: RangeTables, saved: tuple[bool, ...]) -> np.ndarray:
    """Backward range times with the given saves (same formula as :func:`.timing.stage_costs`)."""
    link, m = pb.link_bytes_per_s, pb.microbatches
    s = np.asarray(saved, dtype=float)
    pre = lambda v: np.concatenate([[0.0], np.cumsum(v)])  # noqa: E731
    rng = lambda p: p[None, :] - p[:, None]  # noqa: E731
    comp = rng(pre(np.asarray(pb.bwd_s) + np.asarray(pb.rec_s) * (1 - s)))
    up = (t.in_bytes[:, None] + t.out_bytes[None, :] + t.weight / m + rng(pre(np.asarray(pb.act_bytes) * s))) / link
    grad_in = np.where(np.arange(pb.n + 1) > 0, t.in_bytes, 0)
    down = (grad_in[:, None] + t.grad / m) / link
    return np.where(t.valid, pb.stage_overhead_s + np.maximum(comp, np.maximum(up, down)), INF)


def _forward_driven(pb: PartitionProblem, t: RangeTables, fwd: BalanceTable, limit: float, a: int,
                    b_allowed: np.ndarray) -> Attempt:
    """Balanced forward stages (nothing saved yet), ratio-greedy saves, then the fewest backward stages."""
    best: Attempt = (_NONE, None)
    # fwd_best comes from the balance table with nothing saved: saves are added below within each stage's room
    feasible_f = [k for k in range(1, fwd.fwd_best.shape[0]) if fwd.fwd_best[k, a] <= limit]
    for f in feasible_f[:_FORWARD_COUNTS]:
        forward = fwd.forward_ranges(f, a)
        saved = _saves(pb, forward, limit)
        b_cost = np.where(b_allowed, _backward_times(pb, t, saved), INF)
        count, backward = _fewest(b_cost, limit, a)
        # + 1: the fused stage
        if f + count + 1 < best[0]:
            clean = tuple(s if i < a else False for i, s in enumerate(saved))
            best = (f + count + 1, SegmentPlan(forward=tuple(forward), fused=(a, pb.n), backward=tuple(backward),
                                               saved=clean))
    return best


def _least_saves(pb: PartitionProblem, t: RangeTables, b_ok: np.ndarray,
                 limit: float) -> tuple[np.ndarray, dict[tuple[int, int], list[int]]]:
    """Per backward range, the fewest link seconds of saves that bring it within ``limit`` (ratio greedy), and
    which segments; ``inf`` where no choice does."""
    n, link, m, ovh = pb.n, pb.link_bytes_per_s, pb.microbatches, pb.stage_overhead_s
    budget = limit - ovh
    cost = np.full((n + 1, n + 1), INF)
    chosen: dict[tuple[int, int], list[int]] = {}
    rank = _ratio_rank(pb)
    grad_in = np.where(np.arange(n + 1) > 0, t.in_bytes, 0)
    for a in range(n):
        work = 0.0
        for b in range(a + 1, n):
            # bwd_s alone is the floor: only recompute can be saved away, so a longer range only adds to it
            work += pb.bwd_s[b - 1]
            if work > budget:
                break
            up = (t.in_bytes[a] + t.out_bytes[b] + t.weight[a, b] / m) / link
            if not b_ok[a, b] or (grad_in[a] + t.grad[a, b] / m) / link > budget:
                continue
            # the recompute the range's saves must remove to fit the budget
            need = work + sum(pb.rec_s[a:b]) - budget
            picks: list[int] = []
            if need > 0 and pb.allow_save:
                for i in sorted(range(a, b), key=rank.__getitem__):
                    if need <= 0:
                        break
                    if pb.rec_s[i] > 0:
                        picks.append(i)
                        need -= pb.rec_s[i]
            alpha = sum(pb.act_bytes[i] for i in picks) / link
            # the saves come up beside the range's other uploads and must fit the same budget
            if need <= 1e-12 * budget and up + alpha <= budget:
                cost[a, b], chosen[(a, b)] = alpha, picks
    return cost, chosen


def _fewest_then_lightest(cost: np.ndarray, stop: int) -> list[tuple[int, int]] | None:
    """Fewest finite-cost ranges covering ``[0, stop)``, ties broken by the least total cost (top down)."""
    # 1 per range plus a share of the total cost below 1 over any path: the stage count wins, the cost breaks ties
    key = np.where(np.isfinite(cost), 1.0 + cost / (np.nansum(np.where(np.isfinite(cost), cost, 0)) + 1.0), INF)
    best, prev = np.full(stop + 1, INF), np.full(stop + 1, -1)
    best[0] = 0.0
    for b in range(1, stop + 1):
        vals = best[:b] + key[:b, b]
        k = int(np.argmin(vals))
        best[b], prev[b] = vals[k], k
    if not np.isfinite(best[stop]):
        return None
    out, p = [], stop
    while p > 0:
        out.append((int(prev[p]), p))
        p = int(prev[p])
    return out


def _backward_driven(pb: PartitionProblem, t: RangeTables, masks: Masks, limit: float, a: int,
                     saves_table: tuple[np.ndarray, dict[tuple[int, int], list[int]]]) -> Attempt:
    """Backward stages first (each saving just enough), then the fewest forward stages that carry those saves."""
    cost, chosen = saves_table
    backward = _fewest_then_lightest(cost, a)
    if backward is None:
        return _NONE, None
    saved = [False] * pb.n
    for r in backward:
        for i in chosen[r]:
            saved[i] = True
    carried = np.concatenate([[0.0], np.cumsum(np.asarray(pb.act_bytes, dtype=float) * np.asarray(saved))])
    # a forward stage's download: its outputs and the saves of its segments, per microbatch
    down = pb.stage_overhead_s + (t.out_bytes[None, :] + carried[None, :] - carried[:, None]) / pb.link_bytes_per_s
    count, forward = _fewest(np.maximum(masks[0], down), limit, a)
    plan = SegmentPlan(forward=tuple(reversed(forward)), fused=(a, pb.n), backward=tuple(backward),
                       saved=tuple(saved))
    # no forward cover for those saves: no plan
    return count + len(backward) + 1, plan if count < _NONE else None


def _fewest_stages(pb: PartitionProblem, t: RangeTables, fwd: BalanceTable, masks: Masks, limit: float) -> Attempt:
    """``(stages, plan)``: the heuristic's fewest stages with every stage within ``limit``."""
    f_ok, b_ok, fused = masks
    best: Attempt = (_NONE, None)
    saves_table = _least_saves(pb, t, b_ok, limit)
    for a in np.flatnonzero(fused <= limit):
        # the fused stage alone: one stage, the fewest any plan has (starts come in ascending order)
        if a == 0:
            return 1, SegmentPlan(forward=(), fused=(0, pb.n), backward=(), saved=(False,) * pb.n)
        for cand in (_forward_driven(pb, t, fwd, limit, int(a), b_ok),
                     _backward_driven(pb, t, masks, limit, int(a), saves_table)):
            if cand[1] is not None and cand[0] < best[0]:
                best = cand
    return best


def greedy_plan(pb: PartitionProblem, t: RangeTables, fwd: BalanceTable, masks: Masks, stages: int, lo: float,
                hi: float) -> SegmentPlan | None:
    """The heuristic plan with at most ``stages`` stages and the least slowest stage in ``[lo, hi]``."""
    count, plan = _fewest_stages(pb, t, fwd, masks, hi)
    if count > stages:
        return None
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        c, p = _fewest_stages(pb, t, fwd, masks, mid)
        if c <= stages:
            hi, plan = mid, p
        else:
            lo = mid
        if hi - lo <= 1e-4 * hi:  # the plan kept is scored by its own slowest stage, not by ``hi``
            break
    return plan


def masks_for(pb: PartitionProblem, t: RangeTables) -> Masks:
    """Forward costs, backward memory mask and fused times with ``P = own weight`` (memory relaxation)."""
    f_cost = np.where(t.fwd_need + t.weight <= pb.memory_bytes, t.fwd_time, INF)
    b_ok = t.bwd_need + t.weight <= pb.memory_bytes
    fused = np.where(t.fused_need + t.fused_weight <= pb.memory_bytes, t.fused_time, INF)
    return f_cost, b_ok, fused
