"""What a checkpoint holds, and the checks it must pass before anything loads from it (all or nothing).

pipeline state
    What :meth:`Pipeline.state_dict <rpcompile.training.pipeline.Pipeline.state_dict>` returns
    (:func:`pipeline_state`): the iteration and dropout seed that seed every mask, the scaler's state, an
    overlapped step's stale weights, and what they were computed with (version, model fingerprint, microbatches,
    precision, the plan's cuts, :func:`plan_cuts`), which :func:`check_pipeline_state` checks on load.
checks before loading
    :func:`rpcompile.load_checkpoint` changes the model, the optimizers and the pipeline only once every check here
    has passed: the pipeline state's fields and types (:func:`pipeline_state_problem`), the model's keys and shapes
    (``load_state_dict`` copies what fits before it refuses the rest) and each optimizer's groups and
    per-parameter state (:func:`optimizer_state_problem`; torch's own load checks no shapes). Each ``*_problem``
    function returns the first problem in a few words, or None; the caller says where and what to do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from ...core.digest import short_digest
from ...core.errors import RPCompileError
from ...core.plan import Plan

__all__ = ["STATE_VERSION", "STATE_FORMAT", "CheckpointError", "CheckpointWarning", "Resumable", "Checkpoint",
           "Contents", "plan_cuts", "pipeline_state", "check_pipeline_state", "pipeline_state_problem", "optimizer_state_problem"]

STATE_VERSION = 2
"""Version of the pipeline state's layout (:func:`pipeline_state`); a newer one is refused."""
STATE_FORMAT = "rpcompile.training.pipeline"


class CheckpointError(RPCompileError):
    """No usable checkpoint, or a state that does not fit the pipeline, model or optimizer it is loaded into."""


class CheckpointWarning(UserWarning):
    """A checkpoint was found torn or corrupt and skipped (moved aside); the previous one is used."""


class Resumable(Protocol):
    """What checkpoints use of a :class:`rpcompile.training.pipeline.Pipeline` (which imports this module)."""

    plan: Plan
    microbatches: int
    precision: str
    iteration: int
    dropout_seed: int | None
    scaler: Any

    def state_dict(self) -> dict[str, Any]: ...

    def check_state_dict(self, state: Any, *, optimizer: Any = None, exact: bool = True) -> None: ...

    def load_state_dict(self, state: Mapping[str, Any], *, optimizer: Any = None, exact: bool = True) -> None: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`~rpcompile.load_checkpoint` loaded."""

    path: Path
    step: int
    """The step it was saved at (``save_checkpoint(..., step=)``)."""
    extra: Any = None
    """The ``extra=`` it was saved with."""


@dataclass
class Contents:
    """A checkpoint read into memory (either format), before it is checked against a model and pipeline."""

    path: Path
    step: int
    pipeline: Any
    """The pipeline's state, as ``Pipeline.state_dict()`` returned it (checked when loaded)."""
    model: dict[str, torch.Tensor]
    """The model's ``state_dict``, every tied name filled."""
    optimizers: list[Any] | None
    """Each optimizer's ``state_dict``; None: none was saved."""
    extra: Any = None


def plan_cuts(plan: Plan) -> str:
    """A digest of what in a plan decides the arithmetic: each stage's kind, nodes and saved nodes, the
    microbatch count, the split head and the host's lookups (not the devices, times or memory)."""
    cuts = [[s.kind, list(s.nodes), list(s.saved)] for s in plan.stages]
    text = json.dumps([cuts, plan.microbatches, plan.head_chunks, list(plan.host)])
    return short_digest(text)


def pipeline_state(pipe: Resumable, stale_weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The pipeline's state; ``stale_weights``: the copies the next iteration computes with when an overlapped
    step is done but no iteration has run beside it yet (else empty). Its fields:

    - ``iteration``: the number of ``forward_backward`` calls so far, which seeds every dropout mask (with the node and
      the microbatch, :mod:`rpcompile.runtime.rng`) — a fresh pipeline starts at 0 and would draw the first iteration's
      masks again;
    - ``dropout_seed``: the seed every dropout mask is drawn from beside them (``torch.initial_seed()`` when the
      pipeline was made; a resumed run draws the saved run's masks whatever the new process's seed is; a version-1
      state, saved before there was one, resumes with the masks it was drawing);
    - ``scaler``: the ``GradScaler``'s state (scale, growth tracker) when the pipeline holds one (fp16);
    - ``stale_weights``: after ``pipe.step(optimizer, overlap=True)``, the copies of the weights from *before* that
      step, which the next iteration computes with (one step stale, :meth:`Pipeline.step <rpcompile.Pipeline.step>`).
      The step itself is waited for, so the masters in the model's ``state_dict`` are the stepped ones; saving never
      changes what training computes, and a resumed run goes on one step stale where the saved one would have;
    - what the state was computed with, checked on load: a version, the plan's model fingerprint
      (:class:`rpcompile.core.plan.Fingerprint`: the traced graph, whose node names key the dropout seeds, and the
      parameters), the microbatch count, the precision and the plan's cuts (:func:`plan_cuts`: each stage's nodes and
      saved nodes — a fused stage and a forward/backward pair round differently in the last bit), and the plan itself.
      The devices are not part of it: the same cuts on other devices continue bit for bit. A state that differs is
      refused in one line; ``exact=False`` loads it anyway (the iteration, the dropout seed and the scaler carry over).
    """
    scaler = pipe.scaler
    return {"format": STATE_FORMAT, "version": STATE_VERSION, "model": pipe.plan.model.digest,
            "cuts": plan_cuts(pipe.plan), "plan": pipe.plan.to_json(), "microbatches": pipe.microbatches,
            "precision": pipe.precision, "iteration": pipe.iteration, "dropout_seed": pipe.dropout_seed,
            # None for a disabled scaler too (bf16): every state without loss scaling compares alike
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "stale_weights": dict(stale_weights)}


def check_pipeline_state(pipe: Resumable, state: Any, copies: Mapping[str, tuple[torch.dtype, tuple]], *,
                         exact: bool = True) -> None:
    """Raise :class:`CheckpointError` (one line) unless ``state`` is a pipeline state this pipeline can continue
    — bit for bit where ``exact``; ``copies``: dtype and shape of the copies an overlapped step keeps, by name."""
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise CheckpointError("Pipeline.load_state_dict takes what Pipeline.state_dict() returned (a dict with "
                              f"format={STATE_FORMAT!r}); got {type(state).__name__}")
    version = state.get("version")
    if not isinstance(version, int) or version > STATE_VERSION:
        raise CheckpointError(f"the pipeline state has version {version!r} but this rpcompile reads up to "
                              f"{STATE_VERSION}; load it with the rpcompile that saved it or a newer one")
    problem = pipeline_state_problem(state, version)
    if problem is not None:
        raise CheckpointError(f"the pipeline state is malformed ({problem}); load a state Pipeline.state_dict() "
                              "returned (a checkpoint of this rpcompile)")
    if not exact:
        return
    again = ("compile with the plan it was saved with (plan=rpcompile.checkpoint_plan(directory) for save_checkpoint's "
             "directory), or pass exact=False to continue on this pipeline, not bit for bit")
    if state["model"] != pipe.plan.model.digest:
        raise CheckpointError(f"the pipeline state is for another graph (fingerprint {state['model']}, this "
                              f"pipeline's is {pipe.plan.model.digest}: the model, its head_chunks or host "
                              f"embeddings differ); {again}")
    saved = (state["microbatches"], state["precision"])
    if saved != (pipe.microbatches, pipe.precision):
        raise CheckpointError(f"the pipeline state ran {saved[0]} microbatches in {saved[1]}, this pipeline "
                              f"runs {pipe.microbatches} in {pipe.precision}; compile with microbatches={saved[0]}, "
                              f"precision={saved[1]!r}, or pass exact=False")
    if state["cuts"] != plan_cuts(pipe.plan):
        raise CheckpointError(f"the pipeline state was computed with a plan cut otherwise (cuts {state['cuts']}, "
                              f"this pipeline's {plan_cuts(pipe.plan)}), which changes the last bits; {again}")
    has_scaler = pipe.scaler is not None and pipe.scaler.is_enabled()
    # either way round the scale would change (lost, or started afresh), and with it the last bits
    if (state["scaler"] is not None) != has_scaler:
        raise CheckpointError(f"the pipeline state {'has' if state['scaler'] else 'has no'} GradScaler state but "
                              f"this pipeline {'has' if has_scaler else 'has no'} scaler; compile with "
                              f"scaler={'torch.amp.GradScaler(...)' if state['scaler'] else 'None'}, or pass "
                              "exact=False")
    for name, t in state["stale_weights"].items():
        mine = copies.get(name)
        # load copies them into this pipeline's front copies (Overlap.resume): the dtype and shape must be the same
        if mine != (t.dtype, tuple(t.shape)):
            got = "none" if mine is None else f"{mine[0]} {mine[1]}"
            raise CheckpointError(f"the pipeline state's stale copy of {name} is {t.dtype} {tuple(t.shape)}, this "
                                  f"pipeline keeps {got}; {again}")


_PIPELINE_FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,), "cuts": (str,), "plan": (str,), "microbatches": (int,), "precision": (str,), "iteration": (int,),
    "dropout_seed": (int, type(None)), "scaler": (dict, type(None)), "stale_weights": (dict,)}
_SCALER = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
"""What ``torch.amp.GradScaler.load_state_dict`` reads."""


def pipeline_state_problem(state: Mapping[str, Any], version: int) -> str | None:
    """What is malformed in a pipeline state of ``version`` (a field missing or of another type), or None."""
    for name, types in _PIPELINE_FIELDS.items():
        if name not in state:
            if name == "dropout_seed" and version < 2:  # saved before there was one
                continue
            return f"no {name!r}"
        value = state[name]
        # bool is an int to isinstance; no field here is negative (iteration, microbatches, seed)
        if not isinstance(value, types) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
            return f"{name} is {type(value).__name__} {repr(value)[:40]}"
    bad = next((k for k, t in state["stale_weights"].items() if not isinstance(k, str)
                or not isinstance(t, torch.Tensor)), None)
    if bad is not None:
        return f"stale_weights[{repr(bad)[:40]}] is not a tensor"
    scaler = state["scaler"]
    if scaler is not None and not all(isinstance(scaler.get(k), (int, float, torch.Tensor)) for k in _SCALER):
        return "scaler is not a GradScaler state_dict"
    return None


_ELEMENTWISE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                          "sum", "grad_avg", "exp_inf", "prev", "step_size", "ax"})
"""Per-parameter state that torch's optimizers keep one element per weight element (Adam/AdamW, SGD, RMSprop,
Adadelta, Adagrad, Adamax, Rprop, ASGD): its shape is the parameter's."""


def optimizer_state_problem(optimizer: Any, state: Any) -> str | None:
    """What ``optimizer.load_state_dict(state)`` would refuse (its layout, torch's own group checks) or would load
    only to fail at the next step (per-parameter state of another parameter's shape), or None."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    mine = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or not isinstance(state.get("state"), Mapping) or \
            not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        return "not an optimizer state_dict"
    if len(groups) != len(mine):
        return f"the checkpoint holds {len(groups)} parameter group(s), this optimizer has {len(mine)}"
    if any(len(g["params"]) != len(m["params"]) for g, m in zip(groups, mine)):
        return "a parameter group's size differs from this optimizer's"
    # torch's load_state_dict matches the saved indices to parameters by position within the groups: the same map
    params = {i: p for g, m in zip(groups, optimizer.param_groups) for i, p in zip(g["params"], m["params"])}
    for index, entry in state["state"].items():
        if index not in params or not isinstance(entry, Mapping):
            return f"state for parameter {repr(index)[:20]}, which no parameter group lists"
        shape = tuple(params[index].shape)
        # only state with one element per weight element has the parameter's shape (not a step count)
        wrong = next((k for k, v in entry.items() if k in _ELEMENTWISE and isinstance(v, torch.Tensor)
                      and tuple(v.shape) != shape), None)
        if wrong is not None:
            return (f"parameter {index}'s {wrong} is {tuple(entry[wrong].shape)}, the parameter is {shape} (a model "
                    "or optimizer built otherwise)")
    return None
