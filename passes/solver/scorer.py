"""``PlanScorer``: the exact iteration time of many plans of one problem, for the local search (:mod:`.polish`).

A search scores thousands of plans that share most of their stages, so the scorer keeps each stage's cost (by
kind, range and the range's saved flags) and, beside it, the stage's figures (:func:`.figures.stage_figures`: bytes
over the link as times, the host's accumulation time, what the stage waits for itself). :meth:`PlanScorer.total`
then walks only what depends on the plan (:func:`.figures.walk`, the very walk of the timing model's
:func:`.timing.iteration_time`, so the values are the same bit for bit; ``tests/test_planning_speed.py`` compares
them); at 32 layers it takes ~40% less time than costing each plan afresh.

A search's candidates are one move from the plan it stands on, which it names with :meth:`PlanScorer.anchor`: a
stage's figures and its part of the walk depend only on it and the stages before it, so a candidate whose first
stages are the anchor's (the same figures, the same times after the lazy offload) takes theirs and walks on from
there (llama-8b's local searches: a third of the stages, ~10% of their time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rpcompile.core.stages import StageCost, StageKind

from .figures import StageFigures, Walked, saved_counts, stage_figures, walk
from .problem import PartitionProblem
from .recurrence import Walk
from .timing import stage_cost

__all__ = ["PlanScorer"]


@dataclass(slots=True)
class _Scored:
    """A scored plan's key and walk, which a plan with the same first stages resumes from (:meth:`PlanScorer.anchor`)."""

    key: tuple
    walked: Walked

    @property
    def walk(self) -> Walk:
        """The recurrence's record of the walk (:class:`.recurrence.Walk`)."""
        return self.walked.walk


class PlanScorer:
    """Stage costs by kind, range and the range's saved flags, and plans' exact times, cached: a search scores
    thousands of plans that share most of their stages (and meets some plans again). One scorer may serve every
    search on the same problem (the solver's local searches share one)."""

    def __init__(self, pb: PartitionProblem) -> None:
        self.pb = pb
        self.cache: dict[tuple[str, int, int, tuple[bool, ...]], StageCost] = {}
        self.rows: dict[tuple[str, int, int, tuple[bool, ...]], StageFigures] = {}
        self.totals: dict[tuple, float] = {}
        self.packed: dict[tuple, tuple[tuple[int, int], ...] | None] = {}
        """:func:`.polish._packed` re-cuts by side, range, stage count and saved flags."""
        self.counts: dict[tuple[bool, ...], list[int]] = {}
        """Per saved flags, the saved segments before each index (:func:`.figures.saved_counts`)."""
        self.recent: _Scored | None = None
        """The plan scored last."""
        self.base: _Scored | None = None
        """The plan a search moves from (:meth:`anchor`): a candidate's first stages that are this plan's, with
        the same times, keep their figures and their part of the walk."""

    def _key(self, kind: StageKind, a: int, b: int, saved: tuple[bool, ...]) -> tuple[str, int, int, tuple[bool, ...]]:
        # a stage's cost depends on the plan only through its range's saved flags
        key = (kind, a, b, saved[a:b])
        if key not in self.cache:
            # P = 0: the figures leave the prefetch out, and the walk adds the plan's own (figures.lazy_times)
            self.cache[key] = cost = stage_cost(self.pb, kind, a, b, saved, 0)
            self.rows[key] = stage_figures(self.pb, cost)
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
        # the plan scored last is already walked: only another one needs a walk of its own to resume from
        if self.recent is None or self.recent.key != key:
            self._total(self._rows(key), saved, key)
        self.base = self.recent

    def _rows(self, key: tuple) -> list[StageFigures]:
        fwd, fused, bwd, saved = key
        rows, (top, end) = self.rows, fused
        return ([rows[self._key("forward", a, b, saved)] for a, b in fwd]
                + [rows[self._key("fused", top, end, saved)]]
                + [rows[self._key("backward", a, b, saved)] for a, b in bwd])

    def _total(self, rows: list[StageFigures], saved: tuple[bool, ...], key: tuple) -> float:
        count = self.counts.get(saved)
        if count is None:
            count = self.counts[saved] = saved_counts(saved)
        anchor = self.base
        value, walked = walk(self.pb, rows, count, overlapped=self.pb.host.overlap_iterations,
                             anchor=anchor.walked if anchor is not None else None)
        self.recent = _Scored(key, walked)
        return value
