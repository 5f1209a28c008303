"""Tools for the ``toolpool batch`` tests: ``batch_tools:registry`` (tests/ is on the path).

The crashing ones decide through a marker file whether this run is a first attempt: the first
crashes the worker and leaves the marker, a retry finds it and succeeds.
"""

from __future__ import annotations

import os
import time
from typing import Any

import anyio

from toolpool import Registry, ToolExecution

registry = Registry()


@registry.pre_execute
def crash_in_policy(execution: ToolExecution) -> None:
    """``crash_before``: the worker dies in a pre-execute policy, before the body starts
    (on a first attempt, or every time with ``always``)."""
    if execution.tool != "crash_before":
        return
    marker = execution.args["marker"]
    if execution.args.get("always") or not os.path.exists(marker):
        with open(marker, "a"):
            pass
        os._exit(5)


@registry.tool
def noop() -> None:
    """Do nothing."""


@registry.tool
def echo(value: Any = None) -> Any:
    """Return the value."""
    return value


@registry.tool
def fail(message: str = "boom") -> None:
    """Raise: outcome ``error``."""
    raise RuntimeError(message)


@registry.tool
def crash_before(marker: str, always: bool = False) -> str:
    """Reached only when the policy let it through (see :func:`crash_in_policy`)."""
    return "ran"


@registry.tool
def crash_after(marker: str, always: bool = False) -> str:
    """The body starts, then kills its worker (on a first attempt, or every time)."""
    if always or not os.path.exists(marker):
        with open(marker, "a"):
            pass
        os._exit(6)
    return "ran"


@registry.tool
def raw_bytes() -> bytes:
    """A value JSON cannot hold."""
    return b"\x00\x01"


@registry.tool
def not_a_number() -> float:
    """Another: JSON has no NaN."""
    return float("nan")


@registry.tool
async def hold(ready: str, release: str, execution: ToolExecution, seconds: float = 600) -> str:
    """Say it runs (a file in the directory ``ready``), then wait cooperatively until the file
    ``release`` exists, the call is cancelled, or ``seconds`` pass."""
    with open(os.path.join(ready, f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    with anyio.move_on_after(seconds):
        while not os.path.exists(release):
            with anyio.move_on_after(0.02):
                await execution.signal.wait()
            execution.signal.raise_if_cancelled()
    return "released"


@registry.tool
def stubborn(ready: str, seconds: float = 600) -> int:
    """Say it runs, then spin, never looking at the signal: only SIGTERM or SIGKILL stop it
    (it ignores SIGTERM too)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(ready, f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
    return n


@registry.tool
def sleep_ms(ms: float) -> float:
    """Sleep (not cooperatively) a few milliseconds."""
    time.sleep(ms / 1000)
    return ms
