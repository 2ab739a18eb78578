"""QLoRA end to end (issue 39): an HF model loaded with ``BitsAndBytesConfig(load_in_4bit=True, nf4)`` and wrapped
with PEFT LoRA compiles and trains with eager bitsandbytes' loss, adapter gradients and AdamW weights; its packed
base lives on the host once and goes up packed (≤ 0.6 bytes a weight, counted from storage and from the uploads);
the stages dequantize it on the device; a quantized model rpcompile cannot train is refused in one line."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch

from rpcompile.planner.plan_options import PlanOptions
import rpcompile
from rpcompile.core.errors import ConfigError
from rpcompile.passes.graph.quantized import quantized_layers

from _hf import VOCAB, hf_model, token_loss
from test_batches import _padded
from test_runtime import FINE_CPU, TOL, assert_grads_equal

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.hf

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAMW = dict(lr=1e-3, eps=1e-6)  # eps: as test_lora's (near-zero gradients)


def quantized(kind: str, tmp: Path, *, wide: bool = False, **bnb_options) -> torch.nn.Module:
    """A two-layer HF model of ``kind`` as a QLoRA user loads one: saved, then ``from_pretrained`` with a 4-bit
    NF4 ``BitsAndBytesConfig`` (double quantization, fp32 compute unless ``bnb_options`` say otherwise), on the CPU.
    ``wide``: a Llama of hidden size 256, where the 1 KiB map of the nested scales that each stage uploads once is
    as small a share of its weights as in any real model (on the 32-wide test models it is a third of a layer)."""
    if wide:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp / kind)
    else:
        hf_model(kind).save_pretrained(tmp / kind)
    options = {**dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                      bnb_4bit_compute_dtype=torch.float32), **bnb_options}
    config = transformers.BitsAndBytesConfig(**options)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(tmp / kind, quantization_config=config,
                                                                 device_map={"": "cpu"}, dtype=torch.float32)
    except RuntimeError as e:  # older transformers load bitsandbytes models on accelerators only (make test-compat)
        if "bitsandbytes" not in str(e):
            raise
        pytest.skip(f"transformers {transformers.__version__} loads no bitsandbytes 4-bit model on the CPU")


def qlora(kind: str, tmp: Path, *, wide: bool = False, **bnb_options) -> torch.nn.Module:
    """:func:`quantized` with rank-4 adapters on the attention projections (B random, as test_lora's), in train
    mode (bitsandbytes repacks a 4-bit weight for its CPU inference kernel on an eval-mode call)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False,
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(quantized(kind, tmp, wide=wide, **bnb_options), config).train()


def adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def packed_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.weight": m.weight for n, m in quantized_layers(model)}


def compile_qlora(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], **options) -> rpcompile.Pipeline:
    ids, mask, labels = batch
    return rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
                             loss_fn=None, devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU, time_limit_s=1.0,
                             **{"allow_save": False, **options})  # recompute only: captures cost ~15 s of CPU


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-moe"])
def test_qlora_trains_like_eager_bitsandbytes_on_padded_batches(kind, tmp_path):
    """Batch dicts of three shapes, the model's own loss: every step's loss and adapter gradients equal eager
    bitsandbytes + PEFT on the whole batch, the adapters after AdamW steps too; the packed base gets no gradient
    and does not move; ``merge_and_unload`` gives eager's merged model and the adapters save and load back."""
    model = qlora(kind, tmp_path)
    ref = copy.deepcopy(model)
    assert len(quantized_layers(model)) >= 8
    pipe = compile_qlora(model, _padded(6, 16, seed=1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAMW)
    base = {n: w.detach().clone() for n, w in packed_weights(model).items()}
    for step, (ids, mask, labels) in enumerate([_padded(6, 16, seed=1), _padded(5, 12, seed=2),
                                                 _padded(2, 16, seed=3)]):
        loss = pipe.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"step {step} loss: {m}")
        assert_grads_equal(model, ref, what=f"step {step}: ")
        pipe.step(opt)
        ref_opt.step()
        ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in adapters(model).items():
        torch.testing.assert_close(p, ref_params[name], **TOL, msg=lambda m: f"{name} after AdamW: {m}")
    for name, w in packed_weights(model).items():
        assert w.grad is None and torch.equal(w, base[name]), f"packed {name} moved"
    model.save_pretrained(tmp_path / "adapters")
    again = peft.PeftModel.from_pretrained(quantized(kind, tmp_path / "again"), tmp_path / "adapters")
    saved = dict(again.named_parameters())
    for name, p in adapters(model).items():
        assert torch.equal(saved[name], p.detach()), f"saved {name}"
    merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
    ids, mask, _ = _padded(3, 12, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask).logits,
                                   ref_merged(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)


def test_bf16_qlora_trains_like_eager_bitsandbytes_in_bf16(tmp_path):
    """The usual QLoRA setup: bitsandbytes computing in bf16 and the pipeline compiled with ``precision="bf16"``
    (adapters as fp32 masters): loss and every adapter gradient as eager bitsandbytes + PEFT with its weights in
    bf16, to bf16's rounding (test_lora's standard: loss to 1e-3 relative, gradients normwise within 3e-2)."""
    model = qlora("llama", tmp_path, bnb_4bit_compute_dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    for t in [*ref.parameters(), *ref.buffers()]:
        if t.is_floating_point():  # the adapters, norms and embeddings; the packed base is not floating
            t.data = t.data.to(torch.bfloat16)
    ids, mask, labels = _padded(6, 16, seed=1)
    pipe = compile_qlora(model, (ids, mask, labels), precision="bf16")
    loss = pipe.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-3 * abs(ref_loss.item())
    ref_params = dict(ref.named_parameters())
    for name, p in adapters(model).items():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        g, r = p.grad, ref_params[name].grad.float()
        assert float((g - r).norm() / r.norm()) < 3e-2, name


def test_the_packed_base_lives_on_the_host_once_and_goes_up_packed(tmp_path):
    """Host: the packed indices and every scale of the quantized layers, counted from their storages (each counted
    once: the nested map is shared), take at most 0.6 bytes a weight, and no floating copy of any quantized
    weight exists (the stores keep none; bitsandbytes' QuantState reads the same storages). Link: what the devices
    uploaded for the quantized layers, counted at the upload, is at most 0.6 bytes a weight, and equals the plan's
    weight bytes for those parameters (a plan without stays: each stage uploads what it reads, every iteration)."""
    model = qlora("llama", tmp_path, wide=True)
    pipe = compile_qlora(model, _padded(6, 16, seed=1), allow_stay=False)  # every stage uploads its weights
    layers = dict(quantized_layers(model))
    weights = sum(math.prod(m.weight.quant_state.shape) for m in layers.values())
    prefixes = tuple(f"{n}.weight" for n in layers)
    quant = {n: p for n, p in pipe.gm.named_parameters() if n.startswith(prefixes)}
    assert {n.rsplit(".", 1)[1] for n in quant} == {"weight", "weight_absmax", "weight_scales", "weight_code"}
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in quant.values()}
    host = sum(storages.values())
    assert host / weights <= 0.6, f"{host / weights:.3f} bytes a weight on the host"
    for m in layers.values():  # bitsandbytes' own state is those storages, not copies
        st = m.weight.quant_state
        assert st.absmax.untyped_storage().data_ptr() in storages
    assert all(e.front is None and not e.lazy for n, e in pipe.executor.weights.entries.items() if n in quant)
    inside = tuple(f"{n}." for n in layers)
    floating = [n for n, p in pipe.gm.named_parameters() if p.is_floating_point() and n.startswith(inside)]
    assert not floating, f"floating parameters of quantized layers: {floating}"

    sent: list[str] = []
    source = pipe.executor.weights.source
    pipe.executor.weights.source = lambda name: (sent.append(name), source(name))[1]  # type: ignore[method-assign]
    ids, mask, labels = _padded(6, 16, seed=2)
    pipe.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
    up = [n for n in sent if n in quant]
    up_bytes = sum(quant[n].numel() * quant[n].element_size() for n in up)
    up_weights = sum(math.prod(layers[n.rsplit(".", 1)[0]].weight.quant_state.shape) for n in up
                     if n.endswith(".weight"))
    assert up_weights >= weights  # every quantized layer went up at least once (forward and backward stages)
    assert up_bytes / up_weights <= 0.6, f"{up_bytes / up_weights:.3f} bytes a weight on the link"
    assert all(not quant[n].is_floating_point() for n in up)
    planned = sum(quant[n].numel() * quant[n].element_size() for s in pipe.plan.stages for n in s.params
                  if n in quant)
    assert up_bytes == planned
    assert sum(pipe.executor.stays.uploaded) == sum(s.weight_bytes for s in pipe.plan.stages)  # as planned


def test_the_stages_dequantize_on_the_device(tmp_path):
    """The generated stage code calls ``torch.ops.rpcompile.dequantize_nf4`` on the packed weight and its scales,
    then the linear layer on its result: once per quantized layer in the forward stages and again where a backward
    stage recomputes it."""
    model = qlora("llama", tmp_path)
    pipe = compile_qlora(model, _padded(6, 16, seed=1))
    pipe.codegen(tmp_path / "stages")
    code = "".join(p.read_text() for p in sorted((tmp_path / "stages").glob("*.py")))
    calls = re.findall(r"(\w+) = torch\.ops\.rpcompile\.dequantize_nf4\.default\((\w+)_weight, ", code)
    layers = {n.replace(".", "_").lower() for n, _ in quantized_layers(model)}
    assert {arg for _, arg in calls} >= layers
    for out, _ in calls:
        assert re.search(rf"torch\.ops\.aten\.linear\.default\(\w+, {out}\)", code), out


@pytest.mark.parametrize("allow_save", [False, True], ids=["recompute", "saved"])
def test_each_stage_dequantizes_once_not_per_microbatch(allow_save, tmp_path, monkeypatch):
    """A stage dequantizes its quantized layers once — in its prologue, when its weights are up — and holds them
    for its microbatches: a step of three microbatches calls the dequantize kernel once per quantized layer per
    stage (forward, fused and backward stages), not three times; its ``forward`` reads the held weight. Still
    equal to eager, with the backward stages recomputing or reading saved activations — which never include a
    dequantized weight (a saved segment reads the held one as an input: not shipped)."""
    from rpcompile.core import quant

    model = qlora("llama", tmp_path)
    ref = copy.deepcopy(model)
    batch = _padded(6, 16, seed=1)
    pipe = compile_qlora(model, batch, allow_save=allow_save)
    held = [len(prog.derived) for prog in pipe.program.stages]
    assert sum(held) > 0 and all(prog.prologue is not None for prog, n in zip(pipe.program.stages, held) if n)
    for prog in pipe.program.stages:  # every dequantization moved out of the per-microbatch code
        assert "dequantize_nf4" not in prog.gm.code and "_dequantized" in prog.gm.code or not prog.derived
    import bitsandbytes as bnb

    dequantized = [bnb.functional.dequantize_4bit(m.weight, m.weight.quant_state) for _, m in quantized_layers(model)]
    shipped: list[torch.Tensor] = []  # what forward stages send to the host for saved segments
    for device in pipe.executor.devices:
        monkeypatch.setattr(device, "offload", lambda v, priority=None, off=device.offload:
                            shipped.extend(v.tensors) or off(v, priority=priority))
    calls = []
    ops = quant._bitsandbytes_ops
    monkeypatch.setattr(quant, "_bitsandbytes_ops", lambda: calls.append(1) or ops())
    ids, mask, labels = batch
    loss = pipe.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
    assert len(calls) == sum(held), f"{len(calls)} dequantizations for {held} per stage and 3 microbatches"
    assert bool(shipped) == allow_save
    assert not [t.shape for t in shipped for w in dequantized if t.shape == w.shape and torch.equal(t, w.to(t.dtype))]
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)


def test_without_double_quantization(tmp_path):
    """``bnb_4bit_use_double_quant=False``: fp32 scales per block (0.5625 bytes a weight), same equality."""
    model = qlora("llama", tmp_path, bnb_4bit_use_double_quant=False)
    ref = copy.deepcopy(model)
    pipe = compile_qlora(model, _padded(6, 16, seed=1))
    ids, mask, labels = _padded(4, 12, seed=2)
    loss = pipe.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)
    names = {n.rsplit(".", 1)[1] for n, _ in pipe.gm.named_parameters() if "q_proj.base_layer" in n}
    assert names == {"weight", "weight_absmax"}


def test_the_model_is_left_as_it_was(tmp_path):
    """After compile the quantized layers have their own forward and parameters again (the scales were parameters
    for the trace only) and bitsandbytes computes the same outputs as before."""
    model = qlora("llama", tmp_path)
    ids, mask, labels = _padded(4, 12, seed=2)
    before = model(input_ids=ids, attention_mask=mask).logits.detach()
    names = [n for n, _ in model.named_parameters()]
    compile_qlora(model, _padded(6, 16, seed=1))
    assert [n for n, _ in model.named_parameters()] == names
    assert all("forward" not in vars(m) for _, m in quantized_layers(model))
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits.detach(), before, rtol=0, atol=0)


SUPPORTED = (r"; rpcompile trains a frozen bitsandbytes 4-bit NF4 base \(BitsAndBytesConfig\(load_in_4bit=True, "
             r"bnb_4bit_quant_type='nf4'\), double quantization or not\) under trainable adapters \(peft LoRA\)$")


def test_a_trainable_quantized_weight_is_refused(tmp_path):
    """A 4-bit weight stored in bf16 (``bnb_4bit_quant_storage``, as FSDP-QLoRA loads them) can be set to require
    grad; the packed weight cannot train: refused in one line naming what is supported."""
    model = quantized("llama", tmp_path, bnb_4bit_quant_storage=torch.bfloat16)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
    ids = torch.randint(0, VOCAB, (4, 8))
    with pytest.raises(ConfigError, match=r"^parameter model\.layers\.0\.self_attn\.q_proj\.weight is a 4-bit "
                       r"quantized weight that requires grad \(a quantized weight cannot train: freeze it, "
                       r"p\.requires_grad_\(False\), and train adapters on it\)" + SUPPORTED):
        rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"^parameter model\.layers\.0\.self_attn\.q_proj\.weight is stored as "
                       r"torch\.bfloat16 \(bnb_4bit_quant_storage other than uint8 is not supported\)" + SUPPORTED):
        rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU)


@pytest.mark.parametrize("options, what", [
    (dict(bnb_4bit_quant_type="fp4"), r"is bitsandbytes 4-bit FP4 \(only NF4 is supported\)"),
    (dict(load_in_4bit=False, load_in_8bit=True), r"is bitsandbytes Int8Params \(8-bit quantization is not "
                                                   r"supported\)"),
])
def test_an_unsupported_quantization_scheme_is_refused(tmp_path, options, what):
    model = quantized("llama", tmp_path, **options)
    ids = torch.randint(0, VOCAB, (4, 8))
    with pytest.raises(ConfigError, match=r"^parameter model\.layers\.0\.self_attn\.q_proj\.weight " + what
                       + SUPPORTED):
        rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], spec=FINE_CPU)


# ------------------------------------------------------------------------------------------ planning (plan --quantize)
def test_quantize_base_packs_the_frozen_layers_as_bitsandbytes_does():
    """``quantize_base`` on rpcompile's MoE with LoRA adapters: every frozen linear layer but the output head and
    every expert weight become packed NF4 parameters (bitsandbytes' values); the adapters and the head stay; the
    model computes what the same model with bitsandbytes' dequantized weights computes, bit for bit, and it still
    traces with torch.fx."""
    from rpcompile.tools.lora import apply_lora
    from rpcompile.models.registry import load_model
    from rpcompile.passes.graph.trace import TRACE_META_KEY, trace
    from rpcompile.tools.qlora import NF4Experts, NF4Linear, quantize_base

    spec = load_model("moe-demo")
    ref = apply_lora(copy.deepcopy(spec.model), rank=4)
    model = quantize_base(apply_lora(spec.model, rank=4))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (NF4Linear, NF4Experts))}
    assert len(layers) == 2 * (4 + 1 + 1)  # per layer: q/k/v/o, router, experts
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, p in ref.named_parameters() if p.requires_grad}
    assert all(not p.is_floating_point() for n, m in layers.items() for p in m.parameters())
    assert model.base_model.model.lm_head.weight.dtype == torch.float32
    refs = dict(ref.named_modules())
    with torch.no_grad():
        for name, m in layers.items():
            for attr, shape in ((("weight", m.shape),) if isinstance(m, NF4Linear) else
                                (("gate_up", m.gate_up_shape), ("down", m.down_shape))):
                st = bnb.functional.quantize_4bit(getattr(refs[name], attr).detach(), blocksize=64, quant_type="nf4",
                                                  compress_statistics=True)[1]
                assert torch.equal(getattr(m, attr + "_absmax"), st.absmax), name
                getattr(refs[name], attr).copy_(bnb.functional.dequantize_4bit(getattr(m, attr), st))
                assert tuple(getattr(refs[name], attr).shape) == shape
    (ids,) = spec.example_inputs
    torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    assert trace(model, spec.example_inputs).meta[TRACE_META_KEY] == "fx"


def test_quantize_base_refuses_what_it_cannot_do(capsys):
    from rpcompile.cli import main
    from rpcompile.models.registry import load_model
    from rpcompile.tools.qlora import quantize_base

    model = load_model("llama-demo", device="meta").model
    with pytest.raises(ConfigError, match=r"^quantization scheme 'int4' is not supported; supported: nf4 \(4-bit "
                       r"NormalFloat in blocks of 64 with double-quantized scales, bitsandbytes' layout: QLoRA\)$"):
        quantize_base(model, "int4")
    with pytest.raises(ConfigError, match=r"^Llama has no frozen linear layer to quantize: a quantized base is "
                       r"frozen \(plan --lora --quantize nf4: LoRA adapters on a 4-bit base\)$"):
        quantize_base(model)
    assert main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--quantize", "nf4"]) == 2
    assert "--quantize nf4 quantizes a frozen base: add --lora (QLoRA: adapters train, the 4-bit base does not)" in \
        capsys.readouterr().err


def test_plan_qlora_prices_the_packed_base(capsys):
    """``rpcompile plan MODEL --lora R --quantize nf4`` (analytic, meta device): the JSON and the text report the
    host memory with the base at its packed bytes, and every stage uploads and holds less than the bf16 LoRA
    plan's stages do: its weight bytes are the packed base's (≤ 0.6 bytes a quantized weight beside the
    adapters and the unquantized rest). The dequantizations are priced: each is a node with time on the GPU."""
    from rpcompile.cli import main

    outs = {}
    for quantize in ([], ["--quantize", "nf4"]):
        argv = ["plan", "moe-demo", "--gpus", "2", "--spec", "rtx4090", "--lora", "4", "--time-limit", "1", *quantize]
        assert main([*argv, "--json"]) == 0
        outs[bool(quantize)] = json.loads(capsys.readouterr().out)
    lora, qlora_ = outs[False]["lora"], outs[True]["lora"]
    assert qlora_["quantize"] == "nf4" and "quantize" not in lora and "quantized_params" not in lora
    assert qlora_["frozen_params"] == lora["frozen_params"] and qlora_["trainable_params"] == lora["trainable_params"]
    unquantized = qlora_["frozen_params"] - qlora_["quantized_params"]
    maps = 1024 * 2 * 6  # each quantized layer's 256-value map of its nested scales: 1 KiB (q/k/v/o, router, experts)
    packed = qlora_["frozen_bytes"] - 2 * unquantized - maps  # (on this 64-wide model the maps are a sixth of it)
    assert packed / qlora_["quantized_params"] <= 0.6
    weights = {k: sum(s["weight_bytes"] for s in out["stages"]) for k, out in outs.items()}
    assert weights[True] < 0.6 * weights[False]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert re.search(r"QLoRA \(nf4 base\) rank 4 on q_proj, k_proj, v_proj, o_proj: host memory [\d.]+ [KMG]iB "
                     r"\(predicted\): frozen base [\d.]+k parameters \([\d.]+k in 4-bit NF4\) × 0\.\d\d B", text), text


def test_the_dequantization_is_priced_on_the_gpu():
    """The analytic cost model prices each ``dequantize_nf4`` node as the memory-bound op it is: reading the
    packed weight and writing it in the compute precision (bf16 here), at the spec's memory bandwidth."""
    from rpcompile.core.specs import get_spec
    from rpcompile.tools.lora import apply_lora
    from rpcompile.models.registry import load_model
    from rpcompile.passes.cost.cost_model import COST_KEY
    from rpcompile.planner.planning import prepare
    from rpcompile.tools.qlora import quantize_base

    spec = load_model("llama-demo", device="meta")
    model = quantize_base(apply_lora(spec.model, rank=4))
    gm, _ = prepare(model, spec.example_inputs, PlanOptions(gpus=2, spec="rtx4090", precision="bf16", head_chunks=1),
                    loss_fn=spec.loss_fn, example_target=spec.example_target)
    nodes = [n for n in gm.graph.nodes if "dequantize_nf4" in str(n.target)]
    assert nodes
    gpu = get_spec("rtx4090")
    for n in nodes:
        cost = n.meta[COST_KEY]
        out = math.prod(n.args[4]) * 2  # bf16
        assert cost.fwd_time_s >= out / gpu.memory_bandwidth, n.name


def test_the_plan_holds_the_dequantized_weights_and_dequantizes_once_per_stage():
    """The partition problem of a QLoRA model counts each segment's dequantized weights (2 bytes a weight in bf16)
    as memory its stages hold, beside the packed weights it uploads, and not as activations (autograd keeps the
    held tensor, nothing per microbatch), and prices the dequantization once per stage: its time is spread over
    the microbatches, in forward and backward time, none in the recompute. Every stage's predicted memory is the memory without them
    plus its segments' dequantized bytes."""
    import dataclasses

    from rpcompile.core.specs import get_spec
    from rpcompile.models.registry import load_model
    from rpcompile.passes.cost.cost_model import COST_KEY
    from rpcompile.passes.formulate import partition_problem
    from rpcompile.passes.rewrite.coarsen import segments_of
    from rpcompile.passes.solver.partition import solve
    from rpcompile.passes.solver.timing import stage_costs
    from rpcompile.planner.plan_options import make_hardware
    from rpcompile.planner.planning import prepare
    from rpcompile.tools.lora import apply_lora
    from rpcompile.tools.qlora import quantize_base

    spec = load_model("llama-demo", device="meta")
    model = quantize_base(apply_lora(spec.model, rank=4))
    gm, m = prepare(model, spec.example_inputs, PlanOptions(gpus=2, spec="rtx4090", precision="bf16", head_chunks=1),
                    loss_fn=spec.loss_fn, example_target=spec.example_target)
    deq = {n.name: n for n in gm.graph.nodes if "dequantize_nf4" in str(n.target)}
    assert deq and m > 1
    pb = partition_problem(gm, hardware=make_hardware(2, "rtx4090"), microbatches=m, precision="bf16")
    assert sum(pb.derived_bytes) == sum(math.prod(n.args[4]) * 2 for n in deq.values())
    dispatch = get_spec("rtx4090").dispatch_s
    for i, seg in enumerate(segments_of(gm)):
        mine = [deq[n] for n in seg.nodes if n in deq]
        assert pb.derived_bytes[i] == sum(math.prod(n.args[4]) * 2 for n in mine), seg.name
        once = sum(n.meta[COST_KEY].fwd_time_s for n in mine)  # one microbatch's, as the cost model has it
        assert pb.fwd_s[i] == pytest.approx(max(seg.fwd_s - once + once / m, len(seg.nodes) * dispatch)), seg.name
        assert pb.rec_s[i] == pytest.approx(max(seg.fwd_s - once, len(seg.nodes) * dispatch)), seg.name
        assert pb.bwd_s[i] >= once / m
        kept = sum(n.meta[COST_KEY].act_bytes for n in mine)  # a linear layer keeps its weight: the held one
        assert kept <= pb.derived_bytes[i] and (not mine or kept > 0), seg.name
        if i < pb.n - 1:  # (the last segment adds the loss's bytes)
            assert pb.act_bytes[i] == seg.act_bytes - kept, f"{seg.name}: the held weights are no activations"
    result = solve(pb, "dp", time_limit_s=5)
    assert result.feasible
    without = dataclasses.replace(pb, derived_bytes=())
    for c, bare in zip(stage_costs(pb, result.plan), stage_costs(without, result.plan)):
        assert c.memory_bytes == bare.memory_bytes + sum(pb.derived_bytes[c.start:c.stop]), (c.kind, c.start)
    assert any(pb.derived_bytes[c.start:c.stop] for c in stage_costs(pb, result.plan))
