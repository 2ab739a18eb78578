"""``rpcompile check``: is a checked-in plan stale, no longer right for its model?

A plan goes stale when the model changes, when rpcompile's cost model or partitioner change, or when someone
edits it by hand. :func:`check_plan` reports one line per problem, starting with its kind:

- ``corrupt`` — the file is not a readable plan;
- ``stale model`` — the fingerprint differs (nothing else is checked);
- ``invalid`` — a ``verify_plan`` rule fails;
- ``stale cuts`` — a stage boundary is no longer a cut point of today's coarsening (re-plan);
- ``does not fit`` — under today's costs a stage needs more memory than the hardware has;
- ``stale prediction`` — (analytic cost models) the predicted iteration time in the file differs from today's
  by more than the margin;
- ``regressed`` — a fresh plan is more than the margin faster.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rpcompile.core.units import fmt_bytes
from rpcompile.passes.formulate import partition_problem
from rpcompile.passes.graph.fingerprint import fingerprint
from rpcompile.passes.graph.util import compute_nodes
from rpcompile.passes.plan_inputs import moved_inputs, solve_inputs
from rpcompile.passes.rewrite.coarsen import segments_of
from rpcompile.passes.solver.problem import SegmentPlan
from rpcompile.passes.solver.segment_rules import validate_segment_plan
from rpcompile.passes.solver.timing import iteration_time, stage_costs

from ..core.errors import InfeasibleError, PlanFileError
from ..core.plan import Plan
from ..planner.invariants import plan_violations
from ..planner.plan_options import PlanOptions
from ..planner.planning import plan_graph, prepare

__all__ = ["CheckResult", "check_plan", "rescore", "stays_of", "sums_of"]


@dataclass
class CheckResult:
    path: str
    problems: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        f = self.figures
        if not self.ok:
            return f"{self.path}: {len(self.problems)} problem{'s' * (len(self.problems) != 1)}"
        if not f.get("resolved", True):
            return (f"{self.path}: OK — {f['stages']} stages on {f['devices']} × {f['spec']}, peak {f['peak']} of "
                    f"{f['memory']}, predicted {f['iteration_s'] * 1e3:.3f} ms; not re-solved: "
                    f"{f['resolve_reason']} (--resolve to solve again)")
        return (f"{self.path}: OK — {f['stages']} stages on {f['devices']} × {f['spec']}, peak {f['peak']} of "
                f"{f['memory']}, predicted {f['iteration_s'] * 1e3:.3f} ms, a fresh plan {f['fresh_iteration_s'] * 1e3:.3f} ms "
                f"({f['regression']:+.1%}; re-solved: {f['resolve_reason']})")

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.path, "ok": self.ok, "problems": list(self.problems), **self.figures}


def _quiet(text: str) -> Any:
    return nullcontext()


def rescore(plan: Any, gm: Any) -> tuple[Any, list[str]]:
    """The plan as a :class:`~rpcompile.passes.solver.problem.SegmentPlan` over today's segments of ``gm``, or ``None`` and the
    stage boundaries that are no longer cut points."""
    order = {n.name: i for i, n in enumerate(compute_nodes(gm))}
    segs = segments_of(gm)
    # node position → segment index at every cut point of today's segments, the graph's end included
    seg_at = {s.start: s.index for s in segs} | {segs[-1].stop: len(segs)}
    ranges, bad = [], []
    for s in plan.stages:
        a, b = order[s.nodes[0]], order[s.nodes[-1]] + 1
        if a not in seg_at or b not in seg_at:
            bad.append(f"stale cuts: stage {s.name} ({s.nodes[0]} … {s.nodes[-1]}) no longer starts and ends at "
                       "cut points of the model's segments; re-plan")
            continue
        ranges.append((s.kind, seg_at[a], seg_at[b]))
    if bad:
        return None, bad
    saved_nodes = set(plan.saved)
    # the plan saves nodes, the solver segments: a segment is saved when all its nodes are (an empty one never is)
    saved = tuple(bool(s.nodes) and all(n in saved_nodes for n in s.nodes) for s in segs)
    fused = next((a, b) for k, a, b in ranges if k == "fused")
    return SegmentPlan(forward=tuple((a, b) for k, a, b in ranges if k == "forward"), fused=fused,
                       backward=tuple((a, b) for k, a, b in ranges if k == "backward"),
                       saved=tuple(x and i < fused[0] for i, x in enumerate(saved)),
                       stays=stays_of(plan, segs, fused[0]), resident=plan.resident,
                       accumulates=sums_of(plan, segs, gm)), []


def stays_of(plan: Any, segs: Sequence[Any], fused_start: int) -> tuple[bool, ...]:
    """Per segment, whether the plan keeps its own parameters (those no other segment reads) on the device for
    its backward stage: the ``SegmentPlan.stays`` the plan was lowered from (none for a resident plan, which keeps
    everything)."""
    kept = {p for s in plan.forward_stages for p in s.keeps}
    readers = Counter(p for s in segs for p in set(s.params))
    # a segment's own parameters are those no other segment reads; a shared one (a tied embedding) is no segment's stay
    own = [{p for p in s.params if readers[p] == 1} for s in segs]
    return tuple(not plan.resident and bool(mine) and i < fused_start and mine <= kept for i, mine in enumerate(own))


def check_plan(path: str | Path, model: Any, example_inputs: Sequence[Any], *, max_regression: float = 0.02,
               time_limit_s: float = 10.0, progress: bool | None = False, loss_fn: Any = None,
               example_target: Any = None, status: Any = None, resolve: bool = False) -> CheckResult:
    """Check the plan file at ``path`` against ``model`` (the problems: module docstring). A plan made with a split LM
    head (``head_chunks > 1``) needs ``loss_fn`` and ``example_target`` to rebuild its graph. ``progress`` is the
    profiler's bar; ``status(text)``, a context manager, shows the fresh plan's solve (the CLI's spinner).
    ``resolve``: solve a fresh plan even when none of the plan's inputs moved.

    :func:`check_plan` traces and costs the model with the plan's own cost model, hardware, precision and microbatch
    count, re-scores the plan's stages under today's costs and plans afresh with the plan's strategy, and reports one
    line per problem.

    A fresh plan is solved only when something the plan was solved from moved (:mod:`rpcompile.passes.plan_inputs`: the
    node costs, the partition problem, the hardware, the planning options or rpcompile's partitioner), when the plan
    records none of it (older plans, hand-made ones), or when asked (``resolve=True``, ``check --resolve``): otherwise a
    fresh solve would find the same plan. The result says which, and why (``figures["resolved"]``,
    ``figures["resolve_reason"]``).
    """
    result = CheckResult(str(path))
    try:
        plan = Plan.load(path)
    except PlanFileError as e:
        text = str(e)
        # the error starts with the file's name, which the result's path already says
        result.problems.append("corrupt: " + (text.split(" is corrupt: ", 1)[1] if " is corrupt: " in text else text))
        return result
    hw = plan.hardware
    measured = plan.cost_model.startswith("measured")
    spec = None if measured else hw.spec
    device = "cpu" if measured else None
    options = plan.inputs.get("options", {})
    allow_save = bool(options.get("allow_save", True))
    allow_stay = bool(options.get("allow_stay", True))
    overlap = plan.predicted.overlap_iterations  # priced and re-solved for the mode it was made for

    def graph(host: Any) -> tuple[Any, int]:
        return prepare(model, example_inputs, PlanOptions(gpus=hw.device_count, spec=spec, device=device,
                       microbatches=plan.microbatches, precision=plan.precision, progress=progress,
                       head_chunks=plan.head_chunks, host_embedding=host,
                       segments_per_layer=int(options.get("segments_per_layer", 2)),
                       max_segments=options.get("max_segments")), loss_fn=loss_fn, example_target=example_target)

    try:
        # exactly the plan's lookups; for none, False (True would let the pass choose by table size)
        gm, m = graph(plan.host or False)
    except ValueError:  # the lookups the plan runs on the host are not in this model: the fingerprint says so
        if not plan.host:
            raise
        gm, m = graph(False)
    diffs = plan.model.differences(fingerprint(gm))
    if diffs:
        result.problems.append(f"stale model: the plan was made for a different model ({'; '.join(diffs)}); re-plan")
        return result
    result.problems += [f"invalid: {v}" for v in plan_violations(plan, gm)]
    problem = partition_problem(gm, hardware=hw, microbatches=plan.microbatches, precision=plan.precision,
                                allow_save=allow_save, allow_stay=allow_stay, overlap_iterations=overlap)
    sp, bad = rescore(plan, gm)
    result.problems += bad
    if sp is None:
        return result
    costs = stage_costs(problem, sp)
    for v in validate_segment_plan(problem, sp):
        result.problems.append(f"does not fit: {v}")
    now = iteration_time(problem, sp)
    # measured times differ from run to run and machine to machine: only an analytic prediction must repeat
    if not measured and abs(now / plan.predicted.iteration_time_s - 1) > max_regression:
        result.problems.append(
            f"stale prediction: the plan predicts {plan.predicted.iteration_time_s * 1e3:.3f} ms per iteration but "
            f"today's cost model gives {now * 1e3:.3f} ms ({now / plan.predicted.iteration_time_s - 1:+.1%}); re-plan "
            "to refresh it")
    peak = max(c.memory_bytes for c in costs)
    result.figures = {
        "stages": len(plan.stages), "devices": hw.device_count, "spec": hw.spec.name,
        "peak": fmt_bytes(peak), "memory": fmt_bytes(hw.memory_bytes), "peak_memory_bytes": peak,
        "iteration_s": now, "fresh_iteration_s": None, "regression": None,
    }
    # a hand-made plan may name a strategy plan_graph does not run: the fresh plan is the ILP's then
    strategy = plan.strategy if plan.strategy in ("ilp", "dp", "roundpipe", "uniform") else "ilp"
    # today's inputs under the strategy the plan records, so they compare with what the plan recorded
    reason = _resolve_reason(plan, solve_inputs(gm, problem, hw, strategy=plan.strategy, precision=plan.precision),
                             resolve)
    result.figures |= {"resolved": reason[0], "resolve_reason": reason[1]}
    if not reason[0]:
        return result
    try:
        with (status or _quiet)(f"solving a fresh {strategy} plan (up to {time_limit_s:g} s): {reason[1]}"):
            fresh = plan_graph(gm, hardware=hw, microbatches=plan.microbatches, strategy=strategy,
                               precision=plan.precision, time_limit_s=time_limit_s, allow_save=allow_save,
                               allow_stay=allow_stay,
                               cache=not resolve, overlap=overlap)  # --resolve: solve, even where the solve cache has it
    except InfeasibleError as e:
        result.problems.append(f"does not fit: {e}")
        return result
    regression = now / fresh.predicted.iteration_time_s - 1
    if regression > max_regression:
        result.problems.append(
            f"regressed: the plan takes {now * 1e3:.3f} ms per iteration but a fresh {fresh.strategy} plan takes "
            f"{fresh.predicted.iteration_time_s * 1e3:.3f} ms ({regression:+.1%}, allowed {max_regression:+.1%}; "
            f"re-solved: {reason[1]}); re-plan")
    result.figures |= {"fresh_iteration_s": fresh.predicted.iteration_time_s, "regression": regression}
    return result


def _resolve_reason(plan: Plan, now: dict[str, Any], resolve: bool) -> tuple[bool, str]:
    """Whether ``check`` solves a fresh plan, and why (or why not)."""
    if resolve:
        return True, "asked to (--resolve)"
    if not plan.inputs:
        return True, ("the plan does not record what it was solved from (made before rpcompile recorded it, or "
                      "by hand)")
    moved = moved_inputs(plan.inputs, now)
    if moved:
        return True, "moved since the plan was solved: " + "; ".join(moved)
    return False, "nothing the plan was solved from moved (costs, problem, hardware, options, solver)"


def sums_of(plan: Any, segs: Sequence[Any], gm: Any) -> tuple[bool, ...]:
    """Per segment, whether the plan sums the gradients of its own trainable parameters on its grad stage's device:
    the ``SegmentPlan.accumulates`` the plan was lowered from."""
    summed = {p for s in plan.stages for p in s.accumulates}
    if not summed:
        # no sums: (), the form SegmentPlan gives an all-False accumulates
        return ()
    trainable = {n for n, p in gm.named_parameters() if p.requires_grad}
    readers = Counter(p for s in segs for p in set(s.params))
    own = [{p for p in s.params if readers[p] == 1 and p in trainable} for s in segs]
    return tuple(bool(mine) and mine <= summed for mine in own)
