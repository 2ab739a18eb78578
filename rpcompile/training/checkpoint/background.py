"""Saving on a thread of its own, so that a large save does not stall training (``save_checkpoint(...,
background=True)``).

snapshot
    What ``save_checkpoint`` takes at the save point on the caller's thread (:func:`.snapshot.take_snapshot`: the
    pipeline's state, the buffers and ``extra`` copied; the parameters and the optimizer's state referenced); it
    returns a :class:`PendingSave`.
copy
    The thread's first step: the parameters and optimizer state copied (:meth:`Snapshot.copy
    <.snapshot.Snapshot.copy>`) beside the next ``forward_backward``; until it is done every optimizer step and
    ``load_state_dict`` waits for it, so nothing changes what is being saved.
write
    The thread's second step: the copy written as a checkpoint directory, atomic and checksummed as a synchronous
    save (:func:`.snapshot.write_snapshot`), then the checkpoints beyond ``keep`` removed.

:class:`PendingSave` says what a background save costs and how saves are ordered and fail.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...core.errors import one_line

from ..hooks import Hook
from .snapshot import Snapshot
from .state import CheckpointError, CheckpointWarning

__all__ = ["PendingSave", "start_background", "wait_pending", "available_memory"]

_LOCK = threading.Lock()
_PENDING: dict[Path, "PendingSave"] = {}
"""The pending save into each directory (resolved), until it is waited for or a later one starts."""
_COPYING: list["PendingSave"] = []
"""The saves still copying their snapshot: every optimizer step waits for them (:func:`_before_step`)."""
_STEP_HOOK: list[Any] = []


def _before_step(*args: Any, **kwargs: Any) -> None:
    """The global optimizer step pre-hook, installed once and never removed (a hook removed from another thread
    while a step iterates over the hooks would break that iteration): wait for every save still copying."""
    with _LOCK:
        # waited for outside the lock: a save's thread takes the lock to leave _COPYING when its copy is done
        copying = list(_COPYING)
    for pending in copying:
        pending.wait_copied()


class PendingSave:
    """A checkpoint being written in the background.

    Until step 1 is done, every optimizer step in this process — ``pipe.step``, an overlapped step on its thread, an HF
    Trainer's ``optimizer.step()`` — waits for it (a global ``torch.optim`` step pre-hook), and so do
    ``model.load_state_dict`` and ``optimizer.load_state_dict``: nothing changes what is being saved. In-place writes to
    the weights by other means (``p.data.mul_()``) are not watched: :meth:`PendingSave.wait` first.

    **What it costs.** Host memory: a second copy of the parameters and of the optimizer's state (fp32 masters and
    AdamW's two moments: 12 bytes per trainable parameter) until the write ends — refused in one line when the host
    has less available (:func:`available_memory`), so the caller can save synchronously instead. Time: the caller
    pays the snapshot (the buffers, the pipeline state), the first step after the save may wait for the rest of the
    copy (a memory copy), and the write's disk time overlaps training.

    **Order and failure.** Saves into one directory run one at a time: a new ``save_checkpoint`` or
    ``load_checkpoint`` there waits for the pending one and raises its failure (one line), as does :meth:`wait`; a
    failure also warns (:class:`.state.CheckpointWarning`) when it happens. A process killed mid-write leaves only a
    temporary directory, swept by a later save.
    """

    def __init__(self, path: Path, snapshot: Snapshot, write: Callable[[Snapshot], None]) -> None:
        self.path = path
        """Where the checkpoint goes (it exists once :meth:`done`, unless the save failed)."""
        self.step = snapshot.step
        self.copied = threading.Event()
        """Set once the snapshot no longer shares memory with training (steps wait for it)."""
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.copy_s: float | None = None
        """Seconds the copy took (steps wait for it), once done."""
        self.write_s: float | None = None
        """Seconds the write took (training went on meanwhile), once done."""
        self._pid = os.getpid()
        self._hooks: list[Any] = []
        # not a daemon: the interpreter waits for a pending save before it exits (a KeyboardInterrupt in the
        # training loop does not lose it)
        self._thread = threading.Thread(target=self._run, args=(snapshot, write), daemon=False,
                                        name=f"rpcompile-save-{snapshot.step}")

    def watch(self, model: torch.nn.Module, optimizers: list[Any]) -> None:
        """Make every optimizer step, ``model.load_state_dict`` and each optimizer's ``load_state_dict`` wait for
        the copy (the last two hooks are removed by :meth:`wait`, on the caller's thread)."""
        with _LOCK:
            if not _STEP_HOOK:
                _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_step))
            _COPYING.append(self)
        hook = Hook(lambda *_: self.wait_copied())  # a copy of the model (deepcopy, pickle) gets one doing nothing
        self._hooks.append(model.register_load_state_dict_pre_hook(hook))
        self._hooks += [o.register_load_state_dict_pre_hook(hook) for o in optimizers
                        if hasattr(o, "register_load_state_dict_pre_hook")]

    def wait_copied(self) -> None:
        """Wait until the snapshot no longer shares memory with training (not in a forked child, nor on the
        save's own thread)."""
        # a forked child (a data loader worker) has no save thread to wait for; the save's own thread would wait for
        # itself
        if os.getpid() == self._pid and threading.current_thread() is not self._thread:
            self.copied.wait()

    def _run(self, snapshot: Snapshot, write: Callable[[Snapshot], None]) -> None:
        start = time.perf_counter()
        try:
            try:
                snapshot.copy()
            # set even when the copy failed: no step may wait for a copy that will never end
            finally:
                with _LOCK:
                    if self in _COPYING:
                        _COPYING.remove(self)
                self.copied.set()
                self.copy_s = time.perf_counter() - start
            write(snapshot)
            self.write_s = time.perf_counter() - start - self.copy_s
        except BaseException as e:  # noqa: BLE001 - kept for wait(), and told now
            self._error = e
            warnings.warn(f"background save of {self.path} failed ({one_line(e)}); the checkpoints before it "
                          "are intact", CheckpointWarning, stacklevel=1)
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the save has ended (written, or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the save; its path once written. CheckpointError (one line) if it failed, TimeoutError if
        ``timeout`` seconds pass first."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background save of {self.path} is still writing after {timeout} s")
        # waited for: a later save or load into the directory goes ahead without it
        _forget(self)
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise CheckpointError(str(self._error)) from None
            raise CheckpointError(f"the background save of {self.path} failed ({one_line(self._error)}); the "
                                  "checkpoints before it are intact: free the disk or fix the directory and save "
                                  "again") from None
        return self.path

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "written" if self.done() else "writing"
        return f"PendingSave({str(self.path)!r}, step={self.step}, {state})"


def _forget(pending: PendingSave) -> None:
    with _LOCK:
        for root, p in list(_PENDING.items()):
            if p is pending:
                del _PENDING[root]


def wait_pending(root: Path) -> None:
    """Wait for the pending save into ``root``, if any, raising its failure (:class:`PendingSave`)."""
    with _LOCK:
        pending = _PENDING.get(root.resolve())
    if pending is not None:
        pending.wait()


def available_memory() -> int | None:
    """The host memory available to a new allocation (``MemAvailable``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            # bounded read: MemAvailable is near the top
            for line in f.read(1 << 16).decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def start_background(root: Path, path: Path, snapshot: Snapshot, write: Callable[[Snapshot], None], *,
                     model: torch.nn.Module, optimizers: list[Any]) -> PendingSave:
    """Check the host can hold the snapshot's copy, then start writing it on a thread (:class:`PendingSave`)."""
    need, free = snapshot.shared_bytes(), available_memory()
    if free is not None and need > free:
        raise CheckpointError(f"save_checkpoint(background=True) copies {need / 2**30:.1f} GiB of weights and "
                              f"optimizer state but the host has {free / 2**30:.1f} GiB available; save with "
                              "background=False (training waits for the write) or free host memory")
    pending = PendingSave(path, snapshot, write)
    # watched before the thread starts: the thread takes the save out of _COPYING once copied, which must come after it
    # was put in (or it would stay there)
    pending.watch(model, optimizers)
    with _LOCK:
        _PENDING[root.resolve()] = pending
    pending._thread.start()
    return pending
