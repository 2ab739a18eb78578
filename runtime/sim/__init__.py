"""Simulation: the executor's own per-device action lists walked with a clock instead of devices
(:mod:`.simulator`), and what a simulation returns (:mod:`.sim_result`). Plain numbers: it imports core only.
"""
