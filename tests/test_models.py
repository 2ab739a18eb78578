"""Built-in models and the MODEL-argument resolver (rpcompile/models/)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

from rpcompile.core.errors import ConfigError, ModelSpecError
from rpcompile.models.gpt import GPT, GPTConfig
from rpcompile.models.llama import Attention, Llama, LlamaConfig
from rpcompile.models.registry import ModelSpec, list_models, load_model

DEMOS = ["llama-demo", "llama-32x64", "gpt-demo", "cnn-demo"]
OTHER_DEMOS = ["moe-demo"]  # tested in test_moe.py (sequence length 16)
# published parameter counts (tied embeddings counted once)
META_PRESETS = {"llama-1.7b": 1.72e9, "llama-8b": 8.03e9, "llama-32b": 32.76e9, "qwen3-30b-a3b": 30.53e9,
                "qwen3-235b-a22b": 235.09e9}


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_list_models_names_every_builtin() -> None:
    assert list_models() == sorted([*DEMOS, *OTHER_DEMOS, *META_PRESETS])


@pytest.mark.parametrize("name", DEMOS)
def test_demo_forward_backward(name: str) -> None:
    spec = load_model(name)
    out = spec.model(*spec.example_inputs)
    (x,) = spec.example_inputs
    if name == "cnn-demo":
        assert x.shape == (8, 3, 16, 16) and out.shape == (8, 10)
        assert spec.example_target.shape == (8,)
    else:
        assert x.shape == (4, 32) and x.dtype == torch.int64
        assert out.shape == (4, 32, 256) and spec.example_target.shape == (4, 32)
    loss = spec.loss(out)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert math.isclose(loss.item(), math.log(10 if name == "cnn-demo" else 256), rel_tol=0.25)  # ~uniform at init
    loss.backward()
    for pname, p in spec.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_llama_demo_learns() -> None:
    spec = load_model("llama-demo")
    losses = []
    for _ in range(5):  # plain SGD by hand: the first torch.optim optimizer costs ~2 s of imports
        spec.model.zero_grad()
        loss = spec.loss(spec.model(*spec.example_inputs))
        loss.backward()
        with torch.no_grad():
            for p in spec.model.parameters():
                p -= 0.1 * p.grad
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_gpt_lm_head_is_the_token_embedding() -> None:
    model = load_model("gpt-demo").model
    assert isinstance(model, GPT)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_llama_module_names_and_optional_tying() -> None:
    model = Llama(LlamaConfig(n_layers=2, qk_norm=True, tie_embeddings=True))
    modules = dict(model.named_modules())
    for name in ["embed", "layers.1.attn_norm", "layers.1.attn.q_proj", "layers.1.attn.k_norm", "layers.1.mlp_norm",
                 "layers.1.mlp.gate_proj", "layers.1.mlp.up_proj", "layers.1.mlp.down_proj", "norm", "lm_head"]:
        assert name in modules, name
    assert isinstance(modules["layers.0.attn"], Attention)
    assert model.lm_head.weight is model.embed.weight
    assert "rope_cos" not in model.state_dict()  # non-persistent buffers
    assert Llama(LlamaConfig(n_layers=1)).lm_head.weight is not Llama(LlamaConfig(n_layers=1)).embed.weight


def test_llama_attention_is_causal() -> None:
    spec = load_model("llama-demo")
    ids = spec.example_inputs[0]
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    with torch.no_grad():
        a, b = spec.model(ids), spec.model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


@pytest.mark.parametrize(
    "config",
    [lambda: LlamaConfig(n_heads=4, n_kv_heads=3), lambda: LlamaConfig(dim=66, n_heads=4),
     lambda: GPTConfig(dim=66, n_heads=4)],
)
def test_bad_configs_raise(config) -> None:
    with pytest.raises(ConfigError, match="must be a multiple"):
        config()


@pytest.mark.parametrize("name", sorted(META_PRESETS))
def test_meta_preset_builds_without_memory(name: str) -> None:
    spec = load_model(name)  # (materialised, the 235B preset alone would need ~470 GB: it could not get here)
    tensors = [*spec.model.parameters(), *spec.model.buffers(), *spec.example_inputs, spec.example_target]
    assert all(t.is_meta for t in tensors)
    assert spec.example_inputs[0].shape == (1, 4096)
    assert _n_params(spec.model) == pytest.approx(META_PRESETS[name], rel=0.03)


def test_meta_preset_forward_shape() -> None:
    spec = load_model("llama-1.7b", seq_len=256, batch_size=2)
    out = spec.model(*spec.example_inputs)
    assert out.is_meta and out.shape == (2, 256, 151_936)
    assert spec.model.lm_head.weight is spec.model.embed.weight  # Qwen3-1.7B ties its embeddings


def test_overrides() -> None:
    spec = load_model("llama-demo", batch_size=2, seq_len=8)
    assert spec.example_inputs[0].shape == (2, 8) and spec.model(*spec.example_inputs).shape == (2, 8, 256)
    on_meta = load_model("gpt-demo", device="meta")
    assert all(p.is_meta for p in on_meta.model.parameters())
    with pytest.raises(ModelSpecError, match="must be positive"):
        load_model("llama-demo", batch_size=0)


def test_seed_reproduces_weights_and_inputs_and_spares_global_rng() -> None:
    rng = torch.get_rng_state()
    a, b, c = load_model("llama-demo", seed=1), load_model("llama-demo", seed=1), load_model("llama-demo", seed=2)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    assert not torch.equal(a.example_inputs[0], c.example_inputs[0])
    for (name, pa), pb, pc in zip(a.model.named_parameters(), b.model.parameters(), c.model.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed.weight, c.model.embed.weight)


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_factory_file_tuple_and_spec(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import torch
        from rpcompile.models.registry import ModelSpec

        def pair():
            return torch.nn.Linear(3, 2), torch.ones(4, 3)

        def triple():
            return torch.nn.Linear(3, 2), (torch.ones(4, 3),), lambda out, target: out.sum()

        def spec():
            return ModelSpec(torch.nn.Linear(3, 2), (torch.ones(4, 3),), description="mine")
    """)
    pair = load_model(f"{path}:pair")
    assert isinstance(pair, ModelSpec) and pair.example_inputs[0].shape == (4, 3) and pair.loss_fn is None
    triple = load_model(f"{path}:triple")
    assert triple.loss(triple.model(*triple.example_inputs)).ndim == 0
    assert load_model(f"{path}:spec").description == "mine"
    assert load_model(f"{path}:spec", device="meta").model.weight.is_meta


def test_unknown_name_lists_builtins() -> None:
    names = ", ".join(list_models())
    with pytest.raises(ModelSpecError, match=rf"^unknown model 'nope'; built-in models: {names}; or give a model file"):
        load_model("nope")


@pytest.mark.parametrize(
    ("body", "spec_suffix", "message"),
    [
        ("x = 1\n", ":make", r"my_model.py has no callable 'make'; define def make\(\): \.\.\. there"),
        ("def make():\n    return 42\n", ":make", r"returned int; expected a ModelSpec, \(model, example_inputs\)"),
        ("raise ImportError('no torch')\n", ":make", r"importing .*my_model.py failed: ImportError: no torch"),
        ("x = 1\n", "", r"names no factory; write path/to/file.py:factory"),
    ],
)
def test_bad_model_files(tmp_path: Path, body: str, spec_suffix: str, message: str) -> None:
    path = _write(tmp_path, body)
    with pytest.raises(ModelSpecError, match=message):
        load_model(f"{path}{spec_suffix}")


def test_missing_model_file() -> None:
    with pytest.raises(ModelSpecError, match=r"'no/such/file.py' is not a Python file; built-in models: cnn-demo"):
        load_model("no/such/file.py:make")
