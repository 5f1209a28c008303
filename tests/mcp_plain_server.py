"""A plain MCP server (the SDK's own, no toolpool) answering as toolpool's MCP face does
(``structuredContent`` with ``outcome`` and ``body_started``): the remote client's tests talk
to it over real HTTP. ``python mcp_plain_server.py PORT``; it prints its port once
listening."""

from __future__ import annotations

import os
import socket
import sys

import anyio
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, TextContent

app = MCPServer("plain")


def _result(outcome: str, text: str, **facts: object) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=text)],
        structuredContent={"outcome": outcome, **facts},
        isError=outcome != "ok",
    )


@app.tool()
async def echo(value: str = "") -> CallToolResult:
    """Return the value."""
    return _result("ok", value, body_started=True, value=value)


@app.tool()
async def fail() -> CallToolResult:
    """Answer a tool's error."""
    return _result("error", "Error: boom", body_started=True, error_name="RuntimeError")


@app.tool()
async def draining() -> CallToolResult:
    """Answer as a draining service does."""
    return _result("aborted_before_dispatch", "Error: the service is draining", body_started=False)


@app.tool()
async def slow(ctx: Context, seconds: float = 60.0, progress: bool = False) -> CallToolResult:
    """Say the body started (progress) if asked, then sleep; note a cancel in the ledger."""
    ledger = os.environ.get("TOOLPOOL_TEST_LEDGER")
    if ledger:
        with open(ledger, "a") as f:
            f.write(f"start {os.getpid()}\n")
    if progress:
        await ctx.report_progress(1, 2, "started")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        if ledger:
            with open(ledger, "a") as f:
                f.write(f"cancelled {os.getpid()}\n")
        raise
    return _result("ok", "slept", body_started=True, value=seconds)


if __name__ == "__main__":
    sock = socket.socket()
    sock.bind(("127.0.0.1", int(sys.argv[1])))
    sock.listen(128)  # (connections wait in the backlog until uvicorn accepts them)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app.streamable_http_app(), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
