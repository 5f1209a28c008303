"""The reaper's process-tree helpers (stdlib, and psutil where a tree must be walked: the
reaper loads this file by path, see ``_main.py``).

Two ways to find processes. The reaper's own children are read from
``/proc/self/task/*/children`` (``_linux.child_pids``): a few bytes, however many processes the
machine runs, and exact here, since only the reaper removes entries from that list (it is
single-threaded and the only one that reaps its children), while new ones are only appended.
A worker's descendants are found by psutil (:func:`descendants`), which reads all of
``/proc``: only where no ``cgroup.kill`` kills a tree, and for ``signal``/``clean``. psutil is
imported on first use, so a reaper that never walks a tree never pays for it.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

#: Seconds ``kill_below`` waits for the descendants it killed to die before it kills the
#: worker, and a clean-up for the leftovers it killed (one that does not die, in
#: uninterruptible sleep, must not hold the reaper up).
KILL_TREE_WAIT = 0.5


def state_of(pid: int) -> str | None:
    """The state letter of ``pid`` (``/proc/PID/stat``: R, S, D, Z...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    end = stat.rfind(b")")
    return stat[end + 2 : end + 3].decode() if end > 0 else None


def pid_is_zombie(pid: int) -> bool:
    """Whether ``pid`` (a child of this process: its pid cannot be reused) is dead."""
    return state_of(pid) in (None, "Z", "X")


def children(pid: int) -> list[psutil.Process]:
    import psutil

    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def descendants(pid: int) -> list[psutil.Process]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def is_zombie(proc: psutil.Process) -> bool:
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def signal_proc(proc: psutil.Process, sig: int) -> None:
    import psutil

    try:
        proc.send_signal(sig)  # psutil checks the pid still names the same process
    except psutil.Error:
        pass


def kill_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_below(pid: int) -> int:
    """Kill ``pid`` and everything below it: freeze ``pid``, SIGKILL its descendants until no
    new one appears (it is a subreaper, so escaped daemons stay below it), wait (at most
    KILL_TREE_WAIT) for them to die, then SIGKILL it. ``pid`` must be a child of this process
    (so its pid cannot be reused before we reap it). Returns how many rounds the descendant
    loop took.

    The way without a cgroup: it reads all of ``/proc`` once a round (psutil).
    """
    kill_pid(pid, signal.SIGSTOP)
    rounds = 0
    signalled: set[psutil.Process] = set()  # (a pid and its start time: never a reused pid)
    dying_until: float | None = None
    while rounds < 10_000:
        alive = [p for p in descendants(pid) if not is_zombie(p)]
        if not alive:
            break
        fresh = [p for p in alive if p not in signalled]
        if not fresh:
            # Only ones killed already: dying, or not dying at all (uninterruptible sleep),
            # which no further signal changes. Wait for them, bounded: the reaper must go on.
            if dying_until is None:
                dying_until = time.monotonic() + KILL_TREE_WAIT
            elif time.monotonic() >= dying_until:
                break
            time.sleep(0.0002)
            continue
        for proc in fresh:
            signal_proc(proc, signal.SIGKILL)
            signalled.add(proc)
        rounds += 1
    kill_pid(pid, signal.SIGKILL)
    return rounds


def wait_any_dead(pids: list[int], timeout: float) -> None:
    """Wait until one of ``pids`` (children of this process, not reaped yet) has died, or
    ``timeout`` seconds: on their pidfds (readable at death), or in short sleeps where there
    are none (a kernel before 5.3)."""
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                return  # already reaped by someone? (not by us: it is dead, look again)
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(max(0.0, timeout) * 1000)
    except (AttributeError, OSError):  # no pidfd_open
        time.sleep(min(timeout, 0.0005))
    finally:
        for fd in fds:
            os.close(fd)
