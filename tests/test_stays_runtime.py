"""Weights that stay on their device, runtime side (:mod:`rpcompile.runtime.stays`): training with a plan whose
forward stages keep their weights for the backward stages on their device, or whose weights are all resident,
equals eager PyTorch (loss, every gradient, the weights after AdamW steps) on logical CPU devices — plain ones and
ones whose copies are real (:class:`StridedDevice`: a stale copy would give other numbers) — and the weight bytes
uploaded drop as the plan says. The planning side: ``tests/test_stays.py``."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rpcompile.planner.plan_options import PlanOptions
import rpcompile
from rpcompile.passes.lower import to_plan
from rpcompile.passes.solver.stay_search import without_stays
from rpcompile.passes.solver.stays import resident_allowed, stay_candidates
from rpcompile.planner import planning

from _devices import StridedDevice
from _hf import VOCAB, hf_model, token_loss
from test_runtime import FINE_CPU, TOL, assert_grads_equal

pytestmark = pytest.mark.hf

#: Under this much memory a device the tiny Llama is cut into several stages (some of every kind).
TIGHT = 200_000
ROOMY = 10**9
ADAMW = dict(lr=1e-3, eps=1e-6)  # eps: Adam does not blow 1e-9 summation-order differences up to lr-sized steps


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (6, 8), generator=g), torch.randint(0, VOCAB, (6, 8), generator=g)


@pytest.fixture(scope="module")
def solved():
    """The tiny HF Llama planned for one and two devices under :data:`TIGHT` (one solve each)."""
    out = {}
    for gpus in (1, 2):
        model = hf_model("llama")
        out[gpus] = planning.compile_plan(model, (batch(0)[0],), PlanOptions(gpus=gpus, spec=FINE_CPU,
                                          host_embedding=False, time_limit_s=2.0, head_chunks=1, memory_limit=TIGHT),
                                          loss_fn=token_loss)
    return out


def variant(c, kind: str) -> rpcompile.Plan:
    """The solved cuts with nothing staying (``none``), every segment that can stay (``stays``) or every weight
    resident, priced on a roomy device (what stays must fit)."""
    pb = dataclasses.replace(c.problem, memory_bytes=ROOMY)
    sp = without_stays(c.result.plan)
    if kind == "stays":
        sp = dataclasses.replace(sp, stays=tuple(i in stay_candidates(pb, sp) for i in range(pb.n)))
    elif kind == "resident":
        if not resident_allowed(pb, sp):
            pytest.skip(f"{sp.stage_count} stages on {pb.device_count} devices: a stage would change device")
        sp = dataclasses.replace(sp, resident=True)
    return to_plan(c.graph, pb, dataclasses.replace(c.result, plan=sp),
                   hardware=dataclasses.replace(c.hardware, memory_bytes=ROOMY), precision=c.options.precision)


def pipeline(solved, gpus: int, kind: str, *, strided: bool = True, freeze: str = ""):
    model = hf_model("llama")
    if freeze:
        model.get_submodule(freeze).requires_grad_(False)
    ref = copy.deepcopy(model)
    devices = [StridedDevice(d) for d in range(gpus)] if strided else ["cpu"] * gpus
    plan = variant(solved[gpus], kind)
    pipe = rpcompile.compile(model, (batch(0)[0],), loss_fn=token_loss, devices=devices, plan=plan,
                             host_embedding=False)
    return model, ref, pipe


def step_both(pipe, model, ref, opt, ref_opt, seed: int) -> None:
    """One training iteration of the pipeline and of eager, compared, then both optimizers step."""
    x, y = batch(seed)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = token_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref, what=f"step {seed}: ")
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()


def assert_weights_equal(model, ref) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=1e-5, atol=2e-6,
                                   msg=lambda m: f"weight {name} after AdamW differs: {m}")


@pytest.mark.parametrize("gpus,kind,strided", [
    (2, "stays", True), (2, "stays", False), (1, "stays", True), (1, "resident", True), (1, "resident", False),
    (2, "resident", True), (2, "none", True),
])
def test_training_with_weights_that_stay_equals_eager(solved, gpus, kind, strided):
    model, ref, pipe = pipeline(solved, gpus, kind, strided=strided)
    plan = pipe.plan
    assert plan.resident == (kind == "resident") and any(s.finds for s in plan.stages) == (kind != "none")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), **ADAMW), torch.optim.AdamW(ref.parameters(), **ADAMW)
    for seed in range(3):
        step_both(pipe, model, ref, opt, ref_opt, seed)
    assert_weights_equal(model, ref)


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_weights_uploaded_drop_as_the_plan_says(solved, gpus):
    """Per iteration the devices upload each stage's ``weight_bytes`` and find its ``found_bytes``: with stays,
    the backward stages find what the forward stages kept and the link carries that much less."""
    uploads = {}
    for kind in ("none", "stays"):
        model, _, pipe = pipeline(solved, gpus, kind)
        plan, stays = pipe.plan, pipe.executor.stays
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        for seed in range(2):
            pipe.forward_backward(*batch(seed)[:1], target=batch(seed)[1])
            pipe.step(opt)
        assert sum(stays.uploaded) == 2 * sum(s.weight_bytes for s in plan.stages), kind
        assert sum(stays.found) == 2 * sum(s.found_bytes for s in plan.stages), kind
        assert all(stays.holding(d) == 0 for d in range(gpus))  # all found by the end of the call
        uploads[kind] = sum(stays.uploaded) / 2
    assert uploads["stays"] < uploads["none"]


def test_a_resident_plan_uploads_every_weight_once_and_then_only_what_the_step_changed(solved):
    """The first call uploads every weight; after a step only the trainable ones (at their first use: the plan's
    ``weight_bytes``), never a frozen one again; a call without a step between (gradient accumulation) none."""
    model, ref, pipe = pipeline(solved, 1, "resident")
    stays, plan = pipe.executor.stays, pipe.plan
    everything = sum(p.numel() * 4 for p in model.parameters())
    x, y = batch(0)
    pipe.forward_backward(x, target=y)
    assert sum(stays.uploaded) == everything
    pipe.forward_backward(x, target=y)  # accumulation: nothing changed, nothing goes up
    assert sum(stays.uploaded) == everything
    pipe.step(torch.optim.AdamW(model.parameters(), **ADAMW))
    pipe.forward_backward(x, target=y)
    assert sum(stays.uploaded) - everything == sum(s.weight_bytes for s in plan.stages) == everything


def test_frozen_weights_of_a_resident_plan_go_up_once(solved):
    model = hf_model("llama")
    model.model.layers[0].requires_grad_(False)  # a frozen block (as a LoRA base)
    c = planning.compile_plan(model, (batch(0)[0],), PlanOptions(gpus=1, spec=FINE_CPU, host_embedding=False,
                              time_limit_s=2.0, head_chunks=1, memory_limit=TIGHT), loss_fn=token_loss)
    ref = copy.deepcopy(model)
    pipe = rpcompile.compile(model, (batch(0)[0],), loss_fn=token_loss, devices=[StridedDevice(0)],
                             plan=variant(c, "resident"), host_embedding=False)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    assert sum(s.weight_bytes for s in pipe.plan.stages) == trainable  # the plan prices it so
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAMW)
    for seed in range(3):
        step_both(pipe, model, ref, opt, ref_opt, seed)
    assert sum(pipe.executor.stays.uploaded) == frozen + 3 * trainable
    assert_weights_equal(model, ref)


def test_weights_changed_outside_an_optimizer_are_uploaded_again(solved):
    """A resident copy is current only while its host copy is: a master changed in place (its version counter) or
    through ``p.data`` and ``pipe.refresh_weights()`` goes up again."""
    model, ref, pipe = pipeline(solved, 1, "resident")
    x, y = batch(0)
    pipe.forward_backward(x, target=y)
    with torch.no_grad():
        for m in (model, ref):
            m.model.layers[1].mlp.up_proj.weight.mul_(0.5)
    model.zero_grad(), ref.zero_grad()
    loss = pipe.forward_backward(x, target=y)
    torch.testing.assert_close(loss, token_loss(ref(x), y).detach(), **TOL)
    for m in (model, ref):
        m.model.layers[0].mlp.down_proj.weight.data.mul_(2.0)  # invisible to version counters
    pipe.refresh_weights()
    model.zero_grad(), ref.zero_grad()
    ref_loss = token_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(pipe.forward_backward(x, target=y), ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)


def test_evaluation_between_calls_leaves_no_copy_the_next_call_does_not_count_on(solved):
    """``evaluate`` runs the forward stages, which keep their weights for backward stages it never runs: the next
    call's first stage lets them go (its plan holds nothing at that point), and trains as eager does."""
    model, ref, pipe = pipeline(solved, 2, "stays")
    x, y = batch(1)
    torch.testing.assert_close(pipe.evaluate(x, target=y), token_loss(ref(x), y).detach(), **TOL)
    stays = pipe.executor.stays
    assert sum(stays.holding(d) for d in range(2)) > 0  # what the forward stages kept
    opt, ref_opt = torch.optim.AdamW(model.parameters(), **ADAMW), torch.optim.AdamW(ref.parameters(), **ADAMW)
    step_both(pipe, model, ref, opt, ref_opt, 2)
    assert sum(stays.holding(d) for d in range(2)) == 0


def test_a_fused_adamw_step_makes_a_resident_copy_stale(solved):
    """torch's fused CPU AdamW writes the masters without moving their version counters: the step hook is what
    tells a device's copy it is stale (fp32 on the CPU keeps no host copy whose stamp would say so)."""
    model, ref, pipe = pipeline(solved, 1, "resident")
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **ADAMW)
    for seed in range(3):
        step_both(pipe, model, ref, opt, ref_opt, seed)
    assert_weights_equal(model, ref)


@pytest.mark.parametrize("gpus,kind", [(1, "resident"), (2, "resident"), (2, "stays")])
def test_overlapped_iterations_never_find_a_copy_of_the_weights_from_before_the_step(solved, gpus, kind):
    """Overlapped iterations (``pipe.step(opt, overlap=True)``, each call returning at its loss) over a plan whose
    weights stay: an iteration still draining keeps copies of the weights it began with while the next one reads
    the next step's — it must upload those, not find the older copies — so the run equals delayed-gradient
    training on a plan with nothing staying."""
    model, _, pipe = pipeline(solved, gpus, kind)
    ref, _, ref_pipe = pipeline(solved, gpus, "none")
    pipe.overlap_iterations = True
    opt, ref_opt = torch.optim.AdamW(model.parameters(), **ADAMW), torch.optim.AdamW(ref.parameters(), **ADAMW)
    previous = {k: v.clone() for k, v in ref.state_dict().items()}
    for seed in range(4):
        x, y = batch(seed)
        loss = pipe.forward_backward(x, target=y)
        pipe.step(opt, overlap=True)
        current = {k: v.clone() for k, v in ref.state_dict().items()}
        ref.load_state_dict(previous)  # one step stale: the gradients at the weights from before the last step
        torch.testing.assert_close(loss, ref_pipe.forward_backward(x, target=y), **TOL)
        ref.load_state_dict(current)
        ref_opt.step(), ref_opt.zero_grad()
        previous = current
    pipe.synchronize()
    assert_weights_equal(model, ref)
