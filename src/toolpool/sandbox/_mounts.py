"""A read-only view of the filesystem for the worker: every mount read-only but its scratch
directory, in a mount namespace of its own (the layer bubblewrap and nsjail build on).

Landlock's access rights cover writing to files and changing names, not metadata: a tool
could still ``utime``, ``setxattr`` or ``removexattr`` a world-writable file outside its
scratch directory. On a read-only mount the kernel refuses every change at the VFS, metadata
included (EROFS). Mounts a process inherits from a more privileged namespace stay read-only
even for a root of a user namespace it creates later (the kernel locks them), and Landlock
forbids mounting altogether.

Done in the worker, single-threaded, as root before the uid change (which drops the right to
mount), or without root inside a user namespace where the kernel allows one; before Landlock.
"""

from __future__ import annotations

import ctypes
import os

from ._identity import MS_BIND, MS_PRIVATE, MS_RDONLY, MS_REC, MS_REMOUNT, _libc, _mount
from ._linux import prctl

PR_SET_DUMPABLE = 4

__all__ = ("METADATA_WARNING", "readonly_view")

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
#: Per-mount flags a remount must keep (dropping one would weaken the mount).
_KEEP = {"nosuid": 0x2, "nodev": 0x4, "noexec": 0x8, "nosymfollow": 0x100}
#: What is left open where this layer is missing.
METADATA_WARNING = (
    "metadata outside the scratch directory (times, extended attributes) stays writable"
)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts() -> list[tuple[str, int]]:
    """Every mount point of this namespace, with the per-mount flags to keep."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            options = fields[5].split(",")
            keep = 0
            for name in options:
                keep |= _KEEP.get(name, 0)
            found.append((_unescape(fields[4]), keep))
    return found


def _own_namespace() -> str:
    """Enter a mount namespace of our own; returns how."""
    libc = _libc()
    if libc.unshare(CLONE_NEWNS) == 0:
        return "own mount namespace"
    first = os.strerror(ctypes.get_errno())
    uid, gid = os.getuid(), os.getgid()
    if os.geteuid() == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        raise OSError(f"no mount namespace: unshare(CLONE_NEWNS): {first}")
    try:
        _map_ids(uid, gid)
    except PermissionError:
        # A process that changed its uid is not dumpable, so its /proc files are not its own:
        # it may make itself dumpable again (a process of that uid could ptrace it anyway).
        prctl(PR_SET_DUMPABLE, 1)
        try:
            _map_ids(uid, gid)
        except OSError as exc:  # in a user namespace without ids: there is no going back
            raise RuntimeError(f"the read-only view failed half way: {exc}") from exc
    return "own mount namespace (in a user namespace)"


def _map_ids(uid: int, gid: int) -> None:
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def readonly_view(writable: list[str], keep: tuple[str, ...] = ()) -> str:
    """Make every mount read-only for this process but ``writable`` (directories, each bind-
    mounted onto itself first, so it keeps its own writable mount) and the mounts in
    ``keep``. Returns what was done; raises OSError where no mount namespace can be had
    (nothing changed then)."""
    how = _own_namespace()
    _mount(None, "/", None, MS_REC | MS_PRIVATE, "")  # nothing we do here propagates out
    here = os.getcwd()
    for path in writable:
        _mount(path, path, None, MS_BIND | MS_REC, "")
    os.chdir(here)  # the working directory was the covered one: enter the new mount
    skip = {os.path.realpath(p) for p in writable} | set(keep)
    left: list[str] = []
    for point, flags in _mounts():
        if point in skip:
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, "")
        except OSError as exc:
            if exc.errno not in (2, 20):  # ENOENT, ENOTDIR: covered by another mount, unreachable
                left.append(f"{point} ({os.strerror(exc.errno or 0)})")
    if left:
        raise OSError(f"could not make read-only: {', '.join(left)}")
    kept = f" and {', '.join(keep)}" if keep else ""
    return f"every mount read-only but {', '.join(writable) or 'nothing'}{kept} ({how})"
