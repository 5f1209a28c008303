"""The MCP face (issue 23): ``toolpool mcp`` as a subprocess driven by the ``mcp`` SDK's own
stdio client, and the streamable HTTP face on 127.0.0.1 driven by its HTTP client; real
workers, real signals, real process trees. Nothing is left behind: every tree is checked by
pid and by a marker in a grandchild's argv."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
import psutil
import pytest
import uvicorn
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher
from tests import mcp_raw_client as raw

import toolpool
from toolpool.mcp import DRAINING, McpServer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120, method="thread")]

ROOT = Path(__file__).resolve().parent.parent
GRACES = ["--cancel-grace", "0.3", "--term-grace", "0.3"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---------------------------------------------------------------- processes


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _marked(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if marker in cmdline:
            found.append(proc.pid)
    return found


def _wait_gone(pids: Iterable[int], marker: str, within: float = 15.0) -> float:
    """Seconds until every pid and every process with ``marker`` is gone (polled: nothing
    signals the end of a process that is not our child)."""
    start = time.monotonic()
    pids = list(pids)
    while any(_alive(p) for p in pids) or _marked(marker):
        if time.monotonic() - start > within:
            left = [p for p in pids if _alive(p)] + _marked(marker)
            raise AssertionError(f"processes left behind: {left}")
        time.sleep(0.02)
    return time.monotonic() - start


async def _wait_marked(marker: str, within: float = 30.0) -> list[int]:
    with anyio.fail_after(within):
        while not (found := _marked(marker)):
            await anyio.sleep(0.02)  # (another process's start: no event to await)
    return found


def _end(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


# ---------------------------------------------------------------- stdio, SDK client


@asynccontextmanager
async def _stdio(
    *extra: str, errlog: Any = None
) -> AsyncIterator[tuple[ClientSession, JSONRPCDispatcher[Any]]]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "toolpool", "mcp", "tests.mcp_tools:registry", *GRACES, *extra],
        cwd=str(ROOT),
        env=dict(os.environ),
    )
    async with stdio_client(params, errlog=errlog or sys.stderr) as (read, write):
        dispatcher: JSONRPCDispatcher[Any] = JSONRPCDispatcher(read, write)
        async with ClientSession(dispatcher=dispatcher) as session:
            await session.initialize()
            yield session, dispatcher


async def _wait_running(dispatcher: JSONRPCDispatcher[Any], task_id: str) -> dict[str, Any]:
    """Poll ``tasks/get`` (the protocol's own way) until the body runs."""
    with anyio.fail_after(30):
        while True:
            task = await dispatcher.send_raw_request("tasks/get", {"taskId": task_id}, None)
            if task["status"] != "working" or task["statusMessage"].startswith("running"):
                return task
            await anyio.sleep(0.05)


async def _call_then(
    session: ClientSession,
    tool: str,
    args: dict[str, Any],
    then: Callable[[], object] | None = None,
) -> types.CallToolResult | None:
    """Call ``tool``; at its first progress report (its body runs), ``then()``, or by
    default cancel the call on the client's side. The result, or None if cancelled."""
    started = anyio.Event()
    result: list[Any] = []

    async def note(done: float, total: float | None, message: str | None) -> None:
        started.set()

    async with anyio.create_task_group() as tg:

        async def run() -> None:
            result.append(await session.call_tool(tool, args, progress_callback=note))

        tg.start_soon(run)
        with anyio.fail_after(30):
            await started.wait()
        if then is None:
            tg.cancel_scope.cancel()
        else:
            then()
    return result[0] if result else None


async def test_stdio_tools_calls_and_errors() -> None:
    from tests.mcp_tools import registry as tools  # what the workers serve

    async with _stdio("--workers", "1", "--timeout", "30") as (session, _):
        caps = session.server_capabilities
        assert caps is not None
        assert caps.tools is not None
        assert caps.tools.list_changed
        assert caps.tasks is not None
        assert caps.tasks.cancel is not None
        listed = {t.name: t for t in (await session.list_tools()).tools}
        assert set(listed) == set(tools.catalog)
        echo = listed["echo"]
        assert echo.input_schema == dict(tools.catalog["echo"]["input_schema"])
        assert echo.output_schema is not None
        assert "outcome" in echo.output_schema["properties"]
        assert echo.description is not None
        assert echo.description.startswith("Return value.")
        # The default profile: no network namespace, so nothing claims a closed world.
        assert "has the host's network access" in echo.description
        assert "stopped after 30 s" in echo.description
        assert echo.annotations is None or echo.annotations.open_world_hint is not False

        ok = await session.call_tool("echo", {"value": 7})
        assert not ok.is_error
        assert ok.structured_content == {"outcome": "ok", "body_started": True, "value": 7}
        assert [c.text for c in ok.content if isinstance(c, types.TextContent)] == ["7"]

        bad = await session.call_tool("fail", {"message": "nope"})
        assert bad.is_error
        assert bad.structured_content is not None
        assert bad.structured_content["outcome"] == "error"
        assert bad.structured_content["body_started"] is True
        assert bad.content[0].text == "Error: ValueError: nope"  # type: ignore[union-attr]

        wrong = await session.call_tool("echo", {"value": "x"})
        assert wrong.is_error
        assert wrong.structured_content["outcome"] == "error"

        with pytest.raises(Exception, match="Unknown tool"):
            await session.call_tool("no_such_tool", {})


async def test_stdio_task_cancel_cooperative_reports_aborted_and_worker_serves_on(
    tmp_path: Path,
) -> None:
    log = tmp_path / "server.log"
    # A cooperative stop on a loaded machine may take longer than GRACES' 0.3 s: the grace
    # here is not what is tested.
    with log.open("w+") as errlog:
        async with _stdio("--workers", "1", "--cancel-grace", "30", errlog=errlog) as (
            session,
            dispatcher,
        ):
            before = (await session.call_tool("pid", {})).structured_content["value"]  # type: ignore[index]
            created = await dispatcher.send_raw_request(
                "tools/call",
                {"name": "nap", "arguments": {"seconds": 60}, "task": {"ttl": 60000}},
                None,
            )
            task_id = created["task"]["taskId"]
            assert created["task"]["status"] == "working"
            await _wait_running(dispatcher, task_id)
            final = await dispatcher.send_raw_request("tasks/cancel", {"taskId": task_id}, None)
            assert final["status"] == "cancelled"
            assert final["statusMessage"].startswith("aborted")
            again = await dispatcher.send_raw_request("tasks/get", {"taskId": task_id}, None)
            assert again["status"] == "cancelled"
            payload = await dispatcher.send_raw_request("tasks/result", {"taskId": task_id}, None)
            assert payload["isError"] is True
            assert payload["structuredContent"]["outcome"] == "aborted"
            assert payload["structuredContent"]["cause"] == "user"
            assert payload["content"][0]["text"] == toolpool.ABORTED_TEXT
            listed = await dispatcher.send_raw_request("tasks/list", {}, None)
            assert [t["taskId"] for t in listed["tasks"]] == [task_id]
            after = (await session.call_tool("pid", {})).structured_content["value"]  # type: ignore[index]
            assert after == before  # the worker serves on
            with pytest.raises(Exception, match="already cancelled"):
                await dispatcher.send_raw_request("tasks/cancel", {"taskId": task_id}, None)
        errlog.seek(0)
        assert "(nap) settled aborted, cause user" in errlog.read()


async def test_stdio_task_cancel_stubborn_reports_killed_once_the_tree_is_gone() -> None:
    marker = f"tp-mcp-{uuid.uuid4().hex}"
    async with _stdio("--workers", "1") as (session, dispatcher):
        worker = (await session.call_tool("pid", {})).structured_content["value"]  # type: ignore[index]
        created = await dispatcher.send_raw_request(
            "tools/call", {"name": "stubborn", "arguments": {"marker": marker}, "task": {}}, None
        )
        task_id = created["task"]["taskId"]
        daemons = await _wait_marked(marker)
        final = await dispatcher.send_raw_request("tasks/cancel", {"taskId": task_id}, None)
        # The confirmation comes only once the whole tree is gone: check at once.
        assert not _alive(worker)
        assert not any(_alive(p) for p in daemons)
        assert not _marked(marker)
        assert final["status"] == "cancelled"
        assert final["statusMessage"].startswith("killed")
        payload = await dispatcher.send_raw_request("tasks/result", {"taskId": task_id}, None)
        assert payload["structuredContent"]["outcome"] == "killed"
        assert payload["structuredContent"]["rung"] == "sigkill"
        assert payload["_meta"]["io.modelcontextprotocol/related-task"]["taskId"] == task_id
        # a new worker serves the next call
        assert (await session.call_tool("echo", {"value": 1})).structured_content["value"] == 1  # type: ignore[index]


async def test_stdio_notifications_cancelled_is_user_and_progress_is_in_order(
    tmp_path: Path,
) -> None:
    log = tmp_path / "server.log"
    with log.open("w+") as errlog:
        async with _stdio("--workers", "1", "--cancel-grace", "30", errlog=errlog) as (session, _):
            seen: list[tuple[float, float | None, str | None]] = []
            returned = False

            async def on_progress(done: float, total: float | None, message: str | None) -> None:
                assert not returned, "progress after the response"
                seen.append((done, total, message))

            result = await session.call_tool(
                "count", {"steps": 6, "pause": 0.12}, progress_callback=on_progress
            )
            returned = True
            assert result.structured_content["value"] == 6  # type: ignore[index]
            dones = [d for d, _, _ in seen]
            assert len(dones) >= 2, seen
            assert dones == sorted(set(dones)), seen  # strictly increasing
            assert all(t == 6 for _, t, _ in seen)
            await session.call_tool("echo", {"value": 0})  # any late progress would be here
            assert len(seen) == len(dones), seen

            # cancelled on the client's side: the SDK sends notifications/cancelled
            assert await _call_then(session, "nap", {"seconds": 60}) is None
            # the server follows the call until it settles: the next call is answered after
            assert (await session.call_tool("echo", {"value": 2})).structured_content["value"] == 2  # type: ignore[index]
        errlog.seek(0)
        text = errlog.read()
        assert "(nap) settled aborted, cause user" in text
        assert "no client received it" in text


_SERVE_FROM_PYTHON = """
import anyio, toolpool
from toolpool.mcp import serve

async def main():
    async with toolpool.Pool() as pool:
        await pool.add_provider("main", "tests.mcp_tools:registry", workers=1)
        await serve(pool, timeout=20)

anyio.run(main)
"""


async def test_serve_from_python_on_a_pool_of_providers() -> None:
    params = StdioServerParameters(
        command=sys.executable, args=["-c", _SERVE_FROM_PYTHON], cwd=str(ROOT), env=dict(os.environ)
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = {t.name: t for t in (await session.list_tools()).tools}
        assert "stopped after 20 s" in (tools["echo"].description or "")
        result = await session.call_tool("echo", {"value": 11})
        assert result.structured_content == {"outcome": "ok", "body_started": True, "value": 11}


def test_stdin_closed_mid_call_cancels_as_parent_and_leaves_nothing() -> None:
    marker = f"tp-mcp-{uuid.uuid4().hex}"
    with tempfile.TemporaryFile() as errlog:
        proc = raw.start_server(stderr=errlog)
        try:
            raw.initialize(proc)
            raw.call(proc, 1, "stubborn", {"marker": marker})
            pids = raw.until_progress(proc)
            assert proc.stdin is not None
            proc.stdin.close()
            start = time.monotonic()
            assert proc.wait(timeout=30) == 0
            took = _wait_gone([pids["worker"], pids["daemon"]], marker)
            print(
                f"stdin closed -> server gone in {time.monotonic() - start:.2f}s, tree {took:.2f}s"
            )
        finally:
            _end(proc)
        errlog.seek(0)
        assert b"settled killed, cause parent" in errlog.read()


def test_client_sigkilled_mid_call_leaves_nothing() -> None:
    marker = f"tp-mcp-{uuid.uuid4().hex}"
    client = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "mcp_raw_client.py"), marker],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    server = None
    try:
        assert client.stdout is not None
        pids = json.loads(client.stdout.readline())
        server = pids["server"]
        client.kill()
        client.wait()
        start = time.monotonic()
        took = _wait_gone([server, pids["worker"], pids["daemon"]], marker, within=30)
        print(
            f"client SIGKILLed -> everything gone in {time.monotonic() - start:.2f}s ({took:.2f})"
        )
    finally:
        _end(client)
        if server is not None and _alive(server):
            os.kill(server, signal.SIGKILL)


def test_server_sigkilled_mid_call_leaves_nothing() -> None:
    marker = f"tp-mcp-{uuid.uuid4().hex}"
    proc = raw.start_server()
    try:
        raw.initialize(proc)
        raw.call(proc, 1, "stubborn", {"marker": marker})
        pids = raw.until_progress(proc)
        proc.kill()
        proc.wait()
        took = _wait_gone([pids["worker"], pids["daemon"]], marker)
        print(f"server SIGKILLed -> tree gone in {took:.2f}s")
    finally:
        _end(proc)


def test_sigterm_drains_a_call_as_disposed_and_answers_it() -> None:
    proc = raw.start_server()
    try:
        raw.initialize(proc)
        raw.call(proc, 1, "nap", {"seconds": 60})
        raw.until_progress(proc)
        proc.send_signal(signal.SIGTERM)
        answer = raw.receive(proc)
        while answer.get("id") != 1:
            answer = raw.receive(proc)
        content = answer["result"]["structuredContent"]
        assert content["outcome"] == "aborted"
        assert content["cause"] == "disposed"
        assert proc.wait(timeout=30) == 0
    finally:
        _end(proc)


def test_stdio_garbage_and_oversized_messages_get_errors() -> None:
    proc = raw.start_server()
    try:
        raw.initialize(proc)
        assert proc.stdin is not None
        proc.stdin.write(b"this is not json\n")
        proc.stdin.flush()
        answer = raw.receive(proc)
        assert answer["id"] is None
        assert answer["error"]["code"] == -32700
        raw.send(proc, {"jsonrpc": "2.0", "id": 5, "nonsense": True})
        answer = raw.receive(proc)
        assert answer["error"]["code"] == -32600
        assert answer["id"] == 5
        proc.stdin.write(
            b'{"jsonrpc": "2.0", "id": 6, "method": "x", "params": "' + b"a" * (5 << 20) + b'"}\n'
        )
        proc.stdin.flush()
        answer = raw.receive(proc)
        assert answer["error"]["code"] == -32600
        assert "bytes" in answer["error"]["message"]
        raw.send(proc, {"jsonrpc": "2.0", "id": 7, "method": "no/such/method"})
        answer = raw.receive(proc)
        assert answer["id"] == 7
        assert answer["error"]["code"] == -32601
        raw.call(proc, 8, "echo", {"value": 8})  # still serving
        answer = raw.receive(proc)
        assert answer["result"]["structuredContent"]["value"] == 8
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        _end(proc)


# ---------------------------------------------------------------- streamable HTTP


class _Http:
    def __init__(self, pool: toolpool.Pool, server: McpServer, url: str) -> None:
        self.pool = pool
        self.server = server
        self.url = url


@asynccontextmanager
async def _http(
    *,
    token: str | None = None,
    max_body_bytes: int = 1 << 20,
    timeout: float | None = None,
    cancel_grace: float = 0.3,
) -> AsyncIterator[_Http]:
    """A pool behind the MCP face over HTTP; a short ``cancel_grace`` by default, for the
    tests that escalate (those that stop a body cooperatively pass a long one: on a loaded
    machine a cooperative stop can take longer than 0.3 s, and the grace is not what they
    test)."""
    async with toolpool.Pool(cancel_grace=cancel_grace, term_grace=0.3) as pool:
        await pool.add_provider("main", "tests.mcp_tools:registry", workers=2)
        server = McpServer(pool, timeout=timeout)
        app = server.asgi_app(token=token, max_body_bytes=max_body_bytes)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        uv = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: uv.serve(sockets=[sock]))
                with anyio.fail_after(30):
                    while not uv.started:
                        await anyio.sleep(0.01)  # (uvicorn offers no event for it)
                try:
                    yield _Http(pool, server, f"http://127.0.0.1:{port}/mcp")
                finally:
                    uv.should_exit = True
        finally:
            sock.close()
            server.close()


@asynccontextmanager
async def _client(url: str, **kwargs: Any) -> AsyncIterator[ClientSession]:
    async with (
        streamable_http_client(url, **kwargs) as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        await session.initialize()
        yield session


async def test_http_tools_calls_cancel_and_list_changed() -> None:
    async with _http(cancel_grace=30) as h:
        changed = anyio.Event()

        async def on_message(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                changed.set()

        async with streamable_http_client(h.url) as streams:  # noqa: SIM117
            async with ClientSession(streams[0], streams[1], message_handler=on_message) as s:
                await s.initialize()
                names = {t.name for t in (await s.list_tools()).tools}
                assert {"echo", "fail", "nap", "stubborn"} <= names
                assert "late" not in names
                ok = await s.call_tool("echo", {"value": 4})
                assert ok.structured_content == {"outcome": "ok", "body_started": True, "value": 4}
                bad = await s.call_tool("fail", {})
                assert bad.is_error
                assert bad.structured_content["outcome"] == "error"

                await h.pool.add_provider("extra", "tests.mcp_tools:extra", workers=1)
                with anyio.fail_after(30):
                    await changed.wait()
                changed = anyio.Event()
                assert "late" in {t.name for t in (await s.list_tools()).tools}
                assert (await s.call_tool("late", {"value": 9})).structured_content["value"] == 9  # type: ignore[index]
                await h.pool.reload_provider("extra")
                with anyio.fail_after(30):
                    await changed.wait()
                changed = anyio.Event()
                await h.pool.remove_provider("extra")
                with anyio.fail_after(30):
                    await changed.wait()
                assert "late" not in {t.name for t in (await s.list_tools()).tools}

                assert await _call_then(s, "nap", {"seconds": 60}) is None
                with anyio.fail_after(30):
                    await h.server.wait_idle()

                h.server.begin_drain()  # what `toolpool serve` does on SIGTERM
                assert h.server.draining
                with pytest.raises(MCPError, match="draining") as refused:
                    await s.call_tool("echo", {"value": 1})
                assert refused.value.error.code == DRAINING
                assert (await s.list_tools()).tools  # nothing else changes
        stats = h.server.statistics()
        assert stats.refused_draining == 1
        assert stats.cancelled.get("user") == 1
        assert stats.outcomes.get("aborted") == 1
        assert stats.undelivered == 1
        assert stats.in_flight == 0


async def test_http_2026_wire_calls_and_a_closed_stream_is_parent_and_timeout() -> None:
    """The 2026-07-28 wire (no handshake; a client cancels by closing the response
    stream), and a call's deadline (cause timeout)."""
    async with _http(timeout=0.5, cancel_grace=30) as h, streamable_http_client(h.url) as streams:  # noqa: SIM117
        async with ClientSession(streams[0], streams[1]) as s:
            await s.discover()
            assert s.protocol_version == "2026-07-28"
            assert "echo" in {t.name for t in (await s.list_tools()).tools}
            ok = await s.call_tool("echo", {"value": 3})
            assert ok.structured_content == {"outcome": "ok", "body_started": True, "value": 3}
            late = await s.call_tool("nap", {"seconds": 60})
            assert late.is_error
            assert late.structured_content["outcome"] == "timeout"  # type: ignore[index]
            assert late.structured_content["cause"] == "timeout"  # type: ignore[index]
            assert late.content[0].text == "Error: tool call timed out"  # type: ignore[union-attr]

            # this wire's cancel: the response stream closes
            assert await _call_then(s, "count", {"steps": 100, "pause": 0.1}) is None
            with anyio.fail_after(30):
                await h.server.wait_idle()
    stats = h.server.statistics()
    assert stats.cancelled.get("parent") == 1
    assert stats.outcomes.get("aborted") == 1
    assert stats.outcomes.get("timeout") == 1


async def test_http_2026_wire_a_posted_cancel_is_user_and_answered_once_settled() -> None:
    """On the 2026-07-28 wire the face honours ``notifications/cancelled`` for a call in
    flight on it (cause user, the call's request answered with the settled result); a
    cancel naming no call here, or from a disallowed Host, is not honoured."""
    modern = {
        **_ACCEPT,
        "content-type": "application/json",
        "mcp-protocol-version": "2026-07-28",
    }
    meta = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {},
    }

    def cancel(request_id: str) -> bytes:
        params = {"requestId": request_id, "reason": "test", "_meta": meta}
        message = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": params}
        return json.dumps(message).encode()

    cancel_headers = {**modern, "mcp-method": "notifications/cancelled"}
    request = {
        "jsonrpc": "2.0",
        "id": "call-1",
        "method": "tools/call",
        "params": {
            "name": "nap",
            "arguments": {"seconds": 60},
            "_meta": {**meta, "progressToken": "t"},
        },
    }
    async with _http(cancel_grace=30) as h, httpx2.AsyncClient(timeout=30) as client:
        headers = {**modern, "mcp-method": "tools/call", "mcp-name": "nap"}
        async with client.stream("POST", h.url, json=request, headers=headers) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data:") and "notifications/progress" in line:
                    break  # (the body runs)
            unknown = await client.post(h.url, content=cancel("call-2"), headers=cancel_headers)
            assert unknown.status_code == 202
            assert "toolpool-cancel" not in unknown.headers
            rebound = await client.post(
                h.url, content=cancel("call-1"), headers={**cancel_headers, "host": "evil.test"}
            )
            assert rebound.status_code == 421
            assert "toolpool-cancel" not in rebound.headers
            assert h.server.in_flight == 1
            accepted = await client.post(h.url, content=cancel("call-1"), headers=cancel_headers)
            assert accepted.status_code == 202
            assert accepted.headers["toolpool-cancel"] == "accepted"
            answer = None
            async for line in lines:
                if line.startswith("data:") and '"call-1"' in line:
                    answer = json.loads(line[5:])
                    break
        assert answer is not None
        facts = answer["result"]["structuredContent"]
        assert facts["outcome"] == "aborted"
        assert facts["cause"] == "user"
        assert facts["body_started"] is True
        with anyio.fail_after(30):
            await h.server.wait_idle()
        stats = h.server.statistics()
        assert stats.cancelled.get("user") == 1
        assert stats.undelivered == 0


def test_http_command_drains_on_sigterm_as_disposed(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*raw.server_command(), "--http", "127.0.0.1:0"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        while "serving MCP at" not in (line := proc.stderr.readline()):
            assert line, "the server did not start"
        url = line.rsplit(" ", 1)[1].strip()

        async def client() -> dict[str, Any]:
            async with _client(url) as s:
                result = await _call_then(
                    s, "nap", {"seconds": 60}, lambda: proc.send_signal(signal.SIGTERM)
                )
                assert result is not None
                # the session (its GET stream) stays open: the server exits all the same
                assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0
                return result.structured_content  # type: ignore[no-any-return]

        content = anyio.run(client)
        assert content["outcome"] == "aborted"
        assert content["cause"] == "disposed"
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


async def _raw_session(client: httpx2.AsyncClient, url: str, headers: dict[str, str]) -> str:
    response = await client.post(url, json=raw.INITIALIZE, headers=headers)
    assert response.status_code == 200, response.text
    session = response.headers["mcp-session-id"]
    headers = {**headers, "mcp-session-id": session, "mcp-protocol-version": "2025-11-25"}
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert (await client.post(url, json=note, headers=headers)).status_code == 202
    return session


_ACCEPT = {"accept": "application/json, text/event-stream"}


async def test_http_closing_the_response_stream_cancels_as_parent_and_the_tree_goes() -> None:
    marker = f"tp-mcp-{uuid.uuid4().hex}"
    async with _http() as h, httpx2.AsyncClient(timeout=30) as client:
        session = await _raw_session(client, h.url, _ACCEPT)
        headers = {**_ACCEPT, "mcp-session-id": session, "mcp-protocol-version": "2025-11-25"}
        request = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {
                "name": "stubborn",
                "arguments": {"marker": marker},
                "_meta": {"progressToken": "t"},
            },
        }
        pids: dict[str, int] = {}
        async with client.stream("POST", h.url, json=request, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:") and "notifications/progress" in line:
                    pids = json.loads(json.loads(line[5:])["params"]["message"])
                    break
        # the response stream is closed: the call is cancelled with cause parent
        with anyio.fail_after(30):
            await h.server.wait_idle()
        assert not _alive(pids["worker"])
        assert not _alive(pids["daemon"])
        assert not _marked(marker)
        stats = h.server.statistics()
        assert stats.cancelled.get("parent") == 1
        assert stats.outcomes.get("killed") == 1


async def test_http_garbage_oversized_unknown_and_origin_are_refused_others_served() -> None:
    async with (
        _http(max_body_bytes=64 * 1024) as h,
        httpx2.AsyncClient(timeout=30) as client,
        _client(h.url) as other,  # another session, served throughout
    ):
        session = await _raw_session(client, h.url, _ACCEPT)
        headers = {
            **_ACCEPT,
            "content-type": "application/json",
            "mcp-session-id": session,
            "mcp-protocol-version": "2025-11-25",
        }
        garbage = await client.post(h.url, content=b"{not json", headers=headers)
        assert garbage.status_code == 400
        assert garbage.json()["error"]["code"] == -32700
        big = b'{"jsonrpc":"2.0","id":3,"method":"ping","params":{"x":"' + b"a" * 70000 + b'"}}'
        oversized = await client.post(h.url, content=big, headers=headers)
        assert oversized.status_code == 413
        assert oversized.json()["error"]["code"] == -32600
        unknown = await client.post(
            h.url, json={"jsonrpc": "2.0", "id": 4, "method": "no/such"}, headers=headers
        )
        assert "-32601" in unknown.text
        evil = await client.post(
            h.url,
            json={"jsonrpc": "2.0", "id": 5, "method": "ping"},
            headers={**headers, "origin": "http://evil.example"},
        )
        assert evil.status_code == 403
        assert (await other.call_tool("echo", {"value": 5})).structured_content["value"] == 5  # type: ignore[index]


async def test_http_a_task_belongs_to_its_session() -> None:
    async with _http() as h, httpx2.AsyncClient(timeout=30) as client:
        sessions = [await _raw_session(client, h.url, _ACCEPT) for _ in range(2)]
        owner, stranger = (
            {**_ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": "2025-11-25"}
            for sid in sessions
        )

        async def ask(headers: dict[str, str], method: str, params: dict[str, Any]) -> Any:
            body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
            response = await client.post(h.url, json=body, headers=headers)
            for line in response.text.splitlines():
                if line.startswith("data:") and line[5:].strip():
                    return json.loads(line[5:])
            return response.json()

        created = await ask(
            owner, "tools/call", {"name": "nap", "arguments": {"seconds": 60}, "task": {}}
        )
        task_id = created["result"]["task"]["taskId"]
        for method in ("tasks/get", "tasks/cancel", "tasks/result"):
            refused = await ask(stranger, method, {"taskId": task_id})
            assert "Unknown task" in refused["error"]["message"], refused
        assert (await ask(stranger, "tasks/list", {}))["result"]["tasks"] == []
        final = await ask(owner, "tasks/cancel", {"taskId": task_id})
        assert final["result"]["status"] == "cancelled", final


async def test_http_bearer_token() -> None:
    token = "s3cret-token-" + uuid.uuid4().hex
    async with _http(token=token) as h, httpx2.AsyncClient(timeout=30) as client:
        for value in (None, "Bearer wrong-token-wrong-token", f"Basic {token}"):
            headers = dict(_ACCEPT) if value is None else {**_ACCEPT, "authorization": value}
            denied = await client.post(
                h.url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=headers
            )
            assert denied.status_code == 401
            assert denied.headers["www-authenticate"].startswith("Bearer")
        auth = {"authorization": f"Bearer {token}"}
        async with (
            httpx2.AsyncClient(headers=auth) as authorized,
            _client(h.url, http_client=authorized) as s,
        ):
            assert (await s.call_tool("echo", {"value": 1})).structured_content["value"] == 1  # type: ignore[index]


def test_http_non_loopback_bind_without_token_is_refused(tmp_path: Path) -> None:
    def command(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*raw.server_command(), "--http", "0.0.0.0:0", *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    done = command()
    assert done.returncode == 2
    assert "not a loopback address" in done.stderr
    short = tmp_path / "token"
    short.write_text("short\n")
    done = command("--token-file", str(short))
    assert done.returncode == 2
    assert "at least 16 characters" in done.stderr


async def test_descriptions_tell_the_containment_the_workers_applied() -> None:
    async with toolpool.Pool("tests.mcp_tools:registry", workers=1, profile="untrusted") as pool:
        server = McpServer(pool, timeout=12)
        try:
            tool = server.tools["echo"]
            report = pool.containment()
            if report.active("netns"):
                assert "runs without network access" in tool["description"]
                assert tool["annotations"]["openWorldHint"] is False
            else:
                assert "has the host's network access" in tool["description"]
                assert "annotations" not in tool
            if report.active("cgroup_memory"):
                assert "memory capped at 512 MiB" in tool["description"]
            if report.active("readonly_fs") or report.active("landlock"):
                assert "filesystem read-only" in tool["description"]
            assert "stopped after 12 s" in tool["description"]
            assert server.cancel_all() == 0
            for bad in ({"kind": "timeout"}, {"kind": "nope"}, "user", {"kind": "user", "x": 1}):
                with pytest.raises((ValueError, TypeError)):
                    server.cancel_all(bad)  # type: ignore[arg-type]
        finally:
            server.close()


def test_the_mcp_package_exports_and_says_when_the_extra_is_missing() -> None:
    import toolpool.mcp as face

    assert isinstance(face.__all__, tuple)
    for name in face.__all__:
        obj = getattr(face, name)
        if isinstance(obj, type) or callable(obj):
            assert obj.__module__ == "toolpool.mcp", name
    code = (
        "import sys; sys.modules['mcp'] = None\n"
        "import toolpool.mcp\n"
        "try:\n    toolpool.mcp.McpServer\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'toolpool[mcp]'" in done.stdout


def test_importing_toolpool_does_not_import_the_sdk() -> None:
    code = "import sys, toolpool; toolpool.Pool; assert 'mcp' not in sys.modules, 'mcp'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_task_cancel_after_its_deadline_fired_reports_the_first_cause() -> None:
    """The call's deadline stops it first (cause timeout); a tasks/cancel sent during the
    ladder changes nothing: the task ends failed (not cancelled), its result says timeout."""
    marker = f"tp-mcp-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        raw.server_command("--term-grace", "5", "--timeout", "1"),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        raw.initialize(proc)
        raw.send(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {"name": "stubborn", "arguments": {"marker": marker}, "task": {}},
            },
        )
        task_id = raw.receive(proc)["result"]["task"]["taskId"]
        assert proc.stderr is not None
        # The deadline fired and the ladder reached SIGTERM (the tool ignores it): the
        # SIGKILL is 5 s away, time enough for the client's cancel to arrive first.
        while b"SIGTERM to its tree for call" not in (line := proc.stderr.readline()):
            assert line, "the server's log ended before its SIGTERM"
        raw.send(
            proc,
            {"jsonrpc": "2.0", "id": 2, "method": "tasks/cancel", "params": {"taskId": task_id}},
        )
        final = raw.receive(proc)
        assert final.get("id") == 2, final
        assert final["result"]["status"] == "failed", final
        assert final["result"]["statusMessage"].startswith("killed")
        raw.send(
            proc,
            {"jsonrpc": "2.0", "id": 3, "method": "tasks/result", "params": {"taskId": task_id}},
        )
        content = raw.receive(proc)["result"]["structuredContent"]
        assert (content["outcome"], content["cause"]) == ("killed", "timeout")
        assert not _marked(marker)  # settled: its tree is gone
    finally:
        _end(proc)
        if proc.stderr is not None:
            proc.stderr.close()


def test_tasks_fail_closed_without_an_owner() -> None:
    """The connection that owns a task comes from a private attribute of the SDK
    (``_connection_of``): should an SDK release lose it (None), no task is made and none is
    shown, rather than every client seeing and cancelling every other's tasks."""
    from toolpool.mcp._tasks import TaskStore

    store = TaskStore()
    call: Any = object()
    with pytest.raises(ValueError, match="owner"):
        store.create(None, call, None)
    owner = object()
    task = store.create(owner, call, None)
    assert store.get(owner, task.id) is task
    assert store.get(None, task.id) is None
    assert list(store.of(None)) == []
    assert list(store.of(owner)) == [task]


SERVE_THEN_READ = """
import sys, threading, anyio, toolpool
from toolpool.mcp import serve

async def main():
    async with toolpool.Pool() as pool:
        await pool.add_provider("t", "tests.mcp_tools:registry", workers=1)
        print("serving", file=sys.stderr, flush=True)
        await serve(pool)
    print("returned", file=sys.stderr, flush=True)

anyio.run(main)
for thread in threading.enumerate():
    if thread.name.startswith("toolpool-mcp-stdin"):
        thread.join(20)
        assert not thread.is_alive(), "the stdin reader outlived serve()"
sys.stdout.buffer.write(b"after: " + sys.stdin.buffer.readline())
"""


def test_serve_from_python_leaves_stdin_to_the_program_after_it() -> None:
    """``serve()`` returned (SIGTERM): its reader thread ends and reads no more of stdin,
    so the line the program reads next is the program's, not swallowed by a reader left
    behind."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_THEN_READ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stderr is not None
        while b"serving" not in (line := proc.stderr.readline()):
            assert line, "the program ended before serving"
        raw.initialize(proc)
        proc.send_signal(signal.SIGTERM)
        while b"returned" not in (line := proc.stderr.readline()):
            assert line, "the program ended before serve() returned"
        out, _ = proc.communicate(b"hello\n", timeout=60)
        assert out == b"after: hello\n"
        assert proc.returncode == 0
    finally:
        _end(proc)
        if proc.stderr is not None:
            proc.stderr.close()


async def test_statistics_count_a_cancel_only_where_its_cause_stuck() -> None:
    """The call's deadline stops it first (cause timeout); the server's cancel that comes
    during the ladder is not the cause that stuck, so ``statistics().cancelled`` does not
    count it; the answer says timeout."""
    marker = f"tp-mcp-{uuid.uuid4().hex}"
    sigterm = anyio.Event()

    class OnSigterm(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:  # (the pool logs in its loop)
            if "SIGTERM to its tree" in record.getMessage():
                sigterm.set()

    handler = OnSigterm()
    supervisor_log = logging.getLogger("toolpool.supervisor")
    supervisor_log.addHandler(handler)
    previous = supervisor_log.level
    supervisor_log.setLevel(logging.INFO)
    try:
        async with _http(timeout=1) as http, _client(http.url) as session:
            async with anyio.create_task_group() as tg:
                answers: list[types.CallToolResult] = []

                async def call() -> None:
                    answers.append(await session.call_tool("stubborn", {"marker": marker}))

                tg.start_soon(call)
                with anyio.fail_after(60):
                    await sigterm.wait()  # the deadline fired; the ladder reached SIGTERM
                assert http.server.cancel_all({"kind": "user"}) == 1
            content = answers[0].structured_content
            assert content is not None
            assert (content["outcome"], content["cause"]) == ("killed", "timeout")
            assert not _marked(marker)
            stats = http.server.statistics()
            assert dict(stats.outcomes) == {"killed": 1}
            assert dict(stats.cancelled) == {}
    finally:
        supervisor_log.removeHandler(handler)
        supervisor_log.setLevel(previous)


async def test_a_change_made_while_announcing_the_last_is_announced_too() -> None:
    """A catalog change made while ``tools/list_changed`` of the previous one is being
    sent is announced as well (a client that listed in between must hear of it), and a
    client that takes its notification slowly holds up no other."""
    calls: list[str] = []
    first_sent = anyio.Event()
    release = anyio.Event()
    second_sent = anyio.Event()

    class Slow:  # stands in for a client session that takes the first one slowly
        async def send_tool_list_changed(self) -> None:
            calls.append("slow")
            if len(calls) == 1:
                first_sent.set()
                await release.wait()
            else:
                second_sent.set()

    quick_got = anyio.Event()

    class Quick:
        async def send_tool_list_changed(self) -> None:
            quick_got.set()

    async with toolpool.Pool() as pool:
        server = McpServer(pool)
        try:
            async with server:
                server._connections[1] = Slow()
                server._connections[2] = Quick()
                await pool.add_provider("extra", "tests.mcp_tools:extra", workers=1)
                with anyio.fail_after(30):
                    await first_sent.wait()
                    await quick_got.wait()  # not held up by the slow one
                await pool.remove_provider("extra")  # while the first is being sent
                release.set()
                with anyio.fail_after(30):
                    await second_sent.wait()
                assert "late" not in server.tools
        finally:
            server.close()


def test_sigterm_answers_a_pending_tasks_result_before_exiting() -> None:
    """A client waits on ``tasks/result`` of a running task; SIGTERM drains: the task's
    call is cancelled (disposed) and that request is answered before the server exits."""
    proc = raw.start_server()
    try:
        raw.initialize(proc)
        raw.send(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {"name": "nap", "arguments": {"seconds": 60}, "task": {}},
            },
        )
        task_id = raw.receive(proc)["result"]["task"]["taskId"]
        raw.send(
            proc,
            {"jsonrpc": "2.0", "id": 2, "method": "tasks/result", "params": {"taskId": task_id}},
        )
        deadline = time.monotonic() + 30
        while True:  # the protocol's own way to see the body run: poll tasks/get
            raw.send(
                proc,
                {"jsonrpc": "2.0", "id": 3, "method": "tasks/get", "params": {"taskId": task_id}},
            )
            answer = raw.receive(proc)
            if answer.get("id") == 3 and answer["result"]["statusMessage"].startswith("running"):
                break
            assert time.monotonic() < deadline, "the task's body never ran"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        answer = raw.receive(proc)  # EOFError if the server exits without answering
        while answer.get("id") != 2:
            answer = raw.receive(proc)
        content = answer["result"]["structuredContent"]
        assert (content["outcome"], content["cause"]) == ("aborted", "disposed")
        assert proc.wait(timeout=30) == 0
    finally:
        _end(proc)


def test_stdio_deeply_nested_json_is_refused_not_a_crash() -> None:
    """A line of a few hundred kilobytes of nested brackets (well under the size limit)
    is answered with a parse error, and the server serves on."""
    proc = raw.start_server()
    try:
        raw.initialize(proc)
        assert proc.stdin is not None
        for line in (
            b"[" * 100_000 + b"]" * 100_000,
            b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":'
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}}",
        ):
            proc.stdin.write(line + b"\n")
            proc.stdin.flush()
            answer = raw.receive(proc)  # EOFError if the server died of it
            assert answer["error"]["code"] == -32700, answer
        raw.call(proc, 2, "echo", {"value": 2})
        assert raw.receive(proc)["result"]["structuredContent"]["value"] == 2
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        _end(proc)
