"""The simulator's core: walk the executor's own per-device action lists with a clock instead of devices.

Each device has a compute queue, an upload link and a download link. ``kW`` occupies the device's upload link for
``upload_s[k]`` and may start as soon as the link is free — so a stage's weights are prefetched while the device
still computes its previous stage; ``kFj`` starts when the device's compute queue is free, stage k−1 has finished
microbatch j and stage k's weights are on the device; ``kG`` occupies the download link after the stage's last
microbatch. With no transfers this is exactly the timing model's recurrence
(:func:`rpcompile.passes.problem.pipeline_time`, DESIGN.md §3).

(First slice of the simulator issue: host-bandwidth caps, memory accounting and the static GPipe/1F1B schedules
build on this loop.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .schedule import Action

__all__ = ["SimEvent", "SimResult", "simulate"]


@dataclass(frozen=True)
class SimEvent:
    """One simulated action: where it ran (``lane``: compute, upload or download) and when."""

    action: str
    device: int
    lane: str
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    timeline: tuple[SimEvent, ...]
    iteration_time_s: float
    busy_s: tuple[float, ...]
    """Compute time per device."""

    @property
    def bubble_fraction(self) -> float:
        """Idle compute time over total compute capacity (devices × iteration)."""
        total = len(self.busy_s) * self.iteration_time_s
        return 1.0 - sum(self.busy_s) / total if total > 0 else 0.0

    @property
    def utilisation(self) -> tuple[float, ...]:
        return tuple(b / self.iteration_time_s if self.iteration_time_s else 0.0 for b in self.busy_s)


def simulate(
    lists: Sequence[Sequence[Action]],
    stage_times: Sequence[float],
    *,
    upload_s: Sequence[float] | None = None,
    download_s: Sequence[float] | None = None,
) -> SimResult:
    """Run the action lists with a clock; ``stage_times[k]`` is stage k's time per microbatch."""
    n_stages = len(stage_times)
    up = list(upload_s) if upload_s is not None else [0.0] * n_stages
    down = list(download_s) if download_s is not None else [0.0] * n_stages
    compute_free = [0.0] * len(lists)
    up_free, down_free = [0.0] * len(lists), [0.0] * len(lists)
    weights_ready: dict[int, float] = {}
    finished: dict[tuple[int, int], float] = {}
    last_mb: dict[int, float] = {}
    events: list[SimEvent] = []
    busy = [0.0] * len(lists)
    cursor = [0] * len(lists)
    pending = sum(len(acts) for acts in lists)
    while pending:
        progressed = False
        for d, acts in enumerate(lists):
            while cursor[d] < len(acts):
                act = acts[cursor[d]]
                if act.kind == "W":
                    start = up_free[d]
                    end = start + up[act.stage]
                    up_free[d] = weights_ready[act.stage] = end
                    lane = "upload"
                elif act.kind == "F":
                    dep = (act.stage - 1, act.microbatch)
                    if act.stage > 0 and dep not in finished:
                        break  # waits for another device
                    start = max(compute_free[d], finished.get(dep, 0.0), weights_ready.get(act.stage, 0.0))
                    end = start + stage_times[act.stage]
                    compute_free[d] = finished[(act.stage, act.microbatch)] = last_mb[act.stage] = end
                    busy[d] += stage_times[act.stage]
                    lane = "compute"
                else:
                    start = max(down_free[d], last_mb[act.stage])
                    end = start + down[act.stage]
                    down_free[d] = end
                    lane = "download"
                events.append(SimEvent(str(act), d, lane, start, end))
                cursor[d] += 1
                pending -= 1
                progressed = True
        if not progressed:
            raise ValueError("the action lists deadlock: a microbatch waits for a stage that never runs it")
    end = max((e.end for e in events), default=0.0)
    return SimResult(tuple(events), end, tuple(busy))
