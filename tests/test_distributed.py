"""Data-parallel pipelines over torch.distributed (rpcompile/training/distributed.py, runtime/reduce.py): 2 and 3 processes
on 127.0.0.1 with gloo, each with two logical CPU devices, against one eager process on the concatenated batch.

Each spawn checks several things (a spawn costs ~10-30 s on a loaded 2-core machine): the processes record what
they saw (tests/_dist_worker.py) and the tests here compare it."""

from __future__ import annotations

import copy
import multiprocessing
import socket
import time
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

import _dist_worker
from _dist_worker import my_shard, model_and_batches
from rpcompile.core.plan import Plan

TOL = dict(rtol=1e-5, atol=1e-6)  # tests/test_runtime.py
STEP_TOL = dict(rtol=1e-5, atol=2e-6)  # weights after AdamW, as tests/test_runtime.py (eps=1e-5: no amplified near-zero grads)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(scenario: str, world: int, tmp: Path, timeout_s: float, wall_s: float = 240.0,
          wait: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` processes; every rank's record (a rank that wrote none fails the test).
    ``wait``: the ranks to wait for (default all); the others are killed once those are done."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_dist_worker.main, args=(r, world, port, str(tmp), scenario, timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + wall_s
    for r in (range(world) if wait is None else wait):
        procs[r].join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    out = []
    for r in range(world):
        path = tmp / f"rank{r}.pt"
        assert path.exists(), f"rank {r} wrote no record within {wall_s} s (hung or crashed)"
        out.append(torch.load(path, weights_only=False))
    return out


def eager_reference() -> dict[str, Any]:
    """One process, the whole (concatenated) batches: the same two AdamW steps as _dist_worker.train."""
    spec, _, batches = model_and_batches()
    model = copy.deepcopy(spec.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    out: dict[str, Any] = {"losses": [], "grads": []}
    for group in ([0], [1, 2]):
        for b in group:
            x, y = batches[b]
            loss = spec.loss_fn(model(x), y)
            loss.backward()
            out["losses"].append(float(loss.detach()))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["model"], out["loss_fn"], out["batches"] = model, spec.loss_fn, batches
    return out


def assert_trained_like(rec: dict[str, Any], ref: dict[str, Any], rank: int) -> None:
    assert "error" not in rec, f"rank {rank}: {rec['error']}"
    torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), **TOL,
                               msg=lambda m: f"rank {rank} losses: {m}")
    for step, (got, want) in enumerate(zip(rec["grads"], ref["grads"])):
        assert set(got) == set(want), f"rank {rank} step {step}: gradients of {set(want) ^ set(got)} differ in presence"
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL,
                                       msg=lambda m: f"rank {rank} step {step} grad {name}: {m}")
    for name, w in ref["weights"].items():
        torch.testing.assert_close(rec["weights"][name], w, **STEP_TOL, msg=lambda m: f"rank {rank} weight {name}: {m}")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("two")
    return spawn("two", 2, tmp, timeout_s=60.0), tmp


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return eager_reference()


def test_two_ranks_train_like_one_process_on_the_whole_batch(two, reference):
    records, _ = two
    assert records[0]["buckets"] > 10  # tiny buckets: their order across ranks is exercised
    assert records[0]["plan"] == records[1]["plan"]  # rank 0's plan, on every rank
    for r, rec in enumerate(records):
        assert_trained_like(rec, reference, r)


def test_data_parallel_false_trains_this_process_alone(two, reference):
    records, _ = two
    model, loss_fn = copy.deepcopy(reference["model"]), reference["loss_fn"]
    for r, rec in enumerate(records):
        model.zero_grad(set_to_none=True)
        x, y = my_shard(*reference["batches"][0], r, 2)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.testing.assert_close(torch.tensor(rec["alone_loss"]), loss.detach(), **TOL)
        for name, p in model.named_parameters():
            torch.testing.assert_close(rec["alone_grads"][name], p.grad, **TOL, msg=lambda m: f"rank {r} {name}: {m}")


def test_ranks_with_different_plans_refuse_naming_the_rank(two):
    records, _ = two
    for r, rec in enumerate(records):
        assert rec["mismatch"].startswith(f"DistributedError: rank {r}: every rank must run the same plan but rank 1 "
                                          "runs plan ")
        assert "\n" not in rec["mismatch"]


def test_a_rank_that_raises_stops_every_rank_then_they_go_on(two, reference):
    records, _ = two
    stage, input_ = [rec["failed_stage"] for rec in records], [rec["failed_input"] for rec in records]
    assert stage[0] == ("DistributedError: rank 0: rank 1 failed while finishing the iteration (its own error says "
                        "why); every rank stops this iteration — its gradients are dropped")
    assert stage[1].startswith("LossFnError: loss_fn(output, target) failed on microbatch 0 (ValueError: boom on rank "
                               "1); it was given the target int64 ")
    assert input_[0].startswith("InputError: sequence length ")
    assert input_[1].startswith("DistributedError: rank 1: rank 0 failed while starting the iteration")
    assert all(rec["failed_stage_s"] < 20 and rec["failed_input_s"] < 20 for rec in records)
    # the ranks' collectives stayed paired: the next call is the whole batch's loss at the trained weights
    x, y = reference["batches"][0]
    want = float(reference["loss_fn"](reference["model"](x), y).detach())
    for rec in records:
        assert rec["after_failure_loss"] == pytest.approx(want, rel=1e-5)


def test_three_ranks_on_a_saved_plan_and_a_rank_that_hangs(two, reference):
    records, tmp = two
    three = tmp.parent / "three"
    three.mkdir()
    Plan.from_dict(records[0]["plan"]).save(three / "plan.json")
    out = spawn("three", 3, three, timeout_s=60.0, wait=[0, 1])
    for r, rec in enumerate(out):
        assert_trained_like(rec, reference, r)
    for r in (0, 1):  # rank 2 never finishes its loss: the others give up at the collective's timeout (3 s)
        assert out[r]["hang"].startswith(f"DistributedError: rank {r}: ")
        assert "another rank stopped or hangs" in out[r]["hang"] and "\n" not in out[r]["hang"]
        assert out[r]["hang_s"] < 30


# ---- in this process: the buckets, and the data-parallel path on a one-rank group (no spawn) -------------------
def _toy_pipeline(**options: Any) -> tuple[Any, Any]:
    import rpcompile
    from _toy import TiedToy
    from _dist_worker import FINE_CPU

    torch.manual_seed(0)
    model = TiedToy()
    x = torch.randint(0, 16, (6, 5))
    pipe = rpcompile.compile(model, (x,), loss_fn=lambda out, y: torch.nn.functional.cross_entropy(
        out.flatten(0, 1), y.flatten()), spec=FINE_CPU, devices=["cpu", "cpu"], microbatches=3, time_limit_s=2.0,
        allow_save=False, **options)
    return pipe, model


def test_buckets_leave_frozen_parameters_out_and_hold_a_tied_one_once():
    from rpcompile.runtime.reduce import buckets

    pipe, model = _toy_pipeline()
    model.l1.weight.requires_grad_(False)
    params = dict(pipe.gm.named_parameters())
    program = pipe.executor.program
    got = buckets(program, params, bucket_bytes=64)
    names = [n for b in got for n in b.names]
    assert sorted(names) == sorted(n for n, p in params.items() if p.requires_grad)  # l1.weight: frozen, left out
    assert names.count("embed.weight") == 1  # read by the first stage and the tied output projection: one bucket
    holders = {p.index for p in program.stages if p.kind != "forward" and "embed.weight" in p.params.values()}
    assert next(b for b in got if "embed.weight" in b.names).waits_for >= holders
    assert len(holders) >= 1 and len(got) > 1


def test_data_parallel_true_needs_a_process_group():
    import rpcompile
    from rpcompile.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^data_parallel=True but torch.distributed has no process group: call "
                                          r"torch.distributed.init_process_group\(...\) first"):
        rpcompile.compile(torch.nn.Linear(2, 2), (torch.ones(3, 2),), loss_fn=None, data_parallel=True)


def test_one_rank_data_parallel_equals_the_plain_pipeline_with_accumulation_and_an_overlapped_step():
    """The whole data-parallel path (global token count, held gradients, buckets, install) on a one-rank gloo
    group in this process: what the plain pipeline does, through gradient accumulation and an overlapped optimizer
    step (whose gradients the reduction must not touch) — up to float order: a call's gradients are summed apart
    from ``.grad`` and then added."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs = []
        for dp in (False, True):
            pipe, model = _toy_pipeline(data_parallel=dp)
            assert (pipe.data_parallel is not None) == dp
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
            gen = torch.Generator().manual_seed(1)
            losses, grads = [], []
            for step in range(3):
                x, y = torch.randint(0, 16, (6, 5), generator=gen), torch.randint(0, 16, (6, 5), generator=gen)
                y[:, 3:] = -100  # padding
                losses.append(pipe.forward_backward(x, target=y))
                losses.append(pipe.forward_backward(x[:4], target=y[:4]))  # accumulates
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                pipe.step(opt, overlap=step == 1)
            pipe.synchronize()
            runs.append((losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
        (l0, g0, w0), (l1, g1, w1) = runs
        torch.testing.assert_close(torch.stack(l1), torch.stack(l0), **TOL)
        for a, b in zip(g0, g1):
            for n in a:
                torch.testing.assert_close(b[n], a[n], **TOL, msg=lambda m: f"grad {n}: {m}")
        for n in w0:
            torch.testing.assert_close(w1[n], w0[n], **STEP_TOL, msg=lambda m: f"weight {n}: {m}")
    finally:
        dist.destroy_process_group()


def test_each_rank_salts_its_dropout_seeds():
    from rpcompile.runtime import rng

    draw = lambda: rng.seeded_call("dropout", torch.nn.functional.dropout, torch.ones(64), 0.5)  # noqa: E731
    try:
        alone = draw()
        torch.testing.assert_close(draw(), alone)  # replayable
        rng.stream = "rank1/"
        assert not torch.equal(draw(), alone)
    finally:
        rng.stream = ""
