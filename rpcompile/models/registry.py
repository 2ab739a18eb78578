"""Named models and user model files: turn a MODEL argument into a :class:`~rpcompile.models.registry.ModelSpec`.

Terms:

- *model spec string*: either a built-in name (see :func:`list_models`) or ``path/to/file.py:factory``, where
  ``factory()`` returns a :class:`~rpcompile.models.registry.ModelSpec`, ``(model, example_inputs)``, ``(model, example_inputs, loss_fn)`` or
  ``(model, example_inputs, loss_fn, example_target)``.
- *demo* models are tiny and train on a CPU in milliseconds per step; *published shapes* (``llama-1.7b``,
  ``llama-8b``, ``llama-32b``, ``qwen3-30b-a3b``, ``qwen3-235b-a22b``) are built on the ``meta`` device by default: every tensor has a
  shape and a dtype but no storage, which is all that costing and partitioning need.
- *loss contract*: ``loss_fn(output, target)`` returns a scalar tensor (mean over the batch).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rpcompile.core.errors import ModelSpecError, first_line
from rpcompile.models.cnn import CNNConfig, ConvNet
from rpcompile.models.gpt import GPT, GPTConfig
from rpcompile.models.llama import Llama, LlamaConfig
from rpcompile.models.moe import MoE, MoEConfig

__all__ = ["ModelSpec", "ModelSummary", "LossFn", "load_model", "list_models", "model_summaries", "preset_batch_size",
           "lm_loss", "classification_loss"]

LossFn = Callable[[Any, Any], Tensor]
"""``loss_fn(output, target) -> scalar tensor``."""


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """A model ready to compile: the module, one batch of example inputs and how to score its output."""

    model: nn.Module
    """The model; parameters keep their names through tracing and compilation."""
    example_inputs: tuple[Any, ...]
    """Positional arguments of one forward call (one full batch)."""
    loss_fn: LossFn | None = None
    """``loss_fn(output, target) -> scalar``; ``None`` when the model's output already is the scalar loss."""
    example_target: Any = None
    """A target for ``loss_fn`` matching ``example_inputs`` (``None`` if the loss needs none)."""
    description: str = ""
    """One line for humans: the architecture and its shape."""

    def loss(self, output: Any, target: Any = None) -> Tensor:
        """Score ``output`` against ``target`` (default: the example target)."""
        if target is None:
            target = self.example_target
        return output if self.loss_fn is None else self.loss_fn(output, target)


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean token cross-entropy: ``logits [B, T, V]`` (computed in fp32) against ``target [B, T]``."""
    # fp32 whatever the compute precision: a bf16 log-softmax over a large vocabulary is too coarse for a loss
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def classification_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy: ``logits [B, C]`` against class indices ``target [B]``."""
    return F.cross_entropy(logits.float(), target)


@dataclass(frozen=True, kw_only=True)
class _Preset:
    """A built-in model: how to build it and its default batch, sequence length and device."""

    build: Callable[[int], nn.Module]
    """Builds the model for a given sequence length (image models ignore it)."""
    kind: str
    """``"lm"`` (token ids in, logits out) or ``"image"``."""
    batch_size: int
    seq_len: int
    device: str
    description: str


def _llama(seq_len: int, **shape: Any) -> Llama:
    return Llama(LlamaConfig(max_seq_len=seq_len, **shape))


def _moe(seq_len: int, **shape: Any) -> MoE:
    return MoE(MoEConfig(max_seq_len=seq_len, **shape))


_QWEN3 = dict(vocab_size=151_936, head_dim=128, qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6)

_PRESETS: dict[str, _Preset] = {
    "llama-demo": _Preset(
        build=lambda s: _llama(s, vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176),
        kind="lm", batch_size=4, seq_len=32, device="cpu",
        description="tiny LLaMA: 4 layers, dim 64, 4 heads (2 kv), ffn 176, vocab 256",
    ),
    "llama-32x64": _Preset(
        build=lambda s: _llama(s, vocab_size=256, dim=64, n_layers=32, n_heads=4, n_kv_heads=2, ffn_dim=176),
        kind="lm", batch_size=4, seq_len=32, device="cpu",
        description="deep narrow LLaMA for profiling tests: 32 layers, dim 64, 4 heads (2 kv), vocab 256",
    ),
    "gpt-demo": _Preset(
        build=lambda s: GPT(GPTConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=s)),
        kind="lm", batch_size=4, seq_len=32, device="cpu",
        description="tiny GPT-2: 4 layers, dim 64, 4 heads, vocab 256, tied embeddings",
    ),
    "cnn-demo": _Preset(
        build=lambda s: ConvNet(CNNConfig(in_channels=3, image_size=16, channels=(16, 32, 64), num_classes=10)),
        kind="image", batch_size=8, seq_len=0, device="cpu",
        description="tiny ConvNet: 3x16x16 images, conv blocks 16/32/64, 10 classes",
    ),
    "moe-demo": _Preset(
        build=lambda s: _moe(s, vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
                             num_experts=8, experts_per_token=2, moe_intermediate_size=32),
        kind="lm", batch_size=4, seq_len=16, device="cpu",
        description="tiny Qwen3-MoE: 2 layers, dim 64, 4 heads (2 kv), 8 experts (2 active) of width 32, vocab 256",
    ),
    "llama-1.7b": _Preset(
        build=lambda s: _llama(s, **_QWEN3, dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144,
                               tie_embeddings=True),
        kind="lm", batch_size=1, seq_len=4096, device="meta",
        description="Qwen3-1.7B shape: 28 layers, dim 2048, 16 heads (8 kv), ffn 6144, vocab 151936, tied",
    ),
    "llama-8b": _Preset(
        build=lambda s: _llama(s, vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                               ffn_dim=14_336, rope_theta=500_000.0, norm_eps=1e-5),
        kind="lm", batch_size=1, seq_len=4096, device="meta",
        description="Llama-3-8B shape: 32 layers, dim 4096, 32 heads (8 kv), ffn 14336, vocab 128256",
    ),
    "llama-32b": _Preset(
        build=lambda s: _llama(s, **_QWEN3, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25_600),
        kind="lm", batch_size=1, seq_len=4096, device="meta",
        description="Qwen3-32B shape: 64 layers, dim 5120, 64 heads (8 kv), ffn 25600, vocab 151936",
    ),
    "qwen3-30b-a3b": _Preset(
        build=lambda s: _moe(s, **_QWEN3, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, num_experts=128,
                             experts_per_token=8, moe_intermediate_size=768),
        kind="lm", batch_size=1, seq_len=4096, device="meta",
        description="Qwen3-30B-A3B shape: 48 layers, dim 2048, 32 heads (4 kv), 128 experts (8 active) of width "
                    "768, vocab 151936",
    ),
    "qwen3-235b-a22b": _Preset(
        build=lambda s: _moe(s, **_QWEN3, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, num_experts=128,
                             experts_per_token=8, moe_intermediate_size=1536),
        kind="lm", batch_size=1, seq_len=4096, device="meta",
        description="Qwen3-235B-A22B shape: 94 layers, dim 4096, 64 heads (4 kv), 128 experts (8 active) of width "
                    "1536, vocab 151936",
    ),
}


def preset_batch_size(name: str) -> int | None:
    """The batch a built-in model comes with (None for a model file)."""
    preset = _PRESETS.get(name)
    return None if preset is None else preset.batch_size


def list_models() -> list[str]:
    """Names of the built-in models, sorted."""
    return sorted(_PRESETS)


@dataclass(frozen=True)
class ModelSummary:
    """What ``rpcompile models`` says about a built-in model."""

    name: str
    params: int
    """Parameter count (tied weights once)."""
    layers: int
    """Transformer blocks, or conv blocks of an image model."""
    device: str
    """Where it is built by default: ``cpu`` (it trains here) or ``meta`` (shapes only: profile, plan, simulate)."""
    description: str


def model_summaries() -> list[ModelSummary]:
    """Every built-in model, sorted by name, counted on the ``meta`` device (nothing is allocated)."""
    out = []
    for name in list_models():
        p = _PRESETS[name]
        with torch.device("meta"):
            model = p.build(max(p.seq_len, 1))  # image presets have no sequence (0)
        cfg = model.config
        layers = getattr(cfg, "n_layers", None) or len(getattr(cfg, "channels", ()))
        params = sum(t.numel() for t in model.parameters())
        out.append(ModelSummary(name, params, layers, p.device, p.description))
    return out


def load_model(
    spec: str,
    *,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    seed: int = 0,
) -> ModelSpec:
    """Resolve a model spec string (a built-in name or ``file.py:factory``) into a :class:`~rpcompile.models.registry.ModelSpec`.

    ``device=None`` means the preset's default: ``cpu`` for demos, ``meta`` for published shapes (and ``cpu`` for
    model files). ``batch_size``/``seq_len`` override the preset's (image models ignore ``seq_len``; model files
    ignore both). ``seed`` fixes the random weights and example inputs; the global CPU RNG is left untouched.
    """
    # the CPU generator only: forking a CUDA one would initialise CUDA
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec in _PRESETS:
            return _load_preset(spec, device, batch_size, seq_len)
        if ":" in spec or spec.endswith(".py"):
            return _to_device(_load_file(spec), device)
    raise ModelSpecError(
        f"unknown model {spec!r}; built-in models: {', '.join(list_models())}; "
        "or give a model file as path/to/file.py:factory"
    )


def _load_preset(name: str, device: str | torch.device | None, batch: int | None, seq: int | None) -> ModelSpec:
    p = _PRESETS[name]
    batch = p.batch_size if batch is None else batch
    seq = p.seq_len if seq is None else seq
    if batch < 1 or (p.kind == "lm" and seq < 1):
        raise ModelSpecError(f"{name}: batch_size={batch} and seq_len={seq} must be positive")
    dev = torch.device(p.device if device is None else device)
    with dev:  # parameters and buffers are born on the device: no storage at all on meta
        model = p.build(seq)
    # Inputs come from the CPU generator whatever the device (the same seed gives the same batch everywhere;
    # randint on meta would also import sympy, ~0.8 s).
    cpu = torch.device("cpu")
    if p.kind == "lm":
        assert isinstance(model, (Llama, GPT)), f"{name}: an lm preset builds a Llama, MoE or GPT"  # MoE is a Llama
        vocab = model.config.vocab_size
        inputs: tuple[Any, ...] = (torch.randint(0, vocab, (batch, seq), device=cpu).to(dev),)
        target, loss_fn = torch.randint(0, vocab, (batch, seq), device=cpu).to(dev), lm_loss
    else:
        assert isinstance(model, ConvNet), f"{name}: an image preset builds a ConvNet"
        cfg = model.config
        inputs = (torch.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size, device=cpu).to(dev),)
        target, loss_fn = torch.randint(0, cfg.num_classes, (batch,), device=cpu).to(dev), classification_loss
    shape = f"batch {batch}" + (f", seq {seq}" if p.kind == "lm" else "")
    return ModelSpec(model, inputs, loss_fn, target, f"{name}: {p.description} ({shape}, on {dev})")


def _load_file(spec: str) -> ModelSpec:
    path_str, sep, factory_name = spec.rpartition(":")
    if not sep or not factory_name:
        raise ModelSpecError(f"model file spec {spec!r} names no factory; write path/to/file.py:factory")
    path = Path(path_str)
    if path.suffix != ".py" or not path.is_file():
        raise ModelSpecError(
            f"unknown model {spec!r}: {path_str!r} is not a Python file; "
            f"built-in models: {', '.join(list_models())}"
        )
    factory = getattr(_import_file(path), factory_name, None)
    if not callable(factory):
        raise ModelSpecError(f"{path} has no callable {factory_name!r}; define def {factory_name}(): ... there")
    try:
        made = factory()
    except Exception as e:  # the user's code: one line naming it, not a traceback
        first = first_line(e)
        raise ModelSpecError(f"{spec}: {factory_name}() raised {type(e).__name__}{': ' + first if first else ''}; "
                             f"fix {path}, or run it in Python to see the traceback") from e
    return _as_spec(made, spec)


def _import_file(path: Path) -> Any:
    # one module name per file: two files with the same stem do not replace each other in sys.modules
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"rpcompile_user_model_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ModelSpecError(f"cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # so functions defined there pickle
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]  # no half-imported module left behind
        raise ModelSpecError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def _as_spec(result: Any, where: str) -> ModelSpec:
    if isinstance(result, ModelSpec):
        return result
    if isinstance(result, tuple) and 2 <= len(result) <= 4 and isinstance(result[0], nn.Module):
        model, inputs, *rest = result
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        loss_fn, target = (*rest, None, None)[:2]
        return ModelSpec(model, inputs, loss_fn, target, description=where)
    raise ModelSpecError(
        f"{where} returned {type(result).__name__}; expected a ModelSpec, (model, example_inputs), "
        "(model, example_inputs, loss_fn) or (model, example_inputs, loss_fn, example_target)"
    )


def _to_device(spec: ModelSpec, device: str | torch.device | None) -> ModelSpec:
    if device is None:
        return spec

    def move(x: Any) -> Any:
        return x.to(device) if isinstance(x, Tensor) else x

    return replace(
        spec,
        model=spec.model.to(device),
        example_inputs=tuple(move(x) for x in spec.example_inputs),
        example_target=move(spec.example_target),
    )
