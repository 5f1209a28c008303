"""The reaper's process-tree helpers (stdlib and psutil only: the reaper loads this file by
path, see ``_main.py``)."""

from __future__ import annotations

import os
import signal
import time

import psutil

#: Seconds ``kill_below`` waits for the descendants it killed to die before it kills the
#: worker, and a clean-up for the leftovers it killed (one that does not die, in
#: uninterruptible sleep, must not hold the reaper up).
KILL_TREE_WAIT = 0.5


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def signal_proc(proc: psutil.Process, sig: int) -> None:
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
