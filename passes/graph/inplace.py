"""In-place computations made out of place, so that autograd can differentiate every stage and profile.

Terms: a node *writes its first argument* when it computes in place into it: ``x.relu_()``, ``x += y``,
``aten.relu_``, ``F.hardswish(x, inplace=True)``, or a module built with ``inplace=True`` (``nn.ReLU(inplace=True)``,
every torchvision ResNet). Stage inputs and the cost pass's profiled inputs are autograd leaves, which such a node
may not write. :func:`functional_inplace_pass` rewrites the writes whose target is a fresh value of the graph that
nothing viewed before (the common case: an activation after a conv or an add); the others stay, and
:func:`written_nodes` names them so that their segments are never saved.
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator
from typing import Any

import torch
import torch.fx as fx

from .util import COMPUTE_OPS

__all__ = ["writes_first_arg", "make_functional", "functional_inplace_pass", "written_nodes"]

#: ``a += b`` and friends: the in-place operator and its out-of-place form.
_INPLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                      operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
                      operator.ipow: operator.pow, operator.iand: operator.and_, operator.ior: operator.or_,
                      operator.ixor: operator.xor}
#: Trailing-underscore methods that are not in-place forms of a computation.
_NOT_COMPUTE_METHODS = {"requires_grad_", "share_memory_", "resize_", "set_", "retain_grad"}


@functools.lru_cache(maxsize=4096)
def _signature(target: Any) -> inspect.Signature | None:
    """``target``'s signature when it takes an ``inplace`` argument by name (one look-up per function: a graph
    calls the same few thousands of times), else None."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return sig if "inplace" in sig.parameters else None


def _inplace_kwarg(target: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    """The bound call when a Python function is called with ``inplace=True`` (``F.relu(x, inplace=True)``)."""
    if not callable(target) or isinstance(target, torch._ops.OpOverload):
        return None
    try:
        sig = _signature(target)
    except TypeError:  # unhashable: looked up afresh
        sig = _signature.__wrapped__(target)
    if sig is None:
        return None
    try:
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return bound if bound.arguments.get("inplace") is True else None


def _functional_form(gm: fx.GraphModule, node: fx.Node) -> tuple[str, Any, tuple, dict] | None:
    """``(op, target, args, kwargs)`` computing what ``node`` writes into its first argument, without writing;
    None when ``node`` does not write its first argument or has no such form."""
    op, target, args, kwargs = node.op, node.target, node.args, dict(node.kwargs)
    if op == "call_module":
        mod = gm.get_submodule(str(target))
        return (op, target, args, kwargs) if getattr(mod, "inplace", False) is True else None
    if op == "call_method":
        base = str(target)[:-1]
        # `relu_` -> `relu`, when Tensor has that out-of-place method; dunders and bookkeeping methods are no compute
        if str(target).endswith("_") and not str(target).endswith("__") and target not in _NOT_COMPUTE_METHODS \
                and callable(getattr(torch.Tensor, base, None)):
            return op, base, args, kwargs
        return None
    if op != "call_function":
        return None
    if target in _INPLACE_OPERATORS:
        return op, _INPLACE_OPERATORS[target], args, kwargs
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        name = schema.name.split("::")[-1]
        # exactly the first argument written, and an `op_` name: an `out=` variant writes another argument
        if len(written) != 1 or written[0] is not schema.arguments[0] or not name.endswith("_"):
            return None
        # the out-of-place twin: the name without its underscore, under the same overload name
        packet = getattr(getattr(torch.ops, target.namespace), name[:-1], None)
        overload = getattr(packet, target._overloadname, None) if packet is not None else None
        return (op, overload, args, kwargs) if overload is not None else None
    bound = _inplace_kwarg(target, args, kwargs)
    if bound is not None:
        bound.arguments["inplace"] = False
        return op, target, bound.args, bound.kwargs
    name = getattr(target, "__name__", "")
    # torch.relu_ -> torch.relu: a public torch function and its out-of-place twin
    if name.endswith("_") and not name.endswith("__") and getattr(torch, name, None) is target \
            and callable(getattr(torch, name[:-1], None)):
        return op, getattr(torch, name[:-1]), args, kwargs
    return None


def writes_first_arg(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` computes in place into its first argument: ``x.relu_()``, ``x += y``, ``aten.relu_``,
    ``F.hardswish(x, inplace=True)``, or a module built with ``inplace=True`` (``nn.ReLU(inplace=True)``)."""
    return _functional_form(gm, node) is not None


def make_functional(gm: fx.GraphModule, node: fx.Node) -> None:
    """Rewrite ``node`` (see :func:`writes_first_arg`) to compute out of place, keeping its name. A module is
    replaced in ``gm`` by a copy with ``inplace=False`` (:func:`_own_module`: the model's modules are untouched)."""
    if node.op == "call_module":
        path, _, name = str(node.target).rpartition(".")
        parent = gm.get_submodule(path) if path else gm
        # a shallow copy shares the parameters; only the flag differs (and _own_module ensures `parent` is the graph's)
        functional = copy.copy(getattr(parent, name))
        functional.inplace = False
        setattr(parent, name, functional)
        return
    form = _functional_form(gm, node)
    assert form is not None  # make_functional is called on nodes that write their first argument (they have one)
    op, target, args, kwargs = form
    node.target, node.args, node.kwargs = target, tuple(args), kwargs


def _own_module(gm: fx.GraphModule, target: str) -> bool:
    """Whether the module at ``target`` sits in a container of the graph's own (fx copies the module hierarchy
    above a leaf into plain ``nn.Module`` objects), so that replacing it leaves the model alone."""
    path = str(target).rpartition(".")[0]
    parent = gm.get_submodule(path) if path else gm
    # a model's own container has its model's class; fx's copies are plain nn.Module
    return parent is gm or type(parent) is torch.nn.Module


#: Leaf modules whose output may be their input or a view of it (eval-mode dropout returns its input).
_ALIASING_MODULES = (torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten, torch.nn.modules.dropout._DropoutNd)
#: Functions and methods (by name) whose result is always a new tensor.
_FRESH_NAMES = {
    "add", "sub", "mul", "truediv", "div", "matmul", "neg", "pow", "mm", "bmm", "addmm", "baddbmm", "einsum",
    "linear", "conv1d", "conv2d", "conv3d", "relu", "relu6", "gelu", "silu", "mish", "sigmoid", "tanh",
    "hardswish", "hardsigmoid", "hardtanh", "leaky_relu", "elu", "softmax", "log_softmax", "layer_norm",
    "batch_norm", "group_norm", "rms_norm", "mean", "sum", "cat", "stack", "clone", "exp", "sqrt", "rsqrt",
    "avg_pool2d", "max_pool2d", "adaptive_avg_pool2d", "interpolate", "pad", "where",
}


def _fresh(gm: fx.GraphModule, node: fx.Node, functional: set[fx.Node]) -> bool:
    """Whether ``node``'s output is a new tensor, never its input or a view of one (statically, conservatively);
    ``functional``: in-place nodes that will compute out of place."""
    if node in functional:
        return True
    if node.op not in COMPUTE_OPS or writes_first_arg(gm, node):
        return False
    if node.op == "call_module":
        return not isinstance(gm.get_submodule(str(node.target)), _ALIASING_MODULES)
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        # an output without alias info is a new tensor, never a view of an input
        return len(returns) == 1 and returns[0].alias_info is None
    return getattr(node.target, "__name__", str(node.target)) in _FRESH_NAMES


def _rewritable(gm: fx.GraphModule, node: fx.Node, functional: set[fx.Node], order: dict[fx.Node, int]) -> bool:
    """An in-place ``node`` may compute out of place when what it writes is a new tensor of the graph that nothing
    before it views (later readers are pointed at its result)."""
    x = node.args[0] if node.args else None
    if node.op == "call_module" and not _own_module(gm, str(node.target)):
        return False
    if not isinstance(x, fx.Node) or not _fresh(gm, x, functional - {node}):
        return False
    # an earlier reader that may be a view of x would see the write; after an earlier write into x that is rewritten
    # too, this one waits a round (that write moves x's later readers, this one's included, onto its result)
    earlier = [u for u in x.users if u is not node and order[u] < order[node]]
    return all(_fresh(gm, u, functional) and not (u in functional and u.args[0] is x) for u in earlier)


def functional_inplace_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Make in-place computations out of place (:func:`writes_first_arg`) wherever that cannot change a result:
    what they write is a new tensor of the graph, no view of it exists, and later readers of it read the op's
    result instead. ``nn.ReLU(inplace=True)`` after a BatchNorm, ``out += identity`` in a residual block and
    ``F.hardswish(x, inplace=True)`` become plain ops, so every pass and stage sees a pure graph: its inputs can
    be leaves that need a gradient (a stage input, a profiled node's copy) and a value handed to several stages
    is never changed under them. Writes into inputs, buffers, parameters or views stay. Node names are kept."""
    for _ in range(len(gm.graph.nodes)):  # each round may free the next write of a chain (x.relu_().mul_(2))
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        functional = {n for n in gm.graph.nodes if writes_first_arg(gm, n)}
        while True:
            # to a fixed point: dropping one write can make another's target no longer count as fresh
            keep = {n for n in functional if _rewritable(gm, n, functional, order)}
            shared = {n.target for n in functional - keep if n.op == "call_module"}  # one module, every call
            keep = {n for n in keep if not (n.op == "call_module" and n.target in shared)}
            if keep == functional:
                break
            functional = keep
        if not functional:
            break
        # graph order: a reader after a chain moves from x to the first write's result, then on to the next one's
        for n in sorted(functional, key=order.__getitem__):
            make_functional(gm, n)
            x = n.args[0]
            # later readers read the op's result: before the rewrite they saw x as the op had left it
            for u in [u for u in x.users if order[u] > order[n]]:
                u.replace_input_with(x, n)
    gm.graph.lint()
    gm.recompile()
    return gm


def written_nodes(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes whose values an in-place op of ``gm`` may write into: its first argument and, through
    anything that may return its input or a view of it (``nn.Identity``, ``view``), what that came from."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        if not writes_first_arg(gm, node):
            continue
        x = node.args[0] if node.args else None
        while isinstance(x, fx.Node) and x.name not in out:
            out.add(x.name)
            # a write into a view (or what may be one) writes its base too: walk back to it
            x = x.args[0] if x.op in COMPUTE_OPS and not _fresh(gm, x, set()) and x.args else None
    return out
