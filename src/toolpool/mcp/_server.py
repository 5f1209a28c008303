"""The MCP face of a pool: :class:`McpServer`, on the ``mcp`` SDK's low-level server.

One server serves one pool, over stdio (:meth:`McpServer.run_stdio`) and/or streamable HTTP
(:meth:`McpServer.asgi_app`). It mirrors the pool's tools from its lifecycle events, turns a
``tools/call`` into a pool call answered once the call settled, and is the process manager
of every call it accepted: each one is tracked until it settles, whatever happens to the
request that asked for it (CONTRACT C8).

How each way of stopping a call maps to a cause (C8.1):

======================================================  =========
``notifications/cancelled`` for the request              user
``tasks/cancel`` for a task-augmented call               user
the request's HTTP response stream closed by the client  parent
stdin closed, connection lost, client process dead       parent
the server's shutdown (SIGTERM, SIGINT, ``cancel_all``)  disposed
the call's deadline                                      timeout
======================================================  =========
"""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import anyio.abc
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from ..core import CancelCause, PoolClosedError, UnknownToolError, validate_cause
from ..supervisor import Call, Pool, PoolEvent, Result, ToolsChanged
from ..supervisor._pool import port_of
from ._describe import call_result, describe_tool
from ._tasks import Task, TaskStore

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ("DRAINING", "McpServer", "McpStatistics", "serve")

_log = logging.getLogger("toolpool.mcp")

#: The JSON-RPC error code of a ``tools/call`` refused because the server is draining.
DRAINING: Final = -32001
#: The largest JSON-RPC message accepted by default, over stdio and HTTP: 4 MiB.
DEFAULT_MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024

_USER: Final = CancelCause("user")
_PARENT: Final = CancelCause("parent")
_DISPOSED: Final = CancelCause("disposed")

#: Where the HTTP face leaves the event set when the client closes a request's response
#: stream (``_http.py``); read back from the request's ASGI scope.
DISCONNECTED_KEY: Final = "toolpool.mcp.disconnected"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class McpStatistics:
    """What an :class:`McpServer` did, frozen (``server.statistics()``)."""

    in_flight: int
    """Calls accepted and not settled yet."""
    accepted: int
    """``tools/call`` requests that became pool calls (task-augmented ones included)."""
    refused_draining: int
    """``tools/call`` requests refused because the server was draining."""
    outcomes: Mapping[str, int]
    """Settled calls by outcome (``ok``, ``aborted``, ``killed``...)."""
    cancelled: Mapping[str, int]
    """Settled calls this server's cancel stopped, by cause (``user``, ``parent``,
    ``disposed``): counted once settled, and only where that cancel is the cause that stuck
    (the first wins: a call its deadline stopped first is not counted here)."""
    undelivered: int
    """Settled calls whose result no client received: its request was cancelled, or its
    client went away. Their results are logged (logger ``toolpool.mcp``) and counted here."""


@dataclass(eq=False, slots=True)
class _Tracked:
    call: Call
    tool: str
    task: Task | None = None
    delivered: bool = False
    cause: CancelCause | None = None
    answered: anyio.Event = field(default_factory=anyio.Event)
    """Set once its request's handler is done (at once for a task)."""


def _peer_cancelled(ctx: ServerRequestContext[Any, Any]) -> bool:
    """Whether the client sent ``notifications/cancelled`` for this request.

    The SDK's dispatcher sets the request's ``cancel_requested`` before it cancels the
    handler, so this is exact when the handler sees its cancellation. (Read through the
    session's request channel: the SDK 2.3 context does not expose it otherwise.)
    """
    outbound = getattr(ctx.session, "_request_outbound", None)
    event = getattr(outbound, "cancel_requested", None)
    return isinstance(event, anyio.Event) and event.is_set()


def _connection_of(ctx: ServerRequestContext[Any, Any]) -> Any:
    """The SDK's per-client ``Connection`` of a request (identity: who owns a task).

    A private attribute of the SDK 2.3 session. Should a release rename it, this is None and
    the face fails closed: no task is created, none is shown (``TaskStore``), rather than
    every client seeing every other's tasks."""
    return getattr(ctx.session, "_connection", None)


def _disconnected(ctx: ServerRequestContext[Any, Any]) -> anyio.Event | None:
    request = ctx.request
    scope = getattr(request, "scope", None)
    event = scope.get(DISCONNECTED_KEY) if isinstance(scope, dict) else None
    return event if isinstance(event, anyio.Event) else None


class _LowLevel(Server[Any]):
    """The SDK's low-level server, announcing what it serves: tool list changes, tasks."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        options = super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True),
            experimental_capabilities,
            extensions,
        )
        options.capabilities.tasks = types.ServerTasksCapability(
            list=types.TasksListCapability(),
            cancel=types.TasksCancelCapability(),
            requests=types.ServerTasksRequestsCapability(
                tools=types.TasksToolsCapability(call=types.TasksCallCapability())
            ),
        )
        return options


class _AnswerWatch:
    """The write side of a stream transport, noting each request answered: a drain stops
    serving only once the answers of the calls it settled are written (the SDK writes an
    answer after its handler returned; stopping in between would lose it)."""

    def __init__(self, stream: Any, pending: set[Any], written: Callable[[], None]) -> None:
        self._stream = stream
        self._pending = pending
        self._written = written

    async def send(self, item: Any) -> None:
        await self._stream.send(item)
        message = getattr(item, "message", None)
        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError):
            self._pending.discard(message.id)
            self._written()

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _AnswerWatch:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class McpServer:
    """A pool's tools over the Model Context Protocol.

    ``pool`` is a started :class:`toolpool.Pool` (any number of providers; they may come
    and go). ``timeout``: seconds a call may run when its provider sets none (None: no
    deadline). ``max_message_bytes``: the largest JSON-RPC message accepted (over stdio;
    :meth:`asgi_app` has its own ``max_body_bytes``). ``progress_interval``: the least
    time between two ``notifications/progress`` of one call.

    The server must be *running* to serve calls: :meth:`run_stdio` and the lifespan of
    :meth:`asgi_app` start it; ``async with server:`` does so by hand. Leaving it drains:
    new calls are refused, the calls still in flight are cancelled with cause ``disposed``,
    and it returns once every one settled.
    """

    def __init__(
        self,
        pool: Pool,
        *,
        timeout: float | None = None,
        name: str = "toolpool",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        progress_interval: float = 0.1,
    ) -> None:
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(max_message_bytes, int) or max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be an int of at least 1024")
        if not isinstance(progress_interval, int | float) or not progress_interval >= 0:
            raise ValueError("progress_interval must be a non-negative number of seconds")
        from .. import __version__

        self.pool = pool
        self.timeout = None if timeout is None else float(timeout)
        self.max_message_bytes = max_message_bytes
        self.progress_interval = float(progress_interval)
        self._tools: dict[str, dict[str, Any]] = {}
        self._listing = types.ListToolsResult(tools=[])
        self._tracked: dict[Call, _Tracked] = {}
        # Calls of the 2026-07-28 wire by JSON-RPC request id (`cancel_request`).
        self._by_request: dict[Any, list[_Tracked]] = {}
        self._handlers = 0
        self._idle: anyio.Event | None = None
        # Over a stream transport: requests whose handler returned, answer not yet written.
        self._unwritten: set[Any] | None = None
        self._written: anyio.Event | None = None
        self._draining = False
        self._tg: anyio.abc.TaskGroup | None = None
        self._connections: dict[int, Any] = {}  # id(connection) -> its latest session
        self._list_changed: anyio.Event | None = None
        self._tasks = TaskStore()
        self._accepted = 0
        self._refused = 0
        self._undelivered = 0
        self._outcomes: dict[str, int] = {}
        self._cancelled: dict[str, int] = {}
        self._server = _LowLevel(
            name,
            version=__version__,
            instructions="Tools run by toolpool in isolated worker processes. Each tool's "
            "description says where it runs; a cancelled call is stopped, and its process "
            "tree is gone before the cancellation is confirmed.",
            # The SDK checks a 2026-07-28 call's Mcp-Param headers against the tool's schema:
            # given here, it does not run a whole tools/list per call to find it.
            get_tool_input_schema=self._input_schema,
        )
        self._server.add_request_handler(
            "tools/list", types.PaginatedRequestParams, self._list_tools
        )
        self._server.add_request_handler("tools/call", types.CallToolRequestParams, self._call_tool)
        self._server.add_request_handler("tasks/get", types.GetTaskRequestParams, self._task_get)
        self._server.add_request_handler(
            "tasks/result", types.GetTaskPayloadRequestParams, self._task_result
        )
        self._server.add_request_handler(
            "tasks/cancel", types.CancelTaskRequestParams, self._task_cancel
        )
        self._server.add_request_handler(
            "tasks/list", types.PaginatedRequestParams, self._task_list
        )
        self._server.middleware.append(self._middleware)
        # Tools mirror the providers' lifecycle events (never a read of the pool at start).
        self._unsubscribe = pool.subscribe(self._on_event, replay=True)

    # ------------------------------------------------------------------ state

    @property
    def lowlevel(self) -> Server[Any]:
        """The SDK's low-level server this face runs on."""
        return self._server

    @property
    def in_flight(self) -> int:
        """Calls this server accepted that have not settled yet."""
        return len(self._tracked)

    @property
    def draining(self) -> bool:
        """True once :meth:`begin_drain` was called: new ``tools/call`` are refused."""
        return self._draining

    @property
    def tools(self) -> Mapping[str, Mapping[str, Any]]:
        """The tools as ``tools/list`` shows them now, by name (wire form)."""
        return MappingProxyType(self._tools)

    def statistics(self) -> McpStatistics:
        """A frozen snapshot of what this server did."""
        return McpStatistics(
            in_flight=len(self._tracked),
            accepted=self._accepted,
            refused_draining=self._refused,
            outcomes=MappingProxyType(dict(self._outcomes)),
            cancelled=MappingProxyType(dict(self._cancelled)),
            undelivered=self._undelivered,
        )

    def begin_drain(self) -> None:
        """Refuse new ``tools/call`` from now on (JSON-RPC error :data:`DRAINING`, "the
        server is draining"); calls in flight and everything else go on."""
        self._draining = True

    def cancel_all(self, cause: Mapping[str, str] | None = None, *, force: bool = False) -> int:
        """Cancel every call in flight with ``cause`` (``{"kind": "user" | "parent" |
        "disposed"}``; default ``disposed``), escalating as the pool does (``force``: SIGKILL
        at once). The first cause of a call wins. Returns how many calls were in flight."""
        accepted = _DISPOSED if cause is None else validate_cause(cause, allow_runtime=True)
        if accepted.kind == "timeout":
            raise ValueError(
                "a call's deadline is the pool's own: cancel with user, parent or disposed"
            )
        if not self._tracked:
            return 0
        # One pump once every call is cancelled: between two cancels' pumps, a worker that
        # one freed could take up a queued call not cancelled yet and start it.
        with port_of(self.pool).batch():
            for tracked in list(self._tracked.values()):
                self._cancel(tracked, accepted, force=force)
        return len(self._tracked)

    async def wait_idle(self) -> None:
        """Return once every call this server accepted has settled and every request it
        was handling has been answered (or dropped, its client gone)."""
        while self._tracked or self._handlers:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    def _maybe_idle(self) -> None:
        if not self._tracked and not self._handlers and self._idle is not None:
            self._idle.set()
            self._idle = None

    def cancel_request(self, request_id: object) -> bool:
        """Cancel, with cause ``user``, the 2026-07-28 ``tools/call`` whose request id is
        ``request_id`` (the HTTP face's answer to a ``notifications/cancelled`` it honours,
        docs/mcp.md): its request is then answered once the call settled. False (nothing
        done) unless exactly one such request is in flight here."""
        found = self._by_request.get(request_id)
        if found is None or len(found) != 1:
            return False
        self._cancel(found[0], _USER)
        return True

    def _cancel(self, tracked: _Tracked, cause: CancelCause, *, force: bool = False) -> None:
        call = tracked.call
        if call.done():
            return
        if tracked.cause is None:
            tracked.cause = cause  # counted once settled, if it is the cause that stuck
        if cause.kind in ("user", "parent"):
            call.cancel(cause, force=force)
        else:  # a runtime cause: only the runtime may give it (C1.2)
            self.pool._cancel(call, cause, force=force)

    # ------------------------------------------------------------------ running

    async def __aenter__(self) -> McpServer:
        if self._tg is not None:
            raise RuntimeError("this McpServer is already running")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._announce_changes)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        tg = self._tg
        assert tg is not None
        try:
            with anyio.CancelScope(shield=True):
                self.begin_drain()
                self.cancel_all(_DISPOSED)
                await self.wait_idle()
        finally:
            tg.cancel_scope.cancel()
            self._tg = None
            await tg.__aexit__(None, None, None)

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        """Run the server here unless it already runs (entered by its owner)."""
        if self._tg is not None:
            yield
            return
        async with self:
            yield

    def close(self) -> None:
        """Stop mirroring the pool's events (the server serves no more calls after it)."""
        self._unsubscribe()

    def _init_options(self) -> InitializationOptions:
        return self._server.create_initialization_options()

    async def run_stdio(self, *, handle_signals: bool = True, watch_parent: bool = False) -> None:
        """Serve MCP over this process's stdin/stdout until the client goes away or the
        process is told to stop; return once every call settled.

        - stdin closed (the client closed it, or died), or (``watch_parent``) this
          process's parent died: every call is cancelled with cause ``parent``;
        - SIGTERM or SIGINT (``handle_signals``): new calls are refused, every call is
          cancelled with cause ``disposed`` and answered once settled, then serving stops.
          A second signal kills the calls still running (SIGKILL of their trees).
        """
        from ._stdio import stdio_streams

        async with self._running(), stdio_streams(self.max_message_bytes) as (read, write):
            await self._serve_streams(read, write, handle_signals, watch_parent)

    async def _serve_streams(
        self, read: Any, write: Any, handle_signals: bool, watch_parent: bool
    ) -> None:
        serving = anyio.CancelScope()
        self._unwritten = set()
        write = _AnswerWatch(write, self._unwritten, self._answer_written)
        async with anyio.create_task_group() as tg:
            if handle_signals:
                tg.start_soon(self._on_signals, serving)
            if watch_parent:
                tg.start_soon(self._watch_parent, serving)
            with serving:
                await self._server.run(read, write, self._init_options())
            # The client went away (or we were told to stop, and everything is answered).
            if self.cancel_all(_PARENT):
                _log.info("the client went away: its calls are cancelled (parent)")
            await self.wait_idle()
            tg.cancel_scope.cancel()

    async def _on_signals(self, serving: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:
                count = 0
                async for signum in signals:
                    count += 1
                    if count == 1:
                        _log.info("%s: draining", signal.Signals(signum).name)
                        tg.start_soon(self._stop, serving)
                    else:
                        self.cancel_all(_DISPOSED, force=True)

    async def _stop(self, serving: anyio.CancelScope) -> None:
        self.begin_drain()
        self.cancel_all(_DISPOSED)
        await self.wait_idle()
        await self._answers_written()
        serving.cancel()

    def _answer_written(self) -> None:
        if not self._unwritten and self._written is not None:
            self._written.set()

    async def _answers_written(self) -> None:
        """Until the answers of the requests handled so far are written (at most 5 s: a
        transport that no longer writes cannot hold the stop up)."""
        with anyio.move_on_after(5):
            while self._unwritten:
                self._written = anyio.Event()
                await self._written.wait()

    async def _watch_parent(self, serving: anyio.CancelScope) -> None:
        """The client that started us died (our parent changed): as stdin closed."""
        parent = os.getppid()
        while os.getppid() == parent:  # noqa: ASYNC110 (no event tells a parent's death)
            await anyio.sleep(0.25)
        _log.info("the client process (pid %d) died", parent)
        self.cancel_all(_PARENT)
        await self.wait_idle()
        serving.cancel()

    def asgi_app(
        self,
        *,
        token: str | None = None,
        allowed_origins: list[str] | None = None,
        allowed_hosts: list[str] | None = None,
        max_body_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        path: str = "/mcp",
    ) -> Starlette:
        """MCP streamable HTTP at ``path``, as a Starlette app (see ``_http.py`` and
        ``docs/mcp.md``). Its lifespan runs this server and the SDK's session manager:
        mounted in another app, enter ``app.router.lifespan_context(app)`` in that app's
        lifespan."""
        from ._http import build_app

        return build_app(
            self,
            token=token,
            allowed_origins=allowed_origins,
            allowed_hosts=allowed_hosts,
            max_body_bytes=max_body_bytes,
            path=path,
        )

    # ------------------------------------------------------------------ tools

    def _on_event(self, event: PoolEvent) -> None:
        if not isinstance(event, ToolsChanged):
            return
        tools: dict[str, dict[str, Any]] = {}
        for name, entry in event.catalog.items():
            runs_in = entry.get("runs_in") or {}
            timeout = runs_in.get("timeout_s") or self.timeout
            tools[name] = describe_tool(entry, timeout)
        self._tools = tools
        # Typed once per change: the SDK shapes it for each protocol version it serves.
        self._listing = types.ListToolsResult(
            tools=[types.Tool.model_validate(t, by_name=False) for t in tools.values()]
        )
        # Every change of the catalog is announced, a reload's too (its tools' code is new,
        # even where their descriptions are the same).
        if self._list_changed is not None:
            self._list_changed.set()

    async def _announce_changes(self) -> None:
        """Send ``notifications/tools/list_changed`` to every client after a change."""
        changed = self._list_changed = anyio.Event()
        while True:
            await changed.wait()
            # Armed again before sending: a change made while we send is announced too.
            changed = self._list_changed = anyio.Event()
            async with anyio.create_task_group() as tg:
                for session in list(self._connections.values()):
                    tg.start_soon(self._tell_list_changed, session)

    @staticmethod
    async def _tell_list_changed(session: Any) -> None:
        # Each client on its own, bounded: one that reads nothing holds up no other.
        with anyio.move_on_after(5):
            try:
                await session.send_tool_list_changed()
            except Exception:  # a client gone meanwhile: its connection ends anyway
                _log.debug("could not send tools/list_changed", exc_info=True)

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return self._listing

    def _input_schema(self, tool: str) -> Mapping[str, Any] | None:
        """The tool's ``inputSchema`` as ``tools/list`` shows it (None: not listed)."""
        entry = self._tools.get(tool)
        schema = entry.get("inputSchema") if entry is not None else None
        return schema if isinstance(schema, Mapping) else None

    def _timeout_for(self, tool: str) -> float | None:
        """The deadline for a call: the provider's own, else the server's (None: the pool
        applies the provider's)."""
        entry = self.pool.catalog.get(tool)
        runs_in = entry.get("runs_in") if entry is not None else None
        if runs_in and runs_in.get("timeout_s") is not None:
            return None
        return self.timeout

    def _submit(self, name: str, arguments: Mapping[str, Any] | None) -> Call:
        if self._draining:
            self._refused += 1
            raise MCPError(
                code=DRAINING,
                message="the server is draining: it accepts no new tool calls",
            )
        if self._tg is None:
            raise MCPError(code=types.INTERNAL_ERROR, message="the MCP server is not running")
        try:
            call = self.pool.submit(name, dict(arguments or {}), timeout=self._timeout_for(name))
        except UnknownToolError:
            raise MCPError(code=types.INVALID_PARAMS, message=f"Unknown tool: {name}") from None
        except TypeError as exc:
            raise MCPError(code=types.INVALID_PARAMS, message=f"Invalid arguments: {exc}") from None
        except PoolClosedError:
            raise MCPError(
                code=DRAINING, message="the server is draining: its pool is closed"
            ) from None
        self._accepted += 1
        return call

    def _track(self, call: Call, tool: str, task: Task | None = None) -> _Tracked:
        tracked = _Tracked(call, tool, task)
        self._tracked[call] = tracked
        assert self._tg is not None
        self._tg.start_soon(self._follow, tracked)
        return tracked

    async def _follow(self, tracked: _Tracked) -> None:
        """Until the call settles, whatever happened to its request: then log and count."""
        call = tracked.call
        try:
            with anyio.CancelScope(shield=True):
                result = await call.wait()
        except PoolClosedError as exc:
            _log.error("mcp call %s (%s) left unsettled: %s", call.id, tracked.tool, exc)
            self._outcomes["unsettled"] = self._outcomes.get("unsettled", 0) + 1
            if tracked.task is not None:
                tracked.task.unsettled(str(exc))
        else:
            outcome = result.outcome.value
            self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
            stuck = result.cause["kind"] if result.cause is not None else None
            if tracked.cause is not None and stuck == tracked.cause.kind:
                # Ours only if ours came first: a call its deadline had stopped before we
                # cancelled it is the pool's (cause timeout), not ours.
                self._cancelled[stuck] = self._cancelled.get(stuck, 0) + 1
            if tracked.task is not None:
                tracked.task.settle(result, self._task_payload(tracked.task, result))
                tracked.delivered = True  # it is there for tasks/result
            else:
                with anyio.CancelScope(shield=True):
                    await tracked.answered.wait()  # the handler delivers it, or not
            if not tracked.delivered:
                self._undelivered += 1
            _log.log(
                logging.INFO if tracked.delivered else logging.WARNING,
                "mcp call %s (%s) settled %s%s (body started: %s, rung: %s)%s",
                call.id,
                tracked.tool,
                outcome,
                f", cause {result.cause['kind']}" if result.cause is not None else "",
                result.body_started,
                result.rung.value,
                "" if tracked.delivered else "; no client received it",
                extra={
                    "call_id": call.id,
                    "tool": tracked.tool,
                    "outcome": outcome,
                    "delivered": tracked.delivered,
                },
            )
        finally:
            del self._tracked[call]
            self._maybe_idle()

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        call = self._submit(params.name, params.arguments)
        tracked = self._track(call, params.name)
        self._handlers += 1
        request_id = ctx.request_id
        if request_id is not None and ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            self._by_request.setdefault(request_id, []).append(tracked)
        else:
            request_id = None
        try:
            result = await self._settled(ctx, tracked)
            self._will_answer(ctx)
            gone = _disconnected(ctx)
            tracked.delivered = not (gone is not None and gone.is_set()) and not _peer_cancelled(
                ctx
            )
        except anyio.get_cancelled_exc_class():
            # The SDK cancelled the handler: the client cancelled the request, or went away.
            # The call is not abandoned (C4.5, C8.2): cancelled with that cause, and
            # followed until it settles by `_follow`.
            self._cancel(tracked, _USER if _peer_cancelled(ctx) else _PARENT)
            raise
        finally:
            if request_id is not None:
                same = self._by_request[request_id]
                same.remove(tracked)
                if not same:
                    del self._by_request[request_id]
            tracked.answered.set()
            self._handlers -= 1
            self._maybe_idle()
        return types.CallToolResult.model_validate(call_result(result), by_name=False)

    def _will_answer(self, ctx: ServerRequestContext[Any, Any]) -> None:
        """The handler of this request returns its answer now: over a stream transport, a
        drain waits until the SDK has written it (``_answers_written``)."""
        if (
            self._unwritten is not None
            and ctx.request_id is not None
            and not _peer_cancelled(ctx)  # (the SDK answers no cancelled request)
        ):
            self._unwritten.add(ctx.request_id)  # the SDK writes it once we return

    async def _answering(
        self, ctx: ServerRequestContext[Any, Any], work: Awaitable[dict[str, Any]]
    ) -> dict[str, Any]:
        """A request that waits on a call (``tasks/result``, ``tasks/cancel``): counted as a
        handler, so a drain answers it before serving stops, as it does a ``tools/call``."""
        self._handlers += 1
        try:
            answer = await work
        except MCPError:
            self._will_answer(ctx)
            raise
        else:
            self._will_answer(ctx)
            return answer
        finally:
            self._handlers -= 1
            self._maybe_idle()

    async def _settled(self, ctx: ServerRequestContext[Any, Any], tracked: _Tracked) -> Result:
        call = tracked.call
        meta = ctx.params.get("_meta") if isinstance(ctx.params, Mapping) else None
        token = meta.get("progressToken") if isinstance(meta, Mapping) else None
        gone = _disconnected(ctx)
        async with anyio.create_task_group() as tg:
            if token is not None:
                tg.start_soon(self._forward_progress, ctx, call)
            if gone is not None:
                tg.start_soon(self._on_disconnect, gone, tracked)
            try:
                result = await call.wait()
            except PoolClosedError as exc:
                raise MCPError(code=types.INTERNAL_ERROR, message=str(exc)) from None
            finally:
                tg.cancel_scope.cancel()  # no progress after the response
        return result

    async def _on_disconnect(self, gone: anyio.Event, tracked: _Tracked) -> None:
        await gone.wait()
        _log.info("mcp call %s: the client closed its response stream", tracked.call.id)
        self._cancel(tracked, _PARENT)

    async def _forward_progress(self, ctx: ServerRequestContext[Any, Any], call: Call) -> None:
        """The body's progress reports as ``notifications/progress``: only increasing,
        at most one per ``progress_interval``; stopped before the response is sent."""
        last = -math.inf
        async for progress in call.progress_updates():
            if progress.done <= last:
                continue
            last = progress.done
            await ctx.session.report_progress(progress.done, progress.total, progress.message)
            await anyio.sleep(self.progress_interval)

    # ------------------------------------------------------------------ tasks

    async def _middleware(
        self,
        ctx: ServerRequestContext[Any, Any],
        call_next: Callable[[ServerRequestContext[Any, Any]], Awaitable[Any]],
    ) -> Any:
        connection = _connection_of(ctx)
        if connection is not None and id(connection) not in self._connections:
            self._connections[id(connection)] = ctx.session
            connection.exit_stack.callback(self._connection_ended, connection)
        if (
            ctx.method == "tools/call"
            and ctx.request_id is not None
            and isinstance(ctx.params, Mapping)
            and ctx.params.get("task") is not None
            and ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS
        ):
            return await self._create_task(ctx, connection)
        return await call_next(ctx)

    def _connection_ended(self, connection: Any) -> None:
        self._connections.pop(id(connection), None)
        for task in self._tasks.of(connection):
            tracked = self._tracked.get(task.call)
            if tracked is not None:
                self._cancel(tracked, _PARENT)

    async def _create_task(self, ctx: ServerRequestContext[Any, Any], owner: Any) -> dict[str, Any]:
        if owner is None:  # (an SDK that no longer shows it: see `_connection_of`)
            raise MCPError(
                code=types.INTERNAL_ERROR,
                message="task-augmented calls are unavailable: this request's connection "
                "is unknown, so its task could not be kept from other clients",
            )
        params = types.CallToolRequestParams.model_validate(ctx.params, by_name=False)
        call = self._submit(params.name, params.arguments)
        ttl = params.task.ttl if params.task is not None else None
        task = self._tasks.create(owner, call, ttl)
        self._track(call, params.name, task).answered.set()
        _log.info("mcp call %s (%s) runs as task %s", call.id, params.name, task.id)
        return {"task": task.wire()}

    def _task(self, ctx: ServerRequestContext[Any, Any], task_id: str) -> Task:
        task = self._tasks.get(_connection_of(ctx), task_id)
        if task is None:
            raise MCPError(code=types.INVALID_PARAMS, message=f"Unknown task: {task_id}")
        return task

    def _task_payload(self, task: Task, result: Result) -> dict[str, Any]:
        payload = call_result(result)
        payload["_meta"] = {"io.modelcontextprotocol/related-task": {"taskId": task.id}}
        return payload

    async def _task_get(
        self, ctx: ServerRequestContext[Any, Any], params: types.GetTaskRequestParams
    ) -> dict[str, Any]:
        return self._task(ctx, params.task_id).wire()

    async def _task_result(
        self, ctx: ServerRequestContext[Any, Any], params: types.GetTaskPayloadRequestParams
    ) -> dict[str, Any]:
        task = self._task(ctx, params.task_id)
        return await self._answering(ctx, self._payload_once_done(task))

    @staticmethod
    async def _payload_once_done(task: Task) -> dict[str, Any]:
        await task.done.wait()
        if task.payload is None:
            raise MCPError(code=types.INTERNAL_ERROR, message=task.message or "no result")
        return task.payload

    async def _task_cancel(
        self, ctx: ServerRequestContext[Any, Any], params: types.CancelTaskRequestParams
    ) -> dict[str, Any]:
        task = self._task(ctx, params.task_id)
        if task.terminal:
            raise MCPError(
                code=types.INVALID_PARAMS,
                message=f"Cannot cancel task {task.id}: it is already {task.status}",
            )
        task.cancel_requested = True
        tracked = self._tracked.get(task.call)
        if tracked is not None:
            self._cancel(tracked, _USER)
        # Answered only once the call settled: for a killed call, once its tree is gone.
        return await self._answering(ctx, self._wire_once_done(task))

    @staticmethod
    async def _wire_once_done(task: Task) -> dict[str, Any]:
        with anyio.CancelScope(shield=True):
            await task.done.wait()
        return task.wire()

    async def _task_list(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams
    ) -> dict[str, Any]:
        return {"tasks": [t.wire() for t in self._tasks.of(_connection_of(ctx))]}


async def serve(
    pool: Pool,
    *,
    timeout: float | None = None,
    handle_signals: bool = True,
    watch_parent: bool = False,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> None:
    """Serve ``pool``'s tools over MCP on this process's stdin/stdout until the client goes
    away or the process gets SIGTERM/SIGINT; return once every call settled (the pool stays
    open: close it after). See :meth:`McpServer.run_stdio`."""
    server = McpServer(pool, timeout=timeout, max_message_bytes=max_message_bytes)
    try:
        await server.run_stdio(handle_signals=handle_signals, watch_parent=watch_parent)
    finally:
        server.close()
