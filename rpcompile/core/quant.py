"""A 4-bit NF4 frozen base as the stages see it: one graph op that dequantizes a packed weight on the device.

NF4
    Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023: each block of ``blocksize`` (64)
    weights is stored as 4-bit indices into a 16-value codebook of normal quantiles, two to a byte (*packed*), and
    one scale per block (*absmax*).
double quantization
    The fp32 absmax of every block itself stored as 8 bits — an index into bitsandbytes' 256-value map (*code*),
    scaled per 256 blocks by an fp32 *nested absmax* and shifted by one fp32 *offset*: 0.516 bytes a weight in all.
bitsandbytes' weights
    Kept as ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` made them and dequantized with
    bitsandbytes' own kernels, so a stage computes what eager bitsandbytes computes, bit for bit.

``dequantize_nf4`` (``torch.ops.rpcompile.dequantize_nf4``) is the op a traced quantized linear layer calls. It
lives in core because both the passes (tracing, costing on the meta device) and the runtime (running the stages)
meet it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["dequantize_nf4", "NF4_BLOCK", "NF4_NESTED_BLOCK", "nf4_bytes_per_param"]

NF4_BLOCK = 64
"""Weights per absmax block (bitsandbytes' default, QLoRA's choice)."""
NF4_NESTED_BLOCK = 256
"""Absmax values per nested-absmax block under double quantization (the only size bitsandbytes' kernels take)."""


def nf4_bytes_per_param(*, nested: bool = True, blocksize: int = NF4_BLOCK) -> float:
    """Bytes one weight costs on the host and on the link: half a byte of index plus its share of the scales (an
    8-bit absmax and a 32-bit nested absmax per 256 blocks when ``nested``, an fp32 absmax otherwise)."""
    scales = (1 + 4 / NF4_NESTED_BLOCK) if nested else 4
    return 0.5 + scales / blocksize


def _bitsandbytes_ops() -> object:
    """``torch.ops.bitsandbytes``, its kernels registered (importing bitsandbytes registers them)."""
    # bitsandbytes is optional: imported only when its ops are not registered yet
    if not hasattr(torch.ops.bitsandbytes, "dequantize_4bit"):
        import bitsandbytes  # noqa: F401 - registers torch.ops.bitsandbytes.*
    return torch.ops.bitsandbytes


@torch.library.custom_op("rpcompile::dequantize_nf4", mutates_args=())
def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, scales: torch.Tensor, code: torch.Tensor,
                   shape: Sequence[int], blocksize: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight of ``shape`` in ``dtype`` from its packed NF4 indices (uint8) and scales.

    ``absmax``: uint8 per block under double quantization, then ``scales`` holds the fp32 bits (as int32) of the
    offset followed by the nested absmax and ``code`` those of the 256-value map; without double quantization
    ``absmax`` holds the blocks' fp32 bits and ``scales`` and ``code`` are empty. Computed as bitsandbytes'
    ``MatMul4Bit`` does: the absmax first (fp32), then the weight.

    ``dequantize_nf4`` (``torch.ops.rpcompile.dequantize_nf4``) is the op a traced quantized linear layer calls
    (:mod:`rpcompile.passes.graph.quantized` puts it there): its inputs are the packed weight and its scales, all
    integer tensors — uint8, or int32 holding fp32 bits, so that a stage computing in bf16 uploads them as they are
    instead of rounding the fp32 scales as it rounds floating weights — and its output is the weight in the compute
    precision, made on the device where the stage runs, once per stage (a stage's prologue,
    :mod:`rpcompile.passes.rewrite.dequantize`), and held until the stage ends. Nothing differentiates it: its inputs
    are frozen.
    """
    ops: object = _bitsandbytes_ops()
    if absmax.dtype == torch.uint8:
        # the fp32 bits travelled as int32: viewed back, not converted; s[0] is the offset, added once the
        # blockwise map is undone, as bitsandbytes does
        s = scales.view(torch.float32)
        table = ops.dequantize_blockwise.default(absmax, s[1:], code.view(torch.float32),  # type: ignore[attr-defined]
                                                 NF4_NESTED_BLOCK, torch.float32) + s[0]
    else:
        table = absmax.view(torch.float32)
    return ops.dequantize_4bit.default(packed, table, blocksize, "nf4", list(shape), dtype)  # type: ignore[attr-defined]


@dequantize_nf4.register_fake
def _(packed: torch.Tensor, absmax: torch.Tensor, scales: torch.Tensor, code: torch.Tensor,
      shape: Sequence[int], blocksize: int, dtype: torch.dtype) -> torch.Tensor:
    # fake tensors (meta-device tracing and costing): the shape and dtype are all there is
    return packed.new_empty(list(shape), dtype=dtype)
