"""cost_pass with the measured cost model: every node costed, exact FLOPs/bytes, autograd activations, no side effects."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from _hf import hf_model
from rpcompile.passes.cost.analytic import AnalyticCostModel
from rpcompile.passes.cost.cost import _calibrate, cost_pass
from rpcompile.passes.cost.cost_interp import CostInterpreter
from rpcompile.passes.cost.cost_model import COST_KEY, NodeCall, NodeCost, node_cost
from rpcompile.passes.cost.measured import MeasuredCostModel
from rpcompile.passes.graph.trace import trace


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.lin = nn.Linear(16, 24)
        self.bn = nn.BatchNorm1d(24)

    def forward(self, ids):
        pos = ids + 1                      # integer op: no gradient, no backward
        h = self.embed(pos).sum(1)         # B x 16
        h = self.frozen(h)
        h = self.lin(h).relu()
        return self.bn(h)


def costed(model=None, x=None):
    torch.manual_seed(0)
    model = model or Net()
    x = torch.randint(0, 30, (8, 5)) if x is None else x
    gm = fx.symbolic_trace(model)
    cost_pass(gm, (x,), cost_model=MeasuredCostModel("cpu", repeats=3), progress=False)
    return model, gm, {n.name: n.meta.get(COST_KEY) for n in gm.graph.nodes}


def test_every_compute_node_gets_a_cost():
    _, gm, c = costed()
    assert c["ids"] is None and c["output"] is None
    for name in ("add", "embed", "sum_1", "frozen", "lin", "relu", "bn"):
        assert isinstance(c[name], NodeCost), name
        assert c[name].fwd_time_s > 0, name
    assert gm.meta["rpcompile.cost_model"] == "measured"


def test_params_grads_and_flops():
    _, _, c = costed()
    lin = c["lin"]
    assert lin.params == ("lin.weight", "lin.bias")
    assert lin.param_bytes == (16 * 24 + 24) * 4 and lin.grad_bytes == lin.param_bytes
    assert lin.fwd_flops == 2 * 8 * 16 * 24
    # the input of `lin` comes from a frozen layer fed by an integer-indexed embedding that does need grad
    assert lin.bwd_flops == 2 * (2 * 8 * 16 * 24)
    frozen = c["frozen"]
    assert frozen.grad_bytes == 0 and frozen.param_bytes == (16 * 16 + 16) * 4
    assert frozen.bwd_flops == 2 * 8 * 16 * 16  # only the input gradient: the weight is frozen
    assert c["add"].bwd_time_s == 0 and c["add"].bwd_flops == 0  # nothing upstream needs a gradient
    assert c["lin"].bwd_time_s > 0


def test_activation_bytes_follow_autograd():
    _, _, c = costed()
    # relu saves its own output (8x24 fp32) for backward
    assert c["relu"].act_bytes == 8 * 24 * 4
    # bn saves its input (the relu output, attributed to relu) and small per-channel statistics of its own
    assert 0 < c["bn"].act_bytes < 8 * 24 * 4
    # the embedding's output only feeds a sum, whose backward needs no saved tensor
    assert c["embed"].act_bytes == 0
    # the integer indices are kept: the embedding's backward scatters by them
    assert c["add"].act_bytes == 8 * 5 * 8


def test_backward_transient_bytes_are_the_input_gradients_and_what_leads_to_them():
    """What a node's backward allocates beside its saved tensors (parameter gradients are ``grad_bytes``): a linear's
    input gradient (8 x 16 fp32), relu's and bn's (8 x 24); nothing for the embedding (only its weight has a
    gradient) or the sum (its gradient is a broadcast view of the output gradient); a cross-entropy over [N, V]
    fp32 logits makes the log-softmax's gradient and the logits' (8 bytes a logit), beyond the 4 it keeps."""
    _, _, c = costed()
    assert [c[k].bwd_transient_bytes for k in ("add", "embed", "sum_1", "frozen", "lin", "relu", "bn")] == \
        [0, 0, 0, 8 * 16 * 4, 8 * 16 * 4, 8 * 24 * 4, 8 * 24 * 4]

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.lin = nn.Linear(8, 16), nn.Linear(16, 1000)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.lin(self.up(x)), y)

    gm = fx.symbolic_trace(Head())
    x, y = torch.randn(64, 8), torch.randint(0, 1000, (64,))
    cost_pass(gm, (x, y), cost_model=AnalyticCostModel("rtx4090"), progress=False)
    assert node_cost(next(n for n in gm.graph.nodes if n.name == "cross_entropy")).bwd_transient_bytes == 64 * 1000 * 8
    assert node_cost(next(n for n in gm.graph.nodes if n.name == "lin")).bwd_transient_bytes == 64 * 16 * 4
    assert node_cost(next(n for n in gm.graph.nodes if n.name == "up")).bwd_transient_bytes == 0  # x needs none
    # the forward: a cross-entropy makes its fp32 log-softmax (and nll_loss's total weight, one fp32) on the way to
    # a scalar; a linear makes only its output
    assert [node_cost(next(n for n in gm.graph.nodes if n.name == name)).fwd_transient_bytes
            for name in ("cross_entropy", "lin", "up")] == [64 * 1000 * 4 + 4, 0, 0]


class _ReadsItsGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 if g.abs().max().item() < 1e30 else g  # reads a value: cannot run on meta


class _Picky(nn.Module):
    def forward(self, x):
        return _ReadsItsGradient.apply(x)


def test_a_backward_that_reads_values_counts_at_least_its_input_gradients():
    """The meta run cannot measure it; counting 0 would let a stage past its memory."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.picky, self.down = nn.Linear(8, 16), _Picky(), nn.Linear(16, 4)

        def forward(self, x):
            return self.down(self.picky(self.up(x)))

    class Leaves(fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, _Picky) or super().is_leaf_module(m, name)

    net = Net()
    gm = fx.GraphModule(net, Leaves().trace(net))
    cost_pass(gm, (torch.randn(8, 8),), cost_model=AnalyticCostModel("rtx4090"), progress=False)
    assert node_cost(next(n for n in gm.graph.nodes if n.name == "picky")).bwd_transient_bytes == 8 * 16 * 4


def test_buffers_are_restored():
    model, _, _ = costed()
    assert torch.equal(model.bn.running_mean, torch.zeros(24))
    assert int(model.bn.num_batches_tracked) == 0


def test_export_graph_is_costed_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    gm = torch.export.export(model, (x,), strict=False).module()
    cost_pass(gm, (x,), cost_model=MeasuredCostModel("cpu", repeats=1), progress=False)
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert [node_cost(n).fwd_flops for n in linears] == [2 * 3 * 8 * 8, 2 * 3 * 8 * 4]
    assert node_cost(linears[0]).params == ("0.weight", "0.bias")
    assert torch.equal(gm(x), model(x))


def test_measured_model_validates_arguments():

    with pytest.raises(ValueError, match="need repeats >= 1 and warmup >= 0, got 0, 1"):
        MeasuredCostModel("cpu", repeats=0)


@pytest.mark.hf
@pytest.mark.parametrize("precision", [None, torch.bfloat16])
def test_huggingface_llama_is_costed_on_meta_and_measured(precision):
    model = hf_model("llama", vocab=128).eval()
    kwargs = {"input_ids": torch.randint(0, 128, (2, 16)), "use_cache": False}
    gm = trace(model, (), example_kwargs=kwargs)
    # HF code moves tensors with .to(device) and export adds dtype asserts: the meta runs must cope with both
    cost_pass(gm, (), kwargs, cost_model=AnalyticCostModel("rtx4090", dtype=precision), progress=False)
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 2 * 7 + 1
    q_proj = node_cost(linears[0])
    assert q_proj.params == ("model.layers.0.self_attn.q_proj.weight",)
    assert q_proj.fwd_flops == 2 * 2 * 16 * 32 * 32 and q_proj.fwd_time_s > 0
    total_act = sum(node_cost(n).act_bytes for n in gm.graph.nodes)
    assert total_act > 0


def test_calibration_scales_node_times_to_the_whole_graph_and_warns_when_they_disagree():
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    partial = {"a": {"fwd_time_s": 1.0, "bwd_time_s": 2.0}, "b": {"fwd_time_s": 1.0, "bwd_time_s": 2.0}}
    _calibrate(gm, partial, forward_s=3.0, step_s=3.0 + 6.0)  # forward ×1.5, backward ×1.5
    assert partial["a"] == {"fwd_time_s": 1.5, "bwd_time_s": 3.0}
    assert gm.meta["rpcompile.calibration"] == {"forward": 1.5, "backward": 1.5, "applied": True}
    busy = {"a": {"fwd_time_s": 1.0, "bwd_time_s": 1.0}}
    with pytest.warns(RuntimeWarning, match=r"measured node times do not add up to a whole-graph step \(forward ×0\.03"):
        _calibrate(gm, busy, forward_s=0.03, step_s=0.06)
    tiny = {"a": {"fwd_time_s": 1e-3, "bwd_time_s": 1e-3}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a microsecond graph's mismatch is timer overhead: no warning
        _calibrate(gm, tiny, forward_s=3e-5, step_s=6e-5)
    assert gm.meta["rpcompile.calibration"]["applied"] is False
    assert busy["a"] == {"fwd_time_s": 1.0, "bwd_time_s": 1.0} and gm.meta["rpcompile.calibration"]["applied"] is False


_FIELDS = [f for f in NodeCost.__dataclass_fields__ if not f.endswith("_time_s")]


def _static_costs(gm):
    """Every compute node's costs but its times (which are measurements)."""
    return {n.name: {f: getattr(node_cost(n), f) for f in _FIELDS} for n in gm.graph.nodes if COST_KEY in n.meta}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_measuring_on_another_device_computes_the_values_there(monkeypatch, dtype):
    """A model in CPU memory measured on a GPU: the driver computes each node's value from the copies on the
    measured device (no forward pass of the model where it lives) and gets the costs the plain run gets. On the
    CPU the other device is the CPU itself; the graph's own modules must never run."""
    torch.manual_seed(0)
    x = torch.randint(0, 30, (8, 5))
    plain = fx.symbolic_trace(Net())
    cost_pass(plain, (x,), cost_model=MeasuredCostModel("cpu", repeats=1, dtype=dtype, cache=False), progress=False)
    torch.manual_seed(0)
    driven = fx.symbolic_trace(Net())
    monkeypatch.setattr(MeasuredCostModel, "drive_device", lambda self, gm, flat: torch.device("cpu"))
    ran, call_module = [], fx.Interpreter.call_module

    def spy(self, target, *args):
        if isinstance(self, CostInterpreter):  # the driver (not the warm-up run of the whole graph)
            ran.append(target)
        return call_module(self, target, *args)

    monkeypatch.setattr(fx.Interpreter, "call_module", spy)
    cost_pass(driven, (x,), cost_model=MeasuredCostModel("cpu", repeats=1, dtype=dtype, cache=False), progress=False)
    assert ran == []
    assert _static_costs(driven) == _static_costs(plain) != {}


def test_a_measured_device_out_of_memory_falls_back_to_where_the_graph_is(monkeypatch):
    torch.manual_seed(0)
    x = torch.randint(0, 30, (8, 5))
    plain = fx.symbolic_trace(Net())
    cost_pass(plain, (x,), cost_model=MeasuredCostModel("cpu", repeats=1, cache=False), progress=False)
    torch.manual_seed(0)
    driven = fx.symbolic_trace(Net())
    monkeypatch.setattr(MeasuredCostModel, "drive_device", lambda self, gm, flat: torch.device("cpu"))
    real, failed = NodeCall.materialize, []

    def materialize(self, device, **kw):  # the driver's first copy of `lin` finds the device full
        if self.node.name == "lin" and not failed:
            failed.append(self.node)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, device, **kw)

    monkeypatch.setattr(NodeCall, "materialize", materialize)
    with pytest.warns(UserWarning, match=r"^profiling: cpu ran out of memory holding the graph's values; running "
                                         r"the graph where it is instead \(slower\)$"):
        cost_pass(driven, (x,), cost_model=MeasuredCostModel("cpu", repeats=1, cache=False), progress=False)
    assert failed and _static_costs(driven) == _static_costs(plain)


@pytest.mark.hf
def test_an_exported_hf_model_is_driven_on_the_measured_device_too(monkeypatch):
    """torch.export lifts parameters to inputs and bakes devices into `.to` calls: both follow the copies."""
    model = hf_model("llama", vocab=128).eval()
    kwargs = {"input_ids": torch.randint(0, 128, (2, 8)), "use_cache": False}
    costs = []
    for drive in (None, torch.device("cpu")):
        monkeypatch.setattr(MeasuredCostModel, "drive_device", lambda self, gm, flat, d=drive: d)
        gm = trace(model, (), example_kwargs=kwargs)
        cost_pass(gm, (), kwargs, cost_model=MeasuredCostModel("cpu", repeats=1, cache=False), progress=False)
        costs.append(_static_costs(gm))
    assert costs[0] == costs[1] != {}
