"""Background checkpoint saves against synchronous ones, without a GPU: does a save overlap the training steps?

The runtime runs for real on two :class:`floor.FloorDevice`\\ s whose stage microbatches *sleep* for their share of
``--device-s`` per step (GPU-like compute that leaves the host's cores free, as ``overlap_run.py`` emulates it),
while the host's work is real: the AdamW step over the fp32 masters and the saves into a directory on this
machine's disk. A LLaMA-shaped decoder (``--dim``, ``--layers``, 32k vocabulary; constant values) trains
``--steps`` steps three ways:

- ``no saves``: the baseline;
- ``synchronous``: ``save_checkpoint(...)`` every ``--every`` steps — training waits for each write;
- ``background``: ``save_checkpoint(..., background=True)`` at the same steps — training goes on while it writes
  (the next optimizer step waits only for the copy), and the run ends once the last save is written.

Per mode: wall time, median step, how long training waits per save, how long a save takes, the steps that ran
during a write, and the share of the synchronous wait that saving in the background hid (:func:`main` gives each
figure). CPU figures on whatever machine runs it (its load average is recorded).

    python benchmarks/checkpoint.py [--dim 512] [--layers 8] [--steps 14] [--every 4] [--device-s 1.0]
    python benchmarks/checkpoint.py --quick   # checks the script (CI); its figures mean little

Writes ``benchmarks/results/checkpoint.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from rich.console import Console
from rich.table import Table

import rpcompile
from rpcompile.core.files import write_atomic
from rpcompile.training.checkpoint import background
from rpcompile.training.checkpoint.layout import checkpoints

from floor import FloorDevice  # benchmarks/
from overlap_run import build, lm_loss, sleeping

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"
MODES = ("no saves", "synchronous", "background")


WAITED: list[float] = []
"""Seconds the training thread spent waiting for a background save's copy (the instrumented ``wait_copied``)."""


@contextlib.contextmanager
def timed_waits() -> Iterator[None]:
    """Time every wait for a background save's copy into :data:`WAITED` while the block runs."""
    real = background.PendingSave.wait_copied

    def wait_copied(self: background.PendingSave) -> None:
        t0 = time.perf_counter()
        real(self)
        WAITED.append(time.perf_counter() - t0)

    background.PendingSave.wait_copied = wait_copied  # type: ignore[method-assign]
    try:
        yield
    finally:
        background.PendingSave.wait_copied = real  # type: ignore[method-assign]


def run(pipe: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, *, steps: int, every: int,
        directory: Path) -> dict[str, Any]:
    """Two warm-up steps, then ``steps`` steps in ``mode``: the step intervals, each save's call time, the time
    the steps after it waited for its copy and (background) its copy and write times; the wall to the last
    checkpoint written."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        pipe.forward_backward(x, target=y)
        pipe.step(optimizer)
    shutil.rmtree(directory, ignore_errors=True)
    spans, saves, pending = [], [], []
    start = time.perf_counter()
    for i in range(steps):
        t0 = time.perf_counter()
        pipe.forward_backward(x, target=y)
        pipe.step(optimizer)
        spans.append((t0, time.perf_counter()))
        if mode != "no saves" and (i + 1) % every == 0:
            WAITED.clear()
            if saves:
                saves[-1]["waited_s"] = 0.0
            s0 = time.perf_counter()
            out = rpcompile.save_checkpoint(directory, model=model, optimizer=optimizer, pipeline=pipe, step=i + 1,
                                            extra={"batches": i + 1}, background=mode == "background")
            saves.append({"at": s0, "call_s": time.perf_counter() - s0})
            if mode == "background":
                pending.append(out)
        if saves:
            saves[-1]["waited_s"] = sum(WAITED)
    for p, s in zip(pending, saves):
        p.wait()
        s.update(copy_s=p.copy_s, write_s=p.write_s, done=s["at"] + s["call_s"] + p.copy_s + p.write_s)
    wall = time.perf_counter() - start
    during: list[float] = []
    for s in saves:
        s["stall_s"] = s["call_s"] + s.get("waited_s", 0.0)
        end = s.get("done", s["at"] + s["call_s"])
        inside = [b - a for a, b in spans if a < end and b > s["at"] + s["call_s"]]
        s["steps_during"] = len(inside)
        during += inside
    newest = checkpoints(directory)[0][1] if saves else None
    size = sum(f.stat().st_size for f in newest.iterdir()) if newest is not None else 0
    others = [b - a for a, b in spans if (b - a) not in during] or [0.0]
    return {"mode": mode, "wall_s": wall, "step_s": statistics.median(b - a for a, b in spans),
            "step_during_save_s": statistics.median(during) if during else None,
            "step_otherwise_s": statistics.median(others), "saves": saves, "checkpoint_mb": size / 1e6}


def main(argv: list[str] | None = None) -> int:
    """The figures per mode, in full.

    Per mode: the wall time (to the last checkpoint on disk), the median step, how long training waits per save (the
    ``save_checkpoint`` call, and in the background the next steps' wait for the copy — timed where it happens, so the
    machine's noise does not enter), how long a save takes (background: its copy and its write), how many steps ran
    while a save was writing and their median time (the write competes for the host), and the share of the synchronous
    save's wait that saving in the background hid. CPU figures on whatever machine runs it (its load average is
    recorded): the disk and the host's memory bandwidth are real, the device compute is a sleep.

    The host's work in a save: the snapshot, the copy, the safetensors and ``torch.save`` writes, their sha256, every
    ``fsync``.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--every", type=int, default=4, help="save after every this many steps (default 4)")
    ap.add_argument("--device-s", type=float, default=1.0, help="emulated device compute per step, seconds")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temporary "
                                                           "directory on this machine's disk)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="a tiny run that checks the script")
    args = ap.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.seq, args.steps, args.every, args.device_s = 128, 2, 64, 4, 2, 0.1
        if args.out == RESULTS:
            args.out = RESULTS.with_name("checkpoint-quick.json")
    model, x, y = build(args.layers, args.dim, args.seq, args.microbatches)
    params = sum(p.numel() for p in model.parameters())
    pipe = rpcompile.compile(model, (x,), loss_fn=lm_loss, devices=[FloorDevice(0), FloorDevice(1)], spec="rtx4090",
                             microbatches=args.microbatches, example_target=y, time_limit_s=10.0)
    runs = len(pipe.plan.stages) * args.microbatches  # stage microbatches per step, over two devices
    seconds = {k: 2 * args.device_s / runs for k in range(len(pipe.plan.stages))}
    load = os.getloadavg()
    root = Path(args.dir or tempfile.mkdtemp(prefix="rpcompile-ckpt-bench-", dir=os.environ.get("TMPDIR", "/var/tmp")))
    rows = []
    try:
        with sleeping(seconds), timed_waits():
            for mode in MODES:
                rows.append(run(pipe, model, x, y, mode, steps=args.steps, every=args.every, directory=root / mode))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    sync = rows[1]
    for r in rows:
        n = len(r["saves"])
        r["stall_per_save_s"] = statistics.mean(s["stall_s"] for s in r["saves"]) if n else 0.0
        r["save_s"] = statistics.mean((s["copy_s"] + s["write_s"]) if "copy_s" in s else s["call_s"]
                                      for s in r["saves"]) if n else 0.0
        r["steps_during_save"] = statistics.mean(s["steps_during"] for s in r["saves"]) if n else 0.0
    for r in rows[2:]:  # the share of a synchronous save's stall that saving in the background hid
        r["hidden"] = 1 - r["stall_per_save_s"] / sync["stall_per_save_s"] if sync["stall_per_save_s"] > 0 else None
    print_table(rows, args, params, len(pipe.plan.stages))
    out = {"date": dt.date.today().isoformat(), "machine": platform.node(), "cpus": os.cpu_count(),
           "load_average": [load, os.getloadavg()], "torch": torch.__version__,
           "note": "CPU: device compute emulated by sleeping; host work and disk real",
           "parameters": params, "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "rows": rows}
    write_atomic(args.out, json.dumps(out, indent=1) + "\n")
    return 0


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, params: int, stages: int) -> None:
    table = Table(title=f"checkpoint saves (CPU, emulated device compute {args.device_s:.1f} s/step): "
                        f"{params / 1e6:.0f}M parameters, {stages} stages on 2 sleeping devices, a save every "
                        f"{args.every} of {args.steps} steps, {rows[1]['checkpoint_mb']:.0f} MB each")
    for col in ("mode", "wall", "median step", "training waits per save", "save takes", "steps during a save",
                "their median step", "wait hidden"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        saves = r["saves"]
        takes = "" if not saves else (f"{r['save_s']:.2f} s (copy {statistics.mean(s['copy_s'] for s in saves):.2f} "
                                      f"+ write {statistics.mean(s['write_s'] for s in saves):.2f})"
                                      if "copy_s" in saves[0] else f"{r['save_s']:.2f} s")
        during = r["step_during_save_s"]
        table.add_row(r["mode"], f"{r['wall_s']:.2f} s", f"{r['step_s']:.2f} s",
                      f"{r['stall_per_save_s']:.3f} s" if saves else "", takes,
                      f"{r['steps_during_save']:.1f}" if saves else "",
                      f"{during:.2f} s" if during is not None else "",
                      f"{100 * r['hidden']:.0f}%" if r.get("hidden") is not None else "")
    Console(width=170).print(table)


if __name__ == "__main__":
    raise SystemExit(main())
