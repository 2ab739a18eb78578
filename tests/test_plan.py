"""Plan file format: JSON round trip, schema versioning, corrupt and mismatched files."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from _toy import TiedToy, toy_graph
from rpcompile.core.errors import PlanFileError, PlanMismatchError
from rpcompile.passes.lower import plan_from_ranges
from rpcompile.core.plan import SCHEMA_VERSION, Hardware, Plan, Prediction
from rpcompile.core.specs import assumed_host, get_spec
from rpcompile.passes.graph.fingerprint import fingerprint


def make_plan(gm) -> Plan:
    hw = Hardware(device_count=2, spec=get_spec("rtx4090"), memory_bytes=10**9, link_bytes_per_s=25e9)
    return plan_from_ranges(
        gm, forward=[(0, 2), (2, 4)], fused=(4, 6), backward=[(2, 4), (0, 2)], hardware=hw, microbatches=3,
        saved=["l1"], stage_times=[1e-3, 2e-3, 3e-3, 4e-3, 5e-3], stage_memory=[10, 20, 30, 40, 50],
        predicted=Prediction(iteration_time_s=0.5, bubble_fraction=0.1, peak_memory_bytes=50, bound_s=0.49),
        strategy="manual", stats={"gap": 0.01, "inf": float("inf"), "names": ("a", "b")},
    )


def test_round_trip(tmp_path):
    gm, _ = toy_graph()
    plan = make_plan(gm)
    path = plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path)
    assert loaded.stages == plan.stages
    assert loaded.model == plan.model and loaded.hardware == plan.hardware
    assert loaded.predicted == plan.predicted and loaded.microbatches == 3
    assert dict(loaded.stats) == {"gap": 0.01, "inf": None, "names": ["a", "b"]}  # JSON-safe stats
    assert loaded.to_json() == Plan.load(loaded.save(tmp_path / "again.json")).to_json()
    data = json.loads(path.read_text())
    assert list(data)[0] == "schema_version" and data["schema_version"] == SCHEMA_VERSION
    assert [s["name"] for s in data["stages"]] == ["F0", "F1", "FB", "B1", "B2"]
    assert data["stages"][0]["params"] == ["embed.weight", "l1.weight", "l1.bias"]


def test_views_of_saved_and_recomputed():
    gm, _ = toy_graph()
    plan = make_plan(gm)
    assert plan.saved == ("l1",)
    b2 = plan.backward_stages[1]
    assert b2.saved == ("l1",) and b2.recomputed == ("embed",)
    assert plan.fused_stage.name == "FB" and [s.name for s in plan.forward_stages] == ["F0", "F1"]
    assert [plan.device_of(k) for k in range(5)] == [0, 1, 0, 1, 0]


def test_save_is_atomic_and_leaves_no_tmp(tmp_path):
    gm, _ = toy_graph()
    make_plan(gm).save(tmp_path / "p.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"schema_version": 1, "stages": [', r"p\.json is corrupt: invalid JSON at line 1 column \d+ \(.*\); re-plan to regenerate it"),
        ("[1, 2]", r"p\.json is not an rpcompile plan: expected a JSON object, found list"),
        ('{"hello": 1}', r"p\.json is not an rpcompile plan: no integer 'schema_version'"),
        ('{"schema_version": 99}', r"p\.json has schema_version 99 but this rpcompile reads up to 8; upgrade rpcompile"),
        ('{"schema_version": 1}', r"p\.json is corrupt: missing field 'model'; re-plan to regenerate it"),
    ],
)
def test_bad_files_give_one_line_errors(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(PlanFileError, match=message) as info:
        Plan.load(path)
    assert "\n" not in str(info.value)


def test_wrong_field_type_is_reported(tmp_path):
    gm, _ = toy_graph()
    data = make_plan(gm).to_dict()
    data["stages"][0]["kind"] = "sideways"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"p\.json is corrupt: stages\[0\]\.kind: expected one of \[.forward., .fused., .backward.\], found .sideways.; re-plan"):
        Plan.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(PlanFileError, match=r"cannot read plan file .*nope\.json: No such file or directory"):
        Plan.load(tmp_path / "nope.json")


def test_fingerprint_is_stable_and_sensitive():
    gm1, _ = toy_graph(seed=0)
    gm2, _ = toy_graph(seed=1)  # other weights, same structure
    assert fingerprint(gm1) == fingerprint(gm2)
    other = torch.fx.symbolic_trace(TiedToy(dim=12))
    diffs = fingerprint(gm1).differences(fingerprint(other))
    assert diffs == ["parameters differ (6 tensors / 280 elements vs 6 / 516)"]


def test_mismatched_model_is_refused():
    gm, _ = toy_graph()
    plan = make_plan(gm)
    frozen = TiedToy()
    frozen.l1.weight.requires_grad_(False)
    with pytest.raises(PlanMismatchError, match=r"^plan\.json was made for a different model \(parameters differ .*\); re-plan for this model"):
        plan.check_model(fingerprint(torch.fx.symbolic_trace(frozen)), source="plan.json")


def test_plan_is_frozen():
    gm, _ = toy_graph()
    plan = make_plan(gm)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.microbatches = 4  # type: ignore[misc]


def test_a_version_2_plan_loads_without_a_host(tmp_path):
    """Schema 3 added ``hardware.host`` and the prediction's host part; a version-2 file has neither and loads
    with no host work modelled."""
    gm, _ = toy_graph()
    data = make_plan(gm).to_dict()
    assert "host" not in data["hardware"]  # a plan without a host writes none
    data["schema_version"] = 2
    for key in ("pipeline_s", "optimizer_s", "refresh_s", "accumulate_s", "overlap_step"):
        del data["predicted"][key]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(data))
    plan = Plan.load(path)
    assert plan.schema_version == 2 and plan.hardware.host is None
    assert plan.predicted.host_s == 0.0 and plan.predicted.iteration_time_s == 0.5


def test_a_plan_for_overlapped_iterations_says_so_and_older_plans_are_synchronous(tmp_path):
    """Schema 5 added ``predicted.overlap_iterations``: written only for a plan made for overlapped iterations
    (so a reader of schema 4 refuses such a file rather than read its period as an iteration), and a version-4
    file, which has no such field, loads as a synchronous plan."""
    gm, _ = toy_graph()
    plan = make_plan(gm)
    assert "overlap_iterations" not in plan.to_dict()["predicted"]
    over = dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted, overlap_iterations=True,
                                                                   overlap_step=True))
    assert over.to_dict()["predicted"]["overlap_iterations"] is True
    assert Plan.load(over.save(tmp_path / "over.json")).predicted.overlap_iterations
    data = plan.to_dict()
    data["schema_version"] = 4
    (tmp_path / "v4.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "v4.json")
    assert old.schema_version == 4 and not old.predicted.overlap_iterations
    data["predicted"]["overlap_iterations"] = "yes"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"predicted\.overlap_iterations: expected true or false, found a string"):
        Plan.load(tmp_path / "bad.json")


def test_a_version_5_plan_loads_priced_without_dispatch_and_version_6_fields_are_bounded(tmp_path):
    """Schema 6 added the host's dispatch per graph node to the hardware's spec (``dispatch_s``,
    ``backward_dispatch_s``) and prices one GPU's hand-offs as kept in its memory. A version-5 file has no dispatch
    fields and loads with none, as it was priced; a file is untrusted, so a dispatch that is negative, not a
    number, a second or more, or of the wrong type is refused in one line."""
    gm, _ = toy_graph()
    plan = make_plan(gm)
    spec = plan.to_dict()["hardware"]["spec"]
    assert (spec["dispatch_s"], spec["backward_dispatch_s"]) == (38e-6, 124e-6)  # the rtx4090 preset's
    data = plan.to_dict()
    data["schema_version"] = 5
    for key in ("dispatch_s", "backward_dispatch_s"):
        del data["hardware"]["spec"][key]
    data["hardware"]["spec"]["stage_overhead_s"] = 30e-6  # what version 5 wrote for a GPU preset
    (tmp_path / "v5.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "v5.json")
    assert old.schema_version == 5 and old.hardware.spec.dispatch_s == old.hardware.spec.backward_dispatch_s == 0
    assert old.hardware.spec.stage_overhead_s == 30e-6 and old.predicted == plan.predicted
    assert Hardware(device_count=1, spec=old.hardware.spec, memory_bytes=1, link_bytes_per_s=1.0).resident_handoffs
    assert not old.hardware.resident_handoffs  # two GPUs
    for value, message in ((-1e-6, r"hardware\.spec\.dispatch_s: must be a finite number >= 0"),
                           ("fast", r"hardware\.spec\.dispatch_s: expected a number, found a string"),
                           (1.5, r"dispatch_s must be in \[0, 1\) seconds, got 1\.5")):
        bad = plan.to_dict()
        bad["hardware"]["spec"]["dispatch_s"] = value
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(PlanFileError, match=message):
            Plan.load(tmp_path / "bad.json")
    text = plan.to_json()
    assert '"backward_dispatch_s": 0.000124' in text
    (tmp_path / "nan.json").write_text(text.replace('"backward_dispatch_s": 0.000124', '"backward_dispatch_s": NaN'))
    with pytest.raises(PlanFileError, match="NaN|not a number|corrupt"):
        Plan.load(tmp_path / "nan.json")


def test_a_plan_with_a_host_round_trips(tmp_path):
    gm, _ = toy_graph()
    plan = make_plan(gm)
    hw = dataclasses.replace(plan.hardware, host=assumed_host("rtx4090"))
    pred = dataclasses.replace(plan.predicted, pipeline_s=0.4, optimizer_s=0.08, refresh_s=0.02, accumulate_s=0.1)
    plan = dataclasses.replace(plan, hardware=hw, predicted=pred)
    loaded = Plan.load(plan.save(tmp_path / "p.json"))
    assert loaded.hardware == hw and loaded.predicted == pred and loaded.predicted.host_s == pytest.approx(0.1)
    assert loaded.schema_version == SCHEMA_VERSION == 8
