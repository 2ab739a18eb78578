"""What the commands share without torch: progress lines, output-path checks, the default microbatch count."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from rpcompile.core.errors import ConfigError
from rpcompile.core.text import printable

__all__ = ["say", "step", "stepper", "bars", "writable", "directory", "default_microbatches"]


def say(*lines: str) -> None:
    """Print each line on its own, :func:`~rpcompile.core.text.printable`: text from a plan or cache file never
    reaches the terminal as a control or escape sequence."""
    for line in lines:
        print(printable(line))


@contextmanager
def step(args: argparse.Namespace, text: str) -> Iterator[None]:
    """A spinner and the elapsed time on stderr while a step runs: on a terminal only, never under ``--json``."""
    if getattr(args, "json", False) or not sys.stderr.isatty():
        yield
        return
    with Progress(SpinnerColumn(), TextColumn(text), TimeElapsedColumn(), transient=True,
                  console=Console(stderr=True)) as bar:
        bar.add_task(text, total=None)
        yield


def stepper(args: argparse.Namespace) -> Callable[[str], AbstractContextManager[None]]:
    """:func:`step` bound to ``args``, for library calls that take a ``status=`` hook."""
    return lambda text: step(args, text)


def bars(args: argparse.Namespace) -> bool | None:
    """The profiler's own progress bar: off under ``--json``, else on a terminal (``None``)."""
    return False if getattr(args, "json", False) else None


def writable(path: str, flag: str) -> None:
    """Refuse an output path that cannot be written, before any work (a plan takes minutes to make)."""
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file name such as {target / 'plan.json'}")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {parent} does not exist; create it (mkdir -p {parent}) "
                          "or write elsewhere")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable here; pick a path you can write")


def directory(path: str, flag: str) -> None:
    """Make the output directory ``path`` now, before any work, or refuse it in one line."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot create the directory ({e.strerror}); pick a path you can write") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path}: not writable here; pick a path you can write")


def default_microbatches(gpus: int) -> int:
    """:data:`~rpcompile.cli.parser.DEFAULT_MICROBATCHES`, the count ``planning.prepare`` picks when none is given."""
    return gpus + 1 if gpus > 1 else 1
