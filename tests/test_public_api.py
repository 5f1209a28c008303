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
