"""The core library's layers import downwards only: `restore/` (costs, profile, loader, inputs) sits under the
scheduler (`sched/`), which sits under the engine (`engine/`) and the simulator (`sim/`); nothing in
`cacheflow_common` imports the services, the benchmarks or the operator. Every import counts, those inside
functions included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "cacheflow_common"
ABOVE = {  # package -> the packages above it, which it must not import
    "restore": ("cacheflow_common.engine", "cacheflow_common.sched", "cacheflow_common.sim"),
    "sched": ("cacheflow_common.engine", "cacheflow_common.sim"),
    "sim": ("cacheflow_common.engine",),
}
OUTSIDE = ("cacheflow_services", "cacheflow_bench", "cacheflow_operator")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (`from a import b` names `a` and `a.b`: `b` may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _crossings(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    """`path imports module` for each import of a forbidden package (or a module in it)."""
    return sorted(f"{path.relative_to(CORE.parent)} imports {module}" for path in paths
                  for module in imported_modules(path)
                  if any(module == package or module.startswith(package + ".") for package in forbidden))


@pytest.mark.parametrize("package", ABOVE)
def test_a_layer_imports_nothing_above_it(package):
    paths = sorted((CORE / package).rglob("*.py"))
    assert paths
    assert _crossings(paths, ABOVE[package]) == []


def test_the_core_library_imports_no_service_benchmark_or_operator():
    assert _crossings(sorted(CORE.rglob("*.py")), OUTSIDE) == []


def test_the_scan_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from cacheflow_common import engine\n    import cacheflow_common.sim.engine\n")
    assert {"cacheflow_common.engine", "cacheflow_common.sim.engine"} <= imported_modules(source)


def test_the_engine_does_not_load_the_grants_signature_code():
    """vLLM's process runs the engine for the connector, which checks no grants: importing the engine must not
    load `cryptography` (Ed25519, X.509), 8 MiB of resident memory in every vLLM rank."""
    probe = "import sys, cacheflow_common.engine; print(sorted(m for m in sys.modules if m.startswith('cryptography')))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            cwd=CORE.parent).stdout.strip()
    assert loaded == "[]"
