"""Weights that stay on a device between stages: the runtime's side of ``Stage.keeps`` and ``Plan.resident``.

Normally a stage's device copies of its weights go with the stage, and the next stage that reads a parameter
uploads it again. A plan may instead keep some of a forward stage's weights on its device for the backward stage
there that differentiates them (``keeps``; that stage ``finds`` them), or keep every weight on its device across
iterations (``resident``). Which stage finds and keeps what is :func:`rpcompile.core.schedule.weight_stays`'s
walk over the stages' parameters, the same walk the planner priced (:mod:`rpcompile.passes.stays`).

:class:`DeviceWeights` holds the copies that stay, per device, each with the version of the host copy it was made
from (:meth:`~.weights.WeightStore.version`). A stage takes the copies it finds (:meth:`DeviceWeights.take`) and
uploads only the rest; it leaves the copies it keeps (:meth:`DeviceWeights.leave`). A copy whose host copy
changed since — after an optimizer step, a ``load_state_dict``, ``pipe.refresh_weights()`` — is not current and
is uploaded again: a resident plan refreshes its trainable weights once per step this way, at their first use in
the iteration, and never uploads a frozen one twice; gradient-accumulation calls between steps upload nothing.
So a stay never serves a stale weight, whatever the plan says; a plan that keeps what nobody finds only holds
memory, which its figures count.

Device memory: a copy that stays is referenced here from the upload of the stage that keeps it until the stage
that finds it takes it (and, while it runs, by that stage's state) — what the planner counts as ``held_bytes`` of
the stages in between. Each device's copies are touched by its worker and its prefetch thread, one stage at a time
in list order, so the upload that keeps one ends before the upload that finds it starts.
"""

from __future__ import annotations

import threading
from typing import Hashable, Sequence

import torch

from rpcompile.core.program import Program
from rpcompile.core.schedule import weight_stays

from .weights import WeightStore, nbytes

__all__ = ["DeviceWeights"]


class DeviceWeights:
    """The weight copies that stay on each of ``devices`` devices for ``program`` (module docstring), and the
    weight bytes each device uploaded and found since it was made (:attr:`uploaded`, :attr:`found`)."""

    def __init__(self, program: Program, devices: int) -> None:
        uses = [list(dict.fromkeys(p.params.values())) for p in program.stages]
        keeps = {n for p in program.stages for n in p.stage.keeps}
        walk = weight_stays(uses, devices, keeps, resident=program.resident)
        self.finds = [w.found for w in walk]
        """Per stage (by index): the parameters it may find on its device."""
        self.keeps = [w.kept for w in walk]
        """Per stage: the parameters it leaves on its device."""
        self.uploaded = [0] * devices
        """Weight bytes each device uploaded (its stages' parameters, not buffers)."""
        self.found = [0] * devices
        """Weight bytes each device's stages found there instead of uploading them."""
        self._copies: list[dict[str, tuple[torch.Tensor, Hashable]]] = [{} for _ in range(devices)]
        self._lock = threading.Lock()
        self._devices, self._resident = devices, program.resident

    def take(self, device: int, stage: int, names: Sequence[str], weights: WeightStore) -> dict[str, torch.Tensor]:
        """The current copies of ``names`` on ``device`` that stage ``stage`` finds there; each one it does not
        keep itself leaves this table (the stage's state holds it now). The device's first stage of a call lets
        go of what an unfinished call left (an evaluation runs no backward stage to find what its forward stages
        kept; a failed call stops anywhere), which its plan does not count on; a resident plan's copies stay."""
        with self._lock:
            copies = self._copies[device]
            if stage < self._devices and not self._resident:
                copies.clear()
            if stage >= len(self.finds) or not self.finds[stage]:
                return {}
            out = {}
            for name in names:
                if name not in self.finds[stage] or name not in copies:
                    continue
                t, version = copies[name] if name in self.keeps[stage] else copies.pop(name)
                if version is not None and version == weights.version(name):
                    out[name] = t
            self.found[device] += sum(nbytes(t) for t in out.values())
        return out

    def holding(self, device: int) -> int:
        """Bytes of weight copies staying on ``device`` now (kept by a stage for a later one, or resident)."""
        with self._lock:
            return sum(nbytes(t) for t, _ in self._copies[device].values())

    def leave(self, device: int, stage: int, uploaded: dict[str, torch.Tensor], weights: WeightStore) -> None:
        """After stage ``stage`` uploaded ``uploaded`` to ``device`` (from :meth:`WeightStore.source`): count them,
        and keep those it leaves there, with the version of the host copy they came from."""
        with self._lock:
            self.uploaded[device] += sum(nbytes(t) for t in uploaded.values())
            if stage < len(self.keeps):
                for name in self.keeps[stage] & uploaded.keys():
                    self._copies[device][name] = (uploaded[name], weights.version(name))
