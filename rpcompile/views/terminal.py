"""Text for the terminal: tables that show what they are given as written.

Names in a plan or a cache file reach the CLI's tables. Rich reads a plain string as markup (``[bold]`` styles the
rest, brackets vanish) and emoji codes, and passes control characters (ESC, CSI, OSC, C1) to the terminal.
:func:`term` turns text into a :class:`~rich.text.Text` — never read as markup or emoji — with its control
characters as escapes (:func:`~rpcompile.core.text.printable`); :class:`SafeTable` applies it to every string
cell, title and caption, so a table cannot forget one.
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from ..core.text import printable

__all__ = ["term", "SafeTable"]


def term(value: object) -> Text:
    """``value`` as text for a rich console, shown as written: control characters as escapes
    (:func:`~rpcompile.core.text.printable`), and a :class:`~rich.text.Text`, which rich never reads as markup
    (``[bold]``) or emoji codes (``:smile:``) — stronger than ``rich.markup.escape``."""
    return Text(printable(value))


class SafeTable(Table):
    """A rich :class:`~rich.table.Table` that shows the text it is given as written (:func:`term` on every string
    cell, title and caption): names from a plan or cache file neither style the table nor reach the terminal as
    escape sequences."""

    # Table's own __init__ sets title and caption by assignment too: this catches them there and after
    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, term(value) if name in ("title", "caption") and isinstance(value, str) else value)

    def add_row(self, *renderables: RenderableType | None, **kw: Any) -> None:
        super().add_row(*(term(r) if isinstance(r, str) else r for r in renderables), **kw)
