"""Graph passes: functions over a traced ``torch.fx.GraphModule`` (or over plain numbers, for the solver).

Each analysis pass writes one namespaced ``node.meta`` key:

- :func:`~rpcompile.passes.shape.shape_pass` → ``"rpcompile.shape"`` (dtype, shape, bytes of each output);
- :func:`~rpcompile.passes.cost.cost_pass` → ``"rpcompile.cost"`` (time, bytes, FLOPs per node), with a
  :class:`~rpcompile.passes.measured.MeasuredCostModel` or an :class:`~rpcompile.passes.analytic.AnalyticCostModel`.

Imports are lazy so that the torch-free solver modules can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "shape_pass": "shape",
    "SHAPE_KEY": "shape",
    "cost_pass": "cost",
    "COST_KEY": "cost",
    "NodeCost": "cost",
    "CostModel": "cost",
    "MeasuredCostModel": "measured",
    "AnalyticCostModel": "analytic",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rpcompile.passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
