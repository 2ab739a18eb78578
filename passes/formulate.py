"""The problem pass: a costed, coarsened graph → a :class:`~rpcompile.passes.solver.problem.PartitionProblem` of plain
numbers (per segment: times, activation and weight bytes; the hardware; the microbatch count) for the solvers.

**Launch-bound segments.** A GPU runs a stage's kernels as the host issues them, and the host issues one graph
node at a time (the stage's generated Python, PyTorch's dispatcher, the launch: ``DeviceSpec.dispatch_s``, and
``backward_dispatch_s`` per node of a backward). A segment's time on the device is therefore the longer of its
kernels and its dispatch (:func:`launch_bound`): on the H100 the Qwen3-1.7B shape's forward at 2,048 tokens a
microbatch computed 0.5 ms of kernels per decoder layer while its host took 2.3 ms to issue them (RESULTS.md,
2026-11-28). The bound is taken per segment (attention and MLP halves by default): within one the host runs
ahead of long kernels while short ones queue, between the node-by-node sum of the two (too slow: the queue hides
dispatch behind long kernels) and a whole stage's maximum (too fast: a long matmul early in a stage does not hide
the dispatch of elementwise work much later). Every consumer — the solvers' tables, the timing model, the
simulator — reads the segment times, so they all price it alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch.fx as fx

from rpcompile.core.plan import Hardware
from rpcompile.core.precision import PRECISION_BYTES
from rpcompile.core.specs import HostSpec
from rpcompile.core.stages import HostLoad

from rpcompile.passes.cost.cost_model import COST_KEY, DTYPE_KEY
from .cost.loss_memory import LOSS_BYTES_KEY
from .graph.shape import SHAPE_KEY, scaled_nbytes
from .rewrite.coarsen import Segment, segments_of
from .rewrite.dequantize import dequantizations, derived_bytes
from .rewrite.host import host_of
from .solver.problem import PartitionProblem, SharedParam

__all__ = ["partition_problem", "host_load", "launch_bound"]


def partition_problem(
    gm: fx.GraphModule,
    *,
    hardware: Hardware,
    microbatches: int,
    precision: str = "fp32",
    stage_overhead_s: float | None = None,
    allow_save: bool = True,
    allow_stay: bool = True,
    overlap_step: bool = False,
    overlap_iterations: bool = False,
) -> PartitionProblem:
    """Lower a coarsened graph to plain numbers. Parameters read by several segments (tied embeddings) become
    :class:`~rpcompile.passes.solver.problem.SharedParam` objects: every stage that uses one receives it, and its gradient is summed over them. The host's
    work (:func:`host_load`) is priced for every trainable parameter on ``hardware.host``;
    ``overlap_step``: the optimizer step runs beside the next iteration; ``overlap_iterations``: the devices run on
    into it too, and the plan is priced by the steady-state period (:attr:`HostLoad.overlap_iterations <rpcompile.core.stages.HostLoad.overlap_iterations>`)."""
    segs = segments_of(gm)
    elt = PRECISION_BYTES[precision]
    params = dict(gm.named_parameters())
    # which segments read each parameter: one reader makes it that segment's own, several a SharedParam
    users: dict[str, list[int]] = {}
    for s in segs:
        for pname in s.params:
            users.setdefault(pname, []).append(s.index)
    own_bytes, own_grads = [0] * len(segs), [0] * len(segs)
    shared = []
    for name, segments in users.items():
        p = params[name]
        # a weight that is not floating (a 4-bit base's packed indices and scales) goes up as it is stored
        size = p.numel() * (elt if p.is_floating_point() else p.element_size())
        # a frozen weight sends no gradient home; its gradient is as large as what went up
        grad = size if p.requires_grad else 0
        if len(segments) == 1:
            own_bytes[segments[0]] += size
            own_grads[segments[0]] += grad
        else:
            shared.append(SharedParam(name=name, bytes=size, grad_bytes=grad, segments=tuple(segments)))
    spec = hardware.spec
    dq_s, dq_bytes, dq_kept = _dequantizations(gm, segs, elt)
    # a stage's dequantizations run once: 1/m of them per microbatch, in the forward and in the backward time (a
    # backward stage dequantizes whether it recomputes or not), not in the recompute
    once = tuple(d / microbatches for d in dq_s)
    fwd = tuple(launch_bound(s.fwd_s - d + o, len(s.nodes), spec.dispatch_s) for s, d, o in zip(segs, dq_s, once))
    # a recompute finds the weights already dequantized in the stage's prologue: none of that time is in it
    rec = fwd if not any(dq_s) else tuple(launch_bound(s.fwd_s - d, len(s.nodes), spec.dispatch_s)
                                          for s, d in zip(segs, dq_s))
    return PartitionProblem(
        names=tuple(s.name for s in segs),
        layer=tuple(s.layer for s in segs),
        fwd_s=fwd,
        # the dispatch bound counts the ops that have a backward (backward_ops), not every node
        bwd_s=tuple(launch_bound(s.bwd_s + o, s.backward_ops, spec.backward_dispatch_s) for s, o in zip(segs, once)),
        rec_s=rec,
        # a loss that runs after the graph (the whole LM head) runs in the fused stage, which always holds the last
        # segment: its peak bytes count there (:mod:`.cost.loss_memory`)
        # less the dequantized weights autograd keeps: held by the stage (derived_bytes), never saved per microbatch
        act_bytes=tuple(s.act_bytes - kept + (int(gm.meta.get(LOSS_BYTES_KEY, 0)) if s is segs[-1] else 0)
                        for s, kept in zip(segs, dq_kept)),
        peak_bytes=tuple(s.peak_bytes for s in segs),
        transient_bytes=tuple(s.transient_bytes for s in segs),
        boundary_bytes=tuple(s.boundary_bytes for s in segs),
        input_bytes=int(gm.meta.get("rpcompile.input_bytes", 0)),
        input_grad_bytes=_host_grad_bytes(gm),
        param_bytes=tuple(own_bytes),
        grad_bytes=tuple(own_grads),
        derived_bytes=dq_bytes,
        shared=tuple(shared),
        device_count=hardware.device_count,
        memory_bytes=hardware.memory_bytes,
        link_bytes_per_s=hardware.link_bytes_per_s,
        microbatches=microbatches,
        stage_overhead_s=hardware.spec.stage_overhead_s if stage_overhead_s is None else stage_overhead_s,
        allow_save=allow_save,
        resident_handoffs=hardware.resident_handoffs,
        allow_stay=allow_stay,
        host=host_load(hardware.host, trainable_params=sum(p.numel() for p in params.values() if p.requires_grad),
                       precision=precision, overlap_step=overlap_step, overlap_iterations=overlap_iterations,
                       nodes=hardware.nodes,
                       network_bytes_per_s=hardware.network_bytes_per_s,
                       # a table no segment reads lives on the host alone: its gradient is reduced from there
                       host_params=sum(params[h.weight].numel() for h in host_of(gm)
                                       if h.weight not in users and params[h.weight].requires_grad)),
    )


def _dequantizations(gm: fx.GraphModule, segs: Sequence[Segment],
                     elt: int) -> tuple[tuple[float, ...], tuple[int, ...], tuple[int, ...]]:
    """Per segment: the time of its dequantizations (one microbatch's, as the cost model priced them), the bytes
    of their results (module docstring) and what of those its ``act_bytes`` counts (autograd keeps a linear
    layer's weight for its input's gradient: the cost model counts it as the dequantization's kept output)."""
    deq = {n.name: n for n in dequantizations(gm, planning=True)}
    if not deq:
        return (0.0,) * len(segs), (0,) * len(segs), (0,) * len(segs)
    times, held, kept = [], [], []
    for s in segs:
        mine = [deq[n] for n in s.nodes if n in deq]
        costs = [n.meta[COST_KEY] for n in mine if COST_KEY in n.meta]
        times.append(sum(c.fwd_time_s for c in costs))
        held.append(sum(derived_bytes(n, elt) for n in mine))
        # never more than the segment's own act_bytes, from which it is subtracted
        kept.append(min(s.act_bytes, sum(c.act_bytes for c in costs)))
    return tuple(times), tuple(held), tuple(kept)


def host_load(host: HostSpec | None, *, trainable_params: int, precision: str,
              overlap_step: bool = False, nodes: int = 1, network_bytes_per_s: float = 0.0,
              host_params: int = 0, overlap_iterations: bool = False) -> HostLoad:
    """What ``host`` spends on ``trainable_params`` fp32 masters per iteration (none when ``host`` is unknown).

    The step is torch's AdamW (``optimizer_params_per_s``); the refresh casts every trainable master into its
    pinned compute-precision copy (``cast_params_per_s``; fp32 plans copy 4 B read + 4 B written at the memory
    bandwidth). Gradients arrive in compute precision and are added into fp32 ``.grad``. ``nodes`` machines
    (``network_bytes_per_s`` each; 0: unknown, free) all-reduce those fp32 gradients, ``host_params`` of them
    from tables only the host reads. ``overlap_iterations``: the devices run on into the next iteration (implies
    ``overlap_step``)."""
    elt = 4 if precision == "fp32" else 2
    # reduce_bytes_per_grad_byte: the reduction sums fp32 gradients, 4 / elt bytes per compute-precision byte
    net = HostLoad(overlap_step=overlap_step or overlap_iterations, overlap_iterations=overlap_iterations, nodes=nodes,
                   network_bytes_per_s=network_bytes_per_s or math.inf, reduce_bytes_per_grad_byte=4 / elt,
                   host_grad_bytes=host_params * elt)
    if host is None:
        return net
    n = max(0, int(trainable_params))
    # fp32: the refresh is a plain copy, 4 B read and 4 B written per parameter
    refresh = n * 8 / host.memory_bandwidth if elt == 4 else n / host.cast_params_per_s
    # accumulate_traffic, per arriving byte: the fp32 .grad read and written (2 * 4 B) plus the gradient (elt B)
    return dataclasses.replace(net, accumulate_bytes_per_s=host.accumulate_params_per_s * elt,
                               accumulate_traffic=(2 * 4 + elt) / elt, optimizer_s=n / host.optimizer_params_per_s,
                               refresh_s=refresh)


def launch_bound(kernels_s: float, nodes: int, dispatch_s: float) -> float:
    """A segment's time on the device (module docstring): its ``kernels_s`` (the cost model's time of its nodes),
    or the host's time to issue its ``nodes`` at ``dispatch_s`` each when that is longer."""
    return max(kernels_s, nodes * dispatch_s)


def _host_grad_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the gradients of the rows the host looks up in trainable tables (per microbatch)."""
    params = dict(gm.named_parameters())
    values = {h.value for h in host_of(gm) if params[h.weight].requires_grad}
    # aliases=True: a placeholder counts in full (as _nbytes in coarsen.py does for model inputs)
    return sum(scaled_nbytes(n.meta[SHAPE_KEY], gm.meta.get(DTYPE_KEY), aliases=True)
               for n in gm.graph.find_nodes(op="placeholder") if n.name in values and SHAPE_KEY in n.meta)
