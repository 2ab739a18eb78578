"""The solver's own source: every Python file of this folder, and its digest (what a plan and a solve cache entry
record, so that a new partitioner is not taken for the old one)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["solver_files", "solver_digest"]

_ROOT = Path(__file__).resolve().parent


def solver_files() -> list[Path]:
    """The partitioner's source: every Python file of the solver's folder, in name order."""
    return sorted(_ROOT.rglob("*.py"), key=lambda p: p.relative_to(_ROOT).as_posix())


@functools.lru_cache(maxsize=1)
def solver_digest() -> str:
    """Digest of :func:`solver_files`: each file's path in the folder and its bytes, in order."""
    h = hashlib.sha256()
    for path in solver_files():
        # NUL after the path and after the bytes: no two different sets of files hash the same stream
        h.update(path.relative_to(_ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]
