"""The rules a :class:`~.problem.SegmentPlan` obeys on its :class:`~.problem.PartitionProblem`, checked all at once
(:func:`validate_segment_plan`): its stages cover the chain as the schedule needs, its saves are allowed, and
every stage fits the device by the timing model's memory (:func:`.timing.stage_costs`).

Messages name the rule, the values found, the place (segment names) and a remedy.
"""

from __future__ import annotations

from typing import Sequence

from rpcompile.core.stages import StageCost
from rpcompile.core.units import fmt_bytes

from .problem import PartitionProblem, SegmentPlan
from .stays import resident_allowed, stay_candidates, sum_candidates
from .timing import stage_costs

__all__ = ["validate_segment_plan", "structural_violations", "memory_violations"]


def _where(pb: PartitionProblem, i: int) -> str:
    return pb.names[i] if 0 <= i < pb.n else f"segment {i}"


def _fused_violations(pb: PartitionProblem, plan: SegmentPlan) -> list[str]:
    a, b = plan.fused
    if b != pb.n or not 0 <= a < pb.n:
        return [f"fused stage must be [a, {pb.n}) with 0 <= a < {pb.n} (it holds the loss), got [{a}, {b})"]
    return []


def _chain_violations(pb: PartitionProblem, plan: SegmentPlan, kind: str) -> list[str]:
    """Rules 2 and 3: ranges non-empty, contiguous, covering ``[0, fused[0])`` in the required direction."""
    ranges = plan.forward if kind == "forward" else plan.backward
    label = "F" if kind == "forward" else "B"
    # backward stages are named from B1 (docs/architecture.md §3: FB comes first on that side)
    first = 0 if kind == "forward" else 1
    a = plan.fused[0]
    out: list[str] = []
    if (len(ranges) == 0) != (a == 0):
        out.append(f"{kind} stages: there are {len(ranges)} but the fused stage starts at segment {a}; "
                   f"a plan has {kind} stages exactly when the fused stage does not start at 0")
        return out
    # walk in the order the stages chain their segments: forward upward from 0, backward downward from a
    expect = 0 if kind == "forward" else a
    for k, (lo, hi) in enumerate(ranges):
        name = f"{label}{k + first} [{lo}, {hi})"
        if lo >= hi:
            out.append(f"{kind} stage {name} is empty or reversed; ranges are half-open [start, stop), start < stop")
            continue
        edge = lo if kind == "forward" else hi
        if edge != expect:
            # forward stages leave a gap by starting past the expected segment, backward stages by ending short of it
            what = "gap" if (edge > expect) == (kind == "forward") else "overlap"
            out.append(f"{kind} stage {name} should {'start' if kind == 'forward' else 'end'} at segment {expect} "
                       f"({_where(pb, expect)}) but does at {edge}: {what} between stages; "
                       f"{kind} stages must be {'ascending' if kind == 'forward' else 'descending'} and contiguous")
        expect = hi if kind == "forward" else lo
    end = a if kind == "forward" else 0
    if ranges and expect != end:
        out.append(f"{kind} stages end at segment {expect} but must reach {end} "
                   f"({'the fused stage start' if kind == 'forward' else 'the first segment'})")
    return out


def _saved_violations(pb: PartitionProblem, plan: SegmentPlan) -> list[str]:
    if len(plan.saved) != pb.n:
        return [f"saved has {len(plan.saved)} flags but there are {pb.n} segments; give one per segment"]
    # this rule runs even when rule 1 failed: a negative fused start must not index from the end
    out = [f"segment {i} ({_where(pb, i)}) is in the fused stage and cannot be saved; set saved[{i}] = False"
           for i in range(max(plan.fused[0], 0), pb.n) if plan.saved[i]]
    if not pb.allow_save and any(plan.saved):
        out.append(f"the problem forbids saving (allow_save=False) but segments "
                   f"{[i for i, s in enumerate(plan.saved) if s]} are saved")
    return out


def _sum_violations(pb: PartitionProblem, plan: SegmentPlan) -> list[str]:
    """Rule 5, gradient sums: one flag per segment, set only where its gradients can be summed on a device."""
    if len(plan.accumulates) != pb.n:
        return [f"accumulates has {len(plan.accumulates)} flags but there are {pb.n} segments; give one per segment"]
    can = set(sum_candidates(pb, plan))
    return [f"segment {i} ({_where(pb, i)}) cannot sum its gradients on its device: it has no trainable "
            f"parameters, or calls do not start on device 0 (overlapped iterations, data-parallel); set "
            f"accumulates[{i}] = False" for i, s in enumerate(plan.accumulates) if s and i not in can]


def _stay_violations(pb: PartitionProblem, plan: SegmentPlan) -> list[str]:
    """Rule 5: stays where they can be."""
    if (plan.resident or plan.stays or plan.accumulates) and not pb.allow_stay:
        return ["the problem keeps no weight on the devices (allow_stay=False) but the plan does; drop its stays"]
    if plan.accumulates:
        sums = _sum_violations(pb, plan)
        if sums:
            return sums
    if plan.resident:
        out = [] if resident_allowed(pb, plan) else [
            f"a resident plan needs every stage back on its device each iteration: one device, or a stage count "
            f"that is a multiple of the {pb.device_count} devices (it has {plan.stage_count}); drop resident"]
        return out + (["a resident plan keeps every weight: give it no stays flags"] if plan.stays else [])
    if not plan.stays:
        return []
    if len(plan.stays) != pb.n:
        return [f"stays has {len(plan.stays)} flags but there are {pb.n} segments; give one per segment"]
    can = set(stay_candidates(pb, plan))
    return [f"segment {i} ({_where(pb, i)}) cannot stay: it has no parameters, is in the fused stage or its "
            f"forward and backward stages run on different devices; set stays[{i}] = False"
            for i, s in enumerate(plan.stays) if s and i not in can]


def structural_violations(pb: PartitionProblem, plan: SegmentPlan) -> list[str]:
    """Rules 1-5 of :func:`validate_segment_plan`."""
    out = _fused_violations(pb, plan)
    # the chain and stay rules read fused[0], which means something only once rule 1 holds
    if not out:
        out += _chain_violations(pb, plan, "forward") + _chain_violations(pb, plan, "backward")
        out += _stay_violations(pb, plan)
    return out + _saved_violations(pb, plan)


def memory_violations(pb: PartitionProblem, plan: SegmentPlan, costs: Sequence[StageCost]) -> list[str]:
    """Rule 6: every stage fits the device (with the weights that stay there)."""
    out = []
    for k, c in enumerate(costs):
        if c.memory_bytes > pb.memory_bytes:
            # name the segment most likely to break the limit: its activations and
            # weights, and its backward transient where the stage runs a backward
            worst = max(range(c.start, c.stop), key=lambda i: pb.act_bytes[i] + pb.param_bytes[i]
                        + (pb.transient_bytes[i] if c.kind != "forward" else 0))
            out.append(f"stage {k} ({c.kind} [{c.start}, {c.stop})) needs {fmt_bytes(c.memory_bytes)} but the "
                       f"device has {fmt_bytes(pb.memory_bytes)}; split the stage or lower the micro-batch size "
                       f"(segment: {_where(pb, worst)})")
    return out


def validate_segment_plan(problem: PartitionProblem, plan: SegmentPlan, *, memory: bool = True) -> list[str]:
    """Every rule ``plan`` breaks, one message each (empty when valid). Rules:

    1. ``fused = (a, n)`` with ``0 <= a < n``.
    2. ``forward`` ranges are non-empty, ascending and contiguous, from 0 to ``a``.
    3. ``backward`` ranges are non-empty, descending and contiguous, from ``a`` down to 0.
    4. ``saved`` has one flag per segment, all False in the fused range (and everywhere when saving is off).
    5. ``stays`` is empty or has one flag per segment, True only where a segment's parameters can stay
       (:func:`.stays.stay_candidates`); a ``resident`` plan has no flags and every stage returns to its device
       each iteration (:func:`.stays.resident_allowed`); ``accumulates`` likewise, True only where a segment's
       gradients can be summed on its device (:func:`.stays.sum_candidates`).
    6. (``memory=True``) every stage fits ``memory_bytes``, the weights that stay on its device included.
    """
    problems = structural_violations(problem, plan)
    # stage_costs needs a structurally valid plan (ranges that cover the chain)
    if memory and not problems:
        problems = memory_violations(problem, plan, stage_costs(problem, plan))
    return problems
