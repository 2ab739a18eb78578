"""What a training session is told besides its model, plan and program: :class:`TrainOptions`, made once by
``rpcompile.compile`` (:mod:`rpcompile.compiler`) from its keywords, checked here, and handed whole to the
:class:`~rpcompile.training.pipeline.Pipeline`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..core.errors import ConfigError
from ..core.precision import COMPUTE_DTYPES
from .loss_weighting import checked_weight

__all__ = ["TrainOptions"]


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """A pipeline's own options (``rpcompile.compile``'s ``precision``, ``scaler``, ``loss_weight``,
    ``frozen_masters``); each refused in one line when made."""

    precision: str = "fp32"
    """The compute precision the stages run in (fp32, bf16, fp16): the weights are uploaded in it."""
    scaler: Any = None
    """fp16's loss scaler (``torch.amp.GradScaler("cpu")``); None: no loss scaling."""
    loss_weight: "str | Callable[[Any], float]" = "auto"
    """What each microbatch's mean loss averages over (:func:`~rpcompile.training.loss_weighting.loss_weights`):
    ``"auto"`` (real tokens of an integer target, rows otherwise), ``"rows"``, or a function of a target."""
    frozen_masters: bool = False
    """Keep the fp32 masters of frozen parameters too; False: only their copy in the compute precision."""

    def __post_init__(self) -> None:
        if self.precision not in COMPUTE_DTYPES:
            raise ConfigError(f"precision must be one of {sorted(COMPUTE_DTYPES)}, got {self.precision!r}")
        checked_weight(self.loss_weight)
