"""Loss weighting: what each microbatch's mean loss averages over, so that :class:`~rpcompile.pipeline.Pipeline`'s
weighted sum of them is the whole batch's mean (the module docstring of :mod:`rpcompile.pipeline`, **Loss**).

An integer target counts its real tokens (entries that are not :data:`IGNORE_INDEX`), any other target its rows;
:func:`shifted_tokens` counts the labels a causal LM's own loss averages over; :func:`own_loss` finds the loss a
model computes itself (``loss_fn=None``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from .core.errors import RPCompileError

__all__ = ["IGNORE_INDEX", "shifted_tokens", "loss_weights", "own_loss"]

#: The target value a mean loss leaves out (``ignore_index`` of torch's and HF's cross-entropy): padding.
IGNORE_INDEX = -100


def shifted_tokens(target: torch.Tensor) -> int:
    """``loss_weight=`` for a causal LM loss that shifts inside (HF's): the labels it averages over are
    ``target[:, 1:]`` that are not :data:`IGNORE_INDEX`."""
    return int((target[:, 1:] != IGNORE_INDEX).sum())


def loss_weights(targets: Sequence[Any], rows: Sequence[int], weight: "str | Callable[[Any], float]" = "auto",
                 ) -> list[float]:
    """What each microbatch's mean loss averages over, so that their weighted sum is the whole batch's mean.

    ``"auto"``: an integer target (token ids, class labels) counts its entries that are not
    :data:`IGNORE_INDEX` — padded batches are weighted by real tokens, as eager ``cross_entropy(...,
    ignore_index=-100)`` on the whole batch averages (the gradient-accumulation normalisation HF's Trainer fixed
    with ``num_items_in_batch``); any other target weighs by rows (dim 0). ``"rows"``: always rows. A callable
    (e.g. :func:`shifted_tokens`) counts the items of one microbatch's target."""
    out = []
    for t, n in zip(targets, rows):
        if callable(weight):
            out.append(float(weight(t)))
        elif weight == "auto" and isinstance(t, torch.Tensor) and not t.is_floating_point() \
                and not t.is_complex() and t.dtype != torch.bool:
            out.append(float((t != IGNORE_INDEX).sum()))
        else:
            out.append(float(n))
    return out


def own_loss(output: Any) -> torch.Tensor:
    """The loss a model computes itself (``loss_fn=None``): its output when that is a tensor, else the output's
    ``loss`` (an HF ``ModelOutput`` or a dict) or its first element (a tuple)."""
    if isinstance(output, Mapping):
        if "loss" not in output or output["loss"] is None:
            raise RPCompileError(f"loss_fn=None but the model's output ({type(output).__name__}) has no loss: pass "
                                 "the batch's labels= (the model computes its loss from them) or give loss_fn=")
        return output["loss"]
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


def _shifts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's own loss predicts token t+1 from position t (HF causal LMs: ``loss_type`` or the class
    naming convention HF's loss registry keys on), so it averages over ``labels[:, 1:]``."""
    return getattr(model, "loss_type", None) == "ForCausalLM" or type(model).__name__.endswith("ForCausalLM")


def _checked_weight(loss_weight: Any) -> Any:
    if not callable(loss_weight) and loss_weight not in ("auto", "rows"):
        raise RPCompileError(f"loss_weight={loss_weight!r}; use 'auto', 'rows' or a function of a microbatch's "
                             "target returning how many items its mean loss averages over")
    return loss_weight
