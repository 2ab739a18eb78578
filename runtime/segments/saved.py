"""Saved segments: run a segment's backward from activations kept in host memory instead of recomputing it.

Terms:

- **Saved segment**: a segment (the coarsener's unit, ``node.meta["rpcompile.segment"]``) whose nodes the plan
  lists in ``Stage.saved``. It lies inside one forward stage and one backward stage.
- **fw / bw graph**: AOTAutograd (``aot_function`` with recording compilers) splits the segment into two aten FX
  graphs. ``fw(*params, *buffers, *inputs) -> (*outputs, *updated_buffers, *saved)`` and
  ``bw(*saved, *tangents) -> one gradient per fw input`` (None where there is none). Buffers are cloned inside the
  traced function, so BatchNorm's running-statistics update is an output, not an input mutation.
- **Passthrough**: a saved tensor that is just a fw input (a parameter, a segment input) or a segment output, or a
  view of a fw input (a linear layer's transposed weight). It is not shipped: the backward stage has the
  parameters on its device and receives inputs and outputs anyway, and replays the view ops on its own copy (on a
  GPU a shipped weight view would cross the link twice per microbatch, and the planner counts activations only).
- **Host saved**: the remaining saved tensors; the forward stage sends them to host memory as one
  :class:`~rpcompile.runtime.segments.capture.HostSaved` value per (segment, microbatch), tagged with its capture.
- **Leaf call** (:func:`opaque_calls`): a call of a leaf function or module; a segment with one is never captured.

The capture itself, and running it, is :mod:`.capture`; this module (:class:`SavedSegment`) decides when to capture
and which capture runs a call.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from rpcompile.core.program import SegmentSpec

from .. import rng
from .capture import Aliased, HostSaved, SegmentAOT, SegmentFunction, capture_segment
from .sharing import keep, shared_capture, structure
from .symbolic import Guards, fake_inputs

__all__ = ["SavedSegment", "forward_mode", "opaque_calls"]

#: Captures kept per segment; further new shapes are recomputed.
MAX_CAPTURES = 16

forward_mode = threading.local()
"""Per worker thread: ``save`` (bool) — a training forward stage keeps activations; otherwise segments run plainly."""

_CAPTURE_LOCK = threading.Lock()  # AOT tracing is not meant to run concurrently

#: Modules whose functions and ``nn.Module`` classes are pure tensor code (no side effect a capture could lose).
_PURE_MODULES = ("torch", "rpcompile", "operator", "_operator", "math", "builtins")


def _pure(owner: str | None) -> bool:
    return owner is not None and owner.split(".")[0] in _PURE_MODULES


def opaque_calls(gm: fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` that call a leaf: a Python function from outside torch (``torch.fx.wrap``, an fx
    ``autowrap`` function) or a module whose class is not torch's (``leaf_modules=``). Capturing them would keep
    only their tensor ops.

    A segment that calls a leaf function (``torch.fx.wrap``) or a leaf module (``leaf_modules=``) is never captured: a
    capture replays the tensor ops the leaf ran at capture time, not the leaf, so a side effect (a counter, a log, a
    hook) would happen once and never again. Such a segment runs plainly in its forward stage and is recomputed by its
    backward stage, every step, as in a plan that saves nothing.
    """
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and inspect.isfunction(n.target) and not _pure(n.target.__module__):
            out.append(n.name)
        elif n.op == "call_module" and not _pure(type(gm.get_submodule(str(n.target))).__module__):
            out.append(n.name)
    return out


def _is_size(v: Any) -> bool:
    """An int input of a segment (not a flag): symbolic in a symbolic capture."""
    return isinstance(v, int) and not isinstance(v, bool)


def _constant(v: Any) -> tuple:
    try:
        hash(v)
        return ("const", v)
    except TypeError:
        return ("const", repr(v))


class SavedSegment(SegmentSpec):
    """One saved segment of a plan (its :class:`~rpcompile.core.program.SegmentSpec` and what it has captured),
    shared by its forward stage (:meth:`forward_call`) and its backward stage (:meth:`backward_call`), which call
    it from their graphs with parameters and buffers as ``get_attr`` values.

    Graphs are captured lazily, on the device and in the compute precision, with the sizes of the segment's activation
    inputs symbolic (:mod:`rpcompile.runtime.segments.symbolic`): one capture runs every batch size and sequence length
    its guards allow (sizes 0 and 1 are specialised, and so is whatever the trace had to know), so a padded batch of a
    new length costs a guard check, not a capture. Where a capture's guards do not hold, or symbolic tracing fails,
    signatures (shapes, strides, dtypes, devices, non-tensor values) are captured one by one: a capture costs tens of
    forward passes, so only the first are captured at sight; a later new one is recomputed by the backward stage until
    it comes again (:meth:`SavedSegment._worth_capturing`). A capture is kept for a later segment of the same code,
    module settings and signature (:func:`~.sharing.structure`: names aside, so identical layers share one, as does a
    pipeline compiled again from the same model), or, symbolic, of the same kind of signature where its guards hold,
    :data:`~.sharing.SHARED_CAPTURES` at most: the trace is deterministic, so it would make the same graphs. Dropout
    inside a saved segment is rewritten to ``x * seeded_noise(x)`` (:func:`rpcompile.runtime.rng.dropout_to_noise`)
    where the noise op is opaque to tracing and draws the mask with :func:`rpcompile.runtime.rng.seeded_call` (same seed
    as the recompute path: bit-identical on CPU); the mask is then simply a saved tensor. Segments with other random ops
    are not saveable (recomputed instead).
    """

    def __init__(self, spec: SegmentSpec):
        super().__init__(spec.name, spec.gm, [tuple(p) for p in spec.params], list(spec.buffers), list(spec.inputs),
                         list(spec.outputs), list(spec.wants_grad), tuple(spec.nodes), spec.rewrite)
        if not rng.dropout_to_noise(self.gm):
            raise RuntimeError(f"saved segment {self.name} has a random op other than dropout (a bug: the split pass "
                               "saves only segments whose random ops are dropouts)")
        self.captures: dict[Any, SegmentAOT] = {}
        """Signature -> the capture that runs it (a symbolic capture appears under every signature it ran)."""
        self.symbolic: dict[Any, list[SegmentAOT]] = {}
        """Kind of signature (:meth:`_kind`) -> the symbolic captures to try, by their guards."""
        self.n_captures = 0
        self.seen: dict[Any, int] = {}
        """Signature (or class of signatures, :meth:`_worth_capturing`) -> the iteration it was first seen in."""
        self.first_iteration: int | None = None
        self.calls = {"forward": 0, "backward": 0, "recomputed": 0}
        self.leaves = opaque_calls(self.gm)
        """Nodes calling a leaf function or module: never captured, recomputed every step (:func:`opaque_calls`)."""
        self.on_capture: Callable[[], None] | None = None
        """Called (on the stage's worker thread) after each capture this segment makes: a progress display's hook."""

    def __repr__(self) -> str:  # shows up in generated stage code
        return f"SavedSegment({self.name!r})"

    def _run(self, flat: Sequence[Any], copy_buffers: bool) -> Any:
        p, b = len(self.params), len(self.buffers)
        # each parameter under every attribute it is tied to
        tensors = {attr: flat[i] for i, attrs in enumerate(self.params) for attr in attrs}
        # copies: a recomputation or a capture's example run must not update the running statistics again
        bufs = [t.clone() if copy_buffers else t for t in flat[p:p + b]]
        tensors.update(zip(self.buffers, bufs))
        outs = torch.func.functional_call(self.gm, tensors, tuple(flat[p + b:]), strict=False, tie_weights=False)
        return outs, bufs

    def _key(self, flat: Sequence[Any]) -> tuple:
        """The signature a capture is specialised to: sizes, strides, dtypes, devices, non-tensor values, and the
        modes it bakes in (:meth:`_modes`)."""
        return (*((tuple(v.shape), v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else _constant(v)
                  for v in flat), self._modes())

    def _kind(self, flat: Sequence[Any]) -> tuple:
        """A signature without sizes and strides: what a symbolic capture's guards do not check."""
        first_input = len(self.params) + len(self.buffers)
        return (*((v.dtype, v.device, v.dim()) if isinstance(v, torch.Tensor) else
                  ("size",) if i >= first_input and _is_size(v) else _constant(v) for i, v in enumerate(flat)),
                self._modes())

    def _modes(self) -> tuple:
        """What a capture bakes in of the modes: each module's (a batch norm's statistics, a dropout module) and
        whether the dropouts run (:mod:`rpcompile.runtime.rng`, eval mode after a train-mode trace) — a capture made in
        train mode must not run in eval mode, nor the reverse."""
        return bool(getattr(rng.context, "training", True)), tuple(m.training for m in self.gm.modules())

    def _find(self, key: tuple, flat: Sequence[Any]) -> SegmentAOT | None:
        """The capture that runs this signature: its own, or a symbolic one whose guards hold for it."""
        aot = self.captures.get(key)
        if aot is None:
            for candidate in self.symbolic.get(self._kind(flat), ()):
                if candidate.guards is not None and candidate.guards.hold([flat[i] for i in candidate.inputs]):
                    aot = self.captures[key] = candidate  # the next call of this signature is a plain lookup
                    break
        return aot

    def _capture(self, key: tuple, flat: Sequence[Any]) -> SegmentAOT:
        """Capture symbolically (every size of the activation inputs), or, where that fails, this signature."""
        try:
            aot = self._trace(flat, symbolic=True)
        except Exception:  # noqa: BLE001 - a trace symbolic sizes cannot take (data-dependent shapes, ...)
            aot = self._trace(flat, symbolic=False)
        self.n_captures += 1
        if self.on_capture is not None:
            self.on_capture()
        if aot.guards is not None:  # made from this example: they hold for it
            self.symbolic.setdefault(self._kind(flat), []).append(aot)
        self.captures[key] = aot
        return aot

    def _trace(self, flat: Sequence[Any], symbolic: bool) -> SegmentAOT:
        """One capture: of this signature, or ``symbolic`` (sizes of the activation inputs, int inputs); the one
        an earlier segment of the same structure made of the same signature, or symbolic with guards that hold for it,
        where there is one (:func:`~.sharing.shared_capture`)."""
        shape = structure(self)  # at the call: a module's mode may have changed since the last capture
        shared = None if shape is None else (
            # what changes the trace besides the segment's structure: the ambient device and dtype and autocast
            shape, symbolic, torch.get_default_device(), torch.get_default_dtype(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"), self._kind(flat), self._key(flat))
        with _CAPTURE_LOCK:  # the shared table is read and filled by every device's worker thread
            found = None if shared is None else shared_capture(shared, flat)
        if found is not None:
            return found
        aot = self._capture_new(flat, symbolic)
        if shared is not None:
            with _CAPTURE_LOCK:
                keep(shared, aot)
        return aot

    def _capture_new(self, flat: Sequence[Any], symbolic: bool) -> SegmentAOT:
        """:meth:`_trace` without the shared captures."""
        first_input = len(self.params) + len(self.buffers)
        where = [i for i, v in enumerate(flat)
                 if isinstance(v, torch.Tensor) or (symbolic and i >= first_input and _is_size(v))]
        # AOTAutograd differentiates only the examples that require a gradient; integer tensors cannot
        examples = [flat[i].detach().requires_grad_(self.wants_grad[i] and flat[i].is_floating_point())
                    if isinstance(flat[i], torch.Tensor) else flat[i] for i in where]
        mode = None
        if symbolic:
            # only the activation inputs get symbolic sizes: parameters and buffers keep theirs
            mode, examples = fake_inputs(examples, [i >= first_input for i in where])
        with torch.no_grad():
            # one plain run, on buffer copies, tells which outputs are not tensors (the capture returns tensors only)
            plain, _ = self._run(flat, True)
        constants = tuple(None if isinstance(o, torch.Tensor) else o for o in plain)
        traced: list[Any] = []  # the outputs as traced: a symbolic capture's sizes are expressions

        def make(copy_outputs: bool) -> Callable[..., tuple]:
            def fn(*values: Any) -> tuple:
                args = list(flat)
                for i, v in zip(where, values):
                    args[i] = v
                outs, bufs = self._run(args, True)
                traced[:] = [outs]  # the last trace's outputs, for a symbolic capture's constants (below)
                outs = [o.clone() if copy_outputs else o for o in outs if isinstance(o, torch.Tensor)]
                return (*outs, *bufs)
            return fn

        n_out = sum(c is None for c in constants)
        with _CAPTURE_LOCK:
            try:
                aot = capture_segment(make(False), examples, n_out, len(self.buffers), constants, mode)
            except Aliased:  # outputs that alias inputs or each other: return copies (one copy per output)
                try:
                    aot = capture_segment(make(True), examples, n_out, len(self.buffers), constants, mode)
                except Aliased as e:
                    raise RuntimeError(f"cannot capture saved segment {self.name}: {e}") from None
        if self.rewrite is not None:
            for graph in (aot.fw, aot.bw):
                if graph is not None:
                    self.rewrite(graph)
        aot.inputs = tuple(where)
        if mode is not None:
            guards = Guards(mode, examples)
            aot.guards = guards if guards.symbolic else None  # every size specialised: a capture of one signature
            if aot.guards is not None:
                # a symbolic capture's non-tensor outputs are size expressions, evaluated per call (capture.Bound)
                aot.constants = tuple(None if isinstance(o, torch.Tensor) else o for o in traced[0])
        return aot

    def forward_call(self, *flat: Any) -> tuple:
        """Forward stage: ``(*outputs, HostSaved)``; updates the buffers in place (the real forward)."""
        # evaluation: nothing is kept for a backward; the None stands in for the HostSaved output the stage's
        # graph expects
        if not getattr(forward_mode, "save", False):
            outs, _ = self._run(flat, False)
            return (*outs, None)
        self.calls["forward"] += 1
        key = self._key(flat)
        aot = self._find(key, flat)
        if aot is None and (self.leaves or not self._worth_capturing(key, flat)):
            outs, _ = self._run(flat, False)  # the real forward (buffers update); the backward stage recomputes it
            return (*outs, HostSaved(None, ()))  # key None: the backward stage recomputes
        aot = aot or self._capture(key, flat)
        tensors = [flat[i] for i in aot.inputs]
        # the fw graph returns the updated buffers: written into the device's copies, as the real forward
        with torch.no_grad():
            outs, new_bufs, host = aot.forward(tensors)
            p = len(self.params)
            for buf, new in zip(flat[p:p + len(self.buffers)], new_bufs):
                buf.copy_(new)
        return (*outs, host)

    def _worth_capturing(self, key: Any, flat: Sequence[Any]) -> bool:
        """Capture at once during the first iteration that runs the segment (its microbatches, even and uneven),
        later on the second sighting, at most :data:`MAX_CAPTURES`: a capture costs tens of forward passes, so a
        shape seen once (a last short batch, a rare length) is recomputed. Where captures are symbolic, a
        sighting is of a class of shapes — the same kind with the same sizes of one, the sizes symbolic captures
        specialise — so the second batch of one-row microbatches is captured for every later one."""
        iteration = getattr(rng.context, "iteration", 0)
        # symbolic captures specialise sizes of 1: where each dimension is 1 is part of a class of shapes
        sighting = (self._kind(flat), tuple(tuple(n == 1 for n in v.shape) for v in flat
                                            if isinstance(v, torch.Tensor))) if self.symbolic else key
        again = self.seen.setdefault(sighting, iteration) != iteration  # seen in an earlier iteration
        if self.first_iteration is None:
            self.first_iteration = iteration
        return self.n_captures < MAX_CAPTURES and (iteration == self.first_iteration or again)

    def backward_call(self, host: HostSaved, *flat: Any) -> tuple:
        """Backward stage: the segment's outputs (``flat`` ends with them, as the forward stage shipped them) as an
        autograd node whose backward runs the bw graph on ``host``; recomputed in the stage's own autograd graph
        when the forward did not capture this shape (``host.key`` None)."""
        self.calls["backward"] += 1
        n = len(self.params) + len(self.buffers) + len(self.inputs)
        fw_in, shipped = flat[:n], flat[n:]
        if host.key is None:
            self.calls["recomputed"] += 1
            outs, _ = self._run(fw_in, True)  # buffers on copies: the forward stage updated them already
            return tuple(outs)
        aot = host.key
        ins = [fw_in[i] for i in aot.inputs]
        touts = [o.detach() for o, c in zip(shipped, aot.constants) if c is None]
        # the stage's graph reads the node's outputs instead of the shipped ones, so their gradients reach the bw graph
        res = iter(SegmentFunction.apply(aot, host, len(ins), *ins, *touts))
        return tuple(next(res) if c is None else s for s, c in zip(shipped, aot.constants))
