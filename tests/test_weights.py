"""Host copies of the weights and the gradient sink (runtime/weights.py): copies made once per optimizer step give
what casting at every upload gave, bit for bit; the host's bytes per parameter are what the counting rules say;
frozen weights are stored once; an overlapped optimizer step is exactly one step stale."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
from rpcompile.core.specs import get_spec
from rpcompile.runtime.failures import PipelineError
from rpcompile.runtime.optim import BACKEND_ENV, AdamW as FusedAdamW

FINE = dataclasses.replace(get_spec("cpu"), name="cpu-fine-stages", stage_overhead_s=30e-6)


class Tied(nn.Module):
    """Embedding → three blocks → output projection tied to the embedding (two grad stages read one weight)."""

    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return F.linear(self.norm(h), self.embed.weight)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def batch(seed: int, rows: int = 4, seq: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (rows, seq), generator=g), torch.randint(0, 32, (rows, seq), generator=g)


def pair(precision: str = "bf16", frozen: str | None = None, **options):
    """Two identical models and their pipelines on one plan (two logical CPU devices)."""
    torch.manual_seed(0)
    a = Tied()
    if frozen:
        a.get_submodule(frozen).requires_grad_(False)
    b = copy.deepcopy(a)
    x, y = batch(0)
    pa = rpcompile.compile(a, (x,), loss_fn=loss_fn, devices=["cpu", "cpu"], precision=precision, spec=FINE,
                           microbatches=2, host_embedding=False, time_limit_s=5.0, **options)
    pb = rpcompile.compile(b, (x,), loss_fn=loss_fn, devices=["cpu", "cpu"], precision=precision, plan=pa.plan,
                           host_embedding=False, **options)
    return a, pa, b, pb


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs by {(p.float() - q.float()).abs().max():.3g}"


@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop"])
def test_copies_made_once_per_step_train_as_casting_at_every_upload(kind):
    """Every torch AdamW implementation (the fused one does not even bump version counters) has its steps seen:
    three steps equal a pipeline that remakes every copy before each iteration, bit for bit."""
    a, pa, b, pb = pair()
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}[kind]
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, **flags)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, **flags)
    for step in range(3):
        x, y = batch(step)
        pb.refresh_weights()  # what every upload did before: cast from the master
        assert torch.equal(pa.forward_backward(x, target=y), pb.forward_backward(x, target=y))
        oa.step(), ob.step(), oa.zero_grad(), ob.zero_grad()
    assert_same_weights(a, b)
    copies = pa.executor.weights
    for name, p in a.named_parameters():
        assert copies.source(name).dtype == torch.bfloat16
        assert torch.equal(copies.source(name), p.detach().to(torch.bfloat16)), name


def test_building_a_pipeline_casts_no_weight_and_the_first_step_uploads_the_masters_as_they_are_then():
    """The copies are made by the first uploads (on the prefetch threads, beside compute), not when the pipeline
    is built (for an 8B model: a cast of 32 GB of masters before the first step); a master edited in between is
    uploaded as edited."""
    a, pa, b, pb = pair()
    assert pa.host_traffic.get("weight copies", 0) == 0
    with torch.no_grad():
        for m in (a, b):
            next(m.parameters()).mul_(0.5)
    x, y = batch(1)
    assert torch.equal(pa.forward_backward(x, target=y), pb.forward_backward(x, target=y))
    uploaded = {n for prog in pa.program.stages for n in prog.params.values()}
    assert pa.host_traffic["weight copies"] == sum(6 * p.numel() for n, p in a.named_parameters() if n in uploaded)
    for name, p in a.named_parameters():
        assert torch.equal(pa.executor.weights.source(name), p.detach().to(torch.bfloat16)), name


def test_host_bytes_per_parameter_follow_the_counting_rules():
    """bf16 on logical CPU devices: per iteration the host makes each trainable copy once (read 4 + write 2 bytes
    per parameter) and adds each grad stage's bf16 gradient into .grad (read 2 + write 4 bytes the first time,
    read 2 + read/write 8 after); no weight is cast at upload."""
    a, pa, _, _ = pair()
    opt = torch.optim.AdamW(a.parameters(), fused=True)
    x, y = batch(1)
    pa.forward_backward(x, target=y), opt.step(), opt.zero_grad()
    before = pa.host_traffic
    pa.forward_backward(x, target=y), opt.step(), opt.zero_grad()
    after = pa.host_traffic
    params = dict(a.named_parameters())
    grad_stages: dict[str, int] = {}
    for prog in pa.program.stages:
        if prog.kind != "forward":
            for name in set(prog.params.values()):
                grad_stages[name] = grad_stages.get(name, 0) + 1
    uploaded = {n for prog in pa.program.stages for n in prog.params.values()}
    assert uploaded == set(params)
    assert after["weight copies"] - before["weight copies"] == sum(6 * params[n].numel() for n in uploaded)
    assert after["gradients"] - before["gradients"] == sum((6 + 10 * (k - 1)) * params[n].numel()
                                                           for n, k in grad_stages.items())
    assert "upload casts" not in after
    assert max(grad_stages.values()) == 2, "the tied weight is read by two grad stages"


def test_frozen_weights_are_stored_once_in_the_compute_precision():
    torch.manual_seed(0)
    a, pa, b, pb = pair(frozen="blocks.1")
    frozen = dict(a.named_parameters())["blocks.1.weight"]
    assert frozen.dtype == torch.bfloat16 and not frozen.requires_grad
    assert dict(a.named_parameters())["blocks.0.weight"].dtype == torch.float32
    torch.manual_seed(0)
    c = Tied()
    c.blocks[1].requires_grad_(False)
    x, y = batch(0)
    pc = rpcompile.compile(c, (x,), loss_fn=loss_fn, devices=["cpu", "cpu"], precision="bf16", plan=pa.plan,
                           host_embedding=False, frozen_masters=True)
    assert c.blocks[1].weight.dtype == torch.float32
    assert torch.equal(pa.forward_backward(x, target=y), pc.forward_backward(x, target=y))
    for (name, p), q in zip(a.named_parameters(), c.parameters()):
        assert (p.grad is None) == (not q.requires_grad), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def test_changes_outside_an_optimizer():
    """A master changed in place is seen by its version counter (load_state_dict, no_grad in-place ops); an
    edit through .data is not, until refresh_weights()."""
    a, pa, b, pb = pair()
    x, y = batch(2)
    pa.forward_backward(x, target=y)
    state = {k: v * 1.5 for k, v in a.state_dict().items()}
    a.load_state_dict(state), b.load_state_dict(state)
    pb.refresh_weights()
    assert torch.equal(pa.forward_backward(x, target=y), pb.forward_backward(x, target=y))
    with torch.no_grad():
        a.blocks[0].weight.mul_(0.5), b.blocks[0].weight.mul_(0.5)
    pb.refresh_weights()
    assert torch.equal(pa.forward_backward(x, target=y), pb.forward_backward(x, target=y))
    a.blocks[2].weight.data.mul_(2.0), b.blocks[2].weight.data.mul_(2.0)
    pb.refresh_weights()
    stale = pa.forward_backward(x, target=y)
    assert not torch.equal(stale, pb.forward_backward(x, target=y)), "a .data edit is invisible (documented)"
    pa.refresh_weights()
    assert torch.equal(pa.forward_backward(x, target=y), pb.forward_backward(x, target=y))


def test_step_without_overlap_is_the_plain_loop():
    a, pa, b, pb = pair()
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    for step in range(3):
        x, y = batch(step)
        pa.forward_backward(x, target=y), pb.forward_backward(x, target=y)
        pa.step(oa)
        ob.step(), ob.zero_grad()
    assert_same_weights(a, b)
    assert all(p.grad is None for p in a.parameters())


def test_gradient_buffers_are_reused_after_zero_grad_but_never_under_a_reference_someone_kept():
    """``zero_grad()`` sets ``.grad`` to None; the next call's gradients go into the buffers the last call made
    (no fresh memory to fault in every step) — unless something still refers to them: the tensor (a logged
    gradient) or its memory (a view of it). Those keep their values, and every gradient equals the plain loop's."""
    a, pa, b, pb = pair()
    x, y = batch(0)
    pa.forward_backward(x, target=y)
    first = {n: p.grad for n, p in a.named_parameters()}
    ptrs = {n: g.data_ptr() for n, g in first.items()}
    kept_tensor, kept_view = first["blocks.0.weight"], first["blocks.1.weight"].view(-1)
    want_tensor, want_view = kept_tensor.clone(), kept_view.clone()
    del first
    a.zero_grad()
    x, y = batch(1)
    pa.forward_backward(x, target=y)
    pb.forward_backward(x, target=y)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), n
        reused = p.grad.data_ptr() == ptrs[n]
        assert reused == (n not in ("blocks.0.weight", "blocks.1.weight")), n
    assert torch.equal(kept_tensor, want_tensor) and torch.equal(kept_view, want_view)


def plain_step(optimizers, schedulers=()) -> None:
    """The eager loop's step: every optimizer's ``step()``, then their ``zero_grad()``, then the schedulers."""
    for o in optimizers:
        o.step()
    for o in optimizers:
        o.zero_grad()
    for s in schedulers:
        s.step()


def stale_reference(b: nn.Module, pb, optimizers, steps: int, schedulers=(), zero_grad=None) -> list[torch.Tensor]:
    """The one-step-stale reference: synchronous training on delayed gradients — iteration t's gradients taken at
    the weights from before step t-1 — each step ``o.step()`` for every optimizer, then their ``zero_grad()``,
    then the schedulers (and ``zero_grad()`` before each iteration, when given); returns the losses of
    ``batch(0..steps-1)``."""
    losses = []
    previous = {k: v.clone() for k, v in b.state_dict().items()}
    for step in range(steps):
        x, y = batch(step)
        if zero_grad is not None:
            zero_grad()
        current = {k: v.clone() for k, v in b.state_dict().items()}
        b.load_state_dict(previous)  # the reference takes its gradients at the previous weights
        losses.append(pb.forward_backward(x, target=y))
        b.load_state_dict(current)
        plain_step(optimizers, schedulers)
        previous = current
    return losses


def assert_same_losses(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}: {g.item()} != {w.item()}"


@pytest.mark.parametrize("iterations", [False, True], ids=["step overlapped", "iterations overlapped"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_overlapped_step_is_exactly_one_step_stale(precision, iterations):
    """pipe.step(opt, overlap=True) equals synchronous training on delayed gradients — iteration t's gradients
    taken at the weights from before step t-1, w_{t+1} = step(w_t, ∇L_t(w_{t-1})) — bit for bit: the staleness is
    all that differs; with overlapped iterations too (a plan made for them: each call returns at its loss)."""
    a, pa, b, pb = pair(precision, overlap=iterations)
    assert pa.overlap_iterations == iterations
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        x, y = batch(step)
        losses.append(pa.forward_backward(x, target=y))
        pa.step(oa, overlap=True)
    pa.synchronize()
    assert_same_losses(losses, stale_reference(b, pb, [ob], 4))
    assert_same_weights(a, b)
    x, y = batch(9)  # back to synchronous: the copies are the latest weights
    assert torch.equal(pa.forward_backward(x, target=y), pb.forward_backward(x, target=y))


class Gated(torch.optim.AdamW):
    """AdamW whose step waits until the main thread opens ``gate``: what the main thread does first (the user's
    ``zero_grad``) happens while the overlapped step is in flight and has not read ``.grad`` yet, every time."""

    def __init__(self, params, gate: threading.Event, **options):
        super().__init__(params, **options)
        self.gate = gate

    def step(self, closure=None):
        if not self.gate.wait(timeout=60):
            raise RuntimeError("the test never opened the gate")
        return super().step(closure)


@pytest.mark.parametrize("loop", ["optimizer.zero_grad first", "optimizer.zero_grad after step",
                                  "model.zero_grad first"])
def test_zero_grad_in_the_loop_beside_an_overlapped_step_clears_what_it_means_to(loop):
    """The PyTorch-tutorial loop with ``pipe.step(optimizer, overlap=True)``: the user's ``zero_grad()`` — of the
    optimizer at the top or after the step, or of the model — runs while the step is in flight, before it reads
    ``.grad``. It is recorded, not run, and run once the step is done, before the next iteration's gradients land:
    the one-step-stale reference bit for bit (it used to clear the gradients the step was about to read) — also
    for the parameters the model's zero_grad clears and no optimizer steps. After ``synchronize()`` zero_grad is
    the optimizer's own again."""
    a, pa, b, pb = pair("fp32")
    gate = threading.Event()
    model = loop.startswith("model")
    stepped = (lambda m: m.blocks.parameters()) if model else (lambda m: m.parameters())  # the model's: not all
    oa, ob = Gated(stepped(a), gate, lr=1e-2), torch.optim.AdamW(stepped(b), lr=1e-2)

    def zero_grad() -> None:  # looked up at the call, as the user's loop does
        (a if model else oa).zero_grad()

    losses = []
    for step in range(4):
        x, y = batch(step)
        if not loop.endswith("after step"):
            zero_grad()
            gate.set()  # the step in flight (from the previous iteration) reads .grad only now
        losses.append(pa.forward_backward(x, target=y))
        gate.clear()
        pa.step(oa, overlap=True)
        if loop.endswith("after step"):
            zero_grad()
            gate.set()
    gate.set()
    pa.synchronize()
    assert_same_losses(losses, stale_reference(b, pb, [ob], 4, zero_grad=b.zero_grad if model else None))
    assert_same_weights(a, b)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if not name.startswith("blocks.") and model:  # the last iteration's gradients alone, not a sum
            assert torch.equal(p.grad, q.grad), name
    assert "zero_grad" not in vars(oa) and "zero_grad" not in vars(a)  # the methods are the real ones again
    x, y = batch(7)
    pa.forward_backward(x, target=y)
    oa.zero_grad()
    assert all(p.grad is None for p in stepped(a))


def two_optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """AdamW over the embedding and the norm, SGD with momentum over the blocks: disjoint parameter groups."""
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return torch.optim.AdamW(rest, lr=1e-2), torch.optim.SGD(blocks, lr=0.1, momentum=0.9)


def test_several_optimizers_step_together(tmp_path):
    """``pipe.step([o1, o2], overlap=True, scheduler=[s1, s2])`` steps both on the one thread: the one-step-stale
    reference with the same two optimizers and schedulers, bit for bit; a checkpoint of the two resumes into a
    fresh pipeline (``load_state_dict(state, optimizer=[o1, o2])``); synchronous, it is the plain loop. A second overlapped step
    before the next iteration is refused in one line naming the fix."""
    def schedule(opts):
        return [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1 + t)) for o in opts]

    a, pa, b, pb = pair()
    oa, ob = two_optimizers(a), two_optimizers(b)
    sa, sb = schedule(oa), schedule(ob)
    losses = []
    for step in range(4):
        x, y = batch(step)
        losses.append(pa.forward_backward(x, target=y))
        pa.step(list(oa) if step % 2 else oa, overlap=True, scheduler=sa)  # a list or a tuple
    assert_same_losses(losses, stale_reference(b, pb, ob, 4, sb))

    # saved here (a step in flight) and resumed into a fresh model, optimizers and pipeline: one iteration on
    rpcompile.save_checkpoint(tmp_path, model=a, optimizer=oa, pipeline=pa)
    c = Tied()
    oc = two_optimizers(c)
    pc = rpcompile.compile(c, batch(0)[:1], loss_fn=loss_fn, devices=["cpu", "cpu"], precision="bf16",
                           plan=pa.plan, host_embedding=False)
    with pytest.raises(rpcompile.CheckpointError, match=r"the checkpoint holds the state of 2 optimizer\(s\) but 1 "
                       r"were given; pass optimizer= as it was saved \(2, a list in the same order for several\)$"):
        rpcompile.load_checkpoint(tmp_path, model=c, optimizer=oc[0], pipeline=pc)
    assert not torch.equal(c.embed.weight, a.embed.weight)  # refused before anything was loaded
    rpcompile.load_checkpoint(tmp_path, model=c, optimizer=list(oc), pipeline=pc)  # load_state_dict(optimizer=[...])
    assert pc.state_dict()["stale_weights"]
    x, y = batch(4)
    assert torch.equal(pa.forward_backward(x, target=y), pc.forward_backward(x, target=y))
    pa.synchronize(), pc.synchronize()
    assert_same_weights(a, c)

    # synchronous: o1.step(); o2.step(); zero_grads; schedulers — the plain loop
    assert_same_weights(a, b)  # four steps each (batch(4)'s gradients, not stepped, dropped next)
    for o in oa:
        o.zero_grad()
    for step in range(2):
        x, y = batch(step)
        assert torch.equal(pa.forward_backward(x, target=y), pb.forward_backward(x, target=y))
        pa.step(oa, scheduler=sa)
        plain_step(ob, sb)
    assert_same_weights(a, b)
    assert all(p.grad is None for p in a.parameters())

    pa.forward_backward(x, target=y)
    pa.step(oa[0], overlap=True)
    with pytest.raises(rpcompile.ConfigError, match=r"^pipe\.step\(\.\.\., overlap=True\) again before the next "
                       r"forward_backward, while the overlapped step of AdamW is in flight: step the optimizers "
                       r"together, pipe\.step\(\[o1, o2\], overlap=True\)$"):
        pa.step(oa[1], overlap=True)
    pa.synchronize()  # the first step alone went ahead
    assert "zero_grad" not in vars(oa[0]) and all(p.grad is None for p in oa[0].param_groups[0]["params"])
    assert all(p.grad is not None for p in oa[1].param_groups[0]["params"])


def test_an_lr_scheduler_steps_after_the_optimizer_also_when_overlapped():
    """``pipe.step(opt, scheduler=s)`` is ``opt.step(); opt.zero_grad(); s.step()``; with ``overlap=True`` the
    scheduler steps on the step's thread right after the optimizer, so each step uses its own lr, bit for bit as the
    one-step-stale reference does. A scheduler stepped by hand after an overlapped step races with it (the step may
    read either lr): refused at the next iteration's end, in one line naming the fix."""
    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))  # another lr every step

    a, pa, b, pb = pair()
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    sa, sb = schedule(oa), schedule(ob)
    previous = {k: v.clone() for k, v in b.state_dict().items()}
    for step in range(4):
        x, y = batch(step)
        loss_a = pa.forward_backward(x, target=y)
        pa.step(oa, overlap=step > 0, scheduler=sa)  # the first step synchronous, the others overlapped
        current = {k: v.clone() for k, v in b.state_dict().items()}
        if step > 1:  # from the second overlapped step on, the gradients are one step stale
            b.load_state_dict(previous)
        loss_b = pb.forward_backward(x, target=y)
        b.load_state_dict(current)
        ob.step(), ob.zero_grad(), sb.step()
        previous = current
        assert torch.equal(loss_a, loss_b), f"step {step}"
    pa.synchronize()
    assert_same_weights(a, b)
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"] == 1e-2 / 5

    pa.step(oa, overlap=True)
    sa.step()  # by hand, while the step may still be running
    x, y = batch(5)
    with pytest.raises(PipelineError, match=r"^the overlapped optimizer step failed: ConfigError: the optimizer's lr "
                       r"of group 0 \(0\.002 -> 0\.00166.*\) changed while the overlapped step ran, which may have "
                       r"used either value \(an lr scheduler stepped after pipe.step\(optimizer, overlap=True\)\?\); "
                       r"pass it as pipe.step\(optimizer, overlap=True, scheduler=scheduler\), or change the "
                       r"optimizer before pipe.step$"):
        pa.forward_backward(x, target=y)

    class Adapting(torch.optim.SGD):  # keeps a running value of its own in its groups, as Prodigy's d
        def step(self, closure=None):
            for group in self.param_groups:
                group["d"] = group.get("d", 0) + 1
            return super().step(closure)

    adapting = Adapting(a.parameters(), lr=1e-3)
    for _ in range(3):  # its own change is no race
        pa.forward_backward(x, target=y)
        pa.step(adapting, overlap=True)
    pa.synchronize()
    assert adapting.param_groups[0]["d"] == 3


def test_overlap_with_the_mirroring_adamw_writes_no_copies_itself(monkeypatch):
    """rpcompile's AdamW writes the copies in its own pass: after its first step the pipeline makes none, and
    training matches torch's fused AdamW (which the pipeline's copies follow). Its torch backend: the protocol is
    the same for both, and building the C++ one takes a minute (tests/test_optim.py covers it)."""
    monkeypatch.setenv(BACKEND_ENV, "torch")
    a, pa, b, pb = pair()
    oa = FusedAdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        x, y = batch(step)
        la, lb = pa.forward_backward(x, target=y), pb.forward_backward(x, target=y)
        torch.testing.assert_close(la, lb, rtol=2e-2, atol=2e-2)
        if step == 1:  # the copies of step 0's weights were made by this iteration's uploads; none after
            made = pa.host_traffic["weight copies"]
        pa.step(oa, overlap=step == 2)
        ob.step(), ob.zero_grad()
    pa.synchronize()
    assert pa.host_traffic["weight copies"] == made, "the optimizer's mirrors make every copy after its first step"
    for name, p in a.named_parameters():
        assert torch.equal(pa.executor.weights.source(name), p.detach().to(torch.bfloat16)), name
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_overlap_errors():
    a, pa, _, _ = pair()
    x, y = batch(0)
    scaled = rpcompile.compile(copy.deepcopy(a), (x,), loss_fn=loss_fn, devices=["cpu", "cpu"], precision="fp16",
                               plan=pa.plan, host_embedding=False, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(rpcompile.ConfigError, match=r"^step\(optimizer, overlap=True\) does not take a GradScaler"):
        scaled.step(torch.optim.SGD(scaled.model.parameters(), lr=0.1), overlap=True)

    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("disk full")

    pa.forward_backward(x, target=y)
    grads = {n: p.grad.clone() for n, p in a.named_parameters()}
    broken = Broken(a.parameters(), lr=0.1)
    counted = []
    broken.zero_grad = lambda set_to_none=True: counted.append(set_to_none)  # the user's own, kept as it was
    pa.step(broken, overlap=True)
    broken.zero_grad()  # recorded; dropped with the failed step
    with pytest.raises(PipelineError, match=r"^the overlapped optimizer step failed: RuntimeError: disk full$"):
        pa.forward_backward(x, target=y)
    assert "zero_grad" not in vars(a) and counted == []
    broken.zero_grad(False)
    assert counted == [False]  # the user's own attribute again
    for n, p in a.named_parameters():  # .grad holds what the failed step was given; the iteration's were dropped
        assert torch.equal(p.grad, grads[n]), n
    for name, p in a.named_parameters():  # synchronous again, copies made from the masters
        assert torch.equal(pa.executor.weights.source(name), p.detach().to(torch.bfloat16)), name


@pytest.mark.parametrize("several", [False, True], ids=["one optimizer", "two optimizers"])
def test_step_goes_through_the_pipelines_grad_scaler(several):
    """``pipe.step(o)`` is ``scaler.step(o); scaler.update()``; ``pipe.step([o1, o2])`` is ``scaler.step(o1);
    scaler.step(o2); scaler.update()`` (one update for the iteration), then the zero_grads."""
    a, pa, b, pb = pair("fp16")
    pa.scaler, pb.scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1) for _ in range(2))
    if several:
        oa, ob = two_optimizers(a), two_optimizers(b)
    else:
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), (torch.optim.SGD(b.parameters(), lr=0.1),)
    for step in range(2):
        x, y = batch(step)
        pa.forward_backward(x, target=y), pb.forward_backward(x, target=y)
        pa.step(oa)
        for o in ob:
            pb.scaler.step(o)
        pb.scaler.update()
        for o in ob:
            o.zero_grad()
    assert pa.scaler.get_scale() == pb.scaler.get_scale()
    assert_same_weights(a, b)


def test_devices_are_handed_the_same_compute_precision_buffers_every_iteration():
    """What a GPU's upload would DMA from: every weight a device is handed is already in bf16 and is the same host
    buffer at every upload (refreshed in place after a step, never re-made): nothing is cast or allocated on the
    way to the link."""
    from rpcompile.runtime.devices import CpuDevice

    seen: list[list[tuple[torch.dtype, int]]] = []

    class Recording(CpuDevice):
        def upload_weights(self, tensors, dtype=None):
            seen.append([(t.dtype, t.data_ptr()) for t in tensors])
            return super().upload_weights(tensors, dtype)

    torch.manual_seed(0)
    model = Tied()
    x, y = batch(0)
    pipe = rpcompile.compile(model, (x,), loss_fn=loss_fn, devices=[Recording(torch.device("cpu"), 0)],
                             precision="bf16", spec=FINE, microbatches=2, host_embedding=False, time_limit_s=5.0)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    rounds = []
    for step in range(3):
        seen.clear()
        x, y = batch(step)
        pipe.forward_backward(x, target=y)
        pipe.step(opt)
        rounds.append(sorted(p for upload in seen for p in upload))
    assert all(dtype == torch.bfloat16 for dtype, _ in rounds[0])
    assert rounds[0] == rounds[1] == rounds[2]
    assert pipe.host_traffic.get("upload casts", 0) == 0
