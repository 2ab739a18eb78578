"""Validating the simulator against the executor: run a compiled pipeline, record what its executor did, and
compare it with the simulator fed by the plan's own (measured) costs.

Per stage, the measured figure is the median duration of its microbatch actions in the executor's timeline
(dependency waits excluded: an action's clock starts once its inputs are ready) and the predicted figure is the
plan's ``compute_s``. For the iteration, the simulator walks the pipeline's own action lists with those stage
times (``link_bytes_per_s`` infinite for logical CPU devices, which share memory; the device's own link
otherwise) and is compared with the timeline's span.

Measure the costs under the conditions the executor runs in: ``k`` logical CPU devices each get
``threads // k`` intra-op threads, and ``rpcompile.compile`` profiles with that many.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rpcompile.core.errors import ConfigError
from rpcompile.core.schedule import parse_action
from rpcompile.core.stages import StageCost
from rpcompile.runtime.sim.simulator import simulate

from ..compiler import compile as compile_pipeline

__all__ = ["StageComparison", "Validation", "compile_for_validation", "validate"]


@dataclass(frozen=True)
class StageComparison:
    name: str
    predicted_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        """Measured over predicted."""
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else math.inf


@dataclass(frozen=True)
class Validation:
    stages: tuple[StageComparison, ...]
    predicted_iteration_s: float
    """The simulator's iteration time."""
    measured_iteration_s: float
    """The executor's: first action start to last action end, median over the measured iterations."""

    @property
    def iteration_ratio(self) -> float:
        return self.measured_iteration_s / self.predicted_iteration_s if self.predicted_iteration_s > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "predicted_iteration_s": self.predicted_iteration_s,
            "measured_iteration_s": self.measured_iteration_s,
            "iteration_ratio": self.iteration_ratio,
            "stages": [{"name": s.name, "predicted_s": s.predicted_s, "measured_s": s.measured_s, "ratio": s.ratio}
                       for s in self.stages],
        }


def compile_for_validation(model: torch.nn.Module, example_inputs: Sequence[Any], *, devices: Sequence[str],
                           **kwargs: Any) -> Any:
    """``rpcompile.compile`` with measured costs (no ``spec``): on ``k`` logical CPU devices it already measures
    at the ``threads // k`` intra-op threads each device will run with."""
    if "spec" in kwargs:
        raise ConfigError("simulator validation compares measured costs with the executor: leave out spec=")
    return compile_pipeline(model, example_inputs, devices=list(devices), **kwargs)


def validate(pipe: Any, *inputs: Any, target: Any = None, iterations: int = 5, warmup: int = 2) -> Validation:
    """Run ``iterations`` training iterations of ``pipe`` (after ``warmup``; gradients are zeroed after each)
    and compare the executor's timeline with the simulator (see the module docstring)."""
    def step() -> list:
        pipe.forward_backward(*inputs, target=target)
        for p in pipe.model.parameters():
            p.grad = None
        return list(pipe.timeline)

    # the first calls capture the saved segments and warm the allocator: not what the plan's costs describe
    for _ in range(warmup):
        step()
    runs = [step() for _ in range(max(1, iterations))]
    span = lambda tl: max(e.end for e in tl) - min(e.start for e in tl)  # noqa: E731
    durations: dict[str, list[float]] = {}
    for tl in runs:
        for e in tl:
            # F actions are the per-microbatch compute; W and G are the stage's weight upload and gradients home
            if parse_action(e.action).kind == "F":
                durations.setdefault(e.stage, []).append(e.end - e.start)
    plan = pipe.plan
    # a version-1 plan records only time_s
    predicted = [s.compute_s if s.compute_s > 0 else s.time_s for s in plan.stages]
    stages = tuple(StageComparison(s.name, t, statistics.median(durations.get(s.name, [math.nan])))
                   for s, t in zip(plan.stages, predicted))
    cpu = all(getattr(d, "torch_device", torch.device("cpu")).type == "cpu" for d in pipe.devices)
    # logical CPU devices share the host's memory: their transfers cost nothing here
    link = math.inf if cpu else plan.hardware.link_bytes_per_s
    sim_stages = [StageCost(name=s.name, kind=s.kind, compute_s=t) for s, t in zip(plan.stages, predicted)]
    sim = simulate(pipe.schedule, sim_stages, link_bytes_per_s=link)
    return Validation(stages, sim.iteration_time_s, statistics.median(span(tl) for tl in runs))
