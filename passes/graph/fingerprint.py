"""A traced graph's fingerprint: what a plan records of the model it was made for (:class:`~rpcompile.core.plan.Fingerprint`).

The graph digest hashes every node's op, name, target and arguments (torch.export's ``_guards_fn`` check left
out); the parameter digest hashes names, shapes, dtypes and ``requires_grad``. A plan is never run on a graph whose
fingerprint differs (:func:`rpcompile.planner.planning.graph_as_planned`, :mod:`rpcompile.planner.invariants`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx as fx

from rpcompile.core.plan import Fingerprint

__all__ = ["fingerprint", "qualified_target"]


def qualified_target(node: fx.Node) -> str:
    """A node's target as text: an attribute path, or a callable's qualified name."""
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
    # any other object by its type: a repr may hold an address, which would change the digest on every run
    return type(arg).__name__


def fingerprint(gm: fx.GraphModule) -> Fingerprint:
    """The :class:`~rpcompile.Fingerprint` of a traced model: graph structure plus parameter names, shapes and dtypes."""
    g = hashlib.sha256()
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == "_guards_fn":
            continue
        g.update(f"{node.op}|{node.name}|{qualified_target(node)}|{_arg_repr(node.args)}|{_arg_repr(node.kwargs)}\n".encode())
        count += 1
    p = hashlib.sha256()
    # sorted by name: the digest must not depend on registration order; a tied weight counts once
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
