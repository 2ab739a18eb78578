"""The partition problem as plain numbers, the plan the solvers return, and the one timing model that scores them.

Terms (DESIGN.md §3; RoundPipe, Luo et al., arXiv 2604.27085):

- A **segment** is a run of graph nodes between cheap cut points; the model is a *chain* of ``n`` segments
  (the coarsener linearises DAGs: tensors live across a cut, e.g. skip connections, are in ``boundary_bytes``).
- A **plan** (:class:`SegmentPlan`) cuts the chain three ways: forward stages ``F0..F(f-1)`` cover
  ``[0, fused[0])`` in ascending order, one **fused** stage ``FB = [fused[0], n)`` runs forward, loss and backward
  in one go, and backward stages ``B1..`` cover ``[0, fused[0])`` in *descending* order. Forward and backward cuts
  are independent. ``saved[i]`` says whether segment ``i``'s activations go to host memory in the forward pass
  (``True``) or are recomputed by its backward stage (``False``) — the checkpointing choice of Checkmate
  (Jain et al., MLSys 2020), made per segment.
- Stage ``k`` of ``[F0.., FB, B1..]`` runs on device ``k mod N`` for every microbatch in turn.

**Stage time** (per microbatch) is ``stage_overhead_s + max(compute, upload/link, download/link)``: copies run on
their own streams and the host link is full duplex, so a stage is as slow as its slowest resource. That is the
solvers' per-stage model; the exact model (:func:`stage_costs`, :func:`iteration_time`) refines it for the
runtime's **lazy offload** (:func:`offload_backlog`): a forward stage's saved activations, which nobody in the
forward pass waits for, go down while the device runs its later stages, within the memory its stages leave free,
so a forward stage waits only for the copies of its outputs.
**Stage memory** is ``W + G + P + working`` with ``W``/``G`` the stage's weight/gradient bytes (a shared parameter
counts once per stage using it), ``P`` the largest ``W`` of any stage in the plan (the next stage's weights are
prefetched during this one; conservative), ``working`` one microbatch's live tensors (for a forward stage also
the activations it saves, held until they are copied to the host) and ``buffers`` what double buffering keeps
beside them so that copies overlap compute: a forward stage's previous saved activations still going down, a
backward stage's next input and saved activations already coming up. Forward stages compute no
gradients, so their ``G`` is 0 (the only place this model departs from a literal ``W + G + P + working``).
**Iteration time** is the exact event recurrence of :func:`pipeline_time` — with equal stage times it reduces to
DESIGN §3's ``(⌊(S−1)/N⌋·m + (S−1) mod N + m)·T`` for ``m ≥ N`` — with the transfers that compute may not
hide (:func:`transfer_edges`): a stage starts only once its weights are up — prefetched while the device runs its
previous stage, with what bandwidth that stage's activation copies leave, so a short or upload-bound stage before
a heavy one exposes the rest of the copy, and from the start of the
iteration for the first stage of each device (the optimizer step between iterations changes the weights) — and
the iteration ends only once every stage's gradients are down. Without them the model was up to 9% (llama-1.7b)
and 17% (the MoE, whose ILP plans put short stages before heavy ones) shorter than the simulator. And a
microbatch reaches the next stage only after its hand-off through host memory — the tensors it waits for go down
from one device and up to the next (``handoff_bytes``, both links' time): one hand-off per stage lies on the
fill's and the drain's critical path, so a cut across a wide tensor (inside an MLP) lengthens both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np

__all__ = [
    "SharedParam",
    "PartitionProblem",
    "SegmentPlan",
    "StageCost",
    "PartitionResult",
    "plan_stages",
    "stage_costs",
    "pipeline_time",
    "transfer_edges",
    "offload_backlog",
    "equal_time_factor",
    "equal_time_factors",
    "iteration_time",
    "plan_memory",
    "bubble_fraction",
    "validate_segment_plan",
    "min_feasible_memory",
]

StageKind = Literal["forward", "fused", "backward"]


def _ints(name: str, values: Sequence[int], n: int | None = None) -> tuple[int, ...]:
    out = tuple(values)
    if n is not None and len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but there are {n} segments; give one per segment")
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name}[{i}] = {v!r} must be a non-negative int (bytes / ids)")
    return tuple(int(v) for v in out)


def _times(name: str, values: Sequence[float], n: int) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but there are {n} segments; give one per segment")
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{i}] = {v!r} must be a finite time >= 0 (seconds)")
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
            raise ValueError(f"SharedParam {self.name!r}: segments {segs} must be non-empty, ascending, unique")
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
    boundary_bytes: tuple[int, ...]
    """Bytes live across the cut after the segment (one microbatch); its gradient has the same size."""
    input_bytes: int
    """Bytes of the model inputs (the cut before segment 0)."""
    input_grad_bytes: int = 0
    """Bytes of their gradient, which the stage running segment 0's backward sends down (rows the host looked
    up in a trainable embedding, :mod:`.host`; token ids have none)."""
    param_bytes: tuple[int, ...]
    """Bytes of parameters owned by the segment alone, in upload precision."""
    grad_bytes: tuple[int, ...]
    """Bytes of those parameters' gradients (0 for frozen ones)."""
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

    def __post_init__(self) -> None:
        n = len(self.names)
        if n < 1:
            raise ValueError("a partition problem needs at least one segment")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        set_("names", tuple(str(x) for x in self.names))
        set_("layer", _ints("layer", self.layer, n))
        if any(b < a for a, b in zip(self.layer, self.layer[1:])):
            raise ValueError(f"layer ids must be non-decreasing along the chain, got {self.layer}")
        for key in ("fwd_s", "bwd_s", "rec_s"):
            set_(key, _times(key, getattr(self, key), n))
        for key in ("act_bytes", "peak_bytes", "boundary_bytes", "param_bytes", "grad_bytes"):
            set_(key, _ints(key, getattr(self, key), n))
        set_("input_bytes", _ints("input_bytes", (self.input_bytes,))[0])
        set_("input_grad_bytes", _ints("input_grad_bytes", (self.input_grad_bytes,))[0])
        set_("shared", tuple(self.shared))
        for p in self.shared:
            if not isinstance(p, SharedParam) or p.segments[-1] >= n:
                raise ValueError(f"shared parameter {p!r} must be a SharedParam naming segments < {n}")
        if self.device_count < 1 or self.microbatches < 1:
            raise ValueError(f"device_count={self.device_count} and microbatches={self.microbatches} must be >= 1")
        if self.memory_bytes < 0 or not self.link_bytes_per_s > 0 or not math.isfinite(self.link_bytes_per_s):
            raise ValueError(
                f"memory_bytes={self.memory_bytes} must be >= 0 and link_bytes_per_s={self.link_bytes_per_s} "
                "a finite positive rate"
            )
        if not (math.isfinite(self.stage_overhead_s) and self.stage_overhead_s >= 0):
            raise ValueError(f"stage_overhead_s={self.stage_overhead_s} must be a finite time >= 0")

    @property
    def n(self) -> int:
        """Number of segments."""
        return len(self.names)

    def in_bytes(self, a: int) -> int:
        """Bytes entering a stage that starts at segment ``a``."""
        return self.input_bytes if a == 0 else self.boundary_bytes[a - 1]

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

    def __post_init__(self) -> None:
        pair = lambda r: (int(r[0]), int(r[1]))  # noqa: E731
        object.__setattr__(self, "forward", tuple(pair(r) for r in self.forward))
        object.__setattr__(self, "backward", tuple(pair(r) for r in self.backward))
        object.__setattr__(self, "fused", pair(self.fused))
        object.__setattr__(self, "saved", tuple(bool(s) for s in self.saved))

    @property
    def stage_count(self) -> int:
        """Total number of stages S."""
        return len(self.forward) + 1 + len(self.backward)


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """One stage as the timing model sees it (per microbatch unless said otherwise)."""

    kind: StageKind
    start: int
    stop: int
    compute_s: float
    """Forward, backward and recompute time."""
    upload_bytes: float
    """Host->device bytes (weights amortised over the microbatches)."""
    download_bytes: float
    """Device->host bytes (gradients amortised over the microbatches)."""
    time_s: float
    """``overhead + max(compute, upload/link, download/link)``."""
    memory_bytes: int
    """``W + G + P + working + buffers`` (whole stage, not per microbatch)."""
    weight_bytes: int = 0
    grad_bytes: int = 0
    working_bytes: int = 0
    """One microbatch's live tensors (the ``working`` term of ``memory_bytes``)."""
    prefetch_bytes: int = 0
    """Part of ``upload_bytes`` already in host memory before the stage's producer runs (backward stages: the
    saved activations and the forward input they recompute from), so it can be uploaded ahead."""
    offload_bytes: int = 0
    """Part of ``download_bytes`` no later stage of this pass waits for (forward stages: saved activations)."""
    overhead_s: float = 0.0
    """The fixed per-microbatch cost in ``time_s`` (``stage_overhead_s``)."""
    handoff_bytes: int = 0
    """What a microbatch waits for from the stage before (per microbatch): a forward or fused stage's inputs, a
    backward stage's output gradients. 0 for the first stage (its inputs are in host memory already)."""
    buffer_bytes: int = 0
    """The ``buffers`` term of ``memory_bytes`` (double buffering beside the working set)."""
    backlog_bytes: int = 0
    """Most saved activations of this device's forward stages still waiting to go down while the stage runs (lazy
    offload, :func:`offload_backlog`). Not in ``memory_bytes``: the backlog only fills what the device's stages
    leave free, so ``memory_bytes + backlog_bytes`` stays within the limit too."""


@dataclass(frozen=True, kw_only=True)
class PartitionResult:
    """What every strategy returns; an infeasible problem is a result (``feasible=False``), not an exception."""

    strategy: str
    feasible: bool
    plan: SegmentPlan | None
    objective: float
    """Predicted iteration time (s) by :func:`iteration_time`; ``inf`` when infeasible."""
    solve_time_s: float
    stats: dict[str, Any] = field(default_factory=dict)

    def require_plan(self) -> SegmentPlan:
        """The plan, or :class:`rpcompile.core.errors.InfeasibleError` with the solver's reason when there is none."""
        if self.feasible and self.plan is not None:
            return self.plan
        from rpcompile.core.errors import InfeasibleError  # local: keeps the solver free of the package's imports

        reason = self.stats.get("reason") or "; ".join(self.stats.get("violations", ())) or "no plan"
        raise InfeasibleError(f"{self.strategy}: {reason}")


def plan_stages(plan: SegmentPlan) -> list[tuple[StageKind, int, int]]:
    """The stages in execution order ``[F0.., FB, B1..]`` as ``(kind, start, stop)``."""
    stages: list[tuple[StageKind, int, int]] = [("forward", a, b) for a, b in plan.forward]
    stages.append(("fused", plan.fused[0], plan.fused[1]))
    stages.extend(("backward", a, b) for a, b in plan.backward)
    return stages


def _stage(pb: PartitionProblem, kind: StageKind, a: int, b: int, saved: Sequence[bool], p: int) -> StageCost:
    m, link, seg = pb.microbatches, pb.link_bytes_per_s, range(a, b)
    w, g = pb.weight(a, b), pb.weight(a, b, grads=True)
    inb, outb = pb.in_bytes(a), pb.boundary_bytes[b - 1]
    grad_in = inb if a > 0 else pb.input_grad_bytes
    act = sum(pb.act_bytes[i] for i in seg)
    saved_act = sum(pb.act_bytes[i] for i in seg if saved[i])
    prefetch = offload = buffers = 0
    handoff = inb if a > 0 else 0
    if kind == "forward":
        g = 0
        compute = sum(pb.fwd_s[i] for i in seg)
        up, down, offload = inb + w / m, outb + saved_act, saved_act
        # the activations it saves pile up on the device during the microbatch; the previous microbatch's are
        # still being copied out meanwhile (double buffering, so the copy overlaps the compute)
        working = inb + outb + max(pb.peak_bytes[i] for i in seg) + saved_act
        buffers = saved_act
    elif kind == "fused":
        compute = sum(pb.fwd_s[i] + pb.bwd_s[i] for i in seg)
        up, down = inb + w / m, grad_in + g / m
        working = inb + outb + act
    else:
        compute = sum(pb.bwd_s[i] + (0.0 if saved[i] else pb.rec_s[i]) for i in seg)
        up, down, prefetch = inb + outb + saved_act + w / m, grad_in + g / m, inb + saved_act
        working = inb + outb + act
        buffers = inb + saved_act  # the next microbatch's input and saved activations, prefetched
        handoff = outb  # the gradients of its outputs, from the stage above
    time = pb.stage_overhead_s + max(compute, up / link, down / link)  # eager copies; see offload_backlog
    return StageCost(kind=kind, start=a, stop=b, compute_s=compute, upload_bytes=up, download_bytes=down,
                     time_s=time, memory_bytes=w + g + p + working + buffers, weight_bytes=w, grad_bytes=g,
                     working_bytes=working, prefetch_bytes=prefetch, offload_bytes=offload,
                     overhead_s=pb.stage_overhead_s, handoff_bytes=handoff, buffer_bytes=buffers)


def stage_costs(problem: PartitionProblem, plan: SegmentPlan, *, lazy_offload: bool = True) -> tuple[StageCost, ...]:
    """Cost of every stage of a structurally valid plan, in execution order. ``lazy_offload=False``: each stage
    on its own, its saved activations copied out while it runs (the solvers' per-stage model, which
    :func:`offload_backlog` refines)."""
    stages = plan_stages(plan)
    prefetch = max(problem.weight(a, b) for _, a, b in stages)
    costs = tuple(_stage(problem, kind, a, b, plan.saved, prefetch) for kind, a, b in stages)
    return offload_backlog(problem, costs) if lazy_offload else costs


def offload_backlog(problem: PartitionProblem, costs: Sequence[StageCost]) -> tuple[StageCost, ...]:
    """The stages as they run when saved activations go down lazily (the runtime's and the simulator's policy).

    Nobody in the forward pass waits for a forward stage's saved activations, so the stage need not wait for
    them either: what its link cannot move while it computes stays on the device and goes down later, when the
    device runs stages that download little (backward stages download only gradients). Each device is walked
    through its stages in order with that backlog ``B`` (bytes): a forward stage's time counts only the copies
    others wait for, and a stage of per-microbatch time ``t`` moves
    ``m·((t − overhead)·link − d)`` bytes of it, ``d`` being what it downloads itself and others wait for (a
    forward stage's outputs; a backward stage's input gradients and its weight gradients), and a forward stage
    adds its ``m·saved``. The backlog may use only the memory every stage of the device leaves free
    (``limit − max_k memory_k``), so no stage's own memory is given up for it; a forward stage whose saves do
    not fit that room takes as long as its link needs to keep the backlog there — at most what it took with
    eager copies, unless it also drains an earlier stage's backlog. ``backlog_bytes`` is the most a stage holds
    (beside its ``memory_bytes``; the runtime bounds the backlog the same way, :mod:`rpcompile.runtime.offload`).
    Stage weights prefetched during a stage (``P``) are the plan's largest. When each microbatch's saves land in
    host memory, and the backward stages that wait for them, are :func:`pipeline_time`'s landing edges
    (:func:`transfer_edges` given the plan's ``saved`` flags)."""
    out = list(costs)
    for k, (time, held) in enumerate(zip(*_lazy_offload(problem, costs))):
        c = costs[k]
        if time != c.time_s or held or c.backlog_bytes:
            out[k] = dataclasses.replace(c, time_s=time, backlog_bytes=int(math.ceil(held)))
    return tuple(out)


def _lazy_offload(problem: PartitionProblem, costs: Sequence[StageCost]):
    """:func:`offload_backlog`'s walk as plain numbers: per stage its time and the backlog it holds at most (the
    local search calls this thousands of times: no objects)."""
    n_dev, m, link = problem.device_count, problem.microbatches, problem.link_bytes_per_s
    times = [c.time_s for c in costs]
    if not any(c.offload_bytes for c in costs):
        return times, [0.0] * len(costs)
    prefetch = max(c.weight_bytes for c in costs)
    base = [c.weight_bytes + c.grad_bytes + prefetch + c.working_bytes + c.buffer_bytes for c in costs]
    held_at = [0.0] * len(costs)
    for d in range(n_dev):
        mine = range(d, len(costs), n_dev)
        room = max(0, problem.memory_bytes - max((base[k] for k in mine), default=0))
        backlog = 0.0
        for k in mine:
            c = costs[k]
            own = c.download_bytes - c.offload_bytes  # what the stage waits for itself, per microbatch
            start = backlog
            if c.offload_bytes:
                need = start + m * c.offload_bytes - room  # bytes the stage must move to keep the backlog in room
                times[k] = c.overhead_s + max(c.compute_s, c.upload_bytes / link, (max(need / m, 0.0) + own) / link)
            moved = m * max(0.0, (times[k] - c.overhead_s) * link - own)
            backlog = max(0.0, start + m * c.offload_bytes - moved)
            held_at[k] = max(start, backlog)
    return times, held_at


def pipeline_time(stage_times: Sequence[float], devices: int, microbatches: int, *,
                  weight_s: Sequence[float] = (), grad_s: Sequence[float] = (),
                  handoff_s: Sequence[float] = (), out_s: Sequence[float] = (), save_s: Sequence[float] = (),
                  reads: Sequence[Sequence[int]] = (), prefetch_s: Sequence[float] = ()) -> float:
    """Iteration time of the round-robin schedule (DESIGN §3) by the exact event recurrence.

    Microbatch ``j`` of stage ``k`` starts at ``max(e(k, j-1), e(k-1, j), e(k-N, m-1))`` (0 for negative
    indices) and ends ``t_k`` later. Along ``j`` this is a max-plus scan, so each stage is one vectorised step:
    ``e(k, j) = (j+1)·t_k + max_{i<=j}(a_i − i·t_k)`` with ``a_i = max(e(k-1, i), e(k-N, m-1))``.

    Optional transfer edges (default 0): ``weight_s[k]``, the upload time of stage ``k``'s weights, which start
    going up when the device's previous stage ``k−N`` starts (at 0 for the first stage of each device) and must
    be in before ``k`` starts; ``grad_s[k]``, the download time of its gradients after its last microbatch,
    which the iteration waits for; ``handoff_s[k]`` (``k ≥ 1``), the latency between stage ``k−1`` finishing a
    microbatch and stage ``k`` having it (``e(k−1, j)`` becomes ``e(k−1, j) + handoff_s[k]`` above).

    Saved activations going down lazily (:func:`offload_backlog`): a stage with ``save_s[f] > 0`` sends its
    outputs down (``out_s[f]`` per microbatch) and then its saves (``save_s[f]``), one microbatch after the other
    on its link, so microbatch ``j``'s saves land at ``l(f, j) = max(l(f, j−1), e(f, j) + out_s[f]) + save_s[f]``
    (the latest stage's saves go first, so older backlog does not delay them); a stage that ``reads`` them
    starts ``j`` no earlier than ``l(f, j) + prefetch_s[k]`` (it uploads them before it computes).
    """
    ends = _stage_ends(stage_times, devices, microbatches, weight_s, handoff_s, out_s, save_s, reads, prefetch_s)
    return max((e + (grad_s[k] if k < len(grad_s) else 0.0) for k, e in enumerate(ends)), default=0.0)


def _stage_ends(stage_times: Sequence[float], devices: int, m: int, weight_s: Sequence[float] = (),
                handoff_s: Sequence[float] = (), out_s: Sequence[float] = (), save_s: Sequence[float] = (),
                reads: Sequence[Sequence[int]] = (), prefetch_s: Sequence[float] = ()) -> list[float]:
    """``e(k, m-1)`` for every stage ``k``: when each stage finishes its last microbatch.

    A plain loop over microbatches (the planner's local search calls this thousands of times on short vectors,
    where it is several times faster than array operations): microbatch ``j`` starts once the stage finished
    ``j−1`` and stage ``k−1``'s ``j`` has been handed over (and the saves it reads have landed); the first one also
    waits for the device (``floor``)."""
    prev = [0.0] * m
    last: list[float] = []
    began: list[float] = []  # when each stage's first microbatch started
    landed: dict[int, list[float]] = {}  # stage -> when each microbatch's saves are in host memory
    for k, t in enumerate(stage_times):
        up = weight_s[k] if k < len(weight_s) else 0.0
        h = handoff_s[k] if 0 < k < len(handoff_s) else 0.0  # the first stage has no one to wait for
        floor = max(last[k - devices], began[k - devices] + up) if k >= devices else up
        ready = [p + h for p in prev] if h else prev
        if k < len(reads) and reads[k]:
            pre = prefetch_s[k] if k < len(prefetch_s) else 0.0
            for f in reads[k]:
                if f not in landed:  # it saved 0 bytes: nothing to wait for
                    continue
                gate = [x + pre for x in landed[f]]
                ready = [r if r > g else g for r, g in zip(ready, gate)]
        start = max(ready[0], floor)
        began.append(start)
        end = start + t
        ends = [end]
        for r in ready[1:]:
            end = (r if r > end else end) + t
            ends.append(end)
        if k < len(save_s) and save_s[k] > 0:
            out, save, land, lands = (out_s[k] if k < len(out_s) else 0.0), save_s[k], 0.0, []
            for e in ends:
                e += out
                land = (land if land > e else e) + save
                lands.append(land)
            landed[k] = lands
        prev = ends
        last.append(end)
    return last


def equal_time_factor(stages: int, devices: int, microbatches: int) -> int:
    """``c(S)``: iteration time in units of ``T`` when all ``S`` stages take ``T`` (non-decreasing in ``S``)."""
    return equal_time_factors(stages, devices, microbatches)[stages]


def equal_time_factors(max_stages: int, devices: int, microbatches: int) -> list[int]:
    """``[c(0), c(1), ..., c(max_stages)]`` in one pass (``c(0) = 0``)."""
    return [0] + [round(e) for e in _stage_ends([1.0] * max_stages, devices, microbatches)]


def transfer_edges(problem: PartitionProblem, costs: Sequence[StageCost], times: Sequence[float] | None = None,
                   saved: Sequence[bool] | None = None) -> dict[str, list]:
    """:func:`pipeline_time`'s transfer edges for these stages: each stage's whole weight upload
    (:func:`_weight_time`) and gradient download, and each microbatch's hand-off (down from the previous device,
    up to this one), at the link rate; with the plan's ``saved`` flags also when saved activations land in host
    memory and who waits for them. ``times``: the stages' times when they differ from ``time_s``."""
    link = problem.link_bytes_per_s
    times = [c.time_s for c in costs] if times is None else times
    handoff = []
    for k, c in enumerate(costs):
        one_way = c.handoff_bytes / link
        # a predecessor slower than its compute is bound by its copies: its time already covers the way down
        prev = costs[k - 1]
        slack = times[k - 1] - prev.compute_s - prev.overhead_s if k else 0.0
        handoff.append(2 * one_way - min(one_way, max(slack, 0.0)))
    weight_s = [_weight_time(problem, costs, times, k) for k in range(len(costs))]
    edges: dict[str, list] = dict(weight_s=weight_s, grad_s=[c.grad_bytes / link for c in costs],
                                  handoff_s=handoff)
    if saved is not None and any(c.offload_bytes for c in costs):
        edges.update(out_s=[(c.download_bytes - c.offload_bytes) / link for c in costs],
                     save_s=[c.offload_bytes / link for c in costs], reads=save_reads(costs, saved),
                     prefetch_s=[c.prefetch_bytes / link for c in costs])
    return edges


def _weight_time(problem: PartitionProblem, costs: Sequence[StageCost], times: Sequence[float], k: int) -> float:
    """How long stage ``k``'s weights take to go up, from the start of the device's previous stage ``k − N`` (from
    the start of the iteration, at the link rate, for a device's first stage). They go up behind that stage's
    activation copies (the runtime's priority, :meth:`rpcompile.runtime.devices.Device.upload_weights`): at the
    rate those leave free, ``link − a/t`` for a stage uploading ``a`` activation bytes per microbatch of time ``t``,
    for its ``m·t``, then at the full rate. A stage bound by its uploads leaves nothing: its successor on the
    device waits for its whole weight upload after it."""
    link, m, w = problem.link_bytes_per_s, problem.microbatches, costs[k].weight_bytes
    if k < problem.device_count or w == 0:
        return w / link
    prev, t = costs[k - problem.device_count], times[k - problem.device_count]
    busy = max(0.0, prev.upload_bytes - prev.weight_bytes / m) / max(t - prev.overhead_s, 1e-12)
    free, span = max(0.0, link - busy), m * t
    return w / free if free * span >= w else span + (w - free * span) / link


def save_reads(costs: Sequence[StageCost], saved: Sequence[bool]) -> list[tuple[int, ...]]:
    """Per stage, the forward stages whose saved activations it reads (backward stages; ``()`` for the others)."""
    count = [0]  # saved segments before each index
    for flag in saved:
        count.append(count[-1] + flag)
    savers = [(f, c.start, c.stop) for f, c in enumerate(costs) if c.kind == "forward" and c.offload_bytes]
    out: list[tuple[int, ...]] = []
    for c in costs:
        if c.kind != "backward":
            out.append(())
            continue
        out.append(tuple(f for f, a, b in savers
                         if a < c.stop and c.start < b and count[min(b, c.stop)] > count[max(a, c.start)]))
    return out


def _total(problem: PartitionProblem, costs: Sequence[StageCost], saved: Sequence[bool]) -> float:
    """Exact iteration time of the stages (costed on their own, or already through :func:`offload_backlog`: the
    walk gives the same times either way) with their transfer edges; the local search calls it on cached stages."""
    times = _lazy_offload(problem, costs)[0]
    return pipeline_time(times, problem.device_count, problem.microbatches,
                         **transfer_edges(problem, costs, times, saved))


def iteration_time(problem: PartitionProblem, plan: SegmentPlan) -> float:
    """Predicted time of one training iteration (s): the pipeline plus its exposed fill and drain transfers."""
    return _total(problem, stage_costs(problem, plan, lazy_offload=False), plan.saved)


def plan_memory(problem: PartitionProblem, plan: SegmentPlan) -> int:
    """Peak memory any device needs under ``plan`` (bytes): the largest stage ``W + G + P + working``."""
    return max(c.memory_bytes for c in stage_costs(problem, plan))


def bubble_fraction(problem: PartitionProblem, plan: SegmentPlan) -> float:
    """Idle device time over ``N × iteration``: ``1 − m·Σ t_k / (N · iteration)``."""
    costs = stage_costs(problem, plan)
    total = _total(problem, costs, plan.saved)
    busy = problem.microbatches * sum(c.time_s for c in costs)
    return 1.0 - busy / (problem.device_count * total) if total > 0 else 0.0


def min_feasible_memory(problem: PartitionProblem) -> tuple[int, int]:
    """The smallest ``memory_bytes`` for which some plan fits, and the segment that sets it.

    Usually the plan of single-segment stages; computed exactly over all plans by :mod:`.tables`. The segment
    returned is the most demanding single segment of the binding stage (name it in "does not fit" messages).
    """
    from .tables import RangeTables, min_memory  # local: tables imports this module for its types

    return min_memory(RangeTables.build(problem))


def validate_segment_plan(problem: PartitionProblem, plan: SegmentPlan, *, memory: bool = True) -> list[str]:
    """Every rule ``plan`` breaks, one message each (empty when valid). Rules:

    1. ``fused = (a, n)`` with ``0 <= a < n``.
    2. ``forward`` ranges are non-empty, ascending and contiguous, from 0 to ``a``.
    3. ``backward`` ranges are non-empty, descending and contiguous, from ``a`` down to 0.
    4. ``saved`` has one flag per segment, all False in the fused range (and everywhere when saving is off).
    5. (``memory=True``) every stage fits ``memory_bytes``.
    """
    from .validate import structural_violations, memory_violations

    problems = structural_violations(problem, plan)
    if memory and not problems:
        problems = memory_violations(problem, plan, stage_costs(problem, plan))
    return problems
