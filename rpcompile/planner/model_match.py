"""Whether two plans are for the same model (:func:`model_differences`), for ``rpcompile diff``, which has two plans
and no model.

A plan's fingerprint is that of the graph it was planned from: the model traced, its LM head and loss split into
``plan.head_chunks`` sequence chunks when the plan did so, and the embedding lookups ``plan.host`` names moved to the
host. Two plans are for the same model when their parameters match and their graphs match or differ only where the
plans split the head or run lookups on the host differently. The pass driver rebuilds a plan's graph from a model
(:func:`rpcompile.planner.planning.graph_as_planned`) for ``compile(plan=)``, ``rpcompile check`` and ``rpcompile
show --model``. A plan's own rules are :mod:`rpcompile.planner.invariants`.
"""

from __future__ import annotations

from ..core.plan import Plan

__all__ = ["model_differences"]


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
