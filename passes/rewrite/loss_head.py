"""The loss inside the graph, and the LM head split along the sequence.

Two small passes over a traced model:

- :func:`attach_loss` traces ``loss_fn(output, target)`` on its own and splices it after the model's output: the
  graph gains a last placeholder ``target`` and returns the loss. The planner then costs the loss like any other
  node, and the passes below can reach into it.
- :func:`chunk_loss_head` rewrites ``cross_entropy(chain(linear(x)), chain(target))`` — the LM head and a
  mean token cross-entropy — into ``chunks`` pieces along the sequence (dim 1): each piece projects its tokens and
  sums their cross-entropy; the loss is the sum over pieces divided by the number of counted (not ignored)
  tokens, which is exactly the mean. The full ``[B, T, V]`` logits never exist, and the head — one segment of
  ~110 ms per 4096-token microbatch on an 8B model, the slowest in the graph — becomes ``chunks`` segments the
  partitioner can spread over stages (the head weight is then a parameter shared by those stages).

Only token-wise steps may sit between the head and the loss (``flatten``, ``view``/``reshape`` to ``(-1, V)``,
dtype casts, ``contiguous``), and only ``flatten``/``view(-1)``/casts between the target and the loss; otherwise
:func:`chunk_loss_head` leaves the graph alone and says why (:class:`HeadSplit`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...core.batch import TARGET
from ...core.errors import LossHeadError
from ...core.program import HEAD_CLASSES_META
from ..graph.util import module_path

__all__ = ["attach_loss", "chunk_loss_head", "split_head", "HeadSplit", "HEAD_CHUNKS_META", "CHUNK_META"]

#: ``gm.meta`` key under which :func:`chunk_loss_head` records its chunk count.
HEAD_CHUNKS_META = "rpcompile.head_chunks"
#: ``node.meta`` key naming the chunk a node computes (``lm_head.chunk2``): the coarsener groups by it, so the
#: chunks become segments of their own with readable names.
CHUNK_META = "rpcompile.head_chunk"

_CASTS = {"float", "double", "half", "bfloat16", "to", "type", "contiguous", "long", "int"}


class _Loss(torch.nn.Module):
    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output: Any, target: Any) -> torch.Tensor:
        return self.loss_fn(output, target)


class _LossTracer(fx.Tracer):
    """Traces into torch's loss modules (``nn.CrossEntropyLoss()`` becomes its ``F.cross_entropy`` call)."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        # not leaves: chunk_loss_head looks for the F.cross_entropy call inside them
        return not isinstance(m, torch.nn.modules.loss._Loss) and super().is_leaf_module(m, module_qualified_name)


def attach_loss(gm: fx.GraphModule, loss_fn: Callable[[Any, Any], torch.Tensor]) -> fx.GraphModule:
    """Append ``loss_fn(output, target)`` to ``gm`` in place (a new last placeholder ``target``); returns ``gm``."""
    _attach(gm, loss_fn)
    gm.recompile()
    return gm


def _attach(gm: fx.GraphModule, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
    """:func:`attach_loss`'s rewrite of the graph, without regenerating ``gm``'s code (whoever rewrites it next
    does: ~0.2 s at 128 layers)."""
    graph = gm.graph
    # an exported graph's pytree codegen has a fixed input spec: a new placeholder would not fit it
    if getattr(graph._codegen, "pytree_info", None) is not None:
        raise LossHeadError("the loss can only be attached to a symbolically traced graph, not a torch.export one; "
                            "keep the loss outside the graph (head_chunks=1)")
    if any(n.target == TARGET or n.name == TARGET for n in graph.find_nodes(op="placeholder")):
        raise LossHeadError(f"the model already has an input named {TARGET!r}; rename it to attach the loss")
    try:
        root = _Loss(loss_fn)
        loss_gm = fx.GraphModule(root, _LossTracer().trace(root))
    except Exception as exc:  # noqa: BLE001 - any tracing failure means the same thing here
        raise LossHeadError(f"loss_fn could not be traced with torch.fx ({type(exc).__name__}: {exc}); pass a loss "
                            "built from torch functions, or keep it outside the graph (no head split)") from exc
    out = graph.output_node()
    (value,) = out.args
    if not isinstance(value, fx.Node):
        raise LossHeadError("the model's output is not a single tensor, and the loss can only follow a tensor output; "
                            "keep the loss outside the graph (head_chunks=1)")
    # the last placeholder: the model's own inputs keep their positions; a call's target binds to it by name (TARGET)
    with graph.inserting_after(list(graph.find_nodes(op="placeholder"))[-1]):
        target = graph.placeholder(TARGET)
    env: dict[fx.Node, Any] = {}
    result: Any = None
    with graph.inserting_before(out):
        for node in loss_gm.graph.nodes:
            if node.op == "placeholder":
                # _Loss.forward's parameters: `output` is the model's output, the other one the target
                env[node] = value if node.target == "output" else target
            elif node.op == "output":
                result = fx.map_arg(node.args[0], lambda n: env[n])
            else:
                if node.op in ("call_module", "get_attr"):  # e.g. loss_fn = nn.CrossEntropyLoss()
                    # one attribute of gm, prefixed so it cannot collide with the model's own
                    name = f"loss_{node.target}".replace(".", "_")
                    if node.op == "call_module":
                        gm.add_submodule(name, loss_gm.get_submodule(node.target))
                    else:
                        setattr(gm, name, getattr(loss_gm, node.target))
                    new = graph.create_node(node.op, name, fx.map_arg(node.args, lambda n: env[n]),
                                            fx.map_arg(node.kwargs, lambda n: env[n]))
                else:
                    new = graph.node_copy(node, lambda n: env[n])
                # module path "loss": roll-ups and stage headers name the loss's nodes
                new.meta["nn_module_stack"] = {"loss": ("loss", type(loss_fn))}
                env[node] = new
    out.args = (result,)
    graph.lint()


@dataclass(frozen=True)
class HeadSplit:
    """What :func:`chunk_loss_head` did: ``chunks`` pieces, or 1 with ``reason`` when it left the graph alone."""

    chunks: int
    reason: str = ""


def _is_linear(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return isinstance(node.target, str) and isinstance(gm.get_submodule(node.target), torch.nn.Linear)
    return node.op == "call_function" and node.target in (F.linear, torch._C._nn.linear)


_RESHAPES = ("flatten", "view", "reshape")


def _head_classes(node: fx.Node, gm: fx.GraphModule) -> int | None:
    """The rows of the LM head's weight (a :func:`_is_linear` node): the classes its logits score."""
    if node.op == "call_module":
        head = gm.get_submodule(str(node.target))
        return head.out_features if isinstance(head, torch.nn.Linear) else None
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    if isinstance(weight, fx.Node) and weight.op == "get_attr":
        try:
            return int(gm.get_parameter(str(weight.target)).shape[0])
        except AttributeError:  # a buffer or a constant: no classes to check against
            return None
    return None


def _step_name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")


def _tokenwise(node: fx.Node, target_side: bool) -> bool:
    """A single-tensor step that maps each token's row on its own (so it commutes with a sequence split)."""
    name = _step_name(node)
    if node.op not in ("call_method", "call_function") or name not in _CASTS | set(_RESHAPES):
        return False
    if name in _CASTS:
        return True
    if name == "flatten":
        rest = list(node.args[1:]) + [node.kwargs.get(k) for k in ("start_dim", "end_dim") if k in node.kwargs]
        # [batch, seq] targets become [tokens] by any of these; [batch, seq, vocab] logits only by flatten(0, 1)
        return rest in ([], [0], [0, 1], [0, -1]) if target_side else rest == [0, 1]
    shape = list(node.args[1:])
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = list(shape[0])
    return shape == [-1] if target_side else (len(shape) == 2 and shape[:1] == [-1])  # lists: no Tensor.__eq__


def _chain(end: Any, target_side: bool) -> tuple[fx.Node | None, list[fx.Node]]:
    """Walk back from ``end`` through token-wise steps: the first other node, and the steps in forward order."""
    steps: list[fx.Node] = []
    node = end
    while isinstance(node, fx.Node) and _tokenwise(node, target_side):
        steps.append(node)
        # every token-wise step takes its tensor as its first argument
        node = node.args[0]
    return (node if isinstance(node, fx.Node) else None), steps[::-1]


def _replacing(old: Any, new: fx.Node) -> Callable[[fx.Node], fx.Node]:
    """A ``node_copy`` argument map: ``old`` becomes ``new``, every other node stays."""
    return lambda n: new if n is old else n


def chunk_loss_head(gm: fx.GraphModule, chunks: int) -> HeadSplit:
    """Split the LM head and its cross-entropy into ``chunks`` pieces along dim 1, in place (module docstring)."""
    if chunks <= 1:
        return HeadSplit(1, "one chunk asked for")
    graph = gm.graph
    losses = [n for n in graph.nodes if n.op == "call_function" and n.target is F.cross_entropy]
    if len(losses) != 1:
        return HeadSplit(1, f"expected one cross_entropy in the graph, found {len(losses)}")
    ce = losses[0]
    # F.cross_entropy's positional parameters, in its signature's order
    opts = dict(zip(("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                     "label_smoothing"), ce.args))
    opts.update(ce.kwargs)
    if opts.get("weight") is not None or opts.get("reduction", "mean") != "mean" \
            or opts.get("size_average") is not None or opts.get("reduce") is not None:
        return HeadSplit(1, "cross_entropy must be a plain mean (no class weights, default reduction)")
    head, logit_steps = _chain(opts["input"], target_side=False)
    if head is None or not _is_linear(head, gm):
        return HeadSplit(1, "the cross_entropy input is not a linear layer's output through token-wise steps")
    tgt, target_steps = _chain(opts["target"], target_side=True)
    if tgt is None:
        return HeadSplit(1, "the cross_entropy target is not a tensor through flatten/view(-1)")
    if not any(_step_name(n) in _RESHAPES for n in logit_steps) or \
            not any(_step_name(n) in _RESHAPES for n in target_steps):
        return HeadSplit(1, "cross_entropy must see [tokens, vocab] logits and [tokens] targets "
                            "(flatten(0, 1) / view(-1, V) and flatten() / view(-1))")
    inner = [head] + logit_steps
    if any(len(n.users) != 1 for n in inner):
        return HeadSplit(1, "the logits are used outside the loss, so they must exist whole")
    x = head.args[0]  # the hidden states, [batch, sequence, dim]
    if not isinstance(x, fx.Node):
        return HeadSplit(1, "the LM head's input is not a value of the graph")
    # -100: F.cross_entropy's default
    ignore = opts.get("ignore_index", -100)
    smoothing = opts.get("label_smoothing", 0.0)

    def piece(src: fx.Node, j: int) -> fx.Node:
        # tensor_split, not chunk: always exactly `chunks` pieces, even when they do not divide the sequence
        parts = graph.call_function(torch.tensor_split, (src, chunks), {"dim": 1})
        return graph.call_function(operator.getitem, (parts, j))

    def copy(steps: list[fx.Node], start: fx.Node) -> fx.Node:
        cur = start
        for step in steps:
            cur = graph.node_copy(step, _replacing(step.args[0], cur))
        return cur

    classes = _head_classes(head, gm)
    before = set(graph.nodes)
    label = module_path(head) or "head"
    total = None
    with graph.inserting_before(ce):
        for j in range(chunks):
            start = set(graph.nodes)
            xj = piece(x, j)
            lj = graph.node_copy(head, _replacing(x, xj))
            logits = copy(logit_steps, lj)
            tj = copy(target_steps, piece(tgt, j))
            # summed per piece and divided once by the counted tokens below: exactly the mean over the sequence
            cj = graph.call_function(F.cross_entropy, (logits, tj),
                                     {"ignore_index": ignore, "reduction": "sum", "label_smoothing": smoothing})
            total = cj if total is None else graph.call_function(operator.add, (total, cj))
            for node in graph.nodes:
                if node not in start:
                    node.meta[CHUNK_META] = f"{label}.chunk{j}"
        counted = graph.call_method("sum", (graph.call_method("ne", (tgt, ignore)),))
        loss = graph.call_function(operator.truediv, (total, counted))
    stack = ce.meta.get("nn_module_stack")
    for node in graph.nodes:  # new nodes without a module belong to the loss (names, stage headers)
        if node not in before and not node.meta.get("nn_module_stack") and stack:
            node.meta["nn_module_stack"] = dict(stack)
    ce.replace_all_uses_with(loss)
    # users before what they read: erase_node refuses a node that still has users
    for node in [ce] + logit_steps[::-1] + [head]:
        graph.erase_node(node)
    for node in target_steps[::-1]:
        # the target's steps may feed something else too: only unused ones go
        if not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    gm.meta[HEAD_CHUNKS_META] = chunks  # plans made from this graph record it, so it can be rebuilt
    if classes is not None:  # the target's labels are checked against it on the host (rpcompile.training.pipeline)
        gm.meta[HEAD_CLASSES_META] = classes
    return HeadSplit(chunks)


def split_head(gm: fx.GraphModule, loss_fn: Callable[[Any, Any], torch.Tensor] | None, chunks: int) -> fx.GraphModule:
    """:func:`attach_loss` then :func:`chunk_loss_head` with ``chunks`` (> 1), raising when the head cannot be
    split; the graph a ``head_chunks`` plan was made from, rebuilt from a fresh trace."""
    if loss_fn is None:
        raise LossHeadError(f"head_chunks={chunks} splits the LM head together with its loss: pass loss_fn=")
    _attach(gm, loss_fn)  # the code is regenerated once, by chunk_loss_head (or below)
    split = chunk_loss_head(gm, chunks)
    if split.chunks != chunks:
        # the loss is attached all the same: gm's code must match its graph for a caller that catches this
        gm.recompile()
        raise LossHeadError(f"head_chunks={chunks}: the LM head cannot be split ({split.reason}); use head_chunks=1")
    return gm
