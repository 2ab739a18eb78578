"""A GPT-2-style decoder-only transformer (Radford et al., 2019), traceable by ``torch.fx.symbolic_trace``.

Terms:

- *learned positions*: ``wpe`` is an embedding table indexed by position, added to the token embedding ``wte``.
- *tied embeddings*: ``lm_head.weight`` IS ``wte.weight`` (one Parameter object, counted and updated once).
- *block*: pre-LayerNorm residual layer, ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; attention computes
  q, k and v with one fused Linear (``attn.qkv``, with bias) and uses causal scaled-dot-product attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rpcompile.core.errors import ConfigError

__all__ = ["GPTConfig", "GPT", "GPTBlock", "GPTAttention", "GPTMLP"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT` model."""

    vocab_size: int = 256
    """Number of tokens in the vocabulary."""
    dim: int = 64
    """Hidden size: width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of attention heads (``dim`` must be a multiple)."""
    max_seq_len: int = 128
    """Rows of the learned position table ``wpe``: the longest sequence the model accepts."""
    mlp_ratio: int = 4
    """MLP inner width as a multiple of ``dim``."""
    dropout: float = 0.0
    """Dropout probability after the embeddings, the attention output and the MLP."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ConfigError(f"dim={self.dim} must be a multiple of n_heads={self.n_heads}; change dim or n_heads")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout} must be in [0, 1)")


class GPTAttention(nn.Module):
    """Causal multi-head self-attention with a fused qkv projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t = x.size(0), x.size(1)
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [3, B, H, T, hd]
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.dropout(self.proj(y.transpose(1, 2).flatten(2)))


class GPTMLP(nn.Module):
    """``proj(gelu(fc(x)))`` with dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class GPTBlock(nn.Module):
    """One pre-LayerNorm transformer layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Language model ``input_ids [B, T]`` (int64) -> ``logits [B, T, vocab_size]`` with tied embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter (module docstring)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: weights ~ N(0, 0.02), biases zero (LayerNorms keep their ones/zeros)."""
        for module in self.modules():
            # meta tensors hold no values to fill
            if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.is_meta:
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None and not module.bias.is_meta:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
