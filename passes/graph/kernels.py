"""GPU kernels on the ``meta`` device: calls whose meta path differs from a GPU's, rewritten to what a GPU runs.

Two calls take another path on ``meta`` than on a GPU and are rewritten by :class:`GpuKernels` (a
``TorchFunctionMode``): ``scaled_dot_product_attention`` becomes ``_scaled_dot_product_flash_attention`` (no mask)
or ``_scaled_dot_product_efficient_attention`` (a mask) — one fused kernel each way, not the math path that
materialises the S×S scores; their backward recomputes the scores, 5 matmuls' worth of FLOPs where the math
path's autograd does 4 (Dao et al., FlashAttention, 2022). ``rms_norm`` becomes one fused norm kernel each
way (CUDA's ``_fused_rms_norm``), the shape-only custom ops ``rpcompile::rms_norm[_backward]``; hand-written
RMSNorms stay unfused, as on a GPU.

Both cost passes count under it: the FLOP and saved-tensor profile of :mod:`rpcompile.passes.cost.cost` and the roofline
of :mod:`rpcompile.passes.cost.analytic`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["GpuKernels"]

aten = torch.ops.aten


def _rms_norm_shapes(x: torch.Tensor, weight: torch.Tensor | None, n_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for a fused RMSNorm kernel: returns (output, rstd) with the right shapes; values unset."""
    # rstd: one fp32 value per normalised row, the normalised dimensions kept as 1s
    return torch.empty_like(x), x.new_empty(x.shape[: x.dim() - n_dims] + (1,) * n_dims, dtype=torch.float32)


def _rms_norm_backward_shapes(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                              weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for the fused RMSNorm backward: (grad input, grad weight — empty without a weight)."""
    return torch.empty_like(x), torch.empty_like(weight) if weight is not None else x.new_empty(0)


# Shape-only ops (the analysis runs on meta): the recorder sees ``rpcompile.rms_norm[_backward]`` kernels.
_rms_norm_kernel = torch.library.custom_op("rpcompile::rms_norm", _rms_norm_shapes, mutates_args=())
_rms_norm_kernel.register_fake(_rms_norm_shapes)
_rms_norm_backward_kernel = torch.library.custom_op("rpcompile::rms_norm_backward", _rms_norm_backward_shapes,
                                                    mutates_args=())
_rms_norm_backward_kernel.register_fake(_rms_norm_backward_shapes)


def _rms_norm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    # what the fused backward reads: the input, rstd and the weight, so the saved-tensor profile counts those
    ctx.save_for_backward(inputs[0], output[1], inputs[1])
    ctx.set_materialize_grads(False)  # rstd gets no gradient: do not charge a zeros() kernel for it


def _rms_norm_backward(ctx: Any, grad: torch.Tensor, _grad_rstd: Any) -> tuple:
    x, rstd, weight = ctx.saved_tensors
    gx, gw = _rms_norm_backward_kernel(grad, x, rstd, weight)
    # one gradient per forward input: x, weight, and None for n_dims
    return gx, gw if weight is not None else None, None


_rms_norm_kernel.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def _rms_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None, eps: Any = None) -> Any:
    return _rms_norm_kernel(input, weight, len(normalized_shape))[0]


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
    """SDPA as a GPU runs it: flash attention without a mask, memory-efficient attention with one."""
    # the fused kernels take [batch, heads, seq, dim] only; other ranks keep torch's own path
    if query.dim() != 4:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if attn_mask is None:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if key.size(1) != query.size(1):  # the efficient kernel needs one K/V head per query head
        rep = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    if attn_mask.dtype == torch.bool:  # as torch does: a boolean mask becomes an additive bias
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    # the log-sum-exp is computed (and saved) only when a backward will read it, as torch's dispatch decides
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, lse, dropout_p, is_causal, scale=scale)[0]


_REWRITES: dict[Any, Callable[..., Any]] = {
    **dict.fromkeys((F.scaled_dot_product_attention, aten.scaled_dot_product_attention,
                     aten.scaled_dot_product_attention.default), _sdpa),
    **dict.fromkeys((F.rms_norm, torch.rms_norm, aten.rms_norm, aten.rms_norm.default), _rms_norm),
}


class GpuKernels(TorchFunctionMode):
    """Replaces calls whose meta path differs from the GPU's (see module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            func = _REWRITES.get(func, func)
        except TypeError:  # an unhashable callable: never one of ours
            pass
        return func(*args, **(kwargs or {}))
