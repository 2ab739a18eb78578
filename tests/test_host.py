"""Token embeddings on the host (passes/rewrite/host.py): the graph rewrite, what the planner counts, and the runtime
against eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from rpcompile.planner.plan_options import PlanOptions
import rpcompile
from rpcompile.core.batch import flat_inputs
from rpcompile.core.program import HostEmbedding
from rpcompile.models.registry import load_model
from rpcompile.passes.graph.trace import trace
from rpcompile.passes.rewrite.host import HOST_KEY, host_candidates, host_embedding_pass, host_of

from test_runtime import FINE_CPU, TOL, assert_grads_equal


def _compile(name, k=2, m=3, batch_size=6, **kw):
    spec = load_model(name, batch_size=batch_size)
    ref = copy.deepcopy(spec.model)
    x, = spec.example_inputs
    kw.setdefault("host_embedding", [n.name for n in host_candidates(trace(spec.model, (x,)))][:1])  # the tokens'
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, spec=FINE_CPU, devices=["cpu"] * k,
                             microbatches=m, time_limit_s=2.0, **kw)
    return spec, ref, pipe, x, spec.example_target


# ---- the pass ------------------------------------------------------------------------------------------------

def test_the_pass_turns_the_lookup_into_a_computed_input():
    spec = load_model("llama-demo", batch_size=2)
    x, = spec.example_inputs
    gm = trace(spec.model, (x,))
    assert [n.name for n in host_candidates(gm)] == ["embed"]
    host_embedding_pass(gm, names=["embed"])
    assert host_of(gm) == (HostEmbedding(node="embed", value="embed_1", index="input_ids", weight="embed.weight"),)
    assert "embed" not in {n.name for n in gm.graph.nodes}
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    assert placeholders == ["input_ids", "embed_1"]  # the ids stay an input (also read for the sequence length)
    assert [v.shape for v in flat_inputs(gm, (x,))] == [x.shape]  # the rows are computed, never passed in
    with pytest.raises(ValueError, match=r"node 'norm' is not an embedding lookup of a model input that the host "
                                         r"can run \(a plan made for another graph\?\); re-plan for this model"):
        host_embedding_pass(trace(spec.model, (x,)), names=["norm"])


def test_a_traced_model_is_checked_as_the_plan_ran_it():
    """``as_planned``: a plain traced graph gets the plan's lookups moved on a copy that shares the parameters;
    a graph that already moved others is refused."""
    from rpcompile.passes.rewrite.host import as_planned

    spec = load_model("llama-demo", batch_size=2)
    x, = spec.example_inputs
    gm = trace(spec.model, (x,))
    moved = as_planned(gm, ["embed"])
    assert moved is not gm and [h.node for h in host_of(moved)] == ["embed"] and host_of(gm) == ()
    assert moved.embed.weight is gm.embed.weight and as_planned(moved, ["embed"]) is moved
    assert as_planned(gm, []) is gm
    with pytest.raises(ValueError, match=r"the graph runs \['embed'\] on the host, the plan \[\]; re-plan for this "
                                         r"graph"):
        as_planned(moved, [])


@pytest.mark.parametrize("microbatches,moved", [(1, True), (3, False)])
def test_by_default_a_table_moves_when_it_has_more_rows_than_an_iteration_looks_up(microbatches, moved):
    """llama-demo: 256 rows; a microbatch of 4 sequences of 32 tokens looks up 128 rows: one microbatch gathers
    fewer rows than the table has (moved), three gather more (kept on the devices)."""
    from rpcompile.planner.planning import prepare

    spec = load_model("llama-demo", batch_size=4 * microbatches)
    gm, _ = prepare(spec.model, spec.example_inputs, PlanOptions(gpus=2, spec=FINE_CPU, microbatches=microbatches,
                    progress=False))
    assert [h.node for h in host_of(gm)] == (["embed"] if moved else [])
    gm, _ = prepare(spec.model, spec.example_inputs, PlanOptions(gpus=2, spec=FINE_CPU, microbatches=microbatches,
                    progress=False, host_embedding=False))
    assert host_of(gm) == () and HOST_KEY not in gm.meta


def test_lookups_the_host_cannot_run_stay_on_the_devices():
    class M(nn.Module):
        def __init__(self, **options):
            super().__init__()
            self.emb = nn.Embedding(50, 8, **options)
            self.out = nn.Linear(8, 50)

        def forward(self, ids):
            return self.out(self.emb(ids))

    ids = torch.randint(0, 50, (2, 4))
    for options in ({"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}):
        assert host_candidates(trace(M(**options), (ids,))) == [], options
    assert [n.name for n in host_candidates(trace(M(padding_idx=0), (ids,)))] == ["emb"]


# ---- what the planner counts ---------------------------------------------------------------------------------

def test_the_first_stage_receives_rows_instead_of_the_table_and_the_last_sends_their_gradient():
    from rpcompile.planner.planning import prepare
    from rpcompile.planner.plan_options import make_hardware
    from rpcompile.passes.formulate import partition_problem

    spec = load_model("llama-demo", batch_size=1)
    (x,) = spec.example_inputs
    kept, _ = prepare(spec.model, (x,), PlanOptions(gpus=2, spec=FINE_CPU, microbatches=1, progress=False,
                      host_embedding=False))
    moved, _ = prepare(spec.model, (x,), PlanOptions(gpus=2, spec=FINE_CPU, microbatches=1, progress=False))
    hw = make_hardware(2, FINE_CPU)
    a, b = (partition_problem(g, hardware=hw, microbatches=1) for g in (kept, moved))
    table, rows = 256 * 64 * 4, 32 * 64 * 4  # fp32 (the precision planned), one sequence of 32 tokens
    assert a.param_bytes[0] - b.param_bytes[0] == table and a.grad_bytes[0] - b.grad_bytes[0] == table
    ids = 32 * 8  # int64 token ids, still read for the sequence length
    assert (a.input_bytes, b.input_bytes) == (ids, rows + ids)
    assert (a.input_grad_bytes, b.input_grad_bytes) == (0, rows)


# ---- the runtime ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-demo", "gpt-demo", "moe-demo"])
def test_a_pipeline_with_the_embedding_on_the_host_matches_eager(name):
    """Loss and every gradient equal eager's: gpt-demo's table is tied to its LM head (the head's stage adds the
    dense part, the host the looked-up rows), moe-demo routes tokens through experts."""
    spec, ref, pipe, x, y = _compile(name)
    assert pipe.plan.host and pipe.program.host
    table = pipe.program.host[0].weight
    readers = [s.kind for s in pipe.plan.stages if table in s.params]  # only gpt-demo's tied head reads it
    assert readers == (["fused"] if name == "gpt-demo" else []), readers
    loss = pipe.forward_backward(x, target=y)
    ref_loss = spec.loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(spec.model, ref)
    torch.testing.assert_close(pipe.forward(x), ref(x), **TOL)


def test_host_rows_after_optimizer_steps_and_a_saved_plan(tmp_path):
    """Three AdamW steps give eager's weights (the host reads the masters the optimizer updated in place); the
    plan file records the host lookup and a pipeline compiled from it runs the same graph."""
    spec, ref, pipe, x, y = _compile("llama-demo")
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(3):
        pipe.forward_backward(x, target=y)
        spec.loss_fn(ref(x), y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in spec.model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=1e-5, atol=2e-6,
                                   msg=lambda msg: f"weight {name} after AdamW differs: {msg}")
    from rpcompile.views.graph_rollup import rollup
    from rpcompile.views.report import plan_table

    drawn = [rollup(pipe.plan, trace(spec.model, (x,))), rollup(pipe.plan)]  # over the model, and the plan alone
    assert [(r.boxes[0].name, r.boxes[0].stage_label) for r in drawn] == [("embed", "host")] * 2
    assert str(plan_table(pipe.plan).caption).endswith("; on the host: embed (embedding lookups)")
    first = pipe.codegen(tmp_path / "stages")[0].read_text()
    assert "# embed_1: rows the host looks up, embedding(input_ids, embed.weight)\n" in first
    path = pipe.plan.save(tmp_path / "plan.json")
    assert '"host": [\n  "embed"\n ]' in path.read_text()
    again = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu"] * 2, plan=path)
    assert again.plan == pipe.plan and again.program.host == pipe.program.host
    other = load_model("gpt-demo", batch_size=6)
    with pytest.raises(rpcompile.PlanMismatchError, match=r"plan was made for a different model: node 'embed' is "
                                                          r"not an embedding lookup"):
        rpcompile.compile(other.model, other.example_inputs, loss_fn=other.loss_fn, devices=["cpu"] * 2, plan=path)
    torch.testing.assert_close(again.forward_backward(x, target=y), pipe.forward_backward(x, target=y), **TOL)


def test_padding_rows_and_frozen_tables_get_no_gradient():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16, padding_idx=3)
            self.pos = nn.Embedding(40, 16)
            self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
            self.out = nn.Linear(16, 40)

        def forward(self, ids, where):
            return self.out(self.body(self.emb(ids) + self.pos(where)))

    torch.manual_seed(0)
    model = M()
    model.pos.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 40, (6, 5))
    ids[:, 0] = 3  # padding tokens
    where = torch.arange(5).expand(6, 5)
    y = torch.randint(0, 40, (6, 5))

    def loss_fn(out, t):
        return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())

    pipe = rpcompile.compile(model, (ids, where), loss_fn=loss_fn, spec=FINE_CPU, devices=["cpu"] * 2,
                             microbatches=3, time_limit_s=2.0, host_embedding=["emb", "pos"])
    assert [h.padding_idx for h in pipe.program.host] == [3, None]
    pipe.forward_backward(ids, where, target=y)
    loss_fn(ref(ids, where), y).backward()
    assert_grads_equal(model, ref)
    assert model.pos.weight.grad is None and torch.all(model.emb.weight.grad[3] == 0)


def test_a_failed_lookup_fails_the_step_with_the_reason():
    from rpcompile.runtime.failures import PipelineError

    spec, _, pipe, x, y = _compile("llama-demo")
    bad = x.clone()
    bad[0, 0] = 10_000  # no such row
    with pytest.raises(PipelineError, match=r"the host's embedding lookup failed: IndexError: index out of range"):
        pipe.forward_backward(bad, target=y)


def test_bf16_rows_match_the_devices_lookup():
    """In bf16 the host casts the looked-up fp32 rows, the devices would have looked up cast rows: the same
    values, so the loss is the same with the table on the host or on the devices."""
    losses = []
    for host in (["embed"], False):
        spec = load_model("llama-demo", batch_size=6)
        torch.manual_seed(0)
        x, = spec.example_inputs
        pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, spec=FINE_CPU, devices=["cpu"] * 2,
                                 microbatches=3, precision="bf16", time_limit_s=2.0, host_embedding=host,
                                 strategy="uniform")
        losses.append(pipe.forward_backward(x, target=spec.example_target))
        grads = spec.model.embed.weight.grad
        assert grads.dtype == torch.float32
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
