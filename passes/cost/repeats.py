"""Repeated blocks of a graph (32 identical decoder layers): which nodes may share one measurement.

A *block* is the run of compute nodes owned by one indexed module (``layers.3``: the module path up to its first numeric
part, :func:`~rpcompile.passes.graph.util.module_path`). Names only propose blocks; two blocks are *repeats* when their
signatures are equal: the block module's type, and node by node the op, the target (a submodule by its type and
parameter shapes, never its name), every argument (a node inside the block by its position there, one outside by its
order of first use and its shapes and dtypes, a parameter or buffer by its shape, dtype and kind, constants by value)
and the output's shapes and dtypes. Each repeat's nodes map to the nodes at the same positions in the first block of
their signature (its *representative*), which :func:`~.cost.cost_pass` measures alone.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx

from ..graph.fingerprint import qualified_target
from ..graph.shape import SHAPE_KEY
from ..graph.util import fetch_attr, normalise_path, compute_nodes, module_path

__all__ = ["block_of", "repeat_map"]

_INDEX = re.compile(r"^\d+$")


def block_of(node: fx.Node) -> str | None:
    """The indexed module owning ``node`` (``model.layers.3`` for ``model.layers.3.mlp.up``), None outside any."""
    parts = module_path(node).split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return None


def _tensor_sig(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        kind = "param" if isinstance(t, torch.nn.Parameter) else "buffer"
        # requires_grad too: a frozen block and a trainable one run different backwards
        return f"{kind}{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
    return type(t).__name__


def _shapes(node: fx.Node) -> Any:
    """A node's output shapes and dtypes (whether it aliases an input is left out: it changes no time)."""
    info = node.meta.get(SHAPE_KEY)
    tensors = getattr(info, "tensors", None)
    return repr(info) if tensors is None else tuple((t.shape, t.dtype) for t in tensors)


def _module_sig(mod: torch.nn.Module) -> str:
    state = [(n, _tensor_sig(t)) for n, t in [*mod.named_parameters(), *mod.named_buffers()]]
    return f"{type(mod).__module__}.{type(mod).__qualname__}{state}"


def _block_type(nodes: list[fx.Node], block: str) -> str:
    """The block module's type as the trace recorded it (``nn_module_stack``), "" when not recorded."""
    for n in nodes:
        for path, typ in (n.meta.get("nn_module_stack") or {}).values():
            if normalise_path(str(path)) == block:
                return typ if isinstance(typ, str) else f"{typ.__module__}.{typ.__qualname__}"
    return ""


def _signature(gm: fx.GraphModule, nodes: list[fx.Node], block: str) -> tuple:
    pos = {n: i for i, n in enumerate(nodes)}
    outside: dict[fx.Node, int] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a in pos:
                # a node of the block by its position in it: blocks compare without their node names
                return f"#{pos[a]}"
            if a.op == "get_attr":
                return "attr:" + _tensor_sig(fetch_attr(gm, str(a.target)))
            # an outside value by its order of first use: blocks match when they read their inputs alike
            k = outside.setdefault(a, len(outside))
            return f"in{k}:{_shapes(a)}"
        if isinstance(a, (tuple, list)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg(v)) for k, v in a.items())
        if isinstance(a, (int, float, bool, str, type(None), slice, torch.dtype, torch.device, torch.memory_format,
                          torch.layout)):
            return repr(a)
        # any other object by its type only: its identity or repr would differ from block to block
        return type(a).__name__

    sig: list[Any] = [_block_type(nodes, block)]
    for n in nodes:
        if n.op == "call_module":
            target = "module:" + _module_sig(gm.get_submodule(str(n.target)))
        else:
            target = qualified_target(n)
        sig.append((n.op, target, arg(n.args), arg(n.kwargs), _shapes(n)))
    return tuple(sig)


def repeat_map(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Node of a repeated block → the node at the same position in its representative (the first block with the
    same signature); representatives' nodes and nodes outside blocks are not keys."""
    blocks: dict[str, list[fx.Node]] = {}
    for n in compute_nodes(gm):
        b = block_of(n)
        if b is not None:
            blocks.setdefault(b, []).append(n)
    first: dict[tuple, list[fx.Node]] = {}
    out: dict[fx.Node, fx.Node] = {}
    for name, nodes in blocks.items():
        # the first block (in graph order) with a signature is its representative
        rep = first.setdefault(_signature(gm, nodes, name), nodes)
        if rep is not nodes:
            out.update(zip(nodes, rep))
    return out
