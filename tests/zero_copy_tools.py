"""Tools for ``test_zero_copy.py``: large byte strings in and out (issue 26 step 3)."""

from __future__ import annotations

import gc
import os
import random
import signal
from typing import Any

from toolpool import Registry, ToolExecution

registry = Registry()


def pattern(seed: int, size: int) -> bytes:
    """``size`` bytes that only ``seed`` makes: what a test can check byte for byte."""
    return random.Random(seed).randbytes(size)


@registry.tool
def echo(value: Any = None) -> Any:
    """Return the value unchanged."""
    return value


@registry.tool
def make(seed: int, size: int, as_bytearray: bool = False) -> Any:
    """Return ``pattern(seed, size)`` (as a bytearray if asked)."""
    data = pattern(seed, size)
    return bytearray(data) if as_bytearray else data


@registry.tool
def length(value: bytes) -> list[Any]:
    """What arrived: its type's name, its length and its first and last 8 bytes."""
    return [type(value).__name__, len(value), value[:8], value[-8:]]


@registry.tool
async def wait_for_cancel(execution: ToolExecution) -> str:
    """Wait until cancelled (a call for others to queue behind)."""
    await execution.signal.wait()
    return "cancelled"


@registry.tool
def make_then_die_unsent(seed: int, size: int) -> bytes:
    """Return ``pattern(seed, size)``, having patched the worker so that, once this result is
    concluded, it does what the ledger asks (the spill, the slot) but is SIGKILLed before it
    sends anything: the supervisor can learn the result from the worker's ledger alone."""
    from toolpool.worker._machine import SendFrames
    from toolpool.worker._main import _Server

    (server,) = [obj for obj in gc.get_objects() if isinstance(obj, _Server)]
    conclude = server.machine.conclude_array  # (what the server calls: a result as its array)
    perform = server._perform
    concluded = []

    def conclude_marked(*args: Any) -> Any:
        concluded.append(True)
        return conclude(*args)

    def perform_unsent(actions: Any) -> None:
        if not concluded:
            perform(actions)
            return
        perform([a for a in actions if not isinstance(a, SendFrames)])
        os.kill(os.getpid(), signal.SIGKILL)

    server.machine.conclude_array = conclude_marked  # type: ignore[method-assign]
    server._perform = perform_unsent  # type: ignore[method-assign]
    return pattern(seed, size)
