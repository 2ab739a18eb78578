"""The precisions a plan runs in (``fp32``, ``bf16``, ``fp16``) and their compute dtypes: what the stages compute
in, the runtime uploads the weights in and the passes trace, shape and cost a graph in
(:mod:`rpcompile.passes.graph.precision`)."""

from __future__ import annotations

import torch

__all__ = ["COMPUTE_DTYPES", "PRECISION_BYTES", "compute_dtype"]

#: Each precision a plan runs in → its compute dtype (``None`` for fp32: as the model is).
COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Each precision → the bytes of one element in it (what the planner prices a weight or activation at).
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The compute dtype of ``precision`` (``None`` for fp32: as the model is)."""
    return COMPUTE_DTYPES[precision]
