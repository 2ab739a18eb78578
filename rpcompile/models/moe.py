"""A Qwen3-MoE-style decoder: LLaMA/Qwen3 attention and a mixture-of-experts feed-forward in every layer.

expert
    A SwiGLU MLP of width ``moe_intermediate_size``; a layer's ``num_experts`` experts are stored stacked,
    ``experts.gate_up [E, H, 2I]`` and ``experts.down [E, I, H]``, and run as two batched matmuls.
router
    ``Linear(H, E, bias=False)``; its softmax over experts is each token's affinity to each expert.
expert-choice routing
    Zhou et al., 2022: every expert picks its top-``C`` tokens by affinity, with capacity
    ``C = ceil(T * experts_per_token / num_experts)``; the chosen tokens are gathered, run through their expert,
    weighted by their affinity and scatter-added back (a token chosen by none passes on the residual alone). Why
    expert choice, and what is not modelled: :class:`SparseMoE`.

Module names follow :mod:`rpcompile.models.llama` (``layers.3.attn``, ``layers.3.mlp``), with
``layers.3.mlp.router`` and ``layers.3.mlp.experts`` inside the MoE feed-forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rpcompile.core.errors import ConfigError
from rpcompile.models.llama import Llama, LlamaConfig

__all__ = ["MoEConfig", "MoE", "SparseMoE", "Experts"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """Shape of a :class:`MoE` model: a :class:`~rpcompile.models.llama.LlamaConfig` (``ffn_dim`` unused) plus the experts."""

    num_experts: int = 8
    """Experts per layer."""
    experts_per_token: int = 2
    """Active experts per token (top-k); sets the expert capacity."""
    moe_intermediate_size: int = 32
    """Inner width of one SwiGLU expert."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(f"experts_per_token={self.experts_per_token} must be in 1..num_experts={self.num_experts}")


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs as stacked weights: ``[E, N, H]`` tokens -> ``[E, N, H]``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.dim, cfg.moe_intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, h, 2 * i))  # gate and up side by side: x @ gate_up = [gate|up]
        self.down = nn.Parameter(torch.empty(e, i, h))

    def forward(self, x: Tensor) -> Tensor:
        gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down)


class SparseMoE(nn.Module):
    """Mixture-of-experts feed-forward with per-sequence expert-choice routing (module docstring).

    Why expert choice: every shape is static, so the model traces with plain ``torch.fx.symbolic_trace`` and runs on the
    ``meta`` device (the cost model's only input), where token choice needs data-dependent sizes (``nonzero``, boolean
    masks) or a capacity-padded dispatch. The compute equals top-k token choice at capacity factor 1: ``E * C ≈ T * k``
    token-expert pairs, so FLOPs, weights and activation sizes are those of the published model. Routing is *per
    sequence* (``topk`` over the sequence dimension of each batch row), so a sample's output does not depend on the
    other samples of its batch: splitting a batch into microbatches, as the pipeline does, gives exactly the eager
    result. Not modelled: Qwen3's renormalisation of each token's top-k weights and its load-balancing auxiliary loss
    (expert choice is balanced by construction).
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.dim = cfg.num_experts, cfg.experts_per_token, cfg.dim
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len = x.size(0), x.size(1)
        capacity = (seq_len * self.top_k + self.num_experts - 1) // self.num_experts  # ceil(T·k/E) <= T
        # the softmax computed in fp32, as HF's Qwen3-MoE routes; the affinities then go back to the compute dtype
        affinity = F.softmax(self.router(x), dim=-1, dtype=torch.float32).to(x.dtype)  # [B, T, E]
        # per sequence (over each row's tokens): a sample's output does not depend on the rest of its batch
        weight, token = torch.topk(affinity.transpose(1, 2), capacity, dim=-1)      # [B, E, C] each
        # each picked token's position, repeated across the hidden size: gather and scatter_add index whole rows
        index = token.flatten(1).unsqueeze(-1).expand(-1, -1, self.dim)             # [B, E·C, H]
        picked = torch.gather(x, 1, index).unflatten(1, (self.num_experts, -1))     # [B, E, C, H]
        # expert-major: one batched matmul runs every expert on the tokens it picked in every row
        y = self.experts(picked.transpose(0, 1).flatten(1, 2))                      # [E, B·C, H]
        y = y.unflatten(1, (batch, -1)).transpose(0, 1) * weight.unsqueeze(-1)      # [B, E, C, H]
        # a token picked by several experts gets the sum; one picked by none gets zeros (the block's residual
        # carries it)
        return torch.zeros_like(x).scatter_add(1, index, y.flatten(1, 2))


class MoE(Llama):
    """Decoder-only MoE language model: ``input_ids [B, T]`` (int64) -> ``logits [B, T, vocab_size]``; a
    :class:`~rpcompile.models.llama.Llama` whose feed-forwards are :class:`SparseMoE`."""

    def make_mlp(self, cfg: LlamaConfig) -> nn.Module:
        assert isinstance(cfg, MoEConfig), f"an MoE is built from an MoEConfig, got {type(cfg).__name__}"
        return SparseMoE(cfg)

    def reset_parameters(self) -> None:
        """Every Linear, expert weight and the embedding ~ N(0, 0.02); norms start at one."""
        super().reset_parameters()
        for module in self.modules():
            if isinstance(module, Experts):
                for w in (module.gate_up, module.down):
                    if not w.is_meta:  # meta tensors hold no values to fill
                        nn.init.normal_(w, std=0.02)
