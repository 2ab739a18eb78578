"""Numbers as people write them — a parameter count with k/M/B/T (``8.03B``, ``217.7k``), bytes (``1.50 KiB``), times
(``38.6 ms``) — written once here for the views and for the one-line messages of every layer below them."""

from __future__ import annotations

__all__ = ["fmt_params", "fmt_bytes", "fmt_time", "fmt_ms", "fmt_count"]


def fmt_params(n: float) -> str:
    """A parameter count as people write it: ``8.03B``, ``46.2k``, ``217.7k``, ``64``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            # from 100 on, one decimal (217.7k) where .3g would round to a whole number (218k)
            return f"{n / scale:.3g}{unit}" if n / scale < 100 else f"{n / scale:.1f}{unit}"
    return f"{int(n)}"


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB``: the unit that keeps the number readable."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_time(s: float) -> str:
    """Seconds in the unit that keeps the number readable: ``1.250 s``, ``38.600 ms``, ``12.0 µs``."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_ms(s: float) -> str:
    """Seconds in milliseconds with about three significant digits: ``2,621 ms``, ``38.6 ms``, ``5.76 ms``,
    ``0.978 ms`` (below a microsecond: ``0 ms``)."""
    v = s * 1e3
    digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2 if abs(v) >= 1 else 3
    text = f"{v:,.{digits}f}"
    # a value that rounds to nothing is written 0, not 0.000 (nor -0.000)
    return f"{'0' if float(text.replace(',', '')) == 0 else text} ms"


def fmt_count(n: float) -> str:
    """A count (FLOPs) with k/M/G/T: ``1.23G``."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{int(n)}"
