"""``rpcompile.tools.plandiff``: what changed between two plans, as exact lines and as JSON.

Real plans come from llama-demo costed once on the analytic ``cpu`` spec and cut by deterministic means (the
``uniform`` strategy, or ``plan_from_ranges`` at named segments), so every expected line is known in advance;
synthetic plans (plain Stage data, no graph) check the roll-up of a 16-block model.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from _toy import toy_graph
from rpcompile.core.plan import Fingerprint, Hardware, Plan, Prediction, Stage
from rpcompile.core.specs import get_spec
from rpcompile.models.registry import load_model
from rpcompile.passes.lower import plan_from_ranges
from rpcompile.passes.rewrite.coarsen import segments_of
from rpcompile.planner.plan_options import PlanOptions, make_hardware
from rpcompile.planner.planning import plan_graph, prepare
from rpcompile.tools.plandiff import diff_plans, model_differences

MIB = 2**20


# ---- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph():
    """llama-demo costed for 3 devices (4 microbatches) on the analytic cpu spec, and its segments by name (the
    embedding on the devices, so that every module is in some stage)."""
    ms = load_model("llama-demo", seed=0)
    gm, m = prepare(ms.model, ms.example_inputs, PlanOptions(gpus=3, spec="cpu", host_embedding=False))
    return gm, m, {s.name: s for s in segments_of(gm)}


def reload(plan: Plan, path) -> Plan:
    return Plan.load(plan.save(path))


def manual(graph, backward_cut: str, saved: list[str], times: list[float], memory: list[int],
           iteration_s: float = 0.01) -> Plan:
    """F0 = layers 0–1, F1 = layer 2, FB = layer 3 + head; B1 = ``backward_cut`` … layer 2, B2 = the rest."""
    gm, m, seg = graph
    start, end = seg[backward_cut].start, seg["layers.2.mlp"].stop
    return plan_from_ranges(
        gm, forward=[(0, seg["layers.2.attn"].start), (seg["layers.2.attn"].start, end)], fused=(end, seg["lm_head"].stop),
        backward=[(start, end), (0, start)], hardware=make_hardware(2, "cpu"), microbatches=m, saved=saved,
        stage_times=times, stage_memory=memory,
        predicted=Prediction(iteration_time_s=iteration_s, bubble_fraction=0.2, peak_memory_bytes=max(memory)),
    )


# ---- a hand-made pair: every line known --------------------------------------------------------------------
def test_known_pair_exact_lines(graph, tmp_path):
    _, _, seg = graph
    saved = list(seg["layers.0.attn"].nodes)  # B2 uploads layer 0's attention half instead of recomputing it
    toggled = saved[3]
    a = manual(graph, "layers.2.attn", saved, [1e-3, 1e-3, 1e-3, 1e-3, 2e-3], [MIB] * 5)
    # b: layers.1's MLP half moves from B2 to B1, one saved node is recomputed instead, B1 and B2 change time,
    # B1's memory, so the peak memory too, changes by under 0.5 % (not reported)
    b = manual(graph, "layers.1.mlp", [n for n in saved if n != toggled], [1e-3, 1e-3, 1e-3, 1.1e-3, 1.5e-3],
               [MIB, MIB, MIB, MIB + 5000, MIB], iteration_s=0.0095)
    a, b = reload(a, tmp_path / "a.json"), reload(b, tmp_path / "b.json")
    moved = len(seg["layers.1.mlp"].nodes)
    d = diff_plans(a, b, a_name="a.json", b_name="b.json")
    assert d.changed
    assert d.lines() == [
        "a.json → b.json",
        f"backward placement ({moved} nodes changed stage):",
        "  layers.1.{mlp_norm,mlp}: B2 → B1",
        "activations in the backward pass:",
        f"  saved → recomputed: 1 node: {toggled}",
        "prediction:",
        "  iteration time 10.000 ms → 9.500 ms (−5.0%)",
        "stages (time per microbatch, memory):",
        "  B1: time 1.000 ms → 1.100 ms (+10.0%)",
        "  B2: time 2.000 ms → 1.500 ms (−25.0%)",
    ]
    # the reverse direction says the opposite
    assert diff_plans(b, a).lines()[1:3] == [f"backward placement ({moved} nodes changed stage):",
                                             "  layers.1.{mlp_norm,mlp}: B1 → B2"]
    data = json.loads(json.dumps(d.to_dict()))
    assert data["changed"] is True and data["a_name"] == "a.json"
    assert data["backward"] == [{"label": "layers.1.{mlp_norm,mlp}", "modules": ["layers.1.mlp_norm", "layers.1.mlp"],
                                 "a": ["B2"], "b": ["B1"]}]
    assert data["backward_nodes"]["names"] == list(seg["layers.1.mlp"].nodes)
    assert data["backward_nodes"]["runs"] == [[seg["layers.1.mlp"].nodes[0], seg["layers.1.mlp"].nodes[-1]]]
    assert data["activations"] == [{"a": "saved", "b": "recomputed", "nodes": {"names": [toggled], "runs": [[toggled, toggled]]}}]
    assert data["predicted"] == [{"what": "iteration time", "a": 0.01, "b": 0.0095}]
    assert data["stages"] == [{"stage": "B1", "time_s": [1e-3, 1.1e-3], "memory_bytes": None},
                              {"stage": "B2", "time_s": [2e-3, 1.5e-3], "memory_bytes": None}]
    assert data["forward"] == [] and data["model"] == [] and data["header"] == []


def test_identical_plans(graph, tmp_path):
    a = manual(graph, "layers.2.attn", [], [1e-3] * 5, [MIB] * 5)
    # solver statistics are not part of the comparison
    b = reload(dataclasses.replace(a, stats={"solve_time_s": 1.5}), tmp_path / "b.json")
    d = diff_plans(a, b)
    assert not d.changed
    assert d.lines() == ["plans are identical"]
    assert json.loads(json.dumps(d.to_dict()))["changed"] is False


# ---- real plans --------------------------------------------------------------------------------------------
def test_two_and_three_devices(graph, tmp_path):
    gm, m, seg = graph
    two, three = (reload(plan_graph(gm, hardware=make_hardware(g, "cpu"), microbatches=m, strategy="uniform"),
                         tmp_path / f"{g}.json") for g in (2, 3))
    layer = {i: len(seg[f"layers.{i}.attn"].nodes) + len(seg[f"layers.{i}.mlp"].nodes) for i in range(4)}
    lines = diff_plans(two, three, a_name="2.json", b_name="3.json").lines()
    # uniform: 2 devices → F0 = layers 0–1, FB = layers 2–3 + head, B1 = layers 0–1;
    #          3 devices → F0 = layer 0, F1 = layers 1–2, FB = layer 3 + head, B1 = layers 1–2, B2 = layer 0
    assert lines[:10] == [
        "2.json → 3.json",
        "devices 2 → 3",
        "forward stages 1 → 2; backward stages 1 → 2",
        f"forward placement ({layer[1] + layer[2]} nodes changed stage):",
        "  layers.1: F0 → F1",
        "  layers.2: FB → F1",
        f"backward placement ({layer[0] + layer[2]} nodes changed stage):",
        "  (root), embed, layers.0: B1 → B2",
        "  layers.2: FB → B1",
        "activations in the backward pass:",
    ]
    assert lines[10] == f"  fused → recomputed: {layer[2]} nodes: {seg['layers.2.attn'].nodes[0]} … {seg['layers.2.mlp'].nodes[-1]}"
    assert lines[11] == "prediction:"
    # the figures depend on the cost model; their form does not
    time, size, pct = r"\d+\.\d{3} ms", r"\d+(\.\d\d)? (B|KiB|MiB)", r"\([+−]\d+\.\d%\)"
    assert re.fullmatch(rf"  iteration time {time} → {time} {pct}", lines[12])
    assert re.fullmatch(r"  bubble \d+\.\d% → \d+\.\d% \([+−]\d+\.\d pp\)", lines[13])
    assert re.fullmatch(rf"  peak memory {size} → {size} {pct}", lines[14])
    assert re.fullmatch(rf"  weights up per iteration {size} → {size} {pct}", lines[15])  # one more stage
    assert lines[16] == "stages (time per microbatch, memory):"
    rows = lines[17:]
    assert all(re.fullmatch(rf"  (F0|FB|B1): time {time} → {time} {pct}(; memory {size} → {size} {pct})?", r)
               for r in rows), rows
    assert [r.split(":")[0] for r in rows][:2] == ["  F0", "  FB"]  # both lost a layer
    assert len(lines) <= 30


def test_different_models(graph):
    gm, m, _ = graph
    llama = plan_graph(gm, hardware=make_hardware(2, "cpu"), microbatches=m, strategy="uniform")
    toy, _ = toy_graph()
    other = plan_from_ranges(toy, forward=[(0, 2)], fused=(2, 6), backward=[(0, 2)], hardware=make_hardware(2, "cpu"),
                             microbatches=m)
    d = diff_plans(llama, other)
    lines = d.lines()
    assert lines[1] == "DIFFERENT MODELS: the plans are for different models; only module placement is compared"
    assert lines[2] == (f"  graph differs ({llama.model.num_nodes} vs {other.model.num_nodes} nodes); parameters differ "
                        f"({llama.model.num_params} tensors / {llama.model.param_elements:,} elements vs "
                        f"{other.model.num_params} / {other.model.param_elements:,})")
    # nodes of different models are not compared: no node counts, no activation changes
    assert "forward placement:" in lines and "backward placement:" in lines
    assert not d.activations and not d.forward_nodes and not d.backward_nodes
    assert "  layers.0–1: F0 → —" in lines
    json.dumps(d.to_dict())


# ---- synthetic plans: the roll-up ----------------------------------------------------------------------------
def _block(i: int) -> list[tuple[str, str]]:
    """(node, module) pairs of block ``i``: attention half, residual add, MLP half, residual add."""
    p = f"layers.{i}"
    return [(f"layers_{i}_attn_norm", f"{p}.attn_norm"), (f"layers_{i}_attn_q", f"{p}.attn.q_proj"),
            (f"layers_{i}_sdpa", f"{p}.attn"), (f"add_{2 * i}", p), (f"layers_{i}_mlp_norm", f"{p}.mlp_norm"),
            (f"layers_{i}_mlp_up", f"{p}.mlp.up_proj"), (f"add_{2 * i + 1}", p)]


ALL = [("size", "(root)"), ("embed", "embed"), *(pair for i in range(16) for pair in _block(i)), ("norm", "norm"),
       ("lm_head", "lm_head")]
BODY = len(ALL) - 2  # FB holds norm and lm_head


def cut(block: int, offset: int = 0) -> int:
    """Position of block ``block``'s first node (+ ``offset`` nodes)."""
    return 2 + 7 * block + offset


def _stage(name: str, kind: str, pairs, saved: frozenset[str] = frozenset()) -> Stage:
    return Stage(name=name, kind=kind, nodes=[n for n, _ in pairs], params=(),
                 modules=tuple(dict.fromkeys(m for _, m in pairs)), saved=[n for n, _ in pairs if n in saved])


def synthetic(forward_cuts: list[int], backward_cuts: list[int], saved: frozenset[str] = frozenset()) -> Plan:
    """A 16-block model cut before each position in ``forward_cuts`` (F0, F1, …) and ``backward_cuts`` (the last
    piece is B1), with norm and lm_head in FB, saving the nodes ``saved``."""
    def pieces(cuts):
        bounds = [0, *cuts, BODY]
        return [ALL[x:y] for x, y in zip(bounds, bounds[1:])]

    fwd, bwd = pieces(forward_cuts), pieces(backward_cuts)[::-1]
    stages = [*(_stage(f"F{i}", "forward", p, saved) for i, p in enumerate(fwd)), _stage("FB", "fused", ALL[BODY:]),
              *(_stage(f"B{i + 1}", "backward", p, saved) for i, p in enumerate(bwd))]
    hw = Hardware(device_count=2, spec=get_spec("cpu"), memory_bytes=10**9, link_bytes_per_s=1e10)
    fp = Fingerprint(graph_digest="g", params_digest="p", num_nodes=len(ALL), num_params=0, param_elements=0)
    return Plan(model=fp, hardware=hw, microbatches=3, stages=stages,
                predicted=Prediction(iteration_time_s=1.0, bubble_fraction=0.1, peak_memory_bytes=MIB))


def test_consecutive_blocks_roll_up():
    d = diff_plans(synthetic([cut(8)], [cut(8)]), synthetic([cut(12)], [cut(4)]))
    assert d.lines() == [
        "a → b",
        "forward placement (28 nodes changed stage):",
        "  layers.8–11: F1 → F0",
        "backward placement (28 nodes changed stage):",
        "  layers.4–7: B2 → B1",
    ]
    assert not diff_plans(synthetic([cut(8)], [cut(8)]), synthetic([cut(8)], [cut(8)])).changed


def test_half_block_and_own_ops():
    # the cut moves into block 8, after its attention half and residual add: the add follows the attention half
    d = diff_plans(synthetic([cut(8)], [cut(8)]), synthetic([cut(8, 4)], [cut(8)]))
    assert d.lines() == ["a → b", "forward placement (4 nodes changed stage):", "  layers.8.{attn_norm,attn}: F1 → F0"]
    # only the residual add moves: the block's own ops, now split across two stages
    d = diff_plans(synthetic([cut(8, 3)], [cut(8)]), synthetic([cut(8, 4)], [cut(8)]))
    assert d.lines() == ["a → b", "forward placement (1 node changed stage):", "  layers.8 (own ops): F1 → F0+F1"]
    # whole blocks and a half block that moved alike share a line
    d = diff_plans(synthetic([cut(2)], [cut(2)]), synthetic([cut(9, 4)], [cut(2)]))
    assert d.lines()[1:] == ["forward placement (53 nodes changed stage):", "  layers.2–8, layers.9.{attn_norm,attn}: F1 → F0"]


def test_new_stage_and_long_labels():
    # B2 splits into B2 and a new B3: more than three pieces move alike and abbreviate to first … last
    d = diff_plans(synthetic([cut(8)], [cut(3)]), synthetic([cut(8)], [cut(2, 4), cut(3)]))
    assert d.lines() == [
        "a → b",
        "backward stages 2 → 3",
        f"backward placement ({cut(2, 4)} nodes changed stage):",
        "  (root) … layers.2.{attn_norm,attn}: B2 → B3",
    ]
    # whole blocks carry their own ops; of block 2 only the parts that moved
    assert d.backward[0].modules == ("(root)", "embed", *(f"layers.{i}{m}" for i in (0, 1) for m in
                                     (".attn_norm", ".attn", "", ".mlp_norm", ".mlp")),
                                     "layers.2.attn_norm", "layers.2.attn")


def test_rows_are_capped():
    # one forward stage per block: every block moves its own way
    a, b = synthetic([cut(8)], [cut(8)]), synthetic([cut(i) for i in range(1, 16)], [cut(8)])
    lines = diff_plans(a, b).lines(max_rows=4)
    assert lines == ["a → b", "forward stages 2 → 16", f"forward placement ({BODY - cut(1)} nodes changed stage):",
                     "  layers.1: F0 → F1", "  layers.2: F0 → F2", "  layers.3: F0 → F3", "  … 12 more (--json lists all)"]
    assert len(diff_plans(a, b).forward) == 15


def test_activation_runs():
    block3 = {n for n, _ in _block(3)}
    a = synthetic([cut(8)], [cut(8)], frozenset({"layers_9_sdpa"}))
    b = synthetic([cut(8)], [cut(8)], frozenset(block3 | {"layers_5_attn_norm", "layers_7_sdpa", "layers_11_sdpa"}))
    assert diff_plans(a, b).lines() == [
        "a → b",
        "activations in the backward pass:",
        "  recomputed → saved: 10 nodes: layers_3_attn_norm … add_7, layers_5_attn_norm, layers_7_sdpa and 1 more run",
        "  saved → recomputed: 1 node: layers_9_sdpa",
    ]


def test_header_changes():
    a = synthetic([cut(8)], [cut(8)])
    spec = dataclasses.replace(a.hardware.spec, tensor_flops=4e11)
    b = dataclasses.replace(a, hardware=dataclasses.replace(a.hardware, spec=spec, memory_bytes=2 * 10**9, device_count=3,
                                                            link_bytes_per_s=2.5e10),
                            microbatches=4, strategy="dp", precision="bf16", cost_model="analytic:cpu")
    assert diff_plans(a, b).lines() == [
        "a → b",
        "devices 2 → 3",
        "device spec cpu: tensor_flops 200000000000.0 → 400000000000.0",
        "memory per device 953.67 MiB → 1.86 GiB (+100.0%)",
        "host link 10.0 GB/s → 25.0 GB/s",
        "microbatches 3 → 4",
        "strategy manual → dp",
        "precision fp32 → bf16",
        "cost model (unknown) → analytic:cpu",
    ]
    c = dataclasses.replace(a, hardware=dataclasses.replace(a.hardware, spec=get_spec("rtx4090")))
    assert diff_plans(a, c).lines() == ["a → b", "device spec cpu → rtx4090"]
    hosted = dataclasses.replace(a, host=("embed",))
    assert diff_plans(a, hosted).lines() == ["a → b", "on the host (nothing) → embed"]


def test_nodes_moved_within_split_modules():
    # F0's last node (block 7's second residual add) moves to F1; the stages' module lists are left as they were
    a = synthetic([cut(8)], [cut(8)])
    f0, f1 = a.stages[:2]
    b = dataclasses.replace(a, stages=[dataclasses.replace(f0, nodes=f0.nodes[:-1]),
                                       dataclasses.replace(f1, nodes=(f0.nodes[-1], *f1.nodes)), *a.stages[2:]])
    assert diff_plans(a, b).lines() == ["a → b", "forward placement (1 node changed stage):",
                                        "  nodes: add_15 (their modules' stages did not change)"]


def test_alike_stages_share_a_row():
    a = synthetic([cut(4), cut(8), cut(12)], [cut(4), cut(8), cut(12)])
    a = dataclasses.replace(a, stages=[dataclasses.replace(s, time_s=1e-3) for s in a.stages])
    new = {"F1": 2e-3, "F2": 2e-3, "B1": 2e-3, "B2": 2e-3, "B4": 3e-3, "FB": 1.004e-3}  # FB: under 0.5 %
    b = dataclasses.replace(a, stages=[dataclasses.replace(s, time_s=new.get(s.name, s.time_s)) for s in a.stages])
    assert diff_plans(a, b).lines() == [
        "a → b",
        "stages (time per microbatch, memory):",
        "  F1–F2: time 1.000 ms → 2.000 ms (+100.0%)",
        "  B1–B2: time 1.000 ms → 2.000 ms (+100.0%)",
        "  B4: time 1.000 ms → 3.000 ms (+200.0%)",
    ]


# ---- the same model ------------------------------------------------------------------------------------------
def test_the_same_model_is_the_parameters_and_the_graph_as_planned(graph):
    """plandiff.model_differences, which diff uses: plans whose graphs differ only where they
    split the LM head or run lookups on the host are for the same model; other parameters are another model."""
    a = manual(graph, "layers.2.attn", [], [1e-3] * 5, [MIB] * 5)
    other_graph = dataclasses.replace(a.model, graph_digest="0" * 64)
    split = dataclasses.replace(a, model=other_graph, head_chunks=4)
    hosted = dataclasses.replace(a, model=other_graph, host=("embed",))
    assert model_differences(a, a) == [] and model_differences(a, split) == [] and model_differences(a, hosted) == []
    assert diff_plans(a, split).model == () and any(c.what == "LM head chunks" for c in diff_plans(a, split).header)
    n = a.model.num_nodes
    assert model_differences(a, dataclasses.replace(a, model=other_graph)) == [f"graph differs ({n} vs {n} nodes)"]
    other_params = dataclasses.replace(split.model, params_digest="1" * 64)
    assert model_differences(a, dataclasses.replace(split, model=other_params))[-1].startswith("parameters differ")
