"""A bare MCP client over a ``toolpool mcp`` subprocess's pipes, for the tests that need to
close its stdin, kill it, or be killed: newline-delimited JSON-RPC, nothing else.

Run as a script (``python tests/mcp_raw_client.py MARKER``) it is a client process that
starts the server, has it run ``stubborn``, prints one JSON line (the server's, worker's and
daemon's pids) and then waits to be killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import IO, Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def server_command(*extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "toolpool",
        "mcp",
        "tests.mcp_tools:registry",
        "--workers",
        "1",
        "--cancel-grace",
        "0.3",
        "--term-grace",
        "0.3",
        *extra,
    ]


def start_server(stderr: IO[bytes] | int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        server_command(),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )


def send(proc: subprocess.Popen[bytes], message: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    proc.stdin.flush()


def receive(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise EOFError("the server closed its stdout")
    return json.loads(line)  # type: ignore[no-any-return]


#: The opening request of a 2025-11-25 session.
INITIALIZE: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"},
    },
}


def initialize(proc: subprocess.Popen[bytes]) -> None:
    send(proc, INITIALIZE)
    answer = receive(proc)
    assert answer.get("id") == 0, answer
    assert "result" in answer, answer
    send(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})


def call(proc: subprocess.Popen[bytes], request_id: int, tool: str, args: dict[str, Any]) -> None:
    send(
        proc,
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "tools/call",
            "params": {"name": tool, "arguments": args, "_meta": {"progressToken": request_id}},
        },
    )


def until_progress(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Read until the first progress notification; its message as JSON."""
    while True:
        message = receive(proc)
        if message.get("method") == "notifications/progress":
            return json.loads(message["params"]["message"])  # type: ignore[no-any-return]


def main() -> None:
    marker = sys.argv[1]
    proc = start_server()
    initialize(proc)
    call(proc, 1, "stubborn", {"marker": marker})
    pids = until_progress(proc)
    print(json.dumps({"server": proc.pid, **pids}), flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
