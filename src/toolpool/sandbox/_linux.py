"""prctl(2) through ctypes, and this process's children; stdlib only (the reaper loads this
file by path)."""

from __future__ import annotations

import ctypes
import os

__all__ = (
    "PR_SET_CHILD_SUBREAPER",
    "PR_SET_NO_NEW_PRIVS",
    "PR_SET_PDEATHSIG",
    "child_pids",
    "prctl",
    "reap_zombies",
)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


def prctl(option: int, arg: int) -> bool:
    """Call prctl(option, arg, 0, 0, 0); True on success, False where it fails or is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, arg, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def reap_zombies() -> None:
    """Reap every child that already exited, without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def child_pids() -> list[int] | None:
    """This process's children, zombies included, from ``/proc/self/task/*/children``: a few
    bytes, however many processes the machine runs (no scan of ``/proc``). None where the
    kernel has no such file (built without ``CONFIG_PROC_CHILDREN``)."""
    pids: list[int] = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                pids.extend(int(p) for p in f.read().split())
        except OSError:  # a thread that ended meanwhile; or no such file at all (below)
            if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
                return None
    return pids
