"""Files written whole or not at all, and files read back as bounded data (issue 36).

**Writing** (:func:`write_atomic`, every file rpcompile writes: plans, checkpoints, caches, pictures, stage code):
the bytes go to a *temporary* beside the target, named ``.<name>.<host>.<pid>.<random>.tmp`` and created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` — unpredictable, exclusive, never through a symbolic link planted at its name —
then the file is ``fsync``'d, renamed onto the target (``os.replace``: atomic; a link at the target is replaced,
not followed) and the directory ``fsync``'d, so the target's name only ever holds a whole file.

A process killed while writing leaves its temporary behind. :func:`sweep_temporaries` removes one only when it is
provably dead: made on this host by a process id that no longer exists. Another process's or rank's temporary in
flight — or one from another machine sharing the directory — is never touched.

**Reading** (:func:`read_limited`, :func:`parse_json`): a file is read up to a size bound and parsed as strict JSON
— UTF-8, no ``NaN``/``Infinity``, no number beyond :data:`MAX_INT` or float's range, nesting at most ``max_depth``
deep. Each problem raises :class:`ValueError` with one line saying what is wrong; callers add the file and the fix.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import socket
from pathlib import Path
from typing import IO, Any, Callable, Mapping

__all__ = ["MAX_INT", "host_name", "write_atomic", "temporary_owner", "sweep_temporaries", "read_limited",
           "parse_json", "read_json", "json_depth", "jsonable"]

MAX_INT = 2**63 - 1
"""The largest integer a file may hold (an int64: byte counts, steps); a longer number is refused when parsed."""
_TEMP = re.compile(r"^\..*\.(?P<host>[A-Za-z0-9-]{1,64})\.(?P<pid>\d{1,10})\.[0-9a-f]{16}\.tmp$")


def host_name() -> str:
    """This machine's name as it appears in temporary names (letters, digits and ``-`` only)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create_temporary(path: Path) -> tuple[int, Path]:
    """An exclusive, unpredictable temporary beside ``path`` (never a link): its descriptor and name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    stem = f".{path.name[:100]}.{host_name()}.{os.getpid()}"
    for _ in range(100):
        tmp = path.with_name(f"{stem}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def write_atomic(path: str | os.PathLike, data: bytes | str | Callable[[IO[bytes]], Any]) -> Path:
    """Write ``data`` (bytes, text as UTF-8, or a function that writes into the open binary file) to ``path``
    atomically and durably (module docstring); returns the path. The temporary is removed on any failure; dead
    processes' temporaries for ``path`` are swept after."""
    path = Path(path)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    sweep_temporaries(path.parent, target=path.name)
    return path


def temporary_owner(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of the process that made the temporary called ``name``, or None if it is not one."""
    m = _TEMP.match(name)
    return (m["host"], int(m["pid"])) if m else None


def _dead(host: str, pid: int) -> bool:
    """Whether process ``pid`` on ``host`` is provably gone: on this host, and no such process exists."""
    if host != host_name() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's process, say): alive
        return False
    return False


def sweep_temporaries(directory: str | os.PathLike, *, target: str = "") -> int:
    """Remove the temporaries in ``directory`` left by dead processes (module docstring), only those for files
    named ``target`` when given; the number removed. Never raises for a file it cannot remove."""
    root = Path(directory)
    removed = 0
    try:
        names = [p.name for p in root.iterdir()]
    except OSError:
        return 0
    for name in names:
        owner = temporary_owner(name)
        if owner is None or (target and not name.startswith(f".{target[:100]}.")) or not _dead(*owner):
            continue
        try:
            (root / name).unlink()
            removed += 1
        except OSError:
            pass
    return removed


def read_limited(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of ``path``, refused (ValueError) when it holds more than ``limit``; OSError if unreadable."""
    with open(path, "rb") as f:
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
        value = json.loads(text, parse_constant=no_constant, parse_int=_parse_int, parse_float=_parse_float)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON at line {e.lineno} column {e.colno} ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    except ValueError as e:
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
