"""``polish``: local search on the exact iteration time, after the solvers.

- :func:`polish`: hill-climbs the forward and backward cuts (split, merge, shift by one segment, re-cut a side),
  then flips single segments' save/recompute choices;
- :func:`flip_saves`: sweeps of such flips only, on a plan's fixed cuts;
- :func:`taper`: a jump out of the climbs' local optimum, re-cutting a side so that its stages grow from the
  pipeline's ends inwards.

A move is kept when the exact iteration time (:func:`~rpcompile.passes.solver.timing.pipeline_time`) drops and
every stage still fits in memory. :func:`~rpcompile.passes.solver.partition.ilp` runs all three on its best plans
(step 6 of its search); why each exists is in its docstring.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterator, Sequence

from rpcompile.core.stages import StageCost, StageKind

from .problem import PartitionProblem, SegmentPlan
from .segment_rules import validate_segment_plan
from .scorer import PlanScorer

__all__ = ["flip_saves", "polish", "taper"]

#: ``taper``'s profiles: the first stage's share ``r`` of the side's slowest stage, and the growth ``g`` per stage.
TAPER_RATIOS = (0.15, 0.25, 0.35, 0.5, 0.7)
TAPER_GROWTH = (1.1, 1.2, 1.35, 1.6, 2.0)

Ranges = list[tuple[int, int]]


def _neighbours(rngs: Ranges, descending: bool) -> Iterator[Ranges]:
    """Every plan one move away: splits, merges and one-segment shifts of the cuts of ``rngs``."""
    for i, (a, b) in enumerate(rngs):
        for c in range(a + 1, b):  # split stage i at c (order within the list follows the direction)
            halves = [(c, b), (a, c)] if descending else [(a, c), (c, b)]
            yield rngs[:i] + halves + rngs[i + 1:]
    for i in range(len(rngs) - 1):
        (a0, b0), (a1, b1) = rngs[i], rngs[i + 1]
        merged = (a1, b0) if descending else (a0, b1)
        yield rngs[:i] + [merged] + rngs[i + 2:]
        # shift the cut between them by one segment either way
        if descending:  # rngs[i] = (cut, b0) above rngs[i+1] = (a1, cut)
            for cut in (a0 - 1, a0 + 1):
                if a1 < cut < b0:
                    yield rngs[:i] + [(cut, b0), (a1, cut)] + rngs[i + 2:]
        else:
            for cut in (b0 - 1, b0 + 1):
                if a0 < cut < b1:
                    yield rngs[:i] + [(a0, cut), (cut, b1)] + rngs[i + 2:]


def _packed(lo: int, hi: int, parts: int, cost, descending: bool) -> Ranges | None:
    """``[lo, hi)`` cut into at most ``parts`` contiguous stages minimising the slowest (bisection on the bound,
    greedy packing); ``cost(a, b)`` is a stage's time. ``None`` when ``parts`` exceeds the segments."""
    # every stage needs at least one segment
    if parts < 1 or parts > hi - lo:
        return None
    memo: dict[tuple[int, int], float] = {}  # the bisection packs the same ranges again and again

    def cost_of(a: int, b: int) -> float:
        value = memo.get((a, b))
        if value is None:
            value = memo[a, b] = cost(a, b)
        return value

    def pack(limit: float) -> Ranges | None:
        out, a = [], lo
        while a < hi:
            b = a + 1
            # the longest stage from a within the limit; a single segment is taken even above it
            while b < hi and cost_of(a, b + 1) <= limit:
                b += 1
            out.append((a, b))
            a = b
            # the limit is too low for this many parts
            if len(out) > parts:
                return None
        return out

    # no cut beats the slowest single segment (low); one stage of everything always packs (high)
    low, high = max(cost_of(i, i + 1) for i in range(lo, hi)), cost_of(lo, hi)
    # the fallback in case no bisection step packs
    best = pack(high)
    for _ in range(40):
        mid = (low + high) / 2
        got = pack(mid)
        if got is None:
            low = mid
        else:
            best, high = got, mid
        if high - low <= 1e-6 * high:
            break
    # packed upward from lo; a backward side lists its stages from the fused stage down
    return best[::-1] if descending and best else best


def _packed_once(scorer: PlanScorer, side: StageKind, lo: int, hi: int, parts: int, saved: tuple[bool, ...],
                 cost) -> Ranges | None:
    """:func:`_packed` of ``side``'s stage times under ``saved``, worked out once per scorer: a climb asks for
    the same re-cuts on every pass (its flags and fused stage change rarely), and climbs from one plan again."""
    key = (side, lo, hi, parts, saved)
    if key not in scorer.packed:
        cut = _packed(lo, hi, parts, cost, side == "backward")
        scorer.packed[key] = tuple(cut) if cut is not None else None
    kept = scorer.packed[key]
    return list(kept) if kept is not None else None


def polish(pb: PartitionProblem, plan: SegmentPlan, *, max_evaluations: int = 3000,
           deadline: float = float("inf"), scorer: PlanScorer | None = None) -> SegmentPlan:
    """A plan at least as fast as ``plan`` by exact iteration time. First-improvement climbs depend on the order
    of moves, so two climbs run — local moves only, and re-cuts first — and the faster result wins. Each climb
    stops at a local optimum or after ``max_evaluations`` candidate plans (a count, not a clock, so the result
    never depends on the machine's load; a 32-layer model converges in ~1,500, under a second). ``deadline`` (a
    ``time.perf_counter()`` value) only guards overruns: a climb that passes it stops where it is (the solver's
    time limit holds on a loaded machine).

    Why: the ILP and the balance DP minimise ``c(S)·T`` — the stage-count factor times the slowest stage — which
    is the iteration time only when every stage takes ``T``. When one stage is the bottleneck (an LM head, a fused
    stage), many partitions share that objective while their exact times
    (:func:`~rpcompile.passes.solver.timing.pipeline_time`) differ: finer forward stages fill the pipeline sooner.
    ``polish`` hill-climbs from the solver's plan with three moves on the forward and on the backward cuts — split
    a stage, merge two neighbours, shift a cut by one segment — and one macro move, re-cutting a whole side into
    ``f−2 … f+3`` time-balanced stages, keeping a move when the exact iteration time drops and every stage still
    fits in memory. Once no cut move helps, it flips one segment's checkpointing choice (save ↔ recompute): the
    solvers price saving per stage under the slowest-stage bound, so a stage that is not the bottleneck may save
    activations whose PCIe copies only lengthen the fill or the drain, or recompute what saving would hide.
    Deterministic: moves are tried in a fixed order and the first improvement is taken."""
    scorer = scorer or PlanScorer(pb)
    # first-improvement climbs depend on the order of moves: one with local moves only, one with re-cuts first
    (t1, p1), (t2, p2) = (_climb(pb, plan, max_evaluations, macro, deadline, scorer) for macro in (False, True))
    return p1 if t1 <= t2 else p2


def _climb(pb: PartitionProblem, plan: SegmentPlan, budget: int, macro: bool,
           deadline: float = float("inf"), scorer: PlanScorer | None = None) -> tuple[float, SegmentPlan]:
    evaluations = 0
    saved = plan.saved
    costs = scorer or PlanScorer(pb)

    def t(kind: StageKind, a: int, b: int) -> float:
        return costs.stage(kind, a, b, saved).time_s

    def total(fwd: Ranges, bwd: Ranges) -> float:
        return costs.total(fwd, plan.fused, bwd, saved)

    fwd, bwd = list(plan.forward), list(plan.backward)
    best = total(fwd, bwd)
    # the scorer resumes each candidate's walk from this plan's first stages
    costs.anchor(fwd, plan.fused, bwd, saved)  # the candidates below move from it
    improved = True
    while improved and evaluations < budget:
        if time.perf_counter() > deadline:
            break
        improved = False
        for side in ("forward", "backward"):
            current = fwd if side == "forward" else bwd
            desc = side == "backward"
            cost = (lambda a, b, _k=side: t(_k, a, b))
            lo, hi = 0, plan.fused[0]
            # the macro climb tries re-cuts into f − 2 … f + 3 stages first; the local climb none
            counts = range(max(1, len(current) - 2), len(current) + 4) if macro else range(0)
            rebalanced = (_packed_once(costs, side, lo, hi, p, saved, cost) for p in counts)
            for cand in itertools.chain((c for c in rebalanced if c), _neighbours(current, descending=desc)):
                if evaluations >= budget or time.perf_counter() > deadline:
                    break
                f2, b2 = (cand, bwd) if side == "forward" else (fwd, cand)
                value = total(f2, b2)
                evaluations += 1
                # a gain within float noise does not count, so that the climb cannot cycle
                if value < best * (1 - 1e-9):
                    # the scorer prices time only: memory is checked on an improving candidate alone
                    trial = SegmentPlan(forward=tuple(f2), fused=plan.fused, backward=tuple(b2), saved=saved)
                    if not validate_segment_plan(pb, trial):
                        fwd, bwd, best, improved = f2, b2, value, True
                        costs.anchor(fwd, plan.fused, bwd, saved)
                        # first improvement: start the moves again from the new plan
                        break
            if improved:
                break
        if improved:
            continue
        current_saved = saved
        for i in range(plan.fused[0]):  # no cut move helps: flip one segment's checkpointing choice
            if evaluations >= budget or time.perf_counter() > deadline:
                break
            saved = current_saved[:i] + (not current_saved[i],) + current_saved[i + 1:]
            value = total(fwd, bwd)
            evaluations += 1
            if value < best * (1 - 1e-9):
                trial = SegmentPlan(forward=tuple(fwd), fused=plan.fused, backward=tuple(bwd), saved=saved)
                if not validate_segment_plan(pb, trial):
                    best, improved = value, True
                    costs.anchor(fwd, plan.fused, bwd, saved)
                    break
            # no gain: put the flag back
            saved = current_saved
    return best, SegmentPlan(forward=tuple(fwd), fused=plan.fused, backward=tuple(bwd), saved=saved)


def flip_saves(pb: PartitionProblem, plan: SegmentPlan, *, max_sweeps: int = 3,
               deadline: float = float("inf"), scorer: PlanScorer | None = None) -> SegmentPlan:
    """A plan with the same cuts, at least as fast as ``plan`` by exact iteration time: segments before the fused
    stage are flipped one at a time in index order, a flip kept when the time drops and every stage still fits;
    sweeps repeat while one gains (at most ``max_sweeps``; none begins after ``deadline``).

    The climbs of :func:`polish` usually spend their evaluation budget on cut moves before they settle, so the
    solver ends with ``flip_saves`` on the winner: sweeps of flips only, on its fixed cuts, each one cheap (two
    stages change)."""
    costs = scorer or PlanScorer(pb)

    def total(saved: tuple[bool, ...]) -> float:
        return costs.total(plan.forward, plan.fused, plan.backward, saved)

    saved, best = plan.saved, total(plan.saved)
    costs.anchor(plan.forward, plan.fused, plan.backward, saved)
    for _ in range(max_sweeps):
        if time.perf_counter() > deadline:
            break
        gained = False
        for i in range(plan.fused[0]):
            if time.perf_counter() > deadline:
                break
            trial = saved[:i] + (not saved[i],) + saved[i + 1:]
            value = total(trial)
            # a gain within float noise does not count
            if value < best * (1 - 1e-9):
                candidate = SegmentPlan(forward=plan.forward, fused=plan.fused, backward=plan.backward, saved=trial)
                if not validate_segment_plan(pb, candidate):
                    saved, best, gained = trial, value, True
                    costs.anchor(plan.forward, plan.fused, plan.backward, saved)
        if not gained:
            break
    return SegmentPlan(forward=plan.forward, fused=plan.fused, backward=plan.backward, saved=saved)


def taper(pb: PartitionProblem, plan: SegmentPlan, *, scorer: PlanScorer | None = None) -> SegmentPlan:
    """``plan`` with its forward side, then its backward side, re-cut to the tapered profile (below) that gives
    the shortest exact iteration time, if one beats the plan's own cuts and fits; the same saved flags. Forward
    stages grow from segment 0 (the first stages of the iteration), backward stages too (its last).

    A jump out of the climbs' local optimum that no sequence of one-segment moves makes: it re-cuts a side so
    that its stages grow from the pipeline's end inwards. The fill waits for the first stages' first microbatch
    and the drain for the last stages' last one, so short stages there shorten both; but a short stage after a
    longer one only waits for it (it runs at its predecessor's pace), so the stages must *grow* from each end —
    geometrically, ``T·min(1, r·g^i)`` for the ``i``-th stage from the end, ``T`` the side's slowest stage. The
    solver tapers its winner, climbs again from there and keeps the faster plan."""
    saved, top = plan.saved, plan.fused[0]
    costs = scorer or PlanScorer(pb)

    def stage(kind: StageKind, a: int, b: int) -> StageCost:
        return costs.stage(kind, a, b, saved)

    def total(fwd: Ranges, bwd: Ranges) -> float:
        return costs.total(fwd, plan.fused, bwd, saved)

    def pack(kind: StageKind, limit: float, r: float, g: float) -> Ranges:
        out: Ranges = []
        a = 0
        while a < top:
            # the i-th stage from segment 0 may take T·min(1, r·g^i)
            cap, b = limit * min(1.0, r * g ** len(out)), a + 1
            while b < top and stage(kind, a, b + 1).time_s <= cap * (1 + 1e-9):
                b += 1
            out.append((a, b))
            a = b
        return out

    fwd, bwd = list(plan.forward), list(plan.backward)
    best = total(fwd, bwd)
    costs.anchor(fwd, plan.fused, bwd, saved)
    sides: tuple[tuple[StageKind, Ranges], ...] = (("forward", fwd), ("backward", bwd))
    for side, current in sides:
        if not current:
            continue
        limit = max(stage(side, a, b).time_s for a, b in current)
        for r, g in itertools.product(TAPER_RATIOS, TAPER_GROWTH):
            cut = pack(side, limit, r, g)
            # both sides grow from segment 0, and a backward side lists its stages from the fused stage down: reversed
            f2, b2 = (cut, bwd) if side == "forward" else (fwd, cut[::-1])
            value = total(f2, b2)
            if value < best * (1 - 1e-9):
                trial = SegmentPlan(forward=tuple(f2), fused=plan.fused, backward=tuple(b2), saved=saved)
                if not validate_segment_plan(pb, trial):
                    fwd, bwd, best = f2, b2, value
                    costs.anchor(fwd, plan.fused, bwd, saved)
    return SegmentPlan(forward=tuple(fwd), fused=plan.fused, backward=tuple(bwd), saved=saved)
