"""Which model a :class:`~rpcompile.core.plan.Plan` is for: the graph it ran, and whether two plans share a model.

A plan's fingerprint is that of the graph it was planned from: the model traced, its LM head and loss split into
``plan.head_chunks`` sequence chunks when the plan did so, and the embedding lookups ``plan.host`` names moved to the
host. ``compile(plan=)``, ``rpcompile check`` and ``rpcompile show --model`` rebuild that graph from the model
(:func:`graph_as_planned`: the pass driver's :data:`~rpcompile.planner.planning.GRAPH` passes with the plan's settings,
or ``planning.prepare`` with them) and compare fingerprints
(:mod:`rpcompile.passes.graph.fingerprint`); ``rpcompile diff``, which has two plans and no model, calls them the same
model when their parameters match and their graphs match or differ only where the plans split the head or run lookups on
the host differently (:func:`model_differences`). A plan's own rules are :mod:`rpcompile.planner.invariants`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from rpcompile.passes.graph.fingerprint import fingerprint
from rpcompile.core.precision import compute_dtype
from rpcompile.passes.graph.precision import TRACE_DTYPE_KEY
from rpcompile.passes.graph.trace import TRACE_META_KEY

from ..core.errors import PlanMismatchError
from ..core.plan import Plan
from .planning import GRAPH, planned, run

__all__ = ["graph_as_planned", "model_differences"]


def graph_as_planned(plan: Plan, model: torch.nn.Module, example_inputs: Any, *, loss_fn: Any = None,
                     example_kwargs: Any = None, source: str = "plan", precision: str | None = None,
                     ) -> fx.GraphModule:
    """``model`` traced into the graph ``plan`` was planned from (the module docstring: its LM head split as the
    plan's ``head_chunks``, its ``host`` lookups on the host), once the fingerprints agree; else
    :class:`~rpcompile.PlanMismatchError` saying what differs. ``precision``: the one the graph will run in (default the
    plan's); an exported graph records its casts for it, so it must be the plan's."""
    precision = precision or plan.precision
    if plan.head_chunks > 1 and loss_fn is None:
        raise PlanMismatchError(f"{source} splits the LM head and its loss into {plan.head_chunks} chunks: give "
                                "the model's loss_fn to rebuild that graph (a model file's factory returns "
                                "(model, inputs, loss_fn, target))")
    c = planned(plan, model, example_inputs, loss_fn=loss_fn if plan.head_chunks > 1 else None,
                example_kwargs=example_kwargs, precision=precision)
    try:
        run(c, GRAPH)
    except ValueError as e:
        if "trace" not in c.times:
            raise
        _same_precision(plan, c.graph, model, precision, source)  # what the trace shows is said first
        if "loss_head" not in c.times:
            raise PlanMismatchError(f"{source} was made for a different model: its LM head cannot be split as the "
                                    f"plan's ({e})") from None
        raise PlanMismatchError(f"{source} was made for a different model: {e}") from None
    _same_precision(plan, c.graph, model, precision, source)
    plan.check_model(fingerprint(c.graph), source=source)
    return c.graph


def _same_precision(plan: Plan, gm: fx.GraphModule, model: torch.nn.Module, precision: str, source: str) -> None:
    """:class:`~rpcompile.core.errors.PlanMismatchError` when ``gm``, exported, records its casts for the plan's precision and the run is in
    another."""
    if precision != plan.precision and gm.meta.get(TRACE_DTYPE_KEY, None) != compute_dtype(plan.precision) \
            and gm.meta.get(TRACE_META_KEY) == "export":
        raise PlanMismatchError(f"{source} was made for precision={plan.precision!r} but this run is in "
                                f"{precision!r}, and {type(model).__name__}'s exported graph records its dtype casts "
                                f"for one precision: compile with precision={plan.precision!r} or re-plan")


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
