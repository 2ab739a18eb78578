"""Measured node times on disk, so a re-run of the same model on the same machine skips measuring.

Directory: ``$RPCOMPILE_CACHE``, else ``$XDG_CACHE_HOME/rpcompile``, else ``~/.cache/rpcompile``; one JSON file per
profile under ``profiles/``, named by a hash of its key. The key is everything the times depend on: the graph's
fingerprint (:mod:`rpcompile.passes.graph.fingerprint`: structure, parameter names, shapes and dtypes), the example
inputs' shapes and dtypes, the cost model's identity (device name, compute dtype, intra-op threads on a CPU, repeats),
the torch version and :data:`PROFILE_FORMAT_VERSION`. An entry holds each compute node's whole cost (the fields of
:class:`~rpcompile.passes.cost.cost_model.NodeCost`, times raw: before calibration) and the whole-graph calibration times, so a warm entry
skips the cost pass's graph run too.

An entry that cannot be read, is larger than :data:`MAX_ENTRY_BYTES`, is not strict JSON (bytes that are not UTF-8,
``NaN``/``Infinity``, numbers out of range, deep nesting), is not this format, holds another key, other nodes or a
time or count out of range is ignored with one warning line (logger ``rpcompile``) and measured afresh (then
overwritten). Writes go to a temporary file renamed into place, so
a reader never sees half an entry; a cache that cannot be written is warned about and otherwise ignored.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx

from rpcompile.core.files import read_json
from rpcompile.core.jsoncache import JsonCache

from ..graph.fingerprint import fingerprint

__all__ = ["PROFILE_FORMAT_VERSION", "CacheEntry", "cache_dir", "profile_key", "load_profile", "store",
           "profile_entries", "clear_profiles"]

PROFILE_FORMAT_VERSION = 2
"""The cost format of an entry; bump it when what a node time means changes (the key then changes too)."""

MAX_ENTRY_BYTES = 512 * 2**20
"""The largest entry read (a 235B MoE's measured profile is tens of MB); a larger one is ignored."""
_MAX_SECONDS, _MAX_COUNT = 1e9, 2**53


@dataclass(frozen=True)
class CacheEntry:
    nodes: dict[str, dict[str, Any]]
    """Compute node name → its :class:`~rpcompile.passes.cost.cost_model.NodeCost` fields (``params`` a tuple), times raw (before
    calibration)."""
    calibration: tuple[float, float] | None
    """Whole-graph (forward s, step s), or None when the graph could not run whole."""


def cache_dir() -> Path:
    """The cache directory (not created)."""
    env = os.environ.get("RPCOMPILE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rpcompile"


def _profiles() -> Path:
    return cache_dir() / "profiles"


_CACHE = JsonCache(root=_profiles, name="profile cache", afresh="measuring afresh", max_bytes=MAX_ENTRY_BYTES)


def _input_sig(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # shape, dtype, device and grad, not values: a node's time does not depend on the numbers in its inputs
        return [list(value.shape), str(value.dtype), value.device.type, value.requires_grad]
    if isinstance(value, (int, float, bool, str, type(None))):
        # repr keeps 1, 1.0 and True apart
        return repr(value)
    if isinstance(value, (tuple, list)):
        return [_input_sig(v) for v in value]
    # anything else by its type only: its value would make the key unstable across runs
    return type(value).__name__


def profile_key(gm: fx.GraphModule, flat_inputs: Sequence[Any], identity: dict[str, Any]) -> dict[str, Any]:
    """The key of ``gm``'s measured times for these inputs on the cost model ``identity`` describes."""
    fp = fingerprint(gm)
    return {
        "format": PROFILE_FORMAT_VERSION,
        "torch": torch.__version__,
        "graph": fp.graph_digest,
        "params": fp.params_digest,
        "inputs": [_input_sig(v) for v in flat_inputs],
        # sorted: a stable order in the written entry (its file name and the key comparison ignore order anyway)
        **{k: identity[k] for k in sorted(identity)},
    }


def _path(key: dict[str, Any]) -> Path:
    return _CACHE.path(key)


def _ignore(path: Path, why: str, quiet: bool = False) -> None:
    _CACHE.ignore(path, why, quiet)


def _node(value: Any, fields: set[str]) -> dict[str, Any]:
    """One node's fields, checked (ValueError when not as written: a type, a time not in [0, 1e9] s, a count not
    in [0, 2**53])."""
    if not isinstance(value, dict) or set(value) != fields:
        raise ValueError("fields")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k == "params":
            if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
                raise ValueError("params")
            out[k] = tuple(v)
        elif k.endswith("_s"):
            out[k] = _seconds(v, k)
        else:
            # bool is an int to isinstance: refused as a count
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_COUNT:
                raise ValueError(k)
            out[k] = v
    return out


def _seconds(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= _MAX_SECONDS:
        raise ValueError(what)
    return float(v)


def load_profile(key: dict[str, Any], node_names: set[str], fields: set[str], *,
                 quiet: bool = False) -> CacheEntry | None:
    """The entry for ``key`` if one exists and is sound (exactly ``node_names``, each with exactly ``fields``);
    else None (one warning line when an entry exists but is not usable, unless ``quiet``: a first look, before
    the lookup that warns)."""
    path = _path(key)
    data = _CACHE.read(path, quiet=quiet)
    if data is None:  # none, or warned about
        return None
    try:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT_VERSION:
            _ignore(path, "not this cache format", quiet)
            return None
        # the key as it reads back from JSON (tuples become lists), so an equal key compares equal
        if data.get("key") != json.loads(json.dumps(key)):
            _ignore(path, "made for another model, device or torch", quiet)
            return None
        nodes = {str(k): _node(v, fields) for k, v in data["nodes"].items()}
        cal = data["calibration"]
        calibration = None if cal is None else (_seconds(cal[0], "calibration"), _seconds(cal[1], "calibration"))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        _ignore(path, "wrong schema", quiet)
        return None
    if set(nodes) != node_names:
        _ignore(path, "its nodes are not this graph's", quiet)
        return None
    return CacheEntry(nodes, calibration)


def store(key: dict[str, Any], entry: CacheEntry) -> Path | None:
    """Write ``entry`` atomically (temporary file, then rename); the path, or None when it could not be written."""
    path = _path(key)
    data = {"format": PROFILE_FORMAT_VERSION, "key": key, "created": time.time(),
            # lists: JSON has no tuples; _node turns them back
            "nodes": {k: {**v, "params": list(v["params"])} for k, v in entry.nodes.items()},
            "calibration": None if entry.calibration is None else list(entry.calibration)}
    return path if _CACHE.write(path, data, lost="costs were measured but not kept") else None


def profile_entries() -> list[dict[str, Any]]:
    """What the cache holds: one dict per file (``path``, ``bytes``, ``created``, ``device``, ``dtype``, ``nodes``;
    unreadable files with ``device`` "?")."""
    out = []
    for p in _CACHE.files():
        row: dict[str, Any] = {"path": str(p), "bytes": p.stat().st_size, "created": None, "device": "?",
                               "dtype": "?", "nodes": 0}
        try:
            data = read_json(p, max_bytes=MAX_ENTRY_BYTES, max_depth=6)
            row.update(created=data.get("created"), device=data["key"].get("device", "?"),
                       dtype=data["key"].get("dtype", "?"), nodes=len(data["nodes"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # listed as unreadable
            pass
        out.append(row)
    return out


def clear_profiles() -> int:
    """Remove every entry (and leftover temporary files); the number of files removed."""
    return _CACHE.clear()
