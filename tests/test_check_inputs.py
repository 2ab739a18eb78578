"""``rpcompile check`` solves a fresh plan only when something the plan was solved from moved, or when asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import rpcompile.planner.planning
import rpcompile.tools.staleness
from rpcompile.cli import main
from rpcompile.core.plan import Plan
from rpcompile.passes.plan_inputs import moved_inputs

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A llama-demo plan made by today's rpcompile (it records its inputs)."""
    path = tmp_path_factory.mktemp("inputs") / "fresh.json"
    assert main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "-o", str(path), "--json"]) == 0
    return path


@pytest.fixture
def solves(monkeypatch):
    """Counts fresh solves; ``solves.fail = True`` makes one fail the test."""
    class Counter:
        calls = 0
        fail = False
    counter = Counter()
    real_plan_graph, real_solve = rpcompile.tools.staleness.plan_graph, rpcompile.planner.planning.solve

    def plan_graph(*a, **k):
        counter.calls += 1
        assert not counter.fail, "check solved a fresh plan although nothing moved"
        return real_plan_graph(*a, **k)

    def solve(*a, **k):
        assert not counter.fail, "check called the solver although nothing moved"
        return real_solve(*a, **k)

    monkeypatch.setattr(rpcompile.tools.staleness, "plan_graph", plan_graph)
    monkeypatch.setattr(rpcompile.planner.planning, "solve", solve)
    return counter


def _check(path, capsys, *extra):
    code = main(["check", str(path), "llama-demo", "--json", "--time-limit", "2", *extra])
    return code, json.loads(capsys.readouterr().out)


def _edited(fresh, tmp_path, edit):
    data = json.loads(fresh.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_a_plan_records_what_it_was_solved_from(fresh):
    plan = Plan.load(fresh)
    assert set(plan.inputs) == {"costs", "problem", "hardware", "options", "solver"}
    opts = plan.inputs["options"]
    assert opts["strategy"] == "ilp" and opts["microbatches"] == plan.microbatches == 3
    assert opts["precision"] == plan.precision and opts["memory_bytes"] == plan.hardware.memory_bytes
    assert opts["head_chunks"] == plan.head_chunks and opts["host"] == list(plan.host)
    assert opts["segments_per_layer"] == 2
    assert Plan.from_dict(json.loads(plan.to_json())) == plan  # round trip


def test_check_does_not_resolve_when_nothing_moved(fresh, solves, capsys):
    solves.fail = True
    code, out = _check(fresh, capsys)
    assert code == 0, out
    assert out["resolved"] is False and out["fresh_iteration_s"] is None
    assert "nothing the plan was solved from moved" in out["resolve_reason"]
    assert main(["check", str(fresh), "llama-demo"]) == 0
    assert "not re-solved" in capsys.readouterr().out


def test_resolve_forces_a_fresh_solve(fresh, solves, capsys):
    code, out = _check(fresh, capsys, "--resolve")
    assert code == 0, out
    assert solves.calls == 1 and out["resolved"] is True and "--resolve" in out["resolve_reason"]
    assert out["regression"] == pytest.approx(0.0, abs=0.02)


@pytest.mark.parametrize("edit, named", [
    (lambda d: d["hardware"].__setitem__("memory_bytes", d["hardware"]["memory_bytes"] - 10**9), "hardware"),
    (lambda d: d["hardware"]["spec"].__setitem__("memory_bytes", d["hardware"]["spec"]["memory_bytes"] + 1), "hardware"),
    (lambda d: d.__setitem__("microbatches", 4), "microbatches 3 → 4"),
    (lambda d: d["inputs"].__setitem__("costs", "0" * 16), "costs"),
    (lambda d: d["inputs"].__setitem__("solver", "0" * 16), "partitioner changed"),
])
def test_check_resolves_and_names_what_moved(fresh, solves, tmp_path, capsys, edit, named):
    code, out = _check(_edited(fresh, tmp_path, edit), capsys)
    assert solves.calls == 1, out
    assert out["resolved"] is True and named in out["resolve_reason"], out["resolve_reason"]
    assert out["fresh_iteration_s"] is not None


def test_an_old_plan_without_inputs_is_still_checked(solves, tmp_path, capsys):
    old = tmp_path / "old.json"
    shutil.copy(GOLDEN / "llama-demo.json", old)
    data = json.loads(old.read_text())
    data.pop("inputs", None)
    old.write_text(json.dumps(data))
    assert Plan.load(old).inputs == {}
    code, out = _check(old, capsys)
    assert code == 0, out
    assert solves.calls == 1 and out["resolved"] is True
    assert "does not record what it was solved from" in out["resolve_reason"]


def test_moved_inputs_names_each_input():
    a = {"costs": "a", "problem": "b", "hardware": "c", "solver": "d", "options": {"microbatches": 3}}
    assert moved_inputs(a, dict(a)) == []
    moved = moved_inputs(a, {**a, "costs": "x", "options": {"microbatches": 4}})
    assert len(moved) == 2 and "microbatches 3 → 4" in moved[0] and moved[1].startswith("costs")
