"""Which graph nodes draw random numbers: what the split pass must know to decide whether a segment can be
saved, and what the runtime seeds so a node draws the same mask wherever it runs (:mod:`rpcompile.runtime.rng`)."""

from __future__ import annotations

from typing import Any, Literal

import torch.fx as fx
import torch.nn as nn

__all__ = ["RANDOM_MODULES", "RANDOM_FUNCTIONS", "DROPOUT_MODULES", "DROPOUT_FUNCTIONS", "ATTENTION_DROPOUT",
           "MODE_FUNCTIONS", "mode_fixed", "op_name", "target_name", "is_random", "draws", "random_kind"]

RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
RANDOM_FUNCTIONS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "multinomial", "normal", "uniform_", "normal_", "rrelu"})
#: Multiplicative dropouts: a saved segment keeps their mask as a saved tensor (``x * noise``).
DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
DROPOUT_FUNCTIONS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "feature_dropout"})


#: Attention kernels that draw a dropout mask (inside the kernel) unless their ``dropout_p`` is 0: where that
#: argument sits among their positional ones (``F.scaled_dot_product_attention`` / ``aten`` and its backends).
ATTENTION_DROPOUT = {"scaled_dot_product_attention": 4, "_scaled_dot_product_flash_attention": 3,
                     "_scaled_dot_product_flash_attention_for_cpu": 3, "_scaled_dot_product_efficient_attention": 5,
                     "_scaled_dot_product_cudnn_attention": 5}


#: Functions a trace records with the mode the model was in as a constant argument (batch norm's ``training``):
#: their graph computes that mode's behaviour whatever mode the model is put in later.
MODE_FUNCTIONS = frozenset({
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm",
    "_batch_norm_with_update", "_batch_norm_with_update_functional", "_batch_norm_no_update", "instance_norm"})


def mode_fixed(gm: fx.GraphModule) -> list[str]:
    """Nodes of ``gm`` whose behaviour its trace fixed to the model's mode then (:data:`MODE_FUNCTIONS`); a
    called module (an fx ``call_module``) follows the mode it is in and is not one."""
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and target_name(n) in MODE_FUNCTIONS]


def _attention_dropout(node: fx.Node) -> bool:
    """An attention call whose ``dropout_p`` is not a constant 0 (HF models in train mode with attention dropout:
    ``dropout_p=self.dropout if self.training else 0.0``)."""
    at = ATTENTION_DROPOUT.get(target_name(node))
    if at is None:
        return False
    # by keyword or by position; a call that leaves it out takes the default, 0
    p = node.kwargs.get("dropout_p", node.args[at] if len(node.args) > at else 0.0)
    # a graph value (a training flag, say) is known only at run time: counted as drawing
    return isinstance(p, fx.Node) or bool(p != 0)


def op_name(target: Any) -> str:
    """A function's or an op's name without namespace or overload (``aten.dropout.default`` → ``dropout``); a
    method's name as it is; "" for anything else (a module)."""
    if isinstance(target, str):
        return target
    # an OpOverload's own name carries its overload (dropout.default): its packet's is the op's alone (dropout)
    return getattr(getattr(target, "_overloadpacket", target), "__name__", "").split(".")[-1]


def target_name(node: fx.Node) -> str:
    """A node's op name (:func:`op_name` of its target)."""
    return op_name(node.target)


def is_random(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), RANDOM_MODULES)
    if node.op in ("call_function", "call_method"):
        return target_name(node) in RANDOM_FUNCTIONS or _attention_dropout(node)
    return False


def draws(gm: fx.GraphModule, node: fx.Node) -> bool:
    """:func:`is_random`, but for a dropout that drops nothing (probability a constant 0, in either mode)."""
    if not is_random(gm, node):
        return False
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return not (isinstance(mod, DROPOUT_MODULES) and float(getattr(mod, "p")) == 0)
    if target_name(node) in DROPOUT_FUNCTIONS:
        # F.dropout's default probability is 0.5
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        return isinstance(p, fx.Node) or bool(p != 0)
    return True


def random_kind(gm: fx.GraphModule, node: fx.Node) -> Literal["dropout", "other"] | None:
    """'dropout' for a multiplicative dropout with constant options, 'other' for other random nodes, else None."""
    if not is_random(gm, node):
        return None
    if node.op == "call_module":
        # a dropout module holds its options: a call with more than its input is not the plain multiplicative kind
        ok = isinstance(gm.get_submodule(str(node.target)), DROPOUT_MODULES) and len(node.args) == 1 and not node.kwargs
    else:
        ok = node.op == "call_function" and target_name(node) in DROPOUT_FUNCTIONS and bool(node.args)
    # an option computed in the graph is not a constant: such a node is "other"
    consts = [*node.args[1:], *node.kwargs.values()]
    return "dropout" if ok and not any(isinstance(a, fx.Node) for a in consts) else "other"
