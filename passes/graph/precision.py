"""Tracing and analysing an exported graph in the compute precision (``precision="bf16"``/``"fp16"``).

Terms:

- *compute dtype*: the dtype the stages compute in — the runtime uploads floating parameters and buffers cast to it
  (like ``model.to(dtype)``) while the fp32 masters stay on the host.
- *dtype-baked graph*: ``torch.export`` records concrete dtypes. A model that computes a step in fp32 and casts back
  to its input's dtype (HF's RMSNorm ``hidden_states.to(torch.float32)`` … ``.to(input_dtype)``, attention's
  ``softmax(..., dtype=torch.float32).to(query.dtype)``) traced in fp32 loses the casts back (no-ops at trace
  time), so at run time fp32 activations meet bf16 weights. Traced in the compute dtype, every cast is recorded and
  the graph runs as eager ``model.to(dtype)`` does; the analysis passes (shape, cost) then run it in that dtype too.
  fx graphs keep ``.to(x.dtype)`` symbolic and are traced as the model is, but analysed in the compute dtype
  too (:data:`RUN_DTYPE_KEY`): the shapes and costs of a bf16 plan are those of the bf16 run, upcasts included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

__all__ = ["computing_in", "cast_floating", "recorded_dtype", "TRACE_DTYPE_KEY", "RUN_DTYPE_KEY"]

TRACE_DTYPE_KEY = "rpcompile.trace_dtype"
"""``gm.meta`` key: the compute dtype an exported graph was recorded in (its casts are baked in for it: run and
analyse it with the floating weights, buffers and inputs in that dtype, and measure its nodes as they are);
``None`` or absent: as the model is, and always for fx graphs (their casts stay symbolic)."""

RUN_DTYPE_KEY = "rpcompile.run_dtype"
"""``gm.meta`` key: the compute dtype the shape and cost passes ran the graph in — its floating weights, buffers
and inputs cast to it, as the runtime uploads them — so every node's recorded dtype is the one it has at run time:
an explicit upcast (``logits.float()`` before a cross-entropy, a norm's ``.to(torch.float32)``) stays fp32 and
everything else is in the compute dtype. Bytes then count as recorded and nodes are costed as they are. ``None``
or absent: the graph ran as the model is, and byte counts are scaled to the cost model's dtype (a guess that
counts every upcast at half its size under bf16)."""

def recorded_dtype(meta: dict[str, Any]) -> torch.dtype | None:
    """The compute dtype a graph's shapes were recorded in (``gm.meta``: :data:`RUN_DTYPE_KEY`, or the dtype an
    exported graph was traced in, which it only runs in); ``None``: as the model is."""
    return meta.get(RUN_DTYPE_KEY) or meta.get(TRACE_DTYPE_KEY)


def cast_floating(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` (a tensor or a container of them) with its floating tensors in ``dtype``; others as they are."""
    if dtype is None:
        return value
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t, value)


@contextlib.contextmanager
def computing_in(module: nn.Module, dtype: torch.dtype | None, *, values: bool = True) -> Iterator[None]:
    """While inside: ``module``'s floating parameters and buffers hold ``dtype`` data (the same objects, their
    ``.data`` swapped); restored on exit. ``values=False`` gives uninitialised storage (for tracing with fake
    tensors, which never read it: no second copy of the weights is filled). ``dtype`` None: nothing changes."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point() and t.dtype != dtype]
    if dtype is None or not tensors:
        yield
        return
    saved = [t.data for t in tensors]
    try:
        with torch.no_grad():
            for t in tensors:
                # `.data`, not a new Parameter: the model, the trace and any optimizer keep pointing at the same objects
                t.data = t.data.to(dtype) if values else torch.empty_like(t.data, dtype=dtype)
        yield
    finally:
        for t, data in zip(tensors, saved):
            t.data = data
