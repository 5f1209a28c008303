"""The worker's side of the jail: the zygote it keeps warm, and one child per sample.

The zygote is started once per worker process (as the worker loads its tools, or on its
first sample) as ``python -I -S -c BOOT``: a fresh interpreter that never saw a problem's
tests, with ``_child.py`` and the modules completions commonly use loaded. For each sample
the worker hands it two pipes over a unix socket; it forks a child that jails itself and
runs the completion (``_child.py``) in the worker's scratch directory, which the worker
empties once the sample's processes are gone. No interpreter starts per sample.

When a sample ends, however it ends, :meth:`Child.close` kills the child's session, asks the
zygote to reap the child (its parent), then kills and reaps every process below the worker
that was not there before the sample: a daemon that left the child's session with ``setsid``
and a double fork is reparented to the worker, which in a pool is a child subreaper. Then
the checker empties the scratch directory (:meth:`Zygote.empty`).
"""

from __future__ import annotations

import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Final

from .._tempdir import make_temp_dir
from ..sandbox._linux import children_of, read_proc
from . import _wire

__all__ = (
    "Broken",
    "Cancelled",
    "Child",
    "TimedOut",
    "Wake",
    "Zygote",
    "below",
    "kill_new_processes",
)

#: The longest line the child may send (a longer one is a protocol error: bounded memory).
MAX_REPLY: Final = 1 << 20
#: How long the worker keeps killing what a sample left before it gives up (the pool's own
#: leftover clean-up then kills the rest before the call settles).
KILL_PATIENCE: Final = 5.0
#: Seconds the zygote has to start, and to answer a request.
ZYGOTE_PATIENCE: Final = 30.0
_PACKAGE: Final = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # .../toolpool

# The zygote's program: load _child.py (and what it uses) by path, as stand-in packages whose
# __init__ never runs (no toolpool package, no site-packages), then serve.
BOOT: Final = """
import sys, types
root = sys.argv[1]
for name, sub in (("_tp", ""), ("_tp.eval", "/eval"), ("_tp.sandbox", "/sandbox")):
    module = types.ModuleType(name)
    module.__path__ = [root + sub]
    sys.modules[name] = module
from _tp.eval._child import zygote
zygote(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
"""


# The three are BaseExceptions: a checker's ``except Exception`` must not swallow them.
class TimedOut(BaseException):
    """The sample's time ran out."""


class Cancelled(BaseException):
    """The call's cancel signal fired."""


class Broken(BaseException):
    """The child died, closed its pipe, or sent something that is not a valid reply."""


class Zygote:
    """The warm template process of one worker, and the worker's scratch directory, in which
    every child of the zygote works (one at a time) and which :meth:`empty` empties between
    samples. Started at once; :meth:`fork` waits for it to be ready the first time."""

    def __init__(self) -> None:
        self.directory = make_temp_dir("toolpool-eval-")
        """The children's working directory (the only one they may write to)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    BOOT,
                    _PACKAGE,
                    str(theirs.fileno()),
                    str(os.getpid()),
                    self.directory,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                cwd="/",
                env={},
            )
        except BaseException:
            mine.close()
            _remove(self.directory)
            raise
        finally:
            theirs.close()
        self._sock = mine
        self._ready = False
        self.jail: list[str] = []
        """The layers the zygote applied to itself, which every child inherits."""
        self.failures: list[str] = []

    def wait_ready(self) -> None:
        """Wait until the zygote has started (once). Raises :class:`RuntimeError` if it
        does not."""
        if self._ready:
            return
        ready = _wire.loads(self._answer(time.monotonic() + ZYGOTE_PATIENCE))
        if not isinstance(ready, dict) or ready.get("ready") != self.process.pid:
            raise RuntimeError(f"the zygote did not start: {ready!r}")
        self.jail = [str(j) for j in ready.get("jail") or []]
        self.failures = [str(f) for f in ready.get("failures") or []]
        self._ready = True

    def alive(self) -> bool:
        return self.process.poll() is None

    def _answer(self, deadline: float) -> bytes:
        self._sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            data = self._sock.recv(1 << 16)
        except OSError as exc:  # (socket.timeout included)
            raise RuntimeError(f"the zygote did not answer: {exc}") from None
        if not data:
            raise RuntimeError("the zygote is gone")
        return data

    def fork(self, cpu_seconds: int, request_r: int, reply_w: int) -> int:
        """A new jailed child reading ``request_r`` and writing ``reply_w``, limited to
        ``cpu_seconds`` of CPU; its pid."""
        self.wait_ready()
        socket.send_fds(self._sock, [b"f%d" % cpu_seconds], [request_r, reply_w])
        answer = self._answer(time.monotonic() + ZYGOTE_PATIENCE)
        if not answer.isdigit() or int(answer) <= 0:
            raise RuntimeError(f"the zygote could not fork: {answer!r}")
        return int(answer)

    def reap(self, pid: int) -> int | None:
        """Wait for the child ``pid`` (killed already) and reap it; its wait status."""
        self._sock.send(b"r%d" % pid)
        answer = self._answer(time.monotonic() + ZYGOTE_PATIENCE)
        return int(answer) if answer.isdigit() else None

    def empty(self) -> bool:
        """Empty the scratch directory (every process of the sample is gone by now): remove
        what is in it, whatever its modes, and give the directory its own mode back and no
        extended attribute. False if something is left (the zygote is then of no more use:
        :meth:`close` it)."""
        try:
            os.chmod(self.directory, 0o700)
            for attribute in os.listxattr(self.directory):  # (user.*, ACLs: the child's)
                os.removexattr(self.directory, attribute)
            with os.scandir(self.directory) as entries:
                names = [e.name for e in entries]
            for name in names:
                path = os.path.join(self.directory, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    _rmtree(path, _writable_and_again)
                else:
                    os.unlink(path)
            return not os.listdir(self.directory)
        except OSError:
            return False

    def close(self) -> None:
        """Kill the zygote, reap it, remove the scratch directory. (Once is enough; again
        does nothing.)"""
        self._sock.close()
        if self.process.returncode is None:
            self.process.kill()
            self.process.wait()
        _remove(self.directory)


def _writable_and_again(function: Any, path: str, _info: Any) -> None:
    """``rmtree``'s error handler: a directory the completion made unwritable or
    unreadable (its own, same owner) is given its mode back, and the step retried."""
    parent = os.path.dirname(path)
    for each in (parent, path):
        try:
            if os.path.isdir(each) and not os.path.islink(each):
                os.chmod(each, 0o700)
        except OSError:
            pass
    if function is os.rmdir or function is os.unlink:
        function(path)
    else:  # (scandir, open: the walk itself) once more, from here
        _rmtree(path, _give_up)


def _give_up(_function: Any, _path: str, info: Any) -> None:
    raise info[1]


def _remove(directory: str) -> None:
    try:
        _rmtree(directory, _writable_and_again)
    except OSError:
        pass


class Child:
    """One jailed child running one completion, and the two pipes to it."""

    def __init__(self, zygote: Zygote, cpu_seconds: int, wake: int) -> None:
        self._zygote = zygote
        self._buffer = bytearray()
        self._wake = wake
        self.before = set(below(os.getpid()))
        self.status: int | None = None
        """The child's wait status, once :meth:`close` reaped it."""
        self.clean = False
        """Whether :meth:`close` saw every process of the sample gone."""
        self._closed = False
        request_r, self._request = os.pipe()
        self._reply, reply_w = os.pipe()
        try:
            self.pid = zygote.fork(cpu_seconds, request_r, reply_w)
        except BaseException:
            os.close(self._request)
            os.close(self._reply)
            raise
        finally:
            os.close(request_r)
            os.close(reply_w)
        self.inherited = (zygote.jail, zygote.failures)
        """The zygote's layers and failures, which the child inherits."""
        self._pidfd = os.pidfd_open(self.pid)  # (it is the zygote's, unreaped: no reuse)
        os.set_blocking(self._request, False)
        self._poll = select.poll()
        self._poll.register(self._reply, select.POLLIN)
        self._poll.register(self._wake, select.POLLIN)
        self._out = select.poll()
        self._out.register(self._request, select.POLLOUT)
        self._out.register(self._wake, select.POLLIN)

    def send(self, message: dict[str, Any], deadline: float) -> None:
        data = memoryview(_wire.dumps(message))
        while data:
            events = dict(self._out.poll(_wait(deadline)))
            if self._wake in events:
                raise Cancelled
            if self._request in events:
                try:
                    data = data[os.write(self._request, data) :]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    raise Broken("closed its end of the pipe") from None
            elif not events and time.monotonic() >= deadline:
                raise TimedOut

    def receive(self, deadline: float) -> dict[str, Any]:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                try:
                    message = _wire.loads(line)
                except _wire.NotData as exc:
                    raise Broken(f"sent a line that is {exc}") from None
                if not isinstance(message, dict):
                    raise Broken(f"sent {type(message).__name__} where an object was due")
                return message
            if len(self._buffer) > MAX_REPLY:
                raise Broken(f"sent a line of over {MAX_REPLY:,} bytes")
            events = dict(self._poll.poll(_wait(deadline)))
            if self._wake in events:
                raise Cancelled
            if self._reply in events:
                chunk = os.read(self._reply, 1 << 16)
                if not chunk:
                    raise Broken("closed its end of the pipe")
                self._buffer += chunk
            elif time.monotonic() >= deadline:
                raise TimedOut

    def dead_within(self, seconds: float) -> bool:
        """Whether the child is dead, or dies within ``seconds``."""
        return bool(select.select([self._pidfd], [], [], seconds)[0])

    def close(self) -> None:
        """Kill the child and everything it started; reap them all; close the pipes. (Once:
        later calls do nothing.)"""
        if self._closed:
            return
        self._closed = True
        for fd in (self._request, self._reply):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # its session's group, in one go
        except (ProcessLookupError, PermissionError):
            pass
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.status = self._zygote.reap(self.pid)
        except (RuntimeError, OSError):  # the zygote is gone: the child was reparented to
            pass  # this process (a subreaper in a pool), and the loop below reaps it
        finally:
            os.close(self._pidfd)
            self.clean = kill_new_processes(self.before)


class Wake:
    """A pipe the call's cancel callback writes to, so that a wait on the child wakes at once.
    The callback runs in the cancelling thread, possibly while the body closes the pipe: the
    lock keeps it from writing to a closed (or reused) descriptor."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        self._lock = threading.Lock()
        self._open = True

    def poke(self, _cause: object) -> None:
        with self._lock:
            if self._open:
                try:
                    os.write(self._w, b"!")
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            self._open = False
            os.close(self.fd)
            os.close(self._w)


def describe_status(status: int | None) -> str:
    """A wait status in words."""
    if status is None:
        return "ended (its status is unknown)"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"was killed by {signal.Signals(number).name}"
        except ValueError:
            return f"was killed by signal {number}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _wait(deadline: float) -> int:
    """Milliseconds for poll() until ``deadline`` (at least 0)."""
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


def below(root: int) -> dict[int, int]:
    """Every process below ``root``, as {pid: parent pid}: read from
    ``/proc/<pid>/task/<tid>/children``, walking only this tree (no scan of the machine)."""
    found: dict[int, int] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        for kid in children_of(pid) or ():
            if kid not in found:
                found[kid] = pid
                stack.append(kid)
    return found


def _parent(pid: int) -> int | None:
    try:
        stat = read_proc(f"/proc/{pid}/stat")
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "pid (comm) state"


def kill_new_processes(before: set[int]) -> bool:
    """SIGKILL every process below this one that is not in ``before``, and reap those that
    are this process's own (orphans reparented to it included), until none is left. False
    if some were still there after :data:`KILL_PATIENCE` seconds.

    Each process is pinned with a pidfd before it is signalled, and signalled only if it is
    still in the tree then: a pid reused meanwhile names someone else's process."""
    me = os.getpid()
    give_up = time.monotonic() + KILL_PATIENCE
    while True:
        tree = below(me)
        found = [pid for pid in tree if pid not in before]
        killed: list[int] = []
        for pid in found:
            try:
                pinned = os.pidfd_open(pid)
            except OSError:
                continue  # gone already
            try:
                parent = _parent(pid)
                if parent == me or parent in tree:
                    signal.pidfd_send_signal(pinned, signal.SIGKILL)
                    killed.append(pid)
            except OSError:
                pass
            finally:
                os.close(pinned)
        for pid in killed:
            if tree.get(pid) == me or _parent(pid) == me:  # ours to reap
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
        if not found:
            return True
        if time.monotonic() > give_up:
            return False


def _rmtree(path: str, onerror: Any) -> None:
    import shutil  # (here: it imports bz2, lzma... a worker needs it only once it cleans)

    shutil.rmtree(path, onerror=onerror)
