"""The runtime: generated stage code, the round-robin executor, transfers, the CPU optimizer and the simulator.

(Arrives with the runtime issue; the package exists so the layout is installed from the start.)
"""

__all__: list[str] = []
