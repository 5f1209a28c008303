"""Tools for the MCP face's tests and benchmark: quick, failing, cooperative, stubborn (a
setsid grandchild, SIGTERM ignored, its own signal ignored), and one that reports progress."""

from __future__ import annotations

import json
import os
import signal
import time

import anyio

from toolpool import Registry, ToolExecution
from toolpool.testing.examples import spawn_daemon

registry = Registry()
extra = Registry()


@registry.tool
def echo(value: int) -> int:
    """Return value."""
    return value


@registry.tool
def noop() -> None:
    """Do nothing (the benchmark's round trip)."""


@registry.tool
def fail(message: str = "boom") -> None:
    """Raise ValueError(message)."""
    raise ValueError(message)


@registry.tool
async def nap(seconds: float, execution: ToolExecution) -> str:
    """Sleep, stopping early (aborted) when cancelled; reports its pid as progress first."""
    execution.report_progress(0, None, json.dumps({"worker": os.getpid()}))
    with anyio.move_on_after(seconds):
        await execution.signal.wait()
        execution.signal.raise_if_cancelled()
    return "slept"


@registry.tool
def stubborn(marker: str, execution: ToolExecution, seconds: float = 3600.0) -> int:
    """Leave a setsid double-forked grandchild (``marker`` in its argv), report both pids
    as progress, then ignore SIGTERM and the cancel signal and block: only SIGKILL of the
    whole tree stops it."""
    daemon = spawn_daemon(marker, seconds)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    execution.report_progress(1, None, json.dumps({"worker": os.getpid(), "daemon": daemon}))
    time.sleep(seconds)
    return 0


@registry.tool
async def count(steps: int, execution: ToolExecution, pause: float = 0.06) -> int:
    """Report progress steps/steps, one every ``pause`` seconds, then return steps; stops
    (aborted) at the next step when cancelled."""
    for done in range(1, steps + 1):
        await anyio.sleep(pause)
        execution.signal.raise_if_cancelled()
        execution.report_progress(done, steps, f"step {done}")
    return steps


@extra.tool
def late(value: int = 0) -> int:
    """A tool of a provider added later."""
    return value


@registry.tool
def pid() -> int:
    """The worker's pid."""
    return os.getpid()
