"""Tiny helpers for the hand-written SVG pictures (the pipeline timeline and the plan graph).

The pictures are plain SVG 1.1 text: no Graphviz, no matplotlib. Every emitter returns one line of markup
(without indentation or newline); callers indent and join them, so the output stays readable and diffable.

Terms:

- *stage colour*: :func:`stage_color` gives stage ``k`` a colour that differs clearly from stages ``k ± 1`` for
  a hundred stages and more — hues step by the golden angle (so neighbours are ~137° apart and no two of the first
  dozen are close) and the lightness alternates between two levels. Both pictures use it, so stage ``F3`` has
  the same colour in the timeline and in the graph.
- *transfer colours*: :data:`TRANSFER_COLORS` — weights, activations, gradients — greys, teal and purple, chosen
  to stay apart from the saturated stage colours' role (transfers are drawn in thin lanes of their own).
"""

from __future__ import annotations

import colorsys
from typing import Iterable

from rpcompile.core.text import printable

__all__ = [
    "esc",
    "num",
    "stage_color",
    "TRANSFER_COLORS",
    "text_width",
    "rect",
    "text",
    "line",
    "path",
    "title",
    "document",
]

TRANSFER_COLORS: dict[str, str] = {
    "weights": "#4e79a7",
    "activations": "#59a14f",
    "gradients": "#b07aa1",
}
"""Fill colour of a transfer bar by what it carries."""

_GOLDEN_ANGLE = 137.50776405003785


def esc(value: object) -> str:
    """``value`` as text safe inside an SVG element or a double-quoted attribute: characters XML forbids (and
    every other control character) as visible escapes (:func:`~rpcompile.core.text.printable`), markup escaped."""
    # str.replace beats str.translate by ~5x on the short strings of a picture with 20,000 bars.
    s = printable(value)
    # "&" first: the entities the later replacements add must not be escaped again
    if "&" in s:
        s = s.replace("&", "&amp;")
    if "<" in s:
        s = s.replace("<", "&lt;")
    if ">" in s:
        s = s.replace(">", "&gt;")
    if '"' in s:
        s = s.replace('"', "&quot;")
    return s


def num(x: float) -> str:
    """A coordinate with at most two decimals and no trailing zeros (``12.5``, ``3``, ``0.25``)."""
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    # a tiny negative coordinate rounds to "-0.00", which the strips leave as "-0"
    return "0" if s in ("-0", "") else s


def stage_color(index: int) -> str:
    """Fill colour of stage ``index`` (≥ 0; a negative index — no stage — is a neutral grey)."""
    if index < 0:
        return "#bab0ac"
    hue = (index * _GOLDEN_ANGLE) % 360.0 / 360.0
    # neighbours differ in lightness as well as hue, so adjacent stages stay apart even where hues come close
    lightness = 0.62 if index % 2 == 0 else 0.76
    r, g, b = colorsys.hls_to_rgb(hue, lightness, 0.62)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def text_width(s: str, size: float) -> float:
    """Rough rendered width in px of ``s`` in a sans-serif font of ``size`` px (for "does the label fit")."""
    # about the average glyph width of a sans-serif font, in ems
    return 0.58 * size * len(s)


def _attrs(attrs: dict[str, object]) -> str:
    # class_ sidesteps the Python keyword, text_anchor becomes SVG's text-anchor; a None value leaves the attribute out
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{esc(v)}"' for k, v in attrs.items() if v is not None)


def title(s: str) -> str:
    """A ``<title>`` child: the tooltip browsers show on hover."""
    return f"<title>{esc(s)}</title>"


def rect(x: float, y: float, w: float, h: float, *, tip: str | None = None, **attrs: object) -> str:
    """``<rect>``; ``tip`` adds a ``<title>`` tooltip. Keyword ``class_`` becomes ``class``, ``_`` becomes ``-``."""
    # a negative width or height is an error in SVG: clamped to an empty rectangle
    head = f'<rect x="{num(x)}" y="{num(y)}" width="{num(max(w, 0.0))}" height="{num(max(h, 0.0))}"{_attrs(attrs)}'
    return f"{head}>{title(tip)}</rect>" if tip is not None else head + "/>"


def text(x: float, y: float, s: str, **attrs: object) -> str:
    """``<text>`` at (x, y) (the baseline; ``text_anchor`` and ``dominant_baseline`` as keywords)."""
    return f'<text x="{num(x)}" y="{num(y)}"{_attrs(attrs)}>{esc(s)}</text>'


def line(x1: float, y1: float, x2: float, y2: float, **attrs: object) -> str:
    """``<line>`` from (x1, y1) to (x2, y2)."""
    return f'<line x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}"{_attrs(attrs)}/>'


def path(d: str, **attrs: object) -> str:
    """``<path d=...>``."""
    return f'<path d="{esc(d)}"{_attrs(attrs)}/>'


def document(width: float, height: float, body: Iterable[str], *, style: str = "", defs: Iterable[str] = (),
             label: str = "") -> str:
    """A complete SVG document: the ``<svg>`` root, an optional ``<title>``, ``<style>``, ``<defs>``, then ``body``
    (lines already indented by their callers; two spaces are added to each)."""
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(width)}" height="{num(height)}" '
        f'viewBox="0 0 {num(width)} {num(height)}" font-family="Helvetica, Arial, sans-serif">',
    ]
    if label:
        out.append("  " + title(label))
    if style:
        out.append("  <style>")
        out.extend("    " + s.strip() for s in style.strip().splitlines())
        out.append("  </style>")
    defs = list(defs)
    if defs:
        out.append("  <defs>")
        out.extend("    " + d for d in defs)
        out.append("  </defs>")
    out.extend("  " + b for b in body)
    out.append("</svg>")
    return "\n".join(out) + "\n"
