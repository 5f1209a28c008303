"""The public faces of a call and of a group (turn): what callers await and cancel.

Each holds the machine's record of it (``machine/_records.py``: the machine knows nothing of
these faces) and adds the anyio events to wait on; every decision about them is the
machine's, reached through the pool. Calls, groups and maps talk to their pool through
:class:`PoolPort`, a small interface (the pool's side: ``_pool.Port``), never through its
private attributes; so this module, and ``_map.py``, import nothing of ``_pool.py``. The
pool keeps the face of each unsettled call by its id (``PoolPort.call_of``) and marks it
settled when it performs the machine's ``Settled``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Final, Protocol, final

import anyio

from ..core import (
    CancelCause,
    CancelSignal,
    PoolClosedError,
    cancel_with_runtime_cause,
    validate_cause,
)
from ._results import Progress, Result
from .machine import CallRecord, CallState, GroupRecord

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

    def call_of(self, call_id: int) -> Call | None:
        """The face of unsettled call ``call_id`` (None once the pool performed its
        ``Settled``)."""

    def new_group(self) -> Group:
        """A new group of this pool (``Pool.group``)."""

    def batch(self) -> AbstractContextManager[None]:
        """Submit many calls, then perform what they need in one go (a map's refill)."""


@final
class Call:
    """A submitted call. ``await call`` gives its :class:`Result`; ``call.cancel()`` stops it.

    Created by :meth:`Pool.submit` and :meth:`Group.submit` only.
    """

    __slots__ = (
        "_abandoned",
        "_event",
        "_on_settled",
        "_port",
        "_progress_event",
        "_record",
        "_settled",
        "_started_event",
        "id",
        "tool",
    )

    def __init__(self, port: PoolPort, record: CallRecord) -> None:
        self.id = record.id
        """The pool-wide call id."""
        self.tool = record.tool
        """The tool's name."""
        self._record = record  # the machine's (read here, never changed)
        self._port = port
        self._settled = False  # the pool performed its Settled: its waiters were woken
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
        return self._settled

    def result(self) -> Result:
        """The settled result; raises :class:`RuntimeError` if the call has not settled."""
        if not self._settled:
            raise RuntimeError("the call has not settled yet; await it")
        result = self._record._result
        assert result is not None
        return result

    async def wait(self) -> Result:
        """Wait until the call settles and return its result.

        If the waiting task is cancelled the call is not: cancel it explicitly, or use
        :meth:`Pool.call`, which does so with cause ``parent``.

        Raises :class:`toolpool.PoolClosedError` if the pool closed without settling it:
        its worker's tree did not die of SIGKILL (``CloseReport.unsettled``).
        """
        if not self._settled and self._abandoned is None:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        if not self._settled:
            raise PoolClosedError(self._abandoned or "the pool closed without settling it")
        result = self._record._result
        assert result is not None
        return result

    async def wait_started(self) -> bool:
        """Wait until the worker reports the body started, or the call settled first.

        Returns True if the body started (it may have finished since), False if the call
        settled without its body starting (or without the start being known, for a worker
        that died without a ledger). A worker reports the start of an async body at once,
        and that of a sync body once it has run for about 0.2 ms (a quicker body's result
        says it started).
        """
        record = self._record
        if not record._started and not self._settled:
            if self._started_event is None:
                self._started_event = anyio.Event()
            await self._started_event.wait()
        return record._started

    @property
    def started(self) -> bool:
        """True once the worker reported that the body was invoked (see :meth:`wait_started`)."""
        return self._record._started

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

    def _settle(self) -> None:
        """The pool performs the machine's ``Settled``: wake the waiters, then the one told
        (a map's collector, a sync pool's future)."""
        self._settled = True
        if self._event is not None:
            self._event.set()
        if self._started_event is not None:
            self._started_event.set()
        progress = self._progress_event  # (its progress updates end: _wake_progress, inline)
        if progress is not None:
            progress.set()
            self._progress_event = None
        if self._on_settled is not None:
            self._on_settled(self)

    def _queued(self) -> bool:
        """In the pool's queue still: no worker took it (nor did it settle)."""
        return self._record._state is CallState.QUEUED

    @property
    def progress(self) -> Progress | None:
        """What the body last reported of its progress (``execution.report_progress``), or
        None if it reported none. Kept once the call settled: the last report before it."""
        return self._record._progress

    async def progress_updates(self) -> AsyncIterator[Progress]:
        """The call's progress reports as they arrive, starting with the latest one so far
        (if any); ends when the call settles.

        Reports that arrive while the consumer is busy are coalesced: it gets the latest,
        never a backlog (the worker itself sends at most one every 50 ms). Several
        consumers may iterate at once; each sees every report it was not too slow for.
        """
        seen: Progress | None = None
        record = self._record
        while True:
            latest = record._progress
            if latest is not None and latest is not seen:
                seen = latest
                yield latest
                continue
            if self._settled:
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
        record = self._record
        result = record._result if self._settled else None
        state = result.outcome.value if result is not None else record._state.value
        return f"<toolpool.Call {self.id} {self.tool!r} {state}>"


@final
class Group:
    """A turn: one cancel controller covering every call made in it (CONTRACT C5).

    Use ``async with pool.group() as turn:``. Leaving the block normally waits until every
    call of the group settled; leaving it by an exception or cancellation cancels the group
    with cause ``parent`` (the calls are still tracked to settlement by the pool).
    """

    def __init__(self, port: PoolPort) -> None:
        self._record = GroupRecord()  # the machine's: its controller, its unsettled calls
        self._port = port
        self._record._controller.signal.add_callback(self._on_cancel)

    @property
    def signal(self) -> CancelSignal:
        """The group's cancel signal (read-only)."""
        return self._record.signal

    @property
    def cancelled(self) -> bool:
        """True once the group was cancelled."""
        return self._record.cancelled

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
        return self._record._controller.cancel(cause)

    def _unsettled(self) -> bool:
        """It has calls not settled yet, and was not cancelled."""
        record = self._record
        return bool(record._calls) and not record.cancelled

    def _cancel_unsettled(self, cause: CancelCause) -> None:
        """Cancel it (a runtime ``cause``: ``parent``), if it has calls not settled yet and
        was not cancelled."""
        if self._unsettled():
            cancel_with_runtime_cause(self._record._controller, cause)

    def _on_cancel(self, cause: CancelCause) -> None:
        self._port.cancel_group(self, cause)

    async def wait(self) -> None:
        """Wait until every call submitted so far has settled."""
        calls, port = self._record._calls, self._port
        while calls:
            call = port.call_of(next(iter(calls)).id)
            assert call is not None  # (the record leaves the group as it settles)
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
                cancel_with_runtime_cause(self._record._controller, _PARENT)
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
