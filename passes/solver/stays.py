"""What weights that stay on their device cost and save, per stage of a :class:`~.problem.SegmentPlan`.

- a stage's *weights*: its segments' own parameters and the shared parameters its segments read (counted once
  per stage, as :meth:`.problem.PartitionProblem.weight` counts them);
- *stay* (``SegmentPlan.stays[i]``): segment ``i``'s own parameters kept on the device from its forward stage's
  upload until its backward stage, when both stages run on one device;
- *resident* plan (``SegmentPlan.resident``): every weight kept on its device across iterations;
- *gradient sums* (``SegmentPlan.accumulates``): a segment's gradients summed on the device of the stage that
  computes them during gradient-accumulation calls (``pipe.no_sync()``) and sent home once, by the next call
  outside it.

:func:`stay_figures` gives each stage's figures (what a stay or a resident plan costs and saves there; gradient
sums: :func:`_sums`), which the timing model (:func:`.timing.stage_costs`) prices; :mod:`.stay_search` chooses
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rpcompile.core.schedule import weight_stays

from .problem import PartitionProblem, SegmentPlan, plan_stages

__all__ = ["StayFigures", "NO_STAY", "stay_figures", "stay_candidates", "resident_allowed", "sum_candidates"]

_Item = tuple[str, int]
"""A stage's weights, as the walk counts them: ``("segment", i)`` (segment ``i``'s own parameters) or
``("shared", j)`` (``problem.shared[j]``)."""


@dataclass(frozen=True)
class StayFigures:
    """One stage's part in the plan's stays (bytes in upload precision; see
    :class:`~rpcompile.core.stages.StageCost`)."""

    found: int = 0
    """Its own weights it does not upload: already on the device."""
    kept: int = 0
    """Its own weights it leaves on the device."""
    held: int = 0
    """Other stages' weights on the device while it runs."""
    refreshes: bool = False
    """Its upload replaces copies already on the device (a resident plan's trainable weights after the step)."""
    sums: int = 0
    """Gradient sums on the device while it runs (its own and its device's other stages'; :func:`_sums`)."""
    summed: int = 0
    """Its own gradient bytes (compute precision) that stay on the device in a call under ``no_sync``."""


NO_STAY = StayFigures()
"""A stage with nothing staying."""


def _items(pb: PartitionProblem, a: int, b: int) -> set[_Item]:
    # weightless items are left out: nothing of them to keep or upload
    own = {("segment", i) for i in range(a, b) if pb.param_bytes[i]}
    return own | {("shared", j) for j, p in enumerate(pb.shared) if any(a <= s < b for s in p.segments) and p.bytes}


def _sizes(pb: PartitionProblem, item: _Item) -> tuple[int, int]:
    """``(bytes, trainable bytes)`` of one item."""
    kind, i = item
    if kind == "segment":
        return pb.param_bytes[i], min(pb.grad_bytes[i], pb.param_bytes[i])
    p = pb.shared[i]
    return p.bytes, min(p.grad_bytes, p.bytes)


def stay_figures(pb: PartitionProblem, plan: SegmentPlan) -> list[StayFigures] | None:
    """Per stage of ``plan`` in execution order, its figures; None when nothing stays.

    :func:`rpcompile.core.schedule.weight_stays` walks the stages. A segment's own parameters that stay are found
    on the device by its backward stage, which uploads only the rest, and every stage that runs on that device in
    between holds them beside its own memory. In a resident plan each stage finds its weights, and only the
    trainable ones an optimizer step changed are uploaded again, by the first stage of the iteration on the device
    that reads them (frozen weights — a LoRA base — never again); the device holds all of its stages' weights all
    the time. The timing model (:func:`.timing.stage_costs`) prices both with these figures: the upload a stay
    saves (link time, :attr:`~rpcompile.core.stages.StageCost.weight_bytes`) against the memory it holds
    (:attr:`~rpcompile.core.stages.StageCost.held_bytes`).

    Figures are for an iteration in the steady state: a resident plan's first iteration uploads its frozen weights
    too."""
    if not plan.stays and not plan.resident and not plan.accumulates:
        return None
    stages = plan_stages(plan)
    sums, summed = _sums(pb, plan, stages)
    uses = [_items(pb, a, b) for _, a, b in stages]
    staying = [("segment", i) for i, s in enumerate(plan.stays) if s]
    out = []

    def size(items: set[_Item] | frozenset[_Item], which: int = 0) -> int:
        return sum(_sizes(pb, x)[which] for x in items)

    walk = weight_stays(uses, pb.device_count, staying, resident=plan.resident)
    for use, st, total, own in zip(uses, walk, sums, summed):
        refresh = size(st.found & st.first, 1)  # stale after the step: uploaded again
        # what it does not find, plus the found copies a step made stale
        upload = size(use - st.found) + refresh
        out.append(StayFigures(found=size(use) - upload, kept=size(st.kept), held=size(st.held),
                               refreshes=refresh > 0, sums=total, summed=own))
    return out


def _sums(pb: PartitionProblem, plan: SegmentPlan,
          stages: Sequence[tuple[str, int, int]]) -> tuple[list[int], list[int]]:
    """Per stage: the gradient-sum bytes on its device while it runs, and its own gradient bytes that stay.

    During gradient-accumulation calls (``pipe.no_sync()``) a segment's gradients may stay on the device of the
    stage that computes them, summed there in the masters' dtype (as ``.grad``: ``host.reduce_bytes_per_grad_byte``
    bytes per gradient byte) and sent home once, by the next call outside it: such a call downloads nothing of them
    and the host adds nothing. Every stage of that device holds the sums all the time, and during a call the
    gradients its earlier stages computed too (they join the sums when the call ends, so a failed call leaves the
    sums as they were). The plan's figures are a call outside ``no_sync``; :func:`.timing.stage_costs` with
    ``deferred`` prices one under it."""
    sums, summed = [0] * len(stages), [0] * len(stages)
    if not plan.accumulates:
        return sums, summed
    n, ratio = pb.device_count, pb.host.reduce_bytes_per_grad_byte  # sums in the masters' dtype, as .grad
    for k, (kind, a, b) in enumerate(stages):
        if kind != "forward":
            summed[k] = sum(pb.grad_bytes[i] for i in range(a, b) if plan.accumulates[i])
    for k in range(len(stages)):
        mine = [j for j in range(len(stages)) if j % n == k % n and summed[j]]
        # all of the device's sums (masters' dtype) and, during a call,
        # the gradients its earlier stages computed, not yet added to them
        sums[k] = int(sum(summed[j] * ratio for j in mine) + sum(summed[j] for j in mine if j < k))
    return sums, summed


def sum_candidates(pb: PartitionProblem, plan: SegmentPlan) -> list[int]:
    """Segments whose gradients may be summed on their device (:func:`_sums`): those with trainable parameters
    of their own, when every call starts its stages on device 0 — not with overlapped iterations (the
    round-robin pointer carries on) nor data-parallel (each call's gradients are reduced as they land)."""
    if pb.host.overlap_iterations or pb.host.nodes > 1:
        return []
    return [i for i in range(pb.n) if pb.grad_bytes[i]]


def stay_candidates(pb: PartitionProblem, plan: SegmentPlan) -> list[int]:
    """Segments whose own parameters may stay on ``plan``'s cuts: before the fused stage, with parameters, their
    forward and backward stages on one device (round robin from device 0)."""
    stages = plan_stages(plan)
    fwd = {i: k for k, (kind, a, b) in enumerate(stages) if kind == "forward" for i in range(a, b)}
    bwd = {i: k for k, (kind, a, b) in enumerate(stages) if kind == "backward" for i in range(a, b)}
    n = pb.device_count
    # a stay needs both stages on one device: stage k runs on device k mod N
    return [i for i in range(plan.fused[0]) if pb.param_bytes[i] and i in fwd and i in bwd
            and fwd[i] % n == bwd[i] % n]


def resident_allowed(pb: PartitionProblem, plan: SegmentPlan) -> bool:
    """Whether every stage returns to its device in the next iteration (one device, or a stage count that is a
    multiple of the devices, whichever way the round-robin pointer carries on): a resident plan needs it."""
    return pb.device_count == 1 or plan.stage_count % pb.device_count == 0
