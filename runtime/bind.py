"""Binding a :class:`~rpcompile.core.program.Program`: the runtime's half of the stage code.

The split pass leaves a program as data: a saved segment is called from its stages' graphs by name
(:func:`~rpcompile.core.program.saved_forward` / :func:`~rpcompile.core.program.saved_backward`) and random nodes
are plain ops. :func:`bind` makes it runnable, in place and once (binding a bound program changes nothing):

- each :class:`~rpcompile.core.program.SegmentSpec` becomes a :class:`~.segments.saved.SavedSegment`, which captures and
  runs the segment, and the stage graphs call its ``forward_call`` / ``backward_call``;
- every random node is seeded from (iteration, node, microbatch) (:func:`~.rng.seed_random_nodes`), so a
  recomputation draws the forward's mask.
"""

from __future__ import annotations

import torch.fx as fx

from rpcompile.core.program import Program, saved_backward, saved_forward

from .rng import seed_random_nodes
from .segments.saved import SavedSegment

__all__ = ["bind"]


def _call_segments(gm: fx.GraphModule, segments: dict[str, SavedSegment]) -> None:
    changed = False
    for node in gm.graph.find_nodes(op="call_function", target=saved_forward):
        # the first argument names the segment; the rest are what the segment takes
        node.target, node.args = segments[node.args[0]].forward_call, node.args[1:]
        changed = True
    for node in gm.graph.find_nodes(op="call_function", target=saved_backward):
        node.target, node.args = segments[node.args[0]].backward_call, node.args[1:]
        changed = True
    if changed:
        gm.recompile()


def bind(program: Program) -> Program:
    """Make ``program`` runnable (module docstring); returns it."""
    # a segment bound already is kept: binding twice changes nothing, and its captures stay
    segments = {s.name: s if isinstance(s, SavedSegment) else SavedSegment(s) for s in program.saved}
    program.saved = tuple(segments.values())
    for prog in program.stages:
        _call_segments(prog.gm, segments)
        seed_random_nodes(prog.gm)
    return program
