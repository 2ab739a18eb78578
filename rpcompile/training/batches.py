"""What a call's batch becomes: the inputs checked, split into microbatches and put where the stages read them, and
the loss each microbatch's fused stage computes, weighted by its share of the batch.

A :class:`~rpcompile.training.pipeline.Pipeline` call (``forward_backward``, ``evaluate``, ``forward``) hands its batch to
:func:`call_batch`, which in order

1. takes an HF batch dict's ``labels`` as the target (unless the model takes them itself) and binds the inputs to
   the compiled signature (:class:`~rpcompile.training.signature.InputSignature`), refusing a missing or unused target;
2. splits the batch along dim 0 into the plan's microbatches — fewer for a batch with fewer rows
   (:func:`microbatches_of`) — into a :class:`~rpcompile.runtime.values.ValueStore` (:func:`microbatch_store`);
3. checks integer labels against the classes the model scores (:func:`output_classes`, or a split LM head's) on
   the host, not at a device-side assert on a GPU;
4. weights each microbatch's mean loss by what it averages over (:func:`microbatch_weights`: real tokens or rows)
   divided by the batch's total — summed over the ranks, data-parallel, or ``num_items`` of gradient accumulation
   (:func:`checked_accumulation`) — in the :class:`~rpcompile.training.loss_weighting.MicrobatchLoss` the fused stage calls;
5. names the inputs that require grad, whose gradients ``forward_backward`` computes too.

The pipeline's own contracts (the Loss, padded batches, ``reduction="sum"``) are :mod:`rpcompile.training.pipeline`'s.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import torch
import torch.fx as fx

from rpcompile.runtime.values import ValueStore

from ..core.batch import TARGET, flat_inputs, split_microbatches, tensor_leaves
from ..core.errors import ConfigError, RPCompileError
from ..core.program import Program
from .loss_weighting import MicrobatchLoss, check_labels, label_bounds, loss_weights
from .signature import InputSignature, needs_target

__all__ = ["CallBatch", "Batched", "checked_accumulation", "output_classes", "call_batch", "microbatches_of",
           "microbatch_store", "microbatch_weights"]


class Batched(Protocol):
    """What :func:`call_batch` reads of a :class:`~rpcompile.training.pipeline.Pipeline` (which imports this module), at
    every call: its attributes may change between calls."""

    gm: fx.GraphModule
    program: Program
    microbatches: int
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    loss_weight: Any
    loss_in_graph: bool
    signature: InputSignature | None
    classes: int | None


class CallBatch(NamedTuple):
    """A call's batch as the stages take it (:func:`call_batch`)."""

    store: ValueStore
    """Each microbatch's inputs, by placeholder."""
    microbatches: int
    loss: MicrobatchLoss
    """The loss the fused stage computes for each microbatch, weighted."""
    targets: list[Any] | None
    """Each microbatch's target, for a ``loss_fn`` after the last stage; None otherwise."""
    input_grads: dict[str, torch.Tensor]
    """The inputs that require grad (``x.requires_grad_()``: a saliency map, an adversarial step, a soft prompt),
    by placeholder: ``forward_backward`` computes their gradients too (:mod:`rpcompile.training.pipeline`)."""


def checked_accumulation(loss_scale: Any, num_items: Any) -> tuple[float, float | None]:
    """``forward_backward``'s ``loss_scale`` and ``num_items``, refused in one line unless finite and (for
    ``num_items``) positive."""
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not math.isfinite(loss_scale):
        raise ConfigError(f"loss_scale={loss_scale!r}; give a finite number (1 / steps to accumulate over steps)")
    if num_items is not None and (isinstance(num_items, bool) or not isinstance(num_items, (int, float))
                                  or not math.isfinite(num_items) or num_items <= 0):
        raise ConfigError(f"num_items={num_items!r}; give what the loss averages over in every batch accumulated "
                          "(a positive count of real tokens or rows), or None for this batch's own")
    return float(loss_scale), None if num_items is None else float(num_items)


def output_classes(model: torch.nn.Module) -> int | None:
    """The rows of an HF model's output embeddings (``get_output_embeddings()``, its LM head): the classes its
    logits score. None for a model without them."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model that does not implement it has none to check against
        return None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def call_batch(pipe: Batched, call: str, inputs: Sequence[Any], target: Any, kwargs: dict[str, Any], *,
               total_of: Callable[[float], float] | None = None,
               accumulation: tuple[float, float | None] = (1.0, None)) -> CallBatch:
    """``pipe``'s ``call``'s batch as the stages take it: the inputs checked against the compiled signature and
    split into microbatches (fewer for a batch with fewer rows), each microbatch's target and weight (the loss they
    average over, summed over the ranks by ``total_of`` where given), and the loss the fused stage computes
    (``accumulation``: the ``loss_scale`` and ``num_items`` of ``forward_backward``)."""
    if target is None and "labels" in kwargs and pipe.loss_fn is not None and \
            (pipe.signature is None or "labels" not in pipe.signature.names):
        target = kwargs.pop("labels")  # an HF batch dict: its labels are the loss's target
    if pipe.signature is not None:  # refuse what the stages were not compiled for, in one line (signature.py)
        inputs, kwargs = pipe.signature.bind(inputs, kwargs)
        pipe.signature.check_target(target, inputs, kwargs, used=pipe.loss_in_graph or pipe.loss_fn is not None,
                                    needed=pipe.loss_in_graph or needs_target(pipe.loss_fn), call=call)
    if pipe.loss_in_graph:
        if not isinstance(target, torch.Tensor):
            raise RPCompileError("this pipeline computes the loss inside its graph (head_chunks > 1): "
                                 f"pass the batch's target, {call}(x, target=y)")
        # the loss inside the graph reads its target as a placeholder (TARGET): split and stored with the inputs
        kwargs = {**kwargs, TARGET: target}
    m = microbatches_of(inputs, kwargs, pipe.microbatches)
    store, sizes = microbatch_store(pipe.gm, pipe.program.placeholders, inputs, kwargs, m)
    outside = pipe.loss_fn is not None and not pipe.loss_in_graph  # the loss runs after the last stage
    # a target's tensors are split with the inputs — also inside a tuple or dict, (values, row weights) — so each
    # microbatch's loss gets its own rows (the whole tuple would broadcast against one-row microbatches)
    pieces = [p[0] for p in split_microbatches((target,), m)] if tensor_leaves(target) else [target] * m
    # each microbatch's target goes to the device of the stage that computes its loss (the executor uploads it)
    targets = pieces if outside else None
    # a mean over the batch is the weighted mean of the microbatches' means (weights: what each mean averages
    # over, loss_weights; the model's own loss averages over its labels); a sum is their sum
    summed = outside and getattr(pipe.loss_fn, "reduction", "mean") == "sum"
    where = "graph" if pipe.loss_in_graph else "outside" if outside else "own"
    # labels out of the model's classes: refused here, not at a device-side assert on a GPU (loss_weighting)
    labels = target if where == "graph" else kwargs.get("labels") if where == "own" else None
    if isinstance(labels, torch.Tensor):
        check_labels(label_bounds(labels), pipe.classes, "labels" if where == "own" else "target")
    bounds = [label_bounds(p) for p in pieces] if outside else []
    weights = microbatch_weights(pipe.loss_fn, pipe.loss_weight, kwargs, pieces, sizes, m)
    # the denominator of every microbatch's weight; data-parallel, every rank's total, so that the ranks' gradients,
    # summed, are those of the whole batch's mean
    total = total_of(sum(weights)) if total_of is not None else sum(weights)
    scale, items = accumulation
    if items is not None:
        if summed:
            raise ConfigError(f"num_items={items:g} sets what a mean loss averages over, but loss_fn sums "
                              "(reduction='sum'): scale it with loss_scale= instead")
        if items < total:
            raise ConfigError(f"num_items={items:g} but this batch alone averages over {total:g} (its real "
                              "tokens, or rows): pass the count over every batch the gradients accumulate over")
        total = items
    loss_of = MicrobatchLoss(pipe.loss_fn, where, weights, total, summed=summed, bounds=bounds, scale=scale,
                             checked_targets=pipe.signature is not None and pipe.signature.target is not None)
    flat = flat_inputs(pipe.gm, inputs, kwargs)
    # read from the caller's tensors: the store holds detached ones (microbatch_store)
    wanted = {name: v for name, v in zip(pipe.program.placeholders, flat)
              if isinstance(v, torch.Tensor) and v.requires_grad}
    return CallBatch(store, m, loss_of, targets, wanted)


def microbatches_of(inputs: Sequence[Any], kwargs: Mapping[str, Any], microbatches: int) -> int:
    """The plan's ``microbatches``, or one row each for a batch with fewer rows."""
    rows = next((v.shape[0] for v in tensor_leaves((inputs, kwargs)) if v.dim() > 0), microbatches)
    # at most one microbatch per row: split_microbatches refuses a batch smaller than its microbatches
    return max(1, min(microbatches, rows))


def microbatch_store(gm: fx.GraphModule, placeholders: Sequence[str], inputs: Sequence[Any],
                     kwargs: Mapping[str, Any], m: int) -> tuple[ValueStore, list[int]]:
    """A call's inputs flattened into ``gm``'s placeholders and split into ``m`` microbatches, put where the first
    stages read them; each microbatch's rows (1 for a batch without a batch dimension). Detached: a stage never
    reaches back into the caller's autograd graph (an input's gradient comes home by name, ``CallBatch``)."""
    flat = [v.detach() if isinstance(v, torch.Tensor) else v for v in flat_inputs(gm, inputs, kwargs)]
    pieces = split_microbatches(flat, m)
    store = ValueStore()
    for j, piece in enumerate(pieces):
        for name, value in zip(placeholders, piece):
            store.put(name, j, value)
    sizes = [next((v.shape[0] for v in p if isinstance(v, torch.Tensor) and v.dim() > 0), 1) for p in pieces]
    return store, sizes


def microbatch_weights(loss_fn: Callable[[Any, Any], torch.Tensor] | None, loss_weight: Any,
                       kwargs: Mapping[str, Any], pieces: Sequence[Any], sizes: Sequence[int], m: int) -> list[float]:
    """What each microbatch's mean loss averages over (:func:`~.loss_weighting.loss_weights`): the labels of
    the model's own loss (``loss_fn`` None), the target ``pieces`` of ``loss_fn``, else the rows."""
    labels = kwargs.get("labels") if loss_fn is None else None
    if isinstance(labels, torch.Tensor):
        # split as the inputs are, so each microbatch counts its own labels
        return loss_weights([p[0] for p in split_microbatches((labels,), m)], sizes, loss_weight)
    if loss_fn is not None:
        return loss_weights(pieces, sizes, loss_weight)
    return [float(n) for n in sizes]
