"""A CPU AdamW over the fp32 masters that also refreshes each parameter's compute-precision copy in the same pass.

Terms:

- **master**: a trainable parameter's fp32 tensor in host memory; the Adam moments live there too.
- **mirror**: the bf16 or fp16 copy of a master that the pipeline uploads; it must equal ``param.to(copy.dtype)``
  after every optimizer step. Mirrors are runtime buffers, not optimizer state. Register one with
  :meth:`AdamW.mirror`.
- **backend** (``opt.backend``): ``"cpp"`` (a C++ extension, ``runtime/csrc/adamw.cpp``, built on first use) or
  ``"torch"`` (torch's fused AdamW then a ``copy_`` into each mirror).

With ``torch.optim.AdamW(fused=True)`` the mirror refresh is a second pass over the parameters; :class:`AdamW`
updates the parameter, its two moments and writes the mirror in one loop, so the masters stream through memory once
per step. Its docstring gives the backends, the exact update and the state keys (``state_dict`` moves between it and
``torch.optim.AdamW`` both ways).
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, overload

import torch
from torch.optim.adamw import adamw as torch_adamw

from rpcompile.core.errors import ConfigError

__all__ = ["AdamW", "BACKEND_ENV", "build_extension"]

BACKEND_ENV = "RPCOMPILE_ADAMW_BACKEND"
"""Environment variable that forces a backend: ``cpp`` (a failed build is an error) or ``torch``."""

_SOURCE = Path(__file__).resolve().parent / "csrc" / "adamw.cpp"
_EXTENSION_NAME = "rpcompile_adamw"
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]  # each operation rounds, as torch's CPU ops

#: The process's one attempt at the extension: ``module`` once built, ``failure`` (one line) once it failed.
_BUILD: dict[str, Any] = {}


def _extension() -> Any:
    """The compiled extension module, built on first call; raises :class:`RuntimeError` with one line on failure."""
    if "module" in _BUILD:
        return _BUILD["module"]
    if "failure" in _BUILD:
        raise RuntimeError(_BUILD["failure"])
    # Imported here, not at the top: cpp_extension pulls in setuptools, which only a build needs.
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        _BUILD["failure"] = f"no C++ compiler ({compiler!r} is not on PATH)"
    elif not cpp_extension.is_ninja_available():
        _BUILD["failure"] = "ninja is not installed"
    elif not _SOURCE.is_file():
        _BUILD["failure"] = f"{_SOURCE} is missing from the installed package"
    else:
        try:
            _BUILD["module"] = cpp_extension.load(name=_EXTENSION_NAME, sources=[str(_SOURCE)],
                                                  extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
            return _BUILD["module"]
        except Exception as e:  # noqa: BLE001 - any build failure means the fallback, with its reason
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            _BUILD["failure"] = f"{type(e).__name__}: {lines[0] if lines else 'no message'}"[:300]
    raise RuntimeError(_BUILD["failure"])


def build_extension() -> str:
    """Build the C++ kernel now (a no-op when torch's extension cache holds a current build) and return the file it
    loaded from; raises :class:`RuntimeError` (one line) when it does not build. ``make test`` runs it first, so
    the C++ backend's tests run rather than skip."""
    return str(_extension().__file__)


def _resolve_backend() -> str:
    """``"cpp"`` or ``"torch"``: what :data:`BACKEND_ENV` asks for, else the extension if it builds."""
    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    if choice not in ("", "cpp", "torch"):
        raise ConfigError(f"{BACKEND_ENV}={choice!r}: use 'cpp' (the one-pass C++ kernel) or 'torch' "
                          f"(torch's fused AdamW, then a copy_ per mirror), or leave it unset")
    if choice == "torch":
        return "torch"
    try:
        _extension()
    except RuntimeError as e:
        if choice == "cpp":
            raise ConfigError(f"{BACKEND_ENV}=cpp, but rpcompile's C++ AdamW did not build: {e}") from None
        if not _BUILD.get("warned"):
            _BUILD["warned"] = True
            warnings.warn(f"rpcompile AdamW: the one-pass C++ kernel did not build ({e}); stepping with torch's fused "
                          f"AdamW plus a copy_ per mirror. For the fast path install a C++ compiler and ninja "
                          f"(pip install ninja); {BACKEND_ENV}=torch picks the fallback without this warning",
                          RuntimeWarning, stacklevel=4)
        return "torch"
    return "cpp"


def _number(value: Any) -> float:
    """A float or a one-element tensor (torch allows tensor lr and betas) as a Python float."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW for CPU fp32 parameters that also writes registered compute-precision copies (mirrors).

    Takes torch's arguments ``lr`` (float or one-element tensor), ``betas``, ``eps``, ``weight_decay``, ``amsgrad``
    and ``maximize``; torch's other ones (``foreach``, ``fused``, ``capturable``, ``differentiable``) only at
    their defaults, since this step is always one fused CPU pass. Parameters must be contiguous CPU float32
    tensors and their gradients float32.

    Two backends, ``opt.backend`` says which one runs:

    - ``"cpp"``: ``runtime/csrc/adamw.cpp``, compiled with ``torch.utils.cpp_extension.load`` into torch's extension
      cache on first use (once; needs a C++ compiler and ninja), threads over chunks of 16K elements with
      ``at::parallel_for``. On x86 an AVX2 build of the loop is picked at run time; it writes the mirror per 256-element
      block from L1 with non-temporal stores (nothing on the CPU reads the mirror before the GPUs upload it), which
      saves the read of every mirror line a plain store costs.
    - ``"torch"``: ``torch.optim.adamw.adamw(fused=True)`` and then ``copy_`` into each mirror (two passes). Used when
      the extension does not build (with one warning saying why) or when ``RPCOMPILE_ADAMW_BACKEND=torch``;
      ``RPCOMPILE_ADAMW_BACKEND=cpp`` makes a failed build an error instead.

    Numerics: the update is torch.optim.AdamW's (decoupled weight decay), per element and in this order, in fp32 with
    the scalars computed in double per tensor and rounded to fp32 once (as torch's fused CPU kernel does)::

        g = -grad if maximize else grad
        p = p * (1 - lr * weight_decay)
        m = lerp(m, g, 1 - beta1)                   # torch's lerp: m + w (g - m) for w < 0.5, else g - (g - m)(1 - w)
        v = v * beta2 + (1 - beta2) * g * g
        v_max = max(v_max, v)                       # amsgrad: the denominator uses v_max
        p = p + (-lr / (1 - beta1**step)) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)
        mirror = p.to(mirror.dtype)                 # round to nearest even (c10::BFloat16 / c10::Half), as torch

    with ``step`` the parameter's own count after the increment. The scalars (``1 - lr * weight_decay``, the step size
    ``-lr / (1 - beta1**step)``, ``sqrt(1 - beta2**step)``, ``1 - beta1``, ``1 - beta2``) are Python/C++ doubles rounded
    to fp32 once, as in both of torch's CPU paths; the square root of the bias correction is ``math.sqrt`` as in torch's
    fused kernel (its for-loop takes ``** 0.5``). The differences: torch's vectorised kernels fuse some multiply-adds
    (FMA on AVX2, in lerp and addcmul), while the C++ loop rounds every operation (``-ffp-contract=off``, so its SSE2
    and AVX2 builds agree bit for bit), so the two differ by a few fp32 ulps per step; the torch backend is torch's own
    fused kernel. The mirror equals ``param.to(dtype)`` bit for bit on both backends (a NaN stays a NaN, though its bit
    pattern may differ from the one torch's cast writes).

    State keys and param-group keys are torch's (``step`` as a float32 tensor, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``), so ``state_dict`` moves between this class and ``torch.optim.AdamW`` both ways, and lr
    schedulers drive ``group["lr"]`` as usual. Mirrors are runtime buffers, not state: ``state_dict`` leaves them out.
    """

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None) -> None:
        for name, value, default in (("foreach", foreach, None), ("capturable", capturable, False),
                                     ("differentiable", differentiable, False), ("fused", fused, None)):
            if value is not default and value != default:
                raise ConfigError(f"rpcompile AdamW: {name}={value!r} is not supported (the step is always one fused "
                                  f"CPU pass; it takes lr, betas, eps, weight_decay, amsgrad and maximize)")
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ConfigError(f"rpcompile AdamW: a tensor lr must have one element, got shape {tuple(lr.shape)}")
        # written as "not >=" so that a NaN is refused too
        if not _number(lr) >= 0.0:
            raise ConfigError(f"rpcompile AdamW: lr must be >= 0, got {_number(lr)}")
        if not eps >= 0.0:
            raise ConfigError(f"rpcompile AdamW: eps must be >= 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= _number(b) < 1.0 for b in betas):
            raise ConfigError(f"rpcompile AdamW: betas must be two numbers in [0, 1), got {tuple(betas)}")
        if not weight_decay >= 0.0:
            raise ConfigError(f"rpcompile AdamW: weight_decay must be >= 0, got {weight_decay}")
        self._mirrors: dict[int, torch.Tensor] = {}
        self._backend: str | None = None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Optimizer.__getstate__ pickles only defaults, state and param_groups: these two do not come back
        self.__dict__.setdefault("_mirrors", {})
        self.__dict__.setdefault("_backend", None)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, refusing parameters that are not contiguous CPU float32 tensors."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if p.device.type != "cpu" or p.dtype != torch.float32 or p.is_sparse or not p.is_contiguous():
                layout = "sparse" if p.is_sparse else "contiguous" if p.is_contiguous() else "non-contiguous"
                raise ConfigError(f"rpcompile AdamW: parameter {i} of group {index} is a {layout} {p.dtype} tensor "
                                  f"on {p.device}; it steps contiguous CPU float32 masters only")

    @property
    def backend(self) -> str:
        """``"cpp"`` (one pass, the C++ extension) or ``"torch"`` (fused AdamW, then ``copy_``); resolved on first use."""
        if self._backend is None:
            self._backend = _resolve_backend()
        return self._backend

    def mirror(self, param: torch.Tensor, copy: torch.Tensor | None) -> None:
        """After every step, ``copy`` holds exactly ``param.to(copy.dtype)``; ``copy=None`` unregisters.

        ``copy`` must be a contiguous CPU tensor of ``param``'s shape and a floating dtype (bf16 or fp16 in
        practice; pinned memory is fine). It is filled now, so it is valid from registration on; registering
        another copy for the same parameter replaces the first. A step refreshes every registered copy, also
        those of parameters it skips for want of a gradient. Changing ``param`` outside a step needs
        ``mirror(param, copy)`` again.
        """
        # by identity: "in" would compare tensors element by element
        if not any(p is param for group in self.param_groups for p in group["params"]):
            raise ConfigError("rpcompile AdamW.mirror: the tensor is not one of this optimizer's parameters")
        if copy is None:
            self._mirrors.pop(id(param), None)
            return
        if not isinstance(copy, torch.Tensor):
            raise ConfigError(f"rpcompile AdamW.mirror: the copy must be a tensor or None, got {type(copy).__name__}")
        if (copy.shape != param.shape or not copy.dtype.is_floating_point or copy.device.type != "cpu"
                or not copy.is_contiguous()):
            raise ConfigError(f"rpcompile AdamW.mirror: the copy must be a contiguous CPU floating tensor shaped "
                              f"{tuple(param.shape)}, got a {'' if copy.is_contiguous() else 'non-contiguous '}"
                              f"{copy.dtype} tensor shaped {tuple(copy.shape)} on {copy.device}")
        with torch.no_grad():
            copy.copy_(param)
        self._mirrors[id(param)] = copy

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW step over every parameter with a gradient, refreshing the registered mirrors."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        backend = self.backend
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group, backend)
        return loss

    def _step_group(self, index: int, group: dict[str, Any], backend: str) -> None:
        amsgrad, maximize = bool(group["amsgrad"]), bool(group["maximize"])
        lr, eps, weight_decay = _number(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        beta1, beta2 = (_number(b) for b in group["betas"])
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        max_exp_avg_sqs: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        for i, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                # a mirror equals its master after every step, even one that skips the parameter
                if id(p) in self._mirrors:
                    self._mirrors[id(p)].copy_(p)
                continue
            if grad.dtype != torch.float32 or grad.device.type != "cpu" or grad.is_sparse:
                raise ConfigError(f"rpcompile AdamW: the gradient of parameter {i} of group {index} is a "
                                  f"{'sparse ' if grad.is_sparse else ''}{grad.dtype} tensor on {grad.device}; "
                                  f"it needs dense CPU float32 gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif not isinstance(state["step"], torch.Tensor):  # an old state dict's plain number
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device="cpu")
            if amsgrad and "max_exp_avg_sq" not in state:  # amsgrad switched on after the first step
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(grad.contiguous())  # the C++ loop walks raw memory
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if amsgrad:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        mirrors = [self._mirrors.get(id(p)) for p in params]
        if backend == "cpp":
            neg_step_sizes, bc2_sqrts = [], []
            for step_t in steps:
                step_t += 1  # in place: the count lives in the state's tensor, as torch keeps it
                # the scalars in double per tensor, rounded to fp32 once in the kernel (class docstring)
                step = step_t.item()
                neg_step_sizes.append(-lr / (1.0 - beta1 ** step))
                bc2_sqrts.append(math.sqrt(1.0 - beta2 ** step))
            _extension().adamw_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, mirrors, neg_step_sizes,
                                    bc2_sqrts, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize)
            return
        # torch's step increments the counts itself
        torch_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, fused=True, amsgrad=amsgrad,
                    beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)
        for p, copy in zip(params, mirrors):
            if copy is not None:
                copy.copy_(p)
