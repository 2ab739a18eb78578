"""``MeasuredCostModel``: time every node on the device at hand (a :class:`~rpcompile.passes.cost.cost_model.CostModel`).

Each node runs on its own with concrete inputs (:class:`~rpcompile.passes.cost.cost_model.NodeCall`): ``warmup`` untimed runs, then the
fastest of ``repeats``. Timing nodes one by one misses what a whole step pays (autograd's bookkeeping, cold
caches), so :meth:`MeasuredCostModel.calibration` also times the whole graph once and :func:`~.cost.cost_pass`
scales the node times to it.

Nodes arrive in batches (:meth:`MeasuredCostModel.estimate_batch`, a block of the graph at a time): on CUDA every run
is bracketed by events and the batch ends in one synchronisation, not one per node. ``share_repeats`` (default on)
measures each repeated block once and ``cache`` (default on) keeps the times on disk
(:func:`~.cost.cost_pass`, :mod:`.repeats`, :mod:`.profile_cache`).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from rpcompile.core.batch import tensor_leaves
from rpcompile.core.errors import ConfigError
from .cost_model import CostModel, NodeCall, OpEstimate

from ..graph.portable import running_on

__all__ = ["MeasuredCostModel", "CPUINFO", "cpu_model"]

CPUINFO = Path("/proc/cpuinfo")
"""Where Linux names the CPU (:func:`cpu_model`)."""


def cpu_model() -> str:
    """This machine's CPU model (``AMD EPYC 7763 64-Core Processor``): the first ``model name`` (ARM: ``Hardware``,
    ``cpu model``) of :data:`CPUINFO`, else what :mod:`platform` says. ``platform.processor()`` alone is empty on
    Linux, so every x86_64 machine with as many cores would share one profile cache key."""
    try:
        # the first MiB is plenty: a many-core machine repeats the same fields for every core
        text = CPUINFO.read_text(errors="replace")[: 1 << 20]
    except OSError:
        text = ""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            # every core repeats the same fields: the first processor's entry is kept
            found.setdefault(key.strip().lower(), value.strip())
    name = next((found[k] for k in ("model name", "hardware", "cpu model") if k in found), "")
    return name or platform.processor() or platform.machine()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MeasuredCostModel(CostModel):
    """Times every node on the device at hand: ``warmup`` untimed runs, then the fastest of ``repeats`` (noise
    only ever adds time).

    On CUDA it uses events around each run; on the CPU ``time.perf_counter``. Inputs are copied to ``device``
    a batch of nodes at a time, so a model larger than the device can still be profiled. ``dtype`` casts floating
    inputs (e.g. ``torch.bfloat16`` to profile mixed-precision compute). ``share_repeats``: measure each repeated
    block once; ``cache``: keep the times on disk and reuse them (both on by default).
    """

    name = "measured"

    def __init__(
        self, device: torch.device | str = "cpu", *, warmup: int = 1, repeats: int = 5, dtype: torch.dtype | None = None,
        share_repeats: bool = True, cache: bool = True,
    ):
        if repeats < 1 or warmup < 0:
            raise ConfigError(f"MeasuredCostModel: need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
        self.device = torch.device(device)
        self.warmup, self.repeats, self.dtype = warmup, repeats, dtype
        self.share_repeats, self.cache = share_repeats, cache

    def identity(self) -> dict[str, Any]:
        """The cache key's device part: the device's name (a GPU's; a CPU: its model, :func:`cpu_model`, cores and
        intra-op threads), the compute dtype, warm-up runs and repeats."""
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
        else:
            name = f"{self.device.type}:{platform.machine()}:{cpu_model()}:{os.cpu_count()} cores:" \
                   f"{torch.get_num_threads()} threads"
        return {"cost_model": self.name, "device": name, "dtype": str(self.dtype), "warmup": self.warmup,
                "repeats": self.repeats}

    def __repr__(self) -> str:
        return f"MeasuredCostModel(device={str(self.device)!r}, repeats={self.repeats})"

    def prepare(self, gm: fx.GraphModule, flat_args: list[Any]) -> None:
        """Warm the device up with one forward and backward of the whole graph (first calls of many kernels
        pay one-off initialisation that must not land on the first layer's nodes). Only when the graph is on
        the measured device: a model in CPU memory measured on a GPU would warm the CPU up with a whole forward
        and backward (minutes for a Llama-3-8B shape) — the nodes' own ``warmup`` runs warm the GPU."""
        if not self._holds(gm, flat_args):
            return
        with torch.enable_grad():
            # flat_args are the graph's flat placeholders, not the model's call: no pytree (un)flattening
            out = torch.fx.Interpreter(gm).run(*flat_args, enable_io_processing=False)
            floats = [t for t in tensor_leaves(out) if t.requires_grad]
            if floats:
                # backward needs a scalar per output; its values do not matter to a warm-up
                torch.autograd.backward([t.float().sum() for t in floats])
        # the warm-up's gradients must not be left in the model's .grad
        gm.zero_grad(set_to_none=True)

    def drive_device(self, gm: fx.GraphModule, flat_args: list[Any]) -> torch.device | None:
        """The measured GPU, for a graph that is not on it (a model in CPU memory): the cost pass computes each
        node's value there from the copies it measures anyway, instead of running the model forward on the CPU
        (a Llama-3-8B shape at 2048 tokens: tens of seconds on 16 cores)."""
        return self.device if self.device.type == "cuda" and not self._holds(gm, flat_args) else None

    def _holds(self, gm: fx.GraphModule, flat_args: list[Any]) -> bool:
        """Whether the graph's inputs and parameters are all on the measured device (``cuda`` means ``cuda:0``
        there when it is the current one)."""
        # a tensor's device always has an index, so a bare "cuda" is resolved to the current device before comparing
        want = self.device if self.device.index is not None or self.device.type != "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
        return all(t.device == want for t in [*tensor_leaves(flat_args), *gm.parameters()])

    def _time(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        samples = []
        if self.device.type == "cuda":
            for _ in range(self.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                # the event must have completed before elapsed_time can read it
                end.synchronize()
                # elapsed_time is in milliseconds
                samples.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return min(samples)  # noise only ever adds time: the fastest run is the least disturbed

    def calibration(self, gm: fx.GraphModule, flat_args: list[Any]) -> tuple[float, float] | None:
        """Whole-graph times ``(forward without grad, forward with grad + backward)`` for one microbatch, or
        None when the graph cannot run whole here (model on another device or in another dtype).

        Node-by-node timings run each op with its inputs hot in cache and leave out autograd's bookkeeping, so
        their sum underestimates a real step (1.3–1.6× on this machine's CPU); :func:`~rpcompile.passes.cost.cost.cost_pass` scales the
        node times to these totals."""
        # a cast dtype: the whole graph would run in the model's dtype, not the one the nodes were timed in
        if self.dtype is not None or not self._holds(gm, flat_args):
            return None
        params = [p for p in gm.parameters() if p.requires_grad]

        def forward() -> None:
            with torch.no_grad():
                gm.forward(*flat_args)

        def step() -> None:
            with torch.enable_grad():
                outs = [t for t in tensor_leaves(gm.forward(*flat_args)) if t.requires_grad]
                if outs and params:
                    # autograd.grad, not backward: a step's parameter gradients, never written into the model's .grad
                    torch.autograd.grad([t.float().sum() for t in outs], params, allow_unused=True)

        try:
            return self._time(forward), self._time(step)
        except TypeError:  # a graph whose forward wants the original (pytree) inputs
            return None

    def estimate(self, call: NodeCall) -> OpEstimate:
        return self.estimate_batch([call])[0]

    def _samples(self, fn: Callable[[], Any]) -> list[Any]:
        """``warmup`` untimed runs, then ``repeats`` timed ones: seconds on the CPU, event pairs on CUDA (read
        after the batch's one synchronisation)."""
        for _ in range(self.warmup):
            fn()
        out: list[Any] = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                out.append((start, end))
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out

    @staticmethod
    def _fastest(samples: list[Any]) -> float:
        """The fastest run (noise only ever adds time), in seconds."""
        return min(s if isinstance(s, float) else s[0].elapsed_time(s[1]) / 1e3 for s in samples)

    def estimate_batch(self, calls: Sequence[NodeCall]) -> list[OpEstimate]:
        """Forward and backward times of each call, with one device synchronisation for the whole batch."""
        # every copy to the device is made before any timing starts, so no upload lands between a run's events
        ms = [call.materialize(self.device, dtype=self.dtype) for call in calls]
        # the device as the default device, as the executor runs a stage: a portable submodule (an outlined vmap
        # region, rpcompile.passes.graph.portable) allocates there
        with running_on(self.device):
            with torch.no_grad():
                # no autograd bookkeeping in the forward timing; the backward's time is taken separately below
                fwd = [self._samples(m.run) for m in ms]
            bwd = []
            for m in ms:
                # one forward with grad builds the graph; only its backward is timed (retained, so it can repeat)
                _, backward = m.forward_backward()
                bwd.append(self._samples(backward) if backward is not None else None)
        # the batch's one synchronisation: every CUDA event pair is read after it, in _fastest
        _sync(self.device)
        return [OpEstimate(self._fastest(f), self._fastest(b) if b is not None else 0.0) for f, b in zip(fwd, bwd)]
