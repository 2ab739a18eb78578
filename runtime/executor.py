"""The round-robin executor: a small interpreter of per-device action lists (:mod:`.schedule`).

Terms:

- **worker**: one thread per device that runs its list in order. ``kW`` makes the device's copy of stage k's weights
  (from the host copies in the compute precision, :mod:`~rpcompile.runtime.weights`), ``kFj`` runs stage k on
  microbatch j once stage k−1 has finished microbatch j, ``kG`` sends the stage's gradients home, where the gradient
  sink's thread adds them into the masters' ``.grad`` while the device goes on.
- **value**: what one stage hands to another, kept in host memory (:class:`~.values.ValueStore`), keyed by (value
  name, microbatch). A stage's own steps (its weights and inputs up, the call, its buffers and gradients home) are
  :mod:`.stage_call`'s functions.
- **hand-off**: a value one stage hands to the next (or a gradient a backward stage leaves for an earlier one); on
  one GPU it stays in device memory (:attr:`Executor.resident_budget`).
- **Failures**: an exception in any thread of a call stops the call; the caller gets one
  :class:`~rpcompile.runtime.failures.PipelineError` naming the stage, device and microbatch (or a Ctrl-C's
  ``KeyboardInterrupt``), and every ``.grad`` is what it was before the call.

:class:`Executor` runs one iteration (its docstring says how weights, hand-offs, host embeddings, overlapped
iterations, the stage kinds and failures are handled); the pipeline owns one.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from rpcompile.core.errors import one_line
from rpcompile.core.program import Program, StageProgram
from rpcompile.core.schedule import Action

from . import rng, stage_call
from .activity import span
from .devices import CpuDevice, Device
from .failures import PipelineError, Stopped, first_failure, without_frames
from .segments import saved
from .segments.capture import HostSaved
from .stage_call import StageState, to_host, upload_tree
from .stays import DeviceGrads, DeviceWeights
from .values import TimelineEvent, ValueStore
from .weights import GradSink, HostTraffic, WeightStore

__all__ = ["Executor", "Running"]

class Executor:
    """Runs one iteration of a schedule (the module docstring's terms).

    **Weight prefetch.** A device's weights for its next stage go up while it runs the current one: when the worker
    starts a stage's first microbatch it hands the next ``W`` of its list to the device's prefetch thread, and that
    ``W`` only collects the result (the simulator's rule: a ``W`` may start once the device started the stage before it;
    at most two stages' weights are resident, the planner's ``P`` term). A forward stage's weights are dropped after its
    last microbatch, a fused or backward stage's after its gradients went home — except the copies the plan keeps on the
    device for a later stage there, or keeps for good (weights that stay, :mod:`~rpcompile.runtime.stays`: a stage
    uploads only what it does not find). On a GPU the copies run on a stream of their own, behind the activation uploads
    (:meth:`~.devices.Device.upload_weights`).

    **Hand-offs on one device.** With a single device that is not a logical CPU device (one GPU), every stage runs
    there, so a value one stage hands to the next (and the gradient a backward stage leaves for an earlier one) stays in
    device memory instead of a round trip through host memory. Only what the host reads comes home: the gradients of a
    host embedding's rows, the losses, the model's output in evaluation. Saved activations still go down (they are what
    the plan sends to host memory). What stays is held until the call ends (a backward stage recomputes from its
    forward's input), so at most :attr:`Executor.resident_budget` bytes of it in a call; beyond that a hand-off goes
    home as it would on several devices.

    **Host embeddings** (:mod:`rpcompile.passes.rewrite.host`): a host thread looks up every microbatch's rows in the
    fp32 master table, in order, cast to the compute precision; the stages that read them wait for them like for any
    value still on its way. Once every fused or backward stage that reads a microbatch's rows has finished it, the same
    thread adds the rows' gradients (summed over those stages, as for any value) into the table's ``.grad``.

    **Overlapped iterations** (:meth:`Executor.start`): one iteration runs in the background on threads of its own
    (:class:`Running`, all its per-call state on a shallow copy of the executor that shares the devices, the weight
    store and the sink's locks), so the caller gets its losses while its last stages drain; the next iteration's list
    for a device starts once that device has finished its list of the one before.

    Stage semantics (docs/architecture.md §3):

    - forward stages run without autograd and hand on the values later stages need;
    - the fused stage runs forward, loss and backward in one go;
    - backward stages recompute their forward from the saved boundary values with autograd on, then run backward with
      the gradients later stages left for their outputs, and leave gradients for their own inputs. Saved segments
      (:mod:`.segments.saved`) are not recomputed: the forward stage runs their fw graph and ships their saved tensors
      (:class:`~.segments.capture.HostSaved`); in the backward stage they are one autograd node that runs their bw
      graph.

    Buffers (BatchNorm statistics) are updated by the real forward only: recomputation runs on copies — of the values
    the forward stage found for that microbatch, where it changed them (a running mean the forward also reads recomputes
    as that microbatch saw it). Randomness (dropout) is replayed per node (:mod:`.rng`), so recomputation draws the
    forward's masks.

    **Failures.** An exception in any thread of the call (a worker, the host thread, the gradient sink, a copy going
    down) stops the call: the other workers stop before their next action (or wait), in-flight uploads, saves and
    hand-offs land, and the caller gets one :class:`~rpcompile.runtime.failures.PipelineError` naming the stage, device
    and microbatch — or, for a Ctrl-C (a ``KeyboardInterrupt`` on any of its threads), the ``KeyboardInterrupt`` itself.
    Gradients are all or none: the sink takes back everything the call added (:meth:`~.weights.GradSink.abort`), so
    every ``.grad`` is what it was before the call, and the next call starts clean. What stays alive between calls is
    idle: the devices' prefetch and offload threads (pools that outlive calls) wait for work; the call's own threads
    (workers, host, sink) have ended. A Ctrl-C may also come as :attr:`Executor.interrupted` (set from a signal handler,
    which must not raise at an arbitrary instant of the call's own bookkeeping: ``rpcompile.training.interrupts``); and
    a call that a second Ctrl-C left before its threads had stopped is stopped and settled by :meth:`Executor.finish`,
    at the latest when the next call begins.
    """

    def __init__(
        self,
        program: Program,
        devices: Sequence[Device],
        params: dict[str, torch.nn.Parameter],
        buffers: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        frozen_masters: bool = False,
    ):
        self.program, self.devices = program, list(devices)  # bound by the caller (.bind), as every program it runs
        self.params, self.buffers, self.dtype = params, buffers, dtype
        self.traffic = HostTraffic()
        """Host bytes in parameter-sized work since the last :meth:`HostTraffic.reset <rpcompile.runtime.weights.HostTraffic.reset>` (:mod:`~rpcompile.runtime.weights`)."""
        uploaded = [n for prog in self.program.stages for n in prog.params.values()]
        self.weights = WeightStore(params, dtype, pin=any(d.torch_device.type == "cuda" for d in self.devices),
                                   uploaded=uploaded, host_only=[h.weight for h in self.program.host],
                                   frozen_masters=frozen_masters, traffic=self.traffic)
        self.grads = GradSink(params, self.traffic)
        self.stays = DeviceWeights(self.program, len(self.devices))  # weights that stay on a device (runtime/stays.py)
        self.sums = DeviceGrads(self.program, self.devices, params)  # gradients summed there (no_sync)
        # a logical CPU device's hand-offs never leave it anyway (its download returns the tensor): nothing to
        # keep or count
        self.resident_handoffs = len(self.devices) == 1 and not isinstance(self.devices[0], CpuDevice)
        """Hand-offs between stages stay on the device (class docstring); the host's values still come home."""
        self.resident_budget: float = math.inf
        """Bytes of hand-offs a call may keep on the device (the pipeline gives a GPU part of what its plan leaves
        free); the rest go home."""
        self._resident_bytes = 0
        self._resident_lock = threading.Lock()
        self._host_values = frozenset(h.value for h in self.program.host)
        for d in self.devices:
            d.traffic = self.traffic
        self.timeline: list[TimelineEvent] = []
        self.training = True
        """False: the stages run their dropouts switched off (the model in eval mode after a train-mode trace,
        :mod:`.rng`)."""
        self.seed: int | None = None
        """The dropout seed every mask is drawn from, with the iteration, node and microbatch (:mod:`.rng`)."""
        self._slot_cache: stage_call.SlotCache = {}
        self.interrupted = False
        """Set (it may be from a signal handler: a plain store, no lock) to stop the call in flight at its workers'
        next action, as a Ctrl-C does: the call raises ``KeyboardInterrupt`` and adds no gradient. Whoever sets it
        clears it (``Pipeline`` at each call's start)."""
        self._threads: list[_Thread] = []  # the last call's
        self._watch: Executor | None = None  # an overlapped iteration's: whose interrupted flag stops it too
        self._threads_before: int | None = None  # intra-op threads while iterations overlap (start)
        self._losses_in = threading.Event()
        self._open = False  # a call has begun and neither committed nor settled (finish)
        self._changed_buffers: dict[int, set[str]] = {}  # per forward stage: the buffers its forward changes
        # one thread per device uploads its next stage's weights (in list order, so never more than one ahead)
        self._prefetchers = [ThreadPoolExecutor(1, thread_name_prefix=f"rpcompile-prefetch{d}")
                             for d in range(len(self.devices))]

    # ------------------------------------------------------------------------------------------ the loop
    def run(self, schedule: list[list[Action]], store: ValueStore, *, iteration: int,
            loss_fn: Callable[[Any, Any, int], torch.Tensor] | None, targets: Sequence[Any] | None = None,
            grad_scale: float = 1.0) -> list[torch.Tensor]:
        """Run every device's action list; return the fused stage's per-microbatch losses (on the host).

        The fused stage calls ``loss_fn(output, target, j)`` for microbatch j with ``targets[j]`` uploaded to its
        device (every tensor in it, dtypes kept; None without ``targets``). A failure anywhere stops the call as
        the class docstring's **Failures** says: :class:`~rpcompile.runtime.failures.PipelineError` (or the
        ``KeyboardInterrupt`` itself) once nothing of the call runs any more, every ``.grad`` as it was before the
        call."""
        self.finish()  # a call left behind by a Ctrl-C that escaped: stopped before this one takes its place
        self._begin(schedule, store, iteration, loss_fn, targets, grad_scale)
        # Device 0 runs on the calling thread: a fresh thread would start its own OpenMP team while the caller's
        # idles (spinning) on the same cores, which made one-device CPU steps ~2× slower than eager.
        workers = [_Thread(self._worker, (d, acts), f"rpcompile-dev{d}") for d, acts in enumerate(schedule) if d > 0]
        threads = torch.get_num_threads()
        cpu_workers = sum(1 for d in self.devices if d.torch_device.type == "cpu")
        host = self._host_thread(store)
        # the undo record must exist before any thread can submit a gradient (the host thread starts below)
        self.grads.begin()
        self._threads, self._open = host + workers, True
        try:
            if cpu_workers > 1:  # logical CPU devices share the cores: more intra-op threads than cores thrash
                torch.set_num_threads(max(1, threads // cpu_workers))
            started: list[_Thread] = []
            try:
                for w in host + workers:
                    started.append(w)  # first: a Ctrl-C inside start() leaves it joined (_join skips unstarted)
                    w.start()
                self._worker(0, schedule[0])
            except BaseException as e:  # noqa: BLE001 - Ctrl-C on the calling thread between actions
                self._fail(e)
            self._join(started)
            # after a failure the sink's queue is dropped by _settle's abort, not drained
            if not self.failed:
                try:
                    self.grads.drain()  # every stage's gradients added
                except BaseException as e:  # noqa: BLE001 - a gradient that failed to land fails the call
                    self._fail(e)
            self._stopping()  # (a Ctrl-C while the call ran, however late: the call did not happen)
        finally:  # a second Ctrl-C while the threads stop leaves at once (_join), without settling
            torch.set_num_threads(threads)
        if self.failed:
            self._settle()
            self._open = False
            raise first_failure(self.failed)
        # the call succeeded: only now do its deferred gradients join the device sums (DeviceGrads.commit)
        self.grads.commit()
        self.sums.commit(self.grads)
        self._open = False
        return [self.losses[j] for j in sorted(self.losses)]

    def _begin(self, schedule: list[list[Action]], store: ValueStore, iteration: int,
               loss_fn: Callable[[Any, Any, int], torch.Tensor] | None, targets: Sequence[Any] | None,
               grad_scale: float) -> None:
        """A call's own state (:meth:`run`, :meth:`start`)."""
        self.store, self.iteration, self.loss_fn, self.grad_scale = store, iteration, loss_fn, grad_scale
        self.targets = targets
        self.losses: dict[int, torch.Tensor] = {}
        # W and G actions carry microbatch -1 (schedule.Action): the count comes from the F actions
        self.microbatches = 1 + max(a.microbatch for acts in schedule for a in acts)
        # only F actions have dependents (the next stage's F of the same microbatch, the host's gradient adds)
        self.done = {(a.stage, a.microbatch): threading.Event() for acts in schedule for a in acts if a.kind == "F"}
        self.failed: list[BaseException] = []
        self.t0 = time.perf_counter()
        self.timeline = []
        self._resident_bytes = 0  # what the last call kept went with its store
        self._losses_in = threading.Event()  # every microbatch's loss, or a failure (start)

    def _host_thread(self, store: ValueStore) -> list[_Thread]:
        """The call's host thread, if the program looks rows up on the host; their futures put in the store before
        any stage may look for them."""
        if not self.program.host:
            return []
        # futures rather than values: a stage that starts before the host thread has looked its rows up blocks on the
        # future (stage_call.inputs) instead of finding nothing in the store
        rows: dict[tuple[str, int], Future[torch.Tensor]] = {
            (h.value, j): Future() for h in self.program.host for j in range(self.microbatches)}
        for (name, j), future in rows.items():
            store.put(name, j, future)
        return [_Thread(self._host, (store, rows), "rpcompile-host")]

    # ------------------------------------------------------------------------------------------ overlapped
    def start(self, schedule: list[list[Action]], store: ValueStore, *, iteration: int,
              loss_fn: Callable[[Any, Any, int], torch.Tensor] | None, targets: Sequence[Any] | None = None,
              grad_scale: float = 1.0, held: dict[str, torch.Tensor] | None = None,
              after: "Running | None" = None) -> "Running":
        """One iteration of overlapped iterations, run in the background (:class:`Running`): each device's list
        starts once the device has finished its list of ``after`` (the iteration before, which may still be
        draining), with the weights the store's front copies hold now (:meth:`WeightStore.pinned <rpcompile.runtime.weights.WeightStore.pinned>`), its gradients
        added into ``held`` (a generation's buffers, :meth:`GradSink.fork <rpcompile.runtime.weights.GradSink.fork>`). A Ctrl-C (:attr:`interrupted`)
        stops it until :meth:`Running.losses` has returned; from then on it runs to its end."""
        cpu_workers = sum(1 for d in self.devices if d.torch_device.type == "cpu")
        if cpu_workers > 1 and self._threads_before is None:  # as run() does, for as long as iterations overlap
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, self._threads_before // cpu_workers))
        call = copy.copy(self)  # shares the devices, weights, sink's locks, caches; the call's own state below
        call._watch, call.interrupted = self, False
        call.weights, call.grads = self.weights.pinned(), self.grads.fork(held)
        call._begin(schedule, store, iteration, loss_fn, targets, grad_scale)
        call._resident_lock = threading.Lock()  # the copy counts its own resident bytes (_begin)
        self.timeline = call.timeline  # what pipe.timeline shows: the latest call's, filling while it drains
        return Running(call, schedule, after)

    def restore_threads(self) -> None:
        """Iterations no longer overlap: the intra-op threads :meth:`start` shared out among logical CPU devices
        go back to what they were."""
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _losses_done(self) -> None:
        if len(self.losses) == self.microbatches:
            self._losses_in.set()

    def finish(self) -> None:
        """Leave no call behind: one that a Ctrl-C left before it had stopped its threads (a second Ctrl-C, or one
        at an instant the call could not catch it) is stopped now — its threads end at their next action and are
        waited for — and the gradients it added are taken back (:meth:`GradSink.abort <rpcompile.runtime.weights.GradSink.abort>`). The next :meth:`run`
        does this first; the pipeline does it as soon as a call raises."""
        if not self._open:
            return
        self._fail(Stopped())
        self._join(self._threads)
        self._settle()
        self._open = False

    def _stopping(self) -> bool:
        """Whether the call stops here: it failed, or :attr:`interrupted` was set (recorded as a Ctrl-C) — on an
        overlapped iteration's executor (:meth:`start`), on the one watched."""
        watch = self._watch  # (an overlapped iteration whose losses are all in runs to its end: see start)
        watched = watch is not None and watch.interrupted and len(self.losses) < self.microbatches
        # a Ctrl-C is recorded once, however many threads see the flag
        if (self.interrupted or watched) and not any(isinstance(f, KeyboardInterrupt) for f in self.failed):
            self._fail(KeyboardInterrupt())
        return bool(self.failed)

    def _fail(self, e: BaseException) -> None:
        """Record a failure; every thread of the call stops at its next action (or wait)."""
        self.failed.append(e)
        # wake every thread blocked on a microbatch or the losses: each then sees the failure and stops
        for ev in self.done.values():
            ev.set()
        self._losses_in.set()

    def _join(self, threads: Sequence[_Thread]) -> None:
        """Wait for the call's threads. A Ctrl-C meanwhile stops them (each finishes the action it is in) and is
        re-raised once they have; a second Ctrl-C while they stop returns at once."""
        for t in threads:
            while t.ident is not None and not t.ended.is_set():  # (a thread never started has nothing to stop)
                try:
                    t.ended.wait()
                except KeyboardInterrupt as e:
                    # a second Ctrl-C: the caller leaves now; finish() stops and settles the call later
                    if any(isinstance(f, KeyboardInterrupt) for f in self.failed):
                        raise
                    self._fail(e)

    def _settle(self) -> None:
        """After a failure: nothing of the call left in flight — saves and hand-offs still going down land (and a
        failed copy's error is cleared for the next call), the devices' queues drain — and every gradient the
        call added is taken back (:meth:`GradSink.abort <rpcompile.runtime.weights.GradSink.abort>`)."""
        try:
            for device in self.devices:
                for offloader in (device.offloader, device.handoffs):
                    if offloader is not None:
                        offloader.settle()
                with contextlib.suppress(Exception):  # a device that failed reports it on its next use
                    device.synchronize()
        finally:
            # in the finally: gradients are taken back even when a device's copy failed while settling
            self.sums.abort()
            self.grads.abort()

    def _worker(self, d: int, actions: list[Action], prefetched: dict[int, Future] | None = None) -> None:
        device = self.devices[d]
        states: dict[int, StageState] = {}
        prefetched = {} if prefetched is None else prefetched
        ahead = _next_weights(actions)
        act: Action | None = None
        try:
            with _ambient(device):
                for act in actions:
                    # checked between actions only: an action in progress runs to its end (its uploads and
                    # hand-offs land)
                    if self._stopping():
                        return
                    self._dispatch(device, act, states, prefetched, ahead)
        except BaseException as e:  # noqa: BLE001 - reported to the caller, other workers stop
            # a Ctrl-C stays itself so the caller re-raises it; anything else becomes one line naming the stage
            self._fail(e if isinstance(e, KeyboardInterrupt) else self._stage_error(d, act, e))
        finally:
            wait(prefetched.values())  # an upload still under way for a stage that will not run: let it finish

    def _stage_error(self, d: int, act: Action | None, e: BaseException) -> PipelineError:
        """One line naming the stage, action, device and microbatch; the worker's traceback on ``.details``."""
        device = self.devices[d]
        stage = self.program.stages[act.stage].name if act is not None else None
        what = f"stage {stage} ({act})" if act is not None else "a worker"
        at = f" at microbatch {act.microbatch}" if act is not None and act.kind == "F" else ""
        err = PipelineError(f"{what} failed on device {d} ({device.torch_device}){at}: {one_line(e)}")
        err.stage, err.device = stage, d
        err.microbatch = act.microbatch if act is not None and act.kind == "F" else None
        err.details = traceback.format_exc()
        err.__cause__ = without_frames(e)  # its frames would keep the stage's activations alive
        return err

    def _host(self, store: ValueStore, pending: dict[tuple[str, int], Future]) -> None:
        """The host thread of an iteration (class docstring): every microbatch's lookups, then their gradients."""
        m, host = self.microbatches, self.program.host
        try:
            for j in range(m):
                for h in host:
                    if self._stopping():
                        raise Stopped()  # to the except below: it fails the futures stages wait on
                    with torch.no_grad():
                        rows = h.forward(store.get(h.index, j), self.weights.host_table(h.weight))
                    # cast as the stages' other inputs are: they compute in the compute precision
                    pending[(h.value, j)].set_result(rows.to(self.dtype) if self.dtype is not None else rows)
            # only fused and backward stages differentiate, so only they leave gradients for the rows
            readers = {h.value: [p.index for p in self.program.stages if p.kind != "forward" and h.value in p.inputs]
                       for h in host}
            trainable = [h for h in host if self.params[h.weight].requires_grad and readers[h.value]]
            for j in range(m):
                for h in trainable:
                    for k in readers[h.value]:
                        # the store sums every reader's gradient of microbatch j's rows: all must have finished it
                        self.done[(k, j)].wait()
                    if self._stopping():
                        return
                    grad = store.grad(h.value, j)
                    # (the readers left no gradient for these rows: nothing to add)
                    if grad is None:
                        continue
                    self.grads.accumulate(h.weight, h.accumulate, store.get(h.index, j), grad)
            self.grads.notify("host")  # every row's gradient is in (data-parallel reduction)
        except BaseException as e:  # noqa: BLE001 - reported to the caller; the stages waiting for rows stop
            err: BaseException = e
            # Stopped: the call failed elsewhere and that failure is recorded already
            if not isinstance(e, (KeyboardInterrupt, Stopped)):
                err = PipelineError(f"the host's embedding lookup failed: {one_line(e)}")
                err.details = traceback.format_exc()
                err.__cause__ = without_frames(e)
                self._fail(err)
            elif isinstance(e, KeyboardInterrupt):
                self._fail(e)
            # stages blocked on rows not looked up yet get the error instead of waiting for ever
            for f in pending.values():
                if not f.done():
                    f.set_exception(err)

    def run_forward(self, store: ValueStore, *, iteration: int, microbatches: int = 1,
                    loss_fn: Callable[[Any, Any, int], torch.Tensor] | None = None,
                    targets: Sequence[Any] | None = None) -> list[Any]:
        """Evaluation, without autograd: the forward and fused stages in order, each stage's weights uploaded once
        — the next stage's going up while this one computes, as in training — and its microbatches run in turn (a
        stage holds one microbatch's values at a time, as planned); the buffers a forward wrote (a train-mode
        batch norm's statistics, a counter) come home after the last, as in training — eager's forward writes them
        too. Returns per
        microbatch the model's output on the host, or, with ``loss_fn``, ``loss_fn(output, targets[j], j)``
        computed on the fused stage's device (the output never comes home). A failure raises one
        :class:`~rpcompile.runtime.failures.PipelineError` naming the stage, device and microbatch, as :meth:`run` does."""
        self.store, self.iteration, self.t0 = store, iteration, time.perf_counter()
        for h in self.program.host:
            for j in range(microbatches):
                with torch.no_grad():
                    rows = h.forward(store.get(h.index, j), self.weights.host_table(h.weight))
                store.put(h.value, j, rows.to(self.dtype) if self.dtype is not None else rows)
        # evaluation needs no gradient: the fused stage (the last here) gives the model's output
        stages = [p for p in self.program.stages if p.kind != "backward"]
        ahead: Future[StageState] | None = None
        for k, prog in enumerate(stages):
            d = prog.index % len(self.devices)
            device = self.devices[d]
            act: Action | None = Action(prog.index, "W")
            results: list[Any] = []
            try:
                state = ahead.result() if ahead is not None else self._upload(device, prog)
                ahead = None
                if k + 1 < len(stages):  # the next stage's weights go up while this one computes
                    nxt = stages[k + 1]
                    nxt_device = self.devices[nxt.index % len(self.devices)]
                    ahead = self._prefetchers[nxt_device.index].submit(self._upload, nxt_device, nxt)
                device.wait_weights(state.ready)
                for j in range(microbatches):
                    act = Action(prog.index, "F", j)
                    results.append(self._evaluate(device, prog, state, j, loss_fn, targets))
                act = None
                # what the forward wrote (a train-mode BN's statistics; a counter in any mode), as eager's forward
                stage_call.writeback_buffers(device, state, self.buffers)
            except BaseException as e:  # noqa: BLE001 - one line naming the stage, as a training call's failure
                if ahead is not None:
                    wait([ahead])  # the next stage's upload lands before the caller sees the failure
                with contextlib.suppress(Exception):
                    device.synchronize()
                if isinstance(e, KeyboardInterrupt):
                    raise
                raise self._stage_error(d, act, e) from None
            if prog.kind == "fused":
                return results
        raise RuntimeError("plan has no fused stage")

    def _evaluate(self, device: Device, prog: StageProgram, state: StageState, j: int,
                  loss_fn: Callable[[Any, Any, int], torch.Tensor] | None, targets: Sequence[Any] | None) -> Any:
        """Microbatch ``j`` through one stage without autograd (:meth:`run_forward`): a forward stage's values go
        to the store; the fused stage's output comes home, or its loss does."""
        rng.context.iteration, rng.context.microbatch, rng.context.device = self.iteration, j, device.torch_device
        rng.context.training, rng.context.seed = self.training, self.seed
        saved.forward_mode.save = False  # evaluation keeps nothing for a backward pass
        with torch.no_grad(), _ambient(device), device.compute():
            outs = stage_call.call(prog, state, self._inputs(device, prog, j, leaves=False), self._slot_cache,
                                   copy_buffers=False)  # a real forward: it updates buffers
            if prog.kind == "fused" and loss_fn is not None:
                target = upload_tree(device, targets[j]) if targets is not None else None
                # losses come home in fp32 whatever the compute precision
                return device.download(loss_fn(prog.model_output(outs), target, j).float())
        if prog.kind == "fused":  # the output on the host, like the model's on the CPU
            return prog.model_output(pytree.tree_map(lambda v: to_host(device, v), outs))
        for name, v in zip(prog.outputs, outs):
            self.store.put(name, j, to_host(device, v))
        return None

    def _dispatch(self, device: Device, act: Action, states: dict[int, StageState],
                  prefetched: dict[int, Future], ahead: dict[int, int]) -> None:
        prog = self.program.stages[act.stage]
        # stage 0 reads only the batch; any later stage waits for its predecessor's microbatch
        if act.kind == "F" and act.stage > 0:
            with span("wait", f"{prog.name} mb{act.microbatch}"):
                self.done[(act.stage - 1, act.microbatch)].wait()
            # _fail sets every event: the wake-up may be a failure
            if self.failed:
                return
        start = time.perf_counter() - self.t0
        if act.kind == "F" and act.microbatch == 0 and act.stage in ahead:  # the stage starts: prefetch the next
            nxt = self.program.stages[ahead[act.stage]]
            prefetched[nxt.index] = self._prefetchers[device.index].submit(self._upload, device, nxt)
        if act.kind == "F" and act.microbatch == 0 and device.offloader is not None:
            # saves of the previous stage beyond the budget still going down: this stage's planned memory has no
            # room for them (on an H100 an 8B LM-head stage ran 3.3 GiB past its plan beside such a backlog)
            device.offloader.wait_within_budget()
        if act.kind == "W":
            future = prefetched.pop(act.stage, None)
            # no future: the first W of the device's list, unless an overlapped iteration prefetched it (Running)
            state = states[act.stage] = future.result() if future is not None else self._upload(device, prog)
            # the compute stream waits for the weight stream's copies (CUDA); the host does not
            device.wait_weights(state.ready)
            start, end = state.uploaded  # the upload's own span, on whichever thread ran it
            self.timeline.append(TimelineEvent(str(act), prog.name, act.microbatch, device.index, start, end))
            return
        if act.kind == "F":
            last = act.microbatch == self.microbatches - 1
            with device.compute():
                self._compute(device, prog, states[act.stage], act.microbatch)
                # a backward stage's buffers are recomputation copies (copy_buffers): only real forwards write home
                if prog.kind != "backward" and last:
                    stage_call.writeback_buffers(device, states[act.stage], self.buffers)
            if prog.kind == "forward" and last:
                del states[act.stage]  # no gradients to wait for: the device's copy of the weights can go
            # set only once what the stage leaves (outputs, input gradients) is in the store: the next stage reads it
            # as soon as it wakes
            self.done[(act.stage, act.microbatch)].set()
        else:
            with span("grads out", prog.name):
                stage_call.download_grads(device, prog, states.pop(act.stage), self.grads, self.sums)
        self.timeline.append(TimelineEvent(str(act), prog.name, act.microbatch, device.index, start,
                                           time.perf_counter() - self.t0))

    def _upload(self, device: Device, prog: StageProgram) -> StageState:
        """The device's copies of a stage's weights (:func:`.stage_call.upload`), on the worker or on the device's
        prefetch thread."""
        return stage_call.upload(device, prog, self.weights, self.params, self.buffers, self.dtype, self.t0,
                                 self.stays)

    def _inputs(self, device: Device, prog: StageProgram, mb: int, *, leaves: bool) -> list[Any]:
        """A stage's inputs for microbatch ``mb`` on its device (:func:`.stage_call.inputs`)."""
        return stage_call.inputs(device, prog, mb, self.store, self.dtype, self.program.needs_grad, leaves=leaves)

    def _stays(self, t: torch.Tensor) -> bool:
        """Whether hand-off ``t`` stays on the device (class docstring), counted against the budget if so."""
        if not self.resident_handoffs:
            return False
        # the whole storage: a view keeps all of it alive on the device
        size = t.untyped_storage().nbytes()
        with self._resident_lock:
            if self._resident_bytes + size > self.resident_budget:
                return False
            self._resident_bytes += size
        return True

    def _compute(self, device: Device, prog: StageProgram, state: StageState, mb: int) -> None:
        rng.context.iteration, rng.context.microbatch, rng.context.device = self.iteration, mb, device.torch_device
        rng.context.training, rng.context.seed = self.training, self.seed
        what = f"{prog.name} mb{mb}"  # the profiler spans' detail (.activity)
        if prog.kind == "forward":
            saved.forward_mode.save = True  # saved segments keep their activations for the backward stage
            with torch.no_grad():
                with span("inputs", what):
                    inputs = self._inputs(device, prog, mb, leaves=False)
                with span("compute", what):
                    # before the call: the forward changes buffers in place, and the backward stage recomputes
                    # from the values it read
                    kept = stage_call.buffer_copies(prog, state, self._changed_buffers)
                    outs = stage_call.call(prog, state, inputs, self._slot_cache, copy_buffers=False)
                    stage_call.keep_buffers_before(device, prog, state, kept, mb, self.store, self._changed_buffers,
                                                   on_device=self.resident_handoffs)
            with span("outputs", what):
                for name, v in zip(prog.outputs, outs):
                    if isinstance(v, HostSaved):  # behind the compute, latest stage first (runtime/offload.py)
                        self.store.put(name, mb, device.offload(v, priority=(-prog.index, mb)))
                    elif isinstance(v, torch.Tensor):
                        self.store.put(name, mb, v if self._stays(v) else device.handoff(v))
                    else:
                        self.store.put(name, mb, to_host(device, v))
            return
        # the fused stage runs the real forward (it updates buffers); a backward stage only replays it
        recompute = prog.kind == "backward"
        with span("inputs", what):
            # leaves: each input that needs a gradient collects it in its .grad, for the stage before
            inputs = self._inputs(device, prog, mb, leaves=True)
            before = stage_call.buffers_before(device, prog, mb, self.store) if recompute else None
        with span("compute", what):
            with torch.enable_grad():
                raw = stage_call.call(prog, state, inputs, self._slot_cache, copy_buffers=recompute, before=before)
            if prog.kind == "fused":
                target = upload_tree(device, self.targets[mb]) if self.targets is not None else None
                assert self.loss_fn is not None  # run() is given one whenever the plan has a fused stage
                loss = self.loss_fn(prog.model_output(raw), target, mb)
                # detached: the host copy must not keep the stage's autograd graph alive
                self.losses[mb] = device.download(loss.detach().float())
                self._losses_done()
                # scaled for fp16 (its gradients stay scaled until GradScaler unscales); None: the loss's own gradient 1
                roots, grads = [loss * self.grad_scale], [None]
        if prog.kind != "fused":
            with span("inputs", what):  # the gradients later stages left for this one's outputs
                roots, grads = stage_call.output_grads(device, prog, raw, mb, self.store)
        # (no gradient came back for any output: nothing to differentiate)
        if roots:
            with span("compute", what):
                torch.autograd.backward(roots, grads)
        with span("outputs", what):
            for name, v in zip(prog.inputs, inputs):
                if isinstance(v, torch.Tensor) and v.requires_grad and v.grad is not None:
                    stays = name not in self._host_values and self._stays(v.grad)  # the host adds those
                    self.store.add_grad(name, mb, v.grad if stays else device.handoff(v.grad))


class Running:
    """An overlapped iteration in flight (:meth:`Executor.start`): its devices' lists, host thread and gradient
    sink on threads of their own, and one more that waits for them, drains the sink and commits the call's
    gradients — or, after a failure, settles the call and keeps its error (:attr:`error`)."""

    def __init__(self, call: Executor, schedule: list[list[Action]], after: "Running | None") -> None:
        self.call, self.iteration = call, call.iteration
        self.error: BaseException | None = None
        """The call's failure once :attr:`settled` (None: it succeeded)."""
        self.settled = threading.Event()
        """Set when nothing of the call runs any more: every gradient added and committed, or taken back."""
        self.handed = False
        """Its gradients belong to an optimizer step submitted since (``rpcompile.training.overlap``)."""
        self.workers = [_Thread(self._device, (d, acts, after), f"rpcompile-dev{d}")
                        for d, acts in enumerate(schedule)]
        _Thread(self._run, (), "rpcompile-iteration").start()

    def _device(self, d: int, actions: list[Action], after: "Running | None") -> None:
        c, prefetched = self.call, {}
        # (not where a stage keeps weights for a later one: the device's first stage lets go of what is left)
        prefetch = c.program.resident or not any(c.stays.keeps)
        if after is not None and actions and actions[0].kind == "W" and prefetch:
            # the first stage's weights go up behind the device's last stage of the iteration before, on its
            # prefetch thread, as the next stage's always do (two stages' weights resident: the plan's P term)
            prog = c.program.stages[actions[0].stage]
            prefetched[prog.index] = c._prefetchers[d].submit(c._upload, c.devices[d], prog)
        # the event, not join (see _Thread)
        if after is not None:  # the device goes on once it has finished its list of the iteration before
            after.workers[d].ended.wait()
        c._worker(d, actions, prefetched)

    def _run(self) -> None:
        c = self.call
        host = c._host_thread(c.store)
        c.grads.begin()
        started: list[_Thread] = []
        try:
            for w in host + self.workers:
                started.append(w)
                w.start()
        except BaseException as e:  # noqa: BLE001 - a thread that could not start fails the call
            c._fail(e)
        c._join(started)
        if not c.failed:
            try:
                c.grads.drain()
            except BaseException as e:  # noqa: BLE001 - a gradient that failed to land fails the call
                c._fail(e)
        c._stopping()
        if c.failed:
            try:
                c._settle()
            finally:
                self.error = first_failure(c.failed)
        else:
            c.grads.commit()
        self.settled.set()

    def losses(self) -> list[torch.Tensor]:
        """Every microbatch's loss, once the fused stage has computed them all; from then on a Ctrl-C no longer
        stops the call. A call that failed first raises its failure once it has settled."""
        c = self.call
        c._losses_in.wait()
        # _losses_in is set by the last loss or by a failure: the count tells which
        if len(c.losses) < c.microbatches:  # (a failure after the losses, however soon, is the drain's: later)
            self.settled.wait()
            assert self.error is not None
            raise self.error
        # the losses are the caller's now: a Ctrl-C from here on no longer stops this call (start's docstring)
        c._watch = None
        return [c.losses[j] for j in sorted(c.losses)]

    def wait(self) -> BaseException | None:
        """Wait until the call has settled; its failure, or None."""
        self.settled.wait()
        return self.error


class _Thread(threading.Thread):
    """A daemon thread of a call that says when it has ended (``ended``). Waited for with the event, never
    ``join``: a ``join`` that a Ctrl-C interrupts marks the thread as ended while it still runs (CPython's
    ``_wait_for_tstate_lock``), and the call would settle beside a worker still at work."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._call, self._call_args = target, args
        self.ended = threading.Event()

    def run(self) -> None:
        try:
            self._call(*self._call_args)
        finally:
            self.ended.set()


def _next_weights(actions: Sequence[Action]) -> dict[int, int]:
    """Per stage of a device's list, the stage whose weights go up once its first microbatch starts: the next
    ``W`` in the list (none for the last stage)."""
    out: dict[int, int] = {}
    current = None
    for a in actions:
        if a.kind == "W" and current is not None:
            out[current] = a.stage
        elif a.kind == "F":
            current = a.stage
    return out


def _ambient(device: Device) -> Any:
    """The stage's device as the default device while it runs: fx-traced factory calls without ``device=`` and the
    portable graphs' ``default_device()`` nodes (:mod:`rpcompile.passes.graph.portable`) allocate there. The CPU is the
    default already (and a device context costs a Python call per torch call)."""
    return torch.device(device.torch_device) if device.torch_device.type != "cpu" else contextlib.nullcontext()
