"""The memory of a loss that runs after the graph (the whole LM head): measured on meta, counted in the fused stage.

A GPU run (H200, 2026-11-26, benchmarks/gpu.py --sections seqlen) of a 4-layer Llama-3-8B slice at 125,952 tokens
with the whole head ran out of memory in the fused stage, needing about 152 GiB where the plan said 81.62 GiB: the
loss's fp32 copy of the logits, log-softmax and gradients were counted nowhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rpcompile.models.registry import lm_loss, load_model
from rpcompile.passes.cost.loss_memory import LOSS_BYTES_KEY, PeakBytes
from rpcompile.passes.formulate import partition_problem
from rpcompile.passes.rewrite.coarsen import segments_of
from rpcompile.passes.solver.problem import SegmentPlan
from rpcompile.passes.solver.timing import stage_costs
from rpcompile.planner.plan_options import PlanOptions, make_hardware
from rpcompile.planner.planning import prepare

T, V = 16, 256


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_lm_loss_holds_six_bf16_logits_beside_its_input(device):
    """bf16 logits [1, T, V]: the fp32 copy and log-softmax in forward (4 + 4 bytes a logit), then in backward the
    log-softmax, its gradient and the fp32 logits' gradient (4 + 4 + 4): 12 bytes a logit at the peak, plus a few
    scalars. The same on meta as in a real bf16 run on the CPU."""
    x = torch.randn(1, T, V, dtype=torch.bfloat16, device=device, requires_grad=True)
    y = torch.randint(0, V, (1, T), device=device)
    peak = PeakBytes([x, y])
    with peak:
        lm_loss(x, y).backward()
    assert T * V * 12 <= peak.peak <= T * V * 12 + 64


def _whole_head(precision: str, with_loss: bool):
    ms = load_model("llama-demo")
    x, y = ms.example_inputs[0][:1], ms.example_target[:1]
    loss = dict(loss_fn=ms.loss_fn, example_target=y) if with_loss else {}
    gm, _ = prepare(ms.model, (x,), PlanOptions(gpus=2, spec="rtx4090", precision=precision, microbatches=1,
                    head_chunks=1), **loss)
    assert x.shape == (1, 32) and ms.model.lm_head.out_features == 256
    return gm, partition_problem(gm, hardware=make_hardware(2, "rtx4090", None), microbatches=1, precision=precision)


@pytest.mark.parametrize("precision, logit_bytes", [("bf16", 12), ("fp32", 12)])
def test_the_whole_head_plan_counts_the_loss_in_the_fused_stage(precision, logit_bytes):
    """The last segment (always in the fused stage) carries the loss's peak; without a loss nothing changes."""
    gm, problem = _whole_head(precision, with_loss=True)
    loss = gm.meta[LOSS_BYTES_KEY]
    assert 32 * V * logit_bytes <= loss <= 32 * V * logit_bytes + 64  # llama-demo: 32 tokens
    assert problem.act_bytes[-1] == segments_of(gm)[-1].act_bytes + loss
    bare, bare_problem = _whole_head(precision, with_loss=False)
    assert LOSS_BYTES_KEY not in bare.meta
    assert bare_problem.act_bytes[:-1] == problem.act_bytes[:-1]
    assert bare_problem.act_bytes[-1] == problem.act_bytes[-1] - loss


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_split_head_chunk_s_cross_entropy_gradients_count_in_its_stage(precision):
    """Split head (2 chunks of 16 tokens): each chunk's cross-entropy backward makes the gradients of its fp32
    log-softmax and logits, 8 bytes a logit beside the 4 it keeps. The fused stage holding the head needs exactly
    that much more than a model blind to backward transients (the largest of its segments': they do not add)."""
    ms = load_model("llama-demo")
    x, y = ms.example_inputs[0][:1], ms.example_target[:1]
    gm, _ = prepare(ms.model, (x,), PlanOptions(gpus=2, spec="rtx4090", precision=precision, microbatches=1,
                    head_chunks=2), loss_fn=ms.loss_fn, example_target=y)
    pb = partition_problem(gm, hardware=make_hardware(2, "rtx4090", None), microbatches=1, precision=precision)
    chunks = [i for i, name in enumerate(pb.names) if name.startswith("lm_head.chunk")]
    assert len(chunks) == 2 and all(pb.transient_bytes[i] == 16 * V * 8 for i in chunks)
    k = chunks[0]
    plan = SegmentPlan(forward=((0, k),), fused=(k, pb.n), backward=((0, k),), saved=(False,) * pb.n)
    blind = dataclasses.replace(pb, transient_bytes=())
    fb, fb_blind = stage_costs(pb, plan)[1], stage_costs(blind, plan)[1]
    assert fb.kind == "fused" and fb.memory_bytes - fb_blind.memory_bytes == 16 * V * 8
