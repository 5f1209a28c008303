"""``toolpool batch --server``: the batch's promises with the calls sent to services (here
plain MCP servers answering as toolpool's face does, ``mcp_plain_server.py``; the scale-out
test runs it against ``toolpool serve`` behind haproxy)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from toolpool._batch import Batch, BatchOptions

pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).resolve().parent


class Plain:
    def __init__(self, ledger: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "mcp_plain_server.py"), "0"],
            env={**os.environ, "TOOLPOOL_TEST_LEDGER": str(ledger)},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}/mcp"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def plains(tmp_path: Path) -> Iterator[list[Plain]]:
    started = [Plain(tmp_path / "ledger"), Plain(tmp_path / "ledger")]
    yield started
    for p in started:
        p.kill()


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/mcp"


def write_lines(path: Path, lines: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def batch(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "toolpool", "batch", "--no-progress", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def records(path: Path) -> dict[object, dict[str, object]]:
    out: dict[object, dict[str, object]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "id" in record:
            assert record["id"] not in out, f"two records for {record['id']}"
            out[record["id"]] = record
    return out


def test_every_line_one_record_and_a_dead_server_takes_nothing(
    tmp_path: Path, plains: list[Plain]
) -> None:
    lines: list[dict[str, object]] = [
        {"id": i, "tool": "echo", "args": {"value": str(i)}} for i in range(200)
    ]
    lines.append({"id": "x", "tool": "fail", "args": {}})
    write_lines(tmp_path / "in.jsonl", lines)
    servers = [plains[0].url, dead_url(), plains[1].url]
    run = batch(
        *(f"--server={u}" for u in servers),
        str(tmp_path / "in.jsonl"),
        "-o",
        str(tmp_path / "out.jsonl"),
    )
    out, err = run.communicate(timeout=150)
    assert run.returncode == 1, err  # (one error record)
    summary = json.loads(out)
    assert summary["recorded"] == {"ok": 200, "error": 1}
    got = records(tmp_path / "out.jsonl")
    assert len(got) == 201
    assert all(got[i]["value"] == str(i) and got[i]["attempts"] == 1 for i in range(200))
    assert got["x"]["outcome"] == "error"
    # Resumed: nothing runs again.
    run = batch(
        *(f"--server={u}" for u in servers),
        str(tmp_path / "in.jsonl"),
        "-o",
        str(tmp_path / "out.jsonl"),
    )
    out, _ = run.communicate(timeout=150)
    assert json.loads(out)["skipped"] == 201


class Dropper:
    """A server that takes every connection, reads the request and closes it unanswered: a
    call sent to it is lost mid-call, every time (as with a server that just went away)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/mcp"
        self.taken = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # (closed)
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.taken += 1

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # (wakes the accept)
        self.sock.close()
        self.thread.join(30)


def test_a_retry_goes_to_another_server_than_the_one_it_was_lost_with(
    tmp_path: Path, plains: list[Plain]
) -> None:
    """Calls in turn: the dropper's are lost; their retries go to the other server (by turn,
    half would go back to the dropper and be lost again)."""
    write_lines(
        tmp_path / "in.jsonl",
        [{"id": i, "tool": "echo", "args": {"value": str(i)}} for i in range(4)],
    )
    dropper = Dropper()
    try:
        run = batch(
            f"--server={plains[0].url}",
            f"--server={dropper.url}",
            "--workers",
            "4",
            "--retries",
            "1",
            "--idempotent",
            str(tmp_path / "in.jsonl"),
            "-o",
            str(tmp_path / "out.jsonl"),
        )
        _out, err = run.communicate(timeout=150)
    finally:
        dropper.close()
    got = records(tmp_path / "out.jsonl")
    assert len(got) == 4, err
    assert dropper.taken == 2  # (the first call in turn to each server; no retry)
    assert all(r["outcome"] == "ok" for r in got.values()), got
    assert sorted(int(str(r["attempts"])) for r in got.values()) == [1, 1, 2, 2]


@pytest.mark.parametrize("idempotent", [False, True])
def test_a_server_killed_mid_run(tmp_path: Path, plains: list[Plain], idempotent: bool) -> None:
    """Its calls settle ``worker_lost`` (``body_started`` null: it never said); retried
    only with ``--idempotent``, then on the other server."""
    lines: list[dict[str, object]] = [
        {"id": i, "tool": "slow", "args": {"seconds": 10}} for i in range(20)
    ]
    write_lines(tmp_path / "in.jsonl", lines)
    extra = ["--retries", "1", "--idempotent"] if idempotent else ["--retries", "1"]
    run = batch(
        f"--server={plains[0].url}",
        f"--server={plains[1].url}",
        "--workers",
        "20",
        *extra,
        str(tmp_path / "in.jsonl"),
        "-o",
        str(tmp_path / "out.jsonl"),
    )
    ledger = tmp_path / "ledger"
    deadline = time.monotonic() + 60
    while not (ledger.exists() and len(ledger.read_text().splitlines()) == 20):
        assert time.monotonic() < deadline, "the 20 calls did not all start"
        time.sleep(0.02)  # (another process's file: polled until every call started)
    plains[0].kill()
    _out, err = run.communicate(timeout=150)
    got = records(tmp_path / "out.jsonl")
    assert len(got) == 20, err
    lost = [r for r in got.values() if r["outcome"] == "worker_lost"]
    retried = [r for r in got.values() if r["attempts"] == 2]
    if idempotent:
        # (In full: the error names the server the last run was lost with.)
        assert not lost, f"killed {plains[0].url}: {json.dumps(lost)}\n{err}"
        assert len(retried) == 10  # (half went to the killed server)
        assert all(r["outcome"] == "ok" for r in got.values())
    else:
        assert len(lost) == 10
        assert all(r["body_started"] is None and r["attempts"] == 1 for r in lost)
        assert sum(1 for r in got.values() if r["outcome"] == "ok") == 10


class Relay:
    """A TCP relay in front of a server, as a load balancer stands in front of a node: each
    connection it takes goes on to the server. Once the server is gone (its port refuses),
    it still takes connections, reads the request and closes them unanswered: a call sent
    there is lost (``dead_hits`` counts them), as over a connection that does not know yet
    that its server went away. ``sent`` is set once ``expect`` tool calls went through."""

    _CALL = b"mcp-method: tools/call"

    def __init__(self, backend_port: int, *, expect: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/mcp"
        self.backend = ("127.0.0.1", backend_port)
        self.calls = 0
        self.dead_hits = 0
        self.sent = threading.Event()
        self._expect = expect
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # (closed)
            try:
                up = socket.create_connection(self.backend, timeout=10)
            except OSError:  # the server is gone: read the request, close unanswered
                with conn:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                with self._lock:
                    self.dead_hits += 1
                continue
            up.settimeout(None)
            with self._lock:
                self._open += [conn, up]
            for source, sink, count in ((conn, up, True), (up, conn, False)):
                thread = threading.Thread(target=self._pump, args=(source, sink, count))
                thread.daemon = True
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, count: bool) -> None:
        tail = b""
        try:
            while data := source.recv(65536):
                if count:  # (a header split across two reads is still seen once)
                    seen = (tail + data).lower().count(self._CALL)
                    tail = (tail + data)[-(len(self._CALL) - 1) :]
                    with self._lock:
                        self.calls += seen
                        if self.calls >= self._expect:
                            self.sent.set()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # (wakes the accept)
        self.sock.close()
        with self._lock:
            for end in self._open:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(30)
        with self._lock:
            for end in self._open:
                end.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("late", [False, True], ids=["now", "after_the_window"])
@pytest.mark.anyio
async def test_no_retry_goes_to_the_killed_server(
    tmp_path: Path, plains: list[Plain], monkeypatch: pytest.MonkeyPatch, late: bool
) -> None:
    """A server killed mid-run behind a relay that still takes connections: the calls lost
    with it are retried on the other server, none of them on it, also when the retries come
    later than ``LOST_AVOID_FOR`` after the loss (``late``: as if the machine were slow)."""
    if late:
        monkeypatch.setattr("toolpool._batch._remote.LOST_AVOID_FOR", 0.0)
    calls = 8
    write_lines(
        tmp_path / "in.jsonl",
        [{"id": i, "tool": "slow", "args": {"seconds": 2}} for i in range(calls)],
    )
    relay = Relay(plains[0].port, expect=calls // 2)  # (the calls go to the servers in turn)
    try:
        options = BatchOptions(
            tools="",
            input=str(tmp_path / "in.jsonl"),
            output=str(tmp_path / "out.jsonl"),
            workers=calls,
            retries=1,
            idempotent=True,
            servers=(relay.url, plains[1].url),
        )
        with anyio.fail_after(100):
            async with anyio.create_task_group() as tg:
                tg.start_soon(Batch(options, say=lambda line: None).run)
                assert await anyio.to_thread.run_sync(relay.sent.wait, 60)
                await anyio.to_thread.run_sync(plains[0].kill)
    finally:
        await anyio.to_thread.run_sync(relay.close)
    got = records(tmp_path / "out.jsonl")
    assert {r["outcome"] for r in got.values()} == {"ok"}, got
    assert relay.dead_hits == 0
    assert sorted(int(str(r["attempts"])) for r in got.values()) == [1] * 4 + [2] * 4
