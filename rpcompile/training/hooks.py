"""The hooks rpcompile sets on a user's model and optimizers (:class:`Hook`): callables that pickle and copy as hooks
doing nothing."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Hook"]


# at module level: pickle refers to a function by its module and name, so a closure or lambda would not pickle
def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class Hook:
    """A hook rpcompile sets on a user's model or optimizer: ``fn``, called as the hook; pickled or deep-copied
    (``torch.save(model)``, ``copy.deepcopy(model)``), a hook that does nothing — the copy belongs to no pipeline,
    and ``fn`` (a closure) would not pickle."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Hook, (_nothing,))
