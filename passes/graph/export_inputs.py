"""How ``torch.export`` sees a model's inputs: symbolic sizes, and a signature that names every input.

Terms:

- *dynamic-shapes spec*: export's ``dynamic_shapes``, one entry per argument of ``forward`` as
  ``inspect.signature(model.forward).bind(*args, **kwargs)`` binds the inputs.
- *explicit signature*: for a ``forward(*args, **kwargs)`` (PEFT's ``PeftModel``, wrappers in general) a signature
  with one named parameter per input of this call — ``args_0``, ``args_1``, ... for the positional ones and each
  keyword by its name. torch 2.13's non-strict export mis-binds keywords that land in ``**kwargs`` when it checks
  the spec (it files them both under ``kwargs`` and as top-level names); with every input named there is nothing
  to mis-bind, and the exported program is still called exactly like the model.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn
from torch.export import Dim
from torch.utils import _pytree as pytree

__all__ = ["dynamic_shapes", "explicit_signature"]

_VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def dynamic_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Symbolic batch and sequence sizes for export: dim 0 of every tensor input, and dim 1 of integer ones (token
    ids, masks). ``Dim.AUTO`` lets export keep a size static where the model needs it (or where the example's
    size is 1), so one graph serves every batch and sequence length the model allows, with no re-trace. ``None``
    when the inputs do not bind to ``forward`` (export then names the mismatch)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None

    def dims(v: Any) -> Any:
        if not isinstance(v, Tensor) or v.dim() == 0:
            return None
        # dim 1 only of integer inputs (token ids, masks): a floating input's dim 1 may be channels or features
        seq = v.dim() >= 2 and not v.is_floating_point()
        return {0: Dim.AUTO, **({1: Dim.AUTO} if seq else {})}

    try:  # tree_map: inside a batch dict too
        # bound like the inputs themselves, so the spec has the structure export matches it against
        bound = signature.bind(*pytree.tree_map(dims, args), **pytree.tree_map(dims, kwargs))
    except TypeError:
        return None
    return dict(bound.arguments)


@contextlib.contextmanager
def explicit_signature(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """While exporting: if an input of this call lands in ``*args`` or ``**kwargs`` of ``model.forward``, give the
    instance a ``forward`` that calls the class's with an explicit signature naming each input of this call;
    restored afterwards (an instance's own ``forward``, e.g. one set by accelerate's hooks, included). The
    parameters stay the model's."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        yield
        return
    # `and v`: an empty *args or **kwargs holds nothing to mis-bind
    if not any(signature.parameters[n].kind in _VAR and v for n, v in bound.arguments.items()):
        yield  # every input binds to a named parameter: nothing to rename
        return
    original = model.forward

    def forward(*a: Any, **k: Any) -> Any:
        return original(*a, **k)

    forward.__signature__ = inspect.Signature(_named(signature, bound))  # type: ignore[attr-defined]
    # an instance's own forward (accelerate's hooks set one) is put back afterwards, not deleted
    own = model.__dict__.get("forward")
    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if own is None:
            # the class's forward shows through again
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = own


def _named(signature: inspect.Signature, bound: inspect.BoundArguments) -> list[inspect.Parameter]:
    positional, keyword = [], []
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            positional += [inspect.Parameter(f"{name}_{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD)
                           for i in range(len(value))]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            keyword += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in value]
        elif kind is inspect.Parameter.KEYWORD_ONLY:
            keyword.append(inspect.Parameter(name, kind))
        else:
            positional.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    return positional + keyword
