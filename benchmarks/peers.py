"""rpcompile against torch.distributed.pipelining on the CPU: the same LLaMA batch trained three ways.

One small LLaMA-style decoder, one batch and one set of initial weights, one training step (forward, loss,
backward) run by
- eager PyTorch (the reference: ``lm_loss(model(x), y).backward()``);
- ``torch.distributed.pipelining`` on 2 processes joined by gloo over 127.0.0.1, split halfway through the layers,
  with the ``ScheduleGPipe`` and ``Schedule1F1B`` schedules;
- rpcompile on ``devices=["cpu", "cpu"]``.
Every system must give eager's loss and every parameter's gradient (the table shows the largest difference); step
times are medians after warm-up. CPU timings show each system's overheads, not its speed on GPUs.

Prints a table and writes benchmarks/results/peers.json.
    python benchmarks/peers.py [--steps 20] [--microbatches 4] [--layers 8] [--quick]

Threads (2 cores on the reference machine): eager runs with torch's default intra-op threads (all cores), and
once more with 1 thread (the work on one core, which two 1-thread pipeline workers can at best halve); each
pipelining rank is its own process with 1 intra-op thread (and 1 inter-op thread); rpcompile's executor gives each
logical CPU device ``threads // devices`` intra-op threads by itself (runtime/executor.py), i.e. 1 each on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import socket
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import Tensor, nn

import rpcompile
from rpcompile.core.files import write_atomic
from rpcompile.models.llama import Llama, LlamaConfig
from rpcompile.models.registry import lm_loss

SCHEDULES = ("GPipe", "1F1B")
"""The ``torch.distributed.pipelining`` schedules compared (``ScheduleGPipe``, ``Schedule1F1B``)."""


@dataclass(frozen=True)
class Setup:
    """The model, the batch and the run: everything both the parent and the pipelining ranks need to agree on."""

    layers: int = 8
    dim: int = 128
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 352
    vocab: int = 512
    batch: int = 8
    seq: int = 32
    microbatches: int = 4
    steps: int = 20
    warmup: int = 3
    seed: int = 0
    timeout_s: float = 300.0
    """Wall-clock limit for the pipelining processes (set-up, all schedules and steps)."""
    schedules: tuple[str, ...] = field(default=SCHEDULES)

    def config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab, dim=self.dim, n_layers=self.layers, n_heads=self.heads,
                           n_kv_heads=self.kv_heads, ffn_dim=self.ffn, max_seq_len=self.seq)


QUICK = dict(layers=4, dim=64, heads=4, kv_heads=2, ffn=176, vocab=256, batch=4, seq=32, microbatches=2, steps=2,
             warmup=1)
"""``--quick``: the ``llama-demo`` shape, 2 microbatches, 2 timed steps (what tests/test_peers.py runs)."""


def build(setup: Setup) -> tuple[Llama, Tensor, Tensor]:
    """The model and one batch ``(input_ids, target)``, fixed by ``setup.seed`` (the global RNG is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(setup.seed)
        model = Llama(setup.config())
        x = torch.randint(0, setup.vocab, (setup.batch, setup.seq))
        y = torch.randint(0, setup.vocab, (setup.batch, setup.seq))
    return model, x, y


# ---------------------------------------------------------------------------------------------- pipeline stages
# Manual stage construction: each rank wraps its half of the blocks (sharing the full model's Parameters, so
# gradients are reported under the full model's names). The tracing front end also splits this decoder on torch
# 2.13 — pipeline(model, mb_args=(x_mb,), split_spec={f"layers.{cut}": SplitPoint.BEGINNING}) gives the same two
# halves — but costs ~3 s of torch.export per rank and fixes the microbatch shape; manual stages keep the timed
# step free of tracing artefacts and are the pipelining docs' way for models already written as blocks.


class FirstHalf(nn.Module):
    """Stage 0: ``input_ids -> hidden``: the embedding and blocks ``[0, cut)``."""

    def __init__(self, model: Llama, cut: int) -> None:
        super().__init__()
        self.embed, self.layers = model.embed, nn.ModuleList(model.layers[:cut])
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        t = input_ids.size(1)
        cos, sin = torch.narrow(self.rope_cos, 0, 0, t), torch.narrow(self.rope_sin, 0, 0, t)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class SecondHalf(nn.Module):
    """Stage 1: ``hidden -> logits``: blocks ``[cut, n)``, the final norm and the LM head."""

    def __init__(self, model: Llama, cut: int) -> None:
        super().__init__()
        self.layers, self.norm, self.lm_head = nn.ModuleList(model.layers[cut:]), model.norm, model.lm_head
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        t = x.size(1)
        cos, sin = torch.narrow(self.rope_cos, 0, 0, t), torch.narrow(self.rope_sin, 0, 0, t)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def stage_module(model: Llama, rank: int) -> nn.Module:
    """Rank ``rank``'s half of ``model``, cut at the block boundary ``n_layers // 2``."""
    cut = model.config.n_layers // 2
    return FirstHalf(model, cut) if rank == 0 else SecondHalf(model, cut)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pipelining_worker(rank: int, setup: Setup, port: int, workdir: str) -> None:
    """One pipelining rank (run by ``torch.multiprocessing``): correctness step, then timed steps; writes its result
    to ``workdir/rank{rank}.pt`` (or the traceback to ``rank{rank}.err``)."""
    try:
        _pipelining_rank(rank, setup, port, workdir)
    except BaseException:
        Path(workdir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _pipelining_rank(rank: int, setup: Setup, port: int, workdir: str) -> None:
    # here, not at the top: importable only where torch was built with distributed (run_pipelining checks first)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)  # 2 ranks share the 2 cores (see the module docstring)
    torch.set_num_interop_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, whatever the host name resolves to
    timeout = datetime.timedelta(seconds=max(10.0, setup.timeout_s))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    try:
        state, x, y = torch.load(Path(workdir, "inputs.pt"))
        n_tokens = y.numel()

        # Matching eager's mean-over-batch contract: each microbatch's loss is its *sum* of token losses divided by
        # the token count of the whole batch, and the schedule does not rescale gradients (scale_grads=False), so
        # the microbatch losses add up to — and their gradients to those of — eager's batch-mean cross-entropy.
        # (The schedules' default, scale_grads=True with a per-microbatch mean, gives the same for the equal
        # microbatches that pipelining requires; this form says what is meant and holds for any split.)
        def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum") / n_tokens

        classes = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
        runs = {}
        for name in setup.schedules:  # each schedule gets its own copy of the initial weights
            model = Llama(setup.config())
            model.load_state_dict(state)
            module = stage_module(model, rank)
            names = {id(p): n for n, p in model.named_parameters()}
            stage = PipelineStage(module, rank, 2, torch.device("cpu"))
            schedule = classes[name](stage, setup.microbatches, loss_fn=loss_fn, scale_grads=False)
            runs[name] = (module, names, schedule)

        def step(name: str) -> Tensor | None:
            module, _, schedule = runs[name]
            module.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
                return None
            losses: list[Tensor] = []
            schedule.step(target=y, losses=losses)
            return torch.stack(losses).sum().detach()

        result: dict[str, Any] = {}
        for name in setup.schedules:  # the correctness step: the first one, from the initial weights
            loss = step(name)
            module, names, _ = runs[name]
            grads = {names[id(p)]: p.grad.detach().clone() for p in module.parameters() if p.grad is not None}
            result[name] = {"loss": None if loss is None else float(loss), "grads": grads, "times": []}
        for i in range(setup.warmup + setup.steps):  # then the schedules alternate, step by step
            for name in setup.schedules:
                dist.barrier()
                t0 = time.perf_counter()
                step(name)
                dist.barrier()  # the step ends when the last rank is done
                if i >= setup.warmup:
                    result[name]["times"].append(time.perf_counter() - t0)
        torch.save(result, Path(workdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_pipelining(setup: Setup, model: Llama, x: Tensor, y: Tensor) -> dict[str, dict[str, Any]]:
    """Run every schedule in ``setup.schedules`` on 2 gloo processes; per schedule: ``loss``, ``grads`` (by the full
    model's parameter names, both ranks merged) and step ``times`` (seconds)."""
    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("torch.distributed with the gloo backend is not available in this torch build")
    with tempfile.TemporaryDirectory(prefix="rpcompile-peers-") as workdir:
        torch.save((model.state_dict(), x, y), Path(workdir, "inputs.pt"))
        port = _free_port()
        ctx = mp.start_processes(_pipelining_worker, args=(setup, port, workdir), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + setup.timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"torch.distributed.pipelining ranks (gloo on 127.0.0.1:{port}) did not finish within "
                        f"{setup.timeout_s:.0f} s; alive: "
                        f"{[i for i, p in enumerate(ctx.processes) if p.is_alive()]}")
        except Exception as e:
            errors = [Path(workdir, f"rank{r}.err") for r in range(2)]
            detail = "\n".join(f"rank {r}:\n{p.read_text()}" for r, p in enumerate(errors) if p.exists())
            if isinstance(e, TimeoutError):
                raise TimeoutError(f"{e}\n{detail}") from None
            hint = ("\n(init_process_group failed: gloo could not connect over the loopback interface; "
                    "set GLOO_SOCKET_IFNAME to an interface that reaches 127.0.0.1)"
                    if "init_process_group" in detail else "")
            raise RuntimeError(f"torch.distributed.pipelining failed (gloo on 127.0.0.1:{port}):\n"
                               f"{detail or e}{hint}") from None
        finally:
            for p in ctx.processes:  # only ours, by their handles; no-ops once they have exited
                if p.is_alive():
                    p.terminate()
                p.join(timeout=5)
        ranks = [torch.load(Path(workdir, f"rank{r}.pt")) for r in range(2)]
    out = {}
    for name in setup.schedules:
        first, last = ranks[0][name], ranks[1][name]
        out[name] = {"loss": last["loss"], "grads": {**first["grads"], **last["grads"]},
                     "times": [max(a, b) for a, b in zip(first["times"], last["times"])]}
    return out


# ---------------------------------------------------------------------------------------------- the comparison
def grads_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_diff(ref: dict[str, Tensor], got: dict[str, Tensor]) -> float:
    """Largest ``|got - ref|`` over every parameter; ``inf`` when a parameter's gradient is missing or extra."""
    if set(ref) != set(got):
        return float("inf")
    return max(float((got[n] - ref[n]).abs().max()) for n in ref)


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3 if times else float("nan")


def compare(setup: Setup) -> dict[str, Any]:
    """Train one step every way from the same weights and batch; time ``setup.steps`` more. Returns the report:
    ``rows`` (one per system and schedule) and ``eager`` (its loss and the largest gradient magnitude)."""
    model, x, y = build(setup)
    init = copy.deepcopy(model.state_dict())

    # eager: the reference
    eager = copy.deepcopy(model)
    ref_loss = lm_loss(eager(x), y)
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    ref = grads_of(eager)

    def eager_step() -> None:
        eager.zero_grad(set_to_none=True)
        lm_loss(eager(x), y).backward()

    # rpcompile: analytic CPU costs make the plan independent of timing noise
    ours = copy.deepcopy(model)
    pipe = rpcompile.compile(ours, (x,), loss_fn=lm_loss, devices=["cpu", "cpu"], microbatches=setup.microbatches,
                             spec="cpu")
    ours_loss = pipe.forward_backward(x, target=y).detach()
    ours_grads = grads_of(ours)

    def ours_step() -> None:
        ours.zero_grad(set_to_none=True)
        pipe.forward_backward(x, target=y)

    threads = torch.get_num_threads()

    def eager_1thread_step() -> None:  # the work one core does: what each pipeline rank / logical device gets
        torch.set_num_threads(1)
        try:
            eager_step()
        finally:
            torch.set_num_threads(threads)

    # eager (all threads, then 1) and rpcompile alternate step by step (load changes hit them alike)
    t_eager, t_eager1, t_ours = [], [], []
    for i in range(setup.warmup + setup.steps):
        for fn, out in ((eager_step, t_eager), (eager_1thread_step, t_eager1), (ours_step, t_ours)):
            t0 = time.perf_counter()
            fn()
            if i >= setup.warmup:
                out.append(time.perf_counter() - t0)

    # torch.distributed.pipelining: its own 2 processes, after the in-process runs (the cores are theirs then)
    model.load_state_dict(init)
    peers = run_pipelining(setup, model, x, y)

    eager_ms = _median_ms(t_eager)
    rows = [{"system": "eager", "schedule": "-", "loss": float(ref_loss), "max_grad_diff": 0.0,
             "step_ms": eager_ms, "ratio": 1.0, "times_ms": [t * 1e3 for t in t_eager]}]
    ms = _median_ms(t_eager1)
    rows.append({"system": "eager", "schedule": "- (1 thread)", "loss": float(ref_loss), "max_grad_diff": 0.0,
                 "step_ms": ms, "ratio": ms / eager_ms, "times_ms": [t * 1e3 for t in t_eager1]})
    for name, r in peers.items():
        ms = _median_ms(r["times"])
        rows.append({"system": "torch pipelining", "schedule": name, "loss": r["loss"],
                     "max_grad_diff": grad_diff(ref, r["grads"]), "step_ms": ms, "ratio": ms / eager_ms,
                     "times_ms": [t * 1e3 for t in r["times"]]})
    ms = _median_ms(t_ours)
    rows.append({"system": "rpcompile", "schedule": f"round-robin ({len(pipe.plan.stages)} stages)",
                 "loss": float(ours_loss), "max_grad_diff": grad_diff(ref, ours_grads), "step_ms": ms,
                 "ratio": ms / eager_ms, "times_ms": [t * 1e3 for t in t_ours]})
    for r in rows:
        r["loss_diff"] = abs(r["loss"] - float(ref_loss))
    return {"rows": rows, "eager_loss": float(ref_loss),
            "max_abs_grad": max(float(g.abs().max()) for g in ref.values()),
            "params": sum(p.numel() for p in model.parameters()), "rpcompile_microbatches": pipe.microbatches}


def machine() -> dict[str, Any]:
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, help="timed steps per system (default 20; --quick: 2)")
    ap.add_argument("--microbatches", type=int, help="microbatches for every pipeline (default 4; --quick: 2)")
    ap.add_argument("--layers", type=int, help="decoder blocks, split halfway for pipelining (default 8)")
    ap.add_argument("--quick", action="store_true", help="the llama-demo shape and 2 steps: a smoke run")
    ap.add_argument("--batch", type=int, help="sequences per step (default 8; --quick: 4)")
    args = ap.parse_args()
    options: dict[str, Any] = dict(QUICK) if args.quick else {}
    for key in ("steps", "microbatches", "layers", "batch"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    setup = Setup(**options)
    if setup.layers < 2:
        ap.error("--layers must be at least 2 (one block per pipelining rank)")
    if setup.batch % setup.microbatches:
        # torch.distributed.pipelining sizes its receive buffers from the first microbatch: uneven microbatches
        # (which rpcompile handles) fail there with a shape mismatch.
        ap.error(f"--microbatches {setup.microbatches} must divide the batch ({setup.batch}): "
                 "torch.distributed.pipelining needs equal microbatches")

    report = compare(setup)
    table = Table(title=f"one training step on the CPU ({os.cpu_count()} cores): LLaMA {setup.layers} layers, dim "
                        f"{setup.dim}, batch {setup.batch}×{setup.seq}, {setup.microbatches} microbatches, "
                        f"median of {setup.steps} steps")
    for col in ("system", "schedule", "loss", "max|Δgrad|", "step", "×eager"):
        table.add_column(col, justify="left" if col in ("system", "schedule") else "right")
    for r in report["rows"]:
        table.add_row(r["system"], r["schedule"], f"{r['loss']:.6f}", f"{r['max_grad_diff']:.2e}",
                      f"{r['step_ms']:.1f} ms", f"{r['ratio']:.2f}×")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: rich's default 80 columns would wrap the system names
        console = Console(width=100)
    console.print(table)
    console.print(f"largest eager gradient {report['max_abs_grad']:.2e}; intra-op threads: eager "
                  f"{torch.get_num_threads()} (and 1), pipelining 1 per rank (2 processes), rpcompile "
                  f"{max(1, torch.get_num_threads() // 2)} per logical device (2 devices)")
    out = Path(__file__).parent / "results" / "peers.json"
    out.parent.mkdir(exist_ok=True)
    write_atomic(out, json.dumps({"machine": machine(), "setup": asdict(setup), **report}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
