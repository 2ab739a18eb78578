"""verify_plan: a valid plan passes; every rule has a failing case; all violations are reported at once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _toy import TiedToy, toy_graph
from rpcompile.core.errors import PlanVerificationError
from rpcompile.core.plan import Plan
from rpcompile.passes.lower import plan_from_ranges
from rpcompile.planner.invariants import plan_violations, verify_plan
from test_plan import make_plan


@pytest.fixture
def gm():
    return toy_graph()[0]


@pytest.fixture
def plan(gm) -> Plan:
    return make_plan(gm)


def with_stage(plan: Plan, stage_name: str, **changes) -> Plan:
    stages = tuple(dataclasses.replace(s, **changes) if s.name == stage_name else s for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def violations(plan: Plan, gm) -> list[str]:
    return plan_violations(plan, gm)


def test_valid_plan_passes(plan, gm):
    verify_plan(plan, gm)
    assert violations(plan, gm) == []


def test_rule1_fingerprint(plan):
    other = torch.fx.symbolic_trace(TiedToy(dim=4))
    assert violations(plan, other)[0].startswith("rule 1: fingerprint mismatch: parameters differ")


def test_rule2_kinds_and_names(plan, gm):
    two_fused = with_stage(plan, "F1", kind="fused", name="FB")
    assert "rule 2: need exactly one fused stage, found 2" in violations(two_fused, gm)
    renamed = with_stage(plan, "B2", name="B7")
    assert "rule 2: stage names ['F0', 'F1', 'FB', 'B1', 'B7'] should be ['F0', 'F1', 'FB', 'B1', 'B2']" in violations(renamed, gm)
    swapped = dataclasses.replace(plan, stages=(plan.stages[2], *plan.stages[:2], *plan.stages[3:]))
    assert "rule 2: stage kinds out of order: ['FB', 'F0', 'F1', 'B1', 'B2']" in violations(swapped, gm)


def test_rule3_unknown_node(plan, gm):
    bad = with_stage(plan, "F0", nodes=("embed", "l1", "ghost"))
    assert "rule 3: stage F0 names node 'ghost', which is not a compute node of the graph" in violations(bad, gm)


def test_rule4_forward_cover(plan, gm):
    missing = with_stage(plan, "F1", nodes=("relu",), params=())
    assert "rule 4: 1 node(s) in no forward-or-fused stage: l2" in violations(missing, gm)
    dup = with_stage(plan, "F1", nodes=("l1", "relu", "l2"))
    assert "rule 4: 1 node(s) in several forward-or-fused stages: l1" in violations(dup, gm)


def test_rule5_backward_cover(plan, gm):
    missing = with_stage(plan, "B2", nodes=("embed",), saved=(), params=("embed.weight",))
    assert "rule 5: 1 node(s) in no backward-or-fused stage: l1" in violations(missing, gm)


def test_rule6_contiguity_and_order(plan, gm):
    gap = with_stage(with_stage(plan, "F0", nodes=("embed", "relu"), saved=()), "F1", nodes=("l1", "l2"))
    v = violations(gap, gm)
    assert "rule 6: stage F0 is not a contiguous run in topological order" in v
    assert "rule 6: forward stages do not ascend" in v
    reversed_bwd = dataclasses.replace(plan, stages=(*plan.stages[:3], dataclasses.replace(plan.stages[4], name="B1"), dataclasses.replace(plan.stages[3], name="B2")))
    v = violations(reversed_bwd, gm)
    assert "rule 6: backward stages do not descend" in v and "rule 6: B1 does not end where the fused stage begins" in v


def test_rule6_fused_must_be_tail(gm):
    plan = make_plan(gm)
    odd = plan_from_ranges(gm, forward=[(2, 6)], fused=(0, 2), backward=[(2, 6)], hardware=plan.hardware, microbatches=2)
    assert "rule 6: the fused stage does not hold the last nodes of the graph" in violations(odd, gm)


def test_rule7_params(plan, gm):
    missing = with_stage(plan, "FB", params=("l2.weight",))
    v = violations(missing, gm)
    assert "rule 7: stage FB does not list parameter(s) its nodes read: embed.weight, scale" in v
    extra = with_stage(plan, "F0", params=("embed.weight", "l1.weight", "l1.bias", "l2.bias"))
    assert "rule 7: stage F0 lists parameter(s) none of its nodes read: l2.bias" in violations(extra, gm)


def test_tied_parameter_is_listed_by_every_stage_using_it(plan):
    assert "embed.weight" in plan.stages[0].params and "embed.weight" in plan.fused_stage.params


def test_rule8_saved(plan, gm):
    stray = with_stage(plan, "B1", saved=("embed",))
    assert "rule 8: stage B1 saves node(s) it does not run: embed" in violations(stray, gm)
    fused = with_stage(plan, "FB", saved=("mul",))
    assert "rule 8: the fused stage FB must not save activations" in violations(fused, gm)
    unsaved = with_stage(plan, "F0", saved=())
    assert "rule 8: backward stage B2 expects saved activations no forward stage saves: l1" in violations(unsaved, gm)


def test_rule9_memory(plan, gm):
    big = with_stage(plan, "B1", memory_bytes=3 * 2**30)
    assert "rule 9: stage B1 needs 3.00 GiB but the device has 0.93 GiB usable" in violations(big, gm)


def test_rule10_host_lookups(plan, gm):
    """A plain traced model is checked as the plan ran it, with its ``host`` lookups moved to the host."""
    stray = dataclasses.replace(plan, host=("embed",))  # while F0 and B2 still run it
    found = violations(stray, gm)
    assert found[0].startswith("rule 1: fingerprint mismatch: graph differs")
    assert "rule 3: stage F0 names node 'embed', which is not a compute node of the graph" in found
    assert violations(dataclasses.replace(plan, host=("l1",)), gm) == [
        "rule 10: node 'l1' is not an embedding lookup of a model input that the host can run (a plan made for "
        "another graph?); re-plan for this model"]


def test_all_violations_in_one_error(plan, gm):
    bad = with_stage(with_stage(plan, "B1", memory_bytes=3 * 2**30), "F0", nodes=("embed", "l1", "ghost"))
    with pytest.raises(PlanVerificationError, match=r"plan is invalid \(2 problem\(s\)\):\n  - rule 3: .*\n  - rule 9: ") as info:
        verify_plan(bad, gm)
    assert len(info.value.violations) == 2
