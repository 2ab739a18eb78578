"""Graph: a model captured as a ``torch.fx.GraphModule``, and what the other passes read off it. Tracing
(:mod:`.trace`; why a trace failed :mod:`.trace_failure`; export's inputs :mod:`.export_inputs`; the compute
precision :mod:`.precision`; a 4-bit base traced packed :mod:`.quantized`), graphs that run anywhere (in-place ops
made out of place :mod:`.inplace`; any device and strides :mod:`.portable`), nodes run on the ``meta`` device as a
GPU runs them (:mod:`.meta`, :mod:`.kernels`), shapes and bytes (:mod:`.shape`; what one run leaves for the next
:mod:`.reuse`), a graph's fingerprint (:mod:`.fingerprint`) and small helpers (:mod:`.util`). It imports core and
torch only.
"""
