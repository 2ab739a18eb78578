"""Rendering for people: unit formatting and rich tables for the CLI."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.table import Table

from rpcompile.passes.validate import format_bytes as fmt_bytes

from .profiling import CostRow, Profile

__all__ = ["fmt_bytes", "fmt_time", "fmt_count", "profile_table", "plan_table", "compare_table", "stage_range", "print_table",
           "simulate_table", "devices_table"]


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


def stage_range(stage) -> str:
    """A stage's node range in module terms: ``layers.3.attn → layers.5.mlp``."""
    mods = stage.modules
    if not mods:
        return f"{stage.nodes[0]} → {stage.nodes[-1]}" if stage.nodes else "(empty)"
    return mods[0] if len(mods) == 1 else f"{mods[0]} → {mods[-1]}"


def plan_table(plan, *, title: str = "") -> Table:
    """One row per stage in execution order: device, kind, range, time, memory, saved/recomputed."""
    table = Table(title=title or f"plan: {plan.strategy}, {len(plan.stages)} stages on {plan.hardware.device_count} × {plan.hardware.spec.name}, {plan.microbatches} microbatches")
    for col, justify in (("stage", "left"), ("dev", "right"), ("kind", "left"), ("modules", "left"), ("nodes", "right"),
                         ("time/mb", "right"), ("memory", "right"), ("activations", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for k, s in enumerate(plan.stages):
        if s.kind == "forward":
            act = f"saves {len(s.saved)} node(s)" if s.saved else "stage input only"
        elif s.kind == "backward":
            act = f"recomputes {len(s.recomputed)}, uploads {len(s.saved)}" if s.saved else f"recomputes all {len(s.nodes)}"
        else:
            act = "forward+loss+backward, nothing recomputed"
        table.add_row(s.name, str(plan.device_of(k)), s.kind, stage_range(s), str(len(s.nodes)), fmt_time(s.time_s),
                      fmt_bytes(s.memory_bytes), act)
    p = plan.predicted
    table.caption = (f"iteration {fmt_time(p.iteration_time_s)}, bubble {p.bubble_fraction:.1%}, peak memory "
                     f"{fmt_bytes(p.peak_memory_bytes)} of {fmt_bytes(plan.hardware.memory_bytes)}"
                     + (f"; solver: proven bound {fmt_time(p.bound_s)} on stages × slowest stage, gap "
                        f"{float(plan.stats.get('gap', 0.0)):.1%}" if p.bound_s else "")
                     + (f"; on the host: {', '.join(plan.host)} (embedding lookups)" if plan.host else ""))
    return table


def compare_table(rows: dict, *, reference: str = "ilp") -> Table:
    """Strategies side by side: ``rows`` maps name -> (PartitionResult, Plan | None)."""
    table = Table(title="strategies under the same timing model")
    for col in ("strategy", "feasible", "F/B stages", "iteration", f"vs {reference}", "bubble", "recompute", "peak memory", "solve"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    ref = rows.get(reference, (None, None))[1]
    for name, (result, plan) in rows.items():
        if plan is None:
            table.add_row(name, "no", "-", "-", "-", "-", "-", "-", fmt_time(result.solve_time_s))
            continue
        p = plan.predicted
        ratio = f"{p.iteration_time_s / ref.predicted.iteration_time_s:.3f}×" if ref else "-"
        n_bwd = sum(len(s.nodes) for s in plan.backward_stages)
        recompute = f"{len(plan.recomputed) / n_bwd:.0%}" if n_bwd else "-"
        table.add_row(name, "yes", f"{len(plan.forward_stages)}/{len(plan.backward_stages)}", fmt_time(p.iteration_time_s),
                      ratio, f"{p.bubble_fraction:.1%}", recompute, fmt_bytes(p.peak_memory_bytes), fmt_time(result.solve_time_s))
    return table


def simulate_table(results: dict, scenarios: dict, *, title: str = "") -> Table:
    """One row per simulated schedule: time, bubble, throughput, memory, and whether it fits."""
    t = Table(title=title)
    for col in ("schedule", "stages", "iteration", "bubble", "fill / drain / waits", "tokens/s", "peak memory",
                "fits", "vs ilp"):
        t.add_column(col, justify="left" if col == "schedule" else "right")
    ref = results.get("ilp")
    for name, r in results.items():
        limit = r.memory_limit_bytes
        fits = "—" if limit is None else ("yes" if r.fits else f"no (> {fmt_bytes(limit)})")
        ratio = f"{r.iteration_time_s / ref.iteration_time_s:.2f}×" if ref and ref.iteration_time_s else ""
        sc = scenarios.get(name)
        memory = max(r.peak_memory_bytes, default=0)
        idle = r.idle_fractions
        t.add_row(name, str(sc.stage_count if sc else len(r.stage_names)), fmt_time(r.iteration_time_s), f"{r.bubble_fraction:.1%}",
                  " / ".join(f"{idle[k]:.1%}" for k in ("fill", "drain", "waits")),
                  fmt_count(r.tokens_per_s) if r.tokens_per_iteration else "—",
                  fmt_bytes(memory) if memory else "—", fits, ratio)
    return t


def devices_table(result, *, title: str = "") -> Table:
    """Per device of one simulated schedule: compute utilisation, bytes through its links, the most saved
    activations waiting to go down (lazy offload), peak memory."""
    t = Table(title=title)
    for col in ("device", "busy", "utilisation", "fill", "drain", "waits", "uploaded", "downloaded",
                "offload backlog", "peak memory"):
        t.add_column(col, justify="right")
    idle = result.idle_s()
    for d, (busy, util) in enumerate(zip(result.busy_s, result.utilisation)):
        peak = result.peak_memory_bytes[d] if d < len(result.peak_memory_bytes) else 0
        moved = [fmt_bytes(int(x[d])) if d < len(x) else "—" for x in (result.uploaded_bytes, result.downloaded_bytes)]
        backlog = result.offload_backlog_bytes[d] if d < len(result.offload_backlog_bytes) else 0
        t.add_row(str(d), fmt_time(busy), f"{util:.1%}", *(fmt_time(idle[d][k]) for k in ("fill", "drain", "waits")),
                  *moved, fmt_bytes(backlog) if backlog else "—", fmt_bytes(peak) if peak else "—")
    return t
