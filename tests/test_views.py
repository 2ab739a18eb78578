"""The pictures: the pipeline timeline (Gantt chart) and the plan graph parse as SVG and show what they claim."""

from __future__ import annotations

import dataclasses
import re
import time
import xml.etree.ElementTree as ET

import pytest

import rpcompile
from rpcompile.core.errors import ConfigError
from rpcompile.models.registry import load_model
from rpcompile.passes.graph.util import compute_nodes
from rpcompile.passes.lower import plan_from_ranges
from rpcompile.planner.plan_options import make_hardware
from rpcompile.runtime.sim.sim_result import SimEvent
from rpcompile.views.gantt import timeline_svg, write_timeline_svg
from rpcompile.views.graph_rollup import rollup
from rpcompile.views.graphview import graph_dot, graph_svg, write_graph


def TimelineBar(device, lane, kind, stage, microbatch, start, end, action=""):  # noqa: N802 - reads like a type
    """A simulator event, written in the order these tests read best."""
    return SimEvent(action, device, lane, kind, stage, microbatch, start, end)
from rpcompile.views.svg import esc, stage_color

SVG = "{http://www.w3.org/2000/svg}"
NAMES = ["F0", "F1", "FB", "B1", "B2"]


def bars_two_devices() -> list[SimEvent]:
    """Five stages round-robin on two devices, two microbatches, with overlapping uploads on device 0."""
    out = [
        TimelineBar(0, "upload", "weights", 0, -1, 0.000, 0.004, "0W"),
        TimelineBar(0, "upload", "activations", 0, 0, 0.001, 0.002, "0F0<"),  # overlaps 0W
        TimelineBar(0, "upload", "weights", 2, -1, 0.003, 0.007, "2W"),       # overlaps 0W too
    ]
    t = 0.004
    for k in range(5):
        for j in range(2):
            out.append(TimelineBar(k % 2, "compute", "compute", k, j, t, t + 0.002, f"{k}F{j}"))
            t += 0.002
        if k >= 2:
            out.append(TimelineBar(k % 2, "download", "gradients", k, -1, t, t + 0.001, f"{k}G"))
    return out


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg.encode())


def titled_rects(root: ET.Element) -> list[ET.Element]:
    return [r for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]


# ---- timeline ---------------------------------------------------------------------------------------------------


def test_timeline_has_one_titled_bar_per_event():
    events = bars_two_devices()
    root = parse(timeline_svg(events, devices=2, stage_names=NAMES, title="demo"))
    bars = titled_rects(root)
    assert len(bars) == len(events)
    tips = [b.find(SVG + "title").text for b in bars]
    assert any(t.startswith("B1 (stage 3) 3F1: microbatch 1") for t in tips)
    assert {g.get("id") for g in root.iter(SVG + "g") if g.get("class") == "device"} == {"dev0", "dev1"}


def test_overlapping_transfers_get_their_own_sub_rows():
    root = parse(timeline_svg(bars_two_devices(), devices=2, stage_names=NAMES))
    ys = {}
    for r in titled_rects(root):
        tip = r.find(SVG + "title").text
        for action in ("0W", "0F0<", "2W"):
            if f" {action}" in tip and "upload" in tip:
                ys[action] = float(r.get("y"))
    assert len(ys) == 3
    # both overlap 0W; 2W starts after 0F0< ended, so it may reuse that sub-row but never 0W's
    assert ys["0F0<"] != ys["0W"] and ys["2W"] != ys["0W"]


def test_time_axis_covers_the_last_bar():
    events = bars_two_devices()
    root = parse(timeline_svg(events, devices=2))
    ticks = [float(t.get("data-t")) for t in root.iter(SVG + "text") if t.get("class") == "tick"]
    assert ticks == sorted(ticks) and ticks[0] == 0.0
    assert ticks[-1] >= max(e.end for e in events)
    assert len(ticks) >= 3


def test_timeline_reads_stage_and_kind_from_the_action_text():
    class Bare:  # an event with only the essentials: the rest comes from its action
        def __init__(self, action, lane, start, end):
            self.action, self.device, self.lane, self.start, self.end = action, 0, lane, start, end

    svg = timeline_svg([Bare("1W", "upload", 0.0, 0.001), Bare("1F2", "compute", 0.001, 0.002)], devices=1,
                       stage_names=["F0", "F1"])
    tips = [r.find(SVG + "title").text for r in titled_rects(parse(svg))]
    assert sorted(t.split(":")[0] for t in tips) == ["F1 (stage 1) 1F2", "weights of F1 (stage 1) 1W"]
    assert any(t.startswith("F1 (stage 1) 1F2: microbatch 2, 1–2 ms") for t in tips)
    with pytest.raises(ConfigError, match="runs on device 3, but devices=2"):
        timeline_svg([TimelineBar(3, "compute", "compute", 0, 0, 0.0, 1.0, "0F0")], devices=2)


def test_twenty_thousand_bars_build_quickly(tmp_path):
    events = [TimelineBar(i % 8, ("compute", "upload", "download")[i % 3],
                          ("compute", "weights", "activations")[i % 3], i % 100, i % 5, i * 1e-4, i * 1e-4 + 3e-4,
                          f"{i % 100}F{i % 5}") for i in range(20_000)]
    t0 = time.perf_counter()
    svg = timeline_svg(events, devices=8, stage_names=[f"F{k}" for k in range(100)])
    assert time.perf_counter() - t0 < 5.0  # a guard, not a benchmark (about 0.3 s here)
    assert len(titled_rects(parse(svg))) == len(events)
    assert write_timeline_svg(tmp_path / "t.svg", events[:10], devices=8).read_text().startswith("<?xml")


def test_adjacent_stage_colours_differ():
    colours = [stage_color(k) for k in range(100)]
    assert all(a != b for a, b in zip(colours, colours[1:]))
    assert len(set(colours)) == 100
    assert esc('a<b & "c"') == "a&lt;b &amp; &quot;c&quot;"


# ---- plan graph -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    spec = load_model("llama-demo")
    plan = rpcompile.plan(spec.model, spec.example_inputs, gpus=2, spec="cpu")
    gm = rpcompile.trace(spec.model, spec.example_inputs)
    return spec.model, plan, gm


def boxes_of(svg: str) -> dict[str, ET.Element]:
    groups = [g for g in parse(svg).iter(SVG + "g") if "module" in (g.get("class") or "").split()]
    names = [g.get("data-module") for g in groups]
    assert len(names) == len(set(names)), "a module drawn twice"
    return dict(zip(names, groups))


def expected_modules(model, depth: int) -> set[str]:
    """Modules at ``depth`` plus shallower leaves (``embed``, ``lm_head``): what the boxes must be."""
    names = [n for n, _ in model.named_modules() if n]
    at = {n for n in names if n.count(".") + 1 == depth}
    leaves = {n for n in names if n.count(".") + 1 < depth and not any(m.startswith(n + ".") for m in names)}
    return at | leaves


def test_graph_svg_has_one_box_per_module(demo):
    model, plan, gm = demo
    r = rollup(plan, gm)
    assert r.depth == 3  # layers.N.attn: one below the module list
    boxes = boxes_of(graph_svg(plan, gm))
    # q_norm/k_norm are Identity modules at depth 4 and roll into layers.N.attn
    assert set(boxes) == expected_modules(model, r.depth)


def test_graph_boxes_carry_their_stages(demo):
    _, plan, gm = demo
    boxes = boxes_of(graph_svg(plan, gm))
    node = next(n for n in gm.graph.nodes if n.name == "layers_1_mlp_down_proj")
    fwd = next(s.name for s in plan.stages if s.kind != "backward" and node.name in s.nodes)
    bwd = next(s.name for s in plan.stages if s.kind != "forward" and node.name in s.nodes)
    box = boxes["layers.1.mlp"]
    label = " ".join(t.text or "" for t in box.iter(SVG + "text"))
    assert (box.get("data-forward"), box.get("data-backward")) == (fwd, bwd)
    assert (f"{fwd} | {bwd}" if (fwd, bwd) != ("FB", "FB") else "FB") in label
    assert boxes["lm_head"].get("data-forward") == "FB"  # the last nodes are the fused stage


def test_saved_marker_iff_a_node_is_saved(demo):
    _, plan, gm = demo
    saved = set(plan.saved)
    by_box = {b.name: b.nodes for b in rollup(plan, gm).boxes}
    boxes = boxes_of(graph_svg(plan, gm))
    marked = {name for name, g in boxes.items() if "saved" in g.get("class").split()}
    assert marked == {name for name, nodes in by_box.items() if saved & set(nodes)}
    assert marked and marked != set(boxes)  # this plan saves some modules (not the fused stage's)
    for name, g in boxes.items():
        assert ("saved" in [t.text for t in g.iter(SVG + "text")]) == (name in marked)


def test_graph_dot_and_write_graph(demo, tmp_path):
    _, plan, gm = demo
    dot = graph_dot(plan, gm)
    n_boxes = len(rollup(plan, gm).boxes)
    assert dot.startswith("digraph plan {") and dot.rstrip().endswith("}")
    assert len(re.findall(r'^\s*"[^"]+" \[label=', dot, flags=re.M)) == n_boxes
    assert write_graph(tmp_path / "g.dot", plan, gm).read_text() == dot
    assert parse(write_graph(tmp_path / "g.svg", plan).read_text()) is not None  # no graph: plan order
    with pytest.raises(ConfigError, match=re.escape(
            f"cannot write a plan graph to {str(tmp_path / 'g.png')!r}: the file name must end in .svg or .dot")):
        write_graph(tmp_path / "g.png", plan, gm)


def test_without_a_graph_the_plan_alone_gives_the_same_boxes(demo):
    _, plan, gm = demo
    with_graph, alone = rollup(plan, gm), rollup(plan)
    assert [b.name for b in alone.boxes] == [b.name for b in with_graph.boxes]
    assert [b.stage_label for b in alone.boxes] == [b.stage_label for b in with_graph.boxes]
    # Stage.saved_modules places saved activations on the same boxes (counts are modules, not nodes)
    assert [bool(b.saved) for b in alone.boxes] == [bool(b.saved) for b in with_graph.boxes]
    # a plan written before saved_modules existed cannot place them: no marker rather than a wrong one
    old = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, saved_modules=()) for s in plan.stages))
    assert all(b.saved is None for b in rollup(old).boxes) or not plan.saved


def test_thirty_two_layers_stay_legible():
    spec = load_model("llama-32x64")
    gm = rpcompile.trace(spec.model, spec.example_inputs)
    # the roll-up needs only stage membership: a hand-cut plan (half forward, half fused) skips costing
    n = len(compute_nodes(gm))
    plan = plan_from_ranges(gm, forward=[(0, n // 2)], fused=(n // 2, n), backward=[(0, n // 2)],
                            hardware=make_hardware(2, "cpu"), microbatches=3)
    boxes = boxes_of(graph_svg(plan, gm))
    assert 100 <= len(boxes) <= 150
    assert {"embed", "layers.7.attn", "layers.7.mlp", "norm", "lm_head"} <= set(boxes)
