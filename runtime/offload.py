"""Lazy offload: a forward stage's saved activations go down to host memory behind the compute, not in its way.

Terms:

- **offloader** (:class:`Offloader`): one device's copies to host memory, on a thread of their own, one submission
  at a time — for saved activations the ones needed first first, for a GPU's hand-offs first in first out.
- **backlog**: what was submitted and has not gone down yet; it stays in device memory, bounded by
  ``budget_bytes`` (:meth:`Offloader.wait_within_budget`).
- **landing** (:class:`Landing`): stands for the host copy until it exists; the backward stage's worker calls
  ``wait()`` before it uploads the tensors.

The planner models the same policy (:func:`rpcompile.passes.solver.timing.offload_backlog`), and so does the
simulator; :class:`Offloader`'s docstring gives the rules.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from typing import Any, Callable, Sequence

import torch

from rpcompile.core.errors import ConfigError

from .activity import span

__all__ = ["Landing", "Offloader"]


class Landing:
    """The host copy of one submission, once it has landed."""

    def __init__(self, *, what: str = "saved activations"):
        self._value: Any = None
        self._error: BaseException | None = None
        self._what = what
        self._event = threading.Event()

    def wait(self, timeout: float | None = None) -> Any:
        """The host value (blocks until it has gone down; re-raises the copy's error)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self._what} did not reach host memory in time")
        if self._error is not None:
            raise RuntimeError(f"copying {self._what} to host memory failed: {self._error}") from self._error
        return self._value

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()


class Offloader:
    """One device's saved-activation copies, on a thread of their own (the module docstring's terms).

    ``copy(tensors, ready)`` runs on the offloader's thread and returns host copies of ``tensors``; ``ready`` is
    what the submitter passed (a CUDA event recorded after the tensors were computed, which the copy stream waits
    for). ``wrap(host_tensors)`` builds the value a :class:`Landing` resolves to.

    Nobody in the forward pass waits for saved activations — only a backward stage, much later — so a forward stage
    hands them to its device's :class:`Offloader` and goes on with the next microbatch. The offloader copies them out on
    its own thread, one submission at a time, **the ones needed first first**: the backward pass runs the chain in
    reverse, so the latest stage's saves, then microbatches in order (the priority the executor gives). What has not
    gone down yet stays in device memory, so the backlog is bounded: a submission that would take it past
    ``budget_bytes`` waits until enough has gone down, and the device starts its next stage only once the backlog is
    within the budget again (:meth:`Offloader.wait_within_budget`): the planner gives the memory the device's stages
    leave free, :func:`rpcompile.passes.solver.timing.offload_backlog`, which models the same policy; so does the
    simulator.

    The same machinery sends a GPU's **hand-offs** down (a stage's outputs, a backward stage's input gradients) on a
    second offloader, first in first out, at most two microbatches' worth pending (double buffering, as the simulator's
    ``OUTPUT_BUFFERS``): the worker queues the next microbatch's kernels while the copy runs, and the next stage's
    worker waits on the landing instead of the producing worker waiting on the copy.

    A copy that fails makes every later ``wait()`` and ``submit()`` raise instead of hanging the pipeline, until
    :meth:`Offloader.settle` (the executor's, after a failed call) clears it for the next call; so does a submission
    still queued when the offloader is closed or settled.
    """

    def __init__(self, copy: Callable[[Sequence[torch.Tensor], Any], Sequence[torch.Tensor]], *,
                 budget_bytes: float = math.inf, max_pending: int | None = None, name: str = "offload",
                 what: str = "saved activations"):
        if budget_bytes < 0:
            raise ConfigError(f"budget_bytes={budget_bytes} must be >= 0")
        if max_pending is not None and max_pending < 1:
            raise ConfigError(f"max_pending={max_pending} must be >= 1")
        self.copy, self.budget_bytes, self.max_pending, self.what = copy, float(budget_bytes), max_pending, what
        self.pending_bytes = 0.0
        self.pending = 0
        self.peak_pending_bytes = 0.0
        self._heap: list[tuple[Any, int, Any]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self.name = name
        self._thread = self._start()

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        thread.start()
        return thread

    def submit(self, tensors: Sequence[torch.Tensor], *, priority: Any, ready: Any = None,
               wrap: Callable[[tuple[torch.Tensor, ...]], Any] = tuple) -> Landing:
        """Queue ``tensors`` to go down (smaller ``priority`` first). Blocks while the backlog, with them, would
        exceed the budget (bytes, or ``max_pending`` submissions) and something is still going down (one
        submission larger than the budget still goes)."""
        nbytes = float(sum(t.numel() * t.element_size() for t in tensors))
        landing = Landing(what=self.what)
        with self._cv:
            # with nothing pending a submission goes whatever its size: waiting for room could never end; a failed
            # copy or a close ends the wait too (_raise below says which)
            while (self.pending and (self.pending_bytes + nbytes > self.budget_bytes
                                     or (self.max_pending is not None and self.pending >= self.max_pending))
                   and self._error is None and not self._closed):
                self._cv.wait()
            self._raise()
            self.pending += 1
            self.pending_bytes += nbytes
            self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
            # the sequence number orders equal priorities by submission and keeps heapq from comparing the payloads
            heapq.heappush(self._heap, (priority, next(self._seq), (tuple(tensors), ready, wrap, landing, nbytes)))
            self._cv.notify_all()
        return landing

    def wait_within_budget(self) -> None:
        """Block until the backlog is back within the budget: a device starting its next stage. Only the stage that
        saved them may hold more (the planner counts its previous microbatch's saves beside it, double buffering);
        the next stage's memory leaves only the budget for them (:func:`rpcompile.passes.solver.timing.offload_backlog`:
        a forward stage whose saves do not fit takes as long as its link needs to bring the backlog back)."""
        with self._cv:
            while self.pending_bytes > self.budget_bytes and self._error is None and not self._closed:
                self._cv.wait()
            self._raise()

    def drain(self) -> None:
        """Wait until everything submitted has gone down (end of an iteration)."""
        with self._cv:
            while (self._heap or self.pending) and self._error is None:
                self._cv.wait()
            self._raise()

    def close(self) -> None:
        """Stop the thread once the copy under way is done; what is still queued fails its waiters."""
        with self._cv:
            self._closed = True
            dropped = self._drop_queued()
            self._cv.notify_all()
        for landing in dropped:
            landing._finish(error=RuntimeError("the offloader was closed"))

    def settle(self) -> None:
        """After a failed call: drop what is still queued, wait for the copy under way, and clear a copy's error
        (restarting the thread it ended), so the next call starts with nothing pending."""
        with self._cv:
            dropped = self._drop_queued()
            # not after a copy's error: the thread that failed has ended and will count nothing down
            while self.pending and self._error is None:
                self._cv.wait()
            failed, self._error = self._error is not None, None
            if failed:  # the failed copy's submission was never counted down
                self.pending, self.pending_bytes = 0, 0.0
            self._cv.notify_all()
        for landing in dropped:
            landing._finish(error=RuntimeError("the call failed before this copy was made"))
        if failed and not self._closed:
            # _run returned after the failed copy: a fresh thread for the next call
            self._thread.join()
            self._thread = self._start()

    def _drop_queued(self) -> list[Landing]:
        """Under the lock: the queued (not started) submissions, removed and counted down."""
        dropped = [item[2][3] for item in self._heap]
        for item in self._heap:
            self.pending -= 1
            self.pending_bytes -= item[2][4]
        self._heap.clear()
        return dropped

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"copying {self.what} to host memory failed: {self._error}") from self._error
        if self._closed:
            raise RuntimeError("the offloader is closed")

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed:  # close() dropped and failed what was queued
                    return
                # taken under the lock, copied outside it: submitters and waiters are not held up by the copy
                _, _, (tensors, ready, wrap, landing, nbytes) = heapq.heappop(self._heap)
            try:
                with span("copy out", self.what):
                    value = wrap(tuple(self.copy(tensors, ready)))
            except BaseException as e:  # noqa: BLE001 - handed to every waiter
                with self._cv:
                    self._error = e
                    # this thread ends here, so nothing queued would ever be copied: fail its waiters now
                    failed = [item[2][3] for item in self._heap] + [landing]
                    self._heap.clear()
                    self._cv.notify_all()
                for lnd in failed:
                    lnd._finish(error=e)
                return
            del tensors  # the device memory may be reused once the copy is done
            landing._finish(value)
            with self._cv:
                self.pending -= 1
                self.pending_bytes -= nbytes
                self._cv.notify_all()
