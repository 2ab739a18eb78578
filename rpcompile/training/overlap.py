"""Overlapped optimizer steps: ``pipe.step(optimizer, overlap=True)`` runs the step on a thread of its own beside
the next ``forward_backward``.

overlapped step
    An optimizer step run on the step thread while the next iteration computes; it is *collected* (waited for,
    its failure raised, the weight buffers swapped) by the next ``pipe.step`` or ``pipe.synchronize()``.
one step stale
    The iteration beside step t computes with the weights from before step t: with w₀ the initial weights,
    w_{t+1} = step(w_t, ∇L_t(w_{t-1})), w_{-1} = w₀ (RoundPipe's ``is_async=True``).
overlapped iterations
    A plan made for them (``compile(..., overlap=True)``): ``forward_backward`` returns once its loss is known
    and its last backward stages drain in the background.

:class:`Overlap` says what is computed and how iterations overlap; :class:`ZeroGradShadow` what the user may do
while a step is in flight; :func:`watch_model` and :func:`wait_for_steps` who else waits for it.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from rpcompile.runtime.executor import Running
from rpcompile.runtime.failures import PipelineError
from rpcompile.runtime.weights import GradSink, WeightStore

from ..core.errors import ConfigError
from .hooks import Hook
from .interrupts import deferred, finish_first, finished

__all__ = ["SCHEDULED", "settings", "changed_setting", "optimizers_of", "schedulers_of", "step_now",
           "ZeroGradShadow", "Overlap", "wait_for_steps", "watch_model"]

#: The settings of a parameter group that lr schedulers set (``OneCycleLR`` and ``CyclicLR`` cycle the momentum
#: too). Others are left out: some optimizers keep their own running values there (Prodigy's ``d``).
SCHEDULED = ("lr", "momentum", "betas", "weight_decay")

Settings = list[dict[str, Any]]


def settings(optimizer: Any) -> Settings:
    """An optimizer's :data:`SCHEDULED` settings, per parameter group."""
    # cloned: a scheduler sets a tensor lr in place (fill_), which would change a kept reference with it
    return [{k: g[k].clone() if isinstance(g[k], torch.Tensor) else g[k] for k in SCHEDULED if k in g}
            for g in optimizer.param_groups]


def changed_setting(before: Settings, after: Settings) -> str:
    """The first setting that differs, as ``lr of group 0 (0.001 -> 0.0009)``; "" where none does."""
    for i, (b, a) in enumerate(zip(before, after)):
        for k in sorted({*b, *a}):
            x, y = b.get(k), a.get(k)
            # == of two tensors is a tensor, whose truth is ambiguous past one element
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
            if not same:
                return f"{k} of group {i} ({x!r} -> {y!r})"
    # zip stops at the shorter list: a group added or removed shows as a change of their number
    return "" if len(before) == len(after) else f"parameter groups ({len(before)} -> {len(after)})"


def optimizers_of(optimizer: Any) -> list[Any]:
    """``pipe.step``'s optimizer argument as a list: one optimizer, or a list or tuple of them."""
    many = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not many:
        raise ConfigError("pipe.step got an empty list of optimizers: pass an optimizer or a list of them")
    for o in many:
        if not hasattr(o, "param_groups") or not callable(getattr(o, "step", None)):
            raise ConfigError(f"pipe.step takes an optimizer (param_groups, step(), zero_grad()) or a list of them, "
                              f"got {type(o).__name__}")
    return many


def schedulers_of(scheduler: Any) -> list[Any]:
    """``pipe.step``'s ``scheduler=``: None, one lr scheduler, or a list or tuple of them."""
    if scheduler is None:
        return []
    return list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]


def step_now(optimizers: Sequence[Any], schedulers: Sequence[Any], scaler: Any = None) -> None:
    """The synchronous step: each optimizer's ``step()`` — ``scaler.step(o)`` for each then one
    ``scaler.update()`` with an enabled ``GradScaler`` — then their ``zero_grad()``, then the schedulers; a Ctrl-C
    meanwhile is raised when all of it is done (:class:`~rpcompile.training.interrupts.deferred`)."""
    with deferred():  # a Ctrl-C meanwhile is raised once every optimizer has stepped (rpcompile.training.interrupts)
        if scaler is not None and scaler.is_enabled():
            for o in optimizers:
                scaler.step(o)  # skipped on inf/nan gradients; the scale adapts
            scaler.update()
        else:
            for o in optimizers:
                o.step()
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        for s in schedulers:
            s.step()


class ZeroGradShadow:
    """``zero_grad`` of some owners (optimizers, a module) shadowed by an instance attribute that records the call
    instead of running it, while an overlapped step reads ``.grad``; :meth:`restore` puts back
    exactly what each owner had and, with ``replay``, runs the recorded calls with the real methods, in order.

    **What the user may do meanwhile.** ``optimizer.zero_grad()`` (or the model's ``zero_grad()``) while the step is in
    flight would race with its reading of ``.grad``: from :meth:`Overlap.start` until the step is collected both are
    shadowed by an instance attribute (:class:`ZeroGradShadow`) that records the call, and the call is replayed — with
    the real method — once the step is done and before the held gradients are installed: exactly "clear the gradients
    before the next backward". A change of the settings a scheduler sets (:data:`SCHEDULED`) while the step is in flight
    races too: it is refused when the step is collected (``scheduler=`` steps it on the thread). A step that raises is
    collected as a :class:`~rpcompile.runtime.failures.PipelineError`; the overlap ends, the copies are remade from the
    masters as the step left them, and the recorded ``zero_grad`` calls are dropped (``.grad`` keeps what the failed
    step was given).
    """

    def __init__(self, owners: Sequence[Any]):
        self.saved: list[tuple[Any, bool, Any]] = []
        """Per owner shadowed: the owner, whether it had an instance attribute ``zero_grad``, and its value."""
        self.calls: list[tuple[Callable[..., Any], tuple, dict[str, Any]]] = []
        for owner in owners:
            own = getattr(owner, "__dict__", None)
            # an owner without a __dict__ cannot be shadowed; one given twice (the same optimizer again) is shadowed
            # once, or its second entry would save the shadow as the owner's own attribute and restore would put it back
            # for good
            if own is None or any(owner is s[0] for s in self.saved):
                continue
            self.saved.append((owner, "zero_grad" in own, own.get("zero_grad")))
            own["zero_grad"] = self._deferred(owner.zero_grad)  # not setattr: a Module's __setattr__ stays out

    def _deferred(self, real: Callable[..., Any]) -> Callable[..., None]:
        def zero_grad(*args: Any, **kwargs: Any) -> None:
            """Recorded: an overlapped step is reading ``.grad``; replayed once it is done (rpcompile.training.overlap)."""
            self.calls.append((real, args, kwargs))
        return zero_grad

    def restore(self, *, replay: bool) -> None:
        for owner, had, value in self.saved:
            if had:
                owner.__dict__["zero_grad"] = value
            else:
                owner.__dict__.pop("zero_grad", None)
        self.saved = []
        calls, self.calls = self.calls, []
        if replay:
            for real, args, kwargs in calls:
                real(*args, **kwargs)


_IN_FLIGHT: "weakref.WeakSet[Overlap]" = weakref.WeakSet()
"""Every :class:`Overlap` with a step not yet collected (:func:`wait_for_steps`)."""
_STEP_THREAD = threading.local()  # .on: this thread runs an overlapped step (it must never wait for itself)


def _keys(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """What identifies parameters across pipelines over one model: their storage (the same ``nn.Parameter``, or a
    traced graph's tensor sharing it)."""
    # meta tensors and empty ones (data_ptr 0) have no storage to share: they match nothing
    return frozenset(t.data_ptr() for t in tensors if t.device.type != "meta" and t.data_ptr())


def wait_for_steps(tensors: Iterable[torch.Tensor], *, besides: Overlap | None = None) -> None:
    """Wait for every overlapped step in flight over any of ``tensors`` (another pipeline's over the same model),
    except ``besides``' (a pipeline's own step runs beside its next iteration by design)."""
    # a snapshot: other threads' collects and the garbage collector change the weak set
    others = [o for o in list(_IN_FLIGHT) if o is not besides and o.future is not None and not o.future.done()]
    if not others or getattr(_STEP_THREAD, "on", False):
        return
    keys = _keys(tensors)
    # only the steps that write storage of these tensors: another model's step in flight does not hold this call up
    wait([f for o in others if o.keys & keys and (f := o.future) is not None])


def watch_model(model: torch.nn.Module, overlap: Overlap, synchronize: Callable[[], None]) -> None:
    """Hooks on the compiled ``model``: its ``state_dict()`` waits for ``overlap``'s step in
    flight; its ``load_state_dict()`` calls ``synchronize`` first (the pipeline's ``synchronize``, held weakly),
    which waits for the step and ends the overlap. They go when ``overlap`` (its pipeline) does.

    **Who else waits for the step.** The step writes the masters (and the optimizer's state) on its thread until it is
    collected; whatever reads or writes them meanwhile waits for it first — or would see, or be overwritten by, a
    half-done step. ``model.state_dict()`` (so ``rpcompile.save_checkpoint`` and ``torch.save(model.state_dict())``) and
    ``optimizer.state_dict()`` wait for it; ``model.load_state_dict()`` and ``optimizer.load_state_dict()`` wait for it
    and, for the model, end the overlap as ``pipe.synchronize()`` does, so the loaded weights are the ones the next
    iteration computes with (the pipeline's hooks on the compiled model and, while the step runs, on its optimizers:
    :func:`watch_model`; copies of the model, pickled or deep-copied, carry hooks that do nothing). A run of another
    pipeline over the same parameters — ``forward_backward``, ``evaluate``, ``forward`` — waits for every step in flight
    over them (:func:`wait_for_steps`, keyed by the parameters' storage), so it never computes with half-stepped
    weights. A Ctrl-C waits for the step too (:mod:`rpcompile.training.interrupts`): the weights are stepped or not,
    never half, when the ``KeyboardInterrupt`` arrives; starting and collecting a step are never cut in half.
    """
    # weak: hooks that live on the user's model must not keep the pipeline (its buffers) alive
    compiled, own, sync = weakref.ref(model), weakref.ref(overlap), weakref.WeakMethod(synchronize)

    def before_save(module: torch.nn.Module, *args: Any) -> None:
        o = own()
        # a deep copy or pickle of the model carries these hooks too: they act on the compiled model only
        if module is compiled() and o is not None:
            o.wait()

    def before_load(module: torch.nn.Module, *args: Any) -> None:
        s = sync()
        # not on the step thread: a load_state_dict reached from the step must not wait for the step itself
        if module is compiled() and s is not None and not getattr(_STEP_THREAD, "on", False):
            s()

    handles = [model.register_state_dict_pre_hook(Hook(before_save)),
               model.register_load_state_dict_pre_hook(Hook(before_load))]
    weakref.finalize(overlap, _remove, handles)


def _remove(handles: Sequence[Any]) -> None:
    for h in handles:
        h.remove()


class Overlap:
    """The overlapped step in flight (:attr:`future`) and the overlap it began, which lasts until :meth:`end`
    (``pipe.synchronize()``): the optimizers stepped overlapped since it began, the settings the step in flight
    was given, the ``zero_grad`` methods shadowed meanwhile.

    **What it computes.** The iteration that runs beside step t reads the weights from *before* step t — every trainable
    weight copy is double-buffered (:meth:`rpcompile.runtime.weights.WeightStore.begin_overlap`): the step writes the
    back buffer, the iteration uploads the front one, and the two swap once the step is collected — so its gradients are
    one step stale: with w₀ the initial weights, w_{t+1} = step(w_t, ∇L_t(w_{t-1})), w_{-1} = w₀ (RoundPipe's
    ``is_async=True``). Meanwhile ``.grad`` belongs to the step (it reads them, then zeroes them): the iteration's
    gradients are held aside (:meth:`rpcompile.runtime.weights.GradSink.hold`) and installed into ``.grad`` when it
    ends, after the step is collected. Several optimizers (``pipe.step([o1, o2], overlap=True)``) step one after the
    other on the one thread, each with its parameters double-buffered.

    **Overlapped iterations** (a plan made for them, ``compile(..., overlap=True)``, or ``pipe.overlap_iterations =
    True``): ``forward_backward`` returns once the fused stage has computed every microbatch's loss, and its last
    backward stages drain in the background (:meth:`Executor.start <rpcompile.runtime.executor.Executor.start>`) while
    the caller steps and passes the next batch; each device goes on into the next iteration as soon as it has finished
    its stages of this one, the round-robin pointer carrying on. The semantics stay exactly one step stale — no more:
    every iteration between step t−1 and step t computes with the weights from before step t−1 (each iteration keeps the
    front copies it started with, :meth:`WeightStore.pinned <rpcompile.runtime.weights.WeightStore.pinned>`, through the
    swap that the next ``pipe.step`` makes when it collects step t−1), and its gradients go into buffers of that
    generation (:meth:`GradSink.fork <rpcompile.runtime.weights.GradSink.fork>`) that the step's thread puts into
    ``.grad`` once they have all drained, right before step t. So ``.grad`` is the step's throughout: read gradients
    (clip, log) after :meth:`Pipeline.synchronize <rpcompile.Pipeline.synchronize>`. Iteration t+1 needs only step t−1,
    which ``pipe.step`` collected before submitting step t. A failure in a draining stage is raised, naming its
    iteration, by the next call that finds it (``forward_backward``, ``pipe.step``, ``synchronize``): the step waiting
    for it is not taken and the overlap ends as for a failed step. A Ctrl-C stops the iteration being called, never one
    that already returned its loss. Not data-parallel (refused in one line).
    """

    def __init__(self, weights: WeightStore, grads: GradSink):
        self.weights, self.grads = weights, grads
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="rpcompile-step")
        self.future: Future[tuple[list[Settings], list[Settings]]] | None = None
        self.optimizers: list[Any] = []
        """Every optimizer stepped overlapped since the overlap began (empty: synchronous steps)."""
        self._stepping: list[Any] = []
        self._given: list[Settings] = []
        self._shadow: ZeroGradShadow | None = None
        self.keys: frozenset[int] = frozenset()
        """The storage of the parameters the step in flight writes (:func:`wait_for_steps`)."""
        self._hooks: list[Any] = []  # on the stepping optimizers' state_dict and load_state_dict
        self.iterations = False
        """Iterations overlap too (a plan made for them): :meth:`Pipeline.forward_backward <rpcompile.Pipeline.forward_backward>` returns once its loss
        is known and the devices go on into the next iteration while the last stages drain (:class:`Overlap`)."""
        self.running: list[Running] = []
        """The overlapped iterations not yet handed to a collected step: still draining, or done."""
        self.held: dict[str, torch.Tensor] = {}
        """The gradients of the iterations since the last step (the open generation), apart from ``.grad``."""
        self.last: Running | None = None
        """The latest overlapped iteration: the next one's devices each go on once they have finished theirs."""

    def start(self, optimizers: Sequence[Any], schedulers: Sequence[Any], model: torch.nn.Module) -> None:
        """Submit ``optimizers``' step (then ``zero_grad``, then ``schedulers``) to the step thread, their
        parameters double-buffered, the next iteration's gradients held aside and ``zero_grad`` of the optimizers
        and ``model`` shadowed until the step is collected. With overlapped iterations the step first waits for
        the iterations since the last one to drain, and puts their gradients into ``.grad`` itself."""
        self.check_idle()
        with deferred():  # never half begun: a Ctrl-C meanwhile is raised once the step is submitted
            self._start(optimizers, schedulers, model)

    def _start(self, optimizers: Sequence[Any], schedulers: Sequence[Any], model: torch.nn.Module) -> None:
        for o in optimizers:
            self.weights.begin_overlap(o)
        self.grads.hold(True)  # the next iteration's gradients wait beside .grad, which the step reads
        # by identity: an optimizer stepped again in the same overlap is one entry
        self.optimizers += [o for o in optimizers if all(o is not p for p in self.optimizers)]
        reals = [o.zero_grad for o in optimizers]  # before the shadow: the step thread clears .grad for real
        weights, grads = self.weights, self.grads
        # the iterations since the last step: their gradients are this step's; handed, so the next step does not take
        # them
        drains = [r for r in self.running if not r.handed]
        # with overlapped iterations their gradients were added into self.held, and the step puts them in .grad itself;
        # otherwise the iteration beside the step holds its own and forward_backward installs them once it is collected
        held = self.held if self.iterations else None
        for r in drains:
            r.handed = True
        self.held = {}  # the next generation's

        def run() -> tuple[list[Settings], list[Settings]]:
            for r in drains:  # the iterations this step takes the gradients of, still draining
                if (error := r.wait()) is not None:
                    raise PipelineError(_drain_failed(r, error)) from error
            if held is not None:
                grads.install(held)
            for o in optimizers:
                o.step()
            used = [settings(o) for o in optimizers]  # what the step may have read: changed since, it raced
            for zero_grad in reals:
                zero_grad(set_to_none=True)
            for s in schedulers:
                s.step()
            # the stepped masters into the back buffers, which become the uploaded copies when the step is collected
            # (swap)
            for o in optimizers:
                weights.write_back(o)
            return used, [settings(o) for o in optimizers]

        self._submit(optimizers, run, shadow=[*optimizers, model])

    def check_idle(self) -> None:
        """Refuse (one line) a second overlapped step while one no iteration has run beside is in flight."""
        # with overlapped iterations forward_backward does not collect the step: one in flight is legitimate once an
        # iteration not yet handed to a step (it ran beside it) exists
        if self.future is not None and not (self.iterations and any(not r.handed for r in self.running)):
            names = ", ".join(type(o).__name__ for o in self._stepping)
            raise ConfigError(f"pipe.step(..., overlap=True) again before the next forward_backward, while the "
                              f"overlapped step of {names} is in flight: step the optimizers together, "
                              "pipe.step([o1, o2], overlap=True)")

    def resume(self, optimizers: Sequence[Any], stale: Mapping[str, torch.Tensor]) -> None:
        """A state saved right after an overlapped step (``Pipeline.load_state_dict``): the step is done (the
        optimizers' state says so); the next iteration computes with the ``stale`` copies from before it."""
        for o in optimizers:
            self.weights.begin_overlap(o)  # double-buffered copies of the masters, as start() makes
        for name, t in stale.items():
            self.weights.source(name).copy_(t)  # the front copies: what the next iteration computes with
        self.grads.hold(True)
        self.optimizers = list(optimizers)
        weights = self.weights
        now = [settings(o) for o in optimizers]

        def copies() -> tuple[list[Settings], list[Settings]]:  # the step is done: only its copies
            for o in optimizers:
                weights.write_back(o)
            return now, now

        self._submit(optimizers, copies, shadow=[])  # nothing reads .grad: zero_grad may run

    def _submit(self, optimizers: Sequence[Any], fn: Callable[[], tuple[list[Settings], list[Settings]]],
                shadow: Sequence[Any]) -> None:
        # the settings as submitted: compared at collection with those the step read, to find a change that raced it
        self._stepping, self._given = list(optimizers), [settings(o) for o in optimizers]
        self._shadow = ZeroGradShadow(shadow)
        try:
            self.future = future = self._stepper.submit(_on_step_thread, fn)
        except BaseException:  # (a pool shut down): nothing was shadowed
            self._shadow.restore(replay=False)
            self._shadow = None
            raise
        # whoever reads or writes what the step writes waits for it (watch_model)
        self.keys = _keys(p for o in optimizers for g in o.param_groups for p in g["params"])
        _IN_FLIGHT.add(self)
        # a Ctrl-C from now on waits for the step to end before it is raised (interrupts.finish_first)
        finish_first(future)
        for o in optimizers:
            if hasattr(o, "register_state_dict_pre_hook"):  # torch.optim optimizers
                self._hooks += [o.register_state_dict_pre_hook(Hook(lambda *_: self.wait())),
                                o.register_load_state_dict_pre_hook(Hook(lambda *_: self.wait()))]

    def wait(self) -> None:
        """Wait for the step in flight, if any, without collecting it (not on the step's own thread)."""
        future = self.future
        if future is not None and not getattr(_STEP_THREAD, "on", False):
            wait([future])

    def stale_copies(self) -> dict[str, torch.Tensor]:
        """The copies the next iteration computes with, while a step no iteration has run beside is in flight
        (``Pipeline.state_dict``): collected first if it failed (raising its :class:`~rpcompile.runtime.failures.PipelineError`)."""
        if self.future is None:
            return {}
        if self.future.exception() is not None:
            self.collect()  # raises; back to synchronous steps
        weights = self.weights
        # cloned: at collection the front copies become the back buffers that the next step writes over
        return {n: weights.source(n).clone() for n, e in weights.entries.items() if e.master.requires_grad}

    def collect(self) -> None:
        """Wait for the step in flight, if any: its weights become the ones the devices upload and the
        ``zero_grad`` calls made meanwhile run. A step that raised, or raced with a settings change, raises a
        :class:`~rpcompile.runtime.failures.PipelineError` after ending the overlap (:class:`ZeroGradShadow`)."""
        future = self.future
        if future is None:
            return
        wait([future])  # (a second Ctrl-C here leaves with nothing changed)
        with deferred():  # never half collected
            self._collect(future)

    def _collect(self, future: Future[tuple[list[Settings], list[Settings]]]) -> None:
        if future.exception() is not None:
            self.check_drains()  # an iteration the step waited for failed: that failure, naming the iteration
        self.future = None
        # the iterations this step took the gradients of are done with; those begun since stay for the next step
        self.running = [r for r in self.running if not r.handed]
        _IN_FLIGHT.discard(self)
        finished(future)
        _remove(self._hooks)
        self._hooks = []
        shadow, self._shadow = self._shadow, None
        try:
            used, left = future.result()
            changed = _changed(self._stepping, self._given, used, left)
            if changed:
                raise ConfigError(
                    f"{changed} changed while the overlapped step ran, which may have used either value (an lr "
                    "scheduler stepped after pipe.step(optimizer, overlap=True)?); pass it as "
                    "pipe.step(optimizer, overlap=True, scheduler=scheduler), or change the optimizer before "
                    "pipe.step")
        except Exception as e:
            # back to synchronous steps: the copies are remade from the masters as the step left them, and the
            # iteration's gradients (held apart) are dropped — .grad keeps what the failed step was given
            if shadow is not None:
                shadow.restore(replay=False)
            self._abandon()
            raise PipelineError(f"the overlapped optimizer step failed: {type(e).__name__}: {e}") from e
        # only after a step that succeeded: a failed one's copies are remade from the masters instead (_abandon)
        self.weights.swap()
        if shadow is not None:
            shadow.restore(replay=True)  # before the held gradients are installed: they are the next backward's

    def end(self) -> None:
        """Back to synchronous steps (``pipe.synchronize()``): the overlapped iterations drained, the step
        collected, the held gradients in ``.grad``, the double buffers gone."""
        self.drain()
        self.collect()
        with deferred():
            self.running, self.last = [], None
            if self.optimizers:
                self.grads.install(self.held if self.iterations else None)
                self.held = {}
                self.grads.hold(False)
                self._end(failed=False)

    def check_drains(self) -> None:
        """Raise, as a :class:`~rpcompile.runtime.failures.PipelineError` naming its iteration, the failure of an overlapped iteration that
        failed after its loss was returned — once every iteration in flight has settled and the step has
        finished (not taken), the overlap ended as a failed step ends it: back to synchronous steps, the
        iterations' gradients dropped."""
        # only a settled iteration's failure: one still running may fail later, and is found then
        failed = next((r for r in self.running if r.settled.is_set() and r.error is not None), None)
        if failed is None:
            return
        with deferred():
            future, self.future = self.future, None
            if future is not None:
                wait([future])
                _IN_FLIGHT.discard(self)
                finished(future)
                _remove(self._hooks)
                self._hooks = []
            if self._shadow is not None:
                self._shadow.restore(replay=False)
                self._shadow = None
            self._abandon()
        assert failed.error is not None
        raise PipelineError(_drain_failed(failed, failed.error)) from failed.error

    def drain(self) -> None:
        """Wait for every overlapped iteration in flight (the devices idle); raise a failure among them
        (:meth:`check_drains`)."""
        for r in self.running:
            r.wait()
        self.check_drains()

    def _abandon(self) -> None:
        """Back to synchronous steps after a failure: the overlapped iterations settled (their gradients, held
        apart, dropped with the held buffers) and every copy remade from the masters as they were left."""
        for r in self.running:
            r.wait()
        self.running, self.last, self.held = [], None, {}
        self.grads.hold(False)
        self._end(failed=True)

    def began(self, run: Running) -> None:
        """An overlapped iteration started (:meth:`Pipeline.forward_backward <rpcompile.Pipeline.forward_backward>`)."""
        # a settled iteration that did not fail needs no waiting (its gradients went into held as it ran); a failed one
        # stays for check_drains to raise
        self.running = [r for r in self.running if not r.settled.is_set() or r.error is not None] + [run]
        self.last = run

    def _end(self, *, failed: bool) -> None:
        # once at least, with no optimizer: the back buffers go and the store stops overlapping either way
        for o in self.optimizers or [None]:
            self.weights.end_overlap(o, failed=failed)
        self.optimizers = []
        self.ended()

    def ended(self) -> None:
        """Told when the overlap ends (the pipeline: the executor's threads as before, :meth:`Executor.start <rpcompile.runtime.executor.Executor.start>`)."""


def _drain_failed(run: Running, error: BaseException) -> str:
    return (f"iteration {run.iteration} failed after forward_backward returned its loss (overlapped iterations: "
            f"its last stages were draining): {error}")


def _on_step_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on the step's thread, marked as such: hooks it meets there do not wait for the step itself."""
    _STEP_THREAD.on = True
    try:
        return fn()
    finally:
        _STEP_THREAD.on = False


def _changed(optimizers: Sequence[Any], given: list[Settings], used: list[Settings], left: list[Settings]) -> str:
    """The first scheduled setting changed by someone else while the step ran — between ``pipe.step`` and the
    step (``given``/``used``) or between the step's end and now (``left``/now) — as ``the optimizer's lr of group
    0 (...)``; "" where none was."""
    for i, o in enumerate(optimizers):
        changed = changed_setting(given[i], used[i]) or changed_setting(left[i], settings(o))
        if changed:
            return f"the optimizer's {changed}" if len(optimizers) == 1 else f"optimizer {i}'s {changed}"
    return ""
