"""coarsen_pass: live bytes across cuts, segment granularity, costs conserved, shared parameters visible."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from rpcompile.cli import main
from rpcompile.core.errors import ConfigError
from rpcompile.models.registry import load_model
from rpcompile.passes.cost.cost_model import DTYPE_KEY, node_cost
from rpcompile.passes.graph.shape import shape_pass
from rpcompile.passes.graph.util import compute_nodes
from rpcompile.passes.rewrite.coarsen import SEGMENT_KEY, coarsen_pass, live_bytes, segments_of
from rpcompile.planner.plan_options import make_cost_model
from rpcompile.planner.planning import analyze


class Skip(nn.Module):
    """a = x*2 (64 B); b = a+1 (64 B); c = b.view (alias); d = c*a (a lives across b, c); out = d.sum()."""

    def forward(self, x):
        a = x * 2
        b = a + 1
        c = b.view(-1)
        d = c * a.view(-1)
        return d.sum()


def test_live_bytes_by_hand():
    gm = fx.symbolic_trace(Skip())
    shape_pass(gm, (torch.ones(4, 4),))
    assert [n.name for n in compute_nodes(gm)] == ["mul", "add", "view", "view_1", "mul_1", "sum_1"]
    inputs, live, last_read = live_bytes(gm)
    assert inputs == 64  # x, until mul reads it
    # after mul: a; after add: a, b; after view: a, b (via the view); after view_1: a, b; after mul_1: d; after sum: out
    assert live == [64, 128, 128, 128, 64, 4]
    # read for the last time (live while the node runs): x by mul; a and b (through their views) by mul_1; d by sum
    assert last_read == [64, 0, 0, 0, 128, 64]


def test_live_bytes_count_in_the_precision_the_model_runs_in():
    """The same fp32 graph planned for bf16 (``gm.meta["rpcompile.dtype"]``, set by the cost pass): every
    floating tensor live across a cut or read takes half the bytes; an integer input keeps its size."""
    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids, x):
            return (self.emb(ids) * x * 2).sum()

    gm = fx.symbolic_trace(Lookup())
    shape_pass(gm, (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, 4)))
    fp32 = live_bytes(gm)
    gm.meta[DTYPE_KEY] = torch.bfloat16
    # int64 ids and fp32 x; emb; emb·x; ·2; the sum — then what each node reads for the last time
    assert fp32 == (64 + 128, [128 + 128, 128, 128, 4], [64, 128 + 128, 128, 128])
    assert live_bytes(gm) == (64 + 64, [64 + 64, 64, 64, 2], [64, 64 + 64, 64, 64])


@pytest.fixture(scope="module")
def llama32():
    ms = load_model("llama-32x64")
    gm = analyze(ms.model, ms.example_inputs, cost_model=make_cost_model(spec="rtx4090"), progress=False)
    return coarsen_pass(gm)


def test_transformer_blocks_split_into_attention_and_mlp_halves(llama32):
    segs = segments_of(llama32)
    assert 64 <= len(segs) <= 70
    names = [s.name for s in segs]
    for i in range(32):
        assert f"layers.{i}.attn" in names and f"layers.{i}.mlp" in names
    hidden = 4 * 32 * 64 * 4  # batch x seq x dim fp32: only the residual stream crosses a half-block cut
    assert all(segs[k].boundary_bytes == hidden for k, name in enumerate(names) if name.startswith("layers."))


def test_segments_partition_the_graph_in_order(llama32):
    segs = segments_of(llama32)
    nodes = compute_nodes(llama32)
    assert segs[0].start == 0 and segs[-1].stop == len(nodes)
    assert all(a.stop == b.start for a, b in zip(segs, segs[1:]))
    assert [s.layer for s in segs] == sorted(s.layer for s in segs)
    for s in segs:
        assert [n.meta[SEGMENT_KEY] for n in nodes[s.start:s.stop]] == [s.index] * (s.stop - s.start)
        assert s.nodes == tuple(n.name for n in nodes[s.start:s.stop])
    assert sum(s.fwd_s for s in segs) == pytest.approx(sum(node_cost(n).fwd_time_s for n in nodes))
    assert sum(s.act_bytes for s in segs) == sum(node_cost(n).act_bytes for n in nodes)


def test_tied_embedding_is_read_by_first_and_last_segment():
    ms = load_model("gpt-demo")
    gm = coarsen_pass(analyze(ms.model, ms.example_inputs, cost_model=make_cost_model(spec="rtx4090"), progress=False))
    segs = segments_of(gm)
    users = [s.index for s in segs if "wte.weight" in s.params]
    assert users == [0, len(segs) - 1]


def test_max_segments_is_respected(llama32):
    gm = coarsen_pass(llama32, max_segments=10)
    assert len(segments_of(gm)) == 10


def test_finer_segments_split_inside_the_halves(llama32):
    nodes = compute_nodes(llama32)
    fine = segments_of(coarsen_pass(llama32, segments_per_layer=4))
    assert 4 * 32 <= len(fine) <= 4 * 32 + 10
    assert any(s.name.count(".") == 3 for s in fine)  # layers.i.attn.q_proj and the like: one level deeper
    # still a partition of the same nodes in order, costs conserved
    assert fine[0].start == 0 and fine[-1].stop == len(nodes) and all(a.stop == b.start for a, b in zip(fine, fine[1:]))
    assert sum(s.fwd_s for s in fine) == pytest.approx(sum(node_cost(n).fwd_time_s for n in nodes))
    assert sum(s.act_bytes for s in fine) == sum(node_cost(n).act_bytes for n in nodes)
    # every default cut is still a cut: the finer segmentation refines the halves
    coarse = segments_of(coarsen_pass(llama32))
    assert {s.stop for s in coarse} <= {s.stop for s in fine}
    with pytest.raises(ConfigError, match=r"segments_per_layer must be a positive integer, got 0"):
        coarsen_pass(llama32, segments_per_layer=0)


def test_cli_segments_per_layer(capsys):
    counts = []
    for k in ("2", "4"):
        assert main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--head-chunks", "1",
                     "--segments-per-layer", k, "--time-limit", "2", "--json"]) == 0
        counts.append(json.loads(capsys.readouterr().out)["stats"]["segments"])
    assert counts[1] > counts[0]
    with pytest.raises(SystemExit):
        main(["plan", "llama-demo", "--gpus", "2", "--segments-per-layer", "0"])
    assert "argument --segments-per-layer: expected a positive integer, got '0'" in capsys.readouterr().err


def test_a_segment_s_forward_peak_is_what_its_nodes_hold_while_they_run():
    """A forward's peak is not what lives across the cuts between nodes: while a cross-entropy runs it holds the
    logits and targets it reads for the last time and makes an fp32 log-softmax of the logits' size (at a long
    sequence's LM head this was 5 GiB an H200 run needed and the plan did not count)."""
    from rpcompile.passes.cost.analytic import AnalyticCostModel
    from rpcompile.passes.cost.cost import cost_pass

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 1000)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.lin(x), y)

    gm = fx.symbolic_trace(Head())
    x, y = torch.randn(64, 16), torch.randint(0, 1000, (64,))
    shape_pass(gm, (x, y))
    cost_pass(gm, (x, y), cost_model=AnalyticCostModel("rtx4090"), progress=False)
    coarsen_pass(gm, max_segments=2)
    last = segments_of(gm)[-1]
    assert "cross_entropy" in last.nodes
    # the loss (4 B) after it; logits (64 × 1,000 fp32) and targets (64 int64) read for the last time; the
    # log-softmax and nll_loss's total weight made on the way
    assert last.peak_bytes == 4 + (256_000 + 512) + (256_000 + 4)
