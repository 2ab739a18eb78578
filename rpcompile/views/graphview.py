"""A plan drawn over the model: the boxes of :func:`rpcompile.views.graph_rollup.rollup` (the traced graph rolled up by
module, each labelled with its stages) as SVG or Graphviz DOT.

The SVG is laid out here: boxes in topological order, wrapped into columns of at most :data:`ROWS_PER_COLUMN`
in snake order (down the first column, up the second…), so consecutive boxes always touch; edges between
consecutive boxes are short connectors, others (residual and skip connections) light curves. The DOT text
carries the same information for Graphviz users: one cluster per forward stage, the fill split between the
forward and the backward stage's colour, a bold border on saved boxes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from ..core.errors import ConfigError
from ..core.files import write_atomic
from ..core.text import printable
from ..core.plan import Plan
from .graph_rollup import ModuleBox, Rollup, rollup
from .svg import document, esc, line, num, path, rect, stage_color, text, text_width, title

__all__ = ["ROWS_PER_COLUMN", "graph_dot", "graph_svg", "write_graph"]

ROWS_PER_COLUMN = 25
"""Boxes per column of the SVG layout, at most."""
GRAPH_SUFFIXES = (".svg", ".dot")
FANOUT = 4
"""SVG: a box with more non-adjacent successors than this gets a "→ N uses" tag instead of N curves."""


# ---- DOT ----------------------------------------------------------------------------------------------------


def _q(s: str) -> str:
    """``s`` as a DOT quoted string, shown as it is (:func:`_dot_text`)."""
    return f'"{_dot_text(s)}"'


def _dot_text(s: str) -> str:
    """``s`` inside a DOT quoted string: one line (:func:`~rpcompile.core.text.printable`), backslashes and quotes
    escaped (so a name never starts a DOT escape such as ``\\N`` or ends the string)."""
    # backslashes first: the ones the quote escapes add must not be doubled
    return printable(s).replace("\\", "\\\\").replace('"', '\\"')


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
        # a box no forward stage runs goes under "", drawn outside every cluster
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
            # a literal \n: DOT's own line break inside a label
            label = "\\n".join(_dot_text(t) for t in (b.name, b.stage_label, *(["saved"] if b.saved else [])))
            # with style=striped, "a;0.5:b" fills half the box with each colour
            attrs = f'label="{label}", fillcolor="{fcol};0.5:{bcol}", tooltip={_q(_tooltip(b, plan))}'
            if b.saved:
                attrs += ", penwidth=3"
            out.append(f"{pad}{_q(b.name)} [{attrs}];")
        if stage:
            out.append("  }")
    for src, dst in r.edges:
        skip = dst != src + 1
        # constraint=false: skip edges do not rank the boxes; the chain alone lays them out
        style = ' [color="#99999980", constraint=false]' if skip else ""
        out.append(f"  {_q(r.boxes[src].name)} -> {_q(r.boxes[dst].name)}{style};")
    out.append("}")
    return "\n".join(out) + "\n"


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
    # the width text_width assumes per character, less one for the ellipsis
    keep = max(int(width / (0.58 * size)) - 1, 1)
    return "…" + s[-keep:]


class _Layout:
    """Snake columns: box ``i`` sits in column ``i // rows``, downwards in even columns and upwards in odd ones."""

    def __init__(self, n: int, top: float) -> None:
        self.cols = max(1, math.ceil(n / ROWS_PER_COLUMN))
        # the columns the cap needs, then the boxes spread evenly over them
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
           # the name leaves room at the right for the "saved" badge when there is one
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
        # capped below the gap between columns, so a loop never reaches the next column's boxes
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
    # a broadcast source keeps its chain connector; its other edges are the tag on its box
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
    # never narrower than the header's key line
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
    # edges before the boxes: SVG paints in order, so the boxes cover the curves that pass behind them
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
    return write_atomic(path, body)
