"""Host memory (rpcompile/training/host_memory.py): what a pipeline will allocate, refused in one line when the machine does
not have it, and the plan's GPU memory when a spec names a smaller card than the one at hand."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

import rpcompile
import rpcompile.planner.planning as planning
import rpcompile.training.host_memory as hm
from rpcompile.core.specs import get_spec
from rpcompile.passes.cost.cost import cost_pass
from rpcompile.passes.graph.trace import trace
from rpcompile.runtime.weights import WeightStore, pinned_bytes
from rpcompile.training.gpu_memory import gpu_memory_limit
from rpcompile.training.host_memory import HostMemoryError, HostMemoryWarning, activation_bytes

from test_weights import FINE, Tied, batch, loss_fn


def frozen_norm() -> Tied:
    model = Tied()
    model.norm.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def plan():
    torch.manual_seed(0)
    x, _ = batch(0)
    return rpcompile.compile(frozen_norm(), (x,), loss_fn=loss_fn, devices=["cpu", "cpu"], precision="bf16", spec=FINE,
                             microbatches=2, host_embedding=False, time_limit_s=5.0).plan


def build(plan, model=None, **kw):
    x, _ = batch(0)
    return rpcompile.compile(model or frozen_norm(), (x,), loss_fn=loss_fn, devices=["cpu", "cpu"], precision="bf16",
                             plan=plan, host_embedding=False, **kw)


def test_host_bytes_are_the_copies_gradients_and_activations_the_pipeline_allocates(plan):
    """bf16 on logical CPU devices: a bf16 copy of every weight (2 B each), an fp32 gradient per trainable
    parameter (4 B each), and the forward stages' saved activations and outputs for every microbatch — then the
    copies and gradients made by one step are exactly those bytes."""
    model = frozen_norm()
    pipe = build(plan, model)
    n_all = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    acts = activation_bytes(plan)
    assert acts == plan.microbatches * sum(s.offload_bytes + s.download_bytes for s in plan.stages
                                           if s.kind == "forward") > 0
    assert pipe.host_bytes == 2 * n_all + 4 * n_trainable + acts
    x, y = batch(1)
    pipe.forward_backward(x, target=y)
    store = pipe.executor.weights
    copies = sum(e.front.numel() * e.front.element_size() for e in store.entries.values() if e.front is not None)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert copies + frozen == 2 * n_all  # the frozen norm became its own bf16 copy
    assert sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None) \
        == 4 * n_trainable


def test_pinned_copies_are_counted_as_the_allocator_rounds_them():
    """GPUs upload from pinned copies, and PyTorch's pinned allocator rounds every request up to a power of two:
    a 3,000-element bf16 weight (6,000 B) takes 8,192; an fp32 run still pins a copy of each weight."""
    params = {"w": torch.nn.Parameter(torch.zeros(3, 1000)), "b": torch.nn.Parameter(torch.zeros(1024))}
    assert [pinned_bytes(n) for n in (0, 1, 4096, 4097, 6000)] == [0, 1, 4096, 8192, 8192]
    assert WeightStore.planned_bytes(params, torch.bfloat16, pin=True, uploaded=["w", "b"]) == 8192 + 2048
    assert WeightStore.planned_bytes(params, torch.bfloat16, pin=False, uploaded=["w", "b"]) == 6000 + 2048
    assert WeightStore.planned_bytes(params, None, pin=True, uploaded=["w", "b"]) == 16384 + 4096
    assert WeightStore.planned_bytes(params, None, pin=False, uploaded=["w", "b"]) == 0  # uploads the masters


def test_a_pipeline_the_host_cannot_hold_is_refused_in_one_line_before_it_allocates(plan, monkeypatch):
    model = frozen_norm()
    before = {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()}
    monkeypatch.setattr(hm, "available_host_memory", lambda: 1000)
    with pytest.raises(HostMemoryError) as e:
        build(plan, model)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("host memory: this pipeline needs ")
    assert "(upload copies " in msg and f"at {plan.microbatches} microbatches; predicted) but 1000 B are available" \
        in msg and "RPCOMPILE_HOST_MEMORY=ignore to try anyway" in msg
    # nothing was cast, replaced or created
    assert {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()} == before
    assert all(p.grad is None for p in model.parameters())
    monkeypatch.setenv("RPCOMPILE_HOST_MEMORY", "ignore")
    x, y = batch(1)
    assert torch.isfinite(build(plan, model).forward_backward(x, target=y))


def test_no_room_for_adamw_state_is_one_warning(plan, monkeypatch):
    model = frozen_norm()
    need = build(plan).host_bytes
    adam = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    monkeypatch.setattr(hm, "available_host_memory", lambda: need + adam - 1)
    with pytest.warns(HostMemoryWarning, match=r"leaves no room for an AdamW optimizer's .* of state"):
        build(plan, model)
    monkeypatch.setattr(hm, "available_host_memory", lambda: need + adam)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostMemoryWarning)
        build(plan)


def test_a_spec_caps_the_plans_gpu_memory_at_its_own(monkeypatch):
    """``compile(spec="rtx4090")`` on an 80 GB GPU plans for the 4090's memory; without a spec, 90% of the GPU's."""
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    gpu = torch.device("cuda:0")
    assert gpu_memory_limit(gpu) == int(80 * 2**30 * 0.9)
    assert gpu_memory_limit(gpu, "rtx4090") == get_spec("rtx4090").usable_memory_bytes < int(80 * 2**30 * 0.9)
    Props.total_memory = 16 * 2**30  # a smaller card than the spec's: its own memory binds
    assert gpu_memory_limit(gpu, "rtx4090") == int(16 * 2**30 * 0.9)


def test_the_refusal_names_the_remedy_for_what_dominates(plan, monkeypatch):
    """The weights' state dominates: LoRA. Saved activations do: allow_save=False. Activations handed between
    stages do (nothing saved): smaller batches."""
    long = torch.randint(0, 32, (4, 96))  # long sequences: activations outweigh a 1.3k-parameter model
    options = dict(loss_fn=loss_fn, devices=["cpu", "cpu"], precision="bf16", host_embedding=False)
    saving = rpcompile.compile(frozen_norm(), (long,), spec=FINE, microbatches=2, time_limit_s=5.0, **options).plan
    recompute = rpcompile.compile(frozen_norm(), (long,), spec=FINE, microbatches=2, time_limit_s=5.0,
                                  allow_save=False, **options).plan
    assert any(s.offload_bytes for s in saving.stages) and activation_bytes(plan) < 8160 < activation_bytes(saving)
    assert activation_bytes(recompute) > 8160  # 6 B a parameter: bf16 copy and fp32 gradient, 1,360 parameters
    monkeypatch.setattr(hm, "available_host_memory", lambda: 1000)
    for made, example, remedy in (
            (plan, batch(0)[0], "freeze the base and train adapters (LoRA: it is kept once, in bfloat16)"),
            (saving, long, "re-plan with allow_save=False (rpcompile.compile(..., allow_save=False): the backward "
                           "recomputes instead of keeping activations on the host)"),
            (recompute, long, "use smaller batches (the activations handed between stages wait on the host for "
                              "the backward)")):
        with pytest.raises(HostMemoryError, match=re.escape(f"are available; free host memory, {remedy}, or set "
                                                            "RPCOMPILE_HOST_MEMORY=ignore to try anyway")):
            rpcompile.compile(frozen_norm(), (example,), plan=made, **options)


def test_rpcompile_plan_reports_the_host_memory_of_its_plan(capsys, tmp_path):
    """``rpcompile plan``: the whole run's host memory (predicted) — 18 B a trainable parameter in bf16 (the CLI's
    default: fp32 master, gradient, AdamW moments, bf16 upload copy) and the plan's activations on the host. (The
    ``--json`` output stays the plan file itself.)"""
    from rpcompile.cli import main
    from rpcompile.core.plan import Plan
    from rpcompile.models.registry import load_model
    from rpcompile.core.units import fmt_bytes

    out = tmp_path / "plan.json"
    assert main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--time-limit", "1", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    model = load_model("llama-demo", device="meta").model
    expected = hm.host_memory(model, "bf16", Plan.load(out))
    params = sum(p.numel() for p in model.parameters())
    assert (expected.trainable_bytes, expected.activation_bytes) == (18 * params, activation_bytes(Plan.load(out)))
    assert expected.activation_bytes > 0
    assert expected.line() in text.splitlines()
    assert f", activations on the host {fmt_bytes(expected.activation_bytes)}" in expected.line()


def test_activations_the_host_cannot_keep_are_recomputed_instead(monkeypatch):
    """compile: a plan that saves more activations on the host than is left beside the copies, gradients and AdamW's
    state is re-planned with allow_save=False — one warning, the recomputing plan, and it trains."""
    long, y = torch.randint(0, 32, (4, 96)), torch.randint(0, 32, (4, 96))
    options = dict(loss_fn=loss_fn, devices=["cpu", "cpu"], precision="bf16", spec=FINE, microbatches=2,
                   host_embedding=False, time_limit_s=5.0)
    recompute = rpcompile.compile(frozen_norm(), (long,), allow_save=False, **options)
    adam = 8 * sum(p.numel() for p in frozen_norm().parameters() if p.requires_grad)
    monkeypatch.setattr(hm, "available_host_memory", lambda: 10**12)
    saving = rpcompile.compile(frozen_norm(), (long,), **options)
    assert activation_bytes(saving.plan) > 2 * activation_bytes(recompute.plan)  # it saves when the host has room
    monkeypatch.setattr(hm, "available_host_memory", lambda: recompute.host_bytes + adam)
    traced, costed = [], []  # the re-plan solves the saving plan's graph again: no second trace or cost pass
    monkeypatch.setattr(planning, "trace", lambda *a, **k: traced.append(1) or trace(*a, **k))
    monkeypatch.setattr(planning, "cost_pass", lambda *a, **k: costed.append(1) or cost_pass(*a, **k))
    with pytest.warns(HostMemoryWarning, match=r"host memory: the plan kept .* of activations on the host but .* are "
                                               r"left .*; re-planned to recompute them instead \(allow_save=False\)"):
        pipe = rpcompile.compile(frozen_norm(), (long,), **options)
    assert (len(traced), len(costed)) == (1, 1)
    assert pipe.plan.stages == recompute.plan.stages
    assert pipe.plan.inputs["options"]["allow_save"] is False
    assert torch.isfinite(pipe.forward_backward(long, target=y))
    monkeypatch.setattr(hm, "available_host_memory", lambda: saving.host_bytes)  # fits, but AdamW would not
    with pytest.warns(HostMemoryWarning) as caught:
        kept = rpcompile.compile(frozen_norm(), (long,), allow_save=True, **options)  # asked for: kept
    assert kept.plan.stages == saving.plan.stages
    assert [str(w.message) for w in caught if "re-planned" in str(w.message)] == []


def test_rpcompile_plan_no_save_keeps_no_activations_on_the_host(capsys):
    """``--no-save``: every backward stage recomputes; the host keeps only the hand-offs (and the plan says so)."""
    from rpcompile.cli import main
    from rpcompile.core.plan import Plan

    argv = ["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--time-limit", "1", "--json"]
    runs = []
    for extra in ([], ["--no-save"]):
        assert main([*argv, *extra]) == 0
        runs.append(Plan.from_dict(json.loads(capsys.readouterr().out)))
    saving, recompute = runs
    assert any(s.offload_bytes for s in saving.stages) and saving.inputs["options"]["allow_save"]
    assert not any(s.offload_bytes or (s.kind == "backward" and s.saved) for s in recompute.stages)
    assert recompute.inputs["options"]["allow_save"] is False
    assert activation_bytes(recompute) == recompute.microbatches * sum(
        s.download_bytes for s in recompute.stages if s.kind == "forward")
    assert activation_bytes(recompute) < activation_bytes(saving)


def test_pinned_memory_a_deleted_pipeline_left_cached_is_handed_back_before_a_refusal(plan, monkeypatch):
    """A second pipeline in one process (a notebook, a re-plan): the first one's pinned buffers, freed, stay in
    PyTorch's pinned cache, which the system counts as taken. The check hands them back and measures again before
    it refuses — and only when short (handing back costs the next pipeline its re-pinning)."""
    need = build(plan).host_bytes
    cached = {"bytes": 10**6 + 1}  # what the pinned cache holds and the system does not count: 1 B short
    released = []

    def release():
        released.append(cached["bytes"])
        cached["bytes"] = 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", release, raising=False)
    monkeypatch.setattr(hm, "available_host_memory", lambda: need + 10**6 - cached["bytes"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HostMemoryWarning)
        assert build(plan).host_bytes == need
    assert released == [10**6 + 1]
    assert build(plan).host_bytes == need and released == [10**6 + 1]  # not short: nothing handed back
    cached["bytes"] = 2 * need  # short even after handing it back: still refused, in one line
    monkeypatch.setattr(hm, "available_host_memory", lambda: need - 1 - cached["bytes"])
    with pytest.raises(HostMemoryError, match=r"^host memory: this pipeline needs .* but .* are available"):
        build(plan)
    assert released == [10**6 + 1, 2 * need]
