"""A lowered plan as data: the stage programs the split pass makes and the runtime runs.

Terms
-----
- **Value**: the output of a graph node (or a model input), named by the node's name.
- :class:`StageProgram`: one stage as a pure-ish function ``gm(*inputs) -> outputs``: ``inputs`` are the values it
  reads that other stages (or the model's inputs) produce; ``outputs`` are the values it produces that anybody
  else reads. Its parameters and buffers stay attributes of ``gm`` under their original names and are swapped for
  device copies with ``torch.func.functional_call``.
- :class:`SegmentSpec`: a *saved* segment (run without recomputation): its own graph, and where its forward and
  backward stages call it. Stage graphs call it through :func:`saved_forward` / :func:`saved_backward` by name;
  the runtime binds those calls to the object that captures and runs the segment
  (:func:`rpcompile.runtime.bind.bind`), so a program is plain data until it runs.
- :class:`HostEmbedding`: an embedding lookup the host runs before the first stage
  (:mod:`rpcompile.passes.rewrite.host`).
- :class:`Program`: all of the above for one plan, in execution order.

The passes make these (:mod:`rpcompile.passes.rewrite.split`) and write them out for people
(:mod:`rpcompile.passes.rewrite.codegen`); the runtime runs them (:mod:`rpcompile.runtime.executor`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Protocol

import torch
import torch.fx as fx
import torch.nn.functional as F

from .errors import RPCompileError
from .plan import Stage

__all__ = ["HostEmbedding", "SegmentSpec", "StageProgram", "Program", "Lowering", "saved_forward", "saved_backward",
           "HEAD_CLASSES_META"]

HEAD_CLASSES_META = "rpcompile.head_classes"
"""``gm.meta`` key: the classes the split LM head scores (its weight's rows), for the host's label check
(written by :mod:`rpcompile.passes.rewrite.loss_head`, read by the training session)."""


@dataclass(frozen=True)
class HostEmbedding:
    """One embedding lookup the host runs: ``value = embedding(index, weight, padding_idx)``."""

    node: str
    """The graph node it replaced (what a plan file records)."""
    value: str
    """The placeholder the device stages read its result from."""
    index: str
    """The model input holding the indices."""
    weight: str
    """The table's parameter name (canonical: a tied table is one parameter)."""
    padding_idx: int | None = None
    """Rows at this index get no gradient (``nn.Embedding(padding_idx=...)``)."""

    def forward(self, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.embedding(index, weight, self.padding_idx)

    def accumulate(self, grad_weight: torch.Tensor, index: torch.Tensor, grad: torch.Tensor) -> None:
        """Add the gradient of the looked-up rows into ``grad_weight`` (the table's ``.grad``), in place."""
        # every lookup as one row of the table's width, in the .grad's
        # dtype (the gradients come home in the compute precision)
        idx, rows = index.reshape(-1), grad.reshape(-1, grad_weight.shape[-1]).to(grad_weight.dtype)
        if self.padding_idx is not None:
            # as nn.Embedding: the padding row gets no gradient
            keep = idx != self.padding_idx
            idx, rows = idx[keep], rows[keep]
        # index_add_ sums repeated indices (a token looked up twice gets
        # both rows' gradients), where indexed assignment would keep one
        grad_weight.index_add_(0, idx, rows)


@dataclass(eq=False)
class SegmentSpec:
    """A saved segment: one forward stage runs its fw graph and ships what the backward needs to host memory, one
    backward stage runs its bw graph on that instead of recomputing it (:mod:`rpcompile.runtime.segments.saved`)."""

    name: str
    gm: fx.GraphModule
    """The segment's nodes as one graph: ``gm(*inputs) -> outputs`` with ``params`` and ``buffers`` as attributes."""
    params: list[tuple[str, ...]]
    """Attribute paths inside ``gm`` per unique parameter (tied weights: several paths)."""
    buffers: list[str]
    inputs: list[str]
    outputs: list[str]
    wants_grad: list[bool]
    """Per fw argument (params, buffers, inputs): whether its gradient is wanted (if a float tensor)."""
    nodes: tuple[str, ...] = ()
    """Names of the segment's nodes in the traced graph."""
    rewrite: Callable[[fx.GraphModule], Any] | None = None
    """Applied to each captured fw and bw graph (the split pass gives the stride-tolerant rewrite: a fake
    kernel's strides are a guess, and a real GPU kernel may lay its output out otherwise)."""

    @property
    def host_name(self) -> str:
        """The value a forward stage ships the saved tensors as (one per microbatch)."""
        return f"{self.name}::saved"


def _unbound(segment: str) -> RPCompileError:
    return RPCompileError(f"stage code calls saved segment {segment!r}, which no runtime has bound: run a Program "
                          "through rpcompile.runtime (Executor binds it), not its stage graphs by hand")


def saved_forward(segment: str, *flat: Any) -> tuple:
    """In a forward stage's graph: run saved segment ``segment`` (``flat``: params, buffers, inputs) and return
    ``(*outputs, saved)``. Bound by the runtime to the segment's ``forward_call``."""
    raise _unbound(segment)


def saved_backward(segment: str, saved: Any, *flat: Any) -> tuple:
    """In a backward stage's graph: the segment's outputs as one autograd node whose backward runs the bw graph on
    ``saved`` (``flat``: params, buffers, inputs, then the outputs as shipped). Bound by the runtime to the
    segment's ``backward_call``."""
    raise _unbound(segment)


@dataclass
class StageProgram:
    """One stage of a plan, ready to run (see module docstring)."""

    stage: Stage
    index: int
    """Position in execution order (stage k runs on device (k + offset) mod N)."""
    gm: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: dict[str, str] = field(default_factory=dict)
    """Attribute path inside ``gm`` -> canonical parameter name in the model."""
    buffers: dict[str, str] = field(default_factory=dict)
    """Attribute path inside ``gm`` -> canonical buffer name in the model."""
    out_codegen: Any = None
    """The fused stage: the original graph's codegen, to rebuild the model's output structure."""
    prologue: fx.GraphModule | None = None
    """What the stage computes from its frozen weights once, before its first microbatch (a 4-bit base's
    dequantizations, :mod:`rpcompile.passes.rewrite.dequantize`): no inputs, returns the ``derived`` weights."""
    derived: tuple[str, ...] = ()
    """Attribute paths inside ``gm`` the prologue's results are read from, in the order it returns them."""

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def kind(self) -> str:
        return self.stage.kind

    def model_output(self, raw: Any) -> Any:
        """The fused stage's raw result in the structure the model returns (a tensor, a tuple, a HF
        ``ModelOutput``)."""
        # only an exported graph has an output structure to rebuild; otherwise raw already is the model's result
        if getattr(self.out_codegen, "pytree_info", None) is not None:
            return self.out_codegen.process_outputs(raw)
        return raw


@dataclass
class Program:
    """Every stage of a plan, in execution order, plus what the runtime needs to feed them."""

    stages: list[StageProgram]
    placeholders: tuple[str, ...]
    """Names of the graph's input values, in order (the values of ``flat_inputs``)."""
    needs_grad: frozenset[str]
    """Values that depend on a trainable parameter (their gradient is propagated between stages)."""
    saved: tuple[SegmentSpec, ...] = ()
    """Segments run without recomputation: fw graph in the forward stage, bw graph in the backward stage (once
    bound, the runtime's :class:`~rpcompile.runtime.segments.saved.SavedSegment` objects, which keep their captures)."""
    host: tuple[HostEmbedding, ...] = ()
    """Embedding lookups the host runs before the first stage; their values are inputs of the stages that read
    them, and their gradients come back like any stage input's."""
    resident: bool = False
    """Every weight stays on its device across iterations (``Plan.resident``); otherwise the parameters a stage
    keeps there for a later one are its plan stage's ``keeps``."""

    @property
    def fused(self) -> StageProgram:
        return next(s for s in self.stages if s.kind == "fused")


class Lowering(Protocol):
    """What the training session asks of the compiler that lowered its plan into a :class:`Program`
    (:mod:`rpcompile.compiler`, with :mod:`rpcompile.passes.rewrite.split` and :mod:`~rpcompile.passes.rewrite.codegen`):
    the session receives the program as data and never imports the passes."""

    def program(self, input_grads: Collection[str] = ()) -> Program:
        """The plan's program, split so that the gradients of these graph inputs (placeholders) come home too."""
        ...

    def write(self, program: Program, directory: str | os.PathLike) -> list[Path]:
        """Each of ``program``'s stages written out as Python for people, in ``directory``; returns the files."""
        ...
