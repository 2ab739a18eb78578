"""What a simulation returns: the timeline of every piece of work, and the figures derived from it.

:func:`rpcompile.runtime.sim.simulator.simulate` produces a :class:`SimResult`; ``rpcompile simulate``, the scenario
drivers and the timeline pictures (:mod:`rpcompile.views.gantt`) read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SimEvent", "SimResult"]

_INF = math.inf


@dataclass(frozen=True)
class SimEvent:
    """One simulated piece of work: an action's compute, or one of its copies."""

    action: str
    """``3F1``, ``3W``, ``3G``; copies of a microbatch's activations are ``3F1<`` (in), ``3F1<<`` (saved, in),
    ``3F1>`` (out) and ``3F1>>`` (saved, out)."""
    device: int
    lane: str
    """Display lane: ``compute``, ``upload`` or ``download`` (``host`` for the host's work, which
    :attr:`SimResult.host_timeline` holds apart)."""
    kind: str
    """``compute``, ``weights``, ``activations`` or ``gradients`` (host: ``accumulate``, ``optimizer``)."""
    stage: int
    microbatch: int
    start: float
    end: float
    iteration: int = 0
    """Which iteration of a run of several it belongs to (``stage`` and ``action`` count within it)."""


@dataclass(frozen=True)
class SimResult:
    timeline: tuple[SimEvent, ...]
    iteration_time_s: float
    busy_s: tuple[float, ...]
    """Compute time per device."""
    peak_memory_bytes: tuple[int, ...] = ()
    """Peak device memory per device."""
    host_traffic_bytes: float = 0.0
    """Bytes that crossed host memory in the iteration (both directions)."""
    uploaded_bytes: tuple[float, ...] = ()
    """Per device: bytes copied host → device."""
    downloaded_bytes: tuple[float, ...] = ()
    """Per device: bytes copied device → host."""
    tokens_per_iteration: int = 0
    stage_names: tuple[str, ...] = ()
    memory_limit_bytes: int | None = None
    offload_backlog_bytes: tuple[int, ...] = ()
    """Per device: the most saved activations computed but not yet down in host memory at once (lazy offload;
    part of ``peak_memory_bytes``)."""
    pipeline_s: float = -1.0
    """The iteration before the optimizer step: the devices, their copies and the host's gradient accumulation
    (-1: not given, the same as ``iteration_time_s``)."""
    step_s: float = 0.0
    """The host's optimizer step and copy refresh (added to ``pipeline_s``, or overlapped with it)."""
    overlap_step: bool = False
    reduce_exposed_s: float = 0.0
    """Data-parallel: how much the all-reduce of the gradients lengthened the iteration (what the later stages did
    not hide)."""
    host_timeline: tuple[SimEvent, ...] = ()
    """The host's work: ``kA`` (stage k's gradients added into ``.grad``) and ``step`` (``device`` is only the
    device whose gradients it is; 0 for the step)."""
    iteration_ends_s: tuple[float, ...] = ()
    """A run of several consecutive iterations (``simulate(..., iterations=K)``): when each one's work was done —
    its devices, copies, gradient adds and all-reduces, not its optimizer step. Empty for one iteration. The
    figures above are then per iteration in the steady state: ``iteration_time_s`` is the period
    (:func:`~rpcompile.core.schedule.steady_period`), ``busy_s`` and the bytes are means per iteration, and the
    bubble is over the period; the run's one-off fill and drain are :attr:`fill_s` and :attr:`drain_s`."""

    @property
    def iterations(self) -> int:
        """Iterations simulated (1 unless a run of several)."""
        return max(1, len(self.iteration_ends_s))

    @property
    def first_iteration_s(self) -> float:
        """When the first iteration's work was done: one iteration's pipeline, fill and drain included."""
        return self.iteration_ends_s[0] if self.iteration_ends_s else self.span_s

    @property
    def fill_s(self) -> float:
        """Mean over the devices of the time before their first compute: what a run pays once to fill."""
        first = self._first_last()[0]
        # a device that never computes waited the whole run
        return sum(first.get(d, self._end()) for d in range(len(self.busy_s))) / max(len(self.busy_s), 1)

    @property
    def drain_s(self) -> float:
        """Mean over the devices of the time after their last compute until the run's (last iteration's) work
        is done: what a run pays once to drain."""
        last, end = self._first_last()[1], self._end()
        return sum(max(end - last.get(d, end), 0.0) for d in range(len(self.busy_s))) / max(len(self.busy_s), 1)

    def _end(self) -> float:
        return self.iteration_ends_s[-1] if self.iteration_ends_s else self.span_s

    def _first_last(self) -> tuple[dict[int, float], dict[int, float]]:
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for e in self.timeline:
            if e.lane == "compute":
                first[e.device] = min(first.get(e.device, _INF), e.start)
                last[e.device] = max(last.get(e.device, 0.0), e.end)
        return first, last

    @property
    def accumulate_s(self) -> float:
        """Time the host thread spent adding gradients into ``.grad`` (beside the pipeline; per iteration)."""
        return sum(e.end - e.start for e in self.host_timeline if e.kind == "accumulate") / self.iterations

    @property
    def reduce_s(self) -> float:
        """Data-parallel: time the network spent all-reducing gradients (0 on one node; per iteration)."""
        return sum(e.end - e.start for e in self.host_timeline if e.kind == "reduce") / self.iterations

    @property
    def span_s(self) -> float:
        """The devices' part of the iteration (``pipeline_s``, or the iteration when no host step was given):
        what the bubble and the utilisation are over — the host's optimizer step is reported apart."""
        return self.pipeline_s if self.pipeline_s >= 0 else self.iteration_time_s

    @property
    def bubble_fraction(self) -> float:
        """Idle compute time over total compute capacity (devices × :attr:`span_s`)."""
        total = len(self.busy_s) * self.span_s
        return 1.0 - sum(self.busy_s) / total if total > 0 else 0.0

    @property
    def utilisation(self) -> tuple[float, ...]:
        return tuple(b / self.span_s if self.span_s else 0.0 for b in self.busy_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_iteration / self.iteration_time_s if self.iteration_time_s > 0 else 0.0

    @property
    def fits(self) -> bool:
        """Every device's peak memory within the limit (True when no limit was given)."""
        return self.memory_limit_bytes is None or max(self.peak_memory_bytes, default=0) <= self.memory_limit_bytes

    def stage_times(self) -> dict[int, float]:
        """Per stage: mean compute time per microbatch as simulated."""
        sums: dict[int, list[float]] = {}
        for e in self.timeline:
            if e.lane == "compute":
                sums.setdefault(e.stage, []).append(e.end - e.start)
        return {k: sum(v) / len(v) for k, v in sorted(sums.items())}

    def idle_s(self) -> tuple[dict[str, float], ...]:
        """Per device, where its compute queue sat idle: ``fill`` before its first compute, ``drain`` after its
        last, ``waits`` between them (inputs not yet handed over, copies still draining, memory). The three add up
        to ``span − busy`` (:attr:`span_s`). A run of several iterations: in the steady state no device fills or
        drains, so all of it is ``waits``, the same on every device (the pointer moves the stages round them; the
        run's one-off fill and drain: :attr:`fill_s`, :attr:`drain_s`)."""
        first, last = self._first_last()
        out = []
        span = self.span_s
        mean = sum(self.busy_s) / max(len(self.busy_s), 1)
        for d, busy in enumerate(self.busy_s):
            if self.iteration_ends_s:
                # the mean busy time: the pointer gives every device every stage in turn, so they idle alike
                out.append(dict(fill=0.0, drain=0.0, waits=max(span - mean, 0.0)))
                continue
            if d not in first:
                # a device that ran no compute filled for the whole span
                out.append(dict(fill=span, drain=0.0, waits=0.0))
                continue
            fill, drain = first[d], max(span - last[d], 0.0)
            out.append(dict(fill=fill, drain=drain, waits=max(span - busy - fill - drain, 0.0)))
        return tuple(out)

    @property
    def idle_fractions(self) -> dict[str, float]:
        """``bubble_fraction`` split into fill, drain and waits (each over devices × :attr:`span_s`)."""
        total = len(self.busy_s) * self.span_s
        idle = self.idle_s()
        return {k: (sum(i[k] for i in idle) / total if total > 0 else 0.0) for k in ("fill", "drain", "waits")}

    def summary(self) -> dict:
        """The JSON-able figures (``rpcompile simulate --json``)."""
        return {
            "iteration_time_s": self.iteration_time_s,
            "bubble_fraction": self.bubble_fraction,
            "idle_fractions": self.idle_fractions,
            "tokens_per_s": self.tokens_per_s if self.tokens_per_iteration else None,
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "utilisation": list(self.utilisation),
            "host_traffic_bytes": self.host_traffic_bytes,
            "uploaded_bytes": list(self.uploaded_bytes),
            "downloaded_bytes": list(self.downloaded_bytes),
            "offload_backlog_bytes": list(self.offload_backlog_bytes),
            "fits": self.fits,
            "pipeline_s": self.pipeline_s if self.pipeline_s >= 0 else self.iteration_time_s,
            "host_step_s": self.step_s,
            "host_accumulate_s": self.accumulate_s,
            "overlap_step": self.overlap_step,
        } | ({"reduce_s": self.reduce_s, "reduce_exposed_s": self.reduce_exposed_s} if self.reduce_s else {}) \
          | (self.run_summary() if self.iteration_ends_s else {})

    def run_summary(self) -> dict:
        """A run of several iterations: the period, the first iteration, the one-off fill and drain, and when each
        iteration's work was done."""
        return {"iterations": self.iterations, "period_s": self.iteration_time_s,
                "first_iteration_s": self.first_iteration_s, "fill_s": self.fill_s, "drain_s": self.drain_s,
                "iteration_ends_s": list(self.iteration_ends_s)}
