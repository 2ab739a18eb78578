"""Overlapped iterations (issue 35 item 4): a pipeline compiled with ``overlap=True`` and stepped with
``pipe.step(optimizer, overlap=True)`` returns each ``forward_backward`` once its loss is known, and each device
goes on into the next iteration while the last stages of the one before drain — under exactly the one-step-stale
semantics of the overlapped step: bit for bit delayed-gradient training (``tests/test_weights.py`` checks the
plain loop of it for both modes)."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

import rpcompile
from rpcompile.runtime import rng, stage_call
from rpcompile.runtime.failures import PipelineError
from rpcompile.training.checkpoint.layout import checkpoints

from _resume import build, train
from test_interrupts import _child, _lines
from test_weights import assert_same_losses, assert_same_weights, batch, pair, stale_reference


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def test_the_iterations_of_one_step_accumulate_at_the_same_stale_weights():
    """Two calls per step (``loss_scale=0.5``): both compute with the weights from before the step in flight —
    delayed-gradient training with accumulation, bit for bit — their gradients added apart from ``.grad`` and put
    there by the step. (The overlapped step alone, without overlapped iterations, collects the step at the end of
    the first call, so its second call already sees the new weights.)"""
    a, pa, b, pb = pair("bf16", overlap=True)
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    got, want = [], []
    previous = {k: v.clone() for k, v in b.state_dict().items()}
    for step in range(4):
        batches = [batch(10 * step + half) for half in range(2)]
        got += [pa.forward_backward(x, target=y, loss_scale=0.5) for x, y in batches]
        pa.step(oa, overlap=True)
        current = {k: v.clone() for k, v in b.state_dict().items()}
        b.load_state_dict(previous)  # the reference takes both calls' gradients at the previous weights
        want += [pb.forward_backward(x, target=y, loss_scale=0.5) for x, y in batches]
        b.load_state_dict(current)
        ob.step(), ob.zero_grad()
        previous = current
    pa.synchronize()
    assert_same_losses(got, want)
    assert_same_weights(a, b)


@pytest.mark.parametrize("where", ["first", "after step"])
def test_zero_grad_of_the_model_in_the_loop_clears_what_no_optimizer_steps(where):
    """The optimizer steps the blocks only; ``model.zero_grad()`` in the loop — recorded while the steps are in
    flight, run when ``pipe.step`` collects the step before — clears the other parameters' gradients before the
    next iteration's land: the one-step-stale reference with ``zero_grad()`` before each iteration, bit for bit."""
    a, pa, b, pb = pair("fp32", overlap=True)
    oa = torch.optim.AdamW(a.blocks.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.blocks.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        x, y = batch(step)
        if where == "first":
            a.zero_grad()
        losses.append(pa.forward_backward(x, target=y))
        pa.step(oa, overlap=True)
        if where == "after step":
            a.zero_grad()
    pa.synchronize()
    assert_same_losses(losses, stale_reference(b, pb, [ob], 4, zero_grad=b.zero_grad))
    assert_same_weights(a, b)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if not name.startswith("blocks."):  # the last iteration's gradients alone, not a sum; none when the
            # loop cleared them after its last step
            assert torch.equal(p.grad, q.grad) if where == "first" else p.grad is None, name
    assert "zero_grad" not in vars(oa) and "zero_grad" not in vars(a)


def test_without_overlapped_steps_the_pipeline_is_synchronous():
    """A plan made for overlapped iterations, stepped synchronously: every call returns with all its gradients in
    ``.grad`` and the stages on the plan's devices, equal to the plain loop bit for bit."""
    a, pa, b, pb = pair("fp32", overlap=True)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    for step in range(3):
        x, y = batch(step)
        assert torch.equal(pa.forward_backward(x, target=y), pb.forward_backward(x, target=y))
        assert pa._overlap.running == []
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad)
        pa.step(oa)
        ob.step(), ob.zero_grad()
    assert_same_weights(a, b)


def test_a_device_goes_on_into_the_next_iteration_while_the_last_stages_drain(monkeypatch):
    """The last backward stage's gradients held on their way home: ``forward_backward`` still returns the loss,
    and the next iteration's first stage — on the other device, the pointer carried on — runs all its
    microbatches while that stage of the iteration before has not finished."""
    a, pa, b, pb = pair("fp32", overlap=True)
    kinds = [s.kind for s in pa.plan.stages]
    last = len(kinds) - 1
    assert kinds[last] == "backward" and len(pa.devices) == 2 and len(kinds) % 2 == 1
    gate, held = threading.Event(), threading.Event()
    real = stage_call.download_grads

    def download_grads(device, prog, state, sink, *rest):
        if prog.index == last and held.is_set():
            assert gate.wait(timeout=60), "the test never opened the gate"
        return real(device, prog, state, sink, *rest)

    monkeypatch.setattr(stage_call, "download_grads", download_grads)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    x, y = batch(0)
    pa.forward_backward(x, target=y)
    pa.step(oa, overlap=True)
    held.set()
    first = pa.forward_backward(*batch(1)[:1], target=batch(1)[1])  # returns although its last stage is held
    assert torch.isfinite(first)
    draining = pa._overlap.last
    assert draining is not None and not draining.settled.is_set()
    pa.step(oa, overlap=True)  # the step waits for the drain on its own thread
    result = {}
    x, y = batch(2)
    caller = threading.Thread(target=lambda: result.setdefault("loss", pa.forward_backward(x, target=y)))
    caller.start()
    try:
        _wait_for(lambda: pa._overlap.last is not draining, "the next iteration to start")
        nxt = pa._overlap.last
        m = nxt.call.microbatches
        _wait_for(lambda: nxt.call.done[(0, m - 1)].is_set(), "the next iteration's first stage")
        assert not draining.settled.is_set()  # its last stage is still held: the devices did not wait for it
    finally:
        gate.set()
        caller.join(timeout=60)
    assert "loss" in result
    pa.synchronize()


def test_a_failure_while_draining_surfaces_at_the_next_call_naming_its_iteration(monkeypatch):
    """The last stage fails after ``forward_backward`` returned: the next call raises one line naming the
    iteration; the step waiting for it is not taken, the overlap ends, and training goes on synchronously."""
    a, pa, b, pb = pair("fp32", overlap=True)
    last = len(pa.plan.stages) - 1
    real = stage_call.download_grads

    def download_grads(device, prog, state, sink, *rest):
        if prog.index == last and rng.context.iteration == 2:  # (the worker's: set by the stage's compute)
            raise RuntimeError("link lost")
        return real(device, prog, state, sink, *rest)

    monkeypatch.setattr(stage_call, "download_grads", download_grads)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    pa.forward_backward(*batch(0)[:1], target=batch(0)[1])
    pa.step(oa, overlap=True)
    pa.forward_backward(*batch(1)[:1], target=batch(1)[1])
    pa.step(oa, overlap=True)
    assert torch.isfinite(pa.forward_backward(*batch(2)[:1], target=batch(2)[1]))  # iteration 2's loss
    pa._overlap.last.settled.wait(timeout=60)  # the next call after the failure (not one racing with it)
    with pytest.raises(PipelineError, match=r"^iteration 2 failed after forward_backward returned its loss "
                                            r"\(overlapped iterations: its last stages were draining\): stage "
                                            r".* failed on device \d \(cpu\): RuntimeError: link lost$"):
        pa.step(oa, overlap=True)
    assert pa._overlap.optimizers == [] and pa._overlap.running == []
    assert pa._overlap.future is None and "zero_grad" not in vars(oa)
    x, y = batch(3)  # synchronous again: equal to a pipeline on the same weights
    b.load_state_dict(a.state_dict())
    a.zero_grad(), b.zero_grad()
    assert torch.equal(pa.forward_backward(x, target=y), pb.forward_backward(x, target=y))


def test_overlapped_iterations_refuse_data_parallel_in_one_line():
    a, pa, _, _ = pair("fp32", overlap=True)
    pa._rank = object()  # what join() sets for a data-parallel rank
    with pytest.raises(rpcompile.ConfigError, match=r"^overlapped iterations do not run data-parallel: compile "
                                                    r"without overlap=True \(the step alone then overlaps the next "
                                                    r"iteration\)$"):
        pa.step(torch.optim.SGD(a.parameters(), lr=0.1), overlap=True)


CTRL_C = """
    import copy, os, random, signal, threading, time
    import torch, torch.nn as nn, torch.nn.functional as F
    import rpcompile
    from test_runtime import FINE_CPU

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.c(self.b(self.a(x).relu()).relu())

    torch.manual_seed(0)
    model = MLP()
    pipe = rpcompile.compile(model, (torch.randn(6, 8),), loss_fn=F.mse_loss, devices=["cpu", "cpu"],
                             microbatches=3, spec=FINE_CPU, time_limit_s=1.0, head_chunks=1, overlap=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rng = random.Random(0)
    for trial in range(8):
        timer = threading.Timer(rng.uniform(0.0, 0.05), os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            while True:
                pipe.forward_backward(x, target=y)
                pipe.step(opt, overlap=True)
        except KeyboardInterrupt:
            pass
        timer.join()
        pipe.synchronize()  # drained, stepped, back to synchronous
        alive = [t.name for t in threading.enumerate() if t.name.startswith(("rpcompile-iteration", "rpcompile-dev"))]
        fresh = copy.deepcopy(model)
        other = rpcompile.compile(fresh, (x,), loss_fn=F.mse_loss, devices=["cpu", "cpu"], plan=pipe.plan)
        model.zero_grad(), fresh.zero_grad()
        same = torch.equal(pipe.forward_backward(x, target=y), other.forward_backward(x, target=y)) and all(
            torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), fresh.parameters()))
        print("trial", trial, pipe.iteration, "consistent" if same and not alive else f"BROKEN {alive}", flush=True)
"""


def test_ctrl_c_during_overlapped_iterations_leaves_nothing_running_and_nothing_half_done():
    """Ctrl-C at random points of an overlapped-iterations loop (in a child process): a ``KeyboardInterrupt``
    each time; after ``synchronize()`` no iteration's thread is left and the pipeline computes what a fresh one
    over the same weights does (its copies are the masters)."""
    out = _child(CTRL_C)
    lines = _lines(out)
    assert out.returncode == 0, (lines, out.stderr[-3000:])
    results = [line.split() for line in lines if line.startswith("trial ")]
    assert len(results) == 8 and all(r[3] == "consistent" for r in results), lines
    assert int(results[-1][2]) > 8, lines  # it trained between the Ctrl-Cs


def test_resume_from_a_checkpoint_saved_between_overlapped_iterations_is_exact(tmp_path):
    """A checkpoint after every ``pipe.step(optimizer, overlap=True)`` of overlapped iterations (saving waits for
    the step, which waits for the drain): a fresh pipeline loaded from step 3's continues to the uninterrupted
    run's weights bit for bit — the next iteration one step stale, as it would have been."""

    def run(start: int, stop: int, ckpt=None, load=False):
        model, pipe, opt = build()
        pipe.overlap_iterations = True
        if load:
            resumed = rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
            assert resumed is not None and resumed.step == start and pipe.state_dict()["stale_weights"]
        train(model, pipe, opt, start, stop, overlap=True, ckpt=ckpt, keep=10)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    want = run(0, 6)
    assert all(torch.equal(v, want[k]) for k, v in run(0, 6, ckpt=tmp_path).items())  # saving changed nothing
    for s, path in checkpoints(tmp_path):  # as a run killed after saving step 3 left the directory
        if s > 3:
            shutil.rmtree(path)
    got = run(3, 6, load=True)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.hf
def test_an_hf_llama_over_padded_batches_of_other_sizes_trains_one_step_stale():
    """What users run: an HF Llama from a config, compiled for overlapped iterations, trained over padded batches
    of 6, 4 and 5 rows (labels -100 on the padding) with AdamW — equal to delayed-gradient training on the same
    plan run synchronously (losses and weights)."""
    from _hf import VOCAB, hf_model, token_loss

    def padded(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (rows, 8), generator=g)
        labels = ids.clone()
        labels[:, 8 - seed % 3 - 1:] = -100  # the padded tail
        return ids, labels

    torch.manual_seed(0)
    model = hf_model("llama")
    ref = hf_model("llama")
    ref.load_state_dict(model.state_dict())
    pipe = rpcompile.compile(model, (padded(0, 6)[0],), loss_fn=token_loss, devices=["cpu", "cpu"], microbatches=2,
                             host_embedding=False, time_limit_s=2.0, overlap=True)
    ref_pipe = rpcompile.compile(ref, (padded(0, 6)[0],), loss_fn=token_loss, devices=["cpu", "cpu"],
                                 plan=pipe.plan, host_embedding=False)
    ref_pipe.overlap_iterations = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    previous = {k: v.clone() for k, v in ref.state_dict().items()}
    for seed, rows in enumerate((6, 4, 5, 6)):
        x, y = padded(seed, rows)
        loss = pipe.forward_backward(x, target=y)
        pipe.step(opt, overlap=True)
        current = {k: v.clone() for k, v in ref.state_dict().items()}
        ref.load_state_dict(previous)
        assert torch.equal(loss, ref_pipe.forward_backward(x, target=y)), seed
        ref.load_state_dict(current)
        ref_opt.step(), ref_opt.zero_grad()
        previous = current
    pipe.synchronize()
    assert_same_weights(model, ref)
