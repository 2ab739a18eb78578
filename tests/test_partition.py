"""Unit tests of the partition problem, the rules of a plan and the strategies (literal small cases); the timing
model's are in test_timing.py."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from rpcompile.core.errors import ConfigError, InfeasibleError, ProblemError
from rpcompile.passes.solver.balance import exact_balance
from rpcompile.passes.solver.ilp import solve_budget
from rpcompile.passes.solver.partition import STRATEGIES, solve
from rpcompile.passes.solver.polish import polish, taper
from rpcompile.passes.solver.problem import SegmentPlan, SharedParam
from rpcompile.passes.solver.segment_rules import validate_segment_plan
from rpcompile.passes.solver.tables import RangeTables, min_feasible_memory
from rpcompile.passes.solver.timing import iteration_time, stage_costs

from partition_cases import llama_like, tiny_chain


def _plan(forward, fused, backward, saved) -> SegmentPlan:
    return SegmentPlan(forward=tuple(forward), fused=tuple(fused), backward=tuple(backward), saved=tuple(saved))


# --- plan rules -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("plan, fragment", [
    (_plan([(0, 1), (2, 3)], (3, 4), [(0, 3)], (False,) * 4), "gap"),
    (_plan([(0, 2), (1, 3)], (3, 4), [(0, 3)], (False,) * 4), "overlap"),
    (_plan([(1, 3), (0, 1)], (3, 4), [(0, 3)], (False,) * 4), "ascending"),
    (_plan([(0, 3)], (3, 4), [(0, 1), (1, 3)], (False,) * 4), "descending"),
    (_plan([(0, 3)], (2, 3), [(0, 3)], (False,) * 4), "fused stage must be"),
    (_plan([(0, 3)], (3, 4), [(0, 3)], (False,) * 3), "saved has 3 flags"),
    (_plan([(0, 3)], (3, 4), [(0, 3)], (False, False, False, True)), "in the fused stage"),
    (_plan([], (3, 4), [(0, 3)], (False,) * 4), "forward stages: there are 0"),
    (_plan([(0, 3)], (3, 4), [(1, 3)], (False,) * 4), "must reach 0"),
    (_plan([(0, 0), (0, 3)], (3, 4), [(0, 3)], (False,) * 4), "empty"),
])
def test_validate_catches_each_rule(plan, fragment):
    problems = validate_segment_plan(tiny_chain(4), plan)
    assert any(fragment in p for p in problems), problems


def test_validate_reports_every_problem_at_once():
    problems = validate_segment_plan(tiny_chain(4), _plan([(0, 1), (2, 3)], (3, 4), [(0, 2)], (False,) * 3))
    assert len(problems) == 3


def test_validate_memory_and_saving_rules():
    pb = tiny_chain(4, memory_bytes=500, allow_save=False)
    problems = validate_segment_plan(pb, _plan([(0, 3)], (3, 4), [(0, 3)], (True, False, False, False)))
    assert any("allow_save=False" in p for p in problems)
    problems = validate_segment_plan(pb, _plan([(0, 3)], (3, 4), [(0, 3)], (False,) * 4))
    assert problems and all("needs" in p and "device has" in p for p in problems)
    assert validate_segment_plan(pb, _plan([(0, 3)], (3, 4), [(0, 3)], (False,) * 4), memory=False) == []


def test_problem_validation_messages():
    with pytest.raises(ProblemError, match="fwd_s has 3 entries but there are 4 segments"):
        tiny_chain(4, fwd_s=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="non-decreasing"):
        tiny_chain(4, layer=(0, 2, 1, 3))
    with pytest.raises(ValueError, match=r"act_bytes\[1\] = -1"):
        tiny_chain(4, act_bytes=(1, -1, 1, 1))
    with pytest.raises(ValueError, match="segments < 4"):
        tiny_chain(4, shared=(SharedParam(name="w", bytes=1, grad_bytes=1, segments=(0, 4)),))
    assert isinstance(tiny_chain(3, fwd_s=[1.0, 2.0, 3.0]).fwd_s, tuple)


# --- memory and infeasibility --------------------------------------------------------------------------------

def test_min_feasible_memory_is_the_single_segment_bound():
    pb = tiny_chain(4, act_bytes=(10, 10, 70, 10))
    need, seg = min_feasible_memory(pb)
    # the backward stage [2, 3) alone: W 100 + G 100 + P 100 + in 4 + out 4 + act 70 + the next input 4
    assert (need, seg) == (382, 2)
    assert solve(tiny_chain(4, act_bytes=(10, 10, 70, 10), memory_bytes=need), "dp").feasible


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_infeasible_problem_is_a_result_naming_the_segment(strategy):
    pb = tiny_chain(4, act_bytes=(10, 10, 70, 10), memory_bytes=381)
    res = solve(pb, strategy)
    assert not res.feasible and res.plan is None and res.objective == math.inf
    text = str(res.stats)
    assert "s2" in text  # the segment that sets the memory floor, named in the reason or a violation


def test_require_plan_raises_infeasible_error_with_the_reason():
    pb = tiny_chain(4, act_bytes=(10, 10, 70, 10), memory_bytes=381)
    with pytest.raises(InfeasibleError, match=r"dp: no partition fits: the best plan needs 382 B .*segment: s2"):
        solve(pb, "dp").require_plan()
    assert solve(tiny_chain(4), "dp").require_plan() is not None


def test_unknown_strategy():
    with pytest.raises(ConfigError, match="unknown partition strategy 'magic'"):
        solve(tiny_chain(3), "magic")


# --- baselines ----------------------------------------------------------------------------------------------

def test_uniform_eight_layers_on_four_devices():
    pb = tiny_chain(16, layer=tuple(i // 2 for i in range(16)), devices=4, memory_bytes=10**9)
    res = solve(pb, "uniform")
    assert res.feasible
    assert res.plan == _plan([(0, 4), (4, 8), (8, 12)], (12, 16), [(8, 12), (4, 8), (0, 4)], (False,) * 16)


def test_uniform_uneven_layers_give_the_first_groups_one_more():
    pb = tiny_chain(5, devices=2, memory_bytes=10**9)
    assert solve(pb, "uniform").plan.forward == ((0, 3),)


def test_roundpipe_small_example_by_hand():
    # layers: fwd 1, bwd 2, rec 1 -> backward cost 3, fused cost 3; Tmax = 3; candidates in [3, 3.3]: {3}
    # fused: layer 3 alone (3 + 3 > 3.3); forward from layer 2 down, 3 per stage: [0,3); backward 1 per stage
    pb = tiny_chain(4, devices=2, memory_bytes=10**9)
    res = solve(pb, "roundpipe")
    assert res.plan == _plan([(0, 3)], (3, 4), [(2, 3), (1, 2), (0, 1)], (False,) * 4)
    assert res.stats["bottleneck_s"] == 3.0 and res.stats["roundpipe_cost_s"] == 5 * 3.0


def test_roundpipe_cuts_only_at_layer_boundaries():
    pb = tiny_chain(8, layer=(0, 0, 1, 1, 2, 2, 3, 3), devices=2, memory_bytes=10**9)
    plan = solve(pb, "roundpipe").plan
    cuts = {a for a, _ in plan.forward + plan.backward} | {plan.fused[0]}
    assert cuts <= {0, 2, 4, 6}


def test_dp_beats_or_matches_layer_baselines_and_ilp_beats_all():
    pb = llama_like(8, devices=4, microbatches=6)
    results = {s: solve(pb, s, time_limit_s=3.0) for s in ("uniform", "roundpipe", "dp", "ilp")}
    assert all(r.feasible for r in results.values())
    for name in ("uniform", "roundpipe", "dp"):
        assert results["ilp"].objective <= results[name].objective * (1 + 1e-9), name
    stats = results["ilp"].stats
    assert stats["bound_s"] <= stats["model_best_s"] * (1 + 1e-9)
    for key in ("gap", "status", "stages_forward", "stages_backward", "saved_segments", "candidates_tried"):
        assert key in stats


def test_solver_modules_do_not_import_torch():
    code = ("import sys; import rpcompile.passes.solver.partition, rpcompile.passes.solver.ilp, "
            "rpcompile.passes.solver.problem, rpcompile.passes.solver.timing, rpcompile.passes.solver.segment_rules, "
            "rpcompile.passes.solver.tables; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cpsat_budget_regression_large_time_scale():
    """At 1e9 time units per bound CP-SAT 9.15 proved a wrong optimum (4.0) on this chain; the DP's 3.5 is right."""
    pb = tiny_chain(9, layer=(0,) * 9, fwd_s=(1.0, 1.0, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 1.0),
                    bwd_s=(1.0, 1.0, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 1.0),
                    rec_s=(0.5, 0.5, 0.5, 0.5, 0.25, 1.0, 0.5, 0.5, 0.5), act_bytes=(0,) * 9, peak_bytes=(0,) * 9,
                    boundary_bytes=(1, 1, 1, 10, 1, 1, 1, 1, 1), input_bytes=0,
                    param_bytes=(0, 0, 3, 0, 4, 1, 1, 3, 0), grad_bytes=(0, 0, 3, 0, 4, 1, 1, 3, 0), devices=1,
                    microbatches=1, memory_bytes=18, link_bytes_per_s=300.0, allow_save=False)
    t = RangeTables.build(pb)
    assert exact_balance(pb, t, every_count=True).t_star[9] == 3.5
    res = solve_budget(pb, t, t.bwd_time, 9, ub=6.06, det_time=20.0)
    assert res.status == "OPTIMAL"
    assert max(c.time_s for c in stage_costs(pb, res.plan)) == pytest.approx(3.5, rel=1e-6)
    assert np.isclose(res.bound_s, 3.5, rtol=1e-6)


def test_polish_flips_checkpointing_choices_both_ways():
    # recompute everywhere over a fast link: saving costs nothing, so the polished plan saves and is faster
    pb = tiny_chain(6, devices=2, microbatches=3)
    plan = SegmentPlan(forward=((0, 3), (3, 5)), fused=(5, 6), backward=((3, 5), (0, 3)), saved=(False,) * 6)
    better = polish(pb, plan)
    assert iteration_time(pb, better) < iteration_time(pb, plan) * (1 - 1e-6)
    assert any(better.saved) and not better.saved[5]  # never inside the fused stage
    assert validate_segment_plan(pb, better) == []
    # saving everything over a slow link: every forward stage waits 10 s per saved segment for its copies while
    # recomputing one takes 1 s, so the polished plan recomputes
    slow = tiny_chain(6, devices=2, microbatches=3, act_bytes=(10**6,) * 6, link_bytes_per_s=1e5,
                      memory_bytes=10**9)
    hoard = SegmentPlan(forward=((0, 3), (3, 5)), fused=(5, 6), backward=((3, 5), (0, 3)),
                        saved=(True,) * 5 + (False,))
    thrift = polish(slow, hoard)
    assert iteration_time(slow, thrift) < iteration_time(slow, hoard) * (1 - 1e-6)
    assert sum(thrift.saved) < 5
    assert validate_segment_plan(slow, thrift) == []


def test_taper_grows_the_stages_from_both_ends():
    """24 equal segments on 4 devices, 8 microbatches; forward stages of 4 segments (4 s) and backward stages of 2
    (6 s with recompute). Re-cut so that stages grow from the pipeline's ends — forward 1, 1, 2, 4, … s and the
    last seven backward stages one segment (3 s) each — the fill and the drain shorten: 220 s → 204 s, with the
    same saved flags and every stage valid."""
    pb = tiny_chain(24, devices=4, microbatches=8)
    plan = SegmentPlan(forward=((0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 23)), fused=(23, 24),
                       backward=((22, 23),) + tuple((a, a + 2) for a in range(20, -1, -2)), saved=(False,) * 24)
    assert iteration_time(pb, plan) == pytest.approx(220.0)
    tapered = taper(pb, plan)
    assert iteration_time(pb, tapered) == pytest.approx(204.0)
    assert tapered.forward[:4] == ((0, 1), (1, 2), (2, 4), (4, 8)) and tapered.saved == plan.saved
    assert tapered.backward[-7:] == tuple((a, a + 1) for a in range(6, -1, -1))
    times = [c.time_s for c in stage_costs(pb, tapered)]
    assert times[:4] == pytest.approx([1.0, 1.0, 2.0, 4.0]) and times[-8:] == pytest.approx([6.0] + [3.0] * 7)
    assert validate_segment_plan(pb, tapered) == []


def test_the_winner_s_checkpointing_is_settled_after_its_cuts_settle():
    """Flips of save ↔ recompute and cut moves alternate until neither gains: Llama-3-8B planned for overlapped
    iterations on 8 RTX 4090s (as ``benchmarks/overlap.py`` plans it) ends where no single flip is faster. With one
    round of flips, the cuts that settled after it made two more flips pay (0.7% of the period, and 1.5 points of
    simulated bubble: the saves' copies bound their stages)."""
    from rpcompile.models.registry import load_model
    from rpcompile.passes.formulate import partition_problem
    from rpcompile.passes.solver.polish import flip_saves
    from rpcompile.planner.plan_options import PlanOptions, make_hardware
    from rpcompile.planner.planning import prepare

    ms = load_model("llama-8b", batch_size=16, seq_len=4096)
    gm, _ = prepare(ms.model, ms.example_inputs, PlanOptions(gpus=8, spec="rtx4090", microbatches=16,
                                                             precision="bf16", progress=False, head_chunks=1))
    pb = partition_problem(gm, hardware=make_hardware(8, "rtx4090"), microbatches=16, precision="bf16",
                           overlap_iterations=True)
    plan = solve(pb, "ilp", time_limit_s=30.0).plan  # counts stop it (~5 s), not the wall-clock guard
    flipped = flip_saves(pb, plan, max_sweeps=10)
    assert flipped.saved == plan.saved
