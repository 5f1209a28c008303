"""Ctrl-C for the commands that run a pool (``toolpool call``, ``toolpool demo``).

The first Ctrl-C cancels the command's calls: they stop as the pool stops any call
(cooperatively, or by SIGTERM and then SIGKILL after the graces), and one line says so. A
second kills at once: each call still unsettled is cancelled with ``force=True`` (SIGKILL of
its worker's tree). Either way the command returns only once every call settled and every
process of its pool is gone, says so in one line, and exits 130; never with a traceback.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from ..core import Graces

if TYPE_CHECKING:
    from ._calls import Call
    from ._results import Result

__all__ = ("EXIT_INTERRUPTED", "Interrupts", "killing_line", "say", "stopping_line")

#: Exit status after Ctrl-C, as a shell reports a process that SIGINT ended (128 + 2).
EXIT_INTERRUPTED = 130


def say(line: str) -> None:
    """One line from the command itself, on stderr."""
    print(f"toolpool: {line}", file=sys.stderr, flush=True)


def stopping_line(graces: Graces, what: str = "stopping the pool") -> str:
    """What the first Ctrl-C says: what is stopped, and how."""
    return (
        f"interrupted: {what}. Its calls are cancelled; {graces.ladder()}. Ctrl-C again to "
        "kill them now."
    )


def killing_line(calls: int) -> str:
    """What the second Ctrl-C says."""
    what = "1 call" if calls == 1 else f"{calls} calls"
    return f"interrupted again: killing {what} now (SIGKILL)"


#: What a command (or a SyncPool) says once an interrupted close is over.
STOPPED_LINE = "stopped: every call settled and every process of the pool is gone"


class Interrupts:
    """Ctrl-C handling for one command run (see the module docstring)."""

    def __init__(self, graces: Graces) -> None:
        self.graces = graces
        self.count = 0
        """How many times Ctrl-C was pressed."""
        self._calls: list[Call] = []
        self._scope: anyio.CancelScope | None = None

    def cancellable(self) -> anyio.CancelScope:
        """The scope of the work the first Ctrl-C cancels (``with interrupts.cancellable():``).
        It belongs inside the pool's ``async with``: the pool is then left normally and stops
        its calls. (A pool left by the cancellation of a scope around it cannot escalate
        them: its own tasks are cancelled too.)"""
        self._scope = anyio.CancelScope()
        if self.count:
            self._scope.cancel()
        return self._scope

    def track(self, call: Call) -> Call:
        """Remember ``call``: a second Ctrl-C kills it if it has not settled."""
        self._calls = [c for c in self._calls if not c.done()]
        if call not in self._calls:
            self._calls.append(call)
        return call

    async def wait(self, call: Call) -> Result:
        """Wait for ``call``'s result, as :meth:`toolpool.Pool.call` does (cancelled while
        waiting, it cancels the call with cause ``parent``); a second Ctrl-C kills it."""
        self.track(call)
        try:
            return await call
        except anyio.get_cancelled_exc_class():
            call.cancel({"kind": "parent"})
            raise

    async def run(self, job: Callable[[], Awaitable[int]]) -> int:
        """Run ``job`` (which enters :meth:`cancellable`); its exit status, or 130 if
        interrupted."""
        status: list[int] = []
        failure: list[Exception] = []
        with anyio.open_signal_receiver(signal.SIGINT) as interrupts:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    async for _ in interrupts:
                        self._interrupted()

                tg.start_soon(watch)
                try:
                    status.append(await job())
                except Exception as exc:  # kept out of the task group's exception group
                    failure.append(exc)
                tg.cancel_scope.cancel()
        if failure and not self.count:
            raise failure[0]
        if self.count:
            say(STOPPED_LINE)
            return EXIT_INTERRUPTED
        return status[0]

    def _interrupted(self) -> None:
        self.count += 1
        if self.count == 1:
            say(stopping_line(self.graces))
            if self._scope is not None:
                self._scope.cancel()
            return
        running = [c for c in self._calls if not c.done()]
        for call in running:
            call.cancel(force=True)
        say(killing_line(len(running)))
