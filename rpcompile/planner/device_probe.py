"""The GPU a plan with measured costs is made for, measured when the plan is made.

A plan whose node costs are measured on a GPU (``compile`` without ``spec=``, ``plan --device cuda``) prices that
GPU: :func:`device_spec` starts from the preset of the same GPU family (:func:`preset_for`; an unknown GPU starts
from ``rtx4090``) and replaces

- ``memory_bytes``: the device's own;
- ``host_link_bandwidth``: pinned host ↔ device copies in the pieces the runtime copies in
  (:data:`rpcompile.runtime.devices.WEIGHT_CHUNK_BYTES`), the slower direction (:func:`probe_link`).

The host's dispatch per graph node (``dispatch_s``, ``backward_dispatch_s``) stays the preset's, taken from the
runtime itself (:data:`rpcompile.core.specs.GPU_DISPATCH_S`): a bare traced model's dispatch
(:func:`probe_dispatch`) is a fraction of what the runtime pays per node, so a bare probe would not measure it.
``benchmarks/gpu.py`` records both on every GPU row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..core.errors import ConfigError
from ..core.specs import DeviceSpec, get_spec
from ..models.llama import Llama, LlamaConfig
from ..runtime.devices import WEIGHT_CHUNK_BYTES
from .probe import best_time

__all__ = ["preset_for", "probe_link", "probe_dispatch", "device_spec", "DEFAULT_PRESET"]

#: The preset an unknown GPU's spec starts from (the planner's default hardware).
DEFAULT_PRESET = "rtx4090"
#: GPU name fragments (``torch.cuda.get_device_name``) → preset, first match wins.
_FAMILIES = (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80g"), ("4090", "rtx4090"),
             ("3090", "rtx3090"))


def preset_for(name: str) -> str:
    """The preset of the GPU called ``name`` (``NVIDIA H100 80GB HBM3`` → ``h100-sxm``), else
    :data:`DEFAULT_PRESET`."""
    low = name.lower()
    return next((preset for frag, preset in _FAMILIES if frag in low), DEFAULT_PRESET)


def probe_link(device: torch.device, *, pieces: int = 8, piece_bytes: int = WEIGHT_CHUNK_BYTES,
               repeats: int = 3) -> float:
    """Pinned host ↔ device copies of ``pieces`` pieces of ``piece_bytes`` each way on CUDA ``device``: the slower
    direction's rate (bytes/s), which a stage's copies get per direction."""
    if pieces < 1 or piece_bytes < 1 or repeats < 1:
        raise ConfigError(f"probe_link: pieces, piece_bytes and repeats must be >= 1, got {pieces}, {piece_bytes}, "
                          f"{repeats}")
    # bf16 elements, two bytes each: a piece is as large as the runtime's weight chunks
    n = piece_bytes // 2
    # pinned, as the runtime's host copies are: only pinned memory copies asynchronously at the link's full rate
    host = [torch.empty(n, dtype=torch.bfloat16, pin_memory=True) for _ in range(pieces)]
    dev = [torch.empty(n, dtype=torch.bfloat16, device=device) for _ in range(pieces)]

    def up() -> None:
        for d, h in zip(dev, host):
            d.copy_(h, non_blocking=True)

    def down() -> None:
        for d, h in zip(dev, host):
            h.copy_(d, non_blocking=True)

    def sync() -> None:
        torch.cuda.synchronize(device)

    moved = pieces * n * 2
    return moved / max(best_time(up, repeats, sync=sync), best_time(down, repeats, sync=sync))


def _probe_model() -> torch.nn.Module:
    """Two decoder layers of the Qwen3 kind (rpcompile's own Llama with qk-norm) at a size whose kernels take
    microseconds, so the host's dispatch, not the device, sets the pace."""
    return Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                             max_seq_len=16, qk_norm=True))


def _autograd_nodes(root: torch.Tensor) -> int:
    """The autograd graph's nodes behind ``root`` (what a backward dispatches)."""
    # keyed by id() but holding each node: autograd hands out a fresh Python wrapper per access and frees it when
    # dropped, so an id seen earlier could come back as another node's and end the walk early
    seen: dict[int, Any] = {}
    stack = [root.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return len(seen)


def probe_dispatch(device: "torch.device | str", *, repeats: int = 5, calls: int = 10) -> tuple[float, float]:
    """``(forward, backward)``: the host's seconds per graph node to run a traced model's forward on ``device``
    (``torch.fx`` generated code, as a stage runs) and per autograd node to run its backward, each the best of
    ``repeats`` rounds of ``calls`` calls timed to their completion. On a GPU the kernels are shorter than their
    dispatch, so this is the host's time; on a CPU it includes the (tiny) computation."""
    if repeats < 1 or calls < 1:
        raise ConfigError(f"probe_dispatch: repeats and calls must be >= 1, got {repeats}, {calls}")
    device = torch.device(device)
    # a fixed seed for the probe model, without moving the caller's CPU generator; devices=[] leaves CUDA's alone
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gm = torch.fx.symbolic_trace(_probe_model()).to(device)
    x = torch.randint(0, 64, (2, 16), device=device)
    # placeholders, get_attr and output dispatch no kernel: only call nodes count
    nodes = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forward() -> None:
        with torch.no_grad():
            for _ in range(calls):
                gm(x)

    # the forward with autograd recording and the loss, but no backward: step() minus this is the backward alone
    def graph() -> None:
        for _ in range(calls):
            gm(x).float().sum()

    def step() -> None:
        for _ in range(calls):
            gm(x).float().sum().backward()

    fwd = best_time(forward, repeats, sync=sync) / (calls * nodes)
    with torch.enable_grad():
        backward_nodes = _autograd_nodes(gm(x).float().sum())
        backward = best_time(step, repeats, sync=sync) - best_time(graph, repeats, sync=sync)
        # two best-of timings subtracted: noise can make the difference negative on a fast backward
        bwd = max(backward, 0.0) / (calls * backward_nodes)
    return fwd, bwd


def device_spec(device: "torch.device | str") -> DeviceSpec:
    """The spec of CUDA ``device`` as this machine has it: its family's preset with its own
    memory and host link."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ConfigError(f"device_spec measures a CUDA device, got {device}; plan for the CPU with spec='cpu'")
    base = get_spec(preset_for(torch.cuda.get_device_name(device)))
    return dataclasses.replace(base, memory_bytes=int(torch.cuda.get_device_properties(device).total_memory),
                               host_link_bandwidth=probe_link(device))
