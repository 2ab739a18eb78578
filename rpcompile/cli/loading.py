"""Building the MODEL argument of a command (a built-in name or ``path/to/file.py:factory``): this imports torch."""

from __future__ import annotations

import argparse

import torch

from rpcompile.models.registry import ModelSpec, load_model, preset_batch_size

__all__ = ["load", "load_for", "dtype"]


def dtype(name: str | None) -> torch.dtype | None:
    return {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def load(args: argparse.Namespace) -> ModelSpec:
    kw = {k: v for k, v in (("batch_size", args.batch_size), ("seq_len", args.seq_len), ("device", args.model_device))
          if v is not None}
    return load_model(args.model, **kw)


def load_for(args: argparse.Namespace, microbatches: int) -> ModelSpec:
    """The model with a batch of at least ``microbatches`` (one sample per microbatch at least) unless
    ``--batch-size`` says otherwise: the meta presets come with a batch of one sequence. A built-in model's batch
    is known before it is built, so it is built once (a model file's is not: it ignores ``--batch-size``)."""
    batch = preset_batch_size(args.model)
    # a preset's batch is known before it is built: ask for one sample per microbatch now, so it is built once
    if args.batch_size is None and batch is not None and batch < microbatches:
        args.batch_size = microbatches
    ms = load(args)
    first = ms.example_inputs[0] if ms.example_inputs else None
    if args.batch_size is None and isinstance(first, torch.Tensor) and first.dim() and first.shape[0] < microbatches:
        args.batch_size = microbatches
        ms = load(args)
    return ms
