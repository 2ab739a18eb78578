"""A plan drawn over the model: the traced graph rolled up by module, each box labelled with its stages.

Terms:
- *box*: one rolled-up module (``embed``, ``layers.7.attn``, ``layers.7.mlp``, ``lm_head``): every compute node
  whose module path (:func:`rpcompile.passes.util.module_path`) starts with the box's name, cut to ``depth``
  components as ``rpcompile profile`` does (:func:`rpcompile.profiling.rollup_name`).
- *folding*: nodes owned by a module that also has boxes below it — a block's residual adds (``layers.7``), the
  root's own glue (``(root)``) — join the box just before them when that box lies inside their module (the
  residual add closes the attention or MLP half it follows, as in the partitioner's segments), else the next one;
  so a 32-layer LLaMA gives 4 boxes per layer instead of 5. A module with no box below it keeps its own.
- *depth* (automatic by default): one level below the model's first module list (``layers.7.attn``), or the
  top-level children for a model without one — the partitioner's groups — made shallower while there would be
  more than :data:`MAX_BOXES` boxes.
- a box's *forward stages* are the forward or fused stages that run its nodes, its *backward stages* the backward
  or fused stages that run their backward (usually one each: ``F3 | B11``; ``FB`` when the fused stage does
  both); it is *saved* when a forward stage saves one of its nodes' activations to host memory. An embedding the
  host looks up (``Plan.host``) is a box of its own, first, labelled ``host``.

Node → module mapping. With the traced graph (``graph``: a ``torch.fx.GraphModule`` or ``Graph``, e.g. from
:func:`rpcompile.trace` or :func:`rpcompile.planning.prepare`) every compute node is placed by its
``nn_module_stack`` meta, edges between boxes are the graph's data edges, and saved activations are placed on
the boxes exactly. A :class:`~rpcompile.core.plan.Plan` alone stores node *names* and, per stage, the module paths
its nodes come from (``Stage.modules``, written by :mod:`rpcompile.passes.lower`) but not which node belongs to which
module — so without a graph the boxes come from ``Stage.modules`` (forward stages in order, then the backward
stages from the last), they are chained in that order, and saved modules come from ``Stage.saved_modules``
(plans older than that field leave the saved marker out: each stage's saved
count goes in the box tooltip instead).

The SVG is laid out here: boxes in topological order, wrapped into columns of at most :data:`ROWS_PER_COLUMN`
in snake order (down the first column, up the second…), so consecutive boxes always touch; edges between
consecutive boxes are short connectors, others (residual and skip connections) light curves. The DOT text
carries the same information for Graphviz users: one cluster per forward stage, the fill split between the
forward and the backward stage's colour, a bold border on saved boxes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from .core.errors import ConfigError
from .core.plan import Plan
from .passes.util import is_compute, module_path
from .svg import document, esc, line, num, path, rect, stage_color, text, text_width, title

__all__ = ["MAX_BOXES", "ROWS_PER_COLUMN", "ModuleBox", "Rollup", "rollup", "graph_dot", "graph_svg", "write_graph"]

MAX_BOXES = 150
"""The automatic depth keeps at most this many boxes (unless even depth 1 has more)."""
ROWS_PER_COLUMN = 25
"""Boxes per column of the SVG layout, at most."""
GRAPH_SUFFIXES = (".svg", ".dot")
FANOUT = 4
"""SVG: a box with more non-adjacent successors than this gets a "→ N uses" tag instead of N curves."""
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


# ---- roll-up ------------------------------------------------------------------------------------------------


def _key(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def _under(child: str, parent: str) -> bool:
    """``child`` lies strictly inside module ``parent`` (everything lies inside the root, ``""``)."""
    return child != parent and (parent == "" or child.startswith(parent + "."))


def _fold(keys: Sequence[str]) -> list[str]:
    """Each key's box after folding (see the module docstring)."""
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
    for i in range(len(out) - 1, -1, -1):
        if out[i] is None:
            nxt = out[i + 1] if i + 1 < len(out) else None
            out[i] = nxt if nxt is not None and _under(nxt, keys[i]) else keys[i]
    return [k for k in out if k is not None]


def _count_boxes(paths: Sequence[str], depth: int) -> int:
    return len(set(_fold([_key(p, depth) for p in paths])))


def _auto_depth(paths: Sequence[str]) -> int:
    lists = [i + 1 for p in paths for i, part in enumerate(p.split(".")) if _NUMERIC.match(part)]
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
    traced ``graph`` when given, else from the plan's stage modules (see the module docstring)."""
    if depth is not None and depth < 1:
        raise ConfigError(f"depth must be >= 1, got {depth}; or leave it out for an automatic depth")
    return _rollup_graph(plan, graph, depth) if graph is not None else _rollup_plan(plan, depth)


# ---- DOT ----------------------------------------------------------------------------------------------------


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _stage_index(plan: Plan) -> dict[str, int]:
    return {s.name: i for i, s in enumerate(plan.stages)}


def _headline(plan: Plan, r: Rollup) -> str:
    n = plan.hardware.device_count
    return (f"plan ({plan.strategy}): {len(plan.stages)} stages on {n} device{'s' * (n != 1)}, "
            f"{plan.microbatches} microbatches — {len(r.boxes)} modules at depth {r.depth}")


def _tooltip(b: ModuleBox, plan: Plan) -> str:
    parts = [b.name, f"forward: {', '.join(b.forward) or '—'}", f"backward: {', '.join(b.backward) or '—'}"]
    if b.nodes:
        parts.append(f"{len(b.nodes)} nodes")
    if b.saved is not None:
        parts.append(f"{b.saved} saved to host" if b.saved else "recomputed in backward" if b.backward != ("FB",)
                     else "fused: nothing recomputed")
    else:
        counts = [f"{s.name} saves {len(s.saved)}" for s in plan.forward_stages if s.name in b.forward and s.saved]
        parts.append("; ".join(counts) + " nodes (no graph: not placed on modules)" if counts else "no saved nodes")
    return " · ".join(parts)


def graph_dot(plan: Plan, graph: Any = None, *, depth: int | None = None) -> str:
    """Graphviz DOT text of the rolled-up plan (render with ``dot -Tsvg``): one node per box, clustered by its
    first forward stage, filled half with the forward and half with the backward stage's colour."""
    r = rollup(plan, graph, depth=depth)
    idx = _stage_index(plan)
    clusters: dict[str, list[int]] = {}
    for i, b in enumerate(r.boxes):
        clusters.setdefault(b.forward[0] if b.forward else "", []).append(i)
    out = [
        "digraph plan {",
        f"  graph [rankdir=TB, labelloc=t, fontname=Helvetica, label={_q(_headline(plan, r))}];",
        '  node [shape=box, style="striped", fontname=Helvetica, fontsize=11];',
        "  edge [color=\"#555555\", arrowsize=0.6];",
    ]
    for stage, members in clusters.items():
        pad = "  "
        if stage:
            out.append(f"  subgraph {_q('cluster_' + stage)} {{")
            out.append(f"    label={_q(stage)}; color={_q(stage_color(idx.get(stage, -1)))}; penwidth=2;")
            pad = "    "
        for i in members:
            b = r.boxes[i]
            fcol = stage_color(idx.get(b.forward[0], -1)) if b.forward else stage_color(-1)
            bcol = stage_color(idx.get(b.backward[-1], -1)) if b.backward else stage_color(-1)
            label = f"{b.name}\\n{b.stage_label}" + ("\\nsaved" if b.saved else "")
            attrs = f'label="{_esc_dot(label)}", fillcolor="{fcol};0.5:{bcol}", tooltip={_q(_tooltip(b, plan))}'
            if b.saved:
                attrs += ", penwidth=3"
            out.append(f"{pad}{_q(b.name)} [{attrs}];")
        if stage:
            out.append("  }")
    for src, dst in r.edges:
        skip = dst != src + 1
        style = ' [color="#99999980", constraint=false]' if skip else ""
        out.append(f"  {_q(r.boxes[src].name)} -> {_q(r.boxes[dst].name)}{style};")
    out.append("}")
    return "\n".join(out) + "\n"


def _esc_dot(s: str) -> str:
    """Escape a DOT label that may hold ``\\n`` line breaks (kept) and quotes (escaped)."""
    return s.replace('"', '\\"')


# ---- SVG ----------------------------------------------------------------------------------------------------

_BOX_W, _BOX_H, _GAP_Y, _COL_GAP = 210.0, 40.0, 12.0, 64.0
_MARGIN = 16.0

_STYLE = """
text { fill: #222; }
.title { font-size: 15px; font-weight: bold; }
.key { font-size: 11px; }
.swatch-label { font-size: 10px; }
.name { font-size: 12px; font-weight: bold; }
.stages { font-size: 11px; }
.name, .stages { paint-order: stroke; stroke: #ffffff; stroke-opacity: 0.85; stroke-width: 3px; stroke-linejoin: round; }
.frame { fill: none; stroke: #555; stroke-width: 1; }
.saved .frame { stroke: #111; stroke-width: 3; }
.badge { fill: #111; }
.badge-text { font-size: 9px; font-weight: bold; fill: #fff; }
.chain { stroke: #444; stroke-width: 1.5; }
.fanout { font-size: 9px; fill: #666; }
.skip { fill: none; stroke: #888; stroke-opacity: 0.45; stroke-width: 1; }
"""

_ARROW = ('<marker id="arrow" viewBox="0 0 6 6" refX="6" refY="3" markerWidth="6" markerHeight="6" '
          'orient="auto"><path d="M0,0 L6,3 L0,6 z" fill="#444"/></marker>')


def _fit(s: str, size: float, width: float) -> str:
    """``s``, cut from the left with an ellipsis to fit ``width`` px (the tail of a module path is its name)."""
    if text_width(s, size) <= width:
        return s
    keep = max(int(width / (0.58 * size)) - 1, 1)
    return "…" + s[-keep:]


class _Layout:
    """Snake columns: box ``i`` sits in column ``i // rows``, downwards in even columns and upwards in odd ones."""

    def __init__(self, n: int, top: float) -> None:
        self.cols = max(1, math.ceil(n / ROWS_PER_COLUMN))
        self.rows = max(1, math.ceil(n / self.cols))
        self.top = top

    def pos(self, i: int) -> tuple[float, float, int, int]:
        c, r = divmod(i, self.rows)
        if c % 2:
            r = self.rows - 1 - r
        return _MARGIN + c * (_BOX_W + _COL_GAP), self.top + r * (_BOX_H + _GAP_Y), c, r

    @property
    def width(self) -> float:
        return 2 * _MARGIN + self.cols * _BOX_W + (self.cols - 1) * _COL_GAP

    @property
    def height(self) -> float:
        return self.top + self.rows * (_BOX_H + _GAP_Y) + _MARGIN


def _box_svg(i: int, b: ModuleBox, x: float, y: float, plan: Plan, idx: dict[str, int],
             fans: Sequence[int] = ()) -> list[str]:
    fcol = stage_color(idx.get(b.forward[0], -1)) if b.forward else stage_color(-1)
    bcol = stage_color(idx.get(b.backward[-1], -1)) if b.backward else stage_color(-1)
    cls = "module saved" if b.saved else "module"
    saved = "" if b.saved is None else f' data-saved="{b.saved}"'
    out = [f'<g class="{cls}" id="box{i}" data-module="{esc(b.name)}" data-forward="{esc(" ".join(b.forward))}" '
           f'data-backward="{esc(" ".join(b.backward))}"{saved}>',
           "  " + title(_tooltip(b, plan) + (f" · feeds {len(fans)} later modules" if fans else "")),
           "  " + rect(x, y, _BOX_W / 2, _BOX_H, fill=fcol),
           "  " + rect(x + _BOX_W / 2, y, _BOX_W / 2, _BOX_H, fill=bcol),
           "  " + rect(x, y, _BOX_W, _BOX_H, class_="frame"),
           "  " + text(x + 8, y + 16, _fit(b.name, 12, _BOX_W - (56 if b.saved else 16)), class_="name"),
           "  " + text(x + 8, y + 32, b.stage_label, class_="stages")]
    if b.saved:
        out.append("  " + rect(x + _BOX_W - 42, y + 4, 38, 13, rx=3, class_="badge"))
        out.append("  " + text(x + _BOX_W - 23, y + 13.5, "saved", class_="badge-text", text_anchor="middle"))
    if fans:
        out.append("  " + text(x + _BOX_W + 4, y + 12, f"→ {len(fans)} uses", class_="fanout"))
    out.append("</g>")
    return out


def _edge_svg(lay: _Layout, a: int, b: int) -> str:
    xa, ya, ca, ra = lay.pos(a)
    xb, yb, cb, rb = lay.pos(b)
    if b == a + 1 and ca == cb:  # a short connector down (even column) or up (odd column)
        y1, y2 = (ya + _BOX_H, yb) if yb > ya else (ya, yb + _BOX_H)
        return line(xa + _BOX_W / 2, y1, xb + _BOX_W / 2, y2, class_="chain", marker_end="url(#arrow)")
    if b == a + 1:  # snake turn: the next column, same row
        return line(xa + _BOX_W, ya + _BOX_H / 2, xb, yb + _BOX_H / 2, class_="chain", marker_end="url(#arrow)")
    y1, y2 = ya + _BOX_H / 2, yb + _BOX_H / 2
    x1 = xa + _BOX_W
    if ca == cb:  # a loop out to the right of the column, wider the further it goes
        x2 = xb + _BOX_W
        bulge = min(10 + 5 * abs(ra - rb), _COL_GAP - 12)
        d = f"M{num(x1)},{num(y1)} C{num(x1 + bulge)},{num(y1)} {num(x2 + bulge)},{num(y2)} {num(x2)},{num(y2)}"
    else:
        x2 = xb if cb > ca else xb + _BOX_W
        d = f"M{num(x1)},{num(y1)} C{num(x1 + 40)},{num(y1)} {num(x2 + (-40 if cb > ca else 40))},{num(y2)} " \
            f"{num(x2)},{num(y2)}"
    return path(d, class_="skip")


def _edges_svg(r: Rollup, lay: _Layout) -> tuple[list[str], dict[int, list[int]]]:
    """The edge group, and the *broadcast* sources: a box feeding more than :data:`FANOUT` non-adjacent boxes
    (position ids, rotary tables, masks) gets a tag instead of a fan of curves across the page."""
    skips: dict[int, list[int]] = {}
    for a, b in r.edges:
        if b != a + 1:
            skips.setdefault(a, []).append(b)
    fanout = {a: bs for a, bs in skips.items() if len(bs) > FANOUT}
    out = ['<g class="edges">']
    out += ["  " + _edge_svg(lay, a, b) for a, b in r.edges if a not in fanout or b == a + 1]
    out.append("</g>")
    return out, fanout


def _stage_key(plan: Plan, width: float, y: float) -> tuple[list[str], float]:
    """A row of stage swatches (wrapping): every stage's colour and name."""
    out, x = ['<g class="stage-key">'], _MARGIN
    for k, s in enumerate(plan.stages):
        w = 14 + text_width(s.name, 10) + 10
        if x + w > width - _MARGIN:
            x, y = _MARGIN, y + 16
        out.append("  " + rect(x, y, 12, 11, fill=stage_color(k)))
        out.append("  " + text(x + 15, y + 9.5, s.name, class_="swatch-label"))
        x += w
    out.append("</g>")
    return out, y + 16


def graph_svg(plan: Plan, graph: Any = None, *, depth: int | None = None) -> str:
    """SVG text of the rolled-up plan (see the module docstring for the layout)."""
    r = rollup(plan, graph, depth=depth)
    idx = _stage_index(plan)
    width = max(_Layout(len(r.boxes), 0).width, 760.0)
    key = ("left half: forward stage · right half: backward stage · bold border + saved: activations kept in "
           "host memory, not recomputed")
    if not r.from_graph:
        key += " · no traced graph: boxes chained in plan order"
    head = ['<g class="header">', "  " + text(_MARGIN, 22, _headline(plan, r), class_="title"),
            "  " + text(_MARGIN, 40, key, class_="key"), "</g>"]
    swatches, top = _stage_key(plan, width, 50)
    lay = _Layout(len(r.boxes), top + 12)
    edges, fanout = _edges_svg(r, lay)
    columns: list[str] = []
    for c in range(lay.cols):
        columns.append(f'<g class="column" id="column{c}">')
        for i in range(c * lay.rows, min((c + 1) * lay.rows, len(r.boxes))):
            x, y, _, _ = lay.pos(i)
            columns.extend("  " + s for s in _box_svg(i, r.boxes[i], x, y, plan, idx, fanout.get(i, ())))
        columns.append("</g>")
    return document(width, lay.height, head + swatches + edges + columns, style=_STYLE, defs=[_ARROW],
                    label=_headline(plan, r))


def write_graph(path: str | Path, plan: Plan, graph: Any = None, **kw: Any) -> Path:
    """Write the plan graph to ``path``: SVG for ``.svg``, Graphviz DOT for ``.dot`` (keywords as
    :func:`graph_svg`); any other suffix raises :class:`~rpcompile.core.errors.ConfigError`."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in GRAPH_SUFFIXES:
        raise ConfigError(f"cannot write a plan graph to {str(path)!r}: the file name must end in .svg or .dot")
    body = graph_svg(plan, graph, **kw) if suffix == ".svg" else graph_dot(plan, graph, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body, encoding="utf-8")
    return path
