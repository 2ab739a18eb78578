"""A folder of JSON entries on disk, one file per key: the one mechanism behind the profile cache
(:mod:`rpcompile.passes.cost.profile_cache`) and the solve cache (:mod:`rpcompile.passes.solve_cache`).

An entry's file is named by a hash of its key (a JSON-able dict). Files are data: an entry is read with the strict,
bounded JSON reader (:func:`~rpcompile.core.files.read_json`: UTF-8 only, no ``NaN``, numbers in range, nesting and
size bounded; never pickle) and written through the one atomic writer (:func:`~rpcompile.core.files.write_atomic`:
an unpredictable exclusive temporary that follows no link, renamed into place, so a reader never sees half an
entry). What an entry must hold is its cache's to check; an entry that cannot be read is ignored with one warning
line (logger ``rpcompile``), and so is a cache that cannot be written.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .digest import short_digest
from .files import read_json, sweep_temporaries, write_atomic

__all__ = ["JsonCache"]

log = logging.getLogger("rpcompile")


@dataclass(frozen=True, kw_only=True)
class JsonCache:
    """One cache's folder and its words for the warnings."""

    root: Callable[[], Path]
    """The folder (looked up on each use: the cache's place may move with the environment)."""
    name: str
    """What the warnings call it, e.g. ``"profile cache"``."""
    afresh: str
    """What happens instead of using an entry, e.g. ``"measuring afresh"``."""
    max_bytes: int
    """The largest entry read; a larger one is ignored."""
    max_depth: int = 6
    """The deepest nesting an entry may have."""

    def path(self, key: dict[str, Any]) -> Path:
        """The file of ``key``'s entry."""
        # sort_keys: the same key written in any order names the same file
        digest = short_digest(json.dumps(key, sort_keys=True), 32)
        return self.root() / f"{digest}.json"

    def ignore(self, path: Path, why: str, quiet: bool = False) -> None:
        """The one warning line for an entry not used (none when ``quiet``)."""
        if not quiet:
            log.warning("ignoring %s entry %s (%s); %s", self.name, path, why, self.afresh)

    def read(self, path: Path, *, quiet: bool = False) -> Any:
        """The JSON at ``path``; None when there is none, or (warned about) when it cannot be read or is not strict,
        bounded JSON."""
        try:
            return read_json(path, max_bytes=self.max_bytes, max_depth=self.max_depth)
        except FileNotFoundError:
            return None
        except OSError as e:
            self.ignore(path, f"unreadable: {e.strerror}", quiet)
            return None
        except ValueError as e:  # not UTF-8, not JSON, NaN/Infinity, a number out of range, too deep or too large
            self.ignore(path, f"corrupt: {e}", quiet)
            return None

    def write(self, path: Path, data: Any, *, lost: str) -> bool:
        """``data`` as JSON at ``path``, atomically (:func:`~rpcompile.core.files.write_atomic`: a reader never sees
        half an entry, and a failed write leaves no temporary file); False, with a warning ending in ``lost`` (what
        was done but not kept), when the cache cannot be written."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # allow_nan=False: only what read_json accepts back
            write_atomic(path, json.dumps(data, allow_nan=False))
            return True
        except OSError as e:
            log.warning("cannot write the %s %s (%s); %s", self.name, path.parent, e.strerror, lost)
            return False

    def files(self) -> list[Path]:
        """The entries' files, sorted."""
        root = self.root()
        return sorted(root.glob("*.json")) if root.is_dir() else []

    def clear(self) -> int:
        """Remove every entry (and temporary files of writers that are gone; one in flight is left to its writer);
        the number of files removed."""
        root = self.root()
        if not root.is_dir():
            return 0
        removed = 0
        for p in root.glob("*.json"):
            p.unlink(missing_ok=True)
            removed += 1
        # only temporaries of writers that are gone: one in flight is left alone
        return removed + sweep_temporaries(root)

