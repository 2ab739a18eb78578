"""Numbers as people write them: a parameter count with k/M/B/T (``8.03B``, ``217.7k``), for the views and for
the one-line messages of the layers below them (host memory), which must not import a view to say a number."""

from __future__ import annotations

__all__ = ["fmt_params"]


def fmt_params(n: float) -> str:
    """A parameter count as people write it: ``8.03B``, ``46.2k``, ``217.7k``, ``64``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}" if n / scale < 100 else f"{n / scale:.1f}{unit}"
    return f"{int(n)}"
