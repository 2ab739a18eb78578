"""On a GPU (skipped without CUDA): the runtime's CUDA path gives eager's loss and gradients.

What runs here and nowhere else: uploads on a copy stream, weights prefetched in pieces on a stream of their own,
saved activations and hand-offs going down on offloader threads with their own streams into pinned buffers, the
worker under ``torch.device("cuda")``, GPU kernels' own strides (SDPA, cuBLAS) against graphs traced on the CPU,
costs measured on the GPU. Two logical devices on one GPU exercise the same hand-offs through host memory as two
GPUs do.

Run on a GPU machine with ``python -m pytest -m gpu``. ``RPCOMPILE_GPU_TESTS_ON_CPU=1`` runs the same tests on
logical CPU devices (it checks the tests themselves, not the CUDA path).
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

import rpcompile
from rpcompile.models.registry import load_model

from _hf import VOCAB, hf_model, token_loss
from test_foreign_devices import check_bert
from test_runtime import FINE_CPU, _normwise, _saving_pipeline, assert_grads_equal, bert, eager_step, mlm_loss

ON_CPU = os.environ.get("RPCOMPILE_GPU_TESTS_ON_CPU") == "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_CPU and not torch.cuda.is_available(), reason="needs CUDA")]

GPU_TOL = dict(rtol=1e-4, atol=1e-5)
#: Weights after AdamW steps. Adam's step is about ``lr`` whatever a gradient's size, so where a gradient is near
#: zero, the CUDA kernels' last bits (against eager on the CPU) move a weight by up to a few 1e-5 at lr 1e-3 (seen on
#: an H200, 2026-11-26: one element of 11,264 at 1.66e-5). A lost or wrong gradient moves weights by ~lr.
WEIGHT_TOL = dict(rtol=1e-4, atol=5e-5)


def _devices(k: int) -> list[str]:
    """k devices: the GPUs in turn (two logical devices on one GPU when there is one)."""
    if ON_CPU:
        return ["cpu"] * k
    return [f"cuda:{i % torch.cuda.device_count()}" for i in range(k)]


def _assert_grads(model, ref, what=""):
    assert_grads_equal(model, ref, tol=GPU_TOL, what=what)


@pytest.mark.parametrize("parity", [0, 1])
def test_saved_segments_with_lazy_offload_match_eager_on_cuda(parity):
    spec, ref, pipe, x, y = _saving_pipeline("llama-demo", parity, devices=_devices(2))
    if not ON_CPU:
        assert all(d.offloader is not None and d.handoffs is not None for d in pipe.devices)
    for step in range(2):  # the second step reuses the offloaders, streams and pinned buffers
        for p in (*spec.model.parameters(), *ref.parameters()):
            p.grad = None
        loss = pipe.forward_backward(x, target=y)
        ref_loss = eager_step(ref, spec.loss_fn, x, y, pipe.microbatches)
        torch.testing.assert_close(loss, ref_loss, **GPU_TOL)
        _assert_grads(spec.model, ref, what=f"step {step}: ")
    if ON_CPU:
        return
    saving = {k % len(pipe.devices) for k, s in enumerate(pipe.plan.stages) if s.kind == "forward" and s.saved}
    for d in pipe.devices:
        assert d.offloader.pending == 0 and d.handoffs.pending == 0
        assert (d.offloader.peak_pending_bytes > 0) == (d.index in saving)


@pytest.mark.parametrize("host", [["embed"], False])
def test_compiled_decoder_trains_like_eager_on_cuda(host):
    """Two AdamW steps on a compiled decoder — weights prefetched in pieces on their own stream, the embedding
    looked up on the host or on the GPU — end at eager's weights."""
    spec = load_model("llama-demo", batch_size=6)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=_devices(2), microbatches=3,
                             spec="rtx4090", time_limit_s=2.0, host_embedding=host)
    assert list(pipe.plan.host) == (host or [])
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pipe.forward_backward(x, target=y)
        ref_loss = eager_step(ref, spec.loss_fn, x, y, pipe.microbatches)
        torch.testing.assert_close(loss, ref_loss, **GPU_TOL)
        opt.step(), ref_opt.step()
    for (name, p), r in zip(spec.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, **WEIGHT_TOL, msg=lambda m, n=name: f"weight {n} after two steps: {m}")


def test_two_logical_devices_on_one_gpu_match_eager():
    """Both devices are the same GPU: every hand-off still goes through pinned host memory."""
    device = "cpu" if ON_CPU else "cuda:0"
    spec = load_model("gpt-demo", batch_size=6)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=[device, device], microbatches=3,
                             spec=FINE_CPU, time_limit_s=2.0)
    assert len(pipe.plan.stages) >= 3
    loss = pipe.forward_backward(x, target=y)
    torch.testing.assert_close(loss, eager_step(ref, spec.loss_fn, x, y, 3), **GPU_TOL)
    _assert_grads(spec.model, ref)
    out = pipe.forward(x)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, ref(x), **GPU_TOL)


def test_split_head_matches_eager_on_cuda():
    """The LM head and its loss in sequence chunks: the target goes to the fused stage's device inside the graph,
    and the chunks' views of cuBLAS outputs must not depend on the CPU's strides."""
    spec = load_model("llama-demo", batch_size=6)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=_devices(2), microbatches=3,
                             spec=FINE_CPU, time_limit_s=2.0, example_target=y, head_chunks=4)
    assert pipe.plan.head_chunks == 4
    loss = pipe.forward_backward(x, target=y)
    ref_loss = spec.loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **GPU_TOL)
    _assert_grads(spec.model, ref)
    with torch.no_grad():  # evaluation: the in-graph loss per microbatch on the fused stage's GPU
        torch.testing.assert_close(pipe.evaluate(x, target=y), spec.loss_fn(ref(x), y), **GPU_TOL)


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_matches_low_precision_eager_on_cuda(precision, dtype):
    """bf16, and fp16 with a GradScaler over the CPU masters: loss and gradients agree with eager in that precision
    to its rounding; the step that follows is taken (no overflow) and the masters stay fp32."""
    spec = load_model("llama-demo", batch_size=6)
    device = _devices(1)[0]
    ref = copy.deepcopy(spec.model).to(device=device, dtype=dtype)
    (x,), y = spec.example_inputs, spec.example_target
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if precision == "fp16" else None
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=_devices(2), microbatches=3,
                             spec=FINE_CPU, time_limit_s=2.0, precision=precision, scaler=scaler)
    loss = pipe.forward_backward(x, target=y)
    ref_loss = spec.loss_fn(ref(x.to(device)), y.to(device))
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-2 * abs(ref_loss.item())
    ref_params = dict(ref.named_parameters())
    scale = scaler.get_scale() if scaler is not None else 1.0
    for name, p in spec.model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        assert _normwise(p.grad / scale, ref_params[name].grad.cpu()) < 3e-2, name
    if scaler is not None:
        opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3)
        before = {n: p.detach().clone() for n, p in spec.model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        assert any(not torch.equal(p, before[n]) for n, p in spec.model.named_parameters())


@pytest.mark.hf
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-moe", "mixtral"])
def test_hf_decoders_with_measured_costs_match_eager_on_cuda(kind):
    """Exported on the CPU, costed on the GPU (measured), run on the GPU: every HF decoder failed on an H100 at
    export's ``_assert_tensor_metadata(device=cpu)`` while its costs were measured."""
    model = hf_model(kind)
    ref = copy.deepcopy(model)
    ids, y = torch.randint(0, VOCAB, (4, 8)), torch.randint(0, VOCAB, (4, 8))
    loss_fn = token_loss
    pipe = rpcompile.compile(model, (), example_kwargs={"input_ids": ids, "use_cache": False}, loss_fn=loss_fn,
                             devices=_devices(2), microbatches=2, time_limit_s=2.0,
                             spec=FINE_CPU if ON_CPU else None)  # None: costs measured on the GPU
    loss = pipe.forward_backward(input_ids=ids, use_cache=False, target=y)
    ref_loss = loss_fn(ref(input_ids=ids, use_cache=False), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **GPU_TOL)
    _assert_grads(model, ref)


@pytest.mark.hf
def test_an_exported_bert_matches_eager_on_cuda():
    """A BERT model failed in its backward stages on an H100 (``view size is not compatible``)."""
    check_bert(_devices(2), spec=FINE_CPU if ON_CPU else None)


@contextlib.contextmanager
def _attention_kernels(which: str):
    """CUDA's attention kernels for the block: ``math`` only, or ``fused`` (the defaults: flash, memory-efficient,
    cuDNN, math as the dispatcher picks). The switches are process-wide, so the pipeline's worker threads follow."""
    b = torch.backends.cuda
    flags = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled())
    fused = which == "fused"
    b.enable_flash_sdp(fused and flags[0]), b.enable_mem_efficient_sdp(fused and flags[1])
    b.enable_cudnn_sdp(fused and flags[2])
    try:
        yield
    finally:
        b.enable_flash_sdp(flags[0]), b.enable_mem_efficient_sdp(flags[1]), b.enable_cudnn_sdp(flags[2])


def _worst_normwise(model, ref) -> tuple[float, str]:
    """The largest normwise relative difference of a gradient, and whose — but the attention's key biases': softmax
    ignores a shift shared by a row, so their gradient is zero in exact arithmetic and rounding is all there is."""
    refs = dict(ref.named_parameters())
    return max((_normwise(p.grad, refs[n].grad), n) for n, p in model.named_parameters()
               if p.grad is not None and not n.endswith("attention.self.key.bias"))


@pytest.mark.hf
@pytest.mark.parametrize("kernels", ["math", "fused"])
def test_attention_dropout_replays_its_mask_on_cuda(kernels):
    """An HF BERT in train mode with attention and hidden dropout: the attention kernel draws its own mask (on CUDA
    from the Philox generator, inside a fused kernel). Backward stages that recompute it (two devices, nothing
    saved) must draw the forward's mask, so their loss and gradients equal one device's, whose forward and backward
    are one autograd graph — the same seeds, microbatches and kernels. Then in eval mode both give eager eval's loss.

    ``math``: the loss and every gradient equal to float32 rounding. ``fused``: the fused kernels' backward depends
    on its inputs' layout beyond float32 rounding (an H200, 2026-11-28: with no dropout at all, query/key gradients
    of a near-uniform attention 70% apart between one device and two; the math kernel 9e-8), so the attention is
    sharpened (its gradients well conditioned) and the replay must sit far closer to one device than a run with
    another dropout seed — a wrong mask — does."""
    model = bert(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.3).train()
    if kernels == "fused":
        with torch.no_grad():  # scores of a few units instead of ~0.004: softmax no longer near uniform
            for layer in model.bert.encoder.layer:
                layer.attention.self.query.weight.mul_(25)
                layer.attention.self.key.weight.mul_(25)
    x, y = torch.randint(0, 64, (6, 12)), torch.randint(0, 64, (6, 12))
    loss_fn = mlm_loss
    runs = []
    with _attention_kernels(kernels):
        for devices, options, seed in ((_devices(1), {}, 1), (_devices(2), {"allow_save": False}, 1),
                                       (_devices(2), {"allow_save": False}, 2)):
            m = copy.deepcopy(model)
            torch.manual_seed(seed)  # the dropout seed
            pipe = rpcompile.compile(m, (x,), loss_fn=loss_fn, devices=devices, microbatches=3, head_chunks=1,
                                     spec=FINE_CPU if ON_CPU else None, time_limit_s=2.0, **options)
            runs.append((m, pipe, pipe.forward_backward(x, target=y)))
    (one, _, loss1), (two, pipe2, loss2), (other, _, _) = runs
    assert any(s.kind == "backward" for s in pipe2.plan.stages)
    torch.testing.assert_close(loss2, loss1, **GPU_TOL)
    if kernels == "math":
        _assert_grads(two, one)
    else:
        replay, wrong = _worst_normwise(two, one), _worst_normwise(other, one)
        assert replay[0] <= 1e-2 and wrong[0] >= 10 * replay[0], (replay, wrong)
    ref = copy.deepcopy(model).eval()
    two.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe2.forward_backward(x, target=y), loss_fn(ref(x), y), **GPU_TOL)


def test_pinned_weight_copies_take_what_the_host_memory_check_counts():
    """The host-memory check (rpcompile/training/host_memory.py) counts each pinned weight copy as PyTorch's pinned
    allocator hands it out, rounded up to a power of two (llama-demo's weights include sizes that are not powers of
    two). Trainable weights' copies are made at their first upload (an H200, 2026-11-28: none while the pipeline
    was built), so after one step: the copies are the ones counted, and allocated afresh from an emptied pinned
    cache they grow the allocator by exactly the bytes counted."""
    if ON_CPU:
        pytest.skip("pinned memory needs CUDA")
    from rpcompile.runtime.weights import nbytes, pinned_bytes
    from rpcompile.training.host_memory import activation_bytes, release_pinned_cache

    key = "allocated_bytes.current"
    if key not in torch.cuda.host_memory_stats():
        pytest.skip(f"this torch's host_memory_stats() has no {key}")
    spec = load_model("llama-demo")
    (x,), y = spec.example_inputs, spec.example_target
    plan = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], spec="rtx4090",
                             time_limit_s=2.0, precision="bf16").plan
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=_devices(2), plan=plan, precision="bf16")
    grads = sum(nbytes(p) for p in spec.model.parameters() if p.requires_grad and p.grad is None)
    copies = pipe.host_bytes - grads - activation_bytes(plan)
    pipe.forward_backward(x, target=y)
    torch.cuda.synchronize()
    fronts = [e.front for e in pipe.executor.weights.entries.values() if e.front is not None]
    assert all(f.is_pinned() and f.dtype == torch.bfloat16 for f in fronts)
    assert sum(pinned_bytes(nbytes(f)) for f in fronts) == copies > sum(nbytes(f) for f in fronts)
    if not release_pinned_cache():
        pytest.skip("this torch cannot empty its pinned cache (torch.accelerator.empty_host_cache)")
    before = torch.cuda.host_memory_stats()[key]
    again = [torch.empty_like(f, pin_memory=True) for f in fronts]
    assert torch.cuda.host_memory_stats()[key] - before == copies, len(again)


def test_overlapped_iterations_equal_the_overlapped_step_on_cuda():
    """Overlapped iterations on the GPU — each call returning at its loss, the next iteration's stages starting
    on the copy and compute streams while the last ones drain, its first weights prefetched behind them — compute
    what the overlapped step alone computes (the same one-step-stale training) over four AdamW steps."""
    spec = load_model("llama-demo", batch_size=6)
    twin = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    pa = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=_devices(2), microbatches=3,
                           spec="rtx4090", time_limit_s=2.0, overlap=True)
    pb = rpcompile.compile(twin, (x,), loss_fn=spec.loss_fn, devices=_devices(2), plan=pa.plan)
    pb.overlap_iterations = False
    oa = torch.optim.AdamW(spec.model.parameters(), lr=1e-3)
    ob = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    for step in range(4):
        la, lb = pa.forward_backward(x, target=y), pb.forward_backward(x, target=y)
        torch.testing.assert_close(la, lb, **GPU_TOL)
        pa.step(oa, overlap=True), pb.step(ob, overlap=True)
    pa.synchronize(), pb.synchronize()
    for (name, p), q in zip(spec.model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, **WEIGHT_TOL, msg=name)
