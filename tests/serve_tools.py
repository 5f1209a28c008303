"""Tools for the service tests: ``serve_tools:registry`` (tests/ is on the path).

``work`` appends ``start <id>`` and ``end <id>`` lines to the file named by the
``TOOLPOOL_TEST_LEDGER`` environment variable (one ``write`` each, ``O_APPEND``): a test reads
which calls ran, and how often, whoever ran them.
"""

from __future__ import annotations

import os
import time

import anyio

from toolpool import Registry, ToolExecution

registry = Registry()


def _note(line: str) -> None:
    path = os.environ.get("TOOLPOOL_TEST_LEDGER")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


@registry.tool
def noop() -> None:
    """Do nothing."""


@registry.tool
async def work(id: str, seconds: float = 0.0) -> str:
    """Note the start, sleep ``seconds`` (stopping early, cooperatively, if cancelled), note
    the end."""
    _note(f"start {id} {os.getpid()}")
    await anyio.sleep(seconds)
    _note(f"end {id} {os.getpid()}")
    return id


@registry.tool
def stubborn(id: str, seconds: float = 60.0) -> str:
    """Note the start, then ignore the cancel signal (a sync body sleeping): stopped only
    by the ladder."""
    _note(f"start {id} {os.getpid()}")
    time.sleep(seconds)
    _note(f"end {id} {os.getpid()}")
    return id


@registry.tool
async def cooperative(id: str, execution: ToolExecution, seconds: float = 60.0) -> str:
    """Note the start; return as soon as the call is cancelled (or after ``seconds``)."""
    _note(f"start {id} {os.getpid()}")
    with anyio.move_on_after(seconds):
        await execution.signal.wait()
    _note(f"end {id} {os.getpid()}")
    return id


ops = Registry()


@ops.tool
def uptime() -> float:
    """Seconds since this worker's clock started (a second provider's tool)."""
    return time.monotonic()


@registry.tool
def stubborn_tree(id: str) -> str:
    """Start a child that ignores SIGTERM, note both pids (``tree <id> <worker> <child>``),
    then ignore the cancel signal: only the ladder's SIGKILL ends the tree."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
        ]
    )
    _note(f"tree {id} {os.getpid()} {child.pid}")
    _note(f"start {id} {os.getpid()}")
    time.sleep(600)
    return id
