"""Host memory for what crosses the link every iteration: the weight copies the devices upload from, and the
gradients they send home.

Terms:

- **master**: a parameter's fp32 tensor, which the optimizer steps.
- **upload copy** (:class:`WeightStore`): the copy of a master in the compute precision that a device uploads —
  pinned when any device is a GPU — made once per optimizer step; where it would equal the master (fp32 on logical
  CPU devices) the master itself is uploaded. **Frozen** parameters (LoRA's base) are kept only as the copy.
- **overlap**: the optimizer step runs beside the next iteration (one step stale); every trainable copy is then
  double-buffered (front read by the iteration, back written by the step, :meth:`WeightStore.swap`).
- **gradient sink** (:class:`GradSink`): the thread that adds a stage's gradients into ``.grad`` while the device
  goes on; **all or none**: a failed call leaves ``.grad`` as it found it (:meth:`GradSink.abort`).
- **host traffic** (:class:`HostTraffic`): every byte the host's threads read or write in parameter-sized work —
  casts, staging copies, gradient accumulation, zero-filled gradients — counted where it happens (not DMA: the
  copy engines move pinned memory without the CPU). Deterministic, so the CPU measures it for the GPU.

The executor owns one store and one sink; the class docstrings say when a copy is refreshed and how the undo works.
"""

from __future__ import annotations

import copy
import queue
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .activity import span

__all__ = ["HostTraffic", "WeightStore", "GradSink", "nbytes", "pinned_bytes", "ADD_PIECE"]

#: Bytes of one pinned allocation holding many packed (4-bit) frozen weights (:func:`_pin_together`).
PIN_CHUNK = 1 << 26

#: Elements per piece when a gradient in the compute precision is added into an fp32 ``.grad`` (4 MiB of fp32:
#: cache-sized, and few enough pieces that the Python loop costs ~1% of the memory traffic).
ADD_PIECE = 1 << 20


@dataclass
class HostTraffic:
    """Bytes the host read and wrote in parameter-sized work, by kind (see module docstring)."""

    bytes: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, kind: str, nbytes: int) -> None:
        with self.lock:
            self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)

    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        with self.lock:
            self.bytes = {}


def nbytes(t: torch.Tensor) -> int:
    """A tensor's size in bytes."""
    return t.numel() * t.element_size()


def pinned_bytes(size: int) -> int:
    """Host memory a pinned allocation of ``size`` bytes takes: PyTorch's caching host allocator
    (``torch.empty(..., pin_memory=True)``) rounds each request up to a power of two unless
    ``pinned_max_round_threshold_mb`` (``PYTORCH_ALLOC_CONF``) says otherwise — a 112 MiB weight takes 128 MiB."""
    return 1 << (size - 1).bit_length() if size > 0 else 0


@dataclass
class _Entry:
    """One parameter's upload copy (``front``; ``back`` while overlapping) and what it was made from."""

    master: torch.nn.Parameter
    front: torch.Tensor | None = None
    """The copy the devices upload from; None: the master itself (or, with ``lazy``, a copy not allocated yet)."""
    lazy: bool = False
    """A copy is kept but not allocated until the first upload needs it (:meth:`WeightStore.source`)."""
    back: torch.Tensor | None = None
    written: bool = False
    """``back`` holds the stepped master (an overlapped step wrote it): :meth:`WeightStore.swap` takes it."""
    made_from: tuple[int, int] = (-1, -1)
    """``(master._version, master.data_ptr())`` when ``front`` was made; anything else means stale."""
    generation: int = 0
    """How many times ``front`` was made or swapped in, or an optimizer stepped the master
    (:meth:`WeightStore.version`)."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class WeightStore:
    """The tensors devices upload parameters from (the module docstring's upload copies).

    A device never uploads the fp32 master itself when it computes in another precision or is a GPU: it uploads a copy
    in the compute precision — pinned when any device is a GPU, so the upload is one DMA straight from it — made once
    per optimizer step, not at every upload (a cast of every weight at every upload is host time the GPU waits for:
    the H100 figure is in benchmarks/RESULTS.md). The first copy is made by the first upload that needs it (the
    pipeline allocates them, fills none), so building a pipeline casts no weight. When the copy is refreshed:

    - after any ``torch.optim`` optimizer's ``step()`` over one of its parameters (a global step post-hook, so a plain
      ``optimizer.step()`` loop needs nothing more): the copy is marked stale and refreshed by the next upload that
      needs it — on the device's prefetch thread, beside the previous stage's compute;
    - an optimizer that writes the copies itself in its own pass (:class:`rpcompile.runtime.optim.AdamW`: it has
      ``mirror(param, copy)``) is handed them after its first step, and from then on nothing is recast;
    - a master changed in place outside an optimizer (``load_state_dict``, ``with torch.no_grad(): p.mul_(2)``) is seen
      by its version counter, a master replaced (``p.data = t``) by its storage; edits through ``p.data`` are invisible
      to both — call :meth:`WeightStore.refresh` (``pipe.refresh_weights()``) after them.

    Where a copy would equal the master (fp32 on logical CPU devices) the master itself is uploaded: no copy. **Frozen**
    parameters (``requires_grad=False``, LoRA's base) are kept only in the compute precision: their ``.data`` becomes
    the copy, so they are stored once (2 bytes a parameter in bf16), unless ``frozen_masters=True``; a frozen
    token-embedding table looked up on the host is cast likewise (its rows are cast to that precision anyway).

    **Overlap** (:meth:`WeightStore.begin_overlap`, used by ``pipe.step(optimizer, overlap=True)``): the optimizer step
    runs on a thread beside the next iteration, which therefore reads the weights from before that step (one step
    stale). Every trainable copy is then double-buffered — the iteration reads the front buffer while the step writes
    the back one — and :meth:`WeightStore.swap` makes the back the front once the step is done.

    ``uploaded``: names of the parameters stages upload; ``host_only``: parameters read on the host only (token
    embedding tables, :mod:`rpcompile.passes.rewrite.host`), which need a copy only while overlapping."""

    def __init__(self, params: dict[str, torch.nn.Parameter], dtype: torch.dtype | None, *, pin: bool,
                 uploaded: Iterable[str], host_only: Iterable[str] = (), frozen_masters: bool = False,
                 traffic: HostTraffic | None = None):
        self.dtype, self.pin = dtype, pin
        self.traffic = traffic if traffic is not None else HostTraffic()
        self.entries = {n: _Entry(params[n]) for n in dict.fromkeys([*uploaded, *host_only])}
        self.host_only = set(host_only) - set(uploaded)
        self.overlapping = False
        self._refreshes = 0  # refresh() calls (version)
        self._mirrored: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()
        by_id: dict[int, list[str]] = {}
        for name, e in self.entries.items():
            by_id.setdefault(id(e.master), []).append(name)
        self._by_param = by_id
        packed = [e for name, e in self.entries.items() if name not in self.host_only and _packed(e.master)]
        if pin and packed:
            _pin_together([e.master for e in packed])
        for name, e in self.entries.items():
            # frozen floating weights: cast once here and stored only in the compute precision (class docstring)
            once = not e.master.requires_grad and not frozen_masters and e.master.is_floating_point()
            if _packed(e.master):
                continue  # uploaded as it is: pinned above for GPUs
            if name in self.host_only:
                if once and _casts(e.master, self.dtype):
                    e.master.data = e.master.data.to(self.dtype)  # a frozen host table: its rows are cast anyway
                continue
            if not self._needs_copy(e.master):
                continue
            if once:
                e.front = self._empty_like(e.master)
                self._make(e, e.front)
                e.master.data = e.front  # frozen: stored once, in the compute precision
                e.front = None
                continue
            # allocated and made by the first upload that needs it, on the device's prefetch thread beside the
            # previous stage's compute: not all at once before the first step (for an 8B model a cast of every
            # weight, and pinning 16 GB: ~7 s of building the pipeline on the H100 machine)
            e.lazy = True
        store = weakref.ref(self)
        # the hook is global to the process: it holds the store weakly, and goes with the store
        handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: _after_step(store, opt))
        weakref.finalize(self, handle.remove)

    @staticmethod
    def planned_bytes(params: dict[str, torch.nn.Parameter], dtype: torch.dtype | None, *, pin: bool,
                      uploaded: Iterable[str], host_only: Iterable[str] = (), frozen_masters: bool = False) -> int:
        """Host bytes a store built with these arguments allocates (its construction is the peak): an upload copy
        per parameter that needs one — in the compute precision, rounded as pinned allocations are — and the
        compute-precision table of a frozen host-only embedding. Each parameter counted once."""
        uploaded = list(uploaded)
        host = set(host_only) - set(uploaded)
        total, seen = 0, set()
        for name in dict.fromkeys([*uploaded, *host]):
            master = params[name]
            if id(master) in seen:  # tied parameters: one copy
                continue
            seen.add(id(master))
            if _packed(master) and name not in host:
                total += _aligned(master) if pin else 0  # packed into shared pinned chunks (_pin_together)
                continue
            once = not master.requires_grad and not frozen_masters and master.is_floating_point()
            if name in host:
                total += master.numel() * _copy_dtype(master, dtype).itemsize if once and _casts(master, dtype) else 0
            elif _needs_copy(master, dtype, pin):
                size = master.numel() * _copy_dtype(master, dtype).itemsize
                total += pinned_bytes(size) if pin else size
        return total

    # ------------------------------------------------------------------------------------------ reading
    def source(self, name: str) -> torch.Tensor:
        """What a device uploads for parameter ``name``: the current copy (refreshed first if stale), or the
        master (detached) where no copy is kept."""
        e = self.entries[name]
        if e.front is None and e.lazy:
            with e.lock:
                if e.front is None:  # checked again under the lock: two prefetch threads may need it at once
                    e.front = self._empty_like(e.master)
        if e.front is None:
            return e.master.detach()  # the devices get the data, never the Parameter (a leaf of the user's graph)
        # while overlapping the front must stay the weights from before the step, however the master moves
        if not self.overlapping and e.made_from != _stamp(e.master):
            with e.lock:  # two devices may upload the same parameter at once (a stage's forward and backward)
                if e.made_from != _stamp(e.master):
                    self._make(e, e.front)
        return e.front

    def version(self, name: str) -> Hashable:
        """What :meth:`source` gives for ``name`` now, as a token: a device copy made from it is current while the
        token stays the same (weights that stay on a device, :mod:`~rpcompile.runtime.stays`). None when the host copy is stale (the
        next :meth:`source` remakes it), which no copy was made from."""
        e = self.entries[name]
        if e.front is None:  # (refresh: edits through p.data, which no version counter sees)
            return None if e.lazy else ("master", id(e.master), *_stamp(e.master), e.generation, self._refreshes)
        if not self.overlapping and e.made_from != _stamp(e.master):
            return None
        # the buffer's identity too: a swap alternates two buffers, and a copy made from the other one is stale
        return id(e.front), e.generation, e.made_from

    def host_table(self, name: str) -> torch.Tensor:
        """A token-embedding table as the host looks rows up in it: the master, or its front copy (in the
        master's precision) while overlapping — the master is being stepped."""
        return self.source(name)

    def pinned(self) -> "WeightStore":
        """This store as one iteration sees it while iterations overlap: every trainable weight's front copy as
        it is now, kept by the view through later swaps — an iteration still draining uploads for its backward
        stages the weights its forward stages used, while the next one already reads the next step's. Outside
        an overlap, the store itself."""
        if not self.overlapping:
            return self
        view = copy.copy(self)
        # frozen weights never change (no step writes them): the store's own answer stays right for them
        fronts = {n: e.front for n, e in self.entries.items() if e.master.requires_grad and e.front is not None}
        # a device copy made from a pinned front stays that front's version after the swap (weights that stay,
        # :mod:`~rpcompile.runtime.stays`): the next iteration, reading the next front, must not find it current
        tokens = {n: self.version(n) for n in fronts}
        view.source = lambda name: fronts[name] if name in fronts else self.source(name)  # type: ignore[method-assign]
        view.host_table = view.source  # type: ignore[method-assign]
        view.version = lambda name: tokens[name] if name in tokens else self.version(name)  # type: ignore[method-assign]
        return view

    def refresh(self) -> None:
        """Remake every copy from its master now (after edits through ``p.data``, which nothing can see); copies
        a device kept (:meth:`version`) are stale from here on."""
        self._refreshes += 1
        for e in self.entries.values():
            if e.front is not None:
                with e.lock:
                    self._make(e, e.front)

    # ------------------------------------------------------------------------------------------ overlap
    def begin_overlap(self, optimizer: Any) -> None:
        """Before an overlapped step of ``optimizer``: every trainable parameter has a front copy equal to its
        master and a back buffer the step will write (by the optimizer's ``mirror`` when it has one)."""
        for name, e in self.entries.items():
            if not e.master.requires_grad:
                continue
            if e.front is None:
                # a host table's copy keeps the master's precision: the host looks rows up in it (host_table)
                e.front = self._empty_like(e.master, keep=name in self.host_only)
                self._make(e, e.front)
            elif e.made_from != _stamp(e.master):  # a stale front: the iteration must read the masters as they are now
                self._make(e, e.front)
            if e.back is None:
                e.back = torch.empty(e.front.shape, dtype=e.front.dtype, device="cpu", pin_memory=self.pin)
            e.written = False
        self.overlapping = True
        if hasattr(optimizer, "mirror"):
            mirrored = self._mirrored.setdefault(optimizer, set())
            for p in _params_of(optimizer):
                for name in self._by_param.get(id(p), ())[:1]:
                    e = self.entries[name]
                    if e.back is not None:
                        optimizer.mirror(p, e.back)
                        mirrored.add(id(p))

    def write_back(self, optimizer: Any) -> None:
        """After an overlapped step (on its thread): the back buffers of ``optimizer``'s parameters made from
        the stepped masters, unless the optimizer wrote them itself."""
        mirrored = self._mirrored.get(optimizer, set())
        done: set[int] = set()
        for p in _params_of(optimizer):
            for name in self._by_param.get(id(p), ()):
                e = self.entries[name]
                if e.back is None or id(e.back) in done:
                    continue
                done.add(id(e.back))
                if id(p) not in mirrored:
                    self._make(e, e.back, stamp=False)
                e.written = True

    def swap(self) -> None:
        """The step is done: its results (the back buffers) become what the devices upload."""
        for e in self.entries.values():
            if e.back is not None and e.written:
                e.front, e.back, e.written = e.back, e.front, False  # the old front is the next back buffer
                # the new front holds the stepped master (write_back's copy or the optimizer's mirror), unstamped so far
                e.made_from = _stamp(e.master)
                e.generation += 1

    def end_overlap(self, optimizer: Any = None, *, failed: bool = False) -> None:
        """Back to synchronous steps: the back buffers go; an optimizer's mirrors point at the front copies.
        ``failed``: the overlapped step raised — every copy is remade from the masters as they were left."""
        self.overlapping = False
        for e in self.entries.values():
            e.back = None
            if failed:
                e.made_from = (-1, -1)  # stale: the next source() remakes it
        if optimizer is not None and hasattr(optimizer, "mirror"):
            self._mirrored.pop(optimizer, None)  # its mirrors point at the back buffers just dropped
            self._mirror_front(optimizer)

    # ------------------------------------------------------------------------------------------ after a step
    def stepped(self, optimizer: Any) -> None:
        """``optimizer`` has stepped (the global post-hook): copies of its parameters are stale, except those it
        wrote itself (its mirrors); one that can mirror gets the copies now, for its next step."""
        if self.overlapping:
            return  # the overlapped step writes the back buffers itself (write_back)
        mirrored = self._mirrored.get(optimizer, set())
        for p in _params_of(optimizer):
            for name in self._by_param.get(id(p), ()):
                e = self.entries[name]
                e.generation += 1  # a device's copy of it is stale (torch's fused AdamW leaves _version as it was)
                if e.front is None:
                    continue
                # the mirror writes the copy only while p's storage is the one it was made from (p.data = t breaks it)
                if id(p) in mirrored and e.made_from[1] == p.data_ptr():
                    e.made_from = _stamp(p)  # the optimizer wrote the copy in the pass that updated p
                else:
                    e.made_from = (-1, -1)  # remade by the next upload that needs it
        if hasattr(optimizer, "mirror"):
            self._mirror_front(optimizer)

    def _mirror_front(self, optimizer: Any) -> None:
        mirrored = self._mirrored.setdefault(optimizer, set())
        for p in _params_of(optimizer):
            names = self._by_param.get(id(p), ())
            if names and self.entries[names[0]].front is not None and id(p) not in mirrored:
                optimizer.mirror(p, self.entries[names[0]].front)
                mirrored.add(id(p))

    # ------------------------------------------------------------------------------------------ helpers
    def _needs_copy(self, master: torch.Tensor) -> bool:
        return _needs_copy(master, self.dtype, self.pin)

    def _empty_like(self, master: torch.Tensor, *, keep: bool = False) -> torch.Tensor:
        """An empty copy of ``master`` in the compute precision (``keep``: in its own), pinned for GPUs."""
        dtype = master.dtype if keep else _copy_dtype(master, self.dtype)
        return torch.empty(master.shape, dtype=dtype, device="cpu", pin_memory=self.pin)

    def _make(self, e: _Entry, into: torch.Tensor, *, stamp: bool = True) -> None:
        with torch.no_grad(), span("weights refresh"):
            into.copy_(e.master)
        if into is e.front:  # (an overlapped step writing the back buffer changes nothing the devices read)
            e.generation += 1
        self.traffic.add("weight copies", nbytes(e.master) + nbytes(into))
        # a back buffer is not what the devices read: only the front's stamp says whether they read current weights
        if stamp:
            e.made_from = _stamp(e.master)


def _packed(master: torch.Tensor) -> bool:
    """A frozen weight that is not floating (a 4-bit base's packed indices and scales): no precision applies to it,
    so it is uploaded as it is, never copied — on GPUs its storage is pinned in place (:func:`_pin_together`)."""
    return not master.requires_grad and not master.is_floating_point()


def _pin_together(masters: list[torch.Tensor]) -> None:
    """Move ``masters`` into pinned memory, each ``.data`` a view of a shared pinned allocation: stored once, each
    uploaded in one DMA. The pinned allocator rounds every allocation up to a power of two — pinned one by one, a
    packed weight could take up to twice its bytes — so the views are packed into allocations of one power-of-two
    size (:data:`PIN_CHUNK`, or the largest weight's), largest first, each into the first that has room."""
    # first-fit decreasing: each weight once (tied ones share a master), largest first
    unique = sorted({id(m): m for m in masters}.values(), key=lambda m: -_aligned(m))
    chunk = max(PIN_CHUNK, pinned_bytes(_aligned(unique[0])))  # the largest weight must fit one chunk
    bins: list[list[torch.Tensor]] = []
    free: list[int] = []
    for m in unique:
        k = next((i for i, room in enumerate(free) if room >= _aligned(m)), len(bins))
        if k == len(bins):
            bins.append([])
            free.append(chunk)
        bins[k].append(m)
        free[k] -= _aligned(m)
    with torch.no_grad():
        for group, room in zip(bins, free):
            # a single allocation takes only what it holds: a small base need not pin a whole chunk
            arena = torch.empty(chunk - room if len(bins) == 1 else chunk, dtype=torch.uint8, device="cpu",
                                pin_memory=True)
            offset = 0
            for m in group:
                # the chunk's bytes reinterpreted as the weight; m.data below moves the weight there and frees its old
                # storage
                view = arena[offset:offset + m.numel() * m.element_size()].view(m.dtype).view(m.shape)
                view.copy_(m)
                m.data = view
                offset += _aligned(m)


def _aligned(m: torch.Tensor) -> int:
    """``m``'s bytes rounded up to 64 (every view in a pinned chunk starts aligned for any dtype and vector loads)."""
    return -(-m.numel() * m.element_size() // 64) * 64


def _casts(master: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """``master`` is computed in another precision than its own."""
    return master.is_floating_point() and dtype is not None and master.dtype != dtype


def _needs_copy(master: torch.Tensor, dtype: torch.dtype | None, pin: bool) -> bool:
    """Devices upload a copy of ``master``, not the master: pinned (GPUs) or cast."""
    return pin or _casts(master, dtype)


def _copy_dtype(master: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and master.is_floating_point() else master.dtype


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    return t._version, t.data_ptr()


def _params_of(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]


def _after_step(store: "weakref.ref[WeightStore]", optimizer: Any) -> None:
    s = store()
    if s is not None:
        s.stepped(optimizer)


class GradSink:
    """Adds stage gradients into the parameters' ``.grad`` (or, while overlapping, into its own buffers) on a
    thread of its own, started by the first submission of an iteration and stopped by :meth:`drain`.

    A stage's gradients are added into ``.grad`` in place (in its dtype, the compute-precision gradient converted on the
    fly: one pass, no intermediate copy) by the sink's own thread, so the device's worker goes on with its next stage;
    :meth:`GradSink.drain` waits for them at the end of the iteration. With overlap they go into the sink's own buffers
    instead (the optimizer is still reading ``.grad``) and :meth:`GradSink.install` moves them over once the step is
    done.

    **All or none.** A call's gradients land while it runs, yet a failed call must leave ``.grad`` as it found it. The
    sink keeps an undo record per call (:meth:`GradSink.begin` … :meth:`GradSink.commit` or :meth:`GradSink.abort`),
    written when a parameter's gradient is first touched: a gradient the call creates (``.grad`` was None: the usual
    case after ``zero_grad()``) is undone by setting it back to None, at no cost; a gradient that already held something
    (accumulation across calls) is copied first, on the sink's thread beside the compute (one extra fp32 copy of those
    gradients while the call runs, freed at its end), and copied back on failure. Staging every gradient apart and
    adding it at the end instead would cost the same memory and put a pass over all of them on the critical path after
    the last stage.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], traffic: HostTraffic | None = None):
        self.params = params
        self.traffic = traffic if traffic is not None else HostTraffic()
        self.private: dict[str, torch.Tensor] | None = None
        self._locks = {n: threading.Lock() for n in params}
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()
        self._error: BaseException | None = None
        self._scratch: torch.Tensor | None = None  # the sink thread's (:meth:`_add`)
        self._spare: dict[str, torch.Tensor] = {}  # per parameter, the last gradient buffer made (:meth:`_buffer`)
        self._undo: dict[str, tuple[torch.Tensor, torch.Tensor] | None] | None = None
        """Per parameter the call touched: None (it had no gradient) or (its gradient, a copy from before)."""
        self._dropping = False
        self.listener: Callable[[Any], None] | None = None
        """Told each submission's ``tag`` once its gradients are all added, on the sink's thread, and each
        :meth:`notify` (data-parallel reduction, :class:`rpcompile.runtime.reduce.GradReducer`: a stage's
        gradients are complete). None: nobody listens."""

    def hold(self, on: bool) -> None:
        """Gradients into the sink's own buffers (``on``: an overlapped step is reading ``.grad``) or into
        ``.grad``."""
        self.private = {} if on else None

    def fork(self, held: dict[str, torch.Tensor] | None) -> "GradSink":
        """A sink of its own for one of several iterations in flight at once (overlapped iterations): its own
        thread, queue, undo record and failure, adding into ``held`` (a generation's buffers; None: ``.grad``)
        under the same per-parameter locks, reusing the same spare buffers."""
        f = copy.copy(self)
        f.private, f._queue, f._thread, f._starting = held, queue.SimpleQueue(), None, threading.Lock()
        f._error, f._scratch, f._undo, f._dropping = None, None, None, False
        return f

    def submit(self, names: list[str], grads: Any, *, tag: Any = None) -> None:
        """Add ``grads`` (tensors, or something whose ``wait()`` gives them: copies still landing) into the
        gradients of the parameters ``names``, on the sink's thread; then tell the :attr:`listener` ``tag``."""
        with self._starting:  # two devices may submit first at once: one thread, or drain would wait for one
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rpcompile-grads", daemon=True)
                self._thread.start()
        self._queue.put((names, grads, tag))

    def notify(self, tag: Any) -> None:
        """Tell the :attr:`listener` ``tag`` now, on the calling thread (gradients added there: the host's)."""
        if self.listener is not None:
            self.listener(tag)

    def accumulate(self, name: str, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(grad, *args)`` on parameter ``name``'s gradient buffer (zeros if it has none yet), now, under
        that parameter's lock (the host's embedding gradients: an ``index_add_``)."""
        with self._locks[name]:
            fn(self._target(name, None), *args)

    def drain(self) -> None:
        """Wait until everything submitted has been added and stop the thread; re-raise the first failure."""
        self._stop()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def begin(self) -> None:
        """A call starts: from here on the sink records how to undo what it adds (class docstring)."""
        self._undo = {}

    def commit(self) -> None:
        """The call succeeded (after :meth:`drain`): its gradients stay; the undo record goes."""
        self._undo = None

    def abort(self) -> None:
        """The call failed: stop the thread (what is still queued is dropped) and put every gradient back as
        :meth:`begin` found it — ``.grad`` (or the held buffers, while overlapping) exactly as before the call."""
        self._dropping = True
        try:
            self._stop()
        finally:
            # in the finally: the next call starts clean even if the join was interrupted
            self._dropping, self._error = False, None
            undo, self._undo = self._undo or {}, None
            for name, before in undo.items():
                if before is not None:
                    with torch.no_grad():
                        before[0].copy_(before[1])
                elif self.private is not None:
                    self.private.pop(name, None)
                else:
                    self.params[name].grad = None

    def _stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)  # after everything queued (FIFO): the thread stops once it is drained
            self._thread.join()
            self._thread = None

    def install(self, held: dict[str, torch.Tensor] | None = None) -> None:
        """Move the held gradients into ``.grad`` (added to any already there); keep holding. ``held``: a
        generation's buffers (:meth:`fork`) instead of the sink's own."""
        if held is None:
            held = self.private or {}
            if self.private is not None:
                self.private = {}
        for name, g in held.items():
            p = self.params[name]
            if p.grad is None:
                p.grad = g  # the held buffer itself: no copy
            else:
                p.grad.add_(g)
                self.traffic.add("gradients", 3 * nbytes(g))  # two reads, one write

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            names, grads, tag = item
            if self._error is not None or self._dropping:
                continue  # drain what is queued; the first failure is what the caller sees
            try:
                # copies still landing are waited for here, on the sink's thread: the submitting worker does not wait
                landed = grads.wait() if hasattr(grads, "wait") else grads
                with span("grad sink"):
                    for name, g in zip(names, landed, strict=True):
                        # other writers of the same .grad: the host thread's embedding adds, and the sinks of
                        # overlapped iterations
                        with self._locks[name]:
                            self._target(name, g)
                if tag is not None and self.listener is not None:
                    self.listener(tag)
            except BaseException as e:  # noqa: BLE001 - re-raised by drain() on the caller's thread
                self._error = e

    def _target(self, name: str, g: torch.Tensor | None) -> torch.Tensor:
        """The gradient buffer of ``name`` with ``g`` added in place (``g`` None: made if missing, zero-filled);
        a gradient in the compute precision is converted as it is added."""
        p = self.params[name]
        current = self.private.get(name) if self.private is not None else p.grad
        if self._undo is not None and name not in self._undo:  # first touch in this call: how to undo it
            # a clone only where there was something: undoing a gradient the call created is setting it back to None
            self._undo[name] = None if current is None else (current, current.clone())
            if current is not None:
                self.traffic.add("gradients", 2 * nbytes(current))
        if current is None:
            current = self._buffer(name, p)
            if g is None:
                current.zero_()
                self.traffic.add("gradients", nbytes(current))
            else:
                current.copy_(g)  # into the master's dtype (g is in the compute precision)
                self.traffic.add("gradients", nbytes(g) + nbytes(current))
            if self.private is not None:
                self.private[name] = current
            else:
                p.grad = current
        elif g is not None:
            self._add(current, g)
            self.traffic.add("gradients", nbytes(g) + 2 * nbytes(current))
        return current

    def _buffer(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """A buffer for a new gradient of ``name`` (contents undefined): the one the last call made, when nothing
        else holds it any more (``zero_grad()`` set ``.grad`` to None and no one kept it), else a new one. Freshly
        allocated memory is faulted in page by page as it is first written: 4 bytes a parameter every step,
        ~5 s a step at 2B parameters on the 2-core reference machine (``benchmarks/floor.py``)."""
        spare = self._spare.get(name)
        # the tensor held by this dict, the local and getrefcount's argument only (no .grad, no user, no held
        # buffer), and its memory by the tensor and the probe's storage object only (no view of it anywhere)
        if (spare is not None and sys.getrefcount(spare) <= 3
                and torch._C._storage_Use_Count(spare.untyped_storage()._cdata) <= 2
                and spare.shape == p.shape and spare.dtype == p.dtype):
            return spare
        self._spare[name] = fresh = torch.empty_like(p)
        return fresh

    def _add(self, into: torch.Tensor, g: torch.Tensor) -> None:
        """``into += g``. A gradient in another precision goes through a small scratch buffer, a piece at a time:
        torch's in-place add with type promotion runs an unvectorised loop (~6x slower than a cast then a same-type
        add here); the piece stays in cache, so memory sees what a fused add would."""
        # same dtype: a plain add is vectorised already; not contiguous: flat pieces cannot be taken
        if g.dtype == into.dtype or not into.is_contiguous() or not g.is_contiguous():
            into.add_(g)
            return
        flat, src = into.view(-1), g.reshape(-1)
        n = flat.numel()
        if self._scratch is None or self._scratch.dtype != into.dtype or self._scratch.numel() < min(n, ADD_PIECE):
            self._scratch = torch.empty(min(n, ADD_PIECE), dtype=into.dtype, device="cpu")
        scratch = self._scratch
        for i in range(0, n, ADD_PIECE):
            piece = scratch[:min(ADD_PIECE, n - i)]
            piece.copy_(src[i:i + piece.numel()])
            flat[i:i + piece.numel()].add_(piece)
