"""Run a worker as another user: its own uid per worker, or a named one.

Done in the worker, as root, single-threaded, after the other set-up steps and before PDEATHSIG
is armed (a uid change clears it). Three steps:

1. A private mount namespace in which the interpreter, the standard library, every ``sys.path``
   entry and the working directory are reachable by the new uid. A directory the new uid may
   not search (``/root`` is 0700 on our machines, and pyenv lives under it) is covered by an
   empty tmpfs into which only the needed entries are bind-mounted back: the rest of it stays
   hidden from the tool.
2. Files the worker must keep using (its socket file, its scratch directory) are handed to the
   new uid.
3. ``setgroups([])``, ``setresgid``, ``setresuid``, then ``PR_SET_NO_NEW_PRIVS`` so no set-uid
   program can bring privileges back. All capabilities are gone with the uid change.

With its own uid a tool cannot signal the supervisor, the reaper or a sibling worker, cannot
write itself into another cgroup, cannot connect to another worker's socket, and
``RLIMIT_NPROC`` caps its processes (the kernel counts them per uid).
"""

from __future__ import annotations

import ctypes
import os
import pwd
import stat
import sys
from collections.abc import Iterable
from typing import Any

from ._linux import PR_SET_NO_NEW_PRIVS, prctl

__all__ = ("PER_WORKER", "PER_WORKER_UID_BASE", "drop_privileges", "resolve_user", "target_ids")

#: ``Profile(user=PER_WORKER)``: every worker gets a uid (and gid) of its own.
PER_WORKER = "per-worker"
#: A per-worker uid is this plus the worker's pid: unique among live processes machine-wide,
#: above any uid a distribution hands out, below 2**32 - 1 for any pid_max (at most 2**22).
PER_WORKER_UID_BASE = 2_000_000_000

CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_NOSUID = 0x2
MS_NODEV = 0x4


def resolve_user(user: str | int) -> tuple[int, int]:
    """A user name or uid -> (uid, gid). Raises ValueError for an unknown name."""
    if isinstance(user, int):
        try:
            return user, pwd.getpwuid(user).pw_gid
        except KeyError:
            return user, user
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"no user named {user!r} on this machine") from None
    return entry.pw_uid, entry.pw_gid


def target_ids(user: str | int) -> tuple[int, int]:
    """The uid and gid this worker process will run as."""
    if user == PER_WORKER:
        ident = PER_WORKER_UID_BASE + os.getpid()
        return ident, ident
    return resolve_user(user)


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
    libc = _libc()
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _searchable(path: str, uid: int, gid: int) -> bool:
    st = os.stat(path)
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def needed_paths() -> list[str]:
    """Directories the worker must still read after the uid change: the interpreter's, the
    working directory, and every ``sys.path`` entry that exists."""
    paths = {os.path.dirname(os.path.realpath(sys.executable)), os.getcwd()}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path):
        if p and os.path.isdir(p):
            paths.add(os.path.realpath(p))
    return sorted(paths)


def _interpreter_paths() -> set[str]:
    found = {os.path.dirname(os.path.realpath(sys.executable))}
    found.update(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix))
    return found


def _first_blocked(path: str, uid: int, gid: int) -> tuple[str, str] | None:
    """The first ancestor of ``path`` (itself included) that uid cannot search, and the name
    of its child on the way to ``path`` ('' if it is ``path`` itself)."""
    parts = [p for p in path.split("/") if p]
    current = "/"
    for i, part in enumerate(["", *parts]):
        current = os.path.join(current, part) if part else current
        if not _searchable(current, uid, gid):
            child = parts[i] if i < len(parts) else ""
            return current, child
    return None


def make_reachable(
    paths: Iterable[str], uid: int, gid: int, essential: set[str] | None = None
) -> tuple[list[str], list[str]]:
    """In a new private mount namespace, make the paths in ``paths`` reachable by uid.

    A path uid may not search itself (a 0700 directory of another user) stays unreachable.
    Returns the directories that were covered (their other entries are hidden) and the paths
    left unreachable. Raises OSError if an ``essential`` path cannot be made reachable.
    """
    wanted, unreachable = sorted(set(paths)), []
    namespace = False
    covered: list[str] = []
    for _ in range(16):  # one covered directory per round; nested ones take more rounds
        blocked: dict[str, set[str]] = {}
        for p in list(wanted):
            hit = _first_blocked(p, uid, gid)
            if hit is None:
                continue
            if hit[1] == "":  # the path itself is closed to uid: nothing to uncover
                if p in (essential or set()):
                    raise OSError(f"{p} is needed by the worker but user {uid} cannot search it")
                wanted.remove(p)
                unreachable.append(p)
                continue
            blocked.setdefault(hit[0], set()).add(hit[1])
        if not blocked:
            return covered, unreachable
        if not namespace:
            if _libc().unshare(CLONE_NEWNS) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
            _mount(None, "/", None, MS_REC | MS_PRIVATE, "")
            namespace = True
        directory, children = min(blocked.items(), key=lambda kv: len(kv[0]))
        # Keep a handle on each needed entry, cover the directory, then put the entries back.
        fds = {c: os.open(os.path.join(directory, c), os.O_PATH | os.O_CLOEXEC) for c in children}
        try:
            _mount("toolpool", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
            for child, fd in sorted(fds.items()):
                target = os.path.join(directory, child)
                os.mkdir(target, 0o755)
                _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, "")
        finally:
            for fd in fds.values():
                os.close(fd)
        covered.append(directory)
    raise OSError("too many nested directories to make reachable")


def drop_privileges(user: str | int, own: Iterable[str] = ()) -> str:
    """Become ``user`` for good (see the module docstring). Returns what was done.

    Raises OSError (or ValueError for an unknown user) if it cannot be done.
    """
    uid, gid = target_ids(user)
    if os.geteuid() != 0:
        raise OSError("changing uid needs root (CAP_SETUID); running as uid " + str(os.getuid()))
    for path in own:  # the worker's own: nobody else may use them
        if os.path.exists(path):
            os.chown(path, uid, gid)
            os.chmod(path, 0o700 if os.path.isdir(path) else 0o600)
    covered, unreachable = make_reachable(needed_paths(), uid, gid, _interpreter_paths())
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"the uid change to {uid} did not take")
    if not prctl(PR_SET_NO_NEW_PRIVS, 1):
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    hidden = f"; {', '.join(covered)} hidden but for what the worker needs" if covered else ""
    if unreachable:
        hidden += f"; not readable by it, left out of its view: {', '.join(unreachable)}"
    kind = "own uid" if user == PER_WORKER else "uid"
    return f"{kind} {uid} (gid {gid}), no capabilities, no new privileges{hidden}"
