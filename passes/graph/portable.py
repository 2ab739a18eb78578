"""Make a traced graph run on any device, whatever device and strides it was traced with.

A graph traced on the CPU (or the meta device) remembers more of that device than its values need, and a GPU
then refuses it (each of these failed on an H100 while every CPU test passed):

- **Device constants.** ``torch.export`` writes the trace device into factory and copy nodes
  (``aten.arange.start(0, 32, device=cpu)``, ``aten._to_copy(x, device=cpu)``) and asserts it
  (``aten._assert_tensor_metadata(x, device=cpu)``, from HF's ``create_causal_mask``).
- **Stride-dependent views.** ``view`` succeeds only when the input's strides allow it. The CPU's kernels made
  them allow it at trace time; a GPU's kernels (SDPA, cuDNN), a fake kernel's guess of them, or a hand-off
  through host memory produce other strides, and the same ``view`` fails with "view size is not compatible with
  input tensor's size and stride".

:func:`portable_pass` rewrites both. Device constants become the device the graph runs on — the *default device*
(``torch.get_default_device()``), which the executor sets to each stage's device around its call (a node per use,
so a value never carries one stage's device into another). Metadata assertions are removed (they check the trace,
not the model). A ``view`` becomes ``reshape`` (a view whenever the strides allow it, a copy otherwise: the same
values) unless something writes through it or through what it aliases — then its aliasing is the model's
semantics and it is kept. Views that reinterpret a dtype (``view(torch.float32)``) are kept too.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["portable_pass", "portable_bodies", "default_device", "running_on", "device_of", "RESHAPE", "is_portable",
           "written_values"]

_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default}
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}
_VIEW_METHODS = {"view"}
_ALIAS_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "unsqueeze", "squeeze",
                  "expand", "expand_as", "narrow", "select", "unflatten", "flatten", "unfold", "split", "chunk",
                  "as_strided", "detach", "diagonal", "movedim", "swapaxes", "contiguous", "unbind", "mT", "T"}
_INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}
RESHAPE = torch.ops.aten.reshape.default
"""What an ``aten`` view becomes."""
_PORTABLE_KEY = "rpcompile.portable"


def default_device() -> torch.device:
    """The device a portable graph's factory nodes allocate on: the ambient default device (the executor enters
    ``torch.device(stage_device)`` around a stage on a non-CPU device)."""
    return torch.get_default_device()


def running_on(device: torch.device | str | None) -> Any:
    """Context that makes ``device`` the default device, as the executor does around a stage (nothing for the
    CPU, already the default): portable graphs and bodies of higher-order ops allocate there."""
    device = torch.device(device) if device is not None else None
    return torch.device(device) if device is not None and device.type != "cpu" else contextlib.nullcontext()


def device_of(gm: fx.GraphModule, values: Any = ()) -> torch.device | None:
    """The device a graph runs on: that of its first tensor input, else of its first parameter or buffer."""
    for v in [*values, *gm.parameters(), *gm.buffers()]:
        if isinstance(v, torch.Tensor):
            return v.device
    return None


def portable_bodies(gm: fx.GraphModule) -> fx.GraphModule:
    """Make the bodies of ``gm``'s higher-order ops portable (``wrap_with_set_grad_enabled``'s ``submod_3``,
    outlined vmap regions): they run whole, so their device constants follow the default device from the trace
    on — through shape and cost analysis (:func:`running_on`) as through the stages."""
    for _, sub in gm.named_children():
        if isinstance(sub, fx.GraphModule) and not is_portable(sub):
            portable_pass(sub)
    return gm


def is_portable(gm: fx.GraphModule) -> bool:
    """True once :func:`portable_pass` has rewritten ``gm``."""
    return bool(gm.meta.get(_PORTABLE_KEY))


def portable_pass(gm: fx.GraphModule, *, devices: bool = True) -> fx.GraphModule:
    """Rewrite ``gm`` in place so it runs on any device with inputs of any strides (module docstring); returns it.

    ``devices=False`` keeps device constants: for graphs captured on the device they run on (the saved segments'
    AOT graphs), whose backward runs on autograd's own thread for that device, where the worker's default
    device is not set."""
    for name, sub in gm.named_children():  # bodies of higher-order ops (wrap_with_set_grad_enabled, cond, ...)
        # already portable (portable_bodies at trace time, or a body two graphs share): not rewritten twice
        if isinstance(sub, fx.GraphModule) and not is_portable(sub):
            portable_pass(sub, devices=devices)
    graph = gm.graph
    for node in list(graph.nodes):
        # _assert_tensor_metadata checks the trace's metadata (its device), which a stage on a GPU does not match
        if node.op == "call_function" and node.target in _ASSERTS:
            graph.erase_node(node)
    for node in list(graph.nodes) if devices else ():
        if node.op in ("call_function", "call_method") and _has_device(node):
            with graph.inserting_before(node):
                # a call right before each use, evaluated at run time inside whichever stage runs the node
                here = graph.call_function(default_device)
            node.args, node.kwargs = _with_device((node.args, node.kwargs), here)
    written = _written_alias_groups(gm)
    for node in list(graph.nodes):
        # a view whose alias group something writes into keeps its aliasing: reshape might copy and lose the write
        if _is_stride_view(node) and _group(written, node) not in written["groups"]:
            if node.op == "call_function":
                node.target = RESHAPE
            else:
                node.target = "reshape"
    graph.lint()
    gm.recompile()
    gm.meta[_PORTABLE_KEY] = True
    return gm


def written_values(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes whose values something in ``gm`` writes into in place (directly or through a view)."""
    written = _written_alias_groups(gm)
    return {n.name for n in gm.graph.nodes if _group(written, n) in written["groups"]}


def _has_device(node: fx.Node) -> bool:
    found = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(a) if isinstance(a, torch.device) else a)
    return bool(found)


def _with_device(args: Any, here: fx.Node) -> Any:
    return fx.node.map_aggregate(args, lambda a: here if isinstance(a, torch.device) else a)


def _is_stride_view(node: fx.Node) -> bool:
    """A shape view whose success depends on its input's strides (not a dtype reinterpretation)."""
    if node.op == "call_function" and node.target in _VIEWS:
        return True
    if node.op == "call_method" and node.target in _VIEW_METHODS:
        shape = node.args[1:]
        # `view(torch.float32)` reinterprets bytes: no reshape can stand in for it
        return bool(shape) and not any(isinstance(a, torch.dtype) for a in shape)
    return False


def _aliases_input(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node``'s output may share storage with its first argument."""
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            returns = node.target._schema.returns
            return bool(returns) and returns[0].alias_info is not None
        # getitem: a piece of a split, chunk or unbind is a view of its input
        return node.target is operator.getitem or getattr(node.target, "__name__", "") in _ALIAS_METHODS
    if node.op == "call_method":
        return node.target in _ALIAS_METHODS
    return False


def _writes(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes into (one of) its inputs."""
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            return node.target._schema.is_mutable
        if node.target in _INPLACE_FUNCTIONS:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    return False


def _written_alias_groups(gm: fx.GraphModule) -> dict[str, Any]:
    """Union-find of nodes joined by aliasing ops; ``groups`` holds the roots of groups something writes into."""
    parent: dict[fx.Node, fx.Node] = {}
    state: dict[str, Any] = {"parent": parent, "groups": set()}
    for node in gm.graph.nodes:
        if _aliases_input(gm, node) and node.args and isinstance(node.args[0], fx.Node):
            a, b = _group(state, node), _group(state, node.args[0])
            if a is not b:
                # union: the node's group joins its input's
                parent[a] = b
    for node in gm.graph.nodes:
        if _writes(gm, node):
            for a in node.all_input_nodes:  # conservatively: every tensor the op is handed may be written
                state["groups"].add(_group(state, a))
    return state


def _group(state: dict[str, Any], node: fx.Node) -> fx.Node:
    parent = state["parent"]
    root = node
    while root in parent:
        root = parent[root]
    while node in parent and parent[node] is not root:  # path compression
        parent[node], node = root, parent[node]
    return root
