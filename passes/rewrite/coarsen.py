"""``coarsen_pass``: group a costed graph's compute nodes into *segments* the partitioner can afford.

Terms
-----
- **Position**: the index of a compute node in topological order. A **cut after position i** separates nodes
  ``≤ i`` from nodes ``> i``; its **cost** is the bytes of every tensor live across it (:func:`live_bytes`).
- **Group**: a maximal run of consecutive nodes from the same source module one level below the model's first
  module list (``layers.3.attn``, ``layers.3.mlp``, ``embed``…; :func:`_group_keys`).
- **Segment**: a run of groups, merged until at most ``max_segments`` remain — attention and MLP halves of a
  transformer block by default (how they merge: :func:`coarsen_pass`).
- **Layer**: a run of segments from the same top-level unit (``layers.3``); baselines cut only between layers.

Outputs: ``node.meta["rpcompile.segment"]`` (segment index) and ``gm.meta["rpcompile.segments"]``: a tuple of
:class:`Segment` with summed costs, the bytes live across the cut after it, and the parameters it reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from ...core.errors import ConfigError
from rpcompile.passes.cost.cost_model import DTYPE_KEY, node_cost
from ..graph.shape import SHAPE_KEY, scaled_nbytes
from ..graph.util import compute_nodes, module_path
from .loss_head import CHUNK_META

__all__ = ["COARSEN_META", "SEGMENT_KEY", "SEGMENTS_KEY", "Segment", "coarsen_pass", "live_bytes", "segments_of"]

COARSEN_META = "rpcompile.coarsen"
"""``gm.meta`` key: the options the graph was coarsened with (``segments_per_layer``, ``max_segments``)."""
SEGMENT_KEY = "rpcompile.segment"
SEGMENTS_KEY = "rpcompile.segments"
_NUMERIC = re.compile(r"^\d+$")


@dataclass(frozen=True)
class Segment:
    """A contiguous run of compute nodes ``[start, stop)`` (positions) and its summed costs (one microbatch)."""

    index: int
    name: str
    """The source module group holding most of its time, e.g. ``layers.3.attn``."""
    layer: int
    start: int
    stop: int
    nodes: tuple[str, ...]
    fwd_s: float
    bwd_s: float
    act_bytes: int
    """Bytes autograd keeps for this segment's backward."""
    peak_bytes: int
    """The most bytes its forward holds while one of its nodes runs, without autograd: what is live across that
    node, what it reads for the last time and its forward transient (``fwd_transient_bytes``)."""
    boundary_bytes: int
    """Bytes live across the cut after this segment."""
    params: tuple[str, ...]
    transient_bytes: int = 0
    """Largest ``bwd_transient_bytes`` of its nodes: their backwards run one at a time, so these do not add up."""
    backward_ops: int = 0
    """Its nodes that have a backward (a backward time): what a backward stage dispatches for it, where the
    forward dispatches every one of its ``nodes``."""


def _nbytes(node: fx.Node, dtype: torch.dtype | None) -> int:
    """Bytes a node's value occupies that no earlier node already holds (model inputs count in full), with its
    floating tensors in the precision the model runs in."""
    info = node.meta.get(SHAPE_KEY)
    if info is None:
        return 0
    return scaled_nbytes(info, dtype, aliases=node.op == "placeholder")


def _is_alias(node: fx.Node) -> bool:
    info = node.meta.get(SHAPE_KEY)
    return info is not None and bool(info.tensors) and all(t.is_alias for t in info.tensors)


def live_bytes(gm: fx.GraphModule) -> tuple[int, list[int], list[int]]:
    """(bytes of model inputs live before position 0, bytes live across the cut after each position, bytes each
    position reads for the last time — live while it runs, freed after it).

    A tensor is live across the cut after position ``i`` when it is produced at or before ``i`` (or is a model
    input) and used after it: a stage boundary there must ship all of them (activations through host memory,
    gradients back), so any position can be a cut and its bytes are its cost. Floating tensors count in the
    precision the model runs in (``gm.meta["rpcompile.dtype"]``, the cost model's: an fp32 model planned for bf16
    ships bf16). A view keeps its base alive, so uses of an alias node count as uses of what it aliases."""
    nodes = compute_nodes(gm)
    pos = {n: i for i, n in enumerate(nodes)}
    n = len(nodes)
    last_use: dict[fx.Node, int] = {}
    # backwards: a view's users come after it, so its last use is final when it is reached, and the inputs it
    # extends are reached after it
    for node in reversed(list(gm.graph.nodes)):
        # weights are no activations: they cross no cut
        if node.op == "get_attr":
            continue
        uses = [pos.get(u, n) for u in node.users]  # the output node counts as "after everything"
        # an alias user may already have pushed this node's last use further
        last = max([last_use.get(node, -1), *uses]) if uses else last_use.get(node, -1)
        last_use[node] = last
        if node.op != "placeholder" and _is_alias(node):
            for inp in node.all_input_nodes:
                last_use[inp] = max(last_use.get(inp, -1), last)
    # a difference array: + size after the producer, - size after the last use; its prefix sums are the live bytes
    diff = [0] * (n + 1)
    last_read = [0] * n
    inputs = 0
    dtype = gm.meta.get(DTYPE_KEY)
    for node, last in last_use.items():
        size = _nbytes(node, dtype)
        start = pos.get(node, -1)
        # a value nothing reads after its producer crosses no cut
        if size == 0 or last <= start:
            continue
        if start < 0:
            inputs += size
            start = 0
            diff[0] += size
        else:
            diff[start] += size
        # last == n: the output reads it, so it stays live across every later cut (slot n is past the end)
        diff[min(last, n)] -= size
        if last < n:
            last_read[last] += size
    live, acc = [], 0
    for i in range(n):
        acc += diff[i]
        live.append(acc)
    return inputs, live, last_read


def _group_keys(nodes: Sequence[fx.Node], deeper: int = 1) -> tuple[list[str], list[str]]:
    """(group key, layer key) per node; a group is the module path ``deeper`` levels below the layer.

    The layer is the model's first module list (``layers.3``); for a model without a module list, groups are the
    top-level children. With ``segments_per_layer > 2`` the groups lie one level deeper (``deeper=2``:
    ``layers.3.mlp.gate_proj``…), so a block can be cut, and its activations saved, in smaller pieces."""
    paths = [module_path(n) for n in nodes]
    # the depth of every numbered path part (a module list's index): the shallowest one is the layer level
    depths = [i + 1 for p in paths for i, part in enumerate(p.split(".")) if _NUMERIC.match(part)]
    d = min(depths) if depths else 1
    groups, layers = [], []
    for node, p in zip(nodes, paths):
        parts = p.split(".") if p else []
        layered = len(parts) >= d and _NUMERIC.match(parts[d - 1] if d - 1 < len(parts) else "")
        # inside a layer a group is `deeper` levels below it; outside one (embeddings, the head) its top-level part
        group = ".".join(parts[: d + deeper]) if layered else ".".join(parts[:d]) or "(root)"
        groups.append(node.meta.get(CHUNK_META, group))  # a split LM head: one group per chunk
        layers.append(".".join(parts[:d]) or "(root)")
    return groups, layers


def _runs(keys: Sequence[str]) -> list[tuple[int, int]]:
    runs, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            runs.append((start, i))
            start = i
    return runs


def _merge(bounds: list[tuple[int, int]], time: list[float], cut_cost: list[int], target: int) -> list[tuple[int, int]]:
    """Merge adjacent runs, smallest first, across its more expensive cut, until at most ``target`` remain and
    none is tiny (under a tenth of the largest: a norm or a residual add never stands alone)."""
    segs = list(bounds)
    t = [sum(time[a:b]) for a, b in segs]
    tiny = 0.1 * max(t, default=0.0)
    while len(segs) > 1 and (len(segs) > max(target, 1) or min(t) < tiny):
        k = min(range(len(segs)), key=lambda i: (t[i], i))
        # (that side's cut cost, minus the neighbour's time): the dearer cut wins; on a tie, the smaller neighbour
        left = (cut_cost[segs[k - 1][1] - 1], -t[k - 1]) if k > 0 else None
        right = (cut_cost[segs[k][1] - 1], -t[k + 1]) if k + 1 < len(segs) else None
        j = k - 1 if right is None or (left is not None and left > right) else k + 1
        a, b = min(k, j), max(k, j)
        segs[a:b + 1] = [(segs[a][0], segs[b][1])]
        t[a:b + 1] = [t[a] + t[b]]
    return segs


def default_max_segments(n_layers: int, per_layer: int = 2) -> int:
    """About ``per_layer`` segments per layer (by default two: attention and MLP halves) plus a few for
    embeddings and head."""
    # at least 16 for small models; at most 128 layers' worth, so the solver's problem stays bounded
    return min(128 * per_layer, max(16, per_layer * n_layers + 6))


def coarsen_pass(gm: fx.GraphModule, *, max_segments: int | None = None, segments_per_layer: int = 2) -> fx.GraphModule:
    """Group the compute nodes of a costed graph into segments (terms: module docstring).

    Coarsening starts from groups and repeatedly merges the cheapest segment (forward + backward time) into the
    neighbour across the *more expensive* cut (:func:`_merge`), so cheap norms and residual adds join the
    half-block whose boundary is narrower, until at most ``max_segments`` remain: attention and MLP halves of a
    transformer block by default (torchgpipe's block partition works on the same idea of fixed candidate cuts);
    ``segments_per_layer`` asks for more (finer saves, a larger problem for the solver)."""
    if isinstance(segments_per_layer, bool) or not isinstance(segments_per_layer, int) or segments_per_layer < 1:
        raise ConfigError(f"segments_per_layer must be a positive integer, got {segments_per_layer!r}; use 2 (the default) "
                          "or 4")
    nodes = compute_nodes(gm)
    if not nodes:
        raise ConfigError("coarsen_pass: the graph has no compute nodes, so there is nothing to partition; give a model "
                          "whose forward computes something")
    inputs, live, last_read = live_bytes(gm)
    # what each node holds while it runs: what stays live past it, what it reads for the last time, and what it
    # makes on the way (the forward's peak, which the cuts alone do not see: a cross-entropy's log-softmax)
    running = [live[i] + last_read[i] + node_cost(node).fwd_transient_bytes for i, node in enumerate(nodes)]
    groups, layer_keys = _group_keys(nodes, deeper=2 if segments_per_layer > 2 else 1)
    runs = _runs(groups)
    # only runs whose layer key ends in an index are layers: embeddings, the head and "(root)" are not
    n_layers = sum(1 for a, _ in _runs(layer_keys) if _NUMERIC.match(layer_keys[a].rsplit(".", 1)[-1]))
    chunks = len({n.meta[CHUNK_META] for n in nodes if CHUNK_META in n.meta})  # a split LM head's pieces
    # each piece of a split LM head gets a segment of its own on top of the default
    target = max_segments or default_max_segments(n_layers, segments_per_layer) + chunks
    time = [node_cost(n).fwd_time_s + node_cost(n).bwd_time_s for n in nodes]
    # the bytes live across each position are the cost of cutting there
    bounds = _merge(runs, time, live, target)
    layer_index: list[int] = []
    previous: str | None = None
    for a, _ in bounds:
        # the first segment is layer 0; the index steps up where the layer key changes
        layer_index.append(len(layer_index) and layer_index[-1] + (layer_keys[a] != previous))
        previous = layer_keys[a]
    segments = tuple(_segment(i, nodes, a, b, groups, live, running, layer_index[i]) for i, (a, b) in enumerate(bounds))
    for seg in segments:
        for n in nodes[seg.start:seg.stop]:
            n.meta[SEGMENT_KEY] = seg.index
    gm.meta[SEGMENTS_KEY] = segments
    gm.meta["rpcompile.input_bytes"] = inputs
    gm.meta[COARSEN_META] = {"segments_per_layer": segments_per_layer, "max_segments": max_segments}
    return gm


def _segment(i: int, nodes: Sequence[fx.Node], a: int, b: int, groups: Sequence[str], live: Sequence[int],
             running: Sequence[int], layer: int) -> Segment:
    costs = [node_cost(n) for n in nodes[a:b]]
    weight: dict[str, float] = {}
    for g, c in zip(groups[a:b], costs):
        weight[g] = weight.get(g, 0.0) + c.fwd_time_s + c.bwd_time_s
    params: dict[str, None] = {}
    for c in costs:
        params.update(dict.fromkeys(c.params))
    return Segment(
        index=i,
        name=max(weight, key=lambda g: weight[g]),  # the group that dominates its time, e.g. layers.3.mlp
        layer=layer,
        start=a,
        stop=b,
        nodes=tuple(n.name for n in nodes[a:b]),
        fwd_s=sum(c.fwd_time_s for c in costs),
        bwd_s=sum(c.bwd_time_s for c in costs),
        act_bytes=sum(c.act_bytes for c in costs),
        peak_bytes=max(running[a:b]),
        boundary_bytes=live[b - 1],
        params=tuple(params),
        transient_bytes=max(c.bwd_transient_bytes for c in costs),
        backward_ops=sum(1 for c in costs if c.bwd_time_s > 0),
    )


def segments_of(gm: fx.GraphModule) -> tuple[Segment, ...]:
    """The segments ``coarsen_pass`` recorded on ``gm``."""
    try:
        return gm.meta[SEGMENTS_KEY]
    except KeyError:
        raise ValueError("run coarsen_pass on the graph first") from None
