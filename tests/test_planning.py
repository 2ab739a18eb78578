"""Planning end to end (rpcompile.planner.planning and ``rpcompile plan``): model → costed segments → solver → Plan.

Costs are analytic (``spec="rtx4090"``) wherever a figure is compared, so every run sees the same numbers and the
solver (deterministic limits) returns the same plan. Models are the tiny built-ins; each test takes well under a
second after the module-scoped fixtures have planned once.
"""

from __future__ import annotations

import json
import re

import pytest

from rpcompile.core.errors import BatchSplitError
import torch

import rpcompile
from rpcompile.cli import main
from rpcompile.core.batch import split_microbatches
from rpcompile.core.errors import InfeasibleError
from rpcompile.core.plan import Plan
from rpcompile.core.specs import get_spec
from rpcompile.models.registry import load_model
from rpcompile.passes.formulate import partition_problem
from rpcompile.passes.graph.util import compute_nodes, node_params
from rpcompile.passes.rewrite.coarsen import segments_of
from rpcompile.passes.solver.problem import SegmentPlan
from rpcompile.passes.solver.tables import min_feasible_memory
from rpcompile.passes.solver.timing import iteration_time, stage_costs
from rpcompile.planner import planning
from rpcompile.planner.invariants import plan_violations, verify_plan
from rpcompile.planner.plan_options import PlanOptions, PLAN_STRATEGIES, make_hardware
from rpcompile.planner.planning import compare, plan, plan_graph, prepare
from rpcompile.tools.scenarios import from_plan
from rpcompile.tools.staleness import stays_of, sums_of

SPEC = "rtx4090"
TIME_LIMIT = 2.0
JSON_FIELDS = {"feasible", "iteration_time_s", "bound_s", "solve_time_s", "bubble_fraction", "peak_memory_bytes",
               "forward_stages", "backward_stages", "recompute_fraction"}


# ---- helpers -------------------------------------------------------------------------------------------------
def expected_names(p: Plan) -> list[str]:
    f, b = len(p.forward_stages), len(p.backward_stages)
    return [f"F{i}" for i in range(f)] + ["FB"] + [f"B{i}" for i in range(1, b + 1)]


def retrace(ms, microbatches: int):
    """Trace the model the way planning does: on the first microbatch of the example batch."""
    return rpcompile.trace(ms.model, split_microbatches(ms.example_inputs, microbatches)[0])


def segment_plan_of(p: Plan, gm) -> SegmentPlan:
    """Rebuild the solver's SegmentPlan from a Plan's node names (the inverse of ``planning.to_plan``)."""
    segs = segments_of(gm)
    seg_of = {n: s.index for s in segs for n in s.nodes}

    def span(stage) -> tuple[int, int]:
        ids = [seg_of[n] for n in stage.nodes]
        assert ids == sorted(ids), f"stage {stage.name} is not ascending in segments"
        # a stage must cover whole segments: its first node starts one and its last node ends one
        assert stage.nodes[0] == segs[ids[0]].nodes[0] and stage.nodes[-1] == segs[ids[-1]].nodes[-1], stage.name
        return ids[0], ids[-1] + 1

    saved = set(p.saved)
    fused = span(p.fused_stage)
    return SegmentPlan(
        forward=tuple(span(s) for s in p.forward_stages),
        fused=fused,
        backward=tuple(span(s) for s in p.backward_stages),
        saved=tuple(all(n in saved for n in s.nodes) for s in segs),
        stays=stays_of(p, segs, fused[0]),
        resident=p.resident,
        accumulates=sums_of(p, segs, gm),
    )


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return load_model("llama-demo", seed=0)


@pytest.fixture(scope="module")
def llama_plans(llama):
    """The ilp plan of llama-demo on 2 and 3 devices with default microbatches and memory."""
    return {g: plan(llama.model, llama.example_inputs, gpus=g, spec=SPEC, time_limit_s=TIME_LIMIT) for g in (2, 3)}


@pytest.fixture(scope="module")
def llama_graph(llama):
    """llama-demo costed and coarsened for 3 devices (4 microbatches), with its hardware."""
    gm, m = prepare(llama.model, llama.example_inputs, PlanOptions(gpus=3, spec=SPEC))
    return gm, m, make_hardware(3, SPEC)


# ---- split_microbatches ---------------------------------------------------------------------------------------
def test_split_microbatches_even_and_uneven():
    x, y = torch.arange(14).reshape(7, 2), torch.arange(7)
    pieces = split_microbatches((x, y, "mode", torch.tensor(3.0)), 3)
    assert len(pieces) == 3
    assert [p[0].shape[0] for p in pieces] == [3, 2, 2]  # tensor_split: sizes differ by at most one, largest first
    assert [p[1].tolist() for p in pieces] == [[0, 1, 2], [3, 4], [5, 6]]
    assert all(p[2] == "mode" and p[3].item() == 3.0 for p in pieces)  # non-batched values are repeated
    torch.testing.assert_close(torch.cat([p[0] for p in pieces]), x)
    assert [p[0].shape[0] for p in split_microbatches((torch.zeros(8, 3),), 4)] == [2, 2, 2, 2]
    assert split_microbatches((torch.zeros(5),), 5)[4][0].shape == (1,)


def test_split_microbatches_errors():
    with pytest.raises(BatchSplitError, match=r"^a batch of 2 cannot be split into 3 microbatches; use microbatches "
                                              r"between 1 and 2 \(--microbatches\) or a larger batch \(--batch-size\)$"):
        split_microbatches((torch.zeros(2, 4),), 3)
    with pytest.raises(ValueError, match="a batch of 4 cannot be split into 0 microbatches"):
        split_microbatches((torch.zeros(4),), 0)
    with pytest.raises(ValueError, match=re.escape("inputs disagree on the batch size (dim 0): [2, 3]")):
        split_microbatches((torch.zeros(2), torch.zeros(3)), 1)


def test_plan_rejects_a_batch_too_small_for_the_microbatches(llama):
    # llama-demo's example batch is 4; 4 devices default to 5 microbatches
    with pytest.raises(ValueError, match="a batch of 4 cannot be split into 5 microbatches"):
        plan(llama.model, llama.example_inputs, gpus=4, spec=SPEC)


# ---- hardware and argument checks ----------------------------------------------------------------------------
def test_make_hardware():
    spec = get_spec(SPEC)
    hw = make_hardware(4, SPEC)
    assert (hw.device_count, hw.spec, hw.memory_bytes) == (4, spec, spec.usable_memory_bytes)
    assert hw.link_bytes_per_s == spec.host_link_bandwidth
    assert make_hardware(2, spec, 20 * 2**30).memory_bytes == 20 * 2**30
    with pytest.raises(ValueError, match="gpus must be >= 1, got 0"):
        make_hardware(0, SPEC)
    with pytest.raises(ValueError, match="unknown device spec 'nope'"):
        make_hardware(1, "nope")


def test_bad_strategy_and_precision(llama, llama_graph):
    gm, m, hw = llama_graph
    with pytest.raises(ValueError, match=r"unknown strategy 'magic'; choose one of ilp, dp, roundpipe, uniform"):
        plan_graph(gm, hardware=hw, microbatches=m, strategy="magic")
    with pytest.raises(ValueError, match=r"precision must be one of \['bf16', 'fp16', 'fp32'\], got 'fp8'"):
        plan(llama.model, llama.example_inputs, gpus=2, spec=SPEC, precision="fp8")


# ---- rpcompile.planner.planning.plan ------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus", [2, 3])
def test_plan_shape_and_verification(llama, llama_plans, gpus):
    p = llama_plans[gpus]
    assert p.microbatches == gpus + 1  # docs/architecture.md §3 default
    assert p.strategy == "ilp" and p.precision == "fp32" and p.cost_model
    assert p.hardware.device_count == gpus and p.hardware.spec.name == SPEC
    assert p.hardware.memory_bytes == get_spec(SPEC).usable_memory_bytes
    assert [s.name for s in p.stages] == expected_names(p)
    kinds = [s.kind for s in p.stages]
    assert kinds == ["forward"] * len(p.forward_stages) + ["fused"] + ["backward"] * len(p.backward_stages)
    assert p.forward_stages and p.backward_stages  # 4 layers on >= 2 devices: a real pipeline
    verify_plan(p, retrace(llama, p.microbatches))
    verify_plan(p, rpcompile.trace(llama.model, llama.example_inputs))  # fx graphs do not depend on the batch
    for s in p.stages:
        assert 0 < s.memory_bytes <= p.hardware.memory_bytes, s.name
        assert s.time_s > 0, s.name
    assert p.predicted.peak_memory_bytes == max(s.memory_bytes for s in p.stages)
    assert 0 <= p.predicted.bubble_fraction < 1
    assert p.stats["status"] in ("OPTIMAL", "FEASIBLE") and p.stats["segments"] >= 8


@pytest.mark.parametrize("gpus", [2, 3])
def test_prediction_matches_the_timing_model(llama, llama_plans, gpus):
    """The plan's figures are exactly the shared timing model's on the rebuilt segment plan."""
    p = llama_plans[gpus]
    gm, m = prepare(llama.model, llama.example_inputs, PlanOptions(gpus=gpus, spec=SPEC))
    problem = partition_problem(gm, hardware=p.hardware, microbatches=m)
    sp = segment_plan_of(p, gm)
    assert p.predicted.iteration_time_s == pytest.approx(iteration_time(problem, sp), rel=1e-12)
    costs = stage_costs(problem, sp)
    assert [s.time_s for s in p.stages] == pytest.approx([c.time_s for c in costs], rel=1e-12)
    assert [s.memory_bytes for s in p.stages] == [c.memory_bytes for c in costs]


def test_save_load_round_trip(llama, llama_plans, tmp_path):
    for gpus, p in llama_plans.items():
        loaded = Plan.load(p.save(tmp_path / f"plan{gpus}.json"))
        assert loaded == p
        assert loaded.to_json() == p.to_json()
        verify_plan(loaded, retrace(llama, loaded.microbatches))


def test_planning_is_deterministic(llama, llama_plans):
    again = plan(llama.model, llama.example_inputs, gpus=3, spec=SPEC, time_limit_s=TIME_LIMIT)
    first = llama_plans[3]
    assert again.stages == first.stages
    assert again.predicted == first.predicted and again.model == first.model


def test_explicit_microbatches(llama):
    p = plan(llama.model, llama.example_inputs, gpus=2, spec=SPEC, microbatches=2, time_limit_s=TIME_LIMIT)
    assert p.microbatches == 2
    verify_plan(p, retrace(llama, 2))


# ---- strategies ------------------------------------------------------------------------------------------------
def test_every_strategy_verifies_and_ilp_is_never_slower(llama_graph):
    gm, m, hw = llama_graph
    rows = compare(gm, hardware=hw, microbatches=m, time_limit_s=TIME_LIMIT)
    assert list(rows) == list(PLAN_STRATEGIES) == ["ilp", "dp", "roundpipe", "uniform"]
    for name, (result, p) in rows.items():
        assert result.feasible and p is not None, name
        assert p.strategy == name and [s.name for s in p.stages] == expected_names(p)
        assert plan_violations(p, gm) == [], name
        assert p.predicted.iteration_time_s == pytest.approx(result.objective, rel=1e-12), name
    ilp_time = rows["ilp"][1].predicted.iteration_time_s
    for name in ("dp", "roundpipe", "uniform"):
        assert ilp_time <= rows[name][1].predicted.iteration_time_s * (1 + 1e-12), name
    # full recompute in the baselines: their forward stages save nothing
    for name in ("dp", "roundpipe", "uniform"):
        assert rows[name][1].saved == (), name
    assert rows["ilp"][1].predicted.bound_s > 0


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_graph_agrees_with_compare(llama_graph, strategy):
    gm, m, hw = llama_graph
    single = plan_graph(gm, hardware=hw, microbatches=m, strategy=strategy, time_limit_s=TIME_LIMIT)
    _, from_compare = compare(gm, hardware=hw, microbatches=m, time_limit_s=TIME_LIMIT)[strategy]
    assert single.stages == from_compare.stages


def test_compare_takes_the_baselines_the_ilp_seeds_with_as_solved_alone(llama_graph, monkeypatch):
    """compare() reuses the ILP's dp/roundpipe/uniform seeds: each is the result its strategy gives alone (its
    plan, objective and figures; only the measured solve time differs), and no baseline is solved twice."""
    gm, m, hw = llama_graph
    solved: list[str] = []
    real = planning.solve
    monkeypatch.setattr(planning, "solve", lambda pb, name, **kw: solved.append(name) or real(pb, name, **kw))
    rows = compare(gm, hardware=hw, microbatches=m, time_limit_s=TIME_LIMIT)
    assert solved == []  # the ILP ran directly; the baselines came with it
    pb = partition_problem(gm, hardware=hw, microbatches=m)
    for name in ("dp", "roundpipe", "uniform"):
        alone, (kept, made) = real(pb, name, time_limit_s=TIME_LIMIT), rows[name]
        assert (kept.strategy, kept.feasible, kept.plan, kept.objective) == \
            (alone.strategy, alone.feasible, alone.plan, alone.objective), name
        assert kept.stats == alone.stats and made is not None and made.stages == plan_graph(
            gm, hardware=hw, microbatches=m, strategy=name, time_limit_s=TIME_LIMIT).stages, name


def test_no_saving_means_full_recompute(llama_graph):
    gm, m, hw = llama_graph
    free = plan_graph(gm, hardware=hw, microbatches=m, time_limit_s=TIME_LIMIT)
    recompute = plan_graph(gm, hardware=hw, microbatches=m, time_limit_s=TIME_LIMIT, allow_save=False)
    assert recompute.saved == ()
    assert set(recompute.recomputed) == {n for s in recompute.backward_stages for n in s.nodes}
    assert plan_violations(recompute, gm) == []
    assert free.predicted.iteration_time_s <= recompute.predicted.iteration_time_s * (1 + 1e-12)


def test_a_plan_for_overlapped_iterations_minimises_the_period_and_says_so(llama, llama_graph, tmp_path):
    """``overlap=True`` plans for overlapped iterations: the prediction is the steady-state period (the timing
    model's on the rebuilt plan, as the simulator plays it within 2%), never longer than the period the
    synchronous plan would run at, and it records the mode, which ``rpcompile check`` re-prices it in."""
    gm, m, hw = llama_graph
    sync = plan_graph(gm, hardware=hw, microbatches=m, time_limit_s=TIME_LIMIT)
    over = plan_graph(gm, hardware=hw, microbatches=m, time_limit_s=TIME_LIMIT, overlap=True)
    assert over.predicted.overlap_iterations and over.predicted.overlap_step and not sync.predicted.overlap_iterations
    problem = partition_problem(gm, hardware=hw, microbatches=m, overlap_iterations=True)
    assert over.predicted.iteration_time_s == pytest.approx(iteration_time(problem, segment_plan_of(over, gm)),
                                                            rel=1e-12)
    assert over.predicted.iteration_time_s <= iteration_time(problem, segment_plan_of(sync, gm)) * (1 + 1e-12)
    assert over.predicted.iteration_time_s < over.predicted.pipeline_s + over.predicted.host_s
    assert over.inputs["options"]["overlap"] is True and "overlap" not in sync.inputs["options"]
    sim = from_plan(over).run()
    assert sim.iterations > 1 and sim.iteration_time_s == pytest.approx(over.predicted.iteration_time_s, rel=0.02)
    path = over.save(tmp_path / "over.json")
    assert main(["check", str(path), "llama-demo"]) == 0  # priced as a plan for overlapped iterations: not stale


# ---- tied parameters ----# ---- tied parameters ----------------------------------------------------------------------------------------------
def test_tied_embedding_is_listed_by_every_stage_reading_it():
    """The table on the devices (with it on the host only the head's stage reads it: tests/test_host.py)."""
    ms = load_model("gpt-demo", seed=0)
    p = plan(ms.model, ms.example_inputs, gpus=2, spec=SPEC, time_limit_s=TIME_LIMIT, host_embedding=False)
    gm = retrace(ms, p.microbatches)
    verify_plan(p, gm)
    by_name = {n.name: n for n in compute_nodes(gm)}
    readers = [s.name for s in p.stages if any("wte.weight" in node_params(gm, by_name[n]) for n in s.nodes)]
    listing = [s.name for s in p.stages if "wte.weight" in s.params]
    assert readers == listing
    # the embedding (first forward stage, last backward stage) and the tied LM head (fused stage)
    assert {"F0", "FB", p.backward_stages[-1].name} <= set(listing)
    assert "lm_head.weight" not in dict(gm.named_parameters())  # one parameter, not two copies
    problem = partition_problem(gm_costed := prepare(ms.model, ms.example_inputs, PlanOptions(gpus=2, spec=SPEC,
                                                     host_embedding=False))[0],
                                hardware=p.hardware, microbatches=p.microbatches)
    shared = {sp.name: sp.segments for sp in problem.shared}
    assert set(shared) == {"wte.weight"}
    assert shared["wte.weight"][0] == 0 and shared["wte.weight"][-1] == len(segments_of(gm_costed)) - 1


# ---- memory budget ------------------------------------------------------------------------------------------------
def test_infeasible_budget_names_the_minimum_and_the_segment(llama, llama_graph):
    gm, m, _ = llama_graph
    need, seg = min_feasible_memory(partition_problem(gm, hardware=make_hardware(3, SPEC, 1000), microbatches=m))
    name = segments_of(gm)[seg].name
    size = r"\d+(\.\d+)? (GiB|MiB|KiB|B)"  # GiB today ("0.00 GiB" for a tiny model); any unit is fine
    pattern = (rf"^no plan fits {size} per device: segment {seg} \({re.escape(name)}\) needs at least {size} "
               rf".*allow at least {need} bytes per device \(memory_limit= / --memory-limit\), use more microbatches")
    with pytest.raises(InfeasibleError, match=pattern) as info:
        plan(llama.model, llama.example_inputs, gpus=3, spec=SPEC, memory_limit=1000)
    reported = int(re.search(r"allow at least (\d+) bytes", str(info.value)).group(1))
    assert reported == need
    # exactly the minimum fits, and every stage respects it; one byte less does not
    p = plan(llama.model, llama.example_inputs, gpus=3, spec=SPEC, memory_limit=reported, time_limit_s=TIME_LIMIT)
    assert p.hardware.memory_bytes == reported
    assert max(s.memory_bytes for s in p.stages) <= reported
    verify_plan(p, retrace(llama, p.microbatches))
    with pytest.raises(InfeasibleError, match=f"allow at least {need} bytes per device"):
        plan_graph(gm, hardware=make_hardware(3, SPEC, reported - 1), microbatches=m)


def test_tighter_budget_gives_smaller_stages(llama_graph):
    gm, m, hw = llama_graph
    roomy = plan_graph(gm, hardware=hw, microbatches=m, time_limit_s=TIME_LIMIT)
    budget = roomy.predicted.peak_memory_bytes - 1
    tight = plan_graph(gm, hardware=make_hardware(3, SPEC, budget), microbatches=m, time_limit_s=TIME_LIMIT)
    assert tight.predicted.peak_memory_bytes <= budget < roomy.predicted.peak_memory_bytes
    assert plan_violations(tight, gm) == []


# ---- the command line --------------------------------------------------------------------------------------------
def test_cli_json_compare_schema(capsys):
    code, out, err = cli(capsys, "plan", "llama-demo", "--gpus", "2", "--spec", SPEC, "--json", "--compare",
                         "--time-limit", str(TIME_LIMIT))
    assert code == 0, err
    data = json.loads(out)
    assert list(data) == ["strategies"] and list(data["strategies"]) == ["ilp", "dp", "roundpipe", "uniform"]
    for name, row in data["strategies"].items():
        assert set(row) == JSON_FIELDS, name
        assert row["feasible"] is True
        assert row["iteration_time_s"] > 0 and row["solve_time_s"] >= 0 and row["peak_memory_bytes"] > 0
        assert isinstance(row["forward_stages"], int) and row["forward_stages"] >= 1
        assert isinstance(row["backward_stages"], int) and row["backward_stages"] >= 1
        assert 0 <= row["bubble_fraction"] < 1 and 0 <= row["recompute_fraction"] <= 1
    rows = data["strategies"]
    assert rows["ilp"]["bound_s"] > 0
    assert all(rows["ilp"]["iteration_time_s"] <= r["iteration_time_s"] * (1 + 1e-12) for r in rows.values())
    assert all(rows[b]["recompute_fraction"] == 1.0 for b in ("dp", "roundpipe", "uniform"))


def test_cli_writes_a_plan_that_verifies_and_prints_every_stage(capsys, tmp_path, llama):
    path = tmp_path / "plan.json"
    code, out, err = cli(capsys, "plan", "llama-demo", "--gpus", "3", "--spec", SPEC, "-o", str(path),
                         "--time-limit", str(TIME_LIMIT))
    assert code == 0, err
    p = Plan.load(path)
    assert p.precision == "bf16" and p.strategy == "ilp" and p.microbatches == 4  # the CLI defaults
    verify_plan(p, retrace(llama, p.microbatches))
    table_stages = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    for s in p.stages:
        assert s.name in table_stages, s.name
    for name in PLAN_STRATEGIES:  # the comparison table
        assert any(line.split("│")[1].strip() == name for line in out.splitlines() if line.startswith("│"))
    assert f"plan written to {path}" in out


def test_cli_json_plan_is_the_plan_file(capsys, tmp_path):
    path = tmp_path / "p.json"
    code, out, _ = cli(capsys, "plan", "llama-demo", "--gpus", "2", "--spec", SPEC, "--strategy", "roundpipe",
                       "--json", "-o", str(path), "--time-limit", str(TIME_LIMIT))
    assert code == 0
    assert json.loads(out) == json.loads(path.read_text())
    assert Plan.load(path).strategy == "roundpipe"


def test_cli_infeasible_budget_is_one_line(capsys):
    # 1 MiB still fits llama-demo in bf16 (a 9-stage plan), 64 KiB does not
    code, out, err = cli(capsys, "plan", "llama-demo", "--gpus", "2", "--spec", SPEC, "--memory-limit", "64KiB")
    assert code == 2 and out == ""
    assert err.startswith("rpcompile: error: no plan fits") and err.count("\n") == 1
    need = int(re.search(r"allow at least (\d+) bytes", err).group(1))
    assert need > 64 * 2**10


@pytest.mark.hf
def test_the_readme_s_planning_calls_take_an_hf_model_as_it_comes():
    """``rpcompile.plan`` and ``rpcompile.profile`` on an HF causal LM with just its ids (docs/plans-and-cli.md, "Planning and
    costing"): the trace adds ``use_cache=False``, and the shape and cost passes run the graph on those same inputs
    (they once missed it: "Expected positional argument for parameter use_cache")."""
    from _hf import VOCAB, hf_model

    model = hf_model("llama")
    ids = torch.randint(0, VOCAB, (6, 8))
    made = rpcompile.plan(model, (ids,), gpus=2, spec="rtx4090", precision="bf16", time_limit_s=10.0)
    planned = {p for s in made.stages for p in s.params}
    # every parameter is in a stage but the token embedding table, which is looked up on the host
    assert {n for n, _ in model.named_parameters()} - planned == {"model.embed_tokens.weight"}
    prof = rpcompile.profile(model, (ids,), spec="rtx4090")
    assert prof.total.fwd_time_s > 0 and prof.total.params == sum(p.numel() for p in model.parameters())
    assert model.config.use_cache is True


def test_one_plan_options_object_plans_and_compiles_as_the_keywords_do():
    """``rpcompile.PlanOptions`` holds the planner's options at once (one set for several models or calls):
    ``plan(options=)`` makes the plan the keywords make, ``compile(options=)`` runs it, and a planner keyword given
    beside it — or what compile chooses itself — is refused in one line."""
    spec = load_model("gpt-demo")
    (x,), y = spec.example_inputs, spec.example_target
    options = rpcompile.PlanOptions(gpus=2, spec="cpu", microbatches=2, time_limit_s=2.0, head_chunks=1)
    keywords = dict(gpus=2, spec="cpu", microbatches=2, time_limit_s=2.0, head_chunks=1)
    by_options = rpcompile.plan(spec.model, (x,), options=options)
    assert by_options.to_dict()["stages"] == rpcompile.plan(spec.model, (x,), **keywords).to_dict()["stages"]
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], options=options)
    assert pipe.plan.to_dict()["stages"] == by_options.to_dict()["stages"] and pipe.microbatches == 2
    assert torch.isfinite(pipe.forward_backward(x, target=y))
    with pytest.raises(rpcompile.ConfigError) as e:
        rpcompile.plan(spec.model, (x,), options=options, microbatches=4, strategy="dp")
    assert str(e.value) == ("plan: microbatches, strategy given beside options=; give the planner's options either "
                            "as keywords or in options=PlanOptions(...), not both")
    with pytest.raises(rpcompile.ConfigError, match=r"^compile: precision given beside options="):
        rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], options=options,
                          precision="bf16")
    with pytest.raises(rpcompile.ConfigError, match=r"^options.gpus is 2 but 3 devices were given"):
        rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu"] * 3, options=options)
    with pytest.raises(rpcompile.ConfigError, match=r"^compile measures costs on its first device"):
        rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, options=rpcompile.PlanOptions(gpus=1, threads=1))
    with pytest.raises(rpcompile.ConfigError, match=r"^options= plans the model and plan= runs a plan"):
        rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, options=options, plan=by_options)
    with pytest.raises(rpcompile.ConfigError, match=r"^plan needs the number of devices: gpus=N"):
        rpcompile.plan(spec.model, (x,))
