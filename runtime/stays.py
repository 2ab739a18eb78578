"""Weights and gradients that stay on a device: the runtime's side of ``Stage.keeps``, ``Plan.resident`` and
``Stage.accumulates``.

Terms:

- **keeps** / **finds**: a forward stage may keep some of its weights on its device for the backward stage there
  that differentiates them (``keeps``); that stage ``finds`` them and uploads only the rest. Otherwise a stage's
  device copies go with the stage, and the next stage that reads a parameter uploads it again.
- **resident**: a plan that keeps every weight on its device across iterations (``Plan.resident``).
- **current**: a copy that stays is current while the host copy it was made from has not changed since
  (:meth:`~.weights.WeightStore.version`); one that is not is uploaded again, so a stay never serves a stale weight.
- **gradient sums** (``accumulates``): under ``pipe.no_sync()``, a stage's gradients of some parameters summed on
  its device instead of sent home, one download per accumulation cycle.

Which stage finds and keeps what is :func:`rpcompile.core.schedule.weight_stays`'s walk over the stages'
parameters, the same walk the planner priced (:mod:`rpcompile.passes.solver.stays`). :class:`DeviceWeights` holds
the copies that stay and :class:`DeviceGrads` the sums; their docstrings give the rules.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Hashable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from rpcompile.core.errors import ConfigError
from rpcompile.core.program import Program
from rpcompile.core.schedule import weight_stays

from .devices import Device
from .weights import GradSink, WeightStore, nbytes

__all__ = ["DeviceWeights", "DeviceGrads"]


class DeviceWeights:
    """The weight copies that stay on each of ``devices`` devices for ``program`` (module docstring), and the
    weight bytes each device uploaded and found since it was made (:attr:`uploaded`, :attr:`found`).

    It holds the copies that stay, per device, each with the version of the host copy it was made from
    (:meth:`~.weights.WeightStore.version`). A stage takes the copies it finds (:meth:`DeviceWeights.take`) and uploads
    only the rest; it leaves the copies it keeps (:meth:`DeviceWeights.leave`). A copy whose host copy changed since —
    after an optimizer step, a ``load_state_dict``, ``pipe.refresh_weights()`` — is not current and is uploaded again: a
    resident plan refreshes its trainable weights once per step this way, at their first use in the iteration, and never
    uploads a frozen one twice; gradient-accumulation calls between steps upload nothing. So a stay never serves a stale
    weight, whatever the plan says; a plan that keeps what nobody finds only holds memory, which its figures count.

    Device memory: a copy that stays is referenced here from the upload of the stage that keeps it until the stage that
    finds it takes it (and, while it runs, by that stage's state) — what the planner counts as ``held_bytes`` of the
    stages in between. Each device's copies are touched by its worker and its prefetch thread, one stage at a time in
    list order, so the upload that keeps one ends before the upload that finds it starts.
    """

    def __init__(self, program: Program, devices: int) -> None:
        uses = [list(dict.fromkeys(p.params.values())) for p in program.stages]
        keeps = {n for p in program.stages for n in p.stage.keeps}
        walk = weight_stays(uses, devices, keeps, resident=program.resident)
        self.finds = [w.found for w in walk]
        """Per stage (by index): the parameters it may find on its device."""
        self.keeps = [w.kept for w in walk]
        """Per stage: the parameters it leaves on its device."""
        self.uploaded = [0] * devices
        """Weight bytes each device uploaded (its stages' parameters, not buffers)."""
        self.found = [0] * devices
        """Weight bytes each device's stages found there instead of uploading them."""
        self._copies: list[dict[str, tuple[torch.Tensor, Hashable]]] = [{} for _ in range(devices)]
        self._lock = threading.Lock()
        self._devices, self._resident = devices, program.resident

    def take(self, device: int, stage: int, names: Sequence[str], weights: WeightStore) -> dict[str, torch.Tensor]:
        """The current copies of ``names`` on ``device`` that stage ``stage`` finds there; each one it does not
        keep itself leaves this table (the stage's state holds it now). The device's first stage of a call lets
        go of what an unfinished call left (an evaluation runs no backward stage to find what its forward stages
        kept; a failed call stops anywhere), which its plan does not count on; a resident plan's copies stay."""
        with self._lock:
            copies = self._copies[device]
            # stages 0..N-1 are each device's first of the call (round robin): nothing a plan counts on is here yet
            if stage < self._devices and not self._resident:
                copies.clear()
            if stage >= len(self.finds) or not self.finds[stage]:
                return {}
            out = {}
            for name in names:
                if name not in self.finds[stage] or name not in copies:
                    continue
                # a stage that keeps it too (a resident plan, or a later stage reads it) leaves it in the table
                t, version = copies[name] if name in self.keeps[stage] else copies.pop(name)
                # a copy made from a stale host copy (version None) is never current; one not current is uploaded again
                if version is not None and version == weights.version(name):
                    out[name] = t
            self.found[device] += sum(nbytes(t) for t in out.values())
        return out

    def holding(self, device: int) -> int:
        """Bytes of weight copies staying on ``device`` now (kept by a stage for a later one, or resident)."""
        with self._lock:
            return sum(nbytes(t) for t, _ in self._copies[device].values())

    def leave(self, device: int, stage: int, uploaded: dict[str, torch.Tensor], weights: WeightStore) -> None:
        """After stage ``stage`` uploaded ``uploaded`` to ``device`` (from :meth:`WeightStore.source <rpcompile.runtime.weights.WeightStore.source>`): count them,
        and keep those it leaves there, with the version of the host copy they came from."""
        with self._lock:
            self.uploaded[device] += sum(nbytes(t) for t in uploaded.values())
            if stage < len(self.keeps):
                for name in self.keeps[stage] & uploaded.keys():
                    # the version now, right after source() made the copy: a later step or refresh changes it
                    self._copies[device][name] = (uploaded[name], weights.version(name))


class DeviceGrads:
    """The gradient sums each device keeps across calls under ``no_sync`` (module docstring), and the gradient
    bytes the stages left there instead of sending them home (:attr:`kept`).

    During a call under ``pipe.no_sync()`` (``deferring``), a stage that ``accumulates`` leaves those parameters'
    gradients on its device instead of sending them home; when the call has succeeded they join that device's sums (in
    the masters' dtype, as ``.grad``). The next call outside ``no_sync`` sends each sum home with that call's gradient
    added (one download per accumulation cycle instead of one per call) and the sums go. The sums join only once the
    call has succeeded, so a failed call leaves them as they were — as the gradient sink leaves ``.grad``. Meanwhile
    each summed parameter's ``.grad`` holds what it held before the first deferred call (zeros if nothing:
    :meth:`GradSink.accumulate <rpcompile.runtime.weights.GradSink.accumulate>`), and a change to it by someone else —
    ``optimizer.zero_grad()``, to None or to zeros — means the accumulation was dropped: the sums of that parameter go
    too (:meth:`DeviceGrads.check`). An optimizer step over a parameter whose gradient is still on a device is refused
    in one line (its ``.grad`` is not whole yet); ``pipe.step`` and ``pipe.sync_gradients()`` send the sums home first
    (:meth:`DeviceGrads.flush`).
    """

    def __init__(self, program: Program, devices: Sequence[Device], params: dict[str, torch.nn.Parameter]):
        self.names = [frozenset(p.stage.accumulates) for p in program.stages]
        """Per stage (by index): the parameters whose gradients it may keep on its device."""
        self.deferring = False
        """The call in flight keeps those gradients on the devices (set by the pipeline per call)."""
        self.kept = 0
        """Gradient bytes the stages kept on their devices instead of sending them home."""
        self._devices, self._params = list(devices), params
        self._sums: dict[str, tuple[int, torch.Tensor]] = {}  # name -> (device, sum there)
        self._call: list[tuple[int, str, torch.Tensor]] = []  # the call's gradients, joining the sums at commit
        self._marks: dict[str, tuple[Any, int]] = {}  # name -> (weakref to its .grad, that tensor's version)
        self._lock = threading.Lock()
        if self.active:
            weakref.finalize(self, register_optimizer_step_pre_hook(_refuse_partial(weakref.ref(self))).remove)

    @property
    def active(self) -> bool:
        """Some stage of the plan sums gradients on its device."""
        return any(self.names)

    def pending(self) -> set[str]:
        """The parameters whose gradients are (partly) on the devices now, after :meth:`check`."""
        self.check()
        return set(self._sums)

    def take(self, device: int, stage: int, name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
        """What of parameter ``name``'s gradient stage ``stage`` sends home (None: nothing), on ``device``'s
        worker after its last microbatch: deferring, nothing (the gradient waits for the call's end); otherwise
        the gradient with the sum of the earlier calls added, when there is one (the sum stays until the call
        has succeeded)."""
        if name not in self.names[stage]:
            return grad
        if self.deferring:
            if grad is not None:
                with self._lock:
                    self._call.append((device, name, grad))
                    self.kept += nbytes(grad)
            return None
        # not deferring: the call that ends the accumulation sends the sum home with its own gradient
        held = self._sums.get(name)
        if held is None:
            return grad
        if grad is None:
            return held[1]
        # on the compute stream that made the gradient, so the add follows it
        with self._devices[device].compute():
            return held[1] + grad

    def commit(self, sink: GradSink) -> None:
        """The call succeeded: deferring, its gradients join the sums (and each newly summed parameter's
        ``.grad`` is marked, zeros if it had none); otherwise the sums went home with it and go."""
        if not self.deferring:
            self._sums.clear()
            self._marks.clear()
            return
        call, self._call = self._call, []
        for d, name, grad in call:
            held = self._sums.get(name)
            with self._devices[d].compute():
                if held is None:
                    # a tensor of its own, in the master's dtype: later calls add into it in place, as into .grad
                    self._sums[name] = (d, grad.to(self._params[name].dtype, copy=True))
                else:
                    held[1].add_(grad)
            if name not in self._marks:
                sink.accumulate(name, lambda g: None)  # a zero .grad where there was none: what zero_grad clears
                g = self._params[name].grad
                assert g is not None
                self._marks[name] = (weakref.ref(g), g._version)

    def abort(self) -> None:
        """The call failed: its gradients never join the sums."""
        self._call.clear()

    def check(self) -> None:
        """Drop the sums of every parameter whose ``.grad`` someone changed since they began (class docstring)."""
        for name, (ref, version) in list(self._marks.items()):
            g = self._params[name].grad
            # set to None, replaced, or zeroed in place (its version moves): someone dropped the accumulation
            if g is None or ref() is not g or g._version != version:
                del self._marks[name]
                self._sums.pop(name, None)

    def flush(self, sink: GradSink) -> None:
        """Send every sum home into ``.grad`` now (outside a call): all of them, or — if a copy fails — none,
        ``.grad`` as before."""
        self.check()
        if not self._sums:
            return
        by_device: dict[int, list[str]] = {}
        for name, (d, _) in self._sums.items():
            by_device.setdefault(d, []).append(name)
        # under the sink's undo record: a failed copy leaves every .grad and every sum as it was
        sink.begin()
        try:
            for d, names in by_device.items():
                sink.submit(names, self._devices[d].download_all([self._sums[n][1] for n in names]))
            sink.drain()
        except BaseException:
            sink.abort()
            raise
        sink.commit()
        self._sums.clear()
        self._marks.clear()


def _refuse_partial(ref: "weakref.ref[DeviceGrads]") -> Any:
    """An optimizer step pre-hook (every optimizer's) refusing a step over a gradient still on a device."""
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads = ref()
        if grads is None or not grads._sums:
            return
        pending = {id(grads._params[n]) for n in grads.pending()}
        stepped = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) in pending)
        if stepped:
            raise ConfigError(
                f"optimizer.step() over {stepped} parameter(s) whose gradients are still summed on the devices by "
                "calls under pipe.no_sync(): make the last accumulation call outside no_sync() (or call "
                "pipe.sync_gradients()) before the step, or step with pipe.step(optimizer)")
    return hook
