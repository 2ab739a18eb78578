"""Evaluation as users run it between training steps: ``pipe.evaluate`` (the batch's loss without gradients) and
``pipe.forward`` (the model's output), both run as ``forward_backward`` splits a batch — the plan's microbatches,
a stage holding one at a time — and equal to eager PyTorch under ``torch.no_grad()`` on the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
from rpcompile.models.registry import load_model
from rpcompile.runtime.failures import PipelineError
from rpcompile.training.loss_weighting import shifted_tokens

from _hf import hf_model
from test_batches import _causal_loss, _padded
from _devices import StridedDevice
from test_runtime import FINE_CPU, TOL


def _assert_evaluates_like_eager(pipe, model, ref, batch, labels, what):
    """``evaluate`` is eager's no-grad loss and ``forward`` its logits; neither leaves a gradient or moves a
    weight."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref_out = ref(**batch)
    torch.testing.assert_close(pipe.evaluate(**batch, target=labels), _causal_loss(ref_out, labels), **TOL,
                               msg=lambda m: f"{what}: loss: {m}")
    torch.testing.assert_close(pipe.forward(**batch).logits, ref_out.logits, **TOL,
                               msg=lambda m: f"{what}: logits: {m}")
    assert all(p.grad is None for p in model.parameters()), what
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), what


@pytest.mark.hf
def test_evaluate_and_forward_give_eager_s_no_grad_results_on_padded_batches_between_training_steps():
    """The loop users write: train, and every so often evaluate a held-out padded batch of another size and
    length — the loss weighted by real tokens over the whole batch, as eager's mean over it."""
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    ids, mask, labels = _padded(6, 16)
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask},
                             loss_fn=_causal_loss, loss_weight=shifted_tokens, devices=["cpu", "cpu"],
                             microbatches=3, spec=FINE_CPU, time_limit_s=2.0)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step, (n, seq) in enumerate([(6, 16), (5, 11), (1, 5)]):
        ids, mask, labels = _padded(n, seq, seed=10 + step)
        _assert_evaluates_like_eager(pipe, model, ref, {"input_ids": ids, "attention_mask": mask}, labels,
                                     f"step {step}")
        pipe.forward_backward(input_ids=ids, attention_mask=mask, target=labels)
        pipe.step(opt)
        _causal_loss(ref(input_ids=ids, attention_mask=mask), labels).backward()
        ref_opt.step(), ref_opt.zero_grad()


@pytest.mark.hf
def test_the_model_s_own_loss_evaluates_and_forward_joins_it_as_the_batch_mean():
    """``loss_fn=None``: ``evaluate`` is the model's own loss on the whole batch (each microbatch weighted by the
    shifted labels it averages over), and so is the ``loss`` of what ``forward`` returns."""
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    ids, mask, labels = _padded(seed=2)
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
                             loss_fn=None, devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU, time_limit_s=2.0)
    ids, mask, labels = _padded(5, 20, seed=3)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        ref_out = ref(**batch)
    torch.testing.assert_close(pipe.evaluate(**batch), ref_out.loss, **TOL)
    out = pipe.forward(**batch)
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    torch.testing.assert_close(out.logits, ref_out.logits, **TOL)
    assert all(p.grad is None for p in model.parameters())


def test_a_split_lm_head_evaluates_its_loss_inside_the_graph():
    """``head_chunks=4`` computes the loss in the fused stage's graph, a chunk of the head at a time: ``evaluate``
    runs it there, without the logits, and equals eager on batches of other sizes and lengths."""
    spec = load_model("llama-demo", batch_size=6)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=2.0, example_target=y, head_chunks=4)
    assert pipe.loss_in_graph
    for rows, seq in [(6, x.shape[1]), (4, x.shape[1] // 2)]:
        xs, ys = x[:rows, :seq], y[:rows, :seq]
        with torch.no_grad():
            torch.testing.assert_close(pipe.evaluate(xs, target=ys), spec.loss_fn(ref(xs), ys), **TOL)
    assert all(p.grad is None for p in spec.model.parameters())


SEEN: list[int] = []
FAIL_AT: list[int] = []


class Rows(nn.Module):
    """A leaf module recording the rows each call gets; it raises on the call numbered in ``FAIL_AT``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(x.shape[0])
        if FAIL_AT and len(SEEN) == FAIL_AT[0]:
            raise RuntimeError("sensor offline")
        return x * 1.0


class Recorded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.rows, self.b = nn.Linear(8, 16), Rows(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.rows(self.a(x).relu()))


def test_a_stage_evaluates_one_microbatch_at_a_time_and_a_failure_is_one_line_naming_it():
    """A stage gets the plan's microbatch, not the whole batch (the memory it was planned for); an exception in
    a stage is one ``PipelineError`` naming the stage, device and microbatch, and the next call runs."""
    torch.manual_seed(0)
    model = Recorded()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    pipe = rpcompile.compile(model, (x,), loss_fn=F.mse_loss, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=2.0, leaf_modules=[Rows])
    SEEN.clear()
    torch.testing.assert_close(pipe.forward(x), model(x), **TOL)
    assert SEEN[:3] == [2, 2, 2]
    SEEN.clear()
    torch.testing.assert_close(pipe.evaluate(x[:5], target=y[:5]), F.mse_loss(model(x[:5]), y[:5]), **TOL)
    assert SEEN[:3] == [2, 2, 1]
    SEEN.clear()
    FAIL_AT.append(2)
    stage = next(s.name for s in pipe.plan.stages if any("rows" in n for n in s.nodes) and s.kind != "backward")
    try:
        with pytest.raises(PipelineError, match=rf"^stage {stage} \(\d+F1\) failed on device \d \(cpu\) at "
                                                r"microbatch 1: RuntimeError: sensor offline$"):
            pipe.forward(x)
    finally:
        FAIL_AT.clear()
    torch.testing.assert_close(pipe.forward(x), model(x), **TOL)


def test_beside_an_overlapped_step_evaluation_sees_the_weights_the_next_iteration_computes_with():
    """After ``pipe.step(opt, overlap=True)`` the step is still running: ``evaluate`` uses the weights from before
    it (those the next iteration computes with, one step stale), racing with nothing; after ``synchronize()`` the
    stepped ones."""
    from test_weights import batch, loss_fn, pair

    a, pa, _, _ = pair("fp32")
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    x, y = batch(0)
    pa.forward_backward(x, target=y)
    before = copy.deepcopy(a)
    pa.step(opt, overlap=True)
    with torch.no_grad():
        torch.testing.assert_close(pa.evaluate(x, target=y), loss_fn(before(x), y), **TOL)
    pa.synchronize()
    with torch.no_grad():
        stepped = loss_fn(a(x), y)
        assert not torch.allclose(stepped, loss_fn(before(x), y))
    torch.testing.assert_close(pa.evaluate(x, target=y), stepped, **TOL)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)).relu())


@pytest.mark.parametrize("train", [True, False], ids=["train-mode", "eval-mode"])
def test_a_batch_norm_s_statistics_come_home_from_a_train_mode_evaluation(train):
    """On devices whose copies are not the host's tensors: in train mode ``forward`` normalises each microbatch by
    its own statistics and updates the running ones once per microbatch — as eager over those microbatches —, and
    they come home; in eval mode it uses the running statistics and changes nothing."""
    torch.manual_seed(0)
    model = Normed()
    x = torch.randn(6, 8)
    pipe = rpcompile.compile(model, (x,), loss_fn=F.mse_loss, devices=[StridedDevice(), StridedDevice()],
                             microbatches=3, spec=FINE_CPU, time_limit_s=2.0)
    ref = copy.deepcopy(model)
    model.train(train)
    ref.train(train)
    out = pipe.forward(x)
    with torch.no_grad():
        expected = torch.cat([ref(piece) for piece in x.chunk(3)]) if train else ref(x)
    torch.testing.assert_close(out, expected, **TOL)
    for name, buffer in model.norm.named_buffers():
        torch.testing.assert_close(buffer, getattr(ref.norm, name), **TOL, msg=lambda m: f"{name}: {m}")
    assert int(model.norm.num_batches_tracked) == (3 if train else 0)


class Counted(nn.Module):
    """A forward that counts its calls and keeps a running mean of a hidden layer under ``torch.no_grad()`` (not a
    batch norm), and an fp32 constant that nothing writes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.full((16,), 0.5))
        self.register_buffer("third", torch.full((4,), 1 / 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            self.calls += 1
            self.mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.b(h.relu()) * self.third * 3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["cpu", "strided"])
def test_buffers_a_forward_writes_follow_eager_over_the_same_microbatches(kind, precision):
    """What "eager" means for buffers: the same microbatches run one after the other (as for BatchNorm). A counter
    a forward increments under ``no_grad`` counts microbatches — 3 per call here, in train and eval mode — and a
    running mean follows them; ``compile`` itself changes no buffer (torch.fx ran ``calls += 1`` for real while
    tracing: the counter was one ahead of eager before training began); a buffer no forward writes stays bit for
    bit as it was, also where the devices compute in bf16 (its copy is not written back). ``strided``: devices
    whose copies are not the host's tensors, as a GPU's."""
    torch.manual_seed(0)
    model = Counted()
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    devices = [StridedDevice(), StridedDevice()] if kind == "strided" else ["cpu", "cpu"]
    pipe = rpcompile.compile(model, (x,), loss_fn=F.mse_loss, devices=devices, microbatches=3, spec=FINE_CPU,
                             time_limit_s=1.0, head_chunks=1, precision=precision)
    tol = TOL if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)

    def same(what: str) -> None:
        assert int(model.calls) == int(ref.calls), (what, int(model.calls), int(ref.calls))
        torch.testing.assert_close(model.mean, ref.mean, **tol, msg=lambda m: f"{what}: mean: {m}")
        assert torch.equal(model.third, ref.third), what

    same("after compile")
    pipe.forward_backward(x, target=y)
    for piece in x.chunk(3):
        ref(piece)
    same("after forward_backward")
    pipe.evaluate(x, target=y)
    with torch.no_grad():
        for piece in x.chunk(3):
            ref(piece)
    same("after evaluate")
    model.eval()
    ref.eval()
    pipe.forward(x)
    with torch.no_grad():
        for piece in x.chunk(3):
            ref(piece)
    same("after an eval-mode forward")
    assert int(model.calls) == 9
