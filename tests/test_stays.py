"""Weights that stay on their device, planning side: the walk (:func:`rpcompile.core.schedule.weight_stays`), what
the timing model charges and spares (:mod:`rpcompile.passes.solver.stays`), what the simulator plays, what the solver
picks (:mod:`rpcompile.passes.solver.stay_search`), and the plan file and ``show`` that carry them. The runtime's side:
``tests/test_stays_runtime.py``."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from rpcompile.cli import main
from rpcompile.core.errors import PlanFileError
from rpcompile.core.plan import Plan
from rpcompile.core.schedule import round_robin, weight_stays
from rpcompile.core.stages import StageCost
from rpcompile.passes.solver.partition import solve
from rpcompile.passes.solver.problem import SegmentPlan
from rpcompile.passes.solver.segment_rules import validate_segment_plan
from rpcompile.passes.solver.stay_search import choose_stays, without_stays
from rpcompile.passes.solver.timing import iteration_time, stage_costs
from rpcompile.runtime.sim.simulator import simulate
from rpcompile.tools.scenarios import from_plan, from_segment_plan

from partition_cases import llama_like, tiny_chain

# F0 [0,2), F1 [2,4), FB [4,6), B1 [2,4), B2 [1,2), B3 [0,1) on one device: 400 B of weights a segment, 50 B/s
PLAN = SegmentPlan(forward=((0, 2), (2, 4)), fused=(4, 6), backward=((2, 4), (1, 2), (0, 1)), saved=(False,) * 6)


def chain(memory_bytes: int = 10**6, **kw):
    return tiny_chain(6, devices=1, microbatches=2, memory_bytes=memory_bytes,
                      **{"link_bytes_per_s": 50.0, "param_bytes": (400,) * 6, "grad_bytes": (400,) * 6, **kw})


def with_(plan: SegmentPlan, **changes) -> SegmentPlan:
    return dataclasses.replace(plan, **changes)


# ------------------------------------------------------------------------------------------------ the walk
def test_the_walk_keeps_a_weight_from_one_use_to_the_next_on_the_same_device():
    """F0 {a, b}, F1 {c}, FB {d}, B1 {c}, B2 {a, b}. One device: what stays is found by the stage that reads it
    next and held by every stage in between; two devices (F0, FB, B2 on 0; F1, B1 on 1) the same per device; a
    weight whose next reader is on another device does not stay."""
    uses = [{"a", "b"}, {"c"}, {"d"}, {"c"}, {"a", "b"}]
    one = weight_stays(uses, 1, {"a", "b", "c"})
    assert [set(s.found) for s in one] == [set(), set(), set(), {"c"}, {"a", "b"}]
    assert [set(s.kept) for s in one] == [{"a", "b"}, {"c"}, set(), set(), set()]
    assert [set(s.held) for s in one] == [set(), {"a", "b"}, {"a", "b", "c"}, {"a", "b"}, set()]
    two = weight_stays(uses, 2, {"a", "c"})
    assert [set(s.found) for s in two] == [set(), set(), set(), {"c"}, {"a"}]
    assert [set(s.held) for s in two] == [set(), set(), {"a"}, set(), set()]
    moved = weight_stays([{"a"}, {"b"}, {"a"}], 2, {"a"})  # a's next reader runs on device 0, not 1: a stays there
    assert [set(s.found) for s in moved] == [set(), set(), {"a"}]
    apart = weight_stays([{"a"}, {"a"}], 2, {"a"})  # its next reader is on the other device: nothing to keep it for
    assert [set(s.kept) for s in apart] == [set(), set()]


def test_a_resident_walk_keeps_everything_and_refreshes_at_the_first_use():
    uses = [{"a", "b"}, {"c"}, {"a", "b"}]
    walk = weight_stays(uses, 1, resident=True)
    assert [set(s.found) for s in walk] == [{"a", "b"}, {"c"}, {"a", "b"}]  # everything is there from before
    assert [set(s.first) for s in walk] == [{"a", "b"}, {"c"}, set()]  # refreshed after a step at its first use
    assert [set(s.held) for s in walk] == [{"c"}, {"a", "b"}, {"c"}]


# ------------------------------------------------------------------------------------------------ the timing model
def test_a_stay_spares_the_backward_upload_and_holds_memory_in_between():
    """Segments 2 and 3 (F1's) stay for B1: B1 uploads nothing and finds 800 B; FB, between them, holds them; the
    memory of every stage grows by what it holds and the iteration is shorter (B1 was bound by its upload)."""
    pb = chain()
    none, stays = stage_costs(pb, PLAN), stage_costs(pb, with_(PLAN, stays=(False, False, True, True, False, False)))
    assert [c.weight_bytes for c in none] == [800, 800, 800, 800, 400, 400]
    assert [c.weight_bytes for c in stays] == [800, 800, 800, 0, 400, 400]
    assert [c.found_bytes for c in stays] == [0, 0, 0, 800, 0, 0]
    assert [c.kept_bytes for c in stays] == [0, 800, 0, 0, 0, 0]
    assert [c.held_bytes for c in stays] == [0, 0, 800, 0, 0, 0]
    assert [b.memory_bytes - a.memory_bytes for a, b in zip(none, stays)] == [0, 0, 800, 0, 0, 0]
    assert stays[3].time_s < none[3].time_s  # (2·40 + 800/2) B at 50 B/s: 8.16 s; without its weights 3 s of compute
    assert iteration_time(pb, with_(PLAN, stays=(False, False, True, True, False, False))) < iteration_time(pb, PLAN)


def test_a_resident_plan_uploads_only_what_the_step_changed():
    """Resident: every stage finds its weights; each forward stage (their first use) re-uploads the trainable ones
    the step changed, frozen ones never; the device holds all the others' all the time."""
    frozen = chain(grad_bytes=(0, 0, 400, 400, 400, 400))  # segments 0 and 1 frozen (a LoRA base)
    costs = stage_costs(frozen, with_(PLAN, resident=True))
    assert [c.weight_bytes for c in costs] == [0, 800, 800, 0, 0, 0]
    assert [c.found_bytes for c in costs] == [800, 0, 0, 800, 400, 400]
    assert [c.held_bytes + c.weight_bytes + c.found_bytes for c in costs] == [2400] * 6  # all weights, always
    assert [c.refreshes for c in costs] == [False, True, True, False, False, False]


def test_stays_are_refused_where_they_cannot_be():
    pb = chain()
    assert validate_segment_plan(pb, with_(PLAN, stays=(False,) * 5 + (True,)))[0].startswith("segment 5 (s5) cannot "
                                                                                                  "stay")
    two = tiny_chain(6, devices=2, microbatches=3)
    apart = validate_segment_plan(two, with_(PLAN, stays=(True,) + (False,) * 5))  # F0 on device 0, B3 on 1
    assert apart and "different devices" in apart[0]
    assert validate_segment_plan(two, with_(PLAN, resident=True)) == []  # 6 stages: each back on its device
    four = tiny_chain(6, devices=4, microbatches=4)
    assert "resident plan needs every stage back" in validate_segment_plan(four, with_(PLAN, resident=True))[0]
    off = dataclasses.replace(pb, allow_stay=False)
    assert "allow_stay=False" in validate_segment_plan(off, with_(PLAN, resident=True))[0]
    tight = chain(memory_bytes=3000)
    assert any("needs" in v for v in validate_segment_plan(tight, with_(PLAN, stays=(False, False, True, True, False,
                                                                                       False))))


def test_the_simulator_holds_what_stays_until_the_stage_that_finds_it_ends():
    """One device, free links: F0 (100 B of weights, kept for B2), F1, FB (50 B working set), B1 (10 B each), B2
    (finds F0's 100 B). Without the stay the most on the device is B2's weights going up during B1 (110 B); with
    it, FB runs with F0's weights held beside its own, its working set and B1's prefetch: 170 B."""
    lists = round_robin(["forward", "forward", "fused", "backward", "backward"], 1, 1)
    plain = [StageCost(kind=k, compute_s=1.0, weight_bytes=w, working_bytes=x)
             for k, w, x in zip(("forward", "forward", "fused", "backward", "backward"), (100, 10, 10, 10, 100),
                                (0, 0, 50, 0, 0))]
    held = [dataclasses.replace(plain[0], kept_bytes=100), plain[1], dataclasses.replace(plain[2], held_bytes=100),
            plain[3], dataclasses.replace(plain[4], weight_bytes=0, found_bytes=100)]
    assert simulate(lists, plain).peak_memory_bytes == (110,)
    assert simulate(lists, held).peak_memory_bytes == (170,)
    resident = [dataclasses.replace(s, found_bytes=s.weight_bytes, weight_bytes=0, kept_bytes=s.weight_bytes,
                                    held_bytes=230 - s.weight_bytes) for s in plain]
    assert simulate(lists, resident).peak_memory_bytes == (280,)  # every weight all the time, FB's working set


@pytest.mark.parametrize("devices,microbatches", [(1, 1), (2, 3)])
def test_the_simulator_plays_stays_as_the_timing_model_prices_them(devices, microbatches):
    pb = llama_like(8, devices=devices, microbatches=microbatches, memory_bytes=100 * 10**9)
    plan = solve(pb, "ilp", time_limit_s=3.0).plan
    assert plan.resident or plan.stays
    for p in (plan, without_stays(plan)):
        sim = from_segment_plan(pb, p, name="ilp").run()
        assert sim.iteration_time_s == pytest.approx(iteration_time(pb, p), rel=0.04)


# ------------------------------------------------------------------------------------------------ the choice
@pytest.mark.parametrize("memory,resident,stays", [
    (10**6, True, ()),  # everything fits: resident
    (3300, False, (False, False, True, True, False, False)),  # F1's weights fit beside FB, F0's do not
    (3000, False, (False, False, True, False, False, False)),  # half of them
    (2800, False, ()),  # nothing fits beside the stages: today's round robin
])
def test_the_search_keeps_what_fits_and_nothing_more(memory, resident, stays):
    pb = chain(memory)
    chosen = choose_stays(pb, PLAN)
    assert (chosen.resident, chosen.stays) == (resident, stays)
    assert validate_segment_plan(pb, chosen) == []
    assert iteration_time(pb, chosen) <= iteration_time(pb, PLAN)
    assert choose_stays(dataclasses.replace(pb, allow_stay=False), PLAN) == PLAN


def test_the_ilp_plans_stays_where_memory_allows_and_none_where_it_does_not():
    roomy = solve(chain(), "ilp", time_limit_s=2.0)
    assert roomy.plan.resident and roomy.objective < iteration_time(chain(), without_stays(roomy.plan))
    tight = solve(chain(2800), "ilp", time_limit_s=2.0)
    assert not tight.plan.resident and not tight.plan.stays
    off = solve(dataclasses.replace(chain(), allow_stay=False), "ilp", time_limit_s=2.0)
    assert off.plan == without_stays(roomy.plan)  # the same cuts: stays are chosen on them
    eight = solve(llama_like(8, devices=1, microbatches=1), "ilp", time_limit_s=3.0)  # an 8-layer 8B-like on 24 GB
    assert eight.plan.resident


# ------------------------------------------------------------------------------------------------ plan files
@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """llama-demo planned for one device under 1 MiB (some weights stay), two devices under 800 KiB (forward
    stages keep theirs for the backward stages on their device: 9 stages, so not resident), one device with room
    (resident), and the two-device plan without stays."""
    out = tmp_path_factory.mktemp("plans")
    made = {}
    for name, argv in {"tight": ["--gpus", "1", "--memory-limit", "1MiB"], "two": ["--gpus", "2", "--memory-limit", "800KiB"],
                       "resident": ["--gpus", "1", "--memory-limit", "1GiB", "--segments-per-layer", "2",
                                    "--microbatches", "2"],
                       "none": ["--gpus", "2", "--memory-limit", "800KiB", "--no-stay"]}.items():
        path = out / f"{name}.json"
        assert main(["plan", "llama-demo", "--spec", "rtx4090", "--time-limit", "2", *argv, "-o", str(path)]) == 0
        made[name] = path
    return made


def test_plans_record_what_stays_and_round_trip(plans):
    two = Plan.load(plans["two"])
    assert two.schema_version == 8 and not two.resident
    keepers = [s for s in two.stages if s.keeps]
    assert keepers and all(s.kind == "forward" and set(s.keeps) <= set(s.params) for s in keepers)
    assert {p for s in two.stages for p in s.finds} == {p for s in keepers for p in s.keeps}
    assert sum(s.found_bytes for s in two.stages) == sum(s.kept_bytes for s in two.stages) > 0
    assert Plan.from_dict(json.loads(two.to_json())) == two
    resident = Plan.load(plans["resident"])
    assert resident.resident and all(set(s.keeps) == set(s.finds) == set(s.params) for s in resident.stages)
    none = Plan.load(plans["none"])
    data = json.loads(plans["none"].read_text())
    assert not any(s.keeps or s.finds for s in none.stages) and "resident" not in data
    assert not any(k in s for s in data["stages"] for k in ("keeps", "finds", "held_bytes", "found_bytes"))


def test_a_version_6_plan_loads_as_one_whose_weights_all_leave(plans):
    data = json.loads(plans["none"].read_text())
    data["schema_version"] = 5
    old = Plan.from_dict(data)
    assert old.schema_version == 5 and not old.resident and not any(s.keeps for s in old.stages)


@pytest.mark.parametrize("edit,message", [
    (lambda d, k: d["stages"][k]["keeps"].append("nobody.weight"), r"keeps or finds a parameter it does not read"),
    (lambda d, k: d["stages"][k]["keeps"].append("bad\nname"), r"keeps\[\d+\]: holds the control or format"),
    (lambda d, k: d["stages"][k]["keeps"].clear(), r"finds parameters no earlier stage on its device kept"),
    (lambda d, k: d["stages"][k].update(finds=d["stages"][k]["keeps"]), r"only backward stages find parameters"),
    (lambda d, k: d["stages"][k].update(held_bytes=-1), r"held_bytes: must be >= 0"),
    (lambda d, k: d.update(resident="yes"), r"resident: expected true or false"),
    (lambda d, k: d.update(resident=True), r"resident: 9 stages on 2 devices would not come back"),
])
def test_stays_in_a_plan_file_are_checked(plans, tmp_path, edit, message):
    data = json.loads(plans["two"].read_text())
    k = next(i for i, s in enumerate(data["stages"]) if s.get("keeps"))
    edit(data, k)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=message):
        Plan.load(path)


def test_a_resident_plan_file_keeps_and_finds_every_parameter_of_every_stage(plans, tmp_path):
    data = json.loads(plans["resident"].read_text())
    data["stages"][0]["keeps"] = data["stages"][0]["keeps"][1:]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"stages\[0\] \(\w+\): a resident plan's stage keeps and finds every"):
        Plan.load(path)


def test_the_simulator_plays_a_plan_file_as_predicted(plans):
    for name in ("two", "resident", "tight"):
        plan = Plan.load(plans[name])
        sim = from_plan(plan).run()
        assert sim.pipeline_s == pytest.approx(plan.predicted.pipeline_s, rel=0.1), name


def test_show_says_which_stages_keep_and_find_their_weights(plans, capsys):
    assert main(["show", str(plans["two"])]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "keeps" in out and "finds" in out
    assert "weights that stay:" in " ".join(out.split()) and "without;" in " ".join(out.split())
    assert main(["show", str(plans["resident"])]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "resident: every weight stays on its device across iterations" in text
    assert main(["show", str(plans["none"])]) == 0
    assert "weights that stay" not in " ".join(capsys.readouterr().out.split())


def test_check_rescores_a_plan_with_stays(plans, capsys):
    for name in ("two", "resident", "tight"):
        assert main(["check", str(plans[name]), "llama-demo"]) == 0, name
    assert "OK" in capsys.readouterr().out


def test_diff_says_what_stays_spare_the_link(plans, capsys):
    assert main(["diff", str(plans["none"]), str(plans["two"])]) == 1
    out = capsys.readouterr().out
    assert re.search(r"weights up per iteration [\d.]+ KiB → [\d.]+ KiB \(−\d+\.\d%\)", out), out
    assert "placement" not in out  # the same cuts: stays are chosen on them
