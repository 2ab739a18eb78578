"""Lowering node ranges into a :class:`~rpcompile.core.plan.Plan`.

Strategies decide *where* to cut (in segments or node indices); this module turns those cuts into a plan of
names: each stage's compute nodes, the parameters they read, the source modules they come from, and the saved
set. Ranges are half-open intervals over the graph's compute nodes in topological order.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch.fx as fx

from .core.plan import Hardware, Plan, Prediction, Stage
from .verify import fingerprint

__all__ = ["plan_from_ranges"]


def _modules(nodes: Sequence[fx.Node]) -> tuple[str, ...]:
    from rpcompile.passes.util import module_path

    out: list[str] = []
    for n in nodes:
        path = module_path(n) or "(root)"
        if not out or out[-1] != path:
            out.append(path)
    return tuple(dict.fromkeys(out))


def _tokens(gm: fx.GraphModule) -> int:
    """Elements of the first integer-typed input (token ids), else the first input's batch size; 0 if unknown."""
    from rpcompile.passes.shape import SHAPE_KEY

    shapes = [t for n in gm.graph.nodes if n.op == "placeholder" and SHAPE_KEY in n.meta for t in n.meta[SHAPE_KEY].tensors]
    for t in shapes:
        if t.dtype.startswith(("int", "uint")):
            return math.prod(t.shape)
    return shapes[0].shape[0] if shapes and shapes[0].shape else 0


def plan_from_ranges(
    gm: fx.GraphModule,
    *,
    forward: Sequence[tuple[int, int]],
    fused: tuple[int, int],
    backward: Sequence[tuple[int, int]],
    hardware: Hardware,
    microbatches: int,
    saved: Sequence[str] = (),
    stage_times: Sequence[float] | None = None,
    stage_memory: Sequence[int] | None = None,
    stage_figures: Sequence[dict] | None = None,
    predicted: Prediction | None = None,
    strategy: str = "manual",
    cost_model: str = "",
    precision: str = "fp32",
    stats: dict | None = None,
) -> Plan:
    """Build a Plan whose stages are ``forward`` (F0.. ascending), ``fused`` and ``backward`` (B1.. descending)
    node-index ranges of ``gm``'s compute nodes. ``saved`` names nodes whose activations are saved to host;
    ``stage_times``/``stage_memory`` are per stage in execution order, and so are ``stage_figures`` (extra
    :class:`Stage` fields such as ``compute_s`` and ``weight_bytes``)."""
    from rpcompile.passes.util import compute_nodes, node_params

    nodes = compute_nodes(gm)
    saved_set = set(saved)
    specs = [("forward", f"F{i}", r) for i, r in enumerate(forward)] + [("fused", "FB", fused)]
    specs += [("backward", f"B{i + 1}", r) for i, r in enumerate(backward)]
    n_stages = len(specs)
    times = list(stage_times) if stage_times is not None else [0.0] * n_stages
    memory = list(stage_memory) if stage_memory is not None else [0] * n_stages
    figures = list(stage_figures) if stage_figures is not None else [{}] * n_stages
    if len(times) != n_stages or len(memory) != n_stages or len(figures) != n_stages:
        raise ValueError(f"need {n_stages} stage times, memories and figures, got {len(times)}, {len(memory)}, {len(figures)}")
    stages = []
    for (kind, name, (a, b)), t, mem, fig in zip(specs, times, memory, figures):
        run = nodes[a:b]
        params: dict[str, None] = {}
        for n in run:
            params.update(dict.fromkeys(node_params(gm, n)))
        stages.append(
            Stage(
                name=name,
                kind=kind,  # type: ignore[arg-type]
                nodes=tuple(n.name for n in run),
                params=tuple(params),
                saved=tuple(n.name for n in run if n.name in saved_set) if kind != "fused" else (),
                modules=_modules(run),
                saved_modules=_modules([n for n in run if n.name in saved_set]) if kind == "forward" else (),
                time_s=float(t),
                memory_bytes=int(mem),
                **fig,
            )
        )
    return Plan(
        model=fingerprint(gm),
        hardware=hardware,
        microbatches=microbatches,
        stages=tuple(stages),
        predicted=predicted or Prediction(iteration_time_s=0.0, bubble_fraction=0.0, peak_memory_bytes=max(memory, default=0)),
        strategy=strategy,
        cost_model=cost_model,
        precision=precision,
        tokens_per_microbatch=_tokens(gm),
        stats=stats or {},
    )
