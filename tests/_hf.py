"""Tiny HuggingFace models built from configs with random weights (not collected: no test_ prefix; no hub)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

VOCAB = 64


def hf_model(kind: str, vocab: int = VOCAB) -> torch.nn.Module:
    """``llama``, ``qwen3``, ``qwen3-moe``, ``mixtral`` (causal LMs) or ``bert`` (masked LM), two layers, seeded;
    skipped where the installed transformers cannot build or export it."""
    transformers = pytest.importorskip("transformers")
    if kind in ("qwen3-moe", "mixtral") and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x MoE blocks loop over the experts hit in Python: not exportable")
    if kind.startswith("qwen3") and not hasattr(transformers, "Qwen3Config"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3")
    torch.manual_seed(0)
    small = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small))
    small["num_key_value_heads"] = 2
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **small))
    if kind == "qwen3-moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **small))
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                      **small))


def token_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of an HF output's logits (in fp32)."""
    return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())
