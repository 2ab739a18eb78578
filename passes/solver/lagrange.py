"""Lagrangian lower bounds on the stage count a slowest-stage time ``T`` needs, saving allowed.

- ``sF``, ``sB``: each side's own copy of the segments' saved flags (the forward stage that ships a segment's
  activations to host, the backward stage that fetches them instead of recomputing);
- ``λ``: one multiplier per segment, the price of ``sF`` and ``sB`` disagreeing;
- ``L(λ)``: the least priced stage count over both sides' stagings, a lower bound on the non-fused stage count of
  any plan whose slowest stage is at most ``T``.

:class:`StageCountBound` defines ``L(λ)`` exactly, raises it by subgradient ascent and repairs the flags it meets
into plans; :mod:`.exact` and :func:`~rpcompile.passes.solver.partition.ilp` (step 4) use it to prove that a stage
budget cannot be that fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .problem import PartitionProblem, SegmentPlan
from .tables import INF, RangeTables

__all__ = ["StageCountBound", "MAX_ENUMERATED"]

#: Longest range whose saved subsets are enumerated exactly (2^k subsets).
MAX_ENUMERATED = 11
_TOL = 1e-9
#: Distinct saved-flag vectors kept from the ascent for repair into plans.
_KEEP = 8


@dataclass
class _Side:
    """One side's ranges at a fixed ``T``: per length ``k``, the feasible subsets of every start."""

    starts: list[np.ndarray]
    """``starts[k]``: starts ``p`` of enumerated ranges ``[p, p+k)`` that can meet ``T`` with some subset."""
    feasible: list[np.ndarray]
    """``feasible[k]``: ``(len(starts[k]), 2^k)`` mask of subsets meeting ``T`` and memory."""
    long_ranges: tuple[np.ndarray, np.ndarray, np.ndarray]
    """``(p, q, cap)`` of the longer ranges that can meet ``T``, ``cap`` in activation bytes: their inner minimum
    is the fractional knapsack over the saved bytes their link and memory allow (the covering of recompute
    dropped), a lower bound."""


def _subset_sums(x: np.ndarray, k: int, starts: np.ndarray) -> np.ndarray:
    """``[p, j]``: the sum of ``x`` over the subset ``j`` of the range ``[p, p+k)`` (bit ``i`` of ``j`` takes
    segment ``p + i``), summed in segment order. Built by doubling (subsets without segment ``i``, then with it):
    ``2^k`` additions per start where a product with the 0/1 subset matrix took ``k·2^k`` multiply-adds and
    BLAS's threads (on a loaded 2-core machine, twice the CPU time for the Lagrangian phase); a product of 0/1
    weights summed in that order gives the same numbers."""
    windows = sliding_window_view(x, k)[starts]
    out = np.empty((len(starts), 2 ** k))
    out[:, 0] = 0.0
    for i in range(k):
        half = 1 << i
        np.add(out[:, :half], windows[:, i:i + 1], out=out[:, half:2 * half])
    return out


class StageCountBound:
    """Lower bounds on ``f + b`` (non-fused stages) for plans whose every stage takes at most ``T``.

    The ILP's LP relaxation (and the aggregates of :mod:`.bounds`) treat stages as a fluid: they can say "51 stages
    of 0.167 s hold all the work" when whole segments cannot be packed that way. This keeps the packing integral.
    For a fixed ``T`` the least number of stages is a shortest path over cut positions on each side, except that
    the saved flag ``s_i`` of a segment is shared by the forward stage that ships its activations to host and the
    backward stage that fetches them instead of recomputing. Give each side its own copy (``sF``, ``sB``) and
    price the disagreement with a multiplier ``λ_i`` per segment (Lagrangian relaxation of ``sF = sB``):

        L(λ) = min_a [ F_a(λ) + B_a(λ) ],   F_a(λ) = min over forward stagings of [0, a) of Σ_stages (1 + Σ λ_i sF_i)
                                             B_a(λ) = min over backward stagings of [0, a) of Σ_stages (1 − Σ λ_i sB_i)

    where every stage must meet ``T`` on compute, upload, download and memory with its own saved subset (the inner
    minimum is exact by enumerating the subsets of ranges up to ``MAX_ENUMERATED`` segments; longer ranges take the
    fractional knapsack their link and memory allow and drop the recompute they must remove, which only lowers
    ``L``). Every ``L(λ)`` is a lower bound on the non-fused stage count of any plan whose slowest stage is at most
    ``T``; a subgradient ascent on ``λ`` (:meth:`maximise`) raises it. Since the least stage count can only fall as
    ``T`` grows, ``L(λ) > S − 1`` at ``T`` proves that no plan with at most ``S`` stages is that fast.

    The memory prefetch term ``P`` (the plan's largest stage weight) is relaxed to ``max(own weight, heaviest
    segment)``. Plain numpy. :meth:`plan_for` turns the saved flags met along the way into real plans (fewest
    stages meeting ``T`` once the flags are fixed): the search's primal side."""

    def __init__(self, pb: PartitionProblem, t: RangeTables, T: float) -> None:
        self.evaluations = 0  # of L(λ) by the last maximise
        n, link, m, mem = pb.n, pb.link_bytes_per_s, pb.microbatches, pb.memory_bytes
        # T less the per-stage overhead: what a stage's compute and each of its copies may take
        tp = T - pb.stage_overhead_s
        self.n, self.ok = n, tp >= 0
        # T below the overhead: no stage meets it, every bound is infinite
        if not self.ok:
            return
        # a hair of slack so that a range exactly at T is not lost to float noise
        slack = 1 + _TOL
        budget = tp * link * slack  # bytes one link moves within T
        self.act = np.asarray(pb.act_bytes, dtype=np.float64)
        self.rec = np.asarray(pb.rec_s, dtype=np.float64)
        w, inb, outb = t.weight.astype(np.float64), t.in_bytes.astype(np.float64), t.out_bytes.astype(np.float64)
        p_min = max(float(t.min_weight()), 0.0)
        # the relaxed P: at least the range's own weight and the heaviest single segment
        prefetch = np.maximum(w, p_min)
        valid = t.valid.copy()
        valid[:, n] = False  # the last segment always belongs to the fused stage
        grad_in = np.where(np.arange(n + 1) > 0, inb, 0.0)
        # forward stage: compute and upload fixed; download = boundary + saved; memory adds 2 × saved
        self.f_link = np.broadcast_to(budget - outb[None, :], (n + 1, n + 1))
        self.f_mem = mem * slack - t.fwd_need - prefetch
        self.f_fixed = valid & (t.fwd_time - pb.stage_overhead_s <= tp * slack) & (self.f_mem >= 0)
        # backward stage: download fixed; upload = inputs + weights + saved; compute = full − saved recompute
        self.b_link = budget - (inb[:, None] + outb[None, :] + w / m)
        self.b_mem = mem * slack - t.bwd_need - prefetch
        cum_br = np.concatenate([[0.0], np.cumsum(np.asarray(pb.bwd_s) + self.rec)])
        self.cover = (cum_br[None, :] - cum_br[:, None]) - tp * slack  # recompute that saving must remove
        rec_sum = _range_sums(self.rec)
        b_down = grad_in[:, None] + t.grad / m
        # rec_sum >= cover: only ranges whose compute fits T once every segment is saved
        self.b_fixed = valid & (b_down <= budget) & (self.b_link >= 0) & (self.b_mem >= 0) & (rec_sum >= self.cover)
        # fused_time includes the overhead: compared with T itself, not with T less the overhead
        self.fused = (t.fused_time <= T * slack) & (t.fused_need + np.maximum(t.fused_weight, p_min) <= mem * slack)
        # forward memory holds a microbatch's saves twice (being made, and the last ones going down), backward once
        self.fwd = self._side(self.f_fixed, self.f_link, self.f_mem, 2.0, None)
        self.bwd = self._side(self.b_fixed, self.b_link, self.b_mem, 1.0, self.cover)

    def _side(self, fixed, link_cap, mem_cap, mem_factor, cover) -> _Side:
        n = self.n
        mem_w = mem_factor * self.act
        lengths = np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None]
        starts, feasible = [np.zeros(0, dtype=np.int64)], [np.zeros((0, 1), dtype=bool)]
        for k in range(1, MAX_ENUMERATED + 1):
            # p + k <= n − 1: the ranges end before the last segment, which the fused stage holds
            p = np.arange(max(n - k, 0))
            p = p[fixed[p, p + k]] if p.size else p
            if p.size == 0:
                starts.append(p)
                feasible.append(np.zeros((0, 2 ** k), dtype=bool))
                continue
            # bit i of subset j is segment p + i: the link and memory a subset's saves take, the recompute it removes
            ok = (_subset_sums(self.act, k, p) <= link_cap[p, p + k][:, None])
            ok &= (_subset_sums(mem_w, k, p) <= mem_cap[p, p + k][:, None])
            if cover is not None:
                ok &= (_subset_sums(self.rec, k, p) >= cover[p, p + k][:, None])
            keep = ok.any(axis=1)
            starts.append(p[keep])
            feasible.append(ok[keep])
        lp, lq = np.nonzero(fixed & (lengths > MAX_ENUMERATED))
        # the saved bytes both its link and its memory allow (memory counts them mem_factor times)
        cap = np.minimum(link_cap[lp, lq], mem_cap[lp, lq] / mem_factor)
        return _Side(starts=starts, feasible=feasible, long_ranges=(lp, lq, cap))

    def _costs(self, side: _Side, price: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``cost[p, q] = 1 + min Σ price_i s_i`` over the range's feasible subsets, and a minimising ``s`` per
        range as a bit mask (long ranges: the negative prices)."""
        n = self.n
        cost = np.full((n + 1, n + 1), INF)
        mask = np.zeros((n + 1, n + 1), dtype=np.int64)
        for k in range(1, len(side.starts)):
            p = side.starts[k]
            if p.size == 0:
                continue
            val = np.where(side.feasible[k], _subset_sums(price, k, p), INF)
            best = np.argmin(val, axis=1)
            # one stage, plus the least price of a saved subset that lets it meet T; best is that subset's bit mask
            cost[p, p + k] = 1.0 + val[np.arange(p.size), best]
            mask[p, p + k] = best
        lp, lq, cap = side.long_ranges
        if lp.size:
            cost[lp, lq] = 1.0 + _fractional(price, self.act, lp, lq, cap)[0]
            # -1 marks a long range: its flags come from the fractional knapsack again in _saved
            mask[lp, lq] = -1
        return cost, mask

    def range_costs(self, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Priced range costs ``(forward, backward)`` at ``λ``: ``1 + min Σ ±λ_i s_i`` over each range's feasible
        saved subsets (``inf`` where none meets ``T``); the shortest paths over them make up ``L(λ)``."""
        return self._costs(self.fwd, lam)[0], self._costs(self.bwd, -lam)[0]

    def _saved(self, side: _Side, mask: np.ndarray, pred: np.ndarray, a: int, price: np.ndarray) -> np.ndarray:
        s = np.zeros(self.n)
        for p, q in _ranges(pred, a):
            bits = int(mask[p, q])
            if bits >= 0:
                s[p:q] = (bits >> np.arange(q - p)) & 1
                continue
            lp, lq, cap = side.long_ranges
            j = int(np.flatnonzero((lp == p) & (lq == q))[0])
            # fractional flags on a long range: the subgradient takes them as they are
            s[p:q] = _fractional(price, self.act, lp[j:j + 1], lq[j:j + 1], cap[j:j + 1])[1][0, : q - p]
        return s

    def value(self, lam: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """``L(λ)`` and the saved flags each side chose at a minimiser (``sF − sB`` is a subgradient)."""
        zero = np.zeros(self.n)
        if not self.ok:
            return INF, zero, zero
        cf, mf = self._costs(self.fwd, lam)
        cb, mb = self._costs(self.bwd, -lam)
        df, pf = _paths(cf)
        db, pb_ = _paths(cb)
        # both sides' paths meet at a fused start whose own stage meets T
        total = np.where(self.fused, df + db, INF)
        a = int(np.argmin(total))
        if not np.isfinite(total[a]):
            return INF, zero, zero
        rounding = 1e-9 * (self.n + float(np.abs(lam).sum()))  # the prices cancel in exact arithmetic only
        return (float(total[a]) - rounding, self._saved(self.fwd, mf, pf, a, lam),
                self._saved(self.bwd, mb, pb_, a, -lam))

    def maximise(self, target: float, iterations: int = 60,
                 lam: np.ndarray | None = None) -> tuple[float, np.ndarray, list[np.ndarray]]:
        """Subgradient ascent (Polyak steps towards ``target``); stops once ``L > target``. Returns the best
        ``L``, its ``λ`` (a warm start for a nearby ``T``) and the saved flags met along the way (for
        :meth:`plan_for`)."""
        lam = np.zeros(self.n) if lam is None else lam.copy()
        best, best_lam, theta, stale = -INF, lam.copy(), 1.0, 0
        seen: list[np.ndarray] = []
        self.evaluations = 0
        for _ in range(iterations):
            self.evaluations += 1
            val, s_f, s_b = self.value(lam)
            if not np.isfinite(val):
                return val, lam, []
            for flags in (s_f, s_b):
                if not any(np.array_equal(flags, x) for x in seen):
                    # the last _KEEP distinct flag vectors: plan_for repairs each into a plan
                    seen = (seen + [flags])[-_KEEP:]
            if val > best + 1e-12:
                best, best_lam, stale = val, lam.copy(), 0
            else:
                stale += 1
                if stale >= 4:
                    theta, stale = theta / 2, 0
            g = s_f - s_b
            norm = float(g @ g)
            if best > target or norm == 0:
                break  # proven, or the relaxed optimum agrees on every flag (L is a real staging's count)
            # Polyak step aimed at target + 1 (the caller's target is S − 1):
            # the next whole stage count is what proves the budget
            lam = lam + theta * (target + 1.0 - val) / norm * g
        return best, best_lam, seen

    def plan_for(self, saved: np.ndarray) -> SegmentPlan | None:
        """The plan with fewest stages meeting ``T`` once the saved flags are fixed (``P`` still relaxed, so the
        caller validates memory), or None."""
        if not self.ok:
            return None
        act, rec = _range_sums(self.act * saved), _range_sums(self.rec * saved)
        # saves counted twice in a forward stage's memory and once in a backward stage's, as in _side
        f_ok = self.f_fixed & (act <= self.f_link) & (2 * act <= self.f_mem)
        b_ok = self.b_fixed & (act <= self.b_link) & (act <= self.b_mem) & (rec >= self.cover)
        df, pf = _paths(np.where(f_ok, 1.0, INF))
        db, pb_ = _paths(np.where(b_ok, 1.0, INF))
        total = np.where(self.fused, df + db, INF)
        a = int(np.argmin(total))
        if not np.isfinite(total[a]):
            return None
        # the fused range saves nothing
        flags = tuple(bool(x) for x in saved[:a]) + (False,) * (self.n - a)
        return SegmentPlan(forward=tuple(sorted(_ranges(pf, a))), fused=(a, self.n),
                           backward=tuple(sorted(_ranges(pb_, a), reverse=True)), saved=flags)


def _fractional(price: np.ndarray, weight: np.ndarray, p: np.ndarray, q: np.ndarray,
                cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``min Σ price_i s_i`` over ``0 <= s <= 1`` on each range ``[p, q)`` with ``Σ weight_i s_i <= cap``
    (Dantzig's greedy, all ranges at once), and the minimisers padded to the longest range."""
    width = int((q - p).max())
    idx = p[:, None] + np.arange(width)[None, :]
    inside = idx < q[:, None]
    # indices past a range's end are clipped, and masked out by inside
    idx = np.minimum(idx, len(price) - 1)
    # only a segment with a negative price gains from being saved
    gain = np.where(inside, np.maximum(-price[idx], 0.0), 0.0)
    w = np.where(inside, weight[idx], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        # gain per byte, highest first: weightless gains before all, non-gains after all
        ratio = np.where(gain > 0, np.where(w > 0, gain / w, INF), -INF)
    order = np.argsort(-ratio, axis=1, kind="stable")
    g, ws = np.take_along_axis(gain, order, 1), np.take_along_axis(w, order, 1)
    # Dantzig's greedy: whole items in ratio order while they fit, the item that crosses cap in part
    before = np.cumsum(ws, axis=1) - ws  # weight taken ahead of each item
    room = np.maximum(cap[:, None] - before, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(g > 0, np.where(ws > 0, np.minimum(room / ws, 1.0), 1.0), 0.0)
    s = np.zeros_like(frac)
    np.put_along_axis(s, order, frac, 1)
    # the minimum is minus the gain taken
    return -(frac * g).sum(axis=1), s


def _range_sums(x: np.ndarray) -> np.ndarray:
    cum = np.concatenate([[0.0], np.cumsum(x)])
    return cum[None, :] - cum[:, None]


def _paths(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fewest-cost path from position 0 to every position (``cost[p, q]`` for the range ``[p, q)``)."""
    n1 = cost.shape[0]
    dist = np.full(n1, INF)
    pred = np.full(n1, -1)
    dist[0] = 0.0
    for q in range(1, n1):
        cand = dist[:q] + cost[:q, q]
        k = int(np.argmin(cand))
        dist[q], pred[q] = cand[k], k
    return dist, pred


def _ranges(pred: np.ndarray, a: int) -> list[tuple[int, int]]:
    out, q = [], a
    while q > 0:
        p = int(pred[q])
        out.append((p, q))
        q = p
    return out

