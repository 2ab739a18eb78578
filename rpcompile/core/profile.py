"""A model's cost profile: what ``rpcompile.profile`` returns and the views print (:class:`Profile`), rows of costs
rolled up over its modules (:class:`CostRow`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .specs import HostSpec

__all__ = ["CostRow", "Profile"]


@dataclass(frozen=True)
class CostRow:
    """Costs rolled up over a module (or one node, or the whole model)."""

    name: str
    params: int
    param_bytes: int
    fwd_flops: int
    fwd_time_s: float
    bwd_time_s: float
    activation_bytes: int
    nodes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Profile:
    """The cost table of one model: totals, per-module rows in graph order, and per-node rows."""

    total: CostRow
    modules: tuple[CostRow, ...]
    nodes: tuple[CostRow, ...]
    cost_model: str
    trace: str
    host: HostSpec | None = None
    """The host, when profiling probed it (``probe_host=True``)."""

    def to_dict(self, *, nodes: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "cost_model": self.cost_model,
            "trace": self.trace,
            "total": {k: v for k, v in self.total.to_dict().items() if k != "name"},
            "modules": [r.to_dict() for r in self.modules],
        }
        if nodes:
            d["nodes"] = [r.to_dict() for r in self.nodes]
        if self.host is not None:
            d["host"] = self.host.to_dict()
        return d
