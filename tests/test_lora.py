"""PEFT LoRA end to end: ``rpcompile.compile(get_peft_model(hf_model, LoraConfig(...)), ...)`` trains with eager
PEFT's loss, adapter gradients and AdamW weights; only adapter gradients come home; the frozen base is stored once,
in the compute precision; ``merge_and_unload()`` works afterwards; LoRA dropout replays its masks in recompute."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

import rpcompile
from rpcompile.cli import main
from rpcompile.core.errors import ConfigError
from rpcompile.core.units import fmt_bytes
from rpcompile.models.registry import load_model
from rpcompile.tools.lora import apply_lora, lora_host_memory

from _hf import VOCAB, hf_model, token_loss
from test_batches import _padded
from test_runtime import FINE_CPU, TOL, assert_grads_equal

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.hf

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# eps keeps Adam from amplifying 1e-9 summation-order differences of near-zero gradients into lr-sized steps
ADAMW = dict(lr=1e-3, eps=1e-6)


def lora(kind: str, *, dropout: float = 0.0, task_type: str | None = "CAUSAL_LM") -> torch.nn.Module:
    """A two-layer HF model of ``kind`` with rank-4 adapters on the attention projections. ``init_lora_weights=False``
    starts B random (PEFT's default starts it at zero, which makes every A gradient of the first step zero)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS,
                             init_lora_weights=False, task_type=task_type)
    return peft.get_peft_model(hf_model(kind), config)


def adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def frozen(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if not p.requires_grad}


# qwen3 behind slow: its attention (q/k norms) and projections, where the adapters sit, are qwen3-moe's too
@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen3", marks=pytest.mark.slow), "mixtral", "qwen3-moe"])
def test_lora_trains_like_eager_peft_on_padded_batches(kind):
    """HF batch dicts of different sizes and lengths, the model's own loss (``loss_fn=None``): every step's loss
    and adapter gradients equal eager PEFT's on the whole batch, the weights after AdamW steps too, the frozen base
    gets no gradient and does not move, and the merged models are the same."""
    model = lora(kind)
    ref = copy.deepcopy(model)
    ids, mask, labels = _padded(6, 16, seed=1)
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
                             loss_fn=None, devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU, time_limit_s=1.0,
                             allow_save=False)  # recompute only: capturing saved segments costs ~15 s of CPU here
    planned = {p for s in pipe.plan.stages for p in s.params}
    assert set(adapters(model)) <= planned, "the plan names the user's parameters"
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    base = {n: p.detach().clone() for n, p in frozen(model).items()}
    for step, (ids, mask, labels) in enumerate([(ids, mask, labels), _padded(5, 12, seed=2), _padded(2, 16, seed=3)]):
        loss = pipe.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"step {step} loss: {m}")
        assert_grads_equal(model, ref, what=f"step {step}: ")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in adapters(model).items():
        torch.testing.assert_close(p, ref_params[name], **TOL, msg=lambda m: f"{name} after AdamW: {m}")
    for name, p in frozen(model).items():
        assert torch.equal(p, base[name]), f"frozen {name} moved"
    merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
    ref_state = ref_merged.state_dict()
    for name, w in merged.state_dict().items():
        # W + scaling * B @ A: the adapters agree to TOL, their product to a few times that
        torch.testing.assert_close(w, ref_state[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"merged {name}: {m}")


def test_a_peft_model_without_task_type_compiles_as_the_issue_writes_it():
    """``PeftModel.forward(*args, **kwargs)`` (no ``task_type``): traced with the KV cache off (through the
    ``**kwargs`` it passes on) and symbolic batch and sequence sizes — a later batch of another shape runs as is.
    The plan may save activations (the default): their AOT captures, with a frozen base, give eager's gradients."""
    model = lora("llama", task_type=None)
    assert type(model).__name__ == "PeftModel"
    ref = copy.deepcopy(model)
    ids, y = torch.randint(0, VOCAB, (6, 8)), torch.randint(0, VOCAB, (6, 8))
    pipe = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU,
                             time_limit_s=1.0)
    for x, t in [(ids, y), (ids[:4, :5], y[:4, :5])]:
        loss = pipe.forward_backward(x, target=t)
        ref_loss = token_loss(ref(x), t)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        assert_grads_equal(model, ref)
    assert "forward" not in vars(model), "the trace left PeftModel's own forward in place"


def test_only_adapter_gradients_come_home():
    """The plan downloads gradients of the adapters only, and the host adds exactly those into ``.grad``: one fp32
    gradient read and one ``.grad`` written per adapter parameter (the first microbatch's; nothing for the base)."""
    model = lora("llama")
    ids, y = torch.randint(0, VOCAB, (6, 8)), torch.randint(0, VOCAB, (6, 8))
    pipe = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], microbatches=1,
                             spec=FINE_CPU, time_limit_s=1.0)
    n_adapter = sum(p.numel() for p in adapters(model).values())
    assert sum(s.grad_bytes for s in pipe.plan.stages) == 4 * n_adapter
    pipe.forward_backward(ids, target=y)
    assert pipe.host_traffic["gradients"] == 2 * 4 * n_adapter
    assert all(p.grad is None for p in frozen(model).values())
    assert all(p.grad is not None for p in adapters(model).values())


def test_the_frozen_base_is_stored_once_in_bf16_and_merges():
    """``precision="bf16"``: every frozen parameter's ``.data`` becomes the bf16 copy the devices upload (2 bytes a
    parameter on the host; the token-embedding table looked up on the host too), the adapters keep fp32 masters;
    ``merge_and_unload()`` then gives a plain HF model whose projections are the bf16 base plus
    ``scaling * B @ A`` and which predicts what the adapted model does. ``frozen_masters=True`` keeps the fp32 base."""
    model = lora("llama")
    ids = torch.randint(0, VOCAB, (6, 8))
    rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU, precision="bf16",
                      time_limit_s=1.0)
    base = frozen(model)
    assert {p.dtype for p in base.values()} == {torch.bfloat16}
    assert sum(p.untyped_storage().nbytes() for p in base.values()) == 2 * sum(p.numel() for p in base.values())
    assert {p.dtype for p in adapters(model).values()} == {torch.float32}
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    w, a, b = q.base_layer.weight.detach().clone(), q.lora_A["default"].weight, q.lora_B["default"].weight
    expected = (w.float() + q.scaling["default"] * (b @ a)).detach()
    with torch.no_grad():
        adapted = model(ids).logits.float()
    merged = model.merge_and_unload()
    assert type(merged).__name__ == "LlamaForCausalLM" and not any("lora" in n for n, _ in merged.named_modules())
    weight = merged.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype == torch.bfloat16
    torch.testing.assert_close(weight.float(), expected, rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits.float(), adapted, rtol=0.05, atol=0.05)
    kept = lora("llama")
    rpcompile.compile(kept, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU, precision="bf16",
                      frozen_masters=True, time_limit_s=1.0)
    assert {p.dtype for p in frozen(kept).values()} == {torch.float32}


def test_bf16_training_of_an_hf_lora_model_matches_eager_peft_in_bf16():
    """The PEFT-wrapped HF model in bf16 (traced in bf16, so HF's fp32 islands and their casts back are kept): loss
    and every adapter gradient (fp32 masters) as eager PEFT with its weights in bf16, to bf16's rounding
    (test_runtime's mixed-precision standard: loss to 1e-3 relative, gradients normwise within 3e-2)."""
    model = lora("llama")
    ref = copy.deepcopy(model).to(torch.bfloat16)
    ids, y = torch.randint(0, VOCAB, (6, 8)), torch.randint(0, VOCAB, (6, 8))
    pipe = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU,
                             precision="bf16", time_limit_s=1.0)
    loss = pipe.forward_backward(ids, target=y)
    ref_loss = token_loss(ref(ids), y)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-3 * abs(ref_loss.item())
    ref_adapters = adapters(ref)
    assert adapters(model)
    for name, p in adapters(model).items():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        g, r = p.grad, ref_adapters[name].grad.float()
        assert float((g - r).norm() / r.norm()) < 3e-2, name
    assert all(p.grad is None for p in frozen(model).values())


def test_lora_dropout_trains_and_recomputation_replays_its_masks():
    """``lora_dropout>0`` in training mode: masks are seeded per (iteration, node, microbatch), so the backward
    stages, which recompute the adapters (``allow_save=False``), draw the masks of the forward. Reference: the same
    graph with the same seeds run eagerly over the microbatches. Without dropout the loss differs (the masks are
    really applied)."""
    from rpcompile.core.batch import split_microbatches
    from rpcompile.passes.graph.trace import trace
    from rpcompile.runtime import rng

    model = lora("llama", dropout=0.5, task_type=None)
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    ids, y = torch.randint(0, VOCAB, (6, 8)), torch.randint(0, VOCAB, (6, 8))
    pipe = rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=1.0, allow_save=False)
    assert any(s.kind == "backward" for s in pipe.plan.stages)
    loss = pipe.forward_backward(ids, target=y)
    ref_gm = trace(ref, (ids,))
    assert rng.seed_random_nodes(ref_gm) >= 8  # one dropout per adapter
    rng.context.iteration, rng.context.device, rng.context.seed = 0, torch.device("cpu"), pipe.dropout_seed
    ref_loss = torch.zeros(())
    for j, ((xs,), (ys,)) in enumerate(zip(split_microbatches((ids,), 3), split_microbatches((y,), 3))):
        rng.context.microbatch = j
        part = token_loss(ref_gm(xs, use_cache=False), ys) * (xs.shape[0] / ids.shape[0])
        part.backward()
        ref_loss += part.detach()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_equal(model, ref)
    assert not torch.allclose(loss, token_loss(plain.eval()(ids), y))


def test_the_example_script_runs(tmp_path, capsys, monkeypatch):
    """``examples/lora_finetune.py``: a small Llama from a config, PEFT, compile, a few padded steps, merge, save.
    Run as a script (``__main__``, its own ``sys.argv``) in this process: a fresh interpreter would spend a third of
    the test importing torch, transformers and PEFT again."""
    script = ROOT / "examples" / "lora_finetune.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--steps", "2", "--layers", "2", "--hidden", "32",
                                      "--out", str(tmp_path)])
    with torch.random.fork_rng(devices=[]):  # the script seeds the global generator
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "planned " in out and "step 1: loss " in out and re.search(r"^held-out loss: \d+\.\d{4}$", out, re.M), out
    assert f"merged model saved to {tmp_path}" in out, out
    assert (tmp_path / "config.json").exists()


def test_lora_host_memory_counts_the_frozen_base_once_in_the_compute_precision():
    """2 bytes a frozen parameter in bf16 (4 in fp32); 4 + 4 + 8 + 2 bytes a trainable one (master, gradient, AdamW
    moments, bf16 upload copy), 16 in fp32 (the master is uploaded)."""
    model = lora("llama")
    n_frozen = sum(p.numel() for p in frozen(model).values())
    n_adapter = sum(p.numel() for p in adapters(model).values())
    bf16, fp32 = lora_host_memory(model, "bf16"), lora_host_memory(model, "fp32")
    assert (bf16.frozen_params, bf16.trainable_params) == (n_frozen, n_adapter)
    assert (bf16.frozen_bytes, bf16.trainable_bytes) == (2 * n_frozen, 18 * n_adapter)
    assert (fp32.frozen_bytes, fp32.trainable_bytes) == (4 * n_frozen, 16 * n_adapter)


def test_apply_lora_adds_adapters_on_the_attention_projections_of_a_meta_model():
    spec = load_model("moe-demo", device="meta")
    model = apply_lora(spec.model, rank=4)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 4 * 2  # A and B, q/k/v/o, 2 layers
    assert all(".attn." in n and ".lora_" in n for n in trainable)
    assert all(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(ConfigError, match=r"no nn.Linear named q_proj, k_proj, v_proj, o_proj in ConvNet"):
        apply_lora(load_model("cnn-demo").model)


def test_planning_adapters_equal_pefts_in_parameters_outputs_gradients_and_flops():
    """``apply_lora`` on an rpcompile model: adapters laid out as PEFT's (names, shapes, frozen set), so PEFT's state
    dict loads as is; then the same logits, the same adapter gradients and the same forward + backward FLOPs as
    ``get_peft_model``'s — and it traces with torch.fx, where PeftModel needs torch.export."""
    from torch.utils.flop_counter import FlopCounterMode

    from rpcompile.passes.graph.trace import TRACE_META_KEY, trace
    from rpcompile.tools.lora import LoraModel

    spec = load_model("moe-demo")
    ref = apply_lora(copy.deepcopy(spec.model), rank=4, peft=True)
    model = apply_lora(spec.model, rank=4)
    assert isinstance(model, LoraModel) and type(ref).__name__ == "PeftModel"
    shapes = {n: (p.shape, p.requires_grad) for n, p in model.named_parameters()}
    assert shapes == {n: (p.shape, p.requires_grad) for n, p in ref.named_parameters()}
    assert sum(r for _, r in shapes.values()) == 2 * 4 * 2  # A and B, q/k/v/o, 2 layers
    torch.manual_seed(0)
    for p in adapters(ref).values():  # B starts at zero in both: make the adapters count
        torch.nn.init.normal_(p, std=0.1)
    model.load_state_dict(ref.state_dict())
    (ids,), y = spec.example_inputs, spec.example_target
    flops = []
    for m in (model, ref):
        with FlopCounterMode(display=False) as counter:
            spec.loss(m(ids), y).backward()
        flops.append(counter.get_total_flops())
    assert flops[0] == flops[1] > 0
    torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    assert_grads_equal(model, ref)
    assert trace(model, spec.example_inputs).meta[TRACE_META_KEY] == "fx"


def test_plan_lora_reports_host_memory_gpu_memory_and_tokens_per_s(capsys):
    """``rpcompile plan MODEL --lora R``: the plan downloads adapter gradients only (bf16: 2 bytes each) and the
    JSON and the text report the same host memory: :func:`lora_host_memory` and the plan's activations."""
    argv = ["plan", "moe-demo", "--gpus", "2", "--spec", "rtx4090", "--lora", "4", "--time-limit", "1"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = lora_host_memory(apply_lora(load_model("moe-demo", device="meta").model, rank=4), "bf16")
    acts = out["microbatches"] * sum(s["offload_bytes"] + s["download_bytes"] for s in out["stages"]
                                     if s["kind"] == "forward")
    assert acts > 0
    assert out["lora"] == {"rank": 4, **dataclasses.replace(expected, activation_bytes=acts).to_dict()}
    assert sum(s["grad_bytes"] for s in out["stages"]) == 2 * expected.trainable_params
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert (f"LoRA rank 4 on q_proj, k_proj, v_proj, o_proj: host memory {fmt_bytes(out['lora']['total_bytes'])} "
            "(predicted): ") in text
    assert re.search(r"GPU memory: largest stage [\d.]+ GiB of 20.12 GiB; iteration [\d.]+ s; [\d,]+ tokens/s", text)
    assert main(["plan", "moe-demo", "--gpus", "2", "--spec", "rtx4090", "--lora", "--max-seq-len"]) == 2
    assert "--max-seq-len does not plan LoRA yet" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_qwen3_235b_a22b_lora_on_8_rtx4090(capsys):
    """The published shape (benchmarks/RESULTS.md, LoRA at scale): plans within the solver's limit and fits."""
    assert main(["plan", "qwen3-235b-a22b", "--gpus", "8", "--spec", "rtx4090", "--lora", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 234e9 < out["lora"]["frozen_params"] < 236e9
    assert out["lora"]["frozen_bytes"] == 2 * out["lora"]["frozen_params"]


def test_a_frozen_host_embedding_table_is_stored_in_bf16_and_gives_the_same_step():
    """A frozen token-embedding table looked up on the host is kept in bf16 too (its rows were cast to bf16 for the
    devices anyway): loss and gradients equal those of the same pipeline keeping fp32 masters of the frozen base."""
    runs = []
    for frozen_masters in (False, True):
        spec = load_model("llama-demo", batch_size=6)
        for name, p in spec.model.named_parameters():
            p.requires_grad_(not name.startswith(("embed", "layers.0.")))
        (x,), y = spec.example_inputs, spec.example_target
        pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], spec=FINE_CPU,
                                 precision="bf16", time_limit_s=1.0, frozen_masters=frozen_masters,
                                 allow_save=False)  # recompute only: no captures (seconds each)
        assert [h.weight for h in pipe.executor.program.host] == ["embed.weight"]  # looked up on the host
        table = spec.model.embed.weight
        assert table.dtype == (torch.float32 if frozen_masters else torch.bfloat16)
        runs.append((pipe.forward_backward(x, target=y), {n: p.grad for n, p in spec.model.named_parameters()}))
    (loss, grads), (ref_loss, ref_grads) = runs
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, g in grads.items():
        assert (g is None) == (ref_grads[name] is None), name
        if g is not None:
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
