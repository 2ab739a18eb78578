"""One trace for every LM-head split :func:`rpcompile.planner.planning.compile_plan` tries.

The splits' compilations start alike: the same model traced on the same microbatch, in the same precision; they differ
only from the ``loss_head`` pass on (which attaches the loss and splits the head in place). So the model is traced once
and each later split starts from a copy of that graph taken before any pass rewrote it: its own nodes (same names, each
node's ``meta`` copied), the same modules and parameters, as :func:`rpcompile.passes.rewrite.host.as_planned` copies a
graph. Every compilation also gets one :class:`~rpcompile.passes.graph.reuse.RunMemo` (``c.memo``): the shape and cost
passes of a later split take the body's shapes and costs from the first split's runs and run only the region the
``loss_head`` pass rewrote.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch.fx as fx

from rpcompile.passes.graph.reuse import RunMemo

__all__ = ["graph_copy", "TraceOnce"]


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that later passes may rewrite without touching ``gm``: a new graph (node names and
    ``meta`` copied, shallowly), the same submodules and parameters, ``gm.meta`` copied."""
    with warnings.catch_warnings():  # torch deep-copies an exported graph's pytree codegen with a deprecated check
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        graph = copy.deepcopy(gm.graph)
    out = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta = dict(gm.meta)
    return out


class TraceOnce:
    """The trace pass for ``count`` compilations of one model and inputs, run in turn: the first traces (with
    ``trace_pass``) and keeps a copy of its graph; each later one takes that graph, copied again while another
    compilation still follows (the last takes the kept copy itself). A compilation here is anything with the
    ``model``, ``args``, ``kwargs``, ``gm`` and ``memo`` fields of :class:`rpcompile.planner.planning.Compilation`."""

    def __init__(self, trace_pass: Callable[[Any], None], count: int) -> None:
        self.trace_pass, self.left = trace_pass, count
        self.kept: fx.GraphModule | None = None
        self.memo = RunMemo()

    def __call__(self, c: Any) -> None:
        # left: how many compilations still follow this one
        self.left -= 1
        # one memo for all: a later split's shape and cost passes reuse the first split's runs of the body
        c.memo = self.memo
        if self.kept is None:
            self.trace_pass(c)
            if self.left > 0:
                # copied now, before the loss_head pass rewrites c.gm in place
                self.kept = graph_copy(c.gm)
            return
        if self.left > 0:
            c.gm = graph_copy(self.kept)
        else:
            # the last compilation takes the kept graph itself (no copy left to protect), and this lets go of it
            c.gm, self.kept = self.kept, None
