"""A plan's exact iteration time from its stages' figures: the one implementation behind :func:`.timing.iteration_time`
and the local search's :class:`~.scorer.PlanScorer`.

A stage's **figures** (:class:`StageFigures`, :func:`stage_figures`) are the plain floats its
:class:`~rpcompile.core.stages.StageCost` gives the walk and that do not depend on the plan around it: bytes over
the link as times, the host's accumulation and all-reduce, what the stage waits for itself. :func:`walk` then
computes what depends on the plan, in order: the lazy offload per device (:func:`lazy_times`, the runtime's policy,
:func:`.timing.offload_backlog`), the transfer edges that depend on neighbouring stages (:func:`transfer_times`:
hand-off slack, weight uploads behind the device's previous stage), which stages read whose saves
(:func:`reads_of`) and the event recurrence (:mod:`.recurrence`). Each figure is computed in one place, so the timing
model and the scorer agree bit for bit.

A stage's figures and its part of the walk depend only on it and the stages before it, so a walk over a plan whose
first stages are those of an earlier walk (:class:`Walked`, the same figures and the same times after the lazy
offload) takes theirs and walks on from there (the scorer's anchor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rpcompile.core.schedule import steady_period
from rpcompile.core.stages import StageCost

from .problem import PartitionProblem
from .recurrence import Walk, overlapped_ends, pipeline_end, stage_ends

__all__ = ["StageFigures", "stage_figures", "Walked", "lazy_times", "transfer_times", "saved_counts", "reads_of",
           "walk"]


@dataclass(slots=True)
class StageFigures:
    """One stage's figures that do not depend on the plan around it (plain floats; the memory figures whole bytes,
    so their sums are exact in any order). Not frozen, as it is made per stage for every timing-model call (a
    frozen dataclass sets each field through ``object.__setattr__``); nothing changes one once made."""

    cost: StageCost
    time: float
    compute: float
    overhead: float
    offload: float
    weight: float
    base: float
    """``W + found + G + working + buffers + held + sums``: the stage's memory before the plan's prefetch ``P`` joins
    (whole bytes, so the sum is exact in any order)."""
    up_link: float
    """``upload_bytes / link``."""
    own: float
    """``download_bytes − offload_bytes``: what the stage waits for itself, per microbatch."""
    one_way: float
    """``handoff_bytes / link``."""
    weight_link: float
    busy: float
    """``max(0, upload_bytes − weight_bytes / m)``: the activation bytes its weight uploads queue behind."""
    grad_s: float
    acc: float
    reduce: float
    """``host.reduce_s(reduced_bytes)``: the data-parallel all-reduce of its gradients (0 on one node)."""
    out_s: float
    save_s: float
    prefetch_s: float


def stage_figures(pb: PartitionProblem, c: StageCost) -> StageFigures:
    """``c``'s figures in ``pb`` (its link, microbatches and host)."""
    link, m = pb.link_bytes_per_s, pb.microbatches
    up, down = c.upload_bytes, c.download_bytes
    return StageFigures(
        cost=c, time=c.time_s, compute=c.compute_s, overhead=c.overhead_s, offload=c.offload_bytes,
        weight=c.weight_bytes,
        base=c.weight_bytes + c.found_bytes + c.grad_bytes + c.working_bytes + c.buffer_bytes + c.held_bytes
        + c.sum_bytes, up_link=up / link,
        own=down - c.offload_bytes, one_way=c.handoff_bytes / link, weight_link=c.weight_bytes / link,
        busy=max(0.0, up - c.weight_bytes / m), grad_s=c.grad_bytes / link, acc=pb.host.accumulate_s(c.grad_bytes),
        reduce=pb.host.reduce_s(c.reduced_bytes), out_s=(down - c.offload_bytes) / link,
        save_s=c.offload_bytes / link, prefetch_s=c.prefetch_bytes / link)


def lazy_times(pb: PartitionProblem, rows: Sequence[StageFigures], *, backlog: bool = False,
               offloading: Sequence[int] | None = None) -> tuple[list[float], list[float]]:
    """Per stage its time under the lazy offload (:func:`.timing.offload_backlog` documents the walk) and, with
    ``backlog``, the backlog it holds at most (else ``[]``: the walk stops after the last stage that saves, as the
    backlog changes no time after it). ``offloading``: the stages that save, when the caller knows them."""
    n_dev, m, link = pb.device_count, pb.microbatches, pb.link_bytes_per_s
    times = [r.time for r in rows]
    held_at = [0.0] * len(rows) if backlog else []
    if offloading is None:
        offloading = [k for k, r in enumerate(rows) if r.offload]
    if not offloading:
        return times, held_at
    # P, the plan's largest upload: the prefetch every stage budgets for (timing.stage_costs)
    prefetch = max(r.weight for r in rows)
    base = [r.base + prefetch for r in rows]
    for d in range(n_dev):
        mine = range(d, len(rows), n_dev)
        # the backlog may use only what every stage of this device
        # leaves free, so that no stage gives up its own memory for it
        room = max(0, pb.memory_bytes - max((base[k] for k in mine), default=0))
        if pb.resident_handoffs:  # one GPU: the hand-offs kept there have the other half
            room -= room // 2
        held = 0.0
        # without backlog figures, a device's stages after the plan's last saver change no time: the walk stops there
        for k in (mine if backlog else range(d, offloading[-1] + 1, n_dev)):
            r = rows[k]
            start = held
            if r.offload:
                need = start + m * r.offload - room  # bytes the stage must move to keep the backlog in room
                # per microbatch the link carries the stage's own downloads and its share of what must leave the backlog
                times[k] = r.overhead + max(r.compute, r.up_link, (max(need / m, 0.0) + r.own) / link)
            # link time the stage's own downloads leave over drains the backlog, for each of its m microbatches
            moved = m * max(0.0, (times[k] - r.overhead) * link - r.own)
            held = max(0.0, start + m * r.offload - moved)
            if backlog:
                # the most it holds: before it drains (start) or after its own saves join (held)
                held_at[k] = max(start, held)
    return times, held_at


def transfer_times(pb: PartitionProblem, rows: Sequence[StageFigures], times: Sequence[float], first: int = 0,
                   handoff: list[float] | None = None, weight_s: list[float] | None = None,
                   ) -> tuple[list[float], list[float]]:
    """Each stage's hand-off (down from the previous device, up to this one, less what the previous stage's time
    already covers) and weight upload (from the start of the device's previous stage, behind its activation
    copies: :func:`.timing.transfer_edges`), from stage ``first`` on, appended to ``handoff`` and ``weight_s``
    (the first stages' values)."""
    n_dev, m, link = pb.device_count, pb.microbatches, pb.link_bytes_per_s
    handoff = [] if handoff is None else handoff
    weight_s = [] if weight_s is None else weight_s
    for k in range(first, len(rows)):
        r = rows[k]
        prev = rows[k - 1]
        # a predecessor slower than its compute is bound by its copies: its time already covers the way down
        slack = times[k - 1] - prev.compute - prev.overhead if k else 0.0
        # down from the previous device and up to this one; the part of the way down
        # already inside the previous stage's time does not delay this stage again
        handoff.append(2 * r.one_way - min(r.one_way, max(slack, 0.0)))
        # a device's first stage uploads from the start of the iteration
        # at the full rate; a weightless stage uploads nothing
        if k < n_dev or r.weight == 0:
            weight_s.append(r.weight_link)
            continue
        before, t = rows[k - n_dev], times[k - n_dev]
        # the link rate (bytes/s) the previous stage k−N's activation uploads take while it runs
        busy = before.busy / max(t - before.overhead, 1e-12)
        free, span = max(0.0, link - busy), m * t
        # what fits in the bandwidth they leave during k−N's m
        # microbatches goes at that rate; the rest after, at the full rate
        weight_s.append(r.weight / free if free * span >= r.weight else span + (r.weight - free * span) / link)
    return handoff, weight_s


def saved_counts(saved: Sequence[bool]) -> list[int]:
    """The saved segments before each index."""
    count = [0]
    for flag in saved:
        count.append(count[-1] + flag)
    return count


def reads_of(costs: Sequence[StageCost], count: Sequence[int], start: int = 0) -> list[tuple[int, ...]]:
    """Per stage from ``start`` on, the forward stages whose saved activations it reads (backward stages; ``()``
    for the others); ``count``: :func:`saved_counts` of the plan's flags."""
    savers = [(f, c.start, c.stop) for f, c in enumerate(costs) if c.kind == "forward" and c.offload_bytes]
    out: list[tuple[int, ...]] = []
    for c in costs[start:]:
        if c.kind != "backward":
            out.append(())
            continue
        lo, hi = c.start, c.stop
        # a backward stage waits for a forward stage's saves only
        # when their ranges overlap on at least one saved segment
        out.append(tuple(f for f, a, b in savers if a < hi and lo < b and count[min(b, hi)] > count[max(a, lo)]))
    return out


@dataclass(slots=True)
class Walked:
    """A walked plan's per-stage figures, which a walk over a plan with the same first stages takes instead of
    recomputing (:func:`walk`'s ``anchor``)."""

    rows: list[StageFigures]
    times: list[float]
    handoff: list[float]
    weight_s: list[float]
    reads: list[tuple[int, ...]] | None
    walk: Walk


def walk(pb: PartitionProblem, rows: list[StageFigures], count: Sequence[int], *, overlapped: bool,
         anchor: Walked | None = None) -> tuple[float, Walked]:
    """The exact iteration time of the stages ``rows`` (costed on their own, or already through the lazy offload: the
    walk gives the same times either way) with their transfer edges — or, ``overlapped``, the steady-state period of
    overlapped iterations (:func:`.recurrence.overlapped_ends`, the optimizer step's waits included) — and what the
    walk met. ``count``: :func:`saved_counts` of the plan's flags; ``anchor``: an earlier walk whose first stages
    this one takes where they are the same (the same figures and times)."""
    n_dev, m = pb.device_count, pb.microbatches
    offloading = [k for k, r in enumerate(rows) if r.offload]
    times = lazy_times(pb, rows, offloading=offloading)[0]
    first = 0
    if anchor is not None:
        same, known, known_t = min(len(rows), len(anchor.rows)), anchor.rows, anchor.times
        # the scorer hands back the very StageFigures object for an unchanged stage, so identity is the cheap test
        while first < same and rows[first] is known[first] and times[first] == known_t[first]:
            first += 1
    handoff, weight_s = transfer_times(pb, rows, times, first, *(
        (anchor.handoff[:first], anchor.weight_s[:first]) if anchor is not None else ()))
    reads: list[tuple[int, ...]] | None = None
    out_s: list[float] = []
    save_s: list[float] = []
    prefetch_s: list[float] = []
    if offloading:  # a stage reads savers before it: the first stages read what they read in the anchor
        # an anchor without savers (reads None) read nothing in its first stages
        head = [] if anchor is None else anchor.reads[:first] if anchor.reads is not None else [()] * first
        reads = head + reads_of([r.cost for r in rows], count, first)
        out_s, save_s = [r.out_s for r in rows], [r.save_s for r in rows]
        prefetch_s = [r.prefetch_s for r in rows]
    record = Walk()  # the recurrence, resumed after the anchor's first stages
    ends = stage_ends(times, n_dev, m, weight_s, handoff, out_s, save_s, reads or (), prefetch_s, resume=first,
                      base=anchor.walk if anchor is not None else None, record=record)
    walked = Walked(rows, times, handoff, weight_s, reads, record)
    h = pb.host
    # an unlimited accumulation rate: no host adds to price
    grad_s, acc = [r.grad_s for r in rows], [r.acc for r in rows] if math.isfinite(h.accumulate_bytes_per_s) else []
    reduce = [r.reduce for r in rows]
    if overlapped:  # the first iteration's walk being this one
        fused = next((k for k, r in enumerate(rows) if r.cost.kind == "fused"), len(rows) - 1)
        return steady_period(overlapped_ends(
            times, n_dev, m, fused=fused, step_s=h.step_s, weight_s=weight_s, grad_s=grad_s, handoff_s=handoff,
            out_s=out_s, save_s=save_s, reads=reads or (), prefetch_s=prefetch_s, accumulate_s=acc,
            reduce_s=reduce, overlap_reduce=h.overlap_reduce, reduce_host_s=h.reduce_s(h.host_grad_bytes),
            first=record)), walked
    return pipeline_end(ends, grad_s, acc, reduce, h.overlap_reduce, h.reduce_s(h.host_grad_bytes)), walked
