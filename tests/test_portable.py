"""passes/graph/portable.py: a graph traced on the CPU runs on any device, with inputs of any strides.

Each test stands for a failure first seen on a GPU (an H100, main at f5190f2) that no CPU test caught; they run
without one by using ``meta`` as the foreign device and column-major copies as the foreign strides."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from rpcompile.passes.cost.cost import cost_pass
from rpcompile.passes.cost.cost_model import node_cost
from rpcompile.passes.cost.measured import MeasuredCostModel
from rpcompile.passes.graph.portable import RESHAPE, default_device, portable_pass
from rpcompile.passes.graph.trace import trace

from _devices import scrambled
from _hf import hf_model


def _hf_llama():
    model = hf_model("llama", vocab=128).eval()
    return model, {"input_ids": torch.randint(0, 128, (2, 16)), "use_cache": False}


@pytest.mark.hf
def test_an_exported_graph_runs_on_a_device_it_was_not_traced_on():
    """GPU failure 4 (runtime): ``Tensor device mismatch! Expected: cpu, Got: cuda:0`` from export's
    ``_assert_tensor_metadata(device=cpu)``, then CPU ``arange``s mixed with GPU tensors."""
    model, kwargs = _hf_llama()
    gm = trace(model, (), example_kwargs=kwargs)
    expected = gm(**kwargs).logits
    portable_pass(gm)
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    baked = [n for n in gm.graph.nodes for a in (*n.args, *n.kwargs.values()) if isinstance(a, torch.device)]
    assert not baked, [n.format_node() for n in baked]
    torch.testing.assert_close(gm(**kwargs).logits, expected, rtol=0, atol=0)  # same values on the CPU
    on_meta = copy.deepcopy(gm).to("meta")
    with torch.device("meta"):
        out = on_meta(input_ids=kwargs["input_ids"].to("meta"), use_cache=False)
    assert out.logits.device.type == "meta" and out.logits.shape == (2, 16, 128)


@pytest.mark.hf
def test_costs_are_measured_on_a_device_the_graph_was_not_traced_on():
    """GPU failure 4 (profiling): every HF decoder failed while its costs were measured on the GPU, at the
    ``_assert_tensor_metadata(device=cpu)`` nodes of a graph traced on the CPU."""
    model, kwargs = _hf_llama()
    gm = trace(model, (), example_kwargs=kwargs)
    cost_pass(gm, (), kwargs, cost_model=MeasuredCostModel("meta", warmup=0, repeats=1), progress=False)
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert node_cost(linears[0]).fwd_flops == 2 * 2 * 16 * 32 * 32


class _Views(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = (x * 2).view(-1)  # a shape view: becomes reshape
        b = x.view(torch.int32)  # a dtype view: kept
        c = x.clone(memory_format=torch.contiguous_format)
        d = c.view(-1)  # written through below: kept, its aliasing is the model's meaning
        d.add_(1)
        return a, b, c


def test_shape_views_become_reshapes_unless_written_through_or_reinterpreting():
    """GPU failure 3: ``view size is not compatible with input tensor's size and stride`` in graphs whose views
    the CPU's strides allowed at trace time."""
    gm = fx.symbolic_trace(_Views())
    x = torch.randn(3, 4)
    expected = gm(x)
    portable_pass(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_method" and n.target in ("view", "reshape")]
    assert targets == ["reshape", "view", "view"]
    odd = x.t().contiguous().t()  # same values, column-major
    for got, want in zip(gm(odd), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_aten_views_of_any_strides_after_the_pass():
    """An aten-level graph (what torch.export and the saved segments' AOT graphs hold) fed a tensor laid out
    otherwise than at trace time."""
    def f(x):
        return torch.ops.aten.view.default(torch.ops.aten.mul.Tensor(x, 2.0), [-1, 6])

    gm = fx.symbolic_trace(f)
    x = torch.randn(2, 3, 4)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        gm(scrambled(x))
    portable_pass(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][-1] is RESHAPE
    torch.testing.assert_close(gm(scrambled(x)), f(x), rtol=0, atol=0)


def test_device_constants_follow_the_default_device():
    g = fx.Graph()
    n = g.placeholder("n")
    r = g.call_function(torch.ops.aten.arange.start, (0, n), {"device": torch.device("cpu"), "dtype": torch.int64})
    g.output(r)
    gm = portable_pass(fx.GraphModule(nn.Module(), g))
    assert [m.target for m in gm.graph.nodes if m.op == "call_function"] == [default_device, torch.ops.aten.arange.start]
    assert gm(4).device.type == "cpu"
    with torch.device("meta"):
        assert gm(4).device.type == "meta"
    assert "default_device()" in gm.code


def test_a_model_with_a_vmap_mask_trains_like_eager_on_two_devices():
    """transformers 4.5x builds its attention masks with vmap: the outlined region runs in one stage, and a
    segment holding it is recomputed rather than captured (tests/test_tracing.py has the outlining itself)."""
    import rpcompile
    from test_runtime import FINE_CPU, TOL, assert_grads_equal
    from test_tracing import _VmapMask

    torch.manual_seed(0)
    model = _VmapMask()
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 5, 8), torch.randn(6, 5, 8)
    pipe = rpcompile.compile(model, (x,), loss_fn=nn.functional.mse_loss, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=2.0)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)
