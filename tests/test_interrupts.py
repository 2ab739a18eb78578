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
    # Python's own SIGINT handler, even where the suite runs with SIGINT ignored (``nohup``, ``&`` in a script,
    # some CI runners): a child inheriting SIG_IGN would never raise KeyboardInterrupt
    code = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


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
        from rpcompile.passes.solver.ilp import solve_budget
        from rpcompile.passes.solver.tables import RangeTables

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


TRAINING = """
    import os, random, signal, sys, threading, time
    import torch, torch.nn as nn, torch.nn.functional as F
    import rpcompile
    from test_runtime import FINE_CPU

    LR = 0.1

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.b(self.a(x).relu())

    class SlowSGD(torch.optim.Optimizer):  # plain SGD, a pause before each parameter: half done for a while
        def __init__(self, params):
            super().__init__(params, dict(lr=LR))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        time.sleep(0.01)
                        p.add_(p.grad, alpha=-LR)

    torch.manual_seed(0)
    model = MLP()
    pipe = rpcompile.compile(model, (torch.randn(6, 8),), loss_fn=F.mse_loss, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=1.0, head_chunks=1)
    opt = SlowSGD(model.parameters())
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    params = list(model.parameters())
    rng = random.Random(SEED)
    sent = [0.0]

    def ctrl_c():
        sent[0] = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)

    def train(right_after_step):
        global before, after
        while True:
            pipe.forward_backward(x, target=y)
            before = [p.detach().clone() for p in params]        # the weights without this step ...
            after = [b.clone().add_(p.grad, alpha=-LR) for b, p in zip(before, params)]  # ... and with it
            pipe.step(opt, overlap=True)
            if right_after_step:  # the loop's own code, the step still running on its thread
                ctrl_c()

    before = after = [p.detach().clone() for p in params]
    for trial in range(TRIALS + 1):
        timer = None
        if trial:  # at a random point of the loop (from a timer thread, as a terminal's Ctrl-C)
            timer = threading.Timer(rng.uniform(0.0, 0.25), ctrl_c)
            timer.start()
        try:
            try:
                train(right_after_step=trial == 0)
            except KeyboardInterrupt:
                took = time.perf_counter() - sent[0]
                now = [p.detach().clone() for p in params]
                same = lambda ref: all(torch.equal(a, b) for a, b in zip(now, ref))
                print("trial", trial, "stepped" if same(after) else "not stepped" if same(before) else "HALF",
                      round(took, 3), flush=True)
        finally:
            if timer is not None:
                timer.join()
        pipe.synchronize()  # training goes on from here
        pipe.forward_backward(x, target=y)
    print("last", flush=True)
    threading.Timer(0.1, ctrl_c).start()
    try:
        train(right_after_step=False)
    finally:
        print("finally", round(time.perf_counter() - sent[0], 3), flush=True)
"""


@pytest.mark.parametrize("seed", [0])
def test_ctrl_c_at_any_point_of_overlapped_training_leaves_the_weights_stepped_or_not(seed: int) -> None:
    """``pipe.step(opt, overlap=True)`` in a loop, Ctrl-C right after a step (in the loop's own code) and at random
    points: each time a ``KeyboardInterrupt`` within a bounded time, the weights exactly those before or after the
    last step — never half stepped (the old code raised at once while the step still wrote the masters, or lost
    track of it mid-collection) — and training goes on from there; a last, uncaught Ctrl-C ends the process."""
    trials = 12
    out = _child(TRAINING.replace("SEED", str(seed)).replace("TRIALS", str(trials)))
    lines = _lines(out)
    assert out.returncode in INTERRUPTED and out.stderr.rstrip().endswith("KeyboardInterrupt"), (
        out.returncode, lines, out.stderr[-3000:])
    results = [line.split() for line in lines if line.startswith("trial ")]
    assert len(results) == trials + 1, lines
    for _, trial, *state, took in results:
        assert " ".join(state) in ("stepped", "not stepped"), lines
        assert float(took) < 5.0, lines  # within a step's time (a step here: about 40 ms)
    assert results[0][2] == "stepped", lines  # right after pipe.step: the step finished first
    assert lines[-2] == "last" and lines[-1].startswith("finally ") and float(lines[-1].split()[1]) < 5.0, lines
