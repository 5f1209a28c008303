"""Test-only tools that attack the wire from inside a worker (CONTRACT C7).

Loaded by real worker processes as ``hostile_tools:registry``: the tests directory is on the
test process's ``sys.path`` (pytest's rootdir-relative insertion), and workers inherit the
supervisor's ``sys.path`` through ``PYTHONPATH``.

Every attacking tool first leaves a setsid double-fork daemon behind (so the test can check the
worker's whole tree is gone), then finds the worker's own zmq PAIR socket by walking the
garbage collector's objects, sends one hostile frame on it, and then waits on its signal for a
while (so a supervisor that failed to react would see an ``ok`` result, not a hang).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import gc
import os
import sys
import time
from typing import Any

import anyio
import msgpack
import zmq

from toolpool import Registry, ToolExecution
from toolpool.protocol import PROTOCOL_VERSION, CancelAck, Fatal, Hello, encode
from toolpool.protocol import ResultMessage as Result
from toolpool.protocol import StartedMessage as Started
from toolpool.testing import examples

registry = Registry()


def worker_socket() -> zmq.Socket[Any]:
    """The worker's connection to the supervisor: its only open zmq PAIR socket."""
    found = [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, zmq.Socket) and not obj.closed and obj.socket_type == zmq.PAIR
    ]
    if len(found) != 1:
        raise RuntimeError(f"expected one open PAIR socket in the worker, found {len(found)}")
    return found[0]


def hostile_frame(kind: str, call_id: int, target: int, size: int) -> list[bytes]:
    """The frame(s) to send for attack ``kind``; ``target`` is another call's id."""
    if kind == "garbage":
        return [b"\xc1\xc1 this is not msgpack \x00\xff"]
    if kind == "truncated":
        return [msgpack.packb(["result", call_id, "ok"])[:-2]]
    if kind == "not_an_array":
        return [msgpack.packb({"type": "result", "call_id": call_id})]
    if kind == "oversized":
        return [msgpack.packb(["pong", 1, b"x" * size])]
    if kind == "unknown_type":
        return [msgpack.packb(["launch_missiles", call_id])]
    if kind == "wrong_arity":
        return [msgpack.packb(["started", call_id, "extra"])]
    if kind == "ext_type":
        return [msgpack.packb(["pong", msgpack.ExtType(1, b"\x00" * 8)])]
    if kind == "killed_outcome":
        # ``killed`` is the supervisor's to say, never the worker's.
        return [encode(Result(call_id, "killed", None, "forged", "Killed", True, {}))]
    if kind == "unhashable_outcome":
        return [msgpack.packb(["result", call_id, [], None, None, None, True, {}])]
    if kind == "result_for_other_call":
        return [encode(Result(target, "ok", msgpack.packb("forged"), None, None, True, {}))]
    if kind == "started_for_other_call":
        return [encode(Started(target))]
    if kind == "started_twice":
        return [encode(Started(call_id))]
    if kind == "cancel_ack_for_other_call":
        return [encode(CancelAck(target))]
    if kind == "second_hello":
        return [encode(Hello(PROTOCOL_VERSION, os.getpid(), b"0" * 64, []))]
    if kind == "late_fatal":
        return [encode(Fatal(b"0" * 64, "not really"))]
    if kind == "bad_value":
        return [encode(Result(call_id, "ok", b"\xc1", None, None, True, {}))]
    if kind in ("missing_part", "spill_beyond", "spill_too_large", "too_many_parts"):
        # A value whose part is out of band, in the worker's spill (issue 26 step 3).
        ref = msgpack.packb(msgpack.ExtType(1, (1 if kind == "missing_part" else 0).to_bytes(4)))
        spill: list[Any] = {
            "missing_part": [0, [16 * 1024]],  # one part, and the value refers to a second
            "spill_beyond": [2 * size, [16 * 1024]],  # (size: 2 x max_frame, the spill's)
            "spill_too_large": [0, [size // 2, size // 2]],  # more than max_frame in all
            "too_many_parts": [0, [1] * 65],
        }[kind]
        extras = {"spill": spill, "kept": True}
        return [encode(Result(call_id, "ok", ref, None, None, True, {}, 0, extras))]
    if kind == "multipart_garbage":
        return [msgpack.packb(["pong", 1]), b"\xc1"]
    if kind == "garbage_then_own_result":
        # One message: nothing after the violation may count, not even a well-formed result.
        return [
            b"\xc1",
            encode(Result(call_id, "ok", msgpack.packb("forged"), None, None, True, {})),
        ]
    raise ValueError(f"unknown attack {kind!r}")


@registry.tool
async def attack(
    kind: str,
    execution: ToolExecution,
    target: int = 0,
    size: int = 0,
    marker: str = "",
    linger: float = 30.0,
) -> str:
    """Leave a daemon behind, send a hostile frame, then wait on the signal."""
    if marker:
        examples.spawn_daemon(marker=marker, seconds=120.0)
    frames = hostile_frame(kind, int(execution.call_id), target, size)
    sock = worker_socket()
    sock.send_multipart(frames)
    with anyio.move_on_after(linger):
        await execution.signal.wait()
    return "the supervisor did not react"


@registry.tool
async def forge_own_result(execution: ToolExecution) -> str:
    """Report its own call's result early, then return normally: a second result follows."""
    forged = Result(int(execution.call_id), "ok", msgpack.packb("forged"), None, None, True, {})
    worker_socket().send(encode(forged))
    return "genuine"


@registry.tool
async def flood_pongs(seconds: float, execution: ToolExecution) -> int:
    """Send well-formed but unsolicited pongs as fast as possible for ``seconds``."""
    sock = worker_socket()
    frame = msgpack.packb(["pong", 7])
    sent = 0
    with anyio.move_on_after(seconds):
        while not execution.signal.cancelled:
            try:
                sock.send(frame, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                await anyio.sleep(0)
            if sent % 1000 == 0:
                await anyio.sleep(0)
    return sent


@registry.tool
async def nap(seconds: float, execution: ToolExecution) -> str:
    """Sleep cooperatively: ends ``aborted`` when cancelled."""
    with anyio.move_on_after(seconds):
        await execution.signal.wait()
        execution.signal.raise_if_cancelled()
    return "rested"


@registry.tool
def echo(value: Any = None) -> Any:
    """Return the value."""
    return value


@registry.tool
def pid() -> int:
    """The worker's pid."""
    return os.getpid()


class Tint(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Where:
    x: int
    y: int


@registry.tool
def typed(tint: Tint, at: datetime.datetime, where: Where) -> list[Any]:
    """What the body received, by type: the arguments are converted before it runs."""
    return [type(tint).__name__, tint.name, at.isoformat(), type(where).__name__, where.x]


@registry.tool
def burn_cpu(seconds: float) -> int:
    """Spin until this thread has used ``seconds`` of CPU, however long that takes here."""
    start = time.thread_time()
    n = 0
    while time.thread_time() - start < seconds:
        n += 1
    return n


@registry.tool
def sized(execution: ToolExecution, value: int, printed: int = 0, context: int = 0) -> bytes:
    """Return ``value`` bytes, after printing ``printed`` characters and attaching
    ``context`` bytes of context."""
    if printed:
        print("x" * printed, flush=True)
    if context:
        execution.attach("blob", b"c" * context)
    return b"v" * value


@registry.tool
async def poke_neighbours(send: bool = False, hold: float = 0.5) -> int:
    """Connect a PAIR socket to every other worker endpoint in the pool's directory."""
    endpoint = sys.argv[sys.argv.index("--endpoint") + 1]
    own = endpoint.removeprefix("ipc://")
    pool_dir = os.path.dirname(os.path.dirname(own))  # <pool dir>/w<N>/sock
    ctx = zmq.Context()
    socks = []
    try:
        for name in sorted(os.listdir(pool_dir)):
            path = os.path.join(pool_dir, name, "sock")
            if path != own and os.path.exists(path):
                sock = ctx.socket(zmq.PAIR)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"ipc://{path}")
                if send:
                    sock.send(b"\xc1", zmq.NOBLOCK)
                socks.append(sock)
        await anyio.sleep(hold)
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    return len(socks)


@registry.tool
def connect_unix_others(paths: dict[str, str]) -> dict[str, str]:
    """Connect a unix stream socket to each path whose key is not this worker's pid:
    'connected' or the errno's name, by key."""
    import errno
    import socket

    outcome = {}
    for key, path in paths.items():
        if key == str(os.getpid()):
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(path)
                outcome[key] = "connected"
            except OSError as exc:
                outcome[key] = errno.errorcode.get(exc.errno or 0, str(exc))
    return outcome


@registry.tool
def list_others(paths: dict[str, str]) -> dict[str, list[str] | str]:
    """``list_directory`` for each path whose key is not this worker's pid, by key."""
    return {key: list_directory(path) for key, path in paths.items() if key != str(os.getpid())}


@registry.tool
def list_directory(path: str) -> list[str] | str:
    """The entries of ``path``, or the errno's name if it cannot be listed."""
    import errno

    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))


@registry.tool
def find_in_memory(pattern: str) -> dict[str, int]:
    """Look for ``pattern`` (a bytes regex, given as text) in this worker's initial environment
    block (/proc/self/environ) and in all of its readable memory: match counts."""
    import ctypes
    import re

    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: a uid change cleared it
    regex = re.compile(pattern.encode())
    with open("/proc/self/environ", "rb") as f:
        in_environ = len(regex.findall(f.read()))
    in_memory = 0
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            name = fields[5] if len(fields) > 5 else ""
            if not fields[1].startswith("r") or name in ("[vvar]", "[vsyscall]", "[vvar_vclock]"):
                continue
            try:
                mem.seek(start)
                in_memory += len(regex.findall(mem.read(end - start)))
            except OSError:
                continue
    return {"environ": in_environ, "memory": in_memory}


@registry.tool
def make_sysv_shm(key: int) -> int:
    """Create a System V shared memory segment under ``key`` (mode 0666): its id."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    shmid = int(libc.shmget(ctypes.c_int(key), ctypes.c_size_t(4096), 0o1000 | 0o666))
    if shmid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    return shmid


_KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl


@registry.tool
def add_user_key(description: str, payload: str) -> int:
    """Add a 'user' key to the uid's user keyring (@u): its serial."""
    import ctypes
    import platform

    add_key, _ = _KEY_SYSCALLS[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    data = payload.encode()
    serial = int(
        libc.syscall(add_key, b"user", description.encode(), data, len(data), ctypes.c_long(-4))
    )
    if serial < 0:
        raise OSError(ctypes.get_errno(), "add_key")
    return serial


@registry.tool
def find_user_key(description: str) -> str:
    """Look for a 'user' key in the uid's user keyring: 'found' or the errno's name."""
    import ctypes
    import errno
    import platform

    _, keyctl = _KEY_SYSCALLS[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    serial = libc.syscall(keyctl, 10, ctypes.c_long(-4), b"user", description.encode(), 0)
    if serial < 0:
        return errno.errorcode.get(ctypes.get_errno(), "?")
    return "found"


@registry.tool
def leave_hidden_leftover(marker: str, how: str) -> int:
    """Leave a process behind that the worker's own count misses: ``how="patch"`` makes the
    worker's checks say it has no children and its cgroup no other member (only the
    supervisor's own look at the cgroup then finds it); ``how="clone_parent"`` starts the
    process with clone(CLONE_PARENT), so it is the worker's parent's (the reaper's) child,
    not the worker's (its own cgroup check finds it, and the supervisor's).
    Returns the process's pid, once the shell has started its sleep: two processes left."""
    import ctypes
    import platform
    import signal
    import subprocess
    import time

    import psutil

    command = ["/bin/sh", "-c", f"sleep 600; : {marker}"]
    if how == "patch":
        import toolpool.worker._server as worker_server

        worker_server._has_children = lambda: False  # type: ignore[attr-defined]
        worker_server.others_listed = lambda listed, pid: 0  # type: ignore[attr-defined]
        pid = subprocess.Popen(command, start_new_session=True).pid
    else:
        clone = {"x86_64": 56, "aarch64": 220}[platform.machine()]
        python = ctypes.PyDLL(None)  # holds the GIL across the raw clone
        python.syscall.restype = ctypes.c_long
        # Everything the child needs is made before the clone: a raw clone of a process with
        # threads (the worker's) copies no lock holder, so the child must not allocate or take
        # a lock before its exec. It calls execv(2) and _exit(2) straight from libc.
        path = ctypes.c_char_p(command[0].encode())
        argv = (ctypes.c_char_p * (len(command) + 1))(*[a.encode() for a in command], None)
        execv, exit_now = python.execv, python._exit
        pid = int(python.syscall(clone, 0x00008000 | signal.SIGCHLD, 0, 0, 0, 0))  # CLONE_PARENT
        if pid == 0:
            execv(path, argv)
            exit_now(1)
    shell = psutil.Process(pid)
    limit = 20.0  # (the test's own timeout is 60 s: this must say why first)
    deadline = time.monotonic() + limit
    # The shell forks its sleep on its own time; no event says when: a bounded poll.
    while not shell.children():
        status: str = "gone"
        cmdline: list[str] = []
        try:
            status, cmdline = shell.status(), shell.cmdline()
        except psutil.Error:
            pass
        dead = status in (psutil.STATUS_ZOMBIE, "gone")
        if dead or time.monotonic() > deadline:
            stuck = cmdline != command and not dead
            raise RuntimeError(
                f"process {pid} ({how}) did not start the sleep of {command}"
                f"{'' if dead else f' within {limit:.0f} s'}: it is {status}, running "
                f"{cmdline}{' (not yet exec-ed: stuck before its exec)' if stuck else ''}"
            )
        time.sleep(0.001)
    return pid


@registry.tool
def write_here(name: str, text: str) -> str:
    """Write ``text`` to ``name`` in the working directory; read it back."""
    with open(name, "w") as f:
        f.write(text)
    with open(name) as f:
        return f.read()


def worker_ledger() -> Any:
    """The worker's ledger: the shared mapping it writes before taking up a call."""
    import mmap

    from toolpool.protocol._ledger import LEDGER_SIZE

    found = [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, mmap.mmap)
        and not obj.closed
        and len(obj) >= LEDGER_SIZE  # (the spill follows)
    ]
    if len(found) != 1:
        raise RuntimeError(f"expected one ledger mapping in the worker, found {len(found)}")
    return found[0]


@registry.tool
def erase_ledger_and_exit() -> None:
    """Clear the ledger's marks (as if no call was ever taken up here) and exit the worker,
    all without letting its loop run (so no 'started' is sent): a call that seems never to
    have been taken up, each time it runs."""
    sys.setswitchinterval(1000.0)  # keep the GIL: the worker's loop never turns again
    worker_ledger()[0:16] = bytes(16)
    os._exit(3)


@registry.tool
async def erase_ledger_and_wait(ready: str, execution: ToolExecution, seconds: float = 30.0) -> str:
    """Clear the ledger's marks (as if no call was ever taken up here), say so on the unix
    socket ``ready``, then wait on the signal: a body that started, hiding it from the ledger."""
    import socket

    worker_ledger()[0:16] = bytes(16)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(ready)
        sock.sendall(str(os.getpid()).encode())
    with anyio.move_on_after(seconds):
        await execution.signal.wait()
    return "waited"


@registry.tool
def marked_alive(marker: str) -> int:
    """How many live processes carry ``marker`` in their command line."""
    import psutil

    return sum(
        1
        for p in psutil.process_iter(["cmdline", "status"])
        if p.info.get("status") != psutil.STATUS_ZOMBIE
        and any(marker in arg for arg in p.info.get("cmdline") or [])
    )


@registry.tool
def hold_gil(seconds: float) -> float:
    """Block for ``seconds`` inside C code that keeps the GIL (as a long computation in a C
    extension can): no other thread of the worker, its loop included, runs meanwhile."""
    import ctypes

    ctypes.PyDLL(None).usleep(ctypes.c_uint(int(seconds * 1e6)))
    return seconds


@registry.tool
def keep_queue_hostage(queued: int = 0) -> int:
    """Once ``queued`` calls wait in its worker's queue, patch the worker so that it neither
    takes up nor gives back the calls waiting there (nor any later one), then return how many
    wait: they wait there for good."""
    import toolpool.worker._main as worker_main

    (server,) = [obj for obj in gc.get_objects() if isinstance(obj, worker_main._Server)]
    deadline = time.monotonic() + 10
    machine = server.machine  # (its decisions: worker/_machine.py)
    while len(machine.queue) < queued and time.monotonic() < deadline:
        time.sleep(0.001)  # no event to wait on: the worker's loop appends to its queue

    # Its main thread takes up nothing more. (It still sends the results it
    # holds back: its own call's result is one of them.)
    machine_class = type(machine)
    machine_class._may_take = lambda self: False  # type: ignore[method-assign]
    machine_class._withdraw = lambda self, out, call_id: None  # type: ignore[method-assign]
    return len(machine.queue)


@registry.tool
async def forge_ledger_then_garbage(execution: ToolExecution, seconds: float = 30.0) -> str:
    """Keep a forged 'ok' result for its own call in the ledger, as the worker's next result,
    then break the protocol (a garbage frame) and wait on the signal."""
    from toolpool.protocol._ledger import write_slot
    from toolpool.worker._main import _Server

    (server,) = [obj for obj in gc.get_objects() if isinstance(obj, _Server)]
    call_id = int(execution.call_id)
    forged = Result(call_id, "ok", msgpack.packb("forged"), None, None, True, {})
    write_slot(worker_ledger(), 0, server.machine.results + 1, encode(forged))
    worker_socket().send(hostile_frame("garbage", call_id, 0, 0)[0])
    with anyio.move_on_after(seconds):
        await execution.signal.wait()
    return "the supervisor did not react"
