"""The timing model: what a :class:`~.problem.SegmentPlan` costs, stage by stage and per iteration.

- *stage time*: one microbatch on a stage, ``stage_overhead_s + max(compute, upload/link, download/link)``;
  *stage memory*: ``W + G + P + working`` (both :func:`stage_cost`, with the weights that stay);
- *lazy offload*: a forward stage's saved activations going down while its device runs later stages
  (:func:`offload_backlog`), which the solvers' per-stage model (:mod:`.tables`) leaves out;
- *iteration time*: the exact event recurrence over the stages (:func:`pipeline_time`: the host's accumulation
  and the data-parallel all-reduce too) with the transfers compute may not hide (:func:`transfer_edges`), then the
  optimizer step (:func:`iteration_time`).

Each stage is a :class:`~rpcompile.core.stages.StageCost`, the type the simulator plays too. The solvers re-score
every plan they meet by :func:`iteration_time`; lowering reads :func:`stage_costs` and :func:`host_times`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from rpcompile.core.stages import StageCost, StageKind

from .problem import PartitionProblem, SegmentPlan, plan_stages
from .figures import lazy_times, reads_of, saved_counts, stage_figures, transfer_times, walk
from .recurrence import pipeline_end, stage_ends
from .stays import NO_STAY, StayFigures, stay_figures

__all__ = [
    "stage_cost",
    "stage_costs",
    "pipeline_time",
    "transfer_edges",
    "offload_backlog",
    "save_reads",
    "iteration_time",
    "plan_memory",
    "bubble_fraction",
    "host_times",
    "overlapped_period",
    "no_sync_time",
]


def stage_cost(pb: PartitionProblem, kind: StageKind, a: int, b: int, saved: Sequence[bool], p: int,
               stay: StayFigures = NO_STAY, deferred: bool = False) -> StageCost:
    """One stage's costs: segments ``a..b-1`` of ``pb`` run as ``kind`` with ``saved`` flags, ``p`` prefetched,
    ``stay`` its weights found or kept on the device, ``deferred`` its gradients held back (no_sync).

    **Stage time** (per microbatch) is ``stage_overhead_s + max(compute, upload/link, download/link)``: copies run
    on their own streams and the host link is full duplex, so a stage is as slow as its slowest resource.
    ``compute`` is the sum of its segments' times, each already the longer of its kernels and its host's dispatch
    (:func:`rpcompile.passes.formulate.launch_bound`); ``stage_overhead_s`` is the runtime's own work per action.
    On one GPU the hand-offs between stages stay in device memory (``problem.resident_handoffs``): only the model
    inputs and what the host reads cross the link (:meth:`.problem.PartitionProblem.link_in`, ``link_out``). That
    is the solvers' per-stage model (:mod:`.tables` prices every range that way at once); the exact model
    (:func:`stage_costs`, :func:`iteration_time`) refines it for the runtime's **lazy offload**
    (:func:`offload_backlog`): a forward stage's saved activations, which nobody in the forward pass waits for, go
    down while the device runs its later stages, within the memory its stages leave free, so a forward stage waits
    only for the copies of its outputs.

    **Stage memory** is ``W + G + P + working`` with ``W``/``G`` the stage's weight/gradient bytes (a shared
    parameter counts once per stage using it), ``P`` the largest ``W`` of any stage in the plan (the next stage's
    weights are prefetched during this one; conservative), ``working`` one microbatch's live tensors (for a
    forward stage also the activations it saves, held until they are copied to the host) and ``buffers`` what
    double buffering keeps beside them so that copies overlap compute: a forward stage's previous saved
    activations still going down, a backward stage's next input and saved activations already coming up. A fused
    or backward stage's ``working`` also holds the largest backward transient of its segments
    (``transient_bytes``: what one node's backward allocates beside the saved tensors, its inputs' gradients;
    nodes run backward one at a time, so only the largest counts, as :mod:`.tables` prices it with a running max
    over the range). Forward stages compute no gradients, so their ``G`` is 0 (the only place this model departs
    from a literal ``W + G + P + working``). A stage of a 4-bit base also holds its weights dequantized
    (``derived_bytes``: computed once per stage, held while it runs) beside ``W``.

    **Weights that stay** (:mod:`~rpcompile.passes.solver.stays`): a stage that finds some of its weights on its
    device (left there by an earlier stage, or resident) uploads only the rest — ``weight_bytes`` and the link
    time are what it uploads, ``P`` the largest upload — and every stage a stay spans holds those weights beside
    its own (``held_bytes``, in its memory and out of the room the lazy offload may use). Gradient sums kept on a
    device across accumulation calls hold memory the same way (``sum_bytes``); in a call under ``no_sync`` the
    summed gradients are not sent home."""
    m, link, seg = pb.microbatches, pb.link_bytes_per_s, range(a, b)
    w, g = pb.weight(a, b) - stay.found, pb.weight(a, b, grads=True)  # w: what its W uploads (.stays)
    sent = g - stay.summed if deferred else g  # what of them goes home (under no_sync: not the summed ones)
    inb, outb = pb.in_bytes(a), pb.boundary_bytes[b - 1]
    # what of them crosses the link (one GPU keeps hand-offs on the device: problem.resident_handoffs)
    link_in, link_out = pb.link_in(a), pb.link_out(b)
    # the gradient of a stage's input goes back the way the input came; before segment 0 only the host's embedding rows
    # have one (token ids have none)
    grad_in = link_in if a > 0 else pb.input_grad_bytes
    act = sum(pb.act_bytes[i] for i in seg)
    held = sum(pb.derived_bytes[i] for i in seg)  # dequantized once per stage, held while it runs
    saved_act = sum(pb.act_bytes[i] for i in seg if saved[i])
    prefetch = offload = buffers = 0
    if kind == "forward":
        g = 0
        compute = sum(pb.fwd_s[i] for i in seg)
        inputs, outputs, offload = link_in, link_out, saved_act
        # the activations it saves pile up on the device during the microbatch; the previous microbatch's are
        # still being copied out meanwhile (double buffering, so the copy overlaps the compute)
        working = inb + outb + max(pb.peak_bytes[i] for i in seg) + saved_act
        buffers = saved_act
    elif kind == "fused":
        # nothing recomputed: its forward's activations are still live when its backward runs right after
        compute = sum(pb.fwd_s[i] + pb.bwd_s[i] for i in seg)
        # the loss is inside it: nothing goes on to a next stage, only its input's gradient goes back
        inputs, outputs = link_in, grad_in
        working = inb + outb + act + max(pb.transient_bytes[i] for i in seg)
    else:
        # an unsaved segment's forward runs again (from the stage's input) before its backward
        compute = sum(pb.bwd_s[i] + (0.0 if saved[i] else pb.rec_s[i]) for i in seg)
        # its output gradients wait for the stage above; its input and saved activations are in host memory
        inputs, outputs, prefetch = link_out, grad_in, link_in + saved_act
        working = inb + outb + act + max(pb.transient_bytes[i] for i in seg)
        buffers = link_in + saved_act  # the next microbatch's input and saved activations, prefetched
    # weights go up and gradients down once per stage and iteration: per microbatch, a 1/m share of the link
    up = (inputs + prefetch) + w / m  # StageCost.upload_bytes / download_bytes, spelled out (hot path)
    down = (outputs + offload) + (0 if kind == "forward" else sent) / m
    time = pb.stage_overhead_s + max(compute, up / link, down / link)  # eager copies; see offload_backlog
    # data parallelism reduces a shared parameter once, with the last grad stage holding it: the lowest range
    reduced = 0 if kind == "forward" else sum(pb.grad_bytes[a:b]) + sum(
        s.grad_bytes for s in pb.shared if a <= min(s.segments) < b)
    return StageCost(kind=kind, start=a, stop=b, compute_s=compute, overhead_s=pb.stage_overhead_s,
                     weight_bytes=w, grad_bytes=0 if kind == "forward" else sent, reduce_bytes=reduced,
                     input_bytes=inputs, prefetch_bytes=prefetch, output_bytes=outputs, offload_bytes=offload,
                     working_bytes=working, microbatches=m, time_s=time,
                     # w + stay.found: all its weights are on the device while it runs, uploaded or found
                     memory_bytes=w + stay.found + g + p + working + buffers + stay.held + stay.sums + held,
                     buffer_bytes=buffers, found_bytes=stay.found, kept_bytes=stay.kept, held_bytes=stay.held,
                     refreshes=stay.refreshes, sum_bytes=stay.sums + (stay.summed if deferred else 0))


def stage_costs(problem: PartitionProblem, plan: SegmentPlan, *, lazy_offload: bool = True,
                deferred: bool = False) -> tuple[StageCost, ...]:
    """Cost of every stage of a structurally valid plan, in execution order. ``lazy_offload=False``: each stage
    on its own, its saved activations copied out while it runs (the solvers' per-stage model, which
    :func:`offload_backlog` refines). ``deferred``: a call under ``pipe.no_sync()``, whose summed gradients
    stay on the devices (:mod:`~rpcompile.passes.solver.stays`)."""
    stages = plan_stages(plan)
    stays = stay_figures(problem, plan) or [NO_STAY] * len(stages)  # weights that stay on the device (.stays)
    # P: the next stage prefetched may be any stage, so every stage budgets for the plan's largest upload
    prefetch = max(problem.weight(a, b) - f.found for (_, a, b), f in zip(stages, stays))
    costs = tuple(stage_cost(problem, kind, a, b, plan.saved, prefetch, f, deferred)
                  for (kind, a, b), f in zip(stages, stays))
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
    (``limit − max_k memory_k``; half of it on one GPU, whose hand-offs kept in device memory take the other
    half, as the runtime shares it), so no stage's own memory is given up for it; a forward stage whose saves do
    not fit that room takes as long as its link needs to keep the backlog there — at most what it took with
    eager copies, unless it also drains an earlier stage's backlog. ``backlog_bytes`` is the most a stage holds
    (beside its ``memory_bytes``; the runtime bounds the backlog the same way, :mod:`rpcompile.runtime.offload`).
    Stage weights prefetched during a stage (``P``) are the plan's largest. When each microbatch's saves land in
    host memory, and the backward stages that wait for them, are :func:`pipeline_time`'s landing edges
    (:func:`transfer_edges` given the plan's ``saved`` flags)."""
    out = list(costs)
    times, held = lazy_times(problem, [stage_figures(problem, c) for c in costs], backlog=True)
    for k, (time, most) in enumerate(zip(times, held)):
        c = costs[k]
        # a stage the lazy offload does not change keeps its StageCost
        if time != c.time_s or most or c.backlog_bytes:
            # whole bytes, rounded up so that the backlog is never understated
            out[k] = dataclasses.replace(c, time_s=time, backlog_bytes=int(math.ceil(most)))
    return tuple(out)


def pipeline_time(stage_times: Sequence[float], devices: int, microbatches: int, *,
                  weight_s: Sequence[float] = (), grad_s: Sequence[float] = (),
                  handoff_s: Sequence[float] = (), out_s: Sequence[float] = (), save_s: Sequence[float] = (),
                  reads: Sequence[Sequence[int]] = (), prefetch_s: Sequence[float] = (),
                  accumulate_s: Sequence[float] = (), reduce_s: Sequence[float] = (),
                  overlap_reduce: bool = True, reduce_host_s: float = 0.0) -> float:
    """Iteration time of the round-robin schedule (docs/architecture.md §3) by the exact event recurrence.

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

    Host accumulation (:class:`~rpcompile.core.stages.HostLoad`, the problem's ``host``): ``accumulate_s[k]``, the
    host thread's time to add stage ``k``'s gradients into the fp32 masters' ``.grad`` once they have landed
    (``e(k, m−1) + grad_s[k]``); one thread takes them in the order they land and runs them beside the later
    stages, so they show only when the thread falls behind, and the iteration waits for the last. That is a term
    of the iteration recurrence, not of a stage's per-microbatch price (the solvers' :mod:`.tables`): the host
    thread is one resource that every device's stages share, and it never slows a device.

    Data-parallel reduction (``HostLoad.nodes > 1``, :mod:`rpcompile.training.distributed`): ``reduce_s[k]``, the
    all-reduce of stage ``k``'s fp32 gradient sum across the machines once the host has added it — a ring,
    ``2(n−1)/n`` of the bytes through each machine's network link (``HostLoad.reduce_s``) — on that one link in
    stage order (:func:`.recurrence.reduce_times`), beside the later stages (``overlap_reduce``, as the runtime's
    buckets do) or all after the pipeline, then ``reduce_host_s`` (the tables only the host reads); the iteration
    waits for the last. The local search sees it, so a plan for several nodes may cut otherwise.
    """
    ends = stage_ends(stage_times, devices, microbatches, weight_s, handoff_s, out_s, save_s, reads, prefetch_s)
    return pipeline_end(ends, grad_s, accumulate_s, reduce_s, overlap_reduce, reduce_host_s)


def transfer_edges(problem: PartitionProblem, costs: Sequence[StageCost], times: Sequence[float] | None = None,
                   saved: Sequence[bool] | None = None) -> dict[str, list]:
    """:func:`pipeline_time`'s transfer edges for these stages: each stage's whole weight upload and gradient
    download, and each microbatch's hand-off (down from the previous device, up to this one), at the link rate
    (:func:`.figures.transfer_times`: a stage's weights go up from the start of the device's previous stage ``k − N``,
    behind its activation copies — the runtime's priority, :meth:`rpcompile.runtime.devices.Device.upload_weights`
    — at the rate those leave free, ``link − a/t`` for a stage uploading ``a`` activation bytes per microbatch of
    time ``t``, for its ``m·t``, then at the full rate; a device's first stage from the start of the iteration);
    with the plan's ``saved`` flags also when saved activations land in host memory and who waits for them.
    ``times``: the stages' times when they differ from ``time_s``."""
    rows = [stage_figures(problem, c) for c in costs]
    handoff, weight_s = transfer_times(problem, rows, [r.time for r in rows] if times is None else times)
    edges: dict[str, list] = dict(weight_s=weight_s, grad_s=[r.grad_s for r in rows], handoff_s=handoff)
    # no stage offloads: nothing lands late, and the recurrence needs no landing edges
    if saved is not None and any(c.offload_bytes for c in costs):
        edges.update(out_s=[r.out_s for r in rows], save_s=[r.save_s for r in rows], reads=save_reads(costs, saved),
                     prefetch_s=[r.prefetch_s for r in rows])
    return edges


def save_reads(costs: Sequence[StageCost], saved: Sequence[bool]) -> list[tuple[int, ...]]:
    """Per stage, the forward stages whose saved activations it reads (backward stages; ``()`` for the others)."""
    return reads_of(costs, saved_counts(saved))


def _walked(problem: PartitionProblem, costs: Sequence[StageCost], saved: Sequence[bool], overlapped: bool) -> float:
    """:func:`.figures.walk` of these stages (costed on their own, or already through :func:`offload_backlog`: the
    walk gives the same times either way)."""
    return walk(problem, [stage_figures(problem, c) for c in costs], saved_counts(saved), overlapped=overlapped)[0]


def _total(problem: PartitionProblem, costs: Sequence[StageCost], saved: Sequence[bool]) -> float:
    """Exact iteration time of the stages with their transfer edges (:func:`pipeline_time` after the lazy offload)."""
    return _walked(problem, costs, saved, False)


def overlapped_period(problem: PartitionProblem, costs: Sequence[StageCost], saved: Sequence[bool]) -> float:
    """The steady-state period of overlapped iterations of these stages (:func:`.recurrence.overlapped_ends`; the
    optimizer step's waits included)."""
    return _walked(problem, costs, saved, True)


def _objective(problem: PartitionProblem, costs: Sequence[StageCost], saved: Sequence[bool]) -> float:
    """What an iteration costs: the pipeline and the step (added, or the longer of the two), or with
    ``host.overlap_iterations`` the steady-state period."""
    if problem.host.overlap_iterations:
        return overlapped_period(problem, costs, saved)
    return problem.host.iteration_s(_total(problem, costs, saved))


def iteration_time(problem: PartitionProblem, plan: SegmentPlan) -> float:
    """Predicted time of one training iteration (s): the pipeline plus its exposed fill and drain transfers and
    the host accumulation it could not hide, then the optimizer step and copy refresh (added, or overlapped:
    ``HostLoad.iteration_s``); with ``host.overlap_iterations``, the steady-state period of overlapped iterations
    (:func:`overlapped_period`).

    **Iteration time** is the exact event recurrence of :func:`pipeline_time` — with equal stage times it reduces
    to docs/architecture.md §3's ``(⌊(S−1)/N⌋·m + (S−1) mod N + m)·T`` for ``m ≥ N`` — with the transfers that
    compute may not hide (:func:`transfer_edges`): a stage starts only once its weights are up — prefetched while
    the device runs its previous stage, with what bandwidth that stage's activation copies leave, so a short or
    upload-bound stage before a heavy one exposes the rest of the copy, and from the start of the iteration for
    the first stage of each device (the optimizer step between iterations changes the weights) — and the
    iteration ends only once every stage's gradients are down. And a microbatch reaches the next stage only after
    its hand-off through host memory — the tensors it waits for go down from one device and up to the next
    (``handoff_bytes``, both links' time): one hand-off per stage lies on the fill's and the drain's critical
    path, so a cut across a wide tensor (inside an MLP) lengthens both.

    Between iterations the host steps the optimizer and refreshes the compute-precision copies, a constant per
    iteration (``HostLoad.step_s``, :class:`~rpcompile.core.stages.HostLoad`) that the solvers need not see: this
    adds it (synchronous) or takes ``max(pipeline, step)`` (``overlap_step``)."""
    # costed on their own: the walk applies the lazy offload itself (figures.lazy_times), with the same times
    return _objective(problem, stage_costs(problem, plan, lazy_offload=False), plan.saved)


def no_sync_time(problem: PartitionProblem, plan: SegmentPlan) -> float:
    """Predicted pipeline of a call under ``pipe.no_sync()`` (s): the summed gradients go nowhere
    (:mod:`~rpcompile.passes.solver.stays`), the host adds only the others; as ``host_times``' ``pipeline_s``, the
    step apart."""
    return _total(problem, stage_costs(problem, plan, lazy_offload=False, deferred=True), plan.saved)


def host_times(problem: PartitionProblem, plan: SegmentPlan) -> dict[str, float]:
    """The host's part of the prediction: ``pipeline_s`` (the iteration before the step), ``accumulate_s`` (the
    host thread's accumulation over the iteration, mostly hidden), ``optimizer_s`` and ``refresh_s``."""
    costs = stage_costs(problem, plan, lazy_offload=False)
    h = problem.host
    return dict(pipeline_s=_total(problem, costs, plan.saved), optimizer_s=h.optimizer_s, refresh_s=h.refresh_s,
                accumulate_s=sum(h.accumulate_s(c.grad_bytes) for c in costs))


def plan_memory(problem: PartitionProblem, plan: SegmentPlan) -> int:
    """Peak memory any device needs under ``plan`` (bytes): the largest stage ``W + G + P + working``."""
    return max(c.memory_bytes for c in stage_costs(problem, plan))


def bubble_fraction(problem: PartitionProblem, plan: SegmentPlan) -> float:
    """Idle device time over ``N × iteration``: ``1 − m·Σ t_k / (N · iteration)``, the iteration being the pipeline
    (the step apart) or, with ``host.overlap_iterations``, the steady-state period."""
    # after the lazy offload, so that busy counts each stage's time as its device spends it
    costs = stage_costs(problem, plan)
    over = overlapped_period if problem.host.overlap_iterations else _total
    total = over(problem, costs, plan.saved)
    busy = problem.microbatches * sum(c.time_s for c in costs)
    # a pipeline with no idle device: busy equals the total up to rounding, which must not make it negative
    return max(0.0, 1.0 - busy / (problem.device_count * total)) if total > 0 else 0.0
