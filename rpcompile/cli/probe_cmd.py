"""``rpcompile probe``: measure this host (:mod:`rpcompile.planner.probe`) and print or save what it found."""

from __future__ import annotations

import argparse
import json

from rpcompile.core.files import write_atomic
from rpcompile.planner.probe import probe_host
from rpcompile.views.report import host_table, print_table

from .common import step, writable

__all__ = ["probe_command"]


def probe_command(args: argparse.Namespace) -> int:
    if args.output:
        writable(args.output, "-o")
    with step(args, "probing the host"):
        host = probe_host()
    if args.output:
        write_atomic(args.output, json.dumps({"host": host.to_dict()}, indent=1) + "\n")
    if args.json:
        print(json.dumps(host.to_dict()))
        return 0
    print_table(host_table(host, title="host, measured by rpcompile probe"))
    if args.output:
        print(f"host written to {args.output} (rpcompile plan ... --host {args.output})")
    return 0
