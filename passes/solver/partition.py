"""Partition strategies behind one front door: ``solve(problem, strategy)`` → :class:`.problem.PartitionResult`.

Strategies (all ``(problem, *, time_limit_s, seed) -> PartitionResult``, infeasible is a result):

- ``ilp``: :func:`ilp` below — CP-SAT over cuts, stage count and per-segment saving (:mod:`.ilp`);
- ``dp``: exact pure balance, nothing saved (:mod:`.balance`);
- ``roundpipe``: RoundPipe's greedy at layer granularity (arXiv 2604.27085, docs/architecture.md §4);
- ``uniform``: ``N`` equal layer groups, the static-pipeline baseline;
- ``greedy``: the ILP's preparation without CP-SAT (:func:`greedy`).

The ILP search's seven steps, its ``stats`` (``bound_s``, ``gap``, ``objective_gap``) and why the same input
gives the same plan: :func:`ilp`.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ...core.errors import ConfigError
from .balance import balance_table, bound_values, exact_balance, relaxed_backward_time, relaxed_balance
from .bounds import saving_bounds
from .baselines import dp, dp_of_balance, infeasible_result, make_result, roundpipe, uniform
from .greedy import greedy_plan, masks_for
from .ilp import solve_budget
from .exact import fewest_stages
from .lagrange import StageCountBound
from .polish import flip_saves, polish, taper
from .problem import PartitionProblem, PartitionResult, SegmentPlan
from .recurrence import equal_time_factors
from .scorer import PlanScorer
from .segment_rules import validate_segment_plan
from .stay_search import choose_stays
from .tables import RangeTables, min_memory
from .timing import iteration_time, stage_costs

__all__ = ["solve", "ilp", "greedy", "STRATEGIES", "DET_TIME_PER_S"]

#: CP-SAT deterministic-time units granted per second of ``time_limit_s`` (calibrated on a 2-core machine).
DET_TIME_PER_S = 0.3
#: Stage budgets the greedy heuristic tries before CP-SAT starts.
GREEDY_BUDGETS = 12
#: Smallest CP-SAT solve worth building a model for (deterministic seconds).
MIN_SOLVE_DET = 0.3
#: Candidate plans the exact-time local search that finishes every ILP solve may score (:mod:`.polish`).
POLISH_EVALUATIONS = 3000
#: Plans the local search starts from: the fastest gets ``POLISH_EVALUATIONS``, the others a share of it.
POLISH_STARTS = 5
#: Lagrangian evaluations (:mod:`.lagrange`, ~1–5 ms each) granted per second of ``time_limit_s``.
LAGRANGE_EVALUATIONS_PER_S = 100
#: Subgradient steps per stage-count proof, and bisection steps per budget.
LAGRANGE_ITERATIONS, LAGRANGE_BISECTIONS = 30, 6
#: Work (dominance comparisons, ~1.5 M/s) the exact fewest-stage search (:mod:`.exact`) may spend per second of
#: ``time_limit_s``, and per call.
EXACT_WORK_PER_S, EXACT_WORK_PER_CALL = 200_000, 1_000_000
#: CP-SAT starts no solve once every budget's bound is within this fraction of the incumbent (the stats still
#: report the proven gap; ``status`` is ``OPTIMAL`` only when it is closed).
CPSAT_GAP = 1e-3
#: Share of ``time_limit_s`` after which the greedy phase tries no new budget (a guard: on an idle machine the
#: count ``GREEDY_BUDGETS`` stops it first up to ~100 segments; a 128-layer model's twelve greedy plans take longer).
GREEDY_WALL_SHARE = 0.4
#: Share of ``time_limit_s`` after which the Lagrangian phase starts no new budget or bisection step (a guard;
#: counts stop it).
LAGRANGE_WALL_SHARE = 0.7
#: Share of ``time_limit_s`` after which no new CP-SAT solve starts (the rest is for the final local search).
WALL_SHARE = 0.85
#: Share of ``time_limit_s`` after which the final local search stops where it is (a guard; counts stop it).
FINISH_WALL_SHARE = 1.0
#: Rounds of the winner's checkpointing flips, each followed by cut moves, while a round changes the plan: the cuts
#: that settle after flips can make other flips pay (llama-8b overlapped on 8 GPUs: a second round 0.7% faster).
FLIP_ROUNDS = 4


class _Pool:
    """Every plan met so far, with its slowest stage, indexed by stage count."""

    def __init__(self, pb: PartitionProblem, size: int) -> None:
        self.pb = pb
        self.plans: dict[SegmentPlan, float] = {}  # plan -> its slowest stage (s)
        self.best_t = np.full(size, np.inf)
        self.best_plan: dict[int, SegmentPlan] = {}
        # indexed by stage count, 0 .. 2n
        self.c = np.asarray(equal_time_factors(size - 1, pb.device_count, pb.microbatches), dtype=float)

    def add(self, plan: SegmentPlan | None) -> None:
        """Keep ``plan`` if it is new and valid (heuristic plans may break the memory limit)."""
        if plan is None or plan in self.plans or validate_segment_plan(self.pb, plan):
            return
        t = max(c.time_s for c in stage_costs(self.pb, plan, lazy_offload=False))  # the solvers' c(S)·T model
        self.plans[plan] = t
        s = plan.stage_count
        if t < self.best_t[s]:
            self.best_t[s], self.best_plan[s] = t, plan

    def incumbent(self) -> float:
        """Least ``c(S)·T`` over the plans met."""
        return float(np.min(bound_values(self.c, self.best_t)))

    def hint(self, stages: int) -> tuple[float, SegmentPlan | None]:
        """The fastest known plan with at most ``stages`` stages."""
        s = int(np.argmin(self.best_t[: stages + 1]))
        return float(self.best_t[s]), self.best_plan.get(s)


def _seed(pb: PartitionProblem, pool: _Pool, tables: RangeTables,
          baselines: dict[str, PartitionResult] | None = None) -> dict[str, float]:
    """Baselines and the no-save DP's plans near the optimum go into the pool; ``baselines`` (given) gets the
    baselines' results, each what its own strategy returns (:func:`~rpcompile.planner.planning.compare` reuses them)."""
    seeds = {}
    started = time.perf_counter()
    bal = exact_balance(pb, tables)  # dp's balance too: solved once
    for res in (dp_of_balance(pb, bal, started), roundpipe(pb), uniform(pb)):
        seeds[res.strategy] = res.objective
        if baselines is not None:
            baselines[res.strategy] = res
        pool.add(res.plan if res.feasible else None)
    values = bound_values(pool.c[: len(bal.t_star)], bal.t_star)
    # the no-save optima of the few stage counts with the best c(S)·T* join as seeds
    for s in np.argsort(values, kind="stable")[:8]:
        if np.isfinite(values[s]):
            pool.add(bal.plan(int(s)))
    return seeds


def _lower_bounds(pb: PartitionProblem, tables: RangeTables, pool: _Pool) -> tuple[np.ndarray, np.ndarray]:
    """``LB[S]`` <= slowest stage of any plan with exactly ``S`` stages (saving allowed), and the relaxed
    backward range times."""
    inc = pool.incumbent()
    # a plan that beats the incumbent has no stage slower than incumbent / c(1): c never falls as S grows
    b_relaxed = relaxed_backward_time(pb, tables, inc / pool.c[1])
    relaxed = relaxed_balance(pb, tables, b_relaxed)
    return saving_bounds(pb, tables, relaxed, pool.c, inc), b_relaxed


def _next_budget(pool: _Pool, lb: np.ndarray, tried: set[int], tolerance: float = 1e-9) -> int | None:
    """The untried budget with the least bound, unless no bound is below ``incumbent · (1 − tolerance)``."""
    values = bound_values(pool.c, lb)
    inc = pool.incumbent()
    for s in np.argsort(values, kind="stable"):
        # sorted by bound: once one is not below the incumbent, none after it is
        if values[s] >= inc * (1 - tolerance):
            return None
        if int(s) not in tried:
            return int(s)
    return None


def _greedy_phase(pb: PartitionProblem, tables: RangeTables, pool: _Pool, lb: np.ndarray, *,
                  deadline: float = float("inf")) -> int:
    """Heuristic plans for the most promising stage budgets (:mod:`.greedy`); returns how many were tried (none
    starts after ``deadline``)."""
    masks = masks_for(pb, tables)
    # greedy reads only this table's forward chains; the forward costs stand in on the other side
    fwd = balance_table(masks[0], masks[0], masks[2])
    tried: set[int] = set()
    while len(tried) < GREEDY_BUDGETS and time.perf_counter() < deadline:
        s = _next_budget(pool, lb, tried)
        if s is None:
            break
        tried.add(s)
        hint_t, _ = pool.hint(s)
        # not capped by incumbent / c(s): a plan with a worse bound may still have the better iteration time
        # no plan with at most s stages yet: the slowest stage any plan beating the incumbent may have
        hi = hint_t if np.isfinite(hint_t) else pool.incumbent() / pool.c[1]
        pool.add(greedy_plan(pb, tables, fwd, masks, s, float(lb[s]), hi))
    return len(tried)


def _prepare(pb: PartitionProblem, strategy: str, started: float, *, greedy_deadline: float = float("inf"),
             baselines: dict[str, PartitionResult] | None = None) -> PartitionResult | tuple:
    """Tables, the seeded pool (``baselines``: see :func:`_seed`), lower bounds and the greedy plans — or an
    infeasible result."""
    tables = RangeTables.build(pb)
    # the least memory any plan needs is more than the device has: no strategy can fit
    if min_memory(tables)[0] > pb.memory_bytes:
        return infeasible_result(strategy, pb, started, tables)
    # stage counts up to 2(n − 1) + 1
    pool = _Pool(pb, 2 * pb.n + 1)
    seeds = _seed(pb, pool, tables, baselines)
    lb, b_relaxed = _lower_bounds(pb, tables, pool)
    # the greedy is about saving: with saving off, the seeded no-save optima stand
    greedy_tried = _greedy_phase(pb, tables, pool, lb, deadline=greedy_deadline) if pb.allow_save else 0
    return tables, pool, seeds, lb, b_relaxed, greedy_tried


def greedy(pb: PartitionProblem, *, time_limit_s: float = 10.0, seed: int = 0) -> PartitionResult:
    """The ILP's preparation without CP-SAT: baselines, no-save optima and save-aware greedy plans
    (:mod:`.greedy`) for the most promising stage budgets; the best by iteration time wins."""
    started = time.perf_counter()
    prep = _prepare(pb, "greedy", started)
    if isinstance(prep, PartitionResult):
        return prep
    _, pool, _, _, _, greedy_tried = prep
    # ties go to the plan with fewer stages
    best = choose_stays(pb, min(pool.plans, key=lambda p: (iteration_time(pb, p), p.stage_count)))
    return make_result("greedy", pb, best, started, model_best_s=pool.incumbent(), greedy_budgets=greedy_tried)


def ilp(pb: PartitionProblem, *, time_limit_s: float = 10.0, seed: int = 0,
        baselines: dict[str, PartitionResult] | None = None) -> PartitionResult:
    """Joint partition + checkpointing by CP-SAT (the steps below, the model :mod:`.ilp`). Counts bound each
    phase (the result does not depend on the machine's load); ``time_limit_s`` holds end to end as a guard — the
    greedy phase, the Lagrangian bisections, CP-SAT and the local search each stop at their share of it — apart
    from the tables, baselines and bounds every strategy computes first (1–2 s at 128 layers on 2 cores).
    ``baselines`` (given): filled with the results of ``dp``, ``roundpipe`` and ``uniform`` it seeds with.

    What is minimised is the bound ``c(S)·T`` of a plan with ``S`` stages whose slowest stage takes ``T``
    (:mod:`.ilp`); every plan met is finally re-scored by the exact :func:`.timing.iteration_time` (the recurrence
    over unequal stages plus the weight and gradient copies compute cannot hide, which ``c(S)·T`` leaves out) and
    the best one returned. In order:

    1. *seeds*: ``dp``, ``roundpipe``, ``uniform`` and the no-save optima of the best stage counts form the pool
       and the incumbent — ``ilp`` is never worse than a baseline by construction;
    2. *bounds*: ``LB(S)`` per stage count from the balance DP with a relaxed backward cost
       (:func:`.balance.relaxed_backward_time`) and the link/compute aggregates of :mod:`.bounds`;
    3. *greedy*: save-aware heuristic plans (:mod:`.greedy`) for the ``GREEDY_BUDGETS`` most promising budgets;
    4. *Lagrangian + exact*: per promising budget, a stage-count proof that it cannot beat the incumbent, else a
       bisection on ``T`` (:mod:`.lagrange`: the aggregates above pack stages like a fluid, this keeps whole
       segments). Where the relaxation proves nothing, the exact search of :mod:`.exact` (branch and bound over
       the saved flags, pruned by the same multipliers) finds the fewest stages ``T`` allows, or proves there is
       no plan within the budget; so within its work limit the bisection converges on the budget's true optimum.
       Every plan met goes into the pool;
    5. *CP-SAT*: budgets in increasing order of ``c(S)·LB(S)``, each with ``T <= incumbent / c(S)``, the best
       known plan as hint, and a share of the deterministic time ``time_limit_s · DET_TIME_PER_S``; a solve raises
       ``LB`` for every smaller budget. It stops when no budget's bound is more than ``CPSAT_GAP`` (0.1%) below
       the incumbent (``status`` ``OPTIMAL`` when none is below it at all) or the time is spent (``FEASIBLE``);
    6. *local search* on the exact time (:mod:`.polish`): climbs from the best plans of the best few stage counts,
       the winner's save/recompute flips, then a climb from the winner re-cut into stages that grow from both
       ends of the pipeline (``taper``), the faster of the two kept;
    7. *stays* on the winner's cuts (:mod:`.stay_search`): which weights stay on their device between a forward
       and a backward stage (or all of them, across iterations), where memory allows and the exact time gains.

    ``stats["bound_s"] = min(incumbent, min_S c(S)·LB(S))`` is a proven lower bound on ``c(S)·T`` over all plans;
    ``stats["gap"] = model_best_s / bound_s − 1``; ``objective_gap`` is ``objective / bound_s − 1`` (the exact
    time against the same bound: below ``gap`` when stages are unequal, above it when the plan's copies are
    exposed). Same input, same plan: every limit is deterministic (the wall clock only guards overruns)."""
    started = time.perf_counter()
    prep = _prepare(pb, "ilp", started, greedy_deadline=started + GREEDY_WALL_SHARE * time_limit_s,
                    baselines=baselines)
    if isinstance(prep, PartitionResult):
        return prep
    tables, pool, seeds, lb, b_relaxed, greedy_tried = prep
    # the wall clock only guards overruns (a loaded machine); the counts below are what normally stops each phase
    deadline = started + WALL_SHARE * time_limit_s
    lagrange = _lagrange_phase(pb, tables, pool, lb, int(time_limit_s * LAGRANGE_EVALUATIONS_PER_S),
                               int(time_limit_s * EXACT_WORK_PER_S), deadline=started + LAGRANGE_WALL_SHARE * time_limit_s)
    det_left = time_limit_s * DET_TIME_PER_S
    tried: set[int] = set()
    log: list[tuple[int, str, float, int]] = []
    while det_left >= MIN_SOLVE_DET and time.perf_counter() < deadline:
        s = _next_budget(pool, lb, tried, CPSAT_GAP)
        if s is None:
            break
        tried.add(s)
        # the deterministic time left is shared by this budget and at most two more still open
        share = det_left / min(_open_budgets(pool, lb, tried) + 1, 3)
        hint_t, hint = pool.hint(s)
        # the T worth finding at this budget: below incumbent / c(S), and no slower than the best known plan within it
        ub = min(pool.incumbent() / pool.c[s], hint_t)
        # a hint slower than ub breaks the model's T bound: leave it out
        res = solve_budget(pb, tables, b_relaxed, s, ub=ub, lb=float(lb[s]),
                           hint=hint if hint_t <= ub else None, det_time=max(share, MIN_SOLVE_DET),
                           wall_time=max(deadline - time.perf_counter(), 0.2), seed=seed)
        det_left -= res.det_time
        pool.add(res.plan)
        lb[: s + 1] = np.maximum(lb[: s + 1], res.bound_s)  # plans with <= s stages are at least this slow
        log.append((s, res.status, round(res.det_time, 3), res.variables))
    return _finish(pb, pool, lb, started, seeds, log, greedy_tried, lagrange=lagrange,
                   deadline=started + FINISH_WALL_SHARE * time_limit_s)


def _lagrange_phase(pb: PartitionProblem, tables: RangeTables, pool: _Pool, lb: np.ndarray,
                    evaluations: int, exact_work: int = 0, *, deadline: float = float("inf")) -> dict[str, int]:
    """Stage-count proofs and repaired plans (:mod:`.lagrange`) for the most promising budgets; raises ``lb``
    in place and adds plans to the pool. Bounded by a count of Lagrangian evaluations (deterministic).

    Per budget ``S``: try to prove that no plan with at most ``S`` stages beats the incumbent (one proof closes
    the budget); otherwise bisect between ``LB(S)`` and that time. A proof at ``T`` raises every budget below
    the stage count it shows; every unproven ``T`` offers the relaxation's saved flags to
    :meth:`.lagrange.StageCountBound.plan_for`, which turns them into real plans."""
    left, lam, proven, budgets, work_left = evaluations, None, 0, 0, exact_work
    if not pb.allow_save or evaluations <= 0:
        return dict(lagrange_evaluations=0, lagrange_budgets=0, lagrange_proofs=0, exact_work=0)

    def attempt(T: float, stages: int) -> bool:
        nonlocal left, lam, proven, work_left
        relax = StageCountBound(pb, tables, T)
        # L counts non-fused stages: S − 1 of them is what a plan within the budget may have
        count, new_lam, seen = relax.maximise(stages - 1 + 1e-9, min(LAGRANGE_ITERATIONS, left), lam)
        # a call that stopped at once still costs one evaluation, so the loop ends
        left -= max(relax.evaluations, 1)
        if np.isfinite(count):
            # keep λ as the warm start for the next T
            lam = new_lam
        # plans this fast need at least ceil(count) + 1 stages (none exists when count is infinite)
        covered = min(len(lb), int(np.ceil(count - 1e-9)) + 1) if np.isfinite(count) else len(lb)
        lb[1:covered] = np.maximum(lb[1:covered], T)
        if count > stages - 1 + 1e-9:
            proven += 1
            return True
        for flags in seen:
            pool.add(relax.plan_for(flags))
        if work_left <= 0:
            return False
        found = fewest_stages(relax, new_lam, stages - 1, min(EXACT_WORK_PER_CALL, work_left), lower=count)
        work_left -= found.work
        pool.add(found.plan)
        if found.status == "limit":
            return False
        # the walk completed: no plan this fast has fewer non-fused stages than it found (or than the budget)
        fewest = found.stages if found.status == "plan" and found.stages is not None else stages
        lb[1:fewest + 1] = np.maximum(lb[1:fewest + 1], T)
        if found.status == "none":
            proven += 1
            return True
        return False

    tried: set[int] = set()
    while left > 0 and time.perf_counter() < deadline:
        s = _next_budget(pool, lb, tried)
        if s is None:
            break
        tried.add(s)
        budgets += 1
        # just below the best known time: a plan that only ties it is no gain, so a proof need not rule it out
        hi = min(pool.incumbent() / pool.c[s], pool.hint(s)[0]) * (1 - 1e-9)
        if attempt(hi, s):
            continue
        lo = float(lb[s])
        for _ in range(LAGRANGE_BISECTIONS):
            hi = min(hi, pool.incumbent() / pool.c[s])
            if left <= 0 or hi <= lo or time.perf_counter() >= deadline:
                break
            mid = 0.5 * (lo + hi)
            if attempt(mid, s):
                # proven: no plan within the budget is this fast, so its optimum lies above mid
                lo = mid
            else:
                hi = min(mid, pool.hint(s)[0])  # the exact search may have met a plan faster than mid
    return dict(lagrange_evaluations=evaluations - left, lagrange_budgets=budgets, lagrange_proofs=proven,
                exact_work=exact_work - work_left)


def _open_budgets(pool: _Pool, lb: np.ndarray, tried: set[int]) -> int:
    values = bound_values(pool.c, lb)
    inc = pool.incumbent()
    return sum(1 for s in range(len(values)) if values[s] < inc * (1 - 1e-9) and s not in tried)


def _finish(pb: PartitionProblem, pool: _Pool, lb: np.ndarray, started: float, seeds: dict[str, float],
            log: list, greedy_tried: int, lagrange: dict[str, int] | None = None,
            deadline: float = float("inf")) -> PartitionResult:
    """The local search from the pool's best plans, then the result. ``deadline``: the solve's time limit; each
    local search stops where it is once past it (it is bounded by counts first: on an idle machine it never
    binds)."""
    # the local search starts from the fastest plan (by exact time) of each of the best few stage counts: the
    # climbs stay near their stage count, and a runner-up's neighbourhood is often the faster one
    ranked: list[SegmentPlan] = []
    counts: set[int] = set()
    for plan in sorted(pool.plans, key=lambda p: (iteration_time(pb, p), p.stage_count)):
        if plan.stage_count not in counts and len(ranked) < POLISH_STARTS:
            ranked.append(plan)
            counts.add(plan.stage_count)
    # the fastest start gets the whole budget, each runner-up a share
    shares = [POLISH_EVALUATIONS] + [POLISH_EVALUATIONS // POLISH_STARTS] * (len(ranked) - 1)
    scorer = PlanScorer(pb)  # the searches meet the same stages and plans: score each once
    polished = [polish(pb, p, max_evaluations=k, deadline=deadline, scorer=scorer) for p, k in zip(ranked, shares)]
    best = min(polished, key=lambda p: (iteration_time(pb, p), p.stage_count))
    for _ in range(FLIP_ROUNDS):  # the winner's checkpointing choices on its settled cuts, then its cuts again
        flipped = flip_saves(pb, best, deadline=deadline, scorer=scorer)
        if flipped == best:
            break
        best = polish(pb, flipped, max_evaluations=POLISH_EVALUATIONS // POLISH_STARTS, deadline=deadline,
                      scorer=scorer)
    # a jump out of the climbs' optimum: stages that grow from both ends, climbed again
    tapered = taper(pb, best, scorer=scorer) if time.perf_counter() <= deadline else best
    if tapered != best:
        tapered = flip_saves(pb, polish(pb, tapered, max_evaluations=POLISH_EVALUATIONS, deadline=deadline,
                                        scorer=scorer), deadline=deadline, scorer=scorer)
        best = min((best, tapered), key=lambda p: (iteration_time(pb, p), p.stage_count))
    best = choose_stays(pb, best)  # the weights that stay on their devices, on the settled cuts
    inc = pool.incumbent()
    # the least proven bound over every stage count, and never above the incumbent, which is a plan's value
    bound = min(inc, float(np.min(bound_values(pool.c, lb))))
    proven = bound >= inc * (1 - 1e-9)
    # a zero bound: a zero value has no gap, any other an infinite one
    ratio = (lambda x: x / bound - 1) if bound > 0 else (lambda x: 0.0 if x == 0 else float("inf"))
    gaps = dict(gap=ratio(inc), objective_gap=ratio(iteration_time(pb, best)))
    return make_result("ilp", pb, best, started, bound_s=bound, **gaps,
                       status="OPTIMAL" if proven else "FEASIBLE", model_best_s=inc, seeds=seeds,
                       candidates_tried=len(log), budgets=log, greedy_budgets=greedy_tried, **(lagrange or {}))


#: Each strategy's name and its solver (every one returns a :class:`~rpcompile.passes.solver.problem.PartitionResult`).
STRATEGIES: dict[str, Callable[..., PartitionResult]] = {
    "ilp": ilp, "dp": dp, "roundpipe": roundpipe, "uniform": uniform, "greedy": greedy,
}


def solve(problem: PartitionProblem, strategy: str = "ilp", *, time_limit_s: float = 10.0,
          seed: int = 0) -> PartitionResult:
    """Partition ``problem`` with the named strategy (``ilp``, ``dp``, ``roundpipe`` or ``uniform``)."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown partition strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[strategy](problem, time_limit_s=time_limit_s, seed=seed)

