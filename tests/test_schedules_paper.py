"""Our baselines against the RoundPipe paper's own simulator, on its inputs (issue 19, deliverable 7).

``benchmarks/data/roundpipe-simulator-inputs.json`` carries, per model, the makespans that simulator printed for
those inputs and partitions (``reported_makespan_ms``). Its static schedules recompute every layer's forward
before the layer's backward (full activation checkpointing, the LM head not recomputed); ours keep activations
unless asked (``static_recompute=True``). Pinned here: with the paper's recompute we reproduce its figures, and
without it our static baselines are never slower than the paper's (the stronger baseline).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rpcompile.tools.scenarios import layer_profile_scenarios, load_layer_profile

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "benchmarks" / "data" / "roundpipe-simulator-inputs.json"
MODELS = tuple(json.loads(PROFILE.read_text())["models"])
STATIC = ("gpipe", "1f1b", "interleaved-1f1b")

sys.path.insert(0, str(ROOT / "benchmarks"))
import schedules  # noqa: E402  (benchmarks/ is scripts, not a package)


def _iterations(model: str, *, static_recompute: bool) -> tuple[dict[str, float], dict[str, float]]:
    entry, n, m = load_layer_profile(PROFILE, model)
    names = (*STATIC, "roundpipe")
    scs = layer_profile_scenarios(entry, devices=n, microbatches=m, schedules=names, static_recompute=static_recompute)
    reported = {k: v * 1e-3 for k, v in entry["reported_makespan_ms"].items()}
    return {k: sc.run().iteration_time_s for k, sc in scs.items()}, reported


def test_the_file_carries_the_papers_makespans_for_every_model():
    assert MODELS == ("qwen3-1.7b", "llama3-8b", "gpt-oss-20b", "qwen3-32b", "qwen3-235b-a22b")
    for model in MODELS:
        entry, _, _ = load_layer_profile(PROFILE, model)
        assert set(entry["reported_makespan_ms"]) == {*STATIC, "roundpipe"}


@pytest.mark.parametrize("model", MODELS)
def test_with_the_papers_recompute_the_static_schedules_reproduce_its_simulator(model):
    ours, paper = _iterations(model, static_recompute=True)
    for name in STATIC:
        assert ours[name] == pytest.approx(paper[name], rel=1e-3), (model, name)


@pytest.mark.parametrize("model", MODELS)
def test_our_static_baselines_are_never_weaker_than_the_papers(model):
    """Keeping activations (no memory limit on these profiles) is 13–30% faster than the paper's figures."""
    ours, paper = _iterations(model, static_recompute=False)
    for name in STATIC:
        assert ours[name] < paper[name] * 0.9, (model, name, ours[name], paper[name])
    # round-robin does not recompute differently: the static switch leaves it alone, within 10% of the paper's
    # (the paper's simulator runs microbatches in rounds of N and lets a backward stage recompute before its
    # incoming gradient lands; RESULTS.md, schedules section)
    rec, _ = _iterations(model, static_recompute=True)
    assert rec["roundpipe"] == ours["roundpipe"]
    assert ours["roundpipe"] == pytest.approx(paper["roundpipe"], rel=0.10)


def test_the_recompute_adds_one_forward_per_layer_to_each_backward_stage_only():
    entry, n, m = load_layer_profile(PROFILE, "llama3-8b")
    kept = layer_profile_scenarios(entry, devices=n, microbatches=m, schedules=("1f1b",))["1f1b"]
    rec = layer_profile_scenarios(entry, devices=n, microbatches=m, schedules=("1f1b",), static_recompute=True)["1f1b"]
    f = entry["fwd_ms_per_layer"] * 1e-3
    for a, b in zip(kept.stages, rec.stages):
        extra = 4 * f if a.kind == "backward" else 0.0  # 4 layers per stage; the head is not recomputed
        assert b.compute_s == pytest.approx(a.compute_s + extra), a.name


def test_the_benchmark_checks_pass_and_name_every_model():
    data = {}
    for model in MODELS:
        entry, n, m = load_layer_profile(PROFILE, model)
        scs = layer_profile_scenarios(entry, devices=n, microbatches=m, schedules=(*STATIC, "roundpipe"))
        scs |= {f"{k}-recompute": sc for k, sc in layer_profile_scenarios(
            entry, devices=n, microbatches=m, schedules=STATIC, static_recompute=True).items()}
        reported = entry["reported_makespan_ms"]
        data[model] = {k: {"iteration_time_s": sc.run().iteration_time_s,
                           "paper_iteration_time_s": reported[k.removesuffix("-recompute")] * 1e-3}
                       for k, sc in scs.items()}
    checks = schedules.paper_checks(data)
    assert len(checks) == len(MODELS) * (2 * len(STATIC) + 1)
    assert all(ok for _, ok in checks), [t for t, ok in checks if not ok]
