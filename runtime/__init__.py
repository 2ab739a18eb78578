"""The runtime runs plans; it never plans, and imports only :mod:`rpcompile.core` and torch.

It binds a lowered plan (:mod:`.bind`: saved segments, seeded random ops), runs it with the round-robin executor
(:mod:`.executor`; a stage's own steps :mod:`.stage_call`, host values and timeline :mod:`.values`, what a failed call
raises :mod:`.failures`) on devices and their transfers (:mod:`.devices`, :mod:`.offload`), uploads weights from host
copies in the compute precision made once per optimizer step and adds gradients home (:mod:`~rpcompile.runtime.weights`), keeps saved
segments' activations instead of recomputing them (:mod:`.segments.saved`, :mod:`.segments.capture`,
:mod:`.segments.symbolic`), replays randomness (:mod:`.rng`), names its host work for the profiler (:mod:`.activity`),
steps AdamW on the host writing those copies in the same pass (:mod:`.optim`), and simulates the same action lists with
a clock (:mod:`.sim.simulator`, :mod:`.sim.sim_result`). The schedules themselves are Core data
(:mod:`rpcompile.core.schedule`); plans and stage programs come from the passes; the drivers that plan and then simulate
live in :mod:`rpcompile.tools.scenarios`, timeline pictures in :mod:`rpcompile.views.gantt`.
"""

__all__: list[str] = []
