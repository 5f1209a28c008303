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
    "children_of",
    "prctl",
    "read_proc",
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


def read_proc(path: str) -> bytes:
    """The whole of a small ``/proc`` file in four system calls (open, read to the end,
    close), not the seven of a buffered ``open()`` (it adds fstat, the tty ioctl and a seek).
    Raises what ``os.open`` and ``os.read`` raise."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 1 << 16)
        if data:
            while chunk := os.read(fd, 1 << 16):
                data += chunk
        return data
    finally:
        os.close(fd)


def children_of(pid: int | str) -> list[int] | None:
    """The children of process ``pid`` (``"self"``: this one), zombies included, from
    ``/proc/<pid>/task/*/children``: a few bytes, however many processes the machine runs (no
    scan of ``/proc``). None if the process is gone, or where the kernel has no such file
    (built without ``CONFIG_PROC_CHILDREN``)."""
    pids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            pids.extend(int(p) for p in read_proc(f"/proc/{pid}/task/{tid}/children").split())
        except OSError:  # a thread (or the process) that ended meanwhile: go on; or
            if os.path.isdir(f"/proc/{pid}/task/{tid}"):  # no such file at all
                return None
    return pids


def child_pids() -> list[int] | None:
    """This process's children, zombies included (:func:`children_of`)."""
    return children_of("self")
