"""Type-check the package with mypy under the module names it installs as (``make typecheck``).

``passes/`` and ``runtime/`` install as ``rpcompile.passes`` and ``rpcompile.runtime`` (pyproject's
``[tool.setuptools.package-dir]``). mypy's command line cannot say that: given the directories it names
``passes/solver/ilp.py`` ``passes.solver.ilp``, so ``from ..core.plan import Plan`` there and every ``import
rpcompile.passes.x`` elsewhere would not resolve (with ``ignore_missing_imports`` they silently become ``Any`` and go
unchecked). The editable install does not help either: it maps the names with an import hook, and mypy finds modules on
disk only. So this script lets mypy collect the files and read ``[tool.mypy]`` as usual, renames each module to its
installed name and runs the same build. Extra arguments go to mypy (e.g. ``--no-incremental``).
"""

from __future__ import annotations

import sys

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options

__all__ = ["main"]

# source directory -> installed package (pyproject.toml's package-dir)
INSTALLED = {"rpcompile": "rpcompile", "passes": "rpcompile.passes", "runtime": "rpcompile.runtime"}


def main(argv: list[str]) -> int:
    sources, options = process_options([*INSTALLED, *argv])
    for source in sources:
        top, dot, rest = source.module.partition(".")
        source.module = INSTALLED[top] + dot + rest
    try:
        messages = build.build(sources, options).errors
    except CompileError as e:  # a blocking error (syntax, a file found twice): mypy stops at it
        messages = e.messages
    for line in messages:
        print(line)
    errors = [line for line in messages if ": error: " in line]
    files = {line.split(":", 1)[0] for line in errors}
    if errors:
        print(f"Found {len(errors)} error(s) in {len(files)} file(s) (checked {len(sources)} source files)")
        return 1
    print(f"Success: no issues found in {len(sources)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
