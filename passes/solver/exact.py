"""Exact fewest-stage search at a fixed slowest-stage time ``T``: branch and bound over the saved flags.

:class:`.lagrange.StageCountBound` bounds the number of stages a time ``T`` needs by pricing the one thing that
couples the forward and backward stagings, each segment's saved flag. This module closes the gap from the other
side: it *finds* a plan with that few stages, or proves there is none.

- *state*: at a position of the chain, the open forward and backward stages' starts, the stages closed and what
  the flags chosen so far put in the open stages;
- *work*: dominance comparisons, counted instead of timed, so the same input gives the same answer.

:func:`fewest_stages` (the walk, its two pruning rules and its iterative deepening) is step 4 of
:func:`~rpcompile.passes.solver.partition.ilp`; :class:`Search` is what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .lagrange import StageCountBound
from .problem import SegmentPlan
from .tables import INF

__all__ = ["Search", "fewest_stages"]

_TOL = 1e-9


@dataclass(frozen=True)
class Search:
    """What :func:`fewest_stages` found: ``"plan"`` (the fewest non-fused stages, ``stages``, meeting ``T``),
    ``"none"`` (proof that no plan with at most the budget meets ``T``) or ``"limit"`` (work limit reached first;
    ``plan`` may still hold the best plan met)."""

    status: Literal["plan", "none", "limit"]
    plan: SegmentPlan | None
    stages: int | None
    work: int


def _all_pairs(cost: np.ndarray) -> np.ndarray:
    """``D[p, a]``: cheapest path from position ``p`` to ``a`` over ranges priced ``cost[p, q]``."""
    n1 = cost.shape[0]
    d = np.full((n1, n1), INF)
    d[0, 0] = 0.0
    for a in range(1, n1):
        # from every p < a at once, through the last range [b, a)
        d[:a, a] = np.min(d[:a, :a] + cost[:a, a][None, :], axis=1)
        d[a, a] = 0.0
    return d


class _OpenPaths:
    """``row(p)[i, k]``: cheapest staging of ``[p, ends[k])`` whose first range starts at ``p`` and ends at or after
    ``i`` (``row(p)[p, k] = dist[p, ends[k]]``: the open stage is still empty). Rows are built when first asked
    for: the walk only meets starts near its position, and all of them at once would be ``(n+1)² × |ends|``."""

    def __init__(self, cost: np.ndarray, ends: np.ndarray) -> None:
        self.cost, self.to_ends = cost, _all_pairs(cost)[:, ends]
        self.rows: dict[int, np.ndarray] = {}

    def row(self, p: int) -> np.ndarray:
        if p not in self.rows:
            via = self.cost[p, :, None] + self.to_ends  # via[e, k]: first range [p, e), then on to ends[k]
            # suffix minimum over e: the first range ends at or after i
            g = np.minimum.accumulate(via[::-1], axis=0)[::-1]
            # at i = p the open stage is still empty and may end anywhere
            g[p] = self.to_ends[p]
            self.rows[p] = g
        return self.rows[p]


def fewest_stages(relax: StageCountBound, lam: np.ndarray, budget: int, work_limit: int, *,
                  lower: float = 0.0) -> Search:
    """The fewest non-fused stages (at most ``budget``) of any plan whose every stage meets ``relax``'s ``T``;
    ``lam`` are the relaxation's multipliers (any ``λ`` is exact, a good one is fast).

    Iterative deepening from ``lower`` (a known lower bound such as ``L(λ)``): each budget is searched with the
    tightest pruning it allows, and the first one that holds a plan is the least count.

    Each budget's search walks the chain once, left to right. A state at position ``i`` is the start ``p`` of the
    open forward stage, the start ``q`` of the open backward stage, the number ``c`` of stages already closed and
    what the flags chosen so far put in the open stages — saved bytes on each side (``SF``, ``SB``: link and
    memory) and recompute the backward stage no longer runs (``RS``). At each position either open stage may close
    (if it meets ``T`` with its flags: :class:`.lagrange.StageCountBound`'s per-range capacities and the recompute
    it must shed), then segment ``i`` is saved or not. Two rules keep the walk small, and both are exact:

    - *dominance*: among states with the same ``(p, q)``, one with no more stages, bytes and no less shed
      recompute than another can finish any way the other can;
    - *Lagrangian pruning*: with the multipliers ``λ`` of the relaxation, the stages any completion still needs
      are at least the priced shortest paths from ``p`` and ``q`` to a common fused start (the open stages' first
      ranges ending no earlier than ``i``), plus the prices of the flags only one open stage holds. A state whose
      bound exceeds the budget is dropped. With ``λ`` from the ascent this bound is tight at the root, so the
      search stays near the relaxation's optimum.

    Once a plan within the budget is met the budget tightens to one stage fewer, so a completed walk returns the
    least count. The memory prefetch term ``P`` is relaxed as in :mod:`.lagrange` (the caller validates the plan);
    "none" is a proof either way. Its work is counted (dominance comparisons), not timed, so the same input gives
    the same answer."""
    work = 0
    if not np.isfinite(lower):  # the relaxation already shows that no plan meets T
        return Search("none", None, None, 0)
    # stage counts are whole: start at the bound rounded up (less float noise)
    for level in range(max(int(np.ceil(lower - 1e-9)), 0), budget + 1):
        found = _walk(relax, lam, level, work_limit - work)
        work += found.work
        # a plan or the work limit ends the deepening; only "none" moves to the next level
        if found.status != "none" or work >= work_limit:
            return Search(found.status, found.plan, found.stages, work)
    return Search("none", None, None, work)


def _walk(relax: StageCountBound, lam: np.ndarray, budget: int, work_limit: int) -> Search:
    if not relax.ok or budget < 0:
        return Search("none", None, None, 0)
    n = relax.n
    ends = np.flatnonzero(relax.fused)
    if ends.size == 0:
        return Search("none", None, None, 0)
    cf, cb = relax.range_costs(lam)
    g_f, g_b = _OpenPaths(cf, ends), _OpenPaths(cb, ends)
    # saves count twice in a forward stage's memory, once in a backward stage's (as in .lagrange)
    cap_f = np.minimum(relax.f_link, relax.f_mem / 2.0)
    cap_b = np.minimum(relax.b_link, relax.b_mem)
    f_ok, b_ok, cover = relax.f_fixed, relax.b_fixed, relax.cover
    act, rec = relax.act, relax.rec
    end_set = set(ends.tolist())

    def remaining(p: int, q: int, i: int) -> float:
        # only fused starts at or after i are still reachable
        k = int(np.searchsorted(ends, i))
        return float(np.min(g_f.row(p)[i, k:] + g_b.row(q)[i, k:])) if k < ends.size else INF

    # a point: (closed stages, SF, SB, RS, λ·s over the open forward stage, λ·s over the open backward stage, history)
    states: dict[tuple[int, int], list[tuple]] = {(0, 0): [(0, 0.0, 0.0, 0.0, 0.0, 0.0, None)]}
    best: tuple[int, int, tuple | None] | None = None
    work = 0
    for i in range(n):
        closed: dict[tuple[int, int], list[tuple]] = {}
        for (p, q), points in states.items():
            for c, sf, sb, rs, lf, lb, hist in points:
                close_f = p < i and f_ok[p, i] and sf <= cap_f[p, i]
                close_b = q < i and b_ok[q, i] and sb <= cap_b[q, i] and rs >= cover[q, i] - _TOL
                # either stage may also stay open
                closed.setdefault((p, q), []).append((c, sf, sb, rs, lf, lb, hist))
                if close_f:
                    # the closed stage's flags leave with it: a new forward stage opens at i with nothing saved
                    closed.setdefault((i, q), []).append((c + 1, 0.0, sb, rs, 0.0, lb, (hist, "F", i)))
                if close_b:
                    closed.setdefault((p, i), []).append((c + 1, sf, 0.0, 0.0, lf, 0.0, (hist, "B", i)))
                if close_f and close_b:
                    closed.setdefault((i, i), []).append((c + 2, 0.0, 0.0, 0.0, 0.0, 0.0, (hist, "FB", i)))
        # both stages closed at a fused start: a whole plan with c non-fused stages
        if i in end_set:
            for c, *_, hist in closed.get((i, i), ()):
                if c <= budget and (best is None or c < best[0]):
                    best = (c, i, hist)
                    budget = c - 1  # from now on only fewer stages are worth finding
        # the last segment is always fused: no state goes past it
        if i == n - 1:
            break
        states = {}
        for (p, q), points in closed.items():
            bound = remaining(p, q, i + 1)
            grown = []
            for c, sf, sb, rs, lf, lb, hist in points:
                # completions need >= c + bound + (λ·s of flags only the backward stage holds − forward only)
                if c + bound + lb - lf > budget + 1e-6:
                    continue
                grown.append((c, sf, sb, rs, lf, lb, (hist, 0, i)))
                # saving a segment with nothing to ship or recompute changes nothing
                if act[i] > 0 or rec[i] > 0:
                    # a saved flag counts on both sides: the forward stage ships
                    # it, the backward stage fetches it and sheds its recompute
                    grown.append((c, sf + act[i], sb + act[i], rs + rec[i], lf + lam[i], lb + lam[i], (hist, 1, i)))
            if not grown:
                continue
            # fewest stages and bytes first, most shed recompute last:
            # a dominating state comes before those it dominates
            grown.sort(key=lambda x: (x[0], x[1], x[2], -x[3]))
            kept: list[tuple] = []
            for x in grown:
                work += len(kept) + 1
                if not any(y[0] <= x[0] and y[1] <= x[1] and y[2] <= x[2] and y[3] >= x[3] for y in kept):
                    kept.append(x)
            states[(p, q)] = kept
        if work > work_limit:
            return Search("limit", *_plan_of(n, best), work)
        if not states:
            break
    if best is None:
        return Search("none", None, None, work)
    return Search("plan", *_plan_of(n, best), work)


def _plan_of(n: int, best: tuple | None) -> tuple[SegmentPlan | None, int | None]:
    if best is None:
        return None, None
    count, a, hist = best
    # cut positions of both sides, seeded with the chain's start and the fused start
    fwd, bwd, saved = [0, a], [0, a], [False] * n
    while hist is not None:
        hist, event, i = hist
        if event in ("F", "FB"):
            fwd.append(i)
        if event in ("B", "FB"):
            bwd.append(i)
        # the history holds stage closes ("F", "B", "FB") and flag choices (0, 1)
        if event == 1:
            saved[i] = True
    # a close at the fused start repeats a seeded position
    fwd, bwd = sorted(set(fwd)), sorted(set(bwd))
    plan = SegmentPlan(forward=tuple(zip(fwd, fwd[1:])), fused=(a, n),
                       backward=tuple(reversed(list(zip(bwd, bwd[1:])))),
                       saved=tuple(saved[:a]) + (False,) * (n - a))
    return plan, count
