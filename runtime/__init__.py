"""The runtime runs plans: the round-robin executor (``executor``), devices and their transfers (``devices``,
``offload``), saved segments (``saved``, ``symbolic``), seeded randomness (``rng``), schedules as action lists
(``schedule``) and the simulator that walks them with a clock (``simulator``). It never plans: the drivers that
plan and then simulate live in :mod:`rpcompile.scenarios`, timeline pictures in :mod:`rpcompile.gantt`.
(``split`` and ``codegen`` lower a plan into stage graphs and still sit here: issue 18 moves them to the passes.)
"""

__all__: list[str] = []
