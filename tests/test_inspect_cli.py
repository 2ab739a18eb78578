"""``rpcompile check``, ``diff`` and ``show``: exit codes and messages for the cases CI meets."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from rpcompile.cli import main

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The llama-demo golden plan, a roundpipe plan of the same model, and hand-edited variants."""
    d = tmp_path_factory.mktemp("plans")
    good = d / "good.json"
    shutil.copy(GOLDEN / "llama-demo.json", good)
    rp = d / "roundpipe.json"
    assert main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--strategy", "roundpipe", "-o", str(rp), "--json"]) == 0
    data = json.loads(good.read_text())
    variants = {}
    # the same plan on devices too small for it
    small = json.loads(good.read_text())
    small["hardware"]["memory_bytes"] = 300_000
    variants["small"] = small
    # a prediction that today's cost model no longer gives
    stale = json.loads(good.read_text())
    stale["predicted"]["iteration_time_s"] = data["predicted"]["iteration_time_s"] * 1.5
    variants["stale"] = stale
    # the roundpipe plan relabelled as an ilp plan: a fresh ilp plan is faster
    regressed = json.loads(rp.read_text())
    regressed["strategy"] = "ilp"
    variants["regressed"] = regressed
    paths = {"good": good, "roundpipe": rp}
    for name, v in variants.items():
        paths[name] = d / f"{name}.json"
        paths[name].write_text(json.dumps(v))
    paths["corrupt"] = d / "corrupt.json"
    paths["corrupt"].write_text('{"schema_version": 2, "stages": [')
    return paths


def test_check_passes_a_fresh_plan(plans, capsys):
    assert main(["check", str(plans["good"]), "llama-demo"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and re.match(rf"{re.escape(str(plans['good']))}: OK — 6 stages on 2 × rtx4090, peak .* of 20\.12 GiB, "
                                      r"predicted [\d.]+ ms; not re-solved: nothing the plan was solved from moved .*$",
                                      out[0]), out


def test_check_reports_a_stale_model(plans, capsys):
    assert main(["check", str(plans["good"]), "gpt-demo"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{plans['good']}: stale model: the plan was made for a different model (graph differs (")
    assert out[-1] == f"{plans['good']}: 1 problem"


def test_check_reports_a_corrupt_file(plans, capsys):
    assert main(["check", str(plans["corrupt"]), "llama-demo"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{plans['corrupt']}: corrupt: invalid JSON at line 1 column 34 (Expecting value); re-plan to regenerate it",
        f"{plans['corrupt']}: 1 problem",
    ]


def test_check_reports_a_plan_that_no_longer_fits(plans, capsys):
    assert main(["check", str(plans["small"]), "llama-demo"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(re.match(rf"{re.escape(str(plans['small']))}: invalid: rule 9: stage \w+ needs", line) for line in out), out
    assert any(line.startswith(f"{plans['small']}: does not fit: ") for line in out), out


def test_check_reports_a_stale_prediction(plans, capsys):
    assert main(["check", str(plans["stale"]), "llama-demo", "--json"]) == 1
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] is False and len(res["problems"]) == 1
    assert re.match(r"stale prediction: the plan predicts [\d.]+ ms per iteration but today's cost model gives [\d.]+ ms "
                    r"\(-33\.3%\); re-plan to refresh it$", res["problems"][0]), res["problems"]


def test_check_reports_a_regression_beyond_the_margin(plans, capsys):
    assert main(["check", str(plans["regressed"]), "llama-demo"]) == 1
    out = capsys.readouterr().out.splitlines()
    m = re.match(rf"{re.escape(str(plans['regressed']))}: regressed: the plan takes [\d.]+ ms per iteration but a fresh "
                 r"ilp plan takes [\d.]+ ms \(\+([\d.]+)%, allowed \+2\.0%; re-solved: moved since the plan was solved: "
                 r"options \(strategy 'roundpipe' → 'ilp'\)\); re-plan$", out[0])
    assert m and float(m.group(1)) > 2.0, out
    # a generous margin lets it pass
    assert main(["check", str(plans["regressed"]), "llama-demo", "--max-regression", "90%"]) == 0


def test_diff_exit_codes_and_lines(plans, capsys):
    assert main(["diff", str(plans["good"]), str(plans["good"])]) == 0
    assert capsys.readouterr().out.strip() == "plans are identical"
    assert main(["diff", str(plans["roundpipe"]), str(plans["good"])]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{plans['roundpipe']} → {plans['good']}"
    assert "strategy roundpipe → ilp" in out
    assert main(["diff", str(plans["roundpipe"]), str(plans["good"]), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["changed"] is True


def test_show_prints_the_stage_table_and_draws_the_graph(plans, tmp_path, capsys):
    svg = tmp_path / "g.svg"
    assert main(["show", str(plans["good"]), "--graph", str(svg), "--model", "llama-demo"]) == 0
    out = capsys.readouterr().out
    assert "ilp plan, 6 stages on 2 × rtx4090" in out and f"graph written to {svg}" in out
    import xml.etree.ElementTree as ET

    assert ET.parse(svg).getroot().tag.endswith("svg")
    assert main(["show", str(plans["good"]), "--graph", str(tmp_path / "g.png")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"rpcompile: error: cannot write a plan graph to '{tmp_path / 'g.png'}': the file name must end in .svg or .dot")


@pytest.fixture(scope="module")
def planned_apart(tmp_path_factory):
    """llama-demo planned three ways: as is, with its LM head in 4 chunks, with its embedding on the devices."""
    d = tmp_path_factory.mktemp("apart")
    paths = {name: d / f"{name}.json" for name in ("plain", "split", "device")}
    base = ["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--time-limit", "1", "--json"]
    assert main([*base, "--head-chunks", "1", "-o", str(paths["plain"])]) == 0
    assert main([*base, "--head-chunks", "4", "-o", str(paths["split"])]) == 0
    assert main([*base, "--head-chunks", "1", "--no-host-embedding", "-o", str(paths["device"])]) == 0
    return paths


def test_show_check_and_diff_agree_on_a_split_head(planned_apart, tmp_path, capsys):
    """The plan of a split LM head is for the model it was planned from: show draws it, check passes it."""
    split = str(planned_apart["split"])
    capsys.readouterr()
    assert main(["show", split, "--graph", str(tmp_path / "g.svg"), "--model", "llama-demo"]) == 0
    assert f"graph written to {tmp_path / 'g.svg'}" in capsys.readouterr().out
    assert main(["check", split, "llama-demo", "--time-limit", "1"]) == 0, capsys.readouterr().out
    assert main(["diff", str(planned_apart["plain"]), split]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "LM head chunks 1 → 4" in out and not any("DIFFERENT MODELS" in line for line in out)


def test_diff_calls_host_and_device_embeddings_the_same_model(planned_apart, capsys):
    assert main(["diff", str(planned_apart["plain"]), str(planned_apart["device"])]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "on the host embed → (nothing)" in out and not any("DIFFERENT MODELS" in line for line in out)


def test_diff_still_tells_different_models_apart(capsys):
    assert main(["diff", str(GOLDEN / "llama-demo.json"), str(GOLDEN / "gpt-demo.json")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "DIFFERENT MODELS: the plans are for different models; only module placement is compared"


def test_show_refuses_another_model_in_one_line(planned_apart, tmp_path, capsys):
    code = main(["show", str(planned_apart["split"]), "--graph", str(tmp_path / "g.svg"), "--model", "gpt-demo"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"rpcompile: error: {planned_apart['split']} was made for a different model")


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.json")))
def test_golden_plans_are_current(name, capsys):
    """CI's guard: a change to the cost model or the partitioner that makes a checked-in plan stale or worse
    fails here (regenerate with ``rpcompile plan NAME --gpus 2 --spec rtx4090 -o tests/golden/NAME.json``)."""
    code = main(["check", str(GOLDEN / f"{name}.json"), name])
    assert code == 0, capsys.readouterr().out
