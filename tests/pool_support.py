"""Helpers for the pool tests: tools that announce their body started, and psutil checks.

``pool_support:registry`` is imported by the worker processes too (workers see the test
process's ``sys.path``), so this module imports nothing heavier than toolpool and psutil.

The registry holds every example tool of :mod:`toolpool.testing.examples`, unchanged, plus
``ready_*`` variants: they connect to a unix socket named by their ``ready`` argument and send
``"<worker pid> [<daemon pid>]"`` as the first thing the body does, then behave exactly like the
example they wrap. A test awaits that connection (an event, not a sleep) to know that the
body is running before it cancels the call.
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import psutil
import zmq

import toolpool
from toolpool import Registry, ToolExecution
from toolpool.testing import examples

__all__ = (
    "CANCEL_GRACE",
    "EXAMPLES",
    "TERM_GRACE",
    "TOOLS",
    "Readiness",
    "alive",
    "approving",
    "assert_pool_closed",
    "find_by_marker",
    "new_marker",
    "pool_processes",
    "process_tree",
    "registry",
    "running_pool",
    "workers_of_reaper",
)

EXAMPLES = "toolpool.testing.examples:registry"
TOOLS = "pool_support:registry"
#: Grace periods for the escalation tests: long enough for a cooperative tool on a loaded
#: machine, short enough to keep the suite fast.
CANCEL_GRACE = 1.0
TERM_GRACE = 1.0

registry = Registry()
for _fn in (
    examples.echo,
    examples.noop,
    examples.nap,
    examples.sync_nap,
    examples.busy_loop,
    examples.ignore_sigterm,
    examples.spawn_daemon,
    examples.spawn_daemon_and_block,
    examples.crash,
    examples.fail,
    examples.pid,
):
    registry.add_tool(_fn)


class FakeWorkerSocket:
    """Stands in for a worker's PAIR socket in white-box tests of the pool: what the test (or
    a subclass's ``send``) puts in ``inbox`` is what the supervisor reads next."""

    closed = False

    def __init__(self) -> None:
        self.inbox: collections.deque[bytes] = collections.deque()

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        raise NotImplementedError

    def send_multipart(self, frames: list[bytes], flags: int = 0, copy: bool = True) -> None:
        for frame in frames:
            self.send(frame, flags, copy)

    def get(self, option: int) -> int:
        assert option == zmq.EVENTS
        return int(zmq.POLLIN) if self.inbox else 0

    getsockopt = get

    def recv(self, flags: int = 0) -> bytes:
        return self.inbox.popleft()

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        return [self.inbox.popleft()]  # each entry in the inbox is one single-part message


def thread_name() -> str:
    """The name of the thread the body runs in."""
    return threading.current_thread().name


def reach_the_loop() -> bool:
    """A sync body that calls into its worker's event loop; True if that ran elsewhere."""
    return bool(anyio.from_thread.run_sync(threading.get_ident) != threading.get_ident())


def fork_and_return() -> int:
    """A careless sync body: it forks, and both processes return (the child never exits)."""
    os.fork()
    return os.getpid()


def append_pid(path: str) -> int:
    """Append the pid of the process that runs the body to the file ``path``, one a line."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return os.getpid()


registry.add_tool(thread_name)
registry.add_tool(reach_the_loop)
registry.add_tool(fork_and_return)
registry.add_tool(append_pid)

#: Tools whose approval may wait (``gated``'s approval sleeps ``seconds``), for the tests
#: of what a worker does while a call sits in a stage before its body.
approving = Registry()
approving.add_tool(examples.echo)
approving.add_tool(thread_name)


@approving.tool
def gated(seconds: float) -> str:
    """A sync body behind an approval that takes ``seconds``."""
    return "approved"


@approving.approval
async def _approve_slowly(execution: ToolExecution) -> bool:
    """Takes ``seconds`` to approve ``gated``; a cancel ends the wait (cooperative)."""
    if execution.tool == "gated":
        with anyio.move_on_after(float(execution.args["seconds"])):
            await execution.signal.wait()
        execution.signal.raise_if_cancelled()
    return True


def _wipe_ledger_marks() -> None:
    """Zero the marks of this worker's ledger, as tool code that turned on its worker could."""
    import gc

    (server,) = [o for o in gc.get_objects() if type(o).__name__ == "_Server"]
    server.ledger[0:16] = bytes(16)


@registry.tool
def wipe_ledger_and_exit(delay: float = 0.0) -> None:
    """After ``delay``, make the ledger say no call was taken up, and kill the worker. With no
    delay it keeps the GIL from the start, so its worker hardly ever says 'started'."""
    import sys

    if delay:
        time.sleep(delay)
    else:
        sys.setswitchinterval(1e6)
    _wipe_ledger_marks()
    os._exit(9)


@registry.tool
def ready_wipe_ledger_and_hold_the_gil(ready: str) -> None:
    """Announce, make the ledger say no call was taken up, then keep the GIL for good: the
    worker's loop never runs again (no 'started', no answer to a cancel)."""
    import sys

    sys.setswitchinterval(1e6)
    _wipe_ledger_marks()
    _announce(ready)  # (its socket calls let the loop run for a moment)
    while True:
        pass


@registry.tool
def tree_size() -> int:
    """How many processes the worker has below it (a leftover of an earlier call counts)."""
    return len(psutil.Process().children(recursive=True))


#: Not a Registry: a tools spec naming it must fail at pool start.
not_a_registry = 42


def broken_registry() -> Registry:
    """A registry factory that raises: the worker cannot load its tools."""
    raise RuntimeError("pool_support: this registry factory is broken on purpose")


# --------------------------------------------------------------------------- ready_* tools


def _announce(ready: str, *pids: int) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(ready)
        sock.sendall(" ".join(str(p) for p in (os.getpid(), *pids)).encode())


@registry.tool
async def ready_nap(ready: str, seconds: float, execution: ToolExecution) -> str:
    """Announce, then ``examples.nap`` (cooperative, async)."""
    _announce(ready)
    return await examples.nap(seconds, execution)


@registry.tool
def ready_sync_nap(ready: str, seconds: float, execution: ToolExecution) -> str:
    """Announce, then ``examples.sync_nap`` (cooperative, in a thread)."""
    _announce(ready)
    return examples.sync_nap(seconds, execution)


@registry.tool
def ready_busy_loop(ready: str, seconds: float = 3600.0) -> int:
    """Announce, then ``examples.busy_loop`` (ignores its signal; dies on SIGTERM)."""
    _announce(ready)
    return examples.busy_loop(seconds)


@registry.tool
async def ready_ignore_sigterm(ready: str, seconds: float = 3600.0) -> str:
    """Announce, then ``examples.ignore_sigterm`` (only SIGKILL stops it)."""
    _announce(ready)
    return await examples.ignore_sigterm(seconds)


def _wait_for_exec(pid: int, marker: str) -> None:
    """Wait (briefly) until the daemon ``pid`` has exec'd: its cmdline holds ``marker``.

    ``examples.spawn_daemon`` returns as soon as the daemon knows its pid, which can be just
    before its exec. There is no event for an exec, hence the short poll.
    """
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    return
        except OSError:
            return
        time.sleep(0.001)


@registry.tool
def spawn_daemon_execd(marker: str, seconds: float = 3600.0) -> int:
    """``examples.spawn_daemon``, returning once the daemon carries ``marker`` in its argv."""
    daemon = examples.spawn_daemon(marker, seconds)
    _wait_for_exec(daemon, marker)
    return daemon


@registry.tool
def ready_child_and_block(ready: str, marker: str, seconds: float = 3600.0) -> int:
    """Start a plain child (in the worker's session and process group, ``marker`` in its
    argv), announce it, then block."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", marker])
    _wait_for_exec(child.pid, marker)
    _announce(ready, child.pid)
    time.sleep(seconds)
    return 0


@registry.tool
def ready_spawn_daemon_and_block(ready: str, marker: str, seconds: float = 3600.0) -> int:
    """``examples.spawn_daemon_and_block`` with an announcement after the daemon exists.

    The announcement carries the daemon's pid and is sent once the daemon has exec'd (its
    cmdline holds ``marker``), so the test can find it machine-wide by its marker.
    """
    daemon = examples.spawn_daemon(marker, seconds)
    _wait_for_exec(daemon, marker)
    _announce(ready, daemon)
    time.sleep(seconds)
    return 0


# --------------------------------------------------------------------------- the test side


class Readiness:
    """The listening side of the ``ready_*`` tools' announcements.

    Use ``async with Readiness.open() as ready:``, pass ``ready.path`` as the tool's ``ready``
    argument, and ``await ready.started()`` to get the announcing worker's pids.
    """

    def __init__(self, listener: anyio.abc.SocketListener, path: str) -> None:
        self._listener = listener
        self.path = path

    @classmethod
    @asynccontextmanager
    async def open(cls) -> AsyncIterator[Readiness]:
        directory = tempfile.mkdtemp(prefix="tp-ready-")  # short: unix socket paths are limited
        path = os.path.join(directory, "s")
        try:
            listener = await anyio.create_unix_listener(path)
            async with listener:
                yield cls(listener, path)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    async def started(self, timeout: float = 15.0) -> list[int]:
        """Wait for the next announcement; return ``[worker pid, *other pids]``."""
        with anyio.fail_after(timeout):
            stream = await self._listener.accept()
            data = b""
            async with stream:
                try:
                    while True:
                        data += await stream.receive()
                except anyio.EndOfStream:
                    pass
        return [int(p) for p in data.split()]


def new_marker() -> str:
    """A marker unique machine-wide, for a daemon's argv."""
    return f"toolpool-test-daemon-{uuid.uuid4().hex}"


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants, as psutil handles (safe against pid reuse)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pool_processes(pool: Any) -> list[psutil.Process]:
    """The pool's reaper, its workers and everything they spawned."""
    reaper = pool.reaper_pid
    assert reaper is not None
    procs = process_tree(reaper)
    assert procs, "the pool's reaper is not running"
    return procs


def alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The processes that still exist, zombies included (a zombie is not reaped yet)."""
    return [p for p in procs if p.is_running()]


def find_by_marker(marker: str) -> list[psutil.Process]:
    """Every process on the machine whose command line contains ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any(marker in part for part in cmdline):
            found.append(proc)
    return found


def workers_of_reaper(reaper_pid: int) -> list[psutil.Process]:
    """Every worker process on the machine started by the reaper ``reaper_pid``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        for i, part in enumerate(cmdline[:-1]):
            if part == "--parent-pid" and cmdline[i + 1] == str(reaper_pid):
                found.append(proc)
                break
    return found


# --------------------------------------------------------------------------- pools


@asynccontextmanager
async def running_pool(
    tools: str = TOOLS,
    *,
    workers: int = 1,
    cancel_grace: float = CANCEL_GRACE,
    term_grace: float = TERM_GRACE,
    **kwargs: Any,
) -> AsyncIterator[toolpool.Pool]:
    """A started pool; on a normal exit, close it and check it left nothing behind."""
    pool = toolpool.Pool(
        tools, workers=workers, cancel_grace=cancel_grace, term_grace=term_grace, **kwargs
    )
    async with pool:
        yield pool
        procs = pool_processes(pool)
        reaper_pid = pool.reaper_pid
    assert reaper_pid is not None
    assert_pool_closed(pool, procs, reaper_pid)


def assert_pool_closed(pool: toolpool.Pool, procs: list[psutil.Process], reaper_pid: int) -> None:
    """Every process of the pool is gone and every call it took settled."""
    assert alive(procs) == [], "processes of the pool outlived aclose()"
    assert workers_of_reaper(reaper_pid) == []
    assert pool.worker_pids == []
    stats = pool.statistics()
    # (stats.queued is checked in test_statistics_queued_excludes_settled_calls: see there.)
    assert stats.in_flight == 0
    assert sum(stats.settled.values()) == stats.submitted


def int_keyed() -> dict[int, str]:
    """A result msgpack packs but the wire refuses (a map key that is not a string)."""
    return {1: "one"}


def unserializable_context(execution: ToolExecution) -> str:
    """Attach what cannot be carried in a result's context, and return normally."""
    looped: list[Any] = []
    looped.append(looped)
    execution.attach("int_keyed", {1: 2})
    execution.attach("looped", looped)
    execution.attach("fine", [1, "two"])
    return "returned"


registry.add_tool(int_keyed)
registry.add_tool(unserializable_context)
