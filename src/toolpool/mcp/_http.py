"""MCP streamable HTTP for an :class:`~toolpool.mcp.McpServer`: the ASGI app and a server.

What guards the endpoint, outermost first:

- a **bearer token** when one is configured: ``Authorization: Bearer <token>``, compared in
  constant time; anything else is ``401`` with ``WWW-Authenticate: Bearer``;
- a **body limit** (POST): an oversized body is answered ``413`` with a JSON-RPC error,
  read no further;
- the SDK's **DNS-rebinding protection**: the ``Host`` and ``Origin`` headers must be among
  the allowed ones (loopback by default; a request without ``Origin``, as non-browser clients
  send, passes the origin check);
- the SDK's JSON-RPC validation: a malformed message is answered with a JSON-RPC error on
  its own request; other sessions are untouched.

A client that closes a request's response stream before the answer is cancelling that call:
on the 2025 wire the SDK does not tell the handler, so the guard notices the disconnect (the
SSE response listens for it) and sets an event the handler waits on beside the call
(``DISCONNECTED_KEY`` in the request's scope): the call is cancelled with cause ``parent``.
On the 2026-07-28 wire the SDK cancels the handler itself, with the same result.

On the 2026-07-28 wire the SDK acknowledges a posted ``notifications/cancelled`` and drops it
(that wire cancels by closing the stream, which tells the client nothing). The guard honours
one naming a ``tools/call`` in flight on this server (exactly one with that request id): the
call is cancelled with cause ``user`` and its request, still open, is answered once the call
settled; the ``202`` then carries ``toolpool-cancel: accepted``, which tells the client to
wait for that answer (``toolpool.connect`` does; docs/mcp.md).
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import stat
from collections.abc import AsyncIterator, Generator
from typing import TYPE_CHECKING, Any, Final

import anyio
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._server import DEFAULT_MAX_MESSAGE_BYTES, DISCONNECTED_KEY, McpServer

if TYPE_CHECKING:
    from types import FrameType

    from ..supervisor import Pool

__all__ = ("build_app", "is_loopback", "read_token", "serve_http")

_log = logging.getLogger("toolpool.mcp")

LOOPBACK_HOSTS: Final = ("127.0.0.1:*", "localhost:*", "[::1]:*", "127.0.0.1", "localhost", "[::1]")
LOOPBACK_ORIGINS: Final = ("http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*")
#: The response header by which the face says it honoured a 2026-07-28
#: ``notifications/cancelled``: the call's request will be answered once it settled.
CANCEL_HEADER: Final = b"toolpool-cancel"
#: A token shorter than this is refused: it could be guessed.
MIN_TOKEN_LENGTH: Final = 16


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(path: str) -> str:
    """The bearer token in the file at ``path`` (its first line). Refused if it is shorter
    than 16 characters; a warning if others than its owner may read the file."""
    with open(path, encoding="utf-8") as f:
        token = f.readline().strip()
        mode = os.fstat(f.fileno()).st_mode
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(f"the token in {path} must be at least {MIN_TOKEN_LENGTH} characters")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        _log.warning("the token file %s can be read by others than its owner", path)
    return token


def _json_error(
    status: int, message: str, headers: list[tuple[bytes, bytes]], code: int = -32001
) -> list[Message]:
    body = json.dumps(
        {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}
    ).encode()
    return [
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        },
        {"type": "http.response.body", "body": body},
    ]


class _Guard:
    """The bearer token check, and the disconnect watch of a request (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        max_body_bytes: int,
        server: McpServer,
        security: TransportSecuritySettings,
    ) -> None:
        self.app = app
        self.server = server
        self.security = TransportSecurityMiddleware(security)
        self.token = token.encode() if token is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.token is not None and not self._authorized(scope):
            for message in _json_error(
                401,
                "Unauthorized: a valid bearer token is required",
                [(b"www-authenticate", b'Bearer realm="toolpool", error="invalid_token"')],
            ):
                await send(message)
            return
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        # The body is read here first, so an oversized one gets a JSON-RPC error (the SDK's
        # own limit, kept behind this one, answers in plain text).
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                for reply in _json_error(
                    413,
                    f"Invalid Request: message over {self.max_body_bytes} bytes",
                    [],
                    code=-32600,
                ):
                    await send(reply)
                return
        if await self._honoured_cancel(scope, body):
            await send(
                {
                    "type": "http.response.start",
                    "status": 202,
                    "headers": [(b"content-length", b"0"), (CANCEL_HEADER, b"accepted")],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        replay: list[Message] = [{"type": "http.request", "body": bytes(body), "more_body": False}]
        gone = anyio.Event()
        answered = False

        async def watch_receive() -> Message:
            message = replay.pop() if replay else await receive()
            if message["type"] == "http.disconnect" and not answered:
                gone.set()
            return message

        async def watch_send(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        await self.app({**scope, DISCONNECTED_KEY: gone}, watch_receive, watch_send)

    async def _honoured_cancel(self, scope: Scope, body: bytearray) -> bool:
        """A 2026-07-28 ``notifications/cancelled`` for a call in flight here: cancelled
        with cause ``user`` (its request answered once the call settled). Anything else,
        a bad ``Host`` or ``Origin`` included, goes on to the SDK (which refuses it, or
        acknowledges such a notification and drops it)."""
        headers = dict(scope["headers"])
        if headers.get(b"mcp-method") != b"notifications/cancelled" or (
            headers.get(b"mcp-protocol-version", b"").decode(errors="replace")
            not in MODERN_PROTOCOL_VERSIONS
        ):
            return False
        if await self.security.validate_request(Request(scope), is_post=True) is not None:
            return False
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):
            return False
        params = message.get("params") if isinstance(message, dict) else None
        if (
            message.get("method") != "notifications/cancelled"
            or "id" in message
            or not isinstance(params, dict)
            or not isinstance(params.get("requestId"), str | int)
        ):
            return False
        return self.server.cancel_request(params["requestId"])

    def _authorized(self, scope: Scope) -> bool:
        assert self.token is not None
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, credential = values[0].partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self.token)


def build_app(
    server: McpServer,
    *,
    token: str | None,
    allowed_origins: list[str] | None,
    allowed_hosts: list[str] | None,
    max_body_bytes: int,
    path: str,
) -> Starlette:
    """See :meth:`McpServer.asgi_app`."""
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
        raise ValueError("max_body_bytes must be an int of at least 1024")
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(f"a token must be at least {MIN_TOKEN_LENGTH} characters")
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=list(allowed_hosts if allowed_hosts is not None else LOOPBACK_HOSTS),
        allowed_origins=list(allowed_origins if allowed_origins is not None else LOOPBACK_ORIGINS),
    )
    manager = StreamableHTTPSessionManager(
        app=server.lowlevel,
        security_settings=security,
        max_request_body_size=max_body_bytes,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with server._running(), manager.run():
            try:
                yield
            finally:
                # Shutdown is `disposed` (C8.1): the calls are cancelled and answered
                # before the session manager goes (which would make them `parent`).
                with anyio.CancelScope(shield=True):
                    server.begin_drain()
                    server.cancel_all({"kind": "disposed"})
                    await server.wait_idle()

    return Starlette(
        routes=[
            Route(
                path,
                endpoint=_Guard(
                    StreamableHTTPASGIApp(manager), token, max_body_bytes, server, security
                ),
            )
        ],
        lifespan=lifespan,
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


async def serve_http(
    pool: Pool,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    token_file: str | None = None,
    timeout: float | None = None,
    allowed_origins: list[str] | None = None,
    allowed_hosts: list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    on_ready: Any = None,
) -> None:
    """Serve ``pool``'s tools over MCP streamable HTTP at ``http://host:port/mcp`` until
    SIGTERM or SIGINT: then new calls are refused, every call is cancelled with cause
    ``disposed`` and answered once settled, and it returns (a second signal kills the calls
    still running). The pool stays open: close it after.

    A ``host`` that is not a loopback address is refused unless ``token_file`` names a file
    holding the bearer token clients must send. ``on_ready(url)`` is called once the socket
    listens (``port=0`` picks a free one).
    """
    token = read_token(token_file) if token_file is not None else None
    if token is None and not is_loopback(host):
        raise ValueError(
            f"refusing to serve MCP on {host}, which is not a loopback address, without a "
            "bearer token: give a token file (--token-file)"
        )
    if allowed_hosts is None and not is_loopback(host):
        allowed_hosts = [*LOOPBACK_HOSTS, host, f"{host}:*"]
    import uvicorn

    server = McpServer(pool, timeout=timeout, max_message_bytes=max_body_bytes)
    try:
        app = server.asgi_app(
            token=token,
            allowed_origins=allowed_origins,
            allowed_hosts=allowed_hosts,
            max_body_bytes=max_body_bytes,
        )
        sock = _bind(host, port)
        with sock:
            bound = sock.getsockname()[1]
            shown = f"[{host.strip('[]')}]" if ":" in host else host
            url = f"http://{shown}:{bound}/mcp"
            # Drained first (below): then open streams (a client's GET stream) get 5 s.
            config = uvicorn.Config(
                app,
                lifespan="on",
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=5,
            )
            uv = _Uvicorn(config, server)
            if on_ready is not None:
                on_ready(url)
            await uv.serve(sockets=[sock])
    finally:
        server.close()


class _Uvicorn:
    """uvicorn, with the drain the face promises on SIGTERM/SIGINT (uvicorn alone would
    wait for the open response streams, which end only once their calls settle)."""

    def __init__(self, config: Any, mcp: McpServer) -> None:
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                handlers = {
                    sig: signal.signal(sig, outer._signalled)
                    for sig in (signal.SIGTERM, signal.SIGINT)
                }
                try:
                    yield
                finally:
                    for sig, handler in handlers.items():
                        signal.signal(sig, handler)

        self.server = Server(config)
        self.mcp = mcp
        self.count = 0
        self.loop: Any = None

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.loop.call_soon_threadsafe(self._react, signum)

    def _react(self, signum: int) -> None:
        if self.count == 1:
            _log.info("%s: draining", signal.Signals(signum).name)
            self.mcp.begin_drain()
            self.mcp.cancel_all({"kind": "disposed"})
            self.drain.set()
        else:
            self.mcp.cancel_all({"kind": "disposed"}, force=True)

    async def serve(self, sockets: list[socket.socket]) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        self.drain = anyio.Event()

        async def stop_when_drained() -> None:
            await self.drain.wait()
            await self.mcp.wait_idle()
            self.server.should_exit = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_when_drained)
            await self.server.serve(sockets=sockets)
            tg.cancel_scope.cancel()
