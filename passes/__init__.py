"""Graph passes: functions over a traced ``torch.fx.GraphModule`` (or over plain numbers, for the solver).

Each analysis pass writes one namespaced ``node.meta`` key:

- :func:`~rpcompile.passes.graph.shape.shape_pass` → ``"rpcompile.shape"`` (dtype, shape, bytes of each output);
- :func:`~rpcompile.passes.cost.cost.cost_pass` → ``"rpcompile.cost"`` (time, bytes, FLOPs per node), with a
  :class:`~rpcompile.passes.cost.measured.MeasuredCostModel` or an
  :class:`~rpcompile.passes.cost.analytic.AnalyticCostModel`.

Imports are lazy so that the torch-free solver modules can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "shape_pass": "graph.shape",
    "SHAPE_KEY": "graph.shape",
    "cost_pass": "cost.cost",
    "COST_KEY": "cost.cost",
    "NodeCost": "cost.cost",
    "CostModel": "cost.cost",
    "MeasuredCostModel": "cost.measured",
    "AnalyticCostModel": "cost.analytic",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rpcompile.passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
