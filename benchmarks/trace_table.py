"""Where a step's time goes, read from a torch profiler trace (``gpu.py --profile``): one table, and a slim copy of
the trace small enough to keep in the repository.

Terms:

- **window** — from the first GPU activity (kernel, copy, memset) to the end of the last: the step as the GPU saw it.
- **busy** — the share of the window covered by the union of a kind of GPU activity: compute (kernels on any
  stream), each copy direction (``HtoD``: uploads, ``DtoH``: downloads).
- **gap** — a stretch of the window of at least ``--min-gap-us`` with no kernel running. Each gap is put down to
  what covered most of it: an upload in flight (``upload``), a download (``download``), the host blocked in a CUDA
  synchronize call (``host sync``), or nothing on the GPU side at all (``host``: Python and dispatch did not launch
  the next kernel in time). The host operator that was running longest during the gap is kept as its example.
- **host threads** — per thread that ran operators: the time its outermost operators took (by name) and the CUDA
  runtime calls that block it (synchronize, event synchronize).

    python benchmarks/trace_table.py TRACE.json[.gz|.xz] [--slim OUT.json.gz] [--json OUT.json] [--top 8]

A trace is data from another machine: it is parsed as JSON only, events without the fields a row needs are skipped,
and names are printed as text (rich markup escaped).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import lzma
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rpcompile.core.files import write_atomic
from rpcompile.runtime.activity import ACTIVITIES, PREFIX

#: the largest trace read (decompressed): a profiled step of the 8B shape is ~100 MB of JSON
MAX_TRACE_BYTES = 2 << 30
#: CUDA runtime calls during which the calling host thread waits for the GPU
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"})
#: what the slim copy keeps: GPU activity, operators, the runtime calls that block, the process/thread names
_SLIM_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "cpu_op", "user_annotation", "gpu_user_annotation"}
_SLIM_ARGS = ("stream", "bytes", "device")


def profiler_config(*, cuda: bool = False) -> Any:
    """The torch profiler's ``experimental_config`` for a trace this table reads: every thread's operators (the
    runtime's device, copy and gradient threads, not only the one that started the profiler) and, on CUDA, the
    synchronisations (what a host thread waited for). Options this torch lacks are left out."""
    wanted = {"profile_all_threads": True, **({"enable_cuda_sync_events": True} if cuda else {})}
    config = torch._C._profiler._ExperimentalConfig
    while wanted:
        try:
            return config(**wanted)
        except TypeError as e:  # an older torch: drop the option it names (or the last one)
            drop = next((k for k in wanted if k in str(e)), list(wanted)[-1])
            wanted.pop(drop)
    return config()


def load(path: Path) -> list[dict[str, Any]]:
    """The trace's events (``traceEvents``) from a Chrome trace JSON file, plain, gzip or xz."""
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
    with opener(path, "rb") as f:
        raw = f.read(MAX_TRACE_BYTES + 1)
    if len(raw) > MAX_TRACE_BYTES:
        raise ValueError(f"{path}: more than {MAX_TRACE_BYTES >> 20} MiB of trace; profile fewer steps")
    data = json.loads(raw)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return [e for e in events if isinstance(e, dict)]


def _span(e: dict[str, Any]) -> tuple[float, float] | None:
    ts, dur = e.get("ts"), e.get("dur")
    if e.get("ph") != "X" or not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)) or dur < 0:
        return None
    return float(ts), float(ts) + float(dur)


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering exactly what ``spans`` cover."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covered(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """How much of ``[a, b]`` the disjoint sorted ``spans`` cover."""
    i = bisect.bisect_right(spans, (a, float("inf"))) - 1  # the last span starting at or before a
    total = 0.0
    for x, y in spans[max(i, 0):]:
        if x >= b:
            break
        total += max(0.0, min(b, y) - max(a, x))
    return total


def _direction(name: str) -> str:
    for d in ("HtoD", "DtoH", "DtoD"):
        if d in name:
            return d
    return "other"


def _outermost(ops: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The operators not inside another one on the same thread (sorted by start, longest first on ties)."""
    out: list[tuple[float, float, str]] = []
    end = float("-inf")
    for a, b, name in sorted(ops, key=lambda o: (o[0], -o[1])):
        if a >= end:
            out.append((a, b, name))
            end = b
    return out


def analyse(events: list[dict[str, Any]], *, min_gap_us: float = 50.0, top: int = 8) -> dict[str, Any]:
    """The table's numbers (all times in milliseconds) from a trace's events."""
    kernels, copies, host_ops = [], defaultdict(list), defaultdict(list)
    syncs: list[tuple[float, float]] = []
    gpu_any = []
    for e in events:
        if not isinstance(e, dict):
            continue
        span, cat = _span(e), e.get("cat")
        if span is None:
            continue
        name = str(e.get("name", ""))
        if cat == "kernel":
            kernels.append(span)
        elif cat == "gpu_memcpy":
            copies[_direction(name)].append(span)
        elif cat == "cpu_op":
            host_ops[e.get("tid")].append((*span, name))
        elif cat == "cuda_runtime" and name in SYNC_CALLS:
            syncs.append(span)
            host_ops[e.get("tid")].append((*span, name))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu_any.append(span)
    if not gpu_any:
        raise ValueError("no GPU activity in this trace (profiled on a CPU, or without CUDA activities)")
    start, end = min(a for a, _ in gpu_any), max(b for _, b in gpu_any)
    window = end - start
    compute = union(kernels)
    by_dir = {d: union(s) for d, s in copies.items()}
    sync_u = union(syncs)
    outer = {tid: _outermost(ops) for tid, ops in host_ops.items()}

    # each thread's outermost operators are disjoint and sorted, so those overlapping a gap are found by bisection
    outer_ends = [(ops, [y for _, y, _ in ops]) for ops in outer.values()]
    gaps = []
    edges = [start] + [x for ab in compute for x in ab] + [end]
    for a, b in zip(edges[0::2], edges[1::2]):  # the stretches between kernels, the window's ends included
        if b - a < min_gap_us:
            continue
        share = {"upload": covered(by_dir.get("HtoD", []), a, b), "download": covered(by_dir.get("DtoH", []), a, b),
                 "host sync": covered(sync_u, a, b)}
        cause, most = max(share.items(), key=lambda kv: kv[1])
        if most < 0.5 * (b - a):
            cause = "host"
        example = max(((min(b, y) - max(a, x), n) for ops, ends in outer_ends
                       for x, y, n in ops[bisect.bisect_right(ends, a):bisect.bisect_left(ends, b) + 1] if x < b),
                      default=(0.0, ""))[1]
        gaps.append({"start_ms": (a - start) / 1e3, "ms": (b - a) / 1e3, "cause": cause, "host_op": example})

    causes: dict[str, dict[str, float]] = defaultdict(lambda: {"gaps": 0, "ms": 0.0})
    for g in gaps:
        causes[g["cause"]]["gaps"] += 1
        causes[g["cause"]]["ms"] += g["ms"]
    threads = _threads(outer, top)
    busy = {"compute": sum(b - a for a, b in compute) / 1e3}
    busy |= {f"copy {d}": sum(b - a for a, b in s) / 1e3 for d, s in sorted(by_dir.items())}
    return {"window_ms": window / 1e3, "busy_ms": busy,
            "busy_share": {k: v / (window / 1e3) for k, v in busy.items()},
            "gaps": {"count": len(gaps), "ms": sum(g["ms"] for g in gaps), "min_gap_us": min_gap_us,
                     "by_cause": dict(causes), "longest": sorted(gaps, key=lambda g: -g["ms"])[:top]},
            "threads": threads}


def _threads(outer: dict[Any, list[tuple[float, float, str]]], top: int) -> list[dict[str, Any]]:
    threads = []
    for tid, ops in sorted(outer.items(), key=lambda kv: -sum(b - a for a, b, _ in kv[1])):
        by_name: Counter[str] = Counter()
        for a, b, n in ops:
            by_name[n] += (b - a) / 1e3
        threads.append({"tid": tid, "busy_ms": sum(by_name.values()),
                        "top": [{"op": n, "ms": ms} for n, ms in by_name.most_common(top)]})
    return threads


def host_threads(events: list[dict[str, Any]], *, top: int = 8) -> list[dict[str, Any]]:
    """Per host thread that ran operators: its outermost operators' time in all and by name (the ``top`` longest),
    busiest thread first — the table's last part, for a trace with or without GPU activity."""
    ops: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        span = _span(e) if isinstance(e, dict) else None
        if span is not None and (e.get("cat") == "cpu_op" or (e.get("cat") == "cuda_runtime"
                                                               and e.get("name") in SYNC_CALLS)):
            ops[e.get("tid")].append((*span, str(e.get("name", ""))))
    return _threads({tid: _outermost(o) for tid, o in ops.items()}, top)


def activities(events: list[dict[str, Any]]) -> dict[str, float]:
    """Milliseconds of the runtime's named host work (``rpcompile::<activity>`` spans, ``rpcompile.runtime.activity``)
    by activity, summed over threads; a span inside another of the same thread counts once, in the outer one."""
    spans: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        span = _span(e) if isinstance(e, dict) else None
        name = str(e.get("name", "")) if span is not None else ""
        if span is not None and name.startswith(PREFIX):
            spans[e.get("tid")].append((*span, name[len(PREFIX):].split(" mb")[0]))
    out: Counter[str] = Counter()
    for ops in spans.values():
        for a, b, name in _outermost(ops):
            activity = next((k for k in ACTIVITIES if name == k or name.startswith(k + " ")), name)
            out[activity] += (b - a) / 1e3
    return dict(out.most_common())


def slim(events: list[dict[str, Any]], out: Path) -> int:
    """Write the events worth keeping (``_SLIM_CATS``, the blocking runtime calls, names) as gzipped Chrome trace
    JSON (Perfetto opens it as is), atomically; returns the bytes written."""
    kept = []
    for e in events:
        if not isinstance(e, dict):
            continue
        cat, name = e.get("cat"), str(e.get("name", ""))
        if e.get("ph") == "M" or cat in _SLIM_CATS or (cat == "cuda_runtime" and name in SYNC_CALLS):
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            keep = {k: v for k, v in e.items() if k in ("ph", "cat", "name", "pid", "tid", "ts", "dur")}
            if e.get("ph") == "M":
                keep["args"] = args
            elif any(k in args for k in _SLIM_ARGS):
                keep["args"] = {k: args[k] for k in _SLIM_ARGS if k in args}
            kept.append(keep)
    data = json.dumps({"traceEvents": kept}, separators=(",", ":")).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda f: f.write(gzip.compress(data, compresslevel=9, mtime=0)))
    return out.stat().st_size


def _short(op: str) -> str:
    """An operator's name for the table: autograd's node evaluations by their node."""
    return op.removeprefix("autograd::engine::evaluate_function: ")[:40]


def render(result: dict[str, Any], console: Console) -> None:
    t = Table(title=f"one step: {result['window_ms']:.1f} ms of GPU window")
    t.add_column("GPU activity")
    t.add_column("busy", justify="right")
    t.add_column("share", justify="right")
    for k, ms in result["busy_ms"].items():
        t.add_row(k, f"{ms:.1f} ms", f"{result['busy_share'][k]:.1%}")
    console.print(t)
    g = result["gaps"]
    t = Table(title=f"compute idle: {g['count']} gaps of ≥ {g['min_gap_us']:g} µs, {g['ms']:.1f} ms")
    for c in ("waited for", "gaps", "ms"):
        t.add_column(c, justify="left" if c == "waited for" else "right")
    for cause, v in sorted(g["by_cause"].items(), key=lambda kv: -kv[1]["ms"]):
        t.add_row(cause, str(int(v["gaps"])), f"{v['ms']:.1f}")
    console.print(t)
    t = Table(title="longest gaps")
    for c in ("at", "ms", "waited for", "host operator running"):
        t.add_column(c)
    for x in g["longest"]:
        t.add_row(f"{x['start_ms']:.1f} ms", f"{x['ms']:.2f}", x["cause"], escape(x["host_op"][:80]))
    console.print(t)
    render_threads(result["threads"], console)


def render_threads(threads: list[dict[str, Any]], console: Console, *,
                   title: str = "host threads (outermost operators)") -> None:
    t = Table(title=title)
    for c in ("thread", "busy", "top operators"):
        t.add_column(c)
    for th in threads:
        t.add_row(escape(str(th["tid"])), f"{th['busy_ms']:.1f} ms",
                  escape(", ".join(f"{_short(o['op'])} {o['ms']:.1f}" for o in th["top"])))
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--slim", type=Path, default=None, help="also write a slim gzipped copy of the trace here")
    ap.add_argument("--json", type=Path, default=None, help="write the table's numbers here")
    ap.add_argument("--min-gap-us", type=float, default=50.0)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    try:
        events = load(args.trace)
        result = analyse(events, min_gap_us=args.min_gap_us, top=args.top)
    except (OSError, ValueError, EOFError, lzma.LZMAError) as e:
        print(f"trace_table: {e}", file=sys.stderr)
        return 2
    render(result, Console())
    if args.slim is not None:
        print(f"wrote {args.slim} ({slim(events, args.slim) / 2**20:.1f} MiB)")
    if args.json is not None:
        write_atomic(args.json, json.dumps({"trace": args.trace.name, **result}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
