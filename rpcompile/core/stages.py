"""One stage's costs, as the planner's timing model prices it and the simulator plays it.

A **stage** here is one chain position of a pipeline schedule: a stage of the round-robin schedule (``F0``,
``FB``, ``B1``, …) or the forward or backward half of a static pipeline's stage. The timing model
(:mod:`rpcompile.passes.solver.timing`) returns one :class:`StageCost` per stage of a plan; the simulator
(:mod:`rpcompile.runtime.sim.simulator`) walks the executor's action lists over a list of them; the scenario drivers
(:mod:`rpcompile.tools.scenarios`) build them for static pipelines and published layer profiles too. Figures are per
microbatch unless said otherwise, and each field has one meaning wherever it is read.

What crosses a device's host link per microbatch splits four ways: ``input_bytes`` (activations waiting for
the previous stage's hand-off), ``prefetch_bytes`` (already in host memory), ``output_bytes`` (what the next
stage waits for) and ``offload_bytes`` (saved activations nobody in this pass waits for). Weights go up once
per iteration and gradients down once; the timing model amortises them over the ``microbatches``
(:attr:`StageCost.upload_bytes`, :attr:`StageCost.download_bytes`).

Beside the stages the host works too (:class:`HostLoad`): one host thread adds each grad stage's gradients into
the fp32 masters' ``.grad`` once they are down (beside the later stages), and between iterations the optimizer
steps and the compute-precision copies are refreshed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError

__all__ = ["StageKind", "StageCost", "HostLoad"]

#: A stage's part of the round-robin schedule: forward stages, the fused stage (last forward, first backward), backward
#: stages.
StageKind = Literal["forward", "fused", "backward"]


@dataclass(frozen=True, kw_only=True)
class HostLoad:
    """The host's own work in an iteration, as the timing model prices it and the simulator plays it. The default
    is no host work at all (plans older than schema 3, published profiles)."""

    accumulate_bytes_per_s: float = math.inf
    """Gradient bytes (as downloaded, compute precision) the host thread adds into fp32 ``.grad`` per second; one
    thread, so grad stages' accumulations queue behind each other. ``inf``: free."""
    accumulate_traffic: float = 5.0
    """Host memory bytes moved per gradient byte accumulated (bf16: 2 B read, 4 B read and 4 B written per
    element); the simulator charges them to the host's memory bandwidth, which the links share."""
    optimizer_s: float = 0.0
    """The optimizer step on the fp32 masters, once per iteration (s)."""
    refresh_s: float = 0.0
    """The compute-precision copies refreshed after the step, once per iteration (s)."""
    overlap_step: bool = False
    """The step runs beside the next iteration (one step stale): an iteration takes ``max(pipeline, step)``
    instead of ``pipeline + step``."""
    overlap_iterations: bool = False
    """With ``overlap_step``, the devices run on into the next iteration too: a device that has finished its
    stages of one iteration starts its stages of the next while the others drain (the round-robin pointer
    carries on, docs/architecture.md §3; one step stale as ``overlap_step``). An iteration then costs the steady-state
    period of overlapped iterations (:func:`rpcompile.passes.solver.recurrence.overlapped_ends`), which the planner
    minimises and the simulator plays over several iterations."""
    nodes: int = 1
    """Data-parallel machines (:mod:`rpcompile.training.distributed`), each running this pipeline on its own shard; with
    more than one, each grad stage's gradients are all-reduced over the network once the host has added them."""
    network_bytes_per_s: float = math.inf
    """Each machine's network bandwidth per direction (bytes/s) for that all-reduce."""
    reduce_bytes_per_grad_byte: float = 1.0
    """Bytes all-reduced per downloaded gradient byte: the reduction runs on the fp32 ``.grad`` (2 for bf16/fp16
    gradients, 1 for fp32)."""
    host_grad_bytes: float = 0.0
    """Gradients of parameters no stage holds (token-embedding tables looked up on the host), in downloaded bytes:
    all-reduced too, after the last stage's (the host adds their rows' gradients last)."""
    overlap_reduce: bool = True
    """Each stage's all-reduce starts as soon as its gradients are added (beside the later stages, as the runtime
    does); ``False``: all of them after the pipeline (what reducing after ``forward_backward`` would cost)."""

    def __post_init__(self) -> None:
        if not self.accumulate_bytes_per_s > 0 or not self.accumulate_traffic > 0:
            raise ConfigError(f"HostLoad: accumulate_bytes_per_s and accumulate_traffic must be > 0, got "
                              f"{self.accumulate_bytes_per_s} and {self.accumulate_traffic}")
        if not (self.optimizer_s >= 0 and self.refresh_s >= 0 and math.isfinite(self.optimizer_s + self.refresh_s)):
            raise ConfigError(f"HostLoad: optimizer_s and refresh_s must be finite times >= 0, got "
                              f"{self.optimizer_s} and {self.refresh_s}")
        if self.overlap_iterations and not self.overlap_step:
            raise ConfigError("HostLoad: overlap_iterations needs overlap_step=True (iterations overlap only when the "
                              "optimizer step runs beside the next one); set both")
        if self.nodes < 1 or not self.network_bytes_per_s > 0 or not self.reduce_bytes_per_grad_byte > 0:
            raise ConfigError(f"HostLoad: nodes must be >= 1 and network_bytes_per_s, reduce_bytes_per_grad_byte > 0, "
                              f"got {self.nodes}, {self.network_bytes_per_s} and {self.reduce_bytes_per_grad_byte}")

    @property
    def step_s(self) -> float:
        """The host's work between iterations: optimizer step plus copy refresh."""
        return self.optimizer_s + self.refresh_s

    def accumulate_s(self, grad_bytes: float) -> float:
        """How long the host thread takes to add ``grad_bytes`` of gradients into ``.grad`` (s)."""
        return grad_bytes / self.accumulate_bytes_per_s if grad_bytes else 0.0

    def reduce_s(self, grad_bytes: float) -> float:
        """One stage's ring all-reduce over the ``nodes``: ``2(n−1)/n`` of its (fp32) gradient bytes through each
        machine's link (s; 0 on one node)."""
        if self.nodes < 2 or not grad_bytes:
            return 0.0
        # a ring sends and receives 2(n−1)/n of the data per machine, reduced in the masters' dtype (fp32 .grad)
        return 2 * (self.nodes - 1) / self.nodes * grad_bytes * self.reduce_bytes_per_grad_byte / self.network_bytes_per_s

    def iteration_s(self, pipeline_s: float) -> float:
        """An iteration with the step: ``pipeline + step``, or ``max(pipeline, step)`` when it overlaps."""
        return max(pipeline_s, self.step_s) if self.overlap_step else pipeline_s + self.step_s


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """One stage: what it computes, moves and holds (see the module docstring)."""

    name: str = ""
    """``F0``, ``FB``, ``B1``…; labels only (the timing model prices stages by segment range and leaves it empty;
    :func:`rpcompile.tools.scenarios.from_segment_plan` names them)."""
    kind: StageKind = "forward"
    """``forward``, ``fused`` or ``backward``."""
    compute_s: float
    """Forward, backward and recompute time per microbatch (s), without ``overhead_s``."""
    overhead_s: float = 0.0
    """Fixed cost per microbatch (launch, synchronisation); the simulator runs ``compute_s + overhead_s``."""
    weight_bytes: float = 0
    """Weights uploaded once per iteration, before the first microbatch (the schedule's ``W`` action)."""
    grad_bytes: float = 0
    """Gradients downloaded once, after the last microbatch (``G``); held on the device from the first one."""
    reduce_bytes: float | None = None
    """Data parallelism: the downloaded gradient bytes whose all-reduce this stage's landing completes — a
    parameter several grad stages share counts only with the last of them (:attr:`reduced_bytes`); None: all of
    ``grad_bytes``."""
    input_bytes: float = 0
    """Host → device before computing, once the previous stage's output for the microbatch is in host memory
    (a forward or fused stage's inputs, a backward stage's output gradients)."""
    prefetch_bytes: float = 0
    """Host → device before computing, in host memory already (a backward stage's saved activations and the
    forward input it recomputes from)."""
    output_bytes: float = 0
    """Device → host after computing; the next stage waits for it (outputs, input gradients)."""
    offload_bytes: float = 0
    """Device → host after computing; nobody in this pass waits for it (a forward stage's saved activations)."""
    upload_s: float | None = None
    """A fixed hand-off time per microbatch instead of ``input_bytes`` over the link (published profiles)."""
    working_bytes: float = 0
    """Device memory one microbatch's live tensors take while it computes, its input buffers (``input_bytes``
    and ``prefetch_bytes``) included; for a forward stage also the activations it saves."""
    resident_bytes: float = 0.0
    """Device memory held for the whole iteration (static pipelines: weights, gradients, optimizer state)."""
    stash_bytes: float = 0.0
    """Kept after each microbatch until the stage that ``releases`` it ends that microbatch (static pipelines)."""
    releases: int = -1
    """Chain position whose stash this stage's microbatches free (a static backward half); -1 for none."""
    saved_by: tuple[int, ...] = ()
    """Chain positions whose ``offload_bytes`` this stage's ``prefetch_bytes`` read: microbatch j's prefetch
    starts only once their offload of j has landed in host memory."""
    # weights that stay on the device (rpcompile.core.schedule.weight_stays); its own weights are
    # weight_bytes + found_bytes
    found_bytes: float = 0
    """Its own weights already on its device when it starts (an earlier stage left them there), which its ``W``
    neither uploads nor allocates."""
    kept_bytes: float = 0
    """Its own weights it leaves on the device after its last microbatch, for a later stage."""
    held_bytes: float = 0
    """Other stages' weights staying on the device while it runs (in ``memory_bytes``)."""
    sum_bytes: float = 0
    """Gradient sums on the device while it runs (in ``memory_bytes``; :mod:`rpcompile.passes.solver.stays`); priced for
    a call under ``no_sync``, also its own gradients that stay (``grad_bytes`` is then what it sends home)."""
    refreshes: bool = False
    """Its ``W`` replaces copies already on the device (a resident plan after the optimizer step): the old copy
    goes when the new one lands. Its device held them before the iteration."""

    # the timing model's figures (0 for stages it did not price)
    start: int = 0
    """First segment of the stage (half-open range ``[start, stop)`` of the partition problem's chain)."""
    stop: int = 0
    microbatches: int = 1
    """Microbatches per iteration, over which ``upload_bytes``/``download_bytes`` amortise weights/gradients."""
    time_s: float = 0.0
    """``overhead + max(compute, upload/link, download/link)``, or the lazy offload's time
    (:func:`rpcompile.passes.solver.timing.offload_backlog`)."""
    memory_bytes: int = 0
    """``W + G + P + working + buffers`` (whole stage, not per microbatch)."""
    buffer_bytes: int = 0
    """The ``buffers`` term of ``memory_bytes`` (double buffering beside the working set)."""
    backlog_bytes: int = 0
    """Most saved activations of this device's forward stages still waiting to go down while the stage runs (lazy
    offload). Not in ``memory_bytes``: the backlog only fills what the device's stages leave free."""

    @property
    def reduced_bytes(self) -> float:
        """``reduce_bytes``, or ``grad_bytes`` when not given."""
        return self.grad_bytes if self.reduce_bytes is None else self.reduce_bytes

    @property
    def upload_bytes(self) -> float:
        """Host → device per microbatch, weights amortised: ``input + prefetch + weight / microbatches``."""
        # grouped as timing.stage_cost spells the sum out, so that the two agree bit for bit
        return (self.input_bytes + self.prefetch_bytes) + self.weight_bytes / self.microbatches

    @property
    def download_bytes(self) -> float:
        """Device → host per microbatch, gradients amortised: ``output + offload + grad / microbatches``."""
        # grouped as timing.stage_cost spells the sum out, so that the two agree bit for bit
        return (self.output_bytes + self.offload_bytes) + self.grad_bytes / self.microbatches

    @property
    def handoff_bytes(self) -> float:
        """What a microbatch waits for from the stage before: ``input_bytes``, except for the chain's first stage
        (a forward or fused stage starting at segment 0, whose inputs are in host memory already)."""
        return 0 if self.kind != "backward" and self.start == 0 else self.input_bytes

    @property
    def device_working_bytes(self) -> float:
        """``working_bytes`` beyond the input buffers (which the simulator holds from their copy on)."""
        return max(0.0, self.working_bytes - self.input_bytes - self.prefetch_bytes)
