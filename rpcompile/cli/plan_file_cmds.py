"""``rpcompile check``, ``diff`` and ``show``: the commands that read plan files."""

from __future__ import annotations

import argparse
import json

from rpcompile.core.errors import PlanFileError
from rpcompile.core.plan import Plan
from rpcompile.planner.planning import graph_as_planned
from rpcompile.tools.plandiff import diff_plans
from rpcompile.tools.staleness import check_plan
from rpcompile.views.graphview import write_graph
from rpcompile.views.report import plan_table, print_table

from .common import bars, say, step, stepper
from .loading import load_for

__all__ = ["check_command", "diff_command", "show_command"]


def check_command(args: argparse.Namespace) -> int:
    try:
        microbatches = Plan.load(args.plan).microbatches
    except PlanFileError:
        microbatches = 1  # check_plan reports the file
    # the example batch must split into the plan's microbatches
    ms = load_for(args, microbatches)
    res = check_plan(args.plan, ms.model, ms.example_inputs, max_regression=args.max_regression,
                     time_limit_s=args.time_limit, loss_fn=ms.loss_fn, example_target=ms.example_target,
                     progress=bars(args), status=stepper(args), resolve=args.resolve)
    if args.json:
        print(json.dumps(res.to_dict()))
    else:
        say(*(f"{args.plan}: {line}" for line in res.problems), res.summary())
    return 0 if res.ok else 1


def diff_command(args: argparse.Namespace) -> int:
    d = diff_plans(Plan.load(args.a), Plan.load(args.b), a_name=args.a, b_name=args.b)
    if args.json:
        print(json.dumps(d.to_dict()))
    else:
        say(*d.lines())
    # as diff(1): exit 1 when the plans differ, so CI can fail on a changed plan
    return 1 if d.changed else 0


def show_command(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    hw = plan.hardware
    print_table(plan_table(plan, title=f"{args.plan}: {plan.strategy} plan, {len(plan.stages)} stages on "
                                       f"{hw.device_count} × {hw.spec.name}, {plan.microbatches} microbatches"))
    if args.graph:
        graph = None
        if args.graph_model:
            # show has no batch or sequence options: load_for reads them from args, so they are set here
            args.model, args.batch_size, args.seq_len, args.model_device = args.graph_model, None, None, None
            ms = load_for(args, plan.microbatches)
            with step(args, f"tracing {args.graph_model}"):
                graph = graph_as_planned(plan, ms.model, ms.example_inputs, loss_fn=ms.loss_fn, source=args.plan)
        write_graph(args.graph, plan, graph, depth=args.depth)
        print(f"graph written to {args.graph}")
    return 0
