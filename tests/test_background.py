"""Work in a forked child (rpcompile.passes.background): the same answer as in the caller, whatever goes wrong."""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path

import pytest
import torch

import rpcompile.passes.background as background
import rpcompile.passes.solve_cache as solve_cache
from rpcompile.core.errors import InfeasibleError
from rpcompile.passes.background import later
from rpcompile.passes.solve_cache import solve_apart, solving
from rpcompile.planner.planning import cached_solve
from rpcompile.planner.plan_options import fastest

from partition_cases import llama_like, tiny_chain

CALLER = os.getpid()
FORKS = background.enabled()  # two cores and Linux here and in CI; elsewhere everything runs in the caller


def _where() -> int:
    return os.getpid()


def test_the_work_runs_in_a_child_and_its_result_comes_back():
    job = later(lambda: (_where(), [1.5, "x", {"k": (2, 3)}]))
    assert job.forked == FORKS
    pid, value = job.result()
    assert value == [1.5, "x", {"k": (2, 3)}]
    assert (pid != CALLER) == FORKS
    assert job.result()[0] == pid  # asked again: the same answer, not run again


def test_not_in_the_background_it_runs_in_the_caller_when_asked_for():
    ran: list[int] = []
    job = later(lambda: ran.append(_where()) or "done", background=False)
    assert not job.forked and ran == []  # nothing yet
    assert job.result() == "done" and ran == [CALLER]


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(background.ENV, "off")
    assert not background.enabled()
    assert later(_where).result() == CALLER


def test_an_exception_in_the_child_is_raised_by_result():
    job = later(lambda: (_ for _ in ()).throw(InfeasibleError("no plan fits 1 GiB per device")))
    with pytest.raises(InfeasibleError, match="^no plan fits 1 GiB per device$"):
        job.result()


@pytest.mark.skipif(not FORKS, reason="nothing is forked here")
def test_any_other_error_in_the_child_leaves_the_work_to_the_caller():
    def work():
        if os.getpid() != CALLER:
            raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")  # what a fork may cause
        return "from the caller"

    assert later(work).result() == "from the caller"

    def broken():
        raise KeyError("a real bug")

    with pytest.raises(KeyError, match="a real bug"):  # raised again where it ran last: here
        later(broken).result()


@pytest.mark.skipif(not FORKS, reason="nothing is forked here")
def test_a_child_that_dies_leaves_the_work_to_the_caller():
    def work():
        if os.getpid() != CALLER:
            os._exit(3)  # killed by the OS, say
        return "from the caller"

    assert later(work).result() == "from the caller"


@pytest.mark.skipif(not FORKS, reason="nothing is forked here")
def test_a_result_that_does_not_pickle_is_made_again_in_the_caller():
    value = later(lambda: (lambda: _where())).result()  # a lambda cannot cross the pipe
    assert value() == CALLER


@pytest.mark.skipif(not FORKS, reason="nothing is forked here")
def test_a_silent_child_is_given_up_on_and_stopped(caplog):
    def work():
        if os.getpid() != CALLER:
            time.sleep(60)  # hung
        return "from the caller"

    job = later(work, timeout_s=0.5)
    child = job._child[0]
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="rpcompile"):
        assert job.result() == "from the caller"
    assert time.perf_counter() - started < 10
    assert "background work was silent for 0.5 s; running it here instead" in caplog.text
    assert not child.is_alive()


@pytest.mark.skipif(not FORKS, reason="nothing is forked here")
def test_work_nobody_asks_for_is_stopped_when_forgotten():
    job = later(lambda: time.sleep(60))
    child = job._child[0]
    assert child.is_alive()
    del job
    gc.collect()
    assert not child.is_alive()


def test_fastest_starts_every_attempt_before_it_finishes_any_and_finishes_the_last_first():
    events: list[str] = []

    def attempt(k):
        events.append(f"start {k}")

        def finish():
            events.append(f"finish {k}")
            return {1: 3.0, 8: 2.0}[k], k

        return finish

    assert fastest((1, 8), attempt) == 8
    assert events == ["start 1", "start 8", "finish 8", "finish 1"]


def test_fastest_skips_a_split_whose_deferred_work_fails_and_keeps_the_first_of_equals():
    def attempt(k):
        def finish():
            if k == 8:
                raise InfeasibleError("no plan with 8")
            return 2.0, k
        return finish

    assert fastest((1, 8), attempt) == 1
    assert fastest((1, 4), lambda k: (lambda: (2.0, k))) == 1
    with pytest.raises(InfeasibleError, match="no plan with 8"):
        fastest((8,), attempt)


def test_a_solve_goes_to_a_child_only_where_it_pays(monkeypatch):
    """Not a small problem, nor one the solve cache holds, nor in a process whose fork costs more than the solve."""
    big, small = llama_like(8), tiny_chain(6)  # 18 and 6 segments: about 0.45 and 0.15 s to solve
    monkeypatch.setattr(solve_cache, "fork_cost_s", lambda: 0.1)
    assert solve_apart(big, time_limit_s=5.0) == FORKS
    assert solving(lambda: "solved", big, time_limit_s=5.0).forked == FORKS
    last = solving(lambda: "solved", big, time_limit_s=5.0, background=False)  # the last split: solved here
    assert not last.forked and last.result() == "solved"
    assert not solve_apart(small, time_limit_s=5.0)
    assert not solve_apart(big, time_limit_s=0.2)  # its limit keeps it short
    monkeypatch.setattr(solve_cache, "fork_cost_s", lambda: 2.0)  # a process holding a large model in CPU memory
    assert not solve_apart(big, time_limit_s=5.0)
    monkeypatch.setattr(solve_cache, "fork_cost_s", lambda: 0.1)
    cached_solve(big, "ilp", time_limit_s=0.5)
    assert not solve_apart(big, time_limit_s=0.5)  # cached: the caller looks it up
    assert solve_apart(big, time_limit_s=0.5, cache=False) == FORKS


def test_the_fork_cost_follows_the_memory_the_process_holds():
    before = background.fork_cost_s()
    held = torch.ones(2**28)  # 1 GiB, touched: 2 MiB of page tables in 4 KiB pages, none in huge pages
    grown = background.fork_cost_s() - before
    assert 0 <= grown <= 2.2 * background.FORK_S_PER_PAGE_TABLE_MIB
    if not Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().startswith("[always]"):
        assert grown >= 1.8 * background.FORK_S_PER_PAGE_TABLE_MIB
    del held
