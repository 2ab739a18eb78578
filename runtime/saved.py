"""Saved segments: run a segment's backward from activations kept in host memory instead of recomputing it.

Terms
-----
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
  :class:`HostSaved` value per (segment, microbatch), tagged with the capture they belong to.

Graphs are captured lazily, on the device and in the compute precision, with the sizes of the segment's
activation inputs symbolic (:mod:`rpcompile.runtime.symbolic`): one capture runs every batch size and sequence
length its guards allow (sizes 0 and 1 are specialised, and so is whatever the trace had to know), so a padded
batch of a new length costs a guard check, not a capture. Where a capture's guards do not hold, or symbolic
tracing fails, signatures (shapes, strides, dtypes, devices, non-tensor values) are captured one by one: a capture
costs tens of forward passes, so only the first are captured at sight; a later new one is recomputed by the
backward stage until it comes again (:meth:`SavedSegment._worth_capturing`).
Dropout inside a saved segment is rewritten to ``x * seeded_noise(x)`` where the noise op is opaque to tracing and
draws the mask with :func:`rpcompile.runtime.rng.seeded_call` (same seed as the recompute path: bit-identical on
CPU); the mask is then simply a saved tensor. Segments with other random ops are not saveable (recomputed instead).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx as fx

from rpcompile.core.program import SegmentSpec
from rpcompile.core.randomness import random_kind

from . import rng
from .symbolic import Guards, bind_sizes, concrete, concrete_layout, concrete_value, fake_inputs

__all__ = ["HostSaved", "SegmentAOT", "SavedSegment", "capture_segment", "dropout_to_noise", "context"]

#: Captures kept per segment; further new shapes are recomputed.
MAX_CAPTURES = 16

context = threading.local()
"""Per worker thread: ``save`` (bool) — a training forward stage keeps activations; otherwise segments run plainly."""

_CAPTURE_LOCK = threading.Lock()  # AOT tracing is not meant to run concurrently
_NOISE: dict[str, tuple[str, Callable[..., Any], tuple, dict]] = {}
_TOKENS = itertools.count()


@torch.library.custom_op("rpcompile::seeded_noise", mutates_args=())
def seeded_noise(like: torch.Tensor, token: str) -> torch.Tensor:
    """Dropout's multiplicative noise for ``like`` (mask / (1 - p)), seeded like the node it replaces."""
    name, fn, args, kwargs = _NOISE[token]
    return rng.seeded_call(name, fn, torch.ones_like(like), *args, **kwargs).clone()


@seeded_noise.register_fake
def _(like: torch.Tensor, token: str) -> torch.Tensor:
    return torch.empty_like(like)


def dropout_to_noise(gm: fx.GraphModule) -> bool:
    """Rewrite every dropout node of ``gm`` into ``x * seeded_noise(x.detach())``; False if another random node
    remains (such a segment cannot be saved)."""
    for node in list(gm.graph.nodes):
        kind = random_kind(gm, node)
        if kind == "other":
            return False
        if kind is None:
            continue
        fn = gm.get_submodule(node.target) if node.op == "call_module" else node.target
        token = f"{next(_TOKENS)}/{node.name}"
        _NOISE[token] = (node.name, fn, tuple(node.args[1:]), dict(node.kwargs))
        x = node.args[0]
        with gm.graph.inserting_before(node):
            noise = gm.graph.call_function(torch.ops.rpcompile.seeded_noise.default,
                                           (gm.graph.call_method("detach", (x,)), token))
            new = gm.graph.call_function(torch.mul, (x, noise))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.recompile()
    return True


class HostSaved(NamedTuple):
    """What a forward stage keeps in host memory for one saved segment and microbatch."""

    key: Any
    """The capture (:class:`SegmentAOT`) the tensors belong to; None when the backward stage recomputes."""
    tensors: tuple[torch.Tensor, ...]
    sizes: tuple[int, ...] = ()
    """The sizes a symbolic capture's bw graph takes (plain ints: they stay with the value, not shipped)."""

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "HostSaved":
        return HostSaved(self.key, tuple(fn(t) for t in self.tensors), self.sizes)


def _like(t: torch.Tensor, meta: Any, bindings: dict) -> torch.Tensor:
    """``t`` with the dtype and strides the graph was traced with (host round trips make tensors contiguous);
    a symbolic graph's strides are evaluated with the call's ``bindings``."""
    if not isinstance(meta, torch.Tensor):
        return t
    layout = concrete_layout(meta, bindings)
    if layout is None:  # a stride of a size this call does not bind: dtype only
        return t.to(meta.dtype)
    shape, stride = layout
    if t.dtype == meta.dtype and t.stride() == tuple(stride):
        return t
    broadcast = [d for d, (n, s) in enumerate(zip(shape, stride)) if s == 0 and n > 1]
    if broadcast:  # an expanded tensor (a mask): one copy of its values, expanded again as the graph had it
        for d in broadcast:
            t = t.narrow(d, 0, 1)
        return t.to(meta.dtype).expand(shape)
    out = torch.empty_strided(shape, stride, dtype=meta.dtype, device=t.device)
    return out.copy_(t)


@dataclass
class SegmentAOT:
    """One capture of a segment: fw and bw graphs and where the bw graph's saved tensors come from."""

    fw: fx.GraphModule
    bw: fx.GraphModule | None
    n_outputs: int
    """Tensor outputs of the segment (the fw graph then returns the updated buffers, then the saved tensors)."""
    n_buffers: int
    saved: tuple[tuple[str, Any], ...]
    """Per saved slot of bw: ("input", i) fw input i, ("output", i) tensor output i, ("host", j) host tensor j,
    ("view", (kind, i, ops)) the view ops ``ops`` (``(op, args, kwargs)`` in order) applied to the slot (kind, i)
    of one of the first three kinds."""
    host: tuple[int, ...]
    """fw output positions of the host-saved tensors."""
    sizes: tuple[int, ...]
    """fw output positions of the sizes (ints) bw takes: ("size", j) slots."""
    tangents: tuple[int, ...]
    """fw output index (among outputs + buffers) of each tangent of bw."""
    constants: tuple[Any, ...]
    """The segment's outputs with tensors as None: non-tensor outputs are constants of the signature."""
    inputs: tuple[int, ...] = ()
    """Positions of the tensors among the segment's fw arguments (params, buffers, inputs): the fw graph's inputs."""
    guards: Guards | None = None
    """For a symbolic capture: the shapes it runs (:mod:`rpcompile.runtime.symbolic`)."""

    def forward(self, values: Sequence[Any]) -> tuple[list[Any], list[torch.Tensor], HostSaved]:
        """``values``: the fw graph's inputs (tensors; and sizes, for a symbolic capture). Returns the segment's
        outputs (its non-tensor ones evaluated for this call), the updated buffers and what goes to the host."""
        res = self.fw(*values)
        n = self.n_outputs
        host = HostSaved(self, tuple(res[i] for i in self.host), tuple(int(res[i]) for i in self.sizes))
        constants = self.constants
        if self.guards is not None:
            bindings = bind_sizes([p.meta.get("val") for p in self.fw.graph.find_nodes(op="placeholder")], values)
            constants = concrete(constants, bindings)
        it = iter(res[:n])
        return [next(it) if c is None else c for c in constants], list(res[n:n + self.n_buffers]), host

    def backward(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], host: HostSaved,
                 grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        if self.bw is None:
            return [None] * len(inputs)
        # every symbol of a symbolic capture is a size of an activation input: the inputs bind them all
        bindings = bind_sizes([p.meta.get("val") for p in self.fw.graph.find_nodes(op="placeholder")], inputs)
        pool = {"input": inputs, "output": outputs, "host": host.tensors, "size": host.sizes}
        args = [pool[kind][i] if kind != "view" else _replay(pool[i[0]][i[1]], i[2], bindings)
                for kind, i in self.saved]
        args += [grads[i] for i in self.tangents]
        metas = [p.meta.get("val") for p in self.bw.graph.find_nodes(op="placeholder")]
        res = self.bw(*[_like(a, m, bindings) if isinstance(a, torch.Tensor) else a for a, m in zip(args, metas)])
        return list(res)


def capture_segment(fn: Callable[..., tuple], examples: Sequence[torch.Tensor], n_outputs: int, n_buffers: int,
                    constants: tuple, mode: Any = None) -> SegmentAOT:
    """Trace ``fn(*examples) -> (*outputs, *updated_buffers)`` with AOTAutograd into a :class:`SegmentAOT`.

    ``examples`` carry ``requires_grad`` where a gradient is wanted; ``fn`` runs once forward and backward on them.
    With ``mode``, the fake mode of ``examples`` (:func:`rpcompile.runtime.symbolic.fake_inputs`), the graphs are
    traced with its symbolic sizes and take the sizes bw needs as ints.
    """
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import default_partition

    graphs: dict[str, Any] = {}

    def compiler(name: str) -> Callable:
        def record(gm: fx.GraphModule, _inputs: Any) -> Callable:
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return record

    def partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any) -> Any:
        graphs["num_fwd_outputs"] = num_fwd_outputs
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    with torch.enable_grad(), mode or contextlib.nullcontext():
        res = aot_function(fn, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"), partition_fn=partition,
                           dynamic=mode is not None)(*examples)
        diff = [r for r in res if r.requires_grad]
        if diff:
            torch.autograd.backward(diff, [torch.ones_like(r) for r in diff])
    fw, bw = graphs["fw"], graphs.get("bw")
    n_fwd = n_outputs + n_buffers
    if graphs.get("num_fwd_outputs", n_fwd) != n_fwd:
        raise _Aliased(f"fw graph returns {graphs['num_fwd_outputs']} outputs for {n_fwd}")
    if bw is None and diff:  # outputs that are views of inputs (a parameter's expand): autograd ran around the graphs
        raise _Aliased("no bw graph for outputs that need a gradient")
    outs = list(next(iter(fw.graph.find_nodes(op="output"))).args[0])
    places = {p: i for i, p in enumerate(fw.graph.find_nodes(op="placeholder"))}
    saved, host, shipped, sizes = [], [], {}, []  # shipped: node -> index among the host tensors

    def slot(node: fx.Node) -> tuple[str, int]:
        if node in places:
            return ("input", places[node])
        if node in outs[:n_outputs]:
            return ("output", outs.index(node))
        if node not in shipped:
            if node not in outs:  # a view's base the fw graph does not return yet
                outs.append(node)
            shipped[node] = len(host)
            host.append(outs.index(node))
        return ("host", shipped[node])

    for node in _bw_order(outs[n_fwd:], bw):
        if isinstance(node.meta.get("val"), torch.SymInt):  # a size (symbolic capture): an int beside the tensors
            saved.append(("size", len(sizes)))
            sizes.append(outs.index(node))
            continue
        root, ops = _view_root(node)
        # views of an input replay on the backward stage's own copy; views covering a whole tensor share its copy
        if ops and (root in places or (_numel(root) is not None and str(_numel(root)) == str(_numel(node)))):
            saved.append(("view", (*slot(root), ops)))
        else:
            saved.append(slot(node))
    fw_out = next(iter(fw.graph.find_nodes(op="output")))
    if len(outs) != len(fw_out.args[0]):
        fw_out.args = (tuple(outs),)
        fw.recompile()
    tangents = tuple(i for i, r in enumerate(res) if r.requires_grad)
    if bw is not None:
        n_bw = len(bw.graph.find_nodes(op="placeholder"))
        if n_bw != len(saved) + len(tangents):  # an output aliases another one: AOT folds their tangents
            raise _Aliased(f"unexpected bw graph: {n_bw} inputs for {len(saved)} saved and {len(tangents)} tangents")
    return SegmentAOT(fw, bw, n_outputs, n_buffers, tuple(saved), tuple(host), tuple(sizes), tangents, constants)


def _bw_order(nodes: Sequence[fx.Node], bw: fx.GraphModule | None) -> list[fx.Node]:
    """The fw graph's saved values in the order the bw graph takes them: AOT returns the tensors, then the sizes,
    and passes bw the sizes first; its partitioner names bw's inputs after the values."""
    names = [p.name for p in bw.graph.find_nodes(op="placeholder")][:len(nodes)] if bw is not None else []
    by_name = {n.name: n for n in nodes}
    if sorted(names) == sorted(by_name) and len(by_name) == len(nodes):
        return [by_name[n] for n in names]
    is_size = [isinstance(n.meta.get("val"), torch.SymInt) for n in nodes]
    return [n for n, s in zip(nodes, is_size) if s] + [n for n, s in zip(nodes, is_size) if not s]


#: View ops the backward stage may replay on its own copy of a fw input (``_unsafe_view`` is a view in all but name).
_VIEW_OPS = {torch.ops.aten._unsafe_view.default}
#: Views that read their base's strides literally: a copy laid out differently would give other values.
_NOT_REPLAYED = {torch.ops.aten.as_strided.default}


def _view_root(node: fx.Node) -> tuple[fx.Node, tuple]:
    """``(root, ops)``: ``node`` is ``root`` through the chain of view ops ``ops`` (constant arguments only; empty
    when ``node`` is no such view)."""
    chain = []
    while (node.op == "call_function" and node.target not in _NOT_REPLAYED
           and (getattr(node.target, "is_view", False) or node.target in _VIEW_OPS)):
        first, rest = (node.args[0], node.args[1:]) if node.args else (None, ())
        sized = _sizes_of((tuple(rest), dict(node.kwargs)))
        if not isinstance(first, fx.Node) or sized is None:
            break
        chain.append((node.target, *sized))
        node = first
    return node, tuple(reversed(chain))


def _numel(node: fx.Node) -> Any:
    """Elements of ``node``'s value: an int, or a size expression of a symbolic capture (compared as text: a
    comparison of symbolic sizes would add a guard)."""
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else None


class _Size(NamedTuple):
    """A size argument of a view in a symbolic capture (``value``: its SymInt), evaluated per call."""

    value: Any


def _sizes_of(args: Any) -> Any:
    """``args`` with each graph value that is a size replaced by a :class:`_Size`; None if another graph value
    (a tensor) is among them."""
    tensors = []

    def one(n: fx.Node) -> Any:
        val = n.meta.get("val")
        if isinstance(val, torch.SymInt):
            return _Size(val)
        tensors.append(n)
        return n
    out = fx.node.map_aggregate(args, lambda a: one(a) if isinstance(a, fx.Node) else a)
    return None if tensors else out


def _resolve(args: Any, bindings: dict) -> Any:
    if isinstance(args, _Size):
        return concrete_value(args.value, bindings)
    if isinstance(args, (list, tuple)):
        return type(args)(_resolve(a, bindings) for a in args) if not hasattr(args, "_fields") else args
    if isinstance(args, dict):
        return {k: _resolve(v, bindings) for k, v in args.items()}
    return args


def _replay(t: torch.Tensor, ops: Sequence[tuple], bindings: dict) -> torch.Tensor:
    """The view ops on the backward stage's copy of their base, whose strides may differ from the capture's:
    shape views run as reshapes (as :mod:`rpcompile.passes.portable` rewrites the graphs); sizes of a symbolic
    capture take this call's values."""
    for op, args, kwargs in ops:
        args, kwargs = _resolve(args, bindings), _resolve(kwargs, bindings)
        if op in _VIEW_OPS or op is torch.ops.aten.view.default:
            op = torch.ops.aten.reshape.default
        t = op(t, *args, **kwargs)
    return t


class _Aliased(Exception):
    """AOTAutograd regenerated an output outside the graph (it aliases an input): capture again with copies."""


class _SegmentFunction(torch.autograd.Function):
    """Backward stage: a saved segment's outputs as an autograd node whose backward is the bw graph."""

    @staticmethod
    def forward(ctx: Any, aot: SegmentAOT, host: tuple, n_in: int, *values: Any) -> Any:  # type: ignore[override]
        """``values``: the fw graph's inputs (tensors, and the sizes of a symbolic capture), then the outputs."""
        ctx.aot, ctx.host, ctx.n_in = aot, host, n_in
        outs = tuple(t.detach() for t in values[n_in:])
        ctx.sizes = {k: v for k, v in enumerate(values[:n_in]) if not isinstance(v, torch.Tensor)}
        ctx.save_for_backward(*[None if k in ctx.sizes else v for k, v in enumerate(values[:n_in])], *outs)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        saved = ctx.saved_tensors
        ins = [ctx.sizes.get(k, t) for k, t in enumerate(saved[:ctx.n_in])]
        outs = saved[ctx.n_in:]
        aot: SegmentAOT = ctx.aot
        grads = list(grads) + [None] * aot.n_buffers  # buffers carry no gradient
        grads = [g if g is not None else torch.zeros_like(o) for g, o in zip(grads, outs)] + grads[len(outs):]
        g_in = [None if k in ctx.sizes else g for k, g in enumerate(aot.backward(ins, outs, ctx.host, grads))]
        return (None, None, None, *g_in, *[None] * len(outs))


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
    it from their graphs with parameters and buffers as ``get_attr`` values."""

    def __init__(self, spec: SegmentSpec):
        super().__init__(spec.name, spec.gm, [tuple(p) for p in spec.params], list(spec.buffers), list(spec.inputs),
                         list(spec.outputs), list(spec.wants_grad), tuple(spec.nodes), spec.rewrite)
        if not dropout_to_noise(self.gm):
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

    def __repr__(self) -> str:  # shows up in generated stage code
        return f"SavedSegment({self.name!r})"

    def _run(self, flat: Sequence[Any], copy_buffers: bool) -> Any:
        p, b = len(self.params), len(self.buffers)
        tensors = {attr: flat[i] for i, attrs in enumerate(self.params) for attr in attrs}
        bufs = [t.clone() if copy_buffers else t for t in flat[p:p + b]]
        tensors.update(zip(self.buffers, bufs))
        outs = torch.func.functional_call(self.gm, tensors, tuple(flat[p + b:]), strict=False, tie_weights=False)
        return outs, bufs

    def _key(self, flat: Sequence[Any]) -> tuple:
        """The signature a capture is specialised to: sizes, strides, dtypes, devices, non-tensor values."""
        return tuple((tuple(v.shape), v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else _constant(v)
                     for v in flat)

    def _kind(self, flat: Sequence[Any]) -> tuple:
        """A signature without sizes and strides: what a symbolic capture's guards do not check."""
        first_input = len(self.params) + len(self.buffers)
        return tuple((v.dtype, v.device, v.dim()) if isinstance(v, torch.Tensor) else
                     ("size",) if i >= first_input and _is_size(v) else _constant(v) for i, v in enumerate(flat))

    def _find(self, key: tuple, flat: Sequence[Any]) -> SegmentAOT | None:
        """The capture that runs this signature: its own, or a symbolic one whose guards hold for it."""
        aot = self.captures.get(key)
        if aot is None:
            for candidate in self.symbolic.get(self._kind(flat), ()):
                if candidate.guards is not None and candidate.guards.hold([flat[i] for i in candidate.inputs]):
                    aot = self.captures[key] = candidate
                    break
        return aot

    def _capture(self, key: tuple, flat: Sequence[Any]) -> SegmentAOT:
        """Capture symbolically (every size of the activation inputs), or, where that fails, this signature."""
        try:
            aot = self._trace(flat, symbolic=True)
        except Exception:  # noqa: BLE001 - a trace symbolic sizes cannot take (data-dependent shapes, ...)
            aot = self._trace(flat, symbolic=False)
        self.n_captures += 1
        if aot.guards is not None:  # made from this example: they hold for it
            self.symbolic.setdefault(self._kind(flat), []).append(aot)
        self.captures[key] = aot
        return aot

    def _trace(self, flat: Sequence[Any], symbolic: bool) -> SegmentAOT:
        """One capture: of this signature, or ``symbolic`` (sizes of the activation inputs, int inputs)."""
        first_input = len(self.params) + len(self.buffers)
        where = [i for i, v in enumerate(flat)
                 if isinstance(v, torch.Tensor) or (symbolic and i >= first_input and _is_size(v))]
        examples = [flat[i].detach().requires_grad_(self.wants_grad[i] and flat[i].is_floating_point())
                    if isinstance(flat[i], torch.Tensor) else flat[i] for i in where]
        mode = None
        if symbolic:
            mode, examples = fake_inputs(examples, [i >= first_input for i in where])
        with torch.no_grad():
            plain, _ = self._run(flat, True)
        constants = tuple(None if isinstance(o, torch.Tensor) else o for o in plain)
        traced: list[Any] = []  # the outputs as traced: a symbolic capture's sizes are expressions

        def make(copy_outputs: bool) -> Callable[..., tuple]:
            def fn(*values: Any) -> tuple:
                args = list(flat)
                for i, v in zip(where, values):
                    args[i] = v
                outs, bufs = self._run(args, True)
                traced[:] = [outs]
                outs = [o.clone() if copy_outputs else o for o in outs if isinstance(o, torch.Tensor)]
                return (*outs, *bufs)
            return fn

        n_out = sum(c is None for c in constants)
        with _CAPTURE_LOCK:
            try:
                aot = capture_segment(make(False), examples, n_out, len(self.buffers), constants, mode)
            except _Aliased:  # outputs that alias inputs or each other: return copies (one copy per output)
                try:
                    aot = capture_segment(make(True), examples, n_out, len(self.buffers), constants, mode)
                except _Aliased as e:
                    raise RuntimeError(f"cannot capture saved segment {self.name}: {e}") from None
        if self.rewrite is not None:
            for graph in (aot.fw, aot.bw):
                if graph is not None:
                    self.rewrite(graph)
        aot.inputs = tuple(where)
        if mode is not None:
            guards = Guards(mode, examples)
            aot.guards = guards if guards.symbolic else None
            if aot.guards is not None:
                aot.constants = tuple(None if isinstance(o, torch.Tensor) else o for o in traced[0])
        return aot

    def forward_call(self, *flat: Any) -> tuple:
        """Forward stage: ``(*outputs, HostSaved)``; updates the buffers in place (the real forward)."""
        if not getattr(context, "save", False):
            outs, _ = self._run(flat, False)
            return (*outs, None)
        self.calls["forward"] += 1
        key = self._key(flat)
        aot = self._find(key, flat)
        if aot is None and not self._worth_capturing(key, flat):
            outs, _ = self._run(flat, False)  # the real forward (buffers update); the backward stage recomputes it
            return (*outs, HostSaved(None, ()))
        aot = aot or self._capture(key, flat)
        tensors = [flat[i] for i in aot.inputs]
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
        res = iter(_SegmentFunction.apply(aot, host, len(ins), *ins, *touts))
        return tuple(next(res) if c is None else s for s, c in zip(shipped, aot.constants))
