"""rpcompile: compile a PyTorch model into a round-robin pipeline that trains on a few PCIe GPUs.

Public surface (imported lazily, so ``import rpcompile`` and the CLI start fast and the solver stays torch-free)::

    gm = rpcompile.trace(model, example_inputs)             # torch.fx, torch.export as the fallback
    prof = rpcompile.profile(model, example_inputs, spec="rtx4090")   # per-node and per-module costs
    plan = rpcompile.Plan.load("plan.json"); rpcompile.verify_plan(plan, gm)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "trace": "rpcompile.passes.graph.trace",
    "module_path": "rpcompile.passes.graph.util",
    "Plan": "rpcompile.core.plan",
    "Stage": "rpcompile.core.plan",
    "Hardware": "rpcompile.core.plan",
    "Fingerprint": "rpcompile.core.plan",
    "Prediction": "rpcompile.core.plan",
    "SCHEMA_VERSION": "rpcompile.core.plan",
    "verify_plan": "rpcompile.planner.invariants",
    "fingerprint": "rpcompile.passes.graph.fingerprint",
    "DeviceSpec": "rpcompile.core.specs",
    "SPECS": "rpcompile.core.specs",
    "get_spec": "rpcompile.core.specs",
    "load_model": "rpcompile.models.registry",
    "list_models": "rpcompile.models.registry",
    "profile": "rpcompile.planner.profiling",
    "plan": "rpcompile.planner.planning",
    "PlanOptions": "rpcompile.planner.plan_options",
    "compile": "rpcompile.compiler",
    "max_sequence_length": "rpcompile.planner.seqlen",
    "LinkBoundWarning": "rpcompile.planner.envelope",
    "PrecisionWarning": "rpcompile.training.signature",
    "Pipeline": "rpcompile.training.pipeline",
    "save_checkpoint": "rpcompile.training.checkpoint.save",
    "load_checkpoint": "rpcompile.training.checkpoint.load",
    "checkpoint_plan": "rpcompile.training.checkpoint.load",
    "Checkpoint": "rpcompile.training.checkpoint.state",
    "load_weights": "rpcompile.training.checkpoint.load",
    "save_weights": "rpcompile.training.checkpoint.save",
    "CheckpointError": "rpcompile.training.checkpoint.state",
    "Profile": "rpcompile.core.profile",
    "RPCompileError": "rpcompile.core.errors",
    "TraceError": "rpcompile.core.errors",
    "PlanError": "rpcompile.core.errors",
    "PlanFileError": "rpcompile.core.errors",
    "PlanMismatchError": "rpcompile.core.errors",
    "PlanVerificationError": "rpcompile.core.errors",
    "InfeasibleError": "rpcompile.core.errors",
    "ConfigError": "rpcompile.core.errors",
    "InputError": "rpcompile.core.errors",
    "ModelChangedError": "rpcompile.core.errors",
    "LossFnError": "rpcompile.core.errors",
    "BatchSplitError": "rpcompile.core.errors",
    "LossHeadError": "rpcompile.core.errors",
    "ConcurrentCallError": "rpcompile.core.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rpcompile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    # cached as a module global: later look-ups find it directly and never reach __getattr__ again
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
