"""Text from files, made safe to show.

Names and notes in a plan, a cache or a profile come from files that pull requests and CI artefacts carry. Shown
as they are, a line break ends a comment in generated code, an escape sequence (ESC, CSI, OSC, the C1 controls)
drives the reader's terminal, and a bidirectional override reorders what people read. :func:`printable` writes
every such character as its Python escape (``\\x1b``, ``\\u2028``) so that the text stays one visible line; the
views add their own escaping on top (rich markup, XML, DOT).
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(value: object, *, limit: int | None = None) -> str:
    """``str(value)`` with every character that is not printable (control, format, line and paragraph separator,
    surrogate, private-use, unassigned, and spaces other than ``" "``) written as its escape; cut to ``limit``
    characters (with ``…``) when given. The result is one line that no terminal or parser acts on."""
    text = str(value)
    if limit is not None and len(text) > limit:
        # limit − 1 characters and the ellipsis: limit in all
        text = text[: max(limit - 1, 0)] + "…"
    if text.isprintable():
        return text
    # unicode_escape writes the character as \x1b, \u2028 and the like: plain ASCII
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
