"""Solved partitions on disk, so re-running a training script does not solve the same problem again.

A solve is a function of its inputs: the :class:`~.solver.problem.PartitionProblem` (the solvers' whole input, in plain
numbers: costs, memory, link, microbatches), the strategy, the time limit (every phase of ``ilp`` is bounded by
counts derived from it, so the same limit gives the same plan) and the partitioner's source
(:func:`~.plan_inputs.solver_digest`). :func:`cached_solve` keys an entry by all of them; a warm entry returns the
stored result — its plan re-checked against the problem (:func:`~.solver.segment_rules.validate_segment_plan`) and
re-scored (:func:`~.solver.timing.iteration_time` must give the stored objective) — and ``solve_time_s`` as first measured.
``PartitionResult.cached`` says where a result came from. A solve may run in a forked child
(:mod:`~rpcompile.passes.background`): it reads and writes its entry there, as it would in the caller.

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
from typing import Any

from rpcompile.core.files import json_depth, jsonable
from rpcompile.core.jsoncache import JsonCache

from .cost.profile_cache import cache_dir
from .plan_inputs import problem_digest, solver_digest
from .solver import partition
from .solver.problem import PartitionProblem, PartitionResult, SegmentPlan
from .solver.segment_rules import validate_segment_plan
from .solver.timing import iteration_time

__all__ = ["SOLVE_FORMAT_VERSION", "cached_solve", "lookup", "solve_key", "solve_entries", "clear_solves"]

SOLVE_FORMAT_VERSION = 1
_MAX_ENTRY_BYTES = 64 * 2**20


def _root() -> Path:
    return cache_dir() / "solves"


_CACHE = JsonCache(root=_root, name="solve cache", afresh="solving afresh", max_bytes=_MAX_ENTRY_BYTES)


def solve_key(problem: PartitionProblem, strategy: str, *, time_limit_s: float, seed: int = 0) -> dict[str, Any]:
    """Everything a solve's result depends on (module docstring)."""
    return {"problem": problem_digest(problem), "strategy": strategy, "time_limit_s": repr(float(time_limit_s)),
            "seed": seed, "solver": solver_digest()}


def _path(key: dict[str, Any]) -> Path:
    return _CACHE.path(key)


def cached_solve(problem: PartitionProblem, strategy: str = "ilp", *, time_limit_s: float = 10.0, seed: int = 0,
                 cache: bool = True, **options: Any) -> PartitionResult:
    """:func:`.solver.partition.solve` (``ilp`` with ``options``: :func:`.solver.partition.ilp`'s ``baselines``) through
    the cache (module docstring); ``cache=False`` solves and keeps nothing."""
    def fresh() -> PartitionResult:
        if strategy == "ilp":
            return partition.ilp(problem, time_limit_s=time_limit_s, seed=seed, **options)
        return partition.solve(problem, strategy, time_limit_s=time_limit_s, seed=seed)

    if not cache:
        return fresh()
    key = solve_key(problem, strategy, time_limit_s=time_limit_s, seed=seed)
    path = _path(key)
    found = _load(path, key, problem)
    if found is not None:
        return found
    result = fresh()
    if result.feasible and result.plan is not None:
        _store(path, key, result)
    return result


def lookup(problem: PartitionProblem, strategy: str = "ilp", *, time_limit_s: float = 10.0,
           seed: int = 0) -> PartitionResult | None:
    """The cached result :func:`cached_solve` would return for these arguments, or None (nothing is solved)."""
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
    if problems or not math.isclose(score, objective, rel_tol=1e-9, abs_tol=0.0):
        _ignore(path, "its plan does not check out against the problem")
        return None
    return PartitionResult(strategy=key["strategy"], feasible=True, plan=plan, objective=objective,
                           solve_time_s=took, stats=dict(stats), cached=True)


def _segment_plan(p: Any, n: int) -> SegmentPlan:
    """An entry's plan, its types and ranges checked (ValueError, TypeError or KeyError when not as written)."""
    def pair(r: Any) -> tuple[int, int]:
        if not isinstance(r, list) or len(r) != 2 or not all(type(x) is int and 0 <= x <= n for x in r):
            raise ValueError("range")
        return r[0], r[1]

    lists = ("forward", "backward", "saved")
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
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e12:
        raise ValueError("number")
    return float(v)


def _ignore(path: Path, why: str) -> None:
    _CACHE.ignore(path, why)


def _store(path: Path, key: dict[str, Any], result: PartitionResult) -> None:
    assert result.plan is not None
    plan = result.plan
    data = {"format": SOLVE_FORMAT_VERSION, "key": key, "created": time.time(),
            "plan": {"forward": plan.forward, "fused": plan.fused, "backward": plan.backward, "saved": plan.saved,
                     "stays": plan.stays, "resident": plan.resident, "accumulates": plan.accumulates},
            "objective": result.objective, "solve_time_s": result.solve_time_s,
            "stats": jsonable(result.stats)}
    _CACHE.write(path, data, lost="the plan was solved but not kept")


def solve_entries() -> list[Path]:
    """The entries' files."""
    return _CACHE.files()


def clear_solves() -> int:
    """Remove every entry (and leftover temporary files); the number of files removed."""
    return _CACHE.clear()
