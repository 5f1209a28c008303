"""Built-in example tools, used by the demo and the tests: ``toolpool.testing.examples:registry``.

Each shows one kind of behaviour the pool must handle truthfully: a cooperative sleeper, a busy
loop that ignores its signal, a tool that ignores SIGTERM, one that leaves a daemon grandchild
behind, and one that crashes its worker.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import anyio

from toolpool import Registry, ToolExecution

registry = Registry()


@registry.tool
def echo(value: Any = None) -> Any:
    """Return the value unchanged."""
    return value


@registry.tool
def noop() -> None:
    """Do nothing."""


@registry.tool
async def nap(seconds: float, execution: ToolExecution) -> str:
    """Sleep cooperatively: return early (cancelled) when the call's signal fires."""
    with anyio.move_on_after(seconds):
        await execution.signal.wait()
        execution.signal.raise_if_cancelled()
    return f"slept {seconds}s"


@registry.tool
def sync_nap(seconds: float, execution: ToolExecution) -> str:
    """Sleep in a thread, checking the signal: a cooperative sync tool."""
    if execution.signal.wait_blocking(seconds):
        execution.signal.raise_if_cancelled()
    return f"slept {seconds}s"


@registry.tool
def busy_loop(seconds: float = 3600.0) -> int:
    """Spin without ever looking at the signal: only SIGTERM stops it."""
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
    return n


@registry.tool
async def ignore_sigterm(seconds: float = 3600.0) -> str:
    """Ignore SIGTERM and the signal, then block the worker: only SIGKILL stops it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)  # deliberately blocks the event loop too
    return "survived"


@registry.tool
def spawn_daemon(marker: str = "toolpool-daemon", seconds: float = 3600.0) -> int:
    """Start a grandchild that escapes with setsid and a double fork, then return its pid.

    The daemon sleeps with ``marker`` in its argv, so tests can find it machine-wide.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.setsid()
            if os.fork() == 0:  # grandchild: the daemon
                os.write(write_fd, str(os.getpid()).encode())
                os.execvp(
                    sys.executable,
                    [sys.executable, "-c", f"import time; time.sleep({seconds})", marker],
                )
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    # Read until the end: the pipe is close-on-exec, so the end comes once the daemon has
    # exec'd (its command line then carries the marker) or died; never before.
    data = b""
    while chunk := os.read(read_fd, 32):
        data += chunk
    os.close(read_fd)
    return int(data or b"0")


@registry.tool
def spawn_daemon_and_block(marker: str = "toolpool-daemon", seconds: float = 3600.0) -> int:
    """Leave a daemon behind, then ignore the signal and block in a sleep."""
    spawn_daemon(marker, seconds)
    time.sleep(seconds)
    return 0


@registry.tool
def crash(code: int = 3) -> None:
    """Kill its own worker process at once with ``os._exit(code)``."""
    os._exit(code)


@registry.tool
def fail(message: str = "boom") -> None:
    """Raise an exception: outcome ``error``."""
    raise RuntimeError(message)


@registry.tool
def pid() -> int:
    """The worker's pid."""
    return os.getpid()


@registry.tool
def say(text: str, child: bool = False) -> str:
    """Print ``text`` to stdout (and, with ``child``, have a child process print it too)."""
    print(text)
    if child:
        import subprocess

        subprocess.run([sys.executable, "-c", f"print({text!r} + ' from a child')"], check=True)
    return text
