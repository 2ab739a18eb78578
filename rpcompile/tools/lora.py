"""LoRA at planning scale: adapters on a model's attention projections, and the host memory that training needs.

Terms:

- *LoRA* (Hu et al., 2021): each target ``nn.Linear`` ``W`` gets a rank-``r`` update ``scaling * B @ A``
  (``A: [r, in]``, ``B: [out, r]``, ``scaling = alpha / r``); only ``A`` and ``B`` train. Built on whatever device
  the model lives on — on ``meta`` for published shapes.
- *planning adapters* (:class:`LoraLinear`, :class:`LoraModel`): rpcompile's own models (the presets) get adapters
  laid out as PEFT lays them out — the same modules, parameter names (``base_model.model.layers.0.attn.q_proj.
  lora_A.default.weight``), shapes, frozen set and compute (``base(x) + B(A(x)) * scaling``: two extra matmuls and
  a scaled add a projection) — but with forwards ``torch.fx`` can trace. ``PeftModel.forward(*args, **kwargs)``
  cannot be symbolically traced, and exporting a 94-layer MoE instead took minutes (``tests/test_lora.py`` checks
  parameters, outputs, gradients and FLOPs against PEFT's). Any other model gets PEFT's adapters
  (``peft.get_peft_model``).
- *host memory* (:func:`lora_host_memory`, :mod:`rpcompile.training.host_memory`): what rpcompile keeps in CPU memory to
  train the adapted model. The frozen base is stored once, in the compute precision (``runtime/weights.py``: 2
  bytes a parameter in bf16); each trainable parameter has an fp32 master, an fp32 gradient, AdamW's two fp32
  moments and its upload copy in the compute precision (4 + 4 + 8 + 2 = 18 bytes in bf16). Activations saved on
  the host are the plan's and not counted here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn

from rpcompile.core.errors import ConfigError
from rpcompile.models.llama import Llama
from rpcompile.training.host_memory import HostMemory, host_memory

__all__ = ["LORA_TARGETS", "LORA_RANK", "apply_lora", "LoraLinear", "LoraModel", "lora_host_memory"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The attention projections: module names of rpcompile's and HF's decoders alike."""
LORA_RANK = 16
"""The default rank (``alpha = 2 * rank``)."""


def apply_lora(model: nn.Module, *, rank: int = LORA_RANK, targets: Sequence[str] = LORA_TARGETS,
               peft: bool | None = None) -> nn.Module:
    """``model`` with its base frozen and LoRA adapters of ``rank`` (``alpha = 2 * rank``, no dropout) on every
    ``nn.Linear`` named by ``targets``. ``peft``: PEFT's adapters (``get_peft_model``) or the planning adapters
    (:class:`LoraModel`, same layout and compute, fx-traceable); ``None``: the planning adapters for rpcompile's own
    models, PEFT's for any other. Raises :class:`~rpcompile.ConfigError` without targets, or without ``peft`` installed when
    PEFT's are asked for."""
    if rank < 1:
        raise ConfigError(f"LoRA rank {rank} must be at least 1")
    # targets are module names (q_proj), matched against each linear layer's last path component
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not names & set(targets):
        raise ConfigError(f"no nn.Linear named {', '.join(targets)} in {type(model).__name__} (its linear layers: "
                          f"{', '.join(sorted(names)) or 'none'}); LoRA targets the attention projections")
    # rpcompile's Llama and MoE (a Llama subclass) get the planning adapters: they trace with torch.fx, PEFT's do not
    if peft is False or (peft is None and isinstance(model, Llama)):
        return LoraModel(model, rank=rank, targets=targets)
    try:
        from peft import LoraConfig, get_peft_model  # optional: only LoRA on models not rpcompile's needs it
    except ImportError:
        raise ConfigError(f"LoRA on {type(model).__name__} needs PEFT: pip install peft (or rpcompile[test])") from None
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets))
    return get_peft_model(model, config)


class LoraLinear(nn.Module):
    """``base(x) + lora_B(lora_A(x)) * scaling`` with the frozen ``base_layer`` and the adapters named as PEFT's
    ``lora.Linear`` names them (adapter ``"default"``); ``A`` starts Kaiming-uniform and ``B`` at zero, as PEFT's."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float) -> None:
        super().__init__()
        device, dtype = base.weight.device, base.weight.dtype
        self.base_layer = base.requires_grad_(False)
        a = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
        b = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
        # keyed by PEFT's adapter name, so the parameter paths read lora_A.default.weight as PEFT's do
        self.lora_A, self.lora_B = nn.ModuleDict({"default": a}), nn.ModuleDict({"default": b})
        self.scaling = alpha / rank
        if device.type != "meta":  # meta tensors hold no values to fill
            nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
            # B at zero: the adapted model starts out computing exactly the base model
            nn.init.zeros_(b.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x)) * self.scaling


class LoraModel(nn.Module):
    """An rpcompile model with its base frozen and :class:`LoraLinear` adapters on ``targets``, held as
    ``base_model.model`` (PEFT's names); called like the model."""

    def __init__(self, model: nn.Module, *, rank: int, targets: Sequence[str]) -> None:
        super().__init__()
        # the whole base frozen first: the adapters made below are the only trainable parameters
        model.requires_grad_(False)
        # a snapshot of the modules: the loop replaces children as it walks
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if name in targets and isinstance(child, nn.Linear):
                    setattr(parent, name, LoraLinear(child, rank=rank, alpha=2 * rank))
        self.base_model = _Holder(model)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.base_model.model(input_ids)


class _Holder(nn.Module):
    """PEFT's ``LoraModel`` level: holds the adapted model as ``model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def lora_host_memory(model: nn.Module, precision: str = "bf16") -> HostMemory:
    """:class:`~rpcompile.training.host_memory.HostMemory` of ``model`` trained in ``precision`` with AdamW (each parameter
    counted once; :func:`rpcompile.training.host_memory.host_memory` without a plan)."""
    return host_memory(model, precision)
