"""``passes/graph/export_inputs.py``: a ``forward(*args, **kwargs)`` exports with symbolic sizes and every input
named."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from rpcompile.passes.graph.export_inputs import dynamic_shapes, explicit_signature
from rpcompile.passes.graph.trace import TRACE_META_KEY, trace


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        h = self.proj(self.emb(ids)) * scale
        return h if mask is None else h * mask[..., None]


class Wrapper(nn.Module):
    """A pass-through wrapper, as PEFT's ``PeftModel`` is."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_the_dynamic_shapes_spec_binds_to_var_positional_and_var_keyword():
    ids, mask = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5)
    spec = dynamic_shapes(Wrapper(), (ids,), {"mask": mask, "scale": 2.0})
    assert list(spec) == ["args", "kwargs"]
    assert len(spec["args"]) == 1 and set(spec["args"][0]) == {0, 1}  # token ids: batch and sequence
    assert set(spec["kwargs"]["mask"]) == {0} and spec["kwargs"]["scale"] is None  # floating: batch only


def test_explicit_signature_names_every_input_and_restores_forward():
    model = Wrapper()
    ids = torch.zeros(2, 5, dtype=torch.long)
    with explicit_signature(model, (ids,), {"mask": torch.ones(2, 5), "scale": 2.0}):
        assert "forward" in vars(model)
        assert str(inspect.signature(model.forward)) == "(args_0, *, mask, scale)"
    assert "forward" not in vars(model)
    own = lambda *a, **k: Wrapper.forward(model, *a, **k)  # noqa: E731 - an instance's own forward (accelerate)
    model.forward = own
    with explicit_signature(model, (ids,), {"scale": 2.0}):
        assert model.forward is not own
    assert model.forward is own


def test_a_var_args_forward_exports_with_symbolic_sizes_and_the_model_s_own_parameters():
    """Non-tensor keyword (a constant export specialises) through ``**kwargs``: export, not fx; the graph module
    takes every later batch and sequence size and reads the wrapper's own parameters under their names."""
    model = Wrapper()
    ids, mask = torch.randint(0, 16, (3, 6)), torch.ones(3, 6)
    gm = trace(model, (ids,), example_kwargs={"mask": mask, "scale": 2.0})
    assert gm.meta[TRACE_META_KEY] == "export"
    assert gm.get_parameter("inner.proj.weight") is model.inner.proj.weight
    for b, t in [(3, 6), (5, 4), (2, 9)]:
        x, m = torch.randint(0, 16, (b, t)), torch.rand(b, t)
        torch.testing.assert_close(gm(x, mask=m, scale=2.0), model(x, mask=m, scale=2.0))


@pytest.mark.hf
def test_an_exported_hf_model_is_called_like_the_model():
    """``rpcompile.trace`` of an HF model exports it with ``use_cache=False`` (a placeholder of the graph, specialised):
    the module it returns takes the model's own call — ``gm(ids)`` — and gives its output, logits equal."""
    from _hf import VOCAB, hf_model

    import rpcompile

    model = hf_model("llama")
    ids = torch.randint(0, VOCAB, (2, 8))
    gm = rpcompile.trace(model, (ids,))
    out, ref = gm(ids), model(ids, use_cache=False)
    assert type(out) is type(ref) and torch.equal(out.logits, ref.logits)
    assert torch.equal(gm(input_ids=ids).logits, ref.logits) and torch.equal(gm(ids, False).logits, ref.logits)
