"""A plan over the model: the traced graph rolled up by module into boxes, each labelled with its stages
(drawn by :mod:`rpcompile.views.graphview`).

box
    One rolled-up module (``embed``, ``layers.7.attn``, ``lm_head``): every compute node whose module path
    (:func:`rpcompile.passes.graph.util.module_path`) starts with the box's name, cut to ``depth`` components
    (:func:`rpcompile.planner.profiling.rollup_name`). An embedding the host looks up is a box of its own, ``host``.
folding
    Nodes of a module that also has boxes below it (a block's residual adds) join a neighbouring box (:func:`_fold`).
depth
    Automatic by default: one level below the model's first module list (the partitioner's groups), made
    shallower while there would be more than :data:`MAX_BOXES` boxes.
forward / backward stages
    The stages that run a box's nodes and their backward (``F3 | B11``; ``FB`` when the fused stage does both); a
    box is *saved* when a forward stage saves one of its nodes' activations to host memory.

:func:`rollup` places nodes from the traced graph when given, else from the plan's ``Stage.modules``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..core.errors import ConfigError
from ..core.plan import Plan
from ..passes.graph.util import is_compute, module_path

__all__ = ["MAX_BOXES", "HOST", "ROOT", "ModuleBox", "Rollup", "rollup"]

MAX_BOXES = 150
"""The automatic depth keeps at most this many boxes (unless even depth 1 has more)."""
ROOT = "(root)"
HOST = "host"
"""The pseudo-stage of the embedding lookups the host runs (``Plan.host``; drawn in the no-stage grey)."""
_NUMERIC = re.compile(r"^\d+$")


@dataclass(frozen=True)
class ModuleBox:
    """One rolled-up module and the stages that run it."""

    name: str
    """Module path cut to the roll-up depth; ``(root)`` for nodes of the model itself."""
    nodes: tuple[str, ...]
    """Its compute nodes (empty when drawn from a plan alone)."""
    forward: tuple[str, ...]
    """Forward or fused stages running its nodes, in execution order."""
    backward: tuple[str, ...]
    """Backward or fused stages running its nodes' backward, in execution order."""
    saved: int | None
    """How many of its nodes a forward stage saves; ``None`` when unknown (no graph)."""

    @property
    def stage_label(self) -> str:
        """``F3 | B11``, ``FB`` for a box the fused stage runs alone, ``host`` for an embedding the host looks up,
        ``F2+F3 | B5`` when a cut splits it."""
        if self.forward == self.backward and self.forward in (("FB",), (HOST,)):
            return self.forward[0]
        return f"{'+'.join(self.forward) or '—'} | {'+'.join(self.backward) or '—'}"


@dataclass(frozen=True)
class Rollup:
    """The boxes of a plan in topological order, the edges between them (indices) and the depth used."""

    boxes: tuple[ModuleBox, ...]
    edges: tuple[tuple[int, int], ...]
    depth: int
    from_graph: bool


def _key(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def _under(child: str, parent: str) -> bool:
    """``child`` lies strictly inside module ``parent`` (everything lies inside the root, ``""``)."""
    return child != parent and (parent == "" or child.startswith(parent + "."))


def _fold(keys: Sequence[str]) -> list[str]:
    """Each key's box after folding: nodes owned by a module that also has boxes below it — a block's residual adds
    (``layers.7``), the root's own glue (``(root)``) — join the box just before them when that box lies inside their
    module (the residual add closes the attention or MLP half it follows, as in the partitioner's segments), else the
    next one; so a 32-layer LLaMA gives 4 boxes per layer instead of 5. A module with no box below it keeps its own.
    """
    # every proper prefix of every key ("" the root's): the modules that have boxes below them
    ancestors = {".".join(k.split(".")[:i]) for k in keys if k for i in range(len(k.split(".")))}
    out: list[str | None] = []
    for k in keys:
        prev = out[-1] if out else None
        if k not in ancestors:
            out.append(k)
        elif prev is not None and _under(prev, k):
            out.append(prev)
        else:
            out.append(None)  # decided by the next box
    # right to left, so a run of undecided keys all follow the box decided after them
    for i in range(len(out) - 1, -1, -1):
        if out[i] is None:
            nxt = out[i + 1] if i + 1 < len(out) else None
            out[i] = nxt if nxt is not None and _under(nxt, keys[i]) else keys[i]
    return [k for k in out if k is not None]


def _count_boxes(paths: Sequence[str], depth: int) -> int:
    return len(set(_fold([_key(p, depth) for p in paths])))


def _auto_depth(paths: Sequence[str]) -> int:
    lists = [i + 1 for p in paths for i, part in enumerate(p.split(".")) if _NUMERIC.match(part)]
    # one level below the first list's index (layers.7.attn): the partitioner's groups
    depth = min(lists) + 1 if lists else 1
    while depth > 1 and _count_boxes(paths, depth) > MAX_BOXES:
        depth -= 1
    return depth


def _graph_nodes(graph: Any) -> list[Any]:
    g = getattr(graph, "graph", graph)  # GraphModule or Graph
    return [n for n in g.nodes if is_compute(n)]


def _stage_maps(plan: Plan) -> tuple[dict[str, str], dict[str, str], set[str]]:
    fwd: dict[str, str] = dict.fromkeys(plan.host, HOST)
    bwd: dict[str, str] = dict.fromkeys(plan.host, HOST)
    for s in plan.stages:
        for n in s.nodes:
            if s.kind != "backward":
                fwd.setdefault(n, s.name)
            if s.kind != "forward":
                bwd.setdefault(n, s.name)
    return fwd, bwd, set(plan.saved)


def _ordered(names: Iterable[str], plan: Plan) -> tuple[str, ...]:
    order = {s.name: i for i, s in enumerate(plan.stages)}
    # a name that is not a stage (the host) sorts after the stages
    return tuple(sorted(set(names), key=lambda n: order.get(n, len(order))))


def _rollup_graph(plan: Plan, graph: Any, depth: int | None) -> Rollup:
    nodes = [n for n in _graph_nodes(graph) if n.name not in plan.host]  # drawn first, as in a plan alone
    paths = [module_path(n) for n in nodes]
    depth = depth or _auto_depth(paths)
    boxes_of = _fold([_key(p, depth) for p in paths])
    fwd, bwd, saved = _stage_maps(plan)
    members: dict[str, list[str]] = {}
    for n, b in zip(nodes, boxes_of):
        members.setdefault(b, []).append(n.name)
    index = {b: i for i, b in enumerate(members)}
    box_of_node = {n: b for n, b in zip(nodes, boxes_of)}
    edges_between: dict[tuple[int, int], None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            # inputs, parameters and the host's lookups belong to no box: no edge from them
            if a in box_of_node and box_of_node[a] != box_of_node[n]:
                edges_between[(index[box_of_node[a]], index[box_of_node[n]])] = None
    boxes = tuple(
        ModuleBox(
            name=b or ROOT,
            nodes=tuple(ns),
            forward=_ordered((fwd[n] for n in ns if n in fwd), plan),
            backward=_ordered((bwd[n] for n in ns if n in bwd), plan),
            saved=sum(n in saved for n in ns),
        )
        for b, ns in members.items()
    )
    host = _host_boxes(plan, True)
    edges = {(0, len(host)): None} if host and boxes else {}
    # the module boxes follow the host's in the Rollup: their indices shift past them
    edges.update({(a + len(host), b + len(host)): None for a, b in edges_between})
    return Rollup(host + boxes, tuple(edges), depth, True)


def _host_boxes(plan: Plan, from_graph: bool, saved: int | None = 0) -> tuple[ModuleBox, ...]:
    """One box per embedding lookup the host runs (nothing of it is saved; ``saved=None`` where the view cannot
    say), named after its node: a plan does not record its module."""
    return tuple(ModuleBox(name=n, nodes=(n,) if from_graph else (), forward=(HOST,), backward=(HOST,), saved=saved)
                 for n in plan.host)


def _rollup_plan(plan: Plan, depth: int | None) -> Rollup:
    """Boxes from ``Stage.modules``: forward and fused stages in order, then backward stages from the last (so
    both sequences run in topological order), each folded on its own."""
    def norm(m: str) -> str:
        return "" if m == ROOT else m

    fwd_seq = [(norm(m), s.name) for s in plan.stages if s.kind != "backward" for m in s.modules]
    # backward stages run from the graph's end: reversed, their modules come in topological order like the forward ones
    bwd_seq = [(norm(m), s.name) for s in reversed(plan.stages) if s.kind == "backward" for m in s.modules]
    saved_of = {(s.name, norm(m)) for s in plan.forward_stages for m in s.saved_modules}
    # plans written before Stage.saved_modules existed cannot place their saved nodes on modules
    known = not plan.saved or bool(saved_of)
    depth = depth or _auto_depth([m for m, _ in fwd_seq + bwd_seq])
    members: dict[str, tuple[list[str], list[str]]] = {}
    saved: dict[str, int] = {}
    for seq, side in ((fwd_seq, 0), (bwd_seq, 1)):
        for box, (m, stage) in zip(_fold([_key(m, depth) for m, _ in seq]), seq):
            members.setdefault(box, ([], []))[side].append(stage)
            saved[box] = saved.get(box, 0) + (side == 0 and (stage, m) in saved_of)
    fused = plan.fused_stage
    host = _host_boxes(plan, False, 0 if known else None)
    boxes = host + tuple(
        ModuleBox(
            name=b or ROOT,
            nodes=(),
            forward=_ordered(f, plan),
            # the fused stage runs its own backward
            backward=_ordered(bw + (["FB"] if fused is not None and "FB" in f else []), plan),
            saved=saved.get(b, 0) if known else None,
        )
        for b, (f, bw) in members.items()
    )
    return Rollup(boxes, tuple((i, i + 1) for i in range(len(boxes) - 1)), depth, False)


def rollup(plan: Plan, graph: Any = None, *, depth: int | None = None) -> Rollup:
    """The boxes of ``plan`` rolled up to ``depth`` module-path components (automatic when ``None``), from the
    traced ``graph`` when given, else from the plan's stage modules.

    Node → module mapping. With the traced graph (``graph``: a ``torch.fx.GraphModule`` or ``Graph``, e.g. from
    :func:`rpcompile.trace` or :func:`rpcompile.planner.planning.prepare`) every compute node is placed by its
    ``nn_module_stack`` meta, edges between boxes are the graph's data edges, and saved activations are placed on the
    boxes exactly. A :class:`~rpcompile.core.plan.Plan` alone stores node *names* and, per stage, the module paths its
    nodes come from (``Stage.modules``, written by :mod:`rpcompile.passes.lower`) but not which node belongs to which
    module — so without a graph the boxes come from ``Stage.modules`` (forward stages in order, then the backward stages
    from the last), they are chained in that order, and saved modules come from ``Stage.saved_modules`` (plans older
    than that field leave the saved marker out: each stage's saved count goes in the box tooltip instead).
    """
    if depth is not None and depth < 1:
        raise ConfigError(f"depth must be >= 1, got {depth}; or leave it out for an automatic depth")
    return _rollup_graph(plan, graph, depth) if graph is not None else _rollup_plan(plan, depth)
