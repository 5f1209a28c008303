"""Tools for the liveness and progress tests (``tests/test_liveness.py``), imported by the
worker processes too: one that holds the GIL in C, one that ignores its signal in pure
Python, and sync and async tools that report progress in a tight loop."""

from __future__ import annotations

import asyncio
import itertools
import os
import time

from toolpool import Registry, ToolExecution

registry = Registry()


@registry.tool
def hold_gil() -> int:
    """Holds the GIL in C for hours: ``sum`` over ``itertools.repeat`` never returns to the
    interpreter's loop, so no other thread of the process runs (no heartbeat, nothing read)."""
    time.sleep(0.05)  # (the GIL released a moment: its start is said, the worker is seen up)
    return sum(itertools.repeat(0, 10**12))


@registry.tool
def spin_ignoring() -> int:
    """Ignores its signal, in pure Python: the worker's other threads still run."""
    count = 0
    while True:
        count += 1


@registry.tool
def steps_sync(n: int, gate: str, execution: ToolExecution) -> int:
    """Reports ``n`` steps as fast as it can, then waits until ``gate`` exists."""
    for i in range(1, n + 1):
        execution.report_progress(i, n, f"step {i}")
    while not os.path.exists(gate):
        time.sleep(0.005)
    return n


@registry.tool
async def steps_async(n: int, gate: str, execution: ToolExecution) -> int:
    """As ``steps_sync``, in an async body (it yields to its loop now and then)."""
    for i in range(1, n + 1):
        execution.report_progress(i, n, f"step {i}")
        if i % 1000 == 0:
            await asyncio.sleep(0)
    while not os.path.exists(gate):
        await asyncio.sleep(0.005)
    return n


@registry.tool
def bad_progress(how: str, execution: ToolExecution) -> str:
    """Reports progress wrongly: the tool's own error, never a broken worker."""
    if how == "negative":
        execution.report_progress(-1)
    elif how == "text":
        execution.report_progress("half")  # type: ignore[arg-type]
    elif how == "nan":
        execution.report_progress(float("nan"))
    elif how == "message":
        execution.report_progress(1, 2, message=3)  # type: ignore[arg-type]
    return "reported"
