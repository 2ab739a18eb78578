"""What each process of tests/test_distributed.py runs (not collected: no test_ prefix). Every rank records what it
saw — losses, gradients, weights, one-line errors — into ``rank<r>.pt`` for the test to compare with eager."""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import rpcompile
from rpcompile.core.specs import get_spec
from rpcompile.models.registry import load_model
from rpcompile.runtime import reduce
from rpcompile.training.distributed import shard

FINE_CPU = dataclasses.replace(get_spec("cpu"), name="cpu-fine-stages", stage_overhead_s=30e-6)
SEQ = 16


def model_and_batches(seed: int = 0) -> tuple[Any, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (same weights in every process) and three padded batches of 7 rows: real lengths vary by row,
    targets past a row's length are -100 (padding) and so are its inputs' tokens past it (id 0)."""
    torch.manual_seed(seed)
    spec = load_model("llama-demo", batch_size=4, seq_len=SEQ)
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = spec.model.config.vocab_size
    batches = []
    for _ in range(3):
        x = torch.randint(1, vocab, (7, SEQ), generator=gen)
        y = torch.randint(0, vocab, (7, SEQ), generator=gen)
        lengths = torch.randint(3, SEQ + 1, (7,), generator=gen)
        pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
        batches.append((x.masked_fill(pad, 0), y.masked_fill(pad, -100)))
    return spec, spec.example_inputs[0], batches


def my_shard(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows, cut to its own longest real row (ranks run different sequence lengths)."""
    xs, ys = shard(x, rank, world), shard(y, rank, world)
    keep = int((ys != -100).any(0).nonzero().max()) + 1 if (ys != -100).any() else 1
    return xs[:, :keep], ys[:, :keep]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def train(pipe: Any, model: torch.nn.Module, batches: list, rank: int, world: int, out: dict) -> None:
    """Two AdamW steps: the first on batch 0, the second accumulating batches 1 and 2 (two calls, one step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    out["losses"], out["grads"] = [], []
    for group in ([0], [1, 2]):
        for b in group:
            x, y = my_shard(*batches[b], rank, world)
            out["losses"].append(float(pipe.forward_backward(x, target=y)))
        out["grads"].append(grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}


def scenario_two(rank: int, world: int, out: dict, tmp: Path) -> None:
    """Rank 0 plans; equality with eager; opt-out; a mismatched plan; a rank that raises, then recovery."""
    spec, example, batches = model_and_batches()
    reduce.BUCKET_BYTES = 4096  # many buckets: they must pair up across ranks in the same order
    started = time.perf_counter()
    pipe = rpcompile.compile(spec.model, (example,), loss_fn=spec.loss_fn, spec=FINE_CPU, devices=["cpu", "cpu"],
                             microbatches=3, time_limit_s=2.0, allow_save=False)
    out["compile_s"] = time.perf_counter() - started
    out["buckets"] = len(pipe.data_parallel.reducer.buckets)
    out["plan"] = pipe.plan.to_dict()
    train(pipe, spec.model, batches, rank, world, out)

    # data_parallel=False: this process alone, its own shard's gradients
    alone = rpcompile.compile(spec.model, (example,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], plan=pipe.plan,
                              data_parallel=False)
    x, y = my_shard(*batches[0], rank, world)
    spec.model.zero_grad(set_to_none=True)
    out["alone_loss"] = float(alone.forward_backward(x, target=y))
    out["alone_grads"] = grads(spec.model)
    spec.model.zero_grad(set_to_none=True)

    # rank 1 runs another plan (other microbatches): every rank refuses, naming it
    other = pipe.plan if rank == 0 else dataclasses.replace(pipe.plan, microbatches=2)
    try:
        rpcompile.compile(spec.model, (example,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], plan=other)
    except Exception as e:  # noqa: BLE001 - recorded for the test
        out["mismatch"] = one_line(e)

    # rank 1's loss raises in the middle of the iteration; rank 0 gives a too-long batch: both ranks stop, naming it
    def failing(output: Any, target: Any) -> torch.Tensor:
        raise ValueError("boom on rank 1")

    for what, fn in (("stage", failing if rank == 1 else spec.loss_fn), ("input", spec.loss_fn)):
        pipe.loss_fn = fn
        x, y = my_shard(*batches[0], rank, world)
        if what == "input" and rank == 0:
            x, y = torch.cat([x, x], 1), torch.cat([y, y], 1)
        started = time.perf_counter()
        try:
            pipe.forward_backward(x, target=y)
        except Exception as e:  # noqa: BLE001
            out[f"failed_{what}"] = one_line(e)
        out[f"failed_{what}_s"] = time.perf_counter() - started
    spec.model.zero_grad(set_to_none=True)
    x, y = my_shard(*batches[0], rank, world)
    out["after_failure_loss"] = float(pipe.forward_backward(x, target=y))  # the ranks are in step again


def scenario_three(rank: int, world: int, out: dict, tmp: Path) -> None:
    """Three ranks on rank 0's saved plan; equality with eager; then rank 2 hangs: the others time out."""
    spec, example, batches = model_and_batches()
    pipe = rpcompile.compile(spec.model, (example,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"],
                             plan=tmp / "plan.json")
    train(pipe, spec.model, batches, rank, world, out)
    torch.save(out, tmp / f"rank{rank}.pt")  # rank 2 is killed once the others have given up on it
    dist.barrier()  # in step; then a short timeout (the slow part, compiling, is over)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3), dist.group.WORLD)
    if rank == 2:
        pipe.loss_fn = lambda output, target: time.sleep(60)  # never comes back within the timeout
    x, y = my_shard(*batches[0], rank, world)
    started = time.perf_counter()
    try:
        pipe.forward_backward(x, target=y)
    except Exception as e:  # noqa: BLE001
        out["hang"] = one_line(e)
    out["hang_s"] = time.perf_counter() - started


def main(rank: int, world: int, port: int, tmp: str, scenario: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        {"two": scenario_two, "three": scenario_three}[scenario](rank, world, out, Path(tmp))
    except BaseException as e:  # noqa: BLE001 - the test reports it
        out["error"] = one_line(e)
    torch.save(out, Path(tmp) / f"rank{rank}.pt")
    os._exit(0)  # no process-group teardown: a peer may be gone
