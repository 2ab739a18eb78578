"""The problem pass (:mod:`rpcompile.passes.formulate`): a costed, coarsened graph as plain numbers — here what
issue 35 item 6 added: segments bound by their host's dispatch, and one GPU's hand-offs kept off the link."""

from __future__ import annotations

import dataclasses

import pytest

from rpcompile.core.specs import GPU_BACKWARD_DISPATCH_S, GPU_DISPATCH_S, GPU_STAGE_OVERHEAD_S, get_spec
from rpcompile.models.registry import load_model
from rpcompile.passes.formulate import launch_bound, partition_problem
from rpcompile.passes.rewrite.coarsen import segments_of
from rpcompile.planner.plan_options import PlanOptions, make_hardware
from rpcompile.planner.planning import prepare


def test_a_segment_takes_the_longer_of_its_kernels_and_its_dispatch():
    assert launch_bound(1e-3, 10, 50e-6) == 1e-3  # 0.5 ms to issue 1 ms of kernels: the kernels
    assert launch_bound(1e-3, 40, 50e-6) == pytest.approx(2e-3)  # 2 ms to issue them: the host
    assert launch_bound(1e-3, 40, 0.0) == 1e-3  # a device that computes as it dispatches (the CPU)


@pytest.fixture(scope="module")
def demo_graph():
    spec = load_model("llama-demo", batch_size=2)
    gm, _ = prepare(spec.model, spec.example_inputs, PlanOptions(gpus=1, spec="rtx4090", microbatches=1,
                    progress=False))
    return gm


def test_the_problem_prices_every_segment_s_dispatch_forward_backward_and_recompute(demo_graph):
    """Per segment: forward ``max(kernels, nodes × dispatch_s)``, backward ``max(kernels, backward nodes ×
    backward_dispatch_s)`` (the nodes with a backward), recompute as the forward; with no dispatch, the cost
    model's kernel times exactly."""
    segs = segments_of(demo_graph)
    slow = dataclasses.replace(get_spec("rtx4090"), dispatch_s=1e-3, backward_dispatch_s=3e-3)
    free = dataclasses.replace(slow, dispatch_s=0.0, backward_dispatch_s=0.0)
    pb = partition_problem(demo_graph, hardware=make_hardware(2, slow), microbatches=1)
    raw = partition_problem(demo_graph, hardware=make_hardware(2, free), microbatches=1)
    assert raw.fwd_s == tuple(s.fwd_s for s in segs) and raw.bwd_s == tuple(s.bwd_s for s in segs)
    assert pb.fwd_s == tuple(max(s.fwd_s, len(s.nodes) * 1e-3) for s in segs) == pb.rec_s
    assert pb.bwd_s == tuple(max(s.bwd_s, s.backward_ops * 3e-3) for s in segs)
    assert all(0 < s.backward_ops <= len(s.nodes) for s in segs)
    # a tiny model on a GPU is launch-bound throughout: every forward segment waits for its host
    assert all(f == pytest.approx(len(s.nodes) * 1e-3) for f, s in zip(pb.fwd_s, segs))


def test_gpu_presets_carry_the_measured_dispatch_and_per_action_cost_the_cpu_none():
    for name in ("rtx4090", "rtx3090", "a100-80g", "h100-sxm", "h200"):
        s = get_spec(name)
        assert (s.dispatch_s, s.backward_dispatch_s, s.stage_overhead_s) == (
            GPU_DISPATCH_S, GPU_BACKWARD_DISPATCH_S, GPU_STAGE_OVERHEAD_S)
    assert get_spec("cpu").dispatch_s == get_spec("cpu").backward_dispatch_s == 0.0


def test_only_one_gpu_keeps_its_hand_offs(demo_graph):
    one = partition_problem(demo_graph, hardware=make_hardware(1, "rtx4090"), microbatches=1)
    two = partition_problem(demo_graph, hardware=make_hardware(2, "rtx4090"), microbatches=1)
    cpu = partition_problem(demo_graph, hardware=make_hardware(1, "cpu"), microbatches=1)
    assert (one.resident_handoffs, two.resident_handoffs, cpu.resident_handoffs) == (True, False, False)
    inner = next(b for b in range(1, one.n) if one.boundary_bytes[b - 1])
    assert one.link_out(inner) == 0 and one.link_in(inner) == 0 and one.link_in(0) == one.input_bytes
    assert two.link_out(inner) == two.boundary_bytes[inner - 1] and two.link_in(inner) == two.in_bytes(inner)
