"""``PlanScorer``: the exact iteration time of many plans of one problem, for the local search (:mod:`.polish`).

A search scores thousands of plans that share most of their stages, so the scorer keeps each stage's cost (by
kind, range and the range's saved flags) and, beside it, the per-stage figures :func:`.timing._total` derives
from it on every call (bytes over the link, the host's accumulation time, what the stage waits for itself).
:meth:`PlanScorer.total` then walks only what depends on the plan: the lazy offload per device
(:func:`.timing._lazy_offload`), the transfer edges that depend on neighbouring stages (hand-off slack, weight
uploads behind the device's previous stage, :func:`.timing.transfer_edges`) and :func:`.timing.pipeline_time`.
Every figure is computed by the same expression in the same order as there, so the result is bit-for-bit
:func:`.timing._total`'s (``tests/test_planning_speed.py`` compares them); at 32 layers it takes ~40% less time.

A search's candidates are one move from the plan it stands on, which it names with :meth:`PlanScorer.anchor`: a
stage's figures and its part of the walk depend only on it and the stages before it, so a candidate whose first
stages are the anchor's (the same rows, the same times after the lazy offload) takes theirs and walks on from
there (llama-8b's local searches: a third of the stages, ~10% of their time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rpcompile.core.plan import StageKind
from rpcompile.core.schedule import steady_period
from rpcompile.core.stages import StageCost

from .problem import PartitionProblem
from .recurrence import Walk, overlapped_ends, pipeline_end, stage_ends
from .timing import stage_cost

__all__ = ["PlanScorer"]


@dataclass(frozen=True, slots=True)
class _Row:
    """One stage's figures that do not depend on the plan around it (plain floats)."""

    cost: StageCost
    time: float
    compute: float
    overhead: float
    offload: float
    weight: float
    base: float
    """``W + G`` before the plan's prefetch ``P`` joins (``_lazy_offload``'s ``base`` is ``W + G + P + working +
    buffers``, summed in that order)."""
    tail: tuple[float, float]
    """``(working, buffers)``, added after ``P``."""
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


def _row(pb: PartitionProblem, c: StageCost) -> _Row:
    link, m = pb.link_bytes_per_s, pb.microbatches
    up, down = c.upload_bytes, c.download_bytes
    return _Row(cost=c, time=c.time_s, compute=c.compute_s, overhead=c.overhead_s, offload=c.offload_bytes,
                weight=c.weight_bytes, base=c.weight_bytes + c.grad_bytes, tail=(c.working_bytes, c.buffer_bytes),
                up_link=up / link, own=down - c.offload_bytes, one_way=c.handoff_bytes / link,
                weight_link=c.weight_bytes / link, busy=max(0.0, up - c.weight_bytes / m), grad_s=c.grad_bytes / link,
                acc=pb.host.accumulate_s(c.grad_bytes), reduce=pb.host.reduce_s(c.reduced_bytes), out_s=(down - c.offload_bytes) / link,
                save_s=c.offload_bytes / link, prefetch_s=c.prefetch_bytes / link)


@dataclass(slots=True)
class _Scored:
    """A scored plan's per-stage figures, which a plan with the same first stages takes instead of recomputing
    (:meth:`PlanScorer.anchor`)."""

    key: tuple
    rows: list[_Row]
    times: list[float]
    handoff: list[float]
    weight_s: list[float]
    reads: list[tuple[int, ...]] | None
    walk: Walk


class PlanScorer:
    """Stage costs by kind, range and the range's saved flags, and plans' exact times, cached: a search scores
    thousands of plans that share most of their stages (and meets some plans again). One scorer may serve every
    search on the same problem (the solver's local searches share one)."""

    def __init__(self, pb: PartitionProblem) -> None:
        self.pb = pb
        self.cache: dict[tuple[str, int, int, tuple[bool, ...]], StageCost] = {}
        self.rows: dict[tuple[str, int, int, tuple[bool, ...]], _Row] = {}
        self.totals: dict[tuple, float] = {}
        self.packed: dict[tuple, tuple[tuple[int, int], ...] | None] = {}
        """:func:`.polish._packed` re-cuts by side, range, stage count and saved flags."""
        self.counts: dict[tuple[bool, ...], list[int]] = {}
        """Per saved flags, the saved segments before each index (:func:`.timing.save_reads`'s ``count``)."""
        self._accumulates = math.isfinite(pb.host.accumulate_bytes_per_s)
        self.recent: _Scored | None = None
        """The plan scored last."""
        self.base: _Scored | None = None
        """The plan a search moves from (:meth:`anchor`): a candidate's first stages that are this plan's, with
        the same times, keep their figures and their part of the walk."""

    def _key(self, kind: StageKind, a: int, b: int, saved: tuple[bool, ...]) -> tuple[str, int, int, tuple[bool, ...]]:
        key = (kind, a, b, saved[a:b])
        if key not in self.cache:
            self.cache[key] = cost = stage_cost(self.pb, kind, a, b, saved, 0)
            self.rows[key] = _row(self.pb, cost)
        return key

    def stage(self, kind: StageKind, a: int, b: int, saved: tuple[bool, ...]) -> StageCost:
        return self.cache[self._key(kind, a, b, saved)]

    def total(self, fwd: Sequence[tuple[int, int]], fused: tuple[int, int], bwd: Sequence[tuple[int, int]],
              saved: tuple[bool, ...]) -> float:
        """Exact iteration time of the plan these cuts and flags make (:func:`.timing._total`'s value; with
        ``host.overlap_iterations``, :func:`.timing.overlapped_period`'s)."""
        key = (tuple(fwd), fused, tuple(bwd), saved)
        value = self.totals.get(key)
        if value is None:
            value = self.totals[key] = self._total(self._rows(key), saved, key)
        return value

    def anchor(self, fwd: Sequence[tuple[int, int]], fused: tuple[int, int], bwd: Sequence[tuple[int, int]],
               saved: tuple[bool, ...]) -> None:
        """The plan the next candidates move from: they are scored resuming from its figures where their first
        stages are its own (the same values, :meth:`total`)."""
        key = (tuple(fwd), fused, tuple(bwd), saved)
        if self.recent is None or self.recent.key != key:
            self._total(self._rows(key), saved, key)
        self.base = self.recent

    def _rows(self, key: tuple) -> list[_Row]:
        fwd, fused, bwd, saved = key
        rows, (top, end) = self.rows, fused
        return ([rows[self._key("forward", a, b, saved)] for a, b in fwd]
                + [rows[self._key("fused", top, end, saved)]]
                + [rows[self._key("backward", a, b, saved)] for a, b in bwd])

    def _reads(self, rows: list[_Row], saved: tuple[bool, ...], start: int = 0) -> list[tuple[int, ...]]:
        """:func:`.timing.save_reads` of these stages from ``start`` on, the same tuples: the saved-segment counts
        kept per flags, and the scan over savers only for the backward stages (the others read nothing)."""
        count = self.counts.get(saved)
        if count is None:
            count = [0]
            for flag in saved:
                count.append(count[-1] + flag)
            self.counts[saved] = count
        savers = [(f, r.cost.start, r.cost.stop) for f, r in enumerate(rows)
                  if r.cost.kind == "forward" and r.offload]
        out: list[tuple[int, ...]] = []
        for r in rows[start:]:
            c = r.cost
            if c.kind != "backward":
                out.append(())
                continue
            start, stop = c.start, c.stop
            out.append(tuple(f for f, a, b in savers
                             if a < stop and start < b and count[min(b, stop)] > count[max(a, start)]))
        return out

    def _total(self, rows: list[_Row], saved: tuple[bool, ...], key: tuple) -> float:
        pb = self.pb
        n_dev, m, link = pb.device_count, pb.microbatches, pb.link_bytes_per_s
        times = [r.time for r in rows]
        offloading = [k for k, r in enumerate(rows) if r.offload]
        offloads = bool(offloading)
        if offloads:  # timing._lazy_offload
            prefetch = max(r.weight for r in rows)
            base = [r.base + prefetch + r.tail[0] + r.tail[1] for r in rows]
            for d in range(n_dev):
                mine = range(d, len(rows), n_dev)
                room = max(0, pb.memory_bytes - max((base[k] for k in mine), default=0))
                if pb.resident_handoffs:
                    room -= room // 2
                backlog = 0.0
                for k in range(d, offloading[-1] + 1, n_dev):  # the backlog changes no time after the last saver
                    r = rows[k]
                    start = backlog
                    if r.offload:
                        need = start + m * r.offload - room
                        times[k] = r.overhead + max(r.compute, r.up_link, (max(need / m, 0.0) + r.own) / link)
                    moved = m * max(0.0, (times[k] - r.overhead) * link - r.own)
                    backlog = max(0.0, start + m * r.offload - moved)
        # the first stages the anchor has too (the same row and time, so the same edges and walk: a stage's
        # figures depend only on it and the stages before it)
        first, anchor = 0, self.base
        if anchor is not None:
            same, known, known_t = min(len(rows), len(anchor.rows)), anchor.rows, anchor.times
            while first < same and rows[first] is known[first] and times[first] == known_t[first]:
                first += 1
        handoff, weight_s = (anchor.handoff[:first], anchor.weight_s[:first]) if anchor is not None else ([], [])
        for k in range(first, len(rows)):  # timing.transfer_edges and _weight_time
            r = rows[k]
            prev = rows[k - 1]
            slack = times[k - 1] - prev.compute - prev.overhead if k else 0.0
            handoff.append(2 * r.one_way - min(r.one_way, max(slack, 0.0)))
            if k < n_dev or r.weight == 0:
                weight_s.append(r.weight_link)
                continue
            before, t = rows[k - n_dev], times[k - n_dev]
            busy = before.busy / max(t - before.overhead, 1e-12)
            free, span = max(0.0, link - busy), m * t
            weight_s.append(r.weight / free if free * span >= r.weight else span + (r.weight - free * span) / link)
        reads: list[tuple[int, ...]] | None = None
        out_s: list[float] = []
        save_s: list[float] = []
        prefetch_s: list[float] = []
        if offloads:  # a stage reads savers before it: the first stages read what they read in the anchor
            head = [] if anchor is None else anchor.reads[:first] if anchor.reads is not None else [()] * first
            reads = head + self._reads(rows, saved, first)
            out_s, save_s = [r.out_s for r in rows], [r.save_s for r in rows]
            prefetch_s = [r.prefetch_s for r in rows]
        walk = Walk()  # timing.pipeline_time, resumed after the anchor's first stages
        ends = stage_ends(times, n_dev, m, weight_s, handoff, out_s, save_s, reads or (), prefetch_s, resume=first,
                          base=anchor.walk if anchor is not None else None, record=walk)
        self.recent = _Scored(key, rows, times, handoff, weight_s, reads, walk)
        h = self.pb.host
        grad_s, acc = [r.grad_s for r in rows], [r.acc for r in rows] if self._accumulates else []
        reduce = [r.reduce for r in rows]
        if h.overlap_iterations:  # timing.overlapped_period, the first iteration's walk being this one
            fused = next((k for k, r in enumerate(rows) if r.cost.kind == "fused"), len(rows) - 1)
            return steady_period(overlapped_ends(
                times, n_dev, m, fused=fused, step_s=h.step_s, weight_s=weight_s, grad_s=grad_s, handoff_s=handoff,
                out_s=out_s, save_s=save_s, reads=reads or (), prefetch_s=prefetch_s, accumulate_s=acc,
                reduce_s=reduce, overlap_reduce=h.overlap_reduce, reduce_host_s=h.reduce_s(h.host_grad_bytes),
                first=walk))
        return pipeline_end(ends, grad_s, acc, reduce, h.overlap_reduce, h.reduce_s(h.host_grad_bytes))
