"""``rpcompile simulate``: schedules on one clock, from a plan file, a model or a RoundPipe layer profile."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rpcompile.core.errors import ConfigError, RPCompileError
from rpcompile.core.plan import Plan
from rpcompile.planner.plan_options import PlanOptions
from rpcompile.tools.simulation import (model_scenarios, parse_schedules, plan_scenarios, profile_scenarios, run_all,
                                        scaling, skipped)
from rpcompile.views.gantt import write_timeline_svg
from rpcompile.views.report import devices_table, host_line, print_table, scaling_table, simulate_table

from .common import bars, default_microbatches, say, step, stepper, writable
from .loading import load_for

__all__ = ["simulate_command"]


def simulate_command(args: argparse.Namespace) -> int:
    host = args.host_bandwidth or math.inf
    if args.timeline:
        writable(args.timeline, "--timeline")
    schedules = parse_schedules(args.schedules or "all")  # an unknown name: ConfigError, one line
    if (args.nodes is None) != (args.network is None):
        raise ConfigError("--nodes and --network go together: e.g. --nodes 1,2,4,8 --network 25Gb/s,100Gb/s")
    title, scenarios, left_out, m = _scenarios(args, schedules, host)
    with step(args, f"simulating {', '.join(scenarios)}"):
        results = run_all(scenarios)
    scaled = _scaling(args, scenarios)
    if args.timeline:
        _write_timelines(args.timeline, results, title)
    if args.json:
        out = {name: r.summary() | {"stages": scenarios[name].stage_count}
               | {k: v for k, v in scenarios[name].notes.items() if k == "head_chunks"} for name, r in results.items()}
        extra = ({"microbatches": m} if m else {}) | ({"skipped": left_out} if left_out else {}) \
            | ({"scaling": scaled} if scaled else {})
        # allow_nan=False: NaN or infinity is not JSON; a figure like that fails here rather than in the reader
        print(json.dumps({"schedules": out} | extra, allow_nan=False))
        return 0
    print_table(simulate_table(results, scenarios, title=title))
    for name, r in results.items():
        if host_line(name, r):
            print(host_line(name, r))
    for name, why in left_out.items():
        say(f"{name}: not simulated: {why}")
    if len(results) == 1:
        (name, only), = results.items()
        print_table(devices_table(only, title=f"{name}: per device (simulated)"))
    for name, rows in scaled.items():
        print_table(scaling_table(rows, title=f"{name}: data-parallel scaling (simulated)"))
    if args.timeline:
        print(f"timeline written to {args.timeline}" if len(results) == 1 else f"timelines written next to {args.timeline}")
    return 0


def _scaling(args: argparse.Namespace, scenarios: dict) -> dict[str, list[dict]]:
    """``--nodes``: the scaling report of every round-robin schedule (the static ones keep their gradients on
    the devices; they are left out)."""
    if args.nodes is None:
        return {}
    with step(args, f"simulating {', '.join(map(str, args.nodes))} nodes"):
        return {name: scaling(sc, args.nodes, args.network) for name, sc in scenarios.items()
                # G actions send gradients home: only round-robin schedules have them (static ones keep theirs on
                # the devices)
                if any(a.kind == "G" for acts in sc.lists for a in acts)}


def _scenarios(args: argparse.Namespace, schedules: list[str], host: float) -> tuple[str, dict, dict[str, str], int]:
    """What ``simulate`` runs: (title, {name: Scenario}, {requested schedule left out: why}, microbatches or 0
    when the layer profile says)."""
    if args.layer_profile:
        if not args.profile_model:
            raise ConfigError("--layer-profile needs --model NAME (which model of the file to simulate)")
        try:
            scenarios = profile_scenarios(args.layer_profile, args.profile_model, schedules=schedules, gpus=args.gpus,
                                          microbatches=args.microbatches, time_limit_s=args.time_limit,
                                          overlap=args.overlap)
        except ValueError as e:
            raise RPCompileError(f"{args.layer_profile}: {e}") from None
        return f"{args.profile_model} from {Path(args.layer_profile).name}", scenarios, {}, args.microbatches or 0
    if args.target is None:
        raise ConfigError("say what to simulate: a plan .json file, a MODEL with --gpus N, or --layer-profile FILE --model NAME")
    if args.target.endswith(".json"):
        plan = Plan.load(args.target)
        hw = plan.hardware
        title = f"{args.target}: {plan.strategy} plan, {len(plan.stages)} stages on {hw.device_count} × {hw.spec.name}"
        return title, plan_scenarios(plan, host_bytes_per_s=host, overlap=args.overlap), {}, plan.microbatches
    if args.gpus is None:
        raise ConfigError(f"simulating model {args.target} needs --gpus N")
    return _model_scenarios(args, schedules, host)


def _model_scenarios(args: argparse.Namespace, schedules: list[str], host: float) -> tuple[str, dict, dict[str, str], int]:
    """The MODEL form of :func:`_scenarios`: trace, cost and plan the model for each schedule."""
    m = args.microbatches or default_microbatches(args.gpus)
    # load_for reads the model from args.model; simulate's positional argument is args.target
    args.model = args.target
    ms = load_for(args, m)
    title = f"{args.target} on {args.gpus} × {args.spec or args.device or 'default spec'}, {m} microbatches"
    try:
        options = PlanOptions(gpus=args.gpus, spec=args.spec, device=args.device, microbatches=m,
                              memory_limit=args.memory_limit, precision=args.precision, time_limit_s=args.time_limit,
                              progress=bars(args), head_chunks=args.head_chunks,
                              segments_per_layer=args.segments_per_layer, host_embedding=args.host_embedding,
                              overlap=args.overlap)
        scenarios = model_scenarios(ms.model, ms.example_inputs, options=options, schedules=schedules,
                                    chunks=args.chunks, host_bytes_per_s=host, status=stepper(args),
                                    loss_fn=ms.loss_fn, example_target=ms.example_target)
    except ValueError as e:  # e.g. more stages than layers (scenarios.py still raises it bare): one line
        raise RPCompileError(str(e)) from None
    return title, scenarios, skipped(schedules, scenarios, gpus=args.gpus, microbatches=m, chunks=args.chunks), m


def _write_timelines(path: str, results: dict[str, Any], title: str) -> None:
    target = Path(path)
    for name, r in results.items():
        # several schedules: one file each, named after the schedule, next to the path given
        out = target if len(results) == 1 else target.with_name(f"{target.stem}-{name}{target.suffix or '.svg'}")
        write_timeline_svg(out, r.timeline, devices=len(r.busy_s), stage_names=list(r.stage_names),
                           title=f"{title} — {name}: {r.iteration_time_s * 1e3:.1f} ms, bubble {r.bubble_fraction:.1%}")
