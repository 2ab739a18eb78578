"""Property tests of the partition solvers over random chains, against brute force where it is affordable.

Random chains have 2-24 segments grouped into random layers, random times and bytes, boundaries that are often
larger than their neighbours' activations (the live-across-cut bytes of a linearised DAG: skip connections),
an optional tied parameter, 1-4 devices, 1-6 microbatches and memory from just-feasible to loose. The default
profile runs few examples; ``-m slow`` runs the same properties with many more.
"""

from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpcompile.passes.solver.balance import exact_balance, relaxed_backward_time, relaxed_balance
from rpcompile.passes.solver.bounds import saving_bounds
from rpcompile.passes.solver.ilp import solve_budget
from rpcompile.passes.solver import lagrange
from rpcompile.passes.solver.exact import fewest_stages
from rpcompile.passes.solver.lagrange import StageCountBound
from rpcompile.passes.solver.partition import solve
from rpcompile.passes.solver.problem import PartitionProblem, SegmentPlan, SharedParam
from rpcompile.passes.solver.segment_rules import validate_segment_plan
from rpcompile.passes.solver.tables import RangeTables, min_feasible_memory
from rpcompile.passes.solver.recurrence import equal_time_factors
from rpcompile.passes.solver.timing import pipeline_time, stage_costs

settings.register_profile("partition", max_examples=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
FEW = settings(settings.get_profile("partition"))
MANY = settings(FEW, max_examples=300)
REL = 1e-9


@pytest.fixture(autouse=True)
def _slow_only_when_asked(request):
    """``slow`` sweeps run only under ``-m slow`` (``make test-slow``); a repository-wide conftest hook would do
    the same for every module."""
    if request.node.get_closest_marker("slow") and "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("slow sweep: run with -m slow")


@st.composite
def chains(draw, max_n: int = 24, min_n: int = 2, allow_save: bool | None = None) -> PartitionProblem:
    n = draw(st.integers(min_n, max_n))
    new_layer = draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))
    layer = tuple(int(x) for x in np.concatenate([[0], np.cumsum(new_layer)]))
    unit = st.floats(0.05, 2.0, allow_nan=False).map(lambda x: round(x, 3))
    fwd = draw(st.lists(unit, min_size=n, max_size=n))
    bwd = [f * draw(st.sampled_from([1.0, 2.0, 3.0])) for f in fwd]
    rec = [f * draw(st.sampled_from([0.5, 1.0])) for f in fwd]
    ints = lambda hi: st.lists(st.integers(0, hi), min_size=n, max_size=n)  # noqa: E731
    act, peak, param, transient = draw(ints(1000)), draw(ints(500)), draw(ints(2000)), draw(ints(800))
    boundary = draw(st.lists(st.integers(1, 2500), min_size=n, max_size=n))  # often > act: skip connections
    frozen = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    shared = ()
    if n >= 2 and draw(st.booleans()):
        segs = sorted(draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=min(n, 3))))
        size = draw(st.integers(1, 1500))
        shared = (SharedParam(name="tied", bytes=size, grad_bytes=size, segments=tuple(segs)),)
    pb = PartitionProblem(
        names=tuple(f"seg{i}" for i in range(n)), layer=layer, fwd_s=tuple(fwd), bwd_s=tuple(bwd),
        rec_s=tuple(rec), act_bytes=tuple(act), peak_bytes=tuple(peak), transient_bytes=tuple(transient),
        boundary_bytes=tuple(boundary), input_bytes=draw(st.integers(0, 500)), param_bytes=tuple(param),
        grad_bytes=tuple(0 if f else p for f, p in zip(frozen, param)), shared=shared,
        device_count=(devices := draw(st.integers(1, 4))), microbatches=draw(st.integers(1, 6)), memory_bytes=1,
        resident_handoffs=devices == 1 and draw(st.booleans()),  # one GPU keeps its hand-offs off the link
        link_bytes_per_s=draw(st.sampled_from([300.0, 1000.0, 5000.0])),
        stage_overhead_s=draw(st.sampled_from([0.0, 0.0, 0.01])),
        allow_save=draw(st.booleans()) if allow_save is None else allow_save,
    )
    need, _ = min_feasible_memory(pb)
    memory = int(need * draw(st.sampled_from([1.0, 1.05, 1.3, 2.0, 10.0])))
    return _replace(pb, memory_bytes=memory)


def _replace(pb: PartitionProblem, **kw) -> PartitionProblem:
    fields = {k: getattr(pb, k) for k in PartitionProblem.__dataclass_fields__}
    fields.update(kw)
    return PartitionProblem(**fields)


def _compositions(stop: int) -> Iterator[list[tuple[int, int]]]:
    """Every cut of ``[0, stop)`` into contiguous non-empty ranges, ascending."""
    if stop == 0:
        yield []
        return
    for mask in range(2 ** (stop - 1)):
        cuts = [0] + [i + 1 for i in range(stop - 1) if mask >> i & 1] + [stop]
        yield list(zip(cuts, cuts[1:]))


def _all_plans(pb: PartitionProblem, saves: bool) -> Iterator[SegmentPlan]:
    for a in range(pb.n):
        flags = itertools.product([False, True], repeat=a) if saves and pb.allow_save else [(False,) * a]
        flags = list(flags)
        for fwd in _compositions(a):
            for bwd in _compositions(a):
                for s in flags:
                    yield SegmentPlan(forward=tuple(fwd), fused=(a, pb.n), backward=tuple(reversed(bwd)),
                                      saved=tuple(s) + (False,) * (pb.n - a))


def _brute(pb: PartitionProblem, saves: bool) -> tuple[float, dict[int, float]]:
    """Least ``c(S)·T`` over all plans that fit, and the least ``T`` per exact stage count."""
    c = equal_time_factors(2 * pb.n, pb.device_count, pb.microbatches)
    best, per_s = float("inf"), {}
    for plan in _all_plans(pb, saves):
        if validate_segment_plan(pb, plan):
            continue
        t = max(x.time_s for x in stage_costs(pb, plan, lazy_offload=False))
        s = plan.stage_count
        per_s[s] = min(per_s.get(s, float("inf")), t)
        best = min(best, c[s] * t)
    return best, per_s


# --- properties ------------------------------------------------------------------------------------------------

def _check_ilp_beats_baselines(pb: PartitionProblem) -> None:
    res = solve(pb, "ilp", time_limit_s=2.0)
    assert res.feasible, res.stats
    assert validate_segment_plan(pb, res.plan) == []
    for name in ("dp", "roundpipe", "uniform"):
        other = solve(pb, name)
        if other.feasible:
            assert res.objective <= other.objective * (1 + REL), (name, res.objective, other.objective)
    st_ = res.stats
    assert st_["bound_s"] <= st_["model_best_s"] * (1 + REL)
    # c(S)·T never undercuts the recurrence of the plan it scores in its own per-stage model (without the
    # transfer edges, which c(S)·T does not model), and the exact objective (lazy offload, transfer edges) never
    # undercuts the recurrence of its own stage times
    times = [c.time_s for c in stage_costs(pb, res.plan, lazy_offload=False)]
    assert pipeline_time(times, pb.device_count, pb.microbatches) <= st_["model_objective_s"] * (1 + REL)
    times = [c.time_s for c in stage_costs(pb, res.plan)]
    assert res.objective >= pipeline_time(times, pb.device_count, pb.microbatches) * (1 - REL)


@FEW
@given(chains())
def test_ilp_plans_are_valid_and_never_worse_than_baselines(pb):
    _check_ilp_beats_baselines(pb)


@pytest.mark.slow
@MANY
@given(chains())
def test_ilp_plans_are_valid_and_never_worse_than_baselines_many(pb):
    _check_ilp_beats_baselines(pb)


def _check_no_save_ilp_equals_dp(pb: PartitionProblem) -> None:
    res, ref = solve(pb, "ilp", time_limit_s=2.0), solve(pb, "dp")
    optimum = ref.stats["model_optimum_s"]
    assert res.stats["model_best_s"] == pytest.approx(optimum, rel=1e-6)
    assert res.stats["bound_s"] <= optimum * (1 + 1e-6)
    assert res.plan.saved == (False,) * pb.n


@FEW
@given(chains(allow_save=False))
def test_without_saving_ilp_reaches_the_dp_optimum(pb):
    _check_no_save_ilp_equals_dp(pb)


def _check_cpsat_budget_equals_dp(pb: PartitionProblem, data) -> None:
    """The CP-SAT model alone (no hint, no bound) finds the DP's optimum for a stage budget."""
    t = RangeTables.build(pb)
    bal = exact_balance(pb, t, every_count=True)
    s = data.draw(st.integers(1, 2 * pb.n - 1))
    finite = bal.t_star[np.isfinite(bal.t_star)]
    expect = float(np.min(bal.t_star[: s + 1])) if s < len(bal.t_star) else float(np.min(finite))
    ub = float(np.max(finite)) * 1.01
    res = solve_budget(pb, t, t.bwd_time, s, ub=ub, det_time=20.0)
    if not np.isfinite(expect):
        assert res.plan is None
        return
    assert res.status == "OPTIMAL"
    got = max(c.time_s for c in stage_costs(pb, res.plan))
    assert got == pytest.approx(expect, rel=1e-6)
    assert res.bound_s <= expect * (1 + 1e-9)


@FEW
@given(chains(max_n=10, allow_save=False), st.data())
def test_cpsat_model_matches_dp_for_a_stage_budget(pb, data):
    _check_cpsat_budget_equals_dp(pb, data)


def _check_dp_brute(pb: PartitionProblem) -> None:
    best, _ = _brute(pb, saves=False)
    assert solve(pb, "dp").stats["model_optimum_s"] == pytest.approx(best, rel=1e-9)


@FEW
@given(chains(max_n=5))
def test_dp_equals_brute_force(pb):
    _check_dp_brute(pb)


def _check_ilp_brute(pb: PartitionProblem) -> None:
    best, per_s = _brute(pb, saves=True)
    res = solve(pb, "ilp", time_limit_s=5.0)
    assert res.stats["bound_s"] <= best * (1 + 1e-9) <= res.stats["model_best_s"] * (1 + 2e-9)
    if res.stats["status"] == "OPTIMAL":
        assert res.stats["model_best_s"] == pytest.approx(best, rel=1e-6)
    # the fast bounds are valid for every exact stage count
    t = RangeTables.build(pb)
    c = np.asarray(equal_time_factors(2 * pb.n, pb.device_count, pb.microbatches), dtype=float)
    relaxed = relaxed_balance(pb, t, relaxed_backward_time(pb, t, float("inf")))
    lb = saving_bounds(pb, t, relaxed, c, float("inf"))
    for s, t_min in per_s.items():
        assert lb[s] <= t_min * (1 + 1e-9), (s, lb[s], t_min)


@FEW
@given(chains(max_n=4, allow_save=True))
def test_ilp_equals_brute_force_with_saving(pb):
    _check_ilp_brute(pb)


def _check_lagrangian_brute(pb: PartitionProblem, lams: list[np.ndarray]) -> None:
    """For every plan that fits, with ``T`` its slowest stage: ``L(λ)`` at ``T`` never exceeds its non-fused stage
    count for any ``λ``, nor does the ascent's best; the plans repaired from any flags meet ``T``."""
    t = RangeTables.build(pb)
    fewest: dict[float, int] = {}
    for plan in _all_plans(pb, saves=True):
        if not validate_segment_plan(pb, plan):
            T = max(c.time_s for c in stage_costs(pb, plan, lazy_offload=False))
            fewest[T] = min(fewest.get(T, 10**9), plan.stage_count - 1)
    for T, count in fewest.items():
        relax = StageCountBound(pb, t, T)
        for lam in lams:
            assert relax.value(lam)[0] <= count, (T, lam)
        best, _, seen = relax.maximise(count + 0.5, iterations=15)
        assert best <= count, (best, count)
        for flags in seen + lams:
            plan = relax.plan_for(flags > 0)
            if plan is not None:
                assert not validate_segment_plan(pb, plan, memory=False)
                assert max(c.time_s for c in stage_costs(pb, plan, lazy_offload=False)) <= T * (1 + 1e-9)


@FEW
@given(chains(max_n=5, allow_save=True), st.data())
def test_lagrangian_stage_counts_are_lower_bounds(pb, data):
    values = st.floats(-2.0, 2.0, allow_nan=False)
    lams = [np.zeros(pb.n)] + [np.asarray(data.draw(st.lists(values, min_size=pb.n, max_size=pb.n)))
                               for _ in range(2)]
    _check_lagrangian_brute(pb, lams)


@FEW
@given(chains(max_n=5, allow_save=True), st.data())
def test_lagrangian_long_ranges_are_lower_bounds(pb, data):
    """The same with every range of 2+ segments "long" (fractional knapsack instead of enumerated subsets)."""
    values = st.floats(-2.0, 2.0, allow_nan=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lagrange, "MAX_ENUMERATED", 1)
        _check_lagrangian_brute(pb, [np.asarray(data.draw(st.lists(values, min_size=pb.n, max_size=pb.n)))])


def _check_min_memory_brute(pb: PartitionProblem) -> None:
    need, seg = min_feasible_memory(pb)
    fits = [max(c.memory_bytes for c in stage_costs(pb, p, lazy_offload=False)) for p in _all_plans(pb, saves=False)]
    assert need == min(fits) and 0 <= seg < pb.n


@FEW
@given(chains(max_n=5))
def test_min_feasible_memory_equals_brute_force(pb):
    _check_min_memory_brute(pb)


@FEW
@given(chains(max_n=12), st.data())
def test_range_tables_agree_with_stage_costs(pb, data):
    t = RangeTables.build(pb)
    plans = list(itertools.islice(_all_plans(pb, saves=False), 0, 200))
    plan = data.draw(st.sampled_from(plans))
    costs = stage_costs(pb, plan, lazy_offload=False)
    p = max(c.weight_bytes for c in costs)
    for c in costs:
        if c.kind == "forward":
            table_t, need = t.fwd_time[c.start, c.stop], t.fwd_need[c.start, c.stop]
        elif c.kind == "backward":
            table_t, need = t.bwd_time[c.start, c.stop], t.bwd_need[c.start, c.stop]
        else:
            table_t, need = t.fused_time[c.start], t.fused_need[c.start]
        assert c.time_s == pytest.approx(table_t, rel=1e-12)
        assert c.memory_bytes == need + p


@FEW
@given(chains(max_n=14))
def test_same_input_same_plan(pb):
    first, second = solve(pb, "ilp", time_limit_s=2.0), solve(pb, "ilp", time_limit_s=2.0)
    assert first.plan == second.plan and first.objective == second.objective


@pytest.mark.slow
@MANY
@given(chains(max_n=5))
def test_brute_force_properties_many(pb):
    _check_dp_brute(pb)
    _check_min_memory_brute(pb)
    if pb.n <= 4:
        _check_ilp_brute(pb)


@pytest.mark.slow
@MANY
@given(chains(allow_save=False))
def test_without_saving_ilp_reaches_the_dp_optimum_many(pb):
    _check_no_save_ilp_equals_dp(pb)


@pytest.mark.slow
@MANY
@given(chains(max_n=10, allow_save=False), st.data())
def test_cpsat_model_matches_dp_for_a_stage_budget_many(pb, data):
    _check_cpsat_budget_equals_dp(pb, data)


def _check_exact_brute(pb: PartitionProblem, budget_slack: int, lam_random: np.ndarray) -> None:
    """For every slowest-stage time ``T`` some plan meets, and multipliers from the ascent or random ones: the
    exact search's count equals the fewest non-fused stages of any plan meeting ``T`` when memory cannot bind
    (never more in general: ``P`` is relaxed), its plan meets ``T`` with that count, and "none" under a budget
    below the fewest count is right."""
    t = RangeTables.build(pb)
    fewest: dict[float, int] = {}
    roomy = _replace(pb, memory_bytes=10**15)
    fitting: list[tuple[float, int]] = []  # (slowest stage, stages - 1) of the plans that fit the real memory
    for plan in _all_plans(pb, saves=True):
        if not validate_segment_plan(roomy, plan):
            T = max(c.time_s for c in stage_costs(pb, plan, lazy_offload=False))
            fewest[T] = min(fewest.get(T, 10**9), plan.stage_count - 1)
            if not validate_segment_plan(pb, plan):
                fitting.append((T, plan.stage_count - 1))
    times = sorted(fewest)
    for T in times:
        # plans faster than T also meet T, and so do those within the search's rounding tolerance (two sums of
        # the same times in another order differ in the last bit)
        need = min(fewest[x] for x in times if x <= T * (1 + 1e-9))
        relax = StageCountBound(roomy, RangeTables.build(roomy), T)
        _, lam, _ = relax.maximise(need + 0.5, iterations=5)
        for prices in (lam, lam_random):
            found = fewest_stages(relax, prices, need + budget_slack, 10**7)
            assert found.status == "plan" and found.stages == need, (T, found, need)
            assert found.plan.stage_count == need + 1
            assert not validate_segment_plan(roomy, found.plan)
            assert max(c.time_s for c in stage_costs(pb, found.plan, lazy_offload=False)) <= T * (1 + 1e-9)
            if need > 0:
                assert fewest_stages(relax, prices, need - 1, 10**7).status == "none"
        # with the real memory limit it is a relaxation: never more stages than a plan that fits
        relax = StageCountBound(pb, t, T)
        real = min((k for slowest, k in fitting if slowest <= T * (1 + 1e-9)), default=None)
        if real is not None:
            got = fewest_stages(relax, np.zeros(pb.n), real, 10**7)
            assert got.status == "plan" and got.stages <= real


@FEW
@given(chains(max_n=5, allow_save=True), st.integers(0, 2), st.data())
def test_exact_search_finds_the_fewest_stages(pb, budget_slack, data):
    lam = data.draw(st.lists(st.floats(-2.0, 2.0, allow_nan=False), min_size=pb.n, max_size=pb.n))
    _check_exact_brute(pb, budget_slack, np.asarray(lam))


@FEW
@given(chains(min_n=6, max_n=12, allow_save=True), st.floats(0.7, 1.3), st.data())
def test_exact_search_count_does_not_depend_on_the_prices(pb, factor, data):
    """Any ``λ`` gives the same least count (only the pruning changes), and so does deepening from ``L(λ)``;
    the plan found meets ``T`` with that count."""
    base = solve(pb, "dp")
    if not base.feasible:
        return
    T = factor * max(c.time_s for c in stage_costs(pb, base.plan))
    relax = StageCountBound(pb, RangeTables.build(pb), T)
    budget = 2 * pb.n
    plain = fewest_stages(relax, np.zeros(pb.n), budget, 10**8)
    count, lam, _ = relax.maximise(budget, iterations=10)
    random = np.asarray(data.draw(st.lists(st.floats(-3.0, 3.0, allow_nan=False), min_size=pb.n, max_size=pb.n)))
    for other in (fewest_stages(relax, lam, budget, 10**8, lower=count), fewest_stages(relax, random, budget, 10**8)):
        assert (other.status, other.stages) == (plain.status, plain.stages)
    if plain.plan is not None:
        assert plain.plan.stage_count == plain.stages + 1
        assert not validate_segment_plan(pb, plain.plan, memory=False)
        assert max(c.time_s for c in stage_costs(pb, plain.plan)) <= T * (1 + 1e-9)


def test_exact_search_prices_flags_only_one_open_stage_holds():
    """A chain where the pruning's one-sided price term decides: with its sign flipped the walk drops the only
    3-stage completions (found by a seeded search over random chains)."""
    pb = PartitionProblem(
        names=("s0", "s1", "s2", "s3"), layer=(0, 1, 2, 3), fwd_s=(1.51, 1.149, 0.609, 0.586),
        bwd_s=(3.02, 2.298, 1.218, 1.758), rec_s=(1.51, 1.149, 0.609, 0.293), act_bytes=(421, 906, 394, 549),
        peak_bytes=(91, 353, 476, 170), boundary_bytes=(1312, 1601, 2062, 1928), input_bytes=44,
        param_bytes=(18, 1405, 646, 681), grad_bytes=(245, 1879, 218, 1643), device_count=2, microbatches=3,
        memory_bytes=10**12, link_bytes_per_s=5000.0)
    relax = StageCountBound(pb, RangeTables.build(pb), 3.9919707315857282)
    lam = np.array([1.3695731132748525, -0.24310330169450034, -1.1402372372424057, 0.9601262013669567])
    plain = fewest_stages(relax, np.zeros(pb.n), 8, 10**7)
    priced = fewest_stages(relax, lam, 8, 10**7)
    assert (plain.status, plain.stages) == (priced.status, priced.stages) == ("plan", 3)
