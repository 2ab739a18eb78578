"""The command line: help, profile tables and JSON, bad MODEL arguments, the console script."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import re
import subprocess
import sys

import pytest
import torch
from rich.console import Console

import rpcompile.cli.loading
import rpcompile.cli.plan_cmd
from rpcompile import __version__
from rpcompile.cli import main
from rpcompile.cli.common import step
from rpcompile.core.units import fmt_ms, fmt_params
from rpcompile.tools.demo import CPU_NOTE, run_demo

PROFILE_FIELDS = {"params", "param_bytes", "fwd_flops", "fwd_time_s", "bwd_time_s", "activation_bytes"}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_help():
    done = subprocess.run([sys.executable, "-m", "rpcompile", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for command in ("profile", "plan", "demo", "models"):
        assert command in done.stdout


def test_only_the_process_command_line_freezes_what_is_alive_before_exit(capsys, monkeypatch):
    frozen = []
    monkeypatch.setattr("rpcompile.cli.gc.freeze", lambda: frozen.append(True))
    assert main(["models"]) == 0  # called with arguments (a test, a caller): nothing frozen, its garbage still goes
    assert frozen == []
    monkeypatch.setattr(sys, "argv", ["rpcompile", "models"])
    assert main() == 0  # the console script: frozen after the imports, and before the process exits
    assert frozen == [True, True]
    assert "llama-8b" in capsys.readouterr().out


def test_models_lists_builtins(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    assert {"llama-demo", "gpt-demo", "cnn-demo", "llama-8b"} <= set(out.split())


def _row(out: str, name: str) -> list[str]:
    """The cells of the table row that starts with ``name`` (rich draws │ between cells)."""
    line = next(line for line in out.splitlines() if line.startswith(f"│ {name} "))
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_models_say_size_layers_and_where_they_run(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    header = [cell.strip() for cell in next(line for line in out.splitlines() if "model" in line and "params" in line)
              .strip("┃").split("┃")]
    assert header == ["model", "params", "layers", "runs", "shape"]
    assert _row(out, "llama-8b")[:4] == ["llama-8b", "8.03B", "32", "meta only: profile, plan, simulate"]
    assert _row(out, "llama-demo")[:4] == ["llama-demo", "217.7k", "4", "trains here (cpu)"]
    assert _row(out, "qwen3-30b-a3b")[:3] == ["qwen3-30b-a3b", "30.5B", "48"]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"rpcompile {__version__}\n"
    assert __version__ == importlib.metadata.version("rpcompile")  # the installed package says the same


def test_numbers_are_written_as_people_write_them():
    assert [fmt_params(n) for n in (8_030_261_248, 32_762_123_264, 217_664, 1_511_488, 64)] == [
        "8.03B", "32.8B", "217.7k", "1.51M", "64"]
    assert [fmt_ms(s) for s in (2.621, 0.0386, 0.00576, 0.000978, 1e-7)] == [
        "2,621 ms", "38.6 ms", "5.76 ms", "0.978 ms", "0 ms"]


SPECS = "rtx4090, rtx3090, a100-80g, h100-sxm, h200, cpu"


@pytest.mark.parametrize("argv,message", [
    (["plan", "llama-demo", "--gpus", "2", "--spec", "nosuchgpu"],
     f"rpcompile plan: error: argument --spec: unknown GPU spec 'nosuchgpu'; choose one of {SPECS}; "
     "see rpcompile plan --help"),
    (["profile", "llama-demo", "--spec", "nosuchgpu"],
     f"rpcompile profile: error: argument --spec: unknown GPU spec 'nosuchgpu'; choose one of {SPECS}; "
     "see rpcompile profile --help"),
    (["plan", "llama-demo", "--gpus", "0"],
     "rpcompile plan: error: argument --gpus: expected a positive integer, got '0'; see rpcompile plan --help"),
    (["plan", "llama-demo", "--gpus", "-2"],
     "rpcompile plan: error: argument --gpus: expected a positive integer, got '-2'; see rpcompile plan --help"),
    (["simulate", "llama-demo", "--gpus", "0"],
     "rpcompile simulate: error: argument --gpus: expected a positive integer, got '0'; "
     "see rpcompile simulate --help"),
    (["plan", "llama-demo"],
     "rpcompile plan: error: the following arguments are required: --gpus; see rpcompile plan --help"),
])
def test_bad_arguments_are_one_line_with_exit_code_2(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and err == message + "\n"


def test_a_factory_that_raises_is_one_line(capsys, tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def factory():\n    raise RuntimeError('no weights here\\nsecond line')\n")
    code, out, err = run(capsys, "profile", f"{path}:factory")
    assert code == 2 and out == ""
    assert err == (f"rpcompile: error: {path}:factory: factory() raised RuntimeError: no weights here; fix {path}, "
                   "or run it in Python to see the traceback\n")


def test_an_unwritable_output_is_refused_before_planning(capsys, monkeypatch, tmp_path):
    """-o is checked first: a plan of a big model takes minutes, and its file is the point."""
    def no_planning(*args, **kwargs):
        raise AssertionError("planned before checking -o")

    monkeypatch.setattr(rpcompile.cli.plan_cmd, "prepare", no_planning)
    missing = tmp_path / "missing_dir" / "x.json"
    code, out, err = run(capsys, "plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "-o", str(missing))
    assert code == 2 and out == ""
    assert err == (f"rpcompile: error: -o {missing}: directory {missing.parent} does not exist; create it "
                   f"(mkdir -p {missing.parent}) or write elsewhere\n")
    code, _, err = run(capsys, "plan", "llama-demo", "--gpus", "2", "-o", str(tmp_path))
    assert code == 2 and err == (f"rpcompile: error: -o {tmp_path} is a directory; give a file name such as "
                                 f"{tmp_path / 'plan.json'}\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_gpu_this_machine_lacks_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "llama-demo", "--gpus", "2", "--device", "cuda:0"])
    assert info.value.code == 2 and capsys.readouterr().err == (
        "rpcompile plan: error: argument --device: cuda:0: this machine has 0 CUDA device(s); for a GPU you do not "
        "have, use --spec NAME (analytic costs) instead; see rpcompile plan --help\n")


def test_an_emit_directory_that_cannot_be_made_is_refused_first(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, out, err = run(capsys, "plan", "llama-demo", "--gpus", "2", "--emit", str(blocker / "stages"))
    assert code == 2 and out == ""
    assert err == (f"rpcompile: error: --emit {blocker / 'stages'}: cannot create the directory (Not a directory); "
                   "pick a path you can write\n")


def test_an_unexpected_error_is_one_line_and_verbose_shows_it(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("wte")

    monkeypatch.setattr(rpcompile.cli.loading, "load_model", broken)
    code, out, err = run(capsys, "profile", "llama-demo")
    assert code == 2 and out == "" and err == (
        "rpcompile: error: KeyError: 'wte' (unexpected: rerun with -v for the traceback, and please report it)\n")
    with pytest.raises(KeyError):
        main(["-v", "profile", "llama-demo"])


def test_errors_through_the_console_script_have_no_traceback(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def factory():\n    raise RuntimeError('boom')\n")
    for argv in (["plan", "llama-demo", "--gpus", "-2"], ["profile", f"{path}:factory"]):
        done = subprocess.run([sys.executable, "-m", "rpcompile", *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def test_plan_and_simulate_default_to_the_same_microbatches(capsys):
    """One default, stated in both --help texts: gpus + 1, as rpcompile.compile."""
    for command in ("plan", "simulate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "default gpus + 1 (1 on one device), as rpcompile.compile" in " ".join(capsys.readouterr().out.split())
    code, out, _ = run(capsys, "plan", "llama-demo", "--gpus", "3", "--spec", "rtx4090", "--head-chunks", "1",
                       "--time-limit", "1", "--json")
    assert code == 0 and json.loads(out)["microbatches"] == 4
    code, out, _ = run(capsys, "simulate", "llama-demo", "--gpus", "3", "--spec", "rtx4090", "--schedules", "1f1b",
                       "--json")
    assert code == 0 and json.loads(out)["microbatches"] == 4


def test_the_bound_is_labelled_as_the_objectives(capsys):
    """The solver's bound is on c(S)·T, which can exceed the plan's exact iteration time: the caption says so."""
    code, out, _ = run(capsys, "plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--head-chunks", "1",
                       "--time-limit", "1")
    text = " ".join(out.split())
    assert code == 0 and "proven bound" not in text
    assert re.search(r"ILP objective \(stage factor × slowest stage\) proven ≥ [\d,.]+ ms, gap [\d.]+% — a bound on "
                     r"that objective, not on the iteration time", text), text
    assert re.search(r"predicted from analytic\S* costs: iteration [\d,.]+ ms", text), text


def test_progress_shows_on_a_terminal_only(capsys, monkeypatch):
    with step(argparse.Namespace(json=False), "solving"):
        pass
    assert capsys.readouterr().err == ""  # not a terminal (pytest captures stderr; CI pipes it)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with step(argparse.Namespace(json=True), "solving"):
        pass
    assert capsys.readouterr().err == ""  # --json: quiet even on a terminal


def test_profile_json_schema(capsys):
    code, out, _ = run(capsys, "profile", "llama-demo", "--json")
    assert code == 0
    data = json.loads(out)
    assert PROFILE_FIELDS <= set(data["total"])
    names = [m["name"] for m in data["modules"]]
    assert names[:2] == ["(root)", "embed"] and "layers.3" in names and names[-1] == "lm_head"
    for m in data["modules"]:
        assert PROFILE_FIELDS | {"name"} <= set(m)
    assert sum(m["params"] for m in data["modules"]) == data["total"]["params"]
    assert data["total"]["fwd_time_s"] > 0 and data["trace"] == "fx"


def test_profile_nodes_json(capsys):
    code, out, _ = run(capsys, "profile", "cnn-demo", "--json", "--nodes")
    data = json.loads(out)
    assert code == 0 and len(data["nodes"]) == sum(m["nodes"] for m in data["modules"])


def test_profile_llama8b_analytic_on_meta(capsys):
    code, out, _ = run(capsys, "profile", "llama-8b", "--spec", "rtx4090", "--precision", "bf16", "--json")
    assert code == 0
    total = json.loads(out)["total"]
    assert abs(total["params"] - 8.03e9) / 8.03e9 < 0.01
    assert total["param_bytes"] == total["params"] * 4  # fp32 masters
    # forward FLOPs of one 4096-token sequence: ~2 * params * tokens plus attention
    assert 2 * 8.0e9 * 4096 < total["fwd_flops"] < 2.4 * 8.0e9 * 4096
    assert 0.1 < total["fwd_time_s"] < 2.0 and total["bwd_time_s"] > total["fwd_time_s"]


def test_profile_table_mentions_modules(capsys):
    code, out, _ = run(capsys, "profile", "gpt-demo", "--spec", "rtx4090")
    assert code == 0
    assert out.splitlines()[0].strip() == "gpt-demo: cost table (predicted: analytic costs for rtx4090, traced with fx)"
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert rows == ["(root)", "wte", "wpe", "drop", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "lm_head", "total"]


def test_unknown_model_is_one_line_error(capsys):
    code, out, err = run(capsys, "profile", "no-such-model")
    assert code == 2 and out == ""
    assert err.startswith("rpcompile: error: unknown model 'no-such-model'") and err.count("\n") == 1


def test_bad_factory_file(capsys, tmp_path):
    path = tmp_path / "m.py"
    path.write_text("x = 1\n")
    code, _, err = run(capsys, "profile", f"{path}:factory")
    assert code == 2 and "factory" in err and err.count("\n") == 1


def test_spec_and_device_are_exclusive(capsys):
    with pytest.raises(SystemExit) as info:
        main(["profile", "llama-demo", "--spec", "rtx4090", "--device", "cpu"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_batch_too_small_for_microbatches_is_one_line(capsys):
    code, out, err = run(capsys, "plan", "llama-demo", "--gpus", "4", "--spec", "rtx4090", "--batch-size", "4")
    assert code == 2 and out == ""
    assert err == ("rpcompile: error: a batch of 4 cannot be split into 5 microbatches; use microbatches between "
                   "1 and 4 (--microbatches) or a larger batch (--batch-size)\n")


def test_a_small_example_batch_grows_to_one_sample_per_microbatch(capsys):
    """Without --batch-size, a built-in model whose example batch is smaller than the microbatch count (the meta
    presets have one sequence) is loaded with one sample per microbatch."""
    code, out, _ = run(capsys, "plan", "llama-demo", "--gpus", "4", "--spec", "rtx4090", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["microbatches"] == 5 and plan["tokens_per_microbatch"] == 32


@pytest.mark.skipif(torch.cuda.is_available(), reason="the demo trains on the GPUs there")
def test_the_demo_trains_the_plan_it_prints():
    """make demo: section 3 trains the very plan section 2 printed, and sets the prediction beside the measured
    step time, saying what the prediction is on this machine."""
    buf = io.StringIO()
    assert run_demo("llama-demo", big_model="", steps=2, console=Console(file=buf, width=200)) == 0
    out = buf.getvalue()
    shown = int(re.search(r"llama-demo: the ilp plan, (\d+) stages on 2 logical CPU devices, (\d+) microbatches", out).group(1))
    steps = re.findall(r"^step \d: loss [\d.]+  \(pipeline [\d,.]+ ms, optimizer [\d,.]+ ms; (\d+) stages, 3 "
                       r"microbatches\)", out, re.MULTILINE)
    assert steps == [str(shown)] * 2
    losses = [float(v) for v in re.findall(r"^step \d: loss ([\d.]+)", out, re.MULTILINE)]
    evaluated = float(re.search(r"^after 2 steps: pipe\.evaluate\(x, target=y\) = ([\d.]+) \(no gradients, the same "
                                r"3 microbatches\)", out, re.MULTILINE).group(1))
    assert evaluated < losses[0]  # two AdamW steps on this very batch lowered its loss
    assert re.search(r"plan's prediction: [\d,.]+ ms per pipeline step \(timing model over the cpu spec's analytic "
                     r"costs\); measured: [\d,.]+ ms \(median of steps 1–1\), [\d.e+]+× the prediction\.",
                     " ".join(out.split()))
    assert " ".join(CPU_NOTE.split()) in " ".join(out.split())


def test_every_command_explains_itself_with_examples_that_parse(capsys):
    """``rpcompile COMMAND --help`` has a description and examples, and every example parses as written; no
    option has two names for one thing (``--dtype`` was ``profile``'s ``--precision``)."""
    import shlex

    from rpcompile.cli.parser import EXAMPLES, build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == set(EXAMPLES)
    for name, sub in commands.items():
        text = sub.format_help()
        assert sub.description and "examples:" in text, name
        for line in EXAMPLES[name]:
            assert line in text
            parser.parse_args(shlex.split(line)[1:])
        options = [o for a in sub._actions for o in a.option_strings]
        assert "--dtype" not in options and len(options) == len(set(options)), name
