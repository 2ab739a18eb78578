"""Rendering for people: unit formatting and rich tables for the CLI.

Numbers are written as people write them: parameter counts with k/M/B/T (``8.03B``), and every time in a table
in one unit — milliseconds (``2,621 ms``, ``38.6 ms``, ``0.978 ms``) — so a column can be read down. Figures from
the timing model or the simulator are labelled *predicted* / *simulated*; measured ones say so."""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console, JustifyMethod
from rich.table import Table

from rpcompile.core.profile import CostRow, Profile
from rpcompile.core.specs import HostSpec
from rpcompile.core.units import fmt_bytes, fmt_count, fmt_ms, fmt_params, fmt_time

from .terminal import SafeTable


__all__ = ["scaling_table", "models_table", "bound_note", "host_note", "host_line", "cost_label", "profile_table",
           "plan_table", "compare_table", "stage_range", "print_table", "simulate_table", "devices_table", "host_table"]








def _row(r: CostRow) -> list[str]:
    return [
        r.name, fmt_params(r.params), fmt_bytes(r.param_bytes), fmt_count(r.fwd_flops),
        fmt_ms(r.fwd_time_s), fmt_ms(r.bwd_time_s), fmt_bytes(r.activation_bytes), str(r.nodes),
    ]


def cost_label(cost_model: str) -> str:
    """Where a cost table's times come from, said plainly: ``analytic:rtx4090`` is a prediction for that GPU,
    ``measured`` was timed on this machine."""
    if cost_model.startswith("analytic:"):
        return f"predicted: analytic costs for {cost_model.split(':', 1)[1]}"
    return "measured on this machine" if cost_model.startswith("measured") else cost_model


def _add_columns(table: Table, columns: Sequence[tuple[str, JustifyMethod]]) -> None:
    for name, justify in columns:
        table.add_column(name, justify=justify)


def models_table(summaries: Sequence[Any]) -> Table:
    """``rpcompile models``: one row per built-in model (:class:`rpcompile.models.registry.ModelSummary`)."""
    table = SafeTable(title="built-in models (rpcompile profile|plan|simulate NAME)")
    _add_columns(table, (("model", "left"), ("params", "right"), ("layers", "right"), ("runs", "left"),
                         ("shape", "left")))
    for m in summaries:
        runs = "trains here (cpu)" if m.device != "meta" else "meta only: profile, plan, simulate"
        table.add_row(m.name, fmt_params(m.params), str(m.layers), runs, m.description.split(": ", 1)[-1])
    return table


def profile_table(prof: Profile, *, nodes: bool = False, title: str = "") -> Table:
    """The cost table: one row per module (or per node), then the total."""
    table = SafeTable(title=title or f"cost table ({prof.cost_model}, traced with {prof.trace})", show_footer=False)
    _add_columns(table, (("module" if not nodes else "node", "left"), ("params", "right"), ("param bytes", "right"),
                         ("fwd FLOPs", "right"), ("fwd time", "right"), ("bwd time", "right"),
                         ("activations", "right"), ("nodes", "right")))
    rows: Sequence[CostRow] = prof.nodes if nodes else prof.modules
    for r in rows:
        table.add_row(*_row(r))
    table.add_section()
    table.add_row(*_row(prof.total), style="bold")
    return table


def print_table(table: Table, console: Console | None = None) -> None:
    # the tables are wide: at least 120 columns even where the terminal reports fewer (or none, when piped)
    (console or Console(width=max(Console().width, 120))).print(table)


def stage_range(stage) -> str:
    """A stage's node range in module terms: ``layers.3.attn → layers.5.mlp``."""
    mods = stage.modules
    if not mods:
        # a plan without module paths for its stages: the first and last node names stand in
        return f"{stage.nodes[0]} → {stage.nodes[-1]}" if stage.nodes else "(empty)"
    return mods[0] if len(mods) == 1 else f"{mods[0]} → {mods[-1]}"


def plan_table(plan, *, title: str = "") -> Table:
    """One row per stage in execution order: device, kind, range, time, memory, saved/recomputed."""
    table = SafeTable(title=title or f"plan: {plan.strategy}, {len(plan.stages)} stages on {plan.hardware.device_count} × {plan.hardware.spec.name}, {plan.microbatches} microbatches")
    _add_columns(table, (("stage", "left"), ("dev", "right"), ("kind", "left"), ("modules", "left"), ("nodes", "right"),
                         ("time/mb", "right"), ("memory", "right"), ("activations", "left"), ("weights", "left")))
    for k, s in enumerate(plan.stages):
        if s.kind == "forward":
            act = f"saves {len(s.saved)} node(s)" if s.saved else "stage input only"
        elif s.kind == "backward":
            act = f"recomputes {len(s.recomputed)}, uploads {len(s.saved)}" if s.saved else f"recomputes all {len(s.nodes)}"
        else:
            act = "forward+loss+backward, nothing recomputed"
        table.add_row(s.name, str(plan.device_of(k)), s.kind, stage_range(s), str(len(s.nodes)), fmt_ms(s.time_s),
                      fmt_bytes(s.memory_bytes), act, stage_weights(s, plan.resident))
    p = plan.predicted
    source = f" from {plan.cost_model} costs" if plan.cost_model else ""
    table.caption = (f"predicted{source}: iteration {fmt_ms(p.iteration_time_s)}, "
                     f"bubble {p.bubble_fraction:.1%}, peak memory {fmt_bytes(p.peak_memory_bytes)} of "
                     f"{fmt_bytes(plan.hardware.memory_bytes)}"
                     + (f"; {host_note(plan)}" if plan.hardware.host is not None else "")
                     + (f"; {stays_note(plan)}" if plan.resident or any(s.keeps for s in plan.stages) else "")
                     + (f"; {sums_note(plan)}" if any(s.accumulates for s in plan.stages) else "")
                     + (f"; {bound_note(plan)}" if p.bound_s else "")
                     + (f"; on the host: {', '.join(plan.host)} (embedding lookups)" if plan.host else ""))
    return table


def stage_weights(stage: Any, resident: bool) -> str:
    """What a stage does with its weights: uploads them all, or keeps some on its device for a later stage, finds
    some there (weights that stay, :mod:`rpcompile.passes.solver.stays`); and whether it sums gradients there."""
    sums = f"; sums {len(stage.accumulates)} gradients" if stage.accumulates else ""
    if resident:
        return f"resident: {len(stage.params)} stay, {fmt_bytes(stage.weight_bytes)} refreshed{sums}"
    out = []
    if stage.finds:
        out.append(f"finds {len(stage.finds)} of {len(stage.params)} ({fmt_bytes(stage.found_bytes)})")
    if stage.keeps:
        out.append(f"keeps {len(stage.keeps)} of {len(stage.params)} ({fmt_bytes(stage.kept_bytes)})")
    up = f"uploads {fmt_bytes(stage.weight_bytes)}"
    return (", ".join(out + [up]) if out else up) + sums


def sums_note(plan: Any) -> str:
    """Which stages sum their gradients on their devices under ``pipe.no_sync()`` and what a call there spares."""
    stages = [s for s in plan.stages if s.accumulates]
    held = max(s.sum_bytes for s in plan.stages)
    return (f"gradients summed on the devices under pipe.no_sync(): {', '.join(s.name for s in stages)} "
            f"({sum(len(s.accumulates) for s in stages)} parameters, up to {fmt_bytes(held)} a device); a call "
            f"there {fmt_ms(plan.predicted.no_sync_s)}, the first outside it sends them home")


def stays_note(plan: Any) -> str:
    """Which weights stay on their devices and what that spares the link, per iteration (predicted)."""
    up = sum(s.weight_bytes for s in plan.stages)
    spared = sum(s.found_bytes for s in plan.stages)
    if plan.resident:
        return (f"resident: every weight stays on its device across iterations, uploaded once; weights up "
                f"{fmt_bytes(up)} an iteration (those the optimizer step changed), {fmt_bytes(up + spared)} without")
    keepers = [s.name for s in plan.stages if s.keeps]
    finders = [s.name for s in plan.stages if s.finds]
    return (f"weights that stay: {', '.join(keepers)} keep theirs on the device for {', '.join(finders)}; weights up "
            f"{fmt_bytes(up)} an iteration, {fmt_bytes(up + spared)} without")


def host_note(plan: Any) -> str:
    """The host's part of a plan's predicted iteration: the pipeline, then the optimizer step and copy refresh
    (added, or overlapped), and the gradient accumulation the host thread ran beside the pipeline."""
    p, host = plan.predicted, plan.hardware.host
    how = "measured" if host.source == "probe" else "assumed"
    if p.overlap_iterations:
        return (f"iterations overlapped (planned for overlap=True): {fmt_ms(p.iteration_time_s)} is the steady-state "
                f"period, one iteration alone {fmt_ms(p.pipeline_s)}; host ({how}): optimizer step "
                f"{fmt_ms(p.optimizer_s)} + copy refresh {fmt_ms(p.refresh_s)} beside the next iteration, gradient "
                f"accumulation {fmt_ms(p.accumulate_s)} on the host thread beside the stages")
    return (f"host ({how}): optimizer step {fmt_ms(p.optimizer_s)} + copy refresh {fmt_ms(p.refresh_s)} "
            "(none under rpcompile's AdamW) "
            f"{'beside' if p.overlap_step else 'after'} the {fmt_ms(p.pipeline_s)} pipeline "
            f"({'overlap=True: the longer of the two' if p.overlap_step else 'synchronous: added'}), gradient "
            f"accumulation {fmt_ms(p.accumulate_s)} on the host thread beside the stages")


def host_line(name: str, result: Any) -> str:
    """One simulated schedule's host work, or "" when it has none; for a run of overlapped iterations, its steady
    state, first iteration and one-off fill and drain too."""
    if result.iteration_ends_s:
        return (f"{name}: {result.iterations} iterations{' overlapped' if result.overlap_step else ''} (simulated): "
                f"steady-state period {fmt_ms(result.iteration_time_s)}, bubble {result.bubble_fraction:.1%}; the "
                f"first iteration {fmt_ms(result.first_iteration_s)}; once a run, fill {fmt_ms(result.fill_s)} and "
                f"drain {fmt_ms(result.drain_s)} a device; optimizer step and copy refresh {fmt_ms(result.step_s)} "
                f"{'beside the next iteration' if result.overlap_step else 'between iterations'}")
    if not result.step_s and not result.accumulate_s:
        return ""
    joined = "overlapped with the pipeline" if result.overlap_step else "after the pipeline"
    return (f"{name}: host (simulated, the step as the plan predicts it): pipeline {fmt_ms(result.pipeline_s)}, "
            f"gradient accumulation {fmt_ms(result.accumulate_s)} on the host thread beside it, optimizer step and "
            f"copy refresh {fmt_ms(result.step_s)} {joined}")


def bound_note(plan: Any) -> str:
    """The solver's proven bound, said so that nobody reads it as a bound on the iteration time: it bounds the
    ILP's own objective, stage-count factor × slowest stage (docs/architecture.md §3), which the exact iteration time of
    an unequal plan can beat."""
    gap = plan.stats.get("gap", 0.0)  # free-form stats: an infinite gap is saved as null
    # bool is an int subclass: a true/false in the stats is no gap
    gap_text = f"{gap:.1%}" if isinstance(gap, (int, float)) and not isinstance(gap, bool) else "unknown"
    return (f"ILP objective (stage factor × slowest stage) proven ≥ {fmt_ms(plan.predicted.bound_s)}, gap {gap_text} "
            "— a bound on that objective, not on the iteration time")


def compare_table(rows: dict, *, reference: str = "ilp") -> Table:
    """Strategies side by side: ``rows`` maps name -> (PartitionResult, Plan | None)."""
    table = SafeTable(title="strategies under the same timing model (predicted)")
    for col in ("strategy", "feasible", "F/B stages", "iteration", f"vs {reference}", "bubble", "recompute", "peak memory", "solve"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    # None when the reference strategy is missing or found no plan: the ratio column then reads "-"
    ref = rows.get(reference, (None, None))[1]
    for name, (result, plan) in rows.items():
        if plan is None:
            table.add_row(name, "no", "-", "-", "-", "-", "-", "-", fmt_ms(result.solve_time_s))
            continue
        p = plan.predicted
        ratio = f"{p.iteration_time_s / ref.predicted.iteration_time_s:.3f}×" if ref else "-"
        n_bwd = sum(len(s.nodes) for s in plan.backward_stages)
        # the share of the backward stages' nodes recomputed rather than uploaded from host memory
        recompute = f"{len(plan.recomputed) / n_bwd:.0%}" if n_bwd else "-"
        table.add_row(name, "yes", f"{len(plan.forward_stages)}/{len(plan.backward_stages)}", fmt_ms(p.iteration_time_s),
                      ratio, f"{p.bubble_fraction:.1%}", recompute, fmt_bytes(p.peak_memory_bytes), fmt_ms(result.solve_time_s))
    return table


def simulate_table(results: dict, scenarios: dict, *, title: str = "") -> Table:
    """One row per simulated schedule: time, bubble, throughput, memory, and whether it fits."""
    t = SafeTable(title=title, caption="simulated (the executor's schedules on a clock), not measured")
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
        t.add_row(name, str(sc.stage_count if sc else len(r.stage_names)), fmt_ms(r.iteration_time_s), f"{r.bubble_fraction:.1%}",
                  " / ".join(f"{idle[k]:.1%}" for k in ("fill", "drain", "waits")),
                  fmt_count(r.tokens_per_s) if r.tokens_per_iteration else "—",
                  fmt_bytes(memory) if memory else "—", fits, ratio)
    return t


def host_table(host: HostSpec, *, title: str = "") -> Table:
    """The host's rates, one row each (``measured`` or ``assumed``, as its ``source`` says)."""
    how = "measured" if host.source == "probe" else "assumed"
    table = SafeTable(title=title or f"host ({how})")
    table.add_column("what", justify="left")
    table.add_column("rate", justify="right")
    table.add_column("per 1e9 params", justify="right")
    table.add_row("memory copy (read + write)", f"{host.memory_bandwidth / 1e9:.1f} GB/s", "")
    for label, rate in (("fp32 → bf16 cast", host.cast_params_per_s),
                        ("bf16 → fp32 add-into", host.accumulate_params_per_s),
                        ("AdamW step", host.optimizer_params_per_s)):
        table.add_row(label, f"{rate / 1e9:.2f} G params/s", f"{1e9 / rate:.3f} s")
    for label, rate in (("pinned H2D", host.pinned_h2d), ("pinned D2H", host.pinned_d2h),
                        ("pageable H2D", host.pageable_h2d), ("pageable D2H", host.pageable_d2h)):
        table.add_row(label, f"{rate / 1e9:.1f} GB/s" if rate else "—", "")
    table.caption = host.note
    return table


def devices_table(result, *, title: str = "") -> Table:
    """Per device of one simulated schedule: compute utilisation, bytes through its links, the most saved
    activations waiting to go down (lazy offload), peak memory."""
    t = SafeTable(title=title)
    for col in ("device", "busy", "utilisation", "fill", "drain", "waits", "uploaded", "downloaded",
                "offload backlog", "peak memory"):
        t.add_column(col, justify="right")
    idle = result.idle_s()
    for d, (busy, util) in enumerate(zip(result.busy_s, result.utilisation)):
        peak = result.peak_memory_bytes[d] if d < len(result.peak_memory_bytes) else 0
        moved = [fmt_bytes(int(x[d])) if d < len(x) else "—" for x in (result.uploaded_bytes, result.downloaded_bytes)]
        backlog = result.offload_backlog_bytes[d] if d < len(result.offload_backlog_bytes) else 0
        t.add_row(str(d), fmt_ms(busy), f"{util:.1%}", *(fmt_ms(idle[d][k]) for k in ("fill", "drain", "waits")),
                  *moved, fmt_bytes(backlog) if backlog else "—", fmt_bytes(peak) if peak else "—")
    return t


def scaling_table(rows: Sequence[dict], *, title: str = "") -> Table:
    """Data-parallel scaling (:func:`rpcompile.tools.simulation.scaling`): one row per machine count, network and
    whether the gradient all-reduce overlaps the later stages."""
    t = SafeTable(title=title, caption="simulated: every machine runs the pipeline on its own batch; the all-reduce is "
                  "a ring over each machine's network link, not measured")
    for col in ("nodes", "network", "all-reduce", "iteration", "tokens/s (all nodes)", "efficiency", "reduce",
                "of it exposed"):
        t.add_column(col, justify="right")
    for r in rows:
        # networks are quoted in bits per second, links elsewhere in bytes
        t.add_row(str(r["nodes"]), f"{r['network_bytes_per_s'] * 8 / 1e9:g} Gb/s",
                  "—" if r["nodes"] == 1 else ("overlapped" if r["overlap"] else "after"),
                  fmt_ms(r["iteration_time_s"]), fmt_count(r["tokens_per_s"]) if r["tokens_per_s"] else "—",
                  f"{r['efficiency']:.1%}", fmt_ms(r["reduce_s"]) if r["reduce_s"] else "—",
                  fmt_ms(r["reduce_exposed_s"]) if r["reduce_s"] else "—")
    return t
