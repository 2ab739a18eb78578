"""The pass driver: model → plan, the compile pipeline listed once, in order (:data:`PASSES`).

Every pass is a function of one shape, ``pass(c: Compilation) -> None``: it reads what earlier passes left in the
:class:`Compilation` and adds its own result; :func:`run` runs a list of them and logs each one's time (logger
``rpcompile``, level INFO; also kept in ``Compilation.times``).

    trace → loss_head → shape → cost → host → coarsen → problem → partition → lower

``rpcompile.profile`` runs the front (:data:`FRONT`, to ``cost``), ``prepare`` runs to ``coarsen``, ``plan`` runs
them all, for each LM-head split ``head_chunks`` asks for, and keeps the fastest plan; ``rpcompile.compile`` is
:func:`compile_plan` (the plan and the graph it was made from) plus a :class:`~rpcompile.training.pipeline.Pipeline`. The
options they share (hardware, cost model, head splits, which plan wins) are :mod:`rpcompile.planner.plan_options`.

Microbatches: ``example_inputs`` is one full batch; it is split along dim 0 into ``microbatches`` pieces
(``torch.tensor_split``: sizes differ by at most one) and the graph is costed on the first (largest) piece, so every
time and byte in the problem is per microbatch. The default is ``gpus + 1`` microbatches (docs/architecture.md §3), and 1 on a
single device.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rpcompile.passes.cost.analytic import AnalyticCostModel
from rpcompile.passes.cost.cost import cost_from_cache, cost_pass
from rpcompile.passes.cost.loss_memory import LOSS_BYTES_KEY, loss_memory
from rpcompile.passes.cost.measured import MeasuredCostModel
from rpcompile.passes.formulate import partition_problem
from rpcompile.passes.graph.fingerprint import fingerprint
from rpcompile.passes.graph.meta import on_meta, without_dynamo_import
from rpcompile.passes.graph.precision import RUN_DTYPE_KEY, TRACE_DTYPE_KEY, cast_floating, computing_in
from rpcompile.passes.graph.reuse import RunMemo
from rpcompile.passes.graph.shape import shape_pass
from rpcompile.passes.graph.trace import TRACE_META_KEY, trace, training_inputs
from rpcompile.passes.lower import to_plan
from rpcompile.passes.rewrite.coarsen import coarsen_pass
from rpcompile.passes.rewrite.host import host_embedding_pass
from rpcompile.passes.rewrite.loss_head import split_head
from rpcompile.passes.solve_cache import lookup, remember, solving
from rpcompile.passes.solver.partition import ilp, solve
from rpcompile.passes.solver.problem import PartitionProblem, PartitionResult

from ..core.batch import TARGET, split_microbatches
from ..core.errors import ConfigError, PlanMismatchError
from ..core.plan import Hardware, Plan
from ..core.precision import compute_dtype
from ..core.specs import DeviceSpec
from .envelope import warn_if_link_bound
from .plan_options import (AUTO_HEAD_CHUNKS, PLAN_STRATEGIES, PlanOptions, default_spec, fastest,
                           head_chunk_candidates, infeasible_error, make_cost_model, make_hardware, model_device,
                           options_or_keywords, split_limit)
from .shared_trace import TraceOnce

__all__ = [
    "Compilation",
    "PASSES",
    "DOING",
    "FRONT",
    "GRAPH",
    "run",
    "planned",
    "start",
    "analyze",
    "prepare",
    "shared_trace",
    "plan",
    "compile_plan",
    "graph_as_planned",
    "cached_solve",
    "replanned",
    "plan_graph",
    "compare",
]

log = logging.getLogger("rpcompile")



@dataclass
class Compilation:
    """One run of the pass pipeline: its inputs (the example microbatch and the options) and each pass's result."""

    model: torch.nn.Module | None
    args: tuple[Any, ...]
    """The example's positional inputs, one microbatch of them."""
    kwargs: dict[str, Any]
    cost_model: Any
    microbatches: int
    """Microbatches per iteration (``options.microbatches`` resolved: :func:`start`)."""
    options: PlanOptions = field(default_factory=lambda: PlanOptions(gpus=1))
    """What the plan is for and how it is made, as given (checked when made); the resolved values are the fields
    here (``microbatches``, ``head_chunks``, ``hardware``, ``cost_model``)."""
    hardware: Hardware | None = None
    head_chunks: int = 1
    """The LM-head split this compilation plans (one of ``options.head_chunks``' candidates)."""
    loss: tuple[Any, Any] | None = None
    """``(loss_fn, target of one microbatch)`` when both are given: the loss joins the graph when ``head_chunks > 1``;
    else it runs after the graph, and the cost pass measures its memory (:mod:`rpcompile.passes.cost.loss_memory`)."""

    gm: fx.GraphModule | None = None
    """trace: the graph; later passes annotate and rewrite it."""
    problem: PartitionProblem | None = None
    """problem: the partition problem (plain numbers)."""
    result: Any = None
    """partition: the solver's result."""
    plan: Plan | None = None
    """lower: the plan of names."""
    times: dict[str, float] = field(default_factory=dict)
    """Seconds each pass took."""
    memo: RunMemo | None = None
    """What the shape and cost passes of an earlier compilation of the same trace left for this one (set by
    :func:`shared_trace`'s pass: the LM-head splits' bodies are shaped and costed once, :mod:`rpcompile.passes.graph.reuse`)."""

    @property
    def graph(self) -> fx.GraphModule:
        if self.gm is None:
            raise RuntimeError("no graph yet: run the trace pass first")
        return self.gm


# ------------------------------------------------------------------------------------------------- the passes
def _trace(c: Compilation) -> None:
    if c.model is None:
        raise RuntimeError("the trace pass needs a model")
    # the inputs are as traced already (an HF model's use_cache=False joined them in start): the later passes run
    # the graph on them; bf16/fp16: an exported graph is recorded in the compute dtype, so the model's own casts stay in it
    gm = trace(c.model, c.args, example_kwargs=c.kwargs, leaf_modules=c.options.leaf_modules,
               dtype=compute_dtype(c.options.precision))
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"trace returned {type(gm).__name__}, expected a GraphModule")
    c.gm = gm


def _loss_head(c: Compilation) -> None:
    """``loss`` given and ``head_chunks > 1``: the loss joins the graph (a last input ``target``) and the LM head and
    its cross-entropy are split along the sequence (:mod:`rpcompile.passes.rewrite.loss_head`). With the whole head the
    loss stays outside the graph (the cost pass measures its memory)."""
    if c.loss is None or c.head_chunks == 1:
        if c.loss is None and c.head_chunks > 1:
            raise ConfigError(f"head_chunks={c.head_chunks} splits the LM head together with its loss: pass "
                              "loss_fn= and example_target= (a target for one batch), or use head_chunks=1")
        return
    loss_fn, target = c.loss
    if target is None:  # a plan's graph rebuilt (:func:`planned`): no batch to run it on
        split_head(c.graph, loss_fn, c.head_chunks)
        return
    if c.head_chunks > 1 and not (isinstance(target, torch.Tensor) and target.dim() >= 2):
        raise ConfigError(f"head_chunks={c.head_chunks} splits along the sequence: the target must be a "
                          f"[batch, sequence] tensor, got {getattr(target, 'shape', type(target).__name__)}")
    split_head(c.graph, loss_fn, c.head_chunks)
    # the target feeds the placeholder split_head appended: the shape and cost passes run the graph on it
    c.kwargs = {**c.kwargs, TARGET: target}


def _run_dtype(c: Compilation) -> torch.dtype | None:
    """The dtype the graph runs in: the compute dtype (as the runtime uploads the weights; an exported graph traced
    in one runs only in it), recorded on the graph (:data:`~rpcompile.passes.graph.precision.RUN_DTYPE_KEY`)."""
    dtype = c.graph.meta.get(TRACE_DTYPE_KEY) or compute_dtype(c.options.precision)
    c.graph.meta[RUN_DTYPE_KEY] = dtype
    return dtype


@contextlib.contextmanager
def _as_traced(c: Compilation) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The example inputs, while the graph's weights are in the run dtype (:func:`_run_dtype`): every node then
    has its run-time dtype, explicit fp32 upcasts included. Casts the real weights: for a real run only."""
    dtype = _run_dtype(c)
    with computing_in(c.graph, dtype):
        yield cast_floating(c.args, dtype), cast_floating(c.kwargs, dtype)


def _on_meta(c: Compilation, fn: Callable[[tuple, dict], Any]) -> bool:
    """``fn`` on meta stand-ins in the run dtype (:func:`~rpcompile.passes.graph.meta.on_meta`): the real weights are
    neither read nor cast. False when the graph cannot run on meta."""
    dtype = _run_dtype(c)
    return on_meta(c.graph, cast_floating(c.args, dtype), cast_floating(c.kwargs, dtype), fn, dtype=dtype)


def _from_cache(c: Compilation) -> bool:
    """Measured costs from a warm profile cache (:func:`~rpcompile.passes.cost.cost.cost_from_cache`): the weights
    are not cast for it (uninitialised storage in the run dtype: the cache's key reads shapes and dtypes only).
    False when the cache has no entry for this graph."""
    dtype = _run_dtype(c)
    with computing_in(c.graph, dtype, values=False):
        return cost_from_cache(c.graph, cast_floating(c.args, dtype), cast_floating(c.kwargs, dtype),
                               cost_model=c.cost_model)


def _shape(c: Compilation) -> None:
    """Shapes need no data: the graph runs on meta stand-ins (:func:`~rpcompile.passes.graph.meta.on_meta`) unless a
    data-dependent op needs the real values."""
    if not _on_meta(c, lambda a, k: shape_pass(c.graph, a, k, memo=c.memo)):
        with _as_traced(c) as (args, kwargs):
            shape_pass(c.graph, args, kwargs)


def _cost(c: Compilation) -> None:
    """Costs; analytic ones, like shapes, from a run on meta stand-ins. Measured ones run the graph for real."""
    # torch's intra-op thread count is process-wide: kept here to be restored below even when costing fails
    threads = torch.get_num_threads()
    if c.options.threads is not None:
        torch.set_num_threads(c.options.threads)
    try:
        def cost(a: tuple, k: dict) -> None:
            cost_pass(c.graph, a, k, cost_model=c.cost_model, progress=c.options.progress, memo=c.memo)

        if isinstance(c.cost_model, AnalyticCostModel):
            done = _on_meta(c, cost)
        else:
            done = _from_cache(c)
        if not done:
            with _as_traced(c) as (args, kwargs):
                cost(args, kwargs)
        if c.loss is not None and c.head_chunks == 1:  # the loss runs after the graph: its memory, on meta
            c.graph.meta[LOSS_BYTES_KEY] = loss_memory(c.graph, *c.loss)
    finally:
        torch.set_num_threads(threads)


def _host(c: Compilation) -> None:
    """Token embeddings whose tables are larger than an iteration's lookups run on the host
    (:mod:`rpcompile.passes.rewrite.host`); ``host_embedding`` False: none; node names: exactly those."""
    host = c.options.host_embedding
    if host:
        names = None if host is True else tuple(host)
        host_embedding_pass(c.graph, microbatches=c.microbatches, names=names)


def _coarsen(c: Compilation) -> None:
    coarsen_pass(c.graph, max_segments=c.options.max_segments, segments_per_layer=c.options.segments_per_layer)


def _problem(c: Compilation) -> None:
    if c.hardware is None:
        raise RuntimeError("the problem pass needs the hardware: give Compilation.hardware")
    o = c.options
    c.problem = partition_problem(c.graph, hardware=c.hardware, microbatches=c.microbatches, precision=o.precision,
                                  allow_save=o.allow_save, allow_stay=o.allow_stay, overlap_iterations=o.overlap)


def cached_solve(problem: PartitionProblem, strategy: str = "ilp", *, time_limit_s: float = 10.0, seed: int = 0,
                 cache: bool = True, **options: Any) -> PartitionResult:
    """:func:`~rpcompile.passes.solver.partition.solve` (``ilp`` with ``options``:
    :func:`~rpcompile.passes.solver.partition.ilp`'s ``baselines``) through the solve cache
    (:mod:`rpcompile.passes.solve_cache`): a stored result if there is one, else a fresh one, then kept;
    ``cache=False`` solves and keeps nothing."""
    found = lookup(problem, strategy, time_limit_s=time_limit_s, seed=seed) if cache else None
    if found is not None:
        return found
    # only the ILP takes extra options (the baselines dict it fills for compare); the other strategies take none
    if strategy == "ilp":
        result = ilp(problem, time_limit_s=time_limit_s, seed=seed, **options)
    else:
        result = solve(problem, strategy, time_limit_s=time_limit_s, seed=seed)
    if cache:
        remember(problem, strategy, result, time_limit_s=time_limit_s, seed=seed)
    return result


def _solve(c: Compilation) -> PartitionResult:
    """``c``'s problem solved with its strategy (checked with the options), through the solve cache (what
    :func:`_partition` does)."""
    assert c.problem is not None
    return cached_solve(c.problem, c.options.strategy, time_limit_s=c.options.time_limit_s, cache=c.options.cache)


def _partition(c: Compilation) -> None:
    """Solve with ``strategy`` — unless ``c.result`` already holds that solve (:func:`compile_plan` solves a split
    in the background); :class:`~rpcompile.InfeasibleError` (naming the least memory that fits) if nothing fits."""
    assert c.problem is not None and c.hardware is not None
    # set already when compile_plan ran this solve through passes.solve_cache.solving (maybe in a child process)
    if c.result is None:
        c.result = _solve(c)
    if not c.result.feasible:
        raise infeasible_error(c.problem, c.hardware)


def _lower(c: Compilation) -> None:
    assert c.hardware is not None
    c.plan = to_plan(c.graph, c.problem, c.result, hardware=c.hardware, precision=c.options.precision)


Pass = Callable[[Compilation], None]

#: The compile pipeline, in order: (name, pass).
PASSES: tuple[tuple[str, Pass], ...] = (
    ("trace", _trace),
    ("loss_head", _loss_head),
    ("shape", _shape),
    ("cost", _cost),
    ("host", _host),
    ("coarsen", _coarsen),
    ("problem", _problem),
    ("partition", _partition),
    ("lower", _lower),
)
#: The front: a costed graph (what ``rpcompile profile`` reports).
FRONT = PASSES[:4]
#: To a coarsened graph (what the solvers' problem is made from).
PREPARE = PASSES[:6]
#: Where the solve starts: ``PASSES[:SOLVE]`` make the problem, ``PASSES[SOLVE:]`` solve it and lower the plan.
SOLVE = [name for name, _ in PASSES].index("partition")
#: From a coarsened graph to a plan.
BACK = PASSES[6:]
#: The passes that rewrite the graph before its costs are known: run with a plan's settings (:func:`planned`) they
#: rebuild the graph that plan was made from.
GRAPH = tuple((name, fn) for name, fn in PASSES if name in ("trace", "loss_head", "host"))


#: What each pass is doing, as the progress line on stderr says it.
DOING = {"trace": "tracing the model", "loss_head": "placing the loss", "shape": "propagating shapes",
         "cost": "costing every node", "host": "moving embedding lookups to the host",
         "coarsen": "grouping nodes into segments", "problem": "pricing the segments",
         "partition": "solving the partition", "lower": "writing the plan"}


def run(c: Compilation, passes: Sequence[tuple[str, Pass]] = PASSES) -> Compilation:
    """Run ``passes`` on ``c`` in order, logging each one's time; returns ``c``. With ``c.progress=True`` each pass
    shows a line on stderr while it runs — what it does, the time it has taken, and for the solve the time left of
    its limit (the cost pass draws its own bar; ``rpcompile.compile`` asks for them on a terminal, the CLI draws its
    own). Meta kernels run without importing TorchDynamo (:func:`~rpcompile.passes.graph.meta.without_dynamo_import`)."""
    with without_dynamo_import():
        for name, fn in passes:
            t0 = time.perf_counter()
            with _showing(c, name):
                fn(c)
            c.times[name] = time.perf_counter() - t0
            log.info("%s: %.2f s", name, c.times[name])
    return c


@contextlib.contextmanager
def _showing(c: Compilation, name: str) -> Iterator[None]:
    """A transient progress line on stderr while pass ``name`` runs (:func:`run`)."""
    # progress None shows no line for these passes; the cost pass is left out always, as it draws its own bar
    if c.options.progress is not True or name == "cost":
        yield
        return
    limit = c.options.time_limit_s if name == "partition" else None
    columns = [SpinnerColumn(), TextColumn(f"compile: {DOING.get(name, name)}"), TimeElapsedColumn()]
    if limit is not None:
        columns += [TextColumn(f"(time limit {limit:g} s)"), TimeRemainingColumn()]
    with Progress(*columns, transient=True, console=Console(stderr=True)) as bar:
        bar.add_task(name, total=limit)  # the solve's bar runs against its limit (it may end sooner)
        if limit is None:
            yield
            return
        done = threading.Event()
        ticker = threading.Thread(target=_tick, args=(bar, done), daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()


def _tick(bar: Progress, done: threading.Event) -> None:
    """Advance the solve's bar by the wall time until ``done`` (a bar against the time limit)."""
    start = time.perf_counter()
    while not done.wait(0.2):
        # a solve may run past its limit: the bar stops full rather than overrun its total
        bar.update(bar.task_ids[0], completed=min(time.perf_counter() - start, bar.tasks[0].total or 0.0))


# ------------------------------------------------------------------------------------------------- drivers
def shared_trace(count: int) -> Pass:
    """The trace pass for ``count`` compilations of one model on one example, run in turn (the LM-head splits of
    one plan): the model is traced once, each later compilation starts from a copy of that graph
    (:class:`~rpcompile.planner.shared_trace.TraceOnce`)."""
    return TraceOnce(_trace, count)


def start(model: torch.nn.Module, example_inputs: Sequence[Any], options: PlanOptions, *,
          example_kwargs: Mapping[str, Any] | None = None, loss_fn: Any = None, example_target: Any = None,
          head_chunks: int | None = None, hardware: Hardware | None = None) -> Compilation:
    """A :class:`Compilation` for one microbatch of the example batch, before any pass: the inputs as they are
    traced (:func:`~rpcompile.passes.graph.trace.training_inputs`: an HF model's ``use_cache=False`` joins them, here
    and nowhere else in the planner), split into ``options.microbatches`` (by default ``gpus + 1``, 1 on one device),
    and the cost model of ``options`` (``cache=False``: measure costs and solve afresh, and keep nothing on disk).
    ``head_chunks``: the LM-head split to plan (default: ``options.head_chunks`` when it is a number, else the whole
    head); ``hardware``: what the problem pass prices (:func:`compile_plan` makes it)."""
    # docs/architecture.md §3: N + 1 is the fewest microbatches without a bubble between stages; one device has no
    # pipeline to fill, and splitting the batch would only shrink its kernels.
    gpus = options.gpus
    m = options.microbatches or (gpus + 1 if gpus > 1 else 1)
    k = head_chunks if head_chunks is not None else options.head_chunks if isinstance(options.head_chunks, int) else 1
    args, kwargs = training_inputs(model, example_inputs, example_kwargs)
    # the loss joins the graph only to be split with the head; after it, only its memory is costed
    with_loss = k > 1 or (loss_fn is not None and example_target is not None)
    if k > 1 and (loss_fn is None or example_target is None):  # before the batch split's own errors
        raise ConfigError(f"head_chunks={k} splits the LM head together with its loss: pass loss_fn= and "
                          "example_target= (a target for one batch), or use head_chunks=1")
    # the target is split with the inputs so its rows match the microbatch; it rides as the last value of each piece
    extra = (example_target,) if with_loss else ()
    # tensor_split makes the first piece the largest: costing it gives every microbatch's upper bound
    piece = split_microbatches((*args, *kwargs.values(), *extra), m)[0]
    dtype = compute_dtype(options.precision)
    # the piece holds the values in the order flattened above: the positional inputs, the keyword values, the target
    return Compilation(
        model=model, args=tuple(piece[: len(args)]), kwargs=dict(zip(kwargs, piece[len(args):len(args) + len(kwargs)])),
        cost_model=make_cost_model(spec=options.spec, device=options.device, dtype=dtype,
                                   model_device=model_device(model), cache=options.cache),
        microbatches=m, options=options, hardware=hardware, head_chunks=k,
        loss=(loss_fn, piece[-1]) if with_loss else None)


def planned(plan: Plan, model: torch.nn.Module, example_inputs: Sequence[Any], *, loss_fn: Any = None,
            example_kwargs: Mapping[str, Any] | None = None, precision: str | None = None) -> Compilation:
    """A :class:`Compilation` with ``plan``'s settings (its ``head_chunks``, the lookups its ``host`` names,
    ``precision`` or its own) for one microbatch of ``example_inputs``, before any pass: :data:`GRAPH` run on it
    rebuilds the graph the plan was made from (:func:`graph_as_planned`). No target:
    ``loss_fn`` joins the graph only when the plan split the LM head with it."""
    # host_embedding: exactly the plan's lookups; an empty tuple moves none, where True would let the pass choose
    options = PlanOptions(gpus=plan.hardware.device_count, precision=precision or plan.precision,
                          head_chunks=plan.head_chunks, host_embedding=tuple(plan.host), progress=False)
    args, kwargs = training_inputs(model, example_inputs, example_kwargs)  # as start() gives them to the trace
    return Compilation(model, args, kwargs, None, plan.microbatches, options=options, head_chunks=plan.head_chunks,
                       loss=None if loss_fn is None else (loss_fn, None))


def graph_as_planned(plan: Plan, model: torch.nn.Module, example_inputs: Any, *, loss_fn: Any = None,
                     example_kwargs: Any = None, source: str = "plan", precision: str | None = None,
                     ) -> fx.GraphModule:
    """``model`` traced into the graph ``plan`` was planned from (its LM head and loss split as the plan's
    ``head_chunks``, its ``host`` lookups on the host: the graph whose fingerprint the plan records), once the
    fingerprints agree; else :class:`~rpcompile.PlanMismatchError` saying what differs. ``precision``: the one the
    graph will run in (default the plan's); an exported graph records its casts for it, so it must be the plan's."""
    precision = precision or plan.precision
    if plan.head_chunks > 1 and loss_fn is None:
        raise PlanMismatchError(f"{source} splits the LM head and its loss into {plan.head_chunks} chunks: give "
                                "the model's loss_fn to rebuild that graph (a model file's factory returns "
                                "(model, inputs, loss_fn, target))")
    # with the whole head the loss ran after the graph: the fingerprint the plan records is of the graph without it
    c = planned(plan, model, example_inputs, loss_fn=loss_fn if plan.head_chunks > 1 else None,
                example_kwargs=example_kwargs, precision=precision)
    try:
        run(c, GRAPH)
    except ValueError as e:
        # c.times holds the passes that finished: an error of the trace itself is no mismatch with the plan
        if "trace" not in c.times:
            raise
        _same_precision(plan, c.graph, model, precision, source)  # what the trace shows is said first
        if "loss_head" not in c.times:
            raise PlanMismatchError(f"{source} was made for a different model: its LM head cannot be split as the "
                                    f"plan's ({e})") from None
        raise PlanMismatchError(f"{source} was made for a different model: {e}") from None
    _same_precision(plan, c.graph, model, precision, source)
    plan.check_model(fingerprint(c.graph), source=source)
    return c.graph


def _same_precision(plan: Plan, gm: fx.GraphModule, model: torch.nn.Module, precision: str, source: str) -> None:
    """:class:`~rpcompile.core.errors.PlanMismatchError` when ``gm``, exported, records its casts for the plan's
    precision and the run is in another."""
    # only an exported graph bakes its dtype casts in; a symbolically traced one runs in any precision
    if precision != plan.precision and gm.meta.get(TRACE_DTYPE_KEY, None) != compute_dtype(plan.precision) \
            and gm.meta.get(TRACE_META_KEY) == "export":
        raise PlanMismatchError(f"{source} was made for precision={plan.precision!r} but this run is in "
                                f"{precision!r}, and {type(model).__name__}'s exported graph records its dtype casts "
                                f"for one precision: compile with precision={plan.precision!r} or re-plan")


def analyze(model: torch.nn.Module, example_inputs: Sequence[Any] = (), *, cost_model: Any,
            example_kwargs: Mapping[str, Any] | None = None, leaf_modules: Sequence[Any] = (),
            progress: bool | None = None) -> fx.GraphModule:
    """Trace ``model`` (exactly these inputs, not split; an HF model's ``use_cache=False`` joins them) and cost it:
    the :data:`FRONT` passes."""
    args, kwargs = training_inputs(model, example_inputs, example_kwargs)
    c = Compilation(model, args, kwargs, cost_model, microbatches=1,
                    options=PlanOptions(gpus=1, leaf_modules=leaf_modules, progress=progress))
    return run(c, FRONT).graph


def prepare(model: torch.nn.Module, example_inputs: Sequence[Any], options: PlanOptions, *,
            example_kwargs: Mapping[str, Any] | None = None, loss_fn: Any = None, example_target: Any = None,
            trace_pass: "Pass | None" = None) -> tuple[fx.GraphModule, int]:
    """Trace, cost (on one microbatch), move token embeddings to the host and coarsen; returns the graph and the
    microbatch count (:func:`start`'s arguments).

    ``options.head_chunks > 1`` (which needs ``loss_fn`` and ``example_target``) puts the loss in the graph (its last
    input is ``target``) and splits the LM head along the sequence (:mod:`rpcompile.passes.rewrite.loss_head`);
    ``"auto"`` here is the whole head. ``options.host_embedding``: ``True`` moves the token embeddings whose tables
    are larger than what an iteration looks up to the host (:mod:`rpcompile.passes.rewrite.host`), ``False`` none,
    node names exactly those (a plan's). ``trace_pass``: the trace pass to run instead of tracing afresh, e.g.
    :func:`shared_trace`'s (the LM-head splits of one model and example traced once)."""
    c = start(model, example_inputs, options, example_kwargs=example_kwargs, loss_fn=loss_fn,
              example_target=example_target)
    run(c, PREPARE if trace_pass is None else (("trace", trace_pass), *PREPARE[1:]))
    return c.graph, c.microbatches


def plan_graph(
    gm: fx.GraphModule,
    *,
    hardware: Hardware,
    microbatches: int,
    strategy: str = "ilp",
    precision: str = "fp32",
    time_limit_s: float = 10.0,
    allow_save: bool = True,
    cache: bool = True,
    overlap: bool = False,
    allow_stay: bool = True,
) -> Plan:
    """Partition a costed, coarsened graph with one strategy (the :data:`BACK` passes); raise
    :class:`~rpcompile.InfeasibleError` if nothing fits. ``allow_save=False`` makes every backward stage recompute (no
    activations kept in host memory); ``cache=False`` solves even when the solve cache holds this problem;
    ``overlap``: plan for overlapped iterations (the steady-state period); ``allow_stay=False``: no weight stays
    on a device between stages."""
    options = PlanOptions(gpus=hardware.device_count, strategy=strategy, precision=precision,  # checked first
                          time_limit_s=time_limit_s, allow_save=allow_save, cache=cache, overlap=overlap,
                          allow_stay=allow_stay)
    c = Compilation(None, (), {}, None, microbatches, options=options, hardware=hardware, gm=gm)
    plan = run(c, BACK).plan
    assert plan is not None
    return plan


def compare(
    gm: fx.GraphModule, *, hardware: Hardware, microbatches: int, precision: str = "fp32", time_limit_s: float = 10.0,
    cache: bool = True, allow_save: bool = True, problem: PartitionProblem | None = None, overlap: bool = False,
    allow_stay: bool = True,
) -> dict[str, tuple[Any, Plan | None]]:
    """Every strategy on the same problem: name -> (PartitionResult, Plan or None when infeasible). ``cache``: the
    ILP's solve through the solve cache (:mod:`rpcompile.passes.solve_cache`); ``allow_save=False``: nothing is
    saved to host memory (every backward stage recomputes); ``overlap``: every strategy's plan priced for
    overlapped iterations. ``problem``: ``gm``'s, already made with these arguments."""
    if problem is None:
        problem = partition_problem(gm, hardware=hardware, microbatches=microbatches, precision=precision,
                                    allow_save=allow_save, allow_stay=allow_stay, overlap_iterations=overlap)
    out = {}
    baselines: dict[str, Any] = {}  # the ILP's seeds: dp's, roundpipe's and uniform's own results, not solved again
    facts: dict = {}  # what the plans of one graph share (fingerprint, inputs record, node parameters): made once
    for name in PLAN_STRATEGIES:
        # the ILP comes first in PLAN_STRATEGIES; unless its result came from the solve cache, its seeding left the
        # baselines' own results here
        if name in baselines:
            result = baselines[name]
        elif name == "ilp":
            result = cached_solve(problem, "ilp", time_limit_s=time_limit_s, cache=cache, baselines=baselines)
        else:
            result = solve(problem, name, time_limit_s=time_limit_s)
        made = (to_plan(gm, problem, result, hardware=hardware, precision=precision, facts=facts)
                if result.feasible else None)
        out[name] = (result, made)
    return out


def compile_plan(model: torch.nn.Module, example_inputs: Sequence[Any], options: PlanOptions, *,
                 example_kwargs: Mapping[str, Any] | None = None, loss_fn: Any = None,
                 example_target: Any = None) -> Compilation:
    """Every pass, once per LM-head split of :func:`~rpcompile.planner.plan_options.head_chunk_candidates` (but the trace: the model is traced
    once and each split starts from a copy of that graph, :class:`~rpcompile.planner.shared_trace.TraceOnce`); the
    :class:`Compilation` with the fastest plan (its ``plan`` and the graph ``gm`` it was made from). The splits'
    solves share ``options.time_limit_s`` equally (:func:`~rpcompile.planner.plan_options.split_limit`). Every split
    but the last is solved in a child process while the next one is traced, costed and solved
    (:mod:`rpcompile.passes.background`); the plans do not depend on it."""
    hardware = make_hardware(options.gpus, default_spec(options.spec, options.device, model_device(model)),
                             options.memory_limit)

    candidates = head_chunk_candidates(options.head_chunks, loss_fn, example_target)
    limit = split_limit(float(options.time_limit_s), len(candidates))
    each = replace(options, time_limit_s=limit)
    passes = (("trace", shared_trace(len(candidates))), *PASSES[1:])
    # front ends with the problem pass; attempt() starts the solve itself, and back's partition pass finds c.result
    front, back = passes[:SOLVE], passes[SOLVE:]

    def attempt(k: int) -> Callable[[], tuple[float, Compilation]]:
        c = run(start(model, example_inputs, each, example_kwargs=example_kwargs, loss_fn=loss_fn,
                      example_target=example_target, head_chunks=k, hardware=hardware), front)
        # every split but the last is solved in a child process while the next split is prepared and solved here
        assert c.problem is not None
        # the last split has nothing left to overlap with: fastest() asks for its result at once, so it runs here
        solved = solving(functools.partial(_solve, c), c.problem, time_limit_s=limit, strategy=each.strategy,
                         cache=each.cache, background=k != candidates[-1])

        def finish() -> tuple[float, Compilation]:
            c.result = solved.result()
            run(c, back)
            assert c.plan is not None
            return c.plan.predicted.iteration_time_s, c

        return finish

    made: Compilation = fastest(candidates, attempt)
    warn_if_link_bound(made.plan, (*made.args, *made.kwargs.values()))  # the operating envelope, one line
    return made


def replanned(c: Compilation, **changes: Any) -> Compilation:
    """``c`` planned again with ``changes`` to its options (``allow_save=False``, ``time_limit_s``: fields of
    :class:`~rpcompile.planner.plan_options.PlanOptions`): only the :data:`BACK` passes, on ``c``'s costed, coarsened graph — nothing is traced or
    costed again, and the LM-head split stays ``c``'s. ``c`` itself is left as it was."""
    return run(replace(c, options=replace(c.options, **changes), problem=None, result=None, plan=None, times={}), BACK)


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    gpus: int | None = None,
    spec: "str | DeviceSpec | None" = None,
    device: "str | torch.device | None" = None,
    microbatches: int | None = None,
    memory_limit: int | None = None,
    strategy: str = "ilp",
    precision: str = "fp32",
    example_kwargs: Mapping[str, Any] | None = None,
    time_limit_s: float = 10.0,
    max_segments: int | None = None,
    leaf_modules: Sequence[Any] = (),
    progress: bool | None = None,
    loss_fn: Any = None,
    example_target: Any = None,
    head_chunks: "int | str" = "auto",
    segments_per_layer: int = 2,
    host_embedding: "bool | Sequence[str]" = True,
    cache: bool = True,
    overlap: bool = False,
    allow_stay: bool = True,
    options: PlanOptions | None = None,
) -> Plan:
    """Make a round-robin plan for ``model`` on ``gpus`` devices.

    ``options``: a :class:`~rpcompile.PlanOptions` holding every planner keyword below (and ``gpus``) at once — to
    keep one set of options for several models or calls; the keywords are then left out.

    Costs are analytic for ``spec`` (a :class:`~rpcompile.DeviceSpec` or preset name) or measured on ``device``; with neither,
    measured on the CPU (analytic ``rtx4090`` for a meta-device model). The hardware is ``gpus`` devices of
    ``spec`` (``cpu`` when measuring on the CPU, else ``rtx4090``) with ``memory_limit`` usable bytes each.
    ``head_chunks > 1`` (with ``loss_fn`` and ``example_target``) plans the LM head and its cross-entropy as that
    many sequence chunks (:mod:`rpcompile.passes.rewrite.loss_head`); ``"auto"`` (the default) plans the whole head and,
    when a loss and a target are given and the head can be split, :data:`~rpcompile.planner.plan_options.AUTO_HEAD_CHUNKS` chunks too, and keeps
    the faster plan (the splits' solves share ``time_limit_s`` equally, and run on two cores at once where there
    are two). ``segments_per_layer`` (default 2: attention and MLP halves) above 2 lets the planner cut and save inside those halves: plans up to ~6% faster on the
    benchmark models, at two to three times the solve time (which may then overrun ``time_limit_s``).
    ``host_embedding`` (default on) lets the host run token embeddings whose tables are larger than what an
    iteration looks up (:mod:`rpcompile.passes.rewrite.host`); ``False`` none, node names exactly those lookups.
    ``cache`` (default on) reuses measured costs kept on disk for the same graph, inputs, device and torch
    (:mod:`rpcompile.passes.cost.profile_cache`) and solved partitions of the same problem
    (:mod:`rpcompile.passes.solve_cache`); ``False`` measures and solves afresh and keeps nothing.
    ``overlap`` plans for overlapped iterations — ``pipe.step(optimizer, overlap=True)`` with each device going on
    to the next iteration's stages while the others drain (one step stale): the planner minimises the
    steady-state period (no fill or drain per iteration; the optimizer step and the loss the next batch waits for
    are in it), and the plan's prediction says so (``Prediction.overlap_iterations``).
    ``allow_stay`` (default on) lets a forward stage's weights stay on its device for the backward stage there
    that differentiates them, or every weight stay across iterations (a resident plan), wherever memory allows and
    the plan is not slower (:mod:`rpcompile.passes.solver.stay_search`); ``False``: every stage uploads its weights.
    """
    keywords: dict[str, Any] = dict(
        gpus=gpus, spec=spec, device=device, microbatches=microbatches, memory_limit=memory_limit, strategy=strategy,
        precision=precision, time_limit_s=time_limit_s, max_segments=max_segments, leaf_modules=leaf_modules,
        progress=progress, head_chunks=head_chunks, segments_per_layer=segments_per_layer,
        host_embedding=host_embedding, cache=cache, overlap=overlap, allow_stay=allow_stay)
    if options is not None:
        options_or_keywords(options, keywords, where="plan")  # a keyword beside options= is refused
    elif gpus is None:
        raise ConfigError("plan needs the number of devices: gpus=N (or options=PlanOptions(gpus=N, ...))")
    else:
        options = PlanOptions(**keywords)
    made = compile_plan(model, example_inputs, options, example_kwargs=example_kwargs, loss_fn=loss_fn,
                        example_target=example_target)
    assert made.plan is not None
    return made.plan
