"""HF models (exported graphs) trained in bf16/fp16 with fp32 masters: they match eager HF run in that precision
(``copy.deepcopy(model).to(dtype)``: bf16 weights computing in bf16, its own fp32 casts included), as
tests/test_runtime.py's ``test_mixed_precision_matches_low_precision_eager`` asks of rpcompile's own models."""

from __future__ import annotations

import copy

import pytest
import torch

import rpcompile
from rpcompile.passes.graph.precision import TRACE_DTYPE_KEY
from rpcompile.passes.graph.trace import trace
from rpcompile.training.loss_weighting import shifted_tokens

from _hf import VOCAB, hf_model, token_loss
from test_batches import _causal_loss, _padded
from test_runtime import FINE_CPU

pytestmark = pytest.mark.hf

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_TOL = 3e-2
"""Normwise relative gradient error allowed against eager in the same precision (test_runtime's)."""


def _normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def assert_matches_low_precision_eager(model, ref, loss, ref_loss):
    """The loss to 1e-3 relative, every trained master and its gradient fp32, each gradient within
    :data:`GRAD_TOL` (normwise) of eager's."""
    assert abs(loss.item() - ref_loss.item()) < 1e-3 * abs(ref_loss.item())
    ref_params = dict(ref.named_parameters())
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained
    for name, p in trained:
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
        assert _normwise(p.grad, ref_params[name].grad) < GRAD_TOL, name


# llama: bf16 by default in test_a_padded_batch_dict_trains_in_bf16_like_eager_in_bf16, fp16 in
# test_fp16_with_a_grad_scaler_trains_an_hf_model_like_eager_fp16 (the same model and check, plus a padded batch
# dict / the scaler); these plain runs behind slow
@pytest.mark.parametrize("kind,precision", [pytest.param("llama", "bf16", marks=pytest.mark.slow),
                                            ("qwen3-moe", "bf16"),
                                            pytest.param("llama", "fp16", marks=pytest.mark.slow)])
def test_an_hf_model_trains_in_low_precision_like_eager_in_it(kind, precision):
    model = hf_model(kind)
    ref = copy.deepcopy(model).to(DTYPES[precision])
    ids, y = torch.randint(0, VOCAB, (6, 8)), torch.randint(0, VOCAB, (6, 8))
    pipe = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU,
                             precision=precision, time_limit_s=1.0)
    loss = pipe.forward_backward(ids, target=y)
    ref_loss = token_loss(ref(ids, use_cache=False), y)
    ref_loss.backward()
    assert_matches_low_precision_eager(model, ref, loss, ref_loss)


def test_a_padded_batch_dict_trains_in_bf16_like_eager_in_bf16():
    model = hf_model("llama")
    ref = copy.deepcopy(model).to(torch.bfloat16)
    ids, mask, labels = _padded(seq=16)
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask},
                             loss_fn=_causal_loss, loss_weight=shifted_tokens, devices=["cpu", "cpu"],
                             microbatches=3, spec=FINE_CPU, precision="bf16", time_limit_s=1.0)
    loss = pipe.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
    ref_loss = _causal_loss(ref(input_ids=ids, attention_mask=mask, use_cache=False), labels)
    ref_loss.backward()
    assert_matches_low_precision_eager(model, ref, loss, ref_loss)


def test_a_saved_bf16_plan_recompiles_and_trains(tmp_path):
    """``compile(plan=...)`` re-traces in the plan's precision (the graph digest hashes the recorded casts)."""
    model = hf_model("llama")
    ids, y = torch.randint(0, VOCAB, (6, 8)), torch.randint(0, VOCAB, (6, 8))
    first = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU,
                              precision="bf16", time_limit_s=1.0)
    path = tmp_path / "plan.json"
    first.plan.save(path)
    again = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], precision="bf16",
                              plan=str(path))
    torch.testing.assert_close(again.forward_backward(ids, target=y), first.forward_backward(ids, target=y))


def test_the_export_path_records_the_casts_of_the_compute_dtype_on_the_model_s_own_fp32_parameters():
    """Traced for bf16: RMSNorm's cast back to its input dtype is in the graph (traced in fp32 it is a no-op and
    vanishes); the graph's parameters are the model's objects, still fp32; fx graphs are not re-traced."""
    model = hf_model("llama")
    ids = torch.randint(0, VOCAB, (2, 8))

    def casts_to(gm, dtype):
        return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.kwargs.get("dtype") == dtype
                   or dtype in n.args[1:2])

    fp32, bf16 = trace(model, (ids,)), trace(model, (ids,), dtype=torch.bfloat16)
    assert casts_to(fp32, torch.bfloat16) == 0 and casts_to(bf16, torch.bfloat16) >= 2 * 2 + 1  # 2 norms a layer
    assert bf16.meta[TRACE_DTYPE_KEY] is torch.bfloat16 and fp32.meta[TRACE_DTYPE_KEY] is None
    own = dict(model.named_parameters())
    assert all(own[n] is p and p.dtype == torch.float32 for n, p in bf16.named_parameters())
    fx_model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert TRACE_DTYPE_KEY not in trace(fx_model, (torch.randn(2, 4),), dtype=torch.bfloat16).meta


def test_fp16_with_a_grad_scaler_trains_an_hf_model_like_eager_fp16():
    """The pipeline's gradients are the scaled ones (GradScaler's convention: ``scaler.step`` unscales them); once
    unscaled they are eager fp16's, and the step is taken."""
    model = hf_model("llama")
    ref = copy.deepcopy(model).to(torch.float16)
    ids, y = torch.randint(0, VOCAB, (6, 8)), torch.randint(0, VOCAB, (6, 8))
    scale = 2.0**8
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    pipe = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU,
                             precision="fp16", scaler=scaler, time_limit_s=1.0)
    loss = pipe.forward_backward(ids, target=y)
    ref_loss = token_loss(ref(ids, use_cache=False), y)
    ref_loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(opt)
    assert_matches_low_precision_eager(model, ref, loss, ref_loss)
    before = model.lm_head.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale and not torch.equal(model.lm_head.weight, before)


def test_an_hf_plan_compiled_in_another_precision_is_refused_in_one_line():
    model = hf_model("llama")
    ids = torch.randint(0, VOCAB, (6, 8))
    plan = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU,
                             precision="bf16", time_limit_s=1.0).plan
    with pytest.raises(rpcompile.RPCompileError, match=r"^precision='fp32' but the plan was made for 'bf16' \(its "
                       r"memory and times assume it\): compile with precision='bf16' or none, or re-plan for "
                       r"'fp32'$"):
        rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], precision="fp32", plan=plan)


def test_a_plan_runs_in_its_own_precision_on_every_path():
    """``compile(..., plan=p)`` without ``precision`` runs in the plan's (an fx-traced model ran a bf16 plan in fp32
    before, needing twice the memory the plan budgeted); one that says another is refused (above)."""
    ids = torch.randint(0, VOCAB, (6, 8))
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(6, 8)
    for model, inputs, loss in ((hf_model("llama"), (ids,), token_loss),
                                (mlp, (x,), torch.nn.functional.cross_entropy)):
        plan = rpcompile.plan(model, inputs, gpus=2, spec=FINE_CPU, precision="bf16", loss_fn=loss,
                              time_limit_s=1.0)
        pipe = rpcompile.compile(model, inputs, loss_fn=loss, devices=["cpu", "cpu"], plan=plan)
        assert pipe.precision == "bf16" and pipe.executor.dtype == torch.bfloat16
