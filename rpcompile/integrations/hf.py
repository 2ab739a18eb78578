"""HF ``transformers.Trainer`` with the model compiled into an rpcompile pipeline.

Switch with one line — ``from rpcompile.integrations.hf import Trainer`` instead of ``from transformers import
Trainer`` — and keep the ``TrainingArguments``, datasets, collators, callbacks and loggers as they are. The
pipeline is compiled at the first batch the Trainer hands over, with the options of :class:`PipelineOptions`
(``pipeline=``); a training step is one ``pipe.forward_backward``, and the gradients land in the model's ``.grad``
on the host, so the Trainer's clipping, optimizer and scheduler work unchanged. :class:`PipelineTrainerMixin` says
what else changes underneath (evaluation, logs, overlap, checkpoints).

TRL's ``SFTTrainer`` goes the same way: :func:`sft_trainer` returns its subclass with the same mixin. Its
``compute_loss`` extras (token accuracy, entropy) are not computed: the loss is the model's own, inside the
pipeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rpcompile.compiler import compile as compile_pipeline
from rpcompile.core.errors import ConfigError, first_line
from rpcompile.training.checkpoint.pipeline_file import PIPELINE_FILE, read_pipeline, write_pipeline
from rpcompile.core.plan import Plan

try:
    import transformers
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("rpcompile.integrations.hf needs transformers: pip install 'rpcompile[hf]'") from e

__all__ = ["PipelineOptions", "PipelineTrainerMixin", "Trainer", "sft_trainer", "TRAINER_FOLDER", "TRAINER_PLAN_FILE"]

TRAINER_FOLDER = "rpcompile"
"""The folder of a Trainer checkpoint that holds the pipeline's plan and state, beside the Trainer's own files."""
TRAINER_PLAN_FILE = "plan.json"
"""The plan the checkpoint was trained with, in :data:`TRAINER_FOLDER`."""
_OLD_PLAN, _OLD_STATE = "rpcompile_plan.json", "rpcompile_pipeline.pt"  # how earlier versions kept them


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """How the Trainer's model is compiled (``rpcompile.compile``'s arguments)."""

    gpus: int | None = None
    """GPUs ``cuda:0..gpus-1``; with neither this nor ``devices``, every visible GPU (or one logical CPU device)."""
    devices: Sequence[Any] | None = None
    """Devices by name (``["cpu", "cpu"]``: two logical CPU devices)."""
    precision: str | None = None
    """Compute precision of the stages (``"bf16"``, ``"fp16"``, ``"fp32"``; default: the plan's, else fp32); the
    masters stay fp32."""
    microbatches: int | None = None
    """Microbatches per batch (default: the planner's choice)."""
    spec: Any = None
    """A device spec or preset name for analytic costs (default: measured on the first device)."""
    plan: Plan | str | os.PathLike | None = None
    """A plan to run instead of planning (a resumed checkpoint's plan takes precedence)."""
    time_limit_s: float | None = None
    """The planner's solve time limit."""
    max_length: int | None = None
    """The longest sequence the Trainer will hand over: the pipeline is planned for it (the first batch, padded to
    it, is the example). Default: TRL's ``args.max_length`` where there is one, else the first batch's length —
    then a longer batch later is refused in one line."""
    overlap: bool = False
    """The optimizer step (and the scheduler's) on a thread beside the next iteration — ``pipe.step(optimizer,
    overlap=True)``, one step stale — where the Trainer calls ``optimizer.step()``."""
    compile_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Any other ``rpcompile.compile`` keyword (``memory_limit``, ``host_embedding``, ...)."""

    def __post_init__(self) -> None:
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise ConfigError(f"PipelineOptions(max_length={self.max_length!r}): give the longest sequence length "
                              "the Trainer will see (a positive int), or None for the first batch's")
        if self.precision not in (None, "fp32", "bf16", "fp16"):
            raise ConfigError(f"PipelineOptions(precision={self.precision!r}): use 'fp32', 'bf16' or 'fp16'")
        clash = {"loss_fn", "example_kwargs", "example_target"} & set(self.compile_kwargs)
        if clash:
            raise ConfigError(f"PipelineOptions(compile_kwargs=...) sets {sorted(clash)}, which the Trainer sets "
                              "itself (the model's own loss, the first batch as the example): drop them")

    def kwargs(self) -> dict[str, Any]:
        """``rpcompile.compile``'s keywords (those given)."""
        named = {"gpus": self.gpus, "devices": self.devices, "microbatches": self.microbatches, "spec": self.spec,
                 "plan": self.plan, "time_limit_s": self.time_limit_s, "precision": self.precision}
        return {**{k: v for k, v in named.items() if v is not None}, **self.compile_kwargs}


def _host(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch in host memory (the Trainer's dataloader may have moved it to ``args.device``)."""
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _padded(batch: Mapping[str, Any], length: int | None) -> dict[str, Any]:
    """``batch`` right-padded along the sequence (the second dimension of ``input_ids``) to ``length``: labels with
    -100 (ignored), everything else with 0 (a pad token, a masked position)."""
    ids = batch.get("input_ids")
    if length is None or not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.shape[1] >= length:
        return dict(batch)
    seq, out = ids.shape[1], {}
    for k, v in batch.items():
        # only tensors laid out [batch, sequence, ...] like input_ids (attention mask, labels) grow; the rest is kept
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq:
            # -100 is cross-entropy's ignore_index: the padded positions add nothing to the loss nor to its count of
            # real tokens
            pad = torch.full((v.shape[0], length - seq, *v.shape[2:]), -100 if k == "labels" else 0, dtype=v.dtype)
            v = torch.cat([v, pad], dim=1)
        out[k] = v
    return out


class PipelineTrainerMixin:
    """What turns a ``transformers.Trainer`` (or a subclass of it) into one that trains through a pipeline.
    Mixed in before the Trainer class: ``class T(PipelineTrainerMixin, transformers.Trainer)``. What changes
    underneath:

    - the **pipeline** is compiled at the first batch the Trainer hands over (training or evaluation), with that batch
      as the example (its keys are the compiled signature; with ``labels`` the model's own loss is the loss), and the
      options of :class:`PipelineOptions` (``pipeline=``). A later batch may have any size and length.
    - a **training step** is one ``pipe.forward_backward(**batch, num_items=...)``: the Trainer's ``num_items_in_batch``
      is the denominator of the mean over every batch of the optimizer step (without it, the loss is scaled by ``1 /
      gradient_accumulation_steps``, as the Trainer does), and the calls before the last of an accumulation run under
      ``pipe.no_sync()`` (gradients the plan sums on the devices stay there). The loss returned is the one the Trainer
      logs, as its own ``training_step`` returns it.
    - the gradients land in the model's ``.grad`` on the host, so the Trainer's clipping, its ``grad_norm``, its
      optimizer and scheduler work unchanged; the model stays in CPU memory (never moved to ``args.device``).
    - **evaluation** runs ``pipe.evaluate`` (the loss) and, when predictions are asked for, ``pipe.forward`` (the
      logits).
    - **logs**: each training log also carries ``pipeline/tokens_per_second`` and ``pipeline/bubble``, measured over the
      calls since the last log (:mod:`rpcompile.training.metrics`), so TensorBoard, W&B or any logger the Trainer
      reports to shows them.
    - **overlap** (``PipelineOptions(overlap=True)``): the Trainer's ``optimizer.step()`` runs as ``pipe.step(...,
      overlap=True)`` beside the next iteration (one step stale; the scheduler stepped with it), the last one waited for
      when ``train`` returns.
    - **checkpoints**: the Trainer's own (model, optimizer, scheduler, RNG, trainer state) and, beside them, a folder
      ``rpcompile/`` with ``plan.json`` (the plan) and the pipeline's state as a checkpoint directory holds it
      (``pipeline.json``: the iteration that seeds dropout and the plan, readable text; ``pipeline.safetensors`` for the
      weight copies an overlapped step left); ``resume_from_checkpoint`` compiles with that plan and continues bit for
      bit. Checkpoints of earlier versions (``rpcompile_plan.json``, ``rpcompile_pipeline.pt``) still resume.
    """

    pipe: Any
    """The compiled pipeline (``None`` until the first batch)."""
    # what the Trainer it is mixed into has
    args: Any
    model: Any
    accelerator: Any
    current_gradient_accumulation_steps: int
    optimizer: Any
    lr_scheduler: Any

    def __init__(self, *args: Any, pipeline: PipelineOptions | None = None, **kwargs: Any) -> None:
        if pipeline is not None and not isinstance(pipeline, PipelineOptions):
            raise ConfigError(f"pipeline= takes a rpcompile.integrations.hf.PipelineOptions, got "
                              f"{type(pipeline).__name__}")
        self.pipeline_options = pipeline or PipelineOptions()
        self.pipe = None
        self._resume_dir: str | None = None
        self._records: list[Any] = []  # the training calls' StepRecords since the last log
        self._stepping: Any = None  # the optimizer whose step() runs overlapped (PipelineOptions.overlap)
        self._lr_before_step: float | None = None  # what the Trainer logs as the step's learning rate
        super().__init__(*args, **kwargs)

    # ---- placement: the model stays on the host, the pipeline uploads its stages
    # the Trainer would move the model to args.device; the pipeline needs it on the host, where the fp32 masters live
    def _move_model_to_device(self, model: torch.nn.Module, device: Any) -> None:
        return None

    # ---- the pipeline
    def _pipeline(self, batch: Mapping[str, Any]) -> Any:
        if self.pipe is None:
            options = self.pipeline_options.kwargs()
            plan_path = _plan_file(self._resume_dir) if self._resume_dir else None
            if plan_path is not None:
                options["plan"] = plan_path  # the plan the checkpoint trained with: bit for bit
            # TRL's SFTConfig has max_length (maybe None); plain TrainingArguments has none
            length = self.pipeline_options.max_length or getattr(self.args, "max_length", None)
            example = _padded(batch, length if isinstance(length, int) else None)
            # the batch dict is all keyword inputs; loss_fn=None makes the loss the model's own, computed from labels
            self.pipe = compile_pipeline(self.model, (), loss_fn=None, example_kwargs=example, **options)
            state = _pipeline_state(self._resume_dir) if self._resume_dir else None
            if state is not None:
                self.pipe.load_state_dict(state)
        return self.pipe

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One ``forward_backward`` over the batch (class docstring); returns the loss the Trainer logs."""
        # the pipeline follows the model's mode, and an evaluation may have left it in eval mode (dropout off)
        model.train()
        batch = _host(inputs)
        pipe = self._pipeline(batch)
        scale: dict[str, float] = ({"num_items": float(num_items_in_batch)} if num_items_in_batch is not None
                                   else {"loss_scale": 1.0 / self.current_gradient_accumulation_steps})
        self._overlap_steps(pipe)
        # not the last call of the accumulation (no_sync does not run beside an overlapped step)
        defer = not self.accelerator.sync_gradients and not self.pipeline_options.overlap
        with pipe.no_sync() if defer else contextlib.nullcontext():
            loss = pipe.forward_backward(**batch, **scale)
        self._records.append(pipe.last_step)
        # a plain tensor: torch would carry the BatchLoss subclass into every sum the Trainer makes of the losses
        return loss.detach().as_subclass(torch.Tensor)

    def _overlap_steps(self, pipe: Any) -> None:
        """With ``PipelineOptions.overlap``: the Trainer's ``optimizer.step()`` becomes ``pipe.step(optimizer,
        overlap=True, scheduler=...)`` (the scheduler stepped on the step's thread, right after the optimizer, as
        the overlap requires) and its own ``lr_scheduler.step()`` nothing; the learning rate it logs is the one
        read before the step was submitted, as the Trainer reads it."""
        # once per optimizer object: one the Trainer puts in its place later is patched in turn
        if not self.pipeline_options.overlap or self._stepping is self.optimizer:
            return
        if pipe.overlap_iterations and self.args.max_grad_norm:
            raise ConfigError("PipelineOptions(overlap=True) with a plan made for overlapped iterations cannot clip "
                              "(the next iteration's gradients still land while the Trainer reads them): set "
                              "max_grad_norm=0, or plan without overlap=True")
        # accelerate wraps the optimizer (AcceleratedOptimizer.optimizer) and the scheduler (.scheduler): pipe.step and
        # get_last_lr need the torch objects inside
        optimizer, scheduler = getattr(self.optimizer, "optimizer", self.optimizer), self.lr_scheduler
        inner = getattr(scheduler, "scheduler", scheduler)
        # the scheduler's own step, for the step's thread; the Trainer's call to it becomes nothing
        stepper = types.SimpleNamespace(step=scheduler.step) if scheduler is not None else None

        def step(*args: Any, **kwargs: Any) -> None:
            # read before submitting: the step's thread steps the scheduler, and the Trainer logs this step's rate
            self._lr_before_step = float(inner.get_last_lr()[0]) if inner is not None else None
            pipe.step(optimizer, overlap=True, scheduler=stepper)

        self.optimizer.step = step  # an instance attribute shadows the method: the Trainer's own call lands here
        if scheduler is not None:
            # stepper above bound the real step before this shadows it
            scheduler.step = lambda *args, **kwargs: None
        self._stepping = self.optimizer

    def _get_learning_rate(self) -> float:
        if self._stepping is not None and self._lr_before_step is not None:
            return self._lr_before_step
        return super()._get_learning_rate()  # type: ignore[misc]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; with overlapped steps, the last one waited for before it returns (the model's
        weights are then the trained ones)."""
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        finally:
            if self.pipe is not None:
                self.pipe.synchronize()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the pipeline's measurements since the last one on training logs (to every logger
        the Trainer reports to): ``pipeline/tokens_per_second`` (the calls' tokens over their wall time) and
        ``pipeline/bubble`` (their devices' mean idle share; :mod:`rpcompile.training.metrics`)."""
        # training logs carry "loss"; evaluation logs ("eval_loss") get no pipeline figures
        if self._records and "loss" in logs:
            wall = sum(r.wall_s for r in self._records)
            logs = {**logs, "pipeline/tokens_per_second": sum(r.tokens for r in self._records) / wall if wall else 0.0,
                    "pipeline/bubble": sum(r.bubble for r in self._records) / len(self._records)}
            self._records.clear()
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """The batch's loss (``pipe.evaluate``) and, unless only the loss is asked for, its logits
        (``pipe.forward``) and labels."""
        batch = _host(inputs)
        pipe = self._pipeline(batch)
        labels = batch.get("labels")
        loss = pipe.evaluate(**batch).detach().as_subclass(torch.Tensor) if labels is not None else None
        if prediction_loss_only:
            return loss, None, None
        out = pipe.forward(**batch)
        # an HF ModelOutput is a Mapping; other models may return an object with .logits, or the logits themselves
        logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", out)
        return loss, logits, labels

    # ---- checkpoints: the pipeline's plan and state beside the Trainer's files
    # the Trainer calls this with every checkpoint's folder (and _load_rng_state on every resume): the pipeline's files
    # ride along with it
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)  # type: ignore[misc]
        if self.pipe is not None:
            folder = Path(output_dir, TRAINER_FOLDER)
            folder.mkdir(exist_ok=True)
            self.pipe.plan.save(folder / TRAINER_PLAN_FILE)
            write_pipeline(folder, self.pipe.state_dict())

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)  # type: ignore[misc]
        if checkpoint is not None:
            if self.pipe is not None:  # compiled already (an evaluation first): continue from the state
                state = _pipeline_state(checkpoint)
                if state is not None:
                    # exact=False: compiled at the first batch, perhaps not with the checkpoint's plan
                    self.pipe.load_state_dict(state, exact=False)
            self._resume_dir = checkpoint


def _plan_file(checkpoint: str) -> str | None:
    """The plan file a Trainer checkpoint holds (this version's place, then an earlier version's), or None."""
    for path in (os.path.join(checkpoint, TRAINER_FOLDER, TRAINER_PLAN_FILE), os.path.join(checkpoint, _OLD_PLAN)):
        if os.path.exists(path):
            return path
    return None


def _pipeline_state(checkpoint: str) -> dict[str, Any] | None:
    """The pipeline state a Trainer checkpoint holds, or None; a damaged one refused in one line naming it."""
    folder = Path(checkpoint, TRAINER_FOLDER)
    try:
        if (folder / PIPELINE_FILE).exists():
            return read_pipeline(folder)
        old = Path(checkpoint, _OLD_STATE)
        # weights_only: a checkpoint may come from anywhere, and a full unpickle could run its code
        return torch.load(old, weights_only=True) if old.exists() else None
    except (ValueError, RuntimeError, OSError) as e:
        raise ConfigError(f"the pipeline state in {checkpoint} cannot be read ({first_line(e)}): resume from "
                          "another checkpoint, or delete its rpcompile folder to resume without it "
                          "(dropout then draws other masks)") from None


class Trainer(PipelineTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training through an rpcompile pipeline (module docstring); ``pipeline=`` takes the
    :class:`PipelineOptions`."""


def sft_trainer() -> type:
    """TRL's ``SFTTrainer`` with :class:`PipelineTrainerMixin` (``trl`` imported here, on first use)."""
    try:
        import trl
    except ImportError as e:
        raise ConfigError("sft_trainer() needs TRL: pip install trl") from e
    return type("SFTTrainer", (PipelineTrainerMixin, trl.SFTTrainer), {"__module__": __name__})
