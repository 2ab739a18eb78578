"""``rpcompile profile``, ``models`` and ``demo``: the commands that look at models rather than plans."""

from __future__ import annotations

import argparse
import json

from rpcompile.models.registry import model_summaries
from rpcompile.planner.profiling import profile as profile_model
from rpcompile.tools.demo import run_demo
from rpcompile.views.report import cost_label, host_table, models_table, print_table, profile_table

from .common import bars, step
from .loading import dtype, load

__all__ = ["profile_command", "models_command", "demo_command"]


def profile_command(args: argparse.Namespace) -> int:
    ms = load(args)
    prof = profile_model(ms.model, ms.example_inputs, spec=args.spec, device=args.device, dtype=dtype(args.precision),
                         depth=args.depth, progress=bars(args), probe_host=args.probe_host, cache=args.cache)
    if args.json:
        print(json.dumps(prof.to_dict(nodes=args.nodes)))
    else:
        source = cost_label(prof.cost_model)
        print_table(profile_table(prof, nodes=args.nodes, title=f"{args.model}: cost table ({source}, traced with {prof.trace})"))
        if prof.host is not None:
            print_table(host_table(prof.host, title="host, measured by rpcompile probe"))
    return 0


def models_command(args: argparse.Namespace) -> int:
    with step(args, "counting parameters on the meta device"):
        rows = model_summaries()
    print_table(models_table(rows))
    return 0


def demo_command(args: argparse.Namespace) -> int:
    return run_demo(args.model)
