"""Running ``toolpool serve`` as a real process in the tests (and the benchmark).

:class:`ServeProcess` starts it in a session of its own (its process group is the test's to
kill), reads its JSON log lines from stderr in a thread, and lets a test await a lifecycle
event by name; :meth:`ServeProcess.close` makes sure nothing of it outlives the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

TESTS = Path(__file__).resolve().parent
#: haproxy (Debian's package), the load balancer in front of several services; None if absent.
HAPROXY = shutil.which("haproxy") or (
    "/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None
)


def serve_env(**extra: str) -> dict[str, str]:
    """The environment for a service: the tests' tools importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


class ServeProcess:
    """One ``toolpool serve`` (or any command whose stderr is the service's JSON log)."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        control: str,
        env: dict[str, str] | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        self.control = control
        self.command = (
            list(argv)
            if argv is not None
            else [
                sys.executable,
                "-m",
                "toolpool",
                "serve",
                "--log-format",
                "json",
                "--control",
                control,
                *args,
            ]
        )
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env or serve_env(),
            start_new_session=True,
        )
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._seen: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port: int | None = None
        self.descendants: set[int] = set()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            text = raw.decode(errors="replace").rstrip("\n")
            self.raw.append(text)
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if isinstance(line, dict):
                self.lines.append(line)
                self._events.put(line)
        self._events.put(None)

    def wait_event(self, event: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        """The first log line (since the last one this returned) whose ``event`` is
        ``event`` (and whose fields match); AssertionError after ``timeout``."""
        for i, line in enumerate(self._seen):
            if line.get("event") == event and all(line.get(k) == v for k, v in match.items()):
                del self._seen[: i + 1]
                return line
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._events.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise AssertionError(
                    f"no {event!r} within {timeout}s; stderr:\n" + "\n".join(self.raw[-40:])
                ) from None
            if line is None:
                raise AssertionError(
                    f"the service exited ({self.proc.wait()}) before {event!r}; stderr:\n"
                    + "\n".join(self.raw[-40:])
                )
            if line.get("event") == event and all(line.get(k) == v for k, v in match.items()):
                return line
            self._seen.append(line)

    def wait_listening(self, timeout: float = 60.0) -> int:
        self.port = int(self.wait_event("listening", timeout)["port"])
        return self.port

    def wait_serving(self, timeout: float = 90.0) -> int:
        port = self.wait_listening(timeout) if self.port is None else self.port
        self.wait_event("serving", timeout)
        self.note_descendants()
        return port

    def note_descendants(self) -> set[int]:
        """Remember every process below the service now (checked gone by :meth:`close`)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.descendants |= {p.pid for p in psutil.Process(self.proc.pid).children(True)}
        return self.descendants

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url(path), timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def alive_descendants(self) -> list[int]:
        """The remembered descendants still alive (a zombie counts as gone)."""
        alive = []
        for pid in self.descendants:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def close(self) -> None:
        """End whatever is left of it: the process group, then any remembered descendant."""
        if self.proc.poll() is None:
            self.note_descendants()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        for pid in self.alive_descendants():
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        self._reader.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def haproxy(tmp_path: Path, ports: list[int]) -> Iterator[int]:
    """haproxy on a free loopback port in front of the services on ``ports``, round robin,
    each checked on ``/readyz`` every 0.3 s (a draining one is out at its first failure),
    a connection that fails sent to another (``option redispatch``); ended on exit."""
    port = free_port()
    servers = "\n".join(f"    server n{i} 127.0.0.1:{p} check" for i, p in enumerate(ports))
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        f"""global
    maxconn 4096
defaults
    mode http
    timeout connect 2s
    timeout client 120s
    timeout server 120s
    retries 3
    option redispatch
frontend callers
    bind 127.0.0.1:{port}
    default_backend nodes
backend nodes
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter 300ms fall 1 rise 2
{servers}
"""
    )
    assert HAPROXY is not None
    proc = subprocess.Popen(
        [HAPROXY, "-db", "-f", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # (haproxy says nothing when it listens: try the port)
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "haproxy did not listen"
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()
