"""The cost pass's data: :class:`NodeCost` per node, :class:`NodeCall` (one node with concrete inputs) and the
:class:`CostModel` interface that turns a call into an :class:`OpEstimate`.

Siblings: :mod:`~rpcompile.passes.cost.cost` (the drivers ``cost_pass``/``cost_from_cache``; its docstring has the terms) and
:mod:`.cost_interp` (the interpreter that runs the graph node by node and profiles each node on meta).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from rpcompile.core.batch import tensor_leaves


__all__ = ["COST_KEY", "DTYPE_KEY", "NodeCost", "OpEstimate", "NodeCall", "Materialized", "CostModel", "node_cost"]

COST_KEY = "rpcompile.cost"
DTYPE_KEY = "rpcompile.dtype"
"""``gm.meta`` key: the dtype byte counts made from the recorded shapes (the coarsener's live bytes) are scaled to:
the cost model's when the graph ran as the model is; ``None`` when it ran in the compute dtype
(:data:`~rpcompile.passes.graph.precision.RUN_DTYPE_KEY`: every tensor already has its run-time dtype) or in fp32."""


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
    fwd_transient_bytes: int = 0
    """The most bytes its forward holds at once beyond its inputs and its output: what it makes on the way (a
    cross-entropy's fp32 log-softmax, 4 bytes a logit). Counted while the node runs, beside its inputs, even when
    autograd keeps some of it for backward (then it is also in ``act_bytes``: an upper bound)."""
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

    def forward_backward(self, *, watch: Any = None) -> tuple[Any, Callable[[], Any] | None]:
        """Run forward with autograd on; return the output and a thunk that runs its backward
        (None when nothing differentiable came out). ``watch``: a context (a dispatch mode) around the forward
        alone."""
        with torch.enable_grad(), watch if watch is not None else contextlib.nullcontext():
            out = self.run()
        # an output that does not need a gradient (an integer index, a mask) has no backward to run
        outs = [t for t in tensor_leaves(out) if t.requires_grad]
        if not outs or not self.leaves:
            return out, None
        # any output gradient of the right shape will do: only the backward's time and shapes matter
        grads = [torch.ones_like(t) for t in outs]

        def backward() -> Any:
            # retain_graph: a measuring model runs the thunk warmup + repeats times; allow_unused: a leaf the output
            # does not depend on gets None instead of an error
            return torch.autograd.grad(outs, self.leaves, grads, retain_graph=True, allow_unused=True)

        return out, backward


def _is_inplace(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    # `add_` writes its first argument but `__add__` does not; `__iadd__` and friends do
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
    """The graph was recorded in the compute dtype (:data:`~rpcompile.passes.graph.precision.TRACE_DTYPE_KEY`): its
    tensors already have their run-time dtypes (fp32 islands such as a norm's statistics included), so none is cast."""

    @property
    def inplace(self) -> bool:
        """Whether the node writes its first argument (each autograd run then works on a copy of it): an in-place
        op, ``inplace=True``, or a module built with it (those
        :func:`~rpcompile.passes.graph.inplace.functional_inplace_pass` left)."""
        return _is_inplace(self.node) or getattr(self.fn, "inplace", None) is True or \
            self.kwargs.get("inplace") is True

    def materialize(self, device: torch.device | str, *, dtype: torch.dtype | None = None) -> Materialized:
        """Copy the inputs to ``device`` (``meta``: shapes only), optionally casting floating tensors to
        ``dtype``; inputs are copied so running the node never mutates the reference values."""
        device = torch.device(device)
        # a graph traced in the compute dtype has its fp32 islands baked in: casting would erase them
        dtype = None if self.as_traced else dtype
        memo: dict[int, torch.Tensor] = {}
        leaves: list[torch.Tensor] = []

        def move(t: Any) -> Any:
            if isinstance(t, torch.device):  # a device the trace baked in (torch.export): the one measured on
                return device
            if not isinstance(t, torch.Tensor):
                return t
            # the same tensor passed twice stays one copy (`x * x`); memo (original's id -> copy) also lets the
            # profile tie a copy back to the node that made the original
            if id(t) in memo:
                return memo[id(t)]
            floating = t.is_floating_point()
            to_dtype = dtype if (dtype is not None and floating) else t.dtype
            with torch.no_grad():
                if device.type == "meta":
                    # the original strides: a kernel's cost and output layout depend on them
                    c = torch.empty_strided(t.shape, t.stride(), dtype=to_dtype, device="meta")
                else:
                    # copy=True even on the same device: a run never mutates the reference values; the copy is a leaf
                    c = t.detach().to(device=device, dtype=to_dtype, copy=True)
            if floating and id(t) in self.trainable:
                c.requires_grad_(True)
                leaves.append(c)
            memo[id(t)] = c
            return c

        args, kwargs = pytree.tree_map(move, (self.args, self.kwargs))
        state = {name: move(t) for name, t in {**self.params, **self.buffers}.items()}
        # autograd refuses an in-place write on a leaf that requires grad; a clone makes it a non-leaf (the
        # analytic model drops the clone's cost again)
        clone_first = self.inplace and bool(args) and isinstance(args[0], torch.Tensor) and args[0].requires_grad
        fn = self.fn

        def run() -> Any:
            # without grad the write is allowed and the copy's values do not matter to a timing, so no clone is paid
            a = (args[0].clone(), *args[1:]) if clone_first and torch.is_grad_enabled() else args
            if state:  # only a module call has parameters or buffers: fn is the module
                # strict=False: a tensor not in `state` is taken from the module itself
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
        """Where :func:`~rpcompile.passes.cost.cost.cost_pass` computes the graph's values node by node: ``None`` where the graph is (the
        default); a measuring model on a GPU names it for a graph in CPU memory (:mod:`.measured`)."""
        return None


def node_cost(node: fx.Node) -> NodeCost:
    """The NodeCost of ``node`` (zero for nodes that do no work)."""
    return node.meta.get(COST_KEY) or NodeCost()
