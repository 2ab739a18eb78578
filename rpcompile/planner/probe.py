"""``rpcompile probe``: measure the host the optimizer step and the gradient accumulation run on.

The runtime keeps the fp32 masters and the optimizer on the host (docs/architecture.md §3), so an iteration also costs the
host's work: the optimizer step, the refresh of the compute-precision copies the devices upload, and the gradient
accumulation after each grad stage (:class:`~rpcompile.core.stages.HostLoad`). :func:`probe_host` measures the
rates the timing model needs, each the best of a few short repeats on buffers large enough to leave the caches:

- host memory bandwidth: a large ``copy_`` (bytes read + written per second);
- fp32 → bf16 cast into another buffer (parameters per second);
- bf16 → fp32 add-into (``grad.add_(g)`` with ``g`` in bf16, as the runtime's gradient sink does; parameters per
  second);
- torch's AdamW step (its fused kernel where this torch has one for the CPU, else ``foreach``) on a few million
  fp32 parameters (parameters per second);
- with CUDA: pinned and pageable host ↔ device copies.

It takes about a second; the result is a :class:`~rpcompile.core.specs.HostSpec` with ``source="probe"``,
which ``rpcompile plan --host FILE`` stores with the plan's hardware.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable

import torch

from ..core.errors import ConfigError
from ..core.files import read_json
from ..core.planfile import dataclass_problem
from ..core.specs import HostSpec

__all__ = ["probe_host", "load_host", "best_time"]

#: Elements of the probe's buffers: 8 M (32 MiB in fp32), past the last-level caches.
COPY_ELEMENTS = 8 * 2**20
#: Parameters of the AdamW probe: 4 M (64 MiB of parameters, gradients and moments, past the caches; torch's fused
#: AdamW ran at about the rate of a 50 M-parameter step here, benchmarks/results/optimizer.json).
ADAM_PARAMS = 4 * 2**20


def best_time(fn: Callable[[], object], repeats: int, *, sync: Callable[[], object] = lambda: None) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up (s)."""
    # untimed warm-up: the first call allocates and loads kernels
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    # callers divide by this time: never zero, even under a coarse clock
    return max(best, 1e-9)


def _adamw_step(n: int) -> Callable[[], object]:
    """One AdamW step on ``n`` fp32 parameters: the kernel ``AdamW(fused=True)`` runs, called directly (building
    the first ``torch.optim`` optimizer of a process imports ~2.5 s of machinery, longer than the whole probe);
    ``AdamW(foreach=True)`` where this torch has no fused CPU kernel."""
    p, g, m, v = torch.zeros(n), torch.full((n,), 1e-3), torch.zeros(n), torch.zeros(n)
    # the fused kernel takes its step count as a tensor (torch.optim keeps one per parameter)
    step = torch.zeros(())
    fused: Callable[..., object] | None = getattr(torch, "_fused_adamw_", None)

    def kernel() -> None:
        if fused is None:
            raise NotImplementedError("no fused AdamW kernel in this torch")
        # torch.optim increments the count before the kernel runs: at step 0 the bias correction would divide by zero
        step.add_(1)
        fused([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
              amsgrad=False, maximize=False)

    try:
        # one real call decides: a torch without a CPU fused kernel (or with another signature) raises here
        kernel()
        return kernel
    except (RuntimeError, TypeError, NotImplementedError):
        param = torch.zeros(n, requires_grad=True)
        param.grad = g
        return torch.optim.AdamW([param], lr=1e-4, foreach=True).step


def _link_rates(n_bytes: int, repeats: int) -> dict[str, float]:
    """Pinned and pageable host ↔ device copy rates on the current CUDA device (bytes/s)."""
    n = n_bytes // 2
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize
    return {
        "pinned_h2d": n_bytes / best_time(lambda: dev.copy_(pinned, non_blocking=True), repeats, sync=sync),
        "pinned_d2h": n_bytes / best_time(lambda: pinned.copy_(dev, non_blocking=True), repeats, sync=sync),
        "pageable_h2d": n_bytes / best_time(lambda: dev.copy_(pageable), repeats, sync=sync),
        "pageable_d2h": n_bytes / best_time(lambda: pageable.copy_(dev), repeats, sync=sync),
    }


def probe_host(*, elements: int = COPY_ELEMENTS, adam_params: int = ADAM_PARAMS, repeats: int = 3,
               cuda: bool | None = None) -> HostSpec:
    """Measure this host (see the module docstring). ``cuda``: also time host ↔ device copies (default: when
    CUDA is available)."""
    if elements < 1 or adam_params < 1 or repeats < 1:
        raise ConfigError(f"probe_host: elements, adam_params and repeats must be >= 1, got {elements}, "
                          f"{adam_params}, {repeats}")
    with torch.no_grad():
        src = torch.full((elements,), 0.5)
        dst = torch.empty(elements)
        half = torch.empty(elements, dtype=torch.bfloat16)
        copy_s = best_time(lambda: dst.copy_(src), repeats)
        cast_s = best_time(lambda: half.copy_(src), repeats)
        add_s = best_time(lambda: dst.add_(half), repeats)
        # freed before the AdamW probe allocates its own buffers
        del src, dst, half
    step_s = best_time(_adamw_step(adam_params), repeats)
    links = _link_rates(elements * 2, repeats) if (torch.cuda.is_available() if cuda is None else cuda) else {}
    threads = torch.get_num_threads()
    return HostSpec(
        memory_bandwidth=elements * 8 / copy_s,  # 4 B read + 4 B written per element
        cast_params_per_s=elements / cast_s,
        accumulate_params_per_s=elements / add_s,
        optimizer_params_per_s=adam_params / step_s,
        threads=threads,
        source="probe",
        note=f"probed on {platform.node() or 'this host'} ({os.cpu_count()} CPUs, {threads} torch threads"
             + (f", {torch.cuda.get_device_name()}" if links else "") + f", torch {torch.__version__})",
        **links,
    )


def load_host(path: str | os.PathLike) -> HostSpec:
    """A host saved by ``rpcompile probe --json FILE``."""
    try:
        data = read_json(path, max_bytes=1 << 20, max_depth=4)
    except OSError as e:
        raise ConfigError(f"cannot read the host file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not a host made by `rpcompile probe --json`: {e}") from None
    # probe -o writes {"host": ...}; probe --json prints the host itself: either is read
    host = data.get("host", data) if isinstance(data, dict) else data
    problem = dataclass_problem(HostSpec, host, "host")
    if problem is not None:
        raise ConfigError(f"{path} is not a host made by `rpcompile probe --json`: {problem}; probe again")
    try:
        return HostSpec.from_dict(host)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path} is not a host made by `rpcompile probe --json`: {' '.join(str(e).split())}"
                          ) from None
