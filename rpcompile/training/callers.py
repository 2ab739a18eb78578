"""One caller at a time: a pipeline's calls from two threads at once are refused in one line, not run side by side.

A :class:`~rpcompile.training.pipeline.Pipeline` is one set of state that a call uses from its start to its end: the
devices and their threads, the weight copies, the gradient sink, the dropout iteration, the overlapped optimizer
step. Two calls at once from two threads would share all of it: two ``forward_backward`` calls hang (each waits
for microbatches the other's workers took), an ``evaluate`` beside training reads weights and buffers that the
training call is changing and returns a wrong loss. A lock would make them correct, but in an order nobody chose
(which step's weights does the evaluation see?) and with a thread blocked for a whole iteration without a word;
so the pipeline refuses instead. A call — ``forward_backward``, ``evaluate``, ``forward``, ``step``,
``synchronize``, ``refresh_weights``, ``state_dict``, ``load_state_dict`` — made while a call from another
thread runs raises :class:`~rpcompile.core.errors.ConcurrentCallError` at once, naming both calls and threads,
and changes nothing; the running call goes on undisturbed. Calls from several threads one after the other are
fine (a training thread, then an evaluation thread that takes its turn under a lock of its own), and so are calls
nested in one thread (``step`` calls ``synchronize``; ``model.load_state_dict`` synchronizes the pipeline from
its hook, :mod:`rpcompile.training.overlap`).

Two pipelines over one model are two callers: each refuses only its own second caller. Their runs meet in the
model's parameters, so a run of one waits for the other's overlapped optimizer step over them
(:func:`rpcompile.training.overlap.wait_for_steps`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Concatenate, ParamSpec, TypeVar

from ..core.errors import ConcurrentCallError

__all__ = ["OneCaller", "one_call"]

P = ParamSpec("P")
R = TypeVar("R")


class OneCaller:
    """Which thread is inside a pipeline's calls now, and in which call (module docstring)."""

    def __init__(self, what: str = "pipe") -> None:
        self.what = what
        """How the calls are named in the refusal (``pipe.forward_backward``)."""
        self._guard = threading.Lock()  # held for a few instructions, never across a call
        self._owner: threading.Thread | None = None
        self._call = ""
        self._depth = 0

    def enter(self, call: str) -> None:
        """``call`` begins on this thread; refused (one line, nothing changed) while another thread is inside."""
        me = threading.current_thread()
        with self._guard:
            owner = self._owner
            # a thread that ended without leaving its call can never leave it: it holds nothing any more
            if owner is not None and owner is not me and owner.is_alive():
                raise ConcurrentCallError(
                    f"{self.what}.{call}() called from thread {me.name!r} while {self.what}.{self._call}() runs in "
                    f"thread {owner.name!r}: a pipeline runs one call at a time (this one did nothing); make the "
                    "calls one after the other — from one thread, or under a lock of your own")
            # the same thread nests (step calls synchronize): only deeper; a new owner starts from nothing
            if owner is not me:
                self._owner, self._call, self._depth = me, call, 0
            self._depth += 1

    def leave(self) -> None:
        """The innermost call on this thread has ended."""
        with self._guard:
            self._depth -= 1
            if self._depth <= 0:
                self._owner, self._call, self._depth = None, "", 0


def one_call(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """A method that is one of its object's calls (the object's ``callers``, a :class:`OneCaller`): refused while
    another thread is inside one (module docstring)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        callers: OneCaller = self.callers
        callers.enter(name)
        try:
            return method(self, *args, **kwargs)
        finally:
            callers.leave()

    return call
