"""The solve cache (rpcompile/passes/solve_cache.py): a second compile of the same problem solves nothing and gets
the same plan; --no-cache, a corrupt or tampered entry and ``cache clear`` behave as the module says.
(conftest.py gives every test a fresh, empty cache directory.)"""

from __future__ import annotations

import json
import logging

import pytest

from rpcompile.cli import main
from rpcompile.models.registry import load_model
from rpcompile.passes import solve_cache
from rpcompile.planner import planning
from rpcompile.planner.plan_options import PlanOptions
from rpcompile.planner.planning import compile_plan


def compile_gpt(**kw):
    spec = load_model("gpt-demo")
    return compile_plan(spec.model, spec.example_inputs, PlanOptions(gpus=2, spec="rtx4090", time_limit_s=2.0, **kw),
                        loss_fn=spec.loss, example_target=spec.example_target)


def plan_dict(c) -> dict:
    d = c.plan.to_dict()
    return {"stages": d["stages"], "predicted": d["predicted"]}  # a fresh solve's stats hold its phases' wall times


def test_a_second_compile_solves_nothing_and_gets_the_same_plan(monkeypatch):
    """Both LM-head splits (head_chunks="auto") hit: each asks for half the limit, as it did when it was solved (the
    whole head's solve in a forked child: its entry is written and read there)."""
    first = compile_gpt()
    assert not first.result.cached
    assert len(solve_cache.solve_entries()) == 2  # the whole head and the 8-chunk split
    monkeypatch.setattr(planning, "ilp", lambda *a, **k: pytest.fail("solved although the cache holds it"))
    second = compile_gpt()
    assert second.result.cached
    assert second.result.solve_time_s == first.result.solve_time_s
    assert plan_dict(second) == plan_dict(first)
    assert len(solve_cache.solve_entries()) == 2


def test_an_entry_whose_stats_list_the_ilps_budgets_is_a_hit(monkeypatch):
    """The ILP records each budget it tried as a list (``[stages, status, seconds, models]``): an entry holding
    them was once refused as "wrong schema" (stats nested 3 deep), so every ILP plan that met an infeasible
    budget was solved afresh at every compile."""
    first = compile_gpt(head_chunks=1)
    (path,) = solve_cache.solve_entries()
    data = json.loads(path.read_text())
    data["stats"]["budgets"] = [[6, "INFEASIBLE", 0.011, 192], [7, "OPTIMAL", 0.02, 12]]
    path.write_text(json.dumps(data))
    monkeypatch.setattr(planning, "ilp", lambda *a, **k: pytest.fail("solved although the cache holds it"))
    assert compile_gpt(head_chunks=1).result.cached and plan_dict(compile_gpt(head_chunks=1)) == plan_dict(first)


def test_no_cache_solves_and_keeps_nothing():
    compile_gpt(cache=False)
    assert solve_cache.solve_entries() == []


def test_a_corrupt_or_tampered_entry_is_ignored_with_one_warning_and_replaced(caplog):
    first = compile_gpt(head_chunks=1)
    (path,) = solve_cache.solve_entries()
    data = json.loads(path.read_text())
    data["objective"] *= 0.5  # a plan that does not score as stored
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="rpcompile"):
        again = compile_gpt(head_chunks=1)
    lines = [r.getMessage() for r in caplog.records if "solve cache" in r.getMessage()]
    assert len(lines) == 1 and "(its plan does not check out against the problem); solving afresh" in lines[0]
    assert not again.result.cached and plan_dict(again) == plan_dict(first)
    assert json.loads(path.read_text())["objective"] == first.result.objective  # overwritten
    path.write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rpcompile"):
        compile_gpt(head_chunks=1)
    assert [r.getMessage() for r in caplog.records if "solve cache" in r.getMessage()][0].endswith(
        "(corrupt: invalid JSON at line 1 column 2 (Expecting property name enclosed in double quotes)); solving "
        "afresh")


HOSTILE = {  # issue 36: each crashed the next compile (RecursionError, ...) instead of one warning
    "nested": (lambda raw: raw.replace(b'"stats": {', b'"stats": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b",", 1),
               "corrupt: nested deeper than 6 levels"),
    "not UTF-8": (lambda raw: raw.replace(b'"key"', b'"k\xffy"', 1), "corrupt: byte"),
    "infinite objective": (lambda raw: _set(raw, "objective", "Infinity"), "corrupt: Infinity is not a number"),
    "huge index": (lambda raw: _set(raw, "plan", '{"forward": [[0, 1' + "0" * 400 + ']], "fused": [0, 1], '
                                                 '"backward": [], "saved": []}'), "corrupt: the number"),
    "range beyond the problem": (lambda raw: _set(raw, "plan", '{"forward": [[0, 4611686018427387904]], "fused": '
                                                               '[0, 1], "backward": [], "saved": []}'), "wrong schema"),
    "strings for numbers": (lambda raw: _set(raw, "objective", '"0.5"'), "wrong schema"),
}


def _set(raw: bytes, field: str, text: str) -> bytes:
    data = json.loads(raw)
    data[field] = "@@"
    return json.dumps(data).replace('"@@"', text).encode()


def test_hostile_entries_are_ignored_with_one_warning_and_solved_afresh(caplog):
    first = compile_gpt(head_chunks=1)
    (path,) = solve_cache.solve_entries()
    good = path.read_bytes()
    for name, (corrupt, why) in HOSTILE.items():
        path.write_bytes(corrupt(good))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rpcompile"):
            again = compile_gpt(head_chunks=1)
        lines = [r.getMessage() for r in caplog.records if "solve cache" in r.getMessage()]
        assert len(lines) == 1 and f"({why}" in lines[0] and lines[0].endswith("solving afresh"), (name, lines)
        assert not again.result.cached and plan_dict(again) == plan_dict(first), name


def test_the_cli_reuses_a_solve_and_cache_clear_forgets_it(capsys, monkeypatch):
    argv = ["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--time-limit", "2", "--head-chunks", "1",
            "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    real = planning.ilp
    monkeypatch.setattr(planning, "ilp", lambda *a, **k: pytest.fail("solved although the cache holds it"))
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["stages"] == first["stages"]
    assert main(["cache", "clear"]) == 0
    assert "and 1 solved partition" in capsys.readouterr().out
    assert solve_cache.solve_entries() == []
    calls = []
    monkeypatch.setattr(planning, "ilp", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert main([*argv, "--no-cache"]) == 0
    assert calls == [1] and solve_cache.solve_entries() == []
