"""Training: a compiled model's session. :class:`~.pipeline.Pipeline` runs each call's batch (:mod:`.batches`,
:mod:`.loss_weighting`, checked against :mod:`.signature` and :mod:`.compiled_model`) through the runtime, steps
the optimizer (overlapped: :mod:`.overlap`), saves and resumes (:mod:`.checkpoint`, a sub-package: safetensors in
HF's layout, saves in the background), trains data-parallel (:mod:`.distributed`), budgets host and GPU memory (:mod:`.host_memory`, :mod:`.gpu_memory`,
:mod:`.oom`) and keeps one caller at a time and Ctrl-C out of a half-done step (:mod:`.callers`,
:mod:`.interrupts`); its options are :mod:`.options`. It receives the program a plan was lowered into as data
(the compiler lowers it) and imports only the runtime and core: never the passes, the planner or a view.
"""
