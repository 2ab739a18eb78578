"""Named spans of the runtime's host work, for the torch profiler.

Each span is a ``torch.profiler.record_function`` named ``rpcompile::<activity>`` (``rpcompile::<activity> <detail>``
where a detail helps, e.g. the stage and microbatch): Perfetto shows them on each thread's track, and
``benchmarks/trace_table.py`` and ``benchmarks/floor.py`` sum a step's host time by activity. A span is recorded
only while a profiler is: otherwise :func:`span` is a null context after one C++ call, so an unprofiled step pays
nothing measurable.

The activities:

- ``wait``: a device's thread waits for the microbatch a stage needs from the stage before it (on another device);
- ``inputs``: a stage's inputs brought up from host memory (hand-offs still landing are waited for here);
- ``compute``: a stage's operators dispatched (on a GPU: its kernels launched), its backward included;
- ``outputs``: a stage's outputs, saved activations and input gradients handed to the copy threads;
- ``grads out``: a stage's parameter gradients sent home after its last microbatch;
- ``weights up``: a stage's weights uploaded (on the device's prefetch thread, or its own);
- ``copy out``: an offloader thread's copy to host memory (saved activations, hand-offs, gradients);
- ``grad sink``: gradients added into the parameters' ``.grad`` (the sink's thread);
- ``weights refresh``: the weights' copies in the compute precision remade from the fp32 masters.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["ACTIVITIES", "PREFIX", "span"]

PREFIX = "rpcompile::"
#: The runtime's host work, each a profiler span named ``rpcompile::<activity>``.
ACTIVITIES = ("wait", "inputs", "compute", "outputs", "grads out", "weights up", "copy out", "grad sink",
              "weights refresh")

_NULL = contextlib.nullcontext()  # reusable: one object for every unprofiled span


def span(activity: str, detail: str = "") -> Any:
    """A profiler span for ``activity`` (one of :data:`ACTIVITIES`) while a profiler records; else a null
    context."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return _NULL
    return torch.profiler.record_function(f"{PREFIX}{activity} {detail}" if detail else PREFIX + activity)
