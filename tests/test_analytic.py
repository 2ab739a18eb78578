"""Tests for :mod:`rpcompile.passes.cost.analytic`: exact FLOPs, bytes and roofline times of known ops."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from rpcompile.core.specs import get_spec
from rpcompile.passes.cost.analytic import OP_FLOPS_PER_ELEMENT, AnalyticCostModel, OpRecord, op_class
from rpcompile.passes.cost.cost import cost_pass
from rpcompile.passes.cost.cost_model import COST_KEY, NodeCall, NodeCost

aten = torch.ops.aten
SPEC = get_spec("rtx4090")
EFF = SPEC.efficiency
TENSOR_CORE_CLASSES = ("matmul", "conv", "attention")


class Spy(AnalyticCostModel):
    """Keeps every NodeCall it estimates, by node name, so tests can ask for its breakdown."""

    def __init__(self, spec: str = "rtx4090", **kw) -> None:
        super().__init__(spec, **kw)
        self.calls: dict[str, NodeCall] = {}

    def estimate(self, call: NodeCall):
        self.calls[call.node.name] = call
        return super().estimate(call)

    def ops(self, node: str, phase: str | None = None) -> list[OpRecord]:
        return [r for r in self.breakdown(self.calls[node]) if phase in (None, r.phase)]


def run(
    module: nn.Module, *inputs, model: AnalyticCostModel | None = None, export: bool = False
) -> dict[str, NodeCost]:
    """Trace (symbolic_trace, or torch.export), cost with the analytic model; NodeCost by node name."""
    gm = torch.export.export(module, inputs).module() if export else fx.symbolic_trace(module)
    cost_pass(gm, inputs, cost_model=model or AnalyticCostModel("rtx4090"), progress=False)
    return {n.name: n.meta[COST_KEY] for n in gm.graph.nodes if COST_KEY in n.meta}


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def flop_counter(fn, *args) -> tuple[int, int]:
    """(forward, backward) FLOPs torch's FlopCounterMode gives for ``fn(*args)`` and its backward."""
    with FlopCounterMode(display=False) as fwd:
        out = fn(*args)
    with FlopCounterMode(display=False) as bwd:
        torch.autograd.grad(out, [a for a in args if a.requires_grad], torch.ones_like(out))
    return fwd.get_total_flops(), bwd.get_total_flops()


# --------------------------------------------------------------------------------------------- op classes
def test_op_classes():
    assert op_class(aten.mm.default) == "matmul"
    assert op_class(aten.addmm) == "matmul"
    assert op_class(aten.convolution_backward.default) == "conv"
    assert op_class(aten._scaled_dot_product_flash_attention.default) == "attention"
    assert op_class(aten.native_layer_norm_backward.default) == "norm"
    assert op_class(aten.embedding_dense_backward.default) == "embedding"
    assert op_class(aten._softmax.default) == "reduction"
    assert op_class(aten.sum.dim_IntList) == "reduction"
    assert op_class(aten.add.Tensor) == "elementwise"
    assert op_class(aten.gelu_backward.default) == "elementwise"
    assert op_class(aten.clone.default) == "memory"  # tagged pointwise by torch, but a copy
    assert op_class(aten.cat.default) == "memory"
    for free in (aten.view.default, aten._unsafe_view.default, aten.t.default, aten.expand.default,
                 aten.detach.default, aten.transpose.int, aten.select.int, aten.empty.memory_format):
        assert op_class(free) is None, free


def test_name_and_spec():
    assert AnalyticCostModel("h100-sxm").name == "analytic:h100-sxm"
    assert AnalyticCostModel(SPEC).spec is SPEC
    with pytest.raises(ValueError, match="unknown device spec 'gtx480'"):
        AnalyticCostModel("gtx480")


# ------------------------------------------------------------------------------------------------ FLOPs
class TwoLinear(nn.Module):
    def __init__(self, i: int = 32, h: int = 48, o: int = 16) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(i, h), nn.Linear(h, o)

    def forward(self, x):
        return self.second(self.first(x))


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
def test_linear_flops(export):
    b, i, h, o = 8, 32, 48, 16
    costs = run(TwoLinear(i, h, o), torch.randn(b, i), export=export)
    first, second = (costs["linear"], costs["linear_1"]) if export else (costs["first"], costs["second"])
    # forward: the addmm's matmul (its bias add is free in the GEMM epilogue, as torch counts it)
    assert first.fwd_flops == 2 * b * i * h
    assert second.fwd_flops == 2 * b * h * o
    # backward: grad weight (+ grad input when the input needs one) + the bias gradient's sum over the batch
    assert first.bwd_flops == 2 * b * i * h + b * h  # input x needs no gradient
    assert second.bwd_flops == 2 * (2 * b * h * o) + b * o


def test_conv2d_flops():
    class Convs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)

        def forward(self, x):
            return self.c2(self.c1(x))

    costs = run(Convs(), torch.randn(2, 3, 16, 16))
    c1 = 2 * (2 * 16 * 16) * (8 * 3 * 9)  # 2 · output pixels · (c_out · c_in · k²)
    c2 = 2 * (2 * 16 * 16) * (4 * 8 * 9)
    assert (costs["c1"].fwd_flops, costs["c1"].bwd_flops) == (c1, c1)  # grad weight only
    assert (costs["c2"].fwd_flops, costs["c2"].bwd_flops) == (c2, 2 * c2)


def test_bmm_and_matmul_flops():
    class MM(nn.Module):
        def forward(self, a, b):
            return torch.bmm(a, b), torch.matmul(a, b)

    costs = run(MM(), torch.randn(3, 5, 7), torch.randn(3, 7, 11))
    assert costs["bmm"].fwd_flops == costs["matmul"].fwd_flops == 2 * 3 * 5 * 7 * 11


class Attn(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, causal: bool = False) -> None:
        super().__init__()
        self.qkv, self.heads, self.causal = nn.Linear(d, 3 * d), heads, causal

    def forward(self, x):
        b, t, d = x.shape
        parts = self.qkv(x).split(d, -1)
        q, k, v = (parts[i].view(b, t, self.heads, d // self.heads).transpose(1, 2) for i in range(3))
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_flops_match_flop_counter(causal):
    b, t, d, h = 2, 32, 64, 4
    spy = Spy()
    costs = run(Attn(d, h, causal), torch.randn(b, t, d), model=spy)
    sdpa = costs["scaled_dot_product_attention"]
    q, k, v = (meta(b, h, t, d // h).requires_grad_() for _ in range(3))
    math_fwd, _ = flop_counter(lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal), q, k, v)
    efficient = aten._scaled_dot_product_efficient_attention
    fused = flop_counter(lambda *a: efficient(*a, None, True, 0.0, causal)[0], q, k, v)
    assert sdpa.fwd_flops == math_fwd == fused[0] == 4 * b * h * t * t * (d // h)
    assert sdpa.bwd_flops == fused[1] == 10 * b * h * t * t * (d // h)  # flash recomputes the scores
    assert [r.name for r in spy.ops("scaled_dot_product_attention") if r.op_class] == [
        "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_flash_attention_backward.default"]


def test_sdpa_gqa_and_mask_flops():
    class GQA(nn.Module):
        def forward(self, q, k, v, mask):
            return (F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                    F.scaled_dot_product_attention(q, q, q, attn_mask=mask))

    q, kv, mask = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.ones(16, 16, dtype=torch.bool)
    spy = Spy()
    costs = run(GQA(), q, kv, kv, mask, model=spy)
    with FlopCounterMode(display=False) as fc:  # on meta: the math path, which torch's registry covers
        F.scaled_dot_product_attention(q.to("meta"), kv.to("meta"), kv.to("meta"), enable_gqa=True)
    assert costs["scaled_dot_product_attention"].fwd_flops == fc.get_total_flops() == 4 * 2 * 8 * 16 * 16 * 32
    masked = [r.name for r in spy.ops("scaled_dot_product_attention_1") if r.op_class == "attention"]
    assert masked == ["aten._scaled_dot_product_efficient_attention.default"]


def test_causal_attention_time_counts_the_unmasked_half():
    class Plain(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True)

    t = 2048
    costs = run(Plain(), meta(1, 8, t, 64), meta(1, 8, t, 64), meta(1, 8, t, 64))
    dense, causal = costs["scaled_dot_product_attention"], costs["scaled_dot_product_attention_1"]
    assert dense.fwd_flops == causal.fwd_flops  # torch's dense count either way
    compute = dense.fwd_flops / (SPEC.fp32_flops * EFF["attention"])
    assert dense.fwd_time_s == pytest.approx(compute + SPEC.kernel_overhead_s, rel=1e-12)
    assert causal.fwd_time_s == pytest.approx(compute * (t + 1) / (2 * t) + SPEC.kernel_overhead_s, rel=1e-12)


def test_embedding_is_a_zero_flop_gather():
    spy = Spy()
    costs = run(nn.Embedding(1000, 64), torch.randint(0, 1000, (4, 16)), model=spy)
    assert costs["embedding"].fwd_flops == 0
    (gather,) = [r for r in spy.ops("embedding", "fwd") if r.op_class]
    out, idx = 4 * 16 * 64 * 4, 4 * 16 * 8
    assert (gather.op_class, gather.bytes) == ("embedding", 2 * out + idx)  # rows read + written, not the table
    assert costs["embedding"].bwd_flops == 4 * 16 * 64  # scatter-add of the output gradient


@pytest.mark.parametrize(
    "layer, fwd, bwd",
    [(nn.LayerNorm(64), "native_layer_norm", "native_layer_norm_backward"),
     (nn.RMSNorm(64), "rms_norm", "rms_norm_backward"),
     (nn.GELU(), "gelu", "gelu_backward"),
     (nn.SiLU(), "silu", "silu_backward")],
    ids=["layernorm", "rmsnorm", "gelu", "silu"],
)
def test_per_element_flops(layer, fwd, bwd):
    spy = Spy()
    costs = run(nn.Sequential(nn.Linear(64, 64, bias=False), layer), torch.randn(4, 8, 64), model=spy)
    n = 4 * 8 * 64
    assert costs["_1"].fwd_flops == OP_FLOPS_PER_ELEMENT[fwd] * n
    assert costs["_1"].bwd_flops == OP_FLOPS_PER_ELEMENT[bwd] * n
    assert len([r for r in spy.ops("_1") if r.op_class]) == 2  # one kernel each way (RMSNorm fused, as on CUDA)


# --------------------------------------------------------------------------------------------- roofline
class Binary(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a, b):
        return self.fn(a, b)


def test_big_bf16_matmul_is_compute_bound():
    assert SPEC.tensor_flops == 165e12
    n = 4096
    costs = run(Binary(torch.mm), meta(n, n), meta(n, n), model=AnalyticCostModel("rtx4090", dtype=torch.bfloat16))
    flops, node = 2 * n**3, "mm"
    assert costs[node].fwd_flops == flops
    assert costs[node].fwd_time_s == pytest.approx(flops / (165e12 * EFF["matmul"]) + SPEC.kernel_overhead_s, rel=1e-12)
    assert costs[node].bwd_time_s == 0.0


@pytest.mark.parametrize("dtype, size", [(None, 4), (torch.bfloat16, 2)])
def test_big_add_is_bandwidth_bound(dtype, size):
    assert SPEC.memory_bandwidth == 1008e9
    n = 4096 * 4096
    spy = Spy(dtype=dtype)
    costs = run(Binary(torch.add), meta(4096, 4096), meta(4096, 4096), model=spy)
    node = "add"
    (add,) = spy.ops(node)
    assert add.bytes == 3 * n * size  # bf16 halves the bytes of fp32
    assert costs[node].fwd_flops == n
    assert costs[node].fwd_time_s == pytest.approx(add.bytes / (1008e9 * EFF["elementwise"]) + SPEC.kernel_overhead_s,
                                                   rel=1e-12)


def test_repeated_input_is_read_once():
    spy = Spy()
    run(Binary(lambda a, b: a * a + a * b), torch.randn(64), torch.randn(64), model=spy)
    square, product = spy.ops("mul", "fwd")[0], spy.ops("mul_1", "fwd")[0]
    assert (square.bytes, product.bytes) == (2 * 256, 3 * 256)


def test_views_cost_nothing():
    class Views(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x).view(4, 2, 8).transpose(0, 1).unsqueeze(0)

    spy = Spy()
    costs = run(Views(), torch.randn(4, 16), model=spy)
    for name in ("view", "transpose", "unsqueeze"):
        assert (costs[name].fwd_time_s, costs[name].bwd_time_s, costs[name].fwd_flops) == (0.0, 0.0, 0)
        assert all(r.op_class is None and r.time_s == 0.0 for r in spy.ops(name))


def test_inplace_node_is_not_charged_for_the_profiling_clone():
    class Inplace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).add_(1.0)

    spy = Spy()
    run(Inplace(), torch.randn(2, 8), model=spy)
    assert [r.name for r in spy.ops("add_", "fwd")] == ["aten.add_.Tensor"]


# ------------------------------------------------------------------------------------- models and cache
class Block(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn, self.proj = Attn(d, heads, causal=True), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        x = x + self.proj(self.attn(self.norm1(x)).transpose(1, 2).flatten(2))
        return x + self.down(F.silu(self.up(self.norm2(x))))


def test_meta_transformer():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(100, 64), Block(), Block(), nn.Linear(64, 100, bias=False))
    spy = Spy(dtype=torch.bfloat16)
    costs = run(model, meta(2, 32, dtype=torch.long), model=spy)
    assert all(c.fwd_time_s >= 0 and c.bwd_time_s >= 0 for c in costs.values())
    head = 2 * (2 * 32) * 64 * 100
    assert costs["_3"].fwd_flops == head and costs["_3"].bwd_flops == 2 * head
    assert costs["_3"].fwd_time_s > SPEC.kernel_overhead_s
    assert spy.cache_info().hits > 0  # the second block reuses the first block's analyses


def test_identical_layers_are_analysed_once():
    with torch.device("meta"):
        model = nn.Sequential(*[m for _ in range(32) for m in (nn.Linear(64, 64), nn.SiLU())])
    spy = Spy()
    spy.share_repeats = False  # every node reaches the cost model: its own cache does the sharing
    costs = run(model, meta(8, 64), model=spy)
    assert len(costs) == 64
    # misses: the first Linear (its input needs no gradient), every other Linear, every SiLU
    assert spy.cache_info() == (61, 3, 3)
    assert costs["_0"].bwd_flops < costs["_2"].bwd_flops == costs["_62"].bwd_flops
    # by default repeated blocks take their representative's costs before the model sees them: the same costs
    shared = Spy()
    assert shared.share_repeats
    assert run(model, meta(8, 64), model=shared) == costs
    assert shared.cache_info().misses == 3 and shared.cache_info().hits <= 61


def test_matmul_flops_agree_with_flop_counter_on_a_model():
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
            nn.Flatten(), nn.Linear(8 * 7 * 7, 32), nn.GELU(), nn.Linear(32, 10),
        )
    x = meta(4, 3, 16, 16)
    with FlopCounterMode(display=False) as fc:
        model(x).sum().backward()
    spy = Spy()
    run(model, x, model=spy)
    ours = sum(r.flops for c in spy.calls.values() for r in spy.breakdown(c) if r.op_class in TENSOR_CORE_CLASSES)
    assert ours == fc.get_total_flops()


# -------------------------------------------------------------------- graphs that meta runs would trip over
def node_call(fn, *args, **kwargs) -> NodeCall:
    """A NodeCall of ``fn(*args, **kwargs)`` as a one-node graph (inputs need no gradient)."""
    graph = fx.Graph()
    placeholders = tuple(graph.placeholder(f"a{i}") for i in range(len(args)))
    node = graph.call_function(fn, placeholders, kwargs)
    graph.output(node)
    return NodeCall(node, fn, args, kwargs, {}, {})


def test_device_moves_are_free():
    model = AnalyticCostModel("rtx4090")
    est = model.estimate(node_call(torch.Tensor.to, torch.randn(8, 8), device="cpu"))
    assert (est.fwd_time_s, est.fwd_flops) == (0.0, 0)
    cast = model.estimate(node_call(torch.Tensor.to, torch.randn(8, 8), device="cpu", dtype=torch.float16))
    assert cast.fwd_time_s > 0.0  # a real cast stays a kernel


def test_mixed_dtypes_after_casting_are_unified():
    # traced in fp32, ``b.float()`` was a no-op; cast to bf16 it makes mm see bf16 @ fp32 (shapes are all we need)
    est = AnalyticCostModel("rtx4090", dtype=torch.bfloat16).estimate(
        node_call(lambda a, b: a @ b.float(), torch.randn(16, 32), torch.randn(32, 8)))
    assert est.fwd_flops == 2 * 16 * 32 * 8  # the matmul; the cast is a 0-FLOP memory op
