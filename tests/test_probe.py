"""The host probe (:mod:`rpcompile.planner.probe`), the host on a plan's hardware, and ``rpcompile probe``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from _toy import toy_graph
from rpcompile.cli import main
from rpcompile.core.errors import ConfigError
from rpcompile.core.plan import Plan
from rpcompile.core.specs import HostSpec, assumed_host
from rpcompile.models.registry import load_model
from rpcompile.planner.probe import load_host, probe_host
from rpcompile.planner.profiling import profile
from rpcompile.views.report import host_table
from test_plan import make_plan

RATES = ("memory_bandwidth", "cast_params_per_s", "accumulate_params_per_s", "optimizer_params_per_s")


@pytest.fixture(scope="module")
def probed() -> HostSpec:
    return probe_host(elements=2**20, adam_params=2**18, repeats=1, cuda=False)


def test_the_probe_measures_positive_rates(probed):
    assert all(getattr(probed, r) > 0 for r in RATES)
    assert probed.source == "probe" and probed.threads >= 1 and "probed on" in probed.note
    assert probed.pinned_h2d == probed.pageable_h2d == 0.0  # no CUDA asked for


def test_a_probed_host_round_trips_through_the_plan_json(probed, tmp_path):
    gm, _ = toy_graph()
    plan = make_plan(gm)
    plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, host=probed))
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.hardware.host == probed and loaded.hardware == plan.hardware
    assert json.loads((tmp_path / "plan.json").read_text())["hardware"]["host"]["source"] == "probe"


def test_assumed_hosts_say_so():
    for name in ("rtx4090", "h100-sxm", "cpu"):
        host = assumed_host(name)
        assert host.source == "assumed" and name in host.note
        assert all(getattr(host, r) > 0 for r in RATES)
    h100 = assumed_host("h100-sxm")
    assert 1.72e9 / h100.optimizer_params_per_s == pytest.approx(0.41, rel=0.01)  # the H100 machine's AdamW
    with pytest.raises(ConfigError, match="cast_params_per_s must be a finite rate > 0"):
        dataclasses.replace(h100, cast_params_per_s=0.0)
    with pytest.raises(ConfigError, match="source must be"):
        dataclasses.replace(h100, source="guess")


def test_the_host_table_labels_its_source(probed):
    assert str(host_table(probed).title) == "host (measured)"
    assert str(host_table(assumed_host("rtx4090")).title) == "host (assumed)"


def test_the_probe_command_prints_json_and_writes_a_host_file(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["probe", "--json", "-o", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert all(printed[r] > 0 for r in RATES) and printed["source"] == "probe"
    assert load_host(out).source == "probe"
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(ConfigError, match="not a host made by"):
        load_host(bad)


def test_a_plan_stores_the_host_it_was_given_and_prices_its_step(probed, tmp_path, capsys):
    """``plan --host FILE``: the plan's hardware carries that host, and its prediction prices the step with it:
    AdamW over every trainable parameter at the host's rate, then the bf16 copies refreshed at its cast rate."""
    host_file = tmp_path / "host.json"
    host_file.write_text(json.dumps({"host": probed.to_dict()}))
    assert main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--host", str(host_file),
                 "--head-chunks", "1", "--time-limit", "2", "--json"]) == 0
    plan = Plan.from_dict(json.loads(capsys.readouterr().out))
    assert plan.hardware.host == probed
    n = plan.model.param_elements  # every parameter of llama-demo trains
    p = plan.predicted
    assert p.optimizer_s == pytest.approx(n / probed.optimizer_params_per_s)
    assert p.refresh_s == pytest.approx(n / probed.cast_params_per_s)
    assert p.iteration_time_s == pytest.approx(p.pipeline_s + p.optimizer_s + p.refresh_s)


def test_profiling_can_probe_the_host():
    ms = load_model("llama-demo")
    prof = profile(ms.model, ms.example_inputs, spec="rtx4090", probe_host=True, progress=False)
    assert prof.host is not None and prof.host.source == "probe" and prof.to_dict()["host"]["source"] == "probe"


def test_show_and_simulate_print_the_host_part_as_a_prediction(capsys):
    golden = str(Path(__file__).parent / "golden" / "llama-demo.json")
    assert main(["show", golden]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the caption wraps
    assert "predicted from" in out and "host (assumed): optimizer step" in out and "synchronous: added" in out
    assert main(["simulate", golden]) == 0
    out = capsys.readouterr().out
    assert "host (simulated, the step as the plan predicts it)" in out and "after the pipeline" in out
