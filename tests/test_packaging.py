"""Packaging: the wheel installs passes/ and runtime/ under rpcompile.*, never as top-level names."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("rpcompile-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_claims_only_rpcompile(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"rpcompile"}
    names = set(wheel.namelist())
    assert {"rpcompile/passes/cost/cost.py", "rpcompile/passes/solver/partition.py",
            "rpcompile/runtime/__init__.py"} <= names


def test_pyproject_lists_every_package():
    """Every folder of the source tree is in pyproject's ``packages`` (a new room must be listed there; the wheel
    above cannot tell, since setuptools builds it over a ``build/`` that keeps what earlier builds copied)."""
    tomllib = pytest.importorskip("tomllib")
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = [p.parent.relative_to(ROOT).parts for top in ("rpcompile", "passes", "runtime")
               for p in (ROOT / top).rglob("__init__.py")]
    tree = {".".join(parts if parts[0] == "rpcompile" else ("rpcompile", *parts)) for parts in folders}
    assert tree == packages, f"missing from pyproject: {sorted(tree - packages)}; not in the tree: {sorted(packages - tree)}"


def test_wheel_declares_console_script_and_deps(wheel):
    meta_dir = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    entry = wheel.read(f"{meta_dir}/entry_points.txt").decode()
    assert "rpcompile = rpcompile.cli:main" in entry
    meta = wheel.read(f"{meta_dir}/METADATA").decode()
    for dep in ("Requires-Dist: torch>=2.4", "Requires-Dist: ortools", "Requires-Dist: numpy"):
        assert dep in meta
    assert 'Requires-Dist: transformers>=4.50; extra == "test"' in meta


def test_solver_modules_do_not_import_torch():
    code = (
        "import sys, rpcompile.passes.solver.partition, rpcompile.passes.solver.problem, rpcompile.passes.solver.ilp; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
