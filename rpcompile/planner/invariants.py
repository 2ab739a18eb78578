"""The rules every :class:`~rpcompile.core.plan.Plan` obeys on the traced graph it was made for (:func:`verify_plan`).

:func:`plan_violations` lists every rule a plan breaks, one message each; :func:`verify_plan` raises one
:class:`~rpcompile.core.errors.PlanVerificationError` listing them all. Rule 1 is the model's fingerprint
(:func:`rpcompile.planner.planning.graph_as_planned`); the others are the plan's own invariants: stage kinds and
names, every compute node covered once per pass, contiguous stages, parameters, saved activations, memory and host
lookups.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.fx as fx

from rpcompile.passes.graph.util import compute_nodes, node_params
from rpcompile.passes.rewrite.host import as_planned

from ..core.errors import PlanVerificationError
from ..core.plan import Plan
from ..core.schedule import weight_stays
from rpcompile.passes.graph.fingerprint import fingerprint

__all__ = ["verify_plan", "plan_violations"]


def plan_violations(plan: Plan, gm: fx.GraphModule) -> list[str]:
    """Every rule of :func:`verify_plan` that ``plan`` breaks on ``gm``, one message each."""
    try:  # a plain traced model: check the graph the plan ran, with its embedding lookups on the host
        gm = as_planned(gm, plan.host)
    except ValueError as e:
        return [f"rule 10: {e}"]
    # positions in the topological order of the compute nodes only: rules 3 to 6 check the stages' nodes against it
    order = {n.name: i for i, n in enumerate(compute_nodes(gm))}
    by_name = {n.name: n for n in gm.graph.nodes}
    out: list[str] = []
    out += _check_fingerprint(plan, gm)
    out += _check_kinds(plan)
    out += _check_nodes_known(plan, order)
    out += _check_cover(plan, order)
    out += _check_contiguous(plan, order)
    out += _check_params(plan, gm, by_name, node_params)
    out += _check_saved(plan)
    out += _check_memory(plan)
    out += _check_stays(plan)
    out += _check_sums(plan, gm)
    return out


def verify_plan(plan: Plan, gm: fx.GraphModule) -> None:
    """Check ``plan`` against the traced graph ``gm``; raise one :class:`~rpcompile.PlanVerificationError` listing every
    violation. The rules:

    1. the plan's fingerprint matches ``gm`` (same graph structure and parameters);
    2. stage kinds run ``F0..F(f-1), FB, B1..B(b-1)``: forward stages, exactly one fused stage, backward stages,
       named by position;
    3. every node a stage names exists in ``gm`` and is a compute node;
    4. every compute node is in exactly one forward-or-fused stage;
    5. every compute node is in exactly one backward-or-fused stage;
    6. each stage's nodes are a contiguous run of the topological order, listed in that order; forward stages
       ascend, the fused stage holds the last nodes, backward stages descend (B1 ends where FB begins);
    7. each stage lists exactly the parameters its nodes read (a parameter shared by several stages, such as a
       tied embedding, is listed by each of them);
    8. saved nodes: a backward stage saves only its own nodes, every node a backward stage saves is saved by the
       forward stage that runs it, and the fused stage saves nothing;
    9. every stage's predicted memory fits the hardware's usable memory;
    10. the nodes ``plan.host`` names are embedding lookups of model inputs that the host can run (a plainly
        traced model is checked with them moved there, as the plan runs it:
        :func:`rpcompile.passes.rewrite.host.as_planned`);
    11. the parameters each stage keeps on its device and finds there are the runtime's walk of the plan's
        ``keeps`` (:func:`rpcompile.core.schedule.weight_stays`): each kept for a later stage on the same device
        that finds it, or every parameter of every stage in a resident plan;
    12. the gradients a stage sums on its device (``accumulates``) are of trainable parameters that no other grad
        stage differentiates (one sum per parameter, on one device).
    """
    violations = plan_violations(plan, gm)
    if violations:
        raise PlanVerificationError(violations)


# ------------------------------------------------------------------------------------------------ rules
def _check_fingerprint(plan: Plan, gm: fx.GraphModule) -> list[str]:
    return [f"rule 1: fingerprint mismatch: {d}" for d in plan.model.differences(fingerprint(gm))]


def _check_kinds(plan: Plan) -> list[str]:
    kinds = [s.kind for s in plan.stages]
    out = []
    if kinds.count("fused") != 1:
        out.append(f"rule 2: need exactly one fused stage, found {kinds.count('fused')}")
    rank = {"forward": 0, "fused": 1, "backward": 2}
    if [rank[k] for k in kinds] != sorted(rank[k] for k in kinds):
        out.append(f"rule 2: stage kinds out of order: {[s.name for s in plan.stages]}")
    expected = [f"F{i}" for i in range(kinds.count("forward"))] + ["FB"] * kinds.count("fused")
    expected += [f"B{i}" for i in range(1, kinds.count("backward") + 1)]
    # names are checked only once the kinds are right: otherwise the expected names would repeat the kinds' error
    if [s.name for s in plan.stages] != expected and not out:
        out.append(f"rule 2: stage names {[s.name for s in plan.stages]} should be {expected}")
    return out


def _check_nodes_known(plan: Plan, order: dict[str, int]) -> list[str]:
    return [
        f"rule 3: stage {s.name} names node {n!r}, which is not a compute node of the graph"
        for s in plan.stages
        for n in s.nodes
        if n not in order
    ]


def _check_cover(plan: Plan, order: dict[str, int]) -> list[str]:
    out = []
    for rule, kinds, what in ((4, ("forward", "fused"), "forward-or-fused"), (5, ("backward", "fused"), "backward-or-fused")):
        counts = Counter(n for s in plan.stages if s.kind in kinds for n in s.nodes)
        missing = [n for n in order if counts[n] == 0]
        # a duplicate may be a name rule 3 refuses (not in order): it sorts first
        dup = sorted((n for n, c in counts.items() if c > 1), key=lambda n: order.get(n, -1))
        if missing:
            out.append(f"rule {rule}: {len(missing)} node(s) in no {what} stage: {_few(missing)}")
        if dup:
            out.append(f"rule {rule}: {len(dup)} node(s) in several {what} stages: {_few(dup)}")
    return out


def _check_contiguous(plan: Plan, order: dict[str, int]) -> list[str]:
    out = []
    spans: dict[str, tuple[int, int]] = {}
    for s in plan.stages:
        # unknown names are rule 3's to report; the run is checked over the known ones
        idx = [order[n] for n in s.nodes if n in order]
        if not idx:
            out.append(f"rule 6: stage {s.name} has no nodes")
            continue
        if idx != list(range(idx[0], idx[0] + len(idx))):
            out.append(f"rule 6: stage {s.name} is not a contiguous run in topological order")
        # half-open [first, last + 1), so adjacent stages share an end
        spans[s.name] = (min(idx), max(idx) + 1)
    fwd = [spans[s.name] for s in plan.forward_stages if s.name in spans]
    bwd = [spans[s.name] for s in plan.backward_stages if s.name in spans]
    fb = spans.get(plan.fused_stage.name) if plan.fused_stage else None
    if any(a[1] > b[0] for a, b in zip(fwd, fwd[1:])):
        out.append("rule 6: forward stages do not ascend")
    # backward stages run the graph from its end: each must begin at or after the end of the stage that follows it
    if any(a[0] < b[1] for a, b in zip(bwd, bwd[1:])):
        out.append("rule 6: backward stages do not descend")
    if fb is not None and fb[1] != len(order):
        out.append("rule 6: the fused stage does not hold the last nodes of the graph")
    if fb is not None and bwd and bwd[0][1] != fb[0]:
        out.append("rule 6: B1 does not end where the fused stage begins")
    return out


def _check_params(plan: Plan, gm: fx.GraphModule, by_name: dict[str, fx.Node], node_params: Any) -> list[str]:
    out = []
    for s in plan.stages:
        used = {p for n in s.nodes if n in by_name for p in node_params(gm, by_name[n])}
        listed = set(s.params)
        if used - listed:
            out.append(f"rule 7: stage {s.name} does not list parameter(s) its nodes read: {_few(sorted(used - listed))}")
        if listed - used:
            out.append(f"rule 7: stage {s.name} lists parameter(s) none of its nodes read: {_few(sorted(listed - used))}")
    return out


def _check_saved(plan: Plan) -> list[str]:
    out = []
    saved_fwd = {n for s in plan.forward_stages for n in s.saved}
    for s in plan.stages:
        stray = [n for n in s.saved if n not in set(s.nodes)]
        if stray:
            out.append(f"rule 8: stage {s.name} saves node(s) it does not run: {_few(stray)}")
        if s.kind == "fused" and s.saved:
            out.append(f"rule 8: the fused stage {s.name} must not save activations")
        if s.kind == "backward":
            # a backward stage reads its saved activations from host memory, where only a forward stage's run put them
            unsaved = [n for n in s.saved if n not in saved_fwd]
            if unsaved:
                out.append(f"rule 8: backward stage {s.name} expects saved activations no forward stage saves: {_few(unsaved)}")
    return out


def _check_memory(plan: Plan) -> list[str]:
    limit = plan.hardware.memory_bytes
    return [
        f"rule 9: stage {s.name} needs {s.memory_bytes / 2**30:.2f} GiB but the device has {limit / 2**30:.2f} GiB usable"
        for s in plan.stages
        if s.memory_bytes > limit
    ]


def _few(names: list[str], k: int = 5) -> str:
    head = ", ".join(names[:k])
    return head + (f", … (+{len(names) - k} more)" if len(names) > k else "")


def _check_sums(plan: Plan, gm: Any) -> list[str]:
    params = dict(gm.named_parameters())
    # the fused and backward stages differentiate; a sum kept on one device must hold a parameter's whole gradient, so
    # no second grad stage may read it
    grad_readers = Counter(p for s in plan.stages if s.kind != "forward" for p in s.params)
    return [f"rule 12: stage {s.name} sums gradients of {name} on its device, but it is "
            + ("not a parameter that requires grad" if name not in params or not params[name].requires_grad
               else "differentiated by other stages too")
            for s in plan.stages for name in s.accumulates
            if name not in params or not params[name].requires_grad or grad_readers[name] > 1]


def _check_stays(plan: Plan) -> list[str]:
    staying = {p for s in plan.stages for p in s.keeps}
    # the runtime's own walk is the reference: what it would keep and find from these keeps, stage by stage
    walk = weight_stays([s.params for s in plan.stages], plan.hardware.device_count, staying, resident=plan.resident)
    out = []
    for s, w in zip(plan.stages, walk):
        if set(s.keeps) != w.kept:
            out.append(f"rule 11: stage {s.name} keeps {sorted(s.keeps)[:3]} on its device, but the runtime keeps "
                       f"{sorted(w.kept)[:3]} (a parameter kept for no later stage on the device, or missing)")
        if set(s.finds) != w.found:
            out.append(f"rule 11: stage {s.name} finds {_few(sorted(set(s.finds) ^ w.found))} otherwise than the "
                       "stages before it on its device keep them")
    return out
