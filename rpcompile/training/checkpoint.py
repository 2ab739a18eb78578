"""Exact save and resume: the pipeline's own state, and checkpoint files that a crash cannot tear.

Three ``state_dict``\\ s make a training run: the model's (fp32 masters, buffers such as BatchNorm statistics;
frozen parameters in the compute precision unless ``frozen_masters=True``), the optimizer's (moments, step
counts, learning rates) and the **pipeline's** (:meth:`Pipeline.state_dict`):

- ``iteration``: the number of ``forward_backward`` calls so far, which seeds every dropout mask (with the node
  and the microbatch, :mod:`rpcompile.runtime.rng`) — a fresh pipeline starts at 0 and would draw the first
  iteration's masks again;
- ``dropout_seed``: the seed every dropout mask is drawn from beside them (``torch.initial_seed()`` when the
  pipeline was made; a resumed run draws the saved run's masks whatever the new process's seed is; a version-1
  state, saved before there was one, resumes with the masks it was drawing);
- ``scaler``: the ``GradScaler``'s state (scale, growth tracker) when the pipeline holds one (fp16);
- ``stale_weights``: after ``pipe.step(optimizer, overlap=True)``, the copies of the weights from *before* that
  step, which the next iteration computes with (one step stale, :meth:`Pipeline.step`). The step itself is waited
  for, so the masters in the model's ``state_dict`` are the stepped ones; saving never changes what training
  computes, and a resumed run goes on one step stale where the saved one would have (the checkpoint then holds a
  second copy of the trainable weights, in the compute precision);
- what the state was computed with, checked on load: a version, the plan's model fingerprint
  (:class:`rpcompile.core.plan.Fingerprint`: the traced graph, whose node names key the dropout seeds, and the
  parameters), the microbatch count, the precision and the plan's cuts (:func:`plan_cuts`: each stage's nodes and
  saved nodes — a fused stage and a forward/backward pair round differently in the last bit), and the plan
  itself. The devices are not part of it: the same cuts on other devices continue bit for bit. A state that
  differs is refused in one line; ``exact=False`` loads it anyway (the iteration, the dropout seed and the scaler
  carry over).

Not saved, by design: gradients (checkpoint after the optimizer step), the weight copies and saved-segment
captures (remade from the masters), the user's random state and the data loader's position (pass what you need
in ``extra=``, e.g. an lr scheduler's ``state_dict``; the data's order is yours to replay).

**Files.** :func:`save_checkpoint` writes the three states (and ``extra``) to ``<directory>/ckpt-<step>.ckpt``:
a 48-byte header — magic, payload length, sha256 of the payload — then ``torch.save``\\ 's bytes, streamed (no
second copy in memory), through :func:`rpcompile.core.files.write_atomic` (an exclusive temporary beside it,
``fsync``, rename, directory ``fsync``), so a checkpoint's name only ever holds a whole file; then it deletes all
but the newest ``keep``. The plan goes beside them once, as ``plan.json``
(:func:`checkpoint_plan`: compile the resumed run with it, since a fresh plan may cut otherwise). A process killed
while saving leaves only its temporary file, removed by the next save once that process is gone (a temporary of
another rank saving into the same directory is never touched). :func:`load_checkpoint` takes the newest
checkpoint whose header, length and checksum hold — one torn by a machine crash, truncated or bit-flipped is moved
aside to ``<name>.corrupt`` with a one-line warning and the previous one is used — and loads the model, optimizer
and pipeline states from it, in that order, after checking the pipeline's. Payloads load with
``torch.load(weights_only=True)``: ``extra`` may hold tensors, numbers, strings and lists, tuples and dicts of
them (checked when saving).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Mapping, Protocol, cast

import torch

from ..core.errors import RPCompileError
from ..core.files import sweep_temporaries, write_atomic
from ..core.plan import Plan
from .checkpoint_state import (model_state_problem, optimizer_state_problem, payload_problem,
                               pipeline_state_problem)


__all__ = ["STATE_VERSION", "PLAN_FILE", "Resumable", "Checkpoint", "CheckpointError", "CheckpointWarning",
           "save_checkpoint", "load_checkpoint", "checkpoint_plan", "checkpoints", "verify", "pipeline_state",
           "check_pipeline_state", "plan_cuts"]

STATE_VERSION = 2
"""Version of the pipeline state's layout (:func:`pipeline_state`); a newer one is refused."""
_STATE_FORMAT = "rpcompile.training.pipeline"
_FILE_FORMAT = "rpcompile.training.checkpoint"
_MAGIC = b"RPCKPT\x00\x01"  # the last byte is the file layout's version
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload
PLAN_FILE = "plan.json"
"""The plan :func:`save_checkpoint` keeps beside the checkpoints (:func:`checkpoint_plan`)."""
_NAME = re.compile(r"^ckpt-(\d+)\.ckpt$")
_CHUNK = 1 << 22


class CheckpointError(RPCompileError):
    """No usable checkpoint, or a state that does not fit the pipeline, model or optimizer it is loaded into."""


class CheckpointWarning(UserWarning):
    """A checkpoint was found torn or corrupt and skipped (moved aside); the previous one is used."""


class Resumable(Protocol):
    """What checkpoints use of a :class:`rpcompile.training.pipeline.Pipeline` (which imports this module)."""

    plan: Plan
    microbatches: int
    precision: str
    iteration: int
    dropout_seed: int | None
    scaler: Any

    def state_dict(self) -> dict[str, Any]: ...

    def check_state_dict(self, state: Any, *, optimizer: Any = None, exact: bool = True) -> None: ...

    def load_state_dict(self, state: Mapping[str, Any], *, optimizer: Any = None, exact: bool = True) -> None: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`load_checkpoint` loaded."""

    path: Path
    step: int
    """The step it was saved at (``save_checkpoint(..., step=)``)."""
    extra: Any = None
    """The ``extra=`` it was saved with."""


# ---------------------------------------------------------------------------------------------- pipeline state
def plan_cuts(plan: Plan) -> str:
    """A digest of what in a plan decides the arithmetic: each stage's kind, nodes and saved nodes, the
    microbatch count, the split head and the host's lookups (not the devices, times or memory)."""
    cuts = [[s.kind, list(s.nodes), list(s.saved)] for s in plan.stages]
    text = json.dumps([cuts, plan.microbatches, plan.head_chunks, list(plan.host)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pipeline_state(pipe: Resumable, stale_weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The pipeline's state (module docstring); ``stale_weights``: the copies the next iteration computes with
    when an overlapped step is done but no iteration has run beside it yet (else empty)."""
    scaler = pipe.scaler
    return {"format": _STATE_FORMAT, "version": STATE_VERSION, "model": pipe.plan.model.digest,
            "cuts": plan_cuts(pipe.plan), "plan": pipe.plan.to_json(), "microbatches": pipe.microbatches,
            "precision": pipe.precision, "iteration": pipe.iteration, "dropout_seed": pipe.dropout_seed,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "stale_weights": dict(stale_weights)}


def check_pipeline_state(pipe: Resumable, state: Any, copies: Mapping[str, tuple[torch.dtype, tuple]], *,
                         exact: bool = True) -> None:
    """Raise :class:`CheckpointError` (one line) unless ``state`` is a pipeline state this pipeline can continue
    — bit for bit where ``exact``; ``copies``: dtype and shape of the copies an overlapped step keeps, by name."""
    if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
        raise CheckpointError("Pipeline.load_state_dict takes what Pipeline.state_dict() returned (a dict with "
                              f"format={_STATE_FORMAT!r}); got {type(state).__name__}")
    version = state.get("version")
    if not isinstance(version, int) or version > STATE_VERSION:
        raise CheckpointError(f"the pipeline state has version {version!r} but this rpcompile reads up to "
                              f"{STATE_VERSION}; load it with the rpcompile that saved it or a newer one")
    problem = pipeline_state_problem(state, version)
    if problem is not None:
        raise CheckpointError(f"the pipeline state is malformed ({problem}); load a state Pipeline.state_dict() "
                              "returned (a checkpoint of this rpcompile)")
    if not exact:
        return
    again = ("compile with the plan it was saved with (plan=rpcompile.checkpoint_plan(directory) for save_checkpoint's "
             "directory), or pass exact=False to continue on this pipeline, not bit for bit")
    if state["model"] != pipe.plan.model.digest:
        raise CheckpointError(f"the pipeline state is for another graph (fingerprint {state['model']}, this "
                              f"pipeline's is {pipe.plan.model.digest}: the model, its head_chunks or host "
                              f"embeddings differ); {again}")
    saved = (state["microbatches"], state["precision"])
    if saved != (pipe.microbatches, pipe.precision):
        raise CheckpointError(f"the pipeline state ran {saved[0]} microbatches in {saved[1]}, this pipeline "
                              f"runs {pipe.microbatches} in {pipe.precision}; compile with microbatches={saved[0]}, "
                              f"precision={saved[1]!r}, or pass exact=False")
    if state["cuts"] != plan_cuts(pipe.plan):
        raise CheckpointError(f"the pipeline state was computed with a plan cut otherwise (cuts {state['cuts']}, "
                              f"this pipeline's {plan_cuts(pipe.plan)}), which changes the last bits; {again}")
    has_scaler = pipe.scaler is not None and pipe.scaler.is_enabled()
    if (state["scaler"] is not None) != has_scaler:
        raise CheckpointError(f"the pipeline state {'has' if state['scaler'] else 'has no'} GradScaler state but "
                              f"this pipeline {'has' if has_scaler else 'has no'} scaler; compile with "
                              f"scaler={'torch.amp.GradScaler(...)' if state['scaler'] else 'None'}, or pass "
                              "exact=False")
    for name, t in state["stale_weights"].items():
        mine = copies.get(name)
        if mine != (t.dtype, tuple(t.shape)):
            got = "none" if mine is None else f"{mine[0]} {mine[1]}"
            raise CheckpointError(f"the pipeline state's stale copy of {name} is {t.dtype} {tuple(t.shape)}, this "
                                  f"pipeline keeps {got}; {again}")


# ---------------------------------------------------------------------------------------------- files
class _HashingWriter:
    """A write-only file object that hashes and counts what goes through it."""

    def __init__(self, f: Any):
        self.f, self.sha, self.length = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.length += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _Payload(io.RawIOBase):
    """The payload of an open checkpoint file (what follows the header), as a file torch.load can seek in."""

    def __init__(self, f: Any):
        super().__init__()
        self.f = f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self.f.readinto(buffer)

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            offset += _HEADER.size
        return self.f.seek(offset, whence) - _HEADER.size

    def tell(self) -> int:
        return self.f.tell() - _HEADER.size


def _write_payload(f: Any, payload: Any) -> None:
    """The header, then ``payload`` as ``torch.save`` writes it, hashed on the way (module docstring)."""
    f.write(bytes(_HEADER.size))  # zeros until the payload is complete: a torn file has no magic
    writer = _HashingWriter(f)
    torch.save(payload, cast(IO[bytes], writer))
    f.seek(0)
    f.write(_HEADER.pack(_MAGIC, writer.length, writer.sha.digest()))


def verify(f: Any, size: int) -> None:
    """Check an open checkpoint file of ``size`` bytes — header, length, sha256 of the payload — without
    unpickling anything; raises :class:`ValueError` naming what is wrong if it is torn or corrupt."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise ValueError(f"{len(head)} bytes, shorter than the header")
    magic, length, digest = _HEADER.unpack(head)
    if magic != _MAGIC:
        raise ValueError("no checkpoint header (torn before its header was written, or not a checkpoint)")
    if size != _HEADER.size + length:
        raise ValueError(f"{size} bytes where the header says {_HEADER.size + length}")
    sha = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        sha.update(chunk)
    if sha.digest() != digest:
        raise ValueError("checksum mismatch")


def _unpickle(path: Path) -> dict[str, Any]:
    """The payload of ``path`` (verified already) as ``torch.load(weights_only=True)`` reads it."""
    try:
        with open(path, "rb") as f:
            f.seek(_HEADER.size)
            payload = torch.load(cast(IO[bytes], _Payload(f)), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - its checksum holds: what it holds cannot be loaded safely
        raise CheckpointError(f"{path}: its checksum holds but torch.load(weights_only=True) refused it "
                              f"({_first_line(e)}); load it with the rpcompile that saved it") from None
    if not isinstance(payload, dict) or payload.get("format") != _FILE_FORMAT:
        raise CheckpointError(f"{path} holds no rpcompile checkpoint (format {_FILE_FORMAT!r} missing)")
    return payload


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {' '.join(lines[:2])}"[:240] if lines else type(e).__name__


def checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint file in ``directory``, newest first (none if it does not exist)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def save_checkpoint(directory: str | os.PathLike, *, model: torch.nn.Module, optimizer: Any,
                    pipeline: Resumable, step: int | None = None, extra: Any = None, keep: int = 2) -> Path:
    """Write ``model``'s, ``optimizer``'s and ``pipeline``'s state (and ``extra``) to
    ``<directory>/ckpt-<step>.ckpt`` atomically, then delete all but the newest ``keep`` checkpoints there; returns
    the path. ``step`` defaults to ``pipeline.iteration``. Call it after the optimizer step (gradients are not
    saved); an overlapped step in flight is waited for (module docstring). ``optimizer=None`` saves none; a list of
    optimizers (``pipe.step([o1, o2])``) saves each, and loads into a list in the same order."""
    if keep < 1:
        raise CheckpointError(f"save_checkpoint: keep={keep}; keep at least the checkpoint just written (keep >= 1)")
    step = pipeline.iteration if step is None else step
    if type(step) is not int or step < 0:
        raise CheckpointError(f"save_checkpoint: step={step!r}; give a whole number >= 0 (load_checkpoint takes "
                              "the largest), or leave it out for pipeline.iteration")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    newer = [p.name for s, p in checkpoints(root) if s > step]
    if newer:
        raise CheckpointError(f"save_checkpoint: {root} already holds {newer[0]}, newer than step {step}: a resume "
                              "would take that one; remove it or save into another directory")
    sweep_temporaries(root)  # left by processes killed while they saved (never another rank's in flight)
    _check_extra(extra)
    pipeline_sd = pipeline.state_dict()  # first: it waits for an overlapped step, so the masters are final
    payload = {"format": _FILE_FORMAT, "step": step, "pipeline": pipeline_sd, "model": model.state_dict(),
               "optimizer": _optimizer_state(optimizer), "extra": extra}
    plan_file = root / PLAN_FILE  # first, so that every checkpoint's plan is on disk
    if not plan_file.is_file() or plan_file.read_bytes() != pipeline_sd["plan"].encode():
        write_atomic(plan_file, pipeline_sd["plan"])
    path = root / f"ckpt-{step:08d}.ckpt"
    write_atomic(path, lambda f: _write_payload(f, payload))
    for _, old in checkpoints(root)[keep:]:
        old.unlink(missing_ok=True)
    return path


def _check_extra(extra: Any) -> None:
    """Refuse an ``extra`` that ``torch.load(weights_only=True)`` would not read back (a save that cannot load)."""
    buffer = io.BytesIO()
    try:
        torch.save(extra, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch refuses, the one-line reason
        raise CheckpointError(f"save_checkpoint: extra= would not load back with torch.load(weights_only=True) "
                              f"({_first_line(e)}); keep it to tensors, numbers, strings and lists, tuples and "
                              "dicts of them (e.g. scheduler.state_dict())") from None


def checkpoint_plan(directory: str | os.PathLike) -> Plan | None:
    """The plan the checkpoints in ``directory`` were saved with (``compile(..., plan=)`` continues them bit for
    bit), or None if there is none yet — ``compile`` then plans afresh."""
    path = Path(directory) / PLAN_FILE
    return Plan.load(path) if path.is_file() else None


def _newest_good(root: Path) -> Path | None:
    """The newest checkpoint in ``root`` that passes :func:`verify`, moving bad ones aside with a warning."""
    found = checkpoints(root)
    for _, path in found:
        try:
            with open(path, "rb") as f:
                verify(f, os.fstat(f.fileno()).st_size)
            return path
        except ValueError as e:
            aside = path.with_name(path.name + ".corrupt")
            try:
                path.replace(aside)
                where = f"moved to {aside.name}"
            except OSError:
                where = "left in place"
            warnings.warn(f"checkpoint {path} is torn or corrupt ({e}); {where}, trying the previous one",
                          CheckpointWarning, stacklevel=3)
        except OSError as e:
            warnings.warn(f"checkpoint {path} cannot be read ({e}); trying the previous one", CheckpointWarning,
                          stacklevel=3)
    if found:
        raise CheckpointError(f"no good checkpoint in {root}: all {len(found)} are torn, corrupt or unreadable "
                              "(the corrupt ones moved aside as *.corrupt); start afresh or restore one from a backup")
    return None


def _optimizer_state(optimizer: Any) -> Any:
    """What a checkpoint holds of ``optimizer``: its ``state_dict``, a list of them for a list of optimizers
    (``pipe.step([o1, o2])``), or None."""
    if optimizer is None:
        return None
    if isinstance(optimizer, (list, tuple)):
        return [o.state_dict() for o in optimizer]
    return optimizer.state_dict()


def _optimizer_pairs(path: Path, optimizer: Any, saved: Any) -> list[tuple[Any, Any]]:
    """Each optimizer given to :func:`load_checkpoint` with the state saved for it (none if none was saved)."""
    if optimizer is None or saved is None:
        return []
    mine = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    theirs = saved if isinstance(saved, list) else [saved]
    if len(mine) != len(theirs):
        raise CheckpointError(f"{path}: the checkpoint holds the state of {len(theirs)} optimizer(s) but "
                              f"{len(mine)} were given; pass optimizer= as it was saved ({len(theirs)}, a list in "
                              "the same order for several)")
    return list(zip(mine, theirs))


def _load_optimizer_state(path: Path, pairs: list[tuple[Any, Any]]) -> None:
    for o, state in pairs:
        try:
            o.load_state_dict(state)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: the optimizer's state does not fit this optimizer ({_first_line(e)}); "
                                  "make it as for the run that saved it (same parameters, same groups)") from None


def load_checkpoint(directory: str | os.PathLike, *, model: torch.nn.Module, optimizer: Any,
                    pipeline: Resumable, exact: bool = True) -> Checkpoint | None:
    """Load the newest good checkpoint in ``directory`` into ``model``, ``optimizer`` and ``pipeline`` — made
    as for the run that saved it: the same model compiled with :func:`checkpoint_plan`'s plan, an optimizer of
    the same kind over its parameters; returns what was loaded, or None when the directory holds no checkpoint
    (a fresh start). ``exact=False``: :meth:`Pipeline.load_state_dict`'s."""
    path = _newest_good(Path(directory))
    if path is None:
        return None
    payload = _unpickle(path)
    problem = payload_problem(payload)
    if problem is not None:
        raise CheckpointError(f"{path}: its checksum holds but its content is malformed ({problem}); load it with "
                              "the rpcompile that saved it, or remove it to resume from the one before")
    # every check before anything changes: the pipeline state, the model's, each optimizer's
    pipeline.check_state_dict(payload["pipeline"], optimizer=optimizer, exact=exact)
    optimizers = _optimizer_pairs(path, optimizer, payload["optimizer"])
    problem = model_state_problem(model, payload["model"])
    if problem is not None:
        raise CheckpointError(f"{path}: the model's state does not fit this model ({problem}); load it into the model "
                              "it was saved from")
    problem = next((p for o, state in optimizers if (p := optimizer_state_problem(o, state)) is not None), None)
    if problem is not None:
        raise CheckpointError(f"{path}: the optimizer's state does not fit this optimizer ({problem}); make it as for "
                              "the run that saved it (same parameters, same groups)")
    pipeline.synchronize()  # no overlapped step may be writing the masters while they load
    _load_optimizer_state(path, optimizers)  # torch's load changes nothing until its own checks pass
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:  # checked above: not expected
        raise CheckpointError(f"{path}: the model's state does not fit this model ({_first_line(e)}); load it into "
                              "the model it was saved from") from None
    pipeline.load_state_dict(payload["pipeline"], optimizer=optimizer, exact=exact)
    return Checkpoint(path=path, step=payload["step"], extra=payload["extra"])
