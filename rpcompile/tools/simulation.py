"""Driver of ``rpcompile simulate``: every schedule for a model, a plan file or a published layer profile.

Names (``--schedules``): ``gpipe``, ``1f1b``, ``interleaved-1f1b`` (static binding, weights resident on the
devices), ``roundpipe`` (the paper's partitioner on our costs) and ``ilp`` (rpcompile's plan), all on one clock
(:mod:`rpcompile.runtime.sim.simulator`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from contextlib import nullcontext
from typing import Any, Callable, Sequence

from rpcompile.core.errors import ConfigError, InfeasibleError
from rpcompile.passes.formulate import partition_problem
from rpcompile.passes.lower import input_tokens
from rpcompile.passes.solve_cache import solving
from rpcompile.passes.solver.partition import solve
from rpcompile.tools.scenarios import (SCHEDULES, Scenario, from_plan, from_segment_plan, layer_profile_scenarios,
                                       load_layer_profile, overlapped, static_scenarios)

from ..planner.plan_options import (PlanOptions, default_spec, fastest, head_chunk_candidates, make_hardware,
                                    model_device, options_or_keywords)
from ..planner.planning import prepare

__all__ = ["parse_schedules", "model_scenarios", "plan_scenarios", "profile_scenarios", "run_all",
           "skipped", "scaling"]


def _quiet(text: str) -> Any:
    return nullcontext()


def parse_schedules(text: str) -> list[str]:
    """``all`` or a comma list of schedule names; unknown names raise :class:`~rpcompile.ConfigError` listing the known ones."""
    if text.strip() == "all":
        return list(SCHEDULES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEDULES]
    if bad or not names:
        raise ConfigError(f"unknown schedule {', '.join(bad) or repr(text)}; choose from {', '.join(SCHEDULES)} or all")
    return names


def model_scenarios(model: Any, example_inputs: Sequence[Any], *, gpus: int | None = None, spec: Any = None,
                    device: Any = None,
                    microbatches: int | None = None, memory_limit: int | None = None, precision: str = "bf16",
                    schedules: Sequence[str] = SCHEDULES, chunks: int = 2, host_bytes_per_s: float = math.inf,
                    time_limit_s: float = 10.0, progress: Any = None, loss_fn: Any = None,
                    example_target: Any = None, head_chunks: "int | str" = "auto",
                    segments_per_layer: int = 2, host_embedding: bool = True,
                    status: Any = None, overlap: bool = False,
                    options: PlanOptions | None = None) -> dict[str, Scenario]:
    """Trace and cost ``model`` once, then build every requested schedule on that one problem. ``ilp`` may plan
    a graph with the LM head split as well (``head_chunks``, see :func:`rpcompile.planner.planning.plan`) and keeps the
    faster plan; its notes say which (``head_chunks``). Only ``ilp`` runs token embeddings on the host
    (``host_embedding``, :mod:`rpcompile.passes.rewrite.host`): the baselines keep them on the devices, as their
    systems do. ``progress`` is the profiler's bar; ``status(text)``, a context manager, shows each solve (the
    CLI's spinner). ``overlap``: ``roundpipe`` and ``ilp`` run with overlapped iterations (``ilp`` planned for their
    steady-state period, :func:`rpcompile.tools.scenarios.overlapped`); the static schedules stay synchronous.
    ``options``: a :class:`~rpcompile.PlanOptions` holding the planner keywords at once instead (the schedules'
    own — ``schedules``, ``chunks``, ``host_bytes_per_s``, ``status`` — and the loss stay keywords)."""
    given = options_or_keywords(options, dict(
        gpus=gpus, spec=spec, device=device, microbatches=microbatches, memory_limit=memory_limit, precision=precision,
        time_limit_s=time_limit_s, progress=progress, head_chunks=head_chunks, segments_per_layer=segments_per_layer,
        host_embedding=host_embedding, overlap=overlap), where="model_scenarios", defaults=dict(precision="bf16"))
    if given["gpus"] is None:
        raise ConfigError("model_scenarios needs the number of devices: gpus=N (or options=PlanOptions(gpus=N, ...))")
    gpus, spec, device, microbatches, memory_limit, precision, time_limit_s, progress, head_chunks, \
        segments_per_layer, host_embedding, overlap = (given[k] for k in (
            "gpus", "spec", "device", "microbatches", "memory_limit", "precision", "time_limit_s", "progress",
            "head_chunks", "segments_per_layer", "host_embedding", "overlap"))
    # the shared graph keeps the embeddings on the devices, as the baselines' systems do; ilp prepares its own below
    gm, m = prepare(model, example_inputs, PlanOptions(gpus=gpus, spec=spec, device=device, microbatches=microbatches,
                    precision=precision, progress=progress, segments_per_layer=segments_per_layer,
                    host_embedding=False))
    hardware = make_hardware(gpus, default_spec(spec, device, model_device(model)), memory_limit)
    pb = partition_problem(gm, hardware=hardware, microbatches=m, precision=precision, overlap_iterations=overlap)
    tokens = input_tokens(gm) * m
    out: dict[str, Scenario] = {}
    static = [s for s in schedules if s in ("gpipe", "1f1b", "interleaved-1f1b")]
    if static:
        out.update(static_scenarios(pb, chunks=chunks, precision=precision, tokens_per_iteration=tokens,
                                    host_bytes_per_s=host_bytes_per_s, schedules=static))
    def attempt(name: str, ks: tuple[int, ...], k: int) -> Callable[[], tuple[float, tuple]]:
        problem = pb
        # a split head or embeddings on the host rewrite the graph: such a candidate traces and costs its own
        if k > 1 or (name == "ilp" and host_embedding):
            own, _ = prepare(model, example_inputs, PlanOptions(gpus=gpus, spec=spec, device=device,
                             microbatches=microbatches, precision=precision, progress=progress, head_chunks=k,
                             segments_per_layer=segments_per_layer, host_embedding=host_embedding and name == "ilp"),
                             loss_fn=loss_fn, example_target=example_target)
            problem = partition_problem(own, hardware=hardware, microbatches=m, precision=precision,
                                        overlap_iterations=overlap)
        # every split but the last is solved in a child process while the next is prepared and solved here
        # cache=False: solve() here bypasses the solve cache, so a result stored there must not pass for a quick lookup
        solved = solving(functools.partial(solve, problem, name, time_limit_s=time_limit_s), problem,
                         time_limit_s=time_limit_s, strategy=name, cache=False, background=k != ks[-1])

        def finish() -> tuple[float, tuple]:
            with (status or _quiet)(f"solving {name}" + (f", LM head in {k} chunks" if k > 1 else "")
                                    + (f" (up to {time_limit_s:g} s)" if name == "ilp" else "")):
                res = solved.result()
            if not res.feasible:
                raise InfeasibleError(f"{name}: no feasible plan")
            return res.objective, (problem, res, k)

        return finish

    for name in (s for s in schedules if s in ("roundpipe", "ilp")):
        ks = head_chunk_candidates(head_chunks, loss_fn, example_target) if name == "ilp" else (1,)
        try:
            problem, res, k = fastest(ks, functools.partial(attempt, name, ks))
        # nothing fits: the schedule is left out, and skipped() says why
        except InfeasibleError:
            continue
        sc = from_segment_plan(problem, res.plan, name=name, tokens_per_iteration=tokens,
                               host_bytes_per_s=host_bytes_per_s)
        sc.notes.update(stages=res.plan.stage_count, solve_time_s=res.solve_time_s, head_chunks=k)
        out[name] = sc
    # in the order asked for, which tables keep
    return {name: out[name] for name in schedules if name in out}


def plan_scenarios(plan: Any, *, host_bytes_per_s: float = math.inf, overlap: bool = False) -> dict[str, Scenario]:
    """A saved plan's own schedule, named after its strategy (in the mode it was planned for; ``overlap``: with
    overlapped iterations whatever it was planned for)."""
    sc = from_plan(plan, host_bytes_per_s=host_bytes_per_s)
    return {plan.strategy: overlapped(sc) if overlap else sc}


def profile_scenarios(path: str, model: str, *, schedules: Sequence[str] = SCHEDULES, gpus: int | None = None,
                      microbatches: int | None = None, time_limit_s: float = 10.0,
                      overlap: bool = False) -> dict[str, Scenario]:
    """Every schedule on a RoundPipe-style layer profile (the file's partitions, plus ``ilp``; ``overlap``: the
    round-robin ones with overlapped iterations)."""
    entry, n, m = load_layer_profile(path, model)
    return layer_profile_scenarios(entry, devices=gpus or n, microbatches=microbatches or m, schedules=schedules,
                                   time_limit_s=time_limit_s, overlap=overlap)


def skipped(requested: Sequence[str], scenarios: dict[str, Scenario], *, gpus: int, microbatches: int,
            chunks: int = 2) -> dict[str, str]:
    """Why each requested schedule that has no scenario was left out, one line each (a schedule is never dropped
    without a word)."""
    out = {}
    for name in (s for s in requested if s not in scenarios):
        if name == "interleaved-1f1b" and microbatches % gpus:
            fix = microbatches + gpus - microbatches % gpus
            out[name] = (f"needs microbatches a multiple of the devices ({microbatches} on {gpus}); "
                         f"--microbatches {fix}")
        elif name in ("gpipe", "1f1b", "interleaved-1f1b"):
            v = chunks if name == "interleaved-1f1b" else 1
            out[name] = f"the model has fewer layers than its {gpus * v} stages"
        else:
            out[name] = ("no plan fits the memory per device; raise --memory-limit, use more --microbatches or a "
                         "lower --precision (rpcompile plan MODEL --strategy NAME names the memory it needs)")
    return out


def run_all(scenarios: dict[str, Scenario]) -> dict[str, Any]:
    """``{name: SimResult}`` in the given order."""
    return {name: sc.run() for name, sc in scenarios.items()}


def scaling(scenario: Scenario, nodes: Sequence[int], networks: Sequence[float]) -> list[dict[str, Any]]:
    """Data-parallel scaling of a round-robin schedule (:mod:`rpcompile.training.distributed`): the same pipeline on each of
    ``nodes`` machines over each network (bytes/s), the gradient all-reduce overlapped with the later stages (as
    the runtime runs it) and not. Per row: iteration time, tokens/s over all machines, efficiency (one machine's
    iteration over this one's: every machine keeps its own batch), the all-reduce's time and what of it showed."""
    alone = dataclasses.replace(scenario, host=dataclasses.replace(scenario.host, nodes=1)).run()
    rows = []
    for bw in networks:
        for n in nodes:
            # one machine has no all-reduce, so overlapping it or not is the same run
            for overlap in ((True,) if n == 1 else (True, False)):
                host = dataclasses.replace(scenario.host, nodes=n, network_bytes_per_s=bw, overlap_reduce=overlap)
                r = alone if n == 1 else dataclasses.replace(scenario, host=host).run()
                rows.append(dict(nodes=n, network_bytes_per_s=bw, overlap=overlap, iteration_time_s=r.iteration_time_s,
                                 tokens_per_s=n * r.tokens_per_s, efficiency=alone.iteration_time_s / r.iteration_time_s,
                                 reduce_s=r.reduce_s, reduce_exposed_s=r.reduce_exposed_s))
    return rows
