"""A checkpoint directory: its name, its manifest, and which checkpoints of a run are whole.

A run saves into one directory; each checkpoint is a directory ``ckpt-<step>`` in it (the step, 8 digits or more),
beside the plan and older checkpoints of the earlier format (single files ``ckpt-<step>.ckpt``, :mod:`.legacy`)::

    ckpt/plan.json                                the plan the run trains with (checkpoint_plan)
    ckpt/ckpt-00000006/model.safetensors          weights (or model-0000i-of-0000n.safetensors + the index)
                       config.json                an HF model's config (and generation_config.json)
                       optimizer.pt               optimizer.state_dict() (optimizer-<i>.pt for several)
                       pipeline.json              the pipeline's state (pipeline.safetensors: its tensors)
                       extra.pt                   extra= (the data position, a scheduler's state)
                       checkpoint.json            the manifest, written last

The **manifest** ``checkpoint.json`` (:class:`Manifest`) names every file with its size and sha256 and is
written last; :func:`verify_directory` checks it and every file before anything is parsed, and :func:`newest_good`
takes the newest checkpoint that verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...core.files import MAX_INT, parse_json, read_limited
from ...core.text import printable
from .legacy import verify
from .state import CheckpointError, CheckpointWarning

__all__ = ["MANIFEST", "FORMAT", "VERSION", "Manifest", "checkpoint_name", "checkpoints", "read_manifest",
           "verify_directory", "verify_path", "newest_good", "optimizer_files", "EXTRA_FILE",
           "PLAN_FILE"]

MANIFEST = "checkpoint.json"
FORMAT = "rpcompile.checkpoint"
VERSION = 1
"""The manifest's layout version; a newer one is refused."""
EXTRA_FILE = "extra.pt"
PLAN_FILE = "plan.json"
"""The plan :func:`~.save.save_checkpoint` keeps beside the checkpoints (:func:`~.load.checkpoint_plan`)."""
# at most 19 digits, as many as MAX_INT (an int64) has: a name never holds an unbounded number
_DIR = re.compile(r"^ckpt-(\d{1,19})$")
_LEGACY = re.compile(r"^ckpt-(\d{1,19})\.ckpt$")
# a plain name of a file in the checkpoint: no separator and no leading dot, so a manifest names nothing outside it
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
# the manifest is read before anything is trusted: bounded
_MAX_MANIFEST = 16 << 20
_CHUNK = 1 << 22


@dataclass(frozen=True)
class Manifest:
    """What ``checkpoint.json`` says.

    The **manifest** ``checkpoint.json`` names every file with its size and sha256, the step, the tied weights (dropped
    name → kept name), how many optimizer states and whether ``extra`` was saved, and ends with a sha256 of itself
    (``digest``: of the rest as canonical JSON), so a flipped bit anywhere is caught. :func:`verify_directory` reads it
    (strict, bounded JSON; every field checked) and checks each file — a regular file (no link followed), its size, its
    checksum — before anything is parsed. The directory is written whole or not at all
    (:func:`rpcompile.core.files.atomic_directory`), so a checkpoint's name only ever holds a whole checkpoint;
    :func:`newest_good` takes the newest one that verifies, moving a bad one aside (``<name>.corrupt``) with a one-line
    warning.
    """

    files: dict[str, tuple[int, str]]
    """Each file → (bytes, sha256 hex)."""
    step: int | None = None
    """None: weights alone (``save_weights``)."""
    tied: dict[str, str] = field(default_factory=dict)
    optimizers: int = 0
    extra: bool = False

    def to_json(self) -> str:
        body: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": self.step,
                                "files": {k: {"bytes": n, "sha256": h} for k, (n, h) in sorted(self.files.items())},
                                "tied": dict(sorted(self.tied.items())), "optimizers": self.optimizers,
                                "extra": self.extra}
        return json.dumps({**body, "digest": _digest(body)}, indent=1) + "\n"


def _digest(body: dict[str, Any]) -> str:
    # canonical JSON (sorted keys, no spaces): the digest does not depend on how the file is laid out
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checkpoint_name(step: int) -> str:
    # zero-padded: the names sort by step as text too
    return f"ckpt-{step:08d}"


def optimizer_files(count: int) -> list[str]:
    """The files of ``count`` optimizer states: ``optimizer.pt`` for one, ``optimizer-<i>.pt`` for several."""
    # plain torch.save of state_dict(), not torch.distributed.checkpoint: that format's .metadata is read with a full
    # pickle.load (files would be code), needs its own API to read, and its resharding buys nothing here (the
    # optimizer's state lives whole in each process's host memory)
    return ["optimizer.pt"] if count == 1 else [f"optimizer-{i}.pt" for i in range(count)]


def checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint in ``directory`` — directories and older ``.ckpt`` files — newest
    first (for one step, the directory first); none if it does not exist."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        # a link could lead anywhere: only real directories are checkpoints
        if (m := _DIR.match(p.name)) and p.is_dir() and not p.is_symlink():
            found.append((int(m[1]), 1, p))
        elif m := _LEGACY.match(p.name):
            found.append((int(m[1]), 0, p))
    return [(s, p) for s, _, p in sorted(found, key=lambda x: (x[0], x[1], x[2].name), reverse=True)]


# ---------------------------------------------------------------------------------------------- the manifest
def read_manifest(directory: Path) -> Manifest:
    """The checked manifest of ``directory``; ValueError (one line) naming what is wrong."""
    try:
        raw = read_limited(directory / MANIFEST, _MAX_MANIFEST)
    except FileNotFoundError:
        raise ValueError(f"no {MANIFEST} (not a finished rpcompile checkpoint)") from None
    except OSError as e:
        raise ValueError(f"{MANIFEST} cannot be read ({e.strerror or e})") from None
    try:
        obj = parse_json(raw, max_depth=3, what="a checkpoint manifest")
    except ValueError as e:
        raise ValueError(f"{MANIFEST} is corrupt ({e})") from None
    problem = _manifest_problem(obj)
    if problem is not None:
        raise ValueError(f"{MANIFEST} is corrupt ({problem})")
    return Manifest(files={k: (v["bytes"], v["sha256"]) for k, v in obj["files"].items()}, step=obj["step"],
                    tied=obj["tied"], optimizers=obj["optimizers"], extra=obj["extra"])


def _manifest_problem(obj: Any) -> str | None:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        return f"no format {FORMAT!r}"
    if type(obj.get("version")) is not int or obj["version"] > VERSION:
        return f"version {printable(obj.get('version'), limit=20)}, this rpcompile reads up to {VERSION}"
    # the digest covers every other field
    body = {k: v for k, v in obj.items() if k != "digest"}
    if obj.get("digest") != _digest(body):
        return "its digest does not match its content"
    step, files, tied = obj.get("step"), obj.get("files"), obj.get("tied")
    if step is not None and (type(step) is not int or not 0 <= step <= MAX_INT):
        return f"step is {printable(step, limit=20)}"
    # never the manifest itself: its own sha256 could not be inside it
    if not isinstance(files, dict) or not all(isinstance(k, str) and _FILE.match(k) and k != MANIFEST
                                              and isinstance(v, dict) and type(v.get("bytes")) is int
                                              and v["bytes"] >= 0 and isinstance(v.get("sha256"), str)
                                              and _HEX.match(v["sha256"]) for k, v in files.items()):
        return "files is not a map of plain file names to their bytes and sha256"
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        return "tied is not a map of names"
    if type(obj.get("optimizers")) is not int or not 0 <= obj["optimizers"] <= 1024:
        return f"optimizers is {printable(obj.get('optimizers'), limit=20)}"
    if type(obj.get("extra")) is not bool:
        return "extra is not true or false"
    return None


# ---------------------------------------------------------------------------------------------- verification
def verify_directory(directory: Path) -> Manifest:
    """The manifest of ``directory`` once every file it names is there whole (size and sha256; module
    docstring); ValueError (one line) naming the first file that is not."""
    manifest = read_manifest(directory)
    for name, (size, digest) in manifest.files.items():
        _verify_file(directory / name, size, digest)
    return manifest


def _verify_file(path: Path, size: int, digest: str) -> None:
    # no link followed: the file hashed is the one in the checkpoint; not inherited by child processes
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ValueError(f"{path.name} is missing") from None
    except OSError as e:
        raise ValueError(f"{path.name} cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        # the size of the file opened, the one hashed below: a stat of the path could see another
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            what = "truncated" if actual < size else "longer than written"
            raise ValueError(f"{path.name} is {actual:,} bytes where {MANIFEST} says {size:,} ({what})")
        sha = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    if sha.hexdigest() != digest:
        raise ValueError(f"{path.name} does not match its sha256 in {MANIFEST} (corrupted)")


def verify_path(path: Path) -> None:
    """Check one checkpoint — a directory (:func:`verify_directory`) or an older ``.ckpt`` file — ValueError (one
    line) if it is torn or corrupt."""
    if path.is_dir():
        manifest = verify_directory(path)
        m = _DIR.match(path.name)
        # the name orders the checkpoints (checkpoints()): one renamed to another step's name is refused
        if m and manifest.step != int(m[1]):
            raise ValueError(f"{MANIFEST} says step {manifest.step}, its name {path.name}")
        return
    with open(path, "rb") as f:
        verify(f, os.fstat(f.fileno()).st_size)


def _move_aside(path: Path) -> str:
    """Rename a bad checkpoint to ``<name>.corrupt`` (``.corrupt-<i>`` if taken); where it went, in words."""
    for i in range(100):
        aside = path.with_name(path.name + (".corrupt" if i == 0 else f".corrupt-{i}"))
        # lexists: os.rename would replace what is there, a dangling link included
        if os.path.lexists(aside):
            continue
        try:
            os.rename(path, aside)
            return f"moved to {aside.name}"
        except OSError:
            # a rename refused once (a read-only directory) is refused again
            break
    return "left in place"


def newest_good(root: Path, *, move_aside: bool = True) -> Path | None:
    """The newest checkpoint in ``root`` that verifies, each bad one before it moved aside to ``<name>.corrupt``
    (``move_aside``; else left) with a one-line warning; None if ``root`` holds none; CheckpointError if none
    verifies."""
    found = checkpoints(root)
    for _, path in found:
        try:
            verify_path(path)
            return path
        except ValueError as e:
            where = _move_aside(path) if move_aside else "left in place"
            warnings.warn(f"checkpoint {path} is torn or corrupt ({e}); {where}, trying the previous one",
                          CheckpointWarning, stacklevel=3)
        # unreadable is not corrupt: it stays where it is
        except OSError as e:
            warnings.warn(f"checkpoint {path} cannot be read ({e}); trying the previous one", CheckpointWarning,
                          stacklevel=3)
    if found:
        raise CheckpointError(f"no good checkpoint in {root}: all {len(found)} are torn, corrupt or unreadable "
                              "(the corrupt ones moved aside as *.corrupt); start afresh or restore one from a backup")
    return None
