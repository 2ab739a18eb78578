"""``cost_pass``: forward/backward time, bytes and FLOPs for every node.

Terms:

- **NodeCost** (``node.meta["rpcompile.cost"]``): what the partitioner needs about one compute node —
  forward and backward time per call, the bytes its output allocates, the bytes autograd keeps for its
  backward (*activation bytes*), the bytes of the parameters it reads and of their gradients, and FLOPs.
- **NodeCall**: one node with concrete input values, able to run itself on any device (``materialize``).
  Cost models only ever see NodeCalls, so the same model costs torch.fx graphs (``call_module`` leaves such
  as ``nn.Linear``) and torch.export graphs (aten ops) alike.
- **CostModel**: turns a NodeCall into an :class:`~rpcompile.passes.cost.cost_model.OpEstimate` (times, optionally
  FLOPs). Two implement it: :class:`~rpcompile.passes.cost.measured.MeasuredCostModel` times nodes on the device
  at hand; :class:`~rpcompile.passes.cost.analytic.AnalyticCostModel` predicts them from FLOPs and bytes for a named
  :class:`~rpcompile.core.specs.DeviceSpec`.

:func:`cost_pass` drives a cost model over a graph (its docstring says how nodes are run, batched, shared and
cached). The data types and the CostModel interface (NodeCost, OpEstimate, NodeCall, Materialized, CostModel,
COST_KEY, DTYPE_KEY, node_cost) live in :mod:`.cost_model`, the node-by-node interpreter in :mod:`.cost_interp`;
the public names are re-exported here.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rpcompile.core.batch import flat_inputs

from ..graph.portable import device_of, running_on
from ..graph.precision import recorded_dtype
from ..graph.reuse import RunMemo, all_meta
from ..graph.shape import SHAPE_KEY
from ..graph.util import is_compute
from . import profile_cache
from .cost_interp import CostInterpreter
from .cost_model import COST_KEY, DTYPE_KEY, CostModel, Materialized, NodeCall, NodeCost, OpEstimate, node_cost
from .repeats import repeat_map

__all__ = [
    "cost_pass",
    "cost_from_cache",
]


def _progress(total: int, label: str, enabled: bool):  # pragma: no cover - terminal UI
    """A transient progress bar on stderr (stdout stays the command's output: tables, JSON)."""
    bar = Progress(
        TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
        TimeRemainingColumn(), transient=True, disable=not enabled, console=Console(stderr=True),
    )
    return bar, bar.add_task(label, total=total)


def cost_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    cost_model: CostModel,
    progress: bool | None = None,
    share: bool | None = None,
    cache: bool | None = None,
    memo: RunMemo | None = None,
) -> fx.GraphModule:
    """Write a :class:`~rpcompile.passes.cost.cost_model.NodeCost` into ``node.meta["rpcompile.cost"]`` for every compute node of ``gm``.

    ``progress`` shows a progress bar with an estimate of the time left (default: when stderr is a terminal and
    not under CI). ``share`` measures each repeated block once (default: the cost model's ``share_repeats``);
    ``cache`` reads and writes measured times on disk (default: the cost model's ``cache``). Buffers mutated by
    the graph (BatchNorm statistics) are restored afterwards. Also fills ``rpcompile.shape`` where missing.
    Counts land in ``gm.meta["rpcompile.profiling"]`` (nodes measured, shared, batches, whether the cache hit).
    ``memo`` (analytic costs on ``meta``): nodes the same as in the run it recorded take their recorded costs
    instead of running (:mod:`rpcompile.passes.graph.reuse`; every cost as a full run gives it); a first run records
    them.

    The driver runs the graph once on the model's own device (``meta`` for shape-only models) to get every node's
    inputs. Independently of the cost model it runs each node once more on ``meta`` with autograd on, to count FLOPs
    (``FlopCounterMode``, exact for matmul/conv/attention) and to see which tensors autograd saves
    (``saved_tensors_hooks``): a saved tensor is attributed to the node that produced it, parameters excluded.

    Measuring is batched and shared: nodes go to the cost model a block at a time (:meth:`CostModel.estimate_batch
    <rpcompile.passes.cost.cost_model.CostModel.estimate_batch>`: one device synchronisation per batch on CUDA), and a
    cost model with ``share_repeats`` measures each repeated block (:mod:`.repeats`: same module type, parameter shapes
    and node sequence) once, its repeats taking the representative's times. A cost model with ``cache`` keeps its times
    on disk (:mod:`.profile_cache`) and a warm entry skips measuring altogether.
    """
    enabled = (sys.stderr.isatty() and not os.environ.get("CI")) if progress is None else progress
    share = getattr(cost_model, "share_repeats", False) if share is None else share
    cache = getattr(cost_model, "cache", False) if cache is None else cache
    n_compute = sum(1 for n in gm.graph.nodes if is_compute(n))
    # the driver runs the graph for real: a BatchNorm's running statistics would move (meta buffers hold no values)
    saved = {name: b.detach().clone() for name, b in gm.named_buffers() if b.device.type != "meta"}
    flat = flat_inputs(gm, example_inputs, example_kwargs)
    compute = [n for n in gm.graph.nodes if is_compute(n)]
    key, entry = _cache_entry(gm, flat, cost_model, compute) if cache else (None, None)
    # the entry holds costs, not shapes: a node without a shape still needs the graph run
    if entry is not None and all(n.meta.get(SHAPE_KEY) is not None for n in compute):
        return _warm(gm, cost_model, entry, compute)  # the graph does not run at all
    label = f"profiling ({cost_model.name}{', cached' if entry is not None else ''})"
    bar, task = _progress(n_compute, label, enabled)
    # the device warm-up (prepare) clears .grad; the caller's gradients are put back below
    grads = {name: p.grad for name, p in gm.named_parameters()}
    try:
        # random nodes (dropout) draw while costing: the caller's CPU generator is left where it was
        with torch.random.fork_rng(devices=[]), bar:
            if entry is None:
                cost_model.prepare(gm, flat)
            interp = _drive(gm, flat, cost_model, lambda: bar.advance(task), share and entry is None,
                            entry.nodes if entry is not None else None, memo)
            calibration = getattr(cost_model, "calibration", None)
            if entry is not None:
                totals = entry.calibration
            else:
                totals = calibration(gm, flat) if calibration is not None else None
    finally:
        with torch.no_grad():
            for name, b in gm.named_buffers():
                if name in saved:
                    b.copy_(saved[name])
            for name, p in gm.named_parameters():
                p.grad = grads.get(name)
    for n, fields in interp.partial.items():
        # a node whose output some backward reads keeps it: known only once every user has run, so added here
        if n in interp.kept:
            fields["act_bytes"] += fields["output_bytes"]
    if key is not None and entry is None:
        # times before calibration: the entry keeps the totals beside them and _warm calibrates again on load
        raw = {n.name: dict(f) for n, f in interp.partial.items()}
        profile_cache.store(key, profile_cache.CacheEntry(raw, totals))
    gm.meta["rpcompile.profiling"] = {"nodes": n_compute, "measured": interp.measured, "shared": len(interp.shared),
                                      "batches": interp.batches, "cache_hit": entry is not None}
    return _write(gm, cost_model, interp.partial, totals)


def cost_from_cache(gm: fx.GraphModule, example_inputs: Sequence[Any] = (),
                    example_kwargs: Mapping[str, Any] | None = None, *, cost_model: CostModel) -> bool:
    """:func:`cost_pass` from a warm profile cache only: every compute node's :class:`~rpcompile.passes.cost.cost_model.NodeCost` written from the
    cache's entry, without running the graph or reading its weights (they may be uninitialised storage in the
    compute dtype: a Llama-3-8B in CPU memory is not cast for a lookup). False, and nothing written, when the cost
    model keeps no cache, a node has no shape yet, or there is no sound entry (:func:`cost_pass` then measures,
    and says why an entry was refused)."""
    compute = [n for n in gm.graph.nodes if is_compute(n)]
    if not getattr(cost_model, "cache", False) or any(n.meta.get(SHAPE_KEY) is None for n in compute):
        return False
    _, entry = _cache_entry(gm, flat_inputs(gm, example_inputs, example_kwargs), cost_model, compute, quiet=True)
    if entry is None:
        return False
    _warm(gm, cost_model, entry, compute)
    return True


def _cache_entry(gm: fx.GraphModule, flat: list[Any], cost_model: CostModel, compute: list[fx.Node], *,
                 quiet: bool = False) -> tuple[dict[str, Any], profile_cache.CacheEntry | None]:
    """The profile cache's key for ``gm`` on these inputs and cost model, and its sound entry or None."""
    key = profile_cache.profile_key(gm, flat, cost_model.identity())
    fields = set(NodeCost.__dataclass_fields__)
    return key, profile_cache.load_profile(key, {n.name for n in compute}, fields, quiet=quiet)


def _warm(gm: fx.GraphModule, cost_model: CostModel, entry: profile_cache.CacheEntry,
          compute: list[fx.Node]) -> fx.GraphModule:
    """Every cost from the cache's ``entry``."""
    gm.meta["rpcompile.profiling"] = {"nodes": len(compute), "measured": 0, "shared": 0, "batches": 0,
                                      "cache_hit": True}
    return _write(gm, cost_model, {n: dict(entry.nodes[n.name]) for n in compute}, entry.calibration)


def _drive(gm: fx.GraphModule, flat: list[Any], cost_model: CostModel, on_node: Callable[[], None], share: bool,
           cached: dict[str, dict[str, Any]] | None, memo: RunMemo | None = None) -> CostInterpreter:
    """Run the graph node by node, costing each compute node. On the cost model's :meth:`CostModel.drive_device <rpcompile.passes.cost.cost_model.CostModel.drive_device>`
    when it names one; if that device runs out of memory holding the values, again where the graph is.
    ``memo``: used when nothing is measured (no calibration, no cache entry) and every value is on meta."""
    drive = cost_model.drive_device(gm, flat)
    # a recorded run stands in only when costs depend on shapes alone: all on meta, nothing measured
    reusable = (memo is not None and drive is None and cached is None
                and getattr(cost_model, "calibration", None) is None
                and all_meta([*flat, *gm.parameters(), *gm.buffers()]))
    for where in ([drive, None] if drive is not None else [None]):
        reuse = memo.session(gm, "cost", _memo_key(cost_model, gm, share)) if reusable and memo is not None else None
        values = memo.values(gm) if reusable and memo is not None else None
        interp = CostInterpreter(gm, cost_model, on_node, share=repeat_map(gm) if share else None, cached=cached,
                                 drive=where, reuse=reuse, values=values)
        try:
            # no_grad: this run only makes the values; each node's autograd profile turns grad on for itself
            with torch.no_grad(), running_on(where or device_of(gm, flat)):
                interp.run(*flat, enable_io_processing=False)
                interp.finish()
            interp.record()
            return interp
        # BaseException: an interrupted recording must not leave a half-filled memo behind
        except BaseException as err:
            if reuse is not None:
                reuse.failed()
            if not isinstance(err, torch.OutOfMemoryError):
                raise
            if where is None:
                raise
            # the failed run's copies on the device go before the graph runs again
            del interp
            warnings.warn(f"profiling: {where} ran out of memory holding the graph's values; running the graph "
                          "where it is instead (slower)", stacklevel=3)
    raise AssertionError("unreachable")


def _memo_key(cost_model: CostModel, gm: fx.GraphModule, share: bool) -> tuple:
    """What a run's costs depend on besides its nodes: the cost model (its kind, spec and dtype), the dtype bytes
    are scaled to, and whether repeats share."""
    return (type(cost_model).__module__, type(cost_model).__qualname__, repr(cost_model),
            repr(getattr(cost_model, "spec", None)), repr(cost_model.identity()), str(recorded_dtype(gm.meta)), share)


def _write(gm: fx.GraphModule, cost_model: CostModel, partial: dict[fx.Node, dict[str, Any]],
           totals: tuple[float, float] | None) -> fx.GraphModule:
    """Calibrate the times to the whole-graph ``totals`` and write every node's :class:`~rpcompile.passes.cost.cost_model.NodeCost`."""
    if totals is not None:
        _calibrate(gm, partial, *totals)
    for n, fields in partial.items():
        n.meta[COST_KEY] = NodeCost(**fields)
    gm.meta["rpcompile.cost_model"] = cost_model.name
    # the dtype the shapes' byte counts are scaled to: none when they were recorded in the compute dtype
    gm.meta[DTYPE_KEY] = None if recorded_dtype(gm.meta) is not None else getattr(cost_model, "dtype", None)
    return gm


#: Calibration factors outside this range mean the whole-graph run measured something else (a cold start, a
#: graph with a data-dependent branch); node times are then kept as measured.
CALIBRATION_RANGE = (0.5, 4.0)
#: Below this whole-graph step time a mismatch is expected (timer and call overheads) and not warned about.
CALIBRATION_MIN_STEP_S = 0.01


def _calibrate(gm: fx.GraphModule, partial: dict, forward_s: float, step_s: float) -> None:
    """Scale node forward times to the whole graph's forward and backward times to the rest of its step;
    the factors are kept in ``gm.meta["rpcompile.calibration"]``."""
    fwd = sum(f["fwd_time_s"] for f in partial.values())
    bwd = sum(f["bwd_time_s"] for f in partial.values())
    # no ratio to take: nothing was timed on one side (a graph with nothing to differentiate)
    if fwd <= 0 or bwd <= 0:
        return
    lo, hi = CALIBRATION_RANGE
    # the step is a forward with grad plus the backward: what is left after the forward is the backward's share
    factors = {"forward": forward_s / fwd, "backward": (step_s - forward_s) / bwd}
    if not all(lo <= f <= hi for f in factors.values()):
        gm.meta["rpcompile.calibration"] = {**factors, "applied": False}
        if step_s < CALIBRATION_MIN_STEP_S:
            return  # microsecond graphs: per-call timing overhead, not the machine, explains the mismatch
        warnings.warn(
            f"measured node times do not add up to a whole-graph step (forward ×{factors['forward']:.2f}, backward "
            f"×{factors['backward']:.2f}): the machine was probably busy while profiling, and plans made from these "
            "costs may be poor; profile on an idle machine, or plan from analytic costs (spec=...)",
            RuntimeWarning, stacklevel=2)
        return
    for f in partial.values():
        f["fwd_time_s"] *= factors["forward"]
        f["bwd_time_s"] *= factors["backward"]
    gm.meta["rpcompile.calibration"] = {**factors, "applied": True}
