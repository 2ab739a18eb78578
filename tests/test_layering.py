"""Imports point one way down the layers (issue 18): Face → Passes → Core, and the Runtime imports only Core.

- **Core** (``rpcompile/core/``): the plan schema, device specs, errors, schedule actions: data. Imports only Core.
- **Runtime** (``runtime/``): runs plans; imports Core and torch, never the passes or the face.
- **Passes** (``passes/``): model → plan → stage code; import Core (and each other), never the face.
- **Face**: everything else in ``rpcompile/`` (compile, Pipeline, CLI, views, scenario drivers, demo): anything.

Every import counts, top-level and inside functions. :data:`KNOWN` lists the arrows against the layers that main
still has (none since issue 18): a new one fails here with its file and line, and a known one that is gone must
leave the list, so the list only shrinks. No module imports itself through others (no file-level import loop), and
the README's architecture table names every module, file for file.
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"core": {"core"}, "runtime": {"runtime", "core"}, "passes": {"passes", "core"},
           "face": {"face", "passes", "runtime", "core"}}

#: (importing file, imported module) arrows against the layers that main still has (none: keep it so).
KNOWN: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    """``passes/cost.py`` → ``rpcompile.passes.cost`` (the installed names)."""
    parts = list(path.with_suffix("").parts)
    if parts[0] in ("passes", "runtime"):
        parts.insert(0, "rpcompile")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    for name in ("core", "runtime", "passes"):
        if module == f"rpcompile.{name}" or module.startswith(f"rpcompile.{name}."):
            return name
    return "face"


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, module)`` of every rpcompile import in ``source`` (relative ones resolved)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            names = [target] if node.module or not node.level else [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n == "rpcompile" or n.startswith("rpcompile.")]
    return out


def violations(files: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(file, line, imported module)`` of each import against the layers in ``files`` (path → source)."""
    out = []
    for rel, source in files.items():
        path = Path(rel)
        mod = module_name(path)
        for line, target in imports(source, mod, path.name == "__init__.py"):
            if layer(target) not in ALLOWED[layer(mod)]:
                out.append((rel, line, target))
    return out


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for folder in ("rpcompile", "passes", "runtime")
            for p in sorted((ROOT / folder).rglob("*.py"))}


def test_no_new_import_against_the_layers_and_the_known_ones_shrink():
    found = violations(_sources())
    new = [f"{f}:{line} imports {m} ({layer(module_name(Path(f)))} → {layer(m)})" for f, line, m in found
           if (f, m) not in KNOWN]
    assert not new, "imports against the layers (tests/test_layering.py docstring):\n" + "\n".join(new)
    gone = KNOWN - {(f, m) for f, _, m in found}
    assert not gone, f"remove from KNOWN, they are fixed: {sorted(gone)}"


@pytest.mark.parametrize("rel,source,bad", [
    ("runtime/executor.py", "def f():\n    from rpcompile.planner.planning import prepare\n", "rpcompile.planner.planning"),
    ("runtime/devices.py", "from ..passes import cost\n", "rpcompile.passes"),
    ("passes/ilp.py", "import rpcompile.training.pipeline\n", "rpcompile.training.pipeline"),
    ("rpcompile/core/plan.py", "from ..runtime.executor import Executor\n", "rpcompile.runtime.executor"),
    ("rpcompile/core/schedule.py", "from rpcompile.passes import ilp\n", "rpcompile.passes"),
])
def test_an_arrow_against_the_layers_is_caught_with_its_file_and_line(rel, source, bad):
    assert violations({rel: source}) == [(rel, source.count("\n", 0, source.index("import")) + 1, bad)]


def test_arrows_down_the_layers_pass():
    ok = {"rpcompile/training/pipeline.py": "from rpcompile.runtime.executor import Executor\nfrom .passes import cost\n",
          "runtime/saved.py": "from rpcompile.core.errors import RPCompileError\nfrom .symbolic import Guards\n",
          "passes/ilp.py": "from rpcompile.core.plan import Plan\nfrom .problem import PartitionProblem\n"}
    assert violations(ok) == []


def _architecture_files(readme: str) -> set[str]:
    """Files the README's architecture table names: a row's first path gives the folder of the bare names after it."""
    section = readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    named = set()
    for row in (line for line in section.splitlines() if line.startswith("| ")):
        folder = ""
        for token in re.findall(r"`([^`]+)`", row):
            if "/" in token and (token.endswith(".py") or token.endswith("/")):
                folder = token.rpartition("/")[0] + "/"
                named.add(token) if token.endswith(".py") else None
            elif token.endswith(".py") and folder:
                named.add(folder + token)
    return named


def test_the_readme_architecture_names_every_module_file_for_file():
    named = _architecture_files((ROOT / "README.md").read_text())
    # a package's __init__ that only describes or re-exports needs no row; one that defines functions does
    modules = {rel for rel, source in _sources().items() if not rel.endswith("__init__.py")
               or any(isinstance(n, ast.FunctionDef) for n in ast.parse(source).body)}
    assert not modules - named, f"modules the README's architecture table does not name: {sorted(modules - named)}"
    assert not named - modules, f"the README's architecture table names files that do not exist: {sorted(named - modules)}"


def import_cycle(files: dict[str, str]) -> list[str]:
    """One cycle of module imports among ``files`` (path → source), or [] if there is none."""
    modules = {module_name(Path(rel)) for rel in files}
    graph: dict[str, set[str]] = {}
    for rel, source in files.items():
        mod = module_name(Path(rel))
        graph[mod] = set()
        for _, target in imports(source, mod, rel.endswith("__init__.py")):
            while target and target not in modules:  # ``from pkg.mod import name`` → pkg.mod
                target = target.rpartition(".")[0]
            if target and target != mod:
                graph[mod].add(target)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return list(e.args[1])
    return []


def test_no_module_imports_itself_through_others():
    assert import_cycle(_sources()) == []


def test_an_import_cycle_is_found():
    files = {"passes/cost.py": "from .analytic import A\n", "passes/analytic.py": "from .cost import CostModel\n"}
    assert sorted(set(import_cycle(files))) == ["rpcompile.passes.analytic", "rpcompile.passes.cost"]


def test_the_recurrence_is_plain_numbers():
    """``passes/recurrence.py`` — the round-robin recurrence the timing model, the local search's scorer and the
    overlapped-iterations walk share (issue 35) — imports no torch, no numpy and of rpcompile only Core: plain
    numbers, like the simulator it mirrors."""
    source = (ROOT / "passes" / "recurrence.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    ours = {n for n in names if n.startswith("rpcompile")}
    assert ours and all(layer(n) == "core" for n in ours), sorted(ours)
    assert names - ours <= {"__future__", "dataclasses", "typing", "math"}, sorted(names - ours)
