"""A small device layer: what the executor needs from a device, for CUDA and for logical CPU devices.

There are no logical CPU devices in torch (``cpu:1`` tensors report ``cpu``; CPU streams and events are stubs), so
the runtime defines its own (docs/architecture.md §7). A :class:`Device` moves tensors to and from the host and knows its
``torch.device``:

- :class:`CpuDevice`: a logical device on the CPU. Moving is free (tensors stay where they are); each logical
  device gets its own worker thread in the executor, which is how CI tests the multi-device logic.
- :class:`CudaDevice`: one GPU. Uploads go through a dedicated copy stream from pinned host memory and the compute
  stream waits on an event; downloads wait for the compute stream and land in pinned host buffers. A stage's
  weights go up on a third stream, from the executor's prefetch thread, behind the activation uploads
  (:meth:`CudaDevice.upload_weights`).

Either may send saved activations down lazily (:meth:`Device.enable_offload`) and hand-offs asynchronously
(:meth:`Device.enable_async_handoff`), each on an offloader thread of its own (:mod:`.offload`); the pipeline
turns both on for CUDA devices, with the memory the plan's stages leave free on each as the backlog's budget.
Without them (logical CPU devices, where moving is free) :meth:`Device.download` copies synchronously.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable, Sequence

import torch

from rpcompile.core.errors import ConfigError

from .offload import Offloader
from .weights import HostTraffic, nbytes

__all__ = ["Device", "CpuDevice", "CudaDevice", "make_devices", "host_buffer", "WEIGHT_CHUNK_BYTES"]

#: A weight upload yields to activation uploads between pieces of this size (16 MiB: 0.7 ms on PCIe 4.0 x16), so
#: the copies a microbatch waits for queue behind at most two pieces (:meth:`CudaDevice.upload_weights`).
WEIGHT_CHUNK_BYTES = 16 << 20


def host_buffer(like: torch.Tensor, *, dtype: torch.dtype | None = None, pin: bool = False) -> torch.Tensor:
    """An empty host tensor for a copy of ``like``: on the CPU whatever the ambient default device is (the worker
    runs under ``torch.device(gpu)``), pinned if asked, with ``like``'s strides when they are dense (a hand-off keeps
    the layout the producing kernel chose, so the consumer's graph sees what the producer's saw)."""
    return torch.empty_like(like, dtype=dtype, device="cpu", pin_memory=pin)  # preserve_format: dense strides kept


class Device:
    """Base class: identity moves on ``torch_device``."""

    def __init__(self, torch_device: torch.device, index: int):
        self.torch_device = torch_device
        self.index = index

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.index}: {self.torch_device})"

    def upload(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Host tensor -> device tensor (cast to ``dtype`` for floating tensors)."""
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    def download(self, t: torch.Tensor) -> torch.Tensor:
        """Device tensor -> host tensor."""
        return t

    def upload_weights(self, tensors: Sequence[torch.Tensor],
                       dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], Any]:
        """A stage's weights and buffers to the device (floating ones cast to ``dtype``: the weights come in it
        already, :mod:`~rpcompile.runtime.weights`); returns the copies and a marker to pass to :meth:`wait_weights` before
        computing with them. The executor calls this from the device's prefetch thread while the device runs its
        previous stage. Host work (a cast) is counted in :attr:`~rpcompile.runtime.devices.Device.traffic`."""
        outs = []
        for t in tensors:
            out = self.upload(t, dtype)
            # a cast made in host memory is host work; a tensor handed on as it is costs nothing
            if self.traffic is not None and out is not t and out.device.type == "cpu":
                self.traffic.add("upload casts", nbytes(t) + nbytes(out))
            outs.append(out)
        return outs, None

    def download_all(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Tensors to host memory (a stage's gradients): a list, or — behind the compute, when hand-offs are
        asynchronous — a :class:`~.offload.Landing` of one."""
        if self.handoffs is None:
            return [self.download(t) for t in tensors]
        self._handoff_seq += 1
        # numbered from the hand-offs' counter: gradients and hand-offs go down in the order they were submitted
        return self.handoffs.submit(list(tensors), priority=self._handoff_seq, ready=self._computed(), wrap=list)

    def wait_weights(self, ready: Any) -> None:
        """Make this device's later compute wait for the weights :meth:`upload_weights` returned."""

    def compute(self) -> Any:
        """Context in which this device's computation runs."""
        return contextlib.nullcontext()

    offloader: "Offloader | None" = None
    handoffs: "Offloader | None" = None
    traffic: "HostTraffic | None" = None
    """Where the host's casts at upload are counted (the executor's)."""

    def enable_offload(self, budget_bytes: float,
                       copy: Callable[[Sequence[torch.Tensor], Any], Sequence[torch.Tensor]] | None = None) -> None:
        """Send saved activations down lazily (:mod:`.offload`), at most ``budget_bytes`` of them waiting on the
        device. ``copy`` replaces the device's own copy to host (tests slow it down)."""
        if self.offloader is not None:
            self.offloader.close()
        self.offloader = Offloader(copy or self._copy_out, budget_bytes=budget_bytes,
                                   name=f"rpcompile-offload{self.index}")

    def enable_async_handoff(self, max_pending: int = 2,
                             copy: Callable[[Sequence[torch.Tensor], Any], Sequence[torch.Tensor]] | None = None) -> None:
        """Send hand-offs (outputs, input gradients) down on their own thread, first in first out, at most
        ``max_pending`` of them in flight (:mod:`.offload`); the next stage waits on their landing."""
        if self.handoffs is not None:
            self.handoffs.close()
        self.handoffs = Offloader(copy or self._copy_out, max_pending=max_pending,
                                  name=f"rpcompile-handoff{self.index}", what="a hand-off")
        self._handoff_seq = 0

    def handoff(self, t: torch.Tensor) -> Any:
        """A tensor the next stage waits for, to host memory: now, or as a :class:`~.offload.Landing`."""
        if self.handoffs is None:
            return self.download(t)
        self._handoff_seq += 1  # one worker thread per device submits, so the order is the submission order
        return self.handoffs.submit([t], priority=self._handoff_seq, ready=self._computed(), wrap=lambda h: h[0])

    def offload(self, value: Any, *, priority: Any) -> Any:
        """A forward stage's saved activations (:class:`~.segments.capture.HostSaved`) to host memory: now, or through
        the offloader (a :class:`~.offload.Landing` the backward stage waits on)."""
        if self.offloader is None:
            return value.map(self.download)
        return self.offloader.submit(value.tensors, priority=priority, ready=self._computed(),
                                     wrap=lambda hosts: value._replace(tensors=tuple(hosts)))

    def _computed(self) -> Any:
        """A marker the offloader's copy waits for: the tensors are computed (CUDA: an event on the compute
        stream)."""
        return None

    def _copy_out(self, tensors: Sequence[torch.Tensor], ready: Any) -> list[torch.Tensor]:
        return [self.download(t) for t in tensors]

    def synchronize(self) -> None:
        """Wait for queued work on this device."""


class CpuDevice(Device):
    """A logical device on the CPU (see module docstring)."""


class CudaDevice(Device):
    """One GPU with a copy stream for uploads and pinned host memory for downloads."""

    def __init__(self, torch_device: torch.device, index: int):
        if torch_device.index is None:  # "cuda": the current GPU, named (tensors report theirs by number)
            torch_device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(torch_device, index)
        self.copy_stream = torch.cuda.Stream(torch_device)
        self.weight_stream = torch.cuda.Stream(torch_device)
        self.compute_stream = torch.cuda.Stream(torch_device)
        self._copy_streams = threading.local()  # one D2H stream per offloader thread (saves, hand-offs)

    def upload(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if t.is_cuda and t.get_device() == self.torch_device.index:  # a value this device made and kept (a
            # hand-off): already on its compute stream
            return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t
        with torch.cuda.stream(self.copy_stream):
            # a copy from pageable memory is not asynchronous: pinned first, it runs on the copy stream by DMA
            src = t if t.is_pinned() or t.device.type != "cpu" else t.pin_memory()
            out = src.to(self.torch_device, non_blocking=True)
            # cast on the device after the copy: the host does no cast work
            if dtype is not None and out.is_floating_point():
                out = out.to(dtype)
        # the kernels that read the copy queue behind it; record_stream keeps the allocator from reusing its
        # memory (allocated on the copy stream) while the compute stream may still read it
        self.compute_stream.wait_stream(self.copy_stream)
        out.record_stream(self.compute_stream)
        return out

    def download(self, t: torch.Tensor) -> torch.Tensor:
        # PyTorch's streams do not synchronise with the default stream: a tensor the compute stream produced (a
        # gradient after the last microbatch) must be waited for before another stream copies it
        stream = torch.cuda.current_stream(self.torch_device)
        stream.wait_stream(self.compute_stream)
        host = host_buffer(t, pin=True)
        host.copy_(t, non_blocking=True)  # into pinned memory: a DMA, waited for below before the host reads it
        stream.synchronize()
        return host

    def upload_weights(self, tensors: Sequence[torch.Tensor],
                       dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], Any]:
        """On the prefetch thread: each tensor is copied on the weight stream in pieces of
        :data:`WEIGHT_CHUNK_BYTES`, one piece in flight, each issued once the activation uploads already queued
        on the copy stream are done, two in flight (the next queued behind the current, so the link never idles
        while the host issues it). The activations a microbatch waits for thus wait for at most two pieces —
        the priority the simulator gives weight uploads (they take what the link has left). Weights come as
        pinned copies in the compute precision (:mod:`~rpcompile.runtime.weights`) and go up by DMA straight from them; anything
        else (buffers) is first cast into pinned memory on the host (counted in :attr:`~rpcompile.runtime.devices.Device.traffic`), so what crosses the
        link is what the planner counted."""
        outs: list[torch.Tensor] = []
        in_flight: collections.deque[torch.cuda.Event] = collections.deque()  # pieces issued, at most two
        with torch.cuda.device(self.torch_device), torch.cuda.stream(self.weight_stream):
            for t in tensors:
                cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
                host = t
                # only a pinned, contiguous tensor in the target dtype can go up by DMA straight from where it is
                if not (t.dtype == cast and t.is_contiguous() and t.is_pinned()):
                    host = torch.empty(t.shape, dtype=cast, device="cpu", pin_memory=True)  # contiguous: flat
                    host.copy_(t)
                    if self.traffic is not None:
                        self.traffic.add("upload casts", nbytes(t) + nbytes(host))
                out = torch.empty(t.shape, dtype=cast, device=self.torch_device)
                src, dst = host.view(-1), out.view(-1)  # flat, so a piece is a plain slice
                step = max(1, WEIGHT_CHUNK_BYTES // host.element_size())
                for i in range(0, src.numel(), step):
                    self.copy_stream.synchronize()  # activation uploads first
                    dst[i:i + step].copy_(src[i:i + step], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self.weight_stream)
                    in_flight.append(done)
                    if len(in_flight) > 1:  # the next piece queued behind this one: the link never waits for the
                        in_flight.popleft().synchronize()  # host to issue it (a 0.15 ms gap a piece on the H100)
                out.record_stream(self.compute_stream)  # the allocator must not reuse it while compute reads it
                outs.append(out)
            while in_flight:  # every piece landed before the host copies may change (and temporaries go)
                in_flight.popleft().synchronize()
            ready = torch.cuda.Event()
            ready.record(self.weight_stream)
        return outs, ready

    def wait_weights(self, ready: Any) -> None:
        if ready is not None:
            self.compute_stream.wait_event(ready)

    def compute(self) -> Any:
        return torch.cuda.stream(self.compute_stream)

    def _computed(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.compute_stream)
        return ev

    def _copy_out(self, tensors: Sequence[torch.Tensor], ready: Any) -> list[torch.Tensor]:
        """On an offloader's thread: that thread's own stream (hand-offs never queue behind saves) waits for the
        compute, copies into pinned host buffers and synchronises (the device tensors are released only after)."""
        stream = getattr(self._copy_streams, "stream", None)
        # each offloader thread gets a stream of its own, made on its first copy
        if stream is None:
            stream = self._copy_streams.stream = torch.cuda.Stream(self.torch_device)
        with torch.cuda.device(self.torch_device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            hosts = []
            for t in tensors:
                host = host_buffer(t, pin=True)
                host.copy_(t, non_blocking=True)
                hosts.append(host)
        stream.synchronize()
        return hosts

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)


def make_devices(devices: "list[str | torch.device | Device] | None", gpus: int | None) -> list[Device]:
    """Devices from an explicit list (``["cpu", "cpu"]``, ``["cuda:0", "cuda:1"]``, or :class:`Device` objects of
    your own, e.g. a test device) or ``gpus=k``."""
    if devices is None:
        if gpus is None:
            raise ConfigError("give devices=[...] or gpus=k")
        if gpus < 1:
            raise ConfigError(f"gpus={gpus}; give gpus >= 1, or devices=['cpu'] * k for logical CPU devices")
        if gpus > torch.cuda.device_count():
            raise ConfigError(
                f"gpus={gpus} but {torch.cuda.device_count()} CUDA device(s) are visible; "
                "use devices=['cpu'] * k for logical CPU devices"
            )
        devices = [f"cuda:{i}" for i in range(gpus)]
    if not devices:
        raise ConfigError("need at least one device")
    out: list[Device] = []
    for i, d in enumerate(devices):
        if isinstance(d, Device):
            d.index = i  # a caller's device object: its index is its place in this list
            out.append(d)
            continue
        dev = _torch_device(d)
        out.append(CudaDevice(dev, i) if dev.type == "cuda" else CpuDevice(dev, i))
    return out


def _torch_device(d: "str | torch.device") -> torch.device:
    """``d`` as a device rpcompile can run a stage on — ``cpu`` (a logical device) or a visible ``cuda:i`` — or
    one line saying why not."""
    try:
        dev = torch.device(d)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {d!r} is not a device name; use 'cpu' (a logical CPU device) or 'cuda:i'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {d!r}: rpcompile runs stages on 'cpu' (logical CPU devices) or 'cuda:i', "
                          f"not {dev.type}")
    count = torch.cuda.device_count() if dev.type == "cuda" else 0
    if dev.type == "cuda" and (dev.index or 0) >= count:
        seen = f"only cuda:0..cuda:{count - 1} are visible" if count else "no CUDA device is visible (or torch " \
            "has no CUDA)"
        raise ConfigError(f"device {d!r}: {seen}; use devices=['cpu'] * k for logical CPU devices")
    return dev
