"""``rpcompile plan``: partition a model with every strategy, keep the one asked for, write it and its stage code."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from rpcompile.compiler import PlanLowering
from rpcompile.core.errors import ConfigError, RPCompileError
from rpcompile.core.plan import Hardware, Plan
from rpcompile.core.specs import HostSpec
from rpcompile.models.registry import ModelSpec
from rpcompile.passes.formulate import partition_problem
from rpcompile.passes.solve_cache import solving
from rpcompile.planner.envelope import link_bound, microbatch_tokens
from rpcompile.planner.plan_options import (PlanOptions, default_spec, fastest, head_chunk_candidates, infeasible_error,
                                            make_hardware, model_device, split_limit)
from rpcompile.planner.planning import compare, prepare, shared_trace
from rpcompile.planner.probe import load_host, probe_host
from rpcompile.planner.seqlen import max_sequence_length
from rpcompile.tools.lora import LORA_TARGETS, apply_lora
from rpcompile.tools.qlora import quantize_base
from rpcompile.training.host_memory import host_memory
from rpcompile.views.report import compare_table, plan_table, print_table

from .common import bars, default_microbatches, directory, step, writable
from .loading import load_for

__all__ = ["plan_command", "plan_options"]


def plan_command(args: argparse.Namespace) -> int:
    if args.output:  # before the minutes of planning, not after
        writable(args.output, "-o")
    if args.emit:
        directory(args.emit, "--emit")
    if args.max_seq_len:
        return _max_seq_len(args)
    if args.nodes > 1 and args.network is None:
        raise ConfigError(f"--nodes {args.nodes} needs the network between the machines: add --network 25Gb/s (or "
                          "their bandwidth)")
    # the example batch must split into the microbatches the plan will have
    ms = _with_lora(args, load_for(args, args.microbatches or default_microbatches(args.gpus)))
    hardware = make_hardware(args.gpus, default_spec(args.spec, args.device, model_device(ms.model)), args.memory_limit,
                             host=_host(args), nodes=args.nodes, network_bytes_per_s=args.network or 0.0)
    chosen, gm, m, rows = _plan_fastest(args, ms, hardware)
    if args.output:
        chosen.save(args.output)
    if args.emit:
        lowering = PlanLowering(chosen, gm)  # as compile lowers it
        lowering.write(lowering.program(), args.emit)
    # the example is the whole batch: its tokens per microbatch are those of one of m pieces
    envelope = link_bound(chosen, *microbatch_tokens(ms.example_inputs, m))
    if envelope is not None:  # the operating envelope: one line, on stderr (stdout may be --json)
        print(f"rpcompile: warning: {envelope.message()}", file=sys.stderr)
    if args.json:
        out: dict[str, Any] = ({"strategies": {k: _strategy_json(r, p) for k, (r, p) in rows.items()}}
                               if args.compare else chosen.to_dict())
        if args.lora:
            quantize = {"quantize": args.quantize} if args.quantize else {}
            out["lora"] = {"rank": args.lora, **quantize, **host_memory(ms.model, args.precision, chosen).to_dict()}
        print(json.dumps(out))
        return 0
    head = f", LM head in {chosen.head_chunks} chunks" if chosen.head_chunks > 1 else ""
    if args.nodes > 1:
        head += f", × {args.nodes} nodes over {args.network * 8 / 1e9:g} Gb/s (data-parallel)"
    if args.overlap:
        head += ", iterations overlapped (steady-state period)"
    print_table(plan_table(chosen, title=f"{args.model}: {args.strategy} plan, {len(chosen.stages)} stages on {args.gpus} × {hardware.spec.name}, {m} microbatches{head}"))
    print_table(compare_table(rows, reference=args.strategy))
    if args.lora:
        print("\n".join(_lora_lines(args, ms, chosen)))
    else:
        print(host_memory(ms.model, args.precision, chosen).line())
    if args.output:
        print(f"plan written to {args.output}")
    if args.emit:
        print(f"stage code written to {args.emit}/")
    return 0


def _max_seq_len(args: argparse.Namespace) -> int:
    """``--max-seq-len``: the longest sequence a plan fits (:func:`rpcompile.planner.seqlen.max_sequence_length`)."""
    if args.seq_len is not None or args.batch_size is not None:
        raise RPCompileError("--max-seq-len searches the sequence length with one sequence per microbatch: "
                             "drop --seq-len and --batch-size")
    if args.device is not None:
        raise RPCompileError("--max-seq-len plans with the analytic cost model: give --spec, not --device")
    if args.lora:
        raise RPCompileError("--max-seq-len does not plan LoRA yet: drop --lora, or plan --lora at a --seq-len")
    with step(args, f"bisecting the sequence length to {args.granularity} tokens"):
        found = max_sequence_length(args.model, gpus=args.gpus, spec=args.spec, precision=args.precision,
                                    memory_limit=args.memory_limit, microbatches=args.microbatches,
                                    granularity=args.granularity, head_chunks=args.head_chunks,
                                    strategy=args.strategy, time_limit_s=args.time_limit,
                                    segments_per_layer=args.segments_per_layer, host_embedding=args.host_embedding,
                                    host=_host(args))
    if args.output:
        found.plan.save(args.output)
    if args.json:
        print(json.dumps(found.to_dict()))
        return 0
    p = found.plan
    print_table(plan_table(p, title=f"{args.model} at {found.seq_len} tokens: {args.strategy} plan, {len(p.stages)} "
                                    f"stages on {args.gpus} × {p.hardware.spec.name}, {p.microbatches} microbatches"))
    print("\n".join(found.lines()))
    if args.output:
        print(f"plan written to {args.output}")
    return 0


def _with_lora(args: argparse.Namespace, ms: ModelSpec) -> ModelSpec:
    """``--lora RANK``: the model with its base frozen and adapters on the attention projections (laid out as
    PEFT's; fx-traceable ones on rpcompile's own models: :func:`rpcompile.tools.lora.apply_lora`)."""
    if args.quantize and not args.lora:
        raise ConfigError(f"--quantize {args.quantize} quantizes a frozen base: add --lora (QLoRA: adapters train, "
                          "the 4-bit base does not)")
    if not args.lora:
        return ms
    with step(args, f"adding rank-{args.lora} LoRA adapters"):
        ms = replace(ms, model=apply_lora(ms.model, rank=args.lora))
    # after the adapters: quantize_base quantizes only a frozen base, and apply_lora is what freezes it
    if args.quantize:
        with step(args, f"quantizing the frozen base to {args.quantize}"):
            ms = replace(ms, model=quantize_base(ms.model, args.quantize))
    return ms


def _lora_lines(args: argparse.Namespace, ms: ModelSpec, chosen: Plan) -> list[str]:
    """What ``--lora`` adds below the tables: host memory, the largest stage, tokens/s (predictions)."""
    ids = ms.example_inputs[0]
    # the example is one iteration's batch: all of its token ids
    tokens = ids.numel() if isinstance(ids, torch.Tensor) else 0
    p = chosen.predicted
    rate = f"; {tokens / p.iteration_time_s:,.0f} tokens/s ({tokens:,} tokens an iteration)" if tokens else ""
    what = f"QLoRA ({args.quantize} base) rank {args.lora}" if args.quantize else f"LoRA rank {args.lora}"
    return [f"{what} on {', '.join(LORA_TARGETS)}: {host_memory(ms.model, args.precision, chosen).line()}",
            f"GPU memory: largest stage {max(s.memory_bytes for s in chosen.stages) / 2**30:.2f} GiB of "
            f"{chosen.hardware.memory_bytes / 2**30:.2f} GiB; iteration {p.iteration_time_s:.2f} s{rate} (predicted)"]


def _host(args: argparse.Namespace) -> HostSpec | None:
    """``--host``: ``assumed`` (None: the spec's), ``probe`` (this host, now) or a file from ``rpcompile probe``."""
    if args.host == "assumed":
        return None
    if args.host == "probe":
        with step(args, "probing the host"):
            return probe_host()
    return load_host(args.host)


def _plan_fastest(args: argparse.Namespace, ms: ModelSpec, hardware: Hardware) -> tuple[Plan, Any, int, dict]:
    """Every strategy on each LM-head split ``--head-chunks`` asks for; the split whose ``--strategy`` plan is
    fastest: (that plan, its graph, microbatches, {strategy: (result, plan)})."""

    options = plan_options(args)  # the same object rpcompile.plan builds from its keywords
    candidates = head_chunk_candidates(options.head_chunks, ms.loss_fn, ms.example_target)
    limit = split_limit(options.time_limit_s, len(candidates))
    traced = shared_trace(len(candidates))  # one trace for every split

    def attempt(k: int) -> Callable[[], tuple[float, tuple]]:
        gm, m = prepare(ms.model, ms.example_inputs, replace(options, head_chunks=k), loss_fn=ms.loss_fn,
                        example_target=ms.example_target, trace_pass=traced)
        # the problem is made here, not in compare: solving needs it to choose where to run, infeasible_error to
        # name the least memory
        # every split but the last is solved in a child process while the next one is prepared and solved here
        problem = partition_problem(gm, hardware=hardware, microbatches=m, precision=options.precision,
                                    allow_save=options.allow_save, allow_stay=options.allow_stay,
                                    overlap_iterations=options.overlap)
        solved = solving(functools.partial(compare, gm, hardware=hardware, microbatches=m, precision=options.precision,
                                           time_limit_s=limit, cache=options.cache, allow_save=options.allow_save,
                                           allow_stay=options.allow_stay, problem=problem, overlap=options.overlap),
                         problem, time_limit_s=limit, cache=options.cache, background=k != candidates[-1])
        head = f"LM head in {k} chunks" if k > 1 else "whole LM head"

        def finish() -> tuple[float, tuple]:
            with step(args, f"solving ({head}): ilp ≤ {limit:.3g} s, dp, roundpipe, uniform"):
                rows = solved.result()
            # every strategy was solved on this split, but the one asked for decides which split wins
            chosen = rows[options.strategy][1]
            if chosen is None:
                raise infeasible_error(problem, hardware)
            return chosen.predicted.iteration_time_s, (chosen, gm, m, rows)

        return finish

    try:
        return fastest(candidates, attempt)
    except ValueError as e:  # e.g. a head that cannot be split as asked: one line, not a traceback
        raise RPCompileError(str(e)) from None


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """The planner's options from ``rpcompile plan``'s flags: the object ``rpcompile.plan`` builds from its
    keywords (checked the same way, :class:`~rpcompile.planner.plan_options.PlanOptions`)."""
    return PlanOptions(gpus=args.gpus, spec=args.spec, device=args.device, microbatches=args.microbatches,
                       memory_limit=args.memory_limit, strategy=args.strategy, precision=args.precision,
                       time_limit_s=args.time_limit, max_segments=args.max_segments, progress=bars(args),
                       head_chunks=args.head_chunks, segments_per_layer=args.segments_per_layer,
                       host_embedding=args.host_embedding, cache=args.cache, overlap=args.overlap,
                       allow_save=args.allow_save, allow_stay=args.allow_stay)


def _strategy_json(result: Any, plan: Plan | None) -> dict:
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
