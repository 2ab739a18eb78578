"""Graph passes: functions over a traced ``torch.fx.GraphModule`` (or over plain numbers, for the solver).

Each analysis pass writes one namespaced ``node.meta`` key:

- :func:`~rpcompile.passes.graph.shape.shape_pass` → ``"rpcompile.shape"`` (dtype, shape, bytes of each output);
- :func:`~rpcompile.passes.cost.cost.cost_pass` → ``"rpcompile.cost"`` (time, bytes, FLOPs per node), with a
  :class:`~rpcompile.passes.cost.measured.MeasuredCostModel` or an
  :class:`~rpcompile.passes.cost.analytic.AnalyticCostModel`.

The package itself imports nothing (each name is imported from its module), so the torch-free solver modules
import without torch.
"""
