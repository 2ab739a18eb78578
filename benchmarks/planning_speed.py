"""Planning speed (issue 20): the CLI's wall and CPU seconds for ``plan llama-8b``, a 128-layer model and
``check``, this checkout against a baseline checkout, runs interleaved.

    python benchmarks/planning_speed.py [--baseline DIR] [--repeats 3] [--time-limit 10] [--only plan8b,plan128,check] [--output FILE]

``--baseline DIR``: a directory whose ``rpcompile`` package (with ``rpcompile/passes`` and ``rpcompile/runtime``
inside it, as installed) is the one to compare against, put first on ``PYTHONPATH``; make one from a commit with
``git archive C | tar -x -C D && mkdir D/pkg && cp -r D/rpcompile D/pkg/ && cp -r D/passes D/pkg/rpcompile/passes
&& cp -r D/runtime D/pkg/rpcompile/runtime`` and pass ``D/pkg``. Each command runs in its own process (imports
included, as a user sees it); CPU is the child's user + sys. The 1-minute load average before each run is kept
beside it: on a shared machine wall times follow the load, CPU seconds much less. Writes
``benchmarks/results/planning_speed.json`` (each plan's predicted iteration time too: a speed-up must not change
it for the worse).

The 128-layer model is Llama-3-8B's shape with 128 layers (this file's :func:`llama128`, on the meta device,
9 sequences of 4096 tokens: one per microbatch on 8 GPUs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rpcompile.core.files import write_atomic
from rpcompile.models.llama import Llama, LlamaConfig
from rpcompile.models.registry import lm_loss

RESULTS = Path(__file__).parent / "results" / "planning_speed.json"
HERE = Path(__file__).resolve()


def llama128() -> tuple[Any, ...]:
    """Llama-3-8B's shape with 128 layers on the meta device: (model, inputs, loss, target), 9 × 4096 tokens."""
    cfg = LlamaConfig(max_seq_len=4096, vocab_size=128_256, dim=4096, n_layers=128, n_heads=32, n_kv_heads=8,
                      ffn_dim=14_336, rope_theta=500_000.0, norm_eps=1e-5)
    with torch.device("meta"):
        model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (9, 4096)).to("meta")
    target = torch.randint(0, cfg.vocab_size, (9, 4096)).to("meta")
    return model, (tokens,), lm_loss, target


def _run(argv: list[str], pythonpath: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # cwd away from any checkout: ``-m`` puts the cwd first on sys.path, ahead of PYTHONPATH, so run from a
    # checkout's root the baseline side would import that checkout's package instead of the baseline's
    proc = subprocess.run([sys.executable, "-m", "rpcompile", *argv], env=env, capture_output=True, text=True,
                          cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"rpcompile {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load": round(load, 2), "stdout": proc.stdout}


def _plan(model: str, out: str, time_limit: float) -> list[str]:
    # --no-cache: cold, as a first run (a repeat would take its solve from the solve cache)
    return ["plan", model, "--gpus", "8", "--spec", "rtx4090", "--time-limit", f"{time_limit:g}", "--no-cache",
            "-o", out]


def _predicted(path: str) -> float:
    return json.loads(Path(path).read_text())["predicted"]["iteration_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="PYTHONPATH entry holding the baseline rpcompile package")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--only", default="plan8b,plan128,check")
    ap.add_argument("--output", type=Path, default=RESULTS, help=f"where the JSON goes (default {RESULTS})")
    args = ap.parse_args()
    which = args.only.split(",")
    sides = [("after", None)] + ([("before", args.baseline)] if args.baseline else [])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for side, path in (sides if rep % 2 == 0 else sides[::-1]):  # interleaved, alternating who goes first
                for what in which:
                    out = f"{tmp}/{side}-{what}.json"
                    if what == "plan8b":
                        r = _run(_plan("llama-8b", out, args.time_limit), path)
                    elif what == "plan128":
                        r = _run(_plan(f"{HERE}:llama128", out, args.time_limit), path)
                    else:  # check a plan this side made of llama-8b
                        made = f"{tmp}/{side}-check-source.json"
                        if not Path(made).exists():
                            _run(_plan("llama-8b", made, args.time_limit), path)
                        r = _run(["check", made, "llama-8b"], path)
                        r["ok"] = " OK " in r["stdout"]
                    if what.startswith("plan"):
                        r["predicted_s"] = _predicted(out)
                    r.pop("stdout")
                    rows.append({"what": what, "side": side, "repeat": rep, **r})
                    print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for what in which:
        for side, _ in sides:
            mine = [r for r in rows if r["what"] == what and r["side"] == side]
            summary[f"{what}/{side}"] = {k: statistics.median(r[k] for r in mine) for k in ("wall_s", "cpu_s", "load")}
    meta = {"date": dt.date.today().isoformat(), "machine": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "time_limit_s": args.time_limit,
            "baseline": args.baseline, "repeats": args.repeats}
    args.output.parent.mkdir(exist_ok=True)
    write_atomic(args.output, json.dumps({"meta": meta, "runs": rows, "median": summary}, indent=1) + "\n")
    for key, value in summary.items():
        print(key, value)


if __name__ == "__main__":
    main()
