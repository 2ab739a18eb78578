"""What a new batch shape costs: the first training step at a (batch, sequence) shape the pipeline has not seen,
the second, and the steady step, on logical CPU devices.

One compiled pipeline serves every batch size and every sequence length up to the planned one (symbolic sizes
through torch.export and fx; nothing is re-traced or re-planned). Saved segments are captured with symbolic sizes
(rpcompile/runtime/segments/symbolic.py): one capture runs every shape its guards allow; a class they reject (one-row
microbatches) is recomputed at its first sighting and captured at its second. The "captures" column counts the
saved segments' captures after the shape's steps (all segments together).

    python benchmarks/shapes.py [--steps 3]

Prints a table and writes benchmarks/results/shapes.json. CPU times of tiny models: the ratio is the figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import rpcompile
from rpcompile.core.files import write_atomic
from rpcompile.models.registry import load_model

try:  # optional: the Hugging Face row runs only where transformers is installed
    import transformers
except ImportError:
    transformers = None

SHAPES = ((6, 32), (5, 24), (3, 17), (8, 32), (2, 9))


def _lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _models():
    yield "llama-demo (fx)", load_model("llama-demo", batch_size=6, seq_len=32).model, 256
    if transformers is None:
        return
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2)
    yield "HF LlamaForCausalLM (export)", transformers.LlamaForCausalLM(cfg), 256


def rows(steps: int) -> list[dict]:
    out = []
    for name, model, vocab in _models():
        x = torch.randint(0, vocab, SHAPES[0])
        t0 = time.perf_counter()
        pipe = rpcompile.compile(model, (x,), loss_fn=_lm_loss, devices=["cpu", "cpu"], microbatches=3, spec="cpu",
                                 time_limit_s=5.0)
        compile_s = time.perf_counter() - t0
        for shape in SHAPES:
            x, y = torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)
            times = []
            for _ in range(2 + steps):
                t0 = time.perf_counter()
                pipe.forward_backward(x, target=y)
                times.append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            steady = statistics.median(times[2:])
            out.append({"model": name, "shape": list(shape), "first_step_s": times[0], "second_step_s": times[1],
                        "steady_step_s": steady, "first_over_steady": times[0] / steady,
                        "second_over_steady": times[1] / steady, "compile_s": compile_s,
                        "saved_segments": len(pipe.program.saved),
                        "captures": sum(seg.n_captures for seg in pipe.program.saved)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    result = rows(args.steps)
    table = Table(title="first step at a new shape vs a steady step (2 logical CPU devices, 3 microbatches)")
    for col in ("model", "batch × seq", "1st step", "2nd step", "steady", "1st/steady", "2nd/steady", "captures", "compile"):
        table.add_column(col)
    for r in result:
        table.add_row(r["model"], "×".join(map(str, r["shape"])), f"{r['first_step_s'] * 1e3:.0f} ms",
                      f"{r['second_step_s'] * 1e3:.0f} ms", f"{r['steady_step_s'] * 1e3:.0f} ms",
                      f"{r['first_over_steady']:.2f}×", f"{r['second_over_steady']:.2f}×", f"{r['captures']}/{r['saved_segments']}",
                      f"{r['compile_s']:.1f} s")
    Console(width=160).print(table)
    path = Path(__file__).parent / "results" / "shapes.json"
    write_atomic(path, json.dumps({"torch": torch.__version__, "device": "cpu", "rows": result}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
