"""The solver's own source: every Python file of this folder, and its digest (what a plan and a solve cache entry
record, so that a new partitioner is not taken for the old one).

The digest reads the code a file runs, not its bytes: comments, docstrings (a module's, a class's, a function's, an
attribute's), blank lines and trailing spaces are left out (:func:`runnable`), so that a change to the explanations
alone keeps every plan's and every cache entry's record.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import tokenize
from pathlib import Path

__all__ = ["solver_files", "solver_digest", "runnable"]

_ROOT = Path(__file__).resolve().parent


def solver_files() -> list[Path]:
    """The partitioner's source: every Python file of the solver's folder, in name order."""
    return sorted(_ROOT.rglob("*.py"), key=lambda p: p.relative_to(_ROOT).as_posix())


def runnable(source: str) -> str:
    """``source`` without its comments, docstrings, blank lines and trailing spaces: the lines that run (it parses as
    ``source`` does, a body left empty aside)."""
    lines = source.split("\n")  # as the tokenizer and the parser count lines (read_text made every ending "\n")
    cuts: list[tuple[int, int, int, int]] = []  # (first line, column, last line, end column), lines from 1
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        if t.type == tokenize.COMMENT:
            cuts.append((*t.start, *t.end))
    # a string standing alone as a statement does nothing: a docstring, or an attribute's docstring after it
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            end_line = node.end_lineno or node.lineno
            cuts.append((node.lineno, _chars(lines[node.lineno - 1], node.col_offset), end_line,
                         _chars(lines[end_line - 1], node.end_col_offset or 0)))
    # from the last cut back, so that the positions of the ones still to make stay where the parser saw them
    for a, col, b, end in sorted(cuts, reverse=True):
        lines[a - 1:b] = [lines[a - 1][:col] + lines[b - 1][end:]]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def _chars(line: str, offset: int) -> int:
    # the parser counts columns in UTF-8 bytes, the tokenizer in characters ("−" and "·" are several bytes)
    return len(line.encode()[:offset].decode())


@functools.lru_cache(maxsize=1)
def solver_digest() -> str:
    """Digest of :func:`solver_files`: each file's path in the folder and its :func:`runnable` lines, in order."""
    h = hashlib.sha256()
    for path in solver_files():
        # NUL after the path and after the code: no two different sets of files hash the same stream
        h.update(path.relative_to(_ROOT).as_posix().encode() + b"\0" + runnable(path.read_text()).encode() + b"\0")
    return h.hexdigest()[:16]
