"""Device specifications for analytic costing and planning.

A :class:`DeviceSpec` is what the analytic cost model and the partitioner need to know about one accelerator:
peak arithmetic rates, memory bandwidth, memory size and the host link. Figures are public datasheet numbers
(dense, no sparsity; docs/architecture.md §5). Achieved rates are lower than peak, so every op class carries an efficiency
factor; measured profiles (:class:`rpcompile.passes.cost.measured.MeasuredCostModel`) always beat analytic ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from .errors import ConfigError

__all__ = ["DeviceSpec", "HostSpec", "OP_CLASSES", "SPECS", "get_spec", "assumed_host", "GB", "GiB",
           "GPU_STAGE_OVERHEAD_S", "GPU_DISPATCH_S", "GPU_BACKWARD_DISPATCH_S"]

GB = 10**9
GiB = 2**30

#: Op classes the analytic model distinguishes (see :mod:`rpcompile.passes.cost.analytic`).
OP_CLASSES = ("matmul", "conv", "attention", "norm", "elementwise", "reduction", "embedding", "memory")

_DEFAULT_EFFICIENCY = MappingProxyType(
    {
        "matmul": 0.70,
        "conv": 0.55,
        "attention": 0.50,
        "norm": 0.60,
        "elementwise": 0.75,
        "reduction": 0.60,
        "embedding": 0.50,
        "memory": 0.80,
    }
)


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator as the cost model and the partitioner see it."""

    name: str
    """Preset name, e.g. ``rtx4090``."""
    tensor_flops: float
    """Peak dense bf16/fp16 tensor-core rate (FLOP/s) with fp32 accumulate."""
    fp32_flops: float
    """Peak fp32 rate (FLOP/s) for ops that run in fp32."""
    memory_bandwidth: float
    """Device memory bandwidth (bytes/s)."""
    memory_bytes: int
    """Device memory size (bytes)."""
    host_link_bandwidth: float
    """Host<->device link bandwidth per direction (bytes/s), e.g. ~25 GB/s for PCIe 4.0 x16."""
    kernel_overhead_s: float = 5e-6
    """Fixed cost of one kernel launch (s)."""
    efficiency: Mapping[str, float] = field(default_factory=lambda: dict(_DEFAULT_EFFICIENCY))
    """Achieved fraction of peak per op class (keys from :data:`~rpcompile.core.specs.OP_CLASSES`)."""
    usable_memory_fraction: float = 0.9
    """Share of ``memory_bytes`` the planner may fill (the rest: CUDA context, allocator slack)."""
    stage_overhead_s: float = 30e-6
    """Fixed runtime cost per stage and microbatch beyond its kernels: waiting on events, handing activations
    over, bookkeeping (the runtime's host work per action, ``benchmarks/floor.py``). It is what keeps the planner
    from cutting stages finer than pays off."""
    dispatch_s: float = 0.0
    """Host time to dispatch one graph node of a stage's forward onto the device: the stage's generated Python,
    PyTorch's dispatcher and the kernel launch. A device that runs asynchronously (a GPU) cannot finish a node's
    work before the host has issued it, so a segment takes at least its nodes times this
    (:func:`rpcompile.passes.formulate.launch_bound`). 0 for a device that computes as it dispatches (a CPU: its
    node times contain the dispatch) and in plans older than schema 6."""
    backward_dispatch_s: float = 0.0
    """The same per graph node of a backward (the autograd engine's nodes for it: the gradients of its inputs and
    of its parameters, about twice the forward's launches)."""

    def __post_init__(self) -> None:
        for name in ("tensor_flops", "fp32_flops", "memory_bandwidth", "host_link_bandwidth"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"DeviceSpec {self.name!r}: {name} must be > 0, got {getattr(self, name)}")
        if self.memory_bytes <= 0:
            raise ConfigError(f"DeviceSpec {self.name!r}: memory_bytes must be > 0, got {self.memory_bytes}")
        unknown = set(self.efficiency) - set(OP_CLASSES)
        if unknown:
            raise ConfigError(f"DeviceSpec {self.name!r}: unknown op classes {sorted(unknown)}; known: {OP_CLASSES}")
        bad = {k: v for k, v in self.efficiency.items() if not 0 < v <= 1}
        if bad:
            raise ConfigError(f"DeviceSpec {self.name!r}: efficiency factors must be in (0, 1], got {bad}")
        for name in ("stage_overhead_s", "dispatch_s", "backward_dispatch_s"):
            v = getattr(self, name)
            if not (0 <= v < 1):  # NaN fails too
                raise ConfigError(f"DeviceSpec {self.name!r}: {name} must be in [0, 1) seconds, got {v}")
        if not 0 < self.usable_memory_fraction <= 1:
            raise ConfigError(f"DeviceSpec {self.name!r}: usable_memory_fraction must be in (0, 1]")
        # complete the efficiency table so lookups never miss
        object.__setattr__(self, "efficiency", {**_DEFAULT_EFFICIENCY, **self.efficiency})

    @property
    def usable_memory_bytes(self) -> int:
        # rounded down: never more than the fraction allows
        return int(self.memory_bytes * self.usable_memory_fraction)

    def with_memory(self, memory_bytes: int) -> "DeviceSpec":
        return dataclasses.replace(self, memory_bytes=int(memory_bytes))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["efficiency"] = dict(self.efficiency)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "DeviceSpec":
        return cls(**dict(d))


_RATES = ("memory_bandwidth", "cast_params_per_s", "accumulate_params_per_s", "optimizer_params_per_s")
_LINKS = ("pinned_h2d", "pinned_d2h", "pageable_h2d", "pageable_d2h")


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """The host beside the devices: what its CPU does per iteration (docs/architecture.md §3) and how fast.

    The runtime keeps the fp32 masters and the optimizer on the host. Per iteration the host runs the
    **optimizer step** (``optimizer_params_per_s``), refreshes the pinned **compute-precision copies** the devices
    upload (a cast per trainable parameter, ``cast_params_per_s``) and **adds each grad stage's gradients** into
    the masters' fp32 ``.grad`` (``accumulate_params_per_s``). Figures come from :func:`rpcompile.planner.probe.probe_host`
    (``source="probe"``) or are :func:`assumed_host` (``source="assumed"``; ``note`` says from what)."""

    memory_bandwidth: float
    """Host memory traffic of a large copy (bytes read + written per second)."""
    cast_params_per_s: float
    """fp32 → bf16 casts into another buffer (parameters per second; 4 B read + 2 B written each)."""
    accumulate_params_per_s: float
    """bf16 gradients added into fp32 ``.grad`` (parameters per second; 2 + 4 B read, 4 B written each)."""
    optimizer_params_per_s: float
    """torch's AdamW step on fp32 parameters (parameters per second)."""
    pinned_h2d: float = 0.0
    """Host → device copies from pinned memory (bytes/s; 0: not measured, no accelerator)."""
    pinned_d2h: float = 0.0
    pageable_h2d: float = 0.0
    """Host → device copies from pageable memory (bytes/s; 0: not measured)."""
    pageable_d2h: float = 0.0
    threads: int = 0
    """CPU threads torch used for the figures (0: unknown)."""
    source: str = "assumed"
    """``probe`` (measured on this host) or ``assumed`` (a preset's figures)."""
    note: str = ""
    """Where the figures come from (the probed machine, or what an assumption is scaled from)."""

    def __post_init__(self) -> None:
        for name in _RATES:
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"HostSpec: {name} must be a finite rate > 0, got {v}")
        for name in _LINKS:
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"HostSpec: {name} must be a finite rate >= 0 (0: not measured), got {v}")
        if self.source not in ("probe", "assumed"):
            raise ConfigError(f"HostSpec: source must be 'probe' or 'assumed', got {self.source!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "HostSpec":
        return cls(**dict(d))


def assumed_host(spec: "str | DeviceSpec") -> HostSpec:
    """The host a preset's devices are assumed to sit in (``source="assumed"``; ``rpcompile probe`` measures one).

    GPU presets: the 16 cores of the H100 machine the runtime was measured on (shared/gpu/README.md): torch's
    fused CPU AdamW took 0.41 s for 1.72e9 fp32 parameters (4.2e9 params/s). AdamW reads and writes ~28 B per
    parameter, so that step moved ~117 GB/s: memory traffic is taken as 100 GB/s and a cast (6 B a parameter) as
    100/6 G params/s. The add-into (bf16 into fp32 ``.grad``) is a fifth of the cast: torch's mixed-dtype
    ``add_`` ran 5× slower than the cast on the 2-core machine that ``cpu`` describes. The links: the preset's
    host link pinned, a third of it pageable (54 vs 18 GB/s measured there). The ``cpu`` preset: that 2-core
    machine, shared with other jobs, as ``rpcompile probe`` measured it (memory 4–9 GB/s, casts 0.5–4 G/s, add-into
    0.13–0.25 G params/s; taken as 8 GB/s, 1 and 0.2 G/s) and torch's fused AdamW there on 50 M parameters, 0.12 G
    params/s (benchmarks/results/optimizer.json)."""
    spec = get_spec(spec)
    if spec.name == "cpu":
        traffic, cast, add, adam, threads = 8e9, 1e9, 0.2e9, 0.12e9, 2
        note = "assumed for cpu: the 2-core CI machine as rpcompile probe measured it"
    else:
        traffic, threads = 100e9, 16
        cast = traffic / 6
        add, adam = cast / 5, 4.2e9
        note = (f"assumed for {spec.name}: the 16-core H100 machine's AdamW (0.41 s for 1.72e9 params), "
                "100 GB/s memory traffic, add-into a fifth of the cast")
    link = spec.host_link_bandwidth
    return HostSpec(memory_bandwidth=traffic, cast_params_per_s=cast, accumulate_params_per_s=add,
                    optimizer_params_per_s=adam, pinned_h2d=link, pinned_d2h=link, pageable_h2d=link / 3,
                    pageable_d2h=link / 3, threads=threads, source="assumed", note=note)


#: The runtime's host work per action (one stage on one microbatch) beyond dispatching its nodes: inputs and
#: outputs handed over, events, bookkeeping. ``benchmarks/floor.py`` measured 0.63 ms per action at the Qwen3-1.7B
#: shape once the gradient buffers were reused (RESULTS.md, 2026-11-28; compute on ``meta``, so no GPU needed).
GPU_STAGE_OVERHEAD_S = 0.6e-3
#: Host time per graph node the runtime takes to dispatch a stage's forward onto a GPU, and per node with a
#: backward to run that backward. From the H100 trace of the 1.7B shape (RESULTS.md, 2026-11-28), less the
#: profiler's share (the profiled step took 2.307 s of GPU window, the unprofiled 2.107 s: ×0.91): forward,
#: 2.29 ms of host per decoder layer of 54 graph nodes (42 µs a node; the forward stages, the gradient sink idle);
#: backward, the autograd thread's 795 ms over 8 microbatches of 730 nodes with a backward (136 µs a node: a
#: saved segment's backward runs its captured graph's aten operations one by one, about four per graph node).
GPU_DISPATCH_S = 38e-6
GPU_BACKWARD_DISPATCH_S = 124e-6


def _gpu(name: str, tflops: float, fp32_tflops: float, gbps: float, mem_gb: float, link_gbps: float) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        tensor_flops=tflops * 1e12,
        fp32_flops=fp32_tflops * 1e12,
        memory_bandwidth=gbps * GB,
        memory_bytes=int(mem_gb * GB),
        host_link_bandwidth=link_gbps * GB,
        stage_overhead_s=GPU_STAGE_OVERHEAD_S,
        dispatch_s=GPU_DISPATCH_S,
        backward_dispatch_s=GPU_BACKWARD_DISPATCH_S,
    )


#: Named presets (docs/architecture.md §5). fp32 rates are the non-tensor-core datasheet figures.
SPECS: Mapping[str, DeviceSpec] = MappingProxyType(
    {
        "rtx4090": _gpu("rtx4090", 165, 82.6, 1008, 24, 25),
        "rtx3090": _gpu("rtx3090", 71, 35.6, 936, 24, 25),
        "a100-80g": _gpu("a100-80g", 312, 19.5, 2039, 80, 25),
        "h100-sxm": _gpu("h100-sxm", 989, 67, 3350, 80, 50),
        "h200": _gpu("h200", 989, 67, 4800, 141, 50),
        # A small CPU as a "device": logical CPU devices share host memory, so the link is memory bandwidth.
        "cpu": DeviceSpec(
            name="cpu",
            tensor_flops=0.2e12,
            fp32_flops=0.1e12,
            memory_bandwidth=20 * GB,
            memory_bytes=24 * GiB,
            host_link_bandwidth=10 * GB,
            kernel_overhead_s=10e-6,
            # an effective figure for logical CPU devices: each extra stage costs a hand-off between worker threads
            # that contend for the GIL and the cores. Swept on the peers.py model (2 devices, 4 microbatches):
            # 30 µs -> 16 stages, 109 ms a step; 0.1-0.4 ms -> 6 stages, 103-96 ms; 1 ms -> 5 stages, 89 ms
            stage_overhead_s=400e-6,
        ),
    }
)


def get_spec(spec: "str | DeviceSpec") -> DeviceSpec:
    """Return the preset called ``spec`` (or ``spec`` itself when it already is a DeviceSpec)."""
    if isinstance(spec, DeviceSpec):
        return spec
    try:
        return SPECS[spec]
    except KeyError:
        raise ConfigError(f"unknown device spec {spec!r}; choose one of: {', '.join(SPECS)}") from None
