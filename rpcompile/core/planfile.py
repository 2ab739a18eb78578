"""Checking a plan file's JSON before it becomes a :class:`~rpcompile.core.plan.Plan`.

A plan file is read by people's tools and edited by hand, and a disk or a copy can flip its bits. Whatever is
wrong with one — bytes that are not UTF-8, text that is not JSON, a missing or unknown field, a value of the wrong
type, a negative, NaN or infinite number, stages out of order — :func:`plan_file_problem` names the first problem
by its field path (``stages[2].time_s``), so ``Plan.load`` can refuse the file in one line. Field types come from
the dataclasses' own annotations: a new field is checked with no change here; the rules beyond each field's type
are :func:`plan_file_problem`'s.

A flip inside a number or a name can leave a well-formed plan that says something else (a time of 0.3 s
instead of 0.2 s, ``F1`` renamed ``F3``): such a plan loads, and ``rpcompile check`` (which verifies the plan
against the model, :func:`rpcompile.verify_plan`) is what catches what matters.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import abc
import types
import typing
from typing import Any, Literal, Mapping, Union

from .files import json_depth

__all__ = ["MAX_MICROBATCHES", "SIZE_LIMITS", "MAX_STAGE_RUNS", "TEXT_RULES", "plan_file_problem", "dataclass_problem",
           "size_problem"]

_AT_LEAST_ONE = {"microbatches", "head_chunks", "device_count", "schema_version"}
_FREE_FORM = {"stats", "inputs"}
"""Fields whose content is free-form (solver statistics, digests of what a plan was solved from): their type (a
JSON object), their strings (rule 5), numbers (finite) and nesting are checked."""
# 2**53: the largest integer a double holds exactly, so a reader that parses numbers as doubles keeps it
_MAX_INT, _MAX_FLOAT, _MAX_TEXT, _FREE_DEPTH = 2**53, 1e18, 4096, 4
MAX_MICROBATCHES = 1 << 12
"""The most microbatches a plan (and ``compile``, ``--microbatches``) may have."""
SIZE_LIMITS = {"microbatches": MAX_MICROBATCHES, "head_chunks": 1 << 12, "hardware.device_count": 1 << 16,
               "hardware.nodes": 1 << 16}
"""Upper bounds of a plan's sizes (field path → most), far above any real plan (RoundPipe's 235B model: 16
microbatches, ~100 stages)."""
MAX_STAGE_RUNS = 1 << 14
"""Stages × microbatches at most: the actions a schedule holds. The simulator's work grows faster than linearly
with them (16K runs on 2 devices: about 100 s on the 2-core reference machine), so this bounds ``simulate``."""
_DOTTED = r"[\w-]+(?:\.[\w-]+)*"
TEXT_RULES: dict[str, tuple[str, str]] = {
    "stages.name": (r"F\d{1,6}|FB|B\d{1,6}", "a stage name (F<i>, FB or B<i>)"),
    "stages.nodes": (r"[A-Za-z_][A-Za-z0-9_]*", "a graph node name (a Python identifier)"),
    "stages.saved": (r"[A-Za-z_][A-Za-z0-9_]*", "a graph node name (a Python identifier)"),
    "host": (r"[A-Za-z_][A-Za-z0-9_]*", "a graph node name (a Python identifier)"),
    "stages.params": (_DOTTED, "a parameter name (dotted words)"),
    "stages.keeps": (_DOTTED, "a parameter name (dotted words)"),
    "stages.finds": (_DOTTED, "a parameter name (dotted words)"),
    "stages.accumulates": (_DOTTED, "a parameter name (dotted words)"),
    "stages.modules": (rf"\(root\)|{_DOTTED}", "a module path (dotted words, or (root))"),
    "stages.saved_modules": (rf"\(root\)|{_DOTTED}", "a module path (dotted words, or (root))"),
    "model.graph_digest": (r"[0-9a-f]{16,64}", "a hexadecimal digest"),
    "model.params_digest": (r"[0-9a-f]{16,64}", "a hexadecimal digest"),
    "strategy": (r"[\w.+:-]{1,64}", "a strategy name (letters, digits, . + : -)"),
    "precision": (r"fp32|bf16|fp16", "a precision rpcompile runs (fp32, bf16 or fp16)"),
}
"""What each named text field claims to be (path without list indices → (pattern, what)); other strings only
follow rule 5."""
_TEXT = {k: (re.compile(p), what) for k, (p, what) in TEXT_RULES.items()}


def plan_file_problem(plan_cls: type, d: Any) -> str | None:
    """The first problem of ``d`` as the JSON of a ``plan_cls`` (``field.path: what``), or ``None``. Rules, beyond
    each field's type:

    1. every number is finite and not negative (counts, bytes, seconds, rates), integers at most 2**53 and other numbers
       at most 1e18;
    2. ``microbatches``, ``head_chunks``, ``hardware.device_count`` and ``schema_version`` are at least 1; sizes that a
       simulator or the runtime allocates by are bounded (:data:`SIZE_LIMITS`; stages × microbatches at most
       :data:`MAX_STAGE_RUNS`);
    3. ``predicted.bubble_fraction`` lies in [0, 1];
    4. stage kinds run forward stages, then exactly one fused stage, then backward stages (docs/architecture.md §3), and
       stage names are unique;
    5. text is what it claims to be (:data:`TEXT_RULES`: stage names ``F<i>``/``FB``/``B<i>``, graph node names are
       identifiers, parameter and module names dotted words, digests hexadecimal), and every string — free-form ones
       included — is printable (no control, format or line-separator characters) and at most 4096 characters long.
       Nothing in a plan becomes code or markup; this rule refuses a file that tries;
    6. parameters that stay on a device (``keeps``, ``finds``) are the stage's own, and where the runtime's walk puts
       them (:func:`_stays_problem`); gradients summed on a device (``accumulates``) are those of a grad stage's own
       parameters, each summed by one stage.
    """
    if not isinstance(d, Mapping):
        return f"expected a JSON object, found {_kind(d)}"
    problem = dataclass_problem(plan_cls, d, "")
    if problem is None:
        # the cross-field rules index fields freely: only once every field has its type
        problem = (_stage_order_problem(d["stages"]) or size_problem(len(d["stages"]), d["microbatches"])
                   or _stays_problem(d))
    return problem


def dataclass_problem(cls: type, d: Any, where: str) -> str | None:
    """The first problem of ``d`` as the JSON of dataclass ``cls`` at path ``where`` (:func:`plan_file_problem`'s
    rules), or None."""
    if not isinstance(d, Mapping):
        return f"{where or 'plan'}: expected a JSON object, found {_kind(d)}"
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in d if k not in fields)
    if unknown:
        # a key can be any length: the message shows a bounded part of it
        return f"{where or 'plan'}: unknown field {unknown[0][:40]!r}"
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in d:
            # a field with a default may be absent: older schemas, or written only when set
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
        # an optional field that is not null is checked as its type
        return _value_problem(next(a for a in args if a is not type(None)), v, path)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return dataclass_problem(hint, v, path)
    if origin is Literal:
        return None if v in args else f"{path}: expected one of {list(args)}, found {repr(v)[:60]}"
    if hint is bool:
        return None if isinstance(v, bool) else f"{path}: expected true or false, found {_kind(v)}"
    if hint is int:
        # bool is an int subclass: true is not a count
        if not isinstance(v, int) or isinstance(v, bool):
            return f"{path}: expected an integer, found {_kind(v)}"
        least = 1 if name in _AT_LEAST_ONE else 0
        most = SIZE_LIMITS.get(_field(path), _MAX_INT)
        if v < least:
            return f"{path}: must be >= {least}, found {_number(v)}"
        return None if v <= most else f"{path}: must be at most {most}, found {_number(v)}"
    if hint is float:
        # JSON does not tell 0 from 0.0: an integer is a fine float
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return f"{path}: expected a number, found {_kind(v)}"
        if not math.isfinite(v) or v < 0:
            return f"{path}: must be a finite number >= 0, found {_number(v)}"
        if v > _MAX_FLOAT:
            return f"{path}: must be at most {_MAX_FLOAT:g}, found {_number(v)}"
        if name == "bubble_fraction" and v > 1:
            return f"{path}: must be in [0, 1], found {v}"
        return None
    if hint is str:
        return _text_problem(v, path)
    if origin is tuple:  # a JSON list, or the tuple Plan.to_dict itself gives (from_dict(to_dict(p)) round-trips)
        if not isinstance(v, (list, tuple)):
            return f"{path}: expected a list, found {_kind(v)}"
        item = args[0]
        return next((p for i, x in enumerate(v) if (p := _value_problem(item, x, f"{path}[{i}]")) is not None), None)
    if origin in (abc.Mapping, dict) or hint in (dict, Mapping):
        if not isinstance(v, Mapping):
            return f"{path}: expected a JSON object, found {_kind(v)}"
        if name in _FREE_FORM:
            return _free_form_problem(v, path)
        if not args or args[1] is Any:
            return None
        return next((p for k, x in v.items() if (p := _value_problem(args[1], x, f"{path}.{k}")) is not None), None)
    return None


def _field(path: str) -> str:
    """``stages[2].nodes[0]`` → ``stages.nodes``: a field's path without list indices."""
    return re.sub(r"\[\d+\]", "", path)


def _number(v: float) -> str:
    text = str(v)
    # a huge integer shown whole would make a huge message
    return text if len(text) <= 24 else f"{text[:12]}…({len(text)} digits)"


def _text_problem(v: Any, path: str) -> str | None:
    """Rule 5 for the string ``v`` at ``path``."""
    if not isinstance(v, str):
        return f"{path}: expected a string, found {_kind(v)}"
    if len(v) > _MAX_TEXT:
        return f"{path}: {len(v)} characters, more than the {_MAX_TEXT} a plan's text holds"
    if not v.isprintable():
        bad = next(c for c in v if not c.isprintable())
        return f"{path}: holds the control or format character {bad!r}, which no plan text has"
    rule = _TEXT.get(_field(path))
    if rule is not None and not rule[0].fullmatch(v):
        return f"{path}: {v[:40]!r} is not {rule[1]}"
    return None


def _free_form_problem(v: Mapping[str, Any], path: str) -> str | None:
    """Free-form content (:data:`_FREE_FORM`): printable strings (keys too), finite numbers, shallow nesting."""
    # the depth is checked before the walk below, so that the walk is bounded
    if json_depth(v) > _FREE_DEPTH:
        return f"{path}: nested deeper than {_FREE_DEPTH} levels"
    stack: list[tuple[Any, str]] = [(v, path)]
    while stack:
        x, where = stack.pop()
        if isinstance(x, Mapping):
            for k, item in x.items():
                problem = _text_problem(k, f"{where} key")
                if problem is not None:
                    return problem
                stack.append((item, f"{where}.{k}"))
        elif isinstance(x, (list, tuple)):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(x))
        elif isinstance(x, str):
            problem = _text_problem(x, where)
            if problem is not None:
                return problem
        elif isinstance(x, float) and not math.isfinite(x):
            return f"{where}: {x} is not a number a plan holds"
        # a mapping handed in from Python may hold anything; a file only JSON values
        elif x is not None and not isinstance(x, (int, float, bool)):
            return f"{where}: expected a JSON value, found {_kind(x)}"
    return None


def size_problem(stages: int, microbatches: int) -> str | None:
    """Rule 2's bound on stages × microbatches, or ``None``."""
    runs = stages * microbatches
    if runs > MAX_STAGE_RUNS:
        return (f"stages × microbatches: {stages} × {microbatches} = {runs} stage runs, more than the "
                f"{MAX_STAGE_RUNS} a plan may hold")
    return None


def _stage_order_problem(stages: list[Mapping[str, Any]]) -> str | None:
    if not stages:
        return "stages: empty (a plan has at least its fused stage)"
    rank = {"forward": 0, "fused": 1, "backward": 2}
    # every kind is one of these: dataclass_problem has checked the Literal first
    kinds = [rank[s["kind"]] for s in stages]
    if kinds.count(1) != 1 or kinds != sorted(kinds):
        order = ", ".join(f"{s['name']}:{s['kind']}" for s in stages)
        return f"stages: kinds must run forward…, one fused, backward… (found {order})"
    names = [s["name"] for s in stages]
    dup = next((n for n in names if names.count(n) > 1), None)
    return None if dup is None else f"stages: the name {dup!r} appears twice"


def _stays_problem(d: Mapping[str, Any]) -> str | None:
    """Rule 6: weights that stay are the stage's own, and where the walk puts them
    (:func:`~rpcompile.core.schedule.weight_stays`): a resident plan keeps and finds every parameter of every
    stage; otherwise forward stages keep, backward stages find, and each parameter a stage finds was kept by an
    earlier stage on its device (stage ``k`` on device ``k mod devices``). A plan that says otherwise would have
    the runtime hold or skip weights its memory and time figures do not count."""
    stages, devices, resident = d["stages"], d["hardware"]["device_count"], d.get("resident", False)
    if resident and len(stages) % devices:
        return (f"resident: {len(stages)} stages on {devices} devices would not come back to their devices each "
                "iteration (a resident plan has one device, or stages a multiple of the devices)")
    kept: dict[int, set[str]] = {}
    for k, s in enumerate(stages):
        params, keeps, finds = set(s["params"]), s.get("keeps", []), s.get("finds", [])
        where = f"stages[{k}] ({s['name']})"
        if not params.issuperset(keeps) or not params.issuperset(finds):
            return f"{where}: keeps or finds a parameter it does not read"
        if resident:
            if set(keeps) != params or set(finds) != params:
                return f"{where}: a resident plan's stage keeps and finds every parameter it reads"
            continue
        if (keeps and s["kind"] != "forward") or (finds and s["kind"] != "backward"):
            return f"{where}: only forward stages keep and only backward stages find parameters (unless resident)"
        # stage k runs on device k mod devices
        on = kept.setdefault(k % devices, set())
        if not on.issuperset(finds):
            return f"{where}: finds parameters no earlier stage on its device kept"
        on.update(keeps)
    return _sums_problem(stages)


def _sums_problem(stages: Any) -> str | None:
    """Rule 6, gradients: a stage sums on its device only gradients it computes (a fused or backward stage's own
    parameters), and no parameter is summed by two stages (its sum would be split over devices)."""
    summed: set[str] = set()
    for k, s in enumerate(stages):
        acc = set(s.get("accumulates", []))
        if not acc:
            continue
        where = f"stages[{k}] ({s['name']})"
        if s["kind"] == "forward" or not acc <= set(s["params"]):
            return f"{where}: accumulates gradients of parameters it does not differentiate"
        if acc & summed:
            return f"{where}: accumulates gradients another stage accumulates too"
        summed |= acc
    return None


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
