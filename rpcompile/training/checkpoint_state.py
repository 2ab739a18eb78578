"""What a checkpoint must hold before anything loads from it (issue 36: all or nothing).

:func:`rpcompile.load_checkpoint` changes the model, the optimizers and the pipeline only once every check here
has passed: the payload's layout (its checksum can hold over a malformed payload: a state written by hand or by
another tool), the pipeline state's fields and types, the model's keys and shapes (``load_state_dict`` copies
what fits before it refuses the rest) and each optimizer's groups (torch's own checks). Each function returns the
first problem in a few words, or None; the caller says where and what to do.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["pipeline_state_problem", "payload_problem", "model_state_problem", "optimizer_state_problem"]

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


def payload_problem(payload: Mapping[str, Any]) -> str | None:
    """What is malformed in a checkpoint's payload (its checksum held), or None — checked before anything loads."""
    for name in ("step", "pipeline", "model", "optimizer", "extra"):
        if name not in payload:
            return f"no {name!r}"
    step, model = payload["step"], payload["model"]
    if type(step) is not int or step < 0:
        return f"step is {repr(step)[:40]}"
    if not isinstance(payload["pipeline"], Mapping):
        return f"pipeline is {type(payload['pipeline']).__name__}"
    if not isinstance(model, Mapping) or not all(isinstance(k, str) and (isinstance(v, torch.Tensor)
                                                                         or k.endswith("_extra_state"))
                                                 for k, v in model.items()):
        return "model is not a state_dict of tensors"
    return None


def model_state_problem(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> str | None:
    """What ``model.load_state_dict(state)`` would refuse — after copying what fits —, or None."""
    mine = model.state_dict()
    missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    wrong = next((k for k, t in mine.items() if isinstance(t, torch.Tensor) and isinstance(state.get(k), torch.Tensor)
                  and state[k].shape != t.shape), None)
    if missing:
        return f"missing {missing[0]!r}"
    if unexpected:
        return f"unexpected {unexpected[0]!r}"
    if wrong is None:
        return None
    return f"{wrong!r} is {tuple(state[wrong].shape)}, this model's {tuple(mine[wrong].shape)}"


def optimizer_state_problem(optimizer: Any, state: Any) -> str | None:
    """What ``optimizer.load_state_dict(state)`` would refuse (its layout, torch's own group checks), or None."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    mine = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or not isinstance(state.get("state"), Mapping) or \
            not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        return "not an optimizer state_dict"
    if len(groups) != len(mine):
        return f"the checkpoint holds {len(groups)} parameter group(s), this optimizer has {len(mine)}"
    if any(len(g["params"]) != len(m["params"]) for g, m in zip(groups, mine)):
        return "a parameter group's size differs from this optimizer's"
    return None
