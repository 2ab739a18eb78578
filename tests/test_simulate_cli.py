"""``rpcompile simulate``: plan files, models and layer profiles, in the JSON format tools read."""

from __future__ import annotations

import dataclasses
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rpcompile.cli import main
from rpcompile.passes.solver.timing import pipeline_time
from rpcompile.core.plan import Plan
from rpcompile.core.stages import HostLoad
from rpcompile.tools.scenarios import SCHEDULES, from_plan

GOLDEN = Path(__file__).parent / "golden" / "llama-demo.json"
PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "roundpipe-simulator-inputs.json"
FIELDS = {"iteration_time_s", "bubble_fraction", "tokens_per_s", "peak_memory_bytes"}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_plan_file_simulates_on_its_own_hardware(capsys, tmp_path):
    plan = Plan.load(GOLDEN)
    svg = tmp_path / "t.svg"
    code, out, _ = run(capsys, "simulate", str(GOLDEN), "--json", "--timeline", str(svg))
    assert code == 0
    res = json.loads(out)["schedules"]
    assert list(res) == [plan.strategy]
    r = res[plan.strategy]
    assert FIELDS <= set(r) and len(r["peak_memory_bytes"]) == plan.hardware.device_count
    assert r["fits"] and max(r["peak_memory_bytes"]) <= plan.hardware.memory_bytes
    tokens = plan.tokens_per_microbatch * plan.microbatches
    assert r["tokens_per_s"] == pytest.approx(tokens / r["iteration_time_s"])
    # transfers and host work only add time to the plan's compute
    free = dataclasses.replace(from_plan(plan), link_bytes_per_s=math.inf, host=HostLoad()).run()
    assert free.iteration_time_s == pytest.approx(pipeline_time([s.compute_s for s in plan.stages],
                                                                plan.hardware.device_count, plan.microbatches))
    assert r["pipeline_s"] >= free.iteration_time_s
    # the host's optimizer step and copy refresh follow the pipeline, as the plan predicts them
    assert plan.predicted.host_s > 0 and r["host_step_s"] == pytest.approx(plan.predicted.host_s)
    assert r["iteration_time_s"] == pytest.approx(r["pipeline_s"] + plan.predicted.host_s)
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")


def test_a_version_1_plan_simulates_its_stage_times(tmp_path):
    data = json.loads(GOLDEN.read_text())
    data["schema_version"] = 1
    data.pop("tokens_per_microbatch")
    data["hardware"].pop("host")  # schema 3's host and the prediction's host part
    for key in ("pipeline_s", "optimizer_s", "refresh_s", "accumulate_s", "overlap_step"):
        data["predicted"].pop(key)
    for s in data["stages"]:
        for key in ("compute_s", "weight_bytes", "grad_bytes", "upload_bytes", "prefetch_bytes", "download_bytes",
                    "offload_bytes", "working_bytes", "saved_modules"):
            s.pop(key)
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    plan = Plan.load(path)
    res = from_plan(plan).run()
    assert res.iteration_time_s == pytest.approx(pipeline_time([s.time_s for s in plan.stages],
                                                               plan.hardware.device_count, plan.microbatches))
    assert res.tokens_per_iteration == 0 and res.summary()["tokens_per_s"] is None


def test_a_model_runs_every_requested_schedule(capsys, tmp_path):
    svg = tmp_path / "t.svg"
    code, out, _ = run(capsys, "simulate", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--schedules",
                       "1f1b,interleaved-1f1b,ilp", "--microbatches", "4", "--json", "--timeline", str(svg))
    assert code == 0
    res = json.loads(out)["schedules"]
    assert list(res) == ["1f1b", "interleaved-1f1b", "ilp"]
    for r in res.values():
        assert FIELDS <= set(r) and len(r["peak_memory_bytes"]) == 2 and r["tokens_per_s"] > 0
    assert res["interleaved-1f1b"]["stages"] == 4 and res["1f1b"]["stages"] == 2
    assert res["ilp"]["head_chunks"] in (1, 8)  # auto: the whole LM head or 8 chunks, whichever plans faster
    code, out, _ = run(capsys, "simulate", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--schedules", "ilp",
                       "--head-chunks", "4", "--json")
    assert code == 0 and json.loads(out)["schedules"]["ilp"]["head_chunks"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t-1f1b.svg", "t-ilp.svg", "t-interleaved-1f1b.svg"]


def test_the_papers_layer_profile(capsys):
    code, out, _ = run(capsys, "simulate", "--layer-profile", str(PROFILE), "--model", "qwen3-1.7b",
                       "--schedules", "all", "--json")
    assert code == 0
    res = json.loads(out)["schedules"]
    assert list(res) == list(SCHEDULES)
    for r in res.values():
        assert FIELDS <= set(r) and len(r["peak_memory_bytes"]) == 8 and r["tokens_per_s"] is None
    assert res["1f1b"]["bubble_fraction"] > res["interleaved-1f1b"]["bubble_fraction"] > res["roundpipe"]["bubble_fraction"]


@pytest.mark.parametrize("argv,message", [
    (["llama-demo", "--gpus", "2", "--schedules", "1f1b,zb"],
     "unknown schedule zb; choose from gpipe, 1f1b, interleaved-1f1b, roundpipe, ilp or all"),
    (["llama-demo"], "simulating model llama-demo needs --gpus N"),
    ([], "say what to simulate: a plan .json file, a MODEL with --gpus N, or --layer-profile FILE --model NAME"),
    (["--layer-profile", str(PROFILE)], "--layer-profile needs --model NAME (which model of the file to simulate)"),
    (["--layer-profile", str(PROFILE), "--model", "gpt-5"],
     f"{PROFILE} has no model 'gpt-5'; it has: qwen3-1.7b, llama3-8b, gpt-oss-20b, qwen3-32b, qwen3-235b-a22b"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    code, out, err = run(capsys, "simulate", *argv)
    assert code == 2 and out == "" and err == f"rpcompile: error: {message}\n"


def test_a_schedule_left_out_is_said_with_the_fix(capsys):
    """The default microbatches (gpus + 1) are no multiple of the devices, which interleaved 1F1B needs: the
    schedule is not dropped without a word."""
    code, out, _ = run(capsys, "simulate", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--schedules",
                       "1f1b,interleaved-1f1b", "--json")
    res = json.loads(out)
    assert code == 0 and list(res["schedules"]) == ["1f1b"] and res["microbatches"] == 3
    assert res["skipped"] == {"interleaved-1f1b": "needs microbatches a multiple of the devices (3 on 2); "
                                                  "--microbatches 4"}
    code, out, _ = run(capsys, "simulate", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--schedules",
                       "1f1b,interleaved-1f1b")
    assert code == 0 and ("interleaved-1f1b: not simulated: needs microbatches a multiple of the devices (3 on 2); "
                          "--microbatches 4") in out.splitlines()
    assert "simulated (the executor's schedules on a clock), not measured" in out
    code, out, _ = run(capsys, "simulate", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--memory-limit", "300KiB",
                       "--schedules", "1f1b,ilp", "--time-limit", "1", "--json")
    assert code == 0 and json.loads(out)["skipped"] == {"ilp": (
        "no plan fits the memory per device; raise --memory-limit, use more --microbatches or a lower --precision "
        "(rpcompile plan MODEL --strategy NAME names the memory it needs)")}


def test_a_timeline_into_a_missing_directory_is_refused_first(capsys, tmp_path):
    missing = tmp_path / "no" / "t.svg"
    code, out, err = run(capsys, "simulate", str(GOLDEN), "--timeline", str(missing))
    assert code == 2 and out == "" and err == (f"rpcompile: error: --timeline {missing}: directory {missing.parent} "
                                               f"does not exist; create it (mkdir -p {missing.parent}) or write elsewhere\n")


def test_host_bandwidth_cap_slows_a_streaming_plan(capsys):
    times = []
    for extra in ([], ["--host-bandwidth", "2MB/s"]):
        code, out, _ = run(capsys, "simulate", str(GOLDEN), "--json", *extra)
        assert code == 0
        times.append(json.loads(out)["schedules"]["ilp"]["iteration_time_s"])
    assert times[1] > times[0]
    with pytest.raises(SystemExit) as exc:  # argparse's own usage error, in one line
        main(["simulate", str(GOLDEN), "--host-bandwidth", "fast"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == ("rpcompile simulate: error: argument --host-bandwidth: not a bandwidth: 'fast' "
                                       "(examples: 100GB/s, 50GiB/s); see rpcompile simulate --help\n")


def test_a_plans_backward_stages_wait_for_the_saves_they_read():
    """``from_plan`` links each backward stage to the forward stages that saved what it uploads (by node name),
    and the simulated prefetch of every microbatch starts only after those saves have landed."""
    plan = Plan.load(GOLDEN)
    sc = from_plan(plan)
    linked = 0
    for st, ps in zip(sc.stages, plan.stages):
        if ps.kind == "backward" and ps.saved:
            assert st.saved_by and set(ps.saved) <= set().union(*(plan.stages[f].saved for f in st.saved_by))
            linked += 1
        else:
            assert st.saved_by == ()
    assert linked >= 1
    events = {e.action: e for e in sc.run().timeline}
    for k, st in enumerate(sc.stages):
        for f in st.saved_by:
            for j in range(plan.microbatches):
                assert events[f"{k}F{j}<<"].start >= events[f"{f}F{j}>>"].end - 1e-12


# ---- data parallelism: --nodes / --network ---------------------------------------------------------------------
def test_scaling_report_for_several_nodes(capsys):
    code, out, _ = run(capsys, "simulate", str(GOLDEN), "--nodes", "1,2,4", "--network", "25Gb/s,100Gb/s", "--json")
    assert code == 0
    rows = json.loads(out)["scaling"][Plan.load(GOLDEN).strategy]
    assert [(r["nodes"], r["overlap"]) for r in rows] == [(1, True), (2, True), (2, False), (4, True), (4, False)] * 2
    one = rows[0]["iteration_time_s"]
    for r in rows[1:]:
        assert 0 < r["efficiency"] <= 1 and r["efficiency"] == pytest.approx(one / r["iteration_time_s"])
        assert r["tokens_per_s"] == pytest.approx(r["nodes"] * rows[0]["tokens_per_s"] * r["efficiency"])
        if not r["overlap"]:
            assert r["reduce_exposed_s"] == pytest.approx(r["reduce_s"])  # all of it after the pipeline
    slow, fast = rows[1], rows[6]  # 2 nodes, overlapped: 25 vs 100 Gb/s
    assert fast["reduce_s"] == pytest.approx(slow["reduce_s"] / 4)
    code, _, err = run(capsys, "simulate", str(GOLDEN), "--nodes", "2")
    assert code == 2 and "--nodes and --network go together: e.g. --nodes 1,2,4,8 --network 25Gb/s,100Gb/s" in err


def test_a_plan_for_several_nodes_keeps_them_and_simulates_their_reduction(capsys, tmp_path):
    plan = Plan.load(GOLDEN)
    assert plan.hardware.nodes == 1 and "nodes" not in plan.to_dict()["hardware"]  # old plans: one node
    multi = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, nodes=4, network_bytes_per_s=1e9))
    path = multi.save(tmp_path / "p.json")
    assert Plan.load(path).hardware == multi.hardware
    code, out, _ = run(capsys, "simulate", str(path), "--json")
    r = json.loads(out)["schedules"][plan.strategy]
    assert code == 0 and r["reduce_s"] > 0 and r["reduce_exposed_s"] >= 0
    with pytest.raises(Exception, match=r"Hardware: nodes must be >= 1 and more than one needs network_bytes_per_s"):
        dataclasses.replace(plan.hardware, nodes=2)


def test_plan_nodes_need_a_network(capsys):
    code, _, err = run(capsys, "plan", "llama-demo", "--gpus", "2", "--nodes", "2")
    assert code == 2 and "--nodes 2 needs the network between the machines: add --network 25Gb/s" in err
    with pytest.raises(SystemExit):
        main(["plan", "llama-demo", "--gpus", "2", "--nodes", "2", "--network", "fast"])
    assert "not a network bandwidth: 'fast' (examples: 25Gb/s, 100Gbit/s, 3GB/s)" in capsys.readouterr().err


def test_overlapped_iterations_are_simulated_and_planned_for(capsys, tmp_path):
    """``--overlap``: a plan file's round-robin runs overlapped iterations (the steady-state period, shorter than
    its synchronous iteration, and the run's figures); a model's ilp is planned for it and roundpipe runs it, the
    static schedules stay one synchronous iteration; ``plan --overlap`` writes a plan that says so, which
    ``simulate`` then plays overlapped without the flag."""
    code, out, _ = run(capsys, "simulate", str(GOLDEN), "--json", "--overlap")
    assert code == 0
    r = next(iter(json.loads(out)["schedules"].values()))
    sync = from_plan(Plan.load(GOLDEN)).run()
    assert r["iterations"] == 15 and r["period_s"] == r["iteration_time_s"] < sync.iteration_time_s
    assert r["first_iteration_s"] >= r["period_s"] and r["fill_s"] > 0 and len(r["iteration_ends_s"]) == 15
    code, out, _ = run(capsys, "simulate", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--microbatches", "4",
                       "--schedules", "1f1b,roundpipe,ilp", "--head-chunks", "1", "--overlap", "--json")
    res = json.loads(out)["schedules"]
    assert code == 0 and "iterations" not in res["1f1b"]
    assert res["roundpipe"]["iterations"] == res["ilp"]["iterations"] == 15
    code, out, _ = run(capsys, "simulate", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--microbatches", "4",
                       "--schedules", "ilp", "--head-chunks", "1", "--overlap")
    assert code == 0 and "15 iterations overlapped (simulated): steady-state period" in out
    path = tmp_path / "over.json"
    code, out, _ = run(capsys, "plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--head-chunks", "1",
                       "--overlap", "-o", str(path))
    assert code == 0 and "iterations overlapped" in out and Plan.load(path).predicted.overlap_iterations
    code, out, _ = run(capsys, "simulate", str(path), "--json")
    r = next(iter(json.loads(out)["schedules"].values()))
    assert r["iterations"] == 15
    assert r["iteration_time_s"] == pytest.approx(Plan.load(path).predicted.iteration_time_s, rel=0.02)


def test_the_model_form_takes_the_planner_s_options_as_one_object():
    """``model_scenarios(options=PlanOptions(...))`` (what ``rpcompile simulate MODEL`` passes): every schedule on
    one problem as the keywords give it; a planner keyword beside it refused in one line."""
    from rpcompile import ConfigError, PlanOptions, load_model
    from rpcompile.tools.simulation import model_scenarios

    ms = load_model("llama-demo", device="meta")
    options = PlanOptions(gpus=2, spec="rtx4090", microbatches=3, precision="bf16", time_limit_s=1.0, head_chunks=1)
    got = model_scenarios(ms.model, ms.example_inputs, options=options, schedules=("gpipe", "roundpipe"))
    same = model_scenarios(ms.model, ms.example_inputs, gpus=2, spec="rtx4090", microbatches=3, time_limit_s=1.0,
                           head_chunks=1, schedules=("gpipe", "roundpipe"))
    assert sorted(got) == ["gpipe", "roundpipe"]
    assert {k: (s.stages, s.tokens_per_iteration) for k, s in got.items()} == \
        {k: (s.stages, s.tokens_per_iteration) for k, s in same.items()}
    with pytest.raises(ConfigError, match=r"^model_scenarios: microbatches given beside options="):
        model_scenarios(ms.model, ms.example_inputs, options=options, microbatches=4)
