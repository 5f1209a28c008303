"""The hostile-tool kit: misbehaving tools, each with the outcome and guarantees it must produce.

``toolpool.testing.hostile:registry`` holds the tools; :data:`THREATS` says how to call each
and what must happen; :func:`run_kit` runs them against a live pool and returns a verdict per
threat (``toolpool selftest`` prints them). Every tool is bounded: without limits it still
stops (a fork bomb at a few hundred processes, a memory hog at 1 GiB), so the kit is safe to run
on a machine with no containment at all. Processes the tools start carry a marker in their
argv, so a run can check machine-wide that none survived.

Tools are meant to run in toolpool workers. Do not call them in your own process.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import resource
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import psutil

from ..worker import Registry, ToolExecution

__all__ = ("THREATS", "Judgement", "Setting", "Status", "Threat", "Verdict", "registry", "run_kit")

registry = Registry()


def _sleeper_argv(marker: str, seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})", marker]


def _daemonize(marker: str, seconds: float) -> None:
    """Start a grandchild that escapes with setsid and a double fork; return once it runs
    the sleeper (its cmdline bears ``marker``): the end of a close-on-exec pipe closes at its
    exec, so whoever looks for the marker after the call finds it."""
    ready, done = os.pipe()  # (both close on exec)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                os.execvp(sys.executable, _sleeper_argv(marker, seconds))
        finally:
            os._exit(0)
    os.close(done)
    try:
        while os.read(ready, 1):
            pass  # (nothing is written: EOF once every copy of ``done`` is closed)
    finally:
        os.close(ready)
    os.waitpid(pid, 0)


@registry.tool
def fork_bomb(marker: str, cap: int = 400) -> int:
    """Fork until fork fails or ``cap`` processes exist, then block. Children block too."""
    made = 0
    for _ in range(cap):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            try:
                os.execvp(sys.executable, _sleeper_argv(marker, 3600))
            finally:
                os._exit(0)
        made += 1
    time.sleep(3600)
    return made


@registry.tool
def memory_hog(cap_mib: int = 1024) -> int:
    """Allocate and touch memory in 32 MiB chunks up to ``cap_mib``, then block."""
    chunks = []
    for _ in range(cap_mib // 32):
        chunks.append(b"\x01" * (32 * 1024 * 1024))  # written, so really resident
    time.sleep(3600)
    return len(chunks)


@registry.tool
def infinite_recursion() -> None:
    """Recurse without end."""

    def down(n: int) -> int:
        return down(n + 1) + 1

    down(0)


@registry.tool
async def sigterm_ignoring_loop() -> None:
    """Ignore SIGTERM and the signal; block the worker's event loop in a busy loop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        pass


@registry.tool
def daemon(marker: str) -> str:
    """Leave a setsid'd double-forked daemon behind and return."""
    _daemonize(marker, 3600)
    return "daemon started"


@registry.tool
def fd_exhaustion(cap: int = 100_000) -> dict[str, Any]:
    """Open files until the process runs out of descriptors (EMFILE) or ``cap`` are open;
    return how many it opened, whether EMFILE stopped it, and the soft ``RLIMIT_NOFILE`` it
    ran under (what stopped it)."""
    files = []
    emfile = False
    try:
        for _ in range(cap):
            files.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
        emfile = True
    finally:
        for fd in files:
            os.close(fd)
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return {"opened": len(files), "emfile": emfile, "limit": limit}


@registry.tool
def output_flood(mib: int = 64) -> int:
    """Write ``mib`` MiB to stdout and stderr."""
    block = b"x" * (1024 * 1024)
    for _ in range(mib):
        os.write(1, block)
        os.write(2, block)
    return mib


@registry.tool
def close_stdio() -> str:
    """Close the worker's stdin, stdout and stderr."""
    for fd in (0, 1, 2):
        try:
            os.close(fd)
        except OSError:
            pass
    return "closed"


@registry.tool
def hard_exit(code: int = 7) -> None:
    """``os._exit``: the worker vanishes mid-call."""
    os._exit(code)


@registry.tool
def segfault() -> None:
    """Read address 0 through ctypes."""
    ctypes.string_at(0)


@registry.tool
def kill_own_worker() -> None:
    """SIGKILL the worker process it runs in."""
    os.kill(os.getpid(), signal.SIGKILL)


def _try_signal(pid: int | None) -> str:
    if pid is None:
        return "none"
    try:
        os.kill(pid, signal.SIGURG)  # ignored by default: harmless if it gets through
    except PermissionError:
        return "blocked"
    except ProcessLookupError:
        return "gone"
    return "delivered"


@registry.tool
def signal_others(workers: list[int] | None = None) -> dict[str, str]:
    """Try to signal the reaper, the supervisor and (given the pool's ``workers``) a sibling
    worker, with harmless SIGURG; ``"none"`` where there was no sibling to signal."""
    reaper = os.getppid()
    try:
        supervisor: int | None = psutil.Process(reaper).ppid()
    except psutil.Error:
        supervisor = None
    tried = {"reaper": _try_signal(reaper), "supervisor": _try_signal(supervisor)}
    if workers is not None:
        tried["sibling"] = _try_signal(next((p for p in workers if p != os.getpid()), None))
    return tried


@registry.tool
def reach_network(port: int = 9) -> str:
    """Connect to 127.0.0.1 (loopback only: never another address); return what happened."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(("127.0.0.1", port))
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc))
    return "connected"


@registry.tool
def leave_cgroup(marker: str, block: bool = True) -> str:
    """Try to move itself into the root cgroup, then start a daemon and block (or, with
    ``block=False``, only report whether the move worked)."""
    outcome = "no cgroup v2"
    with open("/proc/self/mountinfo") as f:
        mounts = f.read().splitlines()
    for line in mounts:
        if " - cgroup2 " in line:
            root = line.split()[4]
            try:
                with open(os.path.join(root, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
                outcome = "escaped"
            except OSError as exc:
                outcome = f"blocked ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
            break
    if not block:
        return outcome
    _daemonize(marker, 3600)
    time.sleep(3600)
    return outcome


@registry.tool
async def garbage_frames() -> None:
    """Find the worker's own zmq socket and write garbage and an oversized frame on it."""
    import zmq

    for obj in gc.get_objects():
        if isinstance(obj, zmq.Socket) and not obj.closed and obj.socket_type == zmq.PAIR:
            obj.send(b"\xc1garbage")
            obj.send(b"\x00" * (obj.getsockopt(zmq.MAXMSGSIZE) + 1))  # type: ignore[operator]
    await anyio.sleep(3600)


@registry.tool
def sleep_past_timeout(seconds: float = 3600.0) -> str:
    """Sleep, ignoring its signal, far past the call's timeout."""
    time.sleep(seconds)
    return "woke"


def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc))


def _nest(top: int, depth: int) -> None:
    """``depth`` directories nested in the directory ``top``, with no limit on path length."""
    fd = os.dup(top)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


@registry.tool
def litter_scratch(
    depth: int = 3000, files: int = 2000, outside: str = "", leave: str = "return"
) -> dict[str, Any]:
    """Leave in the scratch directory (the working directory) what a clean-up must get
    through: ``depth`` nested directories, ``files`` small files, names that are not UTF-8,
    directories its own mode makes unreadable and unwritable, a FIFO, a unix socket, symbolic
    links out (to ``/`` and to ``outside``) and, where the kernel lets it, a hard link to the
    file ``outside``. Then ``leave="return"`` (its directory and what it made) or ``"exit"``
    (``os._exit``: the worker dies with it, so its clean-up starts at once)."""
    here = os.getcwd()
    made: dict[str, Any] = {"cwd": here}
    top = os.open(here, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _nest(top, depth)
        os.mkdir("many", dir_fd=top)
        many = os.open("many", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
        try:
            for i in range(files):
                os.close(os.open(f"{i}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=many))
        finally:
            os.close(many)
        raw = os.fsencode(here)
        os.mkdir(raw + b"/\xff\xfe-not-utf8")
        with open(raw + b"/\xff\xfe-not-utf8/\x80\x81", "wb") as f:
            f.write(b"x")
        os.makedirs("closed/inner/deeper")
        with open("closed/inner/file", "w") as f:
            f.write("x")
        os.chmod("closed/inner/file", 0)
        os.chmod("closed/inner", 0)
        os.chmod("closed", 0o100)  # searchable but not readable or writable
        os.mkfifo("fifo")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(os.path.join(here, "sock"))
        os.symlink("/", "to-root")
        if outside:
            os.symlink(os.path.dirname(outside), "to-outside")
            try:
                os.link(outside, "hard-link")
                made["hard_link"] = "made"
            except OSError as exc:
                made["hard_link"] = _errname(exc)
    finally:
        os.close(top)
    if leave == "exit":
        os._exit(9)
    return made


def _try(op: Callable[[], object]) -> str:
    try:
        op()
    except OSError as exc:
        return f"blocked ({_errname(exc)})"
    return "done"


#: What :func:`touch_outside` tries, by kind: content, names, and metadata.
CONTENT_OPS = ("write", "truncate", "create")
NAME_OPS = ("rename", "link", "symlink", "mknod", "mkdir", "unlink")
METADATA_OPS = tuple(
    f"{op} {what}"
    for op in ("utime", "chmod", "chown", "setxattr", "removexattr")
    for what in ("file", "dir")
)


def _metadata_ops(what: str, path: str) -> dict[str, Callable[[], object]]:
    mode = 0o777 if what == "dir" else 0o666
    return {
        f"utime {what}": lambda: os.utime(path, None),  # "now": write access is enough
        f"chmod {what}": lambda: os.chmod(path, mode),
        f"chown {what}": lambda: os.chown(path, os.getuid(), os.getgid()),
        f"setxattr {what}": lambda: os.setxattr(path, "user.x", b"tool"),
        f"removexattr {what}": lambda: os.removexattr(path, "user.toolpool"),
    }


@registry.tool
def touch_outside(directory: str) -> dict[str, str]:
    """Try to change, outside the scratch directory, the world-writable ``directory`` and
    its world-writable ``file`` (which carries the attribute ``user.toolpool``): write,
    truncate and create files; rename, link, symlink, mknod, mkdir, unlink; and their
    metadata: utime, chmod, chown, setxattr, removexattr, on the file and the directory.
    Returns what happened to each ('done' or 'blocked (ERRNO)')."""
    file = os.path.join(directory, "file")

    def write() -> None:
        fd = os.open(file, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"tool was here\n")
        finally:
            os.close(fd)

    def create() -> None:
        os.close(os.open(os.path.join(directory, "new"), os.O_WRONLY | os.O_CREAT, 0o666))

    ops: dict[str, Callable[[], object]] = {
        "write": write,
        "truncate": lambda: os.truncate(file, 0),
        "create": create,
        "rename": lambda: os.rename(file, os.path.join(directory, "renamed")),
        "link": lambda: os.link(file, os.path.join(directory, "linked")),
        "symlink": lambda: os.symlink("/", os.path.join(directory, "symlinked")),
        "mknod": lambda: os.mknod(os.path.join(directory, "fifo"), 0o666 | stat.S_IFIFO),
        "mkdir": lambda: os.mkdir(os.path.join(directory, "made")),
        "unlink": lambda: os.unlink(file),
    }
    for what, path in (("file", file), ("dir", directory)):
        ops.update(_metadata_ops(what, path))
    order = (*METADATA_OPS, *CONTENT_OPS, *NAME_OPS)  # unlink last: the others need the file
    return {name: _try(ops[name]) for name in order}


@registry.tool
def echo(value: Any = None) -> Any:
    """Return the value."""
    return value


@registry.tool
def cooperative(seconds: float, execution: ToolExecution) -> str:
    """A well-behaved tool: the kit checks the pool still serves one after each threat."""
    if execution.signal.wait_blocking(seconds):
        execution.signal.raise_if_cancelled()
    return "fine"


@registry.tool
def environment() -> dict[str, str]:
    """The worker's environment (to check the allowlist)."""
    return dict(os.environ)


@registry.tool
def identity() -> dict[str, object]:
    """Who the tool runs as: uid, gid, supplementary groups, capabilities, no-new-privs."""
    status: dict[str, str] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    return {
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "gid": os.getgid(),
        "groups": os.getgroups(),
        "cap_eff": status.get("CapEff", ""),
        "no_new_privs": status.get("NoNewPrivs", ""),
        "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0],
    }


@registry.tool
def working_directory() -> str:
    """The worker's working directory (its scratch directory when the profile has one)."""
    return os.getcwd()


@registry.tool
def allocate(mib: int) -> int:
    """Allocate and touch ``mib`` MiB, then release it and return (a well-behaved hog)."""
    block = b"\x01" * (mib * 1024 * 1024)
    return len(block) // (1024 * 1024)


# The kit, beside the tools it runs (imported last: it uses the names above).
from ._kit import THREATS as THREATS  # noqa: E402
from ._kit import Judgement as Judgement  # noqa: E402
from ._kit import Observed as Observed  # noqa: E402
from ._kit import Setting as Setting  # noqa: E402
from ._kit import Status as Status  # noqa: E402
from ._kit import Threat as Threat  # noqa: E402
from ._kit import Verdict as Verdict  # noqa: E402
from ._kit import _wait_pid_exit as _wait_pid_exit  # noqa: E402
from ._kit import marker_processes as marker_processes  # noqa: E402
from ._kit import run_kit as run_kit  # noqa: E402
from ._kit import run_threat as run_threat  # noqa: E402
from ._kit import shared_tmp as shared_tmp  # noqa: E402
