"""Built-in models (LLaMA/Qwen3-style, Qwen3-MoE-style, GPT-2-style, a small ConvNet) and the MODEL resolver.

Every built-in model is traceable by plain ``torch.fx.symbolic_trace``; :func:`load_model` turns a name such as
``llama-demo`` or ``llama-8b`` (built on the ``meta`` device) or a ``path/to/file.py:factory`` into a
:class:`ModelSpec` (model, example inputs, loss).
"""

from rpcompile.models.cnn import CNNConfig, ConvNet
from rpcompile.models.gpt import GPT, GPTConfig
from rpcompile.models.llama import Llama, LlamaConfig
from rpcompile.models.moe import MoE, MoEConfig
from rpcompile.models.registry import (ModelSpec, ModelSummary, classification_loss, list_models, lm_loss, load_model,
                                       model_summaries)

__all__ = [
    "CNNConfig",
    "ConvNet",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "ModelSpec",
    "ModelSummary",
    "classification_loss",
    "list_models",
    "lm_loss",
    "load_model",
    "model_summaries",
]
