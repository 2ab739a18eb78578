"""Why a model could not be traced: the innermost module and user source line where each path failed, and what
to try (:func:`failure_message`, the text of :class:`~rpcompile.core.errors.TraceError`)."""

from __future__ import annotations

import os
import sysconfig
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Failure", "ModuleTracker", "failure_message"]


@dataclass(frozen=True)
class Failure:
    """Where one tracing path failed."""

    module: str
    module_class: str
    location: str
    source: str
    error: str
    exception: BaseException


class ModuleTracker:
    """Knows which submodule is running, with forward pre-hooks (push) and forward hooks (pop).

    When a forward raises, its post-hook never runs, so the stack still ends at the innermost failing module.
    Non-strict export runs the real Python, so the hooks fire there as under fx.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack: list[str] = []
        self.handles: list[Any] = []

    def __enter__(self) -> ModuleTracker:
        self.stack.clear()
        for name, module in self.model.named_modules():
            # no hooks on the root (""): an empty stack is what failure() reads as the root
            if name:
                self.handles.append(module.register_forward_pre_hook(self._push(name)))
                self.handles.append(module.register_forward_hook(self._pop(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _push(self, name: str) -> Any:
        return lambda module, args: self.stack.append(name)

    def _pop(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # cut back to this module's entry: also drops entries left by exceptions caught inside it
            while self.stack and self.stack.pop() != name:
                pass

        return hook

    def failure(self, exc: BaseException) -> Failure:
        name = self.stack[-1] if self.stack else ""
        location, source = _user_frame(exc)
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return Failure(
            module=name,
            module_class=type(self.model.get_submodule(name)).__name__,
            location=location,
            source=source,
            error=f"{type(exc).__name__}: {_shorten(first_line, 160)}",
            exception=exc,
        )


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SITE_DIRS = tuple({sysconfig.get_paths()[key] + os.sep for key in ("purelib", "platlib")})


def _user_frame(exc: BaseException) -> tuple[str, str]:
    """``("file:line in func", "source line")`` of the innermost frame outside torch, stdlib and this file."""
    # the chain runs from the raised error to its first cause: the original failure is searched first
    for e in reversed(_exception_chain(exc)):
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_user_file(f.filename)]
        if frames:
            f = frames[-1]
            return f"{_short_path(f.filename)}:{f.lineno} in {f.name}", (f.line or "").strip()
    return "<unknown location>", ""


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    # `not in chain`: an exception can be its own context further up, which would loop forever
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return chain


def _is_user_file(filename: str) -> bool:
    # "<eval_with_key": fx's generated forward; "<frozen": importlib's frozen modules
    if filename.startswith((_TORCH_DIR, "<eval_with_key", "<frozen")) or _is_own(filename):
        return False
    # site-packages sits inside the stdlib folder; model libraries there (transformers, ...) count as user code
    return filename.startswith(_SITE_DIRS) or not filename.startswith(_STDLIB_DIR)


def _is_own(filename: str) -> bool:
    """A frame of rpcompile's passes (the tracer itself, the in-place rewrite): never the user's."""
    return os.path.abspath(filename).startswith(_OWN_DIR)


def _short_path(filename: str) -> str:
    rel = os.path.relpath(filename)
    # relative only under the working directory; elsewhere the absolute path is the shorter, clearer one
    return filename if rel.startswith("..") else rel


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PATH_NAMES = {"fx": "torch.fx.symbolic_trace", "export": "torch.export (non-strict)"}


def failure_message(model: nn.Module, failures: dict[str, Failure | str]) -> str:
    tried = " and ".join(_PATH_NAMES[k] for k in failures)
    lines = [f"cannot trace {type(model).__name__}: {tried} {'both ' if len(failures) > 1 else ''}failed"]
    for key, failure in failures.items():
        lines += _describe(f"{key}:".ljust(7), failure)
    lines.append(_advice(*failures.values()))
    return "\n".join(lines)


def _describe(label: str, failure: Failure | str) -> list[str]:
    if isinstance(failure, str):
        return [f"  {label} {failure}"]
    cls = failure.module_class
    where = f"module '{failure.module}' ({cls})" if failure.module else f"the root module ({cls})"
    pad = " " * (len(label) + 3)
    source = f": {failure.source}" if failure.source else ""
    return [f"  {label} in {where} at {failure.location}{source}", f"{pad}{failure.error}"]


def _advice(*failures: Failure | str) -> str:
    culprits = [f.module for f in failures if isinstance(f, Failure) and f.module]
    leaf = f"pass leaf_modules=[{culprits[0]!r}] to keep that module opaque under fx" if culprits else (
        "move the offending code into a submodule and pass it in leaf_modules="
    )
    return (
        f"try: {leaf}; replace data-dependent Python control flow with torch.where or torch.cond; "
        "avoid .item(), .tolist() and Python loops over data-dependent sizes (e.g. len(torch.nonzero(x)))"
    )
