"""Bytes under a bf16 plan are those of the bf16 run: explicit fp32 upcasts (``lm_loss``'s ``logits.float()``, the
cross-entropy's log-softmax, an HF RMSNorm's ``.to(torch.float32)``) count at fp32 size, everything else at bf16
(:data:`rpcompile.passes.graph.precision.RUN_DTYPE_KEY`); fp32 plans are as they were."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx

from _hf import hf_model
from rpcompile.core.batch import tensor_leaves
from rpcompile.models.registry import load_model
from rpcompile.passes.cost.analytic import AnalyticCostModel
from rpcompile.passes.cost.cost import cost_pass
from rpcompile.passes.cost.cost_model import DTYPE_KEY, node_cost
from rpcompile.passes.graph.meta import on_meta
from rpcompile.passes.graph.precision import RUN_DTYPE_KEY, cast_floating, computing_in
from rpcompile.passes.graph.shape import SHAPE_KEY, shape_pass, storage_key
from rpcompile.passes.graph.trace import trace
from rpcompile.passes.graph.util import is_compute
from rpcompile.core.batch import TARGET
from rpcompile.passes.rewrite.loss_head import CHUNK_META
from rpcompile.planner.plan_options import PlanOptions
from rpcompile.planner.planning import prepare

COST_MODELS = {"analytic": dict(spec="rtx4090"), "measured": dict(device="cpu", cache=False)}


def _demo(precision: str, **cost: object) -> tuple[fx.GraphModule, torch.Tensor, torch.Tensor]:
    """llama-demo, one sequence, the loss in the graph with the LM head in 2 chunks, prepared for ``precision``."""
    ms = load_model("llama-demo")
    x, y = ms.example_inputs[0][:1], ms.example_target[:1]
    gm, _ = prepare(ms.model, (x,), PlanOptions(gpus=1, precision=precision, microbatches=1, host_embedding=False,
                    head_chunks=2, **cost), loss_fn=ms.loss_fn, example_target=y)
    return gm, x, y


def _saved_per_node(gm: fx.GraphModule, inputs: list[torch.Tensor], dtype: torch.dtype) -> dict[fx.Node, int]:
    """Run ``gm`` for real in ``dtype`` (weights and floating inputs cast, as the runtime uploads them) with autograd:
    the bytes autograd saves, attributed as the cost pass does (to the node that produced the tensor, or to the node
    running when a tensor made inside it is saved); parameters, buffers and model inputs excluded. Every value is kept
    alive so that no storage is reused under another node's name."""
    owner: dict[int, fx.Node] = {}
    saved: dict[fx.Node, int] = {}
    seen: set[int] = set()
    keep: list[object] = []
    running: list[fx.Node] = []

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            running[:] = [n]
            out = super().run_node(n)
            keep.append(out)
            for t in tensor_leaves(out):
                owner.setdefault(storage_key(t), n)
            return out

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        key = storage_key(t)
        if key not in skip and key not in seen:
            seen.add(key)
            n = owner.get(key, running[0])
            saved[n] = saved.get(n, 0) + t.untyped_storage().nbytes()
        return t

    with computing_in(gm, dtype):
        values = cast_floating(inputs, dtype)
        skip = {storage_key(t) for t in [*gm.parameters(), *gm.buffers(), *values]}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            Recorder(gm).run(*values)
    return saved


@pytest.mark.parametrize("cost", sorted(COST_MODELS))
def test_lm_loss_upcasts_count_at_fp32_in_a_bf16_plan(cost):
    gm, _, _ = _demo("bf16", **COST_MODELS[cost])
    assert gm.meta[RUN_DTYPE_KEY] is torch.bfloat16 and gm.meta[DTYPE_KEY] is None
    upcasts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "float"]
    losses = [n for n in gm.graph.nodes if "cross_entropy" in n.name]
    assert len(upcasts) == len(losses) == 2  # one per chunk
    for up, ce in zip(upcasts, losses):
        (t,) = up.meta[SHAPE_KEY].tensors
        logits = math.prod(t.shape)  # [tokens of the chunk, vocab]
        assert t.dtype == "float32" and not t.is_alias
        assert node_cost(up).output_bytes == logits * 4, up.format_node()  # was logits * 2
        assert node_cost(ce).act_bytes >= logits * 4, ce.format_node()  # its fp32 log-softmax; was logits * 2
        head = up.args[0].args[0]  # float(flatten(lm_head chunk))
        assert node_cost(head).output_bytes == logits * 2  # the head itself computes in bf16


def test_loss_region_activation_bytes_match_a_real_bf16_run():
    """What autograd saves in the split head and its cross-entropy, predicted against a real bf16 run on the CPU:
    within 1% (they agree exactly today; before, the fp32 log-softmax was counted at half its size)."""
    gm, x, y = _demo("bf16", spec="rtx4090")
    real = _saved_per_node(gm, [x, y], torch.bfloat16)
    region = [n for n in gm.graph.nodes if is_compute(n) and CHUNK_META in n.meta]
    predicted = sum(node_cost(n).act_bytes for n in region)
    measured = sum(real.get(n, 0) for n in region)
    assert measured > 0 and predicted == pytest.approx(measured, rel=0.01), \
        {n.name: (node_cost(n).act_bytes, real.get(n, 0)) for n in region}


def test_hf_llama_fp32_islands_count_at_fp32_in_a_bf16_plan():
    """An HF Llama traced in bf16: its RMSNorms' ``.to(torch.float32)`` outputs are fp32 in the shapes and now in
    the node costs (they were scaled to bf16)."""
    model = hf_model("llama")
    ids = torch.randint(0, 64, (1, 8))
    gm, _ = prepare(model, (ids,), PlanOptions(gpus=1, spec="rtx4090", precision="bf16", microbatches=1,
                    host_embedding=False))
    islands = [n for n in gm.graph.nodes if is_compute(n) and n.meta[SHAPE_KEY].tensors
               and all(t.dtype == "float32" and not t.is_alias for t in n.meta[SHAPE_KEY].tensors)]
    assert len(islands) >= 4  # at least the upcast of each of the 5 norms' inputs, fp32 arithmetic after it
    for n in islands:
        assert node_cost(n).output_bytes == n.meta[SHAPE_KEY].nbytes, n.format_node()


def test_fp32_plans_are_costed_as_the_model_is():
    """fp32: nothing is cast, no dtype is recorded, and every node costs what the plain passes give."""
    gm, x, y = _demo("fp32", spec="rtx4090")
    assert gm.meta[RUN_DTYPE_KEY] is None and gm.meta[DTYPE_KEY] is None
    ms = load_model("llama-demo")
    ref, _ = prepare(ms.model, (x,), PlanOptions(gpus=1, spec="rtx4090", precision="fp32", microbatches=1,
                     host_embedding=False, head_chunks=2), loss_fn=ms.loss_fn, example_target=y)
    for n in ref.graph.nodes:  # re-costed by the bare passes on meta stand-ins (as planning runs them), uncast
        n.meta.pop(SHAPE_KEY, None)
    assert on_meta(ref, (x,), {TARGET: y}, lambda a, k: shape_pass(ref, a, k))
    assert on_meta(ref, (x,), {TARGET: y}, lambda a, k: cost_pass(ref, a, k, cost_model=AnalyticCostModel("rtx4090"),
                                                                 progress=False))
    assert [(n.name, node_cost(n)) for n in gm.graph.nodes] == [(n.name, node_cost(n)) for n in ref.graph.nodes]
