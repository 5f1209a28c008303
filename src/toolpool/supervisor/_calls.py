"""The public faces of a call and of a group (turn): what callers await and cancel.

Each extends the machine's record (``machine/_records.py``) with anyio events to wait on;
every decision about them is the machine's, reached through the pool. Calls, groups and maps
talk to their pool through :class:`PoolPort`, a small interface (the pool's side:
``_pool.Port``), never through its private attributes; so this module, and ``_map.py``,
import nothing of ``_pool.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Final, Protocol, final

import anyio

from ..core import CancelCause, PoolClosedError, cancel_with_runtime_cause, validate_cause
from ._results import Progress, Result
from .machine import CallRecord, GroupRecord

__all__ = ("Call", "Group", "PoolPort", "await_call")

_PARENT: Final = CancelCause("parent")


class PoolPort(Protocol):
    """What a call, a group and a map may ask of their pool."""

    @property
    def catalog(self) -> Mapping[str, Mapping[str, Any]]:
        """The tools the pool's providers have (``Pool.catalog``)."""

    @property
    def size(self) -> int:
        """The default provider's workers (``Pool.size``)."""

    @property
    def prefetch(self) -> int:
        """Calls a busy worker may hold queued (``Pool.prefetch``)."""

    def check_open(self) -> None:
        """Raise :class:`toolpool.PoolClosedError` (or why the pool broke) unless it serves."""

    def submit_call(
        self,
        tool: str,
        args: Mapping[str, Any] | None,
        *,
        timeout: float | None,
        group: Group | None,
        index: int | None = None,
    ) -> Call:
        """Check, submit and return a new call (``index``: its place in a map's input)."""

    def cancel_call(self, call: Call, cause: CancelCause, *, force: bool) -> None:
        """Cancel ``call`` (a validated cause); nothing if it settled."""

    def cancel_group(self, group: Group, cause: CancelCause) -> None:
        """``group`` was cancelled: cancel its calls, queued ones first."""

    def new_group(self) -> Group:
        """A new group of this pool (``Pool.group``)."""

    def batch(self) -> AbstractContextManager[None]:
        """Submit many calls, then perform what they need in one go (a map's refill)."""


@final
class Call(CallRecord):
    """A submitted call. ``await call`` gives its :class:`Result`; ``call.cancel()`` stops it.

    Created by :meth:`Pool.submit` and :meth:`Group.submit` only.
    """

    __slots__ = (
        "_abandoned",
        "_event",
        "_on_settled",
        "_port",
        "_progress_event",
        "_started_event",
    )

    def __init__(
        self,
        port: PoolPort,
        call_id: int,
        tool: str,
        args: bytes,
        group: Group | None,
        now: float,
    ) -> None:
        super().__init__(call_id, tool, args, group, now)
        self._port = port
        self._event: anyio.Event | None = None
        self._started_event: anyio.Event | None = None
        self._abandoned: str | None = None  # the pool closed without settling it: why
        # Told when the call settles, in the loop, right after its waiters are woken (a
        # map's collector: ``_map.py``).
        self._on_settled: Callable[[Call], object] | None = None
        self._progress_event: anyio.Event | None = None

    def cancel(self, cause: object = None, *, force: bool = False) -> None:
        """Cancel the call. ``cause`` is None (``{"kind": "user"}``) or ``{"kind": "parent"}``.

        Validated strictly, even when the call has already settled. A queued call settles at
        once as ``aborted_before_dispatch``; a running one gets a cooperative cancel message,
        then escalation per the pool's grace periods. ``force=True`` goes straight to SIGKILL
        of the worker's process tree. The first cause wins.
        """
        accepted = validate_cause(cause)
        self._port.cancel_call(self, accepted, force=force)

    def done(self) -> bool:
        """True once the call has settled."""
        return self._result is not None

    def result(self) -> Result:
        """The settled result; raises :class:`RuntimeError` if the call has not settled."""
        if self._result is None:
            raise RuntimeError("the call has not settled yet; await it")
        return self._result

    async def wait(self) -> Result:
        """Wait until the call settles and return its result.

        If the waiting task is cancelled the call is not: cancel it explicitly, or use
        :meth:`Pool.call`, which does so with cause ``parent``.

        Raises :class:`toolpool.PoolClosedError` if the pool closed without settling it:
        its worker's tree did not die of SIGKILL (``CloseReport.unsettled``).
        """
        if self._result is None and self._abandoned is None:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        if self._result is None:
            raise PoolClosedError(self._abandoned or "the pool closed without settling it")
        return self._result

    async def wait_started(self) -> bool:
        """Wait until the worker reports the body started, or the call settled first.

        Returns True if the body started (it may have finished since), False if the call
        settled without its body starting (or without the start being known, for a worker
        that died without a ledger). A worker reports the start of an async body at once,
        and that of a sync body once it has run for about 0.2 ms (a quicker body's result
        says it started).
        """
        if not self._started and self._result is None:
            if self._started_event is None:
                self._started_event = anyio.Event()
            await self._started_event.wait()
        return self._started

    @property
    def started(self) -> bool:
        """True once the worker reported that the body was invoked (see :meth:`wait_started`)."""
        return self._started

    def _abandon(self, why: str) -> None:
        """The pool closes without settling this call (its tree lives): wake its waiters."""
        self._abandoned = why
        if self._event is not None:
            self._event.set()
        if self._started_event is not None:
            self._started_event.set()

    def _wake_started(self) -> None:
        if self._started_event is not None:
            self._started_event.set()

    @property
    def progress(self) -> Progress | None:
        """What the body last reported of its progress (``execution.report_progress``), or
        None if it reported none. Kept once the call settled: the last report before it."""
        return self._progress

    async def progress_updates(self) -> AsyncIterator[Progress]:
        """The call's progress reports as they arrive, starting with the latest one so far
        (if any); ends when the call settles.

        Reports that arrive while the consumer is busy are coalesced: it gets the latest,
        never a backlog (the worker itself sends at most one every 50 ms). Several
        consumers may iterate at once; each sees every report it was not too slow for.
        """
        seen: Progress | None = None
        while True:
            latest = self._progress
            if latest is not None and latest is not seen:
                seen = latest
                yield latest
                continue
            if self._result is not None:
                return
            if self._progress_event is None:
                self._progress_event = anyio.Event()
            await self._progress_event.wait()

    def _wake_progress(self) -> None:
        """A report arrived, or the call settled: wake the iterators (each waits anew)."""
        if self._progress_event is not None:
            self._progress_event.set()
            self._progress_event = None

    def __await__(self) -> Generator[Any, None, Result]:
        return self.wait().__await__()

    def __repr__(self) -> str:
        state = self._result.outcome.value if self._result else self._state.value
        return f"<toolpool.Call {self.id} {self.tool!r} {state}>"


@final
class Group(GroupRecord):
    """A turn: one cancel controller covering every call made in it (CONTRACT C5).

    Use ``async with pool.group() as turn:``. Leaving the block normally waits until every
    call of the group settled; leaving it by an exception or cancellation cancels the group
    with cause ``parent`` (the calls are still tracked to settlement by the pool).
    """

    def __init__(self, port: PoolPort) -> None:
        super().__init__()
        self._port = port
        self._controller.signal.add_callback(self._on_cancel)

    def submit(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Call:
        """Submit a call in this group; after a cancel it settles at once as
        ``aborted_before_dispatch``."""
        return self._port.submit_call(tool, args, timeout=timeout, group=self)

    async def call(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Result:
        """Submit in this group and wait; see :meth:`Pool.call`."""
        return await await_call(self.submit(tool, args, timeout=timeout))

    def cancel(self, cause: object = None) -> bool:
        """Cancel every call of the group, queued or running. The first request wins."""
        return self._controller.cancel(cause)

    def _on_cancel(self, cause: CancelCause) -> None:
        self._port.cancel_group(self, cause)

    async def wait(self) -> None:
        """Wait until every call submitted so far has settled."""
        while self._calls:
            call = next(iter(self._calls))
            assert isinstance(call, Call)
            await call.wait()

    async def __aenter__(self) -> Group:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            if not self.cancelled:
                cancel_with_runtime_cause(self._controller, _PARENT)
            return
        await self.wait()


async def await_call(call: Call) -> Result:
    """Wait for ``call``; if the waiting task is cancelled, the cancellation reaches it at
    once and the call gets a cooperative cancel with cause ``parent`` (C4.5)."""
    try:
        return await call.wait()
    except anyio.get_cancelled_exc_class():
        call._port.cancel_call(call, _PARENT, force=False)
        raise
