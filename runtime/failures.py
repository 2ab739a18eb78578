"""What a failed call raises: :class:`PipelineError`, and the helpers that stop a call and drop its frames (its one
line: :func:`rpcompile.core.errors.one_line`).

The executor (:mod:`.executor`, its module docstring's **Failures**) stops a call at the first exception on any of
its threads and raises one :class:`PipelineError` naming the stage, device and microbatch, or the
``KeyboardInterrupt`` of a Ctrl-C itself (:func:`first_failure`).
"""

from __future__ import annotations

from typing import Sequence

from rpcompile.core.errors import RPCompileError

__all__ = ["PipelineError", "Stopped", "first_failure", "without_frames"]


class PipelineError(RPCompileError, RuntimeError):
    """A stage failed on a worker: one line naming the stage, action, device and microbatch, and the failure; the
    original exception is the ``__cause__`` (without its frames, which held the stage's tensors)."""

    details: str = ""
    """The worker's traceback (the message is one line)."""
    stage: str | None = None
    """The stage's name (``F1``, ``FB``, ``B2``); None for the host's lookups or an overlapped optimizer step."""
    device: int | None = None
    """The index of the device whose worker failed."""
    microbatch: int | None = None
    """The microbatch it was computing; None for a weight upload or a gradient download."""


class Stopped(Exception):
    """The host thread stopped early: another thread of the call failed first."""


def first_failure(failed: Sequence[BaseException]) -> BaseException:
    """What the caller sees: a Ctrl-C itself, else the first failure (later ones are its consequences)."""
    return next((e for e in failed if isinstance(e, KeyboardInterrupt)), failed[0])


def without_frames(e: BaseException) -> BaseException:
    """``e`` and the exceptions chained to it without their tracebacks: their frames hold the stage's inputs and
    activations (device memory an out-of-memory retry needs back); the text is on ``.details``."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:  # a chain may loop back on itself
        seen.add(id(cur))
        cur.__traceback__ = None
        cur = cur.__cause__ or cur.__context__
    return e
