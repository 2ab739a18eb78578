"""Checking a :class:`~rpcompile.core.plan.Plan` against the traced graph it was made for.

*The same model.* A plan's fingerprint is that of the graph it was planned from: the model traced, its LM head
and loss split into ``plan.head_chunks`` sequence chunks when the plan did so, and the embedding lookups
``plan.host`` names moved to the host. ``compile(plan=)``, ``rpcompile check`` and ``rpcompile show --model``
rebuild that graph from the model (:func:`graph_as_planned`, or ``planning.prepare`` with the plan's settings)
and compare fingerprints; ``rpcompile diff``, which has two plans and no model, calls them the same model when
their parameters match and their graphs match or differ only where the plans split the head or run lookups on
the host differently (:func:`model_differences`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import torch
import torch.fx as fx

from .core.errors import PlanMismatchError, PlanVerificationError
from .core.plan import Fingerprint, Plan

__all__ = ["fingerprint", "verify_plan", "plan_violations", "planned_graph", "graph_as_planned", "model_differences"]


def _target_name(node: fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    try:
        return fx.node._get_qualified_name(node.target)
    except Exception:  # exotic callables: fall back to their repr without addresses
        return getattr(node.target, "__qualname__", type(node.target).__name__)


def _arg_repr(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (tuple, list)):
        return "(" + ",".join(_arg_repr(a) for a in arg) + ")"
    if isinstance(arg, dict):
        return "{" + ",".join(f"{k}:{_arg_repr(v)}" for k, v in arg.items()) + "}"
    if isinstance(arg, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(arg)
    if isinstance(arg, (int, float, bool, str, type(None), slice)):
        return repr(arg)
    return type(arg).__name__


def fingerprint(gm: fx.GraphModule) -> Fingerprint:
    """The :class:`Fingerprint` of a traced model: graph structure plus parameter names, shapes and dtypes."""
    g = hashlib.sha256()
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == "_guards_fn":
            continue
        g.update(f"{node.op}|{node.name}|{_target_name(node)}|{_arg_repr(node.args)}|{_arg_repr(node.kwargs)}\n".encode())
        count += 1
    p = hashlib.sha256()
    params = sorted(gm.named_parameters(remove_duplicate=True))
    for name, t in params:
        p.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{t.requires_grad}\n".encode())
    return Fingerprint(
        graph_digest=g.hexdigest(),
        params_digest=p.hexdigest(),
        num_nodes=count,
        num_params=len(params),
        param_elements=sum(t.numel() for _, t in params),
    )


def planned_graph(plan: Plan, gm: fx.GraphModule, *, source: str = "plan") -> fx.GraphModule:
    """``gm``, a traced model, as ``plan`` runs it — with the embedding lookups ``plan.host`` names moved to the
    host (:func:`rpcompile.passes.host.as_planned`) — once the plan's fingerprint says it was made for it; else
    :class:`PlanMismatchError`."""
    from rpcompile.passes.host import as_planned

    try:
        gm = as_planned(gm, plan.host)
    except ValueError as e:
        raise PlanMismatchError(f"{source} was made for a different model: {e}") from None
    plan.check_model(fingerprint(gm), source=source)
    return gm


def graph_as_planned(plan: Plan, model: torch.nn.Module, example_inputs: Any, *, loss_fn: Any = None,
                     example_kwargs: Any = None, source: str = "plan") -> fx.GraphModule:
    """``model`` traced into the graph ``plan`` was planned from (the module docstring: its LM head split as the
    plan's ``head_chunks``, its ``host`` lookups on the host), once the fingerprints agree; else
    :class:`PlanMismatchError` saying what differs."""
    from rpcompile.passes.loss_head import split_head
    from rpcompile.tracing import trace

    gm = trace(model, tuple(example_inputs), example_kwargs=example_kwargs)
    if plan.head_chunks > 1:
        if loss_fn is None:
            raise PlanMismatchError(f"{source} splits the LM head and its loss into {plan.head_chunks} chunks: give "
                                    "the model's loss_fn to rebuild that graph (a model file's factory returns "
                                    "(model, inputs, loss_fn, target))")
        try:
            split_head(gm, loss_fn, plan.head_chunks)
        except ValueError as e:
            raise PlanMismatchError(f"{source} was made for a different model: its LM head cannot be split as the "
                                    f"plan's ({e})") from None
    return planned_graph(plan, gm, source=source)


def model_differences(a: Plan, b: Plan) -> list[str]:
    """Why plans ``a`` and ``b`` are not for the same model (the module docstring); empty when they are. Graphs
    that differ only where the plans split the LM head or host lookups differently are the same model."""
    if a.model == b.model:
        return []
    params = a.model.params_digest == b.model.params_digest
    planned_apart = a.head_chunks != b.head_chunks or tuple(a.host) != tuple(b.host)
    if params and planned_apart:
        return []
    return a.model.differences(b.model) or ["fingerprints differ"]


def plan_violations(plan: Plan, gm: fx.GraphModule) -> list[str]:
    """Every rule of :func:`verify_plan` that ``plan`` breaks on ``gm``, one message each."""
    from rpcompile.passes.host import as_planned
    from rpcompile.passes.util import compute_nodes, node_params

    try:  # a plain traced model: check the graph the plan ran, with its embedding lookups on the host
        gm = as_planned(gm, plan.host)
    except ValueError as e:
        return [f"rule 10: {e}"]
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
    return out


def verify_plan(plan: Plan, gm: fx.GraphModule) -> None:
    """Check ``plan`` against the traced graph ``gm``; raise one :class:`PlanVerificationError` listing every
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
        traced model is checked with them moved there, as the plan runs it: :func:`rpcompile.passes.host.as_planned`).
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
        idx = [order[n] for n in s.nodes if n in order]
        if not idx:
            out.append(f"rule 6: stage {s.name} has no nodes")
            continue
        if idx != list(range(idx[0], idx[0] + len(idx))):
            out.append(f"rule 6: stage {s.name} is not a contiguous run in topological order")
        spans[s.name] = (min(idx), max(idx) + 1)
    fwd = [spans[s.name] for s in plan.forward_stages if s.name in spans]
    bwd = [spans[s.name] for s in plan.backward_stages if s.name in spans]
    fb = spans.get(plan.fused_stage.name) if plan.fused_stage else None
    if any(a[1] > b[0] for a, b in zip(fwd, fwd[1:])):
        out.append("rule 6: forward stages do not ascend")
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

