"""What one training call did, measured: the per-step record a running job reports, and its timeline as a trace.

A :class:`StepRecord` is made at the end of every ``forward_backward`` (``pipe.last_step``) and handed to
``pipe.on_step`` when set — a logger's hook, or the HF Trainer's (:mod:`rpcompile.integrations.hf`). Terms:

- **wall** — the call's time on the caller's clock, from entry to its loss;
- **busy** — per device, the time its compute actions (``F``: a stage's microbatch, forward or backward) took,
  from the executor's timeline; **bubble** — ``1 − Σ busy / (devices × span)``, with ``span`` the timeline's first
  start to last end: the share of device time spent waiting (for weights, hand-offs, other stages);
- **tokens** — what the batch holds: its attention mask's ones, else its token ids' count, else its rows.

:func:`chrome_trace` turns a timeline into the Trace Event Format that Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open — one track per device, an event per action with its stage and microbatch — the format
``torch.profiler``'s exports use, so both can sit side by side.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["StepRecord", "step_record", "batch_tokens", "chrome_trace"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One ``forward_backward`` call, measured (module docstring)."""

    iteration: int
    """The call's iteration (the pipeline's counter after it)."""
    loss: float
    """The loss the call returned."""
    wall_s: float
    """The call's wall time (s)."""
    tokens: int
    """Tokens in the batch (module docstring)."""
    bubble: float
    """Share of the devices' time spent not computing, over the timeline's span."""
    stage_s: Mapping[str, float]
    """Per stage, the time its compute actions took in the call (s)."""
    host_traffic: Mapping[str, int]
    """Host bytes in parameter-sized work since the last call, by activity (``pipe.host_traffic``)."""
    no_sync: bool = False
    """The call ran under ``pipe.no_sync()``."""

    @property
    def tokens_per_s(self) -> float:
        """Tokens over the wall time."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers, for loggers (``tokens_per_s`` included)."""
        return {**dataclasses.asdict(self), "stage_s": dict(self.stage_s), "host_traffic": dict(self.host_traffic),
                "tokens_per_s": self.tokens_per_s}


def batch_tokens(inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """Tokens in a call's batch (module docstring)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        # the mask's ones: padding positions are not tokens
        return int(mask.sum())
    tensors = [v for v in (*inputs, *kwargs.values()) if isinstance(v, torch.Tensor)]
    # integer ids of (batch, sequence): every position, padding included, where no mask tells them apart
    ids = next((t for t in tensors if not t.is_floating_point() and t.dim() >= 2), None)
    if ids is not None:
        return ids.numel()
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0


def step_record(*, iteration: int, loss: torch.Tensor, wall_s: float, tokens: int, timeline: Sequence[Any],
                devices: int, host_traffic: Mapping[str, int], no_sync: bool = False) -> StepRecord:
    """The record of a call from what the pipeline knows after it (module docstring)."""
    # compute only: W (weights up) and G (gradients home) are transfers
    compute = [e for e in timeline if _kind(e.action) == "F"]
    stage_s: dict[str, float] = {}
    for e in compute:
        stage_s[e.stage] = stage_s.get(e.stage, 0.0) + (e.end - e.start)
    span = (max(e.end for e in timeline) - min(e.start for e in timeline)) if timeline else 0.0
    busy = sum(stage_s.values())
    bubble = max(0.0, 1.0 - busy / (devices * span)) if span > 0 and devices else 0.0
    return StepRecord(iteration=iteration, loss=float(loss), wall_s=wall_s, tokens=tokens, bubble=bubble,
                      stage_s=stage_s, host_traffic=dict(host_traffic), no_sync=no_sync)


def chrome_trace(timeline: Sequence[Any], *, devices: int, title: str = "rpcompile") -> str:
    """The timeline in the Trace Event Format (JSON text; module docstring): ``ts``/``dur`` in microseconds."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": f"device {d}"}}
               for d in range(devices)]
    for e in timeline:
        kind = _kind(e.action)
        # the format counts in microseconds; the timeline in seconds
        events.append({"name": f"{e.stage} {kind}" + (f" mb{e.microbatch}" if kind == "F" else ""), "cat": kind,
                       "ph": "X", "pid": 0, "tid": e.device, "ts": round(e.start * 1e6, 3),
                       "dur": round(max(0.0, e.end - e.start) * 1e6, 3),
                       "args": {"stage": e.stage, "action": e.action, "microbatch": e.microbatch}})
    # standard JSON (no NaN or Infinity), which every trace viewer parses
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, allow_nan=False)


def _kind(action: str) -> str:
    """``W``, ``F`` or ``G`` of an action's text (``3F0``: stage 3, microbatch 0)."""
    return action.lstrip("0123456789")[:1]
