"""The front half of the compiler and its report: trace → shape_pass → cost_pass → a per-module cost table.

:func:`analyze` is the small pass driver (each pass logged with its time); :func:`profile` wraps it and rolls
node costs up by source module (``layers.3``, ``lm_head``, …) into a :class:`Profile` — the table behind
``rpcompile profile`` and its ``--json`` form.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from .core.specs import DeviceSpec

__all__ = ["analyze", "profile", "profile_graph", "make_cost_model", "Profile", "CostRow", "rollup_name"]

log = logging.getLogger("rpcompile")


def make_cost_model(*, spec: "str | DeviceSpec | None" = None, device: "str | torch.device | None" = None,
                    dtype: torch.dtype | None = None, model_device: str = "cpu"):
    """Pick a cost model: analytic for ``spec``, measured on ``device``; by default analytic ``rtx4090`` for a
    model on the meta device (it cannot run) and measured on the CPU otherwise."""
    from rpcompile.passes.cost import MeasuredCostModel

    if spec is not None and device is not None:
        raise ValueError("give either spec= (analytic costs) or device= (measured costs), not both")
    if spec is None and device is None and model_device == "meta":
        spec = "rtx4090"
    if spec is not None:
        from rpcompile.passes.analytic import AnalyticCostModel

        return AnalyticCostModel(spec, dtype=dtype)
    return MeasuredCostModel(device or "cpu", dtype=dtype)


def _timed(name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    log.info("%s: %.2f s", name, time.perf_counter() - t0)
    return out


def analyze(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    cost_model: Any,
    leaf_modules: Sequence[Any] = (),
    progress: bool | None = None,
    loss: tuple[Any, Any] | None = None,
    head_chunks: int = 1,
) -> fx.GraphModule:
    """Trace ``model`` and run the shape and cost passes; returns the annotated GraphModule.

    ``loss=(loss_fn, example_target)`` puts the loss in the graph (:func:`rpcompile.passes.loss_head.attach_loss`:
    a last input ``target``) and ``head_chunks > 1`` then splits the LM head and its cross-entropy along the
    sequence (:func:`~rpcompile.passes.loss_head.chunk_loss_head`)."""
    from rpcompile.passes.cost import cost_pass
    from rpcompile.passes.loss_head import TARGET, split_head
    from rpcompile.passes.shape import shape_pass
    from rpcompile.tracing import trace

    gm = _timed("trace", lambda: trace(model, example_inputs, example_kwargs=example_kwargs, leaf_modules=leaf_modules))
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"trace returned {type(gm).__name__}, expected a GraphModule")
    if loss is not None:
        loss_fn, target = loss
        if head_chunks > 1 and not (isinstance(target, torch.Tensor) and target.dim() >= 2):
            raise ValueError(f"head_chunks={head_chunks} splits along the sequence: the target must be a "
                             f"[batch, sequence] tensor, got {getattr(target, 'shape', type(target).__name__)}")
        split_head(gm, loss_fn, head_chunks)
        example_kwargs = {**dict(example_kwargs or {}), TARGET: target}
    elif head_chunks > 1:
        raise ValueError(f"head_chunks={head_chunks} splits the LM head together with its loss: pass loss_fn= and "
                         "example_target= (a target for one batch), or use head_chunks=1")
    _timed("shape_pass", lambda: shape_pass(gm, example_inputs, example_kwargs))
    _timed("cost_pass", lambda: cost_pass(gm, example_inputs, example_kwargs, cost_model=cost_model, progress=progress))
    return gm


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

    def to_dict(self, *, nodes: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "cost_model": self.cost_model,
            "trace": self.trace,
            "total": {k: v for k, v in self.total.to_dict().items() if k != "name"},
            "modules": [r.to_dict() for r in self.modules],
        }
        if nodes:
            d["nodes"] = [r.to_dict() for r in self.nodes]
        return d


_NUMERIC = re.compile(r"^\d+$")


def rollup_name(path: str, depth: int) -> str:
    """Cut a module path to ``depth`` components (``layers.3.attn.q`` at depth 2 → ``layers.3``)."""
    parts = path.split(".") if path else []
    return ".".join(parts[:depth]) if parts else "(root)"


def _auto_depth(paths: Sequence[str]) -> int:
    """Depth that keeps the index of the first module list (``layers.3``, ``model.layers.3``); 1 if none."""
    depths = [i + 1 for p in paths for i, part in enumerate(p.split(".")) if _NUMERIC.match(part)]
    return min(depths) if depths else 1


def profile_graph(gm: fx.GraphModule, *, depth: int | None = None) -> Profile:
    """Roll the ``rpcompile.cost`` annotations of ``gm`` up by module."""
    from rpcompile.passes.cost import node_cost
    from rpcompile.passes.util import compute_nodes
    from rpcompile.passes.util import module_path

    nodes = compute_nodes(gm)
    paths = {n: module_path(n) for n in nodes}
    depth = depth or _auto_depth(list(paths.values()))
    params = dict(gm.named_parameters())
    seen: set[str] = set()
    node_rows, groups = [], {}
    for n in nodes:
        c = node_cost(n)
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
) -> Profile:
    """Trace and cost ``model``; analytic on ``spec`` or measured on ``device`` (see :func:`make_cost_model`)."""
    model_device = next((p.device.type for p in model.parameters()), "cpu")
    cost_model = make_cost_model(spec=spec, device=device, dtype=dtype, model_device=model_device)
    gm = analyze(model, example_inputs, example_kwargs=example_kwargs, cost_model=cost_model,
                 leaf_modules=leaf_modules, progress=progress)
    return profile_graph(gm, depth=depth)
