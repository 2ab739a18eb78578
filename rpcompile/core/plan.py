"""The plan file: what rpcompile decided, as plain data.

A :class:`Plan` is a frozen tree of names and numbers — no fx objects — so it can be saved as JSON, checked
into a repository, diffed and verified in CI. It holds

- the **model fingerprint** (:class:`Fingerprint`), so a plan is never run on a model it was not made for;
- the **hardware** (:class:`Hardware`: device count and spec, usable memory, the host);
- the **stages** (:class:`Stage`) in execution order ``[F0, …, F(f-1), FB, B1, …, B(b-1)]`` (docs/architecture.md
  §3): forward stages (ascending node ranges, run without autograd), one fused stage (the last nodes: forward, loss
  and backward in one go) and backward stages (descending ranges, recomputing what was not saved);
- the **prediction** (:class:`Prediction`): per-stage time and memory and the iteration time of the round-robin
  schedule, its host part (optimizer step, copy refresh) reported separately.

The JSON carries ``schema_version``; a newer file than this rpcompile understands is refused with a clear error,
as is a corrupt file. Never pickle a plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from .digest import short_digest
from .errors import ConfigError, PlanFileError, PlanMismatchError
from .files import jsonable, read_json, write_atomic
from .planfile import MAX_MICROBATCHES, plan_file_problem, size_problem
from .specs import DeviceSpec, HostSpec
from .stages import StageKind

__all__ = ["SCHEMA_VERSION", "Fingerprint", "Hardware", "Stage", "Prediction", "Plan"]

SCHEMA_VERSION = 8
"""2 added the per-stage transfer figures (``compute_s``, ``weight_bytes``, …) and ``tokens_per_microbatch``;
version-1 files still load (those figures read as 0 and the simulator falls back to stage times). 3 added the
host (``hardware.host``) and the prediction's host part (``pipeline_s``, ``optimizer_s``, ``refresh_s``,
``accumulate_s``, ``overlap_step``); version-2 files still load without them (no host work is modelled). 4 added
data-parallel machines (``hardware.nodes``, ``hardware.network_bytes_per_s``, written only for more than one
node); version-3 files are single-node plans. 5 added ``predicted.overlap_iterations`` (a plan made for overlapped
iterations, written only then); older files are synchronous plans. 6 added the host's dispatch per graph node
(``hardware.spec.dispatch_s``, ``backward_dispatch_s``: launch-bound segments) and prices a one-GPU plan's
hand-offs as kept in device memory (no link time, ``Hardware.resident_handoffs``); version-5 files load with
no dispatch, as they were priced (re-pricing one, ``rpcompile check``, prices it the version-6 way). 7 added
weights that stay on their device (``resident``; per stage ``keeps``, ``finds``, ``found_bytes``, ``kept_bytes``,
``held_bytes``, each written only when set); older files are plans whose weights leave after every stage. 8 added
gradients summed on the device across accumulation calls (per stage ``accumulates`` and ``sum_bytes``,
``predicted.no_sync_s``, written only when set); older files send every gradient home after every call."""
MAX_PLAN_BYTES = 256 * 2**20
"""The largest plan file :meth:`Plan.load` reads (an 8B model's plan is about 1 MB)."""
_MAX_DEPTH = 8
_KINDS = ("forward", "fused", "backward")
_WRITTEN_IF_SET = ("keeps", "finds", "found_bytes", "kept_bytes", "held_bytes", "accumulates", "sum_bytes")
"""Stage fields of weights and gradient sums that stay, written only when set (most stages of most plans have
none)."""


@dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """Identity of a traced model: a digest of its graph and of its parameters' names, shapes and dtypes."""

    graph_digest: str
    """sha256 of every node's op, target and arguments, in order."""
    params_digest: str
    """sha256 of the sorted (name, shape, dtype) of every parameter."""
    num_nodes: int
    num_params: int
    """Number of parameter tensors."""
    param_elements: int
    """Total number of parameter elements."""

    @property
    def digest(self) -> str:
        return short_digest(self.graph_digest + self.params_digest)

    def differences(self, other: "Fingerprint") -> list[str]:
        """Human-readable differences between two fingerprints (empty when they match)."""
        out = []
        if self.graph_digest != other.graph_digest:
            out.append(f"graph differs ({self.num_nodes} vs {other.num_nodes} nodes)")
        if self.params_digest != other.params_digest:
            out.append(
                f"parameters differ ({self.num_params} tensors / {self.param_elements:,} elements vs "
                f"{other.num_params} / {other.param_elements:,})"
            )
        return out


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The devices a plan was made for."""

    device_count: int
    spec: DeviceSpec
    memory_bytes: int
    """Usable memory per device that the plan was checked against."""
    link_bytes_per_s: float
    """Host link bandwidth per device and direction assumed by the plan."""
    host: HostSpec | None = None
    """The host's rates (optimizer step, casts, gradient accumulation); ``None`` in plans older than schema 3,
    whose predictions leave host work out. Written only when present."""
    nodes: int = 1
    """Machines training data-parallel, each with these devices (:mod:`rpcompile.training.distributed`); the prediction
    includes the all-reduce of every grad stage's gradients between them. Written only when > 1 (schema 4)."""
    network_bytes_per_s: float = 0.0
    """Each machine's network bandwidth per direction (bytes/s) for that all-reduce; 0 on one node."""

    def __post_init__(self) -> None:
        if self.device_count < 1:
            raise ConfigError(f"Hardware: device_count must be >= 1, got {self.device_count}")
        if self.nodes < 1 or (self.nodes > 1 and not self.network_bytes_per_s > 0):
            raise ConfigError(f"Hardware: nodes must be >= 1 and more than one needs network_bytes_per_s > 0, got "
                              f"nodes={self.nodes}, network_bytes_per_s={self.network_bytes_per_s}; pass --network "
                              "25Gb/s with --nodes")
        if self.memory_bytes <= 0:
            raise ConfigError(f"Hardware: memory_bytes must be > 0, got {self.memory_bytes}")

    @property
    def resident_handoffs(self) -> bool:
        """One device that is not the CPU (one GPU): the runtime keeps what a stage hands to the next in device
        memory (``rpcompile.runtime.executor``, "Hand-offs on one device"), so the hand-offs cross no link."""
        return self.device_count == 1 and self.spec.name != "cpu"


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of the round-robin schedule. It lists its compute nodes in topological order, the parameters it reads,
    and which nodes' activations are *saved* (to host memory in the forward pass, so the backward pass need not
    recompute them), and which parameters it leaves on its device for a later stage (``keeps``) or finds there
    (``finds``) instead of uploading them (weights that *stay*; a *resident* plan keeps every weight on its device
    across iterations), and whose gradients it sums on its device across gradient-accumulation calls (``accumulates``).
    """

    name: str
    """``F<i>``, ``FB`` or ``B<i>``."""
    kind: StageKind
    nodes: tuple[str, ...]
    """Compute nodes, in topological order (for a backward stage: the forward nodes whose backward it runs)."""
    params: tuple[str, ...]
    """Fully-qualified names of the parameters its nodes read (uploaded before it runs)."""
    saved: tuple[str, ...] = ()
    """Nodes whose activations are saved to host memory in the forward pass (forward stages: what they save;
    backward stages: what they upload instead of recomputing). Empty for the fused stage."""
    modules: tuple[str, ...] = ()
    """Source modules its nodes come from, in order (for people; not checked)."""
    saved_modules: tuple[str, ...] = ()
    """Source modules of its ``saved`` nodes, in order (for views of the plan without the traced graph)."""
    time_s: float = 0.0
    """Predicted time per microbatch, including recompute and unhidden transfers."""
    memory_bytes: int = 0
    """Predicted peak device memory while it runs (weights, prefetch, gradients, activations)."""
    compute_s: float = 0.0
    """Predicted compute per microbatch (forward, backward, recompute and the fixed per-stage overhead; no
    transfers)."""
    weight_bytes: int = 0
    """Bytes uploaded once per iteration before microbatch 0 (its parameters in upload precision)."""
    grad_bytes: int = 0
    """Gradient bytes downloaded once after the last microbatch (0 for forward stages and frozen parameters)."""
    upload_bytes: int = 0
    """Bytes uploaded per microbatch that wait for the previous stage (its input; for backward stages the
    gradient of its output)."""
    prefetch_bytes: int = 0
    """Bytes uploaded per microbatch that are in host memory already (backward stages: saved activations and
    the forward input they recompute from)."""
    download_bytes: int = 0
    """Bytes downloaded per microbatch that the next stage waits for (outputs; input gradients)."""
    offload_bytes: int = 0
    """Bytes downloaded per microbatch that only the backward pass needs (forward stages: saved activations)."""
    working_bytes: int = 0
    """Device memory one microbatch's live tensors take while it computes."""
    keeps: tuple[str, ...] = ()
    """Parameters it leaves on its device after its last microbatch, for a later stage there, which does not
    upload them (forward stages whose weights stay; every stage of a resident plan). Written only when not empty
    (schema 6)."""
    finds: tuple[str, ...] = ()
    """Parameters already on its device when it starts, left there by an earlier stage: it does not upload them
    (backward stages; every stage of a resident plan, which uploads those an optimizer step changed). Written only
    when not empty."""
    found_bytes: int = 0
    """Bytes of ``finds`` it does not upload (``weight_bytes`` is what it uploads). Written only when not 0."""
    kept_bytes: int = 0
    """Bytes of ``keeps``. Written only when not 0."""
    held_bytes: int = 0
    """Other stages' weights on its device while it runs (in ``memory_bytes``). Written only when not 0."""
    accumulates: tuple[str, ...] = ()
    """Parameters whose gradients stay on its device during calls under ``pipe.no_sync()``, summed there (in the
    masters' dtype) across those calls and sent home once, by the next call outside it (fused and backward
    stages; parameters no other stage reads). Written only when not empty (schema 8)."""
    sum_bytes: int = 0
    """Device memory for gradient sums while it runs (in ``memory_bytes``): the sums of every stage on its device
    that ``accumulates``, and the gradients of those that ran before it in the call, added to the sums when the
    call ends. Written only when not 0."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"stage {self.name}: kind must be one of {_KINDS}, got {self.kind!r}")
        for name in ("nodes", "params", "saved", "modules", "saved_modules", "keeps", "finds", "accumulates"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def recomputed(self) -> tuple[str, ...]:
        """Backward stages: nodes whose forward is recomputed before their backward."""
        if self.kind != "backward":
            return ()
        saved = set(self.saved)
        return tuple(n for n in self.nodes if n not in saved)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the timing model predicts for one training iteration."""

    iteration_time_s: float
    bubble_fraction: float
    peak_memory_bytes: int
    bound_s: float = 0.0
    """ILP strategies: a proven lower bound on the solver's objective, ``c(S)·T`` (stage-count factor times the
    slowest stage, docs/architecture.md §3), which bounds the iteration time of equal stages; the exact iteration time of an
    unequal plan can be lower. 0 when unknown."""
    pipeline_s: float = 0.0
    """The devices' part of ``iteration_time_s``: the pipeline with its transfers and the gradient accumulation
    the host could not hide behind it; 0 when unknown (plans older than schema 3)."""
    optimizer_s: float = 0.0
    """The host's optimizer step, once per iteration (torch AdamW on the fp32 masters)."""
    refresh_s: float = 0.0
    """The refresh of the pinned compute-precision copies after the step (0 under rpcompile's fused AdamW)."""
    accumulate_s: float = 0.0
    """The host's gradient accumulation over the iteration (fp32 ``.grad`` += each grad stage's gradients), run
    beside the later stages; only what it could not hide is in ``pipeline_s``."""
    overlap_step: bool = False
    """``iteration_time_s`` is ``max(pipeline, step)`` (``pipe.step(optimizer, overlap=True)``, one step stale)
    rather than ``pipeline + step`` (synchronous, the default)."""
    overlap_iterations: bool = False
    """The plan was made for overlapped iterations (``rpcompile.plan(..., overlap=True)``): each device goes on to
    the next iteration's stages while the others drain, so ``iteration_time_s`` is the steady-state period and
    ``bubble_fraction`` the idle time over it (:func:`rpcompile.passes.solver.recurrence.overlapped_ends`);
    ``pipeline_s`` is still one iteration alone. Written to the file only when true."""
    no_sync_s: float = 0.0
    """A gradient-accumulation call under ``pipe.no_sync()`` (its pipeline, like ``pipeline_s``), when stages sum
    their gradients on their devices (``Stage.accumulates``): those go nowhere. 0 when none do; written to the
    file only then (schema 8)."""

    @property
    def host_s(self) -> float:
        """The host's work between iterations: optimizer step plus copy refresh."""
        return self.optimizer_s + self.refresh_s


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete, self-describing pipeline plan (see module docstring)."""

    model: Fingerprint
    hardware: Hardware
    microbatches: int
    stages: tuple[Stage, ...]
    predicted: Prediction
    strategy: str = "manual"
    cost_model: str = ""
    precision: str = "fp32"
    tokens_per_microbatch: int = 0
    """Tokens (elements of the first integer input; else samples) in one microbatch, for tokens/s; 0 if unknown."""
    head_chunks: int = 1
    """The graph had its loss attached and the LM head split into this many sequence chunks
    (:mod:`rpcompile.passes.rewrite.loss_head`); 1: the plain model graph. Written only when > 1."""
    host: tuple[str, ...] = ()
    """Embedding lookups the host runs (their node names; :mod:`rpcompile.passes.rewrite.host`): the stages read their
    rows. Written only when not empty."""
    stats: Mapping[str, Any] = field(default_factory=dict)
    """Solver statistics (free-form numbers and strings)."""
    inputs: Mapping[str, Any] = field(default_factory=dict)
    """What the plan was solved from (:mod:`rpcompile.passes.plan_inputs`): digests of the node costs, the
    partition problem, the hardware and the partitioner, and the planning options. ``rpcompile check`` compares
    them instead of solving again. Empty in plans made before it existed or by hand; written only when not empty."""
    resident: bool = False
    """Every weight stays on its device across iterations: uploaded once, then only what an optimizer step
    changed (each stage's ``keeps`` and ``finds`` are all its parameters). Written only when true (schema 6)."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "host", tuple(self.host))
        if not 1 <= self.microbatches <= MAX_MICROBATCHES:
            raise ConfigError(f"Plan: microbatches must be in [1, {MAX_MICROBATCHES}], got {self.microbatches}")
        too_big = size_problem(len(self.stages), self.microbatches)
        if too_big is not None:
            raise ConfigError(f"Plan: {too_big}; use fewer microbatches or stages")

    # ---- views ----------------------------------------------------------------------------------------
    @property
    def forward_stages(self) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.kind == "forward")

    @property
    def fused_stage(self) -> Stage | None:
        return next((s for s in self.stages if s.kind == "fused"), None)

    @property
    def backward_stages(self) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.kind == "backward")

    @property
    def saved(self) -> tuple[str, ...]:
        """Nodes whose activations are saved to host memory."""
        return tuple(n for s in self.forward_stages for n in s.saved)

    @property
    def recomputed(self) -> tuple[str, ...]:
        """Nodes recomputed in the backward pass."""
        return tuple(n for s in self.backward_stages for n in s.recomputed)

    def device_of(self, stage_index: int, offset: int = 0) -> int:
        """Device that runs stage ``stage_index`` (round-robin, docs/architecture.md §3)."""
        return (stage_index + offset) % self.hardware.device_count

    # ---- serialisation --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["hardware"]["spec"] = self.hardware.spec.to_dict()
        # a field at its default is left out: such a plan's file reads as
        # the older schema's did, and from_dict fills the default in again
        if self.hardware.host is None:
            del d["hardware"]["host"]
        if self.hardware.nodes == 1:
            del d["hardware"]["nodes"], d["hardware"]["network_bytes_per_s"]
        # free-form stats may hold inf (the objective of a baseline that found no plan): made strict JSON
        d["stats"] = jsonable(dict(self.stats))
        if d["head_chunks"] == 1:
            del d["head_chunks"]
        if not d["host"]:
            del d["host"]
        for key in ("overlap_iterations", "no_sync_s"):
            if not d["predicted"][key]:
                del d["predicted"][key]
        if not d["resident"]:
            del d["resident"]
        for stage in d["stages"]:
            for key in _WRITTEN_IF_SET:
                if not stage[key]:
                    del stage[key]
        if d["inputs"]:
            d["inputs"] = jsonable(dict(self.inputs))
        else:
            del d["inputs"]
        # schema_version first, where a person or a reader looks for it
        d = {"schema_version": d.pop("schema_version"), **d}
        return d

    def to_json(self) -> str:
        # allow_nan=False: strict JSON, which read_json demands back (jsonable has already turned inf into null)
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan as JSON, atomically (:func:`~rpcompile.core.files.write_atomic`: a crash never leaves half
        a file, and no link planted beside it is followed)."""
        return write_atomic(path, self.to_json())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "plan") -> "Plan":
        if not isinstance(d, Mapping):
            raise PlanFileError(f"{source} is not an rpcompile plan: expected a JSON object, found {type(d).__name__}")
        version = d.get("schema_version")
        if not isinstance(version, int):
            raise PlanFileError(f"{source} is not an rpcompile plan: no integer 'schema_version'")
        if version > SCHEMA_VERSION:
            raise PlanFileError(
                f"{source} has schema_version {version} but this rpcompile reads up to {SCHEMA_VERSION}; "
                "upgrade rpcompile (pip install -U rpcompile) or re-plan with this version"
            )
        # field by field before any constructor runs: a corrupt file gets one line naming the field, not a TypeError
        problem = plan_file_problem(cls, d)
        if problem is not None:
            raise PlanFileError(f"{source} is corrupt: {problem}; re-plan to regenerate it")
        try:
            return cls(
                schema_version=version,
                model=Fingerprint(**d["model"]),
                hardware=_hardware(d["hardware"]),
                microbatches=d["microbatches"],
                stages=tuple(Stage(**s) for s in d["stages"]),
                predicted=Prediction(**d["predicted"]),
                strategy=d.get("strategy", "manual"),
                cost_model=d.get("cost_model", ""),
                precision=d.get("precision", "fp32"),
                tokens_per_microbatch=d.get("tokens_per_microbatch", 0),
                head_chunks=d.get("head_chunks", 1),
                host=tuple(d.get("host", ())),
                stats=d.get("stats", {}),
                inputs=dict(d.get("inputs", {})),
                resident=d.get("resident", False),
            )
        except KeyError as e:
            raise PlanFileError(f"{source} is corrupt: missing field {e.args[0]!r}; re-plan to regenerate it") from None
        except (TypeError, ValueError, AttributeError) as e:
            text = " ".join(str(e).split())  # one line whatever the check said
            raise PlanFileError(f"{source} is corrupt: {text}; re-plan to regenerate it") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read a plan file. Raises :class:`~rpcompile.PlanFileError` (one line: what is wrong, what to do)."""
        path = Path(path)
        try:
            data = read_json(path, max_bytes=MAX_PLAN_BYTES, max_depth=_MAX_DEPTH, what="a plan")
        except OSError as e:
            raise PlanFileError(f"cannot read plan file {path}: {e.strerror or e}") from None
        except ValueError as e:  # not UTF-8, not JSON, NaN, a number out of range, too deep or too large
            raise PlanFileError(f"{path} is corrupt: {e}; re-plan to regenerate it") from None
        return cls.from_dict(data, source=str(path))

    def check_model(self, fingerprint: Fingerprint, *, source: str = "plan") -> None:
        """Raise :class:`~rpcompile.PlanMismatchError` unless the plan was made for a model with ``fingerprint``."""
        diffs = self.model.differences(fingerprint)
        if diffs:
            raise PlanMismatchError(
                f"{source} was made for a different model ({'; '.join(diffs)}); "
                "re-plan for this model (rpcompile plan MODEL ...) or load the model the plan was made for"
            )


def _hardware(d: Mapping[str, Any]) -> Hardware:
    host = d.get("host")
    return Hardware(**{**d, "spec": DeviceSpec.from_dict(d["spec"]),
                       "host": HostSpec.from_dict(host) if host is not None else None})
