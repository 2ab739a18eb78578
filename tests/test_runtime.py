"""The runtime on logical CPU devices: loss, every gradient and the weights after AdamW equal eager PyTorch."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from rpcompile.planner.plan_options import PlanOptions
import rpcompile
from rpcompile.core.batch import split_microbatches
from rpcompile.core.schedule import Action, format_schedule, parse_action, round_robin
from rpcompile.core.specs import get_spec
from rpcompile.models.registry import load_model

# The cpu preset's per-stage overhead (0.4 ms, the executor's real hand-off cost) makes the planner keep tiny
# demo models in very few stages; these tests want many stages of every kind, so they plan with a GPU-like 30 µs.
FINE_CPU = dataclasses.replace(get_spec("cpu"), name="cpu-fine-stages", stage_overhead_s=30e-6)

TOL = dict(rtol=1e-5, atol=1e-6)


def assert_grads_equal(model, ref, scale: float = 1.0, *, tol: dict | None = None, what: str = ""):
    """Every parameter's gradient equals eager's. ``scale``: how much larger than a mean loss's the gradients are
    (a summed loss): float32 summation order then shifts them by as much more in absolute terms. ``tol``: other
    tolerances (a GPU's kernels); ``what`` prefixes the message. The absolute tolerance also grows with the
    largest of eager's gradients in the tensor: float32 sums of terms that large cancel to elements carrying their
    rounding (gradients of 60 differ by 3e-6 where the summation order differs, as threads split work under load)."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name]
        if r.grad is None:
            assert p.grad is None, f"{what}{name}: got a gradient, eager has none"
            continue
        assert p.grad is not None, f"{what}{name}: no gradient, eager has one"
        magnitude = max(1.0, r.grad.detach().abs().max().item())
        each = tol or dict(rtol=TOL["rtol"], atol=TOL["atol"] * scale * magnitude)
        torch.testing.assert_close(p.grad, r.grad, **each, msg=lambda m: f"{what}gradient of {name} differs: {m}")


def assert_step_matches_eager(pipe, model, ref, loss_fn, *args, target, what: str = "", **kwargs):
    """One ``forward_backward`` of ``pipe`` on ``(args, kwargs)`` and ``target``: its loss and every gradient equal
    eager's ``loss_fn(ref(*args, **kwargs), target)`` on the whole batch."""
    loss = pipe.forward_backward(*args, target=target, **kwargs)
    ref_loss = loss_fn(ref(*args, **kwargs), target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"{what}loss: {m}")
    assert_grads_equal(model, ref, what=what)


def assert_matches_seeded_reference(spec, ref, x, y, m, loss, seed):
    """Reference for models with BatchNorm and dropout: the same graph, with the same per-node seeds (the
    pipeline's dropout ``seed``), run eagerly on one device over the same microbatches (gradient accumulation, no
    recompute); loss, gradients and buffers must match."""
    from rpcompile.runtime import rng
    from rpcompile.passes.graph.trace import trace

    ref_gm = trace(ref, (x,))
    assert rng.seed_random_nodes(ref_gm) >= 1
    rng.context.iteration, rng.context.device, rng.context.seed = 0, torch.device("cpu"), seed
    ref_loss = 0.0
    for j, ((xs,), (ys,)) in enumerate(zip(split_microbatches((x,), m), split_microbatches((y,), m))):
        rng.context.microbatch = j
        part = spec.loss_fn(ref_gm(xs), ys) * (xs.shape[0] / x.shape[0])
        part.backward()
        ref_loss += part.detach()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_equal(spec.model, ref)
    ref_buffers = dict(ref.named_buffers())
    for name, buf in spec.model.named_buffers():
        torch.testing.assert_close(buf, ref_buffers[name], msg=lambda msg: f"buffer {name}: {msg}")


def eager_step(ref, loss_fn, x, y, microbatches):
    """Eager reference: gradient accumulation over the same microbatches, weighted to the batch mean."""
    total = x.shape[0]
    loss = 0.0
    for (xs,), (ys,) in zip(split_microbatches((x,), microbatches), split_microbatches((y,), microbatches)):
        part = loss_fn(ref(xs), ys) * (xs.shape[0] / total)
        part.backward()
        loss += part.detach()
    return loss


def make(name, k, m, batch_size=10, **options):
    """Compile a built-in model; analytic ``cpu`` costs (fine stages) by default so the plan (and so the test) is the same on
    every run — pass ``spec=None`` to plan from measured costs."""
    options.setdefault("spec", FINE_CPU)
    spec = load_model(name, batch_size=batch_size)  # 10 splits evenly into 1, 2, 5 and unevenly into 3
    ref = copy.deepcopy(spec.model)
    x, = spec.example_inputs
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu"] * k, microbatches=m,
                             time_limit_s=2.0, **options)
    return spec, ref, pipe, x, spec.example_target


_SLOW = pytest.mark.slow


# gpt-demo's ops (LayerNorm, GELU, learned positions, tied head) run at one shape of the pipeline by default (its
# tied embedding also in test_tied_embedding_gets_the_summed_gradient); the stage counts and microbatch splits
# (one, even, uneven, single-microbatch) are llama-demo's
@pytest.mark.parametrize("name,k,m", [
    *[("llama-demo", k, m) for k, m in [(1, 1), (2, 3), (3, 5), (3, 1)]],
    pytest.param("gpt-demo", 1, 1, marks=_SLOW), ("gpt-demo", 2, 3), pytest.param("gpt-demo", 3, 5, marks=_SLOW),
    pytest.param("gpt-demo", 3, 1, marks=_SLOW)])
def test_decoders_match_eager(name, k, m):
    spec, ref, pipe, x, y = make(name, k, m)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = spec.loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(spec.model, ref)


# every strategy on analytic costs; measured costs change which cuts a plan makes, not how it runs: the ILP's by
# default, the others' behind slow
@pytest.mark.parametrize("strategy,costs", [
    *[(s, "cpu") for s in ("ilp", "dp", "roundpipe", "uniform")], ("ilp", None),
    *[pytest.param(s, None, marks=_SLOW) for s in ("dp", "roundpipe", "uniform")]],
    ids=lambda v: {"cpu": "analytic", None: "measured"}.get(v, v))
def test_every_strategy_matches_eager(strategy, costs):
    spec, ref, pipe, x, y = make("llama-demo", 2, 3, strategy=strategy, spec=costs)
    assert pipe.plan.strategy == strategy
    pipe.forward_backward(x, target=y)
    spec.loss_fn(ref(x), y).backward()
    assert_grads_equal(spec.model, ref)


def test_tied_embedding_gets_the_summed_gradient():
    spec, ref, pipe, x, y = make("gpt-demo", 2, 3)
    users = [s.name for s in pipe.plan.stages if "wte.weight" in s.params and s.kind != "forward"]
    assert len(users) >= 2  # the fused stage (lm_head) and the first backward stage (embedding)
    pipe.forward_backward(x, target=y)
    spec.loss_fn(ref(x), y).backward()
    torch.testing.assert_close(spec.model.wte.weight.grad, ref.wte.weight.grad, **TOL)


def test_gradients_accumulate_across_calls_and_adamw_matches():
    spec, ref, pipe, x, y = make("llama-demo", 2, 3)
    # eps keeps Adam from amplifying 1e-9 summation-order differences of near-zero gradients into lr-sized steps
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    pipe.forward_backward(x, target=y)
    pipe.forward_backward(x, target=y)  # accumulates, as eager does
    spec.loss_fn(ref(x), y).backward()
    spec.loss_fn(ref(x), y).backward()
    assert_grads_equal(spec.model, ref)
    for step in range(3):
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        pipe.forward_backward(x, target=y)
        spec.loss_fn(ref(x), y).backward()
    opt.step(), ref_opt.step()
    ref_params = dict(ref.named_parameters())
    for name, p in spec.model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=1e-5, atol=2e-6,
                                   msg=lambda msg: f"weight {name} after AdamW differs: {msg}")


def test_frozen_parameters_get_no_gradient():
    spec = load_model("llama-demo")
    for name, p in spec.model.named_parameters():
        if not name.startswith("layers.3"):
            p.requires_grad_(False)  # LoRA-style: only the last block trains
    ref = copy.deepcopy(spec.model)
    x, = spec.example_inputs
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, spec=FINE_CPU, devices=["cpu", "cpu"], microbatches=3, time_limit_s=2.0)
    pipe.forward_backward(x, target=spec.example_target)
    spec.loss_fn(ref(x), spec.example_target).backward()
    assert_grads_equal(spec.model, ref)
    assert all(p.grad is None for n, p in spec.model.named_parameters() if not n.startswith("layers.3"))


@pytest.mark.parametrize("k,m", [(2, 3), (3, 2)])
def test_cnn_batchnorm_and_dropout(k, m):
    """BatchNorm statistics update once per microbatch (never in recompute); dropout masks replay in recompute.
    Reference: the same graph with the same per-node seeds run eagerly on one device, no recompute."""

    spec = load_model("cnn-demo")
    ref = copy.deepcopy(spec.model)
    x, = spec.example_inputs
    y = spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, spec=FINE_CPU, devices=["cpu"] * k, microbatches=m, time_limit_s=2.0)
    assert any(s.kind == "backward" for s in pipe.plan.stages)
    loss = pipe.forward_backward(x, target=y)

    assert_matches_seeded_reference(spec, ref, x, y, m, loss, pipe.dropout_seed)
    assert int(spec.model.blocks[0].bn.num_batches_tracked) == m


def bert(**dropout):
    """A two-layer HF BERT (masked LM) with the given dropout probabilities, seeded."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=16, **dropout)
    return transformers.BertForMaskedLM(cfg)


def mlm_loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


@pytest.mark.hf
@pytest.mark.parametrize("allow_save", [False, True])
def test_attention_dropout_replays_its_mask_in_recompute(allow_save):
    """An HF model in train mode with attention dropout calls ``scaled_dot_product_attention(..., dropout_p=0.3)``:
    the kernel draws its own mask, so it is seeded like every other random node (the same mask in the forward
    stage and in the backward stage's recompute) and its segment is recomputed, not saved. Reference: the same
    graph with the same per-node seeds run eagerly on one device over the same microbatches."""
    from rpcompile.core.randomness import is_random
    from rpcompile.passes.graph.trace import trace

    model = bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.3).train()
    ref = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (6, 12)), torch.randint(0, 64, (6, 12))
    loss_fn = mlm_loss
    attention = [n for n in trace(copy.deepcopy(model), (x,)).graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(attention) == 2 and all(is_random(None, n) for n in attention)  # type: ignore[arg-type]
    pipe = rpcompile.compile(model, (x,), loss_fn=loss_fn, spec=FINE_CPU, devices=["cpu"] * 2, microbatches=3,
                             time_limit_s=2.0, head_chunks=1, allow_save=allow_save)
    backward = [s for s in pipe.plan.stages if s.kind == "backward"]
    assert any(n.startswith("scaled_dot_product") for s in backward for n in (s.saved if allow_save else s.recomputed))
    loss = pipe.forward_backward(x, target=y)
    spec = dataclasses.make_dataclass("Spec", ["model", "loss_fn"])(model, loss_fn)
    assert_matches_seeded_reference(spec, ref, x, y, 3, loss, pipe.dropout_seed)


@pytest.mark.hf
def test_torch_manual_seed_chooses_the_dropout_masks():
    """As in eager PyTorch, ``torch.manual_seed`` before the pipeline is made chooses its dropout masks: the same
    seed draws the same masks (the same loss, bit for bit), another seed others."""
    x, y = torch.randint(0, 64, (6, 12)), torch.randint(0, 64, (6, 12))
    losses, plan = [], None
    for seed in (1, 2, 1):
        model = bert(hidden_dropout_prob=0.3).train()
        torch.manual_seed(seed)
        pipe = rpcompile.compile(model, (x,), loss_fn=mlm_loss, spec=FINE_CPU, devices=["cpu"] * 2,
                                 microbatches=3, time_limit_s=2.0, head_chunks=1, plan=plan)
        plan = pipe.plan  # one plan for the three (planning draws nothing)
        assert pipe.dropout_seed == seed
        losses.append(float(pipe.forward_backward(x, target=y)))
    assert losses[0] == losses[2] and abs(losses[0] - losses[1]) > 1e-4


@pytest.mark.hf
def test_eval_mode_after_a_train_mode_trace_switches_the_dropouts_off():
    """Evaluating during training: a model traced in train mode (hidden and attention dropout) and then put in
    eval mode runs as eager eval does — ``forward`` and ``forward_backward`` without dropout, eager's outputs,
    loss and gradients — and in train mode again draws its masks again."""
    model = bert(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.3).train()
    ref = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (6, 12)), torch.randint(0, 64, (6, 12))
    pipe = rpcompile.compile(model, (x,), loss_fn=mlm_loss, spec=FINE_CPU, devices=["cpu"] * 2, microbatches=3,
                             time_limit_s=2.0, head_chunks=1)
    trained = pipe.forward_backward(x, target=y)
    model.eval(), ref.eval()
    with torch.no_grad():
        logits = ref(x).logits
        torch.testing.assert_close(pipe.forward(x).logits, logits, **TOL)
    model.zero_grad(set_to_none=True)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = mlm_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)
    model.train()  # dropout draws again
    with torch.no_grad():
        assert (pipe.forward(x).logits - logits).abs().max() > 0.1
    assert float(pipe.forward_backward(x, target=y)) != float(loss) != float(trained)


@pytest.mark.hf
@pytest.mark.parametrize("parity", [0, 1], ids=["saved-even", "saved-odd"])
def test_eval_mode_after_a_train_mode_trace_runs_fx_batch_norm_and_dropout_modules_as_eager_eval(parity):
    """An fx graph calls the stages' copies of the model's modules: after ``model.eval()`` they follow it (batch
    norm on its running statistics, dropout off) — also in saved segments captured in train mode, which are
    captured again for eval (a capture bakes the modes in) — so training, ``forward`` and ``evaluate`` equal eager
    eval; ``model.train()`` brings train mode back."""
    spec, ref, pipe, x, y = _saving_pipeline("cnn-demo", parity)
    pipe.forward_backward(x, target=y)  # train mode: the saved segments are captured
    model = spec.model
    model.zero_grad(set_to_none=True)
    ref.load_state_dict(model.state_dict())  # the running statistics the train-mode step left
    model.eval()
    ref.eval()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    loss = pipe.forward_backward(x, target=y)
    ref_loss = spec.loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)
    with torch.no_grad():
        torch.testing.assert_close(pipe.forward(x), ref(x), **TOL)
        torch.testing.assert_close(pipe.evaluate(x, target=y), spec.loss_fn(ref(x), y), **TOL)
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())  # eval mode changes no statistic
    model.train()
    pipe.forward_backward(x, target=y)
    assert int(model.blocks[0].bn.num_batches_tracked) == 2 * pipe.microbatches


def test_a_mode_the_trace_cannot_run_is_refused_in_one_line_and_a_model_without_dropout_trains_in_any():
    """Traced in eval mode (as models load), the dropouts are not in the graph: train mode is refused, naming the
    fix. A mixed mode is refused likewise. A model with no dropout (0.0) and no batch norm runs in either mode."""
    x, y = torch.randint(0, 64, (6, 12)), torch.randint(0, 64, (6, 12))
    options = dict(loss_fn=mlm_loss, spec=FINE_CPU, devices=["cpu"] * 2, microbatches=3, time_limit_s=2.0,
                   head_chunks=1)
    pipe = rpcompile.compile(bert(hidden_dropout_prob=0.1).eval(), (x,), **options)
    pipe.model.train()
    with pytest.raises(rpcompile.ModelChangedError, match=r"^the model changed after compile: it is in train mode "
                       r"but was traced in eval mode, and its dropouts \(dropout\) were traced as in eval mode; call "
                       r"model.train\(\) before rpcompile.compile \(models load in eval mode\)$"):
        pipe.forward_backward(x, target=y)
    pipe.model.eval()
    pipe.model.bert.encoder.train()
    with pytest.raises(rpcompile.ModelChangedError, match=r"^the model changed after compile: module bert.encoder is "
                       r"in train mode .* call model.train\(\) before rpcompile.compile"):
        pipe.forward(x)
    model = bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).eval()
    ref = copy.deepcopy(model).train()
    pipe = rpcompile.compile(model, (x,), **options)
    model.train()
    loss = pipe.forward_backward(x, target=y)
    ref_loss = mlm_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)


def test_forward_for_evaluation():
    spec, ref, pipe, x, y = make("llama-demo", 2, 3)
    torch.testing.assert_close(pipe.forward(x), ref(x), **TOL)


def test_schedule_is_literal_round_robin():
    lists = round_robin(["forward", "forward", "fused", "backward", "backward"], devices=2, microbatches=2)
    assert format_schedule(lists) == (
        "dev0: 0W 0F0 0F1 2W 2F0 2F1 2G 4W 4F0 4F1 4G\n"
        "dev1: 1W 1F0 1F1 3W 3F0 3F1 3G"
    )
    assert parse_action("3F1") == Action(3, "F", 1) and str(parse_action("3G")) == "3G"
    with pytest.raises(ValueError, match=r"not an action: '3X' \(examples: 3W, 3F0, 3G\)"):
        parse_action("3X")


def test_timeline_order_per_device():
    spec, ref, pipe, x, y = make("llama-demo", 2, 2, strategy="uniform")
    pipe.forward_backward(x, target=y)
    by_device = {}
    for ev in sorted(pipe.timeline, key=lambda e: e.start):
        by_device.setdefault(ev.device, []).append(ev.action)
    events = {e.action: e for e in pipe.timeline}
    for d, actions in enumerate(pipe.schedule):
        assert sorted(by_device[d]) == sorted(str(a) for a in actions)
        # compute and gradient copies run in list order; a stage's weights go up once the device has started
        # the stage before it (prefetch) and are in before its first microbatch
        assert [a for a in by_device[d] if "W" not in a] == [str(a) for a in actions if a.kind != "W"]
        current = None
        for a in actions:
            if a.kind == "W":
                assert events[f"{a.stage}F0"].start >= events[str(a)].end
                if current is not None:
                    assert events[str(a)].start >= events[f"{current}F0"].start
            elif a.kind == "F":
                current = a.stage
    # stage k+1 never starts a microbatch before stage k finished it
    ends = {(e.action): e.end for e in pipe.timeline}
    for e in pipe.timeline:
        if "F" in e.action and not e.action.startswith("0"):
            k, j = e.action.split("F")
            assert e.start >= ends[f"{int(k) - 1}F{j}"]


def test_codegen_is_readable(tmp_path):
    spec, ref, pipe, x, y = make("llama-demo", 2, 3)
    files = pipe.codegen(tmp_path)
    assert [f.name for f in files] == [f"stage_{k:02d}_{s.name}.py" for k, s in enumerate(pipe.plan.stages)]
    text = files[0].read_text()
    assert text.startswith("# rpcompile stage F0 (forward), position 0 of")
    assert "# source modules: (root), embed" in text and "def forward(self" in text
    compile(text, str(files[0]), "exec")  # valid Python


def test_loaded_plan_for_other_device_count_is_refused(tmp_path):
    spec, ref, pipe, x, y = make("llama-demo", 2, 3)
    path = pipe.plan.save(tmp_path / "plan.json")
    with pytest.raises(rpcompile.RPCompileError, match=r"the plan is for 2 devices but 3 were given; re-plan"):
        rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu"] * 3, plan=path)
    again = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu"] * 2, plan=path)
    assert again.plan == pipe.plan


# HF llama in a pipeline by default in test_batches.py (test_an_hf_model_compiles_as_the_readme_says and the
# padded-batch tests: the same model and check); here behind slow
@pytest.mark.hf
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=_SLOW), "gpt2"])
def test_huggingface_models_match_eager(arch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))
    y = torch.randint(0, 64, (4, 8))

    def loss_fn(out, target):
        return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())

    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "use_cache": False}, loss_fn=loss_fn, spec=FINE_CPU,
                             devices=["cpu", "cpu"], microbatches=2, time_limit_s=2.0)
    loss = pipe.forward_backward(input_ids=ids, use_cache=False, target=y)
    ref_loss = loss_fn(ref(input_ids=ids, use_cache=False), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)


def _normwise(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# fp16 against eager fp16 by default in test_hf_precision.py's test_fp16_with_a_grad_scaler_trains_an_hf_model_like_
# eager_fp16 (with a scaler: the fp16 path), and on this model in test_fp16_loss_scaling_skips_overflowing_steps
@pytest.mark.parametrize("precision,dtype,tol", [("bf16", torch.bfloat16, 3e-2),
                                                 pytest.param("fp16", torch.float16, 3e-2, marks=_SLOW)])
def test_mixed_precision_matches_low_precision_eager(precision, dtype, tol):
    """Compute in bf16/fp16 with fp32 masters: loss and gradients agree with eager run in that precision (to
    its rounding), and the masters and their gradients stay fp32."""
    spec = load_model("llama-demo", batch_size=6)
    ref = copy.deepcopy(spec.model).to(dtype)
    x, y = spec.example_inputs[0], spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, spec=FINE_CPU, devices=["cpu", "cpu"], microbatches=3,
                             precision=precision, time_limit_s=2.0)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = spec.loss_fn(ref(x), y)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-3 * abs(ref_loss.item())
    ref_params = dict(ref.named_parameters())
    for name, p in spec.model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        assert _normwise(p.grad, ref_params[name].grad) < tol, name


def test_fp16_loss_scaling_skips_overflowing_steps():
    spec = load_model("llama-demo", batch_size=6)
    x, y = spec.example_inputs[0], spec.example_target
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1)  # 2**40 overflows fp16 at once
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, spec=FINE_CPU, devices=["cpu", "cpu"], microbatches=3,
                             precision="fp16", scaler=scaler, time_limit_s=2.0)
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in spec.model.named_parameters()}
    pipe.forward_backward(x, target=y)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**39  # lowered
    assert all(torch.equal(p, before[n]) for n, p in spec.model.named_parameters())  # step skipped
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    pipe.scaler = scaler
    pipe.forward_backward(x, target=y)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9  # a good step raises it (growth_interval=1)
    assert any(not torch.equal(p, before[n]) for n, p in spec.model.named_parameters())


# ---------------------------------------------------------------------------------------------- saved segments
def _saving_pipeline(name, parity, k=2, m=3, devices=None, adjust=None):
    """A hand-made plan over ``name`` (a built-in model, or a ``ModelSpec`` of one's own): two forward stages, two
    backward stages cut elsewhere, and every other segment (outside the fused stage) saved, so each backward stage
    mixes saved and recomputed segments. On ``devices`` (default ``["cpu"] * k``)."""
    from rpcompile.passes.lower import plan_from_ranges
    from rpcompile.passes.rewrite.coarsen import coarsen_pass, segments_of
    from rpcompile.passes.graph.util import compute_nodes
    from rpcompile.compiler import pipeline
    from rpcompile.training.options import TrainOptions
    from rpcompile.planner.planning import prepare
    from rpcompile.planner.plan_options import make_hardware
    from rpcompile.runtime.devices import make_devices

    spec = load_model(name, batch_size=10) if isinstance(name, str) else name
    if adjust is not None:
        adjust(spec)
    ref = copy.deepcopy(spec.model)
    x, = spec.example_inputs
    # analytic costs: the segments must not depend on how busy the machine is (measured costs on a loaded machine
    # once collapsed the coarsening to two segments, and the cuts below assume several)
    gm, m = prepare(spec.model, (x,), PlanOptions(gpus=k, microbatches=m, progress=False, spec=FINE_CPU))
    segs = segments_of(coarsen_pass(gm, max_segments=len(compute_nodes(gm))))  # finest: one per module group
    assert len(segs) >= 6, [s.name for s in segs]
    n, c = len(segs), [s.start for s in segs]
    saved = [node for i, s in enumerate(segs[:n - 2]) if i % 2 == parity for node in s.nodes]
    plan = plan_from_ranges(gm, forward=[(0, c[n // 2]), (c[n // 2], c[n - 2])], fused=(c[n - 2], segs[-1].stop),
                            backward=[(c[n // 3], c[n - 2]), (0, c[n // 3])], hardware=make_hardware(k, "cpu"),
                            microbatches=m, saved=saved)
    assert plan.saved
    rpcompile.verify_plan(plan, gm)
    pipe = pipeline(spec.model, gm, plan, make_devices(devices or ["cpu"] * k, None), spec.loss_fn,
                    TrainOptions(precision="fp32"))
    return spec, ref, pipe, x, spec.example_target


def _assert_saved_not_recomputed(pipe):
    """Saved nodes run once per microbatch in their forward stage (fw graph) and never in a backward stage: the
    backward stage graph holds a bw call in their place."""
    assert pipe.program.saved
    for prog in pipe.program.stages:
        if prog.kind == "backward" and prog.stage.saved:
            calls = [nd for nd in prog.gm.graph.nodes if getattr(nd.target, "__name__", "") == "backward_call"]
            assert calls, prog.name
            names = {nd.name for nd in prog.gm.graph.nodes if nd.op != "placeholder" and nd not in calls
                     and not (nd.args and nd.args[0] in calls)}  # the bw call and its getitems
            assert not names & set(prog.stage.saved), (prog.name, sorted(names & set(prog.stage.saved)))
    for seg in pipe.program.saved:
        assert seg.calls == {"forward": pipe.microbatches, "backward": pipe.microbatches, "recomputed": 0}, seg.name


def test_a_pipeline_compiled_again_runs_the_same_captures_unless_a_module_setting_differs():
    """runtime/segments/saved.py shares captures between segments of the same code, module settings and signature: a
    second pipeline over the same model and plan runs the first one's (no trace) and still equals eager; a model whose
    embedding differs only in a setting (``padding_idx``: same graph code, no gradient for that row) captures
    afresh and equals its own eager. (Segments with a dropout never share: each has its own seed token.)"""
    def padded(spec):
        for mod in spec.model.modules():
            if isinstance(mod, torch.nn.Embedding):
                mod.padding_idx = int(spec.example_inputs[0][0, 0])  # a token of the batch

    captures = []
    for adjust in (None, None, padded):
        spec, ref, pipe, x, y = _saving_pipeline("llama-demo", 0, adjust=adjust)
        loss = pipe.forward_backward(x, target=y)
        ref_loss = spec.loss_fn(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        assert_grads_equal(spec.model, ref)
        captures.append({id(a) for seg in pipe.program.saved for a in seg.captures.values()})
    assert captures[0] and captures[1] == captures[0]
    assert captures[2] != captures[0]


def test_the_segments_of_identical_layers_run_one_capture_unless_a_module_setting_differs():
    """runtime/segments/saved.py keys a capture by what it computes, not by names: the saved segments of llama-demo's
    identical layers (same code but for ``layers.1.`` / ``layers.2.``, parameters in the same places) run one
    capture, and the pipeline equals eager. With one layer's norm given another ``eps``, that layer's segment
    captures its own and the pipeline equals its own eager (a shared capture would run the other ``eps``)."""
    def layer_free(seg):  # a segment's parameter names without the layer index
        return tuple(re.sub(r"^layers\.\d+\.", "layers.*.", a) for attrs in seg.params for a in attrs)

    odd = None
    for eps in (None, 0.25):
        spec = load_model("llama-demo", batch_size=10)
        if eps is not None:
            odd = spec.model.layers[2].mlp_norm
            odd.eps = eps
        ref = copy.deepcopy(spec.model)
        x, y = spec.example_inputs[0], spec.example_target
        pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu"] * 2, microbatches=3,
                                 spec=FINE_CPU, time_limit_s=2.0)
        assert_step_matches_eager(pipe, spec.model, ref, spec.loss_fn, x, target=y, what=f"eps {eps}: ")
        groups: dict[tuple, list] = {}
        for seg in pipe.program.saved:
            groups.setdefault(layer_free(seg), []).append(seg)
        alike = [g for g in groups.values() if len(g) > 1]
        assert alike, [s.params for s in pipe.program.saved]  # at least two layers' segments are saved
        for group in alike:
            runs = [{id(a) for a in seg.captures.values()} for seg in group]
            assert all(runs), [seg.name for seg in group]
            odd_ones = [r for seg, r in zip(group, runs) if odd is not None and
                        any(a.startswith("layers.2.mlp_norm.") for attrs in seg.params for a in attrs)]
            plain = [r for r in runs if r not in odd_ones]
            assert all(r == plain[0] for r in plain), [seg.name for seg in group]
            assert not any(r & plain[0] for r in odd_ones), "a layer with another eps ran the others' capture"


def test_a_pipeline_compiled_again_runs_the_first_s_symbolic_captures_at_another_batch_size():
    """A symbolic capture is shared by signature kind, not size: a second pipeline over the same model and plan
    whose first batch has other sizes (7 rows of 20 tokens: microbatches of 3, 2 and 2 rows) runs the first
    pipeline's captures, where their guards hold, and equals eager."""
    captures = []
    for b, t in ((10, 32), (7, 20)):
        spec, ref, pipe, x, y = _saving_pipeline("llama-demo", 1)  # every segment symbolic (test below)
        x, y = x[:b, :t], y[:b, :t]
        loss = pipe.forward_backward(x, target=y)
        torch.testing.assert_close(loss, eager_step(ref, spec.loss_fn, x, y, pipe.microbatches), **TOL)
        assert_grads_equal(spec.model, ref)
        captures.append({id(a) for seg in pipe.program.saved for a in seg.captures.values()})
    assert captures[0] and captures[1] == captures[0]


@pytest.mark.parametrize("name", ["llama-demo", "gpt-demo"])
def test_saved_segments_ship_activations_once_and_no_weights(name):
    """What a forward stage sends to host memory for its saved segments: no view of a parameter (the backward
    stage replays it on its own copy: a linear layer's transposed weight would otherwise cross the link twice per
    microbatch) and no tensor twice (views of one activation share its copy); gradients still equal eager's."""
    spec, ref, pipe, x, y = _saving_pipeline(name, 0)
    params = {p.untyped_storage().data_ptr(): n for n, p in spec.model.named_parameters()}
    shipped: list[torch.Tensor] = []
    for device in pipe.devices:
        def spy(value, *, priority, _orig=device.offload):
            shipped.extend(value.tensors)
            return _orig(value, priority=priority)
        device.offload = spy
    loss = pipe.forward_backward(x, target=y)
    torch.testing.assert_close(loss, eager_step(ref, spec.loss_fn, x, y, pipe.microbatches), **TOL)
    assert_grads_equal(spec.model, ref)
    storages = [t.untyped_storage().data_ptr() for t in shipped]
    assert shipped and not [params[p] for p in storages if p in params]
    assert len(set(storages)) == len(storages)


def test_saved_segments_match_eager():
    spec, ref, pipe, x, y = _saving_pipeline("llama-demo", 1)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = eager_step(ref, spec.loss_fn, x, y, pipe.microbatches)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_equal(spec.model, ref)
    _assert_saved_not_recomputed(pipe)
    torch.testing.assert_close(pipe.forward(x), ref(x), **TOL)  # evaluation runs saved segments plainly


def test_one_symbolic_capture_runs_every_new_shape_and_a_rejected_one_is_captured_on_its_second_sighting():
    """Saved segments are captured with symbolic batch and sequence sizes: a later batch of another size and
    length runs the same capture (no capture, nothing recomputed). A shape its guards reject (a one-row
    microbatch: sizes 1 are specialised) is recomputed the first time and captured when it comes again. Every
    way equals eager."""
    spec, ref, pipe, x, y = _saving_pipeline("llama-demo", 1)
    pipe.forward_backward(x, target=y)
    segs = pipe.program.saved
    captured = {s.name: s.n_captures for s in segs}
    assert all(s.symbolic for s in segs), [s.name for s in segs if not s.symbolic]

    def step(xb, yb, m, what):
        for p in (*spec.model.parameters(), *ref.parameters()):
            p.grad = None
        before = {s.name: s.calls["recomputed"] for s in segs}
        loss = pipe.forward_backward(xb, target=yb)
        torch.testing.assert_close(loss, eager_step(ref, spec.loss_fn, xb, yb, m), **TOL)
        assert_grads_equal(spec.model, ref, what=f"{what}: ")
        return {s.name: s.calls["recomputed"] - before[s.name] for s in segs}

    for b, t in ((7, 20), (6, 9), (10, 32)):  # 7 rows in 3 microbatches: 3, 2, 2
        recomputed = step(x[:b, :t], y[:b, :t], 3, f"{b}x{t}")
        assert set(recomputed.values()) == {0} and {s.name: s.n_captures for s in segs} == captured, (b, t)
    assert step(x[:1, :12], y[:1, :12], 1, "1x12 first") == {s.name: 1 for s in segs}
    assert step(x[:1, :12], y[:1, :12], 1, "1x12 again") == {s.name: 0 for s in segs}
    assert {s.name: s.n_captures for s in segs} == {k: v + 1 for k, v in captured.items()}
    assert step(x[:2, :7], y[:2, :7], 2, "2x7: rows of one") == {s.name: 0 for s in segs}  # the one-row capture
    assert {s.name: s.n_captures for s in segs} == {k: v + 1 for k, v in captured.items()}


def test_a_symbolic_capture_evaluates_its_sizes_once_per_batch_shape(monkeypatch):
    """A symbolic capture's layouts and view sizes are sympy expressions: they are evaluated once per batch shape
    and kept (:class:`~rpcompile.runtime.segments.capture.Bound`), at most ``BOUND_CACHE`` shapes a capture, the
    oldest dropped. Every call equals eager."""
    from rpcompile.runtime.segments import capture, symbolic

    evaluated = []
    monkeypatch.setattr(capture, "concrete_layout", lambda *a: evaluated.append(1) or symbolic.concrete_layout(*a))
    monkeypatch.setattr(capture, "BOUND_CACHE", 2)

    spec, ref, pipe, x, y = _saving_pipeline("llama-demo", 1)
    pipe.forward_backward(x, target=y)  # captured (or found: captures are shared across pipelines)
    ref.zero_grad(set_to_none=True)
    captures = {id(a): a for seg in pipe.program.saved for a in seg.captures.values()}
    assert captures
    for a in captures.values():
        a._bound.clear()  # what earlier pipelines of the same model evaluated
    counts = []
    for b, t in ((7, 20), (7, 20), (6, 9), (10, 32), (7, 20)):  # microbatches of 3, 2, 2 / 2, 2, 2 / 4, 3, 3 rows
        for p in (*spec.model.parameters(), *ref.parameters()):
            p.grad = None
        evaluated.clear()
        loss = pipe.forward_backward(x[:b, :t], target=y[:b, :t])
        torch.testing.assert_close(loss, eager_step(ref, spec.loss_fn, x[:b, :t], y[:b, :t], 3), **TOL)
        assert_grads_equal(spec.model, ref, what=f"{b}x{t}: ")
        counts.append(len(evaluated))
    assert counts[0] > 0 and counts[1] == 0, counts  # the same shape again: nothing evaluated
    assert counts[4] > 0, counts  # (7, 20) was dropped: two shapes came after it
    assert all(len(a._bound) <= 2 for a in captures.values())


@pytest.mark.parametrize("parity", [0, 1])
def test_saved_segments_batchnorm_and_dropout(parity):
    """Saved BatchNorm updates the statistics once per microbatch (fw graph's buffer outputs); a saved dropout's
    mask is a saved tensor drawn with the recompute path's seed."""

    spec, ref, pipe, x, y = _saving_pipeline("cnn-demo", parity)
    m = pipe.microbatches
    loss = pipe.forward_backward(x, target=y)
    assert_matches_seeded_reference(spec, ref, x, y, m, loss, pipe.dropout_seed)
    assert int(spec.model.blocks[0].bn.num_batches_tracked) == m
    _assert_saved_not_recomputed(pipe)


def test_a_summed_loss_sums_the_microbatches_and_a_loss_per_sample_is_refused():
    import torch.nn.functional as F

    from rpcompile.models.registry import load_model

    class TokenCE(torch.nn.Module):
        """A token cross-entropy with torch's ``reduction`` convention."""

        def __init__(self, reduction):
            super().__init__()
            self.reduction = reduction

        def forward(self, out, t):
            return F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction=self.reduction)

    spec = load_model("llama-demo", batch_size=6)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    summed = TokenCE("sum")
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=summed, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=1.0)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = summed(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-4)
    assert_grads_equal(spec.model, ref, scale=y.numel())  # a sum over the batch's tokens, not their mean
    per_token = rpcompile.compile(spec.model, (x,), loss_fn=TokenCE("none"), devices=["cpu", "cpu"], microbatches=3,
                                  spec=FINE_CPU, time_limit_s=1.0)
    with pytest.raises(rpcompile.LossFnError, match=r"^loss_fn returned \(\d+,\), not a scalar: reduce it over the "
                                                   r"batch \(reduction='mean' or 'sum'\)$"):
        per_token.forward_backward(x, target=y)
