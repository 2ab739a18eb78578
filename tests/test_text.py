"""Nothing from a file becomes code, markup or a terminal escape (issue 36; rpcompile.core.text and its users).

Hypothesis writes hostile strings — line breaks (``\\n``, ``\\r``, U+2028, U+0085), quotes and triple quotes,
backslashes, NUL, ESC/CSI/OSC and C1 controls, rich markup and emoji codes, XML, planted code — into the text
fields of a plan:

- through a file, into every text field: ``compile(plan=...)`` refuses it in one printable line, or compiles it,
  and then the generated stage code imports without running anything planted and parses to the clean plan's code;
  ``rpcompile show`` (its table and ``--graph`` SVG) and ``simulate`` print no control character, one line when
  they refuse, and the SVG is well-formed;
- past the files (plans built in memory, as a caller could): ``stage_source``, the plan table, the graph (SVG and
  DOT) and the timeline show the text escaped — never as code, markup or a control character.

A few dozen examples by default; ``-m slow`` runs many more.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib.util
import io
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rich.console import Console

import rpcompile
from rpcompile.cli import main
from rpcompile.core.errors import RPCompileError
from rpcompile.core.plan import Plan
from rpcompile.core.text import printable
from rpcompile.passes.rewrite.codegen import stage_source
from rpcompile.tools.simulation import plan_scenarios, run_all
from rpcompile.views.gantt import timeline_svg
from rpcompile.views.graphview import graph_dot, graph_svg
from rpcompile.views.report import plan_table

from _toy import TiedToy
from test_runtime import FINE_CPU

FAST = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
PARTS = ["\n", "\r", "\r\n", "\u2028", "\u2029", "\x85", "\x00", "\x0b", "\x0c", "\x7f", "\t", "\x1b[2J", "\x1b[31m",
         "\x1b]8;;http://evil\x07", "\x1b]0;title\x1b\\", "\x9b31m", "\x9d0;x\x9c", "\u202e", "'", '"', "'''", '"""',
         "\\", "\\n", "\\x1b", "#", ")", "[bold red]", "[/]", "[link=http://evil]", ":thumbs_up:", "<script>", "&amp;",
         "]]>", "import builtins; builtins.PWNED = 1", "__import__('os')._exit(7)", "F0", "layers.0", "a_1", " "]
HOSTILE = st.lists(st.one_of(st.sampled_from(PARTS), st.text(max_size=4)), min_size=1, max_size=6).map("".join)
IDS = torch.randint(0, 16, (6, 5))
KW: dict[str, Any] = dict(loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                          devices=["cpu", "cpu"], microbatches=3, head_chunks=1)
SVG_TAGS = {f"{{http://www.w3.org/2000/svg}}{t}" for t in
            ("svg", "title", "style", "defs", "marker", "path", "g", "rect", "text", "line", "pattern")}


def terminal_safe(text: str) -> bool:
    """No character a terminal acts on: only printable ones and line ends."""
    return all(c == "\n" or c.isprintable() for c in text)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, rpcompile.Pipeline, list[str]]:
    """The toy model, its pipeline and the AST of its stage code compiled from its plan's file."""
    torch.manual_seed(0)
    model = TiedToy()
    pipe = rpcompile.compile(model, (IDS,), spec=FINE_CPU, time_limit_s=2.0, **KW)
    clean = tmp_path_factory.mktemp("clean")
    again = rpcompile.compile(model, (IDS,), plan=str(pipe.plan.save(clean / "plan.json")), **KW)
    return model, pipe, _code(again.codegen(clean / "stages"))


def _code(paths: list[Path]) -> list[str]:
    return [ast.dump(ast.parse(p.read_text())) for p in sorted(paths)]


# ---- through the files --------------------------------------------------------------------------------------------
def _string_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a string in the JSON tree."""
    if isinstance(value, str):
        return [prefix]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [p for k, v in items for p in _string_paths(v, (*prefix, k))]


def _fields(plan: Plan) -> dict[str, list[tuple]]:
    """Every text field of ``plan``'s file (its path without list indices) → the paths to its strings."""
    out: dict[str, list[tuple]] = {}
    for path in _string_paths(json.loads(plan.to_json())):
        out.setdefault(".".join(str(k) for k in path if not isinstance(k, int)), []).append(path)
    return out


def _with(data: dict, path: tuple, value: str) -> dict:
    data = json.loads(json.dumps(data))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


def _imports_cleanly(paths: list[Path]) -> None:
    for i, p in enumerate(paths):
        spec = importlib.util.spec_from_file_location(f"_hostile_stage_{i}", p)
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert not hasattr(builtins, "PWNED"), "code from the plan file ran"


def _hostile_plan_file(toy, tmp_path_factory, capsys, data) -> None:
    model, pipe, clean = toy
    work = tmp_path_factory.mktemp("hostile")
    fields = _fields(pipe.plan)
    field = data.draw(st.sampled_from(sorted(fields)), label="field")
    path = data.draw(st.sampled_from(fields[field]), label="path")
    value = data.draw(HOSTILE, label="value")
    plan_file = work / "plan.json"
    plan_file.write_text(json.dumps(_with(pipe.plan.to_dict(), path, value)))
    try:
        hostile = rpcompile.compile(model, (IDS,), plan=str(plan_file), **KW)
    except RPCompileError as e:
        event("refused")
        assert "\n" not in str(e) and terminal_safe(str(e)), str(e)
    else:
        event("compiled")
        paths = hostile.codegen(work / "stages")
        _imports_cleanly(paths)
        assert _code(paths) == clean
    for argv in (["show", str(plan_file), "--graph", str(work / "g.svg")], ["simulate", str(plan_file)]):
        code = main(argv)
        out, err = capsys.readouterr()
        assert code in (0, 2) and terminal_safe(out + err), (argv, out, err)
        if code == 2:
            assert err.count("\n") == 1 and err.startswith("rpcompile: error: ") and "unexpected" not in err, err
        elif argv[0] == "show":
            assert set(e.tag for e in ET.parse(work / "g.svg").iter()) <= SVG_TAGS


@settings(FAST, max_examples=60)
@given(data=st.data())
def test_hostile_text_in_every_plan_field_never_runs_prints_or_styles(toy, tmp_path_factory, capsys, data):
    _hostile_plan_file(toy, tmp_path_factory, capsys, data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_many_hostile_plan_files(toy, tmp_path_factory, capsys, data):
    _hostile_plan_file(toy, tmp_path_factory, capsys, data)


def test_a_module_name_with_a_newline_is_refused_before_any_code_is_written(toy, tmp_path):
    """The issue's attack: ``modules`` text with a newline became code in every generated stage file."""
    model, pipe, _ = toy
    d = pipe.plan.to_dict()
    d["stages"][0]["modules"] = ["layers.0\nimport builtins; builtins.PWNED = 1\n#"]
    (tmp_path / "plan.json").write_text(json.dumps(d))
    with pytest.raises(RPCompileError, match=r"stages\[0\]\.modules\[0\]: holds the control or format character "
                                             r"'\\n', which no plan text has; re-plan to regenerate it$"):
        rpcompile.compile(model, (IDS,), plan=str(tmp_path / "plan.json"), **KW)


def test_markup_in_a_plan_file_is_shown_not_applied(toy, tmp_path, capsys, monkeypatch):
    """Text a plan may hold with brackets (a device name, a host note) is printed as written: rich markup eaten
    before (``[bold red]`` vanished and styled the rest)."""
    monkeypatch.setenv("COLUMNS", "2000")
    _, pipe, _ = toy
    d = pipe.plan.to_dict()
    d["hardware"]["spec"]["name"] = "[bold red]gpu[/bold red] :thumbs_up:"
    d["cost_model"] = "[link=http://evil]costs[/link]"
    (tmp_path / "plan.json").write_text(json.dumps(d))
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    out = "".join(capsys.readouterr().out.split())  # the title and caption wrap to the table's width
    assert "[boldred]gpu[/boldred]:thumbs_up:" in out and "[link=http://evil]costs[/link]" in out


# ---- past the files -----------------------------------------------------------------------------------------------
def _hostile_plan(plan: Plan, where: str, value: str) -> Plan:
    """``plan`` with ``value`` in one text field, built in memory (no file check in the way)."""
    hw, first = plan.hardware, plan.stages[0]
    stage = {"stage": dict(name=value), "nodes": dict(nodes=(value, *first.nodes)),
             "modules": dict(modules=(value, *first.modules))}
    if where in stage:
        return dataclasses.replace(plan, stages=(dataclasses.replace(first, **stage[where]), *plan.stages[1:]))
    if where == "spec":
        return dataclasses.replace(plan, hardware=dataclasses.replace(hw, spec=dataclasses.replace(hw.spec,
                                                                                                  name=value)))
    return dataclasses.replace(plan, **{where: (value,) if where == "host" else value})


@FAST
@given(value=HOSTILE, where=st.sampled_from(["name", "nodes", "modules", "params", "inputs"]))
def test_stage_code_holds_hostile_names_only_in_comments(toy, value, where):
    _, pipe, _ = toy
    prog, plan, host = pipe.program.stages[0], pipe.plan, pipe.program.host
    stage = {"name": dict(name=value), "nodes": dict(nodes=(value,)), "modules": dict(modules=(value,))}.get(where)
    hostile = dataclasses.replace(prog, stage=dataclasses.replace(prog.stage, **stage)) if stage else \
        dataclasses.replace(prog, params={k: value for k in prog.params}) if where == "params" else \
        dataclasses.replace(prog, inputs=(value, *prog.inputs))
    clean, text = stage_source(prog, plan, host), stage_source(hostile, plan, host)
    assert ast.dump(ast.parse(text)) == ast.dump(ast.parse(clean))
    assert len(text.splitlines()) == len(clean.splitlines()) and terminal_safe(text)
    assert printable(value) in text


@FAST
@given(value=HOSTILE, where=st.sampled_from(["stage", "modules", "nodes", "strategy", "cost_model", "spec", "host"]))
def test_the_plan_table_shows_hostile_text_as_written(toy, value, where):
    plan = _hostile_plan(toy[1].plan, where, value)
    console = Console(file=io.StringIO(), width=4000, color_system=None, force_terminal=False)
    console.print(plan_table(plan))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert terminal_safe(out)
    if where != "nodes":  # a stage with modules shows them, not its nodes; the caption wraps
        assert "".join(printable(value).split()) in "".join(out.split())


@FAST
@given(value=HOSTILE, where=st.sampled_from(["stage", "modules", "strategy", "host"]))
def test_the_plan_graph_keeps_hostile_text_inside_its_strings(toy, value, where):
    plan = _hostile_plan(toy[1].plan, where, value)
    svg = graph_svg(plan)
    assert terminal_safe(svg) and {e.tag for e in ET.fromstring(svg.encode()).iter()} <= SVG_TAGS
    dot = graph_dot(plan)
    assert terminal_safe(dot)
    for line in dot.splitlines():  # every quoted string ends on its line: none is cut short or runs on
        assert re.sub(r'\\.', "", line).count('"') % 2 == 0, line


@FAST
@given(value=HOSTILE)
def test_the_timeline_keeps_hostile_stage_names_inside_its_text(toy, value):
    plan = toy[1].plan
    (result,) = run_all(plan_scenarios(plan)).values()
    svg = timeline_svg(result.timeline, devices=2, stage_names=[value] * len(plan.stages), title=value)
    assert terminal_safe(svg) and {e.tag for e in ET.fromstring(svg.encode()).iter()} <= SVG_TAGS
    assert printable(value).strip() in "".join(ET.fromstring(svg.encode()).itertext())


@given(value=st.text())
def test_printable_is_one_visible_line_and_changes_nothing_printable(value):
    shown = printable(value)
    assert shown.isprintable() and len(shown.splitlines()) <= 1
    assert (shown == value) == value.isprintable()
