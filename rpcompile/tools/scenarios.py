"""What to simulate: action lists and per-position costs for every schedule, from one cost model.

- :func:`from_plan` — a saved :class:`~rpcompile.core.plan.Plan` on its own hardware (round-robin);
- :func:`from_segment_plan` — a partitioner result (``ilp``, ``roundpipe``, …) on a :class:`~rpcompile.passes.solver.problem.PartitionProblem`;
- :func:`static_scenarios` — the classic static-binding pipelines on the same problem: GPipe and 1F1B with one
  stage per device, interleaved 1F1B with ``chunks`` stages per device. They keep weights, gradients, optimizer
  state and every in-flight microbatch's activations on the device (no streaming, no recompute), hand
  activations between devices through host memory, and take a time-balanced contiguous partition of the layers
  (the best static partition, as torchgpipe's ``balance_by_time`` aims for);
- :func:`overlapped` — a round-robin scenario with its iterations overlapped (``pipe.step(optimizer,
  overlap=True)`` once devices run on into the next iteration): the simulator plays several and reports the
  steady state;
- :func:`layer_profile_scenarios` — a published per-layer profile such as the RoundPipe paper's simulator inputs
  (``benchmarks/data/roundpipe-simulator-inputs.json``): every schedule with the file's own partitions, plus
  ``ilp`` (rpcompile's partitioner on the same layer costs, layer granularity, no memory limit, full recompute
  like the paper's round-robin).

Every scenario runs on :func:`~rpcompile.runtime.sim.simulator.simulate`, so all comparisons share one clock, and
describes its chain positions with the timing model's own :class:`~rpcompile.core.stages.StageCost`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from rpcompile.core.errors import RPCompileError, SimulationError
from rpcompile.core.files import read_json
from rpcompile.core.planfile import MAX_MICROBATCHES
from rpcompile.core.schedule import Action, gpipe, interleaved_one_f_one_b, one_f_one_b, round_robin
from rpcompile.core.stages import HostLoad, StageCost, StageKind
from rpcompile.passes.formulate import host_load
from rpcompile.passes.solver.baselines import layer_ranges
from rpcompile.passes.solver.partition import solve
from rpcompile.passes.solver.problem import PartitionProblem
from rpcompile.passes.solver.timing import save_reads, stage_costs
from rpcompile.runtime.sim.sim_result import SimResult
from rpcompile.runtime.sim.simulator import simulate

__all__ = [
    "Scenario",
    "SCHEDULES",
    "overlapped",
    "from_plan",
    "from_segment_plan",
    "static_scenarios",
    "balanced_ranges",
    "load_layer_profile",
    "layer_profile_scenarios",
    "layer_profile_problem",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "roundpipe", "ilp")
"""Schedule names, in the order tables show them."""

#: Optimizer state a static pipeline keeps on the device per weight byte: Adam's two moments, plus an fp32
#: master copy when weights are 16-bit (mixed-precision Adam: 2 + 4 + 4 + 4 bytes per parameter).
_OPTIMIZER_STATE_PER_WEIGHT_BYTE = {"fp32": 2.0, "bf16": 6.0, "fp16": 6.0}


@dataclass(frozen=True)
class Scenario:
    """One schedule ready to simulate."""

    name: str
    lists: list[list[Action]]
    stages: list[StageCost]
    link_bytes_per_s: float = math.inf
    host_bytes_per_s: float = math.inf
    memory_limit_bytes: int | None = None
    tokens_per_iteration: int = 0
    copies_wait_for_memory: bool = True
    notes: dict[str, Any] = field(default_factory=dict)
    host: HostLoad = HostLoad()
    """The host's own work (gradient accumulation, optimizer step); none by default."""

    @property
    def stage_count(self) -> int:
        """Stages of the schedule (a static stage's forward and backward halves count once)."""
        # a static schedule lists each stage twice, as a forward and a backward chain position
        static = any(s.releases >= 0 for s in self.stages)
        return len(self.stages) // 2 if static else len(self.stages)

    def run(self) -> SimResult:
        return simulate(self.lists, self.stages, link_bytes_per_s=self.link_bytes_per_s,
                        host_bytes_per_s=self.host_bytes_per_s, memory_limit_bytes=self.memory_limit_bytes,
                        copies_wait_for_memory=self.copies_wait_for_memory,
                        tokens_per_iteration=self.tokens_per_iteration, host=self.host)


# ---------------------------------------------------------------------------------------------- round-robin
def from_plan(plan: Any, *, host_bytes_per_s: float = math.inf) -> Scenario:
    """The round-robin schedule of a saved plan, with its stages' transfer figures (schema 2). A version-1 plan
    has none: its stages run for their predicted ``time_s`` and transfers are not simulated."""
    hw, m = plan.hardware, plan.microbatches
    stages = []
    # node → the forward stage that offloads its saved activation; a backward stage waits for those saves
    savers = {node: k for k, s in enumerate(plan.stages) if s.kind == "forward" and s.offload_bytes
              for node in s.saved}
    for s in plan.stages:
        # a version-1 plan records only time_s: it then stands in for the compute
        detailed = s.compute_s > 0 or s.weight_bytes > 0
        saved_by = tuple(sorted({savers[x] for x in s.saved if x in savers})) if s.kind == "backward" else ()
        stages.append(StageCost(  # the plan's compute_s includes the per-stage overhead
            name=s.name, kind=s.kind, compute_s=s.compute_s if detailed else s.time_s,
            weight_bytes=s.weight_bytes, grad_bytes=s.grad_bytes, input_bytes=s.upload_bytes,
            prefetch_bytes=s.prefetch_bytes, output_bytes=s.download_bytes, offload_bytes=s.offload_bytes,
            working_bytes=s.working_bytes, saved_by=saved_by, microbatches=m, found_bytes=s.found_bytes,
            kept_bytes=s.kept_bytes, held_bytes=s.held_bytes, refreshes=plan.resident and s.weight_bytes > 0,
        ))
    lists = round_robin([s.kind for s in plan.stages], hw.device_count, m)
    p = plan.predicted  # the host's rates from the plan's host, its step as the plan predicted it
    host = dataclasses.replace(host_load(hw.host, trainable_params=0, precision=plan.precision, nodes=hw.nodes,
                                         network_bytes_per_s=hw.network_bytes_per_s),
                               optimizer_s=p.optimizer_s, refresh_s=p.refresh_s, overlap_step=p.overlap_step,
                               overlap_iterations=p.overlap_iterations)
    return Scenario(plan.strategy, lists, stages, link_bytes_per_s=hw.link_bytes_per_s,
                    host_bytes_per_s=host_bytes_per_s, memory_limit_bytes=hw.memory_bytes,
                    tokens_per_iteration=plan.tokens_per_microbatch * m, host=host)


def from_segment_plan(problem: Any, plan: Any, *, name: str, tokens_per_iteration: int = 0,
                      host_bytes_per_s: float = math.inf, handoff_s: float | None = None) -> Scenario:
    """The round-robin schedule of a partitioner's :class:`~rpcompile.passes.solver.problem.SegmentPlan` (stage figures from ``stage_costs``).
    ``handoff_s``: a fixed activation hand-off time per microbatch into every stage but the first, instead of
    the byte model (published profiles give it that way)."""
    m, link = problem.microbatches, problem.link_bytes_per_s
    costs = stage_costs(problem, plan)
    f = len(plan.forward)
    names = [f"F{k}" for k in range(f)] + ["FB"] + [f"B{k}" for k in range(1, len(costs) - f)]
    stages = [dataclasses.replace(c, name=n, saved_by=saved_by)
              for c, n, saved_by in zip(costs, names, save_reads(costs, plan.saved))]
    if handoff_s is not None:  # the profile's hand-off replaces the byte model entirely
        stages = [dataclasses.replace(s, input_bytes=0, output_bytes=0, prefetch_bytes=0, offload_bytes=0,
                                      weight_bytes=0, grad_bytes=0, saved_by=(), working_bytes=s.device_working_bytes,
                                      upload_s=handoff_s if k > 0 else None) for k, s in enumerate(stages)]
    lists = round_robin([s.kind for s in stages], problem.device_count, m)
    return Scenario(name, lists, stages, link_bytes_per_s=link if handoff_s is None else math.inf,
                    host_bytes_per_s=host_bytes_per_s, memory_limit_bytes=problem.memory_bytes,
                    tokens_per_iteration=tokens_per_iteration, host=problem.host if handoff_s is None else HostLoad())


def overlapped(scenario: Scenario) -> Scenario:
    """``scenario`` with overlapped iterations (:attr:`HostLoad.overlap_iterations <rpcompile.core.stages.HostLoad.overlap_iterations>`, one step stale): its run plays
    several iterations and reports the steady-state period. A static schedule (stages resident on their devices,
    no pointer to carry on) is returned as it is."""
    if any(s.releases >= 0 or s.resident_bytes or s.stash_bytes for s in scenario.stages):
        return scenario
    host = dataclasses.replace(scenario.host, overlap_step=True, overlap_iterations=True)
    return dataclasses.replace(scenario, host=host)


# ---------------------------------------------------------------------------------------------- static
def balanced_ranges(costs: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Split ``costs`` into ``parts`` contiguous non-empty runs minimising the largest run's sum (exact DP)."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    # best[p][i]: the least largest run sum over splits of the first i costs into p runs; cut[p][i]: where its last run
    # starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        # i leaves at least one cost for each later run, and j at least one for each earlier run
        for i in range(p, n - (parts - p) + 1):
            for j in range(p - 1, i):
                v = max(best[p - 1][j], prefix[i] - prefix[j])
                if v < best[p][i]:
                    best[p][i], cut[p][i] = v, j
    out, i = [], n
    for p in range(parts, 0, -1):
        out.append((cut[p][i], i))
        i = cut[p][i]
    return out[::-1]


def static_scenarios(problem: Any, *, chunks: int = 2, precision: str = "bf16", tokens_per_iteration: int = 0,
                     host_bytes_per_s: float = math.inf, schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved-1f1b"),
                     ) -> dict[str, Scenario]:
    """GPipe, 1F1B and interleaved 1F1B (``chunks`` stages per device) on ``problem``'s segments, partitioned at
    layer boundaries to balance forward + backward time."""
    n_dev, m = problem.device_count, problem.microbatches
    layers = layer_ranges(problem)
    layer_cost = [sum(problem.fwd_s[i] + problem.bwd_s[i] for i in range(a, b)) for a, b in layers]
    opt = _OPTIMIZER_STATE_PER_WEIGHT_BYTE.get(precision, 6.0)
    out = {}
    for name in schedules:
        v = chunks if name == "interleaved-1f1b" else 1
        parts = min(n_dev * v, len(layers))
        if parts < n_dev * v:
            continue  # fewer layers than virtual stages: this schedule does not apply
        groups = balanced_ranges(layer_cost, parts)
        # layer indices back to segment indices: from the first layer's first segment to the last layer's end
        ranges = [(layers[a][0], layers[b - 1][1]) for a, b in groups]
        stages = _static_stages(problem, ranges, n_dev, opt)
        if name == "gpipe":
            lists = gpipe(n_dev, m)
        elif name == "1f1b":
            lists = one_f_one_b(n_dev, m)
        else:
            # interleaved 1F1B (as Megatron-LM's) needs microbatches a multiple of devices: skipped, not refused
            if m % n_dev:
                continue
            lists = interleaved_one_f_one_b(n_dev, m, v)
        out[name] = Scenario(name, lists, stages, link_bytes_per_s=problem.link_bytes_per_s,
                             host_bytes_per_s=host_bytes_per_s, memory_limit_bytes=problem.memory_bytes,
                             tokens_per_iteration=tokens_per_iteration, copies_wait_for_memory=False,
                             notes={"stages_per_device": v})
    return out


def _static_stages(pb: Any, ranges: list[tuple[int, int]], n_dev: int, opt: float) -> list[StageCost]:
    """Chain positions ``F_0..F_{V-1}, B_{V-1}..B_0`` of a static pipeline over segment ``ranges``."""
    V = len(ranges)
    fwd, bwd = [], []
    for s, (a, b) in enumerate(ranges):
        w, g = pb.weight(a, b), pb.weight(a, b, grads=True)
        seg = range(a, b)
        inb, outb = pb.in_bytes(a), pb.boundary_bytes[b - 1]
        cross_in = s > 0 and (s - 1) % n_dev != s % n_dev  # the previous virtual stage lives elsewhere
        cross_out = s < V - 1 and (s + 1) % n_dev != s % n_dev
        fwd.append(StageCost(  # its input is a buffer of its own only when it comes from another device
            name=f"F{s}", kind="forward", compute_s=sum(pb.fwd_s[i] for i in seg), overhead_s=pb.stage_overhead_s,
            input_bytes=inb if cross_in else 0, output_bytes=outb if cross_out else 0,
            working_bytes=inb + outb + max(pb.peak_bytes[i] for i in seg),
            resident_bytes=w + g + opt * w, stash_bytes=sum(pb.act_bytes[i] for i in seg),
        ))
        bwd.append(StageCost(
            name=f"B{s}", kind="backward", compute_s=sum(pb.bwd_s[i] for i in seg), overhead_s=pb.stage_overhead_s,
            input_bytes=outb if cross_out else 0, output_bytes=inb if cross_in else 0,
            working_bytes=inb + outb, releases=s,
        ))
    return fwd + bwd[::-1]


# ---------------------------------------------------------------------------------------------- layer profiles
_PROFILE_TIMES = ("fwd_ms_per_layer", "bwd_ms_per_layer", "head_fwd_ms", "head_bwd_ms", "comm_ms")


def load_layer_profile(path: str | Path, model: str) -> tuple[dict[str, Any], int, int]:
    """``(entry, gpus, microbatches)`` for ``model`` from a RoundPipe-style simulator input file (milliseconds).
    Raises :class:`~rpcompile.RPCompileError` naming the models the file has, or the field that is missing."""
    try:
        data = read_json(path, max_bytes=64 << 20, max_depth=8)
    except OSError as e:
        raise RPCompileError(f"cannot read layer profile {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise RPCompileError(f"{path} is not a layer profile: {e}") from None
    models = data.get("models") if isinstance(data, Mapping) else None
    if not isinstance(models, Mapping):
        raise RPCompileError(f"{path} is not a layer profile: no 'models' object")
    if model not in models:
        raise RPCompileError(f"{path} has no model {model!r}; it has: {', '.join(map(str, models))}"[:400])
    entry = models[model]
    if not isinstance(entry, dict):
        raise RPCompileError(f"{path}: model {model!r} is not an object")
    for key in ("num_layers", *_PROFILE_TIMES):
        if key not in entry:
            raise RPCompileError(f"{path}: model {model!r} lacks {key!r}")
    checks = [(f"model {model!r}: {k}", entry[k], 0, 1e9, False) for k in _PROFILE_TIMES]
    checks += [(f"model {model!r}: num_layers", entry["num_layers"], 1, 1 << 14, True),
               ("num_gpus", data.get("num_gpus", 8), 1, 1 << 16, True),
               ("num_microbatches", data.get("num_microbatches", 16), 1, MAX_MICROBATCHES, True)]
    for what, v, least, most, whole in checks:
        if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) or not least <= v <= most:
            raise RPCompileError(f"{path}: {what} must be {'an integer' if whole else 'a number'} in [{least}, "
                                 f"{most:g}], found {repr(v)[:40]}")
    return entry, int(data.get("num_gpus", 8)), int(data.get("num_microbatches", 16))


def _counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip() != ""]


def layer_profile_scenarios(entry: Mapping[str, Any], *, devices: int, microbatches: int,
                            schedules: Sequence[str] = SCHEDULES, time_limit_s: float = 10.0,
                            static_recompute: bool = False, overlap: bool = False) -> dict[str, Scenario]:
    """Every schedule on a per-layer profile (see module docstring). Times in the entry are milliseconds.

    ``static_recompute``: the static schedules (GPipe, 1F1B, interleaved) recompute every layer's forward in its
    backward (full activation checkpointing; the LM head is not recomputed), as the RoundPipe paper's simulator
    does; with it these reproduce that simulator's makespans. Off (the default), they keep activations: the
    stronger baseline, 14–30% shorter on the paper's inputs (no memory limit applies to these profiles).
    ``overlap``: the round-robin schedules with overlapped iterations (:func:`overlapped`; ``ilp`` planned for
    their steady-state period), as the paper's asynchronous mode; the static ones stay synchronous."""
    ms = 1e-3
    L = int(entry["num_layers"])
    f, b = entry["fwd_ms_per_layer"] * ms, entry["bwd_ms_per_layer"] * ms
    hf, hb, comm = entry["head_fwd_ms"] * ms, entry["head_bwd_ms"] * ms, entry["comm_ms"] * ms
    parts = entry.get("partitions", {})
    out: dict[str, Scenario] = {}
    for name in schedules:
        if name in ("gpipe", "1f1b", "interleaved-1f1b"):
            if name not in parts:
                continue
            counts = _counts(parts[name])
            if sum(counts) != L:
                raise SimulationError(f"{name} partition {parts[name]!r} covers {sum(counts)} layers, not {L}")
            V = len(counts)
            # stage s runs on device s mod devices: each device must hold as many stages as the next
            if V % devices:
                raise SimulationError(f"{name} partition has {V} stages, not a multiple of {devices} devices")
            stages = []
            for s, c in enumerate(counts):  # forward positions; the last virtual stage holds the LM head
                head = s == V - 1
                stages.append(StageCost(name=f"F{s}", compute_s=c * f + (hf if head else 0.0),
                                        upload_s=comm if s > 0 and devices > 1 else None))
            for s in reversed(range(V)):
                head = s == V - 1
                per_layer = b + (f if static_recompute else 0.0)  # the paper's simulator: recompute, then backward
                # a backward stage's input comes from the stage after it; releases=s frees forward s's stash
                stages.append(StageCost(name=f"B{s}", kind="backward",
                                        compute_s=counts[s] * per_layer + (hb if head else 0.0),
                                        upload_s=comm if s < V - 1 and devices > 1 else None, releases=s))
            if name == "gpipe":
                lists = gpipe(devices, microbatches)
            elif name == "1f1b":
                lists = one_f_one_b(devices, microbatches)
            else:
                lists = interleaved_one_f_one_b(devices, microbatches, V // devices)
            out[name] = Scenario(name, lists, stages, notes={"partition": parts[name]})
        elif name == "roundpipe" and "roundpipe" in parts:
            fwd_text, bwd_text = parts["roundpipe"].split("|")
            fwd_counts, bwd_counts = _counts(fwd_text), _counts(bwd_text)
            top = L - sum(fwd_counts)  # layers the fused stage owns beside the head
            if bwd_counts[0] != top or sum(bwd_counts[1:]) != sum(fwd_counts):
                raise SimulationError(f"roundpipe partition {parts['roundpipe']!r} does not cover {L} layers")
            # full recompute, as RoundPipe runs: a backward stage pays its layers' forward again, the fused stage once
            comp = [c * f for c in fwd_counts] + [top * (f + b) + hf + hb] + [c * (f + b) for c in bwd_counts[1:]]
            forward: StageKind = "forward"
            backward: StageKind = "backward"
            kinds = [forward] * len(fwd_counts) + ["fused"] + [backward] * (len(bwd_counts) - 1)
            stages = [StageCost(name=str(k), kind=kd, compute_s=t, upload_s=comm if k > 0 and devices > 1 else None)
                      for k, (kd, t) in enumerate(zip(kinds, comp))]
            out[name] = Scenario(name, round_robin(kinds, devices, microbatches), stages,
                                 notes={"partition": parts["roundpipe"]})
            out[name] = overlapped(out[name]) if overlap else out[name]
        elif name in ("ilp", "dp"):
            pb = layer_profile_problem(entry, devices=devices, microbatches=microbatches)
            if overlap:
                pb = dataclasses.replace(pb, host=HostLoad(overlap_step=True, overlap_iterations=True))
            res = solve(pb, name, time_limit_s=time_limit_s)
            sc = from_segment_plan(pb, res.require_plan(), name=name, handoff_s=comm if devices > 1 else None)
            out[name] = Scenario(name, sc.lists, sc.stages, notes={"partition": _describe(res.plan, L),
                                                                   "solve_time_s": res.solve_time_s})
            out[name] = overlapped(out[name]) if overlap else out[name]
    return out


def layer_profile_problem(entry: Mapping[str, Any], *, devices: int, microbatches: int) -> Any:
    """The profile as a :class:`~rpcompile.passes.solver.problem.PartitionProblem`: one segment per layer plus the LM head, no bytes, no memory
    limit, and full recompute (``allow_save=False``), so partitions compete on the paper's own terms."""
    ms, L = 1e-3, int(entry["num_layers"])
    f, b = entry["fwd_ms_per_layer"] * ms, entry["bwd_ms_per_layer"] * ms
    zeros = (0,) * (L + 1)
    # no bytes in a profile: memory and link are made unbounded so only the times decide
    return PartitionProblem(
        names=tuple(f"layers.{i}" for i in range(L)) + ("lm_head",), layer=tuple(range(L + 1)),
        fwd_s=(f,) * L + (entry["head_fwd_ms"] * ms,), bwd_s=(b,) * L + (entry["head_bwd_ms"] * ms,),
        rec_s=(f,) * L + (entry["head_fwd_ms"] * ms,), act_bytes=zeros, peak_bytes=zeros, boundary_bytes=zeros,
        input_bytes=0, param_bytes=zeros, grad_bytes=zeros, device_count=devices, memory_bytes=1 << 62,
        link_bytes_per_s=1e30, microbatches=microbatches, allow_save=False,
    )


def _describe(plan: Any, layers: int) -> str:
    """A SegmentPlan in the fixture's ``forward|backward`` layer-count notation."""
    fwd = [b - a for a, b in plan.forward]
    # segments are the layers and then the head: the fused stage's first segment says how many layers it holds
    top = layers - plan.fused[0]
    return ",".join(map(str, fwd)) + "|" + ",".join(map(str, [top] + [b - a for a, b in plan.backward]))
