"""The round-robin schedule as data (docs/architecture.md §3).

An :class:`Action` is one unit of work on one device and prints as ``<stage><kind><microbatch>``:
``3F1`` runs stage 3 on microbatch 1; ``3W`` uploads stage 3's weights, ``3G`` sends its gradients home. A
schedule is one list of actions per device; the executor runs each list in order on its device's worker and the
simulator walks the very same lists with a clock.

Stage ``k`` runs on device ``(k + offset) mod N``. On its device a stage's weight upload comes right after the
previous stage's compute begins (so it is prefetched while that stage computes), every microbatch follows, then
its gradient download (backward and fused stages only).

**Weights that stay** (:func:`weight_stays`). A stage's weights normally leave its device after its last
microbatch, so a parameter read by a forward stage and by the backward stage that differentiates it crosses the
link twice an iteration. A plan may keep some on the device instead, from one use to the next use on the same
device (``stays``), or keep every weight there across iterations (``resident``): the later stage finds them and
uploads only the rest. Which weights a stage finds, leaves behind and holds for others is this walk's, the same
for the timing model (segments' weights, :mod:`rpcompile.passes.solver.stays`) and the runtime (parameters,
:mod:`rpcompile.runtime.stays`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Generic, Hashable, Literal, Sequence, TypeVar, cast

from .errors import ConfigError

__all__ = ["Action", "ActionKind", "round_robin", "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "format_schedule",
           "parse_action", "OVERLAP_ITERATIONS", "steady_period", "Stay", "weight_stays"]

ActionKind = Literal["W", "F", "G"]
_ACTION = re.compile(r"^(\d+)([WFG])(\d*)$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``W`` upload weights, ``F`` compute one microbatch, ``G`` download gradients."""

    stage: int
    kind: ActionKind
    microbatch: int = -1

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch if self.kind == 'F' else ''}"


def parse_action(text: str) -> Action:
    m = _ACTION.match(text)
    # an F action names its microbatch, a W or G action none
    if not m or (m.group(2) == "F") != bool(m.group(3)):
        raise ConfigError(f"not an action: {text!r} (examples: 3W, 3F0, 3G)")
    kind = cast(ActionKind, m.group(2))  # the pattern admits W, F and G only
    return Action(int(m.group(1)), kind, int(m.group(3)) if m.group(3) else -1)


def round_robin(kinds: Sequence[str], devices: int, microbatches: int, *, offset: int = 0) -> list[list[Action]]:
    """Per-device action lists for stages of the given kinds (``forward``/``fused``/``backward``) in order."""
    if devices < 1 or microbatches < 1:
        raise ConfigError(f"need devices >= 1 and microbatches >= 1, got {devices}, {microbatches}")
    lists: list[list[Action]] = [[] for _ in range(devices)]
    for k, kind in enumerate(kinds):
        actions = lists[(k + offset) % devices]
        actions.append(Action(k, "W"))
        actions.extend(Action(k, "F", j) for j in range(microbatches))
        if kind != "forward":
            actions.append(Action(k, "G"))
    return lists


#: A hashable item (a stage, a parameter name).
H = TypeVar("H", bound=Hashable)


@dataclass(frozen=True)
class Stay(Generic[H]):
    """One stage's weights as :func:`weight_stays` walks them (items: whatever the caller counts weights by)."""

    found: frozenset[H]
    """Its weights already on its device when it starts: not uploaded (a resident plan re-uploads those an
    optimizer step changed, into the same place; :attr:`first` says which it may be)."""
    kept: frozenset[H]
    """Its weights it leaves on the device after its last microbatch, for a later stage (or iteration)."""
    held: frozenset[H]
    """Other stages' weights on the device while it runs (device memory beside its own)."""
    first: frozenset[H]
    """Its weights no earlier stage of the iteration read on this device: in a resident plan, what an optimizer
    step since the last iteration made stale is refreshed here."""


def weight_stays(uses: Sequence[Collection[H]], devices: int, stays: Collection[H] = (), *, resident: bool = False,
                 offset: int = 0) -> list[Stay[H]]:
    """Which weights each stage finds on its device, leaves there and holds for others (module docstring).

    ``uses[k]``: the weights stage ``k`` reads (it runs on device ``(k + offset) mod devices``). A weight in
    ``stays`` is kept on the device after a stage that reads it as long as a later stage of the iteration on
    that device reads it too (the one that finds it); ``resident``: every weight stays on its device across
    iterations, so every stage finds its own (uploaded once; refreshed after an optimizer step, at its first use
    in the iteration). Anything else leaves the device after the stage."""
    if devices < 1:
        raise ConfigError(f"need devices >= 1, got {devices}")
    staying = set(stays)
    out: list[Stay[H] | None] = [None] * len(uses)
    for d in range(devices):
        mine = [k for k in range(len(uses)) if (k + offset) % devices == d]
        later: list[set[H]] = [set() for _ in mine]  # what the device's stages after each read
        for i in range(len(mine) - 2, -1, -1):
            later[i] = later[i + 1] | set(uses[mine[i + 1]])
        # resident: every weight the device's stages read is already there from the last iteration
        on: set[H] = {x for k in mine for x in uses[k]} if resident else set()
        seen: set[H] = set()
        for i, k in enumerate(mine):
            use = set(uses[k])
            # a weight stays only while a later stage on this device reads it; resident keeps every one
            keep = use if resident else {x for x in use if x in staying and x in later[i]}
            out[k] = Stay(found=frozenset(use & on), kept=frozenset(keep), held=frozenset(on - use),
                          first=frozenset(use - seen))
            seen |= use
            # what it read leaves unless kept; other stages' weights it held stay on
            on = (on - use) | keep
    return cast("list[Stay[H]]", out)


#: Consecutive iterations the simulator and the timing model play for an overlapped run: the first two cannot
#: wait for an optimizer step (iteration ``t`` waits for step ``t − 2``), the third may be the first that does;
#: the steady-state period is the mean of the twelve after it.
OVERLAP_ITERATIONS = 15


def steady_period(ends: Sequence[float]) -> float:
    """The steady-state period of consecutive overlapped iterations that ended at ``ends`` (s): the mean duration
    of the iterations after the third, ``(ends[-1] − ends[2]) / (len(ends) − 3)`` (of those after the first or
    second when there are fewer than four; one iteration: its end).

    Iterations differ only in which device runs which stage (the pointer carries on) and the devices are alike,
    but the round-robin recurrence is max-plus linear and such a system settles into a cycle of iterations, not
    always one long (Baccelli et al., "Synchronization and Linearity", 1992): plans of the benchmark models repeat
    every one to four iterations (their durations differ by up to 10%). Over :data:`OVERLAP_ITERATIONS` the mean
    is over twelve, exact for cycles of 1, 2, 3, 4, 6 and 12."""
    if len(ends) < 2:
        return ends[0] if ends else 0.0
    # leave out up to two iterations of start, keeping at least one duration to average
    skip = min(2, len(ends) - 2)
    return (ends[-1] - ends[skip]) / (len(ends) - 1 - skip)


def format_schedule(lists: Sequence[Sequence[Action]]) -> str:
    """``dev0: 0W 0F0 0F1 2W …`` one line per device."""
    return "\n".join(f"dev{d}: " + " ".join(map(str, acts)) for d, acts in enumerate(lists))


def _static_chain(devices: int) -> tuple[list[int], list[int]]:
    """Chain positions of a static pipeline with one stage per device: forward F_d is position d, backward B_d is
    position 2N−1−d, so "position k−1 finished microbatch j" is the dependency for both directions."""
    fwd = list(range(devices))
    # the backward positions continue the chain after the last forward one, in reverse device order
    bwd = [2 * devices - 1 - d for d in range(devices)]
    return fwd, bwd


def gpipe(devices: int, microbatches: int) -> list[list[Action]]:
    """GPipe (Huang et al., 2019) with one stage bound to each device: every forward, then every backward.
    Stages are chain positions (:func:`_static_chain`); weights stay resident, so there are no W/G actions."""
    fwd, bwd = _static_chain(devices)
    return [[Action(fwd[d], "F", j) for j in range(microbatches)] + [Action(bwd[d], "F", j) for j in range(microbatches)]
            for d in range(devices)]


def one_f_one_b(devices: int, microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): device d runs N−1−d warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards."""
    fwd, bwd = _static_chain(devices)
    lists = []
    for d in range(devices):
        warm = min(devices - 1 - d, microbatches)
        acts = [Action(fwd[d], "F", j) for j in range(warm)]
        f, b = warm, 0
        while f < microbatches:
            acts += [Action(fwd[d], "F", f), Action(bwd[d], "F", b)]
            f, b = f + 1, b + 1
        acts += [Action(bwd[d], "F", j) for j in range(b, microbatches)]
        lists.append(acts)
    return lists


def interleaved_one_f_one_b(devices: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al., SC 2021, Megatron-LM's virtual pipeline): each device holds ``chunks``
    model chunks; virtual stage ``s = c·N + d`` is chunk ``c`` of device ``d``. Forward chain positions are
    ``0..V−1`` and the backward of virtual stage ``s`` is position ``2V−1−s`` (V = N·chunks). Microbatches go
    through the chunks in groups of N; device d first runs ``2(N−1−d) + (chunks−1)·N`` warm-up forwards, then
    alternates one forward and one backward, then drains. Like Megatron-LM it needs ``microbatches % N == 0``."""
    n, m, v = devices, microbatches, chunks
    if n < 1 or m < 1 or v < 1:
        raise ConfigError(f"need devices, microbatches and chunks >= 1, got {n}, {m}, {v}")
    if m % n:
        raise ConfigError(f"interleaved 1F1B needs microbatches to be a multiple of devices ({m} is not a multiple "
                          f"of {n}); use {m + n - m % n} microbatches")
    positions, total = n * v, m * v

    def step(i: int, d: int, forward: bool) -> Action:
        # the i-th forward (or backward) of the device: groups of N microbatches pass through each chunk in turn
        chunk = (i // n) % v
        mb = (i // (n * v)) * n + i % n
        # backwards run the chunks in reverse
        s = (chunk if forward else v - 1 - chunk) * n + d
        return Action(s if forward else 2 * positions - 1 - s, "F", mb)

    lists = []
    for d in range(n):
        warm = min(2 * (n - 1 - d) + (v - 1) * n, total)
        acts = [step(i, d, True) for i in range(warm)]
        f, b = warm, 0
        while f < total:
            acts += [step(f, d, True), step(b, d, False)]
            f, b = f + 1, b + 1
        acts += [step(i, d, False) for i in range(b, total)]
        lists.append(acts)
    return lists
