"""A LLaMA / Qwen3-style decoder-only transformer, written to be traced by ``torch.fx.symbolic_trace``.

Terms:

- *block*: one transformer layer, ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))`` (pre-norm residual).
- *GQA* (grouped-query attention): ``n_kv_heads`` key/value heads are shared by ``n_heads // n_kv_heads`` query
  heads each (Ainslie et al., 2023). ``n_kv_heads == n_heads`` is plain multi-head attention.
- *RoPE* (rotary position embedding, Su et al., 2021): queries and keys are rotated by a position-dependent angle.
  The cos/sin tables are non-persistent buffers of the root module, precomputed for ``max_seq_len`` positions and
  cut to the input length with ``torch.narrow`` (slicing a buffer with a traced size breaks symbolic tracing).
- *qk-norm*: Qwen3 normalises every query and key head with its own RMSNorm before RoPE.
- *SwiGLU* MLP (Shazeer, 2020): ``down(silu(gate(x)) * up(x))``.

Module names are part of the interface: later passes group graph nodes by module path, e.g. ``layers.3.attn`` and
``layers.3.mlp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rpcompile.core.errors import ConfigError

__all__ = ["LlamaConfig", "Llama", "Block", "Attention", "MLP", "rope_tables"]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a :class:`Llama` model."""

    vocab_size: int = 256
    """Number of tokens in the vocabulary (rows of the embedding and of the LM head)."""
    dim: int = 64
    """Hidden size: width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of query heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); ``None`` means ``n_heads``."""
    head_dim: int | None = None
    """Width of one attention head; ``None`` means ``dim // n_heads`` (Qwen3 sets it independently)."""
    ffn_dim: int = 176
    """Inner width of the SwiGLU MLP."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables cover."""
    rope_theta: float = 10_000.0
    """RoPE base frequency (Llama-3: 500000, Qwen3: 1000000)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    qk_norm: bool = False
    """Normalise each query and key head with an RMSNorm before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """Make ``lm_head.weight`` the very same Parameter as ``embed.weight``."""

    def __post_init__(self) -> None:
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads}; change either")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ConfigError(f"dim={self.dim} must be a multiple of n_heads={self.n_heads} (or set head_dim)")
        if self.hd % 2:
            raise ConfigError(f"head_dim={self.hd} must be even for RoPE; use an even head_dim")

    @property
    def kv_heads(self) -> int:
        """Resolved number of key/value heads."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hd(self) -> int:
        """Resolved head width."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads


def rope_tables(max_seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables of shape ``[max_seq_len, head_dim]`` (the two halves of a head share frequencies).

    Computed on the CPU whatever the default device: cheap, and ``arange`` on meta would import torch._dynamo (~2 s).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device="cpu"), inv_freq)
    # the half-split layout (HF's): element i pairs with element i + head_dim/2, so both halves share a frequency
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: Tensor, half: int) -> Tensor:
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (x1, x2) -> (-x2, x1): a quarter turn per pair


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor, half: int) -> Tensor:
    return x * cos + _rotate_half(x, half) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE and optional per-head q/k RMSNorm."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.hd
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.hd, cfg.dim, bias=False)
        self.q_norm = nn.RMSNorm(cfg.hd, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(cfg.hd, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def _heads(self, x: Tensor, n: int) -> Tensor:
        """``[B, T, n*hd]`` -> ``[B, T, n, hd]``."""
        return x.view(x.size(0), x.size(1), n, self.head_dim)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """``[B, Hkv, T, hd]`` -> ``[B, H, T, hd]``: each kv head serves ``H // Hkv`` query heads."""
        rep = self.n_heads // self.n_kv_heads
        if rep == 1:
            return x
        b, t = x.size(0), x.size(2)
        # expand is free; the reshape copies, each kv head repeated rep times in a row, so query head h reads
        # kv head h // rep
        x = x[:, :, None].expand(b, self.n_kv_heads, rep, t, self.head_dim)
        return x.reshape(b, self.n_heads, t, self.head_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = self.head_dim // 2
        q = self.q_norm(self._heads(self.q_proj(x), self.n_heads)).transpose(1, 2)
        k = self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.n_kv_heads).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin, half), _apply_rope(k, cos, sin, half)
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm transformer layer."""

    def __init__(self, cfg: LlamaConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Decoder-only language model: ``input_ids [B, T]`` (int64) -> ``logits [B, T, vocab_size]``."""

    # the rotary tables, [max_seq_len, head_dim] buffers (not in the state dict), declared for the type checker
    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        # `_weight` skips Embedding's own normal_ init (reset_parameters below fills it): on the meta device that
        # init would import torch._dynamo, ~2 s on first use, for a tensor that holds no values anyway.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg, self.make_mlp(cfg)) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.max_seq_len, cfg.hd, cfg.rope_theta)
        # the tables are made on the CPU (rope_tables) and moved where the model is built
        device = torch.get_default_device()  # meta inside `with torch.device("meta")`
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.reset_parameters()

    def make_mlp(self, cfg: LlamaConfig) -> nn.Module:
        """The feed-forward of one layer (subclasses swap in another, e.g. a mixture of experts)."""
        return MLP(cfg)

    def reset_parameters(self) -> None:
        """GPT-2-style init: every Linear and the embedding ~ N(0, 0.02); norms start at one."""
        for module in self.modules():
            # meta tensors hold no values to fill
            if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.is_meta:
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: Tensor) -> Tensor:
        seq_len = input_ids.size(1)
        cos = torch.narrow(self.rope_cos, 0, 0, seq_len)  # not rope_cos[:seq_len] (module docstring)
        sin = torch.narrow(self.rope_sin, 0, 0, seq_len)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
