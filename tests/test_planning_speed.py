"""Planning speed (issue 20, 6): the ILP's time limit holds end to end, and the speed-ups change no plan."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import rpcompile.passes.solver.bounds as bounds
import rpcompile.passes.solver.lagrange as lagrange
import rpcompile.passes.background as background
import rpcompile.passes.solver.partition as partition
from rpcompile.core.stages import HostLoad
from rpcompile.passes.solver.balance import relaxed_backward_time, relaxed_balance
from rpcompile.passes.solver.partition import solve
from rpcompile.passes.solver.polish import _neighbours, flip_saves, polish, taper
from rpcompile.passes.solver.problem import SegmentPlan
from rpcompile.passes.solver.scorer import PlanScorer
from rpcompile.passes.solver.tables import RangeTables
from rpcompile.passes.solver.timing import _total, iteration_time, overlapped_period
from rpcompile.planner.plan_options import PlanOptions, MIN_SHARE_S, split_limit

from partition_cases import llama_like, tiny_chain


def _slow_start():
    pb = tiny_chain(6, devices=2, microbatches=3)
    return pb, SegmentPlan(forward=((0, 3), (3, 5)), fused=(5, 6), backward=((3, 5), (0, 3)), saved=(False,) * 6)


def test_the_local_search_stops_at_its_deadline():
    pb, plan = _slow_start()
    assert iteration_time(pb, polish(pb, plan)) < iteration_time(pb, plan)  # it would improve it
    assert polish(pb, plan, deadline=0.0) == plan  # but a deadline already passed stops it where it is
    assert flip_saves(pb, plan, deadline=0.0) == plan


def test_a_shared_scorer_changes_no_result():
    """The solver's local searches share one PlanScorer: the same plans as a scorer per search."""
    pb = llama_like(8)
    start = solve(pb, "dp").plan
    scorer = PlanScorer(pb)
    for k in (50, 400, 3000):
        assert polish(pb, start, max_evaluations=k, scorer=scorer) == polish(pb, start, max_evaluations=k)
    assert flip_saves(pb, start, scorer=scorer) == flip_saves(pb, start)
    assert taper(pb, start, scorer=scorer) == taper(pb, start)
    assert scorer.totals and scorer.cache


def test_the_ilp_time_limit_holds_end_to_end(monkeypatch):
    """64 layers with a 1 s limit: before the guards the greedy phase, the Lagrangian bisections and the local
    search ran on their counts alone (61 s on this 2-core machine under load); now each stops at its share. Only
    the tables, baselines and bounds every strategy computes come on top (timed here as what a solve that
    stops right after them takes)."""
    pb = llama_like(64)
    monkeypatch.setattr(partition, "GREEDY_BUDGETS", 0)
    monkeypatch.setattr(partition, "LAGRANGE_EVALUATIONS_PER_S", 0)
    t = time.perf_counter()
    partition.greedy(pb)
    fixed = time.perf_counter() - t
    monkeypatch.undo()
    t = time.perf_counter()
    result = solve(pb, "ilp", time_limit_s=1.0)
    elapsed = time.perf_counter() - t
    assert result.feasible
    assert elapsed <= 1.0 + 2 * fixed + 5.0, (elapsed, fixed)  # generous: a loaded 2-core machine; it was 61 s


def test_the_wall_clock_guards_change_no_plan_when_they_do_not_bind(monkeypatch):
    """The guards only stop a phase that overran: on a problem that fits its limit, the plan is the one the
    counts alone give."""
    pb = llama_like(8)
    guarded = solve(pb, "ilp", time_limit_s=10.0)
    for name in ("GREEDY_WALL_SHARE", "LAGRANGE_WALL_SHARE", "WALL_SHARE", "FINISH_WALL_SHARE"):
        monkeypatch.setattr(partition, name, 1e9)
    assert solve(pb, "ilp", time_limit_s=10.0).plan == guarded.plan


def _grid_triples(fwd, bwd, fused, max_stages, ovh, keep):
    """The whole ``(f, b, a)`` grid at once: what :func:`bounds._triples` computed before it went one forward
    count at a time (4.5 s and hundreds of MB at 128 layers)."""
    kf, kb = min(fwd.shape[0], max_stages), min(bwd.shape[0], max_stages)
    f, b, a = np.meshgrid(np.arange(1, kf), np.arange(1, kb), np.arange(fwd.shape[1]), indexing="ij")
    lo = np.maximum(np.maximum(fwd[f, a], bwd[b, a]), fused[a]) - ovh
    s = f + b + 1
    ok = np.isfinite(lo) & (s <= max_stages) & (lo + ovh < keep[np.minimum(s, len(keep) - 1)])
    return a[ok], f[ok], b[ok], np.maximum(lo[ok], 0.0)


@pytest.mark.parametrize("layers", [4, 24])
def test_the_sliced_triples_are_the_whole_grid(layers):
    """``saving_bounds`` enumerates its ``(a, f, b)`` triples one forward count at a time: the same triples, in
    the same order, with the same bounds as the whole grid, for every stage cap and incumbent."""
    pb = llama_like(layers)
    tables = RangeTables.build(pb)
    pool = partition._Pool(pb, 2 * pb.n + 1)
    partition._seed(pb, pool, tables)
    inc = pool.incumbent()
    relaxed = relaxed_balance(pb, tables, relaxed_backward_time(pb, tables, inc / pool.c[1]))
    fused = bounds._fused_times(pb, tables)
    for scale in (0.5, 1.0, 2.0, np.inf):
        with np.errstate(divide="ignore", invalid="ignore"):
            keep = np.where(pool.c > 0, scale * inc / pool.c, np.inf)
        for cap in (1, 3, 7, pb.n, 2 * pb.n):
            got = bounds._triples(relaxed.fwd_best, relaxed.bwd_best, fused, cap, pb.stage_overhead_s, keep)
            want = _grid_triples(relaxed.fwd_best, relaxed.bwd_best, fused, cap, pb.stage_overhead_s, keep)
            assert len(got) == 4 and all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(got, want))
    assert want[0].size > 0  # the last case enumerates something


def test_subset_sums_are_the_subset_matrix_product():
    """The Lagrangian's subset sums by doubling give the numbers of the 0/1 subset matrix product they replaced
    (which ran on BLAS's threads): bit for bit on byte counts (integers: every order sums them exactly), within
    rounding on prices of either sign — against the correctly rounded sums (``math.fsum``), not against BLAS, whose
    summation order depends on the CPU it picks a kernel for (an AVX-512 machine's differed in the last bits)."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        x = rng.standard_normal(int(rng.integers(12, 80))) * 10.0 ** int(rng.integers(-6, 10))
        exact = trial % 3 == 0
        x = np.round(np.abs(x)) if exact else x  # byte counts, and prices of either sign
        for k in range(1, lagrange.MAX_ENUMERATED + 1):
            starts = np.arange(0, len(x) - k + 1, 2)
            subsets = ((np.arange(2 ** k)[:, None] >> np.arange(k)[None, :]) & 1).astype(bool)
            windows = sliding_window_view(x, k)[starts]
            want = np.array([[math.fsum(w[s]) for s in subsets] for w in windows])
            got = lagrange._subset_sums(x, k, starts)
            if exact:
                assert np.array_equal(got, want)
            else:  # k additions: a few units in the last place of the largest term
                np.testing.assert_allclose(got, want, rtol=0, atol=16 * k * np.finfo(float).eps * np.abs(x).max())


@pytest.mark.parametrize("nodes,overlap,resident", [(1, False, False), (4, False, False), (1, True, False),
                                                    (1, False, True)])
def test_the_scorer_is_the_timing_model_bit_for_bit(nodes, overlap, resident):
    """PlanScorer.total walks only what depends on the plan, from per-stage figures it keeps and resuming from its
    anchor (the one walk of passes/solver/figures.py, which timing._total runs on figures made afresh): the same value
    as timing._total for every plan a local search meets (saved activations, lazy offload and all; on 4 data-parallel
    nodes, each grad stage's all-reduce too); with overlapped iterations, timing.overlapped_period's; on one GPU
    whose hand-offs stay in its memory (and whose lazy offload gets half the room), the same."""
    pb = llama_like(8)
    if resident:  # one device, memory tight enough that the halved room binds the lazy offload
        pb = dataclasses.replace(llama_like(8, devices=1, memory_bytes=12 * 10**9), resident_handoffs=True)
    if nodes > 1:  # a network slow enough that the reduction shows
        pb = dataclasses.replace(pb, host=dataclasses.replace(pb.host, nodes=nodes, network_bytes_per_s=1e9))
    if overlap:  # a step long enough that it shows
        pb = dataclasses.replace(pb, host=HostLoad(optimizer_s=1.0, overlap_step=True, overlap_iterations=True))
    cuts = solve(pb, "dp").plan
    start = SegmentPlan(forward=cuts.forward, fused=cuts.fused, backward=cuts.backward,
                        saved=tuple(i < cuts.fused[0] and i % 3 != 2 for i in range(pb.n)))
    scorer = PlanScorer(pb)
    polish(pb, start, max_evaluations=300, scorer=scorer)
    flip_saves(pb, start, scorer=scorer)
    assert len(scorer.totals) > 100 and sum(any(k[3]) for k in scorer.totals) > 100
    for (fwd, fused, bwd, saved), value in scorer.totals.items():
        costs = ([scorer.stage("forward", a, b, saved) for a, b in fwd] + [scorer.stage("fused", *fused, saved)]
                 + [scorer.stage("backward", a, b, saved) for a, b in bwd])
        assert value == (overlapped_period if overlap else _total)(pb, costs, saved)


@pytest.mark.parametrize("nodes", [1, 4])
def test_a_scorer_resuming_from_its_anchor_gives_a_fresh_walks_value(nodes):
    """A candidate shares its first stages with the plan the search moves from (PlanScorer.anchor): its score
    resumes from that plan's walk, and is bit for bit a fresh scorer's — for every one-move neighbour and flip,
    and from an anchor unlike the candidates (other cuts, other flags) too."""
    pb = llama_like(8)
    if nodes > 1:
        pb = dataclasses.replace(pb, host=dataclasses.replace(pb.host, nodes=nodes, network_bytes_per_s=1e9))
    cuts = solve(pb, "dp").plan
    saved = tuple(i < cuts.fused[0] and i % 3 != 2 for i in range(pb.n))
    fwd, bwd = list(cuts.forward), list(cuts.backward)
    plans = [(f, bwd, saved) for f in _neighbours(fwd, descending=False)]
    plans += [(fwd, b, saved) for b in _neighbours(bwd, descending=True)]
    plans += [(fwd, bwd, saved[:i] + (not saved[i],) + saved[i + 1:]) for i in range(cuts.fused[0])]
    assert len(plans) > 50
    counts = []
    for anchor_plan in ((fwd, bwd, saved), (plans[0][0], bwd, (False,) * pb.n)):
        anchored = PlanScorer(pb)
        anchored.anchor(anchor_plan[0], cuts.fused, anchor_plan[1], anchor_plan[2])
        resumed = 0
        for f, b, flags in plans:
            got = anchored.total(f, cuts.fused, b, flags)
            assert anchored.recent is not None and anchored.base is not None
            resumed += anchored.recent.walk.ends[0] is anchored.base.walk.ends[0]  # the anchor's first stage kept
            assert got == PlanScorer(pb).total(f, cuts.fused, b, flags)
        counts.append(resumed)
    assert counts[0] >= 10 and counts[1] == 0  # the moves from it resumed; from a plan unlike them, none could


def test_check_and_plan_do_not_import_ortools_until_a_model_is_built():
    """OR-Tools (and pandas behind it) is imported by ``solve_budget`` only: ~0.2 s that ``rpcompile check`` and
    plans whose bounds close the gap first (llama-8b) never pay."""
    code = ("import sys, rpcompile.cli.plan_cmd, rpcompile.cli.plan_file_cmds, rpcompile.tools.staleness\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ortools', 'pandas')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_planning_a_meta_model_does_not_import_dynamo_and_costs_the_same_as_with_it():
    """torch imports TorchDynamo (~1 s) the first time a Python meta kernel runs (meta ``rms_norm``);
    ``without_dynamo_import`` avoids it for the passes, undoes itself, and changes no cost."""
    code = (
        "import sys, torch\n"
        "from rpcompile.models.registry import load_model\n"
        "from rpcompile.planner.plan_options import PlanOptions\n"
        "from rpcompile.planner.planning import prepare\n"
        "from rpcompile.passes.graph.meta import _dynamo_skipped\n"
        "ms = load_model('llama-demo', device='meta')\n"
        "def costs():\n"
        "    gm, _ = prepare(ms.model, ms.example_inputs, PlanOptions(gpus=2, spec='rtx4090', microbatches=2))\n"
        "    return [(n.name, n.meta.get('rpcompile.cost'), n.meta.get('rpcompile.shape')) for n in gm.graph.nodes]\n"
        "first = costs()\n"
        "print('dynamo', 'torch._dynamo' in sys.modules, len(_dynamo_skipped()) > 10,\n"
        "      any(getattr(f, '__dynamo_disable', None) is f for f in _dynamo_skipped()))\n"
        "import torch._dynamo\n"
        "print('same', costs() == first)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["dynamo False True False", "same True"]


def test_the_head_splits_share_the_time_limit_equally():
    """Each split's limit is known before any solve starts, so the splits can be solved at once."""
    assert split_limit(10.0, 2) == 5.0
    assert split_limit(10.0, 1) == 10.0
    assert split_limit(0.01, 2) == MIN_SHARE_S


def test_compile_plan_solves_the_first_split_in_a_child_and_the_plan_is_the_one_solved_here(monkeypatch, tmp_path):
    """The whole head's solve runs in a forked child while the 8-chunk split is prepared and solved in the caller;
    each gets half the limit, and the plan is the one made with everything in the caller."""
    import rpcompile.planner.planning as planning
    from rpcompile.models.registry import load_model
    from rpcompile.tools.plandiff import diff_plans

    record = tmp_path / "solves"

    def recording(problem, strategy="ilp", *, time_limit_s=10.0, seed=0, cache=True):
        with record.open("a") as f:  # a file: the child's memory is its own
            f.write(f"{time_limit_s} {os.getpid()}\n")
        return solve(problem, strategy, time_limit_s=time_limit_s, seed=seed)

    monkeypatch.setattr(planning, "cached_solve", recording)
    monkeypatch.setattr(background, "fork_cost_s", lambda: 0.0)  # whatever this worker holds: the fork pays
    ms = load_model("llama-demo")

    def made():
        return planning.compile_plan(ms.model, ms.example_inputs, PlanOptions(gpus=2, spec="rtx4090",
                                     time_limit_s=4.0), loss_fn=ms.loss_fn, example_target=ms.example_target).plan

    forked = made()
    solves = [line.split() for line in record.read_text().splitlines()]
    assert [float(limit) for limit, _ in solves] == [2.0, 2.0]
    in_child = {int(pid) != os.getpid() for _, pid in solves}
    assert in_child == ({True, False} if background.enabled() else {False})  # CI has two cores: one in a child
    monkeypatch.setenv(background.ENV, "off")
    assert not background.enabled()
    here = made()
    assert [int(line.split()[1]) for line in record.read_text().splitlines()[2:]] == [os.getpid()] * 2
    assert not diff_plans(forked, here).changed


def test_plans_of_one_graph_sharing_their_facts_are_those_made_alone():
    """``compare`` makes its four plans with one ``facts`` dict (fingerprint, inputs record, node parameters)."""
    from rpcompile.models.registry import load_model
    from rpcompile.passes.lower import to_plan
    from rpcompile.planner.planning import compare, prepare
    from rpcompile.planner.plan_options import make_hardware
    from rpcompile.passes.formulate import partition_problem

    ms = load_model("llama-demo")
    gm, m = prepare(ms.model, ms.example_inputs, PlanOptions(gpus=2, spec="rtx4090", head_chunks=1),
                    loss_fn=ms.loss_fn, example_target=ms.example_target)
    hw = make_hardware(2, "rtx4090", None)
    problem = partition_problem(gm, hardware=hw, microbatches=m)
    rows = compare(gm, hardware=hw, microbatches=m, time_limit_s=2)
    for name, (result, made) in rows.items():
        assert made == to_plan(gm, problem, result, hardware=hw, precision="fp32"), name
    assert len({made.inputs["options"]["strategy"] for _, made in rows.values()}) == len(rows)
