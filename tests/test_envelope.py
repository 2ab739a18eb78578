"""The operating envelope (rpcompile/planner/envelope.py): a plan bound by the host link warns once, with the tokens per
microbatch at which it would be compute-bound; a compute-bound plan says nothing."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

import rpcompile
from rpcompile.cli import main
from rpcompile.core.plan import Plan
from rpcompile.core.specs import get_spec
from rpcompile.models.registry import load_model
from rpcompile.planner.envelope import LinkBoundWarning, link_bound, microbatch_tokens


def _plan(*stages: tuple[str, int, float], microbatches: int = 4) -> Plan:
    """A duck-typed plan: (name, weight bytes, compute seconds per microbatch) per stage, a 1 GB/s link."""
    spec = SimpleNamespace(stage_overhead_s=0.0)
    hw = SimpleNamespace(link_bytes_per_s=1e9, spec=spec)
    made = [SimpleNamespace(name=n, weight_bytes=w, compute_s=c) for n, w, c in stages]
    return cast(Plan, SimpleNamespace(hardware=hw, microbatches=microbatches, stages=made))


def test_rule_and_exact_message():
    # F0: 10 MB up = 10 ms vs 4 x 1 ms compute: link-bound by 2.5x -> 100 tokens x 2.5 = 250 tokens
    # F1: 2 MB = 2 ms vs 4 x 1 ms: compute-bound; B1: 20 MB = 20 ms vs 4 x 2 ms: 2.5x as well
    plan = _plan(("F0", 10_000_000, 1e-3), ("F1", 2_000_000, 1e-3), ("B1", 20_000_000, 2e-3))
    found = link_bound(plan, 100)
    assert found is not None and found.stages == ("F0", "B1") and found.compute_bound_tokens == 250
    assert found.message() == (
        "link-bound plan: 2 of 3 stages take longer to upload their weights than to compute their 4 microbatches "
        "of 100 tokens (worst F0: 10.00 ms upload vs 4.00 ms compute); it would be compute-bound from about 250 "
        "tokens per microbatch (a lower estimate: compute taken as linear in the tokens)")
    # four times the tokens: every stage computes longer than its upload (compute taken as linear in tokens)
    assert link_bound(_plan(("F0", 10_000_000, 4e-3), ("B1", 20_000_000, 8e-3)), 400) is None


def test_microbatch_tokens():
    assert microbatch_tokens((torch.zeros(9, 128, dtype=torch.long),), 3) == (384, "tokens")
    assert microbatch_tokens((torch.zeros(8, 3, 16, 16),), 4) == (2, "samples")
    assert microbatch_tokens(()) == (0, "samples")


def _plan_with_warnings(name: str, seq_len: int) -> tuple[Plan, list[Any]]:
    ms = load_model(name, seq_len=seq_len, batch_size=3, device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = rpcompile.plan(ms.model, ms.example_inputs, gpus=2, spec="rtx4090", precision="bf16",
                              time_limit_s=1.0, head_chunks=1)
    return plan, [w for w in caught if issubclass(w.category, LinkBoundWarning)]


def test_plan_warns_once_when_link_bound():
    # Qwen3-1.7B's shape with 16 tokens per microbatch: each stage moves ~100s of MB for microseconds of compute
    plan, caught = _plan_with_warnings("llama-1.7b", 16)
    assert len(caught) == 1
    found = link_bound(plan, 16)
    assert found is not None and str(caught[0].message) == found.message()
    assert found.compute_bound_tokens > 16


def test_plan_silent_when_compute_bound():
    _, caught = _plan_with_warnings("llama-demo", 32)
    assert caught == []


def test_cli_prints_the_warning_once(capsys):
    code = main(["plan", "llama-1.7b", "--gpus", "2", "--spec", "rtx4090", "--seq-len", "16", "--time-limit", "1",
                 "--head-chunks", "1"])
    out, err = capsys.readouterr()
    assert code == 0
    lines = [ln for ln in err.splitlines() if "link-bound" in ln]
    assert len(lines) == 1 and lines[0].startswith("rpcompile: warning: link-bound plan: ")
    assert "compute-bound from about" in lines[0]
    assert "link-bound" not in out


@pytest.mark.parametrize("argv", [["llama-demo", "--gpus", "2", "--spec", "rtx4090", "--time-limit", "1",
                                   "--head-chunks", "1"]])
def test_cli_silent_when_compute_bound(capsys, argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 0 and "link-bound" not in err + out


def test_compile_warns_once_when_link_bound():
    # a tiny model on a spec whose host link moves 1 MB/s: every stage waits on its weights
    slow = dataclasses.replace(get_spec("rtx4090"), name="slow-link", host_link_bandwidth=1e6)
    ms = load_model("llama-demo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = rpcompile.compile(ms.model, ms.example_inputs, loss_fn=ms.loss_fn, devices=["cpu", "cpu"], spec=slow,
                                 time_limit_s=1.0, head_chunks=1)
    found = [w for w in caught if issubclass(w.category, LinkBoundWarning)]
    assert len(found) == 1
    expected = link_bound(pipe.plan, *microbatch_tokens(ms.example_inputs, pipe.plan.microbatches))
    assert expected is not None and str(found[0].message) == expected.message()
