"""Every contiguous stage range priced at once: the vectorised form of :func:`.timing.stage_costs`.

``RangeTables.build(problem)`` returns ``(n+1) × (n+1)`` arrays indexed ``[a, b]`` for the half-open range
``[a, b)`` (``a < b``; ``inf`` elsewhere) and length ``n+1`` arrays indexed by the fused stage's start. Times are
stage times with *nothing saved* (full recompute); ``need`` is a stage's memory without the prefetch term ``P``.
The solvers (:mod:`.balance`, :mod:`.ilp`) read these instead of re-deriving the cost model, and a hypothesis test
checks them against :func:`.timing.stage_costs`.

:func:`min_memory` finds the least device memory any plan needs. Stage memory is ``need + P`` with ``P`` the
largest stage weight of the plan, so for each cap ``P`` on stage weights it runs a min-max path search over the
ranges with ``W <= P``; caps are tried in increasing order and stop as soon as ``P + (best need at P = ∞)`` cannot
beat the incumbent (usually after one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .problem import PartitionProblem

__all__ = ["RangeTables", "min_memory", "min_feasible_memory", "minmax_path", "best_need"]

INF = float("inf")


def _prefix(values: tuple[float, ...] | tuple[int, ...], dtype: type) -> np.ndarray:
    # a leading 0, so that [a, b) sums to prefix[b] − prefix[a]
    return np.concatenate([[0], np.cumsum(np.asarray(values, dtype=dtype))]).astype(dtype)


def _range_sum(prefix: np.ndarray) -> np.ndarray:
    """``out[a, b] = prefix[b] − prefix[a]``."""
    return prefix[None, :] - prefix[:, None]


def _shared_matrix(pb: PartitionProblem, grads: bool) -> np.ndarray:
    """Bytes of shared parameters used by ``[a, b)``, each counted once."""
    n = pb.n
    out = np.zeros((n + 1, n + 1), dtype=np.int64)
    cols = np.arange(n + 1)
    for p in pb.shared:
        nxt = np.full(n + 1, n + 1)
        for a in range(n + 1):
            # nxt[a]: the first segment at or after a that reads p (n + 1: none); [a, b) reads p when b > nxt[a]
            later = [s for s in p.segments if s >= a]
            nxt[a] = later[0] if later else n + 1
        out += np.where(cols[None, :] > nxt[:, None], p.grad_bytes if grads else p.bytes, 0)
    return out


def _running_max(values: tuple[int, ...]) -> np.ndarray:
    n = len(values)
    out = np.zeros((n + 1, n + 1), dtype=np.int64)
    arr = np.asarray(values, dtype=np.int64)
    for a in range(n):
        # a stage's nodes run one at a time: the range holds the largest of its segments' figures, not their sum
        out[a, a + 1:] = np.maximum.accumulate(arr[a:])
    return out


@dataclass(frozen=True, eq=False)
class RangeTables:
    """Per-range costs of one problem (see the module docstring); arrays are read-only by convention."""

    n: int
    weight: np.ndarray
    """``W`` of ``[a, b)`` (bytes)."""
    grad: np.ndarray
    """``G`` of ``[a, b)`` (bytes)."""
    in_bytes: np.ndarray
    """Bytes entering a stage that starts at ``a`` over the link (length n+1; :meth:`PartitionProblem.link_in <rpcompile.passes.solver.problem.PartitionProblem.link_in>`:
    hand-offs that stay on one GPU's memory cross none)."""
    out_bytes: np.ndarray
    """Bytes leaving a stage that stops at ``b`` over the link (length n+1; ``out_bytes[0] = 0``;
    :meth:`PartitionProblem.link_out <rpcompile.passes.solver.problem.PartitionProblem.link_out>`)."""
    fwd_time: np.ndarray
    bwd_time: np.ndarray
    fused_time: np.ndarray
    fwd_need: np.ndarray
    bwd_need: np.ndarray
    fused_need: np.ndarray
    fused_weight: np.ndarray
    valid: np.ndarray
    """``a < b``."""

    @staticmethod
    def build(pb: PartitionProblem) -> "RangeTables":
        n, m, link, ovh = pb.n, pb.microbatches, pb.link_bytes_per_s, pb.stage_overhead_s
        valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
        w = _range_sum(_prefix(pb.param_bytes, np.int64)) + _shared_matrix(pb, False)
        held = _range_sum(_prefix(pb.derived_bytes, np.int64))  # dequantized weights: memory, not the link
        g = _range_sum(_prefix(pb.grad_bytes, np.int64)) + _shared_matrix(pb, True)
        fwd = _range_sum(_prefix(pb.fwd_s, np.float64))
        # nothing saved here: a backward stage recomputes every segment's forward
        bwd = _range_sum(_prefix(pb.bwd_s, np.float64)) + _range_sum(_prefix(pb.rec_s, np.float64))
        fb = _range_sum(_prefix(tuple(f + b for f, b in zip(pb.fwd_s, pb.bwd_s)), np.float64))
        act = _range_sum(_prefix(pb.act_bytes, np.int64))
        # device memory holds every boundary tensor; the link carries only what is not kept on the device
        in_mem = np.asarray([pb.in_bytes(a) for a in range(n + 1)], dtype=np.int64)  # in_bytes(n): unused
        # out_mem[b]: what is live across the cut after segment b − 1 (index 0 unused)
        out_mem = np.asarray([0] + list(pb.boundary_bytes), dtype=np.int64)
        inb = np.asarray([pb.link_in(a) for a in range(n + 1)], dtype=np.int64)
        outb = np.asarray([0] + [pb.link_out(b) for b in range(1, n + 1)], dtype=np.int64)
        grad_in = np.where(np.arange(n + 1) > 0, inb, 0)
        # a forward stage uploads its input every microbatch and its weights once per iteration (a 1/m share)
        up_f = inb[:, None] + w / m
        down_b = grad_in[:, None] + g / m
        f_time = ovh + np.maximum(fwd, np.maximum(up_f, outb[None, :]) / link)
        # a backward stage uploads its output's gradient and the input it
        # recomputes from, and downloads its input's gradient and weight gradients
        b_time = ovh + np.maximum(bwd, np.maximum(inb[:, None] + outb[None, :] + w / m, down_b) / link)
        # the fused stage always ends at the chain's end: only column n
        fused_time = ovh + np.maximum(fb[:, n], np.maximum(up_f[:, n], down_b[:, n]) / link)
        f_need = w + held + in_mem[:, None] + out_mem[None, :] + _running_max(pb.peak_bytes)
        # + the next microbatch's input, prefetched; + the largest backward transient of a node in the range
        b_need = w + held + g + (in_mem + inb)[:, None] + out_mem[None, :] + act + _running_max(pb.transient_bytes)

        def mask(x: np.ndarray, fill: float) -> np.ndarray:
            return np.where(valid, x, fill)

        # "infinite" for the int64 tables, small enough that adding a few of them cannot overflow
        big = np.iinfo(np.int64).max // 4
        return RangeTables(
            n=n, weight=mask(w, big), grad=mask(g, big), in_bytes=inb, out_bytes=outb, valid=valid,
            fwd_time=mask(f_time, INF), bwd_time=mask(b_time, INF),
            # a fused stage starting at n would be empty
            fused_time=np.where(np.arange(n + 1) < n, fused_time, INF),
            fwd_need=mask(f_need, big), bwd_need=mask(b_need, big),
            fused_need=np.where(np.arange(n + 1) < n, b_need[:, n] - inb, big),  # it prefetches nothing
            fused_weight=np.where(np.arange(n + 1) < n, w[:, n], big),
        )

    def heaviest_segment(self) -> int:
        """The segment whose one-segment stage needs the most memory (the usual culprit of "does not fit")."""
        n = self.n
        # the last segment is always in the fused stage, every other one in a forward and a backward stage
        single = [max(self.bwd_need[i, i + 1] if i < n - 1 else 0, self.fwd_need[i, i + 1] if i < n - 1 else 0,
                      self.fused_need[i] if i == n - 1 else 0) for i in range(n)]
        return int(np.argmax(single))

    def min_weight(self) -> int:
        """Least possible ``P``: every plan has a stage holding the heaviest single segment."""
        return int(max(self.weight[i, i + 1] for i in range(self.n)))


def minmax_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a DAG on positions ``0..n`` with arc costs ``cost[a, b]`` (``a < b``), the least possible largest arc
    on a path from 0 to each position, and the predecessor achieving it."""
    n1 = cost.shape[0]
    best = np.full(n1, INF)
    # -inf at the start: the empty path has no arc, so a path's first arc sets its running maximum
    best[0] = -INF
    pred = np.full(n1, -1)
    for b in range(1, n1):
        vals = np.maximum(best[:b], cost[:b, b])
        k = int(np.argmin(vals))
        best[b], pred[b] = vals[k], k
    return best, pred


def best_need(t: RangeTables, cap: float) -> float:
    """Least largest stage ``need`` over plans whose stage weights are all ``<= cap``."""
    fwd, _ = minmax_path(np.where(t.weight <= cap, t.fwd_need, INF))
    bwd, _ = minmax_path(np.where(t.weight <= cap, t.bwd_need, INF))
    fb = np.where(t.fused_weight <= cap, t.fused_need, INF)
    # a plan: forward path to the fused stage's start, backward path to the same start, then the fused stage
    return float(np.min(np.maximum(np.maximum(fwd, bwd), fb)))


def min_memory(t: RangeTables) -> tuple[int, int]:
    """``(bytes, segment)``: least ``memory_bytes`` any plan fits in (see module docstring)."""
    # every stage weight a plan may have: its possible values of P
    caps = np.unique(np.concatenate([t.weight[t.valid], t.fused_weight[:-1]]))
    # below the heaviest single segment no plan fits
    caps = caps[caps >= t.min_weight()]
    # floor: the least need with no cap, below the least need at any cap
    floor, best = best_need(t, INF), INF
    for cap in caps:
        # caps ascend and need is at least floor: no later cap beats best
        if cap + floor >= best:
            break
        best = min(best, cap + best_need(t, float(cap)))
    return int(best), t.heaviest_segment()


def min_feasible_memory(problem: PartitionProblem) -> tuple[int, int]:
    """The smallest ``memory_bytes`` for which some plan fits, and the segment that sets it.

    Usually the plan of single-segment stages; computed exactly over all plans by :func:`min_memory`. The segment
    returned is the most demanding single segment of the binding stage (name it in "does not fit" messages).
    """
    return min_memory(RangeTables.build(problem))
