"""The executor's measured timeline against the simulator fed by measured costs (the machinery; the accuracy
targets are measured by benchmarks/simulator.py, not asserted by timed tests)."""

from __future__ import annotations

import math

import torch

from rpcompile.models.llama import Llama, LlamaConfig
from rpcompile.models.registry import lm_loss
from rpcompile.tools.simulator_validation import compile_for_validation, validate


def test_measured_timeline_compares_with_the_simulator():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=128, dim=64, ffn_dim=128, n_layers=2, n_heads=4, max_seq_len=32))
    x, y = torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32))
    pipe = compile_for_validation(model, (x,), devices=["cpu", "cpu"], loss_fn=lm_loss, microbatches=2)
    assert pipe.gm.meta["rpcompile.calibration"]["applied"] in (True, False)
    v = validate(pipe, x, target=y, iterations=2, warmup=1)
    assert [s.name for s in v.stages] == [s.name for s in pipe.plan.stages]
    for s in v.stages:
        assert s.predicted_s > 0 and s.measured_s > 0 and math.isfinite(s.ratio), s
        # a units or bookkeeping bug shows up as three orders of magnitude (ms for s) or more; a loaded 2-core
        # machine stretches this small model's stages 2-6x idle and its iteration 3-4x idle, 10.2x beside another
        # test worker (fresh-clone CI, 2026-11-26): timing is not what this test checks
        assert 0.01 < s.ratio < 100, s
    assert 0.01 < v.iteration_ratio < 100, v
    d = v.to_dict()
    assert d["iteration_ratio"] == v.iteration_ratio and len(d["stages"]) == len(v.stages)
    # gradients still land: validate zeroes them after each run, a last call refills them
    pipe.forward_backward(x, target=y)
    assert all(p.grad is not None for p in model.parameters())
