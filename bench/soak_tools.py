"""The tools of the chaos soak (``bench/soak.py``): ``soak_tools:registry``.

Imported by the pool's worker processes too (they get the soak's ``sys.path``), so it imports
nothing but the standard library, anyio and toolpool.

Every process a tool starts is *tagged*: it execs ``sleep`` with its ``argv[0]`` set to the
call's tag (``tpsoak-<run token>-<call number>``) and the tag in its environment
(:data:`TAG_ENV`), and the tool waits for that exec before going on, so the soak's checker can
find, by an independent scan of the machine, every process a call created. Until its exec a
forked child is a copy of its worker (same command line); the soak's checker looks for those
too.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import anyio

from toolpool import Registry, ToolExecution

__all__ = ("TAG_ENV", "registry")

registry = Registry()

#: The environment variable that carries a tagged process's tag.
TAG_ENV = "TOOLPOOL_SOAK_TAG"

_SLEEP = shutil.which("sleep") or "/bin/sleep"


def _exec_tagged(tag: str, seconds: float) -> None:
    """In a freshly forked child: become ``sleep seconds`` carrying ``tag``. Never returns."""
    try:
        os.execve(_SLEEP, [tag, f"{seconds:.3f}"], {TAG_ENV: tag})
    finally:
        os._exit(127)


def _wait_exec(read_fd: int) -> None:
    """Read ``read_fd`` to its end: every writer (each close-on-exec) has exec'd or exited."""
    try:
        while os.read(read_fd, 64):
            pass
    finally:
        os.close(read_fd)


def _fork_tagged(tag: str, seconds: float) -> int:
    """Fork a child that execs a tagged sleeper; return its pid once it carries the tag."""
    read_fd, write_fd = os.pipe()  # both close-on-exec (PEP 446)
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _exec_tagged(tag, seconds)
    os.close(write_fd)
    _wait_exec(read_fd)
    return pid


def _spawn_daemon(tag: str, seconds: float) -> int:
    """Start a tagged daemon that escapes with ``setsid`` and a double fork; return its pid
    once it carries the tag (it is then no child of the caller: a subreaper adopts it)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the intermediate child
        try:
            os.close(read_fd)
            os.setsid()
            daemon = os.fork()
            if daemon == 0:
                _exec_tagged(tag, seconds)
            os.write(write_fd, str(daemon).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    data = b""
    try:
        while chunk := os.read(read_fd, 64):
            data += chunk
    finally:
        os.close(read_fd)
    os.waitpid(pid, 0)
    return int(data or b"0")


@registry.tool
def quick() -> None:
    """Return at once."""


@registry.tool
def slow(seconds: float, execution: ToolExecution) -> str:
    """A sync sleep that checks its signal: cooperative (``aborted`` when cancelled)."""
    if execution.signal.wait_blocking(seconds):
        execution.signal.raise_if_cancelled()
    return "slept"


@registry.tool
async def nap(seconds: float, execution: ToolExecution) -> str:
    """An async nap that wakes on its signal: cooperative."""
    with anyio.move_on_after(seconds):
        await execution.signal.wait()
        execution.signal.raise_if_cancelled()
    return "napped"


@registry.tool
def stubborn(seconds: float, tag: str = "") -> str:
    """A sync body (in a worker thread) that ignores its signal: only the pool's escalation
    (SIGTERM) stops it early. With ``tag`` it first forks a tagged child."""
    if tag:
        _fork_tagged(tag, 3600.0)
    time.sleep(seconds)
    return "ignored"


@registry.tool
async def deaf(seconds: float, tag: str = "") -> str:
    """Ignore the signal and SIGTERM, and block the worker's event loop (it cannot even read
    the cancel message): only SIGKILL stops it early. With ``tag`` it first forks a tagged
    child. SIGTERM is heeded again once it returns (the worker serves other calls)."""
    if tag:
        _fork_tagged(tag, 3600.0)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # async: on the main thread
    try:
        time.sleep(seconds)  # deliberately blocks the event loop
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return "survived"


@registry.tool
def fork_child(tag: str) -> int:
    """Fork a tagged child that sleeps, and return: the pool kills the leftover."""
    return _fork_tagged(tag, 3600.0)


@registry.tool
def daemon(tag: str, hold: float, execution: ToolExecution) -> int:
    """Leave a tagged setsid double-forked daemon, then wait ``hold`` seconds checking the
    signal (cooperative)."""
    pid = _spawn_daemon(tag, 3600.0)
    if hold > 0 and execution.signal.wait_blocking(hold):
        execution.signal.raise_if_cancelled()
    return pid


@registry.tool
def crash(code: int = 3) -> None:
    """Kill its own worker at once: outcome ``worker_lost``."""
    os._exit(code)


@registry.tool
def fail(message: str = "soak: raised on purpose") -> None:
    """Raise: outcome ``error``."""
    raise RuntimeError(message)
