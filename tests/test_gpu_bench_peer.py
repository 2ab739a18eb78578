"""benchmarks/gpu.py --peer roundpipe, on the CPU: the arguments, the refusals, the causal-mask shim and the HF twin.

The peer itself (PyPI ``roundpipe`` 0.1.1) needs CUDA; what runs here is everything around it.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu  # noqa: E402  (benchmarks/ is scripts, not a package)
import roundpipe_peer  # noqa: E402

from rpcompile.models.llama import Llama, LlamaConfig  # noqa: E402
from rpcompile.models.registry import load_model  # noqa: E402


def _fake_mask(config, inputs_embeds, attention_mask, cache=None, position_ids=None):
    """transformers 5's create_causal_mask, as far as its signature goes."""
    return {"config": config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "cache": cache,
            "position_ids": position_ids}


def test_the_peer_flag_takes_roundpipe_only(capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--peer", "megatron"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("argv", [["--peer", "roundpipe"], ["--sections", "capped", "--peer", "roundpipe"],
                                  ["--smoke", "--peer", "roundpipe"]])
def test_without_cuda_the_peer_is_refused_in_one_line(argv, capsys, tmp_path):
    out = tmp_path / "gpu.json"
    with pytest.raises(SystemExit) as e:
        gpu.main([*argv, "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA" in err and "roundpipe" in err
    assert not out.exists()  # refused before any model was built


def test_a_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = roundpipe_peer.importlib.util.find_spec
    monkeypatch.setattr(roundpipe_peer.importlib.util, "find_spec",
                        lambda name: None if name in ("roundpipe", "beartype") else real(name))
    with pytest.raises(roundpipe_peer.PeerUnavailable, match=r"not installed: roundpipe==0.1.1, beartype"):
        roundpipe_peer.check_roundpipe()


def test_a_peer_that_cannot_start_is_an_error_row_not_a_crash(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = roundpipe_peer.importlib.util.find_spec
    monkeypatch.setattr(roundpipe_peer.importlib.util, "find_spec",
                        lambda name: None if name == "roundpipe" else real(name))
    row = roundpipe_peer.roundpipe_row(load_model("llama-demo"), device="cuda:0", microbatches=2, cap_gib=8.0,
                                       steps=1, label="tiny")
    assert row["system"] == "roundpipe" and row["step_s"] is None
    assert row["error"].startswith("PeerUnavailable: --peer roundpipe: not installed: roundpipe==0.1.1")


def test_the_shim_maps_roundpipes_names_onto_transformers_5():
    shim = roundpipe_peer.causal_mask_shim(_fake_mask)
    emb, pos = torch.zeros(1, 3, 4), torch.arange(3)[None]
    # the call roundpipe/models/llama.py (0.1.1) makes
    got = shim(config="cfg", input_embeds=emb, attention_mask=None, cache_position=torch.arange(3),
               past_key_values=None, position_ids=pos)
    assert got["inputs_embeds"] is emb and got["position_ids"] is pos and got["config"] == "cfg"
    assert got["cache"] is None  # past_key_values -> cache; cache_position (gone in transformers 5) dropped


def test_the_shim_keeps_what_needs_no_mapping():
    def old(config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None):
        return input_embeds

    assert roundpipe_peer.causal_mask_shim(old) is old  # a transformers that still takes input_embeds

    def open_kwargs(config, inputs_embeds, **kwargs):
        return inputs_embeds, kwargs

    emb = torch.ones(2)
    got, rest = roundpipe_peer.causal_mask_shim(open_kwargs)(config=None, input_embeds=emb, cache_position=3)
    assert got is emb and rest == {"cache_position": 3}  # **kwargs: nothing dropped
    shim = roundpipe_peer.causal_mask_shim(_fake_mask)
    assert shim(config=None, inputs_embeds=emb, attention_mask=None)["inputs_embeds"] is emb  # new names pass


def test_the_shim_goes_on_the_preset_module_once():
    module = types.SimpleNamespace(create_causal_mask=_fake_mask)
    assert roundpipe_peer.install_mask_shim(module)
    first = module.create_causal_mask
    assert first is not _fake_mask and roundpipe_peer.install_mask_shim(module)
    assert module.create_causal_mask is first  # not wrapped twice
    assert not roundpipe_peer.install_mask_shim(types.SimpleNamespace())


@pytest.mark.hf
def test_the_shim_against_the_installed_create_causal_mask():
    transformers = pytest.importorskip("transformers")
    # RoundPipe calls transformers' masking_utils, which transformers 4.x before 4.53 does not have
    create_causal_mask = pytest.importorskip(
        "transformers.masking_utils", reason=f"transformers {transformers.__version__} has no masking_utils (RoundPipe "
                                             "needs it)").create_causal_mask

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2)
    emb = torch.zeros(2, 5, 8)
    pos = torch.arange(5)[None]
    shim = roundpipe_peer.causal_mask_shim(create_causal_mask)
    got = shim(config=config, input_embeds=emb, attention_mask=torch.ones(2, 5, dtype=torch.long),
               cache_position=torch.arange(5), past_key_values=None, position_ids=pos)
    if "input_embeds" in roundpipe_peer.inspect.signature(create_causal_mask).parameters:
        return  # an older transformers: nothing to map
    ref = create_causal_mask(config=config, inputs_embeds=emb, attention_mask=torch.ones(2, 5, dtype=torch.long),
                             **({"cache": None} if "cache" in roundpipe_peer.inspect.signature(
                                 create_causal_mask).parameters else {"past_key_values": None}),
                             position_ids=pos)
    assert (got is None and ref is None) or torch.equal(got, ref)


@pytest.mark.hf
def test_the_hf_twin_computes_the_same_function():
    pytest.importorskip("transformers")
    spec = load_model("llama-demo")
    model = spec.model.eval()
    hf = roundpipe_peer.hf_twin(model, dtype=torch.float32)
    (x,), y = spec.example_inputs, spec.example_target
    with torch.no_grad():
        logits = model(x)
        out = hf(input_ids=x, labels=y, shift_labels=y)  # what the peer feeds RoundPipe: y is already shifted
    assert torch.equal(out.logits, logits)
    assert out.loss.item() == pytest.approx(spec.loss_fn(logits, y).item(), rel=1e-6)
    assert hf.model.embed_tokens.weight.data_ptr() != model.embed.weight.data_ptr()  # a copy, not shared


@pytest.mark.hf
def test_the_qwen3_twin_computes_the_same_function():
    """A Qwen3 shape (q/k norms, head_dim of its own, tied embeddings: the llama-1.7b preset's kind) gets an HF
    ``Qwen3ForCausalLM`` twin, the class RoundPipe's Qwen3 preset takes."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3")
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=48,
                              qk_norm=True, tie_embeddings=True, rope_theta=1e6)).eval()
    hf = roundpipe_peer.hf_twin(model, dtype=torch.float32)
    untied = roundpipe_peer.hf_twin(model, dtype=torch.float32, untie=True)  # what the peer runs
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight and not untied.config.tie_word_embeddings
    x = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        assert torch.equal(hf(input_ids=x).logits, model(x))
        assert torch.equal(untied(input_ids=x).logits, model(x))


def test_no_twin_for_a_model_without_a_llama_config():
    with pytest.raises(roundpipe_peer.PeerUnavailable, match="Llama/Qwen3-shaped"):
        roundpipe_peer.hf_twin(torch.nn.Linear(2, 2))


def test_rows_are_set_against_the_peer():
    rows = [{"system": "rpcompile", "tokens_per_s": 300.0}, {"system": "roundpipe", "tokens_per_s": 200.0}]
    gpu._versus_peer(rows)
    assert [r["vs_peer"] for r in rows] == [1.5, 1.0]
    failed = [{"system": "rpcompile", "tokens_per_s": 300.0}, {"system": "roundpipe", "tokens_per_s": None}]
    gpu._versus_peer(failed)
    assert [r["vs_peer"] for r in failed] == [None, None]
    header = {"device": "cpu", "date": "today"}
    md = gpu.print_tables([{"section": "capped", "model": "m", **r} for r in rows], header)
    assert "vs RoundPipe" in md.splitlines()[0] and "| 1.500× |" in md


def test_a_peer_whose_loss_is_not_ours_is_flagged():
    """The 2026-11-28 H100 run: RoundPipe's loss on the tied Qwen3-1.7B twin was 7.30 against rpcompile's 12.35."""
    rows = [{"system": "rpcompile", "tokens_per_s": 7776.0, "loss": 12.35},
            {"system": "roundpipe", "tokens_per_s": 5312.0, "loss": 7.30, "error": None}]
    gpu._versus_peer(rows)
    assert rows[1]["loss_vs_rpcompile"] == pytest.approx(7.30 / 12.35)
    assert rows[1]["error"] == ("loss 7.3 against rpcompile's 12.35 on the same weights and tokens: not the same "
                                "computation, so vs RoundPipe is not like for like")
    same = [{"system": "rpcompile", "tokens_per_s": 3261.0, "loss": 12.5989},
            {"system": "roundpipe", "tokens_per_s": 5560.0, "loss": 12.5992, "error": None}]
    gpu._versus_peer(same)
    assert same[1]["error"] is None and same[1]["loss_vs_rpcompile"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_roundpipe_trains_the_twin_on_the_gpu():
    """On a GPU with roundpipe installed: one real RoundPipe row on the tiny model (its loss is the model's)."""
    try:
        roundpipe_peer.check_roundpipe()
    except roundpipe_peer.PeerUnavailable as e:
        pytest.skip(str(e))
    spec = load_model("llama-demo")
    (x,), y = spec.example_inputs, spec.example_target
    with torch.no_grad():
        loss = spec.loss_fn(spec.model(x), y).item()
    row = roundpipe_peer.roundpipe_row(spec, device="cuda:0", microbatches=2, cap_gib=8.0, steps=1, label="tiny",
                                       timeout_s=300)
    assert row["error"] is None and row["step_s"] > 0 and row["stages"] >= 2, row
    assert row["loss"] == pytest.approx(loss, rel=0.05)  # bf16 weights against fp32
