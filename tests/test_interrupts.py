"""Ctrl-C at every point of a process that planned, compiled or trained (issue 36): a ``KeyboardInterrupt`` that
``try``/``finally`` sees, within a bounded time, and nothing half done.

Each case runs in a child process (a Ctrl-C that kills a process cannot be observed from inside it) that sends
SIGINT to itself — from a timer thread, as a terminal's Ctrl-C arrives between any two instructions — and prints
what it saw; the test reads the lines back. The children are small: a tiny model, short solves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
INTERRUPTED = (-signal.SIGINT, 128 + signal.SIGINT)  # how a process that died of KeyboardInterrupt exits


def _child(code: str, *, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "RPCOMPILE_BACKGROUND": "off", "RPCOMPILE_CACHE": os.environ.get("RPCOMPILE_CACHE", "")}
    env = {k: v for k, v in env.items() if v != ""}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _lines(out: subprocess.CompletedProcess[str]) -> list[str]:
    return out.stdout.splitlines()


def test_ctrl_c_after_a_compile_that_solved_its_plan_is_a_keyboard_interrupt():
    """CP-SAT's SIGINT handling left the process at the default action after ``Solve()``: the next Ctrl-C killed
    it (exit 130, no ``KeyboardInterrupt``, no ``finally``). The memory limit makes the plan need CP-SAT."""
    out = _child("""
        import os, signal, time
        import rpcompile
        from rpcompile.models.registry import load_model
        m = load_model("llama-demo")
        before = signal.getsignal(signal.SIGINT)
        pipe = rpcompile.compile(m.model, m.example_inputs, loss_fn=m.loss_fn, devices=["cpu"] * 3, spec="cpu",
                                 microbatches=4, memory_limit=1297654, time_limit_s=1.0, head_chunks=1, cache=False)
        print("cp-sat solves", pipe.plan.stats["candidates_tried"], flush=True)
        print("handler kept", signal.getsignal(signal.SIGINT) is before, flush=True)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", flush=True)
        finally:
            print("finally", flush=True)
    """)
    lines = _lines(out)
    assert out.returncode == 0, (out.returncode, lines, out.stderr[-2000:])
    solves = int(lines[0].split()[-1])
    assert solves >= 1, lines  # the plan went through CP-SAT
    assert lines[1:] == ["handler kept True", "KeyboardInterrupt", "finally"], lines


def test_ctrl_c_during_a_solve_stops_it_with_a_keyboard_interrupt():
    """A Ctrl-C in the middle of a CP-SAT solve: CP-SAT stopped the search as if its time was up and the caller
    went on with what it had; now the solve stops and the caller gets ``KeyboardInterrupt`` (and the process's
    handler is back)."""
    out = _child("""
        import os, signal, threading, time
        from ortools.sat.python import cp_model
        from partition_cases import llama_like
        from rpcompile.passes.ilp import solve_budget
        from rpcompile.passes.tables import RangeTables

        real = cp_model.CpSolver.solve
        def solve(self, *args, **kwargs):  # Ctrl-C half a second into the solve itself
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            return real(self, *args, **kwargs)
        cp_model.CpSolver.solve = solve

        pb = llama_like(32, devices=8, microbatches=16)
        tables = RangeTables.build(pb)
        started = time.perf_counter()
        try:
            res = solve_budget(pb, tables, tables.bwd_time, 40, ub=2.0, det_time=500.0, wall_time=60.0)
            print("returned", res.status, flush=True)
        except KeyboardInterrupt:
            print("KeyboardInterrupt after", round(time.perf_counter() - started, 1), flush=True)
        finally:
            print("finally", flush=True)
        print("handler", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # and a Ctrl-C after it is one too
        time.sleep(5)
    """)
    lines = _lines(out)
    assert out.returncode in INTERRUPTED and "KeyboardInterrupt" in out.stderr, (out.returncode, lines,
                                                                                 out.stderr[-2000:])
    assert lines[0].startswith("KeyboardInterrupt after "), lines
    assert float(lines[0].split()[-1]) < 5.0, lines  # the search stopped: the solve alone runs for seconds
    assert lines[1:] == ["finally", "handler True"], lines
