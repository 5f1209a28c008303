"""A blocking facade for scripts: the pool runs on an event loop in a background thread.

Built on the public API of :class:`Pool` and :class:`Call` only, through an anyio
``BlockingPortal``. A submitted call is a :class:`concurrent.futures.Future` of its
:class:`Result`: ``concurrent.futures.wait`` and ``as_completed`` take it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import signal
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Protocol, TypeVar, final

from anyio.from_thread import BlockingPortal, start_blocking_portal

from ..core import PoolClosedError, validate_cause
from ._calls import Call
from ._interrupts import STOPPED_LINE, killing_line, say, stopping_line
from ._map import MapIterator, SyncMapIterator, _Feed, drive_sync_map, thread_safe_caller
from ._pool import Pool, port_of
from ._results import Progress, Result, Statistics
from .machine import CallState

__all__ = ("Followed", "SyncCall", "SyncPool")

_log = logging.getLogger("toolpool.supervisor")


class Followed(Protocol):
    """A future a :class:`SyncPool` completes when its call settles (in the loop's thread)."""

    _call: Call

    def done(self) -> bool: ...

    def _settle(self, result: Result) -> None: ...

    def _fail(self, exc: BaseException) -> None: ...


F = TypeVar("F", bound=Followed)


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

    def _settle(self, result: Result) -> None:
        self.set_result(result)

    def _fail(self, exc: BaseException) -> None:
        self.set_exception(exc)

    def __repr__(self) -> str:
        state = self.result().outcome.value if self.done() else "pending"
        return f"<toolpool.SyncCall {self.id} {self.tool!r} {state}>"


class _InterruptedClose:
    """Ctrl-C while a :class:`SyncPool` closes (or an executor waits to close it), in the
    main thread: the first says what the close waits for, the next kill the calls at once.

    Its handler never raises: a KeyboardInterrupt raised between two bytecodes of a wait can
    leave a future's lock taken (``concurrent.futures.wait`` takes them one by one), and the
    loop's thread, which completes that future, waits for it for ever. The handler only
    counts, and wakes :meth:`wait` through the loop (a lock taken in a signal handler could
    be the one the interrupted code holds). ``SyncPool._close`` raises one KeyboardInterrupt
    once the close is over."""

    def __init__(self, sync: SyncPool) -> None:
        self._sync = sync
        self.count = 0
        self._previous: Any = None
        self._installed = False
        self._wake: Callable[[], object] | None = None

    def __enter__(self) -> _InterruptedClose:
        if threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    self._previous = signal.signal(signal.SIGINT, self._on_sigint)
                    self._installed = True
            except ValueError:  # (not the main interpreter)
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.interrupted()

    def wait(self, pending: list[concurrent.futures.Future[Any]]) -> None:
        """Until every future in ``pending`` is done, or Ctrl-C is pressed (then
        :attr:`count` is not 0)."""
        if not pending:
            return
        if not self._installed:  # (no Ctrl-C lands in this thread: wait as anyone would)
            concurrent.futures.wait(pending)
            return
        woken = threading.Event()

        def one_done(_: object) -> None:
            if all(f.done() for f in pending):
                woken.set()

        self._wake = woken.set
        for future in pending:
            future.add_done_callback(one_done)
        if not self.count:  # (one before the wake was set: nothing would wake us)
            woken.wait()

    def over(self, *, raise_: bool = True) -> None:
        """Once the close is over (the handler restored): after Ctrl-C, say so, and raise one
        KeyboardInterrupt (``raise_``; else the caller's own goes on)."""
        if self.count:
            say(STOPPED_LINE)
            if raise_:
                raise KeyboardInterrupt

    def interrupted(self) -> None:
        self.count += 1
        sync = self._sync
        pool = sync._pool
        call_soon = sync._call_soon
        if self.count == 1:
            say(stopping_line(pool.graces, sync._waiting_for()))
            if self._wake is not None and call_soon is not None:
                try:
                    call_soon(self._wake)  # (never blocks: this may run in a signal handler)
                except RuntimeError:  # the loop stopped: nothing waits for it
                    pass
            return
        if sync._portal is None:
            return
        calls = [c for c in list(pool._core.calls.values()) if c._facts is None]
        say(killing_line(len(calls)))
        if call_soon is not None:
            try:
                call_soon(sync._kill_all)  # (never blocks: this may run in a signal handler)
            except RuntimeError:  # the loop stopped: nothing is left to kill
                pass


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
        self._following: dict[int, Followed] = {}  # futures of calls not settled (the loop's)
        self._maps: weakref.WeakSet[MapIterator] = weakref.WeakSet()  # (the loop's)
        self._call_soon: Callable[[Callable[[], object]], object] | None = None

    def __enter__(self) -> SyncPool:
        if self._closed or self._portal is not None:
            raise RuntimeError("a SyncPool can be started once")
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            # The pool's start and close must run in one task: wrap it as a context manager.
            self._pool_cm = self._portal.wrap_async_context_manager(self._pool)
            self._pool_cm.__enter__()
            self._call_soon = self._portal.call(thread_safe_caller)
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
        self._close(interrupted=isinstance(exc, KeyboardInterrupt))

    def close(self) -> None:
        """As :meth:`toolpool.Pool.aclose`: every call settled, every process gone. Every
        :class:`SyncCall` is done once this returns. Idempotent.

        Ctrl-C while it waits (in the main thread) escalates: the first says what the pool
        waits for, the second kills the calls still running (SIGKILL of their workers'
        trees); the close goes on until all is gone, then raises one KeyboardInterrupt."""
        self._close(interrupted=False)

    def _close(self, *, interrupted: bool) -> None:
        """Close; ``interrupted``: Ctrl-C brought us here (say so; the next one kills)."""
        if self._portal is None:
            self._closed = True
            return
        with _InterruptedClose(self) as interrupts:
            if interrupted:
                interrupts.interrupted()
            self._close_under()
        interrupts.over(raise_=not interrupted)  # (interrupted: the caller's goes on)

    def _close_under(self) -> None:
        """Close, under the Ctrl-C handling of the caller's :class:`_InterruptedClose`."""
        if self._portal is None:
            self._closed = True
            return
        portal = self._portal
        try:
            self._pool_cm.__exit__(None, None, None)
        finally:
            try:
                portal.call(self._closed_down)  # settled: none may wait on a stopped loop
            finally:
                self._portal_cm.__exit__(None, None, None)
                self._portal = None
                self._closed = True

    def _waiting_for(self) -> str:
        """What the close waits for, in a few words (read from any thread: a snapshot)."""
        calls = list(self._pool._core.calls.values())
        queued = sum(1 for c in calls if c._state is CallState.QUEUED)
        running = len(calls) - queued
        if not calls:
            return "closing the pool (no call is running)"
        what = "1 call" if len(calls) == 1 else f"{len(calls)} calls"
        return f"closing the pool, waiting for {what} ({running} running, {queued} queued)"

    def _kill_all(self) -> int:
        """In the loop: a forced cancel of every call not settled; how many there were."""
        calls = port_of(self._pool).unsettled()
        for call in calls:
            call.cancel(force=True)
        return len(calls)

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
        return portal.call(self._start, tool, args, timeout, functools.partial(SyncCall, portal))

    def _start(
        self,
        tool: str,
        args: Mapping[str, Any] | None,
        timeout: float | None,
        make: Callable[[Call], F],
    ) -> F:
        """In the loop: submit (its errors reach the caller) and follow the call with the
        future ``make`` makes of it, completed once the call settles."""
        call = self._pool.submit(tool, args, timeout=timeout)
        future = make(call)
        self._following[call.id] = future
        if call.done():
            self._deliver(call)
        else:
            call._on_settled = self._deliver
        return future

    def _deliver(self, call: Call) -> None:
        future = self._following.pop(call.id, None)
        if future is not None and not future.done():
            try:
                future._settle(call.result())
            except Exception:  # (called by the pool's pump: never let it break the pool)
                _log.exception("could not complete the future of call %s", call.id)

    def _closed_down(self) -> None:
        for future in list(self._following.values()):
            call = future._call
            if call.done():
                self._deliver(call)
            elif call._abandoned is not None:  # the close left it unsettled: its tree lives
                del self._following[call.id]
                future._fail(PoolClosedError(call._abandoned))
        for it in list(self._maps):  # a map still running ends, even if none takes from it
            if it._pulling:
                it._fail(PoolClosedError("the pool closed while the map ran"))
            it._collector.poke()

    def map(
        self,
        tool: str,
        args_iterable: Iterable[Any],
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
