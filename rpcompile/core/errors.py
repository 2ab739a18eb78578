"""The error hierarchy: every domain error rpcompile raises derives from :class:`RPCompileError`.

Messages follow one shape: the constraint, the actual values, the remedy and the place.
"""

from __future__ import annotations

__all__ = [
    "RPCompileError",
    "TraceError",
    "PlanError",
    "PlanFileError",
    "PlanMismatchError",
    "PlanVerificationError",
    "InfeasibleError",
    "ModelSpecError",
    "BatchSplitError",
    "ConfigError",
    "InputError",
    "ModelChangedError",
    "ProblemError",
    "SimulationError",
    "LossHeadError",
    "ConcurrentCallError",
    "LossFnError",
    "one_line",
    "first_line",
]


def first_line(e: BaseException) -> str:
    """The first non-blank line of ``e``'s message ("" if it has none)."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "")


def one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (torch's messages run to several lines)."""
    text = first_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class RPCompileError(Exception):
    """Base class of every error rpcompile raises on purpose."""


class TraceError(RPCompileError):
    """Neither torch.fx symbolic tracing nor torch.export could capture the model."""

    # the tracer gives each error its own dict (passes/graph/trace.py); this default serves one raised without it
    failures: dict = {}
    """Tracing path (``fx``, ``export``) -> where and why it failed (the original exceptions ride along)."""


class ModelSpecError(RPCompileError):
    """A MODEL argument (built-in name or ``file.py:factory``) could not be resolved."""


class BatchSplitError(RPCompileError, ValueError):
    """A batch cannot be split into the requested microbatches."""


class PlanError(RPCompileError):
    """Base class of plan problems."""


class PlanFileError(PlanError):
    """A plan file is unreadable, corrupt, or written by a newer rpcompile."""


class PlanMismatchError(PlanError):
    """A plan was made for a different model (fingerprint mismatch)."""


class PlanVerificationError(PlanError):
    """A plan breaks one or more of the rules of :func:`rpcompile.verify_plan`.

    ``violations`` holds one line per broken rule instance; with ``source`` (the plan's file) the message is one line
    naming the first.
    """

    def __init__(self, violations: list[str], *, source: str = ""):
        self.violations = list(violations)
        if source:  # one line, for a plan given to compile: the first problem and how to see them all
            more = f" (and {len(self.violations) - 1} more)" if len(self.violations) > 1 else ""
            super().__init__(f"{source} does not fit this model: {self.violations[0]}{more}; re-plan it (rpcompile "
                             "plan), or see every problem with rpcompile check PLAN MODEL")
            return
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"plan is invalid ({len(self.violations)} problem(s)):\n{lines}")


class InfeasibleError(RPCompileError):
    """No partition fits the memory budget."""


class ConfigError(RPCompileError, ValueError):
    """An argument names something unknown or is out of range (a schedule name, a repeat count)."""


class ModelChangedError(RPCompileError):
    """The model's parameters are no longer the ones its pipeline was compiled with: one was replaced by a new
    ``nn.Parameter``, added or removed after ``compile`` (the pipeline would train the old ones)."""


class InputError(RPCompileError, ValueError):
    """A call's inputs do not match what the pipeline was compiled for (count, keywords, dtype, trailing
    dimensions, device, batch size, a missing target): refused before any stage runs."""


class LossFnError(RPCompileError, ValueError):
    """``loss_fn(output, target)`` raised on what a microbatch gave it — most often a target it cannot take (a
    float target for cross-entropy, another length) — or returned no scalar. The stage itself ran: the pipeline
    raises this, naming the target and the output, rather than the stage's ``PipelineError`` around it."""


class ProblemError(RPCompileError, ValueError):
    """A partition problem's numbers are malformed: lengths that disagree, negative bytes or times."""


class SimulationError(RPCompileError, ValueError):
    """The simulator cannot play these action lists on these stages (a deadlock, a missing stage, no bandwidth),
    or a layer profile's partitions do not fit its model."""


class LossHeadError(RPCompileError, ValueError):
    """The loss cannot be attached to the traced graph, or the LM head cannot be split into sequence chunks as
    asked (``head_chunks``). A ``ValueError`` too: ``planning.fastest`` drops a head split the graph refuses."""


class ConcurrentCallError(RPCompileError, RuntimeError):
    """A pipeline was called from a second thread while a call from another thread was still running in it: a
    pipeline runs one call at a time (:mod:`rpcompile.training.callers`)."""
