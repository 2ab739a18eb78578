"""Capture a model as a ``torch.fx.GraphModule`` whose parameters are the model's own.

Terms:

- *fx path*: ``torch.fx`` symbolic tracing (:func:`_trace_fx`); *export path*: non-strict ``torch.export``
  (:func:`_trace_export`). :func:`trace` tries fx first, and ``gm.meta["rpcompile.trace"]`` records the path taken.
- *FQN*: a fully-qualified attribute name such as ``layers.3.attn.q_proj.weight``. Both paths return a graph module
  whose parameters and buffers are the model's own tensor objects (shared storage, no copies) under their original
  FQNs; a tied weight appears once, under the name ``model.named_parameters()`` gives it (export:
  :func:`_rebind_attributes`).
- *module path*: the FQN of the innermost module that owns a node (:func:`rpcompile.passes.graph.util.module_path`);
  ``""`` is the root.

What each path can and cannot trace, and what :func:`trace` raises when both fail: :func:`trace`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from rpcompile.core.errors import ConfigError, TraceError

from .export_inputs import dynamic_shapes, explicit_signature
from .inplace import functional_inplace_pass
from .portable import portable_bodies
from .precision import TRACE_DTYPE_KEY, cast_floating, computing_in
from .quantized import traceable as traceable_quantized
from .trace_failure import Failure, ModuleTracker, failure_message

__all__ = ["trace", "training_inputs", "TRACE_META_KEY"]

log = logging.getLogger("rpcompile")

TRACE_META_KEY = "rpcompile.trace"
"""``gm.meta`` key holding ``"fx"`` or ``"export"``."""

LeafSpec = type[nn.Module] | str
"""A module type, or the qualified name of one submodule, to keep as one ``call_module`` node (fx path only)."""


def trace(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any] = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    leaf_modules: Iterable[LeafSpec] = (),
    method: Literal["auto", "fx", "export"] = "auto",
    dtype: torch.dtype | None = None,
) -> fx.GraphModule:
    """Trace ``model`` with fx symbolic tracing, falling back to non-strict ``torch.export``.

    ``example_inputs`` are the positional arguments (a dict is taken as keyword arguments); the model is traced in
    its current train/eval mode. Non-tensor keyword arguments (``use_cache=False``) skip fx and are specialised by
    export. ``leaf_modules`` only affects fx (export records every op). ``method`` forces one path. Raises
    :class:`~rpcompile.TraceError` naming the failing module and source line of each path tried when all fail; its
    ``failures`` attribute keeps the originals.

    The exported graph module is called like the model (same arguments, same output structure, e.g. a HuggingFace
    ``ModelOutput``): its placeholders and output node are flat and a pytree codegen (un)flattens around them.

    ``gm.meta["rpcompile.trace"]`` records the path taken: ``"fx"`` or ``"export"``. Both paths make in-place
    computations on the graph's own values out of place
    (:func:`~rpcompile.passes.graph.inplace.functional_inplace_pass`: ``nn.ReLU(inplace=True)``,
    ``out += identity``); fx refuses forwards that switch the grad mode (a statistic updated under
    ``torch.no_grad()``), which it cannot record, and export takes them. When both fail, the
    :class:`~rpcompile.core.errors.TraceError` names the module and source line each failed at
    (:mod:`.trace_failure`).
    """
    if method not in ("auto", "fx", "export"):
        raise ConfigError(f"method={method!r}; use 'auto', 'fx' or 'export'")
    args, kwargs = training_inputs(model, example_inputs, example_kwargs)
    leaves = _check_leaves(model, tuple(leaf_modules))
    # a 4-bit base is reached through its packed weights and scales (:mod:`.quantized`); refused here if it cannot
    with _buffers_kept(model), traceable_quantized(model):  # fx runs what it cannot trace for real (a buffer's += 1)
        gm = _trace(model, args, kwargs, leaves, method, dtype)
    # only the non-tensor keyword arguments export specialised on (use_cache=False) are refilled; tensors a call
    # must pass itself
    return _called_like_the_model(gm, {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)})


def _called_like_the_model(gm: fx.GraphModule, constants: dict[str, Any]) -> fx.GraphModule:
    """``gm`` callable as the model is: the non-tensor arguments it was specialised for (an HF model's
    ``use_cache=False``, which the trace adds) are placeholders of the exported graph, filled in here when a call
    leaves them out. The graph module's class is its own, so only ``gm`` changes (until a pass recompiles it)."""
    cls = type(gm)
    inner = cls.forward
    try:
        sig = inspect.signature(inner)
    except (TypeError, ValueError):
        return gm
    fill = {k: v for k, v in constants.items() if k in sig.parameters}
    if not fill:
        return gm

    def forward(self: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(self, *args, **kwargs)
        for k, v in fill.items():
            # setdefault: an argument the caller passes itself wins over the traced constant
            bound.arguments.setdefault(k, v)
        return inner(*bound.args, **bound.kwargs)

    cls.forward = forward
    return gm


def _trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: tuple[LeafSpec, ...],
           method: str, dtype: torch.dtype | None) -> fx.GraphModule:
    tracker = ModuleTracker(model)
    failures: dict[str, Failure | str] = {}
    if method != "export":
        try:
            with tracker:
                return _trace_fx(model, args, kwargs, leaves)
        except _SkipFx as skip:
            failures["fx"] = str(skip)
        except Exception as e:  # noqa: BLE001 - any failure sends us down the export path
            failures["fx"] = tracker.failure(e)
    if method != "fx":
        try:
            with tracker:
                return _trace_export(model, args, kwargs, dtype)
        except Exception as e:  # noqa: BLE001
            failures["export"] = tracker.failure(e)
    # Raised outside the except blocks: no pages of chained traceback; the originals stay on `.failures`.
    error = TraceError(failure_message(model, failures))
    error.failures = failures  # the originals ride on the error
    raise error


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[None]:
    """Tracing leaves the model's buffers as it found them. ``torch.fx`` proxies parameters but hands a forward
    the real buffers, so an in-place update it cannot record — a step counter ``self.calls += 1`` under
    ``torch.no_grad()``, the ``mul_`` of a running average — ran on them for real, once per trace: the model was
    one update ahead of eager before training started. Their values (not meta ones: none) are copied first and
    put back, in place and under their own names, after the trace."""
    kept = [(mod, name, b, b.clone()) for mod in model.modules() for name, b in mod._buffers.items()
            if b is not None and b.device.type != "meta"]
    try:
        yield
    finally:
        with torch.no_grad():
            for mod, name, b, value in kept:
                # the original object goes back too, in case the forward rebound the attribute to a new tensor
                mod._buffers[name] = b
                # unchanged buffers are not written; one whose shape changed cannot be copied back into
                if b.shape == value.shape and not torch.equal(b, value):
                    b.copy_(value)


def training_inputs(
    model: nn.Module, example_inputs: Sequence[Any] | Mapping[str, Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the call to trace. A HuggingFace model whose config caches keys and values
    (``use_cache``) is traced with ``use_cache=False`` unless the call says otherwise — what HF's Trainer does for
    training, without touching the model's config (a cache is an output export cannot take, and training never
    reads it); logged once per trace."""
    args, kwargs = _split_inputs(example_inputs, example_kwargs)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is not None and "use_cache" not in kwargs and _accepts(model, "use_cache"):
        kwargs["use_cache"] = False
        log.info("%s: tracing with use_cache=False (no KV cache in training; the model's config is unchanged)",
                 type(model).__name__)
    return args, kwargs


def _accepts(model: nn.Module, name: str) -> bool:
    """``forward`` takes keyword ``name``: by name, or through ``**kwargs`` that a PEFT wrapper passes on to the
    model it wraps (``PeftModel.forward(*args, **kwargs)``; ``get_base_model()`` is PEFT's name for that model)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if name in params:
        return True
    inner = getattr(model, "get_base_model", None)
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # `base is not model`: a wrapper whose get_base_model() returns itself would recurse forever
    return passes_on and callable(inner) and isinstance(base := inner(), nn.Module) and base is not model \
        and _accepts(base, name)


# --- inputs and leaves -------------------------------------------------------------------------------------------


def _split_inputs(
    example_inputs: Sequence[Any] | Mapping[str, Any], example_kwargs: Mapping[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kwargs = dict(example_kwargs or {})
    if isinstance(example_inputs, Mapping):
        # explicit example_kwargs override the same key in a dict of inputs
        return (), {**example_inputs, **kwargs}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), kwargs
    return (example_inputs,), kwargs


def _check_leaves(model: nn.Module, leaves: tuple[LeafSpec, ...]) -> tuple[LeafSpec, ...]:
    names = dict(model.named_modules())
    unknown = [leaf for leaf in leaves if isinstance(leaf, str) and leaf not in names]
    if unknown:
        # the first non-empty name: "" is the root module
        example = next((n for n in names if n), "layers.0")
        raise TraceError(
            f"leaf_modules names {unknown} but {type(model).__name__} has no such submodule; "
            f"use qualified names as in model.named_modules(), e.g. {example!r}"
        )
    return leaves


# --- the fx path ---------------------------------------------------------------------------------------------------


class _SkipFx(Exception):
    """The fx path cannot represent these inputs; go straight to export."""


class _Tracer(fx.Tracer):
    """An fx tracer that also keeps the given module types and qualified names as leaves."""

    def __init__(self, leaves: tuple[LeafSpec, ...]) -> None:
        super().__init__()
        self.leaf_types = tuple(leaf for leaf in leaves if isinstance(leaf, type))
        self.leaf_names = frozenset(leaf for leaf in leaves if isinstance(leaf, str))

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (
            isinstance(m, self.leaf_types)
            or module_qualified_name in self.leaf_names
            or super().is_leaf_module(m, module_qualified_name)
        )

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        # the mode forward is entered in; create_node flags any node recorded under another one
        self.grad_mode, self.grad_switched = torch.is_grad_enabled(), False
        return super().trace(root, concrete_args)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        # fx records ops, not grad modes: a node made inside `with torch.no_grad():` (a running statistic updated
        # in forward) would be differentiated at run time
        self.grad_switched |= torch.is_grad_enabled() != self.grad_mode
        return super().create_node(*args, **kwargs)


def _trace_fx(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: tuple[LeafSpec, ...],
              ) -> fx.GraphModule:
    """The fx path: ``torch.fx`` symbolic tracing. Runs ``forward`` on Proxy objects; ``torch.nn`` modules (and any
    in ``leaf_modules``) stay as single ``call_module`` nodes. Fast, but fails on data-dependent Python control flow
    and on forwards it cannot introspect (HuggingFace transformers 5.x: ``co_varnames is too small``)."""
    constants = [k for k, v in kwargs.items() if not isinstance(v, Tensor)]
    if constants:
        # fx would bake them in with an assert and rename the placeholder; export specialises them cleanly.
        raise _SkipFx(f"skipped: non-tensor keyword argument(s) {constants} (torch.export specialises those)")
    if any(not isinstance(v, Tensor) and any(isinstance(t, Tensor) for t in pytree.tree_leaves(v)) for v in args):
        # fx takes a batch dict or a pair of tensors as one value, which the runtime can neither split into
        # microbatches nor move to a device; export flattens inputs into one placeholder per tensor.
        raise _SkipFx("skipped: an input is a container of tensors (a batch dict, a tuple): torch.export flattens "
                      "those")
    tracer = _Tracer(leaves)
    graph = tracer.trace(model)
    if tracer.grad_switched:
        raise _SkipFx("skipped: forward switches the grad mode (torch.no_grad) around some ops, which torch.fx "
                      "cannot record (torch.export does)")
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _stringify_module_stacks(gm.graph)
    gm.meta[TRACE_META_KEY] = "fx"
    return functional_inplace_pass(gm)


def _stringify_module_stacks(graph: fx.Graph) -> None:
    """fx records ``{key: (fqn, type)}``; torch.export records ``{key: (fqn, "module.QualName")}``: use the latter."""
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {k: (path, _type_name(t)) for k, (path, t) in stack.items()}


def _type_name(t: Any) -> str:
    return f"{t.__module__}.{t.__qualname__}" if isinstance(t, type) else str(t)


# --- the export path -----------------------------------------------------------------------------------------------


def _trace_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  dtype: torch.dtype | None = None) -> fx.GraphModule:
    """The export path: ``torch.export.export(..., strict=False)``. Runs the real Python with fake tensors and
    records aten-level ops; every compute node carries ``meta["nn_module_stack"]``. The graph is specialised to the
    example input shapes and to non-tensor arguments (e.g. ``use_cache=False``)."""
    # bf16/fp16: floating inputs in the compute dtype, so the exported graph records the dtypes a stage will run in
    args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
    # On failure torch.export prints the partial graph to stderr (pages); keep it only when export succeeds.
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        # values=False: export runs on fake tensors, so the compute-dtype weights are never filled
        with explicit_signature(model, args, kwargs), computing_in(model, dtype, values=False):
            ep = torch.export.export(model, args, kwargs, strict=False,
                                     dynamic_shapes=dynamic_shapes(model, args, kwargs))
    sys.stderr.write(captured.getvalue())
    # check_guards=False: no `_guards_fn` call_module node; its pre-hook is dropped with the module below.
    unlifted = ep.module(check_guards=False)
    graph = unlifted.graph
    holder = _rebind_attributes(model, unlifted, graph)
    gm = fx.GraphModule(holder, graph, type(model).__name__)
    gm.meta.update(unlifted.meta)
    gm.meta[TRACE_META_KEY] = "export"
    gm.meta[TRACE_DTYPE_KEY] = dtype
    # first: the outlined regions become submodules, which portable_bodies below makes portable too
    _outline_vmap(gm)
    functional_inplace_pass(gm)
    portable_bodies(gm)  # bodies of higher-order ops run whole: their device constants follow the stage's device
    return gm


_VMAP_IN = torch._functorch.predispatch._vmap_increment_nesting
_VMAP_OUT = torch._functorch.predispatch._vmap_decrement_nesting


def _outline_vmap(gm: fx.GraphModule) -> None:
    """Move each ``torch.vmap`` region of an exported graph into one ``call_module`` node (``vmap_region_k``).

    Export records a vmap as its steps (``_vmap_increment_nesting``, ``_add_batch_dim``, ...,
    ``_remove_batch_dim``, ``_vmap_decrement_nesting``); the nodes between only make sense run in order, whole —
    per-node shape and cost analysis and a stage cut inside the region fail (``Cannot access storage of
    BatchedTensorImpl``). HF transformers 4.5x builds its attention masks this way (``create_causal_mask``).
    """
    nodes = list(gm.graph.nodes)
    k = i = 0
    while i < len(nodes):
        if not (nodes[i].op == "call_function" and nodes[i].target is _VMAP_IN):
            i += 1
            continue
        depth, j = 0, i
        for j in range(i, len(nodes)):
            # nested vmaps: the region ends at the decrement matching its first increment, not at the first decrement
            depth += (nodes[j].target is _VMAP_IN) - (nodes[j].target is _VMAP_OUT)
            if depth == 0:
                break
        call = _outline(gm, nodes[i:j + 1], f"vmap_region_{k}")
        k += 1
        # the region's nodes are gone: re-read the graph and go on after the new call node
        nodes = list(gm.graph.nodes)
        i = nodes.index(call) + 1
    if k:
        gm.recompile()


class _VmapRegion(fx.GraphModule):
    """A vmap region run whole; an error inside it leaves no vmap level behind (the levels are global state: a
    leaked one turns every later tensor op into a batched one)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        level = torch._C._functorch.maybe_current_level()
        try:
            return super().__call__(*args, **kwargs)
        except BaseException:
            # pop only the levels this region pushed; an enclosing vmap's level stays
            while torch._C._functorch.maybe_current_level() not in (level, None):
                torch._C._functorch._vmap_decrement_nesting()
            raise


def _outline(gm: fx.GraphModule, region: list[fx.Node], name: str) -> fx.Node:
    """Replace the contiguous ``region`` of ``gm``'s graph by a call of a submodule running it; return the call."""
    inside = set(region)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:
            # a weight stays a get_attr inside: the submodule is built with gm as its root (below), which resolves it;
            # any other value from outside the region becomes an input of the call
            env[a] = g.get_attr(str(a.target)) if a.op == "get_attr" else g.placeholder(a.name)
            if a.op != "get_attr":
                inputs.append(a)
        return env[a]

    for n in region:
        env[n] = g.node_copy(n, arg)
    # the region's outputs: the nodes read after it
    outs = [n for n in region if any(u not in inside for u in n.users)]
    single = len(outs) == 1  # one tensor out (a mask), not a tuple: a tuple crossing a cut hides its tensors
    g.output(env[outs[0]] if single else tuple(env[o] for o in outs))
    gm.add_submodule(name, _VmapRegion(gm, g, "VmapRegion"))
    with gm.graph.inserting_before(region[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        # the call takes the module path of the region's first node, so cost roll-ups and module paths still place it
        call.meta["nn_module_stack"] = dict(region[0].meta.get("nn_module_stack") or {})
        for idx, o in enumerate(outs):
            get = call if single else gm.graph.call_function(operator.getitem, (call, idx))
            get.meta["nn_module_stack"] = call.meta["nn_module_stack"]
            # uses inside the region are left alone: those nodes are erased next
            o.replace_all_uses_with(get, delete_user_cb=lambda user: user not in inside)
    # reversed: erase_node refuses a node that still has users, so users go before what they read
    for n in reversed(region):
        gm.graph.erase_node(n)
    return call


def _rebind_attributes(model: nn.Module, unlifted: nn.Module, graph: fx.Graph) -> nn.Module:
    """Point every ``get_attr`` at the model's own tensor under its canonical FQN; return a module holding them.

    ``ep.module()`` already reuses the model's tensor objects, but a tied weight may be reached under its second
    name (GPT-2's embedding reads ``lm_head.weight``) and other torch versions may copy or rename: the canonical
    name comes from object identity, then from the target name.
    """
    canonical = _canonical_names(model)
    by_name: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    by_name.update(model.named_buffers(remove_duplicate=False))
    first: dict[str, fx.Node] = {}
    holder = nn.Module()
    for node in [n for n in graph.nodes if n.op == "get_attr"]:  # graph order: a kept node precedes its twins
        obj = _resolve(unlifted, str(node.target))
        target, obj = _original(str(node.target), obj, canonical, by_name)
        # an attribute nothing reads would otherwise become a stray tensor on the holder
        if not node.users:
            graph.erase_node(node)
        elif target in first:  # a second read of a tied weight: reuse the first node
            node.replace_all_uses_with(first[target])
            graph.erase_node(node)
        else:
            node.target, first[target] = target, node
            _attach(holder, target, obj)
    for node in [n for n in graph.nodes if n.op == "call_module"]:
        _attach(holder, str(node.target), _resolve(unlifted, str(node.target)))
    return holder


def _canonical_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        # first name wins: the one named_parameters() keeps for a tied weight, as util.canonical_names gives it
        names.setdefault(id(t), name)
    return names


def _original(target: str, obj: Any, canonical: dict[int, str], by_name: dict[str, Tensor]) -> tuple[str, Any]:
    if id(obj) in canonical:
        return canonical[id(obj)], obj
    orig = by_name.get(target)
    # identity lost (a torch version that copies): take the model's tensor under the same name only if it looks the same
    if isinstance(obj, Tensor) and orig is not None and orig.shape == obj.shape and orig.dtype == obj.dtype:
        return canonical[id(orig)], orig
    return target, obj  # a constant export lifted out of forward (not a model attribute)


def _resolve(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _attach(root: nn.Module, target: str, obj: Any) -> None:
    *path, field = target.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    # a plain tensor as a buffer, so it moves with .to() and is listed by named_buffers; setattr registers a Parameter
    if isinstance(obj, Tensor) and not isinstance(obj, nn.Parameter):
        root.register_buffer(field, obj)
    else:
        setattr(root, field, obj)
