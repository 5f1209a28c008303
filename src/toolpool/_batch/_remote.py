"""``toolpool batch --server URL [--server URL ...]``: the batch's calls go to services.

:class:`RemotePool` stands where the batch's :class:`toolpool.Pool` stands (submit, groups,
the catalog, statistics), so the runner keeps every promise of ``toolpool batch`` (records,
resume, retries by ``body_started``, progress) unchanged. What it adds is where a call goes:

- calls go to the servers in turn;
- a call that was **never sent** (no connection, 503, the service draining) goes to the next
  server, and again, until one takes it: it cannot have run, so this is no retry (its
  record's ``attempts`` does not count it). If no server takes it for
  :data:`UNAVAILABLE_FOR` seconds, the batch stops as when a pool breaks (unrecorded calls
  run on the next run);
- a call **lost** with its server (the connection dropped mid-call) settles ``worker_lost``
  with ``body_started`` None (unless the server said the body runs): the runner retries it
  only with ``--idempotent``, as any lost call. That server is then passed over for
  :data:`LOST_AVOID_FOR` seconds while another has lost nothing in that time, so that a
  retry does not go back to a server that just went away (over a connection that may not
  know it yet) to be lost again.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Generator, Mapping
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Final

import anyio
import anyio.abc

from ..core import Outcome, ToolpoolError
from ..remote import SERVER_LOST, Client, RemoteCall, ServerUnavailable, connect
from ..supervisor import Result, Statistics, Timeline

__all__ = ("LOST_AVOID_FOR", "UNAVAILABLE_FOR", "RemoteBatchCall", "RemoteGroup", "RemotePool")

#: Seconds a call may find no server that takes it before the batch stops.
UNAVAILABLE_FOR: Final = 30.0
#: Seconds between two rounds over every server, when none took a call.
_ROUND_PAUSE: Final = 0.2
#: Seconds a server that lost a call (``ServerLost``: the connection dropped mid-call) is
#: passed over while another server has lost none in that time.
LOST_AVOID_FOR: Final = 5.0


class RemotePool:
    """The batch's calls, sent to ``servers`` (their MCP endpoints)."""

    #: (the window the batch keeps: calls in flight, no prefetch on top)
    prefetch = 0

    def __init__(self, servers: tuple[str, ...], *, token: str | None, concurrency: int) -> None:
        if not servers:
            raise ValueError("at least one --server")
        self.servers = servers
        self._token = token
        self._concurrency = concurrency
        self._clients: list[Client] = []
        self._lost_at: list[float] = []  # when each server last lost a call (monotonic)
        self._stack = AsyncExitStack()
        self._tg: anyio.abc.TaskGroup | None = None
        self._turn = itertools.count()
        self._ids = itertools.count(1)
        self._calls: set[RemoteBatchCall] = set()
        self.catalog: Mapping[str, Any] = {}
        self.unavailable: dict[str, str] = {}
        """Why each server last refused a call (never sent), by URL."""

    async def __aenter__(self) -> RemotePool:
        for url in self.servers:
            client = connect(url, token=self._token, max_connections=self._concurrency)
            self._clients.append(await self._stack.enter_async_context(client))
            self._lost_at.append(-LOST_AVOID_FOR)
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self.catalog = await self._catalog()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for call in list(self._calls):
            call.cancel({"kind": "disposed"})
        await self._stack.__aexit__(exc_type, exc, tb)

    async def _catalog(self) -> Mapping[str, Any]:
        """The tools of the first server that answers (they serve the same tools)."""
        reasons = []
        for client in self._clients:
            try:
                return await client.list_tools()
            except ServerUnavailable as exc:
                reasons.append(str(exc))
        raise ServerUnavailable("no server answered: " + "; ".join(reasons))

    def submit(
        self,
        tool: str,
        args: Mapping[str, Any],
        *,
        timeout: float | None = None,
        group: RemoteGroup | None = None,
    ) -> RemoteBatchCall:
        assert self._tg is not None
        call = RemoteBatchCall(self, next(self._ids), tool, args, timeout, group)
        self._calls.add(call)
        self._tg.start_soon(call._run)
        return call

    def group(self) -> RemoteGroup:
        return RemoteGroup(self)

    def statistics(self) -> Statistics:
        """What the progress display reads: the calls in flight (the servers queue the rest)."""
        running = sum(1 for c in self._calls if not c.done())
        return Statistics(
            workers={},
            queued=0,
            in_flight=running,
            settled={},
            escalations={},
            workers_started=0,
            workers_replaced=0,
            submitted=0,
        )

    def _next_client(self) -> int:
        """The next server in turn, passing over one that lost a call in the last
        :data:`LOST_AVOID_FOR` seconds; if every server did, the one in turn."""
        count = len(self._clients)
        turn = next(self._turn) % count
        now = time.monotonic()
        for step in range(count):
            index = (turn + step) % count
            if now - self._lost_at[index] >= LOST_AVOID_FOR:
                return index
        return turn


class RemoteGroup:
    """The calls of one input ``group``: cancelled together (CONTRACT C5)."""

    def __init__(self, pool: RemotePool) -> None:
        self._pool = pool
        self._calls: list[RemoteBatchCall] = []
        self.cause: Mapping[str, str] | None = None

    @property
    def cancelled(self) -> bool:
        return self.cause is not None

    def submit(
        self, tool: str, args: Mapping[str, Any], *, timeout: float | None = None
    ) -> RemoteBatchCall:
        call = self._pool.submit(tool, args, timeout=timeout, group=self)
        self._calls.append(call)
        if self.cause is not None:
            call.cancel(self.cause)
        return call

    def cancel(self, cause: Mapping[str, str] | None = None) -> None:
        if self.cause is None:
            self.cause = dict(cause or {"kind": "user"})
        for call in self._calls:
            call.cancel(self.cause)


class RemoteBatchCall:
    """One line's call, sent to one server after another until one takes it."""

    def __init__(
        self,
        pool: RemotePool,
        call_id: int,
        tool: str,
        args: Mapping[str, Any],
        timeout: float | None,
        group: RemoteGroup | None,
    ) -> None:
        self._pool = pool
        self.id = call_id
        self.tool = tool
        self.args = args
        self.timeout = timeout
        self.group = group
        self._inner: RemoteCall | None = None
        self._cancel: str | None = None
        self._timed_out = False
        self._done = anyio.Event()
        self._result: Result | None = None
        self._error: Exception | None = None
        self._submitted = time.monotonic()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Result:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    async def wait(self) -> Result:
        await self._done.wait()
        return self.result()

    def __await__(self) -> Generator[Any, None, Result]:
        return self.wait().__await__()

    def cancel(self, cause: Mapping[str, str] | None = None, *, force: bool = False) -> None:
        """Cancel it: not sent yet, it is never sent; sent, the MCP cancel goes to its
        server (``force`` changes nothing here: the server's ladder decides)."""
        if self._cancel is not None or self.done():
            return
        kind = (cause or {"kind": "user"}).get("kind", "user")
        self._cancel = f"cancelled ({kind})"
        if self._inner is not None:
            self._inner.cancel(self._cancel)

    async def _run(self) -> None:
        try:
            self._result = await self._send()
        except ToolpoolError as exc:
            self._error = exc
        finally:
            self._pool._calls.discard(self)
            self._done.set()

    async def _send(self) -> Result:
        pool = self._pool
        first_refusal: float | None = None
        tried = 0
        while True:
            if self._cancel is not None:
                return self._never_sent()
            index = pool._next_client()
            client = pool._clients[index]
            self._inner = client.submit(self.tool, self.args)
            try:
                with anyio.CancelScope() as deadline:
                    if self.timeout is not None:
                        deadline.deadline = self._submitted + self.timeout
                    result = await self._inner.wait()
                if deadline.cancelled_caught:  # our timeout: the MCP cancel, then its answer
                    self._timed_out = True
                    self._inner.cancel("timeout")
                    result = await self._inner.wait()
            except ServerUnavailable as exc:
                pool.unavailable[client.url] = str(exc)
                now = time.monotonic()
                first_refusal = now if first_refusal is None else first_refusal
                if now - first_refusal > UNAVAILABLE_FOR:
                    raise ServerUnavailable(
                        f"no server took the call for {UNAVAILABLE_FOR:g}s: "
                        + "; ".join(f"{u}: {w}" for u, w in pool.unavailable.items())
                    ) from exc
                tried += 1
                if tried % len(pool._clients) == 0:
                    await anyio.sleep(_ROUND_PAUSE)
                continue
            if result.error_name == SERVER_LOST:
                pool._lost_at[index] = time.monotonic()
            if self._timed_out and result.outcome is Outcome.ABORTED:
                result = dataclasses.replace(result, outcome=Outcome.TIMEOUT)
            return result

    def _never_sent(self) -> Result:
        from ..core import ABORTED_BEFORE_DISPATCH_TEXT

        now = time.monotonic()
        return Result(
            call_id=self.id,
            tool=self.tool,
            outcome=Outcome.ABORTED_BEFORE_DISPATCH,
            error=ABORTED_BEFORE_DISPATCH_TEXT,
            error_name="AbortError",
            body_started=False,
            timeline=Timeline(submitted=self._submitted, settled=now),
        )
