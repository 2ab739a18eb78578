"""Work that runs in a forked child process while the caller goes on (the LM-head splits' solves).

Terms:

- **background work** (:func:`later`, :class:`Later`): a function run in a child process — forked, so the child
  inherits its inputs and nothing is pickled on the way in — while the caller goes on; only the result crosses
  back, pickled through a pipe. :meth:`Later.result` collects it.
- **in the caller**: the fallback — the same work run at :meth:`Later.result`, with the same answer (the work must
  not depend on where it runs: every phase of a solve is bounded by counts, not by the clock), used whenever the
  child fails or forking is not safe here (:func:`enabled`).
- **pays**: work goes to a child only when it is expected to take :data:`FORK_PAYS` times what the fork costs
  (:func:`fork_cost_s`); the solves decide so in :func:`rpcompile.passes.solve_cache.solve_apart`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from rpcompile.core.errors import RPCompileError

__all__ = ["later", "Later", "enabled", "fork_cost_s", "FORK_PAYS", "ENV"]

#: What the work returns.
T = TypeVar("T")
log = logging.getLogger("rpcompile")

ENV = "RPCOMPILE_BACKGROUND"
"""Set to ``off`` (or ``0``) to run every piece of background work in the caller."""


def enabled() -> bool:
    """Whether :func:`later` forks here.

    The child must not touch CUDA nor run torch kernels (a fork inherits neither a usable CUDA context nor OpenMP's
    threads); a solve uses neither. Work runs in the caller, at :meth:`Later.result`, where a fork does not pay or is
    not safe: one usable CPU, no ``fork`` start method or not Linux (macOS's frameworks are not fork-safe), or
    ``RPCOMPILE_BACKGROUND=off``.
    """
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return False
    if not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return False
    # the CPUs this process may run on, not the machine's: on one, child and caller would only take turns
    return len(os.sched_getaffinity(0)) > 1


#: A fork and a result's way back in a process of little memory (measured: 10–17 ms) ...
FORK_S = 0.012
#: ... and per MiB of the page tables a fork copies (``VmPTE``; measured: 0.08 s at 4.8 MiB, 0.28 s at 16.8 MiB:
#: 2 GiB and 8 GiB of tensors in 4 KiB pages).
FORK_S_PER_PAGE_TABLE_MIB = 0.016
#: A piece of work goes to a child only when it is expected to take this many times what the fork costs.
FORK_PAYS = 3.0


def fork_cost_s() -> float:
    """What forking this process and getting a result back costs, predicted from the size of its page tables."""
    try:
        with open("/proc/self/status") as f:
            # "VmPTE:   4920 kB": the page tables' size in KiB
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmPTE:"))
    except (OSError, ValueError, IndexError, StopIteration):
        kib = 0
    return FORK_S + FORK_S_PER_PAGE_TABLE_MIB * kib / 1024


class Later(Generic[T]):
    """``fn()``, started in a child process (or not: :func:`enabled`); :meth:`result` returns what it returned.

    The answer never depends on where the work ran: every phase of a solve is bounded by counts, not by the clock. So
    anything that goes wrong with the child makes :meth:`Later.result` run the work in the caller instead (the same
    answer, only later): the child dies, its result cannot be pickled, it is silent past ``timeout_s``, or the work
    fails there with anything but one of rpcompile's own errors (a fork may be the cause: CUDA cannot be used in a
    forked child). An :class:`~rpcompile.core.errors.RPCompileError` the work raises in the child (a plan that does not
    fit) is raised by :meth:`Later.result`, as if the work had run in the caller.
    """

    def __init__(self, fn: Callable[[], T], *, background: bool = True, timeout_s: float = 120.0):
        self._fn, self._timeout_s = fn, timeout_s
        self._child: Any = None
        self._done: tuple[bool, Any] | None = None
        if background and enabled():
            self._start()

    @property
    def forked(self) -> bool:
        """Whether the work runs (or ran) in a child process."""
        return self._child is not None

    def _start(self) -> None:
        # fork whatever the default start method: the child must inherit fn and its inputs, unpickled
        ctx = multiprocessing.get_context("fork")
        try:
            receive, send = ctx.Pipe(duplex=False)
            # daemon: a child still solving when the caller exits dies with it
            child = ctx.Process(target=_run_child, args=(self._fn, send), daemon=True, name="rpcompile-later")
            with warnings.catch_warnings():  # Python 3.12+ warns of forking with threads: the child takes no locks
                warnings.simplefilter("ignore", DeprecationWarning)
                child.start()
        except OSError as exc:  # no memory to fork, too many processes: the caller does it
            log.debug("background work runs in the caller: %s", exc)
            return
        # the caller's copy of the sending end: while it stays open, a dead child's pipe never raises EOFError
        send.close()
        self._child = (child, receive)
        self._finalizer = weakref.finalize(self, _stop, child, receive)  # never collected: the child is stopped

    def result(self) -> T:
        """What ``fn()`` returned (its exception raised here); waits for the child, or runs ``fn`` now."""
        if self._done is None:
            self._done = self._collect()
        ok, value = self._done
        if ok:
            return value
        raise value

    def _collect(self) -> tuple[bool, Any]:
        got = None
        if self._child is not None:
            child, receive = self._child
            try:
                if receive.poll(self._timeout_s):
                    got = receive.recv()
                else:
                    log.warning("background work was silent for %.3g s; running it here instead", self._timeout_s)
            except (EOFError, OSError) as exc:  # the child died before it answered
                log.debug("background work's child died (%s); running it here", exc)
            finally:
                # the answer is in (or given up on): stop and reap the child now; a finalizer runs only once
                self._finalizer()
        if got is not None and got[0] is False and not isinstance(got[1], RPCompileError):
            # not one of rpcompile's refusals: it may come from being in a fork (CUDA cannot be used in a forked
            # child), so the caller does the work; a real error is raised again here
            log.debug("background work failed in its child (%s: %s); running it here", type(got[1]).__name__, got[1])
            got = None
        if got is None or got[0] is None:  # not forked, or no usable answer: the same work, here
            try:
                return True, self._fn()
            except Exception as exc:
                return False, exc
        return got


def later(fn: Callable[[], T], *, background: bool = True, timeout_s: float = 120.0) -> Later[T]:
    """``fn()`` in a forked child (``background`` and :func:`enabled`), else in the caller when its result is asked
    for; the child is given up and the work done in the caller after ``timeout_s`` without an answer."""
    return Later(fn, background=background, timeout_s=timeout_s)


def _run_child(fn: Callable[[], Any], send: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the caller, which stops the child: no traceback here
    try:
        answer: tuple[bool | None, Any] = (True, fn())
    except BaseException as exc:  # SystemExit too: the caller raises it, as if the work had run there
        answer = (False, exc)
    try:
        send.send(answer)
    except Exception:  # the result or the exception does not pickle: the caller runs it itself
        send.send((None, None))
    finally:
        send.close()


def _stop(child: Any, receive: Any) -> None:
    receive.close()
    child.join(timeout=1)  # it answered and is exiting; or it is hung, or given up on
    if child.is_alive():
        child.kill()
        child.join(timeout=5)
