"""The timing model (:mod:`rpcompile.passes.solver.timing`): stage costs, the event recurrence, transfer edges, lazy
offload.

Literal examples worked by hand, the recurrence against a plain event simulation, and the model against the
simulator, which plays the very same :class:`~rpcompile.core.stages.StageCost` list.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rpcompile
from rpcompile.core.errors import ConfigError, ProblemError
from rpcompile.core.schedule import round_robin, steady_period
from rpcompile.core.specs import HostSpec
from rpcompile.core.stages import HostLoad, StageCost
from rpcompile.passes.formulate import host_load
from rpcompile.models.registry import load_model
from rpcompile.passes.solver.partition import solve
from rpcompile.passes.solver.problem import PartitionProblem, SegmentPlan, SharedParam
from rpcompile.passes.solver.recurrence import equal_time_factor, host_lane_end, overlapped_ends
from rpcompile.passes.solver.segment_rules import validate_segment_plan
from rpcompile.passes.solver.tables import RangeTables
from rpcompile.passes.solver.timing import (bubble_fraction, host_times, iteration_time,
                                            offload_backlog, pipeline_time, plan_memory, save_reads, stage_costs,
                                            transfer_edges)
from rpcompile.runtime.sim.simulator import simulate
from rpcompile.tools.scenarios import from_plan, from_segment_plan

from partition_cases import llama_like, tiny_chain


def _plan(forward, fused, backward, saved) -> SegmentPlan:
    return SegmentPlan(forward=tuple(forward), fused=tuple(fused), backward=tuple(backward), saved=tuple(saved))


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_equal_time_iteration_matches_design_formula(devices):
    for m in range(devices, devices + 10):
        for stages in range(1, 40):
            formula = ((stages - 1) // devices) * m + (stages - 1) % devices + m
            assert pipeline_time([0.25] * stages, devices, m) == pytest.approx(formula * 0.25, rel=1e-12)
            assert equal_time_factor(stages, devices, m) == formula


def _reference_iteration(times, devices, m, weight_s, grad_s, handoff_s, out_s=None, save_s=None, reads=None,
                         prefetch_s=None):
    """The recurrence as its docstring states it, one event at a time."""
    end, land = {}, {}
    for k, t in enumerate(times):
        for j in range(m):
            start = max(end.get((k, j - 1), 0.0), end.get((k - 1, j), -math.inf) + handoff_s[k],
                        end.get((k - devices, m - 1), 0.0))
            if j == 0:  # the weights go up from the device's previous stage's start (or from 0)
                before = end[(k - devices, 0)] - times[k - devices] if k >= devices else 0.0
                start = max(start, before + weight_s[k])
            for f in (reads[k] if reads else ()):  # the saves it reads have landed and come up
                if save_s[f] > 0:
                    start = max(start, land[(f, j)] + prefetch_s[k])
            end[(k, j)] = start + t
            if save_s and save_s[k] > 0:  # its outputs go down, then its saves, microbatch after microbatch
                land[(k, j)] = max(land.get((k, j - 1), 0.0), end[(k, j)] + out_s[k]) + save_s[k]
    return max(end[(k, m - 1)] + grad_s[k] for k in range(len(times)))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.01, 2.0), min_size=1, max_size=20), st.integers(1, 5), st.integers(1, 8),
       st.data())
def test_pipeline_time_matches_the_recurrence_event_by_event(times, devices, m, data):
    edges = st.lists(st.floats(0.0, 1.0), min_size=len(times), max_size=len(times))
    weight_s, grad_s, handoff_s = data.draw(edges), data.draw(edges), data.draw(edges)
    expected = _reference_iteration(times, devices, m, weight_s, grad_s, handoff_s)
    got = pipeline_time(times, devices, m, weight_s=weight_s, grad_s=grad_s, handoff_s=handoff_s)
    assert got == pytest.approx(expected, rel=1e-12)
    # with saved activations going down lazily: some stages save, later ones wait for what they read
    save_s = [x if i % 2 == 0 else 0.0 for i, x in enumerate(data.draw(edges))]
    out_s, prefetch_s = data.draw(edges), data.draw(edges)
    reads = [tuple(sorted(data.draw(st.sets(st.integers(0, k - 1), max_size=3)))) if k else () for k in range(len(times))]
    lazy = dict(out_s=out_s, save_s=save_s, reads=reads, prefetch_s=prefetch_s)
    expected = _reference_iteration(times, devices, m, weight_s, grad_s, handoff_s, **lazy)
    got = pipeline_time(times, devices, m, weight_s=weight_s, grad_s=grad_s, handoff_s=handoff_s, **lazy)
    assert got == pytest.approx(expected, rel=1e-12)


def test_fewer_microbatches_than_devices_is_a_chain():
    # m < N: no stage ever waits for its device, so the last microbatch leaves after (S - 1 + m) stage times
    assert pipeline_time([1.0] * 5, 8, 2) == pytest.approx(6.0)


def _three_stage_problem(**kw) -> PartitionProblem:
    fields = dict(
        names=("a", "b"), layer=(0, 1), fwd_s=(1.0, 2.0), bwd_s=(3.0, 4.0), rec_s=(0.5, 0.7), act_bytes=(100, 200),
        peak_bytes=(10, 20), boundary_bytes=(40, 50), input_bytes=30, param_bytes=(1000, 2000),
        grad_bytes=(1000, 0), device_count=2, memory_bytes=10**6, link_bytes_per_s=100.0, microbatches=2,
        stage_overhead_s=0.1,
    )
    fields.update(kw)
    return PartitionProblem(**fields)


def test_stage_costs_three_stage_example_by_hand():
    pb = _three_stage_problem()
    plan = _plan([(0, 1)], (1, 2), [(0, 1)], (True, False))
    f0, fb, b1 = stage_costs(pb, plan)
    # F0 [0,1): up = input 30 + W/m 1000/2; down = boundary 40 + saved act 100; P = max W = 2000 (the fused stage)
    assert (f0.kind, f0.start, f0.stop) == ("forward", 0, 1)
    assert (f0.compute_s, f0.upload_bytes, f0.download_bytes) == (1.0, 530.0, 140.0)
    assert f0.time_s == pytest.approx(0.1 + 5.3)
    # working: input 30 + boundary 40 + peak 10 + the 100 saved bytes it holds until they are copied out, and the
    # previous microbatch's 100 still going down (double buffering)
    assert (f0.weight_bytes, f0.grad_bytes, f0.memory_bytes) == (1000, 0, 1000 + 2000 + 30 + 40 + 10 + 100 + 100)
    assert f0.working_bytes == 30 + 40 + 10 + 100
    # FB [1,2): compute fwd+bwd; up = boundary 40 + 2000/2; down = grad of boundary 40 + G/m 0
    assert (fb.kind, fb.compute_s, fb.upload_bytes, fb.download_bytes) == ("fused", 6.0, 1040.0, 40.0)
    assert fb.time_s == pytest.approx(0.1 + 10.4)
    assert fb.memory_bytes == 2000 + 0 + 2000 + 40 + 50 + 200
    # B1 [0,1): saved -> no recompute; up = input 30 + grad 40 + saved 100 + W/m 500; down = G/m (a == 0)
    assert (b1.kind, b1.compute_s, b1.upload_bytes, b1.download_bytes) == ("backward", 3.0, 670.0, 500.0)
    assert b1.time_s == pytest.approx(0.1 + 6.7)
    # + the next microbatch's input 30 and saved 100, prefetched
    assert b1.memory_bytes == 1000 + 1000 + 2000 + 30 + 40 + 100 + 30 + 100
    # the event recurrence by hand: F0 ends 5.4/10.8, FB 15.9/26.4, B1 (device 0 again) 22.7/33.2
    assert pipeline_time([c.time_s for c in (f0, fb, b1)], 2, 2) == pytest.approx(33.2)
    # the hand-offs: FB waits for F0's 40-byte output (0.4 s down, 0.4 s up; F0 is bound by its copies, so its
    # time covers the way down: 0.4 s), B1 for FB's 40-byte gradient (likewise 0.4 s)
    assert [round(h, 9) for h in transfer_edges(pb, (f0, fb, b1))["handoff_s"]] == [0.0, 0.4, 0.4]
    # with the weights' uploads (100 B/s: F0 10 s and FB 20 s from t = 0, B1 10 s from F0's start) and B1's
    # gradients (10 s) after its last microbatch: F0 runs 10–15.4/20.8, FB 20–30.5/41.0, B1 30.9–37.7/41.4–48.2
    assert iteration_time(pb, plan) == pytest.approx(48.2 + 10.0)
    assert plan_memory(pb, plan) == 4300
    busy = 2 * (5.4 + 10.5 + 6.8)
    assert bubble_fraction(pb, plan) == pytest.approx(1 - busy / (2 * 58.2))


def test_a_grad_stage_holds_its_largest_backward_transient_not_their_sum():
    """Nodes run backward one at a time: a fused or backward stage's memory rises by the largest transient of its
    segments; a forward stage computes no gradients and is unchanged. The range tables the solvers read agree."""
    plain = _three_stage_problem(names=("a", "b", "c"), layer=(0, 1, 2), fwd_s=(1.0,) * 3, bwd_s=(1.0,) * 3,
                                 rec_s=(1.0,) * 3, act_bytes=(100,) * 3, peak_bytes=(10,) * 3,
                                 boundary_bytes=(40,) * 3, param_bytes=(1000,) * 3, grad_bytes=(1000,) * 3)
    hot = dataclasses.replace(plain, transient_bytes=(700, 300, 5000))
    assert plain.transient_bytes == (0, 0, 0)
    plan = _plan([(0, 2)], (2, 3), [(0, 2)], (False, False, False))
    before, after = stage_costs(plain, plan), stage_costs(hot, plan)
    assert [b.memory_bytes - a.memory_bytes for a, b in zip(before, after)] == [0, 5000, 700]
    assert plan_memory(hot, plan) == after[1].memory_bytes > plan_memory(plain, plan)  # the fused stage now binds
    t0, t1 = RangeTables.build(plain), RangeTables.build(hot)
    assert t1.bwd_need[0, 2] - t0.bwd_need[0, 2] == 700 and t1.fwd_need[0, 2] == t0.fwd_need[0, 2]
    assert t1.fused_need[2] - t0.fused_need[2] == 5000 and t1.fused_need[1] - t0.fused_need[1] == 5000
    with pytest.raises(ProblemError, match=r"transient_bytes\[1\] = -1 must be a non-negative int"):
        dataclasses.replace(plain, transient_bytes=(0, -1, 0))
    with pytest.raises(ProblemError, match="transient_bytes has 2 entries but there are 3 segments"):
        dataclasses.replace(plain, transient_bytes=(0, 1))


def test_recompute_instead_of_save():
    pb = _three_stage_problem()
    plan = _plan([(0, 1)], (1, 2), [(0, 1)], (False, False))
    f0, _, b1 = stage_costs(pb, plan)
    assert f0.download_bytes == 40.0 and b1.compute_s == 3.5 and b1.upload_bytes == 570.0


def test_tied_parameter_counts_once_per_stage_that_uses_it():
    emb = SharedParam(name="embed.weight", bytes=500, grad_bytes=500, segments=(0, 3))
    pb = tiny_chain(4, shared=(emb,))
    whole = _plan([(0, 3)], (3, 4), [(0, 3)], (False,) * 4)
    split = _plan([(0, 1), (1, 3)], (3, 4), [(1, 3), (0, 1)], (False,) * 4)
    one = _plan([], (0, 4), [], (False,) * 4)
    assert [c.weight_bytes for c in stage_costs(pb, whole)] == [300 + 500, 100 + 500, 300 + 500]
    assert [c.weight_bytes for c in stage_costs(pb, split)] == [600, 200, 600, 200, 600]
    assert [c.grad_bytes for c in stage_costs(pb, split)] == [0, 0, 600, 200, 600]
    assert stage_costs(pb, one)[0].weight_bytes == 400 + 500  # first and last segment together: once


def test_one_stage_cost_serves_the_timing_model_and_the_simulator():
    """A StageCost's link load is its four per-microbatch flows plus the amortised weights and gradients; the stage
    time the model computes is built from exactly those, and the simulator plays the same objects (its compute
    adds the overhead, its working set leaves out the input buffers its copies hold)."""
    pb = _three_stage_problem()
    m, link = pb.microbatches, pb.link_bytes_per_s
    f0, fb, b1 = stage_costs(pb, _plan([(0, 1)], (1, 2), [(0, 1)], (True, False)), lazy_offload=False)
    for c in (f0, fb, b1):
        assert c.upload_bytes == c.input_bytes + c.prefetch_bytes + c.weight_bytes / m
        assert c.download_bytes == c.output_bytes + c.offload_bytes + c.grad_bytes / m
        assert c.time_s == c.overhead_s + max(c.compute_s, c.upload_bytes / link, c.download_bytes / link)
    # F0 [0,1): the model inputs (in host memory already: no hand-off), output 40 down, 100 saved bytes offloaded
    assert (f0.input_bytes, f0.prefetch_bytes, f0.output_bytes, f0.offload_bytes, f0.handoff_bytes) == (30, 0, 40, 100, 0)
    # B1 [0,1): its output gradient 40 waits for FB; input 30 and saved 100 are prefetched; input gradient: none
    assert (b1.input_bytes, b1.prefetch_bytes, b1.output_bytes, b1.handoff_bytes) == (40, 130, 0, 40)
    assert b1.device_working_bytes == b1.working_bytes - 40 - 130
    sc = from_segment_plan(pb, _plan([(0, 1)], (1, 2), [(0, 1)], (True, False)), name="ilp")
    assert all(isinstance(s, StageCost) for s in sc.stages) and [s.name for s in sc.stages] == ["F0", "FB", "B1"]
    assert [s.saved_by for s in sc.stages] == [(), (), (0,)]


def test_weights_go_up_with_what_the_stage_before_leaves_of_the_link():
    """One device, m = 2, a 10 B/s link; stages F0 (400 B of weights), FB (100 B), B1 (400 B). F0's weights go up
    from the start at the full rate: 40 s. FB's go up behind F0's activation copies (4 B per 20.4 s microbatch):
    100 B at 9.80 B/s, 10.2 s. B1's behind FB's, which upload 40 B per 9 s microbatch: 5.56 B/s for FB's 18 s
    (100 B), then the other 300 B at the full rate: 48 s, where a full link would have taken 40 s."""
    pb = tiny_chain(2, devices=1, microbatches=2, link_bytes_per_s=10.0, boundary_bytes=(40, 0),
                    param_bytes=(400, 100), grad_bytes=(400, 100))
    plan = SegmentPlan(forward=((0, 1),), fused=(1, 2), backward=((0, 1),), saved=(False, False))
    costs = stage_costs(pb, plan, lazy_offload=False)
    assert [c.time_s for c in costs] == pytest.approx([20.4, 9.0, 24.4])
    assert transfer_edges(pb, costs)["weight_s"] == pytest.approx([40.0, 10.2, 48.0])


def test_handoff_lengthens_the_fill_by_the_wide_cut():
    # two plans of equal stage times; the one whose cut crosses a wide tensor waits longer for each hand-off
    narrow = tiny_chain(4, devices=2, microbatches=2, boundary_bytes=(4, 4, 4, 4), link_bytes_per_s=100.0)
    wide = tiny_chain(4, devices=2, microbatches=2, boundary_bytes=(4, 40, 4, 4), link_bytes_per_s=100.0)
    plan = SegmentPlan(forward=((0, 2), (2, 3)), fused=(3, 4), backward=((2, 3), (0, 2)), saved=(False,) * 4)
    f1 = stage_costs(wide, plan)[1]
    assert f1.handoff_bytes == 40 and stage_costs(wide, plan)[0].handoff_bytes == 0
    # 40 bytes down and up at 100 B/s: 0.8 s instead of 0.08 s before F1's first microbatch
    assert iteration_time(wide, plan) > iteration_time(narrow, plan)
    edges = transfer_edges(wide, stage_costs(wide, plan))["handoff_s"]
    assert edges[1] == pytest.approx(0.8)


def _offload_problem(memory_bytes: int) -> PartitionProblem:
    """F0 [0,1) on device 0 computes 1 s per microbatch and saves 300 bytes at 100 B/s (3 s), FB [1,2) on device 1,
    B1 [0,1) back on device 0; no weights, 2 microbatches."""
    return _three_stage_problem(act_bytes=(300, 10), param_bytes=(0, 0), grad_bytes=(0, 0), stage_overhead_s=0.0,
                                memory_bytes=memory_bytes)


def test_saved_activations_go_down_lazily_in_the_timing_model():
    plan = _plan([(0, 1)], (1, 2), [(0, 1)], (True, False))
    roomy = _offload_problem(10**6)
    eager = stage_costs(roomy, plan, lazy_offload=False)
    assert eager[0].time_s == pytest.approx(3.4)  # its 40-byte output and 300 saved bytes: 3.4 s of link
    f0, fb, b1 = stage_costs(roomy, plan)
    # lazily it waits only for its output (0.4 s): compute-bound, 1 s. Each microbatch's 1 s moves 100 − 40 = 60
    # saved bytes, so 2 × (300 − 60) = 480 bytes are left on the device when it ends
    assert f0.time_s == pytest.approx(1.0) and f0.backlog_bytes == 480
    assert f0.memory_bytes == eager[0].memory_bytes  # the backlog is beside what the stage needs
    # B1 (device 0 again) uploads 30 + 40 + 300 bytes per microbatch (3.7 s) and downloads nothing: the backlog
    # goes down during it; it holds the 480 bytes when it starts
    assert b1.time_s == eager[2].time_s and b1.backlog_bytes == 480 and b1.memory_bytes == eager[2].memory_bytes
    assert fb == eager[1]
    assert offload_backlog(roomy, (f0, fb, b1)) == (f0, fb, b1)  # applying it twice changes nothing
    assert iteration_time(roomy, plan) < pipeline_time([c.time_s for c in eager], 2, 2, **transfer_edges(roomy, eager))
    # with room for 200 bytes beside device 0's largest stage, F0 must move 2 × 300 − 200 = 400 bytes while it
    # runs: 200 per microbatch plus its 40-byte output, 2.4 s
    base = max(eager[0].memory_bytes, eager[2].memory_bytes)
    tight = _offload_problem(base + 200)
    f0, _, b1 = stage_costs(tight, plan)
    assert f0.time_s == pytest.approx(2.4) and f0.backlog_bytes == 200
    assert f0.memory_bytes + f0.backlog_bytes <= tight.memory_bytes
    assert b1.memory_bytes + b1.backlog_bytes <= tight.memory_bytes
    assert validate_segment_plan(tight, plan) == []
    # no room at all: the eager copies' time
    assert stage_costs(_offload_problem(base), plan)[0].time_s == pytest.approx(3.4)


def test_a_stage_reading_saves_waits_until_they_have_landed():
    """Stage 0 computes 1 s per microbatch, sends its output down (0.5 s) and then its saves (2 s): microbatch 0's
    land at 3.5 s, microbatch 1's at 5.5 s. Stage 1 reads them (0.5 s to upload): it starts at 4 s and 6 s."""
    edges = dict(out_s=[0.5, 0.0], save_s=[2.0, 0.0], reads=[(), (0,)], prefetch_s=[0.0, 0.5])
    assert pipeline_time([1.0, 1.0], 2, 2) == pytest.approx(3.0)
    assert pipeline_time([1.0, 1.0], 2, 2, **edges) == pytest.approx(7.0)


@pytest.mark.parametrize("act,tolerance", [(15, 0.02), (30, 0.03)])
def test_lazy_offload_model_agrees_with_the_simulator(act, tolerance):
    """Link-bound forward stages (each saves 1.5 or 3 s of copies per 1 s of compute) on 2 devices: the model's
    iteration time is the simulator's within 2–3%, and both beat the eager copies. At 3 s of copies per second
    the backward stages wait for saves still going down; without that edge the model would be 7% short."""
    pb = tiny_chain(6, devices=2, microbatches=4, act_bytes=(act,) * 6, boundary_bytes=(1,) * 6,
                    link_bytes_per_s=10.0, param_bytes=(0,) * 6, grad_bytes=(0,) * 6, memory_bytes=10**5)
    plan = SegmentPlan(forward=((0, 1), (1, 2), (2, 3), (3, 4), (4, 5)), fused=(5, 6),
                       backward=((4, 5), (3, 4), (2, 3), (1, 2), (0, 1)), saved=(True,) * 5 + (False,))
    costs = stage_costs(pb, plan)
    eager = stage_costs(pb, plan, lazy_offload=False)
    assert all(c.time_s == pytest.approx(1.0) for c in costs[:5]) and all(c.time_s > 1.5 for c in eager[:5])
    sim = from_segment_plan(pb, plan, name="ilp").run()
    model = iteration_time(pb, plan)
    assert sim.iteration_time_s == pytest.approx(model, rel=tolerance)
    assert sim.iteration_time_s < pipeline_time([c.time_s for c in eager], 2, 4, **transfer_edges(pb, eager))
    blind = pipeline_time([c.time_s for c in costs], 2, 4, **transfer_edges(pb, costs))  # no landing edges
    assert (model - blind) / model == pytest.approx(0.051 if act == 30 else 0.0, abs=0.01)


def test_a_forward_stage_whose_saves_are_empty_is_nobody_s_dependency():
    """F0 saves a segment of 0 bytes (nothing goes down): the backward stage that reads it waits for nothing, in
    the timing model and in the simulator (which once refused the plan: "position 0 saves no activations")."""
    pb = tiny_chain(4, devices=2, microbatches=2, act_bytes=(0, 10, 10, 10), link_bytes_per_s=100.0)
    plan = SegmentPlan(forward=((0, 1), (1, 3)), fused=(3, 4), backward=((1, 3), (0, 1)),
                       saved=(True, True, False, False))
    costs = stage_costs(pb, plan)
    assert costs[0].offload_bytes == 0 and costs[1].offload_bytes == 10
    assert save_reads(costs, plan.saved) == [(), (), (), (1,), ()]
    sim = from_segment_plan(pb, plan, name="ilp").run()
    assert sim.iteration_time_s == pytest.approx(iteration_time(pb, plan), rel=0.05)


# ---- host work (HostLoad): accumulation on one host thread, the optimizer step and copy refresh -------------
def test_one_gpu_keeps_its_hand_offs_off_the_link():
    """One GPU (``resident_handoffs``): a stage's outputs, a backward stage's output gradients and the input it
    recomputes from stay in device memory, so only the model inputs come up and only what the host reads (the
    input gradient of host-looked-up rows) goes down; memory is what it was (the tensors are on the device either
    way). By hand, the three-stage example on one device, nothing saved: F0 uploads input 30 + W/m 500 and
    downloads nothing; FB uploads W/m 1000 and downloads nothing; B1 uploads its input 30 (the model's: a = 0)
    + W/m 500 and downloads G/m 500."""
    plan = _plan([(0, 1)], (1, 2), [(0, 1)], (False, False))
    roundtrip = _three_stage_problem(device_count=1)
    kept = dataclasses.replace(roundtrip, resident_handoffs=True)
    f0, fb, b1 = stage_costs(kept, plan)
    assert (f0.input_bytes, f0.output_bytes, f0.upload_bytes, f0.download_bytes) == (30, 0, 530.0, 0.0)
    assert (fb.input_bytes, fb.output_bytes, fb.upload_bytes, fb.download_bytes) == (0, 0, 1000.0, 0.0)
    assert (b1.input_bytes, b1.prefetch_bytes, b1.output_bytes) == (0, 30, 0)
    assert (b1.upload_bytes, b1.download_bytes) == (530.0, 500.0)
    assert [c.handoff_bytes for c in (f0, fb, b1)] == [0, 0, 0]
    assert transfer_edges(kept, (f0, fb, b1))["handoff_s"] == [0.0, 0.0, 0.0]
    before = stage_costs(roundtrip, plan)
    assert [c.memory_bytes for c in before] == [c.memory_bytes for c in (f0, fb, b1)]
    assert iteration_time(kept, plan) < iteration_time(roundtrip, plan)
    # the host's rows' gradient still goes home from the stage that runs segment 0's backward
    rows = dataclasses.replace(kept, input_grad_bytes=70)
    assert stage_costs(rows, plan)[2].output_bytes == 70
    # the solvers' tables price the same links
    t = RangeTables.build(kept)
    assert t.in_bytes.tolist() == [30, 0, 0] and t.out_bytes.tolist() == [0, 0, 0]
    assert t.fwd_time[0, 1] == pytest.approx(f0.time_s) and t.fused_time[1] == pytest.approx(fb.time_s)
    assert t.bwd_time[0, 1] == pytest.approx(b1.time_s) and t.bwd_need[0, 1] + 2000 == b1.memory_bytes


def test_one_gpu_gives_the_lazy_offload_half_the_room():
    """The runtime shares what one GPU's plan leaves free between its kept hand-offs and its saves' backlog (half
    each, rpcompile.training.pipeline): a forward stage whose saves exceed its half waits for the link sooner."""
    plan = _plan([(0, 1)], (1, 2), [(0, 1)], (True, False))
    base = max(c.memory_bytes for c in stage_costs(_offload_problem(10**6), plan, lazy_offload=False)[::2])
    roomy = _offload_problem(base + 400)
    one = dataclasses.replace(roomy, device_count=1)
    kept = dataclasses.replace(one, resident_handoffs=True)
    # all stages share device 0; its largest stage leaves 400 bytes (more with hand-offs off the link)
    room = kept.memory_bytes - max(c.weight_bytes + c.grad_bytes + c.working_bytes + c.buffer_bytes
                                   for c in stage_costs(kept, plan, lazy_offload=False))
    f0 = stage_costs(kept, plan)[0]
    assert f0.backlog_bytes == room - room // 2  # its half fills: 2 x 300 saved bytes exceed it
    assert stage_costs(one, plan)[0].backlog_bytes > f0.backlog_bytes


@pytest.mark.parametrize("link", [math.inf, 50.0])
def test_the_simulator_plays_one_gpu_s_kept_hand_offs_and_launch_bound_stages_as_the_timing_model(link):
    """A one-GPU plan with hand-offs kept on the device and segments bound by their dispatch (their times are the
    launch bound, ``formulate.launch_bound``): the simulator, walking the same StageCosts, agrees with the timing
    model — exactly with transfers free, within 2% with the link."""
    from rpcompile.passes.formulate import launch_bound
    kernels, nodes = (0.2, 0.9, 0.1, 0.6, 0.3, 1.0), (40, 10, 60, 20, 30, 5)
    fwd = tuple(launch_bound(k, n, 0.01) for k, n in zip(kernels, nodes))
    pb = tiny_chain(6, devices=1, microbatches=4, fwd_s=fwd, rec_s=fwd,
                    bwd_s=tuple(launch_bound(2 * k, n, 0.02) for k, n in zip(kernels, nodes)),
                    act_bytes=(5,) * 6, boundary_bytes=(8,) * 6, param_bytes=(20,) * 6, grad_bytes=(20,) * 6,
                    link_bytes_per_s=1e12 if math.isinf(link) else link, resident_handoffs=True)
    assert pb.fwd_s == (0.4, 0.9, 0.6, 0.6, 0.3, 1.0)  # four of six segments wait for their host
    plan = SegmentPlan(forward=((0, 2), (2, 4)), fused=(4, 6), backward=((2, 4), (0, 2)),
                       saved=(True, False, True, False, False, False))
    sc = from_segment_plan(pb, plan, name="ilp")
    if math.isinf(link):
        sc = dataclasses.replace(sc, link_bytes_per_s=math.inf)
    sim = sc.run()
    assert all(s.handoff_bytes == 0 for s in sc.stages)
    assert sim.iteration_time_s == pytest.approx(iteration_time(pb, plan), rel=1e-9 if math.isinf(link) else 0.02)


def test_host_accumulation_queues_on_one_thread_in_landing_order():
    """Two stages on one device, 1 s each: gradients land at 1 s and 2 s. The host thread adds the first in 3 s
    (1 → 4) and the second after it (4 → 4.5): the iteration ends at 4.5, not 2."""
    assert pipeline_time([1.0, 1.0], 1, 1) == 2.0
    assert pipeline_time([1.0, 1.0], 1, 1, accumulate_s=[3.0, 0.5]) == pytest.approx(4.5)
    assert pipeline_time([1.0, 1.0], 1, 1, accumulate_s=[0.5, 0.5]) == pytest.approx(2.5)  # only the last shows
    assert host_lane_end([2.0, 1.0], [1.0, 1.0]) == pytest.approx(3.0)  # the one landing first goes first


def test_the_step_adds_exactly_the_modelled_optimizer_and_refresh_time():
    """3e8 trainable bf16 parameters on a host stepping 1e9 params/s and casting 2e9 params/s: the optimizer
    takes 0.3 s and the refresh 0.15 s, so the prediction grows by exactly 0.45 s (accumulation free here)."""
    pb = tiny_chain(6, devices=2)
    plan = _plan([(0, 2), (2, 4)], (4, 6), [(2, 4), (0, 2)], [False] * 6)
    host = HostSpec(memory_bandwidth=1e10, cast_params_per_s=2e9, accumulate_params_per_s=1e9,
                    optimizer_params_per_s=1e9)
    load = dataclasses.replace(host_load(host, trainable_params=300_000_000, precision="bf16"),
                               accumulate_bytes_per_s=math.inf)
    assert (load.optimizer_s, load.refresh_s) == (pytest.approx(0.3), pytest.approx(0.15))
    pipeline = iteration_time(pb, plan)
    with_host = dataclasses.replace(pb, host=load)
    assert iteration_time(with_host, plan) == pytest.approx(pipeline + 0.45, rel=1e-12)
    assert host_times(with_host, plan)["pipeline_s"] == pytest.approx(pipeline)
    # overlapped (pipe.step(optimizer, overlap=True)): the longer of the two, not the sum
    overlap = dataclasses.replace(with_host, host=dataclasses.replace(load, overlap_step=True))
    assert iteration_time(overlap, plan) == pytest.approx(max(pipeline, 0.45))
    long_step = dataclasses.replace(load, optimizer_s=pipeline * 3, overlap_step=True)
    assert iteration_time(dataclasses.replace(pb, host=long_step), plan) == pytest.approx(pipeline * 3 + 0.15)


def test_slow_host_accumulation_shows_only_past_what_the_later_stages_hide():
    """Gradients of 100 B per segment at 100 B/s: 1 s of host work per segment. The accumulations of the fused
    stage and the first backward stage hide behind later stages; the last stage's cannot, and a host slow
    enough to fall behind adds what it could not hide."""
    pb = tiny_chain(6, devices=2)
    plan = _plan([(0, 2), (2, 4)], (4, 6), [(2, 4), (0, 2)], [False] * 6)
    base = iteration_time(pb, plan)
    acc = dataclasses.replace(pb, host=HostLoad(accumulate_bytes_per_s=100.0))
    costs = stage_costs(pb, plan)
    last = costs[-1].grad_bytes / 100.0  # what the last stage's gradients cost the host after they land
    assert iteration_time(acc, plan) >= base + last - 1e-9
    slow = dataclasses.replace(pb, host=HostLoad(accumulate_bytes_per_s=1.0))
    total = sum(c.grad_bytes for c in costs) / 1.0
    assert iteration_time(slow, plan) >= total  # the host thread is now the bottleneck


# ---- data parallelism: each grad stage's gradients all-reduced across the machines (HostLoad.nodes) -----------
def test_a_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_fp32_gradients():
    load = host_load(None, trainable_params=0, precision="bf16", nodes=4, network_bytes_per_s=1e9)
    assert load.reduce_bytes_per_grad_byte == 2.0  # bf16 gradients come home, their fp32 sums are reduced
    assert load.reduce_s(1e9) == pytest.approx(2 * 3 / 4 * 2e9 / 1e9)
    assert host_load(None, trainable_params=0, precision="bf16").reduce_s(1e9) == 0.0  # one node: nothing
    assert host_load(None, trainable_params=0, precision="fp32", nodes=2, network_bytes_per_s=1e9).reduce_s(1e9) == \
        pytest.approx(1.0)


def test_the_reduction_of_each_stage_hides_behind_the_later_stages_or_adds():
    """Three 1 s stages on one device land gradients at 1, 2 and 3 s. Their all-reduces (0.5 s each, in stage
    order on one link) end at 1.5, 2.5 and 3.5: only the last one's 0.5 s shows. Not overlapped, all 1.5 s do."""
    assert pipeline_time([1.0] * 3, 1, 1, reduce_s=[0.5] * 3) == pytest.approx(3.5)
    assert pipeline_time([1.0] * 3, 1, 1, reduce_s=[0.5] * 3, overlap_reduce=False) == pytest.approx(4.5)
    # a long first reduction holds the link: the third waits for it (1 → 3.5, then 3.5 → 4)
    assert pipeline_time([1.0] * 3, 1, 1, reduce_s=[2.5, 0.0, 0.5]) == pytest.approx(4.0)
    # a reduction starts only once the host has added the stage's gradients (accumulation 1 s: 1 → 2 → 2.5)
    assert pipeline_time([1.0, 1.0], 1, 1, accumulate_s=[1.0, 0.0], reduce_s=[0.5, 0.0]) == pytest.approx(2.5)


def test_a_plan_for_several_nodes_predicts_the_exposed_reduction():
    pb = tiny_chain(6, devices=2)
    plan = _plan([(0, 2), (2, 4)], (4, 6), [(2, 4), (0, 2)], [False] * 6)
    base = iteration_time(pb, plan)
    grads = sum(c.grad_bytes for c in stage_costs(pb, plan))
    net = dataclasses.replace(pb.host, nodes=2, network_bytes_per_s=grads / base)  # the whole reduction takes `base`
    overlapped = iteration_time(dataclasses.replace(pb, host=net), plan)
    after = iteration_time(dataclasses.replace(pb, host=dataclasses.replace(net, overlap_reduce=False)), plan)
    assert after == pytest.approx(2 * base)
    assert base < overlapped < after  # the later stages hide part of it


def test_a_shared_parameter_is_reduced_once_with_its_last_grad_stage():
    """A parameter used by segments 0 and 5 (tied embeddings) is in the fused stage's and the last backward
    stage's gradients; the runtime reduces it once, when the last of them (the lowest range) has landed."""
    pb = dataclasses.replace(tiny_chain(6, devices=2),
                             shared=(SharedParam(name="tied", bytes=100, grad_bytes=100, segments=(0, 5)),))
    plan = _plan([(0, 2), (2, 4)], (4, 6), [(2, 4), (0, 2)], [False] * 6)
    costs = stage_costs(pb, plan)
    grads = [c for c in costs if c.kind != "forward"]
    assert sum(c.grad_bytes for c in grads) == sum(pb.grad_bytes) + 200  # downloaded by both stages
    assert sum(c.reduced_bytes for c in grads) == sum(pb.grad_bytes) + 100  # reduced once
    assert grads[-1].reduced_bytes == sum(pb.grad_bytes[0:2]) + 100 and grads[-1].start == 0


# ---- overlapped iterations (issue 35): the steady-state period --------------------------------------------
def test_overlapped_iterations_are_walked_as_the_simulator_plays_them():
    """Random round-robin pipelines with a host step, transfers free: the timing model's overlapped walk ends
    every iteration exactly where the simulator does (the pointer carried on, the loss and the step before last
    waited for), so the period and bubble agree."""
    rng = random.Random(7)
    for _ in range(40):
        devices, m, f, b = rng.randint(1, 5), rng.randint(1, 6), rng.randint(0, 5), rng.randint(0, 5)
        names = ["forward"] * f + ["fused"] + ["backward"] * b
        times = [rng.uniform(0.001, 0.01) for _ in names]
        step = rng.choice([0.0, 0.005, 0.05])
        host = HostLoad(optimizer_s=step, overlap_step=True, overlap_iterations=True)
        run = simulate(round_robin(names, devices, m),
                       [StageCost(kind=k, compute_s=t) for k, t in zip(names, times)], host=host)
        ends = overlapped_ends(times, devices, m, fused=f, step_s=step)
        assert ends == pytest.approx(list(run.iteration_ends_s), rel=1e-9, abs=1e-12)
        assert steady_period(ends) == pytest.approx(run.iteration_time_s, rel=1e-9)


def test_the_period_is_the_mean_after_the_start_over_whole_cycles():
    """Iterations repeat in a cycle (here of 2: 5, 4 s; of 3: 4, 4, 5 s; of 4: 5, 5, 5, 4 s, as a plan of the
    RoundPipe paper's Llama3-8B profile does) once the start is behind: the period is the mean of the twelve
    after the third, exact for each."""
    def ends(cycle):
        out = [0.0, 9.0, 14.0]
        for k in range(12):
            out.append(out[-1] + cycle[k % len(cycle)])
        return out

    for cycle in ([5.0, 4.0], [4.0, 4.0, 5.0], [5.0, 5.0, 5.0, 4.0], [3.0]):
        assert steady_period(ends(cycle)) == pytest.approx(sum(cycle) / len(cycle))
    assert steady_period([4.0]) == 4.0 and steady_period([4.0, 7.0]) == 3.0


def test_an_overlapped_plan_is_priced_by_its_period_as_the_simulator_plays_it():
    """An 8-layer Llama-like chain on 4 devices, planned for overlapped iterations (host adds and a step
    included): the timing model's period is the simulator's within 2%, and shorter than the synchronous
    iteration of the same plan (its fill, drain and step no longer add up)."""
    pb = llama_like(8, devices=4, microbatches=8)
    host = HostLoad(accumulate_bytes_per_s=20e9, optimizer_s=0.3, overlap_step=True, overlap_iterations=True)
    over = dataclasses.replace(pb, host=host)
    plan = solve(over, "ilp", time_limit_s=5).require_plan()
    sim = from_segment_plan(over, plan, name="ilp").run()
    assert iteration_time(over, plan) == pytest.approx(sim.iteration_time_s, rel=0.02)
    assert bubble_fraction(over, plan) == pytest.approx(sim.bubble_fraction, abs=0.02)
    sync = dataclasses.replace(pb, host=dataclasses.replace(host, overlap_step=False, overlap_iterations=False))
    assert iteration_time(over, plan) < host_times(sync, plan)["pipeline_s"] < iteration_time(sync, plan)


def test_overlapped_iterations_need_the_overlapped_step():
    with pytest.raises(ConfigError, match=r"^HostLoad: overlap_iterations needs overlap_step=True .*; set both$"):
        HostLoad(overlap_iterations=True)
    assert host_load(None, trainable_params=0, precision="bf16", overlap_iterations=True).overlap_step


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-8b", "llama-32b"])
def test_the_period_of_a_benchmark_shape_is_the_simulators_within_2_percent(model):
    """The benchmark's shapes (benchmarks/overlap.py: 8 × rtx4090, 16 microbatches of 4096 tokens, the plan made
    for overlapped iterations, the whole LM head): the timing model's period is the simulator's within 2% (on
    2026-11-28: 8B −0.8%, 32B −0.1% with the split head)."""
    ms = load_model(model, batch_size=16, seq_len=4096)
    plan = rpcompile.plan(ms.model, ms.example_inputs, gpus=8, spec="rtx4090", microbatches=16, precision="bf16",
                          head_chunks=1, overlap=True, cache=False)
    assert plan.predicted.overlap_iterations
    sim = from_plan(plan).run()
    assert sim.iterations > 1
    assert plan.predicted.iteration_time_s == pytest.approx(sim.iteration_time_s, rel=0.02)
