"""A progress line on stderr while a call captures saved segments (the first call at a new batch shape).

A saved segment is captured the first time a forward stage runs it at a signature no capture covers
(:mod:`rpcompile.runtime.segments.saved`): tens of forward passes' worth of tracing, so the first call of a run, and
the first at a shape the symbolic captures do not cover (one-row batches), take seconds where later ones take
milliseconds. :class:`CaptureProgress` shows that time on stderr — segments captured, time spent and, on the
first call (when every segment will capture once), the time left — and removes the line when the call ends. A
call that captures nothing shows nothing; ``compile(..., progress=False)`` turns it off.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn

__all__ = ["CaptureProgress"]


class CaptureProgress:
    """Context manager around one call over ``segments`` (the program's saved segments, each with an
    ``on_capture`` hook and a ``captures`` dict): the line appears at the first capture, not before."""

    def __init__(self, segments: Sequence[Any], *, show: bool):
        self.segments = list(segments) if show else []
        self.fresh = sum(not s.captures for s in self.segments)  # each of these captures once at its first run
        self.bar: Progress | None = None
        self.lock = threading.Lock()  # the hooks run on the devices' worker threads

    def __enter__(self) -> CaptureProgress:
        for s in self.segments:
            s.on_capture = self._captured
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for s in self.segments:
            s.on_capture = None
        with self.lock:
            if self.bar is not None:
                self.bar.stop()
                self.bar = None

    def _captured(self) -> None:
        with self.lock:
            if self.bar is None:
                self.bar = self._start()
            task = self.bar.tasks[0]
            # more captures than counted (a segment captured again at another shape): the total grows, never overflows
            self.bar.update(task.id, advance=1,
                            total=None if task.total is None else max(task.total, task.completed + 1))

    def _start(self) -> Progress:
        text = "capturing saved segments for this batch shape"
        if self.fresh:  # the first call: a known number of captures, hence a time left
            columns = [SpinnerColumn(), TextColumn(text), MofNCompleteColumn(), TimeElapsedColumn(),
                       TimeRemainingColumn()]
        else:
            columns = [SpinnerColumn(), TextColumn(text), MofNCompleteColumn(), TimeElapsedColumn()]
        bar = Progress(*columns, transient=True, console=Console(stderr=True))
        # a later call's captures cannot be counted ahead: no total, no time left
        bar.add_task("capture", total=self.fresh or None)
        bar.start()
        return bar
