"""Replayable randomness: dropout masks that match between a forward pass and its recomputation.

Forward and backward stages cut the graph differently, so randomness cannot be keyed by stage. Instead every
random node of a stage graph (dropout and friends, :mod:`rpcompile.core.randomness`) is rewritten by
:func:`seed_random_nodes` when the runtime binds a program (:mod:`.bind`) to run under a generator seeded from
(the pipeline's dropout seed, iteration, node name, microbatch) — the executor sets those in :data:`context`
before it runs a stage. The dropout seed is ``torch.initial_seed()`` when the pipeline is made, so
``torch.manual_seed`` chooses the masks as it does eager's. A node therefore draws the same mask whenever and
wherever it runs, on any number of devices.
Logical CPU devices share one generator, so seeding takes a process-wide lock there.

A trace records dropouts as the model's mode had them; a model traced in train mode and then put in eval mode
(``model.eval()`` to evaluate) runs them switched off instead: the executor sets ``training`` in :data:`context`
and :func:`seeded_call` passes a dropout's input through and gives an attention kernel ``dropout_p=0``.
"""

from __future__ import annotations

import itertools
import threading
import zlib
from typing import Any, Callable

import torch
import torch.fx as fx

from rpcompile.core.randomness import ATTENTION_DROPOUT, DROPOUT_FUNCTIONS, is_random, op_name, random_kind

__all__ = ["context", "stream", "seed_random_nodes", "seeded_call", "seeded_noise", "dropout_to_noise"]

context = threading.local()
"""Per worker thread: ``iteration``, ``microbatch``, ``device`` (a torch.device), ``seed`` (the pipeline's dropout
seed: None in a pipeline state saved before there was one) and ``training`` (False: dropouts off,
:func:`seeded_call`) of the stage running now."""

#: Dropouts that pass their input through in eval mode (as ``nn.Dropout`` and ``F.dropout(training=False)`` do).
EVAL_IDENTITY = frozenset({*DROPOUT_FUNCTIONS, "alpha_dropout", "feature_alpha_dropout"})

stream = ""
"""A process-wide salt of every seed: data-parallel ranks (:mod:`rpcompile.training.distributed`) set their own, so each
rank's batch shard draws its own masks (the same seeds everywhere would give every shard the same dropout)."""

_CPU_LOCK = threading.Lock()
_NOISE: dict[str, tuple[str, Callable[..., Any], tuple, dict]] = {}
"""Token of a dropout made noise (:func:`dropout_to_noise`) -> (node name, op, its other args, kwargs)."""
_TOKENS = itertools.count()


def _without_dropout(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` as eval mode runs it: a dropout passes its input through, an attention kernel
    runs with ``dropout_p=0``, anything else (a module follows its own mode; a random draw that is no dropout)
    as it is. ``NotImplemented`` where nothing changes."""
    name = op_name(fn)
    if name in EVAL_IDENTITY:
        return args[0]
    if name == "native_dropout":
        return args[0], torch.ones_like(args[0], dtype=torch.bool)  # (output, mask): nothing dropped
    at = ATTENTION_DROPOUT.get(name)
    if at is not None:
        # dropout_p given by keyword or not at all: passed as the keyword 0.0; given by position: replaced there
        if "dropout_p" in kwargs or len(args) <= at:
            return fn(*args, **{**kwargs, "dropout_p": 0.0})
        return fn(*args[:at], 0.0, *args[at + 1:], **kwargs)
    return NotImplemented


def seeded_call(key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` with the current device's generator seeded from (iteration, ``key``, microbatch) — in eval mode
    (``context.training`` False: the model was put in eval mode after a train-mode trace) without its dropout."""
    if not getattr(context, "training", True):
        out = _without_dropout(fn, args, kwargs)
        if out is not NotImplemented:
            return out
    iteration = getattr(context, "iteration", 0)
    mb = getattr(context, "microbatch", 0)
    device = getattr(context, "device", torch.device("cpu"))
    base = getattr(context, "seed", None)
    # crc32, not hash(): str hashes are salted per process, and a mask must not depend on the process
    seed = zlib.crc32(f"{stream}{'' if base is None else f'{base}:'}{iteration}/{key}/{mb}".encode())
    if device.type == "cuda":
        # the generator's state is put back after the call: the model's own random draws go on as in eager
        state = torch.cuda.get_rng_state(device)
        torch.cuda.manual_seed(seed)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_rng_state(state, device)
    with _CPU_LOCK:  # logical CPU devices share the one CPU generator
        state = torch.get_rng_state()
        torch.manual_seed(seed)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_rng_state(state)


def _method(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)

    return call


def seed_random_nodes(gm: fx.GraphModule) -> int:
    """Rewrite every random node of ``gm`` into ``seeded_call(node_name, original, ...)``; returns the count."""
    count = 0
    for node in list(gm.graph.nodes):
        if not is_random(gm, node):
            continue
        with gm.graph.inserting_before(node):
            if node.op == "call_module":
                fn: Any = gm.graph.get_attr(node.target)  # the module itself, called by seeded_call
            elif node.op == "call_method":
                fn = _method(node.target)
            else:
                fn = node.target
            new = gm.graph.call_function(seeded_call, (node.name, fn, *node.args), dict(node.kwargs))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        new.name = node.name  # after the erase: fx would rename a name still in use
        count += 1
    if count:
        gm.recompile()
    return count


@torch.library.custom_op("rpcompile::seeded_noise", mutates_args=())
def seeded_noise(like: torch.Tensor, token: str) -> torch.Tensor:
    """Dropout's multiplicative noise for ``like`` (mask / (1 - p)), seeded like the node it replaces."""
    name, fn, args, kwargs = _NOISE[token]
    # the dropout applied to ones gives its mask scaled by 1 / (1 - p)
    return seeded_call(name, fn, torch.ones_like(like), *args, **kwargs).clone()


@seeded_noise.register_fake
def _(like: torch.Tensor, token: str) -> torch.Tensor:
    return torch.empty_like(like)


def dropout_to_noise(gm: fx.GraphModule) -> bool:
    """Rewrite every dropout node of ``gm`` into ``x * seeded_noise(x.detach())``; False if another random node
    remains (such a segment cannot be saved)."""
    for node in list(gm.graph.nodes):
        kind = random_kind(gm, node)
        if kind == "other":
            return False
        if kind is None:
            continue
        fn = gm.get_submodule(node.target) if node.op == "call_module" else node.target
        # unique per rewrite: node names repeat across segments and stages
        token = f"{next(_TOKENS)}/{node.name}"
        _NOISE[token] = (node.name, fn, tuple(node.args[1:]), dict(node.kwargs))
        x = node.args[0]
        with gm.graph.inserting_before(node):
            # detached: the noise depends on x's shape only, so the gradient flows through the mul alone, as
            # dropout's does
            noise = gm.graph.call_function(torch.ops.rpcompile.seeded_noise.default,
                                           (gm.graph.call_method("detach", (x,)), token))
            new = gm.graph.call_function(torch.mul, (x, noise))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.recompile()
    return True
