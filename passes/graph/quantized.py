"""A 4-bit frozen base (QLoRA) traced so that its weights stay packed until a stage dequantizes them on its device.

Terms:

- *quantized layer*: a bitsandbytes ``Linear4bit`` whose weight is NF4 (``BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4")`` in ``from_pretrained``, the way PEFT's and TRL's QLoRA guides load a base), with or
  without double quantization of its scales (``bnb_4bit_use_double_quant``); ``peft`` wraps it in its
  ``lora.bnb.Linear4bit``.
- *packed weight*: the layer's ``Params4bit``, a frozen uint8 parameter of packed 4-bit indices whose scales hang
  off it as a ``QuantState`` — plain attributes, which no trace sees.

bitsandbytes is what ``transformers`` and ``peft`` quantize a base with (benchmarks/RESULTS.md, QLoRA, says why
it over torchao), but it does not trace. :func:`traceable` makes each quantized layer traceable for the
trace only, so the plan holds the packed weight and its scales as the stage's parameters;
:func:`check_quantized` refuses, in one line, what cannot train this way.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from rpcompile.core.errors import ConfigError
from rpcompile.core.quant import dequantize_nf4

__all__ = ["SUPPORTED", "quantized_layers", "check_quantized", "traceable", "is_quantized_param"]

SUPPORTED = ("a frozen bitsandbytes 4-bit NF4 base (BitsAndBytesConfig(load_in_4bit=True, "
             "bnb_4bit_quant_type='nf4'), double quantization or not) under trainable adapters (peft LoRA)")
"""What rpcompile trains on a quantized model, as its refusals name it."""

#: Per quantized weight (a ``Params4bit``): the frozen parameters made for it, kept so that every trace of a
#: model reaches the same objects (one storage however often it is traced).
_MADE: Any = WeakIdKeyDictionary()


def _is_bnb(obj: Any) -> bool:
    # by module name: bitsandbytes is optional, and this never imports it
    return type(obj).__module__.startswith("bitsandbytes")


def quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every bitsandbytes 4-bit linear layer in ``model``."""
    return [(n, m) for n, m in model.named_modules() if _is_bnb(m) and type(m.__dict__.get("_parameters", {})
            .get("weight")).__name__ == "Params4bit"]


def is_quantized_param(p: torch.Tensor) -> bool:
    """``p`` is a packed 4-bit weight (its element count is half its weights')."""
    return type(p).__name__ == "Params4bit" and _is_bnb(p)


def check_quantized(model: nn.Module) -> None:
    """Refuse, in one line naming what is supported, a quantized model rpcompile cannot train: a quantized weight
    that requires grad, bitsandbytes' FP4 or 8-bit schemes, a ``Params4bit`` stored in another dtype, one packed for
    the CPU's inference kernel (``packing_format_for_cpu``, after an eval-mode call on the CPU), and tensor-subclass
    weights (torchao's ``NF4Tensor`` and other ``torchao`` quantized tensors)."""
    for name, p in model.named_parameters():
        problem = _problem(name, p, model)
        if problem:
            raise ConfigError(f"{problem}; rpcompile trains {SUPPORTED}")


def _problem(name: str, p: torch.Tensor, model: nn.Module) -> str | None:
    kind = type(p).__name__
    data = p.data if isinstance(p, nn.Parameter) else p
    if torch.utils._python_dispatch.is_traceable_wrapper_subclass(data) or kind in ("NF4Tensor",):
        return f"parameter {name} is a {type(data).__module__}.{type(data).__name__} (a quantized tensor subclass)"
    if not _is_bnb(p):
        return None
    if kind != "Params4bit":
        return f"parameter {name} is bitsandbytes {kind} (8-bit quantization is not supported)"
    state = getattr(p, "quant_state", None)
    if p.requires_grad:
        return (f"parameter {name} is a 4-bit quantized weight that requires grad (a quantized weight cannot "
                "train: freeze it, p.requires_grad_(False), and train adapters on it)")
    if state is None:
        return f"parameter {name} is a bitsandbytes 4-bit weight without its quantization state (not quantized yet)"
    if state.quant_type != "nf4":
        return f"parameter {name} is bitsandbytes 4-bit {state.quant_type.upper()} (only NF4 is supported)"
    if p.dtype != torch.uint8:
        return f"parameter {name} is stored as {p.dtype} (bnb_4bit_quant_storage other than uint8 is not supported)"
    if getattr(state, "packing_format_for_cpu", False):
        return (f"parameter {name} was repacked for bitsandbytes' CPU inference kernel by an eval-mode call "
                "(load the model again, or call model.train() before any forward)")
    if state.nested and state.state2.blocksize != 256:
        return f"parameter {name} nests its scales in blocks of {state.state2.blocksize} (bitsandbytes uses 256)"
    return None


@contextlib.contextmanager
def traceable(model: nn.Module) -> Iterator[list[str]]:
    """While inside: every quantized layer of ``model`` reads its scales as frozen parameters and dequantizes with
    ``torch.ops.rpcompile.dequantize_nf4`` (:mod:`rpcompile.core.quant`); yields the layers' names. Refuses a model
    :func:`check_quantized` refuses. Afterwards the model is as it was.

    Why: under ``torch.export`` bitsandbytes' ``forward`` loses the ``QuantState`` (the fake parameter has none) and
    fails, and its ``MatMul4Bit`` is an ``autograd.Function`` around a fused op that has no derivative of its own.

    For the trace only, each quantized layer is reached differently: its scales become frozen parameters beside the
    weight (``weight_absmax``; with double quantization ``weight_scales``, the fp32 offset and nested absmax, and
    ``weight_code``, the 256-value map, one tensor shared by every layer whose map is the same), sharing storage with
    the ``QuantState`` (nothing is copied but the few nested scales), integer-typed so that no precision casts them; and
    its forward becomes what ``MatMul4Bit`` computes, written as ``w = torch.ops.rpcompile.dequantize_nf4(weight,
    absmax, scales, code, shape, blocksize, dtype)`` then ``F.linear(x, w, bias)``: one node that dequantizes
    (:mod:`rpcompile.core.quant`), and a linear layer that autograd differentiates for the input. The trace (and the
    plan) thus holds the packed weight and its scales as the stage's parameters: the host stores them once, as
    bitsandbytes made them, the link carries them packed, and the generated stage code shows the call. The model is left
    as it was: the parameters and the forward are taken off again after the trace (the graph module holds the scales).
    """
    check_quantized(model)
    layers = quantized_layers(model)
    if not layers:
        yield []
        return
    codes: list[nn.Parameter] = []
    touched = []
    try:
        for _, m in layers:
            weight: Any = m.weight  # a Params4bit: its QuantState rides on it
            made = _scales(weight, codes)
            for attr, t in made.items():
                m.register_parameter(attr, t)
            # an instance attribute shadows the class's forward; deleting it below brings the class's back
            m.forward = types.MethodType(_forward, m)
            # shape and blocksize as plain Python values: the trace bakes them into the dequantize call as constants
            m.__dict__["_rpcompile_nf4"] = (list(weight.quant_state.shape), weight.quant_state.blocksize)
            touched.append((m, list(made)))
        yield [n for n, _ in layers]
    finally:
        for m, attrs in touched:
            for attr in attrs:
                del m._parameters[attr]
            del m.forward
            del m.__dict__["_rpcompile_nf4"]


def _scales(weight: Any, codes: list[nn.Parameter]) -> dict[str, nn.Parameter]:
    """The frozen parameters holding ``weight``'s scales, made once per weight (module docstring)."""
    if weight in _MADE:
        return _MADE[weight]
    state = weight.quant_state

    def frozen(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t, requires_grad=False)

    if not state.nested:
        # the fp32 scales viewed as int32: a precision cast skips integer tensors, so they stay exact
        made = {"weight_absmax": frozen(state.absmax.view(torch.int32))}
    else:
        # the offset and the nested absmax in one fp32 tensor: one parameter instead of two
        nested = torch.cat([state.offset.reshape(1).float(), state.state2.absmax.float()])
        state.offset, state.state2.absmax = nested[0], nested[1:]  # one storage: bitsandbytes reads these views
        code = state.state2.code
        # every layer with the same 256-value map shares one parameter (module docstring)
        same = next((c for c in codes if c.shape == code.shape and torch.equal(c.view(torch.float32), code)), None)
        if same is None:
            same = frozen(code.view(torch.int32))
            codes.append(same)
        # bitsandbytes goes on reading the map, now through the shared parameter's storage
        state.state2.code = same.view(torch.float32)
        made = {"weight_absmax": frozen(state.absmax), "weight_scales": frozen(nested.view(torch.int32)),
                "weight_code": same}
        state.absmax = made["weight_absmax"]  # bitsandbytes reads the parameter: its storage wherever it is moved
    _MADE[weight] = made
    return made


def _forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes ``Linear4bit.forward`` in training (``MatMul4Bit``), written as a dequantize and a linear."""
    shape, blocksize = self.__dict__["_rpcompile_nf4"]
    dtype = x.dtype
    # as Linear4bit does: compute in its compute_dtype, and hand the result back in the input's dtype
    compute = getattr(self, "compute_dtype", None) or dtype
    x = x.to(compute)
    bias = None if self.bias is None else self.bias.to(compute)
    if "weight_scales" in self._parameters:
        scales, code = self.weight_scales, self.weight_code
    else:  # no double quantization: nothing nested
        scales = code = self.weight_absmax.new_empty(0, dtype=torch.int32)
    w = dequantize_nf4(self.weight, self.weight_absmax, scales, code, shape, blocksize, compute)
    return F.linear(x, w, bias).to(dtype)
