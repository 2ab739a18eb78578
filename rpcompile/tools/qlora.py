"""QLoRA at planning scale: a frozen base quantized to 4-bit NF4, priced as the runtime stores, sends and runs it.

quantize the base
    :func:`quantize_base`: every frozen ``nn.Linear`` but the output head, and every frozen stacked-expert weight
    of rpcompile's MoE, becomes packed NF4 as bitsandbytes lays it out (:mod:`rpcompile.core.quant`), held as
    frozen integer parameters whose layers dequantize (``torch.ops.rpcompile.dequantize_nf4``) and then compute as
    before — so they trace with ``torch.fx`` and run on the ``meta`` device.
what the planner sees
    The packed weights are parameters like any other, so a stage's weight bytes — its upload, its memory, the link
    time — are their bytes (:func:`rpcompile.passes.formulate.partition_problem`), and each layer's dequantization
    is a graph node the cost model prices like any op (analytic: memory-bound; measured: bitsandbytes' kernel
    timed). Host memory counts their storage (:func:`rpcompile.training.host_memory.host_memory`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rpcompile.core.errors import ConfigError
from rpcompile.core.quant import NF4_BLOCK, NF4_NESTED_BLOCK, dequantize_nf4
from rpcompile.models.moe import Experts

__all__ = ["QUANT_SCHEMES", "quantize_base", "NF4Linear", "NF4Experts"]

QUANT_SCHEMES = ("nf4",)
"""The schemes :func:`quantize_base` (``plan --quantize``) knows."""
SKIP = ("lm_head",)
"""Linear layers left in the compute precision (transformers' 4-bit loading skips the output head too)."""


def quantize_base(model: nn.Module, scheme: str = "nf4", *, skip: Sequence[str] = SKIP) -> nn.Module:
    """``model`` with its frozen linear layers (not ``skip``) and frozen experts in packed NF4, changed in place and
    returned. Raises :class:`~rpcompile.ConfigError` for another scheme, or when nothing is frozen (quantize the base
    of a LoRA model: its trainable weights stay as they are).

    Quantized: every frozen ``nn.Linear`` of the model (the LoRA adapters' base layers, the feed-forwards) except the
    output head, and every frozen stacked-expert weight of rpcompile's MoE, becomes packed NF4 as bitsandbytes lays it
    out — half a byte of index a weight, an 8-bit absmax per 64 weights, an fp32 nested absmax per 256 of those, the
    offset and the 256-value map (:mod:`rpcompile.core.quant`) — held as frozen integer parameters named as the traced
    HF path names them (``weight``, ``weight_absmax``, ``weight_scales``, ``weight_code``; ``gate_up_absmax`` … for
    experts). The layers' forwards call ``torch.ops.rpcompile.dequantize_nf4`` and then compute as before, so they trace
    with ``torch.fx`` and run on the ``meta`` device (published shapes). The output head stays in the compute precision
    (transformers' 4-bit loading skips ``lm_head`` too); an HF model loaded with ``BitsAndBytesConfig`` needs none of
    this (:mod:`rpcompile.passes.graph.quantized`). Unlike transformers' integration, rpcompile's experts are quantized:
    a MoE's experts are most of its weights.

    Off the ``meta`` device the weights are quantized with bitsandbytes (``quantize_4bit``), as ``from_pretrained``
    quantizes them: the same values a bitsandbytes model would hold.
    """
    if scheme not in QUANT_SCHEMES:
        raise ConfigError(f"quantization scheme {scheme!r} is not supported; supported: nf4 (4-bit NormalFloat in "
                          "blocks of 64 with double-quantized scales, bitsandbytes' layout: QLoRA)")
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # a trainable layer (a LoRA adapter's A or B) stays as it is: only a frozen base is quantized
            if name in skip or any(p.requires_grad for p in child.parameters(recurse=False)):
                continue
            # the exact type: a subclass of nn.Linear may compute otherwise, and replacing it would lose that
            if type(child) is nn.Linear:
                setattr(parent, name, NF4Linear(child))
                done += 1
            elif type(child) is Experts:
                setattr(parent, name, NF4Experts(child))
                done += 1
    if not done:
        raise ConfigError(f"{type(model).__name__} has no frozen linear layer to quantize: a quantized base is "
                          "frozen (plan --lora --quantize nf4: LoRA adapters on a 4-bit base)")
    return model


def _packed(module: nn.Module, prefix: str, weight: Tensor) -> tuple[int, ...]:
    """Register ``weight`` on ``module`` as packed NF4: ``{prefix}`` (uint8 indices), ``{prefix}_absmax`` (uint8),
    ``{prefix}_scales`` (fp32 offset and nested absmax as int32 bits), ``{prefix}_code`` (the 256-value map, as
    int32 bits); return its shape."""
    n, device = weight.numel(), weight.device
    blocks = math.ceil(n / NF4_BLOCK)
    if device.type == "meta":
        # two 4-bit indices a byte, in the [n/2, 1] shape bitsandbytes' quantize_4bit returns
        packed = torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=device)
        absmax = torch.empty(blocks, dtype=torch.uint8, device=device)
        # the offset, then one nested absmax per NF4_NESTED_BLOCK blocks
        scales = torch.empty(1 + math.ceil(blocks / NF4_NESTED_BLOCK), dtype=torch.int32, device=device)
        code = torch.empty(256, dtype=torch.int32, device=device)
    else:
        packed, absmax, scales, code = _quantized(weight)
    for suffix, t in (("", packed), ("_absmax", absmax), ("_scales", scales), ("_code", code)):
        module.register_parameter(prefix + suffix, nn.Parameter(t, requires_grad=False))
    return tuple(weight.shape)


def _quantized(weight: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """bitsandbytes' NF4 of ``weight`` with double-quantized scales, as :func:`_packed` holds it."""
    try:
        import bitsandbytes.functional as bnb  # optional: only quantizing real values needs it
    except ImportError:
        raise ConfigError("quantizing real weights to NF4 needs bitsandbytes: pip install bitsandbytes (or plan on "
                          "the meta device)") from None
    packed, state = bnb.quantize_4bit(weight.detach(), blocksize=NF4_BLOCK, quant_type="nf4",
                                      compress_statistics=True)
    # fp32 values kept as int32 bits: every packed parameter is then an integer one, which the runtime's casts to
    # the compute precision leave as it is
    scales = torch.cat([state.offset.reshape(1).float(), state.state2.absmax.float()]).view(torch.int32)
    return packed, state.absmax, scales, state.state2.code.float().view(torch.int32)


def _weight(module: nn.Module, prefix: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    return dequantize_nf4(getattr(module, prefix), getattr(module, f"{prefix}_absmax"),
                          getattr(module, f"{prefix}_scales"), getattr(module, f"{prefix}_code"), list(shape),
                          NF4_BLOCK, dtype)


class NF4Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is packed NF4: ``linear(x, dequantize_nf4(weight, …), bias)``."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.shape = _packed(self, "weight", base.weight)
        # the logical weight count, which host_memory.quantized_weights reads (the packed tensors hold fewer elements)
        self.weights = base.weight.numel()
        self.bias = base.bias

    def forward(self, x: Tensor) -> Tensor:
        # dequantized into the activations' dtype: the matmul runs in the compute precision
        return F.linear(x, _weight(self, "weight", self.shape, x.dtype), self.bias)


class NF4Experts(nn.Module):
    """rpcompile's stacked experts (:class:`~rpcompile.models.moe.Experts`) with packed NF4 weights."""

    def __init__(self, base: Experts) -> None:
        super().__init__()
        self.gate_up_shape = _packed(self, "gate_up", base.gate_up)
        self.down_shape = _packed(self, "down", base.down)
        self.weights = base.gate_up.numel() + base.down.numel()

    def forward(self, x: Tensor) -> Tensor:
        gate, up = torch.bmm(x, _weight(self, "gate_up", self.gate_up_shape, x.dtype)).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, _weight(self, "down", self.down_shape, x.dtype))
