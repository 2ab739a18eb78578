"""The pipeline's own state as files a person can read: ``pipeline.json`` and, for its tensors, ``pipeline.safetensors``.

``pipeline.json`` holds :meth:`Pipeline.state_dict <rpcompile.training.pipeline.Pipeline.state_dict>`'s scalars and
the plan as JSON::

    {"format": "rpcompile.training.pipeline", "version": 2, "iteration": 6, "dropout_seed": "0",
     "scaler": null, "microbatches": 2, "precision": "fp32", "model": "<fingerprint>", "cuts": "<digest>",
     "stale_weights": ["l1.weight", ...], "plan": {...the plan file's JSON...}}

``dropout_seed`` is text (a seed is an unsigned 64-bit number, beyond what strict JSON integers hold here);
``scaler`` is the ``GradScaler``'s ``state_dict`` (numbers); ``stale_weights`` names the tensors in
``pipeline.safetensors`` — the weight copies from before an overlapped step that the next iteration computes with
(absent when there are none). Reading checks the file as strict, bounded JSON and the plan as a plan file
(:meth:`Plan.from_dict <rpcompile.core.plan.Plan.from_dict>`) and rebuilds exactly the dict ``state_dict()``
returned; its fields are then checked as any pipeline state is (:func:`.state.check_pipeline_state`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from ...core.errors import PlanFileError
from ...core.files import read_json, write_atomic_hashed
from ...core.plan import MAX_PLAN_BYTES, Plan
from .tensorfile import read_file, write_tensors

__all__ = ["PIPELINE_FILE", "PIPELINE_TENSORS", "write_pipeline", "read_pipeline"]

PIPELINE_FILE = "pipeline.json"
PIPELINE_TENSORS = "pipeline.safetensors"
_SEED = re.compile(r"^\d{1,20}$")
_MAX_SEED = 2**64 - 1


def write_pipeline(directory: Path, state: Mapping[str, Any]) -> dict[str, tuple[int, str]]:
    """Write ``state`` (``Pipeline.state_dict()``) into ``directory``; each file's bytes and sha256."""
    stale = dict(state["stale_weights"])
    scaler = state["scaler"]
    seed = state.get("dropout_seed")
    body = {"format": state["format"], "version": state["version"], "iteration": state["iteration"],
            "dropout_seed": None if seed is None else str(int(seed)),
            # JSON takes no tensors: one in a scaler's state is stored as its number
            "scaler": None if scaler is None else {k: v.item() if isinstance(v, torch.Tensor) else v
                                                   for k, v in scaler.items()},
            "microbatches": state["microbatches"], "precision": state["precision"], "model": state["model"],
            "cuts": state["cuts"], "stale_weights": list(stale), "plan": json.loads(state["plan"])}
    # strict JSON: a NaN or infinity (a broken scale) fails here, at the save, not at the load
    written = {PIPELINE_FILE: write_atomic_hashed(directory / PIPELINE_FILE,
                                                  json.dumps(body, indent=1, allow_nan=False) + "\n")}
    if stale:
        written[PIPELINE_TENSORS] = write_atomic_hashed(directory / PIPELINE_TENSORS,
                                                        lambda f: write_tensors(f, stale, {"format": "pt"}))
    return written


def read_pipeline(directory: Path) -> dict[str, Any]:
    """The pipeline state saved in ``directory`` as ``Pipeline.state_dict()`` returned it; ValueError (one line)
    naming the problem."""
    try:
        # the plan's own bound and room for the few other fields
        obj = read_json(directory / PIPELINE_FILE, max_bytes=MAX_PLAN_BYTES + (1 << 20), max_depth=12,
                        what="a pipeline state")
    except FileNotFoundError:
        raise ValueError(f"no {PIPELINE_FILE}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{PIPELINE_FILE} is corrupt ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{PIPELINE_FILE} is a JSON {type(obj).__name__}, not an object")
    state = dict(obj)
    plan = obj.get("plan")
    if not isinstance(plan, dict):
        raise ValueError(f"{PIPELINE_FILE} holds no plan")
    try:
        # checked as a plan file, then back to the text state_dict() holds
        state["plan"] = Plan.from_dict(plan, source=f"{PIPELINE_FILE}'s plan").to_json()
    except PlanFileError as e:
        raise ValueError(str(e)) from None
    seed = obj.get("dropout_seed")
    if seed is not None:
        # 20 digits hold every 64-bit number, and more: the bound is checked too
        if not isinstance(seed, str) or not _SEED.match(seed) or int(seed) > _MAX_SEED:
            raise ValueError(f"{PIPELINE_FILE}: dropout_seed is {str(seed)[:30]!r}, not a 64-bit seed as text")
        state["dropout_seed"] = int(seed)
    names = obj.get("stale_weights")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{PIPELINE_FILE}: stale_weights is not a list of names")
    state["stale_weights"] = _read_stale(directory, names)
    return state


def _read_stale(directory: Path, names: list[str]) -> dict[str, torch.Tensor]:
    if not names:
        return {}
    _, tensors = read_file(directory / PIPELINE_TENSORS)
    if set(tensors) != set(names):
        raise ValueError(f"{PIPELINE_TENSORS} holds other tensors than {PIPELINE_FILE} names")
    return {n: tensors[n] for n in names}
