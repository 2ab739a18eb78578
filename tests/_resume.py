"""Training that checkpoints every step, for tests/test_checkpoint.py (not collected: no test_ prefix).

As a script — ``python tests/_resume.py CKPT_DIR PLAN STEPS OUT LOG`` — it builds the model (seeded), compiles it on
two logical CPU devices with the checkpoints' plan (the plan file ``PLAN`` before the first save), resumes from
the newest good checkpoint in ``CKPT_DIR`` if any (printing ``resumed <step>``), trains up to ``STEPS`` steps —
writing ``save <k>`` before and ``saved <k>`` after each checkpoint to the file ``LOG``, so a test can kill it in
either phase — and writes the final ``state_dict`` to ``OUT``. :func:`main` runs the same in a forked process.
``RESUME_SLOW_SAVE=<k>:<seconds>`` makes the first ``os.fsync`` of save ``k`` print ``fsync <k>`` and sleep first, so
a kill soon after that line lands inside the save: its temporary directory being written, not yet renamed into place.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
from rpcompile.core.specs import get_spec

VOCAB, DIM = 32, 16
SAVING = [0]
"""The step whose checkpoint is being written now (0: none)."""
#: Analytic CPU costs with a small per-stage overhead, so the tiny model is cut into several stages.
FINE = dataclasses.replace(get_spec("cpu"), name="cpu-fine-stages", stage_overhead_s=30e-6)


class Net(nn.Module):
    """Embedding → Linear → dropout → tanh → Linear → dropout → LayerNorm → head: dropout in two stages' worth."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, DIM)
        self.drop1 = nn.Dropout(0.25)
        self.l2 = nn.Linear(DIM, DIM)
        self.drop2 = nn.Dropout(0.25)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.drop1(self.l1(self.embed(ids))))
        return self.head(self.norm(h + self.drop2(self.l2(h))))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of step ``step``: a function of the step alone, so a resumed run reads the same batches."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (4, 6), generator=g), torch.randint(0, VOCAB, (4, 6), generator=g)


def build(plan: Any = None, *, precision: str = "fp32", scaler: bool = False, frozen: str | None = None,
          **options: Any) -> tuple[Net, Any, torch.optim.Optimizer]:
    """A seeded model (``frozen``: a submodule without gradients), its pipeline on two logical CPU devices
    (``plan``: a Plan or file; else planned with analytic costs) and an AdamW over it."""
    torch.manual_seed(0)
    model = Net()
    if frozen:
        model.get_submodule(frozen).requires_grad_(False)
    x, _ = batch(0)
    kw: dict[str, Any] = {"plan": plan} if plan is not None else {"spec": FINE, "microbatches": 2, "time_limit_s": 5.0}
    options.setdefault("devices", ["cpu", "cpu"])
    pipe = rpcompile.compile(model, (x,), loss_fn=loss_fn, precision=precision,
                             host_embedding=False, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 12,
                                                                               growth_interval=2) if scaler else None,
                             **kw, **options)
    return model, pipe, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: Net, pipe: Any, optimizer: Any, start: int, stop: int, *, overlap: bool = False,
          ckpt: str | os.PathLike | None = None, keep: int = 2, say: bool = False) -> None:
    """Steps ``start`` to ``stop`` (exclusive); with ``ckpt``, a checkpoint after every step (the newest
    ``keep`` kept)."""
    for step in range(start, stop):
        x, y = batch(step)
        pipe.forward_backward(x, target=y)
        pipe.step(optimizer, overlap=overlap)
        if ckpt is not None:
            SAVING[0] = step + 1
            if say:
                print(f"save {step + 1}", flush=True)
            rpcompile.save_checkpoint(ckpt, model=model, optimizer=optimizer, pipeline=pipe, step=step + 1,
                                      keep=keep)
            if say:
                print(f"saved {step + 1}", flush=True)
    pipe.synchronize()


def main(argv: list[str], slow_save: str = "") -> None:
    """The script: ``argv`` = CKPT_DIR PLAN STEPS OUT LOG (module docstring); its lines go to LOG."""
    ckpt, plan, steps, out, log = argv
    sys.stdout = open(log, "w", buffering=1)
    if slow_save:
        slow, delay = slow_save.split(":")
        fsync = os.fsync

        def slow_fsync(fd: int) -> None:
            if SAVING[0] == int(slow):
                SAVING[0] = -1  # once
                print(f"fsync {slow}", flush=True)
                time.sleep(float(delay))
            fsync(fd)

        os.fsync = slow_fsync
    model, pipe, optimizer = build(rpcompile.checkpoint_plan(ckpt) or plan)  # the checkpoints' plan, once saved
    resumed = rpcompile.load_checkpoint(ckpt, model=model, optimizer=optimizer, pipeline=pipe)
    start = 0 if resumed is None else resumed.step
    print(f"resumed {start}", flush=True)
    train(model, pipe, optimizer, start, int(steps), ckpt=ckpt, say=True)
    torch.save(model.state_dict(), Path(out))
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:], os.environ.get("RESUME_SLOW_SAVE", ""))
