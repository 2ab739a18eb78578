"""Solver: the partitioner, on plain numbers. The problem and the result every strategy returns (:mod:`.problem`),
the timing model and the round-robin recurrence it walks (:mod:`.timing`, :mod:`.recurrence`; its vectorised
tables :mod:`.tables`; the rules a plan obeys :mod:`.segment_rules`), weights that stay on their device
(:mod:`~rpcompile.passes.solver.stays`, :mod:`.stay_search`) and the strategies behind ``solve(problem, strategy)`` (:mod:`.partition`: the
CP-SAT ILP :mod:`.ilp`; heuristics and bounds :mod:`.greedy`, :mod:`.exact`, :mod:`.lagrange`, :mod:`.balance`,
:mod:`.bounds`; the baselines :mod:`.baselines`; local search :mod:`.polish` and its scorer :mod:`.scorer`).

It imports no torch, and of rpcompile only core (``tests/test_layering.py``). A plan records a digest of this
folder's source, every module of it (:func:`~.source.solver_digest`).
"""
