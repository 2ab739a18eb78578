"""The earlier checkpoint format: one ``ckpt-<step>.ckpt`` file per checkpoint, still read (and converted).

A ``.ckpt`` file is a 48-byte header — magic ``RPCKPT\\0\\1``, the payload's length, the payload's sha256 — then
the payload as ``torch.save`` wrote it: ``{"format": "rpcompile.training.checkpoint", "step", "pipeline",
"model", "optimizer", "extra"}`` (the three ``state_dict``\\ s; the optimizer's a list for several, or None).
``torch.load`` alone cannot open one (the header comes first). :func:`verify` checks the header, length and
checksum without unpickling anything; :func:`read_legacy` then loads the payload with
``torch.load(weights_only=True)`` and checks its layout (:func:`payload_problem`). ``load_checkpoint`` and
``load_weights`` read these files as they read checkpoint directories; ``rpcompile checkpoint convert OLD NEW``
rewrites one as a directory that safetensors and ``from_pretrained`` open (:func:`rpcompile.training.checkpoint.save.convert`).
:func:`write_legacy` writes one (tests make old checkpoints with it).
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from pathlib import Path
from typing import IO, Any, Mapping, cast

import torch

from ...core.errors import one_line
from ...core.files import write_atomic
from .state import CheckpointError, Contents

__all__ = ["FILE_FORMAT", "verify", "read_legacy", "payload_problem", "write_legacy"]

FILE_FORMAT = "rpcompile.training.checkpoint"
_MAGIC = b"RPCKPT\x00\x01"  # the last byte is the file layout's version
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload
_CHUNK = 1 << 22


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
        # positions in the payload are past the header: an absolute seek moves by it, a relative one does not
        if whence == 0:
            offset += _HEADER.size
        return self.f.seek(offset, whence) - _HEADER.size

    def tell(self) -> int:
        return self.f.tell() - _HEADER.size


def verify(f: Any, size: int) -> None:
    """Check an open ``.ckpt`` file of ``size`` bytes — header, length, sha256 of the payload — without
    unpickling anything; raises :class:`ValueError` naming what is wrong if it is torn or corrupt."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise ValueError(f"{len(head)} bytes, shorter than the header")
    magic, length, digest = _HEADER.unpack(head)
    if magic != _MAGIC:
        raise ValueError("no checkpoint header (torn before its header was written, or not a checkpoint)")
    # a write cut short leaves fewer bytes than the header says; more is not ours either
    if size != _HEADER.size + length:
        raise ValueError(f"{size} bytes where the header says {_HEADER.size + length}")
    sha = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        sha.update(chunk)
    if sha.digest() != digest:
        raise ValueError("checksum mismatch")


def payload_problem(payload: Mapping[str, Any]) -> str | None:
    """What is malformed in a checkpoint's payload (its checksum held), or None — checked before anything loads."""
    for name in ("step", "pipeline", "model", "optimizer", "extra"):
        if name not in payload:
            return f"no {name!r}"
    step, model = payload["step"], payload["model"]
    if type(step) is not int or step < 0:
        return f"step is {repr(step)[:40]}"
    if not isinstance(payload["pipeline"], Mapping):
        return f"pipeline is {type(payload['pipeline']).__name__}"
    # a module's _extra_state need not be a tensor: torch.save stored it as it was
    if not isinstance(model, Mapping) or not all(isinstance(k, str) and (isinstance(v, torch.Tensor)
                                                                         or k.endswith("_extra_state"))
                                                 for k, v in model.items()):
        return "model is not a state_dict of tensors"
    return None


def read_legacy(path: Path) -> Contents:
    """The checkpoint in the ``.ckpt`` file ``path`` (verified already), its payload loaded with
    ``torch.load(weights_only=True)`` and its layout checked; CheckpointError (one line) otherwise."""
    try:
        with open(path, "rb") as f:
            # torch.load reads the payload as if it began at offset 0 (_Payload)
            f.seek(_HEADER.size)
            payload = torch.load(cast(IO[bytes], _Payload(f)), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - its checksum holds: what it holds cannot be loaded safely
        raise CheckpointError(f"{path}: its checksum holds but torch.load(weights_only=True) refused it "
                              f"({one_line(e)}); load it with the rpcompile that saved it") from None
    if not isinstance(payload, dict) or payload.get("format") != FILE_FORMAT:
        raise CheckpointError(f"{path} holds no rpcompile checkpoint (format {FILE_FORMAT!r} missing)")
    problem = payload_problem(payload)
    if problem is not None:
        raise CheckpointError(f"{path}: its checksum holds but its content is malformed ({problem}); load it with "
                              "the rpcompile that saved it, or remove it to resume from the one before")
    saved = payload["optimizer"]
    optimizers = None if saved is None else list(saved) if isinstance(saved, list) else [saved]
    return Contents(path=path, step=payload["step"], pipeline=payload["pipeline"], model=dict(payload["model"]),
                    optimizers=optimizers, extra=payload["extra"])


def write_legacy(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` (module docstring; ``format`` added) as a ``.ckpt`` file, atomically."""
    buffer = io.BytesIO()
    torch.save({"format": FILE_FORMAT, **payload}, buffer)
    body = buffer.getvalue()
    write_atomic(path, _HEADER.pack(_MAGIC, len(body), hashlib.sha256(body).digest()) + body)
    return Path(path)
