"""A blocking facade for scripts: the pool runs on an event loop in a background thread.

Built on the public API of :class:`Pool` and :class:`Call` only, through an anyio
``BlockingPortal``. A submitted call is a :class:`concurrent.futures.Future` of its
:class:`Result`: ``concurrent.futures.wait`` and ``as_completed`` take it.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, final

from anyio.abc import TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ..core import PoolClosedError, validate_cause
from ._calls import Call
from ._map import MapIterator, SyncMapIterator, _Feed, drive_sync_map
from ._pool import Pool, port_of
from ._results import Progress, Result, Statistics

__all__ = ("SyncCall", "SyncPool")


@final
class SyncCall(concurrent.futures.Future[Result]):
    """A submitted call, for blocking code: a :class:`concurrent.futures.Future` of its
    :class:`toolpool.Result`, completed when the call settles.

    ``result(timeout=None)`` waits (raising :class:`TimeoutError` if ``timeout`` seconds
    pass first), ``done()`` says whether it settled, and ``concurrent.futures.wait`` and
    ``as_completed`` work with it. Every call settles with a result, whatever happened to
    it, so ``exception()`` is always None.

    ``cancel()`` differs from a plain Future's: it cancels the *call* (see
    :meth:`toolpool.Call.cancel`), which then settles with the result that cancellation
    led to (``aborted``, ``aborted_before_dispatch``, ``killed``...). So the future is
    never in the cancelled state: ``cancelled()`` stays False and ``result()`` returns that
    result. Callbacks added with ``add_done_callback`` run in the pool's event-loop thread:
    they must be quick and must not call the :class:`SyncPool` (that would deadlock it).
    Created by :meth:`SyncPool.submit` only.
    """

    def __init__(self, portal: BlockingPortal, call: Call) -> None:
        super().__init__()
        self._portal = portal
        self._call = call
        # It runs, or waits, in the pool from the start: nothing to withdraw as an
        # executor withdraws a pending future.
        self.set_running_or_notify_cancel()

    @property
    def id(self) -> int:
        """The pool-wide call id."""
        return self._call.id

    @property
    def tool(self) -> str:
        """The tool's name."""
        return self._call.tool

    @property
    def progress(self) -> Progress | None:
        """What the body last reported of its progress, as :attr:`toolpool.Call.progress`
        (the latest report the pool's loop received)."""
        return self._call.progress

    def cancel(self, cause: object = None, *, force: bool = False) -> bool:
        """Cancel the call, as :meth:`toolpool.Call.cancel` (``cause`` validated here, at
        once; the first cause wins). Returns True if the call had not settled yet: it
        settles soon with the result the cancel led to; False if it had settled already."""
        if self.done():
            validate_cause(cause)  # validated even so, as Call.cancel does
            return False
        return bool(self._portal.call(self._cancel, cause, force))

    def _cancel(self, cause: object, force: bool) -> bool:
        settled = self._call.done()
        self._call.cancel(cause, force=force)
        return not settled

    def __repr__(self) -> str:
        state = self.result().outcome.value if self.done() else "pending"
        return f"<toolpool.SyncCall {self.id} {self.tool!r} {state}>"


@final
class SyncPool:
    """:class:`toolpool.Pool` for blocking code. Same arguments; use it as a context manager.

    >>> with toolpool.SyncPool("mytools:registry", workers=2) as pool:  # doctest: +SKIP
    ...     print(pool.call("nap", {"seconds": 0.1}).outcome)

    The errors are the async pool's: :class:`toolpool.PoolClosedError` for a call before
    the pool started or once it closed, :class:`toolpool.UnknownToolError`,
    :class:`TypeError` and :class:`ValueError` for a bad call, at once.
    """

    def __init__(self, tools: str, **options: Any) -> None:
        self._pool = Pool(tools, **options)  # validates the options at once
        self._portal_cm: Any = None
        self._portal: BlockingPortal | None = None
        self._pool_cm: Any = None
        self._closed = False
        self._following: dict[int, SyncCall] = {}  # calls not settled yet (the loop's)
        self._maps: weakref.WeakSet[MapIterator] = weakref.WeakSet()  # (the loop's)

    def __enter__(self) -> SyncPool:
        if self._closed or self._portal is not None:
            raise RuntimeError("a SyncPool can be started once")
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            # The pool's start and close must run in one task: wrap it as a context manager.
            self._pool_cm = self._portal.wrap_async_context_manager(self._pool)
            self._pool_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal = None
            self._closed = True
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """As :meth:`toolpool.Pool.aclose`: every call settled, every process gone. Every
        :class:`SyncCall` is done once this returns. Idempotent."""
        if self._portal is None:
            self._closed = True
            return
        portal = self._portal
        try:
            self._pool_cm.__exit__(None, None, None)
        finally:
            try:
                portal.call(self._closed_down)  # settled now: none may wait on a stopped loop
            finally:
                self._portal_cm.__exit__(None, None, None)
                self._portal = None
                self._closed = True

    def _running(self) -> BlockingPortal:
        if self._portal is None:
            if self._closed:
                raise PoolClosedError("the pool is closed")
            raise PoolClosedError("the pool is not started: use 'with toolpool.SyncPool(...)'")
        return self._portal

    def submit(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> SyncCall:
        """As :meth:`toolpool.Pool.submit`: returns at once, with the call's future."""
        portal = self._running()
        _, call = portal.start_task(self._follow, portal, tool, args, timeout)
        assert isinstance(call, SyncCall)
        return call

    async def _follow(
        self,
        portal: BlockingPortal,
        tool: str,
        args: Mapping[str, Any] | None,
        timeout: float | None,
        *,
        task_status: TaskStatus[SyncCall],
    ) -> None:
        """In the loop: submit (its errors reach the caller), then complete the future once
        the call settled."""
        call = self._pool.submit(tool, args, timeout=timeout)
        future = SyncCall(portal, call)
        self._following[call.id] = future
        task_status.started(future)
        try:
            await call.wait()
        except PoolClosedError as exc:  # the close left it unsettled: its tree did not die
            self._fail(call.id, exc)
        finally:
            if call.done():  # (else the portal is closing: _closed_down completes it)
                self._deliver(call.id)

    def _fail(self, call_id: int, exc: BaseException) -> None:
        future = self._following.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(exc)

    def _deliver(self, call_id: int) -> None:
        future = self._following.pop(call_id, None)
        if future is not None and not future.done():
            future.set_result(future._call.result())

    def _closed_down(self) -> None:
        for call_id, future in list(self._following.items()):
            if future._call.done():
                self._deliver(call_id)
            elif future._call._abandoned is not None:
                self._fail(call_id, PoolClosedError(future._call._abandoned))
        for it in list(self._maps):  # a map still running ends, even if none takes from it
            if it._pulling:
                it._fail(PoolClosedError("the pool closed while the map ran"))
            it._collector.poke()

    def map(
        self,
        tool: str,
        args_iterable: Iterable[Mapping[str, Any] | None],
        *,
        timeout: float | None = None,
        ordered: bool = False,
        max_in_flight: int | None = None,
    ) -> SyncMapIterator:
        """As :meth:`toolpool.Pool.map`, for blocking code: an iterator of the settled
        results, handed over from the pool's loop in batches (see
        :class:`toolpool.SyncMapIterator`). Bad arguments raise here, at once.

        >>> with pool.map("fetch", ({"url": u} for u in urls)) as results:  # doctest: +SKIP
        ...     for result in results:
        ...         print(result.index, result.outcome)
        """
        portal = self._running()
        feed = _Feed()
        _, it = portal.start_task(
            drive_sync_map,
            port_of(self._pool),
            self._maps,
            feed,
            tool,
            args_iterable,
            timeout,
            ordered,
            max_in_flight,
        )
        assert isinstance(it, MapIterator)
        return SyncMapIterator(portal, feed, it)

    def call(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Result:
        """As :meth:`toolpool.Pool.call`, blocking."""
        return self.submit(tool, args, timeout=timeout).result()

    def statistics(self) -> Statistics:
        """As :meth:`toolpool.Pool.statistics`; after :meth:`close`, the pool's last."""
        if self._portal is None:
            return self._pool.statistics()  # no loop runs it now: read it here
        return self._portal.call(self._pool.statistics)
