"""Joint partition and checkpointing as a CP-SAT model (OR-Tools), one model per stage budget.

- *stage budget* ``S``: the most stages a plan may have; :func:`solve_budget` builds and solves the model of one
  budget, which minimises ``T`` over the plans within it;
- ``T``: the slowest stage minus the per-stage overhead, in integer time units (:data:`TIME_UNITS` per upper
  bound);
- *range*: a half-open segment range ``[a, b)``, a candidate forward, backward or fused stage.

:func:`~rpcompile.passes.solver.partition.ilp` walks the budgets and re-scores every plan met with the exact
:func:`.timing.iteration_time`. What is optimised, the variables, the constraint families (each in its own
``_add_*`` helper) and the search's determinism: :func:`solve_budget`; a Ctrl-C during a solve: :func:`_solve`.
"""

from __future__ import annotations

import math
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .problem import PartitionProblem, SegmentPlan
from .tables import RangeTables

if TYPE_CHECKING:  # imported by solve_budget, the only place that builds a model (see there)
    from ortools.sat.python import cp_model

__all__ = ["BudgetResult", "solve_budget", "TIME_UNITS"]

#: Integer time units per upper bound ``T`` (rounding error below 1e-7·T per term). Larger scales made CP-SAT 9.15
#: claim wrong optima on small models (coefficients near 1e11 in its LP), so keep it modest.
TIME_UNITS = 10**7


@dataclass(eq=False)
class _Model:
    cp: cp_model.CpModel
    T: cp_model.IntVar
    xf: dict[tuple[int, int], cp_model.IntVar]
    xb: dict[tuple[int, int], cp_model.IntVar]
    z: dict[int, cp_model.IntVar]
    s: dict[int, cp_model.IntVar]
    unit: float
    """Seconds per integer time unit."""
    t_range: tuple[int, int] = (0, 0)
    """Domain of ``T``."""


@dataclass(frozen=True)
class BudgetResult:
    """Outcome of one stage budget."""

    stages: int
    status: str
    plan: SegmentPlan | None
    bound_s: float
    """Proven lower bound on the slowest stage of any plan within the budget (seconds, overhead included)."""
    det_time: float
    """CP-SAT deterministic time spent."""
    variables: int = 0
    """Booleans in the model (ranges, fused starts, saved flags)."""


def _floor(x: float, unit: float) -> int:
    return math.floor(x / unit)


def _ceil(x: float, unit: float) -> int:
    return math.ceil(x / unit)


def _candidate_ranges(pb: PartitionProblem, t: RangeTables, b_relaxed: np.ndarray,
                      ub: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]]:
    """Ranges that can meet ``ub`` and fit memory with ``P = their own weight`` (a relaxation)."""
    # relative: a range exactly at ub must survive float noise in the tables
    tol = ub * 1e-12
    # P is at least a used range's own W, so need + W is what the range needs at the least
    fits_f = t.fwd_need + t.weight <= pb.memory_bytes
    fits_b = t.bwd_need + t.weight <= pb.memory_bytes
    n = pb.n
    # b < n: the fused stage always holds the last segment, so no forward or backward range reaches it
    fwd = [(int(a), int(b)) for a, b in np.argwhere((t.fwd_time <= ub + tol) & fits_f) if b < n]
    bwd = [(int(a), int(b)) for a, b in np.argwhere((b_relaxed <= ub + tol) & fits_b) if b < n]
    fused = [a for a in range(n) if t.fused_time[a] <= ub + tol
             and t.fused_need[a] + t.fused_weight[a] <= pb.memory_bytes]
    return fwd, bwd, fused


def _add_variables(pb: PartitionProblem, ranges: tuple[list, list, list], ub: float, lb: float,
                   unit: float, cp: cp_model.CpModel) -> _Model:
    fwd, bwd, fused = ranges
    ovh = pb.stage_overhead_s
    # T leaves out the per-stage overhead; the bounds rounded outwards so that the domain keeps the optimum
    t_range = (max(0, _floor(lb - ovh, unit)), max(0, _ceil(ub - ovh, unit)))
    T = cp.new_int_var(*t_range, "T")
    xf = {r: cp.new_bool_var(f"xf_{r[0]}_{r[1]}") for r in fwd}
    xb = {r: cp.new_bool_var(f"xb_{r[0]}_{r[1]}") for r in bwd}
    z = {a: cp.new_bool_var(f"z_{a}") for a in fused}
    # segments from the last possible fused start on are always in the fused stage, which saves nothing
    last = max(fused, default=0)
    s = {i: cp.new_bool_var(f"s_{i}") for i in range(last)} if pb.allow_save else {}
    return _Model(cp=cp, T=T, xf=xf, xb=xb, z=z, s=s, unit=unit, t_range=t_range)


def _add_flow_constraints(pb: PartitionProblem, md: _Model) -> None:
    """Forward ranges: a path 0 → fused start; backward ranges: the same positions, walked down."""
    for x in (md.xf, md.xb):
        out_of: dict[int, list[cp_model.IntVar]] = {p: [] for p in range(pb.n + 1)}
        into: dict[int, list[cp_model.IntVar]] = {p: [] for p in range(pb.n + 1)}
        for (a, b), v in x.items():
            out_of[a].append(v)
            into[b].append(v)
        # position 0 is left by one forward (backward) range or is the fused start
        md.cp.add(sum(out_of[0]) + md.z.get(0, 0) == 1)
        for p in range(1, pb.n):
            # a range that ends at p is followed by one that starts there, unless the fused stage starts at p
            md.cp.add(sum(into[p]) == sum(out_of[p]) + md.z.get(p, 0))
    # the one fused start ends both paths
    md.cp.add_exactly_one(md.z.values())


def _add_budget_constraint(md: _Model, stages: int) -> None:
    # + 1: the fused stage
    md.cp.add(sum(md.xf.values()) + sum(md.xb.values()) + 1 <= stages)


def _covered(md: _Model, i: int) -> list:
    """Literals that put segment ``i`` inside the fused stage."""
    return [v for a, v in md.z.items() if a <= i]


def _add_saved_constraints(md: _Model) -> None:
    for i, v in md.s.items():
        # a saved flag is off when a fused start at or below segment i is chosen
        md.cp.add(v + sum(_covered(md, i)) <= 1)


def _add_time_constraints(pb: PartitionProblem, t: RangeTables, md: _Model) -> None:
    """compute, upload and download of every used stage fit in ``T`` (overhead excluded)."""
    u, link, m, ovh = md.unit, pb.link_bytes_per_s, pb.microbatches, pb.stage_overhead_s
    # link time of saved activations rounded down, recompute rounded up where it is
    # subtracted: the model's T never overstates a plan, so its bound is valid in seconds
    act_lo = [_floor(x / link, u) for x in pb.act_bytes]
    rec_hi = [_ceil(x, u) for x in pb.rec_s]
    # before segment 0 no input gradient is priced, as in RangeTables.build
    grad_in = lambda a: t.in_bytes[a] if a > 0 else 0  # noqa: E731
    for (a, b), x in md.xf.items():
        # a forward stage's compute and upload do not depend on its saves
        fixed = max(sum(pb.fwd_s[a:b]), (t.in_bytes[a] + t.weight[a, b] / m) / link)
        md.cp.add(md.T >= _floor(fixed, u) * x)
        saves = [(act_lo[i], md.s[i]) for i in range(a, b) if i in md.s]
        # its saves go down beside its outputs, on the same link
        down = _floor(t.out_bytes[b] / link, u)
        if saves:
            md.cp.add(sum(c * v for c, v in saves) + down <= md.T).only_enforce_if(x)
        else:
            # no saves: the same row, linear without an enforcement literal
            md.cp.add(md.T >= down * x)
    for (a, b), x in md.xb.items():
        down = (grad_in(a) + t.grad[a, b] / m) / link
        up = (t.in_bytes[a] + t.out_bytes[b] + t.weight[a, b] / m) / link
        full = sum(pb.bwd_s[a:b]) + sum(pb.rec_s[a:b])
        md.cp.add(md.T >= _floor(down, u) * x)
        idx = [i for i in range(a, b) if i in md.s]
        if idx:
            # each saved segment removes its recompute from the backward
            # stage's compute and adds its activations to its upload
            md.cp.add(_floor(full, u) - sum(rec_hi[i] * md.s[i] for i in idx) <= md.T).only_enforce_if(x)
            md.cp.add(_floor(up, u) + sum(act_lo[i] * md.s[i] for i in idx) <= md.T).only_enforce_if(x)
        else:
            md.cp.add(md.T >= _floor(max(full, up), u) * x)
    for a, x in md.z.items():
        # fused_time includes the overhead that T leaves out
        md.cp.add(md.T >= _floor(t.fused_time[a] - ovh, u) * x)


def _add_memory_constraints(pb: PartitionProblem, t: RangeTables, md: _Model) -> None:
    """``P >= W`` of each used stage, ``need + P <= memory``; skipped when no choice can break the limit."""
    # saved activations take room: a forward stage holds the ones it is producing and the previous microbatch's
    # being copied out (2 × act_i), a backward stage the next microbatch's, prefetched (act_i)
    saves = lambda r, k: [(k * pb.act_bytes[i], md.s[i]) for i in range(*r) if i in md.s and pb.act_bytes[i]]  # noqa: E731
    items = ([(t.weight[r], t.fwd_need[r], v, saves(r, 2)) for r, v in md.xf.items()]
             + [(t.weight[r], t.bwd_need[r], v, saves(r, 1)) for r, v in md.xb.items()]
             + [(t.fused_weight[a], t.fused_need[a], v, []) for a, v in md.z.items()])
    if not items:
        return
    # every plan holds the heaviest single segment in some stage: P is never below p_min
    p_min, p_max = t.min_weight(), max(int(w) for w, _, _, _ in items)
    worst = lambda need, sv: need + sum(b for b, _ in sv) + p_max  # noqa: E731
    # nothing can break the limit even at the largest P with every save: no P variable needed
    if all(worst(need, sv) <= pb.memory_bytes for _, need, _, sv in items):
        return
    P = md.cp.new_int_var(p_min, max(p_min, p_max), "P")
    for w, need, v, sv in items:
        # a W at or below p_min is implied by P's domain
        if w > p_min:
            md.cp.add(P >= int(w) * v)
        # this range fits at the largest P with all its saves: no row for it
        if worst(need, sv) <= pb.memory_bytes:
            continue
        if sv:
            md.cp.add(P + int(need) + sum(int(b) * s for b, s in sv) <= pb.memory_bytes).only_enforce_if(v)
        else:
            # with v = 0 this reads P <= memory, which P's domain keeps (every candidate's W fits: _candidate_ranges)
            md.cp.add(P + int(need) * v <= pb.memory_bytes)


def _mccormick_upper(md: _Model, count: cp_model.LinearExprT, lo_n: int, hi_n: int) -> list:
    """Two linear over-estimators of ``count·T`` (McCormick; exact at the bounds of either factor)."""
    t_lo, t_hi = md.t_range
    return [count * t_hi + lo_n * md.T - lo_n * t_hi, hi_n * md.T + count * t_lo - hi_n * t_lo]


def _add_aggregate_cuts(pb: PartitionProblem, t: RangeTables, md: _Model, stages: int) -> None:
    """Redundant sums over all stages of a side: compute and link time fit in ``count·T`` (see :mod:`.bounds`).

    ``count·T`` is bilinear; it is replaced by its McCormick over-estimators, tight because ``T``'s domain is
    narrow (between the lower bound and the incumbent)."""
    u, link, m = md.unit, pb.link_bytes_per_s, pb.microbatches
    n_f, n_b = sum(md.xf.values()), sum(md.xb.values())
    cover = {i: sum(_covered(md, i)) for i in range(pb.n)}  # 1 when segment i is in the fused stage
    below = lambda per_seg: [(per_seg(i), cover[i]) for i in range(pb.n)]  # noqa: E731
    alpha = [_floor(x / link, u) for x in pb.act_bytes]
    saved = sum(alpha[i] * v for i, v in md.s.items())
    # compute of the segments outside the fused stage, which the forward (backward) stages share
    fwd_work = sum(_floor(c, u) * (1 - z) for c, z in below(lambda i: pb.fwd_s[i]) if c)
    bwd_work = sum(_floor(c, u) * (1 - z) for c, z in below(lambda i: pb.bwd_s[i] + pb.rec_s[i]) if c)
    # a saved segment is not recomputed (rounded up, as subtracted)
    bwd_work -= sum(_ceil(pb.rec_s[i], u) * v for i, v in md.s.items())
    f_link = saved + sum(_floor(t.out_bytes[b] / link, u) * x for (a, b), x in md.xf.items())
    b_up = saved + sum(_floor((t.in_bytes[a] + t.out_bytes[b] + t.weight[a, b] / m) / link, u) * x
                       for (a, b), x in md.xb.items())
    # each side has at most S − 1 stages beside the fused one
    hi = stages - 1
    for count, lhs_all in ((n_f, (fwd_work, f_link)), (n_b, (bwd_work, b_up))):
        for over in _mccormick_upper(md, count, 0, hi):
            for lhs in lhs_all:
                md.cp.add(lhs <= over)


def _hint(md: _Model, plan: SegmentPlan) -> None:
    used_f, used_b = set(plan.forward), set(plan.backward)
    for r, v in md.xf.items():
        md.cp.add_hint(v, r in used_f)
    for r, v in md.xb.items():
        md.cp.add_hint(v, r in used_b)
    for a, v in md.z.items():
        md.cp.add_hint(v, a == plan.fused[0])
    for i, v in md.s.items():
        md.cp.add_hint(v, plan.saved[i])


def _hint_fits(md: _Model, plan: SegmentPlan) -> bool:
    # a hint that uses a range pruned from this model (or saves a
    # segment without a flag) cannot be expressed: hint nothing
    return (all(r in md.xf for r in plan.forward) and all(r in md.xb for r in plan.backward)
            and plan.fused[0] in md.z and all(i in md.s for i, s in enumerate(plan.saved) if s))


def _decode(pb: PartitionProblem, md: _Model, solver: cp_model.CpSolver) -> SegmentPlan:
    fwd = sorted(r for r, v in md.xf.items() if solver.value(v))
    bwd = sorted((r for r, v in md.xb.items() if solver.value(v)), reverse=True)
    a = next(a for a, v in md.z.items() if solver.value(v))
    saved = tuple(bool(solver.value(md.s[i])) if i in md.s else False for i in range(pb.n))
    return SegmentPlan(forward=tuple(fwd), fused=(a, pb.n), backward=tuple(bwd), saved=saved)


def solve_budget(pb: PartitionProblem, t: RangeTables, b_relaxed: np.ndarray, stages: int, *, ub: float,
                 lb: float = 0.0, hint: SegmentPlan | None = None, det_time: float = 5.0, wall_time: float = 60.0,
                 seed: int = 0, workers: int = 1) -> BudgetResult:
    """Least slowest-stage time over plans with at most ``stages`` stages, if one is at most ``ub`` seconds.

    ``b_relaxed`` (from :func:`.balance.relaxed_backward_time`) prunes backward ranges that cannot meet ``ub``
    even when saving; ``lb`` is a known lower bound on the answer.

    **What is optimised.** A plan with ``S`` stages whose slowest stage takes ``T`` finishes an iteration within
    ``c(S)·T`` (:func:`.recurrence.equal_time_factors`; docs/architecture.md §3: about ``(⌈S/N⌉·m + N − 1)·T``), so
    finer stages shrink the fill/drain bubble while per-stage transfers and overheads push back. For a *stage
    budget* ``S`` the model minimises ``T`` over plans with at most ``S`` stages;
    :func:`~rpcompile.passes.solver.partition.ilp` walks budgets in order of their lower bound ``c(S)·LB(S)`` and
    stops when none can beat the incumbent. Enumerating budgets keeps every model linear (the product ``c(S)·T``
    never appears) and lets each one start from a strong hint.

    **Variables** (per budget; ranges are half-open segment ranges, kept only if they can meet the current ``T``
    upper bound and fit memory):

    - ``xf[a, b]``, ``xb[a, b]``: forward / backward stage ``[a, b)`` is used; ``z[a]``: the fused stage is
      ``[a, n)``;
    - ``s[i]``: segment ``i`` is saved to host in forward (else recomputed in backward) — Checkmate's choice
      (Jain et al., MLSys 2020) at segment grain, under RoundPipe's round-robin execution (arXiv 2604.27085);
    - ``T``: the slowest stage minus the per-stage overhead, in integer time units; ``P``: the prefetch bytes.

    **Constraint families** (each in its own ``_add_*`` helper):

    - *flow*: forward ranges form a path from 0 to the fused start, backward ranges another; one fused start;
    - *budget*: ``Σ xf + Σ xb + 1 <= S``;
    - *saved*: no saving inside the fused range (or anywhere when ``allow_save=False``);
    - *time*: per used range, compute, upload and download each ``<= T`` (saving moves a segment's activations
      onto the forward download and backward upload and removes its recompute from the backward compute);
    - *memory*: ``P >= W`` of every used range and ``need + P <= memory`` (exact bytes; saved activations add to
      the need: twice on a forward range, which produces one microbatch's while the last one's go down, once on a
      backward range, which prefetches the next microbatch's);
    - *aggregate cuts*: per side, total compute and link time ``<= count·T`` (McCormick-linearised), redundant
      sums that tighten the relaxation (:mod:`.bounds` derives the same sums as a fast lower bound).

    Time constants are scaled to integers (``TIME_UNITS`` per upper bound) with lower-bound-safe rounding
    (constants down, subtracted terms up), so the proven bound is valid in seconds; plans are re-scored with the
    exact float model (:mod:`.partition` keeps every plan met and returns the best by
    :func:`.timing.iteration_time`, which can be well below ``c(S)·T`` when stages are unequal, e.g. around a slow
    LM-head stage). Search is deterministic: one worker, a fixed seed and a ``max_deterministic_time`` budget;
    ``workers > 1`` switches to CP-SAT's deterministic ``interleave_search``.
    """
    # Lazy: OR-Tools (and the pandas it imports) takes ~0.2 s to import on the 2-core reference machine, and many
    # runs never build a model — `rpcompile check` without a re-solve, and plans whose Lagrangian bounds close the
    # gap first (llama-8b on 8 GPUs).
    from ortools.sat.python import cp_model

    # TIME_UNITS per upper bound (max: a zero ub still needs a unit)
    unit = max(ub, 1e-12) / TIME_UNITS
    ranges = _candidate_ranges(pb, t, b_relaxed, ub)
    # no fused stage meets ub and fits: infeasible without a model
    if not ranges[2]:
        return BudgetResult(stages=stages, status="INFEASIBLE", plan=None, bound_s=ub, det_time=0.0)
    md = _add_variables(pb, ranges, ub, lb, unit, cp_model.CpModel())
    _add_flow_constraints(pb, md)
    _add_budget_constraint(md, stages)
    _add_saved_constraints(md)
    _add_time_constraints(pb, t, md)
    _add_memory_constraints(pb, t, md)
    _add_aggregate_cuts(pb, t, md, stages)
    md.cp.minimize(md.T)
    if hint is not None and _hint_fits(md, hint):
        _hint(md, hint)
    solver = cp_model.CpSolver()
    prm = solver.parameters
    # one worker by default: on 2 cores it found better plans per second than two interleaved workers
    prm.random_seed, prm.num_workers = seed, workers
    prm.interleave_search = workers > 1  # deterministic whatever the thread timing
    prm.interleave_batch_size = 2 * workers  # small batches keep max_deterministic_time honest
    prm.max_deterministic_time, prm.max_time_in_seconds = det_time, wall_time
    status = _solve(solver, md.cp)
    name = solver.status_name(status)
    nvars = len(md.xf) + len(md.xb) + len(md.z) + len(md.s)
    dt = solver.response_proto.deterministic_time
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        plan = _decode(pb, md, solver)
        # one unit below CP-SAT's bound: a margin over the rounding of the scaled constants
        bound = pb.stage_overhead_s + max(solver.best_objective_bound - 1, 0) * unit
        # the caller's lower bound may be the stronger
        return BudgetResult(stages=stages, status=name, plan=plan, bound_s=max(bound, lb), det_time=dt,
                            variables=nvars)
    if status == cp_model.INFEASIBLE:
        # no plan within the budget is as fast as ub: ub itself is a lower bound
        return BudgetResult(stages=stages, status=name, plan=None, bound_s=ub, det_time=dt, variables=nvars)
    # stopped by a limit with nothing proven: only the caller's lower bound holds
    return BudgetResult(stages=stages, status=name, plan=None, bound_s=lb, det_time=dt, variables=nvars)



def _solve(solver: cp_model.CpSolver, model: cp_model.CpModel) -> Any:
    """``solver.solve(model)``, the process's SIGINT handling left as found and a Ctrl-C during the solve raised as
    ``KeyboardInterrupt`` like anywhere else.

    CP-SAT's own SIGINT handling, on by default, leaves SIGINT at the default action after ``Solve()`` — the next
    Ctrl-C would kill the process with no ``KeyboardInterrupt`` and no ``finally`` — and swallows a Ctrl-C during
    the solve as if its time limit had come. So it (``catch_sigint_signal``) is off; on the main thread — the only
    one Python delivers signals to — the solve runs on a helper thread (CP-SAT releases the GIL) while this one
    waits, interruptibly: a Ctrl-C stops the search (``stop_search``), waits for the helper to return and is
    raised; a second Ctrl-C meanwhile leaves at once. The handler found is put back afterwards in any case, so no
    native code run by the solve can leave another one behind."""
    solver.parameters.catch_sigint_signal = False
    if threading.current_thread() is not threading.main_thread():
        return solver.solve(model)
    found = signal.getsignal(signal.SIGINT)
    answer: list[tuple[bool, Any]] = []
    done = threading.Event()  # not Thread.join: a join interrupted by Ctrl-C may take a running thread for ended

    def run() -> None:
        try:
            answer.append((True, solver.solve(model)))
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            answer.append((False, e))
        finally:
            done.set()

    helper = threading.Thread(target=run, name="rpcompile-cpsat", daemon=True)
    try:
        try:
            helper.start()
            done.wait()
        except KeyboardInterrupt:
            solver.stop_search()
            if helper.ident is not None:
                done.wait()  # returns at once: the search stops at its next check
            raise
    finally:
        if found is not None:  # None: a handler not installed from Python, which Python cannot put back
            signal.signal(signal.SIGINT, found)
    ok, value = answer[0]
    if not ok:
        raise value
    return value
