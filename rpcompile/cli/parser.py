"""The ``rpcompile`` argument parser: every command and option, with one-line errors."""

from __future__ import annotations

import argparse
from typing import NoReturn

from rpcompile import __version__

from .argtypes import (SPEC_NAMES, device, head_chunks, network_rate, network_rates, node_counts, parse_bytes, parse_percent, parse_rate, positive_float,
                       positive_int, microbatch_count, spec)

__all__ = ["build_parser", "DEFAULT_MICROBATCHES"]

DEFAULT_MICROBATCHES = "gpus + 1 (1 on one device), as rpcompile.compile"
"""What ``--microbatches`` defaults to in ``plan`` and ``simulate`` (docs/architecture.md §3: the fewest without a bubble
between stages); planning.prepare applies it."""

_DESCRIPTION = "The rpcompile command line: profile (cost table of a model), plan, simulate, demo (the main job)."


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``rpcompile plan: error: ...; see rpcompile plan --help`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


#: Per command: an example or two for its ``--help`` (each runs as written: tests/test_cli.py).
EXAMPLES: dict[str, tuple[str, ...]] = {
    "profile": ("rpcompile profile llama-demo --spec rtx4090", "rpcompile profile llama-8b --spec rtx4090 --precision bf16"),
    "plan": ("rpcompile plan llama-demo --gpus 2 --spec rtx4090 -o plan.json",
             "rpcompile plan llama-8b --gpus 8 --spec rtx4090 --lora 16 --quantize nf4"),
    "simulate": ("rpcompile simulate plan.json", "rpcompile simulate llama-demo --gpus 4 --spec rtx4090"),
    "check": ("rpcompile check plan.json llama-demo --max-regression 5%",),
    "diff": ("rpcompile diff old.json plan.json",),
    "show": ("rpcompile show plan.json", "rpcompile show plan.json --graph plan.svg --model llama-demo"),
    "probe": ("rpcompile probe -o host.json",),
    "cache": ("rpcompile cache", "rpcompile cache clear"),
    "demo": ("rpcompile demo", "rpcompile demo --model gpt-demo"),
    "models": ("rpcompile models",),
    "checkpoint": ("rpcompile checkpoint verify ckpt/", "rpcompile checkpoint convert ckpt/ckpt-00000006.ckpt ckpt-new/"),
}


def _command(sub: argparse._SubParsersAction, name: str, what: str, details: str = "") -> argparse.ArgumentParser:
    """Subcommand ``name``: ``what`` in the command list and its ``--help`` (with ``details``), then its
    :data:`EXAMPLES`."""
    examples = "\n".join(f"  {line}" for line in EXAMPLES[name])
    return sub.add_parser(name, help=what, description=what[:1].upper() + what[1:] + (f". {details}" if details else "."),
                          epilog=f"examples:\n{examples}", formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rpcompile", description=_DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log pass timings")
    parser.add_argument("--version", action="version", version=f"rpcompile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_profile(sub)
    _add_plan(sub)
    _add_simulate(sub)
    _add_check(sub)
    _add_diff(sub)
    _add_show(sub)
    _add_probe(sub)
    _add_cache(sub)
    _add_checkpoint(sub)
    _command(sub, "demo", "the main job: compile a built-in model and show what rpcompile does",
             "It costs the model, plans it for the devices at hand (each GPU, or two logical CPU devices) beside "
             "the baselines, trains that plan a few steps (the loss falling, the step time beside the prediction) "
             "and plans the real Llama-3-8B shape for 8 × RTX 4090 (predicted)").add_argument(
        "--model", default="llama-demo", help="built-in model (default llama-demo; see rpcompile models)")
    _command(sub, "models", "the built-in models: parameters, layers, whether they train here or are meta only")
    return parser


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name or path/to/file.py:factory")
    p.add_argument("--batch-size", type=positive_int, default=None, help="override the model's example batch size")
    p.add_argument("--seq-len", type=positive_int, default=None, help="override the example sequence length (decoders)")
    p.add_argument("--model-device", type=device, default=None, help="build the model on this device (default: the model's own)")
    _add_cost_source(p)
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="measure costs and solve afresh and keep nothing (default: reuse measured costs and solved "
                        "partitions kept in the cache, rpcompile cache)")


def _add_cost_source(p: argparse.ArgumentParser) -> None:
    cost = p.add_mutually_exclusive_group()
    cost.add_argument("--spec", type=spec, default=None, help=f"analytic costs for this GPU spec ({SPEC_NAMES})")
    cost.add_argument("--device", type=device, default=None, help="measured costs on this device (cpu, cuda:0, ...)")


def _add_batch_override(p: argparse.ArgumentParser) -> None:
    """The batch and sequence overrides of a command whose batch defaults to at least the plan's microbatches."""
    p.add_argument("--batch-size", type=positive_int, default=None, help="override the model's example batch size (default: >= microbatches)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="override the example sequence length (decoders)")
    p.add_argument("--model-device", type=device, default=None, help=argparse.SUPPRESS)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "profile", "cost table of a model, rolled up per module",
                 "Each graph node's forward and backward time and memory, measured on --device or analytic for "
                 "--spec, summed per module")
    _add_model_args(p)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="cost the compute in this precision (default: the model's own dtype)")
    p.add_argument("--nodes", action="store_true", help="one row per graph node instead of per module")
    p.add_argument("--depth", type=int, default=None, help="module depth of the roll-up (default: keep layer indices)")
    p.add_argument("--probe-host", action="store_true",
                   help="also measure this host (AdamW, casts, gradient adds, copies; as rpcompile probe)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "plan", "partition a model into round-robin stages and compare with the baselines",
                 "Traces and costs the model, solves the partition (forward and backward cuts, what is saved or "
                 "recomputed, what stays on the devices) under each device's memory, prints the stage table and "
                 "the predicted iteration; -o writes the plan file")
    _add_model_args(p)
    p.add_argument("--gpus", type=positive_int, required=True, help="number of devices")
    p.add_argument("--microbatches", type=microbatch_count, default=None,
                   help=f"microbatches per iteration (default {DEFAULT_MICROBATCHES})")
    p.add_argument("--memory-limit", type=parse_bytes, default=None, help="usable memory per device, e.g. 20GiB (default: the spec's)")
    p.add_argument("--strategy", choices=("ilp", "dp", "roundpipe", "uniform"), default="ilp",
                   help="ilp (default): the solver; dp, roundpipe, uniform: the baselines it is compared with")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16", help="compute/upload precision (default bf16)")
    p.add_argument("--time-limit", type=positive_float, default=10.0, help="solver time limit in seconds (default 10)")
    p.add_argument("--max-segments", type=int, default=None, help="coarsening target (default ~2 per layer)")
    p.add_argument("--segments-per-layer", type=positive_int, default=2, metavar="K",
                   help="segments per transformer block (default 2; 4 lets the planner save parts of a half-block: "
                        "faster plans, 2-3x the solve time)")
    p.add_argument("--head-chunks", type=head_chunks, default="auto", metavar="K",
                   help="put the loss in the graph and split the LM head into K sequence chunks; 1: never split; "
                        "auto (default): plan the whole head and 8 chunks, keep the faster")
    p.add_argument("--no-host-embedding", dest="host_embedding", action="store_false",
                   help="keep token embeddings on the devices (default: the host looks up the rows of tables larger "
                        "than what an iteration reads)")
    p.add_argument("--no-save", dest="allow_save", action="store_false",
                   help="keep no activations in host memory: every backward stage recomputes its forward (what "
                        "rpcompile.compile falls back to when the saved activations would not fit the host)")
    _no_stay(p)
    p.add_argument("--overlap", action="store_true",
                   help="plan for overlapped iterations (pipe.step(optimizer, overlap=True), each device going on to "
                        "the next iteration while the others drain; one step stale): minimise the steady-state period")
    p.add_argument("--host", default="assumed", metavar="HOST",
                   help="the host the optimizer step and gradient accumulation run on: assumed (default: the spec's "
                        "assumed host), probe (measure this one now, ~0.5 s) or a JSON file from rpcompile probe -o")
    p.add_argument("--nodes", type=positive_int, default=1, metavar="N",
                   help="machines training data-parallel (torchrun, one process each); the plan then includes the "
                        "all-reduce of each stage's gradients over --network (default 1)")
    p.add_argument("--network", type=network_rate, default=None, metavar="RATE",
                   help="(with --nodes) each machine's network bandwidth, e.g. 25Gb/s or 3GB/s")
    p.add_argument("--max-seq-len", action="store_true",
                   help="find the longest sequence (one per microbatch) for which a plan fits, by bisection over the "
                        "analytic cost model (a prediction), and report that plan and what binds")
    p.add_argument("--granularity", type=positive_int, default=1024, metavar="TOKENS",
                   help="(with --max-seq-len) bisect to this many tokens (default 1024)")
    p.add_argument("--lora", type=positive_int, nargs="?", const=16, default=None, metavar="RANK",
                   help="freeze the base and plan LoRA fine-tuning: PEFT adapters of rank RANK (default 16, alpha "
                        "2*RANK) on q/k/v/o_proj; also reports the host memory training needs")
    p.add_argument("--quantize", choices=["nf4"], default=None,
                   help="(with --lora) quantize the frozen base: nf4 = QLoRA's 4-bit NormalFloat with double-"
                        "quantized scales (bitsandbytes' layout; the output head stays in --precision), stored, "
                        "uploaded and priced packed and dequantized on the GPU")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--emit", default=None, metavar="DIR", help="write each stage's generated Python into DIR")
    p.add_argument("--compare", action="store_true", help="(with --json) report every strategy")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _add_probe(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "probe", "measure this host: memory bandwidth, casts, gradient adds, AdamW, host-device copies",
                 "The host's rates price the optimizer step, the copy refresh and the gradient accumulation in "
                 "plans (plan --host FILE)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("-o", "--output", default=None, help="write the host JSON here (for rpcompile plan --host FILE)")


def _add_cache(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "cache", "the profile cache of measured costs: its entries and size; clear empties it",
                 "Measured costs and solved partitions are kept there and reused by the next plan of the same model")
    p.add_argument("action", nargs="?", choices=("show", "clear"), default="show",
                   help="show (default): directory, entries, size; clear: remove every entry")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")


def _add_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "checkpoint", "a run's checkpoints: verify them; convert an older .ckpt file",
                 "A checkpoint is a directory (safetensors weights in HF's layout, optimizer.pt, pipeline.json, a "
                 "manifest of sha256s); verify checks each one whole without loading it, convert rewrites a "
                 "ckpt-<step>.ckpt file of the earlier format as one")
    actions = p.add_subparsers(dest="action", required=True)
    v = actions.add_parser("verify", help="check each checkpoint whole (sizes, sha256) without loading it; exit 1 if "
                                          "one is torn or corrupt")
    v.add_argument("path", help="a run's checkpoint directory, or one checkpoint (a ckpt-<step> directory or .ckpt)")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    c = actions.add_parser("convert", help="rewrite an older .ckpt file as a checkpoint directory (safetensors "
                                           "weights, optimizer.pt, pipeline.json) under NEW")
    c.add_argument("old", help="a .ckpt file, or a directory holding them (its newest good one)")
    c.add_argument("new", help="the run directory to write ckpt-<step>/ and plan.json into")
    c.add_argument("--max-shard-size", default="5GB", help="shard weights above this size (default 5GB)")


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "simulate", "simulate schedules on one clock: a plan file, a model, or a layer profile",
                 "rpcompile simulate plan.json | MODEL --gpus N [--schedules all] | --layer-profile FILE --model "
                 "NAME: the executor's own action lists walked with each device's compute and link, against GPipe, "
                 "1F1B, interleaved 1F1B and RoundPipe")
    p.add_argument("target", nargs="?", default=None, help="a plan .json file, or a built-in model / path/to/file.py:factory")
    _add_batch_override(p)
    _add_cost_source(p)
    p.add_argument("--gpus", type=positive_int, default=None, help="number of devices (MODEL; a layer profile has its own)")
    p.add_argument("--microbatches", type=microbatch_count, default=None,
                   help=f"microbatches per iteration (MODEL: default {DEFAULT_MICROBATCHES}; a layer profile has its own)")
    p.add_argument("--memory-limit", type=parse_bytes, default=None, help="usable memory per device (default: the spec's)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    p.add_argument("--schedules", default=None, help="comma list of gpipe,1f1b,interleaved-1f1b,roundpipe,ilp or 'all' (default all)")
    p.add_argument("--chunks", type=positive_int, default=2, help="stages per device for interleaved-1f1b (default 2)")
    p.add_argument("--segments-per-layer", type=positive_int, default=2, metavar="K",
                   help="(MODEL) segments per transformer block for the planners (default 2)")
    p.add_argument("--head-chunks", type=head_chunks, default="auto", metavar="K",
                   help="(ilp, MODEL) split the LM head and its loss into K sequence chunks; 1: never; "
                        "auto (default): plan both ways, keep the faster")
    p.add_argument("--no-host-embedding", dest="host_embedding", action="store_false",
                   help="(ilp, MODEL) keep token embeddings on the devices (the baselines always do)")
    p.add_argument("--host-bandwidth", type=parse_rate, default=None, help="the host memory's total bandwidth, e.g. 100GB/s (default: unlimited)")
    _no_stay(p)
    p.add_argument("--overlap", action="store_true",
                   help="overlapped iterations (pipe.step(optimizer, overlap=True), each device going on to the next "
                        "iteration while the others drain): the round-robin schedules run several iterations and report the "
                        "steady-state period, bubble and the run's fill and drain (MODEL: ilp plans for it; the static "
                        "schedules stay synchronous)")
    p.add_argument("--nodes", type=node_counts, default=None, metavar="N[,N...]",
                   help="data-parallel machines: a scaling report (iteration, tokens/s, efficiency against one node) "
                        "for each count, e.g. 1,2,4,8, with the gradient all-reduce overlapped and not")
    p.add_argument("--network", type=network_rates, default=None, metavar="RATE[,RATE...]",
                   help="(with --nodes) each machine's network bandwidth, e.g. 25Gb/s or 25Gb/s,100Gb/s")
    p.add_argument("--layer-profile", default=None, metavar="FILE", help="per-layer times (RoundPipe simulator-input format)")
    p.add_argument("--model", dest="profile_model", default=None, metavar="NAME", help="(with --layer-profile) which model of the file")
    p.add_argument("--time-limit", type=positive_float, default=10.0, help="solver time limit in seconds (default 10)")
    p.add_argument("--timeline", default=None, metavar="FILE.svg", help="draw a Gantt chart (FILE-<schedule>.svg when several)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _add_check(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "check", "exit 1 when a plan file is stale, invalid, does not fit or has regressed (for CI)",
                 "The plan is verified against the model as it is now and re-priced; a fresh plan is solved when "
                 "what the plan was solved from moved (--resolve: always)")
    p.add_argument("plan", help="the plan .json file")
    p.add_argument("model", help="built-in model name or path/to/file.py:factory the plan is for")
    _add_batch_override(p)
    p.add_argument("--max-regression", type=parse_percent, default=0.02, help="allowed slowdown against a fresh plan (default 2%%)")
    p.add_argument("--time-limit", type=positive_float, default=10.0, help="solver time limit for the fresh plan (s)")
    p.add_argument("--resolve", action="store_true",
                   help="solve a fresh plan even when nothing the plan was solved from moved (the default re-solves "
                        "only then)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")


def _add_diff(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "diff", "what changed between two plan files (exit 1 when they differ)",
                 "Cuts by module, stages, saved activations, weights that stay and the prediction")
    p.add_argument("a", help="the old plan .json")
    p.add_argument("b", help="the new plan .json")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")


def _add_show(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "show", "a plan file's stage table; --graph draws the model rolled up by module")
    p.add_argument("plan", help="the plan .json file")
    p.add_argument("--graph", default=None, metavar="FILE.svg", help="write the rolled-up graph (.svg or .dot)")
    p.add_argument("--model", dest="graph_model", default=None, metavar="MODEL",
                   help="(with --graph) trace MODEL for the graph's edges and exact module boxes")
    p.add_argument("--depth", type=positive_int, default=None, help="(with --graph) module depth of the roll-up")


def _no_stay(p: argparse.ArgumentParser) -> None:
    """``--no-stay`` (plan, simulate)."""
    p.add_argument("--no-stay", dest="allow_stay", action="store_false",
                   help="keep no weight on a device between stages: every stage uploads its weights (default: a "
                        "forward stage's weights stay for the backward stage on its device, or every weight across "
                        "iterations, where memory allows and it is faster)")
