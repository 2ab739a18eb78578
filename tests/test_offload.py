"""Transfers behind the compute in the runtime: saved activations go down lazily (needed-first, within a budget),
hand-offs asynchronously, and the next stage's weights go up while the current stage runs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rpcompile.runtime.offload import Offloader


def _gated_copy(log: list, gate: threading.Event):
    def copy(tensors, ready):
        gate.wait(10)
        log.append(int(tensors[0][0]))
        return [t.clone() for t in tensors]
    return copy


def test_the_saves_needed_first_go_down_first():
    """While the first copy is held, three more are queued: the latest stage's (priority −2) go first, its
    microbatches in order, then the earlier stage's."""
    log, gate = [], threading.Event()
    off = Offloader(_gated_copy(log, gate), budget_bytes=10**6)
    first = off.submit([torch.tensor([0.0])], priority=(-1, 0))
    time.sleep(0.05)  # the offloader holds the first one in its copy
    landings = [off.submit([torch.tensor([float(v)])], priority=p)
                for v, p in ((1, (-1, 1)), (2, (-2, 0)), (3, (-2, 1)))]
    gate.set()
    assert [int(x.wait(10)[0][0]) for x in (first, *landings)] == [0, 1, 2, 3]
    assert log == [0, 2, 3, 1]
    off.drain()
    assert off.pending_bytes == 0
    off.close()


def test_the_backlog_stays_within_its_budget():
    """Budget 100 bytes, 64 bytes per submission: the second waits until the first has gone down."""
    log, gate = [], threading.Event()
    off = Offloader(_gated_copy(log, gate), budget_bytes=100)
    off.submit([torch.zeros(16)], priority=0)
    returned = threading.Event()
    threading.Thread(target=lambda: (off.submit([torch.ones(16)], priority=1), returned.set()), daemon=True).start()
    assert not returned.wait(0.2)  # blocked: 128 bytes would exceed the budget
    gate.set()
    assert returned.wait(10)
    off.drain()
    assert off.peak_pending_bytes == 64 and log == [0, 1]
    off.close()


def test_hand_offs_are_double_buffered():
    """``max_pending=2``: two hand-offs may be in flight, the third waits until the first has landed."""
    log, gate = [], threading.Event()
    off = Offloader(_gated_copy(log, gate), max_pending=2, what="a hand-off")
    off.submit([torch.zeros(1)], priority=1)
    off.submit([torch.ones(1)], priority=2)
    returned = threading.Event()
    threading.Thread(target=lambda: (off.submit([torch.full((1,), 2.0)], priority=3), returned.set()),
                     daemon=True).start()
    assert not returned.wait(0.2)
    gate.set()
    assert returned.wait(10)
    off.drain()
    assert log == [0, 1, 2] and off.pending == 0
    off.close()


def test_a_failed_copy_is_an_error_for_every_waiter_not_a_hang():
    def broken(tensors, ready):
        raise OSError("pinned memory exhausted")

    off = Offloader(broken, budget_bytes=10**6)
    landing = off.submit([torch.zeros(4)], priority=0)
    with pytest.raises(RuntimeError, match="copying saved activations to host memory failed: pinned memory exhausted"):
        landing.wait(10)
    with pytest.raises(RuntimeError, match="copying saved activations to host memory failed: pinned memory exhausted"):
        off.submit([torch.zeros(4)], priority=0)
    with pytest.raises(ValueError, match="budget_bytes=-1 must be >= 0"):
        Offloader(broken, budget_bytes=-1)
    with pytest.raises(ValueError, match="max_pending=0 must be >= 1"):
        Offloader(broken, max_pending=0)


def test_a_pipeline_with_lazy_offload_matches_eager():
    """Logical CPU devices whose saved activations go down through slow offloaders (2 ms per copy, a budget of
    one copy): the backward stages wait for their saves, and loss and every gradient still equal eager's."""
    from test_runtime import TOL, _saving_pipeline, assert_grads_equal, eager_step

    spec, ref, pipe, x, y = _saving_pipeline("llama-demo", 1)

    def slow(tensors, ready):
        time.sleep(0.002)
        return [t.clone() for t in tensors]

    for device in pipe.devices:
        device.enable_offload(budget_bytes=1, copy=slow)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = eager_step(ref, spec.loss_fn, x, y, pipe.microbatches)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_equal(spec.model, ref)
    assert all(d.offloader.pending_bytes == 0 and d.offloader.peak_pending_bytes > 0 for d in pipe.devices
               if any(s.kind == "forward" and s.saved for k, s in enumerate(pipe.plan.stages)
                      if k % len(pipe.devices) == d.index))


def test_a_pipeline_with_asynchronous_hand_offs_matches_eager():
    """Hand-offs (outputs, input gradients) and saved activations both go down through slow offloaders, at most
    two hand-offs in flight per device: the next stage waits on their landing, the gradients of a value used by
    several stages are summed in the order they were added, and loss and gradients equal eager's."""
    from test_runtime import TOL, _saving_pipeline, assert_grads_equal, eager_step

    spec, ref, pipe, x, y = _saving_pipeline("llama-demo", 0)

    def slow(tensors, ready):
        time.sleep(0.001)
        return [t.clone() for t in tensors]

    for device in pipe.devices:
        device.enable_offload(budget_bytes=10**9, copy=slow)
        device.enable_async_handoff(max_pending=2, copy=slow)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = eager_step(ref, spec.loss_fn, x, y, pipe.microbatches)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_equal(spec.model, ref)
    assert all(d.handoffs.pending == 0 and d.handoffs.peak_pending_bytes > 0 for d in pipe.devices)


def test_a_failed_hand_off_fails_the_step_with_the_reason():
    from test_runtime import _saving_pipeline

    from rpcompile.runtime.failures import PipelineError

    spec, _, pipe, x, y = _saving_pipeline("llama-demo", 0)

    def broken(tensors, ready):
        raise OSError("PCIe link down")

    pipe.devices[0].enable_async_handoff(copy=broken)
    with pytest.raises(PipelineError, match="copying a hand-off to host memory failed: PCIe link down"):
        pipe.forward_backward(x, target=y)


def test_the_pipeline_budget_is_what_the_stages_leave_free():
    """A device's backlog may fill the memory its largest stage leaves free (none when a stage needs it all)."""
    import dataclasses

    from test_runtime import _saving_pipeline

    from rpcompile.training.gpu_memory import offload_budget

    plan = _saving_pipeline("llama-demo", 1)[2].plan
    assert len(plan.stages) == 5  # F0 F1 FB B1 B2: device 0 runs 0, 2, 4 and device 1 runs 1, 3
    plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, memory_bytes=1000),
                               stages=tuple(dataclasses.replace(s, memory_bytes=v)
                                            for s, v in zip(plan.stages, (100, 300, 200, 50, 400))))
    assert [offload_budget(plan, d, 2) for d in (0, 1)] == [600, 700]
    assert offload_budget(plan, 0, 1) == 600  # one device runs all five
    big = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], memory_bytes=1200), *plan.stages[1:]))
    assert offload_budget(big, 0, 2) == 0


def _slow_weights(device, seconds: float, alive: list):
    """Wrap a device's weight upload: it takes ``seconds`` and records how many earlier uploads of the device are
    still alive (weak references) when a new one starts."""
    import weakref

    upload = device.upload_weights
    held: list = []

    def slow(tensors, dtype=None):
        alive.append(sum(1 for refs in held if any(r() is not None for r in refs)))
        time.sleep(seconds)
        copies, ready = upload(tensors, dtype)
        copies = [t.clone() for t in copies]  # device copies of their own, as on a GPU (a CPU one shares the master)
        held.append([weakref.ref(t) for t in copies])
        return copies, ready

    device.upload_weights = slow


@pytest.mark.parametrize("k", [1, 2])
def test_the_next_stage_s_weights_go_up_while_the_current_stage_runs(k):
    """Weight uploads of 30 ms on one and two logical CPU devices: each device's next stage's weights go up on its
    prefetch thread during the stage before (the W event overlaps that stage's compute), at most one earlier
    stage's weights are still on the device when the next ones go up (a forward stage's are dropped after its
    last microbatch), and loss and every gradient still equal eager's."""
    from test_runtime import TOL, _saving_pipeline, assert_grads_equal, eager_step

    spec, ref, pipe, x, y = _saving_pipeline("llama-demo", 0, k=k)  # F0 F1 FB B1 B2: one device runs F0, F1 and FB
    alive: list[int] = []
    for device in pipe.devices:
        _slow_weights(device, 0.03, alive)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = eager_step(ref, spec.loss_fn, x, y, pipe.microbatches)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_equal(spec.model, ref)
    assert max(alive) <= 1, alive
    events = {e.action: e for e in pipe.timeline}
    overlapped = 0
    for acts in pipe.schedule:
        stages = [a.stage for a in acts if a.kind == "W"]
        for prev, nxt in zip(stages, stages[1:]):
            w, last = events[f"{nxt}W"], events[f"{prev}F{pipe.microbatches - 1}"]
            assert w.start >= events[f"{prev}F0"].start and w.end <= events[f"{nxt}F0"].start
            overlapped += w.start < last.end  # went up while the stage before still computed
    assert overlapped >= 1


def test_a_failed_weight_upload_fails_the_step_with_the_stage():
    from test_runtime import _saving_pipeline

    from rpcompile.runtime.failures import PipelineError

    spec, _, pipe, x, y = _saving_pipeline("llama-demo", 0)
    calls = []

    def broken(tensors, dtype=None):
        calls.append(1)
        if len(calls) > 1:  # the device's first stage uploads on the worker; the next one is prefetched
            raise OSError("out of pinned memory")
        return [t for t in tensors], None

    pipe.devices[0].upload_weights = broken
    second = [a for a in pipe.schedule[0] if a.kind == "W"][1]
    with pytest.raises(PipelineError, match=rf"stage {pipe.plan.stages[second.stage].name} \({second}\) failed on "
                                            r"device 0 \(cpu\): OSError: out of pinned memory"):
        pipe.forward_backward(x, target=y)


def test_a_stage_starts_only_once_the_saves_before_it_are_within_the_budget(monkeypatch):
    """One device runs every stage; its saves go down slowly (20 ms a copy) with no room beside the stages (a
    budget of one byte). A forward stage may keep its previous microbatch's saves beside it (the planner counts
    them), but the next stage starts only once they are down: its planned memory has no room for them (on an
    H100 an 8B LM-head stage ran 3.3 GiB past its plan beside the previous stage's saves). Loss and gradients are
    eager's."""
    from test_runtime import TOL, _saving_pipeline, assert_grads_equal, eager_step

    from rpcompile.runtime import executor

    spec, ref, pipe, x, y = _saving_pipeline("llama-demo", 1, k=1)

    def slow(tensors, ready):
        time.sleep(0.02)
        return [t.clone() for t in tensors]

    device, = pipe.devices
    device.enable_offload(budget_bytes=1, copy=slow)
    at_start = []
    compute = executor.Executor._compute

    def spy(self, dev, prog, state, mb):
        if mb == 0:
            at_start.append((prog.name, dev.offloader.pending_bytes))
        return compute(self, dev, prog, state, mb)

    monkeypatch.setattr(executor.Executor, "_compute", spy)
    loss = pipe.forward_backward(x, target=y)
    torch.testing.assert_close(loss, eager_step(ref, spec.loss_fn, x, y, pipe.microbatches), **TOL)
    assert_grads_equal(spec.model, ref)
    assert [name for name, _ in at_start] == [s.name for s in pipe.plan.stages]
    assert device.offloader.peak_pending_bytes > 1  # a forward stage did keep saves beside it
    assert all(pending <= 1 for _, pending in at_start), at_start
