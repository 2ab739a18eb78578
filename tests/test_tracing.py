"""Tracing (passes/graph/trace.py): eager equivalence, original parameter names, shared storage, clear failures."""

from __future__ import annotations

import copy
import time
from collections import Counter
from operator import attrgetter

import pytest
import torch
from torch import fx, nn

from rpcompile.core.errors import TraceError
from rpcompile.models.llama import Attention
from rpcompile.models.registry import load_model
from rpcompile.passes.cost.cost import cost_pass
from rpcompile.passes.cost.measured import MeasuredCostModel
from rpcompile.passes.graph.portable import portable_pass
from rpcompile.passes.graph.shape import shape_pass
from rpcompile.passes.graph.trace import TRACE_META_KEY, trace
from rpcompile.passes.graph.util import module_path


def assert_same_state(gm: fx.GraphModule, model: nn.Module) -> None:
    """gm holds exactly the model's parameters and buffers: original FQNs, the very same tensor objects."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    gm_params, gm_buffers = dict(gm.named_parameters()), dict(gm.named_buffers())
    assert set(gm_params) == set(params)
    # older torch.export versions lift a tensor constant of forward into a buffer of its own (`lifted_tensor_0`)
    gm_buffers = {n: b for n, b in gm_buffers.items() if "lifted_tensor_" not in n}
    assert set(gm_buffers) <= set(buffers)
    for name, p in gm_params.items():
        assert p is params[name], f"parameter {name} is a copy"
    for name, b in gm_buffers.items():
        assert b is buffers[name] and b.data_ptr() == buffers[name].data_ptr(), f"buffer {name} is a copy"
    for node in gm.graph.nodes:  # export may also get_attr the subgraph module of a higher-order op: skip those
        if (node.op == "get_attr" and isinstance(attrgetter(node.target)(gm), torch.Tensor)
                and "lifted_tensor_" not in node.target):
            assert node.target in params or node.target in buffers, f"get_attr {node.target} is not an original FQN"


def assert_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# --- built-in models: the fx path ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-demo", "gpt-demo", "cnn-demo"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_builtin_models_trace_with_fx(name: str, mode: str) -> None:
    spec = load_model(name)
    model = spec.model.train(mode == "train")
    gm = trace(model, spec.example_inputs)
    assert gm.meta[TRACE_META_KEY] == "fx"
    assert_same_state(gm, model)
    torch.manual_seed(0)  # dropout in train mode draws the same numbers in the same order
    expected = model(*spec.example_inputs)
    torch.manual_seed(0)
    assert_equal(gm(*spec.example_inputs), expected)


def test_tied_embedding_stays_one_parameter() -> None:
    model = load_model("gpt-demo").model
    gm = trace(model, load_model("gpt-demo").example_inputs)
    assert gm.get_submodule("lm_head").weight is gm.get_submodule("wte").weight is model.wte.weight
    assert "lm_head.weight" not in dict(gm.named_parameters())


def test_meta_llama_8b_traces_quickly() -> None:
    spec = load_model("llama-8b")  # batch 1, seq 4096, on meta
    start = time.perf_counter()
    gm = trace(spec.model, spec.example_inputs)
    elapsed = time.perf_counter() - start
    assert gm.meta[TRACE_META_KEY] == "fx" and elapsed < 5.0, f"{elapsed:.1f} s"
    assert len(gm.graph.nodes) > 32 * 40
    assert all(p.is_meta for p in gm.parameters())
    assert_same_state(gm, spec.model)


# --- leaf modules and module paths ---------------------------------------------------------------------------------


def test_leaf_modules_by_type_and_name() -> None:
    spec = load_model("llama-demo")
    gm = trace(spec.model, spec.example_inputs, leaf_modules=[Attention, "layers.2.mlp"])
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert [c for c in calls if c.endswith(".attn")] == [f"layers.{i}.attn" for i in range(4)]
    assert "layers.2.mlp" in calls and "layers.1.mlp" not in calls and "layers.1.mlp.up_proj" in calls
    assert_equal(gm(*spec.example_inputs), spec.model(*spec.example_inputs))


def test_unknown_leaf_name_is_an_error() -> None:
    spec = load_model("llama-demo")
    with pytest.raises(TraceError, match=r"leaf_modules names \['layers.9'\] but Llama has no such submodule"):
        trace(spec.model, spec.example_inputs, leaf_modules=["layers.9"])


def test_module_path_on_fx_graph() -> None:
    spec = load_model("llama-demo")
    gm = trace(spec.model, spec.example_inputs)
    by_target = {str(n.target): module_path(n) for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
    assert by_target["layers.3.attn.q_proj"] == "layers.3.attn.q_proj"
    assert by_target["rope_cos"] == ""
    sdpa = [n for n in gm.graph.nodes if n.target is torch.nn.functional.scaled_dot_product_attention]
    assert [module_path(n) for n in sdpa] == [f"layers.{i}.attn" for i in range(4)]
    silu = [n for n in gm.graph.nodes if n.target is torch.nn.functional.silu]
    assert {module_path(n) for n in silu} == {f"layers.{i}.mlp" for i in range(4)}
    assert module_path(next(iter(gm.graph.nodes))) == ""  # the placeholder
    # the stack has torch.export's format: {key: (fqn, "module.QualName")}
    assert list(sdpa[0].meta["nn_module_stack"].values())[-1] == ("layers.0.attn", "rpcompile.models.llama.Attention")


def test_module_path_agrees_on_fx_and_export_graphs() -> None:
    spec = load_model("llama-demo")
    fx_gm = trace(spec.model, spec.example_inputs, method="fx")
    ep_gm = trace(spec.model, spec.example_inputs, method="export")
    assert ep_gm.meta[TRACE_META_KEY] == "export"
    assert_same_state(ep_gm, spec.model)
    assert_equal(ep_gm(*spec.example_inputs), fx_gm(*spec.example_inputs))

    def owners(gm: fx.GraphModule, target: object) -> list[str]:
        return [module_path(n) for n in gm.graph.nodes if n.target is target]

    sdpa = owners(fx_gm, torch.nn.functional.scaled_dot_product_attention)
    assert sdpa == owners(ep_gm, torch.ops.aten.scaled_dot_product_attention.default)
    assert owners(ep_gm, torch.ops.aten.linear.default)[:4] == [f"layers.0.attn.{p}_proj" for p in "qkvo"]
    assert owners(ep_gm, torch.ops.aten.embedding.default) == ["embed"]


@pytest.mark.parametrize(
    ("recorded", "expected"),
    [("model.layers.3.self_attn", "model.layers.3.self_attn"), ("L['self'].model.layers[3].self_attn",
      "model.layers.3.self_attn"), ("L['self']._modules['layers']._modules['0']", "layers.0"), ("", "")],
)
def test_module_path_normalises_stack_entries(recorded: str, expected: str) -> None:
    node = fx.Graph().call_function(torch.relu, ())
    node.meta["nn_module_stack"] = {"outer": ("", "Root"), "inner": (recorded, "X")}
    assert module_path(node) == expected


# --- HuggingFace transformers: the export path ---------------------------------------------------------------------


def _hf_model(kind: str) -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, num_key_value_heads=2, tie_word_embeddings=True, **small)
        return tf.LlamaForCausalLM(cfg)
    if kind == "qwen3":
        if not hasattr(tf, "Qwen3Config"):
            pytest.skip(f"transformers {tf.__version__} has no Qwen3")
        cfg = tf.Qwen3Config(vocab_size=128, hidden_size=32, num_key_value_heads=2, head_dim=16, **small)
        return tf.Qwen3ForCausalLM(cfg)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=0,
                            eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg)
    cfg = tf.BertConfig(vocab_size=128, hidden_size=32, max_position_embeddings=16, **small)
    return tf.BertForMaskedLM(cfg)


HF_ATTENTION = {
    "llama": "model.layers.1.self_attn",
    "qwen3": "model.layers.1.self_attn",
    "gpt2": "transformer.h.1.attn",
    "bert": "bert.encoder.layer.1.attention.self",
}


@pytest.mark.hf
@pytest.mark.parametrize("kind", sorted(HF_ATTENTION))
def test_hf_models_trace_with_export(kind: str) -> None:
    model = _hf_model(kind).eval()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids} if kind == "bert" else {"input_ids": ids, "use_cache": False}
    gm = trace(model, (), example_kwargs=kwargs)
    assert gm.meta[TRACE_META_KEY] == "export"
    assert_same_state(gm, model)
    assert_equal(gm(**kwargs).logits, model(**kwargs).logits)
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and not str(n.target).startswith("vmap_region")]  # no `_guards_fn`
    paths = Counter(module_path(n) for n in gm.graph.nodes if n.op == "call_function")
    assert paths[HF_ATTENTION[kind]] > 0
    assert all(not p.startswith(("L[", "L__")) for p in paths)


@pytest.mark.hf
def test_hf_tied_weight_is_read_once_under_its_first_name() -> None:
    model = _hf_model("gpt2").eval()  # export reads GPT-2's tied embedding as `lm_head.weight`
    ids = torch.randint(0, 128, (2, 8))
    gm = trace(model, {"input_ids": ids, "use_cache": False})  # a dict is taken as keyword arguments
    targets = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert "transformer.wte.weight" in targets and "lm_head.weight" not in targets
    assert gm.get_parameter("transformer.wte.weight") is model.lm_head.weight


def test_non_tensor_kwargs_go_through_export() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
            return self.lin(x) * (2 if double else 1)

    model, x = Scaled(), torch.randn(3, 4)
    gm = trace(model, (x,), example_kwargs={"double": True})
    assert gm.meta[TRACE_META_KEY] == "export"
    assert_same_state(gm, model)
    assert_equal(gm(x, double=True), model(x, double=True))
    assert [module_path(n) for n in gm.graph.nodes if n.op == "call_function"][0] == "lin"


def test_export_path_updates_the_models_batchnorm_statistics() -> None:
    class NoFx(nn.Module):  # `len(x)` defeats fx but not export
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(x) * len(x)

    model, x = NoFx().train(), torch.randn(8, 4)
    gm = trace(model, (x,))
    assert gm.meta[TRACE_META_KEY] == "export"
    gm(x)
    assert model.bn.num_batches_tracked.item() == 1 and not torch.equal(model.bn.running_mean, torch.zeros(4))


# --- failures ------------------------------------------------------------------------------------------------------


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:
            return x * 2
        return x


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lin(x))


TOY_ERROR = (
    r"cannot trace Toy: torch.fx.symbolic_trace and torch.export \(non-strict\) both failed\n"
    r"  fx:     in module 'gate' \(Gate\) at \S*test_tracing.py:\d+ in forward: if x.sum\(\).item\(\) > 0:\n"
    r"          TraceError: symbolically traced variables cannot be used as inputs to control flow\n"
    r"  export: in module 'gate' \(Gate\) at \S*test_tracing.py:\d+ in forward: if x.sum\(\).item\(\) > 0:\n"
    r"          GuardOnDataDependentSymNode: Could not guard on data-dependent expression [^\n]+\n"
    r"try: pass leaf_modules=\['gate'\] to keep that module opaque under fx; replace data-dependent Python control "
    r"flow with torch.where or torch.cond; avoid .item\(\), .tolist\(\) and Python loops over data-dependent sizes"
)


def test_untraceable_model_names_module_line_and_remedy(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TraceError, match=TOY_ERROR) as info:
        trace(Toy(), (torch.randn(2, 4),))
    assert len(str(info.value).splitlines()) == 6
    assert info.value.__cause__ is None and info.value.__context__ is None  # no pages of chained traceback
    assert "def forward" not in capfd.readouterr().err  # export's partial-graph dump is swallowed


def test_forced_fx_reports_only_fx() -> None:
    with pytest.raises(TraceError, match=r"^cannot trace Toy: torch.fx.symbolic_trace failed\n  fx: .*'gate'") as info:
        trace(Toy(), (torch.randn(2, 4),), method="fx")
    assert "export" not in str(info.value)


def test_leaf_modules_rescue_the_untraceable_toy() -> None:
    model, x = Toy(), torch.randn(2, 4)
    gm = trace(model, (x,), leaf_modules=["gate"])
    assert gm.meta[TRACE_META_KEY] == "fx"
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["lin", "gate"]
    assert_equal(gm(x), model(x))


def test_data_dependent_loop_in_nested_module() -> None:
    class Pick(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(())
            for i in range(len(torch.nonzero(x > 0))):
                out = out + i
            return out

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Pick()))
    with pytest.raises(TraceError, match=r"(?s)export: in module '1\.1' \(Pick\) at \S+:\d+ in forward: for i in"):
        trace(model, (torch.randn(3, 4),))


class _VmapMask(nn.Module):
    """A causal mask built with torch.vmap, as transformers 4.5x's ``create_causal_mask`` builds it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.vmap(lambda i: torch.arange(n, device=x.device) <= i)(torch.arange(n, device=x.device))
        return (self.lin(x).transpose(1, 2) @ mask.to(x.dtype)).transpose(1, 2)


def test_a_vmap_region_becomes_one_node_that_runs_whole_on_any_device() -> None:
    """Export records vmap as its steps; per-node analysis and stage cuts inside them fail (``Cannot access
    storage of BatchedTensorImpl``), so the region is outlined, and made portable like every stage."""
    model, x = _VmapMask(), torch.randn(2, 5, 8)
    gm = trace(model, (x,))
    assert gm.meta[TRACE_META_KEY] == "export"
    regions = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [str(n.target) for n in regions] == ["vmap_region_0"]
    assert "_add_batch_dim" not in gm.code and "_add_batch_dim" in gm.vmap_region_0.code
    assert_equal(gm(x), model(x))
    shape_pass(gm, (x,))
    cost_pass(gm, (x,), cost_model=MeasuredCostModel("cpu", warmup=0, repeats=1), progress=False)
    on_meta = portable_pass(copy.deepcopy(gm)).to("meta")  # as every stage is made portable
    with torch.device("meta"):
        assert on_meta(x.to("meta")).shape == x.shape
