"""Running graph nodes on the ``meta`` device robustly (shapes only, no data).

A node traced on a real device may move tensors (``.to(device)``, HF code does), carry torch.export's
``aten._assert_tensor_metadata`` checks, or — once cast to a planning dtype such as bf16 — meet a tensor it
creates itself in fp32. :class:`MetaSafeMode` makes all three harmless: device arguments become ``meta``, asserts
are skipped, and an op that rejects mixed floating dtypes is re-run on inputs cast to the first one's. Both the
cost driver and the analytic cost model run nodes under it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaSafeMode", "packet_name", "compute_dtype", "run_unifying_dtypes", "stay_on_meta", "is_assert"]

aten = torch.ops.aten


def packet_name(op: Any) -> str:
    """``aten.mm.default`` → ``"mm"``."""
    packet = getattr(op, "_overloadpacket", op)
    return getattr(packet, "__name__", str(packet)).split(".")[-1]


def is_assert(op: Any) -> bool:
    return packet_name(op).startswith("_assert")


def compute_dtype(args: tuple, kwargs: dict) -> torch.dtype:
    """The dtype an op computes in: its first floating tensor input's (fp32 if none)."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)


def run_unifying_dtypes(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``func``; if it rejects mixed floating dtypes, run it again on inputs cast to the first one's.

    Casting a graph traced in fp32 to bf16 can pair a cast tensor with one the node creates in fp32 (a
    ``.float()`` that was a no-op, and so vanished, when the graph was traced). Only shapes matter here.
    """
    try:
        return func(*args, **kwargs)
    except RuntimeError as err:
        if "dtype" not in str(err):
            raise
        dtype = compute_dtype(args, kwargs)
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))
        return func(*args, **kwargs)


def stay_on_meta(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[dict, bool]:
    """``device=`` arguments become meta. Returns (kwargs, True when the op is a pure device move — a no-op on
    the one device that runs the node)."""
    if kwargs.get("device") is None or torch.device(kwargs["device"]).type == "meta":
        return kwargs, False
    pure = func._overloadpacket is aten._to_copy and kwargs.get("dtype") in (None, args[0].dtype)
    return {**kwargs, "device": torch.device("meta")}, pure


class MetaSafeMode(TorchDispatchMode):
    """Dispatch mode for shape-only runs (see module docstring)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if is_assert(func):
            return None
        kwargs, _ = stay_on_meta(func, args, kwargs or {})
        return run_unifying_dtypes(func, args, kwargs)
