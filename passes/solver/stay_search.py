"""``choose_stays``: which weights stay on their device (:mod:`~rpcompile.passes.solver.stays`), chosen on a solved
plan's cuts.

- *stay*: segment ``i``'s own parameters held on the device from its forward stage to its backward stage, sparing
  the backward stage their upload while every stage of that device in between holds them;
- *resident* plan: every weight stays, across iterations;
- *gradient sums*: a grad stage's gradients summed on its device across accumulation calls (``no_sync``).

Whether one pays is the exact timing model's to say (:func:`.timing.iteration_time`), whether it fits the memory
rule's (:func:`.segment_rules.validate_segment_plan`). Step 7 of :func:`~rpcompile.passes.solver.partition.ilp`;
the search for stays: :func:`choose_stays`, for gradient sums: :func:`choose_sums`.
"""

from __future__ import annotations

import dataclasses

from .problem import PartitionProblem, SegmentPlan, plan_stages
from .segment_rules import validate_segment_plan
from .stays import resident_allowed, stay_candidates, sum_candidates
from .timing import iteration_time

__all__ = ["choose_stays", "without_stays", "choose_sums"]

#: A stay is kept when the plan is at most this much slower with it (float noise; a stay should save time or
#: nothing).
SLOWER = 1e-12


def without_stays(plan: SegmentPlan) -> SegmentPlan:
    """``plan`` with every weight leaving its device after each stage (today's round robin) and every gradient
    going home after each call."""
    return dataclasses.replace(plan, stays=(), resident=False, accumulates=())


def choose_stays(pb: PartitionProblem, plan: SegmentPlan) -> SegmentPlan:
    """``plan`` with the weights that stay and the gradient sums (:func:`choose_sums`) chosen.

    A stay trades device memory for link time. Whether that pays is the exact timing model's to say
    (:func:`.timing.iteration_time`: the shorter upload may or may not be on the critical path, and the memory it
    holds is room the lazy offload loses), and whether it fits is the memory rule's
    (:func:`.segment_rules.validate_segment_plan`). The search, on the cuts and saved flags the solver settled (the
    range model of the ILP does not know which device a stage lands on, and a stay's memory spans stages):

    1. a **resident** plan, when every stage returns to its device each iteration (:func:`.stays.resident_allowed`):
       every weight stays, uploaded once and refreshed after optimizer steps only — the degenerate plan when the
       whole model fits, eager training on one device with its weights on the CPU;
    2. every segment that can stay (:func:`.stays.stay_candidates`);
    3. otherwise one segment at a time, those held for the fewest stages first (the last forward stages': the least
       memory for the same saving), keeping each that fits and is not slower.

    The first of 1 and 2 that fits and is not slower than the plan without stays is taken (1 before 2 when they
    tie: a resident plan also spares the uploads of weights no step changed, frozen ones and those of gradient
    accumulation steps); else 3. A stay never makes the plan slower: nothing stays when nothing fits."""
    base = without_stays(plan)
    if not pb.allow_stay:
        return base
    return choose_sums(pb, _weights(pb, base))


def _weights(pb: PartitionProblem, base: SegmentPlan) -> SegmentPlan:
    """``base`` with the weights that stay chosen (:func:`choose_stays`, 1–3)."""
    # a stay must not make the plan slower than without stays (SLOWER: float noise only)
    limit = iteration_time(pb, base) * (1 + SLOWER)

    def time_if_valid(p: SegmentPlan) -> float | None:
        return None if validate_segment_plan(pb, p) else iteration_time(pb, p)

    candidates = stay_candidates(pb, base)
    whole = [dataclasses.replace(base, stays=tuple(i in candidates for i in range(pb.n)))] if candidates else []
    # a model without weights has nothing to keep resident
    if resident_allowed(pb, base) and (any(pb.param_bytes) or any(p.bytes for p in pb.shared)):
        whole.insert(0, dataclasses.replace(base, resident=True))
    scored = [(t, p) for p in whole if (t := time_if_valid(p)) is not None and t <= limit]
    if scored:  # the fastest; the first (resident) of those within float noise of it
        fastest = min(t for t, _ in scored)
        return next(p for t, p in scored if t <= fastest * (1 + SLOWER))
    kinds = plan_stages(base)
    span = {i: 0 for i in candidates}  # stages between a segment's forward and backward stage
    for k, (kind, a, b) in enumerate(kinds):
        for i in range(a, b):
            if i in span:
                # forward stages come first in plan order: span[i] holds the
                # forward stage's index until the backward one subtracts it
                span[i] = k - span[i] if kind == "backward" else k
    flags = [False] * pb.n
    best = base
    # the fewest stages held first, then the heaviest (the most upload
    # spared for that memory), then by index for a stable order
    for i in sorted(candidates, key=lambda i: (span[i], -pb.param_bytes[i], i)):
        flags[i] = True
        trial = dataclasses.replace(base, stays=tuple(flags))
        t = time_if_valid(trial)
        if t is not None and t <= limit:
            # each later stay must not be slower than the plan with the stays kept so far
            best, limit = trial, min(limit, t * (1 + SLOWER))
        else:
            flags[i] = False
    return best


def choose_sums(pb: PartitionProblem, plan: SegmentPlan) -> SegmentPlan:
    """``plan`` with the grad stages whose gradients are summed on their devices chosen.

    On the stays chosen, every grad stage whose gradients can be summed on its device across accumulation calls,
    then (if that does not fit) one stage at a time, the largest gradients first, keeping each that fits and
    leaves a call outside ``no_sync`` no slower (the sums take room the lazy offload would use). A call under
    ``no_sync`` only gains from them: it sends those gradients nowhere."""
    candidates = set(sum_candidates(pb, plan))
    if not candidates:
        return plan
    limit = iteration_time(pb, plan) * (1 + SLOWER)
    groups = [[i for i in range(a, b) if i in candidates] for kind, a, b in plan_stages(plan) if kind != "forward"]
    groups = [g for g in groups if g]

    def trial(chosen: set[int]) -> SegmentPlan | None:
        p = dataclasses.replace(plan, accumulates=tuple(i in chosen for i in range(pb.n)))
        return p if not validate_segment_plan(pb, p) and iteration_time(pb, p) <= limit else None

    whole = trial(candidates)
    if whole is not None:
        return whole
    chosen: set[int] = set()
    best = plan
    # the largest gradients first: their sums spare a no_sync call the most download
    for group in sorted(groups, key=lambda g: -sum(pb.grad_bytes[i] for i in g)):
        p = trial(chosen | set(group))
        if p is not None:
            chosen |= set(group)
            best = p
    return best
