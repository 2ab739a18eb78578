"""The longest sequence that fits: bisection over the analytic cost model (``rpcompile plan MODEL --max-seq-len``).

For each probed length ``L`` the model is built on the ``meta`` device with a batch of ``microbatches``
sequences of ``L`` tokens (one sequence per microbatch), traced, costed analytically for the spec and coarsened
(:func:`rpcompile.planner.planning.prepare`); the length is feasible when some plan fits the devices' memory, which
:func:`~rpcompile.passes.solver.tables.min_feasible_memory` decides exactly over all plans without running a solver.
The LM-head splits ``head_chunks`` allows are tried most chunks first (the split head needs the least memory:
the full logits never exist) and the first that fits is kept.

Search: doubling from ``start`` until a length does not fit, then bisection to ``granularity`` tokens; every
probed length is a multiple of ``granularity``, and the answer ``L`` fits while ``L + granularity`` does not.
Only at the answer does a solver run (``strategy``, ``time_limit_s``): the plan reported, and what binds — its
stage with the most memory, split into weights (the stage's weights, the prefetched next stage's, its
gradients) and activations (one microbatch's working set and the double buffers beside it).

Everything here is a prediction of the cost model, not a measurement on a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from rpcompile.core.errors import ConfigError, InfeasibleError
from rpcompile.core.plan import Plan
from rpcompile.core.specs import DeviceSpec, HostSpec
from rpcompile.core.units import fmt_bytes
from rpcompile.models.registry import ModelSpec, load_model
from rpcompile.passes.formulate import partition_problem
from rpcompile.passes.solver.tables import min_feasible_memory

from .plan_options import PlanOptions, default_spec, head_chunk_candidates, make_hardware, options_or_keywords
from .planning import plan_graph, prepare

__all__ = ["max_sequence_length", "SeqLenResult", "Probe", "Binding"]

ModelSource = Union[str, Callable[[int, int], ModelSpec]]
"""A built-in model name / ``file.py:factory`` spec, or ``build(seq_len, batch_size) -> ModelSpec``."""


@dataclass(frozen=True)
class Probe:
    """One probed length."""

    seq_len: int
    feasible: bool
    need_bytes: int
    """The least memory per device any plan needs at this length (with the head split below)."""
    segment: str
    """The segment that sets ``need_bytes``."""
    head_chunks: int
    seconds: float


@dataclass(frozen=True)
class Binding:
    """The stage of the plan closest to the memory limit, and what fills it."""

    stage: str
    memory_bytes: int
    limit_bytes: int
    weight_bytes: int
    """Its weights, the prefetched next stage's weights and its gradients."""
    activation_bytes: int
    """One microbatch's working set and the double buffers beside it."""

    @property
    def dominated_by(self) -> str:
        return "activations" if self.activation_bytes >= self.weight_bytes else "weights"


@dataclass(frozen=True)
class SeqLenResult:
    """What :func:`max_sequence_length` found."""

    seq_len: int
    """The longest length (a multiple of ``granularity``) with a feasible plan."""
    granularity: int
    microbatches: int
    head_chunks: int
    plan: Plan
    binding: Binding
    refused: Probe | None
    """The probe at ``seq_len + granularity`` (None when the search stopped at ``max_seq_len``)."""
    probes: tuple[Probe, ...] = field(default=())
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """The answer in a few lines (prediction, binding stage, the refusal one step up)."""
        b = self.binding
        head = f", LM head in {self.head_chunks} chunks" if self.head_chunks > 1 else ""
        out = [f"longest sequence that fits (a prediction of the analytic cost model): {self.seq_len} tokens per "
               f"microbatch of one sequence, {self.microbatches} microbatches{head} (granularity {self.granularity}, "
               f"{len(self.probes)} probes, {self.seconds:.1f} s)",
               f"binds: stage {b.stage} at {fmt_bytes(b.memory_bytes)} of {fmt_bytes(b.limit_bytes)}: "
               f"activations {fmt_bytes(b.activation_bytes)}, weights {fmt_bytes(b.weight_bytes)} "
               f"(its own, the prefetched next stage's, gradients): {b.dominated_by} dominate"]
        if self.refused is not None:
            r = self.refused
            out.append(f"{r.seq_len} tokens do not fit: segment {r.segment} needs at least {fmt_bytes(r.need_bytes)}")
        else:
            out.append("the search stopped at max_seq_len: longer sequences may fit too")
        return out

    def to_dict(self) -> dict[str, Any]:
        b, r = self.binding, self.refused
        return {
            "prediction": True, "seq_len": self.seq_len, "granularity": self.granularity,
            "microbatches": self.microbatches, "head_chunks": self.head_chunks, "seconds": self.seconds,
            "iteration_time_s": self.plan.predicted.iteration_time_s, "stages": len(self.plan.stages),
            "binding": {"stage": b.stage, "memory_bytes": b.memory_bytes, "limit_bytes": b.limit_bytes,
                        "weight_bytes": b.weight_bytes, "activation_bytes": b.activation_bytes,
                        "dominated_by": b.dominated_by},
            "refused": None if r is None else {"seq_len": r.seq_len, "need_bytes": r.need_bytes, "segment": r.segment},
            "probes": [{"seq_len": p.seq_len, "feasible": p.feasible, "need_bytes": p.need_bytes,
                        "segment": p.segment, "head_chunks": p.head_chunks} for p in self.probes],
        }


def binding_stage(plan: Plan) -> Binding:
    """The stage of ``plan`` with the most memory, split into weights (``W + G + P``, :mod:`rpcompile.passes.solver.timing`) and
    activations (the rest)."""
    # any stage's weights may be the next to go up: the timing model counts the plan's largest as every stage's prefetch
    prefetch = max((s.weight_bytes for s in plan.stages), default=0)
    s = max(plan.stages, key=lambda s: s.memory_bytes)
    weights = s.weight_bytes + s.grad_bytes + prefetch
    return Binding(stage=s.name, memory_bytes=s.memory_bytes, limit_bytes=plan.hardware.memory_bytes,
                   weight_bytes=weights, activation_bytes=max(0, s.memory_bytes - weights))


def max_sequence_length(
    model: ModelSource,
    *,
    gpus: int | None = None,
    spec: "str | DeviceSpec | None" = None,
    precision: str = "bf16",
    memory_limit: int | None = None,
    microbatches: int | None = None,
    granularity: int = 1024,
    start: int | None = None,
    max_seq_len: int = 1 << 22,
    head_chunks: "int | str" = "auto",
    strategy: str = "ilp",
    time_limit_s: float = 2.0,
    segments_per_layer: int = 2,
    host_embedding: bool = True,
    host: HostSpec | None = None,
    progress: Callable[[str], None] | None = None,
    options: PlanOptions | None = None,
) -> SeqLenResult:
    """The longest sequence (per microbatch of one sequence, a multiple of ``granularity``) for which a plan fits
    ``gpus`` devices of ``spec`` (default ``rtx4090``; ``memory_limit`` usable bytes each), predicted by the
    analytic cost model; see the module docstring. ``model``: a built-in name or ``file.py:factory`` whose
    sequence length can be set, or ``build(seq_len, batch_size) -> ModelSpec``. Raises :class:`~rpcompile.InfeasibleError`
    when not even ``granularity`` tokens fit. ``options``: a :class:`~rpcompile.PlanOptions` holding the planner's
    keywords (``gpus``, ``spec``, ``precision``, ``memory_limit``, ``microbatches``, ``head_chunks``,
    ``strategy``, ``time_limit_s``, ``segments_per_layer``, ``host_embedding``) at once instead; the search's own
    (``granularity``, ``start``, ``max_seq_len``, ``host``, ``progress``) stay keywords."""
    # this search's own defaults (bf16, a 2 s solve) differ from PlanOptions': a keyword left at them is no clash
    keywords = options_or_keywords(options, dict(
        gpus=gpus, spec=spec, precision=precision, memory_limit=memory_limit, microbatches=microbatches,
        head_chunks=head_chunks, strategy=strategy, time_limit_s=time_limit_s, segments_per_layer=segments_per_layer,
        host_embedding=host_embedding), where="max_sequence_length", defaults=dict(precision="bf16", time_limit_s=2.0))
    if options is not None and options.device is not None:
        raise ConfigError("max_sequence_length predicts with analytic costs: leave options.device None and name a spec")
    if keywords["gpus"] is None:
        raise ConfigError("max_sequence_length needs the number of devices: gpus=N "
                          "(or options=PlanOptions(gpus=N, ...))")
    gpus, spec, precision, memory_limit, microbatches, head_chunks, strategy, time_limit_s, segments_per_layer, \
        host_embedding = (keywords[k] for k in ("gpus", "spec", "precision", "memory_limit", "microbatches",
                                                "head_chunks", "strategy", "time_limit_s", "segments_per_layer",
                                                "host_embedding"))
    if granularity < 1 or max_seq_len < granularity:
        raise ConfigError(f"granularity must be >= 1 and <= max_seq_len, got {granularity} and {max_seq_len}")
    m = microbatches or (gpus + 1 if gpus > 1 else 1)
    # the probed models are built on the meta device, so costs are analytic: the spec given, else an RTX 4090
    spec = default_spec(spec, None, "meta")
    hardware = make_hardware(gpus, spec, memory_limit, host=host)
    build = _builder(model)
    t0 = time.perf_counter()
    probes: dict[int, Probe] = {}
    graphs: dict[int, Any] = {}

    def fits(length: int) -> bool:
        if length not in probes:
            probes[length] = _probe(length)
            if progress is not None:
                p = probes[length]
                progress(f"{length} tokens: {'fits' if p.feasible else 'does not fit'} "
                         f"(needs {fmt_bytes(p.need_bytes)}, {p.segment})")
        return probes[length].feasible

    def _probe(length: int) -> Probe:
        t = time.perf_counter()
        ms = build(length, m)
        # a factory that ignores seq_len gives the same inputs at every length: the answer would be a length never tried
        if not ms.example_inputs or ms.example_inputs[0].shape[-1] != length:
            raise ConfigError(f"{model if isinstance(model, str) else 'the model'} does not take a sequence length: "
                              "--max-seq-len needs a built-in language model or a build(seq_len, batch_size)")
        best: tuple[int, str, int] | None = None
        # most chunks first: the split head needs the least memory, so the first split that fits ends the loop
        for k in sorted(head_chunk_candidates(head_chunks, ms.loss_fn, ms.example_target), reverse=True):
            gm, _ = prepare(ms.model, ms.example_inputs, PlanOptions(gpus=gpus, spec=spec, microbatches=m,
                            precision=precision, head_chunks=k, segments_per_layer=segments_per_layer,
                            host_embedding=host_embedding, progress=False), loss_fn=ms.loss_fn,
                            example_target=ms.example_target)
            problem = partition_problem(gm, hardware=hardware, microbatches=m, precision=precision)
            need, seg = min_feasible_memory(problem)
            # the least need over the splits tried is what the probe reports when none fits
            if best is None or need < best[0]:
                best = (need, problem.names[seg], k)
            if need <= hardware.memory_bytes:
                # kept for the one solve at the answer, which then needs no second trace
                graphs[length] = gm
                break
        assert best is not None
        return Probe(length, best[0] <= hardware.memory_bytes, best[0], best[1], best[2], time.perf_counter() - t)

    lo, hi = _bracket(fits, granularity, start, max_seq_len)
    while hi is not None and hi - lo > granularity:
        # lo and hi are multiples of granularity at least two apart: mid is one too, strictly between them
        mid = lo + (hi - lo) // (2 * granularity) * granularity
        if fits(mid):
            lo = mid
        else:
            hi = mid
    # hi is lo + granularity (checked next): its probe is the refusal one step up
    refused = probes.get(hi) if hi is not None else None
    if hi is not None and hi != lo + granularity:  # cannot happen: the bracket's ends are multiples of it
        raise AssertionError(f"bisection ended at {lo}, {hi}")
    made = plan_graph(graphs[lo], hardware=hardware, microbatches=m, strategy=strategy, precision=precision,
                      time_limit_s=time_limit_s)
    ordered = tuple(sorted(probes.values(), key=lambda p: p.seq_len))
    return SeqLenResult(seq_len=lo, granularity=granularity, microbatches=m, head_chunks=probes[lo].head_chunks,
                        plan=made, binding=binding_stage(made), refused=refused, probes=ordered,
                        seconds=time.perf_counter() - t0)


def _bracket(fits: Callable[[int], bool], g: int, start: int | None, cap: int) -> tuple[int, int | None]:
    """``(lo, hi)``: ``lo`` fits, ``hi`` does not (None: ``cap`` reached), both multiples of ``g``; by doubling
    from ``start`` (default 4 g) up, or halving down when ``start`` does not fit."""
    # start and cap rounded down to multiples of g, so every probed length is one
    length = max(g, (start or 4 * g) // g * g)
    cap = cap // g * g
    if fits(length):
        while True:
            up = min(length * 2, cap)
            # the cap fits: no refused length to bracket with
            if up == length:
                return length, None
            if not fits(up):
                return length, up
            length = up
    hi = length
    while length > g:
        length = max(g, length // 2 // g * g)
        if fits(length):
            return length, hi
        hi = length
    raise InfeasibleError(f"not even {g} tokens per microbatch fit: lower granularity, add devices or memory")


def _builder(model: ModelSource) -> Callable[[int, int], ModelSpec]:
    if isinstance(model, str):
        name = model
        return lambda length, batch: load_model(name, seq_len=length, batch_size=batch, device="meta")
    if callable(model):
        return model
    raise ConfigError(f"model must be a built-in name, a file.py:factory spec or build(seq_len, batch_size), "
                      f"got {type(model).__name__}")

