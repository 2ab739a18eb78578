"""The GPU a measured plan is for (:mod:`rpcompile.planner.device_probe`): its preset by name, its link and its host's
dispatch measured. The CUDA parts run under ``-m gpu``; the rest here on the CPU."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import rpcompile.planner.plan_options as plan_options
from rpcompile.core.errors import ConfigError
from rpcompile.core.specs import get_spec
from rpcompile.planner.device_probe import (DEFAULT_PRESET, _autograd_nodes, _probe_model, device_spec, preset_for,
                                            probe_dispatch, probe_link)


@pytest.mark.parametrize("name,preset", [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-sxm"),
                                         ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80g"),
                                         ("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
                                         ("NVIDIA L40S", DEFAULT_PRESET)])
def test_a_gpu_starts_from_its_family_s_preset(name, preset):
    assert preset_for(name) == preset


def test_the_dispatch_probe_runs_on_any_device():
    fwd, bwd = probe_dispatch("cpu", repeats=2, calls=2)
    assert 0 < fwd < 1e-2 and 0 < bwd < 1e-2 and math.isfinite(fwd + bwd)
    with pytest.raises(ConfigError, match="repeats and calls must be >= 1"):
        probe_dispatch("cpu", calls=0)


def test_only_a_cuda_device_is_probed():
    with pytest.raises(ConfigError, match="device_spec measures a CUDA device, got cpu"):
        device_spec("cpu")
    with pytest.raises(ConfigError, match="pieces, piece_bytes and repeats must be >= 1"):
        probe_link(torch.device("cuda"), pieces=0)


def test_a_plan_measured_on_a_gpu_is_for_that_gpu(monkeypatch):
    """Costs measured on a GPU: the plan's hardware is that GPU as :func:`device_spec` measures it (not the RTX
    4090 preset, whose 25 GB/s link the 2026-11-28 H100 plans priced); on the CPU the ``cpu`` preset; a meta
    model or no device, the RTX 4090."""
    seen = []
    probed = dataclasses.replace(get_spec("h100-sxm"), host_link_bandwidth=51.5e9)
    monkeypatch.setattr(plan_options, "device_spec", lambda d: seen.append(d) or probed)
    assert plan_options.default_spec(None, "cuda:0", "cpu") is probed and seen == [torch.device("cuda:0")]
    assert plan_options.default_spec(None, "cpu", "cpu") == "cpu"
    assert plan_options.default_spec(None, None, "cpu") == "cpu"
    assert plan_options.default_spec(None, "cuda:0", "meta") == "rtx4090"
    assert plan_options.default_spec("h200", "cuda:0", "cpu") == "h200" and len(seen) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_device_s_spec_is_measured():
    spec = device_spec("cuda:0")
    assert spec.name == preset_for(torch.cuda.get_device_name(0))
    assert 1e9 < spec.host_link_bandwidth < 1e12
    assert spec.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    fwd, bwd = probe_dispatch("cuda:0")
    assert 0 < fwd < 1e-3 and 0 < bwd < 1e-3


class _Wrapper:
    """An autograd node as Python sees it: a fresh wrapper at each access, freed when dropped (so CPython may give
    the next one a freed one's address, and id())."""

    def __init__(self, depth: int):
        self.depth = depth

    @property
    def next_functions(self):
        return ((_Wrapper(self.depth - 1), 0),) if self.depth > 1 else ()


def test_the_backward_probe_counts_every_autograd_node_though_python_reuses_their_ids():
    """A GPU machine's probe counted 2 of the probe model's 211 autograd nodes (so 2.2 ms "a node"): the walk keyed
    nodes by id() of wrappers it let go, and a new wrapper took a dropped one's id."""
    root = type("Root", (), {"grad_fn": _Wrapper(200)})()
    assert _autograd_nodes(root) == 200
    gm = torch.fx.symbolic_trace(_probe_model())
    assert _autograd_nodes(gm(torch.randint(0, 64, (2, 16))).float().sum()) == 211
