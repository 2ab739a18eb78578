"""The operating envelope: is a planned iteration bound by the host link rather than by compute?

A stage uploads its weights once per iteration (``weight_bytes`` over the host link) and then computes every
microbatch (``compute_s`` each). When the upload takes longer than the compute over all ``m`` microbatches, the
device waits on PCIe, not on its kernels: the microbatches hold too few tokens for the weights each stage moves.
Compute grows with the tokens per microbatch and the upload does not, so the plan becomes compute-bound at about

    tokens · (weight_bytes / link) / (m · compute_s)

tokens per microbatch (the largest over the link-bound stages; compute taken as linear in the tokens, the fixed
per-stage overhead left out). That is an estimate: at very small microbatches kernel launch overheads make the
compute per token look dearer than it is at the threshold, so the true figure is higher.

:func:`link_bound` applies the rule to a plan; :func:`warn_if_link_bound` issues one
:class:`LinkBoundWarning` (``rpcompile.compile`` and ``rpcompile.plan`` call it; ``rpcompile plan`` prints the
same line once).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rpcompile.core.plan import Plan

__all__ = ["LinkBoundWarning", "LinkBound", "link_bound", "microbatch_tokens", "warn_if_link_bound"]


class LinkBoundWarning(UserWarning):
    """A plan whose iteration waits on the host link (weight uploads), not on compute."""


@dataclass(frozen=True)
class LinkBound:
    """Why a plan is link-bound: its worst stage and the microbatch size at which it would not be."""

    stages: tuple[str, ...]
    """The stages whose weight upload outlasts their compute over all microbatches."""
    worst: str
    upload_s: float
    """The worst stage's weight upload (weight bytes / link bandwidth)."""
    compute_s: float
    """The worst stage's compute over all microbatches."""
    tokens: int
    """Tokens (or samples) per microbatch of the plan."""
    unit: str
    """``tokens`` (an integer token-id input) or ``samples``."""
    compute_bound_tokens: int
    """About how many tokens per microbatch make every stage compute-bound."""
    microbatches: int
    stage_count: int

    def message(self) -> str:
        return (f"link-bound plan: {len(self.stages)} of {self.stage_count} stages take longer to upload their weights "
                f"than to compute their {self.microbatches} microbatches of {self.tokens} {self.unit} (worst "
                f"{self.worst}: {self.upload_s * 1e3:.2f} ms upload vs {self.compute_s * 1e3:.2f} ms compute); it "
                f"would be compute-bound from about {self.compute_bound_tokens} {self.unit} per microbatch (a lower "
                f"estimate: compute taken as linear in the {self.unit})")


def microbatch_tokens(inputs: Sequence[Any], microbatches: int = 1) -> tuple[int, str]:
    """Tokens per microbatch of a batch ``inputs`` split ``microbatches`` ways: the first tensor's elements per
    microbatch when it holds integer ids (``tokens``), else its rows (``samples``); ``(0, "samples")`` without one."""
    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return 0, "samples"
    # the largest piece, as torch.tensor_split cuts the batch (the one the planner costs)
    rows = math.ceil(first.shape[0] / max(1, microbatches))
    # floating or boolean inputs are features or masks, not token ids: only their rows measure a microbatch
    if first.dtype.is_floating_point or first.dtype.is_complex or first.dtype == torch.bool:
        return rows, "samples"
    return rows * math.prod(first.shape[1:]), "tokens"


def link_bound(plan: Plan, tokens: int, unit: str = "tokens") -> LinkBound | None:
    """The rule of this module on ``plan`` with ``tokens`` per microbatch: None when every stage computes at
    least as long as its weights take to go up."""
    link, m = plan.hardware.link_bytes_per_s, plan.microbatches
    overhead = plan.hardware.spec.stage_overhead_s
    bound, need, worst, worst_ratio = [], 0.0, None, 0.0
    for s in plan.stages:
        upload = s.weight_bytes / link
        # the weights go up once per iteration, hidden while the stage computes all m microbatches if that is longer
        if upload <= m * s.compute_s:
            continue
        bound.append(s.name)
        # only the compute beyond the fixed per-stage overhead grows with the tokens; a stage no longer than the
        # overhead keeps its whole time so the ratio stays finite
        compute = m * (s.compute_s - overhead if s.compute_s > overhead else s.compute_s)
        ratio = upload / compute if compute > 0 else 0.0
        if worst is None or ratio > worst_ratio:
            worst, worst_ratio = s, ratio
        # compute taken as linear in the tokens: ratio times as many make this stage's compute match its upload
        need = max(need, tokens * ratio)
    if worst is None or tokens <= 0:
        return None
    return LinkBound(stages=tuple(bound), worst=worst.name, upload_s=worst.weight_bytes / link,
                     compute_s=m * worst.compute_s, tokens=tokens, unit=unit,
                     compute_bound_tokens=math.ceil(need),
                     microbatches=m, stage_count=len(plan.stages))


def warn_if_link_bound(plan: Plan | None, microbatch_inputs: Sequence[Any]) -> LinkBound | None:
    """Issue one :class:`LinkBoundWarning` when ``plan`` is link-bound for one microbatch's ``microbatch_inputs``;
    returns what :func:`link_bound` found."""
    if plan is None:
        return None
    found = link_bound(plan, *microbatch_tokens(microbatch_inputs))
    if found is not None:
        warnings.warn(found.message(), LinkBoundWarning, stacklevel=3)
    return found
