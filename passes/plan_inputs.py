"""What a plan was solved from: the record ``rpcompile check`` compares instead of solving again.

A plan is a function of its inputs, so when none of them moved a fresh solve would find the same plan and
``check`` need not run one. :func:`solve_inputs` makes the record (``Plan.inputs``, plain JSON),
:func:`moved_inputs` names what differs between two records:

- ``costs``: digest of every compute node's :class:`~rpcompile.passes.cost.cost_model.NodeCost` (times, bytes,
  FLOPs, parameters), in order;
- ``problem``: digest of the :class:`~.solver.problem.PartitionProblem` (the solvers' whole input, in plain numbers);
- ``hardware``: digest of the plan's :class:`~rpcompile.core.plan.Hardware` (spec, memory, link, host rates);
- ``options``: the planning options, readable (listed at :func:`solve_inputs`);
- ``solver``: digest of the partitioner's source, every file of ``passes/solver/``
  (:func:`~.solver.source.solver_digest`).

Each digest is a :func:`~rpcompile.core.digest.short_digest` of an exact ``repr`` (floats round-trip), so analytic
costs give the same digest on every run; measured costs differ from run to run, and their plans are always re-solved.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch.fx as fx

from rpcompile.core.digest import short_digest
from rpcompile.core.plan import Hardware
from rpcompile.passes.cost.cost_model import COST_KEY

from .graph.util import compute_nodes
from .rewrite.coarsen import COARSEN_META
from .rewrite.host import host_of
from .rewrite.loss_head import HEAD_CHUNKS_META
from .solver.problem import PartitionProblem
from .solver.source import solver_digest

__all__ = ["solve_inputs", "moved_inputs", "hardware_digest"]


def costs_digest(gm: fx.GraphModule) -> str:
    # repr of the frozen NodeCost: every field, floats exactly
    return short_digest("\n".join(f"{n.name}|{n.meta.get(COST_KEY)!r}" for n in compute_nodes(gm)))


def hardware_digest(hardware: Hardware) -> str:
    d = dataclasses.asdict(hardware)
    d["spec"] = hardware.spec.to_dict()
    d["host"] = hardware.host.to_dict() if hardware.host is not None else None
    # sorted: the digest must not depend on the order of the fields
    return short_digest(repr(sorted(d.items())))


def solve_inputs(gm: fx.GraphModule, problem: PartitionProblem, hardware: Hardware, *, strategy: str,
                 precision: str) -> dict[str, Any]:
    """The record of what a plan of ``gm`` was solved from (its fields: module docstring).

    ``options`` holds the planning options, readable: ``strategy``, ``microbatches``, ``precision``,
    ``memory_bytes``, ``head_chunks``, ``host`` embeddings, ``segments_per_layer``, ``max_segments``,
    ``allow_save``, ``allow_stay``, and ``overlap`` when the plan is for overlapped iterations. ``solver`` changes
    with the partitioner's source: a new partitioner may find a faster plan from the same inputs. A plan is a
    function of these inputs; a solve takes seconds to minutes, which ``check`` spares when none of them moved."""
    coarsen = gm.meta.get(COARSEN_META, {})
    options = {
        "strategy": strategy, "microbatches": problem.microbatches, "precision": precision,
        "memory_bytes": hardware.memory_bytes, "head_chunks": int(gm.meta.get(HEAD_CHUNKS_META, 1)),
        "host": [h.node for h in host_of(gm)], "segments_per_layer": coarsen.get("segments_per_layer", 2),
        "max_segments": coarsen.get("max_segments"), "allow_save": bool(problem.allow_save),
        "allow_stay": bool(problem.allow_stay),
    } | ({"overlap": True} if problem.host.overlap_iterations else {})  # recorded only when set: older plans match
    return {"costs": costs_digest(gm), "problem": problem.digest(), "hardware": hardware_digest(hardware),
            "options": options, "solver": solver_digest()}


def moved_inputs(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What differs between the ``recorded`` inputs and those of ``now``, one phrase each (empty: nothing moved)."""
    out = []
    old_opts, new_opts = dict(recorded.get("options", {})), dict(now.get("options", {}))
    changed = [f"{k} {old_opts.get(k)!r} → {new_opts.get(k)!r}" for k in sorted(set(old_opts) | set(new_opts))
               if old_opts.get(k) != new_opts.get(k)]
    if changed:
        out.append(f"options ({', '.join(changed)})")
    for key, what in (("hardware", "hardware (the plan's spec, memory, link or host rates)"),
                      ("costs", "costs (the node costs: the model's shapes or the cost model changed)"),
                      ("problem", "partition problem (the numbers the solver sees)"),
                      ("solver", "solver (rpcompile's partitioner changed)")):
        if recorded.get(key) != now.get(key):
            out.append(what)
    return out
