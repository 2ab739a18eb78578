"""Solved partitions on disk, so re-running a training script does not solve the same problem again; and where a
solve runs (here, or in a forked child while the caller goes on).

A solve is a function of its inputs: the :class:`~.solver.problem.PartitionProblem` (the solvers' whole input, in plain
numbers: costs, memory, link, microbatches), the strategy, the time limit (every phase of ``ilp`` is bounded by
counts derived from it, so the same limit gives the same plan) and the partitioner's source
(:func:`~.solver.source.solver_digest`). :func:`solve_key` keys an entry by all of them; :func:`lookup` returns a
warm entry's result — its plan re-checked against the problem (:func:`~.solver.segment_rules.validate_segment_plan`)
and re-scored (:func:`~.solver.timing.iteration_time` must give the stored objective) — and ``solve_time_s`` as
first measured; :func:`remember` keeps a fresh one. The pass driver solves through them
(:func:`rpcompile.planner.planning.cached_solve`). ``PartitionResult.cached`` says where a result came from. A solve
may run in a forked child (:func:`solving`): it reads and writes its entry there, as it would in the caller.

Measured costs from a warm profile cache give the same problem, so a second compile of a model on the same GPU
neither measures nor solves. Directory: ``solves/`` beside the profile cache (:func:`.cost.profile_cache.cache_dir`);
``rpcompile cache clear`` empties both and ``--no-cache`` / ``cache=False`` bypasses both. Only feasible results
are kept. An entry that cannot be read, is not strict JSON (not UTF-8, ``NaN``, numbers out of range, deep
nesting), is too large, has another key, a malformed plan or one that no longer checks out is ignored with one
warning line and solved afresh (then overwritten); a cache that cannot be written is warned about and ignored.
Writes go to a temporary file renamed into place.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from rpcompile.core.files import json_depth, jsonable
from rpcompile.core.jsoncache import JsonCache

from .background import FORK_PAYS, Later, enabled, fork_cost_s
from .cost.profile_cache import cache_dir
from .solver.problem import PartitionProblem, PartitionResult, SegmentPlan
from .solver.segment_rules import validate_segment_plan
from .solver.source import solver_digest
from .solver.timing import iteration_time

__all__ = ["SOLVE_FORMAT_VERSION", "lookup", "remember", "solve_key", "solve_entries", "clear_solves", "solving",
           "solve_apart", "solve_timeout", "SOLVE_S_PER_SEGMENT"]

#: What a solve's work returns.
T = TypeVar("T")

SOLVE_FORMAT_VERSION = 1
_MAX_ENTRY_BYTES = 64 * 2**20


def _root() -> Path:
    return cache_dir() / "solves"


_CACHE = JsonCache(root=_root, name="solve cache", afresh="solving afresh", max_bytes=_MAX_ENTRY_BYTES)


def solve_key(problem: PartitionProblem, strategy: str, *, time_limit_s: float, seed: int = 0) -> dict[str, Any]:
    """Everything a solve's result depends on (module docstring)."""
    # repr(float(...)): a limit of 10 and of 10.0 key alike, and the float is kept exactly
    return {"problem": problem.digest(), "strategy": strategy, "time_limit_s": repr(float(time_limit_s)),
            "seed": seed, "solver": solver_digest()}


def _path(key: dict[str, Any]) -> Path:
    return _CACHE.path(key)


def lookup(problem: PartitionProblem, strategy: str = "ilp", *, time_limit_s: float = 10.0,
           seed: int = 0) -> PartitionResult | None:
    """The stored result of solving ``problem`` with these arguments, or None (nothing is solved)."""
    key = solve_key(problem, strategy, time_limit_s=time_limit_s, seed=seed)
    return _load(_path(key), key, problem)


def _load(path: Path, key: dict[str, Any], problem: PartitionProblem) -> PartitionResult | None:
    data = _CACHE.read(path)
    if data is None:  # none, or warned about
        return None
    try:
        if not isinstance(data, dict) or data.get("format") != SOLVE_FORMAT_VERSION or data.get("key") != key:
            _ignore(path, "another format or problem")
            return None
        plan = _segment_plan(data["plan"], problem.n)
        objective, took, stats = _number(data["objective"]), _number(data["solve_time_s"]), data["stats"]
        if not isinstance(stats, dict) or json_depth(stats) > 3:  # budgets: a list of lists
            raise ValueError("stats")
    except (KeyError, TypeError, ValueError, AttributeError):
        _ignore(path, "wrong schema")
        return None
    try:
        problems = validate_segment_plan(problem, plan)
        score = iteration_time(problem, plan) if not problems else math.inf
    except (IndexError, ValueError, TypeError):
        problems, score = ["does not fit the problem"], math.inf
    # the same walk over the same problem gives the same number up to float rounding; more means the entry is wrong
    if problems or not math.isclose(score, objective, rel_tol=1e-9, abs_tol=0.0):
        _ignore(path, "its plan does not check out against the problem")
        return None
    return PartitionResult(strategy=key["strategy"], feasible=True, plan=plan, objective=objective,
                           solve_time_s=took, stats=dict(stats), cached=True)


def _segment_plan(p: Any, n: int) -> SegmentPlan:
    """An entry's plan, its types and ranges checked (ValueError, TypeError or KeyError when not as written)."""
    def pair(r: Any) -> tuple[int, int]:
        # `type(x) is int`: JSON's true/false would pass isinstance(x, int)
        if not isinstance(r, list) or len(r) != 2 or not all(type(x) is int and 0 <= x <= n for x in r):
            raise ValueError("range")
        return r[0], r[1]

    lists = ("forward", "backward", "saved")
    # no list can be longer than the segments (plus one): a corrupt entry is refused before anything is built from it
    if not isinstance(p, dict) or not all(isinstance(p[k], list) and len(p[k]) <= n + 1 for k in lists):
        raise ValueError("plan")
    stays, resident = p.get("stays", []), p.get("resident", False)  # entries before weights stayed have none
    sums = p.get("accumulates", [])  # nor before gradients were summed on the devices
    if not all(type(x) is bool for x in p["saved"]) \
            or not all(isinstance(x, list) and len(x) <= n for x in (stays, sums)) \
            or not all(type(x) is bool for x in [*stays, *sums, resident]):
        raise ValueError("saved")
    return SegmentPlan(forward=tuple(pair(r) for r in p["forward"]), fused=pair(p["fused"]),
                       backward=tuple(pair(r) for r in p["backward"]), saved=tuple(p["saved"]),
                       stays=tuple(stays), resident=resident, accumulates=tuple(sums))


def _number(v: Any) -> float:
    # the range also refuses NaN, which fails every comparison
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e12:
        raise ValueError("number")
    return float(v)


def _ignore(path: Path, why: str) -> None:
    _CACHE.ignore(path, why)


def remember(problem: PartitionProblem, strategy: str, result: PartitionResult, *, time_limit_s: float,
          seed: int = 0) -> None:
    """Keep ``result`` of solving ``problem`` with these arguments, where :func:`lookup` finds it (only a feasible
    one: an infeasible result is not kept)."""
    if not result.feasible or result.plan is None:
        return
    key = solve_key(problem, strategy, time_limit_s=time_limit_s, seed=seed)
    plan = result.plan
    data = {"format": SOLVE_FORMAT_VERSION, "key": key, "created": time.time(),
            "plan": {"forward": plan.forward, "fused": plan.fused, "backward": plan.backward, "saved": plan.saved,
                     "stays": plan.stays, "resident": plan.resident, "accumulates": plan.accumulates},
            "objective": result.objective, "solve_time_s": result.solve_time_s,
            "stats": jsonable(result.stats)}
    _CACHE.write(_path(key), data, lost="the plan was solved but not kept")


def solve_entries() -> list[Path]:
    """The entries' files."""
    return _CACHE.files()


def clear_solves() -> int:
    """Remove every entry (and leftover temporary files); the number of files removed."""
    return _CACHE.clear()


#: A solve's time per segment of its problem, one core (measured: 24–30 ms on llama-8b, gpt-demo, llama-demo).
SOLVE_S_PER_SEGMENT = 0.025


def solve_apart(problem: PartitionProblem, *, time_limit_s: float, strategy: str = "ilp", cache: bool = True) -> bool:
    """Whether solving ``problem`` is worth a child process: not in the solve cache (a lookup is quicker than a
    fork) and expected to take :data:`~.background.FORK_PAYS` times what the fork costs — not so for a small problem,
    nor in a process holding a large model in CPU memory (a fork copies its page tables: about a second for 25 GiB in
    4 KiB pages), and the parent's later writes copy pages."""
    if not enabled():
        return False
    if cache and lookup(problem, strategy, time_limit_s=time_limit_s) is not None:
        return False
    # the expected solve time: about SOLVE_S_PER_SEGMENT a segment, never much past the limit
    return min(time_limit_s, SOLVE_S_PER_SEGMENT * problem.n) >= FORK_PAYS * fork_cost_s()


def solve_timeout(limit: float) -> float:
    """How long a solve with time limit ``limit`` may stay silent in a child before the caller gives up on it and
    solves it itself: the limit guards the phases, not the tables and bounds before them."""
    # a floor for the unbounded set-up (tables, bounds), plus room for the bounded phases on a loaded machine
    return 60.0 + 4.0 * limit


def solving(fn: Callable[[], T], problem: PartitionProblem, *, time_limit_s: float, strategy: str = "ilp",
            cache: bool = True, background: bool = True) -> Later[T]:
    """``fn()`` — work whose bulk is solving ``problem`` — in a child where that pays (``background`` and
    :func:`solve_apart`), else in the caller when its result is asked for."""
    apart = background and solve_apart(problem, time_limit_s=time_limit_s, strategy=strategy, cache=cache)
    return Later(fn, background=apart, timeout_s=solve_timeout(time_limit_s))
