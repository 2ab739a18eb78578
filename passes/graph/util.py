"""Small helpers shared by the graph passes.

Terms: a *compute node* is a ``call_function``/``call_method``/``call_module`` node that does work (not a
placeholder, output, get_attr, nor torch.export's ``_guards_fn`` input check). A node's *parameters* are the
model parameters it reads: those of a ``call_module`` target and those reached through ``get_attr`` arguments,
named by their fully-qualified names in the original model.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, cast

import torch
import torch.fx as fx

__all__ = [
    "COMPUTE_OPS",
    "is_compute",
    "compute_nodes",
    "node_params",
    "node_buffers",
    "canonical_names",
    "CANONICAL_NAMES_KEY",
    "module_path",
    "normalise_path",
    "fetch_attr",
]

COMPUTE_OPS = ("call_function", "call_method", "call_module")
_IGNORED_MODULES = ("_guards_fn",)


def is_compute(node: fx.Node) -> bool:
    """True for nodes that do work (see module docstring)."""
    return node.op in COMPUTE_OPS and not (node.op == "call_module" and node.target in _IGNORED_MODULES)


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Compute nodes in topological (graph) order."""
    return [n for n in gm.graph.nodes if is_compute(n)]


CANONICAL_NAMES_KEY = "rpcompile.canonical_names"
"""``gm.meta`` key caching :func:`canonical_names` (by ``id``: whoever swaps ``gm``'s tensors re-points it meanwhile)."""


def canonical_names(gm: fx.GraphModule) -> dict[int, str]:
    """id(tensor) -> the one name ``gm.named_parameters()``/``named_buffers()`` gives it (a tied weight has
    several attribute paths but one canonical name)."""
    cache = gm.meta.get(CANONICAL_NAMES_KEY)
    if cache is None:
        # named_parameters() lists a tied weight once, under its first name: one name per tensor
        cache = {id(t): name for name, t in [*gm.named_parameters(), *gm.named_buffers()]}
        gm.meta[CANONICAL_NAMES_KEY] = cache
    return cache


def _attr_values(gm: fx.GraphModule, node: fx.Node, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    names = canonical_names(gm)
    if node.op == "call_module" and node.target not in _IGNORED_MODULES:
        assert isinstance(node.target, str)  # a call_module node's target is the submodule's qualified name
        mod = gm.get_submodule(node.target)
        items = mod.named_parameters(prefix=node.target) if kind == "param" else mod.named_buffers(prefix=node.target)
        # the canonical name: a tied weight reached through this module's path still reports its one name
        yield from ((names.get(id(t), name), t) for name, t in items)
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            assert isinstance(arg.target, str)  # a get_attr node's target is the attribute's qualified name
            value = fetch_attr(gm, arg.target)
            # parameters on one side; buffers and tensor constants on the other
            if isinstance(value, torch.nn.Parameter) == (kind == "param") and isinstance(value, torch.Tensor):
                yield names.get(id(value), arg.target), value


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    """The attribute ``target`` (a dotted path such as ``layers.3.attn.weight``) of ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def node_params(gm: fx.GraphModule, node: fx.Node) -> dict[str, torch.nn.Parameter]:
    """Parameters ``node`` reads, by fully-qualified name."""
    # kind "param" yields named_parameters() and get_attr values that are Parameters only
    return cast("dict[str, torch.nn.Parameter]", dict(_attr_values(gm, node, "param")))


def node_buffers(gm: fx.GraphModule, node: fx.Node) -> dict[str, torch.Tensor]:
    """Buffers (and tensor constants) ``node`` reads, by qualified name."""
    return dict(_attr_values(gm, node, "buffer"))


def module_path(node: fx.Node) -> str:
    """FQN of the innermost module owning ``node`` (``""`` for the root), for fx and exported graphs alike.

    ``call_module`` nodes: their target. ``get_attr`` nodes: the module holding the attribute. Other nodes: the last
    entry of ``meta["nn_module_stack"]`` (recorded by both paths), normalised to plain FQN form.
    """
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    # the stack runs from the outermost module in: the last entry is the innermost
    path, _ = list(stack.values())[-1]
    return normalise_path(str(path))


def normalise_path(path: str) -> str:
    """``L['self'].model.layers[3]._modules['attn']`` (dynamo style) or ``model.layers.3.attn`` -> the latter."""
    path = re.sub(r"^L\['self'\]", "", path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]|\['([^']*)'\]", lambda m: "." + (m.group(1) or m.group(2)), path)
    return path.split("@")[0].strip(".")
