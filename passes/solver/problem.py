"""The partition problem as plain numbers, and the plan and result the solvers return.

Terms (docs/architecture.md §3; RoundPipe, Luo et al., arXiv 2604.27085):

- A **segment** is a run of graph nodes between cheap cut points; the model is a *chain* of ``n`` segments
  (the coarsener linearises DAGs: tensors live across a cut, e.g. skip connections, are in ``boundary_bytes``).
- A **plan** (:class:`SegmentPlan`) cuts the chain three ways: forward stages ``F0..F(f-1)`` cover
  ``[0, fused[0])`` in ascending order, one **fused** stage ``FB = [fused[0], n)`` runs forward, loss and backward
  in one go, and backward stages ``B1..`` cover ``[0, fused[0])`` in *descending* order. Forward and backward cuts
  are independent. ``saved[i]`` says whether segment ``i``'s activations go to host memory in the forward pass
  (``True``) or are recomputed by its backward stage (``False``) — the checkpointing choice of Checkmate
  (Jain et al., MLSys 2020), made per segment.
- ``stays[i]``, ``resident`` and ``accumulates[i]``: weights that stay on their device and gradients summed there
  (terms: :mod:`~rpcompile.passes.solver.stays`), chosen on the solved cuts by :mod:`.stay_search`.
- Stage ``k`` of ``[F0.., FB, B1..]`` (:func:`plan_stages`) runs on device ``k mod N`` for every microbatch in turn.
- Every strategy returns a :class:`PartitionResult`; an infeasible problem is a result, not an exception.

The timing model that prices a plan is :mod:`.timing`; the rules a plan must obey are :mod:`.segment_rules`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from rpcompile.core.digest import short_digest
from rpcompile.core.errors import InfeasibleError, ProblemError
from rpcompile.core.stages import HostLoad, StageKind

__all__ = ["SharedParam", "PartitionProblem", "SegmentPlan", "PartitionResult", "plan_stages"]


def _ints(name: str, values: Sequence[object], n: int | None = None) -> tuple[int, ...]:
    """``values`` as ints, checked (they come from users and JSON files, whatever their annotations say)."""
    out = tuple(values)
    if n is not None and len(out) != n:
        raise ProblemError(f"{name} has {len(out)} entries but there are {n} segments; give one per segment")
    for i, v in enumerate(out):
        # bool is an int subclass: True must not pass for 1
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ProblemError(f"{name}[{i}] = {v!r} must be a non-negative int (bytes / ids)")
    return tuple(int(v) for v in out)  # type: ignore[call-overload]  # checked int-like just above


def _times(name: str, values: Sequence[float], n: int) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if len(out) != n:
        raise ProblemError(f"{name} has {len(out)} entries but there are {n} segments; give one per segment")
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0:
            raise ProblemError(f"{name}[{i}] = {v!r} must be a finite time >= 0 (seconds)")
    return out


@dataclass(frozen=True, kw_only=True)
class SharedParam:
    """A parameter read by several segments (e.g. an embedding tied to the LM head)."""

    name: str
    """Parameter name, for messages."""
    bytes: int
    """Upload-precision bytes; counted once in every stage that uses it."""
    grad_bytes: int
    """Gradient bytes (0 when frozen); counted once in every fused/backward stage that uses it."""
    segments: tuple[int, ...]
    """Ascending ids of the segments that read it."""

    def __post_init__(self) -> None:
        _ints(f"SharedParam {self.name!r} bytes", (self.bytes, self.grad_bytes))
        segs = _ints(f"SharedParam {self.name!r} segments", self.segments)
        if not segs or list(segs) != sorted(set(segs)):
            raise ProblemError(f"SharedParam {self.name!r}: segments {segs} must be non-empty, ascending, unique")
        object.__setattr__(self, "segments", segs)


@dataclass(frozen=True, kw_only=True)
class PartitionProblem:
    """A chain of segments with per-microbatch costs, and the machine to partition it for."""

    names: tuple[str, ...]
    """Segment labels such as ``layers.3.attn`` (messages only)."""
    layer: tuple[int, ...]
    """Layer id per segment, non-decreasing; the layer-granular baselines cut only where it changes."""
    fwd_s: tuple[float, ...]
    """Forward time per segment and microbatch (s)."""
    bwd_s: tuple[float, ...]
    """Backward time, recompute excluded (s)."""
    rec_s: tuple[float, ...]
    """Recompute time, paid by the backward stage when the segment is not saved (s)."""
    act_bytes: tuple[int, ...]
    """Bytes autograd keeps for the segment's backward (one microbatch, output included): shipped to host and back
    when saved, and resident on the device while its backward stage runs either way."""
    peak_bytes: tuple[int, ...]
    """Transient working bytes of the segment's forward without grad."""
    transient_bytes: tuple[int, ...] = ()
    """The most bytes one of the segment's nodes' backward allocates at once beside what the stage holds (its
    inputs' gradients, a cross-entropy's logits gradients): a fused or backward stage holds the largest of its
    segments' at one time, not their sum. Empty: none (0 for every segment)."""
    boundary_bytes: tuple[int, ...]
    """Bytes live across the cut after the segment (one microbatch); its gradient has the same size."""
    input_bytes: int
    """Bytes of the model inputs (the cut before segment 0)."""
    input_grad_bytes: int = 0
    """Bytes of their gradient, which the stage running segment 0's backward sends down (rows the host looked
    up in a trainable embedding, :mod:`rpcompile.passes.rewrite.host`; token ids have none)."""
    param_bytes: tuple[int, ...]
    """Bytes of parameters owned by the segment alone, in upload precision."""
    grad_bytes: tuple[int, ...]
    """Bytes of those parameters' gradients (0 for frozen ones)."""
    derived_bytes: tuple[int, ...] = ()
    """Bytes the segment's stages compute from its frozen weights once per stage and hold while they run (a 4-bit
    base's dequantized weights, :mod:`rpcompile.passes.rewrite.dequantize`): in every stage's memory beside its
    weights, never on the link (their time is in ``fwd_s``, spread over the microbatches:
    :func:`rpcompile.passes.formulate.partition_problem`). Empty: none (0 for every segment)."""
    shared: tuple[SharedParam, ...] = ()
    """Parameters read by several segments."""
    device_count: int
    """Number of devices N."""
    memory_bytes: int
    """Usable memory per device."""
    link_bytes_per_s: float
    """Host<->device bandwidth per device and direction (full duplex)."""
    microbatches: int
    """Microbatches per iteration m."""
    stage_overhead_s: float = 0.0
    """Fixed cost per stage and microbatch (launch, synchronisation)."""
    allow_save: bool = True
    """When False every segment is recomputed (``saved`` all False): the pure balance problem."""
    resident_handoffs: bool = False
    """One GPU: what a stage hands to the next (its outputs, a backward stage's input gradients, the input a
    backward stage recomputes from) stays in device memory and crosses no link (:meth:`link_in`,
    :meth:`link_out`); what the host reads still goes home and the model inputs still come up. The runtime keeps
    them within half of what the plan leaves free, and gives the lazy offload the other half."""
    allow_stay: bool = True
    """When False no weight stays on its device between stages (``stays`` empty, not ``resident``): every stage
    uploads its weights, as before weights could stay (:mod:`.stay_search`)."""
    host: HostLoad = HostLoad()
    """The host's work: gradient accumulation after each grad stage (in the iteration recurrence, not in a
    stage's per-microbatch price) and the optimizer step and copy refresh between iterations (a constant the
    solvers need not see). The default: none."""

    def __post_init__(self) -> None:
        n = len(self.names)
        if n < 1:
            raise ProblemError("a partition problem needs at least one segment")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        set_("names", tuple(str(x) for x in self.names))
        set_("layer", _ints("layer", self.layer, n))
        if any(b < a for a, b in zip(self.layer, self.layer[1:])):
            raise ProblemError(f"layer ids must be non-decreasing along the chain, got {self.layer}")
        for key in ("fwd_s", "bwd_s", "rec_s"):
            set_(key, _times(key, getattr(self, key), n))
        # empty means none: one zero per segment, so that every consumer can index them
        set_("transient_bytes", self.transient_bytes or (0,) * n)
        set_("derived_bytes", self.derived_bytes or (0,) * n)
        for key in ("act_bytes", "peak_bytes", "transient_bytes", "boundary_bytes", "param_bytes", "grad_bytes",
                    "derived_bytes"):
            set_(key, _ints(key, getattr(self, key), n))
        set_("input_bytes", _ints("input_bytes", (self.input_bytes,))[0])
        set_("input_grad_bytes", _ints("input_grad_bytes", (self.input_grad_bytes,))[0])
        set_("shared", tuple(self.shared))
        for p in self.shared:
            if not isinstance(p, SharedParam) or p.segments[-1] >= n:
                raise ProblemError(f"shared parameter {p!r} must be a SharedParam naming segments < {n}")
        if self.device_count < 1 or self.microbatches < 1:
            raise ProblemError(f"device_count={self.device_count} and microbatches={self.microbatches} must be >= 1")
        if self.memory_bytes < 0 or not self.link_bytes_per_s > 0 or not math.isfinite(self.link_bytes_per_s):
            raise ProblemError(
                f"memory_bytes={self.memory_bytes} must be >= 0 and link_bytes_per_s={self.link_bytes_per_s} "
                "a finite positive rate"
            )
        if not isinstance(self.host, HostLoad):
            raise ProblemError(f"host must be a HostLoad, got {type(self.host).__name__}")
        if not (math.isfinite(self.stage_overhead_s) and self.stage_overhead_s >= 0):
            raise ProblemError(f"stage_overhead_s={self.stage_overhead_s} must be a finite time >= 0")

    @property
    def n(self) -> int:
        """Number of segments."""
        return len(self.names)

    def digest(self) -> str:
        """16 hex digits of sha256 over the exact ``repr`` of every field (floats round-trip): the problem a plan and a
        solve cache entry record."""
        d = dataclasses.asdict(self)
        if not any(d.get("derived_bytes", ())):  # none held (no 4-bit base): the digest problems had before the field
            d.pop("derived_bytes", None)
        return short_digest(repr(d))

    def in_bytes(self, a: int) -> int:
        """Bytes entering a stage that starts at segment ``a``."""
        return self.input_bytes if a == 0 else self.boundary_bytes[a - 1]

    def link_in(self, a: int) -> int:
        """Bytes of :meth:`in_bytes` that come over the link: the model inputs (``a = 0``) always, a hand-off from
        the stage before unless it stays on the device (:attr:`resident_handoffs`)."""
        return 0 if self.resident_handoffs and a > 0 else self.in_bytes(a)

    def link_out(self, b: int) -> int:
        """Bytes live across the cut after segment ``b − 1`` that go down to the host for the next stage (0 when
        hand-offs stay on the device)."""
        return 0 if self.resident_handoffs else self.boundary_bytes[b - 1]

    def weight(self, a: int, b: int, *, grads: bool = False) -> int:
        """Weight (or gradient) bytes of the range ``[a, b)``; shared parameters count once."""
        own = self.grad_bytes if grads else self.param_bytes
        total = sum(own[a:b])
        for p in self.shared:
            if any(a <= s < b for s in p.segments):
                total += p.grad_bytes if grads else p.bytes
        return total


@dataclass(frozen=True, kw_only=True)
class SegmentPlan:
    """Where the chain is cut, as half-open segment ranges, and what is saved (see the module docstring)."""

    forward: tuple[tuple[int, int], ...]
    """F0..F(f-1), ascending, covering ``[0, fused[0])``."""
    fused: tuple[int, int]
    """``[fused[0], n)``: forward + loss + backward, nothing saved or recomputed."""
    backward: tuple[tuple[int, int], ...]
    """B1..B(b-1), descending, covering ``[0, fused[0])``: the first ends at ``fused[0]``, the last starts at 0."""
    saved: tuple[bool, ...]
    """Per segment: activations saved to host (True) or recomputed (False); False inside the fused range."""
    stays: tuple[bool, ...] = ()
    """Per segment: its own parameters stay on the device from its forward stage to its backward stage (True);
    empty when none does (a plan with all False is stored that way, so equal plans compare equal)."""
    resident: bool = False
    """Every weight stays on its device across iterations: uploaded once, refreshed after optimizer steps only
    (one device, or stages a multiple of the devices, so that each stage returns to its device)."""
    accumulates: tuple[bool, ...] = ()
    """Per segment: the gradients of its own parameters stay on its grad stage's device during calls under
    ``pipe.no_sync()``, summed there, and go home with the next call outside it; empty when none do."""

    def __post_init__(self) -> None:
        pair = lambda r: (int(r[0]), int(r[1]))  # noqa: E731
        object.__setattr__(self, "forward", tuple(pair(r) for r in self.forward))
        object.__setattr__(self, "backward", tuple(pair(r) for r in self.backward))
        object.__setattr__(self, "fused", pair(self.fused))
        object.__setattr__(self, "saved", tuple(bool(s) for s in self.saved))
        stays = tuple(bool(s) for s in self.stays)
        object.__setattr__(self, "stays", stays if any(stays) else ())
        object.__setattr__(self, "resident", bool(self.resident))
        acc = tuple(bool(s) for s in self.accumulates)
        object.__setattr__(self, "accumulates", acc if any(acc) else ())

    @property
    def stage_count(self) -> int:
        """Total number of stages S."""
        return len(self.forward) + 1 + len(self.backward)


@dataclass(frozen=True, kw_only=True)
class PartitionResult:
    """What every strategy returns; an infeasible problem is a result (``feasible=False``), not an exception."""

    strategy: str
    feasible: bool
    plan: SegmentPlan | None
    objective: float
    """Predicted iteration time (s) by :func:`.timing.iteration_time`; ``inf`` when infeasible."""
    solve_time_s: float
    stats: dict[str, Any] = field(default_factory=dict)
    cached: bool = False
    """From the solve cache (:mod:`rpcompile.passes.solve_cache`), not solved now; ``solve_time_s`` is then the first
    solve's."""

    def require_plan(self) -> SegmentPlan:
        """The plan, or :class:`rpcompile.core.errors.InfeasibleError` with the solver's reason when there is none."""
        if self.feasible and self.plan is not None:
            return self.plan
        reason = self.stats.get("reason") or "; ".join(self.stats.get("violations", ())) or "no plan"
        raise InfeasibleError(f"{self.strategy}: {reason}")


def plan_stages(plan: SegmentPlan) -> list[tuple[StageKind, int, int]]:
    """The stages in execution order ``[F0.., FB, B1..]`` as ``(kind, start, stop)``."""
    stages: list[tuple[StageKind, int, int]] = [("forward", a, b) for a, b in plan.forward]
    stages.append(("fused", plan.fused[0], plan.fused[1]))
    stages.extend(("backward", a, b) for a, b in plan.backward)
    return stages
