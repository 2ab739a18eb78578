"""The cost pass's interpreter: runs the graph node by node, profiles each compute node on meta (FLOPs, saved and
transient bytes) and hands batches of :class:`~.cost_model.NodeCall` to the cost model, sharing repeated blocks.

Siblings: :mod:`.cost_model` (the data and the CostModel interface) and :mod:`~rpcompile.passes.cost.cost` (the
drivers that run it).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from rpcompile.core.batch import tensor_leaves

from ..graph.kernels import GpuKernels
from ..graph.meta import MetaSafeMode
from ..graph.portable import running_on
from ..graph.precision import recorded_dtype
from ..graph.reuse import Reuse
from ..graph.shape import SHAPE_KEY, scaled_nbytes, shape_info, storage_key
from ..graph.util import is_compute, node_params
from .cost_model import CostModel, Materialized, NodeCall, OpEstimate
from .loss_memory import PeakBytes
from .repeats import block_of

__all__ = ["CostInterpreter"]

log = logging.getLogger(__name__)



# --------------------------------------------------------------------------------------------- the driver
def _call_for(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict, needs_grad: dict[fx.Node, bool]) -> NodeCall:
    params = node_params(gm, node)
    # what needs a gradient here: trainable weights, and every value coming from a node that needs one
    trainable = {id(p) for p in params.values() if p.requires_grad}
    for arg_node in node.all_input_nodes:
        if needs_grad.get(arg_node, False):
            trainable.update(id(t) for t in tensor_leaves(_env_lookup(args, kwargs, node, arg_node)))
    target = node.target
    call = functools.partial(NodeCall, as_traced=recorded_dtype(gm.meta) is not None)
    if node.op in ("call_module", "call_method"):  # fx names modules and methods by string
        assert isinstance(target, str), node.format_node()
        if node.op == "call_method":
            # a method is looked up on its receiver (args[0]) at call time: a tensor method, not a graph attribute
            return call(node, _method(target), args, kwargs, {}, {}, trainable)
        mod = gm.get_submodule(target)
        return call(node, mod, args, kwargs, dict(mod.named_parameters()), dict(mod.named_buffers()), trainable)
    assert callable(target), node.format_node()  # call_function
    return call(node, target, args, kwargs, {}, {}, trainable)


def _method(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)

    call.__name__ = name
    return call


def _env_lookup(args: tuple, kwargs: dict, node: fx.Node, arg_node: fx.Node) -> list[Any]:
    """Concrete values in (args, kwargs) that stand where ``arg_node`` stands in node.args/node.kwargs."""
    flat_sym, spec = pytree.tree_flatten((node.args, node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node))
    # flattened to the symbolic structure, so each value sits at the same position as the node it came from
    flat_val = spec.flatten_up_to((args, kwargs))
    return [v for s, v in zip(flat_sym, flat_val) if s is arg_node]


def _scaled_nbytes(info: Any, dtype: torch.dtype | None) -> int:
    """New bytes of a node's output if its floating tensors were ``dtype``."""
    return scaled_nbytes(info, dtype)


def _autograd_profile(
    call: NodeCall, producers: dict[int, fx.Node], dtype: torch.dtype | None = None
) -> tuple[int, int, set[fx.Node], int, int, int]:
    """Run ``call`` on meta with autograd: (fwd FLOPs, bwd FLOPs, input nodes whose value it saves, own saved bytes,
    backward transient bytes, forward transient bytes)."""
    m = call.materialize("meta", dtype=dtype)
    saved_keys: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        # every tensor autograd saves for backward passes through here; identity packing leaves it in place
        saved_keys.append(t)
        return t

    # attention as a GPU (or the CPU) runs it: flash, not meta's math path; ``peak``: what the forward allocates
    peak = PeakBytes(list(m.memo.values()))
    with FlopCounterMode(display=False) as fwd_counter, MetaSafeMode(), GpuKernels(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, backward = m.forward_backward(watch=peak)
    bwd_flops = 0
    if backward is not None:
        try:
            with FlopCounterMode(display=False) as bwd_counter, MetaSafeMode(), GpuKernels():
                backward()
            bwd_flops = bwd_counter.get_total_flops()
        except Exception:  # noqa: BLE001 - a backward that reads values (a custom op's .tolist()) cannot run on meta
            bwd_flops = 2 * fwd_counter.get_total_flops()  # a matmul's backward: two matmuls of its size
    # weights a backward saves are on the device anyway: they are no activation memory
    param_keys = {storage_key(m.memo[id(t)]) for t in {**call.params, **call.buffers}.values() if id(t) in m.memo}
    input_keys: dict[int, fx.Node] = {}
    for orig_id, copy in m.memo.items():
        if orig_id in producers:
            input_keys[storage_key(copy)] = producers[orig_id]
            # an exported graph reads its weights through get_attr nodes: those are weights too
            if producers[orig_id].op == "get_attr":
                param_keys.add(storage_key(copy))
    out_keys = {storage_key(t) for t in tensor_leaves(out)}
    saved_inputs: set[fx.Node] = set()
    own = 0
    seen: set[int] = set()
    for t in saved_keys:
        key = storage_key(t)
        # one storage saved twice (a tensor and its view) is held once
        if key in param_keys or key in seen:
            continue
        seen.add(key)
        if key in input_keys:
            # a saved input's producer keeps its output: cost_pass adds it to that compute node's act_bytes
            if is_compute(input_keys[key]):
                saved_inputs.add(input_keys[key])
        # neither input nor output: a tensor the node made for its backward (an attention's log-sum-exp)
        elif key not in out_keys:
            own += t.numel() * t.element_size()
        else:
            saved_inputs.add(call.node)
    transient = _backward_transient(m, out, saved_keys, param_keys) if backward is not None else 0
    made = {storage_key(t): t.untyped_storage().nbytes() for t in tensor_leaves(out)
            if storage_key(t) not in input_keys and storage_key(t) not in param_keys}  # its output's new storage
    # the output is priced as output_bytes: the transient is what the forward held beyond it
    held = max(0, peak.peak - sum(made.values()))
    return fwd_counter.get_total_flops(), bwd_flops, saved_inputs, own, transient, held


def _backward_transient(m: Materialized, out: Any, saved: list[torch.Tensor], param_keys: set[int]) -> int:
    """The most bytes the node's backward (to its non-parameter inputs) allocates at once on meta: everything that
    existed before it (inputs, parameters, saved tensors, outputs, output gradients) and views of it count 0."""
    # parameter gradients are counted in grad_bytes, not in the transient
    leaves = [t for t in m.leaves if storage_key(t) not in param_keys]
    outs = [t for t in tensor_leaves(out) if t.requires_grad]
    if not leaves or not outs:
        return 0
    grads = [torch.ones_like(t) for t in outs]
    # everything that exists before the backward starts counts 0: only its new allocations are the transient
    peak = PeakBytes([*m.memo.values(), *saved, *tensor_leaves(out), *grads])
    try:
        with MetaSafeMode(), GpuKernels(), peak:
            torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
    except Exception as err:  # noqa: BLE001 - a backward that reads values cannot run on meta
        # at least its inputs' gradients: counting nothing would let a stage past the memory it has
        log.debug("a backward does not run on meta (%s): its transient is its input gradients", err)
        return sum(t.numel() * t.element_size() for t in leaves if t.requires_grad)
    return peak.peak


#: Nodes outside repeated blocks go to the cost model in batches of at most this many.
BATCH_NODES = 64


def _grad_pattern(call: NodeCall) -> tuple[bool, ...]:
    """Which of a call's tensors need a gradient, in argument order (a repeat shares times only when it matches)."""
    leaves = tensor_leaves([call.args, call.kwargs, list(call.params.values())])
    return tuple(id(t) in call.trainable for t in leaves)


@dataclass
class _Recorded:
    """What a meta run of the cost pass leaves of one node for a later run (:mod:`rpcompile.passes.graph.reuse`): its
    value, whether it needs a gradient and, for a compute node, its shape, grad pattern, profile (saved inputs by name)
    and fields before :func:`~rpcompile.passes.cost.cost.cost_pass` adds the kept output bytes, with the cost model's estimate where it made one."""

    value: Any
    needs_grad: bool | None
    shape: Any = None
    pattern: tuple[bool, ...] = ()
    profile: tuple[int, int, frozenset[str], int, int, int] | None = None
    fields: dict[str, Any] | None = None
    estimate: OpEstimate | None = None


class CostInterpreter(fx.Interpreter):
    """The cost pass's run of a graph: each node run (or its recorded run reused) and priced by a cost model."""

    def __init__(self, gm: fx.GraphModule, cost_model: CostModel, on_node: Callable[[], None], *,
                 share: dict[fx.Node, fx.Node] | None = None, cached: dict[str, dict[str, Any]] | None = None,
                 drive: torch.device | None = None, reuse: Reuse | None = None, values: Reuse | None = None):
        super().__init__(gm)
        self.reuse = reuse
        """Nodes the same as in a recorded run take its entries instead of running
        (:mod:`rpcompile.passes.graph.reuse`)."""
        self.values = values
        """Nodes the same as in the shape pass's recorded run take the value it computed instead of computing it
        again (their costs are still worked out here)."""
        self.gm = gm  # ``self.module`` as fx types it (an nn.Module)
        self.drive = drive
        """Compute nodes' values are computed on this device (their inputs and parameters copied there), not
        where the graph is: a model in CPU memory measured on a GPU runs no forward pass on the CPU."""
        self.cost_model, self.on_node = cost_model, on_node
        self.dtype: torch.dtype | None = getattr(cost_model, "dtype", None)
        self.scale: torch.dtype | None = None if recorded_dtype(gm.meta) is not None else self.dtype
        """The dtype output bytes are scaled to: none when the graph ran in the compute dtype (bytes as recorded)."""
        self.needs_grad: dict[fx.Node, bool] = {}
        self.kept: set[fx.Node] = set()
        self.partial: dict[fx.Node, dict[str, Any]] = {}
        self.share = share or {}
        """node of a repeat → its representative's node (:func:`.repeats.repeat_map`)."""
        self.cached = cached
        """node name → its cached cost fields: nothing is measured."""
        self.patterns: dict[fx.Node, tuple[bool, ...]] = {}
        self.profiles: dict[fx.Node, tuple[int, int, set[fx.Node], int, int, int]] = {}
        """Each node's meta profile (:func:`_autograd_profile`), for its repeats to take."""
        self.shared: dict[fx.Node, fx.Node] = {}
        """Nodes that took their representative's times (filled in by :meth:`finish`)."""
        self.pending: list[NodeCall] = []
        self.pending_block: str | None = None
        self.estimates: dict[fx.Node, OpEstimate] = {}
        self.measured = 0
        """Nodes the cost model estimated (the others shared a representative's times or came from the cache)."""
        self.batches = 0
        self._by_name: dict[str, fx.Node] | None = None

    def run_node(self, n: fx.Node) -> Any:
        if self.reuse is not None:
            got = self.reuse.lookup(n)
            if got is not None:
                return self._reused(n, got)
        result = self._run_node(n)
        if self.reuse is not None:
            self.reuse.settle(n, result, _Recorded(result, self.needs_grad.get(n)))
        return result

    def _reused(self, n: fx.Node, rec: _Recorded) -> Any:
        """``n`` as the recorded run left it: its value, and for a compute node everything :meth:`_cost` makes."""
        if rec.needs_grad is not None:
            self.needs_grad[n] = rec.needs_grad
        if rec.fields is None or rec.profile is None:
            return rec.value
        nodes = self._names()
        fwd_flops, bwd_flops, saved_names, own, transient, held = rec.profile
        saved = {nodes[s] for s in saved_names}
        self.patterns[n] = rec.pattern
        self.profiles[n] = (fwd_flops, bwd_flops, saved, own, transient, held)
        # as in _cost: a node no backward runs through keeps nothing
        if self.needs_grad[n]:
            self.kept |= saved
        if n.meta.get(SHAPE_KEY) is None:
            n.meta[SHAPE_KEY] = rec.shape
        self.partial[n] = dict(rec.fields)
        if rec.estimate is not None:
            self.estimates[n] = rec.estimate
        self.on_node()
        return rec.value

    def _names(self) -> dict[str, fx.Node]:
        if self._by_name is None:
            self._by_name = {n.name: n for n in self.gm.graph.nodes}
        return self._by_name

    def record(self) -> None:
        """A recording run is over: complete each compute node's entry (its times are known now)."""
        if self.reuse is None or not self.reuse.recording:
            return
        for n, fields in self.partial.items():
            rec = self.reuse.entries[n.name][1]
            fwd_flops, bwd_flops, saved, own, transient, held = self.profiles[n]
            rec.shape, rec.pattern, rec.fields, rec.estimate = \
                n.meta.get(SHAPE_KEY), self.patterns[n], dict(fields), self.estimates.get(n)
            rec.needs_grad = self.needs_grad[n]
            rec.profile = (fwd_flops, bwd_flops, frozenset(s.name for s in saved), own, transient, held)

    def _run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if self.drive is not None and is_compute(n):
            call = _call_for(self.gm, n, args, kwargs, self.needs_grad)
            with running_on(self.drive):
                m = call.materialize(self.drive, dtype=self.dtype)
                result = m.run()
            if n.meta.get(SHAPE_KEY) is None:  # aliases of the copies the node ran on
                n.meta[SHAPE_KEY] = shape_info(result, list(m.memo.values()))
            self._cost(n, args, kwargs, result, call)
            return result
        got = self.values.lookup(n) if self.values is not None else None
        # a value the shape pass's meta run computed is taken as it is; the node is still costed below
        result = got[0] if got is not None else super().run_node(n)
        if self.values is not None and got is None:
            # `values` only reads: settle records nothing, it marks a placeholder or weight holding the recorded value
            # as the same
            self.values.settle(n, result, None)
        if n.op == "get_attr":
            # a frozen weight or a buffer starts no gradient; a trainable parameter does
            self.needs_grad[n] = isinstance(result, torch.nn.Parameter) and result.requires_grad
        elif is_compute(n):
            self._cost(n, args, kwargs, result)
        return result

    def _cost(self, n: fx.Node, args: tuple, kwargs: dict, result: Any, call: NodeCall | None = None) -> None:
        call = call if call is not None else _call_for(self.gm, n, args, kwargs, self.needs_grad)
        params = node_params(self.gm, n)
        # an integer output (indices, a mask) carries no gradient even from trainable inputs
        self.needs_grad[n] = bool(call.trainable) and any(t.is_floating_point() for t in tensor_leaves(result))
        self.patterns[n] = _grad_pattern(call)
        profile = self._shared_profile(n)
        if profile is None:
            # concrete input value -> the node that made it, so the profile can name which inputs a backward saves
            producers = {id(t): a for a in n.all_input_nodes if a in self.env for t in tensor_leaves(self.env[a])}
            profile = _autograd_profile(call, producers, self.dtype)
        self.profiles[n] = profile
        fwd_flops, bwd_flops, saved_inputs, own, transient, held = profile
        # no backward runs through the node: it saves nothing and its backward costs nothing
        if not self.needs_grad[n]:
            saved_inputs, own, bwd_flops, transient = set(), 0, 0, 0
        self.kept |= saved_inputs
        if n.meta.get(SHAPE_KEY) is None:
            # the inputs and weights are passed so an output that is a view of one is marked an alias (0 new bytes)
            n.meta[SHAPE_KEY] = shape_info(result, list(args) + list(kwargs.values()) + list(params.values()))
        self.partial[n] = dict(
            fwd_time_s=0.0,
            bwd_time_s=0.0,
            output_bytes=_scaled_nbytes(n.meta[SHAPE_KEY], self.scale),
            act_bytes=own,
            fwd_transient_bytes=held,
            bwd_transient_bytes=transient,
            param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
            grad_bytes=sum(p.numel() * p.element_size() for p in params.values() if p.requires_grad),
            fwd_flops=fwd_flops,
            bwd_flops=bwd_flops if self.needs_grad[n] else 0,
            params=tuple(params),
        )
        self._time(n, call)
        self.on_node()

    def _rep(self, n: fx.Node) -> fx.Node | None:
        """The representative whose measurements ``n`` takes: same block position and same gradient pattern."""
        rep = self.share.get(n)
        # a repeat whose tensors need gradients in another pattern runs another backward: it cannot share times
        return rep if rep is not None and self.patterns.get(rep) == self.patterns[n] else None

    def _shared_profile(self, n: fx.Node) -> tuple[int, int, set[fx.Node], int, int, int] | None:
        """The representative's meta profile (FLOPs, saved inputs, own saved bytes) carried over to ``n``: a saved
        input maps to the input at the same position of ``n`` (the block signatures match argument by argument)."""
        rep = self._rep(n)
        # inputs are mapped by position below: a different count means the blocks do not line up here
        if rep is None or rep not in self.profiles or len(rep.all_input_nodes) != len(n.all_input_nodes):
            return None
        fwd_flops, bwd_flops, saved, own, transient, held = self.profiles[rep]
        where = {a: i for i, a in enumerate(rep.all_input_nodes)}
        # a saved value that is not one of rep's own inputs cannot be mapped onto n's: profile n itself
        if any(s is not rep and s not in where for s in saved):
            return None
        mapped = {n if s is rep else n.all_input_nodes[where[s]] for s in saved}
        # the same filter as _autograd_profile: only compute nodes' values count as kept
        return fwd_flops, bwd_flops, {s for s in mapped if s is n or is_compute(s)}, own, transient, held

    def _time(self, n: fx.Node, call: NodeCall) -> None:
        """Times from the cache, from the representative (later, in :meth:`finish`) or measured in a batch."""
        if self.cached is not None:
            fwd, bwd = self.cached[n.name]["fwd_time_s"], self.cached[n.name]["bwd_time_s"]
            self.partial[n].update(fwd_time_s=fwd, bwd_time_s=bwd if self.needs_grad[n] else 0.0)
            return
        rep = self._rep(n)
        reused_unmeasured = rep is not None and rep not in self.estimates and self.reuse is not None \
            and rep.name in self.reuse.same  # a reused node whose times were a representative's: measure n
        if rep is not None and not reused_unmeasured:
            self.shared[n] = rep
            return
        block = block_of(n)
        # a batch's input copies sit on the device together: one repeated block, or at most BATCH_NODES outside blocks
        if self.pending and (block != self.pending_block or block is None and len(self.pending) >= BATCH_NODES):
            self.flush()
        self.pending.append(call)
        self.pending_block = block

    def flush(self) -> None:
        """Measure the pending calls in one batch."""
        if not self.pending:
            return
        calls, self.pending = self.pending, []
        ests = self.cost_model.estimate_batch(calls)
        for call, est in zip(calls, ests, strict=True):
            self.estimates[call.node] = est
            self._apply(call.node, est)
        self.measured += len(calls)
        self.batches += 1

    def _apply(self, n: fx.Node, est: OpEstimate) -> None:
        f = self.partial[n]
        f["fwd_time_s"] = est.fwd_time_s
        f["bwd_time_s"] = est.bwd_time_s if self.needs_grad[n] else 0.0
        if est.fwd_flops is not None:
            f["fwd_flops"] = est.fwd_flops
        if est.bwd_flops is not None and self.needs_grad[n]:
            f["bwd_flops"] = est.bwd_flops

    def finish(self) -> None:
        """Measure what is pending and give each repeat its representative's times."""
        self.flush()
        for n, rep in self.shared.items():
            # every representative is measured by now (flush above): its estimate is there
            self._apply(n, self.estimates[rep])
