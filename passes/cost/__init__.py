"""Cost: every compute node's forward and backward time and bytes. The cost pass (:mod:`~rpcompile.passes.cost.cost`; its data and the
``CostModel`` interface :mod:`.cost_model`; the interpreter that runs it :mod:`.cost_interp`), costs measured on the
device at hand (:mod:`.measured`, kept on disk by :mod:`.profile_cache`) or analytic for a spec (:mod:`.analytic`),
repeated blocks measured once (:mod:`.repeats`) and the memory of a loss that runs after the graph
(:mod:`.loss_memory`). It imports the graph room, core and torch.
"""
