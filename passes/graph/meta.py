"""Running graph nodes on the ``meta`` device robustly (shapes only, no data).

A node traced on a real device may move tensors (``.to(device)``, HF code does), carry torch.export's
``aten._assert_tensor_metadata`` checks, or — once cast to a planning dtype such as bf16 — meet a tensor it
creates itself in fp32. :class:`MetaSafeMode` makes all three harmless: device arguments become ``meta``, asserts
are skipped, and an op that rejects mixed floating dtypes is re-run on inputs cast to the first one's. Both the
cost driver and the analytic cost model run nodes under it.
"""

from __future__ import annotations

import functools
import logging
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch._compile
import torch._decomp
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from rpcompile.core.batch import tensor_leaves

from .kernels import GpuKernels
from .util import CANONICAL_NAMES_KEY, canonical_names

__all__ = ["MetaSafeMode", "packet_name", "op_dtype", "run_unifying_dtypes", "stay_on_meta", "is_assert",
           "without_dynamo_import", "on_meta"]

aten = torch.ops.aten
log = logging.getLogger(__name__)


def packet_name(op: Any) -> str:
    """``aten.mm.default`` → ``"mm"``."""
    packet = getattr(op, "_overloadpacket", op)
    return getattr(packet, "__name__", str(packet)).split(".")[-1]


def is_assert(op: Any) -> bool:
    return packet_name(op).startswith("_assert")


def op_dtype(args: tuple, kwargs: dict) -> torch.dtype:
    """The dtype an op computes in: its first floating tensor input's (fp32 if none)."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)


def run_unifying_dtypes(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``func``; if it rejects mixed floating dtypes, run it again on inputs cast to the first one's.

    Casting a graph traced in fp32 to bf16 can pair a cast tensor with one the node creates in fp32 (a
    ``.float()`` that was a no-op, and so vanished, when the graph was traced). Only shapes matter here.
    """
    try:
        return func(*args, **kwargs)
    except RuntimeError as err:
        # only a dtype mismatch is retried; any other failure is the op's own
        if "dtype" not in str(err):
            raise
        dtype = op_dtype(args, kwargs)
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))
        return func(*args, **kwargs)


def stay_on_meta(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[dict, bool]:
    """``device=`` arguments become meta. Returns (kwargs, True when the op is a pure device move — a no-op on
    the one device that runs the node)."""
    if kwargs.get("device") is None or torch.device(kwargs["device"]).type == "meta":
        return kwargs, False
    # a _to_copy that keeps the dtype only changes the device
    pure = func._overloadpacket is aten._to_copy and kwargs.get("dtype") in (None, args[0].dtype)
    return {**kwargs, "device": torch.device("meta")}, pure


class MetaSafeMode(TorchDispatchMode):
    """Dispatch mode for shape-only runs (see module docstring). ``keep_moves``: a pure device move returns its
    input, as on the one device that runs the graph (``x.to(x.device)`` is ``x``), so the shapes record it as an
    alias; the whole-graph driver of :func:`on_meta` sets it (a mode pushed above it rewrites devices first)."""

    def __init__(self, *, keep_moves: bool = False):
        super().__init__()
        self.keep_moves = keep_moves

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if is_assert(func):
            return None
        kwargs, pure = stay_on_meta(func, args, kwargs or {})
        # copy=True asks for new storage even on the same device: that one stays a real op
        if pure and self.keep_moves and not kwargs.get("copy"):
            return args[0]
        return run_unifying_dtypes(func, args, kwargs)


def _dynamo_skipped() -> tuple[Callable[..., Any], ...]:
    """The functions torch's Python meta kernels wrap in ``torch._disable_dynamo`` (its ``inner`` imports
    ``torch._dynamo`` on a function's first call): found by following ``__wrapped__`` and closures from the
    decomposition and meta tables, ``torch._refs`` and the dispatch modes defined so far (each one's
    ``__torch_dispatch__`` is wrapped too). Empty if torch no longer works this way."""
    # every wrapper _disable_dynamo makes shares this code object: it is how the wrappers are recognised below
    inner = getattr(torch._compile._disable_dynamo(lambda: 0), "__code__", None)
    roots: list[Any] = list(torch._decomp.meta_table.values())
    roots += [f for table in torch._decomp.global_decomposition_table.values() for f in table.values()]
    roots += [v for name, mod in list(sys.modules.items()) if name.startswith("torch._refs") and mod is not None
              for v in list(vars(mod).values())]
    modes, i = [TorchDispatchMode], 0
    while i < len(modes):
        # every dispatch mode class, subclasses of subclasses included
        modes += modes[i].__subclasses__()
        i += 1
    roots += [vars(cls).get("__torch_dispatch__") for cls in modes]
    found: dict[int, Callable[..., Any]] = {}
    seen: set[int] = set()
    while roots:
        f = roots.pop()
        code = getattr(f, "__code__", None)
        if code is None or id(f) in seen:
            continue
        seen.add(id(f))
        # the wrapper holds the function it wraps in its closure cell `fn`
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in (f.__closure__ or ()))))
        if code is inner and callable(cells.get("fn")):
            found[id(cells["fn"])] = cells["fn"]
        roots += [v for v in (getattr(f, "__wrapped__", None), *cells.values()) if callable(v)]
    return tuple(found.values())


@contextmanager
def without_dynamo_import() -> Iterator[None]:
    """Run torch's Python meta kernels without importing ``torch._dynamo`` (~1 s of CPU the first time a meta
    ``rms_norm`` or ``add.Scalar`` runs: torch wraps each such kernel to be skipped by TorchDynamo and imports it
    to build the wrapper). While nothing has imported TorchDynamo nothing can be compiling, so each wrapper is
    told its function is its own skipped version for the duration, and forgets it afterwards (a later call, when
    something may compile, builds the real one). A no-op once TorchDynamo is imported."""
    if "torch._dynamo" in sys.modules:
        yield
        return
    key = "__dynamo_disable"  # the attribute torch._compile._disable_dynamo's wrapper caches its function in
    # a wrapper that already built its real function keeps it; only empty caches are filled (and emptied again)
    marked = [fn for fn in _dynamo_skipped() if getattr(fn, key, None) is None]
    for fn in marked:
        setattr(fn, key, fn)
    try:
        yield
    finally:
        for fn in marked:
            # only our own mark is removed: a real wrapper built meanwhile stays
            if getattr(fn, key, None) is fn:
                delattr(fn, key)


def _stand_in(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A meta tensor with ``t``'s shape, strides, dtype (``dtype`` instead, for a floating ``t``) and (for a
    parameter) ``requires_grad``."""
    as_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    m = torch.empty_strided(t.shape, t.stride(), dtype=as_dtype, device="meta")
    # still a Parameter with the model's requires_grad: the passes ask which weights are trainable
    return torch.nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else m


class _Runner(torch.nn.Module):
    """Holds ``gm`` as its child so :func:`torch.func.functional_call` swaps its parameters and buffers."""

    def __init__(self, gm: fx.GraphModule, fn: Callable[..., Any]):
        super().__init__()
        self.gm, self.fn = gm, fn

    def forward(self, *values: Any) -> Any:
        return self.fn(*values)


def on_meta(gm: fx.GraphModule, args: tuple, kwargs: dict, fn: Callable[[tuple, dict], Any], *,
            dtype: torch.dtype | None = None) -> bool:
    """Run ``fn(args, kwargs)`` — a pass that runs ``gm`` only for the shapes of its values — on the ``meta``
    device: ``gm``'s parameters and buffers are swapped for meta stand-ins (nothing is copied, and they are
    back when it returns), ``args``/``kwargs`` tensors become meta tensors, under :class:`MetaSafeMode`. A model
    on the CPU then costs no real forward pass (a Llama-3-8B shape at 2048 tokens is minutes of CPU). ``dtype``:
    the floating parameters' and buffers' stand-ins are in it (the compute precision; the real weights are not
    cast, which would take seconds a pass at 8B widths). False when the graph cannot run
    on meta (a data-dependent op such as ``nonzero`` or ``item``): the caller runs it on the real values instead.
    True, without swapping, when everything is on meta already in ``dtype``."""
    weights = [*gm.parameters(), *gm.buffers()]
    if all(t.device.type == "meta" for t in [*tensor_leaves((args, kwargs)), *weights]) and (
            dtype is None or all(t.dtype == dtype for t in weights if t.is_floating_point())):
        fn(args, kwargs)
        return True
    # one stand-in per tensor (a tied weight's names share it), and the id-keyed name cache of
    # passes/graph/util.py:canonical_names pointed at the stand-ins for the run, then back
    real = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    canonical = canonical_names(gm)
    stand_ins = {id(t): _stand_in(t, dtype) for _, t in real}
    # "gm.": the graph module is the _Runner's child of that name
    state = {f"gm.{name}": stand_ins[id(t)] for name, t in real}
    meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, _stand_in, (args, kwargs))
    gm.meta[CANONICAL_NAMES_KEY] = {id(stand_ins[i]): name for i, name in canonical.items() if i in stand_ins}
    try:
        with torch.no_grad(), MetaSafeMode(keep_moves=True), GpuKernels():  # GPU kernels' layouts, as the real run's
            # tie_weights=False: tied names already share one stand-in, and `state` names every one of them
            torch.func.functional_call(_Runner(gm, lambda: fn(meta_args, meta_kwargs)), state, (),
                                       tie_weights=False)
    except Exception as err:  # noqa: BLE001 - any failure: the real run decides (and raises its own error)
        log.debug("the graph cannot run on meta (%s: %s): running it on its real values", type(err).__name__, err)
        return False
    finally:
        gm.meta[CANONICAL_NAMES_KEY] = canonical
    return True
