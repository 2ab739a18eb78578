"""What a pipeline's GPUs may hold: the memory a plan for a GPU may use (:func:`gpu_memory_limit`), and the saved
activations that may wait on a device to go down (:func:`offload_budget`, the lazy offload of
:mod:`rpcompile.runtime.offload`)."""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import ConfigError
from ..core.plan import Plan
from ..core.specs import get_spec

__all__ = ["gpu_memory_limit", "offload_budget"]


def gpu_memory_limit(device: torch.device, spec: Any = None) -> int:
    """The memory a plan for GPU ``device`` may use: 90% of what it has — no more than ``spec``'s usable memory
    when a spec is given (a plan for a 24 GB card made on an 80 GB one stays a plan for the 24 GB card). A device
    that is not a CUDA GPU (a device class of the user's) has what its ``spec`` says."""
    if torch.device(device).type != "cuda":
        if spec is None:
            raise ConfigError(f"how much memory a {torch.device(device).type} device has is unknown: pass "
                              "memory_limit= (bytes) or spec= (a GPU spec name)")
        return get_spec(spec).usable_memory_bytes
    have = int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    return have if spec is None else min(have, get_spec(spec).usable_memory_bytes)


def offload_budget(plan: Plan, device: int, devices: int) -> int:
    """Saved activations that may wait on ``device`` to go down: the memory its stages leave free (the lazy
    offload policy of :func:`rpcompile.passes.solver.timing.offload_backlog`)."""
    # the stages this device runs in round robin (stage k on device k mod devices): what the largest of them leaves free
    # may wait there, so no stage's own memory is given up for it
    mine = [s.memory_bytes for k, s in enumerate(plan.stages) if k % devices == device]
    return max(0, plan.hardware.memory_bytes - max(mine, default=0))
