"""The simulator: walk the executor's own per-device action lists with a clock instead of devices.

Terms:

- **compute queue** and **copy queues**: each device has one compute queue and copy queues — weights up,
  activations up (inputs that wait for the previous stage; saved activations already in host memory), activations
  down (outputs the next stage waits for; saved activations), gradients down.
- **upload link** and **download link**: the two physical links a device's copy queues share, each
  ``link_bytes_per_s`` and full duplex. All links share the host's memory bandwidth (``host_bytes_per_s``).
- **fluid model**: transfers running at the same time split the bandwidth max-min fairly (each gets an equal share
  of its tightest resource), so eight GPUs streaming weights at once are as slow as the host allows, not eight
  times a single link.
- **chain position**: one :class:`~rpcompile.core.stages.StageCost`, the type the timing model prices.

:func:`simulate` plays the lists (``kW``/``kFj``/``kG``, see :mod:`.schedule`; its docstring says what each action
turns into, and how memory, the host's work and consecutive iterations are played) and returns a
:class:`~.sim_result.SimResult` (the timeline and its figures). With transfers free this is exactly the timing
model's recurrence (:func:`rpcompile.passes.solver.timing.pipeline_time`, docs/architecture.md §3);
:mod:`rpcompile.tools.scenarios` builds the action lists and stages for a plan, for the classic static schedules
(GPipe, 1F1B, interleaved 1F1B) and for published layer profiles.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from rpcompile.core.errors import SimulationError
from rpcompile.core.schedule import OVERLAP_ITERATIONS, Action, steady_period
from rpcompile.core.stages import HostLoad, StageCost

from .sim_result import SimEvent, SimResult

__all__ = ["simulate"]

_INF = math.inf
#: Output buffers per device: a compute action waits until the outputs of the one ``OUTPUT_BUFFERS`` before it
#: have gone down to the host, so a stage whose copies are slower than its compute stalls instead of piling
#: up device memory (inputs are double-buffered the same way, see ``kFj`` below).
OUTPUT_BUFFERS = 2
_DOWN = ("a_down", "s_down", "g_down")
#: Lanes whose queue starts the copy needed first, not the oldest (saved-activation offload, see above).
_LAZY = ("s_down",)
#: Lanes that take what bandwidth the others leave on their link: saved activations going down, and weights going
#: up (the executor's prefetch thread copies them in pieces behind the activation uploads, runtime/devices.py).
_BACKGROUND = ("s_down", "w_up")
# lane -> (physical link, what it carries, display lane)
_LANES = {
    "compute": (None, "compute", "compute"),
    "w_up": ("up", "weights", "upload"),
    "a_up": ("up", "activations", "upload"),
    "s_up": ("up", "activations", "upload"),
    "a_down": ("down", "activations", "download"),
    "s_down": ("down", "activations", "download"),
    "g_down": ("down", "gradients", "download"),
    "acc": ("cpu", "accumulate", "host"),
    "net": (None, "reduce", "host"),
    "step": (None, "optimizer", "host"),
}
#: Lanes of the host, one for all devices (their queue key has device -1).
_HOST = ("acc", "net", "step")


_Ref = tuple[str, int, int]
"""``(what, position, microbatch)``: ``producer`` (the output a microbatch waits for) or ``offload`` (saves)."""


@dataclass(eq=False)
class _Task:
    label: str
    device: int
    lane: str
    stage: int
    microbatch: int
    work: float
    """Bytes for transfers over a link, seconds for compute and fixed-time copies."""
    on_link: bool
    after_end: list["_Task"] = field(default_factory=list)
    after_start: list["_Task"] = field(default_factory=list)
    refs: list[_Ref] = field(default_factory=list)
    """Tasks it also waits for, by name, that a later device list may define; resolved into ``after_end``."""
    alloc_start: float = 0.0
    """Bytes allocated on the device when the task starts."""
    alloc_end: float = 0.0
    """Bytes allocated on the device when it ends."""
    free_end: list[tuple[int, float]] = field(default_factory=list)
    """(device, bytes) released when it ends."""
    start: float = -1.0
    end: float = -1.0
    left: float = 0.0
    iteration: int = 0
    """Which of the run's iterations it belongs to (``simulate(..., iterations=K)``)."""


def _growth(t: _Task) -> float:
    """Most a task adds to its device's memory over its life: ``alloc_start`` while it runs, and at its end the
    outputs it leaves (``alloc_end``) in place of what it frees there (a compute's working set and inputs)."""
    freed = sum(b for dev, b in t.free_end if dev == t.device)
    return t.alloc_start + max(0.0, t.alloc_end - freed) if t.lane == "compute" else t.alloc_start


def simulate(
    lists: Sequence[Sequence[Action]],
    stages: Sequence[StageCost | float],
    *,
    link_bytes_per_s: float = _INF,
    host_bytes_per_s: float = _INF,
    memory_limit_bytes: int | None = None,
    copies_wait_for_memory: bool = True,
    tokens_per_iteration: int = 0,
    host: HostLoad | None = None,
    iterations: int | None = None,
) -> SimResult:
    """Run the per-device action lists with a clock.

    ``stages[k]`` describes chain position k (a bare number is a :class:`~rpcompile.core.stages.StageCost` with only ``compute_s``).
    Bandwidths are bytes/s; infinite bandwidth makes byte transfers free. ``copies_wait_for_memory=False``
    admits copies regardless of ``memory_limit_bytes`` (static schedules, which do not stream and are only
    checked against the limit). ``host``: the host's own work (below); none by default.
    ``iterations``: how many consecutive iterations of these lists to play (below; round-robin
    lists only); by default one, or :data:`~rpcompile.core.schedule.OVERLAP_ITERATIONS` when
    ``host.overlap_iterations``.

    What an action list turns into (``kW``/``kFj``/``kG``, see :mod:`.schedule`):

    - ``kW`` uploads stage k's weights. It may start once the device has *started* the stage before k in its list (the
      weight prefetch: at most the running stage and the next one are resident), and it takes only what bandwidth the
      activation copies leave on the upload link (the executor copies weights in small pieces behind them, so a
      microbatch's inputs never queue behind a whole stage's weights).
    - ``kFj`` first brings microbatch j's inputs in — ``prefetch_bytes`` (in host memory already) and ``input_bytes``
      (once chain position k−1's output for j reached host memory); both may start once the device began its previous
      compute action, a double buffer — then computes (``compute_s + overhead_s``) once the compute queue is free and
      k's weights are in and the outputs of its compute action two before have drained (double buffering); then sends
      ``output_bytes`` down (the next position waits for them) and, on their own queue, ``offload_bytes`` (saved
      activations, which only the backward pass reads).
    - ``kG`` sends the gradients down after k's last microbatch.

    **Saved activations go down lazily.** Nobody in the forward pass waits for them, so their copies do not hold the
    compute back (the output double buffer counts only the copies a later position waits for); they yield the download
    link to those copies (strict priority: they get what the hand-offs and gradients leave), and among themselves the
    ones needed first go first — the latest position's, since the backward pass runs the chain in reverse — microbatches
    in order. What has not gone down yet stays in device memory, so the memory limit is what bounds the backlog: a
    compute that would overfill its device waits for the copies out of it. A backward position prefetches saved
    activations only once the forward positions that saved them (``saved_by``) have them in host memory for that
    microbatch.

    Work is admitted only while it fits: with ``memory_limit_bytes`` a copy that would overfill its device waits until
    compute frees memory (a prefetcher that respects the allocator), and a compute action that would overfill waits
    while copies out of its device are draining — so a plan whose overlap does not fit loses time instead of memory.
    Only when nothing else can run does work overfill a device, and the peak shows it. Memory per device is accounted
    from the same events: weights from the start of their upload until the stage's last microbatch ends — those that
    stay on the device (:attr:`StageCost.kept_bytes <rpcompile.core.stages.StageCost.kept_bytes>`) until the end of the
    stage that finds them there (:attr:`StageCost.found_bytes <rpcompile.core.stages.StageCost.found_bytes>`), a
    resident plan's from before the run; gradients from the first microbatch until the ``G`` copy ends; input buffers,
    working activations and output buffers around each microbatch; ``resident_bytes`` for the whole iteration (static
    schedules keep weights, gradients and optimizer state on the device) and ``stash_bytes`` from a forward microbatch
    until the backward position named by ``releases`` ends it (activations kept for the backward pass).

    **The host's own work** (``host``, a :class:`~rpcompile.core.stages.HostLoad`): after each ``kG`` a ``kA`` on the
    host's one accumulation lane adds the gradients into the fp32 ``.grad`` — taken in the order the gradients land, at
    the host thread's rate, and moving ``accumulate_traffic`` host-memory bytes per gradient byte through the host's
    memory bandwidth, which it shares with the links' copies (so when that bandwidth is tight it slows them). The
    optimizer step and the copy refresh (``step_s``) follow the iteration (synchronous: they add to it) or run from its
    start beside it (``overlap_step``: the iteration takes the longer of the two). Data-parallel machines (``host.nodes
    > 1``): after each ``kA`` a ``kR`` on the host's network lane all-reduces the stage's gradients
    (``HostLoad.reduce_s``, a ring over the machines' links), strictly in stage order as the runtime launches its
    buckets, beside the later stages — or, with ``overlap_reduce=False``, all after everything else. Host work is
    reported in ``SimResult.host_timeline``, apart from the devices' lanes.

    **Consecutive iterations** (``iterations=K > 1``; round-robin lists only): the lists and stages describe one
    iteration, and the run plays ``K`` of them. Position ``k`` of iteration ``t`` is global position ``t·S + k`` (``S``
    positions an iteration) on the device after the one that ran ``t·S + k − 1``: the round-robin pointer carries on
    across iterations (docs/architecture.md §3), so a device runs the next iteration's stage as soon as it is done with
    its stages of this one, in its list's order. Iteration ``t + 1``'s first position takes its inputs from the host,
    not from iteration ``t``'s last position. The optimizer step of iteration ``t`` (``stepT``, on the host's step
    thread: ``step_s``, after iteration ``t``'s gradients are all added — and all-reduced — and after step ``t − 1``)
    decides the rest:

    - synchronous (``host.overlap_step`` False): iteration ``t + 1`` starts once step ``t`` is done — every iteration
      pays the fill, the drain and the step, as one iteration does;
    - the step overlapped (``host.overlap_step``; today's ``pipe.step(optimizer, overlap=True)``, one step stale):
      iteration ``t + 1`` starts once iteration ``t``'s work is done (``forward_backward`` is a barrier) and computes
      with the weights from before step ``t``, which step ``t − 1`` made (double-buffered copies), so its weight uploads
      and its first position (host-side lookups read those weights too) wait for step ``t − 1``;
    - iterations overlapped (``host.overlap_iterations`` too): as the step overlapped, but nothing of iteration ``t``
      holds iteration ``t + 1`` up except its loss — the first position waits for the fused position's last microbatch
      (``forward_backward`` returns the loss, then the caller passes the next batch): a device that has finished its
      part of iteration ``t`` goes on with ``t + 1`` while the others drain
      (:func:`rpcompile.passes.solver.recurrence.overlapped_ends` is the timing model's walk of the same).

    :class:`~rpcompile.runtime.sim.sim_result.SimResult` then reports the steady-state period (``iteration_time_s``),
    the bubble over it, and the one-off fill and drain of the run (:attr:`SimResult.fill_s
    <rpcompile.runtime.sim.sim_result.SimResult.fill_s>`, :attr:`SimResult.drain_s
    <rpcompile.runtime.sim.sim_result.SimResult.drain_s>`); the timeline holds every iteration (``SimEvent.iteration``).

    A one-GPU plan's hand-offs stay in device memory (the timing model's ``resident_handoffs``): its stage costs carry
    no hand-off bytes, so none cross a link here either; the memory they hold and the half of the lazy offload's room
    the runtime gives them are not played (the timing model halves that room). A segment bound by its host's dispatch is
    in ``compute_s`` already (:func:`rpcompile.passes.formulate.launch_bound`).
    """
    sts = [s if isinstance(s, StageCost) else StageCost(name=str(k), compute_s=float(s)) for k, s in enumerate(stages)]
    host = host or HostLoad()
    if iterations is None:
        iterations = OVERLAP_ITERATIONS if host.overlap_iterations else 1
    per = len(sts)
    if iterations != 1:
        lists, sts = _repeat(lists, sts, iterations)
    tasks, lanes, compute_of = _build(lists, sts, link_bytes_per_s, per)
    _add_accumulation(tasks, lanes, sts, host)
    _add_reduction(tasks, lanes, sts, host)
    if iterations > 1:
        _add_steps(tasks, lanes, sts, host, per, iterations)
    devices = len(lists)
    memory = [0.0] * devices
    peak = [0.0] * devices
    for d, acts in enumerate(lists):  # static residency: every stage this device runs, from t = 0
        memory[d] = peak[d] = sum(sts[k].resident_bytes for k in {a.stage for a in acts}) + _standing(acts, sts)
    # copies first: a compute that would overfill its device must see the copies that are about to free memory
    queues = {key: deque(ts) for key, ts in sorted(lanes.items(), key=lambda kv: kv[0][1] == "compute")}
    running: dict[tuple[int, str], _Task] = {}
    now, left = 0.0, len(tasks)
    # copies_wait_for_memory=False (static schedules): nothing waits for room; the peak is only checked
    limit = memory_limit_bytes if memory_limit_bytes is not None and copies_wait_for_memory else _INF
    def start_ready(force: bool) -> None:
        """Start every task whose lane is free and whose dependencies are met (and, unless ``force``, that fits)."""
        started = True
        while started:
            started = False
            for key, q in queues.items():
                if key in running or not q:
                    continue
                lazy = key[1] in _LAZY
                t = _next(q, lazy)
                if t is None:
                    continue
                if lazy and any(r.device == t.device and r.lane in _DOWN and r.lane not in _LAZY
                                for r in running.values()):
                    continue  # the link is busy with copies others wait for
                if not force and memory[t.device] + _growth(t) > limit:
                    if t.lane != "compute":
                        continue  # a copy waits for room (the prefetcher never overfills a device)
                    if any(r.device == t.device and r.lane in _DOWN for r in running.values()):
                        continue  # compute waits while copies out of this device free memory
                q.remove(t)  # the head, except on a lazy lane (tasks compare by identity)
                t.start, t.left = now, t.work
                memory[t.device] += t.alloc_start
                peak[t.device] = max(peak[t.device], memory[t.device])
                running[key] = t
                started = True

    while left:
        start_ready(force=False)
        if not running and any(queues.values()):
            start_ready(force=True)  # only work waiting for room is left: let it overfill (the peak shows it)
        if not running:
            waiting = [q[0].label for q in queues.values() if q][:4]
            raise SimulationError(f"the action lists deadlock at t={now:.6g}s: {', '.join(waiting)} wait for work that never runs")
        rates = _rates(running.values(), link_bytes_per_s, host_bytes_per_s,
                       host.accumulate_bytes_per_s * host.accumulate_traffic)
        # rates hold until the next task ends (fluid model): jump straight to that instant
        dt = min((t.left / rates[id(t)] if rates[id(t)] > 0 else _INF) for t in running.values())
        if dt == _INF:
            raise SimulationError("a transfer has no bandwidth (link_bytes_per_s and host_bytes_per_s must be > 0)")
        now += dt
        for key, t in list(running.items()):
            r = rates[id(t)]
            t.left -= r * dt
            # float residue: done when what is left is negligible against its work, or would take a negligible time
            if t.left <= 1e-9 * max(1.0, t.work) or (r > 0 and t.left / r <= 1e-12 * max(1.0, now)):
                t.end = now
                del running[key]
                left -= 1
                for dev, b in t.free_end:  # working memory goes before the outputs it held become buffers
                    memory[dev] -= b
                memory[t.device] += t.alloc_end
                peak[t.device] = max(peak[t.device], memory[t.device])
    busy = [0.0] * devices
    for t in compute_of.values():
        busy[t.device] += (t.end - t.start) / iterations  # per iteration
    moved = {"up": [0.0] * devices, "down": [0.0] * devices}
    for t in tasks:
        link_name = _LANES[t.lane][0]
        if t.on_link and link_name in moved:  # every copy on a link has one
            moved[link_name][t.device] += t.work / iterations
    events = tuple(_event(t, per) for t in tasks if t.lane not in _HOST)
    host_events = tuple(_event(t, per) for t in tasks if t.lane in _HOST)
    ends = [0.0] * iterations  # when each iteration's work is done (its optimizer step apart)
    rest = [0.0] * iterations  # the same without the all-reduce
    for t in tasks:
        if t.lane != "step":
            ends[t.iteration] = max(ends[t.iteration], t.end)
            if t.lane != "net":
                rest[t.iteration] = max(rest[t.iteration], t.end)
    if iterations > 1:
        period = steady_period(ends)
        # a synchronous period includes the optimizer step; the pipeline's own time does not
        pipeline, iteration = (period if host.overlap_step else period - host.step_s), period
    else:
        pipeline = ends[0]
        iteration = host.iteration_s(pipeline)
        if host.step_s > 0:  # a fixed time on the host's own thread: it meets nothing else, so it is placed afterwards
            begin = 0.0 if host.overlap_step else pipeline
            host_events += (SimEvent("step", 0, "host", "optimizer", -1, -1, begin, begin + host.step_s),)
    changes: list[tuple[float, int, int, float]] = []  # (time, order, device, bytes): landings before new saves
    for t in tasks:
        if t.lane == "s_down":
            changes.append((t.end, 0, t.device, -sts[t.stage].offload_bytes))
        elif t.lane == "compute" and sts[t.stage].offload_bytes:
            changes.append((t.end, 1, t.device, sts[t.stage].offload_bytes))
    backlog, most = [0.0] * devices, [0.0] * devices
    for _, _, d, b in sorted(changes):
        backlog[d] += b
        most[d] = max(most[d], backlog[d])
    return SimResult(
        timeline=events,
        iteration_time_s=iteration,
        busy_s=tuple(busy),
        peak_memory_bytes=tuple(int(round(p)) for p in peak),
        host_traffic_bytes=sum(moved["up"]) + sum(moved["down"]),
        uploaded_bytes=tuple(moved["up"]),
        downloaded_bytes=tuple(moved["down"]),
        tokens_per_iteration=tokens_per_iteration,
        stage_names=tuple(s.name for s in sts[:per]),
        memory_limit_bytes=memory_limit_bytes,
        offload_backlog_bytes=tuple(int(round(b)) for b in most),
        pipeline_s=pipeline,
        step_s=host.step_s,
        overlap_step=host.overlap_step,
        host_timeline=host_events,
        reduce_exposed_s=ends[-1] - rest[-1],
        iteration_ends_s=tuple(ends) if iterations > 1 else (),
    )


def _ready(t: _Task) -> bool:
    return all(p.end >= 0 for p in t.after_end) and all(p.start >= 0 for p in t.after_start)


def _next(q: deque, lazy: bool) -> "_Task | None":
    """The task a lane starts next, if its dependencies are met: the head of the queue, or on a lazy lane the
    ready copy needed first (the latest chain position's, earliest microbatch first); on the host's lane the
    work that landed first."""
    if q[0].lane == "acc":
        ready = [t for t in q if _ready(t)]
        return min(ready, key=lambda t: max(p.end for p in t.after_end)) if ready else None  # the first to land
    if not lazy:
        return q[0] if _ready(q[0]) else None
    best = None
    for t in q:  # in the device's compute order: once one is not ready (its compute runs), none after it is
        if not _ready(t):
            break
        if best is None or (-t.stage, t.microbatch) < (-best.stage, best.microbatch):
            best = t
    return best


def _build(lists: Sequence[Sequence[Action]], sts: Sequence[StageCost], link: float, per: int):
    """Tasks in device-list order, the queue of every (device, lane), and the compute task of every (stage, mb);
    ``per`` positions an iteration (an iteration's first position waits for no producer)."""
    free = math.isinf(link)
    tasks: list[_Task] = []
    lanes: dict[tuple[int, str], list[_Task]] = {}
    compute: dict[tuple[int, int], _Task] = {}
    out_copy: dict[tuple[int, int], _Task] = {}
    offload: dict[tuple[int, int], _Task] = {}
    weights: dict[int, _Task] = {}
    first_compute: dict[int, _Task] = {}
    last_compute: dict[int, _Task] = {}
    stash_release: list[tuple[_Task, int, int, float]] = []  # (backward compute, device, position, bytes)

    def add(t: _Task) -> _Task:
        t.iteration = t.stage // per
        tasks.append(t)
        lanes.setdefault((t.device, t.lane), []).append(t)
        return t

    def copy(label, d, lane, k, j, nbytes, fixed=None):
        if fixed is not None:
            return _Task(label, d, lane, k, j, float(fixed), on_link=False)
        # an infinite link: the copy takes no time and no share of any bandwidth
        return _Task(label, d, lane, k, j, 0.0 if free else float(nbytes), on_link=not free)

    for d, acts in enumerate(lists):
        prev_compute: _Task | None = None
        drains: list[list[_Task]] = []  # per compute action of this device: its output copies
        current_stage = None  # the stage of the latest compute action in this list
        for a in acts:
            if a.stage >= len(sts):
                raise SimulationError(f"action {a} names stage {a.stage} but only {len(sts)} stages were given")
            s = sts[a.stage]
            if a.kind == "W":
                t = add(copy(f"{a}", d, "w_up", a.stage, -1, s.weight_bytes))
                t.alloc_start = s.weight_bytes
                if s.refreshes:  # a resident copy refreshed: the old one goes when the new one lands
                    t.free_end.append((d, s.weight_bytes))
                if current_stage is not None and current_stage in first_compute:
                    t.after_start.append(first_compute[current_stage])  # prefetch at most one stage ahead
                weights[a.stage] = t
            elif a.kind == "F":
                current_stage = a.stage
                c = _Task(str(a), d, "compute", a.stage, a.microbatch, s.compute_s + s.overhead_s, on_link=False)
                working = s.device_working_bytes  # the input buffers are the copies' own
                c.alloc_start = working
                if len(drains) >= OUTPUT_BUFFERS:  # double-buffered outputs: wait until the oldest has drained
                    c.after_end.extend(drains[-OUTPUT_BUFFERS])
                drains.append([])
                c.free_end.append((d, working))
                if s.prefetch_bytes:
                    pre = add(copy(f"{a}<<", d, "s_up", a.stage, a.microbatch, s.prefetch_bytes))
                    pre.alloc_start = s.prefetch_bytes
                    c.free_end.append((d, s.prefetch_bytes))
                    if prev_compute is not None:
                        pre.after_start.append(prev_compute)
                    # saved activations come up only once the forward positions that saved them have them in host memory
                    pre.refs.extend(("offload", k, a.microbatch) for k in s.saved_by)
                    c.after_end.append(pre)
                if s.input_bytes or s.upload_s:
                    cin = add(copy(f"{a}<", d, "a_up", a.stage, a.microbatch, s.input_bytes, s.upload_s))
                    cin.alloc_start = s.input_bytes
                    c.free_end.append((d, s.input_bytes))
                    if prev_compute is not None:
                        cin.after_start.append(prev_compute)
                    c.after_end.append(cin)
                    _depend_on_producer(cin, a, per)
                else:
                    _depend_on_producer(c, a, per)
                if a.stage in weights:
                    c.after_end.append(weights[a.stage])
                if a.stage not in first_compute and s.grad_bytes:  # gradients held from the stage's first microbatch
                    c.alloc_start += s.grad_bytes
                add(c)
                compute[(a.stage, a.microbatch)] = c
                first_compute.setdefault(a.stage, c)
                last_compute[a.stage] = c
                if s.stash_bytes:
                    c.alloc_end += s.stash_bytes
                if s.releases >= 0:
                    stash_release.append((c, d, s.releases, sts[s.releases].stash_bytes))
                if s.output_bytes:
                    out = add(copy(f"{a}>", d, "a_down", a.stage, a.microbatch, s.output_bytes))
                    out.after_end.append(c)
                    c.alloc_end += s.output_bytes
                    out.free_end.append((d, s.output_bytes))
                    out_copy[(a.stage, a.microbatch)] = out
                    drains[-1].append(out)
                if s.offload_bytes:
                    off = add(copy(f"{a}>>", d, "s_down", a.stage, a.microbatch, s.offload_bytes))
                    off.after_end.append(c)
                    c.alloc_end += s.offload_bytes
                    off.free_end.append((d, s.offload_bytes))
                    offload[(a.stage, a.microbatch)] = off  # lazy: not a buffer the compute waits for
                prev_compute = c
            else:  # G
                g = add(copy(f"{a}", d, "g_down", a.stage, -1, s.grad_bytes))
                if a.stage not in last_compute:
                    raise SimulationError(f"action {a} on device {d} comes before any microbatch of stage {a.stage}")
                g.after_end.append(last_compute[a.stage])
                g.free_end.append((d, s.grad_bytes))
    # weights leave when the stage's last microbatch ends (gradients stay until their copy), but for those that
    # stay on the device for a later stage; those it found there leave with its own
    for k, w in weights.items():
        if k in last_compute:
            s = sts[k]
            last_compute[k].free_end.append((w.device, s.weight_bytes + s.found_bytes - s.kept_bytes))
    for c, d, pos, nbytes in stash_release:
        producer = compute.get((pos, c.microbatch))
        if producer is not None:
            c.free_end.append((producer.device, nbytes))  # the stash lives on the device that made it
    # the producer dependency may name a position that a later device list defines: resolve lazily
    for t in tasks:
        t.after_end.extend(_resolve(r, compute, out_copy, offload) for r in t.refs)
    return tasks, lanes, compute


def _standing(acts: Sequence[Action], sts: Sequence[StageCost]) -> float:
    """Weights on a device before its first stage starts: a resident plan's, which stay across iterations (what
    the first stage holds for the others and finds of its own)."""
    first = next((sts[a.stage] for a in acts if a.stage < len(sts)), None)
    if first is None:
        return 0.0
    return first.held_bytes + first.found_bytes + (first.weight_bytes if first.refreshes else 0.0)


def _add_accumulation(tasks: list[_Task], lanes: dict, sts: Sequence[StageCost], host: HostLoad) -> None:
    """A ``kA`` on the host's lane after every ``kG``: the host thread adds the stage's gradients into ``.grad``
    (work: the host-memory bytes it moves)."""
    if math.isinf(host.accumulate_bytes_per_s):
        return
    for g in [t for t in tasks if t.lane == "g_down" and sts[t.stage].grad_bytes]:
        # on_link: its bytes go through the host's memory bandwidth beside the links' copies (the "cpu" capacity)
        acc = _Task(f"{g.stage}A", g.device, "acc", g.stage, -1, sts[g.stage].grad_bytes * host.accumulate_traffic,
                    on_link=True, iteration=g.iteration)
        acc.after_end.append(g)
        tasks.append(acc)
        lanes.setdefault((-1, "acc"), []).append(acc)


def _add_reduction(tasks: list[_Task], lanes: dict, sts: Sequence[StageCost], host: HostLoad) -> None:
    """A ``kR`` on the host's network lane after every grad stage's ``kA`` (its ``kG`` when accumulation is free),
    in stage order: the all-reduce of its gradients across the data-parallel machines (fixed time); not
    overlapped, every ``kR`` waits for all other work of its iteration."""
    if host.nodes < 2:
        return
    done = {t.stage: t for t in tasks if t.lane == "g_down"}
    done.update({t.stage: t for t in tasks if t.lane == "acc"})
    for it in sorted({t.iteration for t in tasks}):
        others = [t for t in tasks if t.iteration == it]
        mine = {k: t for k, t in done.items() if t.iteration == it}
        # each grad stage's gradients, then the tables only the host reads (stage -1: added after every stage)
        for k, work, after in [(k, host.reduce_s(sts[k].reduced_bytes), [mine[k]]) for k in sorted(mine)] \
                + [(-1, host.reduce_s(host.host_grad_bytes), list(mine.values()))]:
            if work <= 0:
                continue
            r = _Task(f"{k}R" if k >= 0 else "hostR", mine[k].device if k >= 0 else 0, "net", k, -1, work,
                      on_link=False, iteration=it)
            r.after_end.extend(after if host.overlap_reduce else others)  # not overlapped: after all else
            tasks.append(r)
            lanes.setdefault((-1, "net"), []).append(r)


def _repeat(lists: Sequence[Sequence[Action]], sts: list[StageCost], iterations: int,
            ) -> tuple[list[list[Action]], list[StageCost]]:
    """``iterations`` consecutive copies of one iteration's round-robin lists and positions: position ``k`` of
    iteration ``t`` becomes ``t·S + k`` on the device ``t·S`` after its own (the pointer carries on)."""
    if iterations < 1:
        raise SimulationError(f"iterations must be >= 1, got {iterations}; pass the number of iterations to play")
    if any(s.releases >= 0 or s.resident_bytes or s.stash_bytes for s in sts):
        raise SimulationError("iterations > 1 plays round-robin schedules only (a static schedule keeps its stages "
                              "resident); simulate GPipe, 1F1B and interleaved 1F1B one iteration at a time")
    per, n = len(sts), len(lists)
    out: list[list[Action]] = [[] for _ in range(n)]
    stages: list[StageCost] = []
    for t in range(iterations):
        for d, acts in enumerate(lists):
            # the round-robin pointer carries on: iteration t starts t·S devices further on
            out[(d + t * per) % n].extend(Action(a.stage + t * per, a.kind, a.microbatch) for a in acts)
        stages.extend(dataclasses.replace(s, saved_by=tuple(f + t * per for f in s.saved_by)) for s in sts)
    return out, stages


def _add_steps(tasks: list[_Task], lanes: dict, sts: Sequence[StageCost], host: HostLoad, per: int,
               iterations: int) -> None:
    """A ``stepT`` on the host's step thread after each iteration's work (and the step before), and what waits for
    it (the module docstring): synchronous, all of the next iteration; overlapped, the weight uploads and the first
    position of the iteration after next, the first position also waiting for the loss of the one before — or,
    with ``overlap_step`` but not ``overlap_iterations``, for all of the one before (today's runtime: the step
    alone runs beside the next iteration)."""
    work: list[list[_Task]] = [[] for _ in range(iterations)]
    for t in tasks:
        work[t.iteration].append(t)
    # (no fused stage: the last position gives the loss)
    fused = next((k for k, s in enumerate(sts[:per]) if s.kind == "fused"), per - 1)
    steps: list[_Task] = []
    for it in range(iterations):
        step = _Task(f"step{it}", 0, "step", -1, -1, host.step_s, on_link=False, iteration=it)
        step.after_end.extend(work[it] + steps[-1:])
        steps.append(step)
        tasks.append(step)
        lanes.setdefault((-1, "step"), []).append(step)
    for it in range(1, iterations):
        if not host.overlap_step:
            for t in work[it]:
                t.after_end.append(steps[it - 1])
            continue
        loss = [t for t in work[it - 1] if t.lane == "compute" and t.stage == (it - 1) * per + fused]
        for t in work[it]:
            first = t.stage == it * per and t.lane in ("compute", "a_up", "s_up")
            if not host.overlap_iterations:
                t.after_end.extend(work[it - 1])  # forward_backward is a barrier: the step alone overlaps
            elif first:
                t.after_end.extend(loss)
            # one step stale: iteration it computes with the weights step it − 2 made
            if it >= 2 and (first or t.lane == "w_up"):
                t.after_end.append(steps[it - 2])


def _event(t: _Task, per: int) -> SimEvent:
    """``t`` as the timeline shows it: its position and label within its iteration."""
    stage, label = t.stage, t.label
    if stage >= 0 and t.iteration:
        stage = stage % per
        label = f"{stage}{label[len(str(t.stage)):]}"  # the global position in the label replaced too
    lane = _LANES[t.lane]
    return SimEvent(label, t.device, lane[2], lane[1], stage, t.microbatch, t.start, t.end, iteration=t.iteration)


def _depend_on_producer(t: _Task, a: Action, per: int) -> None:
    if a.stage % per:  # an iteration's first position takes its inputs from the host
        t.refs.append(("producer", a.stage - 1, a.microbatch))


def _resolve(ref: _Ref, compute: dict, out_copy: dict, offload: dict) -> _Task:
    what, k, j = ref
    if what == "offload":
        if (k, j) not in offload:
            raise SimulationError(f"position {k} saves no activations for microbatch {j}, but a backward position "
                                  f"prefetches from it; drop {k} from its saved_by")
        return offload[(k, j)]
    # the consumer waits for the output to reach host memory; for the compute itself only where nothing goes down
    if (k, j) in out_copy:
        return out_copy[(k, j)]
    if (k, j) not in compute:
        raise SimulationError(f"the action lists deadlock: {k + 1}F{j} waits for {k}F{j}, which no device runs")
    return compute[(k, j)]


def _rates(running, link: float, host: float, cpu: float = _INF) -> dict[int, float]:
    """Max-min fair rates: compute and fixed-time copies progress at 1 s/s; byte copies share their device link
    (one per direction) and the host's memory bandwidth (progressive filling); the host thread's accumulation
    shares that bandwidth too, at most ``cpu`` bytes/s."""
    rates: dict[int, float] = {}
    flows: list[_Task] = []
    for t in running:
        if t.on_link:
            flows.append(t)
        else:
            rates[id(t)] = 1.0
    cap: dict[object, float] = {"host": host, "cpu": cpu}
    for background in (False, True):  # strict priority: background copies share what the others leave
        _fill([t for t in flows if (t.lane in _BACKGROUND) == background], cap, link, rates)
    return rates


def _fill(flows: list, cap: dict, link: float, rates: dict) -> None:
    """Progressive filling of ``flows`` into the capacities left in ``cap`` (updated in place)."""
    if not flows:
        return
    members: dict[object, list] = {"host": list(flows)}  # every copy shares the host's memory bandwidth
    for t in flows:
        # the host's accumulation is capped by its thread's rate; a device's copies by its link, one per direction
        lane_key: object = "cpu" if t.lane in _HOST else (t.device, _LANES[t.lane][0])
        cap.setdefault(lane_key, link)
        members.setdefault(lane_key, []).append(t)
    unfrozen = set(id(t) for t in flows)
    while unfrozen:
        best: object = None
        share = _INF
        for key, ts in members.items():
            n = sum(1 for t in ts if id(t) in unfrozen)
            # the tightest resource: the smallest equal share
            if n and cap[key] / n < share:
                best, share = key, cap[key] / n
        if best is None:
            break
        for t in members[best]:
            if id(t) in unfrozen:
                rates[id(t)] = share
                unfrozen.discard(id(t))
                # a flow fixed here takes its share from every other resource it crosses
                for key, ts in members.items():
                    if key != best and t in ts:
                        cap[key] = max(0.0, cap[key] - share)
        cap[best] = 0.0  # saturated
