"""A batch as the pipeline sees it: a call's inputs flattened into a graph's placeholders, and split into
microbatches along dim 0. The passes use it on the example batch, the training loop on every batch."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .errors import BatchSplitError, InputError

__all__ = ["TARGET", "flat_inputs", "joined", "split_microbatches", "tensor_leaves"]

#: Name of the graph input a loss inside the graph reads its target from (the placeholder
#: :func:`rpcompile.passes.rewrite.loss_head.attach_loss` adds; a call's target binds to it).
TARGET = "target"


def flat_inputs(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> list[Any]:
    """The values of ``gm``'s placeholders, in order, for a call ``gm(*args, **kwargs)``.

    Graphs from torch.export take pytree-flattened inputs; graphs from symbolic_trace take one value per
    placeholder (positional first, then keyword by placeholder name, then defaults). Placeholders whose value
    the host computes (:mod:`rpcompile.passes.rewrite.host`) are not inputs and have no value here.
    """
    kwargs = dict(kwargs or {})
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        spec = info.in_spec
        children = spec.children()
        # export flattened the keyword inputs in the order it saw them: the call's
        # reordered to match, so that the leaves line up with the placeholders
        if len(children) == 2 and children[1].context is not None:
            order = list(children[1].context)
            kwargs = {k: kwargs[k] for k in order if k in kwargs}
        return pytree.tree_leaves((tuple(args), kwargs))
    values: list[Any] = []
    it = iter(args)
    # placeholders the host computes take no value from the call
    computed = {h.value for h in gm.meta.get("rpcompile.host", ())}  # passes/rewrite/host.py's HOST_KEY
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.name in computed:
            continue
        try:
            values.append(next(it))
        except StopIteration:
            if node.name in kwargs:
                values.append(kwargs[node.name])
            # a placeholder for *args or **kwargs has the stars in its target
            elif node.target.lstrip("*") in kwargs:
                values.append(kwargs[node.target.lstrip("*")])
            # symbolic_trace records a parameter's default as its placeholder's only argument
            elif node.args:
                values.append(node.args[0])
            else:
                raise InputError(f"no value for the graph's input {node.name!r}; pass it as in the compile "
                                 "example") from None
    return values


def split_microbatches(values: Sequence[Any], microbatches: int) -> list[tuple[Any, ...]]:
    """Split every tensor in ``values`` — also inside tuples, lists and dicts (a batch dict) — along dim 0 into
    ``microbatches`` pieces of the same structure (other values are repeated)."""
    values, spec = pytree.tree_flatten(list(values))
    sizes = {v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) > 1:
        raise BatchSplitError(f"inputs disagree on the batch size (dim 0): {sorted(sizes)}; pass tensors with one "
                              "batch dimension, or constants as non-tensor arguments")
    # no tensor with a batch dimension: a batch of one, which splits no further
    batch = sizes.pop() if sizes else 1
    if microbatches < 1 or batch < microbatches:
        raise BatchSplitError(
            f"a batch of {batch} cannot be split into {microbatches} microbatches; "
            f"use microbatches between 1 and {batch} (--microbatches) or a larger batch (--batch-size)"
        )
    # tensor_split allows uneven pieces (the first ones one row longer); scalars and non-tensors go to every microbatch
    pieces = [
        torch.tensor_split(v, microbatches, dim=0) if isinstance(v, torch.Tensor) and v.dim() > 0 else [v] * microbatches
        for v in values
    ]
    return [tuple(pytree.tree_unflatten([p[j] for p in pieces], spec)) for j in range(microbatches)]


def joined(outputs: Sequence[Any], weights: Sequence[float]) -> Any:
    """The whole batch's output from its microbatches' outputs (the inverse of :func:`split_microbatches`), leaf by
    leaf: a tensor with a batch dimension is concatenated along dim 0; a scalar tensor (a mean loss) is the mean
    of the microbatches' weighted by ``weights`` (what each averages over; a microbatch weighing nothing is left
    out, and a batch that weighs nothing is nan, as eager's mean over nothing); anything else is the first's."""
    if len(outputs) == 1:
        return outputs[0]
    total = sum(weights)

    def join(*leaves: Any) -> Any:
        first = leaves[0]
        if not isinstance(first, torch.Tensor):
            return first
        if first.dim() > 0:
            return torch.cat(leaves)
        if total == 0:
            return torch.full_like(first, float("nan"))
        return sum(leaf * (w / total) for leaf, w in zip(leaves, weights) if w)

    return pytree.tree_map(join, outputs[0], *outputs[1:])


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a (possibly nested) value."""
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
