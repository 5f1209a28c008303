"""``toolpool.connect``: the remote client over real HTTP, against a plain MCP server that
answers as toolpool's face does (``mcp_plain_server.py``), and against nothing at all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import toolpool
from toolpool import Outcome
from toolpool.remote import ServerUnavailable

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

HERE = Path(__file__).resolve().parent


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # (the client runs on httpx2, asyncio or trio: one backend is enough)


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "ledger"


@pytest.fixture
def server(ledger: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "mcp_plain_server.py"), "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "TOOLPOOL_TEST_LEDGER": str(ledger)},
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}/mcp", proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()


async def _handler_started(ledger: Path) -> None:
    """Until the server's ``slow`` handler noted its start (another process's file: polled)."""
    with anyio.fail_after(30):
        while "start" not in (ledger.read_text() if ledger.exists() else ""):
            await anyio.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_call_results_carry_outcome_and_body_started(
    server: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, _ = server
    async with toolpool.connect(url) as client:
        ok = await client.call("echo", {"value": "hi"})
        assert ok.outcome is Outcome.OK
        assert ok.value == "hi"
        assert ok.body_started is True
        assert isinstance(ok, toolpool.Result)
        failed = await client.call("fail")
        assert failed.outcome is Outcome.ERROR
        assert failed.error == "Error: boom"
        assert failed.error_name == "RuntimeError"
        assert failed.body_started is True
        tools = await client.list_tools()
        assert {"echo", "fail", "slow"} <= set(tools)


async def test_map_keeps_input_order(server: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, _ = server
    async with toolpool.connect(url) as client:
        got = [r async for r in client.map("echo", ({"value": str(i)} for i in range(30)))]
    assert [r.value for r in got] == [str(i) for i in range(30)]
    assert [r.index for r in got] == list(range(30))


async def test_never_sent_raises_server_unavailable() -> None:
    async with toolpool.connect(f"http://127.0.0.1:{_free_port()}/mcp") as client:
        call = client.submit("echo", {"value": "x"})
        with pytest.raises(ServerUnavailable):
            await call
    async with toolpool.connect(f"http://127.0.0.1:{_free_port()}/mcp") as client:
        pass  # (a client never used closes cleanly)


@pytest.mark.parametrize("progress", [False, True])
async def test_server_killed_mid_call_is_worker_lost(
    server: tuple[str, subprocess.Popen[bytes]], ledger: Path, progress: bool
) -> None:
    """The node dies with the call in flight: ``worker_lost``, ``body_started`` None unless
    the server had said the body runs (a progress notification)."""
    url, proc = server
    async with toolpool.connect(url) as client:
        await client.call("echo")  # (the server is up)
        call = client.submit("slow", {"seconds": 60, "progress": progress})
        if progress:
            while call.body_started is None and not call.done():
                await anyio.sleep(0.01)
        else:
            await _handler_started(ledger)  # (it runs, and said nothing yet)
        os.killpg(proc.pid, signal.SIGKILL)
        result = await call
    assert result.outcome is Outcome.WORKER_LOST
    assert result.body_started is (True if progress else None)
    assert result.error is not None
    assert "lost" in result.error


async def test_draining_answer_is_never_sent(server: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, _ = server
    async with toolpool.connect(url) as client:
        with pytest.raises(ServerUnavailable, match="draining"):
            await client.call("draining")


async def test_cancel_travels_as_the_mcp_cancel(
    server: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """A server that does not answer a cancelled request (the plain SDK's) leaves the outcome
    unknown: said so, never guessed."""
    url, _ = server
    async with toolpool.connect(url) as client:
        call = client.submit("slow", {"seconds": 60, "progress": True})
        while call.body_started is None:
            await anyio.sleep(0.01)
        result = await client.cancel(call)
    assert result.outcome in (Outcome.ERROR, Outcome.ABORTED)
    if result.outcome is Outcome.ERROR:
        assert result.error_name == "CancelUnconfirmed"
        assert result.body_started is True


async def test_a_cancel_before_the_answer_starts_closes_the_stream_at_once(
    server: tuple[str, subprocess.Popen[bytes]], ledger: Path
) -> None:
    """A server that sends nothing yet (the SDK commits its event stream only with the first
    notification, or after 15 s) and does not honour the posted cancel: the client closes
    the request's stream at once, not once the answer starts (it used to wait for the
    response headers, so the server noticed the cancel up to 15 s late)."""
    url, _ = server
    async with toolpool.connect(url) as client:
        call = client.submit("slow", {"seconds": 60})
        await _handler_started(ledger)
        call.cancel()
        # The server's handler is cancelled well before its 15 s deferral runs out.
        with anyio.fail_after(10):
            while "cancelled" not in ledger.read_text():
                await anyio.sleep(0.01)
        result = await call
        assert result.outcome is Outcome.ERROR
        assert result.error_name == "CancelUnconfirmed"
        assert result.body_started is None
