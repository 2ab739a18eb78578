"""Tools: what works on whole plans and models from outside the training loop. Plan diffs (:mod:`.plandiff`),
``rpcompile check`` (:mod:`.staleness`: is a plan stale), plan-then-simulate drivers (:mod:`.scenarios`,
:mod:`.simulation`), the simulator against the executor (:mod:`.simulator_validation`), LoRA at planning scale
(:mod:`.lora`) and the main job (:mod:`.demo`). Tools may import every room below the CLI.
"""
