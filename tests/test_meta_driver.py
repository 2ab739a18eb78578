"""Shapes and analytic costs of a model in CPU memory come from a run on meta stand-ins (passes/graph/meta.py:on_meta):
the same costs and plans as running the model for real, without computing anything on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rpcompile.planner.plan_options import PlanOptions
import rpcompile.planner.planning as planning
from _hf import hf_model, token_loss
from rpcompile.models.registry import load_model
from rpcompile.passes.graph.meta import on_meta
from rpcompile.planner.planning import compile_plan

SHAPE, COST = "rpcompile.shape", "rpcompile.cost"


def _both_ways(monkeypatch, model, inputs, example_kwargs=None, loss_fn=None, example_target=None, **options):
    """compile_plan on meta stand-ins, then with every graph run on the real values."""
    opts = PlanOptions(gpus=2, spec="rtx4090", time_limit_s=2, **options)
    example = dict(example_kwargs=example_kwargs, loss_fn=loss_fn, example_target=example_target)
    made = [compile_plan(model, inputs, opts, **example)]
    monkeypatch.setattr(planning, "on_meta", lambda *a, **k: False)
    made.append(compile_plan(model, inputs, opts, **example))
    return made


def _node_facts(c):
    """Each node's shapes and costs; its forward transient to 64 bytes: a real CPU run of an exported HF model's
    ``wrap_with_set_grad_enabled`` (the rotary embedding, transformers 4.57) makes 16 bytes of small copies that the
    meta run does not — far below anything a plan weighs."""
    def cost(n):
        c = n.meta.get(COST)
        return c if c is None else dataclasses.replace(c, fwd_transient_bytes=c.fwd_transient_bytes // 64)
    return {n.name: (n.meta.get(SHAPE), cost(n)) for n in c.graph.graph.nodes}


@pytest.mark.parametrize("name,precision", [("llama-demo", "bf16"), ("gpt-demo", "fp32"), ("moe-demo", "bf16"),
                                            ("cnn-demo", "fp32")])
def test_meta_stand_ins_give_the_real_runs_costs_and_plan(monkeypatch, name, precision):
    """gpt-demo ties its embeddings (one stand-in, one name); llama's attention output is a view only with the
    GPU kernel's layout (passes/graph/kernels.py), which the meta run takes too."""
    ms = load_model(name)
    meta, real = _both_ways(monkeypatch, ms.model, ms.example_inputs, precision=precision, loss_fn=ms.loss_fn,
                            example_target=ms.example_target)
    assert _node_facts(meta) == _node_facts(real)
    assert meta.plan.to_dict()["stages"] == real.plan.to_dict()["stages"]


@pytest.mark.hf
@pytest.mark.parametrize("kind", ["llama", "mixtral", "bert"])
def test_an_exported_hf_model_too(monkeypatch, kind):
    """torch.export graphs: lifted parameters, `.to(device)` calls, metadata asserts, MoE routing."""
    model = hf_model(kind)
    ids = torch.randint(0, 64, (3, 8))
    options = dict(example_kwargs={"input_ids": ids}, loss_fn=token_loss, example_target=ids, head_chunks=1)
    meta, real = _both_ways(monkeypatch, model, (), **options)
    assert _node_facts(meta) == _node_facts(real)
    assert meta.plan.to_dict()["stages"] == real.plan.to_dict()["stages"]


def test_the_model_computes_nothing_on_the_cpu():
    ms = load_model("llama-demo")
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.device.type))
             for m in ms.model.modules() if isinstance(m, torch.nn.Linear)]
    compile_plan(ms.model, ms.example_inputs, PlanOptions(gpus=2, spec="rtx4090", time_limit_s=2))
    for h in hooks:
        h.remove()
    assert seen and set(seen) == {"meta"}
    assert all(p.device.type == "cpu" for p in ms.model.parameters())  # and the weights are back


def test_the_weights_are_not_cast_to_the_compute_precision(monkeypatch):
    """A bf16 plan of a model in CPU memory: the meta stand-ins are made in bf16 (so every node has its run-time
    dtype), and the real weights are neither read nor cast (for a Llama-3-8B-width 4-layer slice on this CPU the
    casts were 4 s per pass, 33 of a 45 s compile)."""
    casts = []
    cast = planning.computing_in
    monkeypatch.setattr(planning, "computing_in", lambda m, dtype, **k: casts.append(dtype) or cast(m, dtype, **k))
    ms = load_model("llama-demo")
    c = compile_plan(ms.model, ms.example_inputs, PlanOptions(gpus=2, spec="rtx4090", precision="bf16",
                     time_limit_s=2))
    assert casts == []
    proj = next(n for n in c.graph.graph.nodes if n.name == "layers_0_attn_q_proj")
    assert proj.meta[SHAPE].tensors[0].dtype == "bfloat16"
    assert all(p.dtype == torch.float32 for p in ms.model.parameters())
    monkeypatch.setattr(planning, "on_meta", lambda *a, **k: False)  # a graph that cannot run on meta: cast
    compile_plan(ms.model, ms.example_inputs, PlanOptions(gpus=2, spec="rtx4090", precision="bf16", time_limit_s=2))
    assert casts and set(casts) == {torch.bfloat16}


def test_a_graph_that_needs_its_values_is_left_to_the_real_run():
    """A data-dependent op (boolean indexing: the output's size depends on the data) cannot run on meta:
    on_meta says so, and the graph keeps its real weights."""

    class Picky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x[x.sum(-1) > 0])

    gm = torch.fx.symbolic_trace(Picky())
    weight = gm.lin.weight
    x = torch.randn(6, 4)
    shapes = []
    assert not on_meta(gm, (x,), {}, lambda a, k: shapes.append(torch.fx.Interpreter(gm).run(*a).shape))
    assert shapes == [] and gm.lin.weight is weight and weight.device.type == "cpu"
    assert on_meta(torch.fx.symbolic_trace(torch.nn.Linear(4, 2)), (x,), {}, lambda a, k: shapes.append(a[0].device))
    assert shapes == [torch.device("meta")]
