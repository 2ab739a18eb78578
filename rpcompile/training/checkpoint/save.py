"""Saving: a training run's checkpoint (:func:`save_checkpoint`, synchronous or in the background), a model's
weights alone (:func:`save_weights`), and an older ``.ckpt`` file rewritten as a directory (:func:`convert`)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Literal, overload

import torch

from ...core.errors import one_line
from ...core.files import remove_atomically, sweep_temporaries, write_atomic
from .background import PendingSave, start_background, wait_pending
from .layout import MANIFEST, PLAN_FILE, Manifest, checkpoint_name, checkpoints, newest_good, verify_path
from .legacy import read_legacy
from .snapshot import Snapshot, config_writer, hash_file, take_snapshot, write_snapshot
from .state import STATE_FORMAT, CheckpointError, Resumable, pipeline_state_problem
from .weights import DEFAULT_SHARD_SIZE, parse_size, untie, write_weights

__all__ = ["save_checkpoint", "save_weights", "convert"]



@overload
def save_checkpoint(directory: str | os.PathLike, *, model: torch.nn.Module, optimizer: Any, pipeline: Resumable,
                    step: int | None = ..., extra: Any = ..., keep: int = ..., background: Literal[False] = ...,
                    max_shard_size: int | str = ...) -> Path: ...


@overload
def save_checkpoint(directory: str | os.PathLike, *, model: torch.nn.Module, optimizer: Any, pipeline: Resumable,
                    step: int | None = ..., extra: Any = ..., keep: int = ..., background: Literal[True],
                    max_shard_size: int | str = ...) -> PendingSave: ...


def save_checkpoint(directory: str | os.PathLike, *, model: torch.nn.Module, optimizer: Any, pipeline: Resumable,
                    step: int | None = None, extra: Any = None, keep: int = 2, background: bool = False,
                    max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path | PendingSave:
    """Write ``model``'s, ``optimizer``'s and ``pipeline``'s state (and ``extra``) as the checkpoint directory
    ``<directory>/ckpt-<step>`` (:mod:`rpcompile.training.checkpoint`), whole or not at all, then remove all but
    the newest ``keep`` checkpoints there; returns its path. ``step`` defaults to ``pipeline.iteration``. Call it
    after the optimizer step (gradients are not saved); an overlapped step in flight is waited for.
    ``optimizer=None`` saves none; a list of optimizers (``pipe.step([o1, o2])``) saves each, and loads into a
    list in the same order. ``background=True`` returns a :class:`~.background.PendingSave` at once and writes on
    a thread (:mod:`~rpcompile.training.checkpoint.background`: what it copies, what waits for it). Weights above ``max_shard_size`` (bytes or
    ``"5GB"``) are sharded as HF shards them."""
    if keep < 1:
        raise CheckpointError(f"save_checkpoint: keep={keep}; keep at least the checkpoint just written (keep >= 1)")
    step = pipeline.iteration if step is None else step
    if type(step) is not int or step < 0:
        raise CheckpointError(f"save_checkpoint: step={step!r}; give a whole number >= 0 (load_checkpoint takes "
                              "the largest), or leave it out for pipeline.iteration")
    shard_bytes = parse_size(max_shard_size)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    pipeline_sd = pipeline.state_dict()  # first: it waits for an overlapped step, so the masters are final
    wait_pending(root)  # one save at a time into a directory; a failed one raises here
    # a resume takes the newest checkpoint: one newer than this save would hide it
    newer = [p.name for s, p in checkpoints(root) if s > step]
    if newer:
        raise CheckpointError(f"save_checkpoint: {root} already holds {newer[0]}, newer than step {step}: a resume "
                              "would take that one; remove it or save into another directory")
    sweep_temporaries(root)  # left by processes killed while they saved (never another rank's in flight)
    snap = take_snapshot(step=step, model=model, optimizer=optimizer, pipeline_state=pipeline_sd,
                         extra=_copy_extra(extra))
    plan_file = root / PLAN_FILE  # first, so that every checkpoint's plan is on disk
    # written only when it differs: every save of a run keeps the same plan
    if not plan_file.is_file() or plan_file.read_bytes() != pipeline_sd["plan"].encode():
        write_atomic(plan_file, pipeline_sd["plan"])
    path = root / checkpoint_name(step)

    def write(s: Snapshot) -> None:
        write_snapshot(path, s, shard_bytes)
        # checkpoints() lists the newest first; the older ones go only once the new one is whole
        for _, old in checkpoints(root)[keep:]:
            remove_atomically(old)

    if background:
        optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) \
            else [optimizer]
        return start_background(root, path, snap, write, model=model, optimizers=optimizers)
    # written before returning: the parameters the snapshot references (not copies) cannot step meanwhile
    write(snap)
    return path


def _copy_extra(extra: Any) -> Any:
    """``extra`` as ``torch.load(weights_only=True)`` reads it back — a copy, so later changes to the caller's
    objects do not reach a save in flight; one it would not read back is refused (a save that cannot load)."""
    if extra is None:
        return None
    buffer = io.BytesIO()
    try:
        torch.save(extra, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch refuses, the one-line reason
        raise CheckpointError(f"save_checkpoint: extra= would not load back with torch.load(weights_only=True) "
                              f"({one_line(e)}); keep it to tensors, numbers, strings and lists, tuples and "
                              "dicts of them (e.g. scheduler.state_dict())") from None


def save_weights(directory: str | os.PathLike, model: torch.nn.Module, *,
                 max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write ``model``'s weights into ``directory`` as HF ``save_pretrained`` does — ``model.safetensors`` or
    shards and their index, an HF model's ``config.json`` — with ``checkpoint.json`` (their sizes and sha256)
    last; each file atomic, other files there left alone (a tokenizer's), stale shards removed. No pipeline
    needed; :func:`~.load.load_weights` and ``from_pretrained`` read it."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST).unlink(missing_ok=True)  # meanwhile the directory reads as save_pretrained's, unchecked
    weights, tied = untie(model.state_dict(), model)
    files = write_weights(root, weights, parse_size(max_shard_size))
    dtype = next((t.dtype for t in weights.values() if t.is_floating_point()), None)
    writer = config_writer(model, dtype)
    for name in writer(root) if writer is not None else []:
        files[name] = hash_file(root / name)
    write_atomic(root / MANIFEST, Manifest(files=files, tied=tied).to_json())
    return root


def convert(old: str | os.PathLike, new: str | os.PathLike, *,
            max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Rewrite the ``.ckpt`` file ``old`` (or the newest good one in the directory ``old``) as the checkpoint
    directory ``<new>/ckpt-<step>``, its plan as ``<new>/plan.json``; returns the directory. Nothing in ``old``
    changes. Tied weights (one tensor under several names) keep the first name; no ``config.json`` is written
    (the model is not at hand: ``model.config.save_pretrained`` there for ``from_pretrained``)."""
    source = Path(old)
    if source.is_dir():
        found = newest_good(source, move_aside=False)
        if found is None or found.is_dir():
            raise CheckpointError(f"{source} holds no .ckpt checkpoint to convert" +
                                  (f" (its newest, {found.name}, is in the current format already)" if found else ""))
        source = found
    elif not source.is_file():
        raise CheckpointError(f"{source}: no such file or directory; give a .ckpt file or the directory holding them")
    else:
        try:
            verify_path(source)
        except ValueError as e:
            raise CheckpointError(f"{source} is torn or corrupt ({e}); convert an earlier checkpoint") from None
    contents = read_legacy(source)
    # no model at hand: aliases are found by storage alone, the first name kept
    weights, tied = untie(contents.model)
    state = contents.pipeline
    version = state.get("version") if isinstance(state, dict) else None
    problem = "not a pipeline state" if not isinstance(state, dict) or state.get("format") != STATE_FORMAT \
        or type(version) is not int else pipeline_state_problem(state, version)
    if problem is not None:
        raise CheckpointError(f"{source}: its pipeline state is malformed ({problem}); load it with the rpcompile "
                              "that saved it")
    snap = Snapshot(step=contents.step, pipeline=dict(state), weights=weights, tied=tied,
                    optimizers=contents.optimizers, extra=contents.extra)
    root = Path(new)
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / PLAN_FILE, state["plan"])
    path = root / checkpoint_name(contents.step)
    write_snapshot(path, snap, parse_size(max_shard_size))
    return path
