"""``cost_pass``: forward/backward time, bytes and FLOPs for every node.

Terms
-----
- **NodeCost** (``node.meta["rpcompile.cost"]``): what the partitioner needs about one compute node —
  forward and backward time per call, the bytes its output allocates, the bytes autograd keeps for its
  backward (*activation bytes*), the bytes of the parameters it reads and of their gradients, and FLOPs.
- **NodeCall**: one node with concrete input values, able to run itself on any device (``materialize``).
  Cost models only ever see NodeCalls, so the same model costs torch.fx graphs (``call_module`` leaves such
  as ``nn.Linear``) and torch.export graphs (aten ops) alike.
- **CostModel**: turns a NodeCall into an :class:`OpEstimate` (times, optionally FLOPs). Two implement it:
  :class:`~rpcompile.passes.measured.MeasuredCostModel` times nodes on the device at hand;
  :class:`~rpcompile.passes.analytic.AnalyticCostModel` predicts them from FLOPs and bytes for a named
  :class:`~rpcompile.core.specs.DeviceSpec`.

The driver runs the graph once on the model's own device (``meta`` for shape-only models) to get every node's
inputs. Independently of the cost model it runs each node once more on ``meta`` with autograd on, to count
FLOPs (``FlopCounterMode``, exact for matmul/conv/attention) and to see which tensors autograd saves
(``saved_tensors_hooks``): a saved tensor is attributed to the node that produced it, parameters excluded.

Measuring is batched and shared: nodes go to the cost model a block at a time (:meth:`CostModel.estimate_batch`:
one device synchronisation per batch on CUDA), and a cost model with ``share_repeats`` measures each repeated block
(:mod:`.repeats`: same module type, parameter shapes and node sequence) once, its repeats taking the
representative's times. A cost model with ``cache`` keeps its times on disk (:mod:`.profile_cache`) and a warm
entry skips measuring altogether.
"""

from __future__ import annotations

import abc
import functools
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, cast

import torch
import torch.fx as fx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from rpcompile.core.batch import flat_inputs, tensor_leaves

from . import profile_cache
from .kernels import GpuKernels
from .loss_memory import PeakBytes
from .meta import MetaSafeMode
from .portable import device_of, running_on
from .precision import recorded_dtype
from .repeats import block_of, repeat_map
from .reuse import Reuse, RunMemo, all_meta
from .shape import SHAPE_KEY, describe, scaled_nbytes, storage_key
from .util import is_compute, node_params

__all__ = [
    "COST_KEY",
    "NodeCost",
    "OpEstimate",
    "NodeCall",
    "Materialized",
    "CostModel",
    "cost_pass",
    "cost_from_cache",
    "node_cost",
    "DTYPE_KEY",
]

log = logging.getLogger(__name__)

COST_KEY = "rpcompile.cost"
DTYPE_KEY = "rpcompile.dtype"
"""``gm.meta`` key: the dtype byte counts made from the recorded shapes (the coarsener's live bytes) are scaled to:
the cost model's when the graph ran as the model is; ``None`` when it ran in the compute dtype
(:data:`~.precision.RUN_DTYPE_KEY`: every tensor already has its run-time dtype) or in fp32."""


@dataclass(frozen=True, kw_only=True)
class NodeCost:
    """Costs of one node, per call (one microbatch)."""

    fwd_time_s: float = 0.0
    bwd_time_s: float = 0.0
    output_bytes: int = 0
    """New bytes the output allocates (views of inputs count 0)."""
    act_bytes: int = 0
    """Bytes autograd keeps for backward that this node produced (its output if a consumer saves it, plus
    internal tensors such as an attention's log-sum-exp)."""
    bwd_transient_bytes: int = 0
    """The most bytes its backward allocates at once beyond its saved tensors and its output's gradient (its
    inputs' gradients and what it makes on the way to them: a cross-entropy's log-softmax and logits gradients,
    8 bytes a logit in fp32), beside what the stage holds; parameter gradients are not in it (``grad_bytes``)."""
    param_bytes: int = 0
    grad_bytes: int = 0
    """Bytes of the gradients of the trainable parameters it reads (0 for frozen ones)."""
    fwd_flops: int = 0
    bwd_flops: int = 0
    params: tuple[str, ...] = ()
    """Fully-qualified names of the parameters it reads."""


@dataclass(frozen=True)
class OpEstimate:
    """What a cost model says about one NodeCall. FLOPs left as None are filled in by the driver."""

    fwd_time_s: float
    bwd_time_s: float
    fwd_flops: int | None = None
    bwd_flops: int | None = None


@dataclass
class Materialized:
    """A NodeCall moved to one device: ``run()`` executes the node; ``leaves`` are the tensors to
    differentiate with respect to (already ``requires_grad``)."""

    run: Callable[[], Any]
    leaves: list[torch.Tensor]
    memo: dict[int, torch.Tensor]
    """id(original tensor) -> its copy, to map inputs back to the nodes that produced them."""

    def forward_backward(self) -> tuple[Any, Callable[[], Any] | None]:
        """Run forward with autograd on; return the output and a thunk that runs its backward
        (None when nothing differentiable came out)."""
        with torch.enable_grad():
            out = self.run()
        outs = [t for t in tensor_leaves(out) if t.requires_grad]
        if not outs or not self.leaves:
            return out, None
        grads = [torch.ones_like(t) for t in outs]

        def backward() -> Any:
            return torch.autograd.grad(outs, self.leaves, grads, retain_graph=True, allow_unused=True)

        return out, backward


def _is_inplace(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__") or name.startswith("__i")


@dataclass
class NodeCall:
    """One compute node with concrete inputs (see module docstring)."""

    node: fx.Node
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    params: dict[str, torch.Tensor]
    """Parameters of a call_module target (get_attr parameters are already inside ``args``)."""
    buffers: dict[str, torch.Tensor]
    trainable: set[int] = field(default_factory=set)
    """ids of the tensors in args/kwargs/params that need a gradient."""
    as_traced: bool = False
    """The graph was recorded in the compute dtype (:data:`~.precision.TRACE_DTYPE_KEY`): its tensors already have
    their run-time dtypes (fp32 islands such as a norm's statistics included), so none is cast."""

    @property
    def inplace(self) -> bool:
        """Whether the node writes its first argument (each autograd run then works on a copy of it): an in-place
        op, ``inplace=True``, or a module built with it (those :func:`~.inplace.functional_inplace_pass` left)."""
        return _is_inplace(self.node) or getattr(self.fn, "inplace", None) is True or \
            self.kwargs.get("inplace") is True

    def materialize(self, device: torch.device | str, *, dtype: torch.dtype | None = None) -> Materialized:
        """Copy the inputs to ``device`` (``meta``: shapes only), optionally casting floating tensors to
        ``dtype``; inputs are copied so running the node never mutates the reference values."""
        device = torch.device(device)
        dtype = None if self.as_traced else dtype
        memo: dict[int, torch.Tensor] = {}
        leaves: list[torch.Tensor] = []

        def move(t: Any) -> Any:
            if isinstance(t, torch.device):  # a device the trace baked in (torch.export): the one measured on
                return device
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in memo:
                return memo[id(t)]
            floating = t.is_floating_point()
            to_dtype = dtype if (dtype is not None and floating) else t.dtype
            with torch.no_grad():
                if device.type == "meta":
                    c = torch.empty_strided(t.shape, t.stride(), dtype=to_dtype, device="meta")
                else:
                    c = t.detach().to(device=device, dtype=to_dtype, copy=True)
            if floating and id(t) in self.trainable:
                c.requires_grad_(True)
                leaves.append(c)
            memo[id(t)] = c
            return c

        args, kwargs = pytree.tree_map(move, (self.args, self.kwargs))
        state = {name: move(t) for name, t in {**self.params, **self.buffers}.items()}
        clone_first = self.inplace and bool(args) and isinstance(args[0], torch.Tensor) and args[0].requires_grad
        fn = self.fn

        def run() -> Any:
            a = (args[0].clone(), *args[1:]) if clone_first and torch.is_grad_enabled() else args
            if state:  # only a module call has parameters or buffers: fn is the module
                return torch.func.functional_call(cast(torch.nn.Module, fn), state, a, kwargs, strict=False)
            return fn(*a, **kwargs)

        return Materialized(run, leaves, memo)


class CostModel(abc.ABC):
    """Turns a NodeCall into times (and optionally FLOPs)."""

    name: str = "cost-model"
    dtype: torch.dtype | None = None
    share_repeats: bool = False
    """Measure each repeated block once (:mod:`.repeats`); its repeats take the representative's times."""
    cache: bool = False
    """Keep the times on disk (:mod:`.profile_cache`, keyed with :meth:`identity`); a warm entry skips measuring."""

    def prepare(self, gm: fx.GraphModule, flat_args: list[Any]) -> None:
        """Called once before any node is costed (e.g. to warm the device up)."""

    @abc.abstractmethod
    def estimate(self, call: NodeCall) -> OpEstimate:
        """Forward and backward time of one call of ``call.node`` (backward 0 when nothing needs grad)."""

    def estimate_batch(self, calls: Sequence[NodeCall]) -> list[OpEstimate]:
        """:meth:`estimate` of each call (a measuring model overrides it to synchronise once per batch)."""
        return [self.estimate(c) for c in calls]

    def identity(self) -> dict[str, Any]:
        """What the times depend on besides the graph and its inputs (the cache key's part; see :mod:`.profile_cache`)."""
        return {"cost_model": self.name, "dtype": str(self.dtype)}

    def drive_device(self, gm: fx.GraphModule, flat_args: list[Any]) -> torch.device | None:
        """Where :func:`cost_pass` computes the graph's values node by node: ``None`` where the graph is (the
        default); a measuring model on a GPU names it for a graph in CPU memory (:mod:`.measured`)."""
        return None


# --------------------------------------------------------------------------------------------- the driver
def _call_for(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict, needs_grad: dict[fx.Node, bool]) -> NodeCall:
    params = node_params(gm, node)
    trainable = {id(p) for p in params.values() if p.requires_grad}
    for arg_node in node.all_input_nodes:
        if needs_grad.get(arg_node, False):
            trainable.update(id(t) for t in tensor_leaves(_env_lookup(args, kwargs, node, arg_node)))
    target = node.target
    call = functools.partial(NodeCall, as_traced=recorded_dtype(gm.meta) is not None)
    if node.op in ("call_module", "call_method"):  # fx names modules and methods by string
        assert isinstance(target, str), node.format_node()
        if node.op == "call_method":
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
    flat_val = spec.flatten_up_to((args, kwargs))
    return [v for s, v in zip(flat_sym, flat_val) if s is arg_node]


def _scaled_nbytes(info: Any, dtype: torch.dtype | None) -> int:
    """New bytes of a node's output if its floating tensors were ``dtype``."""
    return scaled_nbytes(info, dtype)


def _autograd_profile(
    call: NodeCall, producers: dict[int, fx.Node], dtype: torch.dtype | None = None
) -> tuple[int, int, set[fx.Node], int, int]:
    """Run ``call`` on meta with autograd: (fwd FLOPs, bwd FLOPs, input nodes whose value it saves, own saved bytes,
    backward transient bytes)."""
    m = call.materialize("meta", dtype=dtype)
    saved_keys: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved_keys.append(t)
        return t

    # attention as a GPU (or the CPU) runs it: flash, not meta's math path
    with FlopCounterMode(display=False) as fwd_counter, MetaSafeMode(), GpuKernels(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, backward = m.forward_backward()
    bwd_flops = 0
    if backward is not None:
        try:
            with FlopCounterMode(display=False) as bwd_counter, MetaSafeMode(), GpuKernels():
                backward()
            bwd_flops = bwd_counter.get_total_flops()
        except Exception:  # noqa: BLE001 - a backward that reads values (a custom op's .tolist()) cannot run on meta
            bwd_flops = 2 * fwd_counter.get_total_flops()  # a matmul's backward: two matmuls of its size
    param_keys = {storage_key(m.memo[id(t)]) for t in {**call.params, **call.buffers}.values() if id(t) in m.memo}
    input_keys: dict[int, fx.Node] = {}
    for orig_id, copy in m.memo.items():
        if orig_id in producers:
            input_keys[storage_key(copy)] = producers[orig_id]
            if producers[orig_id].op == "get_attr":
                param_keys.add(storage_key(copy))
    out_keys = {storage_key(t) for t in tensor_leaves(out)}
    saved_inputs: set[fx.Node] = set()
    own = 0
    seen: set[int] = set()
    for t in saved_keys:
        key = storage_key(t)
        if key in param_keys or key in seen:
            continue
        seen.add(key)
        if key in input_keys:
            if is_compute(input_keys[key]):
                saved_inputs.add(input_keys[key])
        elif key not in out_keys:
            own += t.numel() * t.element_size()
        else:
            saved_inputs.add(call.node)
    transient = _backward_transient(m, out, saved_keys, param_keys) if backward is not None else 0
    return fwd_counter.get_total_flops(), bwd_flops, saved_inputs, own, transient


def _backward_transient(m: Materialized, out: Any, saved: list[torch.Tensor], param_keys: set[int]) -> int:
    """The most bytes the node's backward (to its non-parameter inputs) allocates at once on meta: everything that
    existed before it (inputs, parameters, saved tensors, outputs, output gradients) and views of it count 0."""
    leaves = [t for t in m.leaves if storage_key(t) not in param_keys]
    outs = [t for t in tensor_leaves(out) if t.requires_grad]
    if not leaves or not outs:
        return 0
    grads = [torch.ones_like(t) for t in outs]
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
    """What a meta run of the cost pass leaves of one node for a later run (:mod:`.reuse`): its value, whether it
    needs a gradient and, for a compute node, its shape, grad pattern, profile (saved inputs by name) and fields
    before :func:`cost_pass` adds the kept output bytes, with the cost model's estimate where it made one."""

    value: Any
    needs_grad: bool | None
    shape: Any = None
    pattern: tuple[bool, ...] = ()
    profile: tuple[int, int, frozenset[str], int, int] | None = None
    fields: dict[str, Any] | None = None
    estimate: OpEstimate | None = None


class _CostInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, cost_model: CostModel, on_node: Callable[[], None], *,
                 share: dict[fx.Node, fx.Node] | None = None, cached: dict[str, dict[str, Any]] | None = None,
                 drive: torch.device | None = None, reuse: Reuse | None = None, values: Reuse | None = None):
        super().__init__(gm)
        self.reuse = reuse
        """Nodes the same as in a recorded run take its entries instead of running (:mod:`.reuse`)."""
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
        self.profiles: dict[fx.Node, tuple[int, int, set[fx.Node], int, int]] = {}
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
        fwd_flops, bwd_flops, saved_names, own, transient = rec.profile
        saved = {nodes[s] for s in saved_names}
        self.patterns[n] = rec.pattern
        self.profiles[n] = (fwd_flops, bwd_flops, saved, own, transient)
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
            fwd_flops, bwd_flops, saved, own, transient = self.profiles[n]
            rec.shape, rec.pattern, rec.fields, rec.estimate = \
                n.meta.get(SHAPE_KEY), self.patterns[n], dict(fields), self.estimates.get(n)
            rec.needs_grad = self.needs_grad[n]
            rec.profile = (fwd_flops, bwd_flops, frozenset(s.name for s in saved), own, transient)

    def _run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if self.drive is not None and is_compute(n):
            call = _call_for(self.gm, n, args, kwargs, self.needs_grad)
            with running_on(self.drive):
                m = call.materialize(self.drive, dtype=self.dtype)
                result = m.run()
            if n.meta.get(SHAPE_KEY) is None:  # aliases of the copies the node ran on
                n.meta[SHAPE_KEY] = describe(result, list(m.memo.values()))
            self._cost(n, args, kwargs, result, call)
            return result
        got = self.values.lookup(n) if self.values is not None else None
        result = got[0] if got is not None else super().run_node(n)
        if self.values is not None and got is None:
            self.values.settle(n, result, None)
        if n.op == "get_attr":
            self.needs_grad[n] = isinstance(result, torch.nn.Parameter) and result.requires_grad
        elif is_compute(n):
            self._cost(n, args, kwargs, result)
        return result

    def _cost(self, n: fx.Node, args: tuple, kwargs: dict, result: Any, call: NodeCall | None = None) -> None:
        call = call if call is not None else _call_for(self.gm, n, args, kwargs, self.needs_grad)
        params = node_params(self.gm, n)
        self.needs_grad[n] = bool(call.trainable) and any(t.is_floating_point() for t in tensor_leaves(result))
        self.patterns[n] = _grad_pattern(call)
        profile = self._shared_profile(n)
        if profile is None:
            producers = {id(t): a for a in n.all_input_nodes if a in self.env for t in tensor_leaves(self.env[a])}
            profile = _autograd_profile(call, producers, self.dtype)
        self.profiles[n] = profile
        fwd_flops, bwd_flops, saved_inputs, own, transient = profile
        if not self.needs_grad[n]:
            saved_inputs, own, bwd_flops, transient = set(), 0, 0, 0
        self.kept |= saved_inputs
        if n.meta.get(SHAPE_KEY) is None:
            n.meta[SHAPE_KEY] = describe(result, list(args) + list(kwargs.values()) + list(params.values()))
        self.partial[n] = dict(
            fwd_time_s=0.0,
            bwd_time_s=0.0,
            output_bytes=_scaled_nbytes(n.meta[SHAPE_KEY], self.scale),
            act_bytes=own,
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
        return rep if rep is not None and self.patterns.get(rep) == self.patterns[n] else None

    def _shared_profile(self, n: fx.Node) -> tuple[int, int, set[fx.Node], int, int] | None:
        """The representative's meta profile (FLOPs, saved inputs, own saved bytes) carried over to ``n``: a saved
        input maps to the input at the same position of ``n`` (the block signatures match argument by argument)."""
        rep = self._rep(n)
        if rep is None or rep not in self.profiles or len(rep.all_input_nodes) != len(n.all_input_nodes):
            return None
        fwd_flops, bwd_flops, saved, own, transient = self.profiles[rep]
        where = {a: i for i, a in enumerate(rep.all_input_nodes)}
        if any(s is not rep and s not in where for s in saved):
            return None
        mapped = {n if s is rep else n.all_input_nodes[where[s]] for s in saved}
        return fwd_flops, bwd_flops, {s for s in mapped if s is n or is_compute(s)}, own, transient

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
            self._apply(n, self.estimates[rep])


def _progress(total: int, label: str, enabled: bool):  # pragma: no cover - terminal UI
    """A transient progress bar on stderr (stdout stays the command's output: tables, JSON)."""
    bar = Progress(
        TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
        TimeRemainingColumn(), transient=True, disable=not enabled, console=Console(stderr=True),
    )
    return bar, bar.add_task(label, total=total)


def cost_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    cost_model: CostModel,
    progress: bool | None = None,
    share: bool | None = None,
    cache: bool | None = None,
    memo: RunMemo | None = None,
) -> fx.GraphModule:
    """Write a :class:`NodeCost` into ``node.meta["rpcompile.cost"]`` for every compute node of ``gm``.

    ``progress`` shows a progress bar with an estimate of the time left (default: when stderr is a terminal and
    not under CI). ``share`` measures each repeated block once (default: the cost model's ``share_repeats``);
    ``cache`` reads and writes measured times on disk (default: the cost model's ``cache``). Buffers mutated by
    the graph (BatchNorm statistics) are restored afterwards. Also fills ``rpcompile.shape`` where missing.
    Counts land in ``gm.meta["rpcompile.profiling"]`` (nodes measured, shared, batches, whether the cache hit).
    ``memo`` (analytic costs on ``meta``): nodes the same as in the run it recorded take their recorded costs
    instead of running (:mod:`.reuse`; every cost as a full run gives it); a first run records them.
    """
    enabled = (sys.stderr.isatty() and not os.environ.get("CI")) if progress is None else progress
    share = getattr(cost_model, "share_repeats", False) if share is None else share
    cache = getattr(cost_model, "cache", False) if cache is None else cache
    n_compute = sum(1 for n in gm.graph.nodes if is_compute(n))
    saved = {name: b.detach().clone() for name, b in gm.named_buffers() if b.device.type != "meta"}
    flat = flat_inputs(gm, example_inputs, example_kwargs)
    compute = [n for n in gm.graph.nodes if is_compute(n)]
    key, entry = _cache_entry(gm, flat, cost_model, compute) if cache else (None, None)
    if entry is not None and all(n.meta.get(SHAPE_KEY) is not None for n in compute):
        return _warm(gm, cost_model, entry, compute)  # the graph does not run at all
    label = f"profiling ({cost_model.name}{', cached' if entry is not None else ''})"
    bar, task = _progress(n_compute, label, enabled)
    grads = {name: p.grad for name, p in gm.named_parameters()}
    try:
        with torch.random.fork_rng(devices=[]), bar:
            if entry is None:
                cost_model.prepare(gm, flat)
            interp = _drive(gm, flat, cost_model, lambda: bar.advance(task), share and entry is None,
                            entry.nodes if entry is not None else None, memo)
            calibration = getattr(cost_model, "calibration", None)
            if entry is not None:
                totals = entry.calibration
            else:
                totals = calibration(gm, flat) if calibration is not None else None
    finally:
        with torch.no_grad():
            for name, b in gm.named_buffers():
                if name in saved:
                    b.copy_(saved[name])
            for name, p in gm.named_parameters():
                p.grad = grads.get(name)
    for n, fields in interp.partial.items():
        if n in interp.kept:
            fields["act_bytes"] += fields["output_bytes"]
    if key is not None and entry is None:
        raw = {n.name: dict(f) for n, f in interp.partial.items()}
        profile_cache.store(key, profile_cache.CacheEntry(raw, totals))
    gm.meta["rpcompile.profiling"] = {"nodes": n_compute, "measured": interp.measured, "shared": len(interp.shared),
                                      "batches": interp.batches, "cache_hit": entry is not None}
    return _write(gm, cost_model, interp.partial, totals)


def cost_from_cache(gm: fx.GraphModule, example_inputs: Sequence[Any] = (),
                    example_kwargs: Mapping[str, Any] | None = None, *, cost_model: CostModel) -> bool:
    """:func:`cost_pass` from a warm profile cache only: every compute node's :class:`NodeCost` written from the
    cache's entry, without running the graph or reading its weights (they may be uninitialised storage in the
    compute dtype: a Llama-3-8B in CPU memory is not cast for a lookup). False, and nothing written, when the cost
    model keeps no cache, a node has no shape yet, or there is no sound entry (:func:`cost_pass` then measures,
    and says why an entry was refused)."""
    compute = [n for n in gm.graph.nodes if is_compute(n)]
    if not getattr(cost_model, "cache", False) or any(n.meta.get(SHAPE_KEY) is None for n in compute):
        return False
    _, entry = _cache_entry(gm, flat_inputs(gm, example_inputs, example_kwargs), cost_model, compute, quiet=True)
    if entry is None:
        return False
    _warm(gm, cost_model, entry, compute)
    return True


def _cache_entry(gm: fx.GraphModule, flat: list[Any], cost_model: CostModel, compute: list[fx.Node], *,
                 quiet: bool = False) -> tuple[dict[str, Any], profile_cache.CacheEntry | None]:
    """The profile cache's key for ``gm`` on these inputs and cost model, and its sound entry or None."""
    key = profile_cache.profile_key(gm, flat, cost_model.identity())
    return key, profile_cache.load(key, {n.name for n in compute}, set(NodeCost.__dataclass_fields__), quiet=quiet)


def _warm(gm: fx.GraphModule, cost_model: CostModel, entry: profile_cache.CacheEntry,
          compute: list[fx.Node]) -> fx.GraphModule:
    """Every cost from the cache's ``entry``."""
    gm.meta["rpcompile.profiling"] = {"nodes": len(compute), "measured": 0, "shared": 0, "batches": 0,
                                      "cache_hit": True}
    return _write(gm, cost_model, {n: dict(entry.nodes[n.name]) for n in compute}, entry.calibration)


def _drive(gm: fx.GraphModule, flat: list[Any], cost_model: CostModel, on_node: Callable[[], None], share: bool,
           cached: dict[str, dict[str, Any]] | None, memo: RunMemo | None = None) -> _CostInterpreter:
    """Run the graph node by node, costing each compute node. On the cost model's :meth:`~CostModel.drive_device`
    when it names one; if that device runs out of memory holding the values, again where the graph is.
    ``memo``: used when nothing is measured (no calibration, no cache entry) and every value is on meta."""
    drive = cost_model.drive_device(gm, flat)
    reusable = (memo is not None and drive is None and cached is None
                and getattr(cost_model, "calibration", None) is None
                and all_meta([*flat, *gm.parameters(), *gm.buffers()]))
    for where in ([drive, None] if drive is not None else [None]):
        reuse = memo.session(gm, "cost", _memo_key(cost_model, gm, share)) if reusable and memo is not None else None
        values = memo.values(gm) if reusable and memo is not None else None
        interp = _CostInterpreter(gm, cost_model, on_node, share=repeat_map(gm) if share else None, cached=cached,
                                  drive=where, reuse=reuse, values=values)
        try:
            with torch.no_grad(), running_on(where or device_of(gm, flat)):
                interp.run(*flat, enable_io_processing=False)
                interp.finish()
            interp.record()
            return interp
        except BaseException as err:
            if reuse is not None:
                reuse.failed()
            if not isinstance(err, torch.OutOfMemoryError):
                raise
            if where is None:
                raise
            del interp
            warnings.warn(f"profiling: {where} ran out of memory holding the graph's values; running the graph "
                          "where it is instead (slower)", stacklevel=3)
    raise AssertionError("unreachable")


def _memo_key(cost_model: CostModel, gm: fx.GraphModule, share: bool) -> tuple:
    """What a run's costs depend on besides its nodes: the cost model (its kind, spec and dtype), the dtype bytes
    are scaled to, and whether repeats share."""
    return (type(cost_model).__module__, type(cost_model).__qualname__, repr(cost_model),
            repr(getattr(cost_model, "spec", None)), repr(cost_model.identity()), str(recorded_dtype(gm.meta)), share)


def _write(gm: fx.GraphModule, cost_model: CostModel, partial: dict[fx.Node, dict[str, Any]],
           totals: tuple[float, float] | None) -> fx.GraphModule:
    """Calibrate the times to the whole-graph ``totals`` and write every node's :class:`NodeCost`."""
    if totals is not None:
        _calibrate(gm, partial, *totals)
    for n, fields in partial.items():
        n.meta[COST_KEY] = NodeCost(**fields)
    gm.meta["rpcompile.cost_model"] = cost_model.name
    # the dtype the shapes' byte counts are scaled to: none when they were recorded in the compute dtype
    gm.meta[DTYPE_KEY] = None if recorded_dtype(gm.meta) is not None else getattr(cost_model, "dtype", None)
    return gm


#: Calibration factors outside this range mean the whole-graph run measured something else (a cold start, a
#: graph with a data-dependent branch); node times are then kept as measured.
CALIBRATION_RANGE = (0.5, 4.0)
#: Below this whole-graph step time a mismatch is expected (timer and call overheads) and not warned about.
CALIBRATION_MIN_STEP_S = 0.01


def _calibrate(gm: fx.GraphModule, partial: dict, forward_s: float, step_s: float) -> None:
    """Scale node forward times to the whole graph's forward and backward times to the rest of its step;
    the factors are kept in ``gm.meta["rpcompile.calibration"]``."""
    fwd = sum(f["fwd_time_s"] for f in partial.values())
    bwd = sum(f["bwd_time_s"] for f in partial.values())
    if fwd <= 0 or bwd <= 0:
        return
    lo, hi = CALIBRATION_RANGE
    factors = {"forward": forward_s / fwd, "backward": (step_s - forward_s) / bwd}
    if not all(lo <= f <= hi for f in factors.values()):
        gm.meta["rpcompile.calibration"] = {**factors, "applied": False}
        if step_s < CALIBRATION_MIN_STEP_S:
            return  # microsecond graphs: per-call timing overhead, not the machine, explains the mismatch
        warnings.warn(
            f"measured node times do not add up to a whole-graph step (forward ×{factors['forward']:.2f}, backward "
            f"×{factors['backward']:.2f}): the machine was probably busy while profiling, and plans made from these "
            "costs may be poor; profile on an idle machine, or plan from analytic costs (spec=...)",
            RuntimeWarning, stacklevel=2)
        return
    for f in partial.values():
        f["fwd_time_s"] *= factors["forward"]
        f["bwd_time_s"] *= factors["backward"]
    gm.meta["rpcompile.calibration"] = {**factors, "applied": True}


def node_cost(node: fx.Node) -> NodeCost:
    """The NodeCost of ``node`` (zero for nodes that do no work)."""
    return node.meta.get(COST_KEY) or NodeCost()
