"""Batches as users have them: HF models as they come, HF batch dicts, padding weighted by tokens, inputs bound
to the compiled signature with one-line refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import rpcompile
from rpcompile.training.loss_weighting import IGNORE_INDEX, loss_weights, shifted_tokens

from _hf import VOCAB, hf_model, token_loss
from test_runtime import FINE_CPU, TOL, assert_grads_equal, assert_step_matches_eager

def _padded(batch=6, seq=32, seed=0):
    """Right-padded token ids, their attention mask and labels (-100 on padding), rows of random lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return ids, mask, labels


def _causal_loss(out, labels):
    """HF's causal LM loss: predict token t+1 from position t, padding ignored, mean over the real tokens."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


@pytest.mark.hf
def test_an_hf_model_compiles_as_the_readme_says():
    """The README's snippet on an HF model, with no extra arguments: the KV cache is off for the trace (the model's
    config is not touched) and forward_backward takes the ids as compiled."""
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    ids, y = torch.randint(0, VOCAB, (6, 8)), torch.randint(0, VOCAB, (6, 8))
    pipe = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU,
                             time_limit_s=2.0)
    assert model.config.use_cache is True
    assert_step_matches_eager(pipe, model, ref, token_loss, ids, target=y)


@pytest.mark.hf
def test_a_padded_hf_batch_dict_gives_eager_s_whole_batch_loss_and_gradients():
    """Right-padded rows of different lengths with an attention mask; the loss is the mean over real tokens of the
    whole batch — not the mean of the microbatches' means (HF Trainer's ``num_items_in_batch`` fix)."""
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    ids, mask, labels = _padded()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask},
                             loss_fn=_causal_loss, loss_weight=shifted_tokens, devices=["cpu", "cpu"],
                             microbatches=3, spec=FINE_CPU, time_limit_s=2.0)
    loss = pipe.forward_backward(**batch)
    ref_loss = _causal_loss(ref(input_ids=ids, attention_mask=mask), labels)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)
    rows = [float(n) for n in (2, 2, 2)]
    assert loss_weights(list(labels.tensor_split(3)), rows, shifted_tokens) != rows  # the rows differ in length


@pytest.mark.hf
def test_loss_fn_none_uses_the_model_s_own_loss_weighted_by_its_shifted_labels():
    """``loss_fn=None`` with labels in the batch: the HF model's own causal LM loss, each microbatch weighted by
    the labels it averages over (``labels[:, 1:]`` not -100), so loss and gradients equal eager on the whole batch,
    batch after batch of different sizes and lengths."""
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    ids, mask, labels = _padded(seed=2)
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
                             loss_fn=None, devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU, time_limit_s=2.0)
    assert pipe.loss_weight is shifted_tokens
    for step, (ids, mask, labels) in enumerate([(ids, mask, labels), _padded(5, 20, seed=3), _padded(2, 32, seed=4)]):
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        loss = pipe.forward_backward(**batch)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"step {step}: loss: {m}")
        assert_grads_equal(model, ref, what=f"step {step}: ")
    # the model's loss runs inside the last stage: its labels are checked on the host against the model's output
    # embeddings before anything runs (on a GPU a label past the vocabulary stops at a device-side assert)
    model.zero_grad(set_to_none=True)
    beyond = labels.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(VOCAB + 6))
    with pytest.raises(rpcompile.InputError, match=rf"^labels has label {VOCAB + 6}, beyond the {VOCAB} classes of "
                                                   rf"the model's output \(its last dimension\): labels must be "
                                                   rf"below {VOCAB}, or -100 \(ignored\); check the tokenizer "):
        pipe.forward_backward(input_ids=ids, attention_mask=mask, labels=beyond)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.hf
def test_loss_fn_none_without_labels_is_refused_at_compile_in_one_line():
    model = hf_model("llama")
    ids = torch.randint(0, VOCAB, (4, 8))
    with pytest.raises(rpcompile.RPCompileError, match=r"^loss_fn=None uses the model's own loss, which it computes "
                                                        r"from labels: compile with them in the example \(example_kwargs="):
        rpcompile.compile(model, (ids,), loss_fn=None, devices=["cpu"], spec=FINE_CPU, time_limit_s=2.0)


@pytest.mark.hf
def test_padding_is_weighted_by_tokens_by_default():
    """An integer target with -100 on padding: each microbatch's mean counts its real tokens (the default). A
    microbatch whose labels are all -100 has no mean (eager's ``cross_entropy`` gives nan): it weighs 0, so the
    batch still gives eager's loss and gradients. A batch with no real token returns 0 — eager: nan — and adds no
    gradient (nothing to learn from; no nan reaches the weights)."""
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    ids, mask, labels = _padded(seed=1)
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask},
                             loss_fn=token_loss, devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU,
                             time_limit_s=2.0)
    assert_step_matches_eager(pipe, model, ref, token_loss, input_ids=ids, attention_mask=mask, target=labels)
    labels[:2] = IGNORE_INDEX  # microbatch 0 of 3: padding only
    for p in (*model.parameters(), *ref.parameters()):
        p.grad = None
    assert_step_matches_eager(pipe, model, ref, token_loss, input_ids=ids, attention_mask=mask, target=labels)
    model.zero_grad(set_to_none=True)
    loss = pipe.forward_backward(input_ids=ids, attention_mask=mask, target=torch.full_like(labels, IGNORE_INDEX))
    assert float(loss) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@pytest.mark.hf
def test_gradient_accumulation_over_padded_batches_equals_one_big_batch_or_their_scaled_means():
    """Three padded batches of different sizes and lengths accumulated before one optimizer step. With
    ``num_items`` (the real tokens of all three) the gradients are those of the mean over every real token —
    one big batch, padding weighted as in it (HF Trainer's ``num_items_in_batch``); with ``loss_scale=1/3``
    those of the eager ``(loss / 3).backward()`` loop. The losses returned are the ones differentiated, and the
    weights after the step are eager's."""
    model = hf_model("llama")
    ids, mask, labels = _padded(seed=5)
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask},
                             loss_fn=token_loss, devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU,
                             time_limit_s=2.0)
    batches = [_padded(6, 32, seed=6), _padded(3, 20, seed=7), _padded(5, 11, seed=8)]
    items = sum(int((labels != IGNORE_INDEX).sum()) for _, _, labels in batches)
    summed = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten(), reduction="sum")  # noqa: E731
    for how, options, ref_loss in [("num_items", {"num_items": items}, lambda out, y: summed(out, y) / items),
                                   ("loss_scale", {"loss_scale": 1 / 3}, lambda out, y: token_loss(out, y) / 3)]:
        ref = copy.deepcopy(model)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        for ids, mask, labels in batches:
            loss = pipe.forward_backward(input_ids=ids, attention_mask=mask, target=labels, **options)
            expected = ref_loss(ref(input_ids=ids, attention_mask=mask), labels)
            expected.backward()
            torch.testing.assert_close(loss, expected.detach(), **TOL, msg=lambda m: f"{how}: loss: {m}")
        assert_grads_equal(model, ref, what=f"{how}: ")
        pipe.step(opt)
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{how}: weights after the step: {m}")


@pytest.mark.hf
def test_inputs_that_do_not_match_the_compiled_signature_are_refused_in_one_line():
    model = hf_model("llama")
    ids, mask, _ = _padded(batch=4, seq=8)
    plain = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu"], spec=FINE_CPU, time_limit_s=2.0)
    with pytest.raises(rpcompile.RPCompileError, match=r"^keyword input\(s\) \['attention_mask'\] were not in the "
                                                        r"compile example .*compile with them in example_kwargs="):
        plain.forward_backward(ids, attention_mask=mask, target=ids)  # silently unmasked before
    with pytest.raises(rpcompile.RPCompileError, match=r"^use_cache=True but the pipeline was compiled with "
                                                        r"use_cache=False"):
        plain.forward_backward(ids, use_cache=True, target=ids)
    masked = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask},
                               loss_fn=token_loss, devices=["cpu"], spec=FINE_CPU, time_limit_s=2.0)
    with pytest.raises(rpcompile.RPCompileError, match=r"^missing keyword input\(s\) \['attention_mask'\]"):
        masked.forward_backward(input_ids=ids, target=ids)  # KeyError ('attention_mask', 0) inside a stage before
    with pytest.raises(rpcompile.RPCompileError, match=r"^the pipeline was compiled for 0 positional input\(s\), got 2"):
        masked.forward_backward(ids, mask, target=ids)
    with pytest.raises(rpcompile.RPCompileError, match=r"^loss_weight='tokens'; use 'auto', 'rows' or a function"):
        rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu"], spec=FINE_CPU, time_limit_s=2.0,
                          loss_weight="tokens")


def _loop(pipe, model, ref, batches, loss_fn, make_kwargs):
    for step, (ids, mask, labels) in enumerate(batches):
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        assert_step_matches_eager(pipe, model, ref, loss_fn, **make_kwargs(ids, mask), target=labels,
                                  what=f"step {step} (batch {tuple(ids.shape)}): ")


def _random_batches(n, max_batch, max_seq, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b = int(torch.randint(1, max_batch + 1, (), generator=g))
        s = int(torch.randint(2, max_seq + 1, (), generator=g))
        out.append(_padded(b, s, seed=seed * 100 + i))
    return out


@pytest.mark.hf
def test_one_hf_pipeline_trains_every_batch_size_and_length_like_eager():
    """Twelve padded batches of random size (1 to 8 rows: fewer rows than microbatches too, and uneven splits) and
    length (up to the compiled 16), each step's loss and every gradient equal to eager on the whole batch — one
    compiled graph with symbolic batch and sequence sizes, no re-planning; a longer sequence is refused."""
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    ids, mask, _ = _padded(batch=6, seq=16)
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask},
                             loss_fn=token_loss, devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU,
                             time_limit_s=2.0)
    plan = pipe.plan
    _loop(pipe, model, ref, _random_batches(12, 8, 16, seed=3), token_loss,
          lambda i, m: {"input_ids": i, "attention_mask": m})
    assert pipe.plan is plan
    # symbolic captures: one for one-row microbatches, one for the rest, whatever the lengths
    assert pipe.program.saved and {s.name: s.n_captures for s in pipe.program.saved} == \
        {s.name: min(s.n_captures, 2) for s in pipe.program.saved}
    long_ids, long_mask, long_labels = _padded(batch=2, seq=17)
    with pytest.raises(rpcompile.RPCompileError, match=r"^sequence length 17 is longer than the 16 this pipeline "
                                                        r"was planned for .*compile again with an example of length 17"):
        pipe.forward_backward(input_ids=long_ids, attention_mask=long_mask, target=long_labels)


@pytest.mark.parametrize("name", ["llama-demo", pytest.param("gpt-demo", marks=pytest.mark.slow)])
def test_the_built_in_decoders_train_every_batch_size_and_length_like_eager(name):
    from rpcompile.models.registry import load_model

    spec = load_model(name, batch_size=6, seq_len=16)
    ref = copy.deepcopy(spec.model)
    (x,) = spec.example_inputs
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=token_loss_plain, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=2.0)
    batches = [(i % 256, None, labels) for i, _, labels in _random_batches(12, 8, 16, seed=4)]
    _loop(pipe, spec.model, ref, batches, token_loss_plain, lambda i, m: {"input_ids": i})


def token_loss_plain(logits, target):
    """Mean token cross-entropy of plain logits, padding (-100) ignored."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _row_weighted(out, target):
    """A loss whose target is a tuple: (values, a weight per row); the mean over the rows of the weighted error."""
    values, weights = target
    return (((out - values) ** 2).mean(1) * weights).mean()


@pytest.mark.parametrize("rows", [3, 6, 4], ids=["one-row-microbatches", "two-row", "uneven"])
def test_a_tuple_target_is_split_with_the_inputs_and_gives_eager_s_loss(rows):
    """A target of (values, row weights): every tensor in it is split into microbatches along dim 0 as the inputs
    are. With one-row microbatches the old code gave each microbatch the whole tuple, which broadcast against its
    one row to a silently wrong loss (with two or more rows it was refused by the loss's shape error)."""
    from test_bad_inputs import MLP

    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    x, values, weights = torch.randn(6, 8), torch.randn(6, 4), torch.rand(6)
    pipe = rpcompile.compile(model, (x,), loss_fn=_row_weighted, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=1.0, head_chunks=1)
    target = (values[:rows], weights[:rows])
    with torch.no_grad():
        torch.testing.assert_close(pipe.evaluate(x[:rows], target=target), _row_weighted(ref(x[:rows]), target),
                                   **TOL)
    assert_step_matches_eager(pipe, model, ref, _row_weighted, x[:rows], target=target)
    dict_pipe = rpcompile.compile(model, (x,), loss_fn=lambda out, t: _row_weighted(out, (t["v"], t["w"])),
                                  devices=["cpu", "cpu"], microbatches=3, plan=pipe.plan)
    with torch.no_grad():  # a dict target likewise
        torch.testing.assert_close(dict_pipe.evaluate(x[:rows], target={"v": target[0], "w": target[1]}),
                                   _row_weighted(ref(x[:rows]), target), **TOL)


class _Residual(torch.nn.Module):
    """Residual tanh layers on float inputs: thirteen segments, no dropout or batch norm (eager is exact)."""

    def __init__(self, d: int = 16, n: int = 6) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x
        return self.head(x)


def _eager_input_grads(ref, loss_fn, x, target, calls=2):
    """``x.grad`` after ``calls`` eager backward passes (the model's gradients accumulate in ``ref`` too)."""
    xr = x.detach().clone().requires_grad_(True)
    for _ in range(calls):
        loss_fn(ref(xr), target).backward()
    return xr.grad


@pytest.mark.parametrize("plan", ["one-device", "pipelined", "saved-segments"])
def test_an_input_that_requires_grad_gets_eager_s_gradient(plan):
    """``x.requires_grad_(True)`` then ``forward_backward(x, ...)`` (saliency maps, adversarial steps): ``x.grad``
    is eager's, accumulated over calls like the parameters' — the first stage's input gradients come home per
    microbatch, through saved segments too. The old code left ``x.grad`` None (or, on one CPU device, reached
    into the caller's graph by accident)."""
    from test_runtime import _saving_pipeline
    from rpcompile.models.registry import ModelSpec

    torch.manual_seed(0)
    x, y = torch.randn(6, 16), torch.randn(6, 4)
    if plan == "saved-segments":
        spec = ModelSpec(_Residual(), (x,), F.mse_loss, y)
        _, ref, pipe, _, _ = _saving_pipeline(spec, 0)
        model = spec.model
    else:
        model = _Residual()
        ref = copy.deepcopy(model)
        pipe = rpcompile.compile(model, (x,), loss_fn=F.mse_loss, devices=["cpu"] * (1 if plan == "one-device" else 2),
                                 microbatches=3, spec=FINE_CPU, time_limit_s=1.0, head_chunks=1)
    xa = x.clone().requires_grad_(True)
    for _ in range(2):
        pipe.forward_backward(xa, target=y)
    torch.testing.assert_close(xa.grad, _eager_input_grads(ref, F.mse_loss, x, y), **TOL)
    assert_grads_equal(model, ref)
    before = xa.grad.clone()  # and a call without it changes nothing of x
    pipe.forward_backward(x, target=y)
    assert torch.equal(xa.grad, before)


def test_a_soft_prompt_gets_eager_s_gradient_through_the_input_it_makes():
    """An input made by the caller's own autograd graph — a soft prompt (a parameter) expanded over the batch and
    joined to the rest — is differentiated on through that graph, as eager's ``loss.backward()`` does: the
    prompt's ``.grad`` is eager's (the input itself is no leaf and keeps none)."""
    torch.manual_seed(0)
    model = _Residual()
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 16), torch.randn(6, 4)
    pipe = rpcompile.compile(model, (x,), loss_fn=F.mse_loss, devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU,
                             time_limit_s=1.0, head_chunks=1)
    prompt = torch.nn.Parameter(torch.randn(1, 4) * 0.1)
    ref_prompt = torch.nn.Parameter(prompt.detach().clone())
    joined = torch.cat([prompt.expand(6, -1), x[:, 4:]], 1)
    pipe.forward_backward(joined, target=y, loss_scale=0.5)
    (F.mse_loss(ref(torch.cat([ref_prompt.expand(6, -1), x[:, 4:]], 1)), y) * 0.5).backward()
    torch.testing.assert_close(prompt.grad, ref_prompt.grad, **TOL)
    assert_grads_equal(model, ref)


@pytest.mark.hf
def test_loss_fn_may_be_left_out_for_a_model_with_its_own_loss():
    """An HF model computes its loss from labels: ``compile`` needs no ``loss_fn`` for it; a model whose output is
    not a loss gets one line at its first call naming ``loss_fn=``."""
    model = hf_model("llama")
    ids, mask, labels = _padded(seed=2)
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
                             devices=["cpu"], spec=FINE_CPU, time_limit_s=2.0)
    assert pipe.loss_fn is None and torch.isfinite(pipe.forward_backward(input_ids=ids, attention_mask=mask,
                                                                         labels=labels))
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    plain = rpcompile.compile(mlp, (torch.randn(2, 4),), devices=["cpu"], spec=FINE_CPU, time_limit_s=1.0)
    with pytest.raises(rpcompile.RPCompileError, match=r"^without a loss_fn the model's output is the loss, but it "
                       r"is \(2, 4\), not a scalar: compile with loss_fn= \(e\.g\. torch\.nn\.functional\."
                       r"cross_entropy\), or have the model return its loss reduced over the batch$"):
        plain.forward_backward(torch.randn(2, 4))
