"""Ctrl-C that never leaves training half done: it is a ``KeyboardInterrupt`` within a bounded time, and the weights
are either stepped or not.

Python raises ``KeyboardInterrupt`` on the main thread between any two of its instructions. Two stretches of a
training loop must not be cut there:

rpcompile's own bookkeeping
    Starting or collecting an overlapped step, a synchronous ``pipe.step``, a training call's threads being
    started and settled, held gradients going into ``.grad``: run inside :class:`deferred`, which holds the
    ``KeyboardInterrupt`` back until the block ends.
an overlapped step on its own thread
    Which a Ctrl-C does not stop (:mod:`rpcompile.training.overlap`): :func:`finish_first` makes a Ctrl-C wait for
    it to end before it is raised, wherever the main thread is.

A second Ctrl-C while the first is held back or waits is raised at once, as the executor's is
(:mod:`rpcompile.runtime.executor`): the way out of a step that hangs.
"""

from __future__ import annotations

import signal
import threading
import weakref
from concurrent.futures import Future, wait
from types import FrameType, TracebackType
from typing import Any, Callable

__all__ = ["deferred", "finish_first", "finished"]


class _Guard:
    """The process's one SIGINT handler of rpcompile's and what it holds back.

    **How.** While either is in use, a handler of rpcompile's takes SIGINT's place — on the main thread only (Python
    runs signal handlers there, and only there can they be set) and only over a handler set from Python (the default one
    raises ``KeyboardInterrupt``; ``SIG_IGN`` and ``SIG_DFL`` are left alone). It hands every Ctrl-C on to the handler
    it replaced — at once inside a :class:`deferred` block, holding back what that raises; after the steps in flight
    outside one — so a handler of the user's still decides what a Ctrl-C does, and gives SIGINT back to it as soon as
    nothing needs it any more (unless the user has set another one meanwhile).
    """

    def __init__(self) -> None:
        self.previous: Any = None
        """The handler replaced (while ``installed``), to which every Ctrl-C is handed on."""
        self.installed = False
        self.depth = 0
        """:class:`deferred` blocks open on the main thread."""
        self.stops: list[Callable[[], None]] = []
        """What the open blocks asked to be told of a Ctrl-C (:class:`deferred`'s ``stop``)."""
        self.pending: BaseException | None = None
        """What the replaced handler raised for a Ctrl-C inside a block, held until the outermost block ends."""
        self.steps: "weakref.WeakSet[Future[Any]]" = weakref.WeakSet()
        """Overlapped steps in flight that a Ctrl-C waits for (:func:`finish_first`)."""
        self.waiting = False
        self.handler = self._handle  # one bound method: SIGINT's handler is compared with it

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.waiting or self.pending is not None:  # a second Ctrl-C: at once
            self.pending = None
            _hand_on(self.previous, signum, frame)
            return
        # outside every block nothing is held back, but an overlapped step still writing the masters ends first
        if not self.depth:
            self.waiting = True
            try:
                wait(list(self.steps))
            finally:
                self.waiting = False
            _hand_on(self.previous, signum, frame)
            return
        try:  # the replaced handler decides what a Ctrl-C is, now; what it raises waits for the block's end
            _hand_on(self.previous, signum, frame)
        except BaseException as e:  # noqa: BLE001 - raised when the outermost block ends
            self.pending = e
            # from the signal handler: each stop only sets a flag (no lock may be taken here)
            for stop in self.stops:
                stop()

    def raise_pending(self, pending: BaseException) -> None:
        """The held interrupt, raised once the steps in flight have ended."""
        self.waiting = True
        try:
            wait(list(self.steps))
        finally:
            self.waiting = False
        raise pending

    def install(self) -> None:
        """Take SIGINT's place, if this is the main thread and its handler was set from Python."""
        # Python sets signal handlers on the main thread only (signal.signal raises elsewhere)
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGINT)
        # SIG_IGN and SIG_DFL are not callable, nor is None (a handler set from C): those stay as they are
        if callable(current) and current != self.handler:
            self.previous = current
            signal.signal(signal.SIGINT, self.handler)
            self.installed = True

    def release(self) -> None:
        """Give SIGINT back once nothing needs the handler (and it is still SIGINT's)."""
        if not self.installed or self.depth or len(self.steps) \
                or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) == self.handler:
            signal.signal(signal.SIGINT, self.previous)
        self.installed, self.previous = False, None


def _hand_on(previous: Any, signum: int, frame: FrameType | None) -> None:
    """A Ctrl-C to the handler rpcompile's replaced (``KeyboardInterrupt`` when there is none to hand it to)."""
    if callable(previous):
        previous(signum, frame)
    else:
        raise KeyboardInterrupt


_GUARD = _Guard()


class deferred:
    """``with deferred(): ...`` — the handler a Ctrl-C inside would have run runs at once, but what it raises
    (``KeyboardInterrupt``) is raised when the block ends; on a thread other than the main one,
    where no Ctrl-C arrives, it does nothing. Blocks nest: the outermost one raises. ``stop`` (called from the
    signal handler: it must take no lock — set a flag) is told of a Ctrl-C the block holds, so that work the block
    runs can stop early (a training call's workers); a block that ends with a ``KeyboardInterrupt`` of its own
    (that work stopped) raises nothing more.

    Such blocks are rpcompile's bookkeeping: an overlapped step being started or collected, a synchronous
    ``pipe.step`` (the optimizer's ``step()``, ``zero_grad()``, the schedulers), a training call's threads being
    started, stopped and settled, the held gradients going into ``.grad``. Cut in the middle, the pipeline is left
    half switched (double buffers begun for some weights, ``zero_grad`` shadowed for good, a worker left running
    into the next call) or the masters half stepped."""

    def __init__(self, stop: Callable[[], None] | None = None) -> None:
        self._stop = stop

    def __enter__(self) -> None:
        self._main = threading.current_thread() is threading.main_thread()
        if self._main:
            _GUARD.install()  # first: until depth counts this block, a Ctrl-C is handed on at once
            if self._stop is not None:
                _GUARD.stops.append(self._stop)
            _GUARD.depth += 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._main:
            return
        _GUARD.depth -= 1
        if self._stop is not None:
            _GUARD.stops.remove(self._stop)
        # an inner block: the outermost one raises what is pending
        if _GUARD.depth:
            return
        pending = _GUARD.pending
        _GUARD.pending = None
        # SIGINT handed back before raising, unless an overlapped step in flight still needs the handler
        _GUARD.release()
        if pending is not None and not isinstance(error, KeyboardInterrupt):  # (a step started here waits too)
            _GUARD.raise_pending(pending)


def finish_first(step: Future[Any]) -> None:
    """An overlapped step is in flight: until :func:`finished`, a Ctrl-C waits for it to end first. Raised at once,
    the interrupt would reach the loop's ``except`` or ``finally`` — where a checkpoint is saved — while the step is
    still writing the masters; a step is bounded, so the wait is too, and the interrupt is then raised wherever the
    main thread is: in rpcompile or in the loop's own code."""
    _GUARD.steps.add(step)
    _GUARD.install()


def finished(step: Future[Any]) -> None:
    """The step has been collected: a Ctrl-C no longer waits for it."""
    _GUARD.steps.discard(step)
    _GUARD.release()
