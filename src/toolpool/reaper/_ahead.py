"""Launching the reaper process, and launching it ahead of its pool.

A pool's start waits for its reaper: an interpreter to start (tens of milliseconds), then,
with ``start_method="fork"``, the worker's modules imported into it (the template, as long
again). A command that makes one pool (``toolpool eval``, ``toolpool batch``) knows it will
need a reaper long before its own imports let it make the pool, so it starts one first with
:func:`start_ahead`, and has it import the worker's modules with :func:`preload_ahead` as soon
as it knows their path; the process's next pool adopts it (:func:`take_ahead`) and finds it
ready. On a machine with two cores or more the two starts overlap.

Nothing changes for the pool: the reaper is started with the same arguments and environment
either way, and the commands it gets are the same, in the same order. A reaper started ahead
that no pool adopts (the command failed first, or its pool wanted another path) is killed and
waited for: it has no worker yet, and nothing of it outlives the process. A forked child
never adopts its parent's.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = (
    "REAPER_ENV",
    "SCRIPT",
    "discard_ahead",
    "launch",
    "preload_ahead",
    "pythonpath",
    "reaper_env",
    "start_ahead",
    "take_ahead",
)

#: The reaper process's script, run by path (``python -P SCRIPT SUPERVISOR_PID FD``).
SCRIPT: Final = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_main.py")

#: What the reaper keeps of the supervisor's environment. Workers forked from it inherit its
#: initial environment block (``/proc/self/environ``, the stack), whatever ``os.environ`` they
#: are given: nothing else of the supervisor's environment may be in it.
REAPER_ENV: Final = ("PATH", "PYTHONPATH", "PYTHONHOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ")


def reaper_env() -> dict[str, str]:
    """The reaper's environment: :data:`REAPER_ENV` from the supervisor's, no more."""
    return {name: os.environ[name] for name in REAPER_ENV if name in os.environ}


def pythonpath(env: Mapping[str, str], allowlist: Sequence[str] | None) -> str:
    """The workers' ``PYTHONPATH``: this process's ``sys.path``, then ``env``'s own
    ``PYTHONPATH`` where the profile's ``allowlist`` (None: everything) keeps it."""
    paths = [p or os.getcwd() for p in sys.path]
    extra = env.get("PYTHONPATH") if allowlist is None or "PYTHONPATH" in allowlist else None
    if extra:
        paths.append(extra)
    return os.pathsep.join(dict.fromkeys(paths))


def launch() -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start a reaper for this process: the process and our end of its socket (blocking)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        # A plain, fast fork+exec (no preexec_fn: zmq threads may exist).
        proc = subprocess.Popen(
            [sys.executable, "-P", SCRIPT, str(os.getpid()), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=reaper_env(),
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


class Ahead:
    """A reaper started before its pool, not adopted yet."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.owner = os.getpid()
        #: The path it was told to preload from (None: not told).
        self.paths: tuple[str, ...] | None = None

    def discard(self) -> None:
        """Kill it and wait for it: it has no worker, and nothing else to end. One that does
        not die of SIGKILL within :data:`DISCARD_WAIT` (uninterruptible sleep: a hung mount
        on its path) is left to a daemon thread to reap, and said."""
        self.sock.close()
        if self.proc.poll() is not None:
            return
        self.proc.kill()
        try:
            self.proc.wait(DISCARD_WAIT)
        except subprocess.TimeoutExpired:
            pid = self.proc.pid
            _log.warning("the reaper started ahead (pid %s) did not die of SIGKILL yet", pid)
            threading.Thread(target=self.proc.wait, daemon=True).start()


#: Seconds a discarded reaper has to die of SIGKILL before it is left to a thread to reap.
DISCARD_WAIT: Final = 5.0

_ahead: Ahead | None = None
_lock = threading.Lock()  # (a pool started in another thread meanwhile: one adopts it)
_log = logging.getLogger("toolpool")


def start_ahead() -> None:
    """Start the reaper of this process's next pool now (once; see the module's text)."""
    global _ahead
    with _lock:
        if _ahead is not None:
            return
        proc, sock = launch()
        _ahead = Ahead(proc, sock)
    _log.debug("started the next pool's reaper ahead (pid %s)", proc.pid)


def preload_ahead(paths: Sequence[str]) -> None:
    """Have the reaper started ahead import the worker's modules from ``paths`` (the workers'
    ``PYTHONPATH``, split) now. A pool whose workers get another path will not adopt it."""
    ahead = _ahead
    if ahead is None or ahead.owner != os.getpid() or ahead.paths is not None:
        return
    from ..protocol._reaper import PreloadCommand, encode_reaper  # (after the launch)

    try:
        ahead.sock.send(encode_reaper(PreloadCommand(tuple(paths))))
    except OSError:  # gone already: the pool starts its own
        discard_ahead()
        return
    ahead.paths = tuple(paths)


def take_ahead(paths: Sequence[str] | None) -> Ahead | None:
    """The reaper started ahead, for the pool starting now to adopt (None: start one).

    ``paths``: what the pool preloads from (None: it forks no worker). A reaper told to
    preload from another path, or that is gone already, is discarded.
    """
    global _ahead
    with _lock:
        ahead, _ahead = _ahead, None
    if ahead is None:
        return None
    if ahead.owner != os.getpid():  # (after_in_child forgets it; this is a second guard)
        return None
    if ahead.proc.poll() is not None or (
        paths is not None and ahead.paths is not None and ahead.paths != tuple(paths)
    ):
        ahead.discard()
        return None
    return ahead


def discard_ahead() -> None:
    """End the reaper started ahead if no pool adopted it (a command that failed first)."""
    global _ahead
    with _lock:
        ahead, _ahead = _ahead, None
    if ahead is not None and ahead.owner == os.getpid():
        ahead.discard()


def _forget_in_child() -> None:
    global _ahead, _lock
    _lock = threading.Lock()  # (perhaps held by another thread of the parent at the fork)
    ahead, _ahead = _ahead, None
    if ahead is not None:
        ahead.sock.close()  # our copy only: the parent's reaper is the parent's


atexit.register(discard_ahead)
os.register_at_fork(after_in_child=_forget_in_child)
