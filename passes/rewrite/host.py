"""``host_embedding_pass``: token embeddings run on the host, next to their fp32 master.

- *token embedding*: an ``nn.Embedding``, ``F.embedding`` or ``aten.embedding`` whose indices are a model input
  (:func:`host_candidates`) — a gather: almost no compute and a large table;
- *moved* embedding: its node becomes a placeholder the device stages read, and ``gm.meta[HOST_KEY]`` records a
  :class:`~rpcompile.core.program.HostEmbedding` for it, all the runtime needs (:mod:`rpcompile.runtime.executor`).

Why a moved embedding saves the link and the pipeline's fill and drain, and the graph rewrite:
:func:`host_embedding_pass`; which embeddings move by default: :func:`_pays`.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from rpcompile.core.errors import ConfigError
from rpcompile.core.program import HostEmbedding

from ..graph.shape import SHAPE_KEY
from ..graph.util import node_params

__all__ = ["HOST_KEY", "host_embedding_pass", "host_candidates", "host_of", "as_planned"]

HOST_KEY = "rpcompile.host"


def _lookup(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, torch.nn.Parameter, str, int | None] | None:
    """``(index node, table, table name, padding_idx)`` when ``node`` is a plain embedding lookup, else None."""
    args, kwargs = list(node.args), dict(node.kwargs)
    index: fx.node.Argument
    weight: fx.node.Argument
    padding: Any  # the lookup's padding_idx: an int or None (a graph node is refused below)
    names: tuple[str, ...]
    if node.op == "call_module":
        assert isinstance(node.target, str)  # a call_module node's target is the submodule's qualified name
        mod = gm.get_submodule(node.target)
        # the exact type: a subclass may change forward, which the host's plain lookup would not follow
        if type(mod) is not torch.nn.Embedding or len(args) != 1 or kwargs:
            return None
        if mod.max_norm is not None or mod.scale_grad_by_freq or mod.sparse:
            return None
        index, weight, padding = args[0], mod.weight, mod.padding_idx
    elif node.op == "call_function" and node.target is F.embedding:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
        bound = dict(zip(names, args)) | kwargs
        if bound.get("max_norm") is not None or bound.get("scale_grad_by_freq") or bound.get("sparse"):
            return None
        index, weight, padding = bound.get("input"), bound.get("weight"), bound.get("padding_idx")
    elif node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
        names = ("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse")
        bound = dict(zip(names, args)) | kwargs
        if bound.get("scale_grad_by_freq") or bound.get("sparse"):
            return None
        index, weight, padding = bound.get("indices"), bound.get("weight"), bound.get("padding_idx", -1)
        # aten.embedding says "no padding" with -1; HostEmbedding with None
        padding = None if padding is None or padding < 0 else padding
    else:
        return None
    # the indices must be a model input, which the host holds before any stage runs; padding must be a constant
    if not isinstance(index, fx.Node) or index.op != "placeholder" or isinstance(padding, fx.Node):
        return None
    params = node_params(gm, node)
    if len(params) != 1:
        return None
    (name, table), = params.items()
    if isinstance(weight, fx.Node) and weight.op != "get_attr":
        return None
    return index, table, name, padding


def host_candidates(gm: fx.GraphModule) -> list[fx.Node]:
    """Embedding nodes the host could run (token embeddings: module docstring), in graph order. Never a
    ``max_norm`` lookup (it renormalises the table in place), nor ``scale_grad_by_freq`` and ``sparse`` ones."""
    return [n for n in gm.graph.nodes if _lookup(gm, n) is not None]


def _pays(node: fx.Node, table: torch.Tensor, microbatches: int) -> bool:
    """The table has more rows than an iteration's lookups gather.

    By default an embedding moves when that moves fewer bytes: when its table has more rows than an iteration
    gathers (``vocab > microbatches × indices per microbatch``) — the link then carries less, the host does less
    (gathering rows instead of casting the table for its upload, adding rows instead of the table's gradient) and
    the pipeline's first and last stages no longer wait for the table."""
    info = node.meta.get(SHAPE_KEY)
    if info is None or not info.tensors:
        return False
    # every dimension but the embedding's last one counts a looked-up index
    rows_per_microbatch = math.prod(info.tensors[0].shape[:-1])
    return table.shape[0] > microbatches * rows_per_microbatch


def host_embedding_pass(gm: fx.GraphModule, *, microbatches: int = 1,
                        names: Sequence[str] | None = None) -> fx.GraphModule:
    """Move token embeddings to the host: the ones that pay (``names=None``, :func:`_pays`) or exactly the nodes
    ``names`` (a plan's choice; ValueError naming a node that is not such an embedding).

    A token embedding's table is large — Llama-3-8B's is 128,256 × 4,096, 1 GB in bf16. On a GPU of the
    round-robin pipeline the first stage must upload the whole table before its first microbatch, every iteration
    and on the fill's critical path (every later stage waits for it), and the last backward stage must send the
    whole table's gradient home after its last microbatch, on the drain's. On the host, where the master lives,
    the same lookup gathers just the microbatch's rows, and its backward adds just those rows' gradients into the
    master's ``.grad``: the first stage receives the gathered rows (``tokens × dim``) as its input, and the stage
    that runs the backward of its users sends their gradient down like any stage's input gradient.

    The pass rewrites the graph: each moved embedding node becomes a placeholder (the value the device stages
    read; fx names it after the node) and ``gm.meta[HOST_KEY]`` records a
    :class:`~rpcompile.core.program.HostEmbedding` per moved node, which is all the runtime needs
    (:mod:`rpcompile.runtime.executor`). A placeholder's value is computed, never passed in:
    :func:`~rpcompile.core.batch.flat_inputs` skips it."""
    moved = list(gm.meta.get(HOST_KEY, ()))
    if names is None:
        chosen = []
        for n in host_candidates(gm):
            found = _lookup(gm, n)
            if found is not None and _pays(n, found[1], microbatches):
                chosen.append(n)
    else:
        by_name = {n.name: n for n in gm.graph.nodes}
        chosen = []
        for name in names:
            node = by_name.get(name)
            if node is None or _lookup(gm, node) is None:
                raise ConfigError(f"node {name!r} is not an embedding lookup of a model input that the host can run "
                                  "(a plan made for another graph?); re-plan for this model")
            chosen.append(node)
    graph = gm.graph
    for node in chosen:
        found = _lookup(gm, node)
        assert found is not None  # every chosen node is a lookup (checked above)
        index, _, weight, padding = found
        # after the last placeholder: the model's own inputs keep their positions
        last = list(graph.find_nodes(op="placeholder"))[-1]
        with graph.inserting_after(last):
            value = graph.placeholder(node.name)
        # only the shape carries over: the placeholder does no work, so it has no cost or module of its own
        value.meta = {k: v for k, v in node.meta.items() if k == SHAPE_KEY}
        node.replace_all_uses_with(value)
        moved.append(HostEmbedding(node=node.name, value=value.name, index=index.name, weight=weight,
                                   padding_idx=padding))
        graph.erase_node(node)
    if chosen:
        gm.recompile()
    gm.meta[HOST_KEY] = tuple(moved)
    return gm


def host_of(gm: fx.GraphModule) -> tuple[HostEmbedding, ...]:
    """The lookups :func:`host_embedding_pass` moved to the host (empty when none)."""
    return tuple(gm.meta.get(HOST_KEY, ()))


def as_planned(gm: fx.GraphModule, names: Sequence[str]) -> fx.GraphModule:
    """``gm`` with the lookups ``names`` (a plan's ``host``) moved to the host: ``gm`` itself when it already has
    exactly those, else a rewritten copy that shares its parameters (a plain traced model stays untouched)."""
    if tuple(h.node for h in host_of(gm)) == tuple(names) or (not names and HOST_KEY not in gm.meta):
        return gm
    if host_of(gm):
        raise ConfigError(f"the graph runs {[h.node for h in host_of(gm)]} on the host, the plan {list(names)}; "
                          "re-plan for this graph")
    # a copy of the graph only: the new module takes gm's parameters by reference, so nothing is duplicated
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    # a copy: the rewrite's HOST_KEY must not land in gm's meta
    out.meta = dict(gm.meta)
    return host_embedding_pass(out, names=names)
