"""Loss weighting: what each microbatch's mean loss averages over, so that :class:`~rpcompile.training.pipeline.Pipeline`'s
weighted sum of them is the whole batch's mean (:class:`rpcompile.training.pipeline.Pipeline`'s contracts, **Loss**).

An integer target counts its real tokens (entries that are not :data:`IGNORE_INDEX`), any other target its rows;
:func:`shifted_tokens` counts the labels a causal LM's own loss averages over; :func:`own_loss` finds the loss a
model computes itself (``loss_fn=None``); :class:`MicrobatchLoss` is what the fused stage calls for each microbatch's
weighted loss, and :class:`BatchLoss` what ``forward_backward`` returns.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from ..core.errors import InputError, LossFnError, RPCompileError

__all__ = ["IGNORE_INDEX", "BatchLoss", "MicrobatchLoss", "check_labels", "label_bounds", "scored_classes",
           "shifted_tokens", "loss_weights", "own_loss", "checked_weight", "shifts_labels"]

#: The target value a mean loss leaves out (``ignore_index`` of torch's and HF's cross-entropy): padding.
IGNORE_INDEX = -100


def shifted_tokens(target: torch.Tensor) -> int:
    """``loss_weight=`` for a causal LM loss that shifts inside (HF's): the labels it averages over are
    ``target[:, 1:]`` that are not :data:`IGNORE_INDEX`."""
    # labels[:, 0] is never a target: HF's loss compares logits[:, :-1] with labels[:, 1:]
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
        # floating, complex and bool targets (regression values, soft labels, masks) have no padding index: they
        # weigh by rows
        elif weight == "auto" and isinstance(t, torch.Tensor) and not t.is_floating_point() \
                and not t.is_complex() and t.dtype != torch.bool:
            # every entry, not every row: a token-level mean averages over all (batch, sequence) positions that are not
            # padding
            out.append(float((t != IGNORE_INDEX).sum()))
        else:
            out.append(float(n))
    return out


def own_loss(output: Any) -> torch.Tensor:
    """The loss a model computes itself (``loss_fn=None``): its output when that is a tensor, else the output's
    ``loss`` (an HF ``ModelOutput`` or a dict) or its first element (a tuple)."""
    if isinstance(output, Mapping):
        # an HF ModelOutput holds loss=None when the model was given no labels
        if "loss" not in output or output["loss"] is None:
            raise LossFnError(f"loss_fn=None but the model's output ({type(output).__name__}) has no loss: pass "
                              "the batch's labels= (the model computes its loss from them) or give loss_fn=")
        return output["loss"]
    # HF models called with return_dict=False put the loss first
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


def shifts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's own loss predicts token t+1 from position t (HF causal LMs: ``loss_type`` or the class
    naming convention HF's loss registry keys on), so it averages over ``labels[:, 1:]``."""
    return getattr(model, "loss_type", None) == "ForCausalLM" or type(model).__name__.endswith("ForCausalLM")


def checked_weight(loss_weight: Any) -> Any:
    """``loss_weight`` itself once it is one a pipeline takes ('auto', 'rows' or a function); else one line."""
    if not callable(loss_weight) and loss_weight not in ("auto", "rows"):
        raise RPCompileError(f"loss_weight={loss_weight!r}; use 'auto', 'rows' or a function of a microbatch's "
                             "target returning how many items its mean loss averages over")
    return loss_weight


class BatchLoss(torch.Tensor):
    """What ``forward_backward`` returns: the batch's loss, a scalar tensor with no autograd graph (its gradients
    are already in each ``p.grad``). ``loss.backward()`` out of eager habit — on it or on anything computed from it,
    ``(loss / accumulation).backward()`` — is refused in one line rather than with torch's "element 0 of tensors
    does not require grad". It prints, formats, copies and pickles as a plain tensor (``torch.load(weights_only=True)``
    reads it back as one)."""

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise RPCompileError("loss.backward() on what forward_backward returned: forward_backward already ran the "
                             "backward pass and added the gradients into each p.grad; drop loss.backward() and call "
                             "optimizer.step() (the loss is for logging; to accumulate gradients over k calls, pass "
                             "forward_backward(..., loss_scale=1/k))")

    # as a plain tensor: torch formats, copies and prints exact Tensors only (f"{loss:.4f}", copy.deepcopy)
    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __format__(self, spec: str) -> str:
        return self.as_subclass(torch.Tensor).__format__(spec)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).__deepcopy__(memo)

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        return self.as_subclass(torch.Tensor).__repr__(**kwargs)


class MicrobatchLoss:
    """``loss(output, target, j)``: microbatch ``j``'s loss, weighted so that the microbatches' sum is the batch's
    mean (``weights[j] / total``; summed as they are for ``summed``), times ``scale``, from ``loss_fn(output, target)``
    (``where="outside"``), the model's own loss (``"own"``, ``loss_fn=None``) or the graph's output (``"graph"``,
    the loss inside the graph). A ``loss_fn`` that raises, or a loss that is no scalar, is refused in one line
    naming the target it was given (:class:`~rpcompile.core.errors.LossFnError`), and ``checked_targets=False``
    (no ``example_target=``) adds how to check every target before anything runs. ``bounds[j]`` (the host's
    :func:`label_bounds` of microbatch j's target) are checked against the classes of the output ``loss_fn`` gets
    before it runs: on a GPU a label out of range stops cross-entropy at a device-side assert."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor] | None, where: str, weights: Sequence[float],
                 total: float, *, summed: bool = False, checked_targets: bool = True,
                 bounds: Sequence[tuple[int, int] | None] = (), scale: float = 1.0) -> None:
        self.loss_fn, self.where, self.weights, self.total = loss_fn, where, weights, total
        self.summed, self.checked_targets, self.bounds, self.scale = summed, checked_targets, bounds, scale

    def __call__(self, output: Any, target: Any, j: int) -> torch.Tensor:
        if self.where == "graph":
            loss = output
        elif self.where == "own":
            loss = own_loss(output)
        else:
            assert self.loss_fn is not None  # outside: there is a loss_fn
            if j < len(self.bounds):
                check_labels(self.bounds[j], scored_classes(output, target), f"the target of microbatch {j}",
                             LossFnError)
            loss = self._loss_fn(output, target, j)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            if self.where != "own":
                what = "loss_fn returned" if self.where == "outside" else "the loss in the graph is"
                raise LossFnError(f"{what} {shape}, not a scalar: reduce it over the batch (reduction='mean' or "
                                  "'sum')")
            raise LossFnError(f"without a loss_fn the model's output is the loss, but it is {shape}, not a scalar: "
                              "compile with loss_fn= (e.g. torch.nn.functional.cross_entropy), or have the model "
                              "return its loss reduced over the batch")
        if self.summed:
            # a sum over the batch is the sum of the microbatches' sums: no weight
            return loss * self.scale if self.scale != 1.0 else loss
        if self.weights[j] == 0:  # nothing to average (all padding): the mean is nan, its gradient zero
            # nan_to_num first (nan * 0 is nan); still computed from the loss, so the backward has a graph to run
            # through
            return loss.nan_to_num() * 0.0
        return loss * (self.weights[j] / self.total * self.scale)

    def _loss_fn(self, output: Any, target: Any, j: int) -> Any:
        assert self.loss_fn is not None
        try:
            return self.loss_fn(output, target)
        # rpcompile's own errors are one line already: not wrapped again
        except RPCompileError:
            raise
        except Exception as e:  # noqa: BLE001 - most often a target the loss cannot take: say which
            # torch's messages run over several lines: the first one that says something
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            hint = "" if self.checked_targets else (
                ", or compile with example_target= (one batch's target) to have every call's target checked "
                "before anything runs")
            raise LossFnError(f"loss_fn(output, target) failed on microbatch {j} ({type(e).__name__}: {first}); "
                              f"it was given the target {_summary(target)} and the output {_summary(output)}: "
                              f"pass a target loss_fn takes (or fix loss_fn){hint}") from e


def label_bounds(target: Any) -> tuple[int, int] | None:
    """The smallest and largest label of an integer target, leaving out :data:`IGNORE_INDEX` (padding); None for
    another target or one that is all padding."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() \
            or target.dtype == torch.bool or target.numel() == 0:
        return None
    labels = target[target != IGNORE_INDEX]
    return (int(labels.min()), int(labels.max())) if labels.numel() else None


def scored_classes(output: Any, target: Any) -> int | None:
    """How many classes the output scores for each label of ``target``: the last dimension of the output's
    logits — the output itself, its ``logits`` or its first tensor — when it has one dimension more than the
    target (``(batch, seq, vocab)`` for ``(batch, seq)`` labels) and more than one class; None otherwise."""
    if isinstance(output, Mapping):
        output = output.get("logits")
    elif isinstance(output, (tuple, list)):
        output = next((v for v in output if isinstance(v, torch.Tensor)), None)
    # one output column (a regression, a binary logit) scores no classes to check labels against
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor) \
            or output.dim() != target.dim() + 1 or output.shape[-1] < 2:
        return None
    return int(output.shape[-1])


def check_labels(bounds: tuple[int, int] | None, classes: int | None, what: str,
                 error: type[Exception] = InputError) -> None:
    """Refuse (``error``, one line) a label the output has no class for (``>= classes``): on a GPU the loss would
    stop at a device-side assert (and CUDA in the process with it) rather than raise. Negative labels are left to
    the loss (a loss may ignore another index than -100)."""
    if bounds is None or classes is None or bounds[1] < classes:
        return
    raise error(f"{what} has label {bounds[1]}, beyond the {classes} classes of the model's output (its last "
                f"dimension): labels must be below {classes}, or {IGNORE_INDEX} (ignored); check the tokenizer "
                "against the model's vocabulary (resize_token_embeddings, then compile) — on a GPU the loss would "
                "stop at a device-side assert")


def _summary(value: Any) -> str:
    """A short description of a loss's input: ``int64 (2, 8)`` for a tensor; the tensors of an HF output, a
    mapping or a tuple as ``CausalLMOutputWithPast(logits float32 (2, 8, 64))``."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    if isinstance(value, Mapping):
        parts = [f"{k} {_summary(v)}" for k, v in value.items() if isinstance(v, torch.Tensor)]
        return f"{type(value).__name__}({', '.join(parts[:3])})"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_summary(v) for v in value[:3])})"
    return type(value).__name__
