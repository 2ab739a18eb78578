"""The ``rpcompile`` command line: ``profile`` (cost table of a model), ``demo`` (the main job).

MODEL is a built-in name (``rpcompile profile --list``) or ``path/to/file.py:factory`` where ``factory()``
returns ``(model, example_inputs)``. Every error rpcompile anticipates prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name or path/to/file.py:factory")
    p.add_argument("--batch-size", type=int, default=None, help="override the model's example batch size")
    p.add_argument("--seq-len", type=int, default=None, help="override the example sequence length (decoders)")
    p.add_argument("--model-device", default=None, help="build the model on this device (default: the model's own)")
    cost = p.add_mutually_exclusive_group()
    cost.add_argument("--spec", default=None, help="analytic costs for this GPU spec (rtx4090, a100-80g, h100-sxm, h200, cpu, ...)")
    cost.add_argument("--device", default=None, help="measured costs on this device (cpu, cuda:0, ...)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="cost compute in this precision")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rpcompile", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log pass timings")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="cost table of a model, rolled up per module")
    _add_model_args(p)
    p.add_argument("--nodes", action="store_true", help="one row per graph node instead of per module")
    p.add_argument("--depth", type=int, default=None, help="module depth of the roll-up (default: keep layer indices)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("plan", help="partition a model into round-robin stages and compare with the baselines")
    _add_model_args(p)
    p.add_argument("--gpus", type=int, required=True, help="number of devices")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per iteration (default gpus + 1)")
    p.add_argument("--memory-limit", type=_parse_bytes, default=None, help="usable memory per device, e.g. 20GiB (default: the spec's)")
    p.add_argument("--strategy", choices=("ilp", "dp", "roundpipe", "uniform"), default="ilp")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16", help="compute/upload precision (default bf16)")
    p.add_argument("--time-limit", type=float, default=10.0, help="solver time limit in seconds")
    p.add_argument("--max-segments", type=int, default=None, help="coarsening target (default ~2 per layer)")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--emit", default=None, metavar="DIR", help="write each stage's generated Python into DIR")
    p.add_argument("--compare", action="store_true", help="(with --json) report every strategy")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("demo", help="the main job: compile a built-in model and show what rpcompile does")
    p.add_argument("--model", default="llama-demo", help="built-in model (default llama-demo)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("models", help="list the built-in models")
    p.set_defaults(func=_cmd_models)
    return parser


def _dtype(name: str | None):
    import torch

    return {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _load(args: argparse.Namespace):
    from rpcompile.models import load_model

    kw = {k: v for k, v in (("batch_size", args.batch_size), ("seq_len", args.seq_len), ("device", args.model_device)) if v is not None}
    return load_model(args.model, **kw)


def _cmd_profile(args: argparse.Namespace) -> int:
    from rpcompile.profiling import profile
    from rpcompile.report import print_table, profile_table

    ms = _load(args)
    prof = profile(ms.model, ms.example_inputs, spec=args.spec, device=args.device, dtype=_dtype(args.dtype),
                   depth=args.depth, progress=None if not args.json else False)
    if args.json:
        print(json.dumps(prof.to_dict(nodes=args.nodes)))
    else:
        print_table(profile_table(prof, nodes=args.nodes, title=f"{args.model}: cost table ({prof.cost_model}, traced with {prof.trace})"))
    return 0


def _parse_bytes(text: str) -> int:
    import re

    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 20GiB, 24GB, 1073741824)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def _strategy_json(result, plan) -> dict:
    d = {"feasible": bool(result.feasible), "solve_time_s": result.solve_time_s}
    if plan is None:
        return d | {"iteration_time_s": None, "bound_s": None}
    p = plan.predicted
    n_bwd = sum(len(s.nodes) for s in plan.backward_stages)
    return d | {
        "iteration_time_s": p.iteration_time_s,
        "bound_s": p.bound_s or None,
        "bubble_fraction": p.bubble_fraction,
        "peak_memory_bytes": p.peak_memory_bytes,
        "forward_stages": len(plan.forward_stages),
        "backward_stages": len(plan.backward_stages),
        "recompute_fraction": len(plan.recomputed) / n_bwd if n_bwd else 0.0,
    }


def _cmd_plan(args: argparse.Namespace) -> int:
    from rpcompile.planning import compare, default_spec, make_hardware, prepare
    from rpcompile.report import compare_table, plan_table, print_table

    ms = _load(args)
    gm, m = prepare(ms.model, ms.example_inputs, gpus=args.gpus, spec=args.spec, device=args.device,
                    microbatches=args.microbatches, precision=args.precision, max_segments=args.max_segments,
                    progress=False if args.json else None)
    model_device = next((p.device.type for p in ms.model.parameters()), "cpu")
    hardware = make_hardware(args.gpus, default_spec(args.spec, args.device, model_device), args.memory_limit)
    rows = compare(gm, hardware=hardware, microbatches=m, precision=args.precision, time_limit_s=args.time_limit)
    result, chosen = rows[args.strategy]
    if chosen is None:
        from rpcompile.planning import _infeasible, partition_problem

        raise _infeasible(partition_problem(gm, hardware=hardware, microbatches=m, precision=args.precision), hardware)
    if args.output:
        chosen.save(args.output)
    if args.emit:
        from rpcompile.runtime.codegen import write_stages
        from rpcompile.runtime.split import split_plan

        write_stages(split_plan(chosen, gm), chosen, args.emit)
    if args.json:
        out = {"strategies": {k: _strategy_json(r, p) for k, r_p in rows.items() for r, p in [r_p]}} if args.compare else chosen.to_dict()
        print(json.dumps(out))
        return 0
    print_table(plan_table(chosen, title=f"{args.model}: {args.strategy} plan, {len(chosen.stages)} stages on {args.gpus} × {hardware.spec.name}, {m} microbatches"))
    print_table(compare_table(rows, reference=args.strategy))
    if args.output:
        print(f"plan written to {args.output}")
    if args.emit:
        print(f"stage code written to {args.emit}/")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from rpcompile.models import list_models

    for name in list_models():
        print(name)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rpcompile.demo import run_demo

    return run_demo(args.model)


def main(argv: Sequence[str] | None = None) -> int:
    from rpcompile.errors import RPCompileError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except RPCompileError as e:
        print(f"rpcompile: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rpcompile: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
