"""Imports point one way down the layers (issues 18 and 37): each room imports its own modules and the rooms below it.

Bottom to top (the map of the rooms: README "Where the code lives", docs/architecture.md §8):

- **Core** (``rpcompile/core/``): the plan schema, device specs, errors, schedule actions, units: data.
- **Models** (``rpcompile/models/``): the built-in models and the MODEL resolver.
- **Passes** (``passes/``: model → plan → stage code) ⟂ **Runtime** (``runtime/``: runs plans, imports torch).
  Inside them rooms stack too (:data:`INNER`): in ``passes/``, ``graph/`` < ``cost/`` < ``rewrite/``, the
  ``solver/`` beside them imports none of them (nor torch: every solver module imports in an interpreter that
  cannot import torch), and the modules at ``passes/``'s root join both sides; in ``runtime/``, ``sim/`` (the
  simulator) imports none of the rest.
- **Planner** (``rpcompile/planner/``: the pass driver, options, verify, profile, probes) ⟂ **Training**
  (``rpcompile/training/``: ``Pipeline`` and its session, which imports only Core, the Runtime and itself:
  :data:`ONLY`).
- **Compiler**: ``rpcompile/compiler.py`` (``compile``, the one module that joins planner and training) and the
  package itself (``rpcompile/__init__.py``, the public surface).
- **Views** (``rpcompile/views/``), then **Tools** (``rpcompile/tools/``) ⟂ **Integrations**
  (``rpcompile/integrations/``: HF Trainer, TRL), then the **CLI** (``rpcompile/cli/``, ``rpcompile/__main__.py``).

Rooms on one layer (⟂) never import each other. Every import counts, top-level and in functions. :data:`KNOWN`
lists the arrows against the layers that main still has (none since issue 18): a new one fails here with its file
and line, and a known one that is gone must leave the list, so the list only shrinks. No module imports itself
through others (no file-level import loop), every folder holds at most :data:`CEILING` loose modules (the front
end's root :data:`ROOT_CEILING`), and the architecture page's table (docs/architecture.md §8) names every module,
file for file.

Module docstrings stay short (:data:`DOCSTRING_CEILING` lines, issue 37 phase 7), and the why of a tricky line sits
in a comment beside it (at least :data:`COMMENT_FLOOR` comments per 1,000 lines).

One home per name (issue 37 phase 3): a name sits in one module's ``__all__`` (packages re-export nothing; the
public surface ``rpcompile/__init__.py`` points each public name at its home), and no ``_private`` name is used
outside its module — in the package and the benchmarks; tests may reach into the module they mirror.
:data:`KNOWN_TWO_HOMES` and :data:`KNOWN_PRIVATE` only shrink. Two modules never define the same public name (one
word, one meaning).
"""

from __future__ import annotations

import ast
import graphlib
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The layers, bottom to top; a room imports its own layer's modules only within itself, and every lower layer.
TIERS: tuple[tuple[str, ...], ...] = (("core",), ("models",), ("passes", "runtime"), ("planner", "training"),
                                       ("compiler",), ("views",), ("tools", "integrations"), ("cli",))
RANK = {room: rank for rank, rooms in enumerate(TIERS) for room in rooms}
ALLOWED = {room: {room} | {r for r in RANK if RANK[r] < RANK[room]} for room in RANK}

#: Rooms that import fewer rooms than their layer allows. The training session receives data (issue 37 phase 6): the
#: compiler lowers a plan into the program it runs, and the constants both sides need live in Core — so training
#: imports Core, the Runtime and itself, never the passes (nor the models or a view).
ONLY: dict[str, set[str]] = {"training": {"core", "runtime", "training"}}

#: Inside ``passes/`` and ``runtime/``: the rooms each room may import from its own folder ("" is the folder's root
#: modules, and the package itself).
INNER: dict[str, dict[str, set[str]]] = {
    "passes": {"graph": {"graph"}, "cost": {"graph", "cost"}, "rewrite": {"graph", "cost", "rewrite"},
               "solver": {"solver"}, "": {"graph", "cost", "rewrite", "solver", ""}},
    "runtime": {"sim": {"sim"}, "segments": {"segments", ""}, "": {"segments", "sim", ""}},
}

#: (importing file, imported module) arrows against the layers that main still has (none: keep it so).
KNOWN: set[tuple[str, str]] = set()

#: The most modules one chain of imports may pass through, top to bottom (:func:`longest_chain`); only comes down.
CHAIN_CEILING = 12

#: Loose modules (``*.py`` but ``__init__.py``) a folder may hold; the front end's root holds fewer.
CEILING, ROOT_CEILING = 20, 8
#: Folders allowed over :data:`CEILING` for now, each no further than its count here (none since issue 37's phase 2).
OVERFULL: dict[str, int] = {}


def module_name(path: Path) -> str:
    """``passes/cost/cost.py`` → ``rpcompile.passes.cost.cost`` (the installed names)."""
    parts = list(path.with_suffix("").parts)
    if parts[0] in ("passes", "runtime"):
        parts.insert(0, "rpcompile")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    """The room of ``module``: its folder, and for the front end's root modules the compiler's layer (the CLI's for
    ``rpcompile.__main__``)."""
    room = module.split(".")[1] if "." in module else "compiler"
    return room if room in RANK else "cli" if room == "__main__" else "compiler"


def inner_room(module: str) -> str | None:
    """The room of ``module`` inside ``passes/`` or ``runtime/`` ("" for the folder's root), None outside them."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "rpcompile" or parts[1] not in INNER:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in INNER[parts[1]] else ""


def against_the_layers(mod: str, target: str) -> bool:
    """Whether ``mod`` importing ``target`` points up or sideways: between the layers, or between the rooms inside
    ``passes/`` and ``runtime/``."""
    if layer(target) not in ALLOWED[layer(mod)] or layer(target) not in ONLY.get(layer(mod), RANK):
        return True
    room, other = inner_room(mod), inner_room(target)
    return room is not None and other is not None and layer(mod) == layer(target) \
        and mod.split(".")[1] == target.split(".")[1] and other not in INNER[mod.split(".")[1]][room]


def imports(source: str, module: str, is_package: bool, submodules: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every rpcompile import in ``source`` (relative ones resolved); ``submodules``: each
    ``from pkg import name`` also as ``pkg.name`` (a module, when ``name`` is one)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            names = [target] if node.module or not node.level else [f"{base}.{a.name}" for a in node.names]
            if submodules and node.module:
                names += [f"{target}.{a.name}" for a in node.names]
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
            if against_the_layers(mod, target):
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
    ("passes/solver/ilp.py", "import rpcompile.training.pipeline\n", "rpcompile.training.pipeline"),
    ("rpcompile/core/plan.py", "from ..runtime.executor import Executor\n", "rpcompile.runtime.executor"),
    ("rpcompile/core/schedule.py", "from rpcompile.passes import ilp\n", "rpcompile.passes"),
    ("rpcompile/core/units.py", "from ..models import load_model\n", "rpcompile.models"),
    ("rpcompile/models/llama.py", "from rpcompile.passes.graph.trace import trace\n", "rpcompile.passes.graph.trace"),
    ("rpcompile/training/pipeline.py", "from ..planner.planning import plan\n", "rpcompile.planner.planning"),
    ("rpcompile/planner/planning.py", "from rpcompile.training.batches import x\n", "rpcompile.training.batches"),
    ("rpcompile/training/host_memory.py", "from rpcompile.views.report import fmt_params\n",
     "rpcompile.views.report"),
    ("rpcompile/training/pipeline.py", "from rpcompile.passes.rewrite.split import split_plan\n",
     "rpcompile.passes.rewrite.split"),
    ("rpcompile/training/batches.py", "def f():\n    from ..passes.rewrite.loss_head import TARGET\n",
     "rpcompile.passes.rewrite.loss_head"),
    ("rpcompile/training/checkpoint/save.py", "from ...models.registry import load_model\n",
     "rpcompile.models.registry"),
    ("rpcompile/planner/probe.py", "from ..views.terminal import SafeTable\n", "rpcompile.views.terminal"),
    ("rpcompile/planner/seqlen.py", "from .. import compile\n", "rpcompile.compile"),
    ("rpcompile/training/overlap.py", "import rpcompile\n", "rpcompile"),
    ("rpcompile/compiler.py", "from .views.report import plan_table\n", "rpcompile.views.report"),
    ("rpcompile/views/gantt.py", "from ..tools.scenarios import Scenario\n", "rpcompile.tools.scenarios"),
    ("rpcompile/tools/demo.py", "from rpcompile.cli import main\n", "rpcompile.cli"),
    ("passes/solver/ilp.py", "from ..graph.util import compute_nodes\n", "rpcompile.passes.graph.util"),
    ("passes/solver/timing.py", "from .. import formulate\n", "rpcompile.passes.formulate"),
    ("passes/solver/problem.py", "from rpcompile.passes.cost.cost import COST_KEY\n", "rpcompile.passes.cost.cost"),
    ("passes/graph/shape.py", "from ..cost.cost import COST_KEY\n", "rpcompile.passes.cost.cost"),
    ("passes/cost/analytic.py", "from ..rewrite.coarsen import segments_of\n", "rpcompile.passes.rewrite.coarsen"),
    ("passes/rewrite/coarsen.py", "def f():\n    from ..lower import to_plan\n", "rpcompile.passes.lower"),
    ("passes/graph/util.py", "from ..solver.problem import SegmentPlan\n", "rpcompile.passes.solver.problem"),
    ("runtime/sim/simulator.py", "from ..weights import nbytes\n", "rpcompile.runtime.weights"),
])
def test_an_arrow_against_the_layers_is_caught_with_its_file_and_line(rel, source, bad):
    assert violations({rel: source}) == [(rel, source.count("\n", 0, source.index("import")) + 1, bad)]


def test_arrows_down_the_layers_pass():
    ok = {"rpcompile/training/pipeline.py": "from rpcompile.runtime.executor import Executor\nfrom ..core import plan\n"
                                              "from .batches import CallBatch\n",
          "rpcompile/training/checkpoint/save.py": "from ...core.program import Program\nfrom ..pipeline import x\n",
          "runtime/segments/saved.py": "from rpcompile.core.errors import RPCompileError\n"
                                       "from .symbolic import Guards\n",
          "passes/solver/ilp.py": "from rpcompile.core.plan import Plan\nfrom .problem import PartitionProblem\n",
          "rpcompile/planner/seqlen.py": "from rpcompile.models import load_model\nfrom ..runtime.devices import x\n",
          "rpcompile/compiler.py": "from .planner.planning import plan\nfrom .training.pipeline import Pipeline\n",
          "rpcompile/views/report.py": "from ..planner.profiling import Profile\nfrom rpcompile.core.units import x\n",
          "rpcompile/tools/demo.py": "import rpcompile\nfrom ..views.report import plan_table\n",
          "rpcompile/__main__.py": "from rpcompile.cli import main\n",
          "rpcompile/cli/plan_cmd.py": "from rpcompile.tools.lora import apply_lora\n",
          "passes/formulate.py": "from .solver.problem import PartitionProblem\nfrom .rewrite.coarsen import x\n",
          "passes/rewrite/coarsen.py": "from ..cost.cost import node_cost\nfrom ..graph.util import compute_nodes\n",
          "passes/solver/partition.py": "from ...core.errors import ConfigError\nfrom .ilp import solve_budget\n",
          "runtime/segments/saved.py": "from .. import rng\nfrom .capture import HostSaved\n",
          "runtime/executor.py": "from .segments import saved\nfrom .segments.capture import HostSaved\n"}
    assert violations(ok) == []


def test_every_room_inside_passes_and_runtime_has_its_rules():
    """A new folder in ``passes/`` or ``runtime/`` takes a place in :data:`INNER` (it would otherwise count as the
    folder's root, which may import every room)."""
    for top, rooms in INNER.items():
        found = {p.parent.name for p in (ROOT / top).glob("*/__init__.py")}
        assert found == set(rooms) - {""}, f"{top}/: rooms without rules in INNER {sorted(found - set(rooms))}"


def _import_without_torch(modules: list[str]) -> subprocess.CompletedProcess:
    """Import ``modules`` in a fresh interpreter whose every import of torch fails."""
    code = ("import importlib, sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError(f'torch is not importable here: {name}')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_every_solver_module_imports_without_torch():
    """The solver is plain numbers (docs/architecture.md §8): every module of ``passes/solver/`` imports where torch
    cannot be imported (the digest a plan records is that folder's source, ``solver.source.solver_files``)."""
    modules = sorted(module_name(p.relative_to(ROOT)) for p in (ROOT / "passes" / "solver").rglob("*.py"))
    assert "rpcompile.passes.solver.partition" in modules
    done = _import_without_torch(modules)
    assert done.returncode == 0, f"a solver module imports torch:\n{done.stderr}"


def test_a_module_that_imports_torch_is_caught():
    done = _import_without_torch(["rpcompile.passes.solver.problem", "rpcompile.passes.graph.util"])
    assert done.returncode != 0 and "torch is not importable here: torch" in done.stderr


def test_every_room_is_a_layer():
    """A new folder in the front end takes a place in :data:`TIERS` (it would otherwise count as the root's)."""
    rooms = {p.parent.name for p in (ROOT / "rpcompile").glob("*/__init__.py")}
    assert rooms <= set(RANK), f"folders of rpcompile/ with no layer in TIERS: {sorted(rooms - set(RANK))}"


def loose_modules() -> dict[str, int]:
    """Folder (relative to the repository) → how many modules it holds directly (``__init__.py`` not counted)."""
    folders = [p.parent for top in ("rpcompile", "passes", "runtime") for p in (ROOT / top).rglob("__init__.py")]
    return {str(f.relative_to(ROOT)): sum(1 for m in f.glob("*.py") if m.name != "__init__.py") for f in folders}


def test_no_folder_is_a_warehouse():
    counts = loose_modules()
    ceiling = {f: OVERFULL.get(f, ROOT_CEILING if f == "rpcompile" else CEILING) for f in counts}
    over = {f: n for f, n in counts.items() if n > ceiling[f]}
    assert not over, (f"folders over their ceiling of loose modules ({CEILING}; the front end's root {ROOT_CEILING}; "
                      f"OVERFULL: {OVERFULL}): {over} — give the new module a room (a sub-package)")
    fixed = {f for f in OVERFULL if counts.get(f, 0) <= CEILING}
    assert not fixed, f"remove from OVERFULL, they are under the ceiling now: {sorted(fixed)}"


#: The page whose table maps every module (the README links to it).
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ARCHITECTURE_SECTION = "## 8. Where the code lives"


def _architecture_files(page: str) -> set[str]:
    """Files the architecture page's table names: a row's first path gives the folder of the bare names after it."""
    section = page.split(ARCHITECTURE_SECTION, 1)[1].split("\n## ", 1)[0]
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


def test_the_architecture_page_names_every_module_file_for_file():
    named = _architecture_files(ARCHITECTURE.read_text())
    # a package's __init__ that only describes or re-exports needs no row; one that defines functions does
    modules = {rel for rel, source in _sources().items() if not rel.endswith("__init__.py")
               or any(isinstance(n, ast.FunctionDef) for n in ast.parse(source).body)}
    assert not modules - named, f"modules the architecture table (docs/architecture.md §8) does not name: {sorted(modules - named)}"
    assert not named - modules, f"the architecture table (docs/architecture.md §8) names files that do not exist: {sorted(named - modules)}"


def module_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """Module → the modules of ``files`` (path → source) it imports, top-level and in functions."""
    modules = {module_name(Path(rel)) for rel in files}
    graph: dict[str, set[str]] = {}
    for rel, source in files.items():
        mod = module_name(Path(rel))
        graph[mod] = set()
        for _, target in imports(source, mod, rel.endswith("__init__.py"), submodules=True):
            while target and target not in modules:  # ``from pkg.mod import name`` → pkg.mod
                target = target.rpartition(".")[0]
            if target and target != mod:
                graph[mod].add(target)
    return graph


def import_cycle(files: dict[str, str]) -> list[str]:
    """One cycle of module imports among ``files`` (path → source), or [] if there is none."""
    try:
        tuple(graphlib.TopologicalSorter(module_graph(files)).static_order())
    except graphlib.CycleError as e:
        return list(e.args[1])
    return []


def longest_chain(files: dict[str, str]) -> list[str]:
    """The longest chain of imports among ``files`` (an acyclic graph: :func:`import_cycle`), top module first."""
    graph = module_graph(files)
    below: dict[str, list[str]] = {}
    for mod in graphlib.TopologicalSorter(graph).static_order():  # a module after everything it imports
        below[mod] = [mod, *max((below[t] for t in graph[mod]), key=len, default=[])]
    return max(below.values(), key=len)


def test_no_module_imports_itself_through_others():
    assert import_cycle(_sources()) == []


def test_an_import_cycle_is_found():
    files = {"passes/cost/cost.py": "from .analytic import A\n",
             "passes/cost/analytic.py": "from .cost import CostModel\n"}
    assert sorted(set(import_cycle(files))) == ["rpcompile.passes.cost.analytic", "rpcompile.passes.cost.cost"]


def test_the_longest_import_chain_does_not_grow():
    """Issue 37 measured 19 modules from the CLI down to Core; the rooms brought it to 17, and cutting the imports
    that went sideways inside a room (a cache calling the solver, a fork helper reading the cache, a checkpoint's
    reader importing its writer, a view reading the planner for its data types) to :data:`CHAIN_CEILING`. The
    ceiling only comes down (issue 37's goal is ~8)."""
    chain = longest_chain(_sources())
    assert len(chain) <= CHAIN_CEILING, f"an import chain of {len(chain)} modules: " + " → ".join(chain)


def test_the_longest_chain_is_found():
    files = {"rpcompile/cli/main.py": "from ..tools import demo\nfrom ..core.units import fmt\n",
             "rpcompile/tools/demo.py": "from rpcompile.core.plan import Plan\n",
             "rpcompile/core/plan.py": "from .units import fmt\n", "rpcompile/core/units.py": ""}
    assert longest_chain(files) == ["rpcompile.cli.main", "rpcompile.tools.demo", "rpcompile.core.plan",
                                    "rpcompile.core.units"]


#: The most rooms one chain of imports may pass through (issue 37's "import chain from the CLI to core of ~8",
#: counted in rooms: the passes' and the runtime's rooms each one, a room's own modules one).
ROOM_CHAIN_CEILING = 8


def room_of(module: str) -> str:
    """The room of ``module``: ``passes.solver``, ``runtime.segments``, ``passes`` (its root) …, or its layer."""
    inner = inner_room(module)
    return layer(module) if inner is None else ".".join(filter(None, module.split(".")[1:2] + [inner]))


def room_chain(files: dict[str, str]) -> list[str]:
    """The rooms of the chain of imports among ``files`` that passes through the most rooms, top room first."""
    graph = module_graph(files)
    below: dict[str, list[str]] = {}
    for mod in graphlib.TopologicalSorter(graph).static_order():
        here = room_of(mod)
        below[mod] = max(([here, *below[t]] if below[t][0] != here else below[t] for t in graph[mod]), key=len,
                         default=[here])
    return max(below.values(), key=len)


def test_an_import_chain_passes_through_few_rooms():
    rooms = room_chain(_sources())
    assert len(rooms) <= ROOM_CHAIN_CEILING, f"an import chain through {len(rooms)} rooms: " + " → ".join(rooms)


def test_the_rooms_of_a_chain_are_counted_once_each():
    files = {"rpcompile/cli/main.py": "from ..tools import demo\n",
             "rpcompile/tools/demo.py": "from . import util\nfrom ..passes.solver import partition\n",
             "rpcompile/tools/util.py": "from rpcompile.core.plan import Plan\n",
             "passes/solver/partition.py": "from .timing import t\n",
             "passes/solver/timing.py": "from rpcompile.core import plan\n",
             "rpcompile/core/plan.py": ""}
    assert room_chain(files) == ["cli", "tools", "passes.solver", "core"]


#: The most lines a module docstring may take (issue 37 phase 7): what the module is and its terms; the details in
#: the docstrings of what they describe, measurements and history in benchmarks/RESULTS.md.
DOCSTRING_CEILING = 25


def test_module_docstrings_are_short():
    long = {rel: n for rel, source in _sources().items()
            if (n := (ast.get_docstring(ast.parse(source), clean=False) or "").count("\n") + 1) > DOCSTRING_CEILING}
    assert not long, (f"module docstrings over {DOCSTRING_CEILING} lines (move the details to the docstrings of what "
                      f"they describe, figures and history to benchmarks/RESULTS.md): {long}")


#: The fewest ``#`` comments per 1,000 lines the package may have (issue 37 phase 7: the why of a tricky line sits
#: beside it; the issue counted 28, against 68–105 in torchgpipe, torch.fx.passes, torch.distributed.pipelining and
#: torchtitan). It only goes up.
COMMENT_FLOOR = 70


def comments_per_thousand_lines(files: dict[str, str]) -> float:
    """``#`` comments (tokens, so a ``#`` inside a string is none) per 1,000 lines of ``files`` (path → source)."""
    comments = sum(t.type == tokenize.COMMENT for source in files.values()
                   for t in tokenize.generate_tokens(io.StringIO(source).readline))
    return 1000 * comments / max(sum(source.count("\n") for source in files.values()), 1)


def test_tricky_lines_say_why_beside_them():
    density = comments_per_thousand_lines(_sources())
    assert density >= COMMENT_FLOOR, (f"{density:.1f} comments per 1,000 lines, under {COMMENT_FLOOR}: the why of a "
                                      f"tricky line goes in a comment beside it")


def test_comments_are_counted_as_tokens():
    files = {"a.py": "x = 1  # why\ns = '# not a comment'\n", "b.py": "# why\ny = 2\n"}
    assert comments_per_thousand_lines(files) == 500


def test_the_recurrence_is_plain_numbers():
    """``passes/solver/recurrence.py`` — the round-robin recurrence the timing model, the local search's scorer and the
    overlapped-iterations walk share (issue 35) — imports no torch, no numpy and of rpcompile only Core: plain
    numbers, like the simulator it mirrors."""
    source = (ROOT / "passes" / "solver" / "recurrence.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    ours = {n for n in names if n.startswith("rpcompile")}
    assert ours and all(layer(n) == "core" for n in ours), sorted(ours)
    assert names - ours <= {"__future__", "dataclasses", "typing", "math"}, sorted(names - ours)


# --- one home per name (issue 37 phase 3) ----------------------------------------------------------------------------

#: The public surface: every public name listed once more here, each pointing at its one home (the table's value).
SURFACE = "rpcompile"

#: (name, module) pairs of names that still sit in a second module's ``__all__``: the list only shrinks.
KNOWN_TWO_HOMES: set[tuple[str, str]] = set()

#: (importing file, imported module, private name) imports of a ``_private`` name across modules: the list only
#: shrinks.
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


def exported(source: str) -> list[str]:
    """The names in a module's ``__all__``: a literal list or tuple, with ``*TABLE`` or ``list(TABLE)`` of a
    module-level dict literal (the lazy tables of ``rpcompile/__init__.py``) spelled out."""
    tree = ast.parse(source)
    tables = {t.id: [k.value for k in n.value.keys if isinstance(k, ast.Constant)] for n in tree.body
              if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict) for t in n.targets
              if isinstance(t, ast.Name)}
    names: list[str] = []
    for n in tree.body:
        if not (isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                and any(isinstance(t, ast.Name) and t.id == "__all__"
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))):
            continue
        value = n.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.args:
            value = value.args[0]  # list(TABLE), tuple(TABLE), sorted(TABLE)
        elts = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value] if value is not None else []
        for e in elts:
            e = e.value if isinstance(e, ast.Starred) else e
            if isinstance(e, ast.Constant) and isinstance(e.value, str):
                names.append(e.value)
            elif isinstance(e, ast.Name) and e.id in tables:
                names += tables[e.id]
    return names


def two_homes(files: dict[str, str]) -> dict[str, list[str]]:
    """Name → the modules whose ``__all__`` lists it, for each name listed by two or more (the public surface,
    :data:`SURFACE`, not counted: it points at the homes)."""
    homes: dict[str, list[str]] = {}
    for rel, source in files.items():
        mod = module_name(Path(rel))
        if mod != SURFACE:
            for name in dict.fromkeys(exported(source)):
                homes.setdefault(name, []).append(mod)
    return {name: mods for name, mods in homes.items() if len(mods) > 1}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(files: dict[str, str], modules: set[str] | None = None) -> list[tuple[str, int, str, str]]:
    """``(file, line, module, name)`` of each ``_private`` name of an rpcompile module used outside it: imported
    (``from m import _x``) or reached through an imported module (``from pkg import m`` … ``m._x``). ``modules``:
    the rpcompile modules that exist (default: those of ``files``)."""
    modules = modules if modules is not None else {module_name(Path(rel)) for rel in files}
    out = []
    for rel, source in files.items():
        path = Path(rel)
        mod = module_name(path) if path.parts[0] in ("rpcompile", "passes", "runtime") else ""
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(source)
        bound: dict[str, str] = {}  # local name → the rpcompile module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                if not (target == "rpcompile" or target.startswith("rpcompile.")) or target == mod:
                    continue
                for a in node.names:
                    if _private(a.name):
                        out.append((rel, node.lineno, target, a.name))
                    elif f"{target}.{a.name}" in modules:
                        bound[a.asname or a.name] = f"{target}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules and a.asname:
                        bound[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                    and _private(node.attr):
                out.append((rel, node.lineno, bound[node.value.id], node.attr))
    return out


def _sources_and_benchmarks() -> dict[str, str]:
    benchmarks = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "benchmarks").glob("*.py"))}
    return {**_sources(), **benchmarks}


def test_no_name_has_two_homes_and_the_known_ones_shrink():
    """A name sits in one module's ``__all__``, its home; callers import it from there. The public surface
    (``rpcompile/__init__.py``) lists each public name once more, pointing at its home — that is not a second home."""
    found = {(name, m) for name, mods in two_homes(_sources()).items() for m in mods}
    new = sorted({name for name, m in found - KNOWN_TWO_HOMES})
    assert not new, "names in two modules' __all__ (give each one home): " + ", ".join(
        f"{n} {two_homes(_sources())[n]}" for n in new)
    gone = KNOWN_TWO_HOMES - found
    assert not gone, f"remove from KNOWN_TWO_HOMES, they are fixed: {sorted(gone)}"


def test_the_surface_points_at_each_names_home():
    """Each name of ``rpcompile/__init__.py``'s table is in the ``__all__`` of the module it points at."""
    files = _sources()
    by_module = {module_name(Path(rel)): exported(source) for rel, source in files.items()}
    table = ast.literal_eval(next(n.value for n in ast.parse(files["rpcompile/__init__.py"]).body
                                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_EXPORTS"))
    astray = {name: home for name, home in table.items() if name not in by_module.get(home, [])}
    assert not astray, f"public names whose table entry is not their home: {astray}"


def defined_twice(files: dict[str, str]) -> dict[str, list[str]]:
    """Public name → the modules that define it at their top level (a function or a class), for each defined by two
    or more: one word meaning two things (issue 37 phase 3: distinct names for distinct things)."""
    where: dict[str, list[str]] = {}
    for rel, source in files.items():
        names = {n.name for n in ast.parse(source).body
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("_")}
        for name in names:
            where.setdefault(name, []).append(module_name(Path(rel)))
    return {name: sorted(mods) for name, mods in where.items() if len(mods) > 1}


def test_a_public_name_means_one_thing():
    assert defined_twice(_sources()) == {}


def test_a_name_defined_in_two_modules_is_found():
    files = {"passes/graph/shape.py": "def describe(value): ...\n",
             "rpcompile/training/checkpoint/load.py": "def describe(path): ...\ndef _local(): ...\n",
             "rpcompile/cli/main.py": "def _local(): ...\n"}
    assert defined_twice(files) == {"describe": ["rpcompile.passes.graph.shape", "rpcompile.training.checkpoint.load"]}


def test_no_private_name_is_used_across_modules_and_the_known_ones_shrink():
    """A ``_private`` name stays in its module: one that others need is public in its home (no underscore, in
    ``__all__``, a docstring). Checked in the package and the benchmarks (they use the package as a reader would);
    not in tests, which may reach into the module they mirror (STYLE 1)."""
    files = _sources_and_benchmarks()
    modules = {module_name(Path(rel)) for rel in _sources()}
    found = private_imports(files, modules)
    new = sorted({f"{f}:{line} uses {m}.{n}" for f, line, m, n in found if (f, m, n) not in KNOWN_PRIVATE})
    assert not new, "private names used across modules (make them public in their home):\n" + "\n".join(new)
    gone = KNOWN_PRIVATE - {(f, m, n) for f, _, m, n in found}
    assert not gone, f"remove from KNOWN_PRIVATE, they are fixed: {sorted(gone)}"


def test_two_homes_and_private_imports_are_caught():
    files = {"passes/cost/cost.py": "from .cost_model import CostModel\n__all__ = ['CostModel', 'cost_pass']\n",
             "passes/cost/cost_model.py": "__all__ = ('CostModel',)\n",
             "rpcompile/__init__.py": "_EXPORTS = {'CostModel': 'rpcompile.passes.cost.cost_model'}\n"
                                      "__all__ = ['__version__', *_EXPORTS]\n",
             "passes/solver/scorer.py": "from . import timing\nfrom .timing import _stage\nx = timing._total\n",
             "passes/solver/timing.py": "_stage = _total = 1\n"}
    assert two_homes(files) == {"CostModel": ["rpcompile.passes.cost.cost", "rpcompile.passes.cost.cost_model"]}
    assert exported(files["rpcompile/__init__.py"]) == ["__version__", "CostModel"]
    assert sorted(private_imports(files)) == [
        ("passes/solver/scorer.py", 2, "rpcompile.passes.solver.timing", "_stage"),
        ("passes/solver/scorer.py", 3, "rpcompile.passes.solver.timing", "_total")]
    assert private_imports({"passes/solver/timing.py": "from .timing import _stage\n"}) == []  # itself
