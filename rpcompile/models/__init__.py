"""Built-in models (LLaMA/Qwen3-style, Qwen3-MoE-style, GPT-2-style, a small ConvNet) and the MODEL resolver.

Every built-in model is traceable by plain ``torch.fx.symbolic_trace``; :func:`.registry.load_model` turns a name
such as ``llama-demo`` or ``llama-8b`` (built on the ``meta`` device) or a ``path/to/file.py:factory`` into a
:class:`.registry.ModelSpec` (model, example inputs, loss). Each name is imported from its module
(``rpcompile.models.registry``, ``rpcompile.models.llama``, ...): the package re-exports nothing.
"""
