"""Rendering for people: unit formatting and rich tables for the CLI."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.table import Table

from .profiling import CostRow, Profile

__all__ = ["fmt_bytes", "fmt_time", "fmt_count", "profile_table", "print_table"]


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{int(n)}"


def _row(r: CostRow) -> list[str]:
    return [
        r.name, fmt_count(r.params), fmt_bytes(r.param_bytes), fmt_count(r.fwd_flops),
        fmt_time(r.fwd_time_s), fmt_time(r.bwd_time_s), fmt_bytes(r.activation_bytes), str(r.nodes),
    ]


def profile_table(prof: Profile, *, nodes: bool = False, title: str = "") -> Table:
    """The cost table: one row per module (or per node), then the total."""
    table = Table(title=title or f"cost table ({prof.cost_model}, traced with {prof.trace})", show_footer=False)
    for col, justify in (("module" if not nodes else "node", "left"), ("params", "right"), ("param bytes", "right"),
                         ("fwd FLOPs", "right"), ("fwd time", "right"), ("bwd time", "right"),
                         ("activations", "right"), ("nodes", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    rows: Sequence[CostRow] = prof.nodes if nodes else prof.modules
    for r in rows:
        table.add_row(*_row(r))
    table.add_section()
    table.add_row(*_row(prof.total), style="bold")
    return table


def print_table(table: Table, console: Console | None = None) -> None:
    (console or Console(width=max(Console().width, 120))).print(table)
