"""One stage's steps on its device, as the executor's workers run them (:mod:`.executor`).

:func:`upload` makes the device's copies of the stage's weights (a :class:`StageState`), :func:`inputs` brings its
inputs up from host memory (the :class:`~.values.ValueStore`), :func:`call` runs its module with those copies,
:func:`output_grads` brings up the gradients later stages left for its outputs; after the last microbatch
:func:`writeback_buffers` sends a real forward's buffers home and :func:`download_grads` the stage's gradients.
Buffers a forward stage changes (BatchNorm statistics) are kept per microbatch as they were before it ran
(:func:`buffer_copies`, :func:`keep_buffers_before`), so that the backward stage recomputes from the values that
forward read (:func:`buffers_before`). What these read of the executor (host weights, the gradient sink, the store,
caches that live as long as it does) comes as arguments.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from rpcompile.core.program import StageProgram

from .activity import span
from .devices import Device
from .offload import Landing
from .segments.capture import HostSaved
from .stays import DeviceGrads, DeviceWeights
from .values import ValueStore
from .weights import GradSink, WeightStore

__all__ = [
    "StageState", "upload", "writeback_buffers", "download_grads", "inputs", "call", "buffer_copies",
    "keep_buffers_before", "buffers_before", "output_grads", "to_host", "upload_tree", "derive",
]

#: Store key of a buffer's value before a forward stage changed it (per microbatch; the backward stage recomputes
#: from it).
_BEFORE = "{}::before"

#: Per stage program (by identity: a program split for input gradients has stage modules of its own):
#: ``(module._parameters or ._buffers, key, canonical name, is_param)`` per attribute, or None.
SlotCache = dict[int, list[tuple[dict, str, str, bool]] | None]


@dataclass
class StageState:
    """A stage's device copies of its weights while it is resident."""

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """canonical name -> device tensor (a leaf with requires_grad for trainable params of grad stages)."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: Any = None
    """What the device's compute waits for before it uses them (:meth:`~.devices.Device.wait_weights`)."""
    uploaded: tuple[float, float] = (0.0, 0.0)
    """When the upload started and ended (seconds since the call started; the timeline's ``W`` event)."""
    derived: list[torch.Tensor] | None = None
    """The stage's derived weights (its prologue's results: a 4-bit base dequantized), made at its first call and
    held until the stage ends, when this state is dropped."""


# ------------------------------------------------------------------------------------------ weights
def upload(device: Device, prog: StageProgram, weights: WeightStore, masters: dict[str, torch.nn.Parameter],
           host_buffers: dict[str, torch.Tensor], dtype: torch.dtype | None, t0: float,
           stays: DeviceWeights | None = None) -> StageState:
    """The device's copies of a stage's parameters and buffers (like ``model.to(dtype)``: floating buffers
    too), on the worker or on the device's prefetch thread. ``stays``: the copies that stay on the devices
    (:mod:`~rpcompile.runtime.stays`): those the stage finds there are not uploaded, those it keeps are left there."""
    grads = prog.kind != "forward"  # forward stages run under no_grad: their copies need no .grad
    # canonical names, once each in order: tied attributes share one parameter and one upload
    params = list(dict.fromkeys(prog.params.values()))
    buffers = list(dict.fromkeys(prog.buffers.values()))
    # take before uploading: what a stage finds on its device does not go up again
    found = stays.take(device.index, prog.index, params, weights) if stays is not None else {}
    sent = [n for n in params if n not in found]
    start = time.perf_counter() - t0
    with span("weights up", prog.name):
        copies, ready = device.upload_weights([weights.source(n) for n in sent]
                                              + [host_buffers[n] for n in buffers], dtype)
    state = StageState(ready=ready, uploaded=(start, time.perf_counter() - t0))
    uploaded = dict(zip(sent, copies))
    if stays is not None:
        # only what this upload made: a copy found here that the stage keeps is still in the table
        stays.leave(device.index, prog.index, uploaded, weights)
    for name in params:
        # a new leaf (on logical CPU devices sharing the host copy's storage, which other stages read at the
        # same time; a copy that stayed shares the storage of the stage that left it): its own .grad
        t = found[name] if name in found else uploaded[name]
        state.params[name] = t.detach().requires_grad_(grads and masters[name].requires_grad)
    state.buffers = dict(zip(buffers, copies[len(sent):]))  # buffers were queued after the parameters
    return state


def writeback_buffers(device: Device, state: StageState, host_buffers: dict[str, torch.Tensor]) -> None:
    """After a real forward's last microbatch: the device copies of the buffers it wrote (BatchNorm statistics, a
    counter a forward increments under ``no_grad``) go home. A copy in the compute precision that still equals its
    master cast to it is left out: nothing wrote it, and copied home it would round an fp32 buffer (version counters
    cannot tell: a batch norm's kernel writes its statistics without moving them)."""
    for name, t in state.buffers.items():
        master = host_buffers[name]
        # a logical CPU device with no cast used the host buffer itself, which holds every write already
        if t is master:
            continue
        home = device.download(t)
        with torch.no_grad():
            if home.dtype != master.dtype and torch.equal(home, master.to(home.dtype)):
                continue
            master.copy_(home)


def download_grads(device: Device, prog: StageProgram, state: StageState, sink: GradSink,
                   sums: DeviceGrads | None = None) -> None:
    """The stage's gradients (still multiplied by grad_scale: GradScaler unscales) on their way home, in the
    compute precision; the sink adds them into the masters' ``.grad`` on its own thread. ``sums``: the gradients
    summed on the devices (:class:`~.stays.DeviceGrads`), which keep some or add their sums."""
    names, grads = [], []
    for name, t in state.params.items():
        # a stage that sums gradients on its device may send nothing, or its sum with this call's gradient
        g = t.grad if sums is None else sums.take(device.index, prog.index, name, t.grad)
        if g is not None:
            names.append(name)
            grads.append(g)
    if names:
        sink.submit(names, device.download_all(grads), tag=prog.index)
    elif sink.listener is not None:  # nothing to add, but the listener counts on every grad stage
        sink.submit([], [], tag=prog.index)


# ------------------------------------------------------------------------------------------ compute
def inputs(device: Device, prog: StageProgram, mb: int, store: ValueStore, dtype: torch.dtype | None,
           needs_grad: frozenset[str], *, leaves: bool) -> list[Any]:
    out = []
    for name in prog.inputs:
        v = store.get(name, mb)
        if isinstance(v, Landing):  # saved activations still going down from the device that saved them
            v = v.wait()
        elif isinstance(v, Future):  # rows the host is still looking up
            v = v.result()
        if isinstance(v, torch.Tensor):
            # cast like the weights: a stage computes in one precision (an fp32 batch from the host included)
            v = device.upload(v, dtype)
            # a fresh leaf per stage: autograd stops at the stage's boundary and the input's .grad is what the
            # stage leaves for the one before (integer inputs cannot carry a gradient)
            if leaves and v.is_floating_point() and name in needs_grad:
                v = v.detach().requires_grad_(True)
        elif isinstance(v, HostSaved):  # saved activations keep their dtype (the compute precision)
            v = v.map(device.upload)
        out.append(v)
    return out


def call(prog: StageProgram, state: StageState, inputs: list[Any], slot_cache: SlotCache, *, copy_buffers: bool,
         before: dict[str, torch.Tensor] | None = None) -> Any:
    """Run the stage's module with this device's copies of its parameters and buffers (``copy_buffers``: on
    copies, those in ``before`` instead of the device's: :func:`buffers_before`).

    The copies are put straight into the module's parameter and buffer slots for the call and the originals
    put back after it — what ``torch.func.functional_call`` does, without its generic attribute walk, which
    cost ~0.2 ms per call (a quarter of a CPU stage's hand-off). The stage's derived weights (:func:`derive`) are
    put in their attributes the same way."""
    if prog.derived:
        with _derived_in(prog, derive(prog, state)):
            return _call(prog, state, inputs, slot_cache, copy_buffers=copy_buffers, before=before)
    return _call(prog, state, inputs, slot_cache, copy_buffers=copy_buffers, before=before)


def derive(prog: StageProgram, state: StageState) -> list[torch.Tensor]:
    """The stage's derived weights on its device: its prologue (:mod:`rpcompile.passes.rewrite.dequantize`) run
    with the device's copies of the weights at the stage's first call — on the device's compute stream, after the
    upload it waited for — without autograd (the base is frozen: nothing differentiates them), and kept in
    ``state`` for its other microbatches."""
    if state.derived is None:
        assert prog.prologue is not None  # a program with derived weights has the prologue that makes them
        # the prologue's own attributes only, tied names each included: it reads a part of the stage's weights
        mine = {a for a, _ in prog.prologue.named_parameters(remove_duplicate=False)}
        mine |= {a for a, _ in prog.prologue.named_buffers(remove_duplicate=False)}
        tensors = {a: state.params[n] for a, n in prog.params.items() if a in mine}
        tensors.update({a: state.buffers[n] for a, n in prog.buffers.items() if a in mine})
        with torch.no_grad(), span("dequantize", prog.name):
            out = torch.func.functional_call(prog.prologue, tensors, (), strict=False, tie_weights=False)
        state.derived = list(out)
    return state.derived


@contextlib.contextmanager
def _derived_in(prog: StageProgram, values: list[torch.Tensor]) -> Iterator[None]:
    """``values`` in the stage module's derived-weight attributes while inside (plain attributes: the stage's
    modules are its own, and one device runs it at a time)."""
    owners = []
    for attr, v in zip(prog.derived, values):
        path, _, key = attr.rpartition(".")
        owner = prog.gm.get_submodule(path) if path else prog.gm
        owners.append((owner, key, owner.__dict__[key]))
        owner.__dict__[key] = v
    try:
        yield
    finally:
        for owner, key, old in reversed(owners):
            owner.__dict__[key] = old


def _call(prog: StageProgram, state: StageState, inputs: list[Any], slot_cache: SlotCache, *, copy_buffers: bool,
          before: dict[str, torch.Tensor] | None = None) -> Any:
    slots = _slots(prog, slot_cache)
    if slots is None:  # an attribute outside _parameters/_buffers: the generic path
        tensors = {attr: state.params[name] for attr, name in prog.params.items()}
        for attr, name in prog.buffers.items():
            # a backward stage recomputes from the value the forward read for this microbatch, on a clone so
            # that replaying a running statistic's update does not touch the device's copy
            b = (before or {}).get(name, state.buffers[name])
            tensors[attr] = b.clone() if copy_buffers else b
        return torch.func.functional_call(prog.gm, tensors, tuple(inputs), strict=False, tie_weights=False)
    originals = []
    try:
        for table, key, name, is_param in slots:
            # recorded before the swap, so the finally restores every slot even if a later one fails
            originals.append((table, key, table[key]))
            if is_param:
                table[key] = state.params[name]
            else:
                b = (before or {}).get(name, state.buffers[name]) if copy_buffers else state.buffers[name]
                table[key] = b.clone() if copy_buffers else b
        return prog.gm(*inputs)
    finally:
        # the module gets its own tensors back: it must not keep a stage's device copies alive past its state
        for table, key, value in reversed(originals):
            table[key] = value


def buffer_copies(prog: StageProgram, state: StageState,
                  changed_buffers: dict[int, set[str]]) -> dict[str, tuple[int, torch.Tensor]]:
    """Before a forward stage runs a microbatch: ``(version, copy)`` of each buffer it changes (all of them the
    first time, until it is known which: ``changed_buffers``, per forward stage)."""
    # the first microbatch copies every buffer; keep_buffers_before then records which ones the stage changes
    changed = changed_buffers.get(prog.index, state.buffers.keys())
    return {n: (state.buffers[n]._version, state.buffers[n].clone()) for n in changed}


def keep_buffers_before(device: Device, prog: StageProgram, state: StageState,
                        kept: dict[str, tuple[int, torch.Tensor]], mb: int, store: ValueStore,
                        changed_buffers: dict[int, set[str]], *, on_device: bool = False) -> None:
    """After a forward stage ran microbatch ``mb``: the buffers it changed (a running statistic) go to host
    memory as they were before, for the backward stage that recomputes the microbatch (:func:`buffers_before`);
    ``on_device``: they stay on the device (one device runs every stage: the executor's resident hand-offs)."""
    changed = {n for n, (version, old) in kept.items()  # meta holds no values to compare: its version tells
               if state.buffers[n]._version != version or (not old.is_meta and not torch.equal(state.buffers[n], old))}
    # decided at the first microbatch: a stage changes the same buffers at every microbatch
    changed_buffers.setdefault(prog.index, changed)
    for n in changed:
        store.put(_BEFORE.format(n), mb, kept[n][1] if on_device else device.handoff(kept[n][1]))


def buffers_before(device: Device, prog: StageProgram, mb: int, store: ValueStore) -> dict[str, torch.Tensor]:
    """A backward stage's buffers as the forward pass found them for microbatch ``mb`` (those it changed): its
    recomputation reads the statistic that microbatch's forward read, not the latest one."""
    out = {}
    for name in dict.fromkeys(prog.buffers.values()):
        # no entry: the forward did not change that buffer, and the device's copy is what it read
        v = store.values.get((_BEFORE.format(name), mb))
        if v is not None:
            out[name] = device.upload(v.wait() if isinstance(v, Landing) else v)
    return out


def _slots(prog: StageProgram, cache: SlotCache) -> list[tuple[dict, str, str, bool]] | None:
    """``(module._parameters or ._buffers, key, canonical name, is_param)`` per attribute of the stage, cached."""
    ident = id(prog)  # programs live as long as their pipeline: an identity is never reused meanwhile
    if ident not in cache:
        slots: list[tuple[dict, str, str, bool]] | None = []
        for attrs, is_param in ((prog.params, True), (prog.buffers, False)):
            for attr, name in attrs.items():
                path, _, key = attr.rpartition(".")
                mod = prog.gm.get_submodule(path) if path else prog.gm
                table = mod._parameters if is_param else mod._buffers
                # a parameter held as a plain attribute: the slots cannot be swapped, use functional_call
                if key not in table:
                    slots = None
                    break
                assert slots is not None  # set to None only just before the break above
                slots.append((table, key, name, is_param))
            if slots is None:
                break
        cache[ident] = slots
    return cache[ident]


def output_grads(device: Device, prog: StageProgram, outs: Any, mb: int, store: ValueStore) -> tuple[list, list]:
    roots, grads = [], []
    for name, v in zip(prog.outputs, outs):
        g = store.grad(name, mb)
        # an output no later stage left a gradient for (or that depends on no weight or input) is not a root
        if g is not None and isinstance(v, torch.Tensor) and v.requires_grad:
            roots.append(v)
            grads.append(device.upload(g, v.dtype))  # autograd wants each gradient in its output's dtype
    return roots, grads


def to_host(device: Device, v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return device.download(v)
    if isinstance(v, HostSaved):
        return v.map(device.download)
    return v


def upload_tree(device: Device, value: Any) -> Any:
    """Every tensor in ``value`` (a target: a tensor, a tuple, a dict) to ``device``, dtypes kept."""
    return pytree.tree_map(lambda v: device.upload(v) if isinstance(v, torch.Tensor) else v, value)
