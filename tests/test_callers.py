"""One caller at a time, and nobody beside an overlapped step in flight (rpcompile/training/callers.py, rpcompile/training/overlap.py;
issue 36).

A pipeline refuses a call from a second thread while a call from another thread runs — in one line, at once,
changing nothing — and the running call goes on to eager's result; calls from several threads one after the other
are fine. While an overlapped optimizer step runs on its thread, whatever reads or writes what it writes waits for
it: ``model.load_state_dict`` (the loaded weights are the ones kept and trained on), ``model.state_dict`` and the
optimizer's (what ``save_checkpoint`` writes), and another pipeline's runs over the same model. Every wait is
bounded: threads are joined with a timeout and asserted to have ended, so a regression fails instead of hanging.
"""

from __future__ import annotations

import copy
import io
import threading
import time
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import rpcompile
from rpcompile.core.errors import ConcurrentCallError
from test_bad_inputs import MLP
from test_runtime import FINE_CPU, TOL, assert_grads_equal

X, Y = torch.randn(6, 8), torch.randn(6, 4)
LR = 0.1


class SlowSGD(torch.optim.Optimizer):
    """Plain SGD that takes its time over every parameter (and counts its steps in its state): an overlapped
    step of it is in flight for a while, half done in between."""

    def __init__(self, params: Any, pause: float = 0.05) -> None:
        super().__init__(params, dict(lr=LR))
        self.pause = pause

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    time.sleep(self.pause)
                    p.add_(p.grad, alpha=-group["lr"])
                    self.state[p]["steps"] = self.state[p].get("steps", 0) + 1


def _pipeline(seed: int = 0, **kw: Any) -> rpcompile.Pipeline:
    torch.manual_seed(seed)
    opts = dict(loss_fn=F.mse_loss, devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU, time_limit_s=1.0,
                head_chunks=1)
    return rpcompile.compile(MLP(), (X,), **{**opts, **kw})


def _stepped(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What one SlowSGD step makes of the model's parameters and gradients, computed as it computes them."""
    return {n: p.detach().clone().add_(p.grad, alpha=-LR) for n, p in model.named_parameters()}


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _ended(t: threading.Thread, what: str, timeout: float = 60.0) -> None:
    t.join(timeout)
    assert not t.is_alive(), f"{what} still running after {timeout:g} s"


# ---------------------------------------------------------------------------------------------- one caller at a time
@pytest.mark.parametrize("second", ["forward_backward", "evaluate", "forward", "step", "synchronize",
                                    "state_dict"])
def test_a_second_thread_s_call_is_refused_in_one_line_while_a_call_runs(second: str) -> None:
    """Thread 1 is inside ``forward_backward`` (its loss holds it there); thread 2's call is refused at once with
    one line naming both calls, changes nothing, and thread 1's call still gives eager's loss and gradients. On
    the old code two ``forward_backward`` calls hung, and ``evaluate`` beside training gave wrong losses."""
    inside, go_on = threading.Event(), threading.Event()

    def held(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        inside.set()
        go_on.wait(30)
        return F.mse_loss(out, y)

    pipe = _pipeline(loss_fn=held)
    ref = copy.deepcopy(pipe.model)
    opt = torch.optim.SGD(pipe.model.parameters(), lr=LR)
    calls: dict[str, Callable[[], Any]] = {
        "forward_backward": lambda: pipe.forward_backward(X, target=Y), "evaluate": lambda: pipe.evaluate(X, target=Y),
        "forward": lambda: pipe.forward(X), "step": lambda: pipe.step(opt), "synchronize": pipe.synchronize,
        "state_dict": pipe.state_dict}
    first, got = _in_thread(lambda: pipe.forward_backward(X, target=Y))
    try:
        assert inside.wait(30), "the first call never reached its loss"
        second_thread, refused = _in_thread(calls[second])
        _ended(second_thread, f"the second thread's {second}", timeout=10)
    finally:
        go_on.set()
    _ended(first, "the first thread's forward_backward")
    error = refused.get("error")
    assert isinstance(error, ConcurrentCallError), refused
    message = str(error)
    assert "\n" not in message
    assert message.startswith(f"pipe.{second}() called from thread ") and "while pipe.forward_backward() runs in " \
        "thread " in message and message.endswith("a pipeline runs one call at a time (this one did nothing); make "
                                                  "the calls one after the other — from one thread, or under a lock "
                                                  "of your own"), message
    assert "error" not in got, got
    ref_loss = F.mse_loss(ref(X), Y)
    ref_loss.backward()
    torch.testing.assert_close(got["value"], ref_loss.detach(), **TOL)
    assert_grads_equal(pipe.model, ref)
    assert pipe.iteration == 1


def test_calls_from_several_threads_one_after_the_other_are_fine() -> None:
    """Training in one thread, then evaluation in another, then training again in a third: eager's results."""
    pipe = _pipeline()
    ref = copy.deepcopy(pipe.model)
    for call in (lambda: pipe.forward_backward(X, target=Y), lambda: pipe.evaluate(X, target=Y),
                 lambda: pipe.forward_backward(X, target=Y)):
        t, out = _in_thread(call)
        _ended(t, "a call")
        assert "error" not in out, out
    F.mse_loss(ref(X), Y).backward()
    F.mse_loss(ref(X), Y).backward()
    assert_grads_equal(pipe.model, ref)
    torch.testing.assert_close(out["value"], F.mse_loss(ref(X), Y).detach(), **TOL)


# ---------------------------------------------------------------------------------------------- an overlapped step in flight
def test_load_state_dict_beside_an_overlapped_step_waits_for_it_and_is_what_training_continues_from() -> None:
    """``model.load_state_dict(...)`` right after ``pipe.step(opt, overlap=True)``: the old code let the step in
    flight overwrite the loaded weights. Now the load waits for the step and ends the overlap: the weights are
    exactly the ones loaded, and the next iteration computes with them (eager's gradients on them)."""
    pipe = _pipeline()
    model = pipe.model
    loaded = {k: v + 1.0 for k, v in model.state_dict().items()}
    opt = SlowSGD(model.parameters())
    pipe.forward_backward(X, target=Y)
    pipe.step(opt, overlap=True)
    assert pipe._step is not None and not pipe._step.done()  # in flight
    model.load_state_dict(loaded)
    assert pipe._step is None and pipe._overlap_optimizer is None  # waited for, and the overlap is over
    for name, value in model.state_dict().items():
        assert torch.equal(value, loaded[name]), name
    ref = copy.deepcopy(model)  # the loaded weights
    model.zero_grad(set_to_none=True)
    loss = pipe.forward_backward(X, target=Y)
    ref_loss = F.mse_loss(ref(X), Y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)


def test_state_dicts_beside_an_overlapped_step_are_the_stepped_ones() -> None:
    """``model.state_dict()`` and ``optimizer.state_dict()`` — what ``save_checkpoint`` and ``torch.save`` read —
    wait for the step in flight: every weight stepped exactly once, every parameter's step counted (the old code
    read them half stepped)."""
    pipe = _pipeline()
    opt = SlowSGD(pipe.model.parameters())
    pipe.forward_backward(X, target=Y)
    expect = _stepped(pipe.model)
    pipe.step(opt, overlap=True)
    state = pipe.model.state_dict()
    for name, value in expect.items():
        assert torch.equal(state[name], value), name
    assert [s["steps"] for s in opt.state_dict()["state"].values()] == [1] * len(expect)


def test_a_checkpoint_saved_through_a_second_pipeline_holds_the_stepped_weights(tmp_path) -> None:
    """``save_checkpoint`` with another pipeline over the same model (an evaluation pipeline) while the training
    pipeline's step is in flight: the checkpoint holds the stepped weights and the optimizer's state after it."""
    train = _pipeline()
    other = rpcompile.compile(train.model, (X,), loss_fn=F.mse_loss, devices=["cpu"], plan=None, spec=FINE_CPU,
                              time_limit_s=1.0, head_chunks=1)
    opt = SlowSGD(train.model.parameters())
    train.forward_backward(X, target=Y)
    expect = _stepped(train.model)
    train.step(opt, overlap=True)
    path = rpcompile.save_checkpoint(tmp_path, model=train.model, optimizer=opt, pipeline=other, step=1)
    train.synchronize()
    fresh = MLP()
    fresh_opt = SlowSGD(fresh.parameters())
    resumed = rpcompile.compile(fresh, (X,), loss_fn=F.mse_loss, devices=["cpu"],
                                plan=rpcompile.checkpoint_plan(tmp_path))
    rpcompile.load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, pipeline=resumed)
    assert path.is_dir()
    for name, p in fresh.named_parameters():
        assert torch.equal(p, expect[name]), name
    assert [s["steps"] for s in fresh_opt.state.values()] == [1] * len(expect)


def test_a_second_pipeline_over_the_same_model_never_runs_on_half_stepped_weights() -> None:
    """``evaluate``, ``forward`` and ``forward_backward`` of another pipeline over the same model, right after the
    first pipeline's ``step(overlap=True)``: each waits for the step and computes with the stepped weights (the
    old code evaluated on half-stepped ones)."""
    train = _pipeline()
    other = rpcompile.compile(train.model, (X,), loss_fn=F.mse_loss, devices=["cpu", "cpu"], plan=train.plan)
    opt = SlowSGD(train.model.parameters())
    for run in ("evaluate", "forward", "forward_backward"):
        train.forward_backward(X, target=Y)
        stepped = copy.deepcopy(train.model)
        with torch.no_grad():
            for name, value in _stepped(train.model).items():
                stepped.get_parameter(name).copy_(value)
        stepped.zero_grad(set_to_none=True)
        train.step(opt, overlap=True)
        assert train._step is not None and not train._step.done()
        if run == "evaluate":
            with torch.no_grad():
                torch.testing.assert_close(other.evaluate(X, target=Y), F.mse_loss(stepped(X), Y), **TOL)
        elif run == "forward":
            with torch.no_grad():
                torch.testing.assert_close(other.forward(X), stepped(X), **TOL)
        else:  # (its gradients land in .grad beside the ones the step reads: a toy, not a training loop)
            train.synchronize()
            train.model.zero_grad(set_to_none=True)
            F.mse_loss(stepped(X), Y).backward()
            torch.testing.assert_close(other.forward_backward(X, target=Y), F.mse_loss(stepped(X), Y).detach(),
                                       **TOL)
            assert_grads_equal(train.model, stepped)
        train.synchronize()
        train.model.zero_grad(set_to_none=True)


def test_the_model_still_pickles_and_a_copy_belongs_to_no_pipeline() -> None:
    """The pipeline's hooks on the model pickle (``torch.save(model)``) and deep-copy as hooks that do nothing:
    loading weights into a copy leaves the pipeline's overlap alone."""
    pipe = _pipeline()
    buffer = io.BytesIO()
    torch.save(pipe.model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    opt = torch.optim.SGD(pipe.model.parameters(), lr=LR)
    pipe.forward_backward(X, target=Y)
    pipe.step(opt, overlap=True)
    twin = copy.deepcopy(pipe.model)
    twin.load_state_dict(again.state_dict())
    again.load_state_dict(twin.state_dict())
    assert pipe._overlap_optimizer is not None  # still overlapping: the copies' loads did not synchronize it
    pipe.synchronize()
