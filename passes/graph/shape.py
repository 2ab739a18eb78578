"""``shape_pass``: the dtype, shape and bytes of every node's output.

Writes ``node.meta["rpcompile.shape"]`` (a :class:`ShapeInfo`) on every node. ``nbytes`` counts only *new*
memory: an output that is a view of one of the node's own inputs (``view``, ``transpose``, ``getitem`` of a
tuple, …) allocates nothing and counts 0. Aliasing is detected against the node's own inputs, never by
deduplicating pointers across the graph (the allocator reuses freed blocks; docs/architecture.md §7).

Runs on whatever device the inputs live on, including ``meta`` (shape-only models that are too big to allocate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from rpcompile.core.batch import flat_inputs, tensor_leaves

from .portable import device_of, running_on
from .reuse import Reuse, RunMemo, all_meta

__all__ = ["SHAPE_KEY", "TensorInfo", "ShapeInfo", "shape_pass", "shape_info", "storage_key", "scaled_nbytes"]

SHAPE_KEY = "rpcompile.shape"


@dataclass(frozen=True)
class TensorInfo:
    """One output tensor."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    is_alias: bool
    """True when the tensor shares storage with one of the node's inputs (a view): it allocates nothing."""


@dataclass(frozen=True)
class ShapeInfo:
    """All tensors a node outputs (pytree leaves, in order)."""

    tensors: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        """New bytes this node allocates (aliases excluded)."""
        return sum(t.nbytes for t in self.tensors if not t.is_alias)


def scaled_nbytes(info: ShapeInfo, dtype: torch.dtype | None, *, aliases: bool = False) -> int:
    """Bytes of ``info``'s tensors with the floating ones in ``dtype`` (``None``: as traced) — what they take when
    the model runs in that precision (an fp32 model planned for bf16). Aliases count only with ``aliases=True``
    (a model input's value, which no node of the graph allocates)."""
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else 0
    total = 0
    for t in info.tensors:
        if t.is_alias and not aliases:
            continue
        traced = getattr(torch, t.dtype)
        floating = dtype is not None and traced.is_floating_point
        # floating tensors: elements times the new element size; integer ones (token ids, indices) keep their dtype
        total += t.nbytes // torch.empty((), dtype=traced).element_size() * size if floating else t.nbytes
    return total


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage; equal for views of one tensor, also on the meta device."""
    # the storage object's address, not data_ptr(): a meta tensor has no data, and views share one storage object
    return t.untyped_storage()._cdata


def shape_info(value: Any, inputs: Sequence[Any] = ()) -> ShapeInfo:
    """ShapeInfo of ``value``; tensors sharing storage with a tensor in ``inputs`` are marked as aliases."""
    in_keys = {storage_key(t) for t in tensor_leaves(list(inputs))}
    infos = []
    for t in tensor_leaves(value):
        nbytes = t.numel() * t.element_size()
        infos.append(TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes, storage_key(t) in in_keys))
    return ShapeInfo(tuple(infos))


class _ShapeInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, reuse: Reuse | None = None) -> None:
        super().__init__(gm)
        self.reuse = reuse

    def run_node(self, n: fx.Node) -> Any:
        if self.reuse is not None:
            got = self.reuse.lookup(n)
            if got is not None:  # the same node as in the recorded run: its value and shape
                n.meta[SHAPE_KEY] = got[1]
                return got[0]
        result = self._run_node(n)
        if self.reuse is not None:
            self.reuse.settle(n, result, (result, n.meta.get(SHAPE_KEY)))
        return result

    def _run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        result = super().run_node(n)
        inputs = list(args) + list(kwargs.values())
        if n.op == "call_module":
            assert isinstance(n.target, str), n.format_node()  # a call_module's target is the module's path
            mod = self.fetch_attr(n.target)
            # a module's own weights count as its inputs: an output that is one of them allocates nothing
            inputs += list(mod.parameters()) + list(mod.buffers())
        # described against themselves, so always aliases: a graph input or a weight allocates nothing inside the graph
        n.meta[SHAPE_KEY] = (shape_info(result, inputs) if n.op not in ("get_attr", "placeholder")
                             else shape_info(result, [result]))
        return result


def shape_pass(
    gm: fx.GraphModule, example_inputs: Sequence[Any] = (), example_kwargs: Mapping[str, Any] | None = None, *,
    memo: RunMemo | None = None,
) -> fx.GraphModule:
    """Run ``gm`` once on the example inputs and record every node's output :class:`ShapeInfo`.

    Placeholders and get_attr nodes are recorded as aliases (they allocate nothing inside the graph).
    Runs under ``torch.no_grad()``; the graph's buffers are restored afterwards, so running it does not
    advance BatchNorm statistics. ``memo`` (a run on ``meta``): nodes the same as in the run it recorded take
    their recorded values and shapes instead of running (:mod:`.reuse`); a first run records them.
    """
    # running the graph for real would move a BatchNorm's running statistics: they are put back below
    saved = {name: b.detach().clone() for name, b in gm.named_buffers() if b.device.type != "meta"}
    reuse = None
    try:
        flat = flat_inputs(gm, example_inputs, example_kwargs)
        if memo is not None and all_meta([*flat, *gm.parameters(), *gm.buffers()]):
            reuse = memo.session(gm, "shape")
        with torch.no_grad(), running_on(device_of(gm, flat)):
            _ShapeInterpreter(gm, reuse).run(*flat, enable_io_processing=False)
    except BaseException:
        if reuse is not None:
            reuse.failed()
        raise
    finally:
        with torch.no_grad():
            for name, b in gm.named_buffers():
                if name in saved:
                    b.copy_(saved[name])
    return gm
