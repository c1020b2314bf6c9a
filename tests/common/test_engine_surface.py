"""The engine's internals are its own (issue 40's target): outside `cacheflow_common/engine/`, no file of the
code base (services/, bench/, operator/, the rest of cacheflow_common/) uses a public attribute of the engine
core (`EngineCore`), reaches into an `Engine`'s private parts, or imports an engine module other than the
package itself, whose `__all__` is the surface (docs/architecture.md, "The engine")."""

from __future__ import annotations

import ast
from pathlib import Path

from cacheflow_common.engine import engine as engine_module
from cacheflow_common.engine.core import EngineCore
from cacheflow_common.sched.policies import make_policy
from cacheflow_common.sched.scheduler import BatchScheduler

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("services", "bench", "operator", "cacheflow_common")
ENGINE_DIR = ROOT / "cacheflow_common" / "engine"
PACKAGE = "cacheflow_common.engine"
OWN = {"self", "cls"}  # a class's own private attributes are its business


def core_public_names() -> set[str]:
    """Every public attribute of an engine core: its methods, properties and instance fields."""
    core = EngineCore(BatchScheduler(make_policy("cake"), n_stages=1), stage=0, n_channels=1)
    return {name for name in dir(core) if not name.startswith("_")}


def engine_private_names() -> set[str]:
    """The private attributes an `Engine` sets on itself (its core, builder, loop, channels)."""
    tree = ast.parse(Path(engine_module.__file__).read_text())
    engine_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    return {node.attr for node in ast.walk(engine_class) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "self"
            and node.attr.startswith("_") and not node.attr.startswith("__")}


def violations(source: str, *, core_names: set[str], private_names: set[str]) -> list[str]:
    """What `source` uses of the engine's internals, one line each (`line: what`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr in core_names:
                found.append(f"{node.lineno}: .{node.attr} (the engine core's)")
            elif node.attr in private_names and not (isinstance(node.value, ast.Name) and node.value.id in OWN):
                found.append(f"{node.lineno}: .{node.attr} (an Engine's private part)")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
            found.append(f"{node.lineno}: from {node.module} import ... (an engine module, not the package)")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name} (an engine module, not the package)"
                      for a in node.names if a.name.startswith(PACKAGE + ".")]
    return found


def test_the_engine_core_has_public_attributes_to_guard():
    assert {"admit_restore", "wait_for_load", "next_step", "end_step"} <= core_public_names()
    assert {"_core", "_builder", "_step_loop"} <= engine_private_names()


def test_the_scan_finds_each_kind_of_reach_into_the_engine():
    source = ("from cacheflow_common.engine.core import EngineCore\nimport cacheflow_common.engine.step_loop\n"
              "engine._core.wait_for_load(0)\nself._core = None\n")
    found = violations(source, core_names=core_public_names(), private_names=engine_private_names())
    assert [line.split(":")[0] for line in found] == ["1", "2", "3", "3"], found


def test_no_file_outside_the_engine_uses_its_internals():
    core_names, private_names = core_public_names(), engine_private_names()
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if ENGINE_DIR in path.parents:
                continue
            found += [f"{path.relative_to(ROOT)}:{line}" for line in
                      violations(path.read_text(), core_names=core_names, private_names=private_names)]
    assert not found, "the engine's internals used outside cacheflow_common/engine/:\n" + "\n".join(found)
