"""On a GPU (skipped without CUDA): the runtime's CUDA path — uploads on a copy stream, weights prefetched on a
stream of their own, saved activations and hand-offs going down on offloader threads with their own streams,
embeddings looked up on the host — gives eager's loss and gradients.

Run on a GPU machine with ``pytest -m gpu tests/test_gpu.py``; two logical devices on one GPU exercise the
same hand-offs through host memory as two GPUs do."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU_TOL = dict(rtol=1e-4, atol=1e-5)


def _devices(k: int) -> list[str]:
    return [f"cuda:{i % torch.cuda.device_count()}" for i in range(k)]


@pytest.mark.parametrize("parity", [0, 1])
def test_saved_segments_with_lazy_offload_match_eager_on_cuda(parity):
    from test_runtime import _saving_pipeline, eager_step

    spec, ref, pipe, x, y = _saving_pipeline("llama-demo", parity, devices=_devices(2))
    assert all(d.offloader is not None and d.handoffs is not None for d in pipe.devices)
    for step in range(2):  # the second step reuses the offloaders, streams and pinned buffers
        for p in (*spec.model.parameters(), *ref.parameters()):
            p.grad = None
        loss = pipe.forward_backward(x, target=y)
        ref_loss = eager_step(ref, spec.loss_fn, x, y, pipe.microbatches)
        torch.testing.assert_close(loss, ref_loss, **GPU_TOL)
        ref_params = dict(ref.named_parameters())
        for name, p in spec.model.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, **GPU_TOL,
                                       msg=lambda m, n=name: f"step {step}: gradient of {n} differs: {m}")
    saving = {k % len(pipe.devices) for k, s in enumerate(pipe.plan.stages) if s.kind == "forward" and s.saved}
    for d in pipe.devices:
        assert d.offloader.pending == 0 and d.handoffs.pending == 0
        assert (d.offloader.peak_pending_bytes > 0) == (d.index in saving)


@pytest.mark.parametrize("host", [["embed"], False])
def test_compiled_decoder_trains_like_eager_on_cuda(host):
    """Two AdamW steps on a compiled decoder — weights prefetched in pieces on their own stream, the embedding
    looked up on the host or on the GPU — end at eager's weights."""
    import copy

    import rpcompile
    from rpcompile.models import load_model

    spec = load_model("llama-demo", batch_size=6)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=_devices(2), microbatches=3,
                             spec="rtx4090", time_limit_s=2.0, host_embedding=host)
    assert list(pipe.plan.host) == (host or [])
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    from test_runtime import eager_step

    for _ in range(2):
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pipe.forward_backward(x, target=y)
        ref_loss = eager_step(ref, spec.loss_fn, x, y, pipe.microbatches)
        torch.testing.assert_close(loss, ref_loss, **GPU_TOL)
        opt.step(), ref_opt.step()
    for (name, p), r in zip(spec.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, **GPU_TOL, msg=lambda m, n=name: f"weight {n} after two steps: {m}")
