"""Tool bodies for the benchmark, importable by every peer's workers (fork, spawn, forkserver).

Two views of the same bodies:

- plain functions (``noop``, ``echo``, ``busy``...) for the peers, which pickle a function by
  reference: ``bench/`` must be on the workers' ``sys.path`` (``run.py`` sets ``PYTHONPATH``);
- ``registry``, a :class:`toolpool.Registry` with equivalent tools for toolpool (built on
  first access, so the peers' workers never import toolpool).

The stop and leak bodies report to the harness through small files: ``<tag>.start`` is written
when the body is running (with the worker's pid and a ``time.monotonic()`` stamp, which is
CLOCK_MONOTONIC and so comparable across processes), ``<tag>.end`` when the body itself ends
(it never appears when the process is killed).
"""

import itertools
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import toolpool

LONG = 600.0
"""Seconds a stuck body would run if nobody stopped it (never reached in a run)."""
C_CALL_ITERATIONS = 10**12
"""``sum(itertools.repeat(0, n))``: about 3 ns an iteration, so far longer than any run."""


# --------------------------------------------------------------------------- reporting


def mark(tag: str, kind: str, extra: str = "") -> None:
    """Write ``<tag>.<kind>`` atomically: "pid monotonic [extra]"."""
    if not tag:
        return
    tmp = f"{tag}.{kind}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {time.monotonic()!r} {extra}".strip())
    os.replace(tmp, f"{tag}.{kind}")


def read_mark(tag: str, kind: str) -> tuple[int, float, str] | None:
    """The (pid, monotonic, extra) of a mark, or None if it is not there yet."""
    try:
        with open(f"{tag}.{kind}") as f:
            parts = f.read().split(" ", 2)
    except FileNotFoundError:
        return None
    return int(parts[0]), float(parts[1]), parts[2] if len(parts) > 2 else ""


# --------------------------------------------------------------------------- plain bodies


def noop() -> None:
    return None


def echo(value: Any) -> Any:
    return value


def noop_of(item: Any) -> None:
    """The no-op for ``map``: one item in, nothing out."""
    return None


def pid_nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def block(seconds: float = LONG, tag: str = "") -> str:
    """The load on the pool's other worker: an interruptible sleep."""
    mark(tag, "start")
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return "slept"
    finally:
        mark(tag, "end")


def coop(tag: str = "", seconds: float = LONG) -> str:
    """The most cooperative a peer's body can be: a Python sleep, where signals and
    asynchronous exceptions are handled at once (the peers have no cancel message)."""
    return block(seconds, tag)


def busy(tag: str = "", seconds: float = LONG) -> int:
    """Spin in Python, looking at nothing."""
    mark(tag, "start")
    try:
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            n += 1
        return n
    finally:
        mark(tag, "end")


def ignore_term(tag: str = "", seconds: float = LONG) -> str:
    """Ignore SIGTERM (main thread), then sleep: only SIGKILL stops it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mark(tag, "start")
    try:
        time.sleep(seconds)
        return "survived"
    finally:
        mark(tag, "end")


def swallow(tag: str = "", seconds: float = LONG) -> str:
    """Catch every exception, including the ones a pool raises to stop it, and go on."""
    mark(tag, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            time.sleep(0.01)
        except BaseException:
            pass
    mark(tag, "end")
    return "swallowed"


def c_call(tag: str = "", n: int = C_CALL_ITERATIONS) -> int:
    """One C call that holds the GIL and never checks for signals: Python-level signal
    handlers (and any other thread of the process) do not run until it returns."""
    mark(tag, "start")
    try:
        return sum(itertools.repeat(0, n))
    finally:
        mark(tag, "end")


# --------------------------------------------------------------------------- leak bodies


def _sleeper_argv(marker: str, seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})", marker]


def _start_child(marker: str, seconds: float) -> int:
    # Popen returns after the exec succeeded, so the marker is in the child's cmdline.
    child = subprocess.Popen(
        _sleeper_argv(marker, seconds),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return child.pid


def _start_daemon(marker: str, seconds: float) -> int:
    """setsid and a double fork; returns the daemon's pid once it runs with the marker."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read_fd)
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:  # the daemon
                os.closerange(3, 256)
                os.execv(sys.executable, _sleeper_argv(marker, seconds))
            os.write(write_fd, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    daemon = int(os.read(read_fd, 32) or b"0")
    os.close(read_fd)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:  # wait for the exec, so the marker is visible
        try:
            with open(f"/proc/{daemon}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    break
        except OSError:
            break
        time.sleep(0.002)
    return daemon


def child_block(tag: str = "", marker: str = "", seconds: float = LONG) -> int:
    """Start a child, then block."""
    child = _start_child(marker, seconds)
    mark(tag, "start", str(child))
    time.sleep(seconds)
    return child


def daemon_block(tag: str = "", marker: str = "", seconds: float = LONG) -> int:
    """Leave a double-forked daemon (own session), then block."""
    daemon = _start_daemon(marker, seconds)
    mark(tag, "start", str(daemon))
    time.sleep(seconds)
    return daemon


def child_return(tag: str = "", marker: str = "", seconds: float = LONG) -> int:
    """Start a child and return at once, leaving it running."""
    child = _start_child(marker, seconds)
    mark(tag, "start", str(child))
    return child


# --------------------------------------------------------------------------- floors


def zmq_echo_server(endpoint: str) -> None:
    """The raw pyzmq floor: a ROUTER that decodes each msgpack message and answers it."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops what exceeds its high-water mark
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    while True:
        ident, frame = sock.recv_multipart()
        msg = msgpack.unpackb(frame)
        if msg.get("t") == "stop":
            break
        reply = msgpack.packb({"t": "result", "id": msg["id"], "outcome": "ok", "value": None})
        sock.send_multipart([ident, reply])
    sock.close()
    ctx.term()


def pipe_echo_server(conn: Any) -> None:
    """The multiprocessing.Pipe floor: echo until None."""
    while True:
        msg = conn.recv()
        if msg is None:
            break
        conn.send(msg)


# --------------------------------------------------------------------------- toolpool

_registry: "toolpool.Registry | None" = None


def __getattr__(name: str) -> Any:
    """``bodies.registry`` is built on first use, so that importing this module in a peer's
    worker does not import toolpool (or anyio and zmq) and inflate its memory and start."""
    global _registry
    if name == "registry":
        if _registry is None:
            _registry = _build_registry()
        return _registry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_registry() -> "toolpool.Registry":
    import anyio

    import toolpool

    registry = toolpool.Registry()
    ToolExecution = toolpool.ToolExecution  # annotations are evaluated here, eagerly

    @registry.tool(name="noop")
    def _noop() -> None:
        """Do nothing."""

    @registry.tool(name="echo")
    def _echo(value: Any = None) -> Any:
        """Return the value unchanged."""
        return value

    @registry.tool(name="pid_nap")
    def _pid_nap(seconds: float) -> int:
        """Sleep, then return the worker's pid."""
        return pid_nap(seconds)

    async def _coop(execution: toolpool.ToolExecution, tag: str, seconds: float) -> str:
        mark(tag, "start")
        try:
            with anyio.move_on_after(seconds):
                await execution.signal.wait()
                execution.signal.raise_if_cancelled()
            return "slept"
        finally:
            mark(tag, "end")

    @registry.tool(name="block")
    async def _block(execution: ToolExecution, seconds: float = LONG, tag: str = "") -> str:
        """The load on the other worker: a cooperative sleep."""
        return await _coop(execution, tag, seconds)

    @registry.tool(name="coop")
    async def _coop_tool(execution: ToolExecution, tag: str = "", seconds: float = LONG) -> str:
        """Sleep until cancelled; stop at the cancel signal (outcome ``aborted``)."""
        return await _coop(execution, tag, seconds)

    @registry.tool(name="busy")
    def _busy(tag: str = "", seconds: float = LONG) -> int:
        """Spin in Python, never looking at the signal."""
        return busy(tag, seconds)

    @registry.tool(name="ignore_term")
    async def _ignore_term(tag: str = "", seconds: float = LONG) -> str:
        """Ignore SIGTERM, then block the worker's main thread (and its event loop)."""
        return ignore_term(tag, seconds)

    @registry.tool(name="swallow")
    def _swallow(execution: ToolExecution, tag: str = "", seconds: float = LONG) -> str:
        """Look at the signal, and swallow the AbortError it raises (and everything else)."""
        mark(tag, "start")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                time.sleep(0.01)
                execution.signal.raise_if_cancelled()
            except BaseException:
                pass
        mark(tag, "end")
        return "swallowed"

    @registry.tool(name="c_call")
    def _c_call(tag: str = "", n: int = C_CALL_ITERATIONS) -> int:
        """One C call that holds the GIL and never checks for signals."""
        return c_call(tag, n)

    @registry.tool(name="child_block")
    def _child_block(tag: str = "", marker: str = "", seconds: float = LONG) -> int:
        """Start a child, then block."""
        return child_block(tag, marker, seconds)

    @registry.tool(name="daemon_block")
    def _daemon_block(tag: str = "", marker: str = "", seconds: float = LONG) -> int:
        """Leave a double-forked daemon, then block."""
        return daemon_block(tag, marker, seconds)

    @registry.tool(name="child_return")
    def _child_return(tag: str = "", marker: str = "", seconds: float = LONG) -> int:
        """Start a child and return, leaving it running."""
        return child_return(tag, marker, seconds)

    return registry
