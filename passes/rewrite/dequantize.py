"""Dequantizing a 4-bit base once per stage: a stage's dequantizations moved out of its per-microbatch code.

Terms:

- *weight-only node*: a node computed from the stage's frozen weights alone — a get_attr, or an op all of whose
  inputs are weight-only (no placeholder, nothing random): its value is the same for every microbatch.
- *dequantization*: a weight-only ``torch.ops.rpcompile.dequantize_nf4`` node (:mod:`rpcompile.core.quant`; a
  quantized linear layer's weight, :mod:`rpcompile.passes.graph.quantized`).
- *prologue*: a stage's dequantizations and the weight-only nodes they read, as a graph of their own with no
  inputs (it reads the stage's parameters as attributes) returning the dequantized weights. The runtime runs it
  once per stage, when the stage's weights are up and before its first microbatch, without autograd (the base is
  frozen), and holds its results until the stage ends (:func:`rpcompile.runtime.stage_call.call`).
- *derived weight*: one result of the prologue; the stage's code reads it as an attribute next to the packed
  weight (``…q_proj.weight_dequantized``), put there for each call as the parameters are.

Run per microbatch (as the trace has it) every microbatch would dequantize its stage's whole weight set again, and
a backward stage's autograd would keep a copy per microbatch; held, a stage dequantizes once and its memory holds
the dequantized weights (2 bytes a weight in bf16) beside the packed ones (0.52) for as long as it runs — what the
planner prices (:mod:`rpcompile.passes.formulate`: the dequantization's time once per stage, its bytes held).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx

from rpcompile.core.quant import dequantize_nf4

__all__ = ["DEQUANTIZE", "DERIVED_SUFFIX", "dequantizations", "hoist_dequantize", "derived_bytes"]

DEQUANTIZE = dequantize_nf4._opoverload
"""The op a traced quantized layer dequantizes with (``torch.ops.rpcompile.dequantize_nf4.default``)."""

DERIVED_SUFFIX = "_dequantized"
"""A derived weight's attribute: the packed weight's, with this suffix."""


def _weight_only(gm: fx.GraphModule) -> set[fx.Node]:
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        # graph order: inputs are classified first; a placeholder never qualifies, nor anything reading the microbatch
        if n.op == "get_attr" or (n.op in ("call_function", "call_method") and all(a in out for a in n.all_input_nodes)):
            out.add(n)
    return out


def dequantizations(gm: fx.GraphModule, *, planning: bool = False) -> list[fx.Node]:
    """``gm``'s weight-only dequantizations (module docstring), in graph order. ``planning``: also those whose
    dtype is read off an activation (``x.dtype`` in a planning model's fx trace, :mod:`rpcompile.tools.qlora`):
    the same for every microbatch of a run, so the runtime would hold them too — the planner prices them so."""
    const = _weight_only(gm)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is DEQUANTIZE
            # args[:4]: the packed weight, absmax, scales and code; planning lets the dtype come from an activation
            and (n in const or (planning and all(a in const for a in n.args[:4])))]


def _ancestors(nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` and every node they read, transitively (all weight-only)."""
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return list(seen)


def hoist_dequantize(gm: fx.GraphModule) -> tuple[fx.GraphModule | None, tuple[str, ...]]:
    """Move ``gm``'s dequantizations into a prologue (module docstring), in place: each becomes a get_attr of its
    derived weight (a meta tensor until the runtime puts the device's there), keeping its name so that the code
    reads the same. Returns the prologue (None when there is nothing to hoist) and the derived weights'
    attributes, in the order the prologue returns them."""
    deq = dequantizations(gm)
    if not deq:
        return None, ()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    # graph order, so every copy finds what it reads already in env
    for n in sorted(_ancestors(deq), key=order.__getitem__):
        env[n] = g.node_copy(n, env.__getitem__)
    attrs = []
    for n in deq:
        packed = n.args[0]
        assert isinstance(packed, fx.Node) and packed.op == "get_attr"  # weight-only: read straight off the stage
        attr = f"{packed.target}{DERIVED_SUFFIX}"
        path, _, key = attr.rpartition(".")
        owner = gm.get_submodule(path) if path else gm
        shape, dtype = list(n.args[4]), n.args[6]  # type: ignore[arg-type]  # dequantize_nf4's signature
        # not a parameter or buffer: it is made on the device by the prologue, never uploaded as the weights are
        owner.__dict__[key] = torch.empty(shape, dtype=dtype, device="meta")  # type: ignore[arg-type]
        with gm.graph.inserting_before(n), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a plain attribute, on purpose: no parameter, no buffer
            got = gm.graph.get_attr(attr)
        n.replace_all_uses_with(got)
        env[n]._rename(got.name)  # the prologue's value and the forward's read of it under one name in the code
        attrs.append(attr)
    g.output(tuple(env[n] for n in deq))
    # gm as the root: the prologue's get_attr nodes resolve to the stage's own packed weights, shared, not copied
    prologue = fx.GraphModule(gm, g, class_name="Prologue")
    # only now: the prologue copied them above, and every use was pointed at the derived weight
    for n in deq:
        gm.graph.erase_node(n)
    for n in reversed(list(gm.graph.nodes)):  # what only the dequantizations read (the no-nesting empty scales)
        if n in env and not n.users and n.op in ("get_attr", "call_function", "call_method") and not n.is_impure():
            gm.graph.erase_node(n)
    gm.recompile()
    return prologue, tuple(attrs)


def derived_bytes(node: fx.Node, element_bytes: int) -> int:
    """Bytes a dequantization's result holds: its shape in its dtype, or ``element_bytes`` each (the compute
    precision's) when the dtype is read off an activation."""
    shape: Any = node.args[4]  # dequantize_nf4's signature: a sequence of ints, then the blocksize and the dtype
    dtype = node.args[6]
    count = 1
    for d in shape:
        count *= int(d)
    if isinstance(dtype, torch.dtype):
        # a dtype the trace fixed wins over the compute precision's guess
        element_bytes = dtype.itemsize
    return count * element_bytes
