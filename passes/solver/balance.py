"""Exact min-max balance for every stage count: the engine of the ``dp`` strategy and of the ILP's bounds.

For a plan with ``S`` stages whose slowest stage takes ``T``, the iteration takes at most ``c(S)·T`` (the event
recurrence is monotone in every stage time; :func:`.recurrence.equal_time_factors`). Forward cuts, backward cuts and
the fused start are independent choices once the fused start is fixed, so with per-range stage times from
:class:`.tables.RangeTables`:

- ``F[k][p]``: least possible slowest stage among ``k`` forward stages covering ``[0, p)``
  (``F[k] = min_a max(F[k-1][a], t_fwd[a, ·])``, one vectorised step per ``k``); ``B[k][p]`` likewise backward;
- ``H[s][p] = min_{f+b=s} max(F[f][p], B[b][p])`` (a (min, max) convolution over stage counts);
- ``T*(S) = min_p max(H[S-1][p], t_fused[p])``.

That is ``O(n³)`` element operations in ``O(n)`` numpy calls: ~10 ms at n = 130. Memory couples stages through the
prefetch term ``P`` (largest stage weight): ranges are first allowed when they fit with ``P = their own W`` (a
relaxation); stage counts whose optimal plan breaks the real limit are redone for every cap on stage weights
(exact, rarely needed). Like torchgpipe's ``balance.blockpartition`` but over three coupled chains and with the
transfer and memory terms of the timing model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .problem import PartitionProblem, SegmentPlan
from .tables import INF, RangeTables
from .recurrence import equal_time_factors

__all__ = ["Balance", "BalanceTable", "balance_table", "bound_values", "exact_balance", "relaxed_balance",
           "relaxed_backward_time"]


def _chains(cost: np.ndarray, max_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """``best[k][p]`` (k stages covering ``[0, p)``) and the start of the last stage."""
    n1 = cost.shape[0]
    best = np.full((max_stages + 1, n1), INF)
    arg = np.zeros((max_stages + 1, n1), dtype=np.int64)
    # zero stages cover the empty prefix [0, 0), at no cost
    best[0, 0] = 0.0
    for k in range(1, max_stages + 1):
        # cand[a, p]: k − 1 stages over [0, a), then the stage [a, p)
        cand = np.maximum(best[k - 1][:, None], cost)
        arg[k] = np.argmin(cand, axis=0)
        best[k] = cand[arg[k], np.arange(n1)]
        # no prefix can be covered by k stages, so none by more: stop growing the table
        if not np.isfinite(best[k]).any():
            return best[:k], arg[:k]
    return best, arg


@dataclass(eq=False)
class BalanceTable:
    """``t_star[S]``: least slowest-stage time of a plan with exactly ``S`` stages (``inf``: none), and the plans."""

    n: int
    t_star: np.ndarray
    fwd_best: np.ndarray
    """``[k, p]``: least slowest stage of ``k`` forward stages covering ``[0, p)``."""
    bwd_best: np.ndarray
    """``[k, p]``: the same for backward stages."""
    _fwd_arg: np.ndarray = field(repr=False)
    _bwd_arg: np.ndarray = field(repr=False)
    _split: np.ndarray = field(repr=False)
    _fused_start: np.ndarray = field(repr=False)

    def forward_ranges(self, k: int, stop: int) -> list[tuple[int, int]]:
        """The min-max ``k`` forward stages covering ``[0, stop)``, ascending."""
        return list(reversed(_walk(self._fwd_arg, k, stop)))

    def plan(self, stages: int) -> SegmentPlan:
        """The min-max plan with exactly ``stages`` stages (nothing saved)."""
        a = int(self._fused_start[stages])
        # the forward stage count of the best split at S − 1 non-fused stages
        f = int(self._split[stages - 1, a])
        fwd = _walk(self._fwd_arg, f, a)
        bwd = _walk(self._bwd_arg, stages - 1 - f, a)
        return SegmentPlan(forward=tuple(reversed(fwd)), fused=(a, self.n), backward=tuple(bwd),
                           saved=(False,) * self.n)


def _walk(arg: np.ndarray, k: int, p: int) -> list[tuple[int, int]]:
    """Ranges of a k-stage chain ending at ``p``, from the top down."""
    out = []
    while k > 0:
        a = int(arg[k, p])
        out.append((a, p))
        k, p = k - 1, a
    return out


def balance_table(f_cost: np.ndarray, b_cost: np.ndarray, fused: np.ndarray) -> BalanceTable:
    """Min-max balance for every stage count given masked per-range stage times (``inf`` = not allowed)."""
    n = fused.shape[0] - 1
    # at most n − 1 stages per side: the last segment is always fused
    fwd, fwd_arg = _chains(f_cost, max(n - 1, 0))
    bwd, bwd_arg = _chains(b_cost, max(n - 1, 0))
    kf, kb = fwd.shape[0], bwd.shape[0]
    # h[s]: s = f + b non-fused stages
    h = np.full((kf + kb - 1, n + 1), INF)
    split = np.zeros(h.shape, dtype=np.int64)
    for f in range(kf):
        # max(F[f][p], B[b][p]) for every b at once
        cand = np.maximum(fwd[f][None, :], bwd)
        better = cand < h[f:f + kb]
        h[f:f + kb] = np.where(better, cand, h[f:f + kb])
        split[f:f + kb] = np.where(better, f, split[f:f + kb])
    # the fused stage starting at p counts in the slowest stage too
    total = np.maximum(h, fused[None, :])
    fused_start = np.argmin(total, axis=1)
    # H counts the non-fused stages: t_star[S] is row S − 1 (S = 0: no plan)
    t_star = np.concatenate([[INF], total[np.arange(h.shape[0]), fused_start]])
    return BalanceTable(n=n, t_star=t_star, fwd_best=fwd, bwd_best=bwd, _fwd_arg=fwd_arg, _bwd_arg=bwd_arg,
                        _split=split, _fused_start=np.concatenate([[0], fused_start]))


def _masked(t: RangeTables, b_time: np.ndarray, limit: int,
            cap: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage times with ranges that cannot fit set to ``inf``. ``cap=None``: each range with ``P = its own W``."""
    p = t.weight if cap is None else cap
    p_fused = t.fused_weight if cap is None else cap
    ok_w = t.weight <= (INF if cap is None else cap)
    f_cost = np.where(ok_w & (t.fwd_need + p <= limit), t.fwd_time, INF)
    b_cost = np.where(ok_w & (t.bwd_need + p <= limit), b_time, INF)
    ok_fused = (t.fused_weight <= (INF if cap is None else cap)) & (t.fused_need + p_fused <= limit)
    return f_cost, b_cost, np.where(ok_fused, t.fused_time, INF)


def _fits(pb: PartitionProblem, t: RangeTables, plan: SegmentPlan) -> bool:
    stages = [(a, b, t.fwd_need[a, b]) for a, b in plan.forward] + [(a, b, t.bwd_need[a, b]) for a, b in plan.backward]
    a0 = plan.fused[0]
    # the real P: the plan's largest stage weight, the fused stage's included
    p = max([t.weight[a, b] for a, b, _ in stages] + [t.fused_weight[a0]])
    return all(need + p <= pb.memory_bytes for *_, need in stages) and t.fused_need[a0] + p <= pb.memory_bytes


def _cover_bound(f_cost: np.ndarray, b_cost: np.ndarray, fused: np.ndarray) -> float:
    """A quick lower bound on any plan's slowest stage: every segment below the fused start lies in some
    forward and some backward range, so the plan is at least as slow as the cheapest such range."""
    def cheapest_cover(cost: np.ndarray) -> np.ndarray:
        tail = np.minimum.accumulate(cost[:, ::-1], axis=1)[:, ::-1]  # tail[a, j] = min_{b >= j} cost[a, b]
        cover = np.minimum.accumulate(tail[:, 1:], axis=0)  # cover[a', i] = min_{a <= a', b > i} cost[a, b]
        per_seg = np.diagonal(cover)  # segment i: ranges with a <= i < b
        # a fused start at p needs every segment below p covered: the worst segment's cheapest cover so far
        return np.concatenate([[0.0], np.maximum.accumulate(per_seg)])
    need = np.maximum(np.maximum(cheapest_cover(f_cost), cheapest_cover(b_cost)), fused)
    return float(need.min())


@dataclass(eq=False)
class Balance:
    """The exact answer under the real memory limit, kept only where it can matter (see :func:`exact_balance`)."""

    t_star: np.ndarray
    """``T*(S)`` for every stage count whose bound ``c(S)·T*(S)`` can reach the optimum; ``inf`` elsewhere."""
    lower: np.ndarray
    """A lower bound on ``T*(S)`` for every ``S``."""
    tables: list[BalanceTable]
    pick: np.ndarray

    def plan(self, stages: int) -> SegmentPlan:
        """A plan achieving ``t_star[stages]`` (which must be finite)."""
        return self.tables[int(self.pick[stages])].plan(stages)


def bound_values(c: np.ndarray, t_star: np.ndarray) -> np.ndarray:
    """``c(S)·T*(S)`` per stage count, ``inf`` where there is no plan (and for ``S = 0``)."""
    finite = np.isfinite(t_star)
    out = np.where(finite, c * np.where(finite, t_star, 0.0), INF)
    out[0] = INF
    return out


def _pad(x: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([x, np.full(max(size - len(x), 0), INF)])[:size]


def exact_balance(pb: PartitionProblem, t: RangeTables, b_time: np.ndarray | None = None, *,
                  every_count: bool = False) -> Balance:
    """Exact min-max balance per stage count under the real memory limit (see the module docstring).

    The memory-relaxed table is exact for every stage count whose plan fits. The others are re-solved for each
    cap ``P`` on stage weights (ranges with ``W <= P`` and ``need + P <= limit``) — only while their relaxed bound
    can still beat the best fitting plan, and skipping caps whose :func:`_cover_bound` cannot
    (``every_count=True``: for every stage count, e.g. for tests). ``b_time`` replaces the backward stage times.
    """
    b_time = t.bwd_time if b_time is None else b_time
    relaxed = balance_table(*_masked(t, b_time, pb.memory_bytes, None))
    # stage counts up to 2(n − 1) + 1
    size = 2 * pb.n + 1
    lower = _pad(relaxed.t_star, size)
    c = np.asarray(equal_time_factors(size - 1, pb.device_count, pb.microbatches), dtype=float)
    # a relaxed plan that fits the real limit is exact for its stage count
    fits = np.asarray([np.isfinite(lower[s]) and _fits(pb, t, relaxed.plan(s)) for s in range(size)])
    t_star = np.where(fits, lower, INF)
    tables, pick = [relaxed], np.zeros(size, dtype=np.int64)
    # best: the best c(S)·T*(S) among the counts already exact; every_count keeps every count open
    best = INF if every_count else float(np.min(bound_values(c, t_star)))
    # counts still open: their relaxed plan does not fit and their bound could still beat best
    open_ = [s for s in range(1, size) if not fits[s] and c[s] * lower[s] < best]
    # every stage weight a plan may have: its possible values of P (as tables.min_memory)
    caps = np.unique(np.concatenate([t.weight[t.valid], t.fused_weight[:-1]]))
    for cap in caps[caps >= t.min_weight()] if open_ else ():
        masked = _masked(t, b_time, pb.memory_bytes, float(cap))
        quick = _cover_bound(*masked)
        # a cap whose quick bound helps no open count is not worth a table
        if all(c[s] * max(quick, lower[s]) >= best for s in open_):
            continue
        table = balance_table(*masked)
        cand = _pad(table.t_star, size)
        better = cand < t_star
        t_star, pick = np.where(better, cand, t_star), np.where(better, len(tables), pick)
        tables.append(table)
        best = best if every_count else min(best, float(np.min(bound_values(c, t_star))))
        # a better best closes more counts
        open_ = [s for s in open_ if c[s] * lower[s] < best]
    return Balance(t_star=t_star, lower=lower, tables=tables, pick=pick)


def relaxed_balance(pb: PartitionProblem, t: RangeTables, b_time: np.ndarray) -> BalanceTable:
    """Like :func:`exact_balance` but with every range allowed whenever it fits with ``P = its own W``: a lower
    bound per stage count, in one pass."""
    return balance_table(*_masked(t, b_time, pb.memory_bytes, None))


def relaxed_backward_time(pb: PartitionProblem, t: RangeTables, cutoff: float) -> np.ndarray:
    """A lower bound on each backward range's time when the range may save any of its segments.

    Saving segment ``i`` trades ``rec_s[i]`` of compute for ``act_bytes[i]`` of upload; the best fractional choice
    (items by recompute saved per byte, Dantzig's greedy) bounds every integral one. Ignores the forward stages'
    download limit, so it is a relaxation of the joint problem. Ranges whose compute cannot fall to ``cutoff``
    are left ``inf``.
    """
    if not pb.allow_save:
        return t.bwd_time
    n, link, ovh, m = pb.n, pb.link_bytes_per_s, pb.stage_overhead_s, pb.microbatches
    rec, bwd = np.asarray(pb.rec_s), np.asarray(pb.bwd_s)
    act = np.asarray(pb.act_bytes, dtype=float) / link
    grad_in = np.where(np.arange(n + 1) > 0, t.in_bytes, 0)
    out = np.full((n + 1, n + 1), INF)
    for a in range(n):
        for b in range(a + 1, n):  # backward ranges stop before the last segment (it is always fused)
            floor = bwd[a:b].sum()
            # backward compute cannot be saved away, only recompute: longer ranges only add to it
            if ovh + floor > cutoff:
                break  # longer ranges only get slower
            up0 = (t.in_bytes[a] + t.out_bytes[b] + t.weight[a, b] / m) / link
            down = (grad_in[a] + t.grad[a, b] / m) / link
            # the link alone misses the cutoff: left inf
            if ovh + max(up0, down) <= cutoff:
                out[a, b] = ovh + max(_fractional(floor + rec[a:b].sum(), up0, rec[a:b], act[a:b]), down)
    return out


def _fractional(compute: float, upload: float, rec: np.ndarray, act: np.ndarray) -> float:
    """``min max(compute − Σ x·rec, upload + Σ x·act)`` over ``x ∈ [0, 1]^k``."""
    # saving a segment with no activation bytes costs no upload: always taken
    free = act <= 0
    compute -= rec[free].sum()
    # by recompute removed per second of upload added, best first
    order = np.argsort(-(rec[~free] / act[~free]), kind="stable")
    for r, a in zip(rec[~free][order], act[~free][order]):
        # upload-bound already: a further save only lengthens the upload
        if compute <= upload:
            break
        if compute - r >= upload + a:
            compute, upload = compute - r, upload + a
        else:
            # the share of this segment's save that makes compute and upload equal
            x = (compute - upload) / (r + a)
            return compute - x * r
    return max(compute, upload)
