"""Files written whole or not at all, and files read back as bounded data.

temporary
    A file or directory beside its target, named ``.<name>.<host>.<pid>.<random>.tmp`` and created exclusively
    (never through a planted link), filled, ``fsync``'d and renamed onto the target, so the target's name only ever
    holds a whole file or directory: :func:`write_atomic` (every file rpcompile writes), :func:`atomic_directory`
    (a checkpoint). A killed writer's temporary is removed only once its writer is provably dead
    (:func:`sweep_temporaries`).
bounded data
    :func:`read_limited` and :func:`parse_json`: a file read up to a size bound and parsed as strict JSON — UTF-8,
    no ``NaN``/``Infinity``, no number beyond :data:`MAX_INT` or float's range, nesting at most ``max_depth`` deep.
    Each problem raises :class:`ValueError` with one line saying what is wrong; callers add the file and the fix.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import socket
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Mapping, cast

__all__ = ["MAX_INT", "host_name", "write_atomic", "write_atomic_hashed", "atomic_directory", "fsync_tree", "temporary_owner",
           "sweep_temporaries", "remove_tree", "remove_atomically", "read_limited", "parse_json", "read_json", "json_depth", "jsonable"]

MAX_INT = 2**63 - 1
"""The largest integer a file may hold (an int64: byte counts, steps); a longer number is refused when parsed."""
_TEMP = re.compile(r"^\..*\.(?P<host>[A-Za-z0-9-]{1,64})\.(?P<pid>\d{1,10})\.[0-9a-f]{16}\.tmp$")


def host_name() -> str:
    """This machine's name as it appears in temporary names (letters, digits and ``-`` only)."""
    # at most 64 characters, as the temporary-name pattern (_TEMP) expects; "host" when nothing is left
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    # some filesystems refuse fsync on a directory: the rename stands, only its durability is best effort
    except OSError:
        pass
    finally:
        os.close(fd)


def _temporary_name(path: Path) -> Path:
    """An unpredictable temporary name beside ``path`` that says who made it (module docstring)."""
    # the target's name cut to 100 characters keeps the temporary's
    # name within filesystem limits (sweeps match the same cut)
    return path.with_name(f".{path.name[:100]}.{host_name()}.{os.getpid()}.{secrets.token_hex(8)}.tmp")


def _create_temporary(path: Path) -> tuple[int, Path]:
    """An exclusive, unpredictable temporary beside ``path`` (never a link): its descriptor and name."""
    # O_NOFOLLOW and O_CLOEXEC where the OS has them; the mode is left to the umask
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    # a clash of 64 random bits is all but impossible: a bounded retry, then give up
    for _ in range(100):
        tmp = _temporary_name(path)
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def _create_temporary_directory(path: Path) -> Path:
    """An exclusive, unpredictable temporary directory beside ``path`` (``mkdir`` refuses any name that exists,
    a planted link included)."""
    for _ in range(100):
        tmp = _temporary_name(path)
        try:
            os.mkdir(tmp, 0o777)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def fsync_tree(directory: str | os.PathLike) -> None:
    """``fsync`` every regular file directly in ``directory`` (links are not followed), then the directory."""
    root = Path(directory)
    for entry in os.scandir(root):
        if entry.is_file(follow_symlinks=False):
            # O_NOFOLLOW: a link swapped in after the scan is not followed
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_directory(root)


def remove_tree(path: str | os.PathLike) -> None:
    """Remove the file or directory ``path`` (a link itself, never what it points to); nothing if it is gone."""
    path = Path(path)
    try:
        # lstat: a link is removed itself, never followed
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)  # rmtree never follows a link inside
    else:
        path.unlink(missing_ok=True)


def remove_atomically(path: str | os.PathLike) -> None:
    """Remove the file or directory ``path``: renamed to a temporary name first (atomic), then removed, so a
    process killed midway leaves a temporary that a later sweep removes, never half a directory under its name."""
    path = Path(path)
    aside = _temporary_name(path)
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    remove_tree(aside)


@contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary directory beside ``path`` to fill; when the block ends without an exception every file in it
    and the directory are ``fsync``'d and it is renamed onto ``path`` (an existing ``path`` is renamed aside
    first and removed after), then the parent is ``fsync``'d. On an exception the temporary is removed and
    ``path`` left as it was.

    A **directory** of files written as one (:func:`atomic_directory`: a checkpoint) is built the same way: a temporary
    directory of the same unpredictable name, made by ``mkdir`` (exclusive: a link or anything else planted at its name
    is refused and another name drawn), filled (each file through :func:`write_atomic`, or by any writer — a name inside
    a directory nobody else knows yet), every file and the directory ``fsync``'d, then renamed onto the target. A
    directory cannot be renamed onto a non-empty one: an existing target is first renamed aside to a temporary name and
    removed after, so the target's name holds the old directory, nothing (for that instant: a reader takes the previous
    one), or the new one — never a mixture.
    """
    path = Path(path)
    tmp = _create_temporary_directory(path)
    try:
        yield tmp
        fsync_tree(tmp)
        _rename_directory(tmp, path)
    except BaseException:
        remove_tree(tmp)
        raise
    _fsync_directory(path.parent)


def _rename_directory(tmp: Path, path: Path) -> None:
    """Rename the directory ``tmp`` onto ``path``; whatever is at ``path`` (a directory, a file, a link — renamed,
    never followed) is first renamed aside to a temporary name, and removed once ``tmp`` is in place (put back if
    the rename fails)."""
    asides: list[Path] = []
    for _ in range(100):
        try:
            os.replace(tmp, path)  # onto nothing or an empty directory
            break
        except OSError as e:
            # these say something is at path: move it aside and try again; anything else is a real failure
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                # put the old one back only when nothing has taken its name meanwhile
                if asides and not os.path.lexists(path):
                    os.rename(asides.pop(), path)  # the previous one back in place
                raise
        aside = _temporary_name(path)
        try:
            os.rename(path, aside)
            asides.append(aside)
        except FileNotFoundError:  # another writer moved it first: try again
            pass
    else:
        raise FileExistsError(f"{path} kept reappearing while this writer renamed its own into place")
    for aside in asides:
        remove_tree(aside)


def write_atomic(path: str | os.PathLike, data: bytes | str | Callable[[IO[bytes]], Any]) -> Path:
    """Write ``data`` (bytes, text as UTF-8, or a function that writes into the open binary file) to ``path``
    atomically and durably; returns the path. The temporary is removed on any failure; dead processes'
    temporaries for ``path`` are swept after.

    The bytes go to a *temporary* beside the target, named ``.<name>.<host>.<pid>.<random>.tmp`` and created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` — unpredictable, exclusive, never through a symbolic link planted at its name —
    then the file is ``fsync``'d, renamed onto the target (``os.replace``: atomic; a link at the target is replaced, not
    followed) and the directory ``fsync``'d, so the target's name only ever holds a whole file.
    """
    path = Path(path)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            # the data on disk before the rename, or a crash could leave the name on an empty file
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # the rename itself made durable
    _fsync_directory(path.parent)
    sweep_temporaries(path.parent, target=path.name)
    return path


class _Hashing:
    """A write-only binary file that hashes (sha256) and counts what goes through it to ``f``."""

    def __init__(self, f: IO[bytes]):
        self.f, self.sha, self.length = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.sha.update(data)
        # memoryview: a buffer (an array, a memoryview) may not count its len in bytes
        self.length += len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_atomic_hashed(path: str | os.PathLike, data: bytes | str | Callable[[IO[bytes]], Any]) -> tuple[int, str]:
    """:func:`write_atomic`, returning the bytes written and their sha256 (hex), hashed on the way (a function
    given as ``data`` writes into a file object that hashes)."""
    out: list[tuple[int, str]] = []

    def fill(f: IO[bytes]) -> None:
        hashing = _Hashing(f)
        if callable(data):
            data(cast(IO[bytes], hashing))
        else:
            hashing.write(data.encode("utf-8") if isinstance(data, str) else data)
        out.append((hashing.length, hashing.sha.hexdigest()))

    write_atomic(path, fill)
    return out[0]


def temporary_owner(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of the process that made the temporary called ``name``, or None if it is not one."""
    m = _TEMP.match(name)
    return (m["host"], int(m["pid"])) if m else None


def _dead(host: str, pid: int) -> bool:
    """Whether process ``pid`` on ``host`` is provably gone: on this host, and no such process exists."""
    # a pid on another host says nothing about this host's processes
    if host != host_name() or pid <= 0:
        return False
    try:
        # signal 0 sends nothing: it only asks whether the process exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's process, say): alive
        return False
    return False


def sweep_temporaries(directory: str | os.PathLike, *, target: str = "") -> int:
    """Remove the temporaries (files and directories) in ``directory`` left by dead processes, only those for
    files named ``target`` when given; the number removed. Never raises for one it cannot remove.

    A process killed while writing leaves its temporary (file or directory) behind. :func:`sweep_temporaries` removes
    one only when its writer is provably dead: made on this host by a process id that no longer exists. Another
    process's or rank's temporary in flight — or one from another machine sharing the directory — is never touched.
    """
    root = Path(directory)
    removed = 0
    try:
        names = [p.name for p in root.iterdir()]
    except OSError:
        return 0
    for name in names:
        owner = temporary_owner(name)
        # temporaries carry the target's name cut to 100 characters (_temporary_name)
        if owner is None or (target and not name.startswith(f".{target[:100]}.")) or not _dead(*owner):
            continue
        try:
            # a link named like a temporary is unlinked, never followed into
            if os.path.isdir(root / name) and not os.path.islink(root / name):
                shutil.rmtree(root / name)
            else:
                (root / name).unlink()
            removed += 1
        except OSError:
            pass
    return removed


def read_limited(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of ``path``, refused (ValueError) when it holds more than ``limit``; OSError if unreadable."""
    with open(path, "rb") as f:
        # one byte over the limit tells a file that is too large from one at the limit, without reading it all
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"larger than {limit:,} bytes, more than such a file holds")
    return raw


def _parse_int(text: str) -> int:
    value = int(text) if len(text) <= 20 else MAX_INT + 1  # int() of a very long digit string is slow or refused
    if abs(value) > MAX_INT:
        raise ValueError(f"the number {text[:24]}{'…' if len(text) > 24 else ''} is out of range (beyond 2**63)")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:24]}{'…' if len(text) > 24 else ''} is out of range (beyond a float)")
    return value


def parse_json(raw: bytes, *, max_depth: int, what: str = "such a file") -> Any:
    """``raw`` as strict JSON (module docstring), or ValueError with one line naming the problem (``what``: the
    kind of file, for the message about ``NaN``)."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number {what} holds")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"byte {e.start} is not UTF-8 text (0x{raw[e.start]:02x})") from None
    try:
        # NaN and Infinity refused; huge or infinite numbers refused as they are parsed
        value = json.loads(text, parse_constant=no_constant, parse_int=_parse_int, parse_float=_parse_float)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON at line {e.lineno} column {e.colno} ({e.msg})") from None
    # the decoder recurses, so very deep input can overflow before json_depth runs
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    except ValueError as e:
        # a refusal from parse_int, parse_float or no_constant: one bounded line
        raise ValueError(" ".join(str(e).split())[:160]) from None
    if json_depth(value) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return value


def read_json(path: str | os.PathLike, *, max_bytes: int, max_depth: int, what: str = "such a file") -> Any:
    """:func:`parse_json` of :func:`read_limited`: OSError when unreadable (FileNotFoundError when missing),
    ValueError (one line) when too large or not strict JSON."""
    return parse_json(read_limited(path, max_bytes), max_depth=max_depth, what=what)


def json_depth(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, (list, tuple)):
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((x, depth + 1) for x in v)
    return deepest


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON holds it: mappings with string keys, lists, finite numbers (others become null),
    other objects as their text."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
