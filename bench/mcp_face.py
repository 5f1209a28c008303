"""The MCP face's price: a no-op ``tools/call`` through ``toolpool mcp`` beside a plain SDK
server running the same no-op in-process, over stdio and streamable HTTP; and cancel ->
process tree gone.

Every server is a subprocess driven by the ``mcp`` SDK's own client, in one run:

- stdio: ``toolpool mcp tests.mcp_tools:registry --workers 8`` and a plain low-level SDK
  server (this file, ``--plain-stdio``); 1 client: calls one after another; 8 clients: 8
  calls in flight at once on the one stdio session (stdio has one client);
- HTTP: the same two with streamable HTTP on 127.0.0.1; 8 clients are 8 sessions;
- cancel: a task-augmented call, ``tasks/cancel`` round trip (answered once the call
  settled: for ``stubborn``, once its tree, a setsid grandchild included, is gone), minus the
  graces it had to wait (``--cancel-grace 0.1 --term-grace 0.1``).

Prints a table (p50 in ms, calls/s) and the ratios toolpool / plain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
TOOLPOOL = [sys.executable, "-m", "toolpool", "mcp", "tests.mcp_tools:registry", "--workers", "8"]
GRACE = 0.1


# ------------------------------------------------------------------ the plain SDK server


def _plain_server() -> Any:
    import mcp_types as types
    from mcp.server.lowlevel.server import Server

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[types.Tool(name="noop", input_schema={"type": "object"})]
        )

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(type="text", text="null")])

    return Server("plain", on_list_tools=list_tools, on_call_tool=call_tool)


def run_plain_stdio() -> None:
    from mcp.server.stdio import stdio_server

    async def main() -> None:
        server = _plain_server()
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)


def run_plain_http() -> None:
    import socket

    import uvicorn

    app = _plain_server().streamable_http_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    print(
        f"serving MCP at http://127.0.0.1:{sock.getsockname()[1]}/mcp", file=sys.stderr, flush=True
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    anyio.run(uvicorn.Server(config).serve, [sock])


# ------------------------------------------------------------------ clients


@asynccontextmanager
async def stdio_session(command: list[str]) -> AsyncIterator[Any]:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=command[0], args=command[1:], cwd=str(ROOT), env=dict(os.environ)
    )
    with open(os.devnull, "w") as devnull:
        async with (
            stdio_client(params, errlog=devnull) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


@asynccontextmanager
async def http_server(command: list[str]) -> AsyncIterator[str]:
    proc = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        while "serving MCP at" not in (line := proc.stderr.readline()):
            if not line:
                raise RuntimeError("the HTTP server did not start")
        # Keep reading what it logs: an undrained pipe would block the server.
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.stderr.close()  # type: ignore[union-attr]


@asynccontextmanager
async def http_session(url: str) -> AsyncIterator[Any]:
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with (
        streamable_http_client(url) as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        await session.initialize()
        yield session


async def timed_calls(session: Any, n: int, out: list[float]) -> None:
    for _ in range(n):
        start = time.perf_counter()
        result = await session.call_tool("noop", {})
        out.append(time.perf_counter() - start)
        assert not result.is_error, result


async def measure(sessions: list[Any], calls: int, concurrency: int) -> tuple[float, float]:
    """(p50 ms, calls/s) of ``calls`` no-op calls, ``concurrency`` in flight at once,
    spread over ``sessions`` round robin."""
    for session in sessions:
        await timed_calls(session, 10, [])  # warm up
    latencies: list[float] = []
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(concurrency):
            tg.start_soon(timed_calls, sessions[i % len(sessions)], calls // concurrency, latencies)
    elapsed = time.perf_counter() - start
    return statistics.median(latencies) * 1e3, len(latencies) / elapsed


Row = tuple[str, str, int, float, float]
ROUNDS = 3


async def interleaved(
    wire: str, sessions: dict[str, dict[int, list[Any]]], calls: int
) -> list[Row]:
    """Each server and concurrency measured in turn, ``ROUNDS`` times (a loaded machine
    drifts: interleaving spreads the drift over both); the median of the rounds."""
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(ROUNDS):
        for concurrency in (1, 8):
            for name, by_conc in sessions.items():
                got.setdefault((name, concurrency), []).append(
                    await measure(by_conc[concurrency], calls, concurrency)
                )
    return [
        (
            wire,
            name,
            concurrency,
            statistics.median(p for p, _ in runs),
            statistics.median(r for _, r in runs),
        )
        for (name, concurrency), runs in got.items()
    ]


async def stdio_rows(calls: int) -> list[Row]:
    plain = [sys.executable, __file__, "--plain-stdio"]
    async with stdio_session(TOOLPOOL) as ours, stdio_session(plain) as theirs:
        sessions = {
            "toolpool": {1: [ours], 8: [ours]},
            "plain SDK": {1: [theirs], 8: [theirs]},
        }
        return await interleaved("stdio", sessions, calls)


async def http_rows(calls: int) -> list[Row]:
    plain = [sys.executable, __file__, "--plain-http"]
    async with (
        http_server([*TOOLPOOL, "--http", "127.0.0.1:0"]) as ours,
        http_server(plain) as theirs,
        _sessions(ours, 8) as our_sessions,
        _sessions(theirs, 8) as their_sessions,
    ):
        sessions = {
            "toolpool": {1: our_sessions[:1], 8: our_sessions},
            "plain SDK": {1: their_sessions[:1], 8: their_sessions},
        }
        return await interleaved("HTTP", sessions, calls)


@asynccontextmanager
async def _sessions(url: str, n: int) -> AsyncIterator[list[Any]]:
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(http_session(url)) for _ in range(n)]


async def cancel_rows(trials: int) -> list[tuple[str, float, float]]:
    """(tool, median ms, p90 ms) of tasks/cancel round trips, graces taken off."""
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher

    command = [*TOOLPOOL, "--cancel-grace", str(GRACE), "--term-grace", str(GRACE)]
    params = StdioServerParameters(
        command=command[0], args=command[1:], cwd=str(ROOT), env=dict(os.environ)
    )
    out = []
    with open(os.devnull, "w") as devnull:
        async with stdio_client(params, errlog=devnull) as (read, write):
            dispatcher: JSONRPCDispatcher[Any] = JSONRPCDispatcher(read, write)
            async with ClientSession(dispatcher=dispatcher) as session:
                await session.initialize()
                request = dispatcher.send_raw_request
                for tool, args, graces in (
                    ("nap", {"seconds": 60}, 0.0),
                    ("stubborn", {"marker": "x"}, 2 * GRACE),
                ):
                    times = []
                    for _ in range(trials):
                        if tool == "stubborn":
                            args = {"marker": f"tp-bench-{uuid.uuid4().hex}"}
                        task = (
                            await request(
                                "tools/call", {"name": tool, "arguments": args, "task": {}}, None
                            )
                        )["task"]
                        while True:  # until the body runs (and, for stubborn, its daemon)
                            state = await request("tasks/get", {"taskId": task["taskId"]}, None)
                            if state["statusMessage"].startswith("running"):
                                break
                            await anyio.sleep(0.01)
                        await anyio.sleep(0.05)
                        start = time.perf_counter()
                        final = await request("tasks/cancel", {"taskId": task["taskId"]}, None)
                        times.append((time.perf_counter() - start - graces) * 1e3)
                        assert final["status"] == "cancelled", final
                    times.sort()
                    out.append((tool, statistics.median(times), times[int(len(times) * 0.9) - 1]))
    return out


async def main(calls: int, trials: int) -> dict[str, Any]:
    rows = await stdio_rows(calls) + await http_rows(calls)
    cancels = await cancel_rows(trials)
    return {"rows": rows, "cancel": cancels}


def report(data: dict[str, Any]) -> None:
    print(f"{'wire':6} {'server':10} {'clients':>7} {'p50 ms':>8} {'calls/s':>8}")
    rows = sorted(data["rows"], key=lambda r: (r[0] != "stdio", r[2], r[1] != "toolpool"))
    for wire, name, conc, p50, rate in rows:
        print(f"{wire:6} {name:10} {conc:>7} {p50:>8.2f} {rate:>8.0f}")
    print("\nratios toolpool / plain SDK (p50: lower is better; calls/s: higher is better)")
    by = {(w, n, c): (p, r) for w, n, c, p, r in rows}
    for wire in ("stdio", "HTTP"):
        for conc in (1, 8):
            tp, plain = by[(wire, "toolpool", conc)], by[(wire, "plain SDK", conc)]
            print(
                f"{wire:6} {conc} client(s): p50 x{tp[0] / plain[0]:.2f}, "
                f"calls/s x{tp[1] / plain[1]:.2f}"
            )
    print(f"\ntasks/cancel -> answered (tree gone), graces of {GRACE}s each taken off:")
    for tool, median, p90 in data["cancel"]:
        print(f"  {tool:9} median {median:.1f} ms, p90 {p90:.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="no-op calls per row")
    parser.add_argument("--trials", type=int, default=10, help="cancels per tool")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--plain-stdio", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain-http", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.plain_stdio:
        run_plain_stdio()
    elif ns.plain_http:
        run_plain_http()
    else:
        result = anyio.run(main, ns.calls, ns.trials)
        report(result)
        if ns.json:
            Path(ns.json).write_text(json.dumps(result, indent=2))
