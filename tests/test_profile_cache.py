"""Fast measured profiling (issue 20): repeated blocks measured once, nodes measured in batches, and the profile cache
on disk (passes/cost/repeats.py, passes/cost/cost.py, passes/cost/measured.py, passes/cost/profile_cache.py, rpcompile
cache).

Measured times on this shared 2-core machine vary by more than the differences these tests could see, so the
shared path is checked by structure (which nodes were measured, which took whose times) and totals only within a
wide band; the analytic model, which does not measure, checks that sharing changes no cost and no plan."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch import nn

from rpcompile.planner.plan_options import PlanOptions
import rpcompile
from rpcompile.cli import main
from rpcompile.models.registry import load_model
from rpcompile.passes.cost import measured, profile_cache
from rpcompile.passes.cost.analytic import AnalyticCostModel
from rpcompile.passes.cost.cost_model import COST_KEY, node_cost
from rpcompile.passes.cost.measured import MeasuredCostModel
from rpcompile.passes.cost.repeats import block_of, repeat_map
from rpcompile.passes.graph.fingerprint import fingerprint
from rpcompile.passes.graph.util import compute_nodes
from rpcompile.planner.planning import analyze, compile_plan


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(8, width), nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    """Four blocks, the third wider: blocks 0, 1, 3 repeat one another, block 2 repeats nothing."""

    def __init__(self, widths: tuple[int, ...] = (16, 16, 32, 16)):
        super().__init__()
        self.layers = nn.ModuleList(_Block(w) for w in widths)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _stack() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return _Stack(), (torch.randn(4, 8),)


def _measured(**kw: object) -> MeasuredCostModel:
    return MeasuredCostModel("cpu", warmup=0, repeats=1, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ repeated blocks
@pytest.mark.parametrize("name", ["llama-demo", "gpt-demo"])
def test_repeat_map_maps_every_layer_onto_the_first(name: str) -> None:
    ms = load_model(name)
    gm = analyze(ms.model, ms.example_inputs, cost_model=AnalyticCostModel("rtx4090"))
    rm = repeat_map(gm)
    blocks: dict[str, list[fx.Node]] = {}
    for n in compute_nodes(gm):
        b = block_of(n)
        if b is not None:
            blocks.setdefault(b, []).append(n)
    names = list(blocks)
    assert len(names) == 4, names
    first = blocks[names[0]]
    assert not any(n in rm for n in first)
    for other in names[1:]:
        nodes = blocks[other]
        assert len(nodes) == len(first)
        assert [rm[n] for n in nodes] == first  # position by position
        for n, r in zip(nodes, first):
            assert n.op == r.op and n.target == r.target or n.op == "call_module"


def test_repeats_are_found_from_the_graph_not_from_names() -> None:
    model, inputs = _stack()
    gm = analyze(model, inputs, cost_model=AnalyticCostModel("rtx4090"))
    rm = repeat_map(gm)
    by_block = {block_of(n): block_of(r) for n, r in rm.items()}
    assert by_block == {"layers.1": "layers.0", "layers.3": "layers.0"}  # layers.2 is wider: its own


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a loaded 2-core machine two threads wait ~20 ms at every barrier, and a tiny
    linear then times at 20 ms instead of 0.2 ms (measured here at load 5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["llama-demo", "gpt-demo"])
def test_shared_path_measures_one_layer_and_gives_its_times_to_the_repeats(name: str, one_thread: None) -> None:
    ms = load_model(name)
    # the default warm-up and repeats: a representative's cold first run would otherwise land on every repeat
    shared = analyze(ms.model, ms.example_inputs, cost_model=MeasuredCostModel("cpu", cache=False))
    per_layer = analyze(ms.model, ms.example_inputs, cost_model=MeasuredCostModel("cpu", cache=False, share_repeats=False))
    n = len(compute_nodes(shared))
    s, p = shared.meta["rpcompile.profiling"], per_layer.meta["rpcompile.profiling"]
    assert p["measured"] == n and p["shared"] == 0
    rm = repeat_map(shared)
    assert s["shared"] == len(rm) and s["measured"] == n - len(rm)
    assert s["batches"] < s["measured"]  # a block at a time, not a node at a time
    for node, rep in rm.items():  # calibration scales every node alike: the repeat keeps exactly the rep's times
        assert node_cost(node).fwd_time_s == node_cost(rep).fwd_time_s
        assert node_cost(node).bwd_time_s == node_cost(rep).bwd_time_s
    # the per-layer path measured the layers separately: its repeats' times are their own
    nodes_p = {x.name: x for x in compute_nodes(per_layer)}
    assert any(node_cost(nodes_p[a.name]).fwd_time_s != node_cost(nodes_p[b.name]).fwd_time_s for a, b in rm.items())
    # every non-time field is the same; totals agree within what this busy machine's noise allows
    for a, b in zip(compute_nodes(shared), compute_nodes(per_layer)):
        ca, cb = node_cost(a), node_cost(b)
        assert (ca.output_bytes, ca.act_bytes, ca.fwd_flops, ca.bwd_flops) == \
            (cb.output_bytes, cb.act_bytes, cb.fwd_flops, cb.bwd_flops)
    # totals, as measured (calibration, applied or not by the whole-graph run's noise, divided out): this shared
    # 2-core machine's load moves a whole profile by tens of percent between runs, and a process's first profile
    # runs cold, so each path's fastest of two runs, within a wide band
    def raw_total(g: fx.GraphModule) -> float:
        cal = g.meta.get("rpcompile.calibration") or {}
        f, b = (cal["forward"], cal["backward"]) if cal.get("applied") else (1.0, 1.0)
        return sum(node_cost(x).fwd_time_s / f + node_cost(x).bwd_time_s / b for x in compute_nodes(g))

    def again(share: bool) -> fx.GraphModule:
        return analyze(ms.model, ms.example_inputs, cost_model=MeasuredCostModel("cpu", cache=False, share_repeats=share))

    tot = [min(raw_total(shared), raw_total(again(True))), min(raw_total(per_layer), raw_total(again(False)))]
    assert 1 / 3 < tot[0] / tot[1] < 3, tot


@pytest.mark.parametrize("name", ["llama-demo", "gpt-demo"])
def test_sharing_changes_no_analytic_cost_and_no_plan(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced on for the analytic model (whose times do not depend on measuring), sharing the repeats' times and
    meta profiles (FLOPs, saved activations) must leave every NodeCost, the graph and the plan exactly as they were."""
    ms = load_model(name)
    assert AnalyticCostModel("rtx4090").share_repeats  # on by default since issue 20 (6): this test is its guard

    def made(share: bool) -> tuple[fx.GraphModule, dict]:
        monkeypatch.setattr(AnalyticCostModel, "share_repeats", share)
        c = compile_plan(ms.model, ms.example_inputs, PlanOptions(gpus=2, spec="rtx4090", strategy="dp",
                         head_chunks=1), loss_fn=ms.loss_fn, example_target=ms.example_target)
        assert c.plan is not None
        d = c.plan.to_dict()
        d["stats"] = {k: v for k, v in d["stats"].items() if "time" not in k}  # the solver's wall time
        return c.graph, d

    g_off, plan_off = made(False)
    g_on, plan_on = made(True)
    assert g_off.meta["rpcompile.profiling"]["shared"] == 0
    assert g_on.meta["rpcompile.profiling"]["shared"] > 0
    assert fingerprint(g_on) == fingerprint(g_off)
    assert [n.meta.get(COST_KEY) for n in compute_nodes(g_on)] == [n.meta.get(COST_KEY) for n in compute_nodes(g_off)]
    assert plan_on == plan_off


def test_a_repeat_whose_gradients_differ_is_measured_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """layers.0 reads the model input (no gradient), layers.1 and .3 a trainable layer's output: same structure,
    so the same block signature, but their first node's backward differs and is measured on its own."""
    model, inputs = _stack()
    measured: list[str] = []
    real = MeasuredCostModel.estimate_batch
    monkeypatch.setattr(MeasuredCostModel, "estimate_batch",
                        lambda self, c: measured.extend(x.node.name for x in c) or real(self, c))
    gm = analyze(model, inputs, cost_model=_measured(cache=False))
    rm = repeat_map(gm)
    assert {block_of(n) for n in rm} == {"layers.1", "layers.3"}
    own = {n.name for n in rm if n.name in measured}
    assert own and all(block_of(n) != "layers.2" for n in rm)
    # exactly the repeats' nodes that read the block's input (the up projection and the residual add)
    reads_input = {n.name for n in rm if any(a.op == "placeholder" or block_of(a) != block_of(n) for a in n.all_input_nodes
                                             if a.op != "get_attr")}
    assert own == reads_input, (own, reads_input)
    assert gm.meta["rpcompile.profiling"]["shared"] == len(rm) - len(own)


# ------------------------------------------------------------------------------------------ the profile cache
def _cache_files() -> list[Path]:
    return sorted((profile_cache.cache_dir() / "profiles").glob("*"))


def _no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*a: object, **k: object) -> None:
        raise AssertionError("measured although the cache was warm")

    for name in ("estimate_batch", "prepare", "calibration", "_samples", "_time"):
        monkeypatch.setattr(MeasuredCostModel, name, fail)


def _times(gm: fx.GraphModule) -> list[tuple[float, float]]:
    return [(node_cost(n).fwd_time_s, node_cost(n).bwd_time_s) for n in compute_nodes(gm)]


def test_the_suite_uses_a_temporary_cache() -> None:
    assert profile_cache.cache_dir() != Path.home() / ".cache" / "rpcompile"


def test_cold_then_warm_does_not_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = _stack()
    cold = analyze(model, inputs, cost_model=_measured())
    assert not cold.meta["rpcompile.profiling"]["cache_hit"]
    assert len(_cache_files()) == 1 and not any(p.name.startswith(".tmp") for p in _cache_files())
    _no_measuring(monkeypatch)
    warm = analyze(model, inputs, cost_model=_measured())
    assert warm.meta["rpcompile.profiling"] == {**warm.meta["rpcompile.profiling"], "cache_hit": True, "measured": 0}
    assert _times(warm) == _times(cold)
    assert [n.meta[COST_KEY] for n in compute_nodes(warm)] == [n.meta[COST_KEY] for n in compute_nodes(cold)]
    assert warm.meta.get("rpcompile.calibration") == cold.meta.get("rpcompile.calibration")


def test_a_warm_cache_casts_no_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 plan with measured costs: the warm lookup gives the graph uninitialised storage in bf16 for the
    key's dtypes and never casts the real weights (a Llama-3-8B in CPU memory is 32 GB to read per cast, once
    per LM-head split); the costs are the cold compile's."""
    import rpcompile.planner.planning as planning

    model, inputs = _stack()
    plan = dict(gpus=1, device="cpu", precision="bf16", time_limit_s=1)
    cold = compile_plan(model, inputs, PlanOptions(**plan))
    assert not cold.graph.meta["rpcompile.profiling"]["cache_hit"]
    values = []
    cast = planning.computing_in
    monkeypatch.setattr(planning, "computing_in",
                        lambda m, dtype, **k: values.append(k.get("values", True)) or cast(m, dtype, **k))
    _no_measuring(monkeypatch)
    warm = compile_plan(model, inputs, PlanOptions(**plan))
    assert values == [False] and warm.graph.meta["rpcompile.profiling"]["cache_hit"]
    assert [n.meta[COST_KEY] for n in compute_nodes(warm.graph)] == [n.meta[COST_KEY] for n in compute_nodes(cold.graph)]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_the_key_changes_with_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = _stack()
    gm = analyze(model, inputs, cost_model=AnalyticCostModel("rtx4090"))
    base_id = _measured().identity()
    path = profile_cache._path

    def key(g: fx.GraphModule = gm, x: tuple = inputs, **ident: object) -> Path:
        return path(profile_cache.profile_key(g, list(x), {**base_id, **ident}))

    base = key()
    other_model, _ = _stack()
    other = _Stack((16, 16, 16, 16))
    variants = {
        "inputs": key(x=(torch.randn(8, 8),)),
        "dtype": key(dtype="torch.bfloat16"),
        "device": key(device="NVIDIA H100 80GB HBM3"),
        "repeats": key(repeats=9),
        "graph": key(g=analyze(other, inputs, cost_model=AnalyticCostModel("rtx4090"))),
    }
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0.0-other")
        variants["torch"] = key()
    with monkeypatch.context() as m:
        m.setattr(profile_cache, "PROFILE_FORMAT_VERSION", profile_cache.PROFILE_FORMAT_VERSION + 1)
        variants["format"] = key()
    assert key() == base  # deterministic
    assert len({base, *variants.values()}) == len(variants) + 1, variants
    assert key(g=analyze(other_model, inputs, cost_model=AnalyticCostModel("rtx4090"))) == base  # same model, same key


def _first_node_field(text: str, field: str, value: str) -> str:
    """``text`` with the first node's ``field`` written as the raw JSON ``value`` (Infinity, 10**400…)."""
    data = json.loads(text)
    first = next(iter(data["nodes"].values()))
    first[field] = "@@"
    return json.dumps(data).replace('"@@"', value, 1)


HOSTILE = {  # issue 36: each crashed the next compile instead of one warning
    "not UTF-8": lambda text: text.encode().replace(b'"format"', b'"f\xe9rmat"', 1),
    "infinite time": lambda text: _first_node_field(text, "fwd_time_s", "Infinity").encode(),
    "huge byte count": lambda text: _first_node_field(text, "output_bytes", "1" + "0" * 400).encode(),
    "time out of range": lambda text: _first_node_field(text, "bwd_time_s", "1e300").encode(),
    "nested": lambda text: _first_node_field(text, "params", "[" * 50_000 + "]" * 50_000).encode(),
}


def test_the_key_names_the_cpu_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36: platform.processor() is empty on Linux, so two x86_64 machines with as many cores shared timings."""
    keys = []
    for model in ("AMD EPYC 7763 64-Core Processor", "Intel(R) Xeon(R) Platinum 8480+"):
        info = tmp_path / f"cpuinfo-{len(keys)}"
        info.write_text(f"processor\t: 0\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: fpu\n\n"
                        f"processor\t: 1\nmodel name\t: {model}\n")
        monkeypatch.setattr(measured, "CPUINFO", info)
        monkeypatch.setattr(measured.platform, "processor", lambda: "")
        identity = _measured().identity()
        assert model in identity["device"]
        keys.append(identity["device"])
    assert keys[0] != keys[1]


@pytest.mark.parametrize("how", ["garbage", "truncated", "foreign", "schema", "nodes", "empty", "older", *HOSTILE])
def test_a_bad_entry_warns_once_and_is_measured_afresh(how: str, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    model, inputs = _stack()
    analyze(model, inputs, cost_model=_measured())
    (entry,) = _cache_files()
    text = entry.read_text()
    data = json.loads(text)
    if how in HOSTILE:
        entry.write_bytes(HOSTILE[how](text))
    elif how == "garbage":
        entry.write_text("not json {")
    elif how == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif how == "empty":
        entry.write_text("")
    elif how == "foreign":
        entry.write_text(json.dumps({**data, "key": {**data["key"], "graph": "0" * 64}}))
    elif how == "schema":
        entry.write_text(json.dumps({**data, "nodes": [1, 2, 3]}))
    elif how == "older":  # written before NodeCost had bwd_transient_bytes: refused, not read as 0
        old = {name: {k: v for k, v in fields.items() if k != "bwd_transient_bytes"}
               for name, fields in data["nodes"].items()}
        assert old != data["nodes"]
        entry.write_text(json.dumps({**data, "nodes": old}))
    else:
        entry.write_text(json.dumps({**data, "nodes": dict(list(data["nodes"].items())[1:])}))
    calls = []
    real = MeasuredCostModel.estimate_batch
    monkeypatch.setattr(MeasuredCostModel, "estimate_batch", lambda self, c: calls.append(len(c)) or real(self, c))
    with caplog.at_level(logging.WARNING, logger="rpcompile"):
        gm = analyze(model, inputs, cost_model=_measured())
    warnings = [r for r in caplog.records if "profile cache" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert calls and not gm.meta["rpcompile.profiling"]["cache_hit"]
    assert set(json.loads(entry.read_text())["nodes"]) == set(data["nodes"])  # rewritten whole


def test_an_unwritable_cache_warns_and_the_costs_still_come(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("RPCOMPILE_CACHE", str(blocker))  # a file where the directory should be
    model, inputs = _stack()
    with caplog.at_level(logging.WARNING, logger="rpcompile"):
        gm = analyze(model, inputs, cost_model=_measured())
    assert all(node_cost(n).fwd_time_s > 0 for n in compute_nodes(gm))
    assert sum("cannot write the profile cache" in r.getMessage() for r in caplog.records) == 1


def test_cli_cache_show_clear_and_no_cache(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    assert main(["profile", "cnn-demo", "--json"]) == 0
    (entry,) = _cache_files()
    before = entry.stat().st_mtime_ns
    capsys.readouterr()
    assert main(["cache", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown["entries"]) == 1 and shown["bytes"] == entry.stat().st_size
    assert main(["cache"]) == 0
    assert "1 entry" in capsys.readouterr().out
    # --no-cache: measures (the warm entry is not read) and writes nothing
    calls = []
    real = MeasuredCostModel.estimate_batch
    monkeypatch.setattr(MeasuredCostModel, "estimate_batch", lambda self, c: calls.append(len(c)) or real(self, c))
    assert main(["profile", "cnn-demo", "--json", "--no-cache"]) == 0
    assert calls and _cache_files() == [entry] and entry.stat().st_mtime_ns == before
    assert main(["cache", "clear"]) == 0
    assert _cache_files() == []
    assert "removed 1 entry" in capsys.readouterr().out


def test_no_cache_in_the_python_api(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = _stack()
    rpcompile.profile(model, inputs, cache=False)
    assert _cache_files() == []
    rpcompile.profile(model, inputs)
    assert len(_cache_files()) == 1
    _no_measuring(monkeypatch)
    rpcompile.profile(model, inputs)  # warm


def test_compile_takes_cache_false() -> None:
    model, inputs = _stack()
    target = torch.randn(4, 4)
    rpcompile.compile(model, inputs, loss_fn=nn.functional.mse_loss, devices=["cpu"], cache=False,
                      example_target=target, head_chunks=1)
    assert _cache_files() == []
    rpcompile.compile(model, inputs, loss_fn=nn.functional.mse_loss, devices=["cpu"], example_target=target,
                      head_chunks=1)
    assert len(_cache_files()) == 1
