"""The ``rpcompile`` command line: ``profile`` (cost table of a model), ``plan``, ``simulate``, ``demo`` (the main job).

MODEL is a built-in name (``rpcompile models``) or ``path/to/file.py:factory`` where ``factory()``
returns ``(model, example_inputs)``. Every error rpcompile anticipates — a bad argument included — prints one line
that says what to do and exits 2. Steps that take more than a moment show a progress line on a terminal (never
under ``--json``, nor when stderr is not a terminal, as in CI).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator, Sequence

from rpcompile import __version__
from rpcompile.core.specs import SPECS

__all__ = ["main", "build_parser", "DEFAULT_MICROBATCHES"]

DEFAULT_MICROBATCHES = "gpus + 1 (1 on one device), as rpcompile.compile"
"""What ``--microbatches`` defaults to in ``plan`` and ``simulate`` (DESIGN.md §3: the fewest without a bubble
between stages); planning.prepare applies it."""


_SPEC_NAMES = ", ".join(SPECS)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``rpcompile plan: error: ...; see rpcompile plan --help`` (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name or path/to/file.py:factory")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="override the model's example batch size")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="override the example sequence length (decoders)")
    p.add_argument("--model-device", type=_device, default=None, help="build the model on this device (default: the model's own)")
    cost = p.add_mutually_exclusive_group()
    cost.add_argument("--spec", type=_spec, default=None, help=f"analytic costs for this GPU spec ({_SPEC_NAMES})")
    cost.add_argument("--device", type=_device, default=None, help="measured costs on this device (cpu, cuda:0, ...)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="cost compute in this precision")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rpcompile", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log pass timings")
    parser.add_argument("--version", action="version", version=f"rpcompile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="cost table of a model, rolled up per module")
    _add_model_args(p)
    p.add_argument("--nodes", action="store_true", help="one row per graph node instead of per module")
    p.add_argument("--depth", type=int, default=None, help="module depth of the roll-up (default: keep layer indices)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("plan", help="partition a model into round-robin stages and compare with the baselines")
    _add_model_args(p)
    p.add_argument("--gpus", type=_positive_int, required=True, help="number of devices")
    p.add_argument("--microbatches", type=_positive_int, default=None,
                   help=f"microbatches per iteration (default {DEFAULT_MICROBATCHES})")
    p.add_argument("--memory-limit", type=_parse_bytes, default=None, help="usable memory per device, e.g. 20GiB (default: the spec's)")
    p.add_argument("--strategy", choices=("ilp", "dp", "roundpipe", "uniform"), default="ilp")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16", help="compute/upload precision (default bf16)")
    p.add_argument("--time-limit", type=_positive_float, default=10.0, help="solver time limit in seconds (default 10)")
    p.add_argument("--max-segments", type=int, default=None, help="coarsening target (default ~2 per layer)")
    p.add_argument("--segments-per-layer", type=_positive_int, default=2, metavar="K",
                   help="segments per transformer block (default 2; 4 lets the planner save parts of a half-block: "
                        "faster plans, 2-3x the solve time)")
    p.add_argument("--head-chunks", type=_head_chunks, default="auto", metavar="K",
                   help="put the loss in the graph and split the LM head into K sequence chunks; 1: never split; "
                        "auto (default): plan the whole head and 8 chunks, keep the faster")
    p.add_argument("--no-host-embedding", dest="host_embedding", action="store_false",
                   help="keep token embeddings on the devices (default: the host looks up the rows of tables larger "
                        "than what an iteration reads)")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--emit", default=None, metavar="DIR", help="write each stage's generated Python into DIR")
    p.add_argument("--compare", action="store_true", help="(with --json) report every strategy")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("simulate", help="simulate schedules on one clock: a plan file, a model, or a layer profile",
                       description="rpcompile simulate plan.json | MODEL --gpus N [--schedules all] | "
                                   "--layer-profile FILE --model NAME")
    p.add_argument("target", nargs="?", default=None, help="a plan .json file, or a built-in model / path/to/file.py:factory")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="override the model's example batch size (default: >= microbatches)")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="override the example sequence length (decoders)")
    p.add_argument("--model-device", type=_device, default=None, help=argparse.SUPPRESS)
    cost = p.add_mutually_exclusive_group()
    cost.add_argument("--spec", type=_spec, default=None, help=f"analytic costs for this GPU spec ({_SPEC_NAMES})")
    cost.add_argument("--device", type=_device, default=None, help="measured costs on this device (cpu, cuda:0, ...)")
    p.add_argument("--gpus", type=_positive_int, default=None, help="number of devices (MODEL; a layer profile has its own)")
    p.add_argument("--microbatches", type=_positive_int, default=None,
                   help=f"microbatches per iteration (MODEL: default {DEFAULT_MICROBATCHES}; a layer profile has its own)")
    p.add_argument("--memory-limit", type=_parse_bytes, default=None, help="usable memory per device (default: the spec's)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    p.add_argument("--schedules", default=None, help="comma list of gpipe,1f1b,interleaved-1f1b,roundpipe,ilp or 'all' (default all)")
    p.add_argument("--chunks", type=_positive_int, default=2, help="stages per device for interleaved-1f1b (default 2)")
    p.add_argument("--segments-per-layer", type=_positive_int, default=2, metavar="K",
                   help="(MODEL) segments per transformer block for the planners (default 2)")
    p.add_argument("--head-chunks", type=_head_chunks, default="auto", metavar="K",
                   help="(ilp, MODEL) split the LM head and its loss into K sequence chunks; 1: never; "
                        "auto (default): plan both ways, keep the faster")
    p.add_argument("--no-host-embedding", dest="host_embedding", action="store_false",
                   help="(ilp, MODEL) keep token embeddings on the devices (the baselines always do)")
    p.add_argument("--host-bandwidth", type=_parse_rate, default=None, help="the host memory's total bandwidth, e.g. 100GB/s (default: unlimited)")
    p.add_argument("--layer-profile", default=None, metavar="FILE", help="per-layer times (RoundPipe simulator-input format)")
    p.add_argument("--model", dest="profile_model", default=None, metavar="NAME", help="(with --layer-profile) which model of the file")
    p.add_argument("--time-limit", type=_positive_float, default=10.0, help="solver time limit in seconds (default 10)")
    p.add_argument("--timeline", default=None, metavar="FILE.svg", help="draw a Gantt chart (FILE-<schedule>.svg when several)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("check", help="exit 1 when a plan file is stale, invalid, does not fit or has regressed (for CI)")
    p.add_argument("plan", help="the plan .json file")
    p.add_argument("model", help="built-in model name or path/to/file.py:factory the plan is for")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="override the model's example batch size (default: >= microbatches)")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="override the example sequence length (decoders)")
    p.add_argument("--model-device", type=_device, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-regression", type=_parse_percent, default=0.02, help="allowed slowdown against a fresh plan (default 2%%)")
    p.add_argument("--time-limit", type=_positive_float, default=10.0, help="solver time limit for the fresh plan (s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("diff", help="what changed between two plan files (exit 1 when they differ)")
    p.add_argument("a", help="the old plan .json")
    p.add_argument("b", help="the new plan .json")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    p.set_defaults(func=_cmd_diff)

    p = sub.add_parser("show", help="a plan file's stage table; --graph draws the model rolled up by module")
    p.add_argument("plan", help="the plan .json file")
    p.add_argument("--graph", default=None, metavar="FILE.svg", help="write the rolled-up graph (.svg or .dot)")
    p.add_argument("--model", dest="graph_model", default=None, metavar="MODEL",
                   help="(with --graph) trace MODEL for the graph's edges and exact module boxes")
    p.add_argument("--depth", type=_positive_int, default=None, help="(with --graph) module depth of the roll-up")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("demo", help="the main job: compile a built-in model and show what rpcompile does")
    p.add_argument("--model", default="llama-demo", help="built-in model (default llama-demo)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("models", help="the built-in models: parameters, layers, whether they train here or are meta only")
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
    from rpcompile.report import cost_label, print_table, profile_table

    ms = _load(args)
    prof = profile(ms.model, ms.example_inputs, spec=args.spec, device=args.device, dtype=_dtype(args.dtype),
                   depth=args.depth, progress=_bars(args))
    if args.json:
        print(json.dumps(prof.to_dict(nodes=args.nodes)))
    else:
        source = cost_label(prof.cost_model)
        print_table(profile_table(prof, nodes=args.nodes, title=f"{args.model}: cost table ({source}, traced with {prof.trace})"))
    return 0


def _spec(text: str) -> str:
    if text not in SPECS:
        raise argparse.ArgumentTypeError(f"unknown GPU spec {text!r}; choose one of {_SPEC_NAMES}")
    return text


def _device(text: str) -> str:
    """A device this machine has: ``cpu``, ``meta``, ``cuda:K`` with K < the CUDA devices here."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (examples: cpu, cuda:0, meta)") from None
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s); for a GPU you do not have, use "
            "--spec NAME (analytic costs) instead")
    if dev.type not in ("cpu", "cuda", "meta"):
        raise argparse.ArgumentTypeError(f"{text}: rpcompile runs on cpu, cuda:K or meta")
    return text


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return x


@contextmanager
def _step(args: argparse.Namespace, text: str) -> Iterator[None]:
    """A spinner and the elapsed time on stderr while a step runs: on a terminal only, never under ``--json``."""
    if getattr(args, "json", False) or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn(text), TimeElapsedColumn(), transient=True,
                  console=Console(stderr=True)) as bar:
        bar.add_task(text, total=None)
        yield


def _stepper(args: argparse.Namespace) -> Any:
    """``_step`` bound to ``args``, for library calls that take a ``status=`` hook."""
    return lambda text: _step(args, text)


def _bars(args: argparse.Namespace) -> bool | None:
    """The profiler's own progress bar: off under ``--json``, else on a terminal (``None``)."""
    return False if getattr(args, "json", False) else None


def _writable(path: str, flag: str) -> None:
    """Refuse an output path that cannot be written, before any work (a plan takes minutes to make)."""
    from rpcompile.core.errors import RPCompileError

    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise RPCompileError(f"{flag} {path} is a directory; give a file name such as {target / 'plan.json'}")
    if not parent.is_dir():
        raise RPCompileError(f"{flag} {path}: directory {parent} does not exist; create it (mkdir -p {parent}) "
                             "or write elsewhere")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise RPCompileError(f"{flag} {path}: not writable here; pick a path you can write")


def _directory(path: str, flag: str) -> None:
    """Make the output directory ``path`` now, before any work, or refuse it in one line."""
    from rpcompile.core.errors import RPCompileError

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RPCompileError(f"{flag} {path}: cannot create the directory ({e.strerror}); pick a path you can write") from None
    if not os.access(path, os.W_OK):
        raise RPCompileError(f"{flag} {path}: not writable here; pick a path you can write")


def _positive_int(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return k


def _head_chunks(text: str) -> "int | str":
    if text == "auto":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def _parse_bytes(text: str) -> int:
    import re

    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 20GiB, 24GB, 1073741824)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def _parse_rate(text: str) -> float:
    base = text.strip().removesuffix("/s").removesuffix("ps")
    try:
        return float(_parse_bytes(base))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a bandwidth: {text!r} (examples: 100GB/s, 50GiB/s)") from None


def _cmd_simulate(args: argparse.Namespace) -> int:
    import math

    from rpcompile.core.errors import RPCompileError
    from rpcompile.simulation import parse_schedules, run_all

    host = args.host_bandwidth or math.inf
    if args.timeline:
        _writable(args.timeline, "--timeline")
    try:
        schedules = parse_schedules(args.schedules or "all")
    except ValueError as e:
        raise RPCompileError(str(e)) from None
    title, scenarios, left_out, m = _scenarios(args, schedules, host)
    with _step(args, f"simulating {', '.join(scenarios)}"):
        results = run_all(scenarios)
    if args.timeline:
        _write_timelines(args.timeline, results, title)
    if args.json:
        out = {name: r.summary() | {"stages": scenarios[name].stage_count}
               | {k: v for k, v in scenarios[name].notes.items() if k == "head_chunks"} for name, r in results.items()}
        extra = ({"microbatches": m} if m else {}) | ({"skipped": left_out} if left_out else {})
        print(json.dumps({"schedules": out} | extra, allow_nan=False))
        return 0
    from rpcompile.report import devices_table, print_table, simulate_table

    print_table(simulate_table(results, scenarios, title=title))
    for name, why in left_out.items():
        print(f"{name}: not simulated: {why}")
    if len(results) == 1:
        (name, only), = results.items()
        print_table(devices_table(only, title=f"{name}: per device (simulated)"))
    if args.timeline:
        print(f"timeline written to {args.timeline}" if len(results) == 1 else f"timelines written next to {args.timeline}")
    return 0


def _scenarios(args: argparse.Namespace, schedules: list[str], host: float) -> tuple[str, dict, dict[str, str], int]:
    """What ``simulate`` runs: (title, {name: Scenario}, {requested schedule left out: why}, microbatches or 0
    when the layer profile says)."""
    from rpcompile.core.errors import RPCompileError
    from rpcompile.simulation import model_scenarios, plan_scenarios, profile_scenarios, skipped

    if args.layer_profile:
        if not args.profile_model:
            raise RPCompileError("--layer-profile needs --model NAME (which model of the file to simulate)")
        try:
            scenarios = profile_scenarios(args.layer_profile, args.profile_model, schedules=schedules, gpus=args.gpus,
                                          microbatches=args.microbatches, time_limit_s=args.time_limit)
        except ValueError as e:
            raise RPCompileError(f"{args.layer_profile}: {e}") from None
        return f"{args.profile_model} from {Path(args.layer_profile).name}", scenarios, {}, args.microbatches or 0
    if args.target is None:
        raise RPCompileError("say what to simulate: a plan .json file, a MODEL with --gpus N, or --layer-profile FILE --model NAME")
    if args.target.endswith(".json"):
        from rpcompile.core.plan import Plan

        plan = Plan.load(args.target)
        hw = plan.hardware
        title = f"{args.target}: {plan.strategy} plan, {len(plan.stages)} stages on {hw.device_count} × {hw.spec.name}"
        return title, plan_scenarios(plan, host_bytes_per_s=host), {}, plan.microbatches
    if args.gpus is None:
        raise RPCompileError(f"simulating model {args.target} needs --gpus N")
    m = args.microbatches or _default_microbatches(args.gpus)
    args.model = args.target
    ms = _load_for(args, m)
    title = f"{args.target} on {args.gpus} × {args.spec or args.device or 'default spec'}, {m} microbatches"
    try:
        scenarios = model_scenarios(ms.model, ms.example_inputs, gpus=args.gpus, spec=args.spec, device=args.device,
                                    microbatches=m, memory_limit=args.memory_limit, precision=args.precision,
                                    schedules=schedules, chunks=args.chunks, host_bytes_per_s=host,
                                    time_limit_s=args.time_limit, progress=_bars(args), status=_stepper(args),
                                    loss_fn=ms.loss_fn, example_target=ms.example_target,
                                    head_chunks=args.head_chunks, segments_per_layer=args.segments_per_layer,
                                    host_embedding=args.host_embedding)
    except ValueError as e:
        raise RPCompileError(str(e)) from None
    return title, scenarios, skipped(schedules, scenarios, gpus=args.gpus, microbatches=m, chunks=args.chunks), m


def _default_microbatches(gpus: int) -> int:
    """:data:`DEFAULT_MICROBATCHES`, the count ``planning.prepare`` picks when none is given."""
    return gpus + 1 if gpus > 1 else 1


def _load_for(args: argparse.Namespace, microbatches: int):
    """The model with a batch of at least ``microbatches`` (one sample per microbatch at least) unless
    ``--batch-size`` says otherwise: the meta presets come with a batch of one sequence."""
    ms = _load(args)
    first = ms.example_inputs[0] if ms.example_inputs else None
    if args.batch_size is None and getattr(first, "shape", None) and first.shape[0] < microbatches:
        args.batch_size = microbatches
        ms = _load(args)
    return ms


def _write_timelines(path: str, results: dict, title: str) -> None:
    from pathlib import Path

    from rpcompile.gantt import write_timeline_svg

    target = Path(path)
    for name, r in results.items():
        out = target if len(results) == 1 else target.with_name(f"{target.stem}-{name}{target.suffix or '.svg'}")
        write_timeline_svg(out, r.timeline, devices=len(r.busy_s), stage_names=list(r.stage_names),
                           title=f"{title} — {name}: {r.iteration_time_s * 1e3:.1f} ms, bubble {r.bubble_fraction:.1%}")


def _parse_percent(text: str) -> float:
    try:
        return float(text.strip().removesuffix("%")) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a percentage: {text!r} (examples: 2%, 0.02)") from None


def _cmd_check(args: argparse.Namespace) -> int:
    from rpcompile.checking import check_plan
    from rpcompile.core.errors import PlanFileError
    from rpcompile.core.plan import Plan

    try:
        microbatches = Plan.load(args.plan).microbatches
    except PlanFileError:
        microbatches = 1  # check_plan reports the file
    ms = _load_for(args, microbatches)
    res = check_plan(args.plan, ms.model, ms.example_inputs, max_regression=args.max_regression,
                     time_limit_s=args.time_limit, loss_fn=ms.loss_fn, example_target=ms.example_target,
                     progress=_bars(args), status=_stepper(args))
    if args.json:
        print(json.dumps(res.to_dict()))
    else:
        for line in res.problems:
            print(f"{args.plan}: {line}")
        print(res.summary())
    return 0 if res.ok else 1


def _cmd_diff(args: argparse.Namespace) -> int:
    from rpcompile.core.plan import Plan
    from rpcompile.plandiff import diff_plans

    d = diff_plans(Plan.load(args.a), Plan.load(args.b), a_name=args.a, b_name=args.b)
    print(json.dumps(d.to_dict()) if args.json else "\n".join(d.lines()))
    return 1 if d.changed else 0


def _cmd_show(args: argparse.Namespace) -> int:
    from rpcompile.core.plan import Plan
    from rpcompile.report import plan_table, print_table

    plan = Plan.load(args.plan)
    hw = plan.hardware
    print_table(plan_table(plan, title=f"{args.plan}: {plan.strategy} plan, {len(plan.stages)} stages on "
                                       f"{hw.device_count} × {hw.spec.name}, {plan.microbatches} microbatches"))
    if args.graph:
        from rpcompile.graphview import write_graph

        graph = None
        if args.graph_model:
            from rpcompile.verify import graph_as_planned

            args.model, args.batch_size, args.seq_len, args.model_device = args.graph_model, None, None, None
            ms = _load_for(args, plan.microbatches)
            with _step(args, f"tracing {args.graph_model}"):
                graph = graph_as_planned(plan, ms.model, ms.example_inputs, loss_fn=ms.loss_fn, source=args.plan)
        try:
            write_graph(args.graph, plan, graph, depth=args.depth)
        except ValueError as e:
            from rpcompile.core.errors import RPCompileError

            raise RPCompileError(str(e)) from None
        print(f"graph written to {args.graph}")
    return 0


def _strategy_json(result, plan) -> dict:
    d = {"feasible": bool(result.feasible), "solve_time_s": result.solve_time_s}
    if plan is None:
        return d | {"iteration_time_s": None, "bound_s": None}
    p = plan.predicted
    n_bwd = sum(len(s.nodes) for s in plan.backward_stages)
    return d | {
        "iteration_time_s": p.iteration_time_s,
        "bound_s": p.bound_s or None,  # on the solver's objective (stages × slowest stage), not the iteration
        "bubble_fraction": p.bubble_fraction,
        "peak_memory_bytes": p.peak_memory_bytes,
        "forward_stages": len(plan.forward_stages),
        "backward_stages": len(plan.backward_stages),
        "recompute_fraction": len(plan.recomputed) / n_bwd if n_bwd else 0.0,
    }


def _cmd_plan(args: argparse.Namespace) -> int:
    from rpcompile.planning import default_spec, make_hardware
    from rpcompile.report import compare_table, plan_table, print_table

    if args.output:  # before the minutes of planning, not after
        _writable(args.output, "-o")
    if args.emit:
        _directory(args.emit, "--emit")
    ms = _load_for(args, args.microbatches or _default_microbatches(args.gpus))
    model_device = next((p.device.type for p in ms.model.parameters()), "cpu")
    hardware = make_hardware(args.gpus, default_spec(args.spec, args.device, model_device), args.memory_limit)
    chosen, gm, m, rows = _plan_fastest(args, ms, hardware)
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
    head = f", LM head in {chosen.head_chunks} chunks" if chosen.head_chunks > 1 else ""
    print_table(plan_table(chosen, title=f"{args.model}: {args.strategy} plan, {len(chosen.stages)} stages on {args.gpus} × {hardware.spec.name}, {m} microbatches{head}"))
    print_table(compare_table(rows, reference=args.strategy))
    if args.output:
        print(f"plan written to {args.output}")
    if args.emit:
        print(f"stage code written to {args.emit}/")
    return 0


def _plan_fastest(args: argparse.Namespace, ms: Any, hardware: Any) -> tuple[Any, Any, int, dict]:
    """Every strategy on each LM-head split ``--head-chunks`` asks for; the split whose ``--strategy`` plan is
    fastest: (that plan, its graph, microbatches, {strategy: (result, plan)})."""
    from rpcompile.core.errors import RPCompileError
    from rpcompile.planning import _infeasible, compare, fastest, head_chunk_candidates, partition_problem, prepare

    def attempt(k: int) -> tuple[float, tuple]:
        gm, m = prepare(ms.model, ms.example_inputs, gpus=args.gpus, spec=args.spec, device=args.device,
                        microbatches=args.microbatches, precision=args.precision, max_segments=args.max_segments,
                        progress=_bars(args), loss_fn=ms.loss_fn, example_target=ms.example_target,
                        head_chunks=k, segments_per_layer=args.segments_per_layer, host_embedding=args.host_embedding)
        head = f"LM head in {k} chunks" if k > 1 else "whole LM head"
        with _step(args, f"solving ({head}): ilp ≤ {args.time_limit:g} s, dp, roundpipe, uniform"):
            rows = compare(gm, hardware=hardware, microbatches=m, precision=args.precision,
                           time_limit_s=args.time_limit)
        chosen = rows[args.strategy][1]
        if chosen is None:
            raise _infeasible(partition_problem(gm, hardware=hardware, microbatches=m, precision=args.precision),
                              hardware)
        return chosen.predicted.iteration_time_s, (chosen, gm, m, rows)

    try:
        return fastest(head_chunk_candidates(args.head_chunks, ms.loss_fn, ms.example_target), attempt)
    except ValueError as e:  # e.g. a head that cannot be split as asked: one line, not a traceback
        raise RPCompileError(str(e)) from None


def _cmd_models(args: argparse.Namespace) -> int:
    from rpcompile.models import model_summaries

    from rpcompile.report import models_table, print_table

    with _step(args, "counting parameters on the meta device"):
        rows = model_summaries()
    print_table(models_table(rows))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rpcompile.demo import run_demo

    return run_demo(args.model)


def main(argv: Sequence[str] | None = None) -> int:
    from rpcompile.core.errors import RPCompileError

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
    except BrokenPipeError:  # `rpcompile ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # not anticipated: still one line, the traceback behind -v
        if args.verbose:
            raise
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"rpcompile: error: {type(e).__name__}{': ' + text if text else ''} (unexpected: rerun with -v for the "
              "traceback, and please report it)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
