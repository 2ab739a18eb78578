"""Capturing one saved segment with AOTAutograd, and running the capture (:mod:`.saved` decides when).

``capture_segment`` traces ``fn(*inputs) -> (*outputs, *updated_buffers)`` into a fw and a bw aten graph
(:class:`SegmentAOT`) and works out where each tensor the bw graph takes comes from: a fw input or output (not
shipped: the backward stage has them), a view of one (its view ops replayed there), or a host-saved tensor the
forward stage ships (:class:`HostSaved`). :class:`SegmentFunction` is the capture as one autograd node in the
backward stage's graph.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import default_partition

from .symbolic import Binder, Guards, bind_sizes, concrete, concrete_layout, concrete_value, size_binders

__all__ = ["HostSaved", "SegmentAOT", "Bound", "Layout", "BOUND_CACHE", "SegmentFunction", "capture_segment", "Aliased"]


class HostSaved(NamedTuple):
    """What a forward stage keeps in host memory for one saved segment and microbatch."""

    key: Any
    """The capture (:class:`SegmentAOT`) the tensors belong to; None when the backward stage recomputes."""
    tensors: tuple[torch.Tensor, ...]
    sizes: tuple[int, ...] = ()
    """The sizes a symbolic capture's bw graph takes (plain ints: they stay with the value, not shipped)."""

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "HostSaved":
        return HostSaved(self.key, tuple(fn(t) for t in self.tensors), self.sizes)


#: A bw input's layout in one call: ``(dtype, shape, stride)``; shape and stride None where a size is not bound
#: (dtype only); None for an input that is not a tensor.
Layout = tuple[torch.dtype, tuple[int, ...] | None, tuple[int, ...] | None] | None


def _layout(meta: Any, bindings: dict) -> Layout:
    """The layout the graph traced ``meta`` with, its symbolic sizes evaluated with the call's ``bindings``."""
    if not isinstance(meta, torch.Tensor):
        return None
    layout = concrete_layout(meta, bindings)
    if layout is None:  # a stride of a size this call does not bind: dtype only
        return meta.dtype, None, None
    return meta.dtype, tuple(layout[0]), tuple(layout[1])


def _like(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``t`` with the dtype and strides the graph was traced with (host round trips make tensors contiguous)."""
    if layout is None:
        return t
    dtype, shape, stride = layout
    if shape is None or stride is None:
        return t.to(dtype)
    if t.dtype == dtype and t.stride() == stride:
        return t
    # stride 0 over a size above 1: a dimension the graph had expanded
    broadcast = [d for d, (n, s) in enumerate(zip(shape, stride)) if s == 0 and n > 1]
    if broadcast:  # an expanded tensor (a mask): one copy of its values, expanded again as the graph had it
        for d in broadcast:
            t = t.narrow(d, 0, 1)
        return t.to(dtype).expand(shape)
    # the traced strides restored: the bw graph's kernels and views were traced on them
    out = torch.empty_strided(shape, stride, dtype=dtype, device=t.device)
    return out.copy_(t)


#: The symbol values (batch sizes, sequence lengths) a capture keeps its sizes evaluated for; past them the
#: oldest goes (:meth:`SegmentAOT.bound`).
BOUND_CACHE = 64


@dataclass
class Bound:
    """A capture's sizes evaluated for one call's symbol values: sympy runs once per batch shape, not on every call
    (on the autograd thread, it was half a saved segment's backward overhead: benchmarks/RESULTS.md, dispatch)."""

    layouts: list[Layout]
    """Per bw input (:data:`Layout`)."""
    views: dict[int, list[tuple]]
    """Per ``view`` slot of :attr:`SegmentAOT.saved`: its view ops with their sizes evaluated."""
    constants: tuple[Any, ...] | None = None
    """The segment's non-tensor outputs evaluated (made by the first forward call that needs them)."""


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
    """For a symbolic capture: the shapes it runs (:mod:`rpcompile.runtime.segments.symbolic`)."""
    _bound: dict[frozenset, Bound] = field(default_factory=dict, compare=False, repr=False)
    _metas: tuple[list[Binder], list[Any]] | None = field(default=None, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def bound(self, values: Sequence[Any]) -> tuple[Bound, dict]:
        """The capture's sizes evaluated for a call whose fw inputs are ``values`` (every symbol of a symbolic
        capture is a size of an activation input: they bind them all), and the symbols' values. Kept per symbol
        values: captures are shared by identical segments and several devices' threads, hence the lock."""
        with self._lock:
            if self._metas is None:  # where the fw inputs bind the symbols; the bw inputs' example values
                self._metas = (size_binders([p.meta.get("val") for p in self.fw.graph.find_nodes(op="placeholder")]),
                               [p.meta.get("val") for p in self.bw.graph.find_nodes(op="placeholder")]
                               if self.bw is not None else [])
            binders, bw_metas = self._metas
            # (a capture of one signature binds nothing)
            bindings = bind_sizes(binders, values) if self.guards is not None else {}
            key = frozenset(bindings.items())
            hit = self._bound.get(key)
            if hit is None:
                views = {k: [(op, _resolve(a, bindings), _resolve(kw, bindings)) for op, a, kw in i[2]]
                         for k, (kind, i) in enumerate(self.saved) if kind == "view"}
                hit = Bound([_layout(m, bindings) for m in bw_metas], views)
                # dicts keep insertion order: the first key is the oldest
                if len(self._bound) >= BOUND_CACHE:
                    del self._bound[next(iter(self._bound))]
                self._bound[key] = hit
            return hit, bindings

    def forward(self, values: Sequence[Any]) -> tuple[list[Any], list[torch.Tensor], HostSaved]:
        """``values``: the fw graph's inputs (tensors; and sizes, for a symbolic capture). Returns the segment's
        outputs (its non-tensor ones evaluated for this call), the updated buffers and what goes to the host."""
        res = self.fw(*values)
        n = self.n_outputs
        # the sizes as plain ints: they stay with the value and are never shipped
        host = HostSaved(self, tuple(res[i] for i in self.host), tuple(int(res[i]) for i in self.sizes))
        constants = self.constants
        if self.guards is not None:
            bound, bindings = self.bound(values)
            if bound.constants is None:
                bound.constants = concrete(constants, bindings)
            constants = bound.constants
        it = iter(res[:n])
        return [next(it) if c is None else c for c in constants], list(res[n:n + self.n_buffers]), host

    def backward(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], host: HostSaved,
                 grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        if self.bw is None:
            return [None] * len(inputs)
        bound, _ = self.bound(inputs)
        pool = {"input": inputs, "output": outputs, "host": host.tensors, "size": host.sizes}
        args = [pool[kind][i] if kind != "view" else _replay(pool[i[0]][i[1]], bound.views[k])
                for k, (kind, i) in enumerate(self.saved)]
        args += [grads[i] for i in self.tangents]  # bw takes a tangent per output that needs a gradient
        # a host round trip made the saved tensors contiguous: back to the layouts the bw graph was traced with
        res = self.bw(*[_like(a, lay) if isinstance(a, torch.Tensor) else a for a, lay in zip(args, bound.layouts)])
        return list(res)


def capture_segment(fn: Callable[..., tuple], examples: Sequence[torch.Tensor], n_outputs: int, n_buffers: int,
                    constants: tuple, mode: Any = None) -> SegmentAOT:
    """Trace ``fn(*examples) -> (*outputs, *updated_buffers)`` with AOTAutograd into a :class:`SegmentAOT`.

    ``examples`` carry ``requires_grad`` where a gradient is wanted; ``fn`` runs once forward and backward on them.
    With ``mode``, the fake mode of ``examples`` (:func:`rpcompile.runtime.segments.symbolic.fake_inputs`), the graphs
    are traced with its symbolic sizes and take the sizes bw needs as ints.
    """
    graphs: dict[str, Any] = {}

    def compiler(name: str) -> Callable:
        def record(gm: fx.GraphModule, _inputs: Any) -> Callable:
            graphs[name] = gm
            return make_boxed_func(gm.forward)  # AOTAutograd calls compiled functions with boxed arguments
        return record

    def partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any) -> Any:
        # recorded to spot outputs AOTAutograd took out of the graph (they alias an input: Aliased below)
        graphs["num_fwd_outputs"] = num_fwd_outputs
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    with torch.enable_grad(), mode or contextlib.nullcontext():
        res = aot_function(fn, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"), partition_fn=partition,
                           dynamic=mode is not None)(*examples)
        # a backward once, with any gradients (only the trace matters): AOTAutograd compiles the bw graph, and so
        # records it, lazily at the first backward
        diff = [r for r in res if r.requires_grad]
        if diff:
            torch.autograd.backward(diff, [torch.ones_like(r) for r in diff])
    fw, bw = graphs["fw"], graphs.get("bw")
    n_fwd = n_outputs + n_buffers
    if graphs.get("num_fwd_outputs", n_fwd) != n_fwd:
        raise Aliased(f"fw graph returns {graphs['num_fwd_outputs']} outputs for {n_fwd}")
    if bw is None and diff:  # outputs that are views of inputs (a parameter's expand): autograd ran around the graphs
        raise Aliased("no bw graph for outputs that need a gradient")
    outs = list(next(iter(fw.graph.find_nodes(op="output"))).args[0])
    places = {p: i for i, p in enumerate(fw.graph.find_nodes(op="placeholder"))}
    saved: list[tuple[str, Any]] = []
    host: list[int] = []
    shipped: dict[fx.Node, int] = {}  # node -> index among the host tensors
    sizes: list[int] = []

    def slot(node: fx.Node) -> tuple[str, int]:
        if node in places:
            return ("input", places[node])
        if node in outs[:n_outputs]:  # the backward stage receives the outputs anyway
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
    # slot() added view bases to return: the fw graph must ship them too
    if len(outs) != len(fw_out.args[0]):
        fw_out.args = (tuple(outs),)
        fw.recompile()
    tangents = tuple(i for i, r in enumerate(res) if r.requires_grad)
    if bw is not None:
        n_bw = len(bw.graph.find_nodes(op="placeholder"))
        if n_bw != len(saved) + len(tangents):  # an output aliases another one: AOT folds their tangents
            raise Aliased(f"unexpected bw graph: {n_bw} inputs for {len(saved)} saved and {len(tangents)} tangents")
    return SegmentAOT(fw, bw, n_outputs, n_buffers, tuple(saved), tuple(host), tuple(sizes), tangents, constants)


def _bw_order(nodes: Sequence[fx.Node], bw: fx.GraphModule | None) -> list[fx.Node]:
    """The fw graph's saved values in the order the bw graph takes them: AOT returns the tensors, then the sizes,
    and passes bw the sizes first; its partitioner names bw's inputs after the values."""
    names = [p.name for p in bw.graph.find_nodes(op="placeholder")][:len(nodes)] if bw is not None else []
    by_name = {n.name: n for n in nodes}
    # names match one to one: bw's own order; otherwise the order AOT passes them in (sizes first)
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


def _replay(t: torch.Tensor, ops: Sequence[tuple]) -> torch.Tensor:
    """The view ops on the backward stage's copy of their base, whose strides may differ from the capture's:
    shape views run as reshapes (as :mod:`rpcompile.passes.graph.portable` rewrites the graphs); the sizes of a
    symbolic capture's ops are this call's (:attr:`Bound.views`)."""
    for op, args, kwargs in ops:
        # a view needs strides compatible with its base's; a reshape copies where they are not
        if op in _VIEW_OPS or op is torch.ops.aten.view.default:
            op = torch.ops.aten.reshape.default
        t = op(t, *args, **kwargs)
    return t


class Aliased(Exception):
    """AOTAutograd regenerated an output outside the graph (it aliases an input): capture again with copies."""


class SegmentFunction(torch.autograd.Function):
    """Backward stage: a saved segment's outputs as an autograd node whose backward is the bw graph."""

    @staticmethod
    def forward(ctx: Any, aot: SegmentAOT, host: tuple, n_in: int, *values: Any) -> Any:
        """``values``: the fw graph's inputs (tensors, and the sizes of a symbolic capture), then the outputs."""
        ctx.aot, ctx.host, ctx.n_in = aot, host, n_in
        # new tensors (not the inputs themselves), so that this node becomes their grad_fn
        outs = tuple(t.detach() for t in values[n_in:])
        # save_for_backward takes tensors only: a symbolic capture's sizes are kept apart
        ctx.sizes = {k: v for k, v in enumerate(values[:n_in]) if not isinstance(v, torch.Tensor)}
        ctx.save_for_backward(*[None if k in ctx.sizes else v for k, v in enumerate(values[:n_in])], *outs)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        saved = ctx.saved_tensors
        ins = [ctx.sizes.get(k, t) for k, t in enumerate(saved[:ctx.n_in])]
        outs = saved[ctx.n_in:]
        aot: SegmentAOT = ctx.aot
        padded: list[torch.Tensor | None] = list(grads) + [None] * aot.n_buffers  # buffers carry no gradient
        # autograd gives None for an output no gradient reached; the bw graph needs a tensor there: zeros
        full = [g if g is not None else torch.zeros_like(o) for g, o in zip(padded, outs)] + padded[len(outs):]
        g_in = [None if k in ctx.sizes else g for k, g in enumerate(aot.backward(ins, outs, ctx.host, full))]
        # no gradient for aot, host and n_in, nor for the shipped outputs (inputs of this node only as data)
        return (None, None, None, *g_in, *[None] * len(outs))
