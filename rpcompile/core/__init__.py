"""Core: the data every layer shares, and nothing that decides or runs.

- :mod:`~rpcompile.core.plan`: the plan schema (frozen, versioned, saved as JSON);
- :mod:`~rpcompile.core.specs`: device specs (memory, compute, link bandwidth);
- :mod:`~rpcompile.core.errors`: the :class:`~rpcompile.core.errors.RPCompileError` hierarchy;
- :mod:`~rpcompile.core.schedule`: the round-robin schedule as lists of actions.

Core imports nothing else of rpcompile: the passes (model → plan → stage code), the runtime (runs a plan) and
the face (``compile``, ``Pipeline``, CLI, views) all import it (README "Architecture").
"""
