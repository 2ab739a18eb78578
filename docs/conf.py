"""Sphinx configuration: the user guide (Markdown, myst-parser) and the API reference (autodoc of every module).

``make docs`` builds with ``-W -n``: every warning fails the build, and every cross-reference must resolve, so a
docstring that names a moved or removed rpcompile object fails it. Only references to other packages (torch,
Python, ...) are ignored: without internet there is no intersphinx inventory for them.
"""

from __future__ import annotations

import pkgutil
from typing import Any

import rpcompile

project = "rpcompile"
author = "rpcompile authors"
release = rpcompile.__version__
extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
html_theme = "alabaster"
nitpicky = True
autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "private-members": True,
    "ignore-module-all": True,
    "show-inheritance": False,
}
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_inherit_docstrings = False  # torch's docstrings (autograd.Function.backward) are not ours to check

#: Packages whose names the docs mention without documenting them (no intersphinx offline); never rpcompile.
EXTERNAL = ("torch", "transformers", "peft", "trl", "numpy", "np", "ortools", "safetensors", "bitsandbytes",
            "accelerate", "rich", "sympy", "functorch", "argparse", "collections", "concurrent", "contextlib",
            "dataclasses", "enum", "io", "json", "logging", "os", "pathlib", "queue", "re", "signal", "subprocess",
            "sys", "threading", "types", "typing", "typing_extensions", "weakref", "multiprocessing", "hashlib",
            "tempfile", "abc", "fx", "nn", "optim", "datasets", "builtins", "inspect", "functools", "itertools",
            "shutil", "struct", "time", "traceback", "warnings", "math", "random", "heapq", "operator", "pickle",
            "pytest", "hypothesis", "cp_model", "pywraplp", "_thread", "mmap", "zlib", "uuid", "socket", "platform",
            "datetime", "textwrap", "unittest", "importlib", "atexit", "gc", "ctypes", "select", "errno", "stat")
nitpick_ignore_regex = [
    # a quoted annotation autodoc splits at its commas (``'dict[str, int]'``): never a name of ours
    (r"py:.*", r"'.*"),
    *((r"py:.*", rf"{name}(\..*)?") for name in EXTERNAL),
    # Python's builtins and typing names, written bare in docstrings and type hints
    (r"py:.*", r"(int|float|str|bytes|bool|object|None|list|dict|tuple|set|frozenset|type|callable|Callable|"
               r"Any|Optional|Union|Iterable|Iterator|Sequence|Mapping|Literal|Exception|BaseException|"
               r"RuntimeError|ValueError|TypeError|KeyError|OSError|KeyboardInterrupt|NotImplementedError|"
               r"RuntimeWarning|UserWarning|Warning|AttributeError|SystemExit|TimeoutError|FileNotFoundError|"
               r"ellipsis|NoneType|Path|Tensor|Module|GraphModule|Node|Graph|Generator|Protocol|TypeVar|"
               r"ContextManager|AbstractContextManager|Self|ClassVar|Final|NamedTuple|TypedDict)"),
]


def _modules() -> list[str]:
    """Every module of the package, recursively (rpcompile, rpcompile.passes.*, rpcompile.runtime.*)."""
    import rpcompile.passes
    import rpcompile.runtime

    names = {"rpcompile", "rpcompile.passes", "rpcompile.runtime"}
    for package in (rpcompile, rpcompile.passes, rpcompile.runtime):
        names |= {info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")}
    # a ``__main__`` runs the CLI when imported
    return sorted(name for name in names if not name.endswith("__main__"))


def _public_surface() -> str:
    lines = []
    for name in rpcompile.__all__:
        if name == "__version__":
            continue
        obj = getattr(rpcompile, name)
        kind = ("autoclass" if isinstance(obj, type) else
                "autofunction" if callable(obj) else "autodata")
        lines += [f".. {kind}:: rpcompile.{name}", "   :no-index-entry:", ""]
    return "\n".join(lines)


def _every_module() -> str:
    lines = []
    for name in _modules():
        if name == "rpcompile":
            continue
        lines += [name, "-" * len(name), "", f".. automodule:: {name}", ""]
    return "\n".join(lines)


def _fill(app: Any, docname: str, source: list[str]) -> None:
    """The API pages' markers replaced by the generated directives (nothing generated is kept in the tree)."""
    if docname == "api":
        source[0] = (source[0].replace("<!-- public surface -->", "```{eval-rst}\n" + _public_surface() + "\n```")
                     .replace("<!-- every module -->", "```{eval-rst}\n" + _every_module() + "\n```"))


def setup(app: Any) -> None:
    app.connect("source-read", _fill)
