"""``toolpool batch --server URL [--server URL ...]``: the batch's calls go to services.

:class:`RemotePool` stands where the batch's :class:`toolpool.Pool` stands (submit, groups,
the catalog, statistics), so the runner keeps every promise of ``toolpool batch`` (records,
resume, retries by ``body_started``, progress) unchanged. What it adds is where a call goes:

- calls go to the servers in turn;
- a call that was **never sent** (no connection, 503, the service draining) goes to the next
  server that has not refused it yet, and once every server refused it, after
  :data:`_ROUND_PAUSE`, round again, until one takes it: it cannot have run, so this is no
  retry (its record's ``attempts`` does not count it). If no server takes it for
  :data:`UNAVAILABLE_FOR` seconds, the batch stops as when a pool breaks (unrecorded calls
  run on the next run);
- a call **lost** with its server (the connection dropped mid-call) settles ``worker_lost``
  with ``body_started`` None (unless the server said the body runs): the runner retries it
  only with ``--idempotent``, as any lost call. Its retry (``submit(..., retry_of=call)``)
  never goes back to a server an earlier run of it was lost with while another server
  takes it, however late the retry comes: not to a server that just went away, nor over a
  connection that may not know it yet, to be lost again. Other calls pass over a server
  that lost one for :data:`LOST_AVOID_FOR` seconds while another has lost nothing in that
  time.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Collection, Generator, Mapping
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
        retry_of: RemoteBatchCall | None = None,
    ) -> RemoteBatchCall:
        """Send a call; ``retry_of``: the earlier run of the same call, settled, whose
        retry this is (it goes to a server none of its runs was lost with, where one
        takes it)."""
        assert self._tg is not None
        lost_with = frozenset[int]() if retry_of is None else retry_of.lost_with
        call = RemoteBatchCall(self, next(self._ids), tool, args, timeout, group, lost_with)
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

    def _next_client(self, *, refused: Collection[int], lost_with: Collection[int]) -> int | None:
        """The next server in turn for a call, not one in ``refused`` (it refused the call
        in this round); None if every server is. Preferred: one the call's earlier runs were
        not lost with (``lost_with``) and that lost no call in the last
        :data:`LOST_AVOID_FOR` seconds; then one the call was not lost with; then any."""
        count = len(self._clients)
        turn = next(self._turn) % count
        now = time.monotonic()
        order = [(turn + step) % count for step in range(count)]
        order = [index for index in order if index not in refused]
        for index in order:
            if index not in lost_with and now - self._lost_at[index] >= LOST_AVOID_FOR:
                return index
        for index in order:
            if index not in lost_with:
                return index
        return order[0] if order else None


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
        self,
        tool: str,
        args: Mapping[str, Any],
        *,
        timeout: float | None = None,
        retry_of: RemoteBatchCall | None = None,
    ) -> RemoteBatchCall:
        call = self._pool.submit(tool, args, timeout=timeout, group=self, retry_of=retry_of)
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
        lost_with: frozenset[int] = frozenset(),
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
        self.lost_with = lost_with
        """The servers (their indexes) the call's earlier runs were lost with, and this
        run's once it is: its retry avoids them."""

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
        refused: set[int] = set()  # the servers that refused it in this round
        while True:
            if self._cancel is not None:
                return self._never_sent()
            index = pool._next_client(refused=refused, lost_with=self.lost_with)
            if index is None:  # every server refused it: a pause, then round again
                refused.clear()
                await anyio.sleep(_ROUND_PAUSE)
                continue
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
                refused.add(index)
                continue
            if result.error_name == SERVER_LOST:
                pool._lost_at[index] = time.monotonic()
                self.lost_with = self.lost_with | {index}
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
