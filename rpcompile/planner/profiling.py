"""The cost report: the front of the pass pipeline (trace → shape → cost, :func:`rpcompile.planner.planning.analyze`)
rolled up by source module (``layers.3``, ``lm_head``, …) into a :class:`~rpcompile.core.profile.Profile` — the
table behind ``rpcompile profile`` and its ``--json`` form — and, with ``probe_host=True``, the host the optimizer
step and the gradient accumulation will run on (:func:`rpcompile.planner.probe.probe_host`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from rpcompile.passes.cost.cost_model import node_cost
from rpcompile.passes.graph.util import compute_nodes, module_path

from ..core.profile import CostRow, Profile
from ..core.specs import DeviceSpec
from .plan_options import make_cost_model, model_device
from .planning import analyze
from .probe import probe_host as measure_host

__all__ = ["profile", "profile_graph", "rollup_name"]


_NUMERIC = re.compile(r"^\d+$")


def rollup_name(path: str, depth: int) -> str:
    """Cut a module path to ``depth`` components (``layers.3.attn.q`` at depth 2 → ``layers.3``)."""
    parts = path.split(".") if path else []
    return ".".join(parts[:depth]) if parts else "(root)"


def _auto_depth(paths: Sequence[str]) -> int:
    """Depth that keeps the index of the first module list (``layers.3``, ``model.layers.3``); 1 if none."""
    # a depth that ends at a numeric part (a module list's index); the least is the outermost list
    depths = [i + 1 for p in paths for i, part in enumerate(p.split(".")) if _NUMERIC.match(part)]
    return min(depths) if depths else 1


def profile_graph(gm: fx.GraphModule, *, depth: int | None = None) -> Profile:
    """Roll the ``rpcompile.cost`` annotations of ``gm`` up by module."""
    nodes = compute_nodes(gm)
    paths = {n: module_path(n) for n in nodes}
    depth = depth or _auto_depth(list(paths.values()))
    params = dict(gm.named_parameters())
    seen: set[str] = set()
    node_rows: list[tuple[str, CostRow]] = []
    groups: dict[str, list[CostRow]] = {}
    for n in nodes:
        c = node_cost(n)
        # a parameter several nodes read (a tied embedding) counts at its first reader only, so the totals hold it once
        new = [p for p in c.params if p not in seen]
        seen.update(new)
        row = CostRow(
            name=n.name,
            params=sum(params[p].numel() for p in new if p in params),
            param_bytes=sum(params[p].numel() * params[p].element_size() for p in new if p in params),
            fwd_flops=c.fwd_flops,
            fwd_time_s=c.fwd_time_s,
            bwd_time_s=c.bwd_time_s,
            activation_bytes=c.act_bytes,
            nodes=1,
        )
        node_rows.append((paths[n], row))
        groups.setdefault(rollup_name(paths[n], depth), []).append(row)
    modules = tuple(_sum_rows(name, rows) for name, rows in groups.items())
    total = _sum_rows("total", [r for _, r in node_rows])
    return Profile(
        total=total,
        modules=modules,
        nodes=tuple(CostRow(**{**r.to_dict(), "name": f"{p or '(root)'}:{r.name}"}) for p, r in node_rows),
        cost_model=str(gm.meta.get("rpcompile.cost_model", "")),
        trace=str(gm.meta.get("rpcompile.trace", "")),
    )


def _sum_rows(name: str, rows: Sequence[CostRow]) -> CostRow:
    return CostRow(
        name=name,
        params=sum(r.params for r in rows),
        param_bytes=sum(r.param_bytes for r in rows),
        fwd_flops=sum(r.fwd_flops for r in rows),
        fwd_time_s=sum(r.fwd_time_s for r in rows),
        bwd_time_s=sum(r.bwd_time_s for r in rows),
        activation_bytes=sum(r.activation_bytes for r in rows),
        nodes=sum(r.nodes for r in rows),
    )


def profile(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    spec: "str | DeviceSpec | None" = None,
    device: "str | torch.device | None" = None,
    dtype: torch.dtype | None = None,
    depth: int | None = None,
    leaf_modules: Sequence[Any] = (),
    progress: bool | None = None,
    probe_host: bool = False,
    cache: bool = True,
) -> Profile:
    """Trace and cost ``model``; analytic on ``spec`` or measured on ``device`` (see :func:`~rpcompile.planner.plan_options.make_cost_model`).
    ``probe_host``: also measure this host (about a second; :func:`rpcompile.planner.probe.probe_host`). ``cache``: reuse
    measured costs kept on disk (:mod:`rpcompile.passes.cost.profile_cache`); ``False`` measures afresh, keeps
    nothing."""
    cost_model = make_cost_model(spec=spec, device=device, dtype=dtype, model_device=model_device(model),
                                 cache=cache)
    gm = analyze(model, example_inputs, example_kwargs=example_kwargs, cost_model=cost_model,
                 leaf_modules=leaf_modules, progress=progress)
    prof = profile_graph(gm, depth=depth)
    return dataclasses.replace(prof, host=measure_host()) if probe_host else prof
