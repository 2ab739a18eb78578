"""benchmarks/peers.py in quick mode: eager, torch.distributed.pipelining (GPipe, 1F1B on 2 gloo processes) and
rpcompile on 2 logical CPU devices must agree on the loss and every gradient of one LLaMA training step."""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peers  # noqa: E402  (benchmarks/ is scripts, not a package; the spawned ranks import it by this name too)

# 1 timed step and no warm-up: this checks numbers, not speed. The cap on the pipelining processes keeps a stuck
# gloo rendezvous from hanging the suite (run_pipelining terminates the ranks and raises TimeoutError).
SETUP = replace(peers.Setup(**peers.QUICK), steps=1, warmup=0, timeout_s=90.0)
LOSS_ATOL = 1e-5
"""fp32 losses near 5.5 differ by ~1e-6 at most through reordered sums."""
GRAD_RTOL = 1e-5
"""Gradient differences relative to the largest eager gradient (seen: ~2e-7 relative)."""


@pytest.fixture(scope="module")
def report() -> dict:
    return peers.compare(SETUP)


def test_every_system_ran(report: dict) -> None:
    got = [(r["system"], r["schedule"]) for r in report["rows"]]
    assert got[:4] == [("eager", "-"), ("eager", "- (1 thread)"), ("torch pipelining", "GPipe"),
                       ("torch pipelining", "1F1B")]
    assert [s for s, _ in got[4:]] == ["rpcompile"]
    assert all(r["step_ms"] > 0 and len(r["times_ms"]) == SETUP.steps for r in report["rows"]), report["rows"]


@pytest.mark.parametrize("system", ["GPipe", "1F1B", "rpcompile"])
def test_loss_and_gradients_equal_eager(report: dict, system: str) -> None:
    r = next(r for r in report["rows"] if system in (r["system"], r["schedule"]))
    assert r["loss_diff"] <= LOSS_ATOL, (r["system"], r["schedule"], r["loss"], report["eager_loss"])
    tol = GRAD_RTOL * report["max_abs_grad"]
    assert r["max_grad_diff"] <= tol, (r["system"], r["schedule"], r["max_grad_diff"], tol)


def test_tolerance_catches_a_missing_microbatch() -> None:
    """The gradient of the batch less its last microbatch (or the full one scaled by 1/m, a missed rescale) lies
    far outside GRAD_RTOL: the tolerance above would catch either bug."""
    model, x, y = peers.build(SETUP)
    full = copy.deepcopy(model)
    peers.lm_loss(full(x), y).backward()
    ref = peers.grads_of(full)
    keep = SETUP.batch - SETUP.batch // SETUP.microbatches
    peers.lm_loss(model(x[:keep]), y[:keep]).backward()
    tol = GRAD_RTOL * max(float(g.abs().max()) for g in ref.values())
    assert peers.grad_diff(ref, peers.grads_of(model)) > 100 * tol
    assert peers.grad_diff(ref, {n: g / SETUP.microbatches for n, g in ref.items()}) > 100 * tol
    assert peers.grad_diff(ref, {n: g for n, g in ref.items() if n != "lm_head.weight"}) == float("inf")

