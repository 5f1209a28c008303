"""The public surface: __all__ matches what is exported, and re-exports read toolpool.X."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

import toolpool


def test_all_is_a_sorted_tuple_of_real_names() -> None:
    assert isinstance(toolpool.__all__, tuple)
    assert len(set(toolpool.__all__)) == len(toolpool.__all__)
    for name in toolpool.__all__:
        assert hasattr(toolpool, name), name


def test_all_lists_every_public_attribute() -> None:
    public = {
        name
        for name, value in vars(toolpool).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    }
    assert public <= set(toolpool.__all__) | {"__version__"}


@pytest.mark.parametrize("name", ["Registry", "ToolResult", "Outcome", "CancelController"])
def test_reexports_have_public_module(name: str) -> None:
    assert getattr(toolpool, name).__module__ == "toolpool"


def test_every_error_reads_toolpool_x_from_its_first_raise() -> None:
    """In a fresh interpreter that never looked ``toolpool.X`` up, as the supervisor's own
    raise meets a user first."""
    code = textwrap.dedent(
        """
        from toolpool.core import _errors
        names = [n for n in _errors.__all__ if getattr(_errors, n).__module__ != "toolpool"]
        assert not names, names
        raise _errors.WorkerStartError("tools fail to import")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "toolpool.WorkerStartError: tools fail to import"


def test_every_error_is_exported() -> None:
    from toolpool.core import _errors

    assert set(_errors.__all__) <= set(toolpool.__all__)


def test_the_executor_errors_read_toolpool_x_from_their_first_raise() -> None:
    code = textwrap.dedent(
        """
        from toolpool.supervisor import _executor
        names = ("CallFailed", "RemoteError", "RemoteTraceback")
        assert all(getattr(_executor, n).__module__ == "toolpool" for n in names)
        import toolpool
        assert issubclass(toolpool.RemoteError, toolpool.CallFailed)
        assert issubclass(toolpool.CallFailed, toolpool.ToolpoolError)
        raise _executor.RemoteTraceback("the worker's traceback")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1, done.stderr
    assert (
        done.stderr.strip().splitlines()[-1] == "toolpool.RemoteTraceback: the worker's traceback"
    )


def test_one_export_list_sorted_and_the_type_checkers_imports_agree_with_it() -> None:
    """``__all__`` (what static tools read) and the lazy loader's map of where each name
    lives name the same names, both sorted; the imports for type checkers import each from
    the module the map says."""
    import ast
    from pathlib import Path

    exports: dict[str, str] = vars(toolpool)["_EXPORTS"]
    assert list(toolpool.__all__) == sorted(toolpool.__all__)
    assert list(exports) == sorted(exports)
    assert toolpool.__all__ == tuple(sorted([*exports, "__version__"]))
    tree = ast.parse(Path(toolpool.__file__).read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.unparse(imp)
                for alias in imp.names:  # ``X as X``: a re-export, whatever __all__ is
                    assert alias.asname == alias.name, ast.unparse(imp)
                    typed[alias.name] = imp.module or ""
    assert typed == exports


def test_every_exported_name_is_importable_from_the_module_the_list_names() -> None:
    import importlib

    exports: dict[str, str] = vars(toolpool)["_EXPORTS"]
    for name, module in exports.items():
        assert hasattr(importlib.import_module(f"toolpool.{module}"), name), (name, module)
    namespace: dict[str, object] = {}
    exec("from toolpool import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(toolpool.__all__)


def test_the_supervisor_packages_all_is_sorted_and_real() -> None:
    import toolpool.supervisor as supervisor

    assert list(supervisor.__all__) == sorted(supervisor.__all__)
    assert len(set(supervisor.__all__)) == len(supervisor.__all__)
    for name in supervisor.__all__:
        assert hasattr(supervisor, name), name
