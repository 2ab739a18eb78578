"""The round-robin schedule's event recurrence (docs/architecture.md §3), on plain numbers.

- :func:`stage_ends`: when every stage of an iteration finishes;
- :func:`pipeline_end`: when the iteration's gradients are down, added on the host (:func:`lane_ends`, one host
  thread) and all-reduced (:func:`reduce_times`, one network link);
- *overlapped iterations*: consecutive iterations whose stages run on as one chain while the host steps the
  optimizer one step stale (:func:`overlapped_ends`, which describes the chain and its waits).

:func:`rpcompile.passes.solver.timing.pipeline_time` documents the recurrence and its transfer edges; the timing
model (:mod:`.timing`) and the local search's scorer (:mod:`.scorer`) walk it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from rpcompile.core.schedule import OVERLAP_ITERATIONS

__all__ = ["Walk", "stage_ends", "pipeline_end", "lane_ends", "reduce_times", "host_lane_end", "overlapped_ends",
           "equal_time_factor", "equal_time_factors"]


def pipeline_end(ends: Sequence[float], grad_s: Sequence[float], accumulate_s: Sequence[float],
                 reduce_s: Sequence[float], overlap_reduce: bool, reduce_host_s: float) -> float:
    """:func:`.timing.pipeline_time` after the walk: each stage's last microbatch ``ends``, its gradients down, added on
    the host, all-reduced."""
    # a stage's gradients go down once, after its last microbatch (a stage beyond grad_s has none)
    landed = [e + (grad_s[k] if k < len(grad_s) else 0.0) for k, e in enumerate(ends)]
    added = lane_ends(landed, accumulate_s)
    # the iteration waits for every gradient down and for the host thread's last add
    end = max(max(landed, default=0.0), max(added, default=0.0))
    if any(reduce_s) or reduce_host_s:
        # the host-only tables reduce last, once every stage's gradients are added
        work = [reduce_s[k] if k < len(reduce_s) else 0.0 for k in range(len(added))] + [reduce_host_s]
        ready = added + [max(added, default=0.0)]
        # not overlapped: the whole reduction waits for the pipeline's end
        end = max(end, max(reduce_times(ready, work, after=None if overlap_reduce else end)[1]))
    return end


def lane_ends(landed: Sequence[float], work: Sequence[float]) -> list[float]:
    """When each stage's ``work`` is done on one host thread that takes it in the order it lands (``landed[k]``
    for a stage without work)."""
    out = list(landed)
    end = 0.0
    # by landing time (then stage order): the host thread takes the adds as they land
    for at, k in sorted((landed[k], k) for k, w in enumerate(work) if w > 0 and k < len(landed)):
        end = max(end, at) + work[k]
        out[k] = end
    return out


def reduce_times(ready: Sequence[float], reduce_s: Sequence[float], *, after: float | None = None,
                 ) -> tuple[list[float], list[float]]:
    """``(starts, ends)`` of each stage's all-reduce on one network link, in stage order (the runtime launches its
    buckets in that order on every rank), each once its gradients are added (``ready[k]``) — or all after
    ``after`` (the reduction not overlapped)."""
    starts, ends, free = [], [], 0.0
    for k, r in enumerate(ready):
        w = reduce_s[k] if k < len(reduce_s) else 0.0
        begin = max(free, r if after is None else after)
        starts.append(begin)
        # a stage with nothing to reduce does not hold the network link
        free = begin + w if w > 0 else free
        ends.append(begin + w if w > 0 else r)
    return starts, ends


def host_lane_end(landed: Sequence[float], accumulate_s: Sequence[float]) -> float:
    """When one host thread finishes ``accumulate_s[k]`` of work that may start at ``landed[k]``, taken in the
    order it lands (0 when there is none)."""
    end = 0.0
    for at, work in sorted((landed[k], w) for k, w in enumerate(accumulate_s) if w > 0 and k < len(landed)):
        end = max(end, at) + work
    return end


@dataclass(slots=True)
class Walk:
    """What :func:`stage_ends` met at each stage, for a later walk over a plan with the same first stages (the
    local search's candidates share a prefix with the plan they move from) to resume from."""

    ends: list[list[float]] = field(default_factory=list)
    """Each stage's microbatch ends."""
    last: list[float] = field(default_factory=list)
    began: list[float] = field(default_factory=list)
    landed: dict[int, list[float]] = field(default_factory=dict)


def stage_ends(stage_times: Sequence[float], devices: int, m: int, weight_s: Sequence[float] = (),
               handoff_s: Sequence[float] = (), out_s: Sequence[float] = (), save_s: Sequence[float] = (),
               reads: Sequence[Sequence[int]] = (), prefetch_s: Sequence[float] = (), *, resume: int = 0,
               base: Walk | None = None, record: Walk | None = None,
               gate: tuple[float, float] | None = None) -> list[float]:
    """``e(k, m-1)`` for every stage ``k``: when each stage finishes its last microbatch.

    A plain loop over microbatches (the planner's local search calls this thousands of times on short vectors,
    where it is several times faster than array operations): microbatch ``j`` starts once the stage finished
    ``j−1`` and stage ``k−1``'s ``j`` has been handed over (and the saves it reads have landed); the first one also
    waits for the device (``floor``). Stage ``k`` reads only what stages before it left, so a walk whose first
    ``resume`` stages have the inputs of ``base``'s takes their results from it (``record``: this walk's).

    ``gate = (inputs, weights)``: stage ``resume`` begins the next iteration of an overlapped run
    (:func:`overlapped_ends`): its microbatches come from the host at ``inputs`` instead of from stage ``resume − 1``,
    and the weights of the next ``devices`` stages (the first on each device) go up from ``weights`` on."""
    # -1: no stage is exempt from waiting for a hand-off
    first = resume if gate is not None else -1
    if base is not None and resume > 0:
        # under a gate the resumed stage's microbatches come from the host, not from the stage before it
        prev = [gate[0]] * m if gate is not None else base.ends[resume - 1]
        every, last, began = base.ends[:resume], base.last[:resume], base.began[:resume]
        landed = {f: v for f, v in base.landed.items() if f < resume}
    else:
        resume, prev, every, last, began, landed = 0, [0.0] * m, [], [], [], {}
    # began: when each stage's first microbatch started; landed: stage -> when each microbatch's saves are in
    # host memory
    n_weight, n_handoff, n_reads, n_save = len(weight_s), len(handoff_s), len(reads), len(save_s)
    for k in range(resume, len(stage_times)):
        t = stage_times[k]
        up = weight_s[k] if k < n_weight else 0.0
        h = handoff_s[k] if 0 < k < n_handoff and k != first else 0.0  # the first stage has no one to wait for
        # the device is free once stage k−N's last microbatch ends; k's weights start going up when k−N began
        floor, b = (last[k - devices], began[k - devices]) if k >= devices else (0.0, 0.0)
        if gate is not None and k < first + devices and gate[1] > b:
            b = gate[1]  # an overlapped iteration's weights exist once the step before last is done
        b += up
        # the first microbatch waits for the device and for the weights to be in
        floor = b if b > floor else floor
        ready = [p + h for p in prev] if h else prev
        if k < n_reads and reads[k]:
            pre = prefetch_s[k] if k < len(prefetch_s) else 0.0
            for f in reads[k]:
                if f not in landed:  # it saved 0 bytes: nothing to wait for
                    continue
                # the saves come up before the stage computes on them (prefetch_s)
                ready = [r if r > g else g for r, g in zip(ready, [x + pre for x in landed[f]])]
        start = ready[0]
        start = floor if floor > start else start
        began.append(start)
        end = start + t
        ends = [end]
        add = ends.append
        for r in ready[1:]:
            # max-plus scan: each microbatch waits for its input and for the stage's previous microbatch
            end = (r if r > end else end) + t
            add(end)
        if k < n_save and save_s[k] > 0:
            out, save, land, lands = (out_s[k] if k < len(out_s) else 0.0), save_s[k], 0.0, []
            for e in ends:
                # on its link each microbatch's outputs go down first, then its saves, behind the earlier saves
                e += out
                land = (land if land > e else e) + save
                lands.append(land)
            landed[k] = lands
        prev = ends
        every.append(ends)
        last.append(end)
    if record is not None:
        record.ends, record.last, record.began, record.landed = every, last, began, landed
    return last


def equal_time_factor(stages: int, devices: int, microbatches: int) -> int:
    """``c(S)``: iteration time in units of ``T`` when all ``S`` stages take ``T`` (non-decreasing in ``S``)."""
    return equal_time_factors(stages, devices, microbatches)[stages]


def equal_time_factors(max_stages: int, devices: int, microbatches: int) -> list[int]:
    """``[c(0), c(1), ..., c(max_stages)]`` in one pass (``c(0) = 0``)."""
    # with T = 1 every end is a whole number; round away the float sums' error
    return [0] + [round(e) for e in stage_ends([1.0] * max_stages, devices, microbatches)]


def overlapped_ends(stage_times: Sequence[float], devices: int, microbatches: int, *, fused: int, step_s: float,
                    iterations: int = OVERLAP_ITERATIONS, weight_s: Sequence[float] = (),
                    grad_s: Sequence[float] = (), handoff_s: Sequence[float] = (), out_s: Sequence[float] = (),
                    save_s: Sequence[float] = (), reads: Sequence[Sequence[int]] = (),
                    prefetch_s: Sequence[float] = (), accumulate_s: Sequence[float] = (),
                    reduce_s: Sequence[float] = (), overlap_reduce: bool = True, reduce_host_s: float = 0.0,
                    first: Walk | None = None) -> list[float]:
    """When each of ``iterations`` overlapped iterations is done (below): its stages, gradients, host adds and
    all-reduces, not its optimizer step. Arguments as :func:`rpcompile.passes.solver.timing.pipeline_time`'s, for
    one iteration's stages; ``fused``: the index of the stage that computes the loss; ``step_s``: the host's
    optimizer step and copy refresh. ``first``: the first iteration's walk, already done (the scorer's).

    **Overlapped iterations** (``pipe.step(optimizer, overlap=True)`` once the devices run on into the next
    iteration; the simulator's ``iterations=K`` plays the same, :mod:`rpcompile.runtime.sim.simulator`). The
    round-robin pointer carries on across iterations, so the stages of iterations ``0, 1, …`` form one chain
    ``t·S + k`` in which stage ``j`` runs on the device after ``j − 1``'s and waits for stage ``j − N`` on it — the
    walk goes on over it, except that iteration ``t``'s first stage takes its inputs from the host. The
    one-step-stale step sets the rest: iteration ``t`` computes with the weights step ``t − 2`` made
    (double-buffered copies; step ``t − 1`` runs beside it, writing the other buffer), so its weight uploads, and
    its first stage's inputs (the host's lookups read those weights), wait for step ``t − 2``; and its first stage
    waits for iteration ``t − 1``'s loss (the fused stage's last microbatch: ``forward_backward`` returns it, then
    the caller passes the next batch). Step ``t`` starts once iteration ``t`` is done (its gradients down, added,
    all-reduced) and step ``t − 1`` too, and takes ``step_s``. Iterations are alike but for which device runs which
    stage, and devices are alike, so once the start is behind the iterations repeat, one by one or in a short
    cycle: the steady-state period is their mean duration once the start is behind
    (:func:`rpcompile.core.schedule.steady_period`)."""
    per, m = len(stage_times), microbatches
    # each per-stage figure padded to one iteration's length, so the chain repeats it per iteration
    one = [[v[k] if k < len(v) else 0.0 for k in range(per)]
           for v in (stage_times, weight_s, handoff_s, out_s, save_s, prefetch_s)]
    grown: list[list[float]] = [[] for _ in range(6)]
    times, weights, handoff, outs, saves, pre = grown
    shifted: list[tuple[int, ...]] = []
    walk = Walk()
    ends: list[float] = []
    steps: list[float] = []
    for t in range(iterations):
        for have, piece in zip(grown, one):
            have.extend(piece)
        # read stages as indices into the chain: iteration t's stage f is f + t·per
        shifted.extend(tuple(f + t * per for f in (reads[k] if k < len(reads) else ())) for k in range(per))
        if t == 0:
            if first is None:
                stage_ends(times, devices, m, weights, handoff, outs, saves, shifted, pre, record=walk)
            else:  # the caller's walk is read, never written
                walk = first
        else:
            # double-buffered copies: iteration t computes with the weights step t − 2 wrote (0: the initial ones)
            done = steps[t - 2] if t >= 2 else 0.0  # the weights this iteration reads exist
            # iteration t − 1's loss: its fused stage's last microbatch
            loss = walk.last[(t - 1) * per + fused]
            walk, base = Walk(), walk
            # the first stage's inputs wait for that loss and for those weights (the host's lookups read them)
            stage_ends(times, devices, m, weights, handoff, outs, saves, shifted, pre, resume=t * per, base=base,
                       record=walk, gate=(max(loss, done), done))
        ends.append(pipeline_end(walk.last[t * per:], grad_s, accumulate_s, reduce_s, overlap_reduce,
                                 reduce_host_s))
        # steps run in order on the host: step t waits for iteration t and for step t − 1
        steps.append(max(ends[-1], steps[-1] if steps else 0.0) + step_s)
        cycle = _cycle(walk, steps, per, devices, fused)
        if cycle is not None:  # every later iteration repeats the one a cycle before, shifted
            c, delta = cycle
            while len(ends) < iterations:
                ends.append(ends[-c] + delta)
            break
    return ends


#: The longest cycle of iterations :func:`overlapped_ends` recognises to stop walking.
MAX_CYCLE = 4


def _cycle(walk: Walk, steps: Sequence[float], per: int, devices: int, fused: int) -> tuple[int, float] | None:
    """``(c, δ)`` when what the next iteration depends on — the device floors its stages meet (the last
    ``devices`` stages' ends and starts), the loss it waits for and the two latest steps — is that of the
    iteration ``c`` before plus ``δ`` (``c ≤`` :data:`MAX_CYCLE`, the shortest): the walk is a max-plus one, so
    every later iteration then repeats the one ``c`` before it shifted by ``δ``. None otherwise (or when an
    iteration has fewer stages than there are devices, and its floors reach further back)."""
    t = len(steps) - 1
    if per < devices:
        return None
    b = t * per
    last, began = walk.last, walk.began
    # relative tolerance: the ends are sums of floats
    tol = 1e-12 * max(1.0, abs(last[-1]))
    # c ≤ t − 1 so that steps[t − 1 − c] exists
    for c in range(1, min(MAX_CYCLE, t - 1) + 1):
        a = b - c * per
        delta = last[b + fused] - last[a + fused]
        pairs = [(steps[t], steps[t - c]), (steps[t - 1], steps[t - 1 - c])]
        # the last N stages' ends and starts are the floors the next iteration's first stages meet
        pairs += [(last[b + k], last[a + k]) for k in range(per - devices, per)]
        pairs += [(began[b + k], began[a + k]) for k in range(per - devices, per)]
        if all(abs(x - y - delta) <= tol for x, y in pairs):
            return c, delta
    return None
