"""``rpcompile cache``: the profile cache of measured costs (:mod:`rpcompile.passes.cost.profile_cache`) — its
directory, entries and size — and the solved partitions beside it (:mod:`rpcompile.passes.solve_cache`); ``rpcompile
cache clear`` empties both."""

from __future__ import annotations

import argparse
import json
import time

from rpcompile.core.units import fmt_bytes
from rpcompile.passes import solve_cache
from rpcompile.passes.cost import profile_cache

from .common import say

__all__ = ["cache_command"]


def cache_command(args: argparse.Namespace) -> int:
    root = profile_cache.cache_dir()
    if args.action == "clear":
        removed, dropped = profile_cache.clear_profiles(), solve_cache.clear_solves()
        if args.json:
            print(json.dumps({"directory": str(root), "removed": removed, "removed_solves": dropped}))
        else:
            print(f"profile cache {root}: removed {removed} entr{'y' if removed == 1 else 'ies'} and {dropped} "
                  f"solved partition{'' if dropped == 1 else 's'}")
        return 0
    rows = profile_cache.profile_entries()
    size = sum(r["bytes"] for r in rows)
    solves = solve_cache.solve_entries()
    if args.json:
        print(json.dumps({"directory": str(root), "entries": rows, "bytes": size, "solves": len(solves)}))
        return 0
    print(f"profile cache {root}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}, {fmt_bytes(size)}; "
          f"{len(solves)} solved partition{'' if len(solves) == 1 else 's'}")
    now = time.time()
    for r in rows:
        # the entry is read from a file: a missing or garbled time shows as "?" rather than failing the listing
        age = f"{(now - r['created']) / 3600:.1f} h ago" if isinstance(r["created"], (int, float)) else "?"
        say(f"  {r['device']}  {r['dtype']}  {r['nodes']} nodes  {fmt_bytes(r['bytes'])}  {age}")  # from files
    return 0
