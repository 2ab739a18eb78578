"""Symbolic shapes for captured segments: one capture serves every batch size and sequence length.

A saved segment (:mod:`rpcompile.runtime.segments.saved`) is captured by AOTAutograd on fake tensors. Made from the real
example with every dimension of the segment's *activation* inputs symbolic (parameters and buffers keep their
sizes), the fw and bw graphs compute their shapes from their inputs, and one capture runs every shape the trace
did not have to specialise. What it did specialise is recorded by the fake tensors' ``ShapeEnv`` as
**guards** (``t6.size()[2] == 32``, ``2 <= t6.size()[0]``, ``t7.size()[0] == t6.size()[0]``); a capture is used
for a call only when its guards hold for the call's tensors (:meth:`Guards.hold`), exactly as ``torch.compile``
guards its graphs. Sizes 0 and 1 are specialised (a one-row microbatch gets a capture of its own).

Terms: **hint** — the value a symbol had in the example the capture was traced with; **bindings** — the values
the symbols of one capture take in one call (read off its tensors' sizes and the saved sizes).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence, cast

import sympy
import torch
from torch.utils import _pytree as pytree
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP, DimDynamic, ShapeEnv, StatelessSymbolicContext

__all__ = ["Guards", "fake_inputs", "Binder", "size_binders", "bind_sizes",
           "concrete", "concrete_layout", "concrete_value"]


def fake_inputs(examples: Sequence[Any], dynamic: Sequence[bool]) -> tuple[FakeTensorMode, list[Any]]:
    """Fake copies of ``examples`` (``requires_grad`` kept) in a fresh fake mode with a shape environment; every
    dimension of ``examples[i]`` is a symbol where ``dynamic[i]``, a constant elsewhere. An int example (a size
    the segment receives from outside: a sequence length) becomes a symbol of its own. Each equal size gets its own
    symbol (no duck sizing): equalities the trace relies on become guards instead of assumptions."""
    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))
    # its dispatch cache costs more than it saves here: a hit rebuilds a symbolic output (strides, contiguity:
    # sympy), and a capture, in a shape environment of its own, reuses few entries
    mode.cache_enabled = False
    shape_env = mode.shape_env
    assert shape_env is not None
    fakes: list[Any] = []
    for i, (t, dyn) in enumerate(zip(examples, dynamic)):
        source = LocalSource(f"t{i}")
        if not isinstance(t, torch.Tensor):
            symbol = shape_env.create_symbol(t, source, dynamic_dim=DimDynamic.DYNAMIC, positive=t >= 0)
            fakes.append(shape_env.create_symintnode(symbol, hint=t, source=source))
            continue
        kind = DimDynamic.DYNAMIC if dyn else DimDynamic.STATIC
        context: StatelessSymbolicContext[..., Any] = StatelessSymbolicContext(dynamic_sizes=[kind] * t.dim())
        fake = mode.from_tensor(t, source=source, symbolic_context=context)
        fakes.append(fake.requires_grad_(t.requires_grad) if t.is_floating_point() else fake)  # integer tensors cannot
    return mode, fakes


class Guards:
    """What a capture traced on ``fakes`` assumed about its inputs' sizes, strides and offsets (static ones
    included), compiled once; :meth:`hold` checks a call's tensors against it."""

    def __init__(self, mode: FakeTensorMode, fakes: Sequence[torch.Tensor]):
        shape_env = mode.shape_env
        assert shape_env is not None
        produced = shape_env.produce_guards(list(fakes), [LocalSource(f"t{i}") for i in range(len(fakes))],
                                            ignore_static=False)
        # a microbatch is a slice of its batch: its storage offset varies, and the aten graphs never read it
        # ("True" where no guard is left: every shape may run the capture)
        self.text = " and ".join(g for g in produced if ".storage_offset()" not in g) or "True"
        self._code = compile(self.text, "<rpcompile guards>", "eval")
        self.symbolic = bool(shape_env.backed_var_to_val)
        """Whether any symbol survived the trace unspecialised (else the capture is one shape only)."""

    def hold(self, values: Sequence[Any]) -> bool:
        """Whether a call whose inputs (tensors and ints, as the capture's examples) are ``values`` may run it."""
        # the guard text calls sympy's helpers (SYMPY_INTERP) and names the inputs by their sources, L['t0'], ...
        return bool(eval(self._code, SYMPY_INTERP, {"L": {f"t{i}": v for i, v in enumerate(values)}}))


def _expr(v: Any) -> Any:
    return v.node.expr if isinstance(v, torch.SymInt) else v


#: Where a call's value of a symbol is: ``(input, dim, symbol)`` — dim ``dim`` of tensor input ``input``, or the
#: int input itself where ``dim`` is None (:func:`size_binders`).
Binder = tuple[int, "int | None", sympy.Symbol]


def size_binders(metas: Sequence[Any]) -> list[Binder]:
    """Where each symbol of a graph's inputs (their example values ``metas``) is bound in a call: a meta size (or a
    SymInt input) that is a bare symbol takes the value the call's tensor (or int) has in its place. Worked out
    once per graph; :func:`bind_sizes` reads a call's values off it."""
    out: list[Binder] = []
    for i, meta in enumerate(metas):
        if isinstance(meta, torch.Tensor):
            # a bare symbol only: a size such as s0*s1 cannot be solved for its symbols
            out += [(i, d, _expr(m)) for d, m in enumerate(meta.shape) if isinstance(_expr(m), sympy.Symbol)]
        elif isinstance(meta, torch.SymInt) and isinstance(_expr(meta), sympy.Symbol):
            out.append((i, None, _expr(meta)))
    return out


def bind_sizes(binders: Sequence[Binder], values: Sequence[Any]) -> dict[sympy.Symbol, int]:
    """The symbols' values in one call whose inputs are ``values`` (:func:`size_binders`)."""
    return {sym: int(values[i] if d is None else values[i].shape[d]) for i, d, sym in binders}


def concrete_value(v: Any, bindings: Mapping[sympy.Symbol, int]) -> int | None:
    """``v`` (an int or a SymInt) under ``bindings``; None if a symbol of it is unbound."""
    expr = _expr(v)
    if not isinstance(expr, sympy.Expr):
        return int(expr)
    # what is left unbound keeps a free symbol, so the result is not a number
    value = sympy.sympify(expr.xreplace(dict(bindings)))
    return int(value) if value.is_number else None


def concrete_layout(meta: torch.Tensor, bindings: Mapping[sympy.Symbol, int]) -> tuple[list[int], list[int]] | None:
    """``(shape, stride)`` that the traced tensor ``meta`` has in a call with ``bindings``; None if unknown."""
    shape = [concrete_value(s, bindings) for s in meta.shape]
    stride = [concrete_value(s, bindings) for s in meta.stride()]
    if None in shape or None in stride:
        return None
    return cast(list[int], shape), cast(list[int], stride)  # no None left (checked above)


def concrete(value: Any, bindings: Mapping[sympy.Symbol, int]) -> Any:
    """``value`` (a segment's non-tensor output: a size, a shape) with its symbols' values in this call."""
    def one(v: Any) -> Any:
        if not isinstance(v, torch.SymInt):
            return v
        out = concrete_value(v, bindings)
        if out is None:
            raise RuntimeError(f"a symbolic capture's output {v} depends on a size its inputs do not bind")
        return out
    return pytree.tree_map(one, value)
