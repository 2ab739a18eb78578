"""Loading: a training run resumed bit for bit (:func:`load_checkpoint`), a checkpoint's plan
(:func:`checkpoint_plan`), and weights into a plain model, no pipeline needed (:func:`load_weights`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any, cast

import torch

from ...core.errors import one_line
from ...core.plan import Plan
from .background import wait_pending
from .layout import (EXTRA_FILE, MANIFEST, PLAN_FILE, Manifest, newest_good, optimizer_files, read_manifest,
                     verify_directory, verify_path)
from .legacy import read_legacy
from .pipeline_file import PIPELINE_FILE, PIPELINE_TENSORS, read_pipeline
from .state import Checkpoint, CheckpointError, Contents, Resumable, optimizer_state_problem
from .tensorfile import read_file
from .weights import INDEX_NAME, WEIGHTS_NAME, apply_weights, fill_aliases, read_weights, weights_problem

__all__ = ["load_checkpoint", "checkpoint_plan", "load_weights", "read_checkpoint", "checkpoint_summary"]

_AGAIN = "load it with the rpcompile that saved it, or remove it to resume from the one before"


def checkpoint_plan(directory: str | os.PathLike) -> Plan | None:
    """The plan the checkpoints in ``directory`` were saved with (``compile(..., plan=)`` continues them bit for
    bit), or None if there is none yet — ``compile`` then plans afresh."""
    path = Path(directory) / PLAN_FILE
    return Plan.load(path) if path.is_file() else None


def _torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of ``path``, opened without following a link; ValueError (one line)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        with os.fdopen(os.open(path, flags), "rb") as f:
            # weights_only: nothing in the file runs as code; on the CPU, where the masters and the optimizer's state
            # live
            return torch.load(cast(IO[bytes], f), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch refuses (weights_only, a malformed archive)
        raise ValueError(f"{path.name}: torch.load(weights_only=True) refused it ({one_line(e)})") from None


def read_checkpoint(path: Path) -> Contents:
    """What the checkpoint ``path`` (a directory that verified, or a ``.ckpt`` file) holds, read into memory and
    checked as files (each field's type and bound); CheckpointError (one line) naming the problem."""
    if not path.is_dir():
        return read_legacy(path)
    try:
        # verified already (newest_good): the manifest is read again only for what it lists
        manifest = read_manifest(path)
        if manifest.step is None:
            raise ValueError(f"{MANIFEST} names no step (weights alone, save_weights): load_weights reads it")
        model = read_weights(path, manifest.tied, listed=manifest.files)
        # a file the manifest does not list was never checksummed: refused rather than read
        unlisted = next((f for f in _needed(path, manifest) if f not in manifest.files and (path / f).exists()), None)
        if unlisted is not None:
            raise ValueError(f"{unlisted} is not among the files {MANIFEST} vouches for")
        pipeline = read_pipeline(path)
        optimizers = [_torch_load(path / f) for f in optimizer_files(manifest.optimizers)] \
            if manifest.optimizers else None
        extra = _torch_load(path / EXTRA_FILE) if manifest.extra else None
    except ValueError as e:
        raise CheckpointError(f"{path}: its checksums hold but its content is malformed ({e}); {_AGAIN}") from None
    return Contents(path=path, step=manifest.step, pipeline=pipeline, model=model, optimizers=optimizers,
                    extra=extra)


def _needed(path: Path, manifest: Manifest) -> list[str]:
    """The files besides the weights that a checkpoint with ``manifest`` is read from."""
    return [PIPELINE_FILE, *([PIPELINE_TENSORS] if (path / PIPELINE_TENSORS).exists() else []),
            *optimizer_files(manifest.optimizers), *([EXTRA_FILE] if manifest.extra else [])]


def _optimizer_pairs(path: Path, optimizer: Any, saved: list[Any] | None) -> list[tuple[Any, Any]]:
    """Each optimizer given to :func:`load_checkpoint` with the state saved for it (none if none was saved)."""
    if optimizer is None or saved is None:
        return []
    mine = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if len(mine) != len(saved):
        raise CheckpointError(f"{path}: the checkpoint holds the state of {len(saved)} optimizer(s) but "
                              f"{len(mine)} were given; pass optimizer= as it was saved ({len(saved)}, a list in "
                              "the same order for several)")
    return list(zip(mine, saved))


def load_checkpoint(directory: str | os.PathLike, *, model: torch.nn.Module, optimizer: Any,
                    pipeline: Resumable, exact: bool = True) -> Checkpoint | None:
    """Load the newest good checkpoint in ``directory`` into ``model``, ``optimizer`` and ``pipeline`` — made
    as for the run that saved it: the same model compiled with :func:`checkpoint_plan`'s plan, an optimizer of
    the same kind over its parameters; returns what was loaded, or None when the directory holds no checkpoint
    (a fresh start). Every check passes before anything changes (all or nothing). ``exact=False``:
    :meth:`Pipeline.load_state_dict <rpcompile.Pipeline.load_state_dict>`'s."""
    root = Path(directory)
    # a background save into it may be writing the newest checkpoint
    wait_pending(root)
    path = newest_good(root)
    if path is None:
        return None
    contents = read_checkpoint(path)
    pipeline.check_state_dict(contents.pipeline, optimizer=optimizer, exact=exact)
    optimizers = _optimizer_pairs(path, optimizer, contents.optimizers)
    problem = weights_problem(model, contents.model)
    if problem is not None:
        raise CheckpointError(f"{path}: the model's state does not fit this model ({problem}); load it into the model "
                              "it was saved from")
    problem = next((p for o, state in optimizers if (p := optimizer_state_problem(o, state)) is not None), None)
    if problem is not None:
        raise CheckpointError(f"{path}: the optimizer's state does not fit this optimizer ({problem}); make it as for "
                              "the run that saved it (same parameters, same groups)")
    pipeline.synchronize()  # no overlapped step may be writing the masters while they load
    for o, state in optimizers:  # torch's load changes nothing until its own checks pass
        try:
            o.load_state_dict(state)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: the optimizer's state does not fit this optimizer ({one_line(e)}); "
                                  "make it as for the run that saved it (same parameters, same groups)") from None
    try:
        model.load_state_dict(contents.model)
    except RuntimeError as e:  # checked above: not expected
        raise CheckpointError(f"{path}: the model's state does not fit this model ({one_line(e)}); load it into "
                              "the model it was saved from") from None
    # last: a state saved right after an overlapped step resumes it, which needs the optimizer's state loaded
    pipeline.load_state_dict(contents.pipeline, optimizer=optimizer, exact=exact)
    return Checkpoint(path=path, step=contents.step, extra=contents.extra)


def _weights_at(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The weights ``path`` names (module docstring of :func:`load_weights`) and where they were read from."""
    if path.is_file():
        # a bare safetensors file has no manifest to check it against
        if path.suffix == ".safetensors":
            return path, read_file(path)[1]
        try:
            verify_path(path)
        except ValueError as e:
            raise CheckpointError(f"{path} is torn or corrupt ({e}); load an earlier checkpoint") from None
        return path, read_legacy(path).model
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory; give a checkpoint directory, a run's directory "
                              "of them, or a directory save_pretrained wrote")
    if (path / MANIFEST).is_file():
        try:
            manifest = verify_directory(path)
        except ValueError as e:
            raise CheckpointError(f"{path} is torn or corrupt ({e}); copy it again or load an earlier checkpoint "
                                  "(rpcompile checkpoint verify lists them)") from None
        return path, read_weights(path, manifest.tied, listed=manifest.files)
    # HF's save_pretrained writes no manifest: read as it is
    if (path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file():
        return path, read_weights(path)
    wait_pending(path)
    # loading weights only reads: a bad checkpoint is skipped, not moved aside
    newest = newest_good(path, move_aside=False)
    if newest is None:
        raise CheckpointError(f"{path} holds no weights: no checkpoint, {WEIGHTS_NAME} or {INDEX_NAME}")
    return _weights_at(newest)


def load_weights(path: str | os.PathLike, model: torch.nn.Module, *, strict: bool = True) -> Path:
    """Load weights into ``model`` — any module, no pipeline needed — from ``path``: a checkpoint directory
    (its checksums checked first), a run's directory (its newest good checkpoint; nothing is moved), a directory
    HF ``save_pretrained`` or :func:`~.save.save_weights` wrote, a ``.safetensors`` file, or an older ``.ckpt``
    file. Names, shapes and dtypes are checked against the model before anything is copied (all or nothing);
    ``strict=False`` loads the names both have (shapes still checked). Returns where the weights came from."""
    try:
        source, state = _weights_at(Path(path))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}; copy it again, or load an earlier checkpoint") from None
    # the names untie dropped (tied weights) filled from the ones kept, as this model names them
    fill_aliases(model, state)
    problem = weights_problem(model, state, strict=strict)
    if problem is not None:
        raise CheckpointError(f"{source}: the weights do not fit this model ({problem}); load them into the model "
                              f"they were saved from{'' if not strict else ', or pass strict=False'}")
    apply_weights(model, state, strict=strict)
    return source


def checkpoint_summary(path: Path) -> str:
    """One line about the checkpoint ``path`` for people (``rpcompile checkpoint verify``)."""
    if not path.is_dir():
        return (f"{path.name}: the older .ckpt format; load_checkpoint reads it, rpcompile checkpoint convert "
                f"{path} NEW rewrites it for safetensors and from_pretrained")
    manifest = read_manifest(path)
    size = sum(n for n, _ in manifest.files.values())
    shards = sum(name.endswith(".safetensors") and name.startswith("model") for name in manifest.files)
    extras = [f for f in ("config.json", "optimizer.pt", "extra.pt") if f in manifest.files]
    return (f"{path.name}: step {manifest.step}, {size / 2**20:.1f} MiB in {len(manifest.files)} files, weights in "
            f"{shards} safetensors file{'s' if shards != 1 else ''}" +
            (f" ({len(manifest.tied)} tied)" if manifest.tied else "") + (f"; {', '.join(extras)}" if extras else ""))
