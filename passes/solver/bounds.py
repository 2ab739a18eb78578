"""Lower bounds on the slowest stage of any plan with ``S`` stages when segments may be saved.

A plan with fused start ``a``, ``f`` forward and ``b`` backward stages, all within ``T`` (``T' = T − overhead``),
must satisfy, besides the per-side min-max bounds of :mod:`.balance`:

- *forward link*: the forward stages download the saved activations plus one boundary each:
  ``Σ_saved α + Fo(a, f) <= f·T'`` (``α = act_bytes / link``);
- *backward link*: the backward stages upload them again plus their inputs, incoming gradients and weights:
  ``Σ_saved α + Bo(a, b) <= b·T'``; their downloads ``Bd(a, b) <= b·T'``;
- *backward compute*: ``Σ_{i<a} (bwd + rec) − Σ_saved rec <= b·T'``.

``Fo``, ``Bo``, ``Bd`` use the smallest boundary below ``a`` for the unknown inner cuts. The best saved set for
these aggregates is a fractional knapsack (recompute removed per link second, Dantzig's greedy), so the least
feasible ``T'`` of each ``(a, f, b)`` is found by bisection on a monotone test, vectorised over all triples that
could still beat the incumbent. The bound per stage count is the least over its triples; it is what lets the ILP
skip stage budgets whose plans would need more link time than exists (the per-range relaxation cannot see that).
"""

from __future__ import annotations

import numpy as np

from .balance import BalanceTable
from .problem import PartitionProblem
from .tables import INF, RangeTables

__all__ = ["saving_bounds"]

_BISECT_STEPS = 48


class _Knapsack:
    """``R_a(σ)``: most recompute removable by saving segments below ``a`` within ``σ`` seconds of link."""

    def __init__(self, pb: PartitionProblem, alpha: np.ndarray) -> None:
        n, rec = pb.n, np.asarray(pb.rec_s)
        below = np.arange(n)[None, :] < np.arange(n + 1)[:, None]  # [a, i]: segment i lies below a
        paid = alpha > 0
        # recompute of segments with no activation bytes: removed at no link cost
        self.free = (below & ~paid[None, :]) @ rec
        # the paid segments by recompute removed per link second, best first (Dantzig's order)
        order = np.argsort(-np.where(paid, rec / np.where(paid, alpha, 1.0), 0.0), kind="stable")[: paid.sum()]
        mask = below[:, order]
        zeros = np.zeros((n + 1, 1))
        # R_a is piecewise linear: its breakpoints are the link time and recompute of the whole items taken so far
        self.cum_a = np.hstack([zeros, np.cumsum(mask * alpha[order], axis=1)])
        self.cum_r = np.hstack([zeros, np.cumsum(mask * rec[order], axis=1)])
        step_a, step_r = np.diff(self.cum_a, axis=1), np.diff(self.cum_r, axis=1)
        # each piece's slope; an item not below a adds a piece of zero width and no slope
        slope = np.where(step_a > 0, step_r / np.where(step_a > 0, step_a, 1.0), 0.0)
        self.slope = np.hstack([slope, zeros])
        self.total = self.cum_a[:, -1]
        # rows offset by a·big (more than any row's total) make one sorted array: a single searchsorted serves every a
        self.big = 2.0 * float(self.total.max()) + 1.0
        width = self.cum_a.shape[1]
        self.keys = (self.cum_a + np.arange(n + 1)[:, None] * self.big).ravel()
        self.width = width

    def __call__(self, a: np.ndarray, sigma: np.ndarray) -> np.ndarray:
        # the last breakpoint of row a at or below sigma
        pos = np.searchsorted(self.keys, sigma + a * self.big, side="right") - 1
        k = np.clip(pos - a * self.width, 0, self.width - 1)
        # the next breakpoint after a run of equal ones carries the slope of the next item saved
        k = np.minimum(k, self.width - 1)
        # along the piece past it: the item that crosses sigma taken in part
        return self.free[a] + self.cum_r[a, k] + self.slope[a, k] * (sigma - self.cum_a[a, k])


def _triples(fwd: np.ndarray, bwd: np.ndarray, fused: np.ndarray, max_stages: int, ovh: float,
             keep: np.ndarray) -> tuple[np.ndarray, ...]:
    """All ``(a, f, b)`` with finite per-side bounds, ``f + b + 1 <= max_stages`` and ``keep[f + b + 1]`` above
    the per-side bound (flat arrays in ``(f, b, a)`` order), plus that bound ``lo`` in ``T'`` units.

    One forward count at a time: a ``[b, a]`` slice holds what survives; the whole ``(f, b, a)`` grid at 128
    layers (~12 M triples, hundreds of MB) took 4.5 s to build and filter, and most of it never beats ``keep``."""
    kf = min(fwd.shape[0], max_stages)
    kb = min(bwd.shape[0], max_stages)
    counts = np.arange(1, kb)
    out: list[tuple[np.ndarray, ...]] = []
    for f in range(1, kf):
        b = counts[: max(0, min(kb - 1, max_stages - f - 1))]  # f + b + 1 <= max_stages
        if b.size == 0:
            break
        side = np.maximum(fwd[f], fused)  # [a]
        if not np.isfinite(side).any():
            continue
        lo = np.maximum(side[None, :], bwd[b]) - ovh  # [b, a]; max is exact, so the order of the maxima is free
        # keep[S]: the slowest stage a plan with S stages may have and still beat the incumbent
        cap = keep[np.minimum(f + b + 1, len(keep) - 1)]
        bi, ai = np.nonzero(np.isfinite(lo) & (lo + ovh < cap[:, None]))
        out.append((ai, np.full(ai.size, f, dtype=b.dtype), b[bi], np.maximum(lo[bi, ai], 0.0)))
    if not out:
        empty = np.zeros(0, dtype=counts.dtype)
        return empty, empty, empty, np.zeros(0)
    return tuple(np.concatenate(parts) for parts in zip(*out))


def saving_bounds(pb: PartitionProblem, t: RangeTables, relaxed: BalanceTable, c: np.ndarray,
                  incumbent: float) -> np.ndarray:
    """``LB[S]`` for every stage count ``S`` (length ``len(c)``); ``relaxed`` is the balance table over no-save
    forward times and relaxed backward times (:func:`.balance.relaxed_backward_time`), ``c`` the factors
    ``c(S)``, ``incumbent`` the best ``c(S)·T`` known (triples that cannot beat it keep their per-side bound)."""
    size, ovh = len(c), pb.stage_overhead_s
    lb = np.full(size, INF)
    # the per-side bound holds before any aggregate raises it
    base = relaxed.t_star[: size]
    lb[: len(base)] = base
    with np.errstate(divide="ignore", invalid="ignore"):
        # c(0) = 0 is the count no plan has: no cap there
        keep = np.where(c > 0, incumbent / c, INF)
    hopeful = np.flatnonzero(np.isfinite(lb) & (lb < keep))  # stage counts that might still beat the incumbent
    if hopeful.size == 0:
        return lb
    a, f, b, lo = _triples(relaxed.fwd_best, relaxed.bwd_best, _fused_times(pb, t), int(hopeful.max()), ovh, keep)
    if a.size == 0:
        return lb
    t_min = _least_time(pb, t, a, f, b, lo) + ovh
    best = np.full(size, INF)
    # the least over each stage count's triples
    np.minimum.at(best, f + b + 1, t_min)
    # triples left out could not beat the incumbent: they are at least keep[S]
    lb[2:] = np.maximum(lb[2:], np.minimum(best, keep)[2:])
    return lb


def _fused_times(pb: PartitionProblem, t: RangeTables) -> np.ndarray:
    fits = t.fused_need + t.fused_weight <= pb.memory_bytes
    return np.where(fits, t.fused_time, INF)


def _least_time(pb: PartitionProblem, t: RangeTables, a: np.ndarray, f: np.ndarray, b: np.ndarray,
                lo: np.ndarray) -> np.ndarray:
    """Least ``T'`` meeting the aggregate link and compute tests of each triple (bisection; valid bound)."""
    n, link, m = pb.n, pb.link_bytes_per_s, pb.microbatches
    alpha = np.asarray(pb.act_bytes, dtype=float) / link
    knap = _Knapsack(pb, alpha)
    work = np.concatenate([[0.0], np.cumsum(np.asarray(pb.bwd_s) + np.asarray(pb.rec_s))])
    out = t.out_bytes / link
    inner = np.full(n + 1, INF)  # smallest boundary strictly inside [0, a)
    for p in range(2, n + 1):
        inner[p] = min(inner[p - 1], out[p - 1])
    # a <= 1: no cut lies inside [0, a)
    inner_a = np.where(np.isfinite(inner[a]), inner[a], 0.0)
    # weights go up and gradients down once per iteration: a 1/m share per microbatch
    w_a = np.where(a > 0, t.weight[0, np.maximum(a, 1)], 0) / (m * link)
    g_a = np.where(a > 0, t.grad[0, np.maximum(a, 1)], 0) / (m * link)
    # the last forward stage's outputs at a, and at least the smallest inner boundary at each of the f − 1 other cuts
    fo = out[a] + (f - 1) * inner_a
    # weights, the model inputs and the output gradient at a, then
    # per inner cut an input to recompute from and an output gradient
    bo = w_a + (t.in_bytes[0] / link + out[a]) + 2 * (b - 1) * inner_a
    # weight gradients, and an input gradient at each inner cut (none below segment 0)
    bd = g_a + (b - 1) * inner_a
    need = work[a]

    def feasible(x: np.ndarray) -> np.ndarray:
        # link time both sides leave for saves, no more than saving every segment below a takes
        sigma = np.clip(np.minimum(f * x - fo, b * x - bo), 0.0, knap.total[a])
        # the compute test: backward stages within x, with the recompute the saves remove
        return (f * x >= fo) & (b * x >= bo) & (b * x >= bd) & (b * x + knap(a, sigma) >= need)

    # feasible by construction; the margins keep it so through float rounding
    hi = np.maximum.reduce([lo, need / b, fo / f, bo / b, bd / b]) * (1 + 1e-12) + 1e-15
    # the per-side bound already passes every aggregate test: nothing to raise
    done = feasible(lo)
    low = lo.copy()
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (low + hi)
        ok = feasible(mid)
        hi, low = np.where(ok, mid, hi), np.where(ok, low, mid)
    return np.where(done, lo, low)
