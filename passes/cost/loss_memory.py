"""The device memory of a loss that runs after the graph (the whole LM head, ``head_chunks=1``).

Terms:

- *outside loss*: with ``head_chunks=1`` the loss is no node of the graph; the runtime calls ``loss_fn(output,
  target)`` on the fused stage's device after the graph's last node and runs its backward there. For ``lm_loss``
  that is an fp32 copy of the bf16 logits, the fp32 log-softmax kept for backward and, in backward, the fp32
  gradients of both and the logits' own gradient: about six times the bf16 logits at once (7 with the logits),
  which the graph ends with (at 125,952 tokens of a 128,256-word vocabulary, 30 GiB of logits and 180 GiB beside
  them). The cost pass never sees it.
- *peak bytes*: the most bytes the loss's forward and backward hold at once, beyond its inputs (the graph's output
  is already counted as the fused stage's output boundary).

:func:`loss_memory` runs the loss once on meta tensors shaped like the graph's output, in the dtype the output has
when the stage runs, and tracks every storage it allocates until freed; the planner keeps the result in
``gm.meta[LOSS_BYTES_KEY]`` and the problem pass adds it to the last segment, which is always in the fused stage.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..graph.meta import MetaSafeMode
from ..graph.shape import SHAPE_KEY, storage_key

__all__ = ["LOSS_BYTES_KEY", "PeakBytes", "loss_memory"]

LOSS_BYTES_KEY = "rpcompile.loss_bytes"
"""``gm.meta`` key: peak bytes of the loss that runs after the graph (:func:`loss_memory`); absent: none (the loss
is in the graph, or there is none)."""

log = logging.getLogger(__name__)


class PeakBytes(TorchDispatchMode):
    """While active: the most bytes of storage allocated under it alive at once (``peak``); storages of
    ``ignore`` (the inputs) and views of them do not count."""

    def __init__(self, ignore: list[torch.Tensor]) -> None:
        super().__init__()
        self.ignore = {storage_key(t) for t in ignore}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}  # a freed address may be reused
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and storage_key(t) not in self.ignore:
                storage = t.untyped_storage()
                # a view of a storage already live adds nothing: storages are counted once, by identity
                self.live.setdefault(storage_key(t), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _stand_in(t: Any) -> Any:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t


def loss_memory(gm: fx.GraphModule, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any) -> int:
    """Peak bytes of ``loss_fn(output, target)`` and its backward beyond its inputs (module docstring), with the
    output a meta tensor of the shape and dtype the shape pass recorded for ``gm``'s single output; 0 when the
    output is not a single tensor (an HF model's output object: not modelled) or the loss cannot run on meta."""
    (value,) = gm.graph.output_node().args
    info = value.meta.get(SHAPE_KEY) if isinstance(value, fx.Node) else None
    if info is None or len(info.tensors) != 1:
        log.debug("the graph's output is not one tensor: the loss after it is not costed")
        return 0
    t = info.tensors[0]
    # requires_grad: the loss's backward to the logits runs in the fused stage too, and its gradients are the bulk
    output = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="meta", requires_grad=True)
    meta_target = pytree.tree_map(_stand_in, target)
    inputs = [output, *(x for x in pytree.tree_leaves(meta_target) if isinstance(x, torch.Tensor))]
    peak = PeakBytes(inputs)
    try:
        with torch.enable_grad(), MetaSafeMode(), peak:
            loss_fn(output, meta_target).backward()
    except Exception as err:  # noqa: BLE001 - a loss that reads values (.item()) cannot run on meta
        log.debug("the loss cannot run on meta (%s: %s): not costed", type(err).__name__, err)
        return 0
    return peak.peak
