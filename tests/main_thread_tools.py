"""Tools that need the main thread of their process, as code-evaluation harnesses and many
libraries do (signal handlers, ``setitimer``, ``faulthandler``), and tools that block their
worker in every way a body can while it is cancelled. Imported by worker processes."""

from __future__ import annotations

import asyncio
import faulthandler
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from toolpool import Registry, ToolExecution

registry = Registry()
#: The same tools behind an approval stage: they take the registry's staged path.
staged = Registry()


class TimeLimitExceeded(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """HumanEval's ``execution.py`` guard: SIGALRM raises in the main thread on time."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeLimitExceeded("Timed out!")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _work(how: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    if how == "sleep":  # blocked in C
        time.sleep(seconds)
    elif how == "select":  # select on nothing, in C
        select.select([], [], [], seconds)
    else:  # a tight loop in pure Python
        while time.monotonic() < deadline:
            pass


def guarded(how: str, work: float, limit: float, catch: bool = True) -> str:
    """Install SIGTERM and SIGALRM handlers, register a faulthandler signal, arm setitimer,
    then work for ``work`` seconds: 'finished', or 'timed out' once the alarm fires (raised
    out of the body if not ``catch``)."""
    terms: list[int] = []
    previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
    try:
        with time_limit(limit):
            _work(how, work)
        return "finished"
    except TimeLimitExceeded:
        if not catch:
            raise
        return "timed out"
    finally:
        faulthandler.unregister(signal.SIGUSR2)
        signal.signal(signal.SIGTERM, previous_term)


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


async def on_main_thread_async() -> bool:
    return threading.current_thread() is threading.main_thread()


def runs_asyncio() -> int:
    """A sync body that runs an event loop of its own, as a script may."""

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    return asyncio.run(answer())


def cooperates(how: str, execution: ToolExecution, seconds: float = 30.0) -> str:
    """Work in slices of ``how`` until the call's signal is set, then end 'aborted'. With
    ``how`` 'wait', block on the signal itself (a threading event, in C)."""
    deadline = time.monotonic() + seconds
    signal_ = execution.signal
    while not signal_.cancelled and time.monotonic() < deadline:
        if how == "wait":
            signal_.wait_blocking(deadline - time.monotonic())
        else:
            _work(how, 0.02)
    signal_.raise_if_cancelled()
    return "never cancelled"


def ignores(how: str, seconds: float = 30.0, term: bool = False) -> str:
    """Work for ``seconds``, deaf to its signal; with ``term``, deaf to SIGTERM too."""
    if term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _work(how, seconds)
    return "never stopped"


for _tool in (guarded, on_main_thread, on_main_thread_async, runs_asyncio, cooperates, ignores):
    registry.add_tool(_tool)
    staged.add_tool(_tool)


@staged.approval
def _approve(execution: ToolExecution) -> bool:
    return True
