"""Checking a plan file's JSON before it becomes a :class:`~rpcompile.core.plan.Plan`.

A plan file is read by people's tools and edited by hand, and a disk or a copy can flip its bits. Whatever is
wrong with one — bytes that are not UTF-8, text that is not JSON, a missing or unknown field, a value of the wrong
type, a negative, NaN or infinite number, stages out of order — :func:`plan_file_problem` names the first problem
by its field path (``stages[2].time_s``), so ``Plan.load`` can refuse the file in one line. Field types come from
the dataclasses' own annotations: a new field is checked with no change here.

Rules, beyond each field's type:

1. every number is finite and not negative (counts, bytes, seconds, rates);
2. ``microbatches``, ``head_chunks``, ``hardware.device_count`` and ``schema_version`` are at least 1;
3. ``predicted.bubble_fraction`` lies in [0, 1];
4. stage kinds run forward stages, then exactly one fused stage, then backward stages (DESIGN.md §3), and stage
   names are unique.

A flip inside a number or a name can leave a well-formed plan that says something else (a time of 0.3 s
instead of 0.2 s, ``F1`` renamed ``F3``): such a plan loads, and ``rpcompile check`` (which verifies the plan
against the model, :func:`rpcompile.verify_plan`) is what catches what matters.
"""

from __future__ import annotations

import dataclasses
import math
from collections import abc
import types
import typing
from typing import Any, Literal, Mapping, Union

__all__ = ["decode_plan_text", "plan_file_problem"]

_AT_LEAST_ONE = {"microbatches", "head_chunks", "device_count", "schema_version"}
_FREE_FORM = {"stats", "inputs"}
"""Fields whose content is free-form (solver statistics, digests of what a plan was solved from): only their type
(a JSON object) is checked."""


def decode_plan_text(raw: bytes) -> tuple[str | None, str | None]:
    """``(text, None)`` or ``(None, problem)`` for a plan file's bytes."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"byte {e.start} is not UTF-8 text (0x{raw[e.start]:02x})"


def plan_file_problem(plan_cls: type, d: Any) -> str | None:
    """The first problem of ``d`` as the JSON of a ``plan_cls`` (``field.path: what``), or ``None``."""
    if not isinstance(d, Mapping):
        return f"expected a JSON object, found {_kind(d)}"
    problem = _dataclass_problem(plan_cls, d, "")
    if problem is None:
        problem = _stage_order_problem(d["stages"])
    return problem


def _dataclass_problem(cls: type, d: Any, where: str) -> str | None:
    if not isinstance(d, Mapping):
        return f"{where or 'plan'}: expected a JSON object, found {_kind(d)}"
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in d if k not in fields)
    if unknown:
        return f"{where or 'plan'}: unknown field {unknown[0][:40]!r}"
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                return f"missing field {path!r}"
            continue
        problem = _value_problem(hints[name], d[name], path)
        if problem is not None:
            return problem
    return None


def _value_problem(hint: Any, v: Any, path: str) -> str | None:
    """The problem of value ``v`` as a ``hint`` (a type annotation), or ``None``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    name = path.rsplit(".", 1)[-1]
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        return _value_problem(next(a for a in args if a is not type(None)), v, path)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass_problem(hint, v, path)
    if origin is Literal:
        return None if v in args else f"{path}: expected one of {list(args)}, found {v!r}"
    if hint is bool:
        return None if isinstance(v, bool) else f"{path}: expected true or false, found {_kind(v)}"
    if hint is int:
        if not isinstance(v, int) or isinstance(v, bool):
            return f"{path}: expected an integer, found {_kind(v)}"
        least = 1 if name in _AT_LEAST_ONE else 0
        return None if v >= least else f"{path}: must be >= {least}, found {v}"
    if hint is float:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return f"{path}: expected a number, found {_kind(v)}"
        if not math.isfinite(v) or v < 0:
            return f"{path}: must be a finite number >= 0, found {v}"
        if name == "bubble_fraction" and v > 1:
            return f"{path}: must be in [0, 1], found {v}"
        return None
    if hint is str:
        return None if isinstance(v, str) else f"{path}: expected a string, found {_kind(v)}"
    if origin is tuple:  # a JSON list, or the tuple Plan.to_dict itself gives (from_dict(to_dict(p)) round-trips)
        if not isinstance(v, (list, tuple)):
            return f"{path}: expected a list, found {_kind(v)}"
        item = args[0]
        return next((p for i, x in enumerate(v) if (p := _value_problem(item, x, f"{path}[{i}]")) is not None), None)
    if origin in (abc.Mapping, dict) or hint in (dict, Mapping):
        if not isinstance(v, Mapping):
            return f"{path}: expected a JSON object, found {_kind(v)}"
        if name in _FREE_FORM or not args or args[1] is Any:
            return None
        return next((p for k, x in v.items() if (p := _value_problem(args[1], x, f"{path}.{k}")) is not None), None)
    return None


def _stage_order_problem(stages: list[Mapping[str, Any]]) -> str | None:
    if not stages:
        return "stages: empty (a plan has at least its fused stage)"
    rank = {"forward": 0, "fused": 1, "backward": 2}
    kinds = [rank[s["kind"]] for s in stages]
    if kinds.count(1) != 1 or kinds != sorted(kinds):
        order = ", ".join(f"{s['name']}:{s['kind']}" for s in stages)
        return f"stages: kinds must run forward…, one fused, backward… (found {order})"
    names = [s["name"] for s in stages]
    dup = next((n for n in names if names.count(n) > 1), None)
    return None if dup is None else f"stages: the name {dup!r} appears twice"


def _kind(v: Any) -> str:
    """A JSON value's kind, for messages: ``a string ('3')``, ``null``, ``an object``."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, str):
        return f"a string ({v[:20]!r})"
    if isinstance(v, (int, float)):
        return f"a number ({v})"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, Mapping):
        return "an object"
    return type(v).__name__
