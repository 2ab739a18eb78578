"""One trace for every LM-head split (rpcompile/planner/shared_trace.py): the plans are those of a fresh trace per split."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import torch

from rpcompile.cli import main
from rpcompile.cli import plan_cmd
from rpcompile.core.plan import Plan
from rpcompile.models.registry import load_model
from rpcompile.passes.cost.cost_model import COST_KEY
from rpcompile.passes.graph.shape import SHAPE_KEY
from rpcompile.passes.graph.trace import trace
from rpcompile.passes.rewrite.loss_head import split_head
from rpcompile.planner import planning
from rpcompile.planner.plan_options import PlanOptions
from rpcompile.planner.shared_trace import TraceOnce, graph_copy

from _hf import hf_model, token_loss


def _plan_data(p: Plan) -> dict[str, Any]:
    """A plan without its solver statistics (solve times differ from run to run)."""
    d = p.to_dict()
    d.pop("stats")
    return d


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """What every compilation (one per split) ends with: its split, code, each node's shape and cost, its plan."""
    runs: list[tuple] = []
    run = planning.run

    def recorded(c: planning.Compilation, passes: Any = planning.PASSES) -> planning.Compilation:
        run(c, passes)
        if passes[-1][0] == "problem":  # compile_plan runs each split's front, then (last split first) its back
            return c
        nodes = {n.name: (n.meta.get(SHAPE_KEY), n.meta.get(COST_KEY)) for n in c.graph.graph.nodes}
        runs.append((c.head_chunks, c.graph.code, nodes, _plan_data(c.plan) if c.plan is not None else None))
        return c

    monkeypatch.setattr(planning, "run", recorded)
    return runs


def _unshared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every split traces the model afresh (the path before the trace was shared)."""
    monkeypatch.setattr(planning, "shared_trace", lambda count: planning._trace)
    monkeypatch.setattr(plan_cmd, "shared_trace", lambda count: planning._trace)


def test_a_graph_copy_is_rewritten_without_touching_the_original():
    ms = load_model("llama-demo")
    gm = trace(ms.model, ms.example_inputs)
    gm.graph.nodes.__iter__().__next__().meta[SHAPE_KEY] = "kept"
    code, names = gm.code, [n.name for n in gm.graph.nodes]
    copy = graph_copy(gm)
    assert copy.code == code and [n.name for n in copy.graph.nodes] == names and copy.meta == gm.meta
    assert next(iter(copy.graph.nodes)).meta[SHAPE_KEY] == "kept"
    assert dict(copy.named_parameters()).keys() == dict(gm.named_parameters()).keys()
    assert all(a is b for a, b in zip(copy.parameters(), gm.parameters()))  # the same weights, not copies
    split_head(copy, ms.loss_fn, 4)
    assert copy.code != code and "target" in [n.name for n in copy.graph.nodes]
    assert gm.code == code and [n.name for n in gm.graph.nodes] == names and "rpcompile.head_chunks" not in gm.meta


def test_trace_once_traces_the_first_compilation_only():
    traced: list[int] = []

    class C:
        def __init__(self, i: int):
            self.model, self.args, self.kwargs, self.gm, self.i = torch.nn.Linear(2, 2), (torch.ones(1, 2),), {}, None, i

    def trace_pass(c: C) -> None:
        traced.append(c.i)
        c.gm = trace(c.model, c.args)

    once = TraceOnce(trace_pass, 3)
    cs = [C(i) for i in range(3)]
    for c in cs:
        once(c)
    assert traced == [0]
    assert len({id(c.gm) for c in cs}) == 3 and len({id(c.gm.graph) for c in cs}) == 3
    assert cs[1].gm.code == cs[2].gm.code == cs[0].gm.code


@pytest.mark.parametrize("name,head_chunks", [("llama-demo", "auto"), ("llama-demo", 1), ("llama-demo", 8),
                                              ("gpt-demo", "auto")])
def test_compile_plan_makes_the_plans_of_a_trace_per_split(monkeypatch, name, head_chunks):
    ms = load_model(name)

    def made(m: pytest.MonkeyPatch) -> Any:
        runs = _recording(m)
        c = planning.compile_plan(ms.model, ms.example_inputs, PlanOptions(gpus=2, spec="rtx4090",
                                  head_chunks=head_chunks), loss_fn=ms.loss_fn, example_target=ms.example_target)
        return _plan_data(c.plan), c.head_chunks, c.gm.code, runs

    with monkeypatch.context() as m:
        shared = made(m)
    with monkeypatch.context() as m:
        _unshared(m)
        assert made(m) == shared
    # every split's graph, shapes, costs and plan: the later ones come from a copy of the first trace
    # (the splits are finished last first: the whole head's solve ran in the background meanwhile)
    assert [r[0] for r in shared[3]] == ([8, 1] if head_chunks == "auto" else [head_chunks])


def test_an_hf_model_plans_as_with_a_trace_per_split(monkeypatch):
    """An exported graph (HF) cannot take the head split: the split is refused from the copy as from a trace."""
    model = hf_model("llama")
    ids = torch.randint(0, 64, (4, 16))

    def made() -> dict[str, Any]:
        return _plan_data(planning.plan(model, (ids,), gpus=2, spec="rtx4090", loss_fn=token_loss,
                                        example_target=ids, head_chunks="auto"))

    shared = made()
    with monkeypatch.context() as m:
        _unshared(m)
        assert made() == shared
    with pytest.raises(Exception, match="torch.export"):  # the 8-chunk split, refused (and skipped) as before
        planning.plan(model, (ids,), gpus=2, spec="rtx4090", loss_fn=token_loss, example_target=ids, head_chunks=8)


def _cli_plan(tmp_path, model: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "plan.json"
    assert main(["plan", model, "--gpus", "8", "--spec", "rtx4090", "-o", str(out), *extra]) == 0
    d = json.loads(out.read_text())
    d.pop("stats")
    return d


def test_the_cli_plans_as_with_a_trace_per_split(monkeypatch, tmp_path, capsys):
    with monkeypatch.context() as m:
        runs = _recording(m)
        shared = _cli_plan(tmp_path, "llama-demo")
    with monkeypatch.context() as m:
        _unshared(m)
        again = _recording(m)
        assert _cli_plan(tmp_path, "llama-demo") == shared
    assert again == runs and [r[0] for r in runs] == [1, 8]  # each split's graph, shapes and costs


@pytest.mark.slow
@pytest.mark.parametrize("head_chunks", ["auto", "1", "8"])
def test_llama_8b_plans_as_with_a_trace_per_split(monkeypatch, tmp_path, capsys, head_chunks):
    """~20-40 s each: llama-8b's solves stop by their counts, so the plans are compared exactly."""
    shared = _cli_plan(tmp_path, "llama-8b", "--head-chunks", head_chunks)
    with monkeypatch.context() as m:
        _unshared(m)
        assert _cli_plan(tmp_path, "llama-8b", "--head-chunks", head_chunks) == shared


def test_a_later_split_takes_the_bodys_shapes_and_costs_from_the_first_and_they_equal_a_fresh_run():
    """The memo (passes/graph/reuse.py): the 8-chunk split shapes and costs only the head region again."""
    ms = load_model("llama-demo")
    kw = dict(loss_fn=ms.loss_fn, example_target=ms.example_target)
    opts = PlanOptions(gpus=2, spec="rtx4090")

    def nodes(gm: Any) -> dict[str, tuple]:
        return {n.name: (n.meta.get(SHAPE_KEY), n.meta.get(COST_KEY)) for n in gm.graph.nodes}

    traced = planning.shared_trace(2)
    planning.prepare(ms.model, ms.example_inputs, replace(opts, head_chunks=1), trace_pass=traced, **kw)
    assert traced.memo is not None and traced.memo.reused == {"shape": 0, "cost": 0}  # the first run records
    gm, _ = planning.prepare(ms.model, ms.example_inputs, replace(opts, head_chunks=8), trace_pass=traced, **kw)
    compute = sum(1 for n in gm.graph.nodes if n.op.startswith("call"))
    assert traced.memo.reused["shape"] > compute // 2 and traced.memo.reused["cost"] > compute // 2
    fresh, _ = planning.prepare(ms.model, ms.example_inputs, replace(opts, head_chunks=8), **kw)
    assert nodes(gm) == nodes(fresh)
