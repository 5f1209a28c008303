"""What the supervisor imports to start a pool (issue 26, step 4): the modules made lazy stay
out, checked in a fresh interpreter, so the gain cannot regress silently. Only which modules
load is checked here; the times are ``bench/start_imports.py``'s, in docs/performance.md."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import toolpool

#: Never loaded by ``import toolpool`` nor by the first pool: the optional faces' packages,
#: the executor's and the sync face's modules, and stdlib modules the start no longer needs.
LAZY = (
    "rich",
    "prometheus_client",
    "mcp",
    "starlette",
    "uvicorn",
    "httpx",
    "psutil",
    "toolpool.mcp",
    "toolpool.serve",
    "toolpool.eval",
    "toolpool._batch",
    "toolpool.metrics",
    "toolpool.remote",
    "toolpool.worker",
    "toolpool.supervisor._executor",
    "toolpool.supervisor._sync",
    "toolpool.supervisor._map",
    "anyio.from_thread",
    "tempfile",
    "secrets",
    "pathlib",
)


def _loaded(code: str) -> list[str]:
    """The modules of ``LAZY`` that ``code`` loads in a fresh interpreter."""
    script = textwrap.dedent(code) + textwrap.dedent(
        f"""
        import json, sys
        print(json.dumps([m for m in {LAZY!r} if m in sys.modules]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_import_toolpool_and_the_pool_class_load_none_of_the_lazy_modules() -> None:
    assert _loaded("import toolpool\ntoolpool.Pool\nfrom toolpool import Call, Result\n") == []


def test_the_first_pool_and_one_call_load_none_of_the_lazy_modules() -> None:
    code = """
        import anyio
        import toolpool

        async def main() -> None:
            async with toolpool.Pool("toolpool.testing.examples:registry", workers=1) as pool:
                await pool.call("noop")

        anyio.run(main)
        """
    # the pool's examples live in toolpool.testing, run by the worker: not this process's
    assert _loaded(code) == []


def test_the_lazy_names_still_load_on_use() -> None:
    code = """
        import toolpool
        toolpool.SyncPool, toolpool.Executor, toolpool.MapIterator, toolpool.Registry
        """
    assert set(_loaded(code)) >= {
        "toolpool.supervisor._sync",
        "toolpool.supervisor._executor",
        "toolpool.supervisor._map",
        "toolpool.worker",
    }


def test_the_supervisor_package_names_each_export_once_where_it_lives() -> None:
    import importlib

    import toolpool.supervisor as supervisor

    exports: dict[str, str] = vars(supervisor)["_EXPORTS"]
    assert tuple(sorted(exports)) == supervisor.__all__
    for name, module in exports.items():
        assert getattr(importlib.import_module(f"toolpool.supervisor.{module}"), name) is getattr(
            supervisor, name
        )
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        supervisor.Nope  # noqa: B018
    assert toolpool.Pool is supervisor.Pool


def test_the_command_lines_help_and_toolpool_core_load_no_asyncio() -> None:
    code = """
        import runpy, sys
        sys.argv = ["toolpool", "--help"]
        try:
            runpy.run_module("toolpool", run_name="__main__", alter_sys=True)
        except SystemExit:
            pass
        import toolpool.core
        toolpool.core.CancelController().signal
        assert "asyncio" not in sys.modules, "asyncio"
        """
    assert _loaded(code) == []
