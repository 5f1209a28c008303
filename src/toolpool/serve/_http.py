"""The service's HTTP face: ``/healthz``, ``/readyz`` and ``/metrics`` beside the MCP app.

A plain ASGI router, no framework of its own: the probes are answered from the service's
state without touching the pool's calls; ``/metrics`` renders the service's Prometheus
registry; ``/mcp`` (and below) goes to the MCP face's ASGI app, which does its own
authentication. Everything else is 404. The probes and ``/metrics`` need no token (a kubelet
and a Prometheus scrape do not send one; they tell counts and states, never arguments or
results): keep them from strangers with a NetworkPolicy (``deploy/kubernetes/``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final, Protocol

__all__ = ("Probes", "ServiceApp")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Where the MCP face is mounted.
MCP_PATH: Final = "/mcp"


class Probes(Protocol):
    """What the probes and ``/metrics`` read from the service."""

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether the process and the pool's reaper are alive, and the facts."""
        ...

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Whether a worker serves and the service is not draining, and the facts."""
        ...

    def metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""
        ...


class ServiceApp:
    """The ASGI app the service's listener runs."""

    def __init__(self, probes: Probes, mcp: AsgiApp | None) -> None:
        self._probes = probes
        self._mcp = mcp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            if self._mcp is not None:
                await self._mcp(scope, receive, send)
            else:
                await _lifespan(receive, send)
            return
        if kind != "http":
            return  # (websockets: not served; uvicorn closes the connection)
        path: str = scope["path"]
        if self._mcp is not None and (path == MCP_PATH or path.startswith(MCP_PATH + "/")):
            await self._mcp(scope, receive, send)
            return
        route = {
            "/healthz": self._health,
            "/readyz": self._ready,
            "/metrics": self._metrics,
        }.get(path)
        if route is None:
            await _answer(send, 404, b"not found\n", "text/plain; charset=utf-8")
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _answer(send, 405, b"GET only\n", "text/plain; charset=utf-8", allow="GET, HEAD")
            return
        await route(send, head=scope["method"] == "HEAD")

    async def _health(self, send: Send, *, head: bool) -> None:
        ok, facts = self._probes.health()
        await _json(send, 200 if ok else 503, facts, head=head)

    async def _ready(self, send: Send, *, head: bool) -> None:
        ok, facts = self._probes.readiness()
        await _json(send, 200 if ok else 503, facts, head=head)

    async def _metrics(self, send: Send, *, head: bool) -> None:
        body, content_type = self._probes.metrics()
        await _answer(send, 200, body, content_type, head=head)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _json(send: Send, status: int, facts: dict[str, Any], *, head: bool) -> None:
    body = json.dumps(facts, separators=(",", ":")).encode() + b"\n"
    await _answer(send, status, body, "application/json", head=head)


async def _answer(
    send: Send,
    status: int,
    body: bytes,
    content_type: str,
    *,
    allow: str | None = None,
    head: bool = False,
) -> None:
    """The response; for HEAD, its headers only (the length of the body a GET gets)."""
    headers = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
    ]
    if allow is not None:
        headers.append((b"allow", allow.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})
