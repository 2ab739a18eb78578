"""Plain data of an executor call: host memory between stages (:class:`ValueStore`) and the timeline of what ran
(:class:`TimelineEvent`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from .offload import Landing

__all__ = ["ValueStore", "TimelineEvent"]


@dataclass(frozen=True)
class TimelineEvent:
    """One executed action: what ran where and when (seconds since the call started)."""

    action: str
    stage: str
    microbatch: int
    device: int
    start: float
    end: float


class ValueStore:
    """Host memory between stages: values and accumulated gradients by (name, microbatch)."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int], Any] = {}
        self.grads: dict[tuple[str, int], list[Any]] = {}
        self.lock = threading.Lock()

    def put(self, name: str, mb: int, value: Any) -> None:
        self.values[(name, mb)] = value

    def get(self, name: str, mb: int) -> Any:
        return self.values[(name, mb)]

    def add_grad(self, name: str, mb: int, grad: Any) -> None:
        """Add a gradient contribution (a tensor, or a :class:`~.offload.Landing` of one still going down)."""
        with self.lock:
            # locked: several stages (and their threads) may leave gradients for the same value
            self.grads.setdefault((name, mb), []).append(grad)

    def grad(self, name: str, mb: int) -> torch.Tensor | None:
        """The sum of the contributions, in the order they were added (waits for those still going down)."""
        with self.lock:
            # a copy taken under the lock; the landings are waited for outside it, not holding up add_grad
            parts = list(self.grads.get((name, mb), ()))
        total = None
        for g in parts:
            g = g.wait() if isinstance(g, Landing) else g
            total = g if total is None else total + g  # not in place: the parts stay in the store
        return total
