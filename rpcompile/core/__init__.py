"""Core: the data every layer shares, and nothing that decides or runs.

- :mod:`~rpcompile.core.plan`: the plan schema (frozen, versioned, saved as JSON);
- :mod:`~rpcompile.core.program`: a lowered plan as data (stage programs, saved segments, host lookups);
- :mod:`~rpcompile.core.batch`: a call's inputs flattened into a graph's placeholders and split into microbatches;
- :mod:`~rpcompile.core.schedule`: the round-robin schedule (and its peers) as lists of actions;
- :mod:`~rpcompile.core.specs`: device specs (memory, compute, link bandwidth);
- :mod:`~rpcompile.core.stages`: one stage's costs, shared by the planner's timing model and the simulator;
- :mod:`~rpcompile.core.errors`: the :class:`~rpcompile.core.errors.RPCompileError` hierarchy;
- :mod:`~rpcompile.core.randomness`: which graph nodes draw random numbers;
- :mod:`~rpcompile.core.units`: numbers as people write them (parameter counts).

Core imports nothing else of rpcompile: the passes (model → plan → stage code), the runtime (runs a plan) and
the front end's rooms (models, planner, training, compiler, views, tools, CLI) all import it (README "Where the code lives").
"""
