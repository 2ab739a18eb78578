"""What one meta run of a graph leaves for the next run of a graph with mostly the same nodes.

The LM-head splits of one plan (:class:`rpcompile.planner.shared_trace.TraceOnce`) run the shape and cost passes on
graphs that differ only in the head: each split's graph is a copy of one trace (the same node names, modules and
weights) that the ``loss_head`` pass rewrote near its output. Both passes run the graph node by node on ``meta``,
and the body's nodes compute exactly what they computed for the previous split. A :class:`RunMemo` keeps, per
node name, what the first run met — the node's signature, its value and what the pass derived from it — and a
later run (:class:`Reuse`) takes a node's entry instead of running it when the node is *the same*: its op, target
and arguments (node names included) are the recorded ones and every node it reads is the same too (placeholders
and ``get_attr`` nodes still run, and are the same when their values have the recorded shape, strides, dtype,
device and ``requires_grad``). So only the rewritten region and what depends on it run again.

Only runs whose values are all on ``meta`` record or reuse (a value there is its shape and nothing else, so a
recorded one stands for any run's); a run that fails leaves the memo empty.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from rpcompile.core.batch import tensor_leaves

__all__ = ["RunMemo", "Reuse", "signature"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _arg_key(arg: Any) -> Any:
    """An argument as comparable data: nodes by name, plain values by type and value, anything else by identity
    (a copied graph's own objects then differ: not reused, never wrongly reused)."""
    if isinstance(arg, fx.Node):
        return ("node", arg.name)
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(_arg_key(a) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _arg_key(v)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return ("slice", _arg_key(arg.start), _arg_key(arg.stop), _arg_key(arg.step))
    if isinstance(arg, _PLAIN):
        # the type too: 1, 1.0 and True are equal in Python but may compute differently
        return (type(arg).__name__, arg)
    return ("object", id(arg))


def signature(gm: fx.GraphModule, node: fx.Node) -> tuple:
    """What a node computes, given what its inputs are: op, target (a module by identity) and arguments."""
    target: Any = node.target
    if node.op == "call_module":
        assert isinstance(target, str), node.format_node()
        # the module object too: the same path in another graph may hold another module
        target = (target, id(gm.get_submodule(target)))
    return (node.op, target, _arg_key(node.args), _arg_key(node.kwargs))


def value_key(value: Any) -> Any:
    """A placeholder's or ``get_attr``'s value as comparable data (``None`` when it cannot be compared)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type, value.requires_grad,
                isinstance(value, torch.nn.Parameter))
    if isinstance(value, (tuple, list)):
        keys = tuple(value_key(v) for v in value)
        # one element that cannot be compared makes the whole value so: never wrongly the same
        return None if any(k is None for k in keys) else (type(value).__name__, keys)
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    return None


def all_meta(values: Iterable[Any]) -> bool:
    """Whether every tensor among ``values`` is on ``meta``."""
    return all(t.device.type == "meta" for t in tensor_leaves(list(values)))


class RunMemo:
    """Per pass (``"shape"``, ``"cost"``), what a first meta run recorded: ``key`` (what else the pass's results
    depend on, e.g. the cost model) and node name → ``(signature, entry)``. Shared by every split of one plan."""

    def __init__(self) -> None:
        self.runs: dict[str, tuple[Any, dict[str, tuple[Any, Any]]]] = {}
        self.reused: dict[str, int] = {}
        """Per pass, how many nodes its latest run took from the memo."""

    def session(self, gm: fx.GraphModule, kind: str, key: Any = None) -> "Reuse":
        """A run of ``gm``: it reuses ``kind``'s entries recorded under the same ``key``, or records them."""
        recorded = self.runs.get(kind)
        self.reused[kind] = 0
        # another key (another cost model, dtype or sharing) would give other results: record afresh instead
        if recorded is not None and recorded[0] == key:
            return Reuse(gm, recorded[1], recording=False, on_reuse=lambda: self._count(kind))
        entries: dict[str, tuple[Any, Any]] = {}
        self.runs[kind] = (key, entries)
        return Reuse(gm, entries, recording=True, on_fail=lambda: self.runs.pop(kind, None))

    def values(self, gm: fx.GraphModule) -> "Reuse | None":
        """The values the shape pass's recorded run computed, for another pass running ``gm`` on ``meta`` (its
        entries are ``(value, shape)``): a read-only view, ``None`` when nothing was recorded."""
        recorded = self.runs.get("shape")
        return Reuse(gm, recorded[1], recording=False) if recorded is not None else None

    def _count(self, kind: str) -> None:
        self.reused[kind] += 1


class Reuse:
    """One run's view of a :class:`RunMemo`: :meth:`lookup` before running a node, :meth:`settle` after."""

    def __init__(self, gm: fx.GraphModule, entries: dict[str, tuple[Any, Any]], *, recording: bool,
                 on_fail: Callable[[], Any] | None = None, on_reuse: Callable[[], Any] | None = None) -> None:
        self.gm, self.entries, self.recording, self.on_fail, self.on_reuse = gm, entries, recording, on_fail, on_reuse
        self.same: set[str] = set()
        """Names of the nodes that are the recorded ones (reused, or placeholders with the recorded values)."""

    def lookup(self, node: fx.Node) -> Any:
        """The recorded entry of ``node`` when it is the same node as recorded and may be reused; else ``None``
        (run it, then :meth:`settle`)."""
        # placeholders and weights always run: cheap, and their values decide whether the nodes after them are the same
        if self.recording or node.op in ("placeholder", "get_attr", "output"):
            return None
        got = self.entries.get(node.name)
        # graph order: every input has been looked up or settled before, so `same` already says whether it is unchanged
        if got is None or any(a.name not in self.same for a in node.all_input_nodes):
            return None
        if got[0] != signature(self.gm, node):
            return None
        self.same.add(node.name)
        if self.on_reuse is not None:
            self.on_reuse()
        return got[1]

    def settle(self, node: fx.Node, value: Any, entry: Any) -> None:
        """``node`` ran and gave ``value``: record ``entry`` (a first run), or mark a placeholder or ``get_attr``
        with the recorded value as the same."""
        if self.recording:
            if node.op in ("placeholder", "get_attr"):
                # placeholders and weights are keyed by their value's shape and kind, other nodes by what they compute
                self.entries[node.name] = (value_key(value), entry)
            elif node.op != "output":
                self.entries[node.name] = (signature(self.gm, node), entry)
            return
        if node.op in ("placeholder", "get_attr"):
            got = self.entries.get(node.name)
            key = value_key(value)
            if got is not None and key is not None and got[0] == key:
                self.same.add(node.name)

    def failed(self) -> None:
        """The run raised: a first run's partial record is dropped."""
        if self.recording and self.on_fail is not None:
            self.on_fail()
