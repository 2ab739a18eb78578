"""Planner: a model to a plan. The pass driver (:mod:`.planning`: ``plan``, ``prepare``, ``compare``) runs the
passes in order under a plan's options (:mod:`.plan_options`), traces once for every LM-head split
(:mod:`.shared_trace`), rebuilds a plan's graph from its model and checks a plan's own rules (:mod:`.invariants`),
profiles a model (:mod:`.profiling`), measures the host and the GPU (:mod:`.probe`, :mod:`.device_probe`) and finds
the longest sequence that fits and the operating envelope (:mod:`.seqlen`, :mod:`.envelope`). It imports the passes,
the runtime's device helpers, the built-in models and core; never training, the views or the tools.
"""
