"""A blocking facade for scripts: the pool runs on an event loop in a background thread."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, final

from anyio.from_thread import BlockingPortal, start_blocking_portal

from ._calls import Call
from ._pool import Pool
from ._results import Result, Statistics

__all__ = ("SyncCall", "SyncPool")


@final
class SyncCall:
    """A submitted call, for blocking code: ``result()`` waits, ``cancel()`` stops it."""

    def __init__(self, portal: BlockingPortal, call: Call) -> None:
        self._portal = portal
        self._call = call

    @property
    def id(self) -> int:
        """The pool-wide call id."""
        return self._call.id

    def cancel(self, cause: object = None, *, force: bool = False) -> None:
        """As :meth:`toolpool.Call.cancel` (validated here, at once)."""
        self._portal.call(lambda: self._call.cancel(cause, force=force))

    def done(self) -> bool:
        """True once the call has settled."""
        return self._portal.call(self._call.done)

    def result(self) -> Result:
        """Block until the call settles and return its result."""
        return self._portal.call(self._call.wait)


@final
class SyncPool:
    """:class:`toolpool.Pool` for blocking code. Same arguments; use it as a context manager.

    >>> with toolpool.SyncPool("mytools:registry", workers=2) as pool:  # doctest: +SKIP
    ...     print(pool.call("nap", {"seconds": 0.1}).outcome)
    """

    def __init__(self, tools: str, **options: Any) -> None:
        self._pool = Pool(tools, **options)  # validates the options at once
        self._portal_cm: Any = None
        self._portal: BlockingPortal | None = None
        self._pool_cm: Any = None

    def __enter__(self) -> SyncPool:
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            # The pool's start and close must run in one task: wrap it as a context manager.
            self._pool_cm = self._portal.wrap_async_context_manager(self._pool)
            self._pool_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal = None
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
        """As :meth:`toolpool.Pool.aclose`: every call settled, every process gone."""
        if self._portal is None:
            return
        try:
            self._pool_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)
            self._portal = None

    def _running(self) -> BlockingPortal:
        if self._portal is None:
            raise RuntimeError("use 'with toolpool.SyncPool(...) as pool:'")
        return self._portal

    def submit(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> SyncCall:
        """As :meth:`toolpool.Pool.submit`."""
        portal = self._running()
        # Wrapped in a tuple: a Call is awaitable, and the portal would await it.
        (call,) = portal.call(lambda: (self._pool.submit(tool, args, timeout=timeout),))
        return SyncCall(portal, call)

    def call(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Result:
        """As :meth:`toolpool.Pool.call`, blocking."""
        return self.submit(tool, args, timeout=timeout).result()

    def statistics(self) -> Statistics:
        """As :meth:`toolpool.Pool.statistics`."""
        return self._running().call(self._pool.statistics)
