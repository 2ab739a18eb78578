"""Which saved segments share a capture (:mod:`.saved`): the structure a capture depends on, and the kept ones.

A capture (:mod:`.capture`) takes a segment's parameters, buffers and inputs by position and runs the ops of its
graph; the trace is deterministic. So a capture made for one segment serves another whose graph computes the
same thing from arguments in the same places, whatever their names: the segments of identical layers
(``layers.1.attn`` and ``layers.2.attn``) and the segments of a pipeline compiled again from the same model.
:func:`structure` is that, as a key: the graph with nodes by position, functions by identity, parameters and
buffers by their place among the arguments, called modules by class, mode and settings, tensor constants by value.
Where a graph cannot be told so (a nested graph, a code generator of its own), the key keeps the names.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Sequence

import torch
import torch.fx as fx

from rpcompile.core.program import SegmentSpec

from .capture import SegmentAOT

__all__ = ["SHARED_CAPTURES", "keep", "shared_capture", "structure"]

#: Captures kept for a later segment of the same :func:`structure` and signature (module docstring).
SHARED_CAPTURES = 64
_SHARED: OrderedDict[tuple, SegmentAOT] = OrderedDict()


def _tensor_digest(t: torch.Tensor) -> tuple | None:
    """A tensor constant's identity by value; None for one without values (meta)."""
    if t.device.type == "meta":
        return None
    # the raw bytes in logical order, whatever the dtype and layout (shape, strides and dtype are in the key)
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (tuple(t.shape), t.stride(), t.dtype, str(t.device), hashlib.sha1(data).hexdigest())


def _hooked(mod: torch.nn.Module) -> bool:
    # a hook runs Python a capture would not replay (a counter, a log)
    return bool(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or mod._backward_pre_hooks)


def _settings(mod: torch.nn.Module) -> tuple | None:
    """A module's class, mode and settings (tensor attributes by value); None for a tensor on meta."""
    attrs: list[Any] = []
    for key, value in sorted(vars(mod).items()):
        if isinstance(value, torch.Tensor):
            digest = _tensor_digest(value)
            if digest is None:
                return None
            attrs.append((key, digest))
        # a graph module's code is keyed on its own; private attributes hold state and caches, not settings;
        # the mode is in the key already
        elif not isinstance(mod, fx.GraphModule) and not key.startswith("_") and key != "training":
            attrs.append((key, repr(value)))
    return type(mod).__module__, type(mod).__qualname__, mod.training, tuple(attrs)


def _named_structure(spec: SegmentSpec) -> tuple | None:
    """:func:`structure` by attribute names: the code of each graph module and every module's settings."""
    parts: list[Any] = [spec.params, spec.buffers, spec.inputs, spec.outputs]
    for name, mod in spec.gm.named_modules():
        settings = _settings(mod)
        if settings is None:
            return None
        parts.append((name, mod.code if isinstance(mod, fx.GraphModule) else None, settings))
    return ("named", *map(repr, parts))


def _module_form(mod: torch.nn.Module, path: str, where: dict[str, tuple]) -> tuple | None:
    """A called module by what its call computes: its modules' settings, each parameter and buffer by its place
    among the segment's arguments (``where``); None where that cannot be told (a nested graph, a tensor on meta,
    a parameter that is no argument)."""
    out: list[Any] = []
    for name, sub in mod.named_modules(remove_duplicate=False):
        settings = _settings(sub)
        if settings is None or isinstance(sub, fx.GraphModule):
            return None
        out.append((name, settings))
    for name, _ in [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]:
        place = where.get(f"{path}.{name}")
        if place is None:
            return None
        out.append((name, place))
    return tuple(out)


def _graph_form(gm: fx.GraphModule, where: dict[str, tuple]) -> tuple | None:
    """A segment's graph without its names: nodes by position, functions by identity, parameters and buffers by
    their place among the segment's arguments (``where``), called modules and constants by value. None where
    that cannot be told (:func:`_module_form`, a graph with its own code generator)."""
    # a code generator of its own (export's pytree one) changes how arguments map to placeholders: keep the names
    if type(gm.graph._codegen) is not fx.graph.CodeGen:
        return None
    index: dict[fx.Node, int] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, torch.Tensor):
            return ("tensor", _tensor_digest(a))
        return a

    out: list[Any] = []
    for k, node in enumerate(gm.graph.nodes):
        index[node] = k
        args = repr(fx.node.map_aggregate((node.args, node.kwargs), arg))
        target: Any = None
        if node.op in ("get_attr", "call_module"):
            path = str(node.target)
            target = where.get(path)
            if target is None:
                value = gm.get_submodule(path) if node.op == "call_module" else _attr(gm, path)
                if isinstance(value, torch.nn.Module):
                    target = _module_form(value, path, where)
                elif isinstance(value, torch.Tensor):
                    target = _tensor_digest(value)
                else:
                    target = repr(value)
            if target is None:
                return None
        elif node.op in ("call_function", "call_method"):
            # functions by identity; the key must be hashable, so anything else by its text
            target = node.target if _hashable(node.target) else repr(node.target)
        out.append((node.op, target, args))
    return tuple(out)


def _attr(gm: fx.GraphModule, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(gm.get_submodule(owner), name)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False


def structure(spec: SegmentSpec) -> tuple | None:
    """What a segment's capture depends on besides its call's signature: its code (and that of nested graphs),
    each module's settings and mode, the values of tensor constants, the argument layout and the rewrite — not
    names: a capture takes its arguments by position, so the segments of identical layers (``layers.0``,
    ``layers.1``) share one. Where names cannot be left out (:func:`_graph_form`), by name. None where that
    cannot be told from the outside (hooks, a constant on meta): such a segment shares no capture."""
    if any(_hooked(mod) for mod in spec.gm.modules()):
        return None
    where: dict[str, tuple] = {a: ("param", i) for i, attrs in enumerate(spec.params) for a in attrs}
    where.update((a, ("buffer", j)) for j, a in enumerate(spec.buffers))
    form = _graph_form(spec.gm, where)
    common = (tuple(map(len, spec.params)), len(spec.buffers), len(spec.inputs), len(spec.outputs),
              tuple(spec.wants_grad), repr(spec.rewrite), torch.are_deterministic_algorithms_enabled(),
              spec.gm.training)
    # the tags keep the positional and the named keys apart
    if form is not None:
        return ("positional", common, form)
    named = _named_structure(spec)
    return None if named is None else (common, named)


def shared_capture(key: tuple, flat: Sequence[Any]) -> SegmentAOT | None:
    """The kept capture for ``key`` (:meth:`~.saved.SavedSegment._trace`): the one made of the same signature, else a
    symbolic one of the same structure and kind of signature whose guards hold for ``flat`` (what
    :meth:`~.saved.SavedSegment._find` would run within one segment). Called under the capture lock."""
    if key in _SHARED:
        # least recently used first out (keep evicts from the front)
        _SHARED.move_to_end(key)
        return _SHARED[key]
    if key[1]:  # symbolic: key[:-1] is all but the sizes and strides
        for k, aot in reversed(_SHARED.items()):  # most recently used first
            if k[:-1] == key[:-1] and aot.guards is not None and aot.guards.hold([flat[i] for i in aot.inputs]):
                _SHARED.move_to_end(k)
                return aot
    return None


def keep(key: tuple, aot: SegmentAOT) -> None:
    """Keep ``aot`` for later segments of ``key`` (the newest :data:`SHARED_CAPTURES`). Called under the capture
    lock."""
    _SHARED[key] = aot
    while len(_SHARED) > SHARED_CAPTURES:
        _SHARED.popitem(last=False)
