"""A stage that ran out of device memory: which stage, and the plan that would fit.

The planner keeps every stage's predicted peak (``Stage.memory_bytes``) under the plan's limit
(``Hardware.memory_bytes``). A stage that still runs out used more than predicted (or shared the device with
another process). When the allocator's message gives the sizes — PyTorch's CUDA message says what it tried to
allocate, the device's capacity and what was free — the stage needed about ``capacity - free + requested``; the
memory model under-predicted it by ``needed / planned``, so a plan whose stages are predicted at no more than
``capacity × planned / needed`` fits: that is the ``--memory-limit`` offered. Without sizes (another allocator's
message) the offer is 10% under the plan's limit.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from rpcompile.core.plan import Plan
from rpcompile.core.units import fmt_bytes
from rpcompile.runtime.failures import PipelineError

__all__ = ["StageOutOfMemoryError", "out_of_memory", "fitting_limit"]

_UNITS = {"B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = r"([0-9.]+) ?([KMGT]iB|B)"


class StageOutOfMemoryError(PipelineError, torch.OutOfMemoryError):
    """A stage ran out of device memory (an ``OutOfMemoryError`` too: handlers of torch's keep working)."""


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.upper()])


def _sizes(message: str) -> tuple[int, int, int] | None:
    """``(requested, capacity, free)`` from PyTorch's CUDA out-of-memory message, or None."""
    tried = re.search(r"Tried to allocate " + _SIZE, message)
    total = re.search(r"total capacity of " + _SIZE + r" of which " + _SIZE + r" is free", message)
    if tried is None or total is None:
        return None
    # the capacity's number and unit, then the free memory's
    return _bytes(*tried.groups()), _bytes(*total.groups()[:2]), _bytes(*total.groups()[2:])


def fitting_limit(planned: int, limit: int, sizes: tuple[int, int, int] | None) -> int:
    """The ``--memory-limit`` under which the stage would fit (module docstring), in bytes."""
    if sizes is None or planned <= 0:
        return int(limit * 0.9)
    requested, capacity, free = sizes
    needed = capacity - free + requested
    # at least 10% under the plan's limit: where the stage needed little more than planned, the ratio alone would
    # offer a limit no lower than the one that failed
    return min(int(limit * 0.9), int(capacity * planned / max(needed, 1)))


def _limit_arg(n: int) -> str:
    """``n`` bytes as ``--memory-limit`` takes it, rounded down (1 decimal of the largest unit that fits)."""
    for unit in ("GiB", "MiB", "KiB"):
        size = _UNITS[unit.upper()]
        if n >= size:
            # rounded down: rounded up, the offer could let the plan that failed through again
            return f"{int(n * 10 / size) / 10:g}{unit}"
    return str(n)


def _plan_command(plan: Plan, limit: int, devices: Sequence[str]) -> str:
    hw = plan.hardware
    # a measured plan is measured again on the device; an analytic one needs the spec it was made for
    costs = f"--device {devices[0]}" if plan.cost_model == "measured" else f"--spec {hw.spec.name}"
    return (f"rpcompile plan MODEL --gpus {hw.device_count} {costs} --microbatches {plan.microbatches} "
            f"--precision {plan.precision} --memory-limit {_limit_arg(limit)}")


def out_of_memory(err: PipelineError, plan: Plan, devices: Sequence[str]) -> StageOutOfMemoryError | None:
    """``err`` as a :class:`StageOutOfMemoryError` when its cause is an out-of-memory error, else None: one line
    naming the stage, device and microbatch, what the plan predicted, and the command that plans for less."""
    cause = err.__cause__
    # no stage to name (the host's lookups, an overlapped optimizer step): the error stays as it is
    if not isinstance(cause, torch.OutOfMemoryError) or err.stage is None:
        return None
    stage = next(s for s in plan.stages if s.name == err.stage)
    sizes = _sizes(str(cause))
    limit = fitting_limit(stage.memory_bytes, plan.hardware.memory_bytes, sizes)
    where = f"device {err.device} ({devices[err.device]})" if err.device is not None else "its device"
    at = f" at microbatch {err.microbatch}" if err.microbatch is not None else ""
    planned = f"planned at {fmt_bytes(stage.memory_bytes)} under a {fmt_bytes(plan.hardware.memory_bytes)} limit"
    if sizes is not None:
        needed = sizes[1] - sizes[2] + sizes[0]
        planned += f", it needed about {fmt_bytes(needed)} of the device's {fmt_bytes(sizes[1])}"
    new = StageOutOfMemoryError(f"stage {err.stage} ran out of memory on {where}{at} ({planned}); plan for less "
                                f"memory: {_plan_command(plan, limit, devices)} (or compile(..., memory_limit={limit}))")
    # as the PipelineError had them, for handlers that read which stage, device and microbatch failed
    new.stage, new.device, new.microbatch, new.details = err.stage, err.device, err.microbatch, err.details
    return new
