"""Gradients summed on the devices across accumulation calls (``pipe.no_sync()``, :class:`rpcompile.runtime.stays.
DeviceGrads`): an HF Llama from a config, trained over padded batches of several sizes with the first calls of each
accumulation cycle under ``no_sync``, gets exactly the gradients and weights of the same pipeline without it (on
devices whose copies are real, :class:`StridedDevice`), sends fewer gradient bytes home, and its ``.grad`` contract
holds: ``zero_grad`` drops the sums, a step over a gradient still on a device is refused in one line, a failed call
leaves the sums as they were. The planning side (what is summed where, priced): at the end."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re

import pytest
import torch

from rpcompile.planner.plan_options import PlanOptions
import rpcompile
from rpcompile.core.errors import ConfigError
from rpcompile.passes.solver.segment_rules import validate_segment_plan
from rpcompile.passes.solver.stay_search import choose_sums, without_stays
from rpcompile.passes.solver.timing import iteration_time, no_sync_time, stage_costs
from rpcompile.planner import planning
from rpcompile.runtime import stage_call
from rpcompile.runtime.failures import PipelineError

from _devices import StridedDevice
from _hf import VOCAB, hf_model, token_loss
from test_runtime import FINE_CPU

pytestmark = pytest.mark.hf

ROWS = (6, 4, 5, 6, 3, 5)  # two accumulation cycles of three calls


def padded(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, 8), generator=g)
    labels = ids.clone()
    labels[:, 8 - seed % 3 - 1:] = -100  # the padded tail
    return ids, labels


def compiled(**kw):
    """A tiny HF Llama compiled on two :class:`StridedDevice` s, and its weights as built; every batch shape of
    :data:`ROWS` run once (the first call at a new microbatch shape captures its saved segments, whose replays
    may round differently from the capture run: comparisons are between replays)."""
    torch.manual_seed(0)
    model = hf_model("llama")
    pipe = rpcompile.compile(model, (padded(0, 6)[0],), loss_fn=token_loss, devices=[StridedDevice(0), StridedDevice(1)],
                             microbatches=2, host_embedding=False, time_limit_s=2.0, **kw)
    initial = copy.deepcopy(model.state_dict())
    for rows in sorted(set(ROWS)):
        call(pipe, 0, rows)
    restart(model, initial)
    return model, pipe, initial


def call(pipe, seed: int, rows: int, **kw) -> torch.Tensor:
    x, y = padded(seed, rows)
    return pipe.forward_backward(x, target=y, **kw)


def restart(model, initial) -> None:
    """The model's weights back to ``initial`` and no gradients: the same pipeline trains it again from there
    (comparisons run on one pipeline: two compiled pipelines need not add a stage's gradients in one order)."""
    model.load_state_dict(initial)
    model.zero_grad()


def summed(pipe) -> set[str]:
    return {p for s in pipe.plan.stages for p in s.accumulates}


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def train(model, pipe, *, defer: bool) -> tuple[list, list, list]:
    """Two cycles of three padded batches (the mean over all of a cycle's tokens: ``num_items``), the first two
    calls of each under ``no_sync`` when ``defer``, AdamW through ``pipe.step``: per cycle the gradients and the
    weights after the step, per call the gradient bytes the host added."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out_grads, out_weights, traffic = [], [], []
    for cycle in range(2):
        batches = [padded(seed, rows) for seed, rows in enumerate(ROWS[3 * cycle:3 * cycle + 3], 3 * cycle)]
        n = sum(int((y != -100).sum()) for _, y in batches)
        for i, (x, y) in enumerate(batches):
            pipe.executor.traffic.reset()
            with pipe.no_sync() if defer and i < 2 else contextlib.nullcontext():
                pipe.forward_backward(x, target=y, num_items=n)
            traffic.append(pipe.host_traffic.get("gradients", 0))
        out_grads.append(grads(model))
        pipe.step(opt)
        out_weights.append(weights(model))
    return out_grads, out_weights, traffic


def test_accumulation_under_no_sync_equals_accumulation_without_it():
    """Every gradient and the weights after each step equal the same pipeline's without ``no_sync`` bitwise (the
    sums add in the order ``.grad`` would) and eager's within float tolerance; the host added none of the summed
    gradients in a deferred call, and the stages kept exactly those bytes on their devices."""
    model, pipe, initial = compiled()
    assert len(summed(pipe)) >= 10 and pipe.plan.predicted.no_sync_s > 0  # the planner sums where memory allows
    deferred = train(model, pipe, defer=True)
    assert pipe.executor.sums.kept == 2 * 2 * sum(p.numel() * 4 for n, p in model.named_parameters()
                                                  if n in summed(pipe))  # two deferred calls a cycle, two cycles
    restart(model, initial)
    plain = train(model, pipe, defer=False)
    for mine, theirs in zip(deferred[0] + deferred[1], plain[0] + plain[1]):
        assert_same(mine, theirs)
    for k in (0, 1, 3, 4):  # the deferred calls
        assert deferred[2][k] < plain[2][k], (deferred[2], plain[2])
    eager = hf_model("llama")
    eager.load_state_dict(initial)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for cycle in range(2):
        batches = [padded(seed, rows) for seed, rows in enumerate(ROWS[3 * cycle:3 * cycle + 3], 3 * cycle)]
        n = sum(int((y != -100).sum()) for _, y in batches)
        for x, y in batches:
            out = eager(x).logits.flatten(0, 1)
            (torch.nn.functional.cross_entropy(out, y.flatten(), reduction="sum") / n).backward()
        for name, p in eager.named_parameters():
            g = deferred[0][cycle][name]
            assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item()), name
        opt.step(), opt.zero_grad()
    for name, p in eager.named_parameters():
        assert torch.allclose(deferred[1][1][name], p, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_drops_what_the_devices_summed(set_to_none):
    """``optimizer.zero_grad()`` after calls under ``no_sync`` drops their gradients — those on the devices too —
    as it drops ``.grad``: the next call's gradients are its own."""
    model, pipe, initial = compiled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pipe.no_sync():
        call(pipe, 1, 6)
        call(pipe, 2, 4)
    opt.zero_grad(set_to_none=set_to_none)
    call(pipe, 3, 5)
    mine = grads(model)
    restart(model, initial)
    call(pipe, 3, 5)
    assert_same(mine, grads(model))


def test_a_step_over_gradients_still_on_the_devices_is_refused_in_one_line():
    """``optimizer.step()`` right after calls under ``no_sync`` would step on partial gradients: refused, naming
    the fix; ``pipe.sync_gradients()`` sends the sums home (then ``.grad`` is whole, e.g. to clip it), and
    ``pipe.step`` does so itself."""
    model, pipe, initial = compiled()

    def run(defer: bool) -> list[dict[str, torch.Tensor]]:
        restart(model, initial)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with pipe.no_sync() if defer else contextlib.nullcontext():
            call(pipe, 1, 6)
            call(pipe, 2, 4)
        if defer:
            with pytest.raises(ConfigError, match=re.escape(
                    f"optimizer.step() over {len(summed(pipe))} parameter(s) whose gradients are still summed on the "
                    "devices by calls under pipe.no_sync(): make the last accumulation call outside no_sync() (or "
                    "call pipe.sync_gradients()) before the step, or step with pipe.step(optimizer)")):
                opt.step()
            pipe.sync_gradients()
        out = [grads(model)]
        opt.step(), opt.zero_grad()
        with pipe.no_sync() if defer else contextlib.nullcontext():
            call(pipe, 3, 5)
        pipe.step(opt)  # sends them home first
        return out + [weights(model)]

    for mine, theirs in zip(run(True), run(False)):
        assert_same(mine, theirs)


def test_a_failed_call_under_no_sync_leaves_the_sums_as_they_were(monkeypatch):
    """A call that fails after some stages kept their gradients (here the last grad stage fails, the fused one's
    gradients already kept) adds nothing to the sums: the cycle redone from there equals one that never failed."""
    model, pipe, initial = compiled()
    real, fail = stage_call.download_grads, {"on": False}

    def download_grads(device, prog, state, sink, sums=None):
        if fail["on"] and prog.index == len(pipe.plan.stages) - 1:
            raise RuntimeError("injected")
        return real(device, prog, state, sink, sums)

    monkeypatch.setattr(stage_call, "download_grads", download_grads)
    with pipe.no_sync():
        call(pipe, 1, 6)
        fail["on"] = True
        with pytest.raises(PipelineError, match="injected"):
            call(pipe, 2, 4)
        fail["on"] = False
        call(pipe, 2, 4)
    call(pipe, 3, 5)
    mine = grads(model)
    restart(model, initial)
    for seed, rows in ((1, 6), (2, 4), (3, 5)):
        call(pipe, seed, rows)
    assert_same(mine, grads(model))


def test_no_sync_beside_an_overlapped_step_is_refused_and_without_sums_it_changes_nothing():
    model, pipe, initial = compiled()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    call(pipe, 1, 6)
    pipe.step(opt, overlap=True)
    with pytest.raises(ConfigError, match=re.escape(
            "pipe.no_sync() does not run beside an overlapped step: call pipe.synchronize() and step with "
            "overlap=False while accumulating, or accumulate outside no_sync()")), pipe.no_sync():
        call(pipe, 2, 4)
    pipe.synchronize()
    # a plan that sums nothing on the devices (allow_stay=False): calls under no_sync are ordinary calls
    model, pipe, initial = compiled(allow_stay=False)
    assert not summed(pipe)
    with pipe.no_sync():
        call(pipe, 1, 6)
    mine = grads(model)
    restart(model, initial)
    call(pipe, 1, 6)
    assert_same(mine, grads(model))
    assert pipe.executor.sums.kept == 0


def test_the_planner_sums_where_memory_allows_and_prices_it():
    """On the solved cuts of a tight device, the sums chosen fit (their memory is in every stage's figure on the
    device) and leave a call outside ``no_sync`` no slower; a call under it is predicted faster (its summed
    gradients stay); on a roomy device every grad stage sums."""
    model = hf_model("llama")
    c = planning.compile_plan(model, (padded(0, 6)[0],), PlanOptions(gpus=2, spec=FINE_CPU, host_embedding=False,
                              time_limit_s=2.0, head_chunks=1, memory_limit=200_000), loss_fn=token_loss)
    base = without_stays(c.result.plan)
    for memory in (200_000, 10**9):
        pb = dataclasses.replace(c.problem, memory_bytes=memory)
        sp = choose_sums(pb, base)
        assert not validate_segment_plan(pb, sp)
        assert iteration_time(pb, sp) <= iteration_time(pb, base) * (1 + 1e-12)
        costs, plain = stage_costs(pb, sp), stage_costs(pb, base)
        ratio = pb.host.reduce_bytes_per_grad_byte
        for k, (cost, was) in enumerate(zip(costs, plain)):
            mine = [j for j in range(len(costs)) if j % pb.device_count == k % pb.device_count]
            sums = [sum(pb.grad_bytes[i] for i in range(costs[j].start, costs[j].stop) if sp.accumulates
                        and sp.accumulates[i]) if costs[j].kind != "forward" else 0 for j in mine]
            expect = sum(s * ratio for s in sums) + sum(s for j, s in zip(mine, sums) if j < k)
            assert cost.sum_bytes == expect and cost.memory_bytes == was.memory_bytes + expect
        if memory == 10**9:
            assert sp.accumulates and all(sp.accumulates[i] for i in range(pb.n) if pb.grad_bytes[i])
            assert no_sync_time(pb, sp) < iteration_time(pb, base)
