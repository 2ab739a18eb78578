"""Host memory: what training keeps in CPU memory, predicted, and the check a pipeline makes before it allocates.

host footprint
    The fp32 masters, their gradients and the optimizer's state, an upload copy of each weight in the compute
    precision (:mod:`rpcompile.runtime.weights`) and the activations saved on the host
    (:mod:`rpcompile.runtime.offload`). Host memory, not the GPUs', is often what binds, and a run that outgrows it
    is killed mid-step with no message.

- :func:`host_memory` predicts a model's whole footprint (:class:`HostMemory`);
- :func:`check_host_memory` runs before a :class:`~rpcompile.training.pipeline.Pipeline` allocates: more than the
  OS reports available is refused (:class:`HostMemoryError`), no room for AdamW's moments warns
  (:class:`HostMemoryWarning`); ``RPCOMPILE_HOST_MEMORY=ignore`` skips it;
- the planner does not bound host memory: ``rpcompile.compile`` compares the plan's saved activations with
  :func:`activation_room` and, when they do not fit, re-plans with ``allow_save=False`` (:func:`fit_host_memory`);
- what ``compile`` itself allocates is not predicted: running out there is one :class:`HostMemoryError` line
  (:func:`within_host_memory`).

Predictions, not measurements: the optimizer's temporaries, Python, the CUDA context and the data loader are not
counted, and pinned buffers may take up to twice their bytes (:func:`rpcompile.runtime.weights.pinned_bytes`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rpcompile.core.errors import ConfigError, RPCompileError
from rpcompile.core.plan import Plan
from rpcompile.core.units import fmt_bytes, fmt_params
from rpcompile.runtime.weights import WeightStore

__all__ = ["HostMemory", "HostMemoryError", "HostMemoryWarning", "host_memory", "activation_bytes",
           "release_pinned_cache", "activation_room", "fit_host_memory", "available_host_memory", "check_host_memory",
           "within_host_memory", "ADAM_BYTES", "quantized_weights"]

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_BYTES = 8
"""Bytes of optimizer state per trainable fp32 parameter with AdamW (two moments)."""
#: The environment variable that turns the host-memory check off (``ignore``).
ENV = "RPCOMPILE_HOST_MEMORY"


class HostMemoryError(RPCompileError):
    """A pipeline would need more host memory than the machine has available."""


class HostMemoryWarning(UserWarning):
    """A pipeline fits in host memory, but an AdamW optimizer's state would not fit beside it."""


@dataclass(frozen=True)
class HostMemory:
    """Host memory to train a model whose frozen parameters are stored once (in the compute precision), in bytes."""

    frozen_params: int
    trainable_params: int
    frozen_bytes: int
    """The frozen base, in the compute precision."""
    trainable_bytes: int
    """Masters, gradients and AdamW state in fp32, plus the upload copy in the compute precision."""
    activation_bytes: int = 0
    """Activations an iteration holds on the host (saved for the backward, hand-offs); 0 without a plan."""
    quantized_params: int = 0
    """Frozen parameters stored quantized (4-bit NF4: their packed bytes and scales are in ``frozen_bytes``)."""

    @property
    def total_bytes(self) -> int:
        return self.frozen_bytes + self.trainable_bytes + self.activation_bytes

    def line(self) -> str:
        low = self.frozen_bytes / max(self.frozen_params, 1)
        each = self.trainable_bytes // max(self.trainable_params, 1)
        nf4 = f" ({fmt_params(self.quantized_params)} in 4-bit NF4)" if self.quantized_params else ""
        # a base partly in NF4 averages a fraction of a byte per weight: shown with two decimals then
        parts = [f"frozen base {fmt_params(self.frozen_params)} parameters{nf4} × {low:.{0 if low.is_integer() else 2}f}"
                 f" B = {fmt_bytes(self.frozen_bytes)}"] if self.frozen_params else []
        parts.append(f"trainable {fmt_params(self.trainable_params)} × {each} B (fp32 master, gradient, AdamW "
                     f"moments, upload copy) = {fmt_bytes(self.trainable_bytes)}")
        if self.activation_bytes:
            parts.append(f"activations on the host {fmt_bytes(self.activation_bytes)}")
        note = "" if self.activation_bytes else "; saved activations not included"
        return f"host memory {fmt_bytes(self.total_bytes)} (predicted{note}): {', '.join(parts)}"

    def to_dict(self) -> dict[str, int]:
        quantized = {"quantized_params": self.quantized_params} if self.quantized_params else {}
        return {"frozen_params": self.frozen_params, "trainable_params": self.trainable_params,
                "frozen_bytes": self.frozen_bytes, "trainable_bytes": self.trainable_bytes,
                "activation_bytes": self.activation_bytes, "total_bytes": self.total_bytes, **quantized}


def host_memory(model: nn.Module, precision: str = "bf16", plan: Plan | None = None) -> HostMemory:
    """:class:`HostMemory` of ``model`` trained in ``precision`` with AdamW (each parameter counted once), with the
    activations ``plan`` holds on the host when one is given."""
    if precision not in _BYTES:
        raise ConfigError(f"precision must be one of {sorted(_BYTES)}, got {precision!r}")
    low = _BYTES[precision]
    params = {id(p): p for p in model.parameters()}.values()
    frozen = sum(p.numel() for p in params if not p.requires_grad and p.is_floating_point())
    # a quantized base (4-bit NF4): stored as it is, packed indices and scales (runtime/weights.py stores a frozen
    # weight that is not floating once, uncast); counted by its weights, not its bytes
    packed = sum(p.numel() * p.element_size() for p in params if not p.requires_grad and not p.is_floating_point())
    quantized = quantized_weights(model)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    copy = low if low != 4 else 0  # fp32 on the devices: the master itself is uploaded
    return HostMemory(frozen + quantized, trainable, frozen * low + packed, trainable * (4 + 4 + ADAM_BYTES + copy),
                      activation_bytes(plan) if plan is not None else 0, quantized_params=quantized)


def quantized_weights(model: nn.Module) -> int:
    """How many weights ``model`` holds quantized: a bitsandbytes 4-bit layer's (its ``QuantState`` shape) and
    rpcompile's planning ones' (:mod:`rpcompile.tools.qlora`: their ``weights``)."""
    total = 0
    m: Any
    for m in model.modules():
        if type(m).__name__ in ("NF4Linear", "NF4Experts"):
            total += int(m.weights)
        elif type(m.__dict__.get("_parameters", {}).get("weight")).__name__ == "Params4bit":
            total += math.prod(m.weight.quant_state.shape)
    return total


def activation_bytes(plan: Plan) -> int:
    """Activations one iteration of ``plan`` holds on the host at its peak, once every microbatch's forward is done:
    each forward stage's saved activations and outputs (which the backward recomputes from), all microbatches."""
    return plan.microbatches * sum(s.offload_bytes + s.download_bytes for s in plan.stages if s.kind == "forward")


def available_host_memory() -> int | None:
    """Bytes the operating system can give this process without swapping (``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    # /proc/meminfo counts in kB (KiB)
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _state_bytes(params: dict[str, nn.Parameter], *, dtype: torch.dtype | None, pin: bool, uploaded: Iterable[str],
                 host_only: Iterable[str] = (), frozen_masters: bool = False) -> tuple[int, int, int]:
    """``(copies, gradients, AdamW state)`` a pipeline over ``params`` adds to host memory: the upload copies its
    :class:`~rpcompile.runtime.weights.WeightStore` allocates, the fp32 gradients that do not exist yet, and the two
    moments an AdamW optimizer would keep per trainable fp32 parameter."""
    copies = WeightStore.planned_bytes(params, dtype, pin=pin, uploaded=uploaded, host_only=host_only,
                                       frozen_masters=frozen_masters)
    trainable = {id(p): p for p in params.values() if p.requires_grad}.values()
    # a gradient that exists already is taken memory in what the OS reports available
    grads = sum(p.numel() * p.element_size() for p in trainable if p.grad is None)
    adam = ADAM_BYTES * sum(p.numel() for p in trainable if p.dtype == torch.float32)
    return copies, grads, adam


def release_pinned_cache() -> bool:
    """Hand PyTorch's cached pinned host memory that nothing uses back to the system; False where there is none to
    hand back (CUDA never used). A freed pinned buffer (a pipeline deleted) stays in PyTorch's cache, which
    ``MemAvailable`` counts as taken, so a second pipeline in the same process would be refused without this."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)  # torch < 2.9 has only the private one
    if empty is None:
        return False
    empty()
    return True


def _available(available: int | None) -> int | None:
    """``available``, else what the OS reports; None when unknown or the check is off (:data:`ENV`)."""
    if os.environ.get(ENV, "").lower() == "ignore":
        return None
    return available_host_memory() if available is None else available


def check_host_memory(params: dict[str, nn.Parameter], plan: Plan, *, dtype: torch.dtype | None, pin: bool,
                      uploaded: Iterable[str], host_only: Iterable[str] = (), frozen_masters: bool = False,
                      available: int | None = None) -> int:
    """Before a pipeline allocates: refuse (:class:`HostMemoryError`) when what it will allocate exceeds the host
    memory ``available`` (default :func:`available_host_memory`), warn (:class:`HostMemoryWarning`) when AdamW's state
    would not fit on top. Counted: upload copies as the pinned allocator rounds them, gradients that do not exist
    yet, saved activations and hand-offs at the plan's microbatches; against ``MemAvailable``, after PyTorch's
    cached pinned memory that nothing uses is handed back (:func:`release_pinned_cache`). Returns the bytes it will
    allocate."""
    copies, grads, adam = _state_bytes(params, dtype=dtype, pin=pin, uploaded=uploaded, host_only=host_only,
                                       frozen_masters=frozen_masters)
    acts = activation_bytes(plan)
    need = copies + grads + acts
    have = _available(available)
    if have is None:
        return need
    parts = (f"upload copies {fmt_bytes(copies)}, gradients {fmt_bytes(grads)}, activations on the host "
             f"{fmt_bytes(acts)} at {plan.microbatches} microbatches")
    # only when short, and only against the OS's figure: a freed pipeline's pinned buffers stay in torch's cache, which
    # MemAvailable counts as taken
    if need > have and available is None and release_pinned_cache():
        # None (meminfo unreadable now): the figure from before
        have = available_host_memory() or have
    if need > have:
        # the advice follows the largest part: the weights' copies and gradients, else activations the plan saves, else
        # the hand-offs between stages
        if acts <= copies + grads:
            fix = f"freeze the base and train adapters (LoRA: it is kept once, in {dtype_name(dtype)})"
        elif any(s.offload_bytes for s in plan.stages):
            fix = ("re-plan with allow_save=False (rpcompile.compile(..., allow_save=False): the backward recomputes "
                   "instead of keeping activations on the host)")
        else:
            fix = "use smaller batches (the activations handed between stages wait on the host for the backward)"
        raise HostMemoryError(
            f"host memory: this pipeline needs {fmt_bytes(need)} more ({parts}; predicted) but "
            f"{fmt_bytes(have)} are available; free host memory, {fix}, or set {ENV}=ignore to try anyway")
    if need + adam > have:
        warnings.warn(
            f"host memory: the pipeline takes {fmt_bytes(need)} ({parts}; predicted) of {fmt_bytes(have)} "
            f"available, which leaves no room for an AdamW optimizer's {fmt_bytes(adam)} of state (two fp32 "
            "moments a trainable parameter); use a lighter optimizer or train fewer parameters", HostMemoryWarning,
            stacklevel=4)
    return need


def activation_room(params: dict[str, nn.Parameter], plan: Plan, *, dtype: torch.dtype | None, pin: bool,
                    frozen_masters: bool = False, available: int | None = None) -> int | None:
    """Host bytes left for ``plan``'s activations once a pipeline's copies, new gradients and an AdamW optimizer's
    state are counted (None where the available memory is unknown or the check is off, :data:`ENV`)."""
    have = _available(available)
    if have is None:
        return None
    uploaded = [n for s in plan.stages for n in s.params if n in params]
    return have - sum(_state_bytes(params, dtype=dtype, pin=pin, uploaded=uploaded, frozen_masters=frozen_masters))


def fit_host_memory(made: Any, replan: Callable[[], Any], *, dtype: torch.dtype | None, pin: bool,
                    frozen_masters: bool = False) -> Any:
    """``made`` (a :class:`~rpcompile.planner.planning.Compilation`), or — when its plan keeps more activations on the host
    than :func:`activation_room` leaves — ``replan()`` (``rpcompile.compile``: the same graph solved again with
    ``allow_save=False``, :func:`~rpcompile.planner.planning.replanned`), with one
    :class:`HostMemoryWarning` giving both plans' predicted iteration times. Not called when ``allow_save`` is
    given (``allow_save=True`` keeps the saving plan)."""
    plan = made.plan
    # a plan that saves nothing on the host has nothing to recompute instead
    if not any(s.offload_bytes for s in plan.stages):
        return made
    kept = activation_bytes(plan)
    room = activation_room(dict(made.graph.named_parameters()), plan, dtype=dtype, pin=pin,
                           frozen_masters=frozen_masters)
    if room is not None and kept > room and release_pinned_cache():
        room = activation_room(dict(made.graph.named_parameters()), plan, dtype=dtype, pin=pin,
                               frozen_masters=frozen_masters)
    if room is None or kept <= room:
        return made
    again = replan()
    # room is negative when the copies, gradients and optimizer state alone outgrow the host: shown as 0
    warnings.warn(
        f"host memory: the plan kept {fmt_bytes(kept)} of activations on the host but {fmt_bytes(max(room, 0))} "
        f"are left beside the weights' copies, gradients and an AdamW optimizer's state; re-planned to recompute "
        f"them instead (allow_save=False): iteration {plan.predicted.iteration_time_s:.4g} s -> "
        f"{again.plan.predicted.iteration_time_s:.4g} s (predicted); allow_save=True keeps the saving plan",
        HostMemoryWarning, stacklevel=3)
    return again


#: torch's CPU allocator out of memory: ``DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes``
_ALLOCATOR = re.compile(r"can't allocate memory(?:: you tried to allocate (\d+) bytes)?")


@contextlib.contextmanager
def within_host_memory(what: str) -> Iterator[None]:
    """Run ``what`` (``compile``), turning the host running out of memory — torch's CPU allocator refusing, or
    Python's ``MemoryError`` — into one :class:`HostMemoryError` line: how much was asked for, where in rpcompile,
    what is available, and what to do. Other errors pass unchanged."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        found = _ALLOCATOR.search(str(e)) if isinstance(e, RuntimeError) else None
        if isinstance(e, RuntimeError) and found is None:
            raise
        # torch's message names the bytes asked for; Python's MemoryError does not
        asked = f"an allocation of {fmt_bytes(int(found.group(1)))}" if found and found.group(1) else "memory"
        have = _available(None)
        available = f"; {fmt_bytes(have)} available" if have is not None else ""
        raise HostMemoryError(
            f"{what} ran out of host memory: {asked} failed {_where(e)}{available}; free host memory, or give "
            f"{what} less to do: an example batch no larger than one step's (it is run once, node by node, to "
            # from None: this one line is the whole report (where it failed is in it)
            "measure costs), or spec='rtx4090' (any GPU spec) for analytic costs that run nothing") from None


def _where(e: BaseException) -> str:
    """The innermost frame of rpcompile's own code in ``e``'s traceback, as ``in passes/cost/measured.py (prepare)``."""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        parts = frame.filename.replace(os.sep, "/").split("/")
        for top in ("passes", "runtime", "rpcompile"):
            if top in parts[:-1]:
                # from the last folder so named: the checkout's own path may hold "rpcompile" higher up
                at = "/".join(parts[len(parts) - 1 - parts[::-1].index(top):])
                return f"in {at} ({frame.name})"
    return "in compile"


def dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "the compute precision"
