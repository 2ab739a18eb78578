"""The solver's digest reads the code that runs (passes/solver/source.py): an edit to comments or docstrings keeps
every plan's record of its partitioner, an edit to the code does not."""

from __future__ import annotations

import pytest

from rpcompile.passes.solver import source
from rpcompile.passes.solver.source import runnable, solver_digest

MODULE = '''"""A module's docstring."""

import math  # why math

LIMIT = 2  # the limit
"""LIMIT's docstring."""


class Box:
    """A class's docstring, · and − in it."""

    size: int = 0
    """An attribute's docstring."""

    def area(self) -> float:
        """A method's docstring
        over two lines."""
        # a comment on a line of its own
        return math.pi * "·−".count("·") * self.size ** 2   # trailing
'''


def test_runnable_keeps_only_the_lines_that_run():
    assert runnable(MODULE) == ("import math\nLIMIT = 2\nclass Box:\n    size: int = 0\n    def area(self) -> float:\n"
                                "        return math.pi * \"·−\".count(\"·\") * self.size ** 2")


def test_a_string_in_an_expression_and_a_hash_in_a_string_stay():
    assert runnable('x = "# not a comment"\ny = f(\n    "a",  # why a\n    """b""")\n') == \
        'x = "# not a comment"\ny = f(\n    "a",\n    """b""")'


@pytest.fixture
def solver_folder(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text(MODULE)
    (tmp_path / "b.py").write_text("def f():\n    return 1\n")
    monkeypatch.setattr(source, "_ROOT", tmp_path)
    solver_digest.cache_clear()
    yield tmp_path
    solver_digest.cache_clear()


def test_explanations_keep_the_digest_and_code_moves_it(solver_folder):
    before = solver_digest()
    edited = MODULE.replace("# why math", "# another why").replace("A class's docstring", "Another docstring")
    (solver_folder / "a.py").write_text(edited.replace("\nclass Box", "\n\n\nclass Box") + "\n# one more\n")
    solver_digest.cache_clear()
    assert solver_digest() == before
    (solver_folder / "a.py").write_text(MODULE.replace("LIMIT = 2", "LIMIT = 3"))
    solver_digest.cache_clear()
    assert solver_digest() != before


def test_a_file_renamed_moves_the_digest(solver_folder):
    before = solver_digest()
    (solver_folder / "b.py").rename(solver_folder / "c.py")
    solver_digest.cache_clear()
    assert solver_digest() != before
