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


def _cmd_models(args: argparse.Namespace) -> int:
    from rpcompile.models import list_models, load_model

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
