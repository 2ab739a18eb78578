"""What a plan is made for and how the driver chooses (:mod:`rpcompile.planner.planning`): the options of one plan
(:class:`PlanOptions`, checked once when made and passed down whole), the hardware, the cost model, the strategies,
the LM-head splits to try and which of their plans wins, and the refusal when nothing fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from rpcompile.core.units import fmt_bytes
from rpcompile.passes.cost.analytic import AnalyticCostModel
from rpcompile.passes.cost.measured import MeasuredCostModel
from rpcompile.core.precision import PRECISION_BYTES
from rpcompile.passes.solver.problem import PartitionProblem
from rpcompile.passes.solver.tables import min_feasible_memory

from ..core.errors import ConfigError, InfeasibleError, RPCompileError
from ..core.plan import Hardware
from ..core.specs import DeviceSpec, HostSpec, assumed_host, get_spec
from .device_probe import device_spec

__all__ = ["PlanOptions", "PLAN_DEFAULTS", "options_or_keywords", "PLAN_STRATEGIES", "AUTO_HEAD_CHUNKS",
           "make_cost_model", "make_hardware", "default_spec", "head_chunk_candidates", "fastest", "split_limit",
           "infeasible_error", "model_device"]

#: The strategies a plan may name (``--strategy``, ``strategy=``); :data:`rpcompile.passes.solver.partition.STRATEGIES` runs them.
PLAN_STRATEGIES = ("ilp", "dp", "roundpipe", "uniform")
#: Sequence chunks ``head_chunks="auto"`` tries for the LM head (besides not splitting it): on the benchmark
#: models, 8 chunks beat 4 and 16 (benchmarks/RESULTS.md, schedules).
AUTO_HEAD_CHUNKS = 8


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Everything the planner is told about one plan besides the model and its example (``rpcompile.plan``'s and
    ``rpcompile.compile``'s keywords, the CLI's flags): made once, checked here (one line each), and passed whole
    through the pass driver (:func:`~rpcompile.planner.planning.start`, ``prepare``, ``compile_plan``)."""

    gpus: int
    """Devices the plan is for (each a pipeline stage's home)."""
    spec: "str | DeviceSpec | None" = None
    """The device spec or preset (``rtx4090``, ``a100-80g``, ``cpu``, ...) to cost analytically; None: measure."""
    device: "str | torch.device | None" = None
    """Where to measure costs (with ``spec`` None); None: the CPU (analytic ``rtx4090`` for a meta-device model)."""
    microbatches: int | None = None
    """Microbatches per iteration; None: ``gpus + 1`` (1 on a single device)."""
    memory_limit: int | None = None
    """Usable bytes per device; None: the spec's usable memory."""
    strategy: str = "ilp"
    """The partitioner (:data:`~rpcompile.planner.plan_options.PLAN_STRATEGIES`)."""
    precision: str = "fp32"
    """The compute precision (fp32, bf16, fp16)."""
    time_limit_s: float = 10.0
    """The solve's wall-time limit, shared equally by the LM-head splits' solves
    (:func:`~rpcompile.planner.plan_options.split_limit`)."""
    max_segments: int | None = None
    """At most this many segments for the partitioner (:mod:`rpcompile.passes.rewrite.coarsen`); None: its own."""
    segments_per_layer: int = 2
    """Segments per layer the coarsener keeps (2: attention and MLP halves)."""
    leaf_modules: Sequence[Any] = ()
    """Modules the trace keeps whole (:func:`rpcompile.passes.graph.trace.trace`)."""
    progress: bool | None = None
    """A progress line per pass on stderr (True), none (False); None: the cost pass's own choice."""
    threads: int | None = None
    """Intra-op threads while measuring costs (a logical CPU device's share of the cores); None: as they are."""
    head_chunks: "int | str" = "auto"
    """Sequence chunks of the LM head and its loss (1: the whole head); ``"auto"``: the whole head and
    :data:`~rpcompile.planner.plan_options.AUTO_HEAD_CHUNKS`, the faster plan kept."""
    host_embedding: "bool | Sequence[str]" = True
    """Token embeddings on the host (:mod:`rpcompile.passes.rewrite.host`): True where it pays, False none, or
    exactly these node names."""
    allow_save: bool = True
    """Backward stages may use activations saved in host memory; False: every backward stage recomputes."""
    allow_stay: bool = True
    """Weights may stay on their devices between stages where memory allows (:mod:`rpcompile.passes.solver.stay_search`)."""
    overlap: bool = False
    """Plan for overlapped iterations (``pipe.step(optimizer, overlap=True)``): the objective is the steady-state
    period (:attr:`HostLoad.overlap_iterations <rpcompile.core.stages.HostLoad.overlap_iterations>`)."""
    cache: bool = True
    """Measured costs and solved partitions kept on disk (:mod:`rpcompile.passes.cost.profile_cache`,
    :mod:`rpcompile.passes.solve_cache`); False: measured and solved afresh, nothing kept."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_BYTES:
            raise ConfigError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {self.precision!r}")
        if self.gpus < 1:
            raise ConfigError(f"gpus must be >= 1, got {self.gpus}")
        if self.strategy not in PLAN_STRATEGIES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(PLAN_STRATEGIES)}")
        if self.spec is not None and self.device is not None:
            raise ConfigError("give either spec= (analytic costs) or device= (measured costs), not both")
        head = self.head_chunks
        # bool is a subclass of int: without the first test head_chunks=True would pass as 1
        if head != "auto" and (isinstance(head, bool) or not isinstance(head, int) or head < 1):
            raise ConfigError(f"head_chunks must be a positive integer or 'auto', got {head!r}")


#: Each :class:`PlanOptions` field's default, by name.
PLAN_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(PlanOptions)}


def options_or_keywords(options: "PlanOptions | None", keywords: dict[str, Any], *, where: str,
                        defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The planner's options as keywords: ``keywords`` (a call's planner keywords, :class:`PlanOptions` field
    names) when ``options`` is None, else ``options``' fields — refused in one line when a keyword also left its
    default (``defaults``: the call's own where they are not :class:`PlanOptions`'; ``gpus``: unless it equals
    ``options.gpus``). ``where`` names the call in the message."""
    if options is None:
        return keywords
    if not isinstance(options, PlanOptions):
        raise ConfigError(f"{where}(options=...) takes a rpcompile.PlanOptions, got {type(options).__name__}")
    defaults = {**PLAN_DEFAULTS, **(defaults or {})}
    def given(name: str, value: Any) -> bool:
        if name == "gpus":
            return value is not None and value != options.gpus
        return value is not defaults[name] and value != defaults[name]

    clash = [k for k, v in keywords.items() if given(k, v)]
    if clash:
        raise ConfigError(f"{where}: {', '.join(clash)} given beside options=; give the planner's options either "
                          f"as keywords or in options=PlanOptions(...), not both")
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(PlanOptions)}


def make_cost_model(*, spec: "str | DeviceSpec | None" = None, device: "str | torch.device | None" = None,
                    dtype: torch.dtype | None = None, model_device: str = "cpu", cache: bool = True) -> Any:
    """Pick a cost model: analytic for ``spec``, measured on ``device``; by default analytic ``rtx4090`` for a
    model on the meta device (it cannot run) and measured on the CPU otherwise. ``cache``: measured times are
    kept on disk and reused (:mod:`rpcompile.passes.cost.profile_cache`)."""
    if spec is not None and device is not None:
        raise ConfigError("give either spec= (analytic costs) or device= (measured costs), not both")
    if spec is None and device is None and model_device == "meta":
        spec = "rtx4090"
    if spec is not None:
        return AnalyticCostModel(spec, dtype=dtype)
    return MeasuredCostModel(device or "cpu", dtype=dtype, cache=cache)


def make_hardware(gpus: int, spec: "str | DeviceSpec", memory_limit: int | None = None, *,
                  host: HostSpec | None = None, nodes: int = 1, network_bytes_per_s: float = 0.0) -> Hardware:
    """``gpus`` devices of ``spec`` with ``memory_limit`` usable bytes each (default: the spec's usable memory),
    in ``host`` (default: the host :func:`~rpcompile.core.specs.assumed_host` assumes for the spec; measure one
    with :func:`rpcompile.planner.probe.probe_host`); ``nodes`` such machines training data-parallel over a network of
    ``network_bytes_per_s`` each (:mod:`rpcompile.training.distributed`)."""
    spec = get_spec(spec)
    if gpus < 1:
        raise ConfigError(f"gpus must be >= 1, got {gpus}")
    memory = int(memory_limit) if memory_limit is not None else spec.usable_memory_bytes
    return Hardware(device_count=gpus, spec=spec, memory_bytes=memory, link_bytes_per_s=spec.host_link_bandwidth,
                    host=host if host is not None else assumed_host(spec), nodes=nodes,
                    network_bytes_per_s=network_bytes_per_s if nodes > 1 else 0.0)


def default_spec(spec: "str | DeviceSpec | None", device: "str | torch.device | None",
                 model_device: str) -> "str | DeviceSpec":
    """The hardware a plan is for: ``spec`` when given; the CPU when costs are measured there; the GPU itself when
    they are measured on one (:func:`rpcompile.planner.device_probe.device_spec`: its family's preset with its own memory
    and measured host link); else an RTX 4090 (also for meta-device models, which can only be costed
    analytically)."""
    if spec is not None:
        return spec
    if model_device != "meta" and (device is None or torch.device(device).type == "cpu"):
        return "cpu"
    if model_device != "meta" and device is not None and torch.device(device).type == "cuda":
        return device_spec(torch.device(device))
    return "rtx4090"


def head_chunk_candidates(head_chunks: "int | str", loss_fn: Any, example_target: Any) -> tuple[int, ...]:
    """The LM-head splits to plan for ``head_chunks``: an int is itself; ``"auto"`` is the whole head and
    :data:`AUTO_HEAD_CHUNKS` sequence chunks when a loss and a ``[batch, sequence]`` target are given (the split
    needs both), else the whole head only."""
    if head_chunks == "auto":
        # every chunk needs at least one position: a sequence shorter than AUTO_HEAD_CHUNKS gets one chunk per position,
        # and a sequence of one (or no [batch, sequence] target) cannot be split at all
        seq = example_target.shape[1] if isinstance(example_target, torch.Tensor) and example_target.dim() >= 2 else 1
        return (1, min(AUTO_HEAD_CHUNKS, seq)) if loss_fn is not None and seq > 1 else (1,)
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ConfigError(f"head_chunks must be a positive integer or 'auto', got {head_chunks!r}")
    return (head_chunks,)


def split_limit(total: float, count: int) -> float:
    """Each of ``count`` LM-head splits' solves gets this share of the time limit ``total``: an equal one, known
    before any of them runs, so the splits can be solved at once (:mod:`rpcompile.passes.background`) and each
    one's plan never depends on how long another took."""
    return max(total / max(count, 1), MIN_SHARE_S)


#: The least limit a split's solve gets: its phases stop at once and it keeps the plans it was seeded with.
MIN_SHARE_S = 0.05

Made = tuple[float, Any]
"""What an attempt at one candidate makes: (predicted iteration seconds, payload)."""


def fastest(candidates: Sequence[int], attempt: Callable[[int], "Made | Callable[[], Made]"]) -> Any:
    """Run ``attempt(k)`` for every candidate head split and return the payload of the fastest: ``attempt``
    returns ``(predicted iteration seconds, payload)`` (the first wins a tie), or a function that returns it once
    the work it started is done. Every attempt is started, in order, before any is finished, and they finish in
    reverse order: work an attempt left in the background (:func:`rpcompile.passes.background.later`) runs while
    the later candidates are prepared and solved, and the last one's is done in the foreground. A split the graph
    refuses (an error for ``k > 1``) or that has no feasible plan (the whole head may not fit where its chunks
    do) is skipped while another candidate remains."""
    outcomes: dict[int, "Made | Exception | Callable[[], Made]"] = {}
    for k in candidates:
        try:
            outcomes[k] = attempt(k)
        except (ValueError, RPCompileError) as exc:
            _refused(candidates, k, exc)
            outcomes[k] = exc
    for k in reversed(candidates):
        pending = outcomes[k]
        if callable(pending):
            try:
                outcomes[k] = pending()
            except (ValueError, RPCompileError) as exc:
                _refused(candidates, k, exc)
                outcomes[k] = exc
    # each plan with its candidate's index, so a tie goes to the earlier candidate (the whole head comes first)
    made = [(o, i) for i, o in enumerate(outcomes[k] for k in candidates) if isinstance(o, tuple)]
    if not made:
        # no candidate made a plan: the first candidate's error (outcomes holds the candidates in their order)
        raise next(o for o in outcomes.values() if isinstance(o, Exception))
    return min(made, key=lambda m: (m[0][0], m[1]))[0][1]


def _refused(candidates: Sequence[int], k: int, exc: Exception) -> None:
    """Raise ``exc`` unless a split may be skipped for it: another candidate remains, and ``k`` is a split or the
    whole head is infeasible."""
    # the whole head is the graph as traced: an error there other than not fitting is the model's own, raised rather
    # than hidden behind a split's plan
    if len(candidates) == 1 or (k == 1 and not isinstance(exc, InfeasibleError)):
        raise exc


def infeasible_error(problem: PartitionProblem, hardware: Hardware) -> InfeasibleError:
    """The one-line refusal when nothing fits: the least memory per device that would, and what to change."""
    need, seg = min_feasible_memory(problem)
    return InfeasibleError(
        f"no plan fits {fmt_bytes(hardware.memory_bytes)} per device: segment {seg} ({problem.names[seg]}) needs "
        f"at least {fmt_bytes(need)} (its weights, the prefetched next stage, gradients and one microbatch's "
        f"activations); allow at least {need} bytes per device (memory_limit= / --memory-limit), use more "
        "microbatches (smaller ones) or a lower precision"
    )


def model_device(model: torch.nn.Module) -> str:
    """The device type of the model's parameters (``meta`` for a model built without weights); ``cpu`` if none."""
    return next((p.device.type for p in model.parameters()), "cpu")
