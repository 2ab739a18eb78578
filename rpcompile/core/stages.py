"""One stage's costs, as the planner's timing model prices it and the simulator plays it.

A **stage** here is one chain position of a pipeline schedule: a stage of the round-robin schedule (``F0``,
``FB``, ``B1``, …) or the forward or backward half of a static pipeline's stage. The timing model
(:mod:`rpcompile.passes.timing`) returns one :class:`StageCost` per stage of a plan; the simulator
(:mod:`rpcompile.runtime.simulator`) walks the executor's action lists over a list of them; the scenario drivers
(:mod:`rpcompile.scenarios`) build them for static pipelines and published layer profiles too. Figures are per
microbatch unless said otherwise, and each field has one meaning wherever it is read.

What crosses a device's host link per microbatch splits four ways: ``input_bytes`` (activations waiting for
the previous stage's hand-off), ``prefetch_bytes`` (already in host memory), ``output_bytes`` (what the next
stage waits for) and ``offload_bytes`` (saved activations nobody in this pass waits for). Weights go up once
per iteration and gradients down once; the timing model amortises them over the ``microbatches``
(:attr:`StageCost.upload_bytes`, :attr:`StageCost.download_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import StageKind

__all__ = ["StageKind", "StageCost"]


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """One stage: what it computes, moves and holds (see the module docstring)."""

    name: str = ""
    """``F0``, ``FB``, ``B1``…; labels only (the timing model prices stages by segment range and leaves it empty;
    :func:`rpcompile.scenarios.from_segment_plan` names them)."""
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

    # the timing model's figures (0 for stages it did not price)
    start: int = 0
    """First segment of the stage (half-open range ``[start, stop)`` of the partition problem's chain)."""
    stop: int = 0
    microbatches: int = 1
    """Microbatches per iteration, over which ``upload_bytes``/``download_bytes`` amortise weights/gradients."""
    time_s: float = 0.0
    """``overhead + max(compute, upload/link, download/link)``, or the lazy offload's time
    (:func:`rpcompile.passes.timing.offload_backlog`)."""
    memory_bytes: int = 0
    """``W + G + P + working + buffers`` (whole stage, not per microbatch)."""
    buffer_bytes: int = 0
    """The ``buffers`` term of ``memory_bytes`` (double buffering beside the working set)."""
    backlog_bytes: int = 0
    """Most saved activations of this device's forward stages still waiting to go down while the stage runs (lazy
    offload). Not in ``memory_bytes``: the backlog only fills what the device's stages leave free."""

    @property
    def upload_bytes(self) -> float:
        """Host → device per microbatch, weights amortised: ``input + prefetch + weight / microbatches``."""
        return (self.input_bytes + self.prefetch_bytes) + self.weight_bytes / self.microbatches

    @property
    def download_bytes(self) -> float:
        """Device → host per microbatch, gradients amortised: ``output + offload + grad / microbatches``."""
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
