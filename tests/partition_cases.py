"""Problem builders shared by the partition tests (plain numbers; no torch).

``llama_like`` gives LLaMA-shaped chains: an embedding segment, attention and MLP halves of every layer, and an
LM-head segment. Per-layer times follow the RoundPipe paper's RTX 4090 measurements (shared fixture
``roundpipe-simulator-inputs.json``: Llama3-8B 18.5 ms forward / 41.2 ms backward per layer, head 37 / 74.5 ms);
backward ≈ 2× forward, recompute = forward, PCIe 4.0 (25 GB/s), 24 GB per device.
"""

from __future__ import annotations

from rpcompile.passes.solver.problem import PartitionProblem, SharedParam

__all__ = ["llama_like", "qwen32b_like", "tiny_chain"]

MB = 10**6
GB = 10**9


def llama_like(layers: int = 32, *, hidden: int = 4096, intermediate: int = 14336, kv_dim: int = 1024,
               vocab: int = 128256, tokens: int = 8192, fwd_layer_s: float = 18.5e-3, head_fwd_s: float = 37.2e-3,
               devices: int = 8, microbatches: int = 16, memory_bytes: int = 24 * GB,
               link: float = 25 * GB, overhead_s: float = 0.2e-3, tied: bool = False) -> PartitionProblem:
    """``2·layers + 2`` segments: embed, (attn, mlp) × layers, head. 32 layers → 66, 64 → 130."""
    h2 = tokens * hidden * 2  # one bf16 hidden state for the microbatch
    attn_p = hidden * (2 * hidden + 2 * kv_dim) * 2
    mlp_p = 3 * hidden * intermediate * 2
    emb_p = vocab * hidden * 2
    attn_f = fwd_layer_s * 0.4
    mlp_f = fwd_layer_s * 0.6
    names, layer, fwd, act, peak, params = ["embed"], [0], [0.2e-3], [tokens * 8], [h2], [0 if tied else emb_p]
    for i in range(layers):
        names += [f"layers.{i}.attn", f"layers.{i}.mlp"]
        layer += [i + 1, i + 1]
        fwd += [attn_f, mlp_f]
        act += [int(4.5 * h2), int(h2 * (1 + 3 * intermediate / hidden))]
        peak += [3 * h2, int(h2 * 2 * intermediate / hidden)]
        params += [attn_p, mlp_p]
    logits = tokens * vocab * 4
    names.append("lm_head")
    layer.append(layers + 1)
    fwd.append(head_fwd_s)
    act.append(logits + h2)
    peak.append(logits)
    params.append(0 if tied else emb_p)
    n = len(names)
    shared = (SharedParam(name="embed.weight", bytes=emb_p, grad_bytes=emb_p, segments=(0, n - 1)),) if tied else ()
    return PartitionProblem(
        names=tuple(names), layer=tuple(layer), fwd_s=tuple(fwd), bwd_s=tuple(2 * f for f in fwd),
        rec_s=tuple(fwd), act_bytes=tuple(act), peak_bytes=tuple(peak), boundary_bytes=(h2,) * n,
        input_bytes=tokens * 8, param_bytes=tuple(params), grad_bytes=tuple(params), shared=shared,
        device_count=devices, memory_bytes=memory_bytes, link_bytes_per_s=link, microbatches=microbatches,
        stage_overhead_s=overhead_s,
    )


def qwen32b_like(layers: int = 64, **kw) -> PartitionProblem:
    """Qwen3-32B-shaped chain (64 layers → 130 segments): 40.6 ms forward per layer, head 55 ms."""
    return llama_like(layers, hidden=5120, intermediate=25600, kv_dim=1024, vocab=151936, fwd_layer_s=40.6e-3,
                      head_fwd_s=55e-3, **kw)


def tiny_chain(n: int = 4, *, devices: int = 2, microbatches: int = 3, memory_bytes: int = 10**6,
               **kw) -> PartitionProblem:
    """Uniform toy chain: every segment 1 s forward, 2 s backward, 1 s recompute, small bytes."""
    fields = dict(
        names=tuple(f"s{i}" for i in range(n)), layer=tuple(range(n)), fwd_s=(1.0,) * n, bwd_s=(2.0,) * n,
        rec_s=(1.0,) * n, act_bytes=(10,) * n, peak_bytes=(5,) * n, boundary_bytes=(4,) * n, input_bytes=4,
        param_bytes=(100,) * n, grad_bytes=(100,) * n, device_count=devices, memory_bytes=memory_bytes,
        link_bytes_per_s=1e9, microbatches=microbatches,
    )
    fields.update(kw)
    return PartitionProblem(**fields)
