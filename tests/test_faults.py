"""Faults (runtime/executor.py, GradSink in runtime/weights.py, runtime/offload.py, rpcompile/training/oom.py): a failure
anywhere in a call reaches the caller in bounded time as one line naming stage, device and microbatch; nothing of
the call is left running; every ``.grad`` is what it was before the call; the next call equals eager. Ctrl-C is
re-raised as ``KeyboardInterrupt``; an out-of-memory error offers the plan that fits. Leaf functions and leaf
modules run at every step in every plan (saved segments never capture them)."""

from __future__ import annotations

import collections
import copy
import faulthandler
import signal
import threading
import time
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from rpcompile.planner.plan_options import PlanOptions
import rpcompile
from rpcompile.runtime import rng
from rpcompile.runtime.failures import PipelineError
from rpcompile.training.oom import StageOutOfMemoryError
from test_runtime import FINE_CPU, TOL

M = 4  # microbatches
FAULT: dict[str, Any] | None = None
"""``{"layer": i, "mb": j, "when": "forward" | "backward", "raise": exception factory}``: where the next call fails."""
CALLS: list[tuple[int, int, bool]] = []
"""``(layer, microbatch, grad enabled)`` per call of :func:`layer`."""


def _trip(i: int, mb: int, when: str) -> None:
    f = FAULT
    if f is not None and (f["layer"], f["mb"], f["when"]) == (i, mb, when):
        raise f["raise"](i)


class _Backward(torch.autograd.Function):
    """Identity whose backward may trip the fault."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, i: int, mb: int) -> torch.Tensor:
        ctx.i, ctx.mb = i, mb
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        _trip(ctx.i, ctx.mb, "backward")
        return g, None, None


@fx.wrap
def layer(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, i: int) -> torch.Tensor:
    """One residual layer, a leaf function (one graph node): records its call and may trip the fault."""
    mb = getattr(rng.context, "microbatch", 0)
    CALLS.append((i, mb, torch.is_grad_enabled()))
    _trip(i, mb, "forward")
    return _Backward.apply(torch.tanh(F.linear(x, w, b)), i, mb) + x


class Layer(nn.Module):
    def __init__(self, d: int, i: int):
        super().__init__()
        self.w, self.b, self.i = nn.Parameter(torch.randn(d, d) / 4), nn.Parameter(torch.randn(d) / 4), i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer(x, self.w, self.b, self.i)


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 12):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d, i) for i in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lay in self.layers:
            x = lay(x)
        return self.head(x)


def _pipeline(devices: Any = None, memory: int = 12 * 2**30) -> tuple[Any, nn.Module, torch.Tensor, torch.Tensor]:
    """Net on 4 logical CPU devices, by a hand-made plan of 8 stages (F0-F3, FB, B1-B3: the backward cuts differ
    from the forward ones) in which every other layer is saved — and, calling a leaf, recomputed. Each stage is
    planned at ``memory`` bytes under a 20 GiB limit (the out-of-memory advice reads them)."""
    from rpcompile.passes.graph.util import compute_nodes
    from rpcompile.passes.lower import plan_from_ranges
    from rpcompile.passes.rewrite.coarsen import coarsen_pass, segments_of
    from rpcompile.planner.planning import prepare
    from rpcompile.planner.plan_options import make_hardware
    from rpcompile.runtime.devices import make_devices
    from rpcompile.compiler import pipeline
    from rpcompile.training.options import TrainOptions

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    gm, m = prepare(model, (x,), PlanOptions(gpus=4, microbatches=M, progress=False, spec=FINE_CPU))
    segs = segments_of(coarsen_pass(gm, max_segments=len(compute_nodes(gm))))
    saved = [n for s in segs[:8] if s.start % 2 == 0 for n in s.nodes]
    plan = plan_from_ranges(gm, forward=[(0, 2), (2, 4), (4, 6), (6, 8)], fused=(8, len(compute_nodes(gm))),
                            backward=[(5, 8), (2, 5), (0, 2)], hardware=make_hardware(4, "rtx4090", 20 * 2**30),
                            microbatches=m, saved=saved, stage_memory=[memory] * 8)
    pipe = pipeline(model, gm, plan, make_devices(devices or ["cpu"] * 4, None), F.cross_entropy,
                    TrainOptions(precision="fp32"))
    assert len(pipe.program.saved) >= 3 and all(s.leaves for s in pipe.program.saved)
    return pipe, ref, x, y


@pytest.fixture
def watchdog() -> Iterator[None]:
    """A hang fails the run (the process exits with every thread's stack) instead of blocking it."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _no_fault() -> Iterator[None]:
    global FAULT
    FAULT = None
    CALLS.clear()
    yield
    FAULT = None


def _arm(i: int, mb: int, when: str, exc: Callable[[int], BaseException] | None = None) -> None:
    global FAULT
    FAULT = {"layer": i, "mb": mb, "when": when,
             "raise": exc or (lambda i: RuntimeError(f"injected fault in layer {i}\nsecond line"))}


def _disarm() -> None:
    global FAULT
    FAULT = None


#: Threads that outlive calls (idle between them): the devices' prefetch pools and offloaders, the step thread.
PERSISTENT = ("rpcompile-prefetch", "rpcompile-offload", "rpcompile-handoff", "rpcompile-step")


def _call_threads() -> list[str]:
    """Threads of a call still alive (workers, host, gradient sink): none may be."""
    return [t.name for t in threading.enumerate() if t.name.startswith("rpcompile") and not t.name.startswith(PERSISTENT)]


def _layer_of(stage: Any) -> int:
    name = next(n for n in stage.nodes if n.startswith("layer"))
    return int(name.partition("_")[2] or 0)


def _eager(ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = F.cross_entropy(ref(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _failing_call(pipe: Any, x: torch.Tensor, y: torch.Tensor, expected: type[BaseException],
                  match: str | None = None) -> BaseException:
    """The call fails with ``expected`` within seconds, nothing of it still running and every ``.grad`` (None,
    or the tensor it was, holding the values it held) as before."""
    before = {n: (p.grad, None if p.grad is None else p.grad.clone()) for n, p in pipe.model.named_parameters()}
    start = time.perf_counter()
    with pytest.raises(expected, match=match) as info:
        pipe.forward_backward(x, target=y)
    assert time.perf_counter() - start < 30
    assert _call_threads() == []
    for n, p in pipe.model.named_parameters():
        obj, values = before[n]
        assert p.grad is obj, f"{n}: .grad replaced"
        if values is not None:
            assert torch.equal(p.grad, values), f"{n}: .grad changed by the failed call"
    return info.value


def _clean_call_matches_eager(pipe: Any, x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor,
                              grads: dict[str, torch.Tensor], what: str) -> None:
    """The next call adds eager's gradients to whatever ``.grad`` held."""
    _disarm()
    held = {n: p.grad.clone() if p.grad is not None else 0 for n, p in pipe.model.named_parameters()}
    got = pipe.forward_backward(x, target=y)
    torch.testing.assert_close(got, loss, **TOL, msg=lambda m: f"{what}: loss: {m}")
    for n, p in pipe.model.named_parameters():
        torch.testing.assert_close(p.grad, held[n] + grads[n], **TOL, msg=lambda m: f"{what}: {n}: {m}")


def test_a_fault_at_every_stage_both_ways_leaves_nothing_behind(watchdog: None) -> None:
    """Every stage of the 4-device plan fails in turn — forward stages forward, backward stages backward, the
    fused stage both — at a different microbatch: the caller gets one line naming stage, device and microbatch
    within seconds, no thread of the call runs on, ``.grad`` is as before (None, or the previous call's
    gradients), and the next call equals eager."""
    pipe, ref, x, y = _pipeline()
    loss, grads = _eager(ref, x, y)
    cases = [(k, s, when) for k, s in enumerate(pipe.plan.stages)
             for when in {"forward": ["forward"], "backward": ["backward"], "fused": ["forward", "backward"]}[s.kind]]
    assert len(cases) == 9 and len({k % 4 for k, _, _ in cases}) == 4
    for n, (k, stage, when) in enumerate(cases):
        if n % 2:
            pipe.model.zero_grad(set_to_none=True)  # the failed call finds no gradients; else the last call's
        i, mb = _layer_of(stage), k % M
        _arm(i, mb, when)
        err = _failing_call(pipe, x, y, PipelineError,
                            rf"^stage {stage.name} \({k}F{mb}\) failed on device {k % 4} \(cpu\) at microbatch "
                            rf"{mb}: RuntimeError: injected fault in layer {i}$")
        assert (err.stage, err.device, err.microbatch) == (stage.name, k % 4, mb)
        assert "second line" in err.details and isinstance(err.__cause__, RuntimeError)
        _clean_call_matches_eager(pipe, x, y, loss, grads, f"after a {when} fault in {stage.name}")


def test_faults_with_copies_in_flight_and_a_failed_copy(watchdog: None) -> None:
    """With saved activations and hand-offs going down on offloader threads (as on a GPU; slowed down), a fault
    leaves no copy in flight; a copy that fails fails its call, and the next call starts clean."""
    pipe, ref, x, y = _pipeline()
    loss, grads = _eager(ref, x, y)
    broken = [False]

    def slow(tensors: Any, ready: Any) -> list[torch.Tensor]:
        time.sleep(0.002)
        if broken[0]:
            broken[0] = False
            raise OSError("PCIe link down")
        return [t.clone() for t in tensors]

    for d in pipe.devices:
        d.enable_offload(1 << 30, copy=slow)
        d.enable_async_handoff(copy=slow)
    for k in (0, 4, 5):  # F0 (saves going down), FB (hand-offs), B1
        stage = pipe.plan.stages[k]
        _arm(_layer_of(stage), 1, "forward" if stage.kind != "backward" else "backward")
        _failing_call(pipe, x, y, PipelineError, rf"^stage {stage.name} ")
        for d in pipe.devices:
            assert d.offloader.pending == 0 and d.handoffs.pending == 0
        pipe.model.zero_grad(set_to_none=True)
        _clean_call_matches_eager(pipe, x, y, loss, grads, f"after a fault in {stage.name}")
    pipe.model.zero_grad(set_to_none=True)
    broken[0] = True
    _failing_call(pipe, x, y, PipelineError, "copying .* to host memory failed: PCIe link down")
    _clean_call_matches_eager(pipe, x, y, loss, grads, "after a failed copy")


@pytest.mark.parametrize("how", ["worker", "caller", "signal"])
def test_ctrl_c_stops_the_workers_and_is_reraised(how: str, watchdog: None) -> None:
    """A ``KeyboardInterrupt`` in a worker, in the caller's own stage, or Ctrl-C itself (SIGINT to the main
    thread while it waits): the caller gets ``KeyboardInterrupt`` — not wrapped — with the workers stopped and
    no gradient added; the next call equals eager."""
    if how == "signal" and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's KeyboardInterrupt here")
    pipe, ref, x, y = _pipeline()
    loss, grads = _eager(ref, x, y)
    main = threading.main_thread().ident
    assert main is not None
    delivered = threading.Event()

    def interrupt(signum: int, frame: Any) -> None:  # Python's own Ctrl-C, and a note that it was raised
        delivered.set()
        signal.default_int_handler(signum, frame)

    def ctrl_c(i: int) -> BaseException:
        signal.pthread_kill(main, signal.SIGINT)  # arrives while the caller computes or waits
        # the stage goes on only once the caller has raised it: on a loaded machine a fixed sleep let the stage
        # fail first and the KeyboardInterrupt land later, in pytest itself (a crashed xdist worker)
        delivered.wait(30)
        return RuntimeError("ran on after Ctrl-C")

    k = {"worker": 2, "caller": 4, "signal": 1}[how]  # F2 on device 2, FB on device 0 (the caller), F1 on device 1
    _arm(_layer_of(pipe.plan.stages[k]), 2, "forward", ctrl_c if how == "signal" else lambda i: KeyboardInterrupt())
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        err = _failing_call(pipe, x, y, KeyboardInterrupt)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert delivered.is_set() == (how == "signal")
    assert type(err) is KeyboardInterrupt
    _clean_call_matches_eager(pipe, x, y, loss, grads, f"after Ctrl-C ({how})")


CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 24.00 GiB of which "
            "512.00 MiB is free. Including non-PyTorch memory, this process has 23.49 GiB memory in use.")


@pytest.mark.parametrize("message,limit", [
    (CUDA_OOM, int(24 * 2**30 * 12 * 2**30 / (25.5 * 2**30))),  # capacity × planned / needed
    ("out of memory", int(20 * 2**30 * 0.9)),                    # no sizes: 10% under the plan's limit
])
def test_out_of_memory_names_the_stage_and_the_plan_that_fits(message: str, limit: int, watchdog: None) -> None:
    pipe, ref, x, y = _pipeline()
    _arm(_layer_of(pipe.plan.stages[5]), 3, "backward", lambda i: torch.OutOfMemoryError(message))
    gib = f"{int(limit * 10 / 2**30) / 10:g}GiB"
    needed = ", it needed about 25.50 GiB of the device's 24.00 GiB" if "Tried" in message else ""
    err = _failing_call(pipe, x, y, StageOutOfMemoryError,
                        rf"^stage B1 ran out of memory on device 1 \(cpu\) at microbatch 3 \(planned at 12.00 GiB "
                        rf"under a 20.00 GiB limit{needed}\); plan for less memory: rpcompile plan MODEL --gpus 4 "
                        rf"--spec rtx4090 --microbatches 4 --precision fp32 --memory-limit {gib} "
                        rf"\(or compile\(\.\.\., memory_limit={limit}\)\)$")
    assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, PipelineError)
    assert (err.stage, err.device, err.microbatch) == ("B1", 1, 3)
    assert gib == ("11.2GiB" if needed else "18GiB")
    from rpcompile.cli.parser import build_parser

    command = str(err).split("plan for less memory: ")[1].split(" (or ")[0].replace("MODEL", "llama-demo")
    args = build_parser().parse_args(command.split()[1:])  # the offered command is one the CLI takes
    assert (args.gpus, args.memory_limit, args.microbatches) == (4, int(float(gib[:-3]) * 2**30), 4)


def test_a_failed_call_beside_an_overlapped_step_changes_nothing(watchdog: None) -> None:
    """``step(overlap=True)`` then a failed call then a good one: weights and gradients bit for bit those of the
    same run without the failed call (its gradients were never held, the step finished and is taken by the next
    call)."""
    runs = []
    for fail in (False, True):
        pipe, _, x, y = _pipeline()
        opt = torch.optim.SGD(pipe.model.parameters(), lr=0.1)
        pipe.forward_backward(x, target=y)
        pipe.step(opt, overlap=True)
        if fail:  # (.grad is the step's meanwhile: the iteration's gradients are held apart)
            _arm(_layer_of(pipe.plan.stages[6]), 0, "backward")
            with pytest.raises(PipelineError, match=r"^stage B2 "):
                pipe.forward_backward(x, target=y)
            assert pipe.executor.grads.private == {} and pipe._step is not None and pipe._step.done()
            _disarm()
        pipe.forward_backward(x, target=y)
        pipe.synchronize()
        runs.append({n: (p.detach().clone(), p.grad.clone()) for n, p in pipe.model.named_parameters()})
    for n, (w, g) in runs[0].items():
        assert torch.equal(runs[1][n][0], w) and torch.equal(runs[1][n][1], g), n


# ---------------------------------------------------------------------------------------------- leaves
TAPS: collections.Counter = collections.Counter()


@fx.wrap
def tap(x: torch.Tensor, tag: str) -> torch.Tensor:
    """A leaf function with a side effect."""
    TAPS[(tag, torch.is_grad_enabled())] += 1
    return x * 1.0


class Tap(nn.Module):
    """A leaf module (``leaf_modules=[Tap]``) with a side effect."""

    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        TAPS[(self.tag, torch.is_grad_enabled())] += 1
        return x + 0.0


class Tapped(nn.Module):
    def __init__(self, d: int = 16, n: int = 6):
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.taps = nn.ModuleList(Tap(f"mod{i}") for i in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (lin, t) in enumerate(zip(self.lin, self.taps)):
            x = t(tap(torch.tanh(lin(x)), f"fn{i}")) + x
        return self.head(x)


@pytest.mark.parametrize("allow_save", [True, False], ids=["saving", "recompute"])
def test_leaf_functions_and_modules_run_every_step_in_every_plan(allow_save: bool) -> None:
    """Eager runs each leaf once per step; the pipeline once per microbatch in the forward pass at every step —
    also in saved segments, which capture neither (they used to run a leaf only at capture time, never again) —
    and once more per microbatch where a backward stage recomputes it. Gradients equal eager at every step."""
    torch.manual_seed(0)
    model = Tapped()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    pipe = rpcompile.compile(model, (x,), loss_fn=F.cross_entropy, devices=["cpu"] * 4, microbatches=M,
                             spec=FINE_CPU, time_limit_s=2.0, leaf_modules=[Tap], allow_save=allow_save)
    assert bool(pipe.program.saved) == allow_save
    leafy = [s for s in pipe.program.saved if s.leaves]
    assert bool(leafy) == allow_save and len(leafy) < len(pipe.program.saved) or not allow_save
    fused = set(pipe.plan.stages[[s.kind for s in pipe.plan.stages].index("fused")].nodes)
    per_step = []
    for step in range(3):
        TAPS.clear()
        loss = pipe.forward_backward(x, target=y)
        counts = collections.Counter(TAPS)
        per_step.append(counts)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, dict(ref.named_parameters())[n].grad, **TOL)
        for i in range(6):  # a leaf outside the fused stage: forward stage, then recompute
            for tag, node in ((f"fn{i}", f"tap_{i}" if i else "tap"), (f"mod{i}", f"taps_{i}")):
                assert counts[(tag, False)] == (0 if node in fused else M), (step, tag, counts)
                assert counts[(tag, True)] == M, (step, tag, counts)
    assert per_step[0] == per_step[1] == per_step[2]
    for s in pipe.program.saved:  # captured unless it calls a leaf
        assert s.calls["recomputed"] == (3 * M if s.leaves else 0), (s.name, s.nodes, s.calls)


def test_opaque_calls_name_leaves_only() -> None:
    """torch's functions and modules are pure; a wrapped Python function and a user's leaf module are not."""
    from rpcompile.passes.graph.trace import trace
    from rpcompile.runtime.segments.saved import opaque_calls

    gm = trace(Tapped(n=2), (torch.randn(2, 16),), leaf_modules=[Tap])
    assert opaque_calls(gm) == ["tap", "taps_0", "tap_1", "taps_1"]


# ---------------------------------------------------------------------------------------------- mechanisms
def test_grad_sink_takes_back_everything_a_failed_call_added() -> None:
    """abort(): a gradient the call created is None again, one it added into holds its old values (the same
    tensor), and so for the buffers held while an overlapped step reads ``.grad``; commit() keeps them."""
    from rpcompile.runtime.weights import GradSink

    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    sink = GradSink({"a": a, "b": b})
    b.grad = held = torch.full((3,), 2.0)
    for private in (False, True):
        sink.hold(private)
        if private:
            sink.private = {"b": torch.full((3,), 5.0)}
        sink.begin()
        sink.submit(["a", "b"], [torch.ones(3), torch.ones(3)])
        sink.accumulate("a", lambda g: g.add_(1.0))
        sink.drain()
        sink.abort()
        if private:
            assert list(sink.private) == ["b"] and torch.equal(sink.private["b"], torch.full((3,), 5.0))
        else:
            assert a.grad is None and b.grad is held and torch.equal(held, torch.full((3,), 2.0))
    sink.hold(False)
    sink.begin()
    sink.submit(["a", "b"], [torch.ones(3), torch.ones(3)])
    sink.drain()
    sink.commit()
    assert torch.equal(a.grad, torch.ones(3)) and torch.equal(b.grad, torch.full((3,), 3.0))


def test_offloader_settle_clears_a_failed_copy() -> None:
    from rpcompile.runtime.offload import Offloader

    fail = [True]

    def copy_out(tensors: Any, ready: Any) -> list[torch.Tensor]:
        if fail[0]:
            raise OSError("link down")
        return [t.clone() for t in tensors]

    off = Offloader(copy_out, name="rpcompile-offload-test")
    try:
        with pytest.raises(RuntimeError, match="link down"):
            off.submit([torch.ones(2)], priority=0).wait(timeout=10)
        with pytest.raises(RuntimeError, match="link down"):
            off.submit([torch.ones(2)], priority=0)
        off.settle()
        fail[0] = False
        assert torch.equal(off.submit([torch.ones(2)], priority=0).wait(timeout=10)[0], torch.ones(2))
        assert off.pending == 0
    finally:
        off.close()
