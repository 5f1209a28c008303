"""Tools for the tests of ``pool.map``, loaded by real workers as ``map_tools:registry``.

``varied`` is one tool that behaves as its ``kind`` says, so that one map (one tool over many
argument mappings) can mix calls that return, fail, crash their worker in several ways, hang
past their timeout, or wait cooperatively: each borrows its misbehaviour from
:mod:`toolpool.testing` (the example tools and the hostile kit).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from toolpool import Registry, ToolExecution
from toolpool.testing import examples, hostile

registry = Registry()


@registry.tool
def square(i: int) -> int:
    """``i * i``, at once."""
    return i * i


@registry.tool
def varied(kind: str, execution: ToolExecution, i: int = 0, path: str = "") -> object:
    """Behave as ``kind`` says:

    - ``ok``: return ``i``; ``fail``: raise (outcome ``error``);
    - ``exit``, ``segv``, ``kill``: end the worker (``os._exit``, a segfault, SIGKILL);
    - ``hang``: sleep past any timeout, deaf to the signal (SIGTERM ends it);
    - ``stubborn``: ignore SIGTERM and sleep (only SIGKILL ends it);
    - ``nap``: wait for the call's cancel signal (cooperative), for up to an hour;
    - ``touch``: create the file ``path``, then return ``i``;
    - ``gate``: wait until the file ``path`` exists, then 0.2 s more, then return ``i``.
    """
    if kind == "ok":
        return i
    if kind == "fail":
        examples.fail(f"failed on purpose: {i}")
    elif kind == "exit":
        hostile.hard_exit(7)
    elif kind == "segv":
        hostile.segfault()
    elif kind == "kill":
        hostile.kill_own_worker()
    elif kind == "hang":
        return hostile.sleep_past_timeout()
    elif kind == "stubborn":
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return hostile.sleep_past_timeout()
    elif kind == "nap":
        return examples.sync_nap(3600.0, execution)
    elif kind == "touch":
        with open(path, "w"):
            pass
        return i
    elif kind == "gate":
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.005)  # (the tool's own wait, in its worker)
        time.sleep(0.2)
        return i
    raise ValueError(f"unknown kind {kind!r}")


# --------------------------------------------------------------------------- the test side


class Pulled:
    """An arguments generator that records, at every pull, how far it ran ahead of the
    results asked for (``asked`` is counted before each request for a result, so the map's
    own count of results handed out is never above it)."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.pulled = 0
        self.asked = 0
        self.ahead: list[int] = []
        self.reached: dict[int, threading.Event] = {}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for item in self.items:
            self.pulled += 1
            self.ahead.append(self.pulled - self.asked)
            event = self.reached.get(self.pulled)
            if event is not None:
                event.set()
            yield item

    def when_pulled(self, n: int) -> threading.Event:
        self.reached[n] = threading.Event()
        return self.reached[n]


def oks(n: int) -> list[dict[str, Any]]:
    return [{"kind": "ok", "i": i} for i in range(n)]


def cancelled(settled: Mapping[str, int]) -> int:
    """How many calls of a pool's ``statistics().settled`` ended by a cancel (run or not)."""
    return settled.get("aborted", 0) + settled.get("aborted_before_dispatch", 0)
