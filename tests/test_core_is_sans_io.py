"""The pool's core does no I/O (docs/core.md): its modules, the supervisor's machine and the
worker's (``worker/_machine.py``), import neither anyio, zmq, a socket, a subprocess nor a
clock, and call none of os's process functions; worker/ and supervisor/ never import each
other; protocol/ and core/ are leaves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "toolpool"
MACHINE = SRC / "supervisor" / "machine"
CORE = sorted(p.name for p in MACHINE.glob("*.py"))
#: Every file of the core, relative to src/toolpool: the supervisor's machine, the worker's.
CORE_FILES = [f"supervisor/machine/{name}" for name in CORE] + ["worker/_machine.py"]
FORBIDDEN_MODULES = {"anyio", "zmq", "socket", "subprocess", "select", "selectors", "asyncio"}
FORBIDDEN_CALLS = {
    ("os", name)
    for name in ("kill", "killpg", "fork", "waitpid", "waitid", "pidfd_open", "open", "read")
} | {("time", name) for name in ("monotonic", "time", "perf_counter", "sleep")}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.add(base)
    return found


def test_every_part_of_the_machine_is_checked() -> None:
    assert {"_machine.py", "_state.py", "_records.py", "_settlement.py", "_lifecycle.py"} <= set(
        CORE
    ), CORE


def test_the_workers_machine_is_checked() -> None:
    assert (SRC / "worker" / "_machine.py").exists()
    assert "worker/_machine.py" in CORE_FILES


@pytest.mark.parametrize("module", CORE_FILES)
def test_the_core_does_no_io(module: str) -> None:
    path = SRC / module
    imports = _imports(path)
    assert not {i.split(".")[0] for i in imports} & FORBIDDEN_MODULES, imports
    assert not {"os", "threading", "resource", "mmap"} & imports, imports
    assert "time" not in imports, imports
    # ... and none of the shell's modules (which do the I/O).
    if module.startswith("worker/"):
        shell = {p.stem for p in (SRC / "worker").glob("*.py")} - {"_machine", "__init__"}
        assert not {i for i in imports if i.startswith(".") and i[1:] in shell}, imports
    shell = {p.stem for p in (SRC / "supervisor").glob("*.py")} - {"_results", "__init__"}
    assert not {i for i in imports if i.startswith("..") and i[2:] in shell}, imports
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert (node.value.id, node.attr) not in FORBIDDEN_CALLS, (module, node.attr)


def test_worker_and_supervisor_never_import_each_other_and_the_leaves_stay_leaves() -> None:
    for part, others in (
        ("worker", ("supervisor", "reaper")),
        ("supervisor", ("worker",)),
        ("protocol", ("supervisor", "worker", "reaper", "sandbox", "core")),
        ("core", ("supervisor", "worker", "reaper", "sandbox", "protocol")),
    ):
        for path in (SRC / part).glob("*.py"):
            for imported in _imports(path):
                for other in others:
                    assert not imported.startswith((f"..{other}", f"toolpool.{other}")), (
                        path.name,
                        imported,
                    )


def test_no_import_circle_in_the_supervisor() -> None:
    """The supervisor's modules (the shell, and the machine's parts) import each other in
    layers: no module imports, through any chain, one that imports it (counting imports for
    type checking only)."""
    graph: dict[str, set[str]] = {}
    for path in [*(SRC / "supervisor").glob("*.py"), *MACHINE.glob("*.py")]:
        here = "machine." if path.parent == MACHINE else ""
        name = here + path.stem
        edges = graph.setdefault(name, set())
        for imported in _imports(path):
            if here and imported.startswith("..") and not imported.startswith("..."):
                target = imported[2:]  # a shell module, from the machine
            elif imported.startswith(".") and not imported.startswith(".."):
                target = here + imported[1:]
            else:
                continue
            if target and not target.endswith("__init__"):
                edges.add(target.rstrip("."))
    assert len(graph) > 15, graph

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False

    for name, edges in graph.items():
        for target in edges:
            assert not reaches(target, name, set()), f"{name} -> {target} -> ... -> {name}"


def test_no_two_classes_of_the_processes_share_a_name() -> None:
    """A class name says which one it is: the wire's messages (``protocol/``), the
    supervisor's public objects and the machine's actions never share one (``Result`` was
    both the wire's message and the caller's result)."""
    where: dict[str, list[str]] = {}
    for part in ("protocol", "supervisor", "reaper", "worker", "core"):
        for path in sorted((SRC / part).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    where.setdefault(node.name, []).append(str(path.relative_to(SRC)))
    assert len(where) > 50, where
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
