"""Run a worker as another user: its own uid per worker, or a named one.

Done in the worker, as root, single-threaded, after the other set-up steps and before PDEATHSIG
is armed (a uid change clears it). The steps:

1. Check the process can do it at all (root with CAP_SETUID, CAP_SETGID, CAP_CHOWN; and
   CAP_SYS_ADMIN if a view must be built): if not, the layer is unavailable and nothing has
   changed (:class:`LayerUnavailable`).
2. A private mount namespace in which what the worker must import is reachable by the new uid:
   the interpreter and its prefixes, site-packages, toolpool itself and the entry of
   ``sys.path`` that provides the tools module. A directory on the way that the new uid may
   not search (``/root`` is 0700 on our machines, and pyenv lives under it) is covered by an
   empty tmpfs into which only the needed entries are bind-mounted back, read-only: the rest
   of it stays hidden from the tool. Other ``sys.path`` entries are not uncovered.
3. Files the worker keeps using (its socket and its directory, its scratch directory) are
   handed to the new uid.
4. The capability bounding set is emptied, then ``setgroups([])``, ``setresgid``,
   ``setresuid``, ``PR_SET_NO_NEW_PRIVS``; then the result is verified (every uid changed, no
   effective capability left). A failure from here on is fatal to the worker: it never runs a
   tool half-changed.

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
from collections.abc import Callable, Iterable
from typing import Any

from ._linux import PR_SET_NO_NEW_PRIVS, prctl

__all__ = (
    "PER_WORKER",
    "PER_WORKER_UID_BASE",
    "LayerUnavailable",
    "drop_privileges",
    "resolve_user",
    "target_ids",
)

#: ``Profile(user=PER_WORKER)``: every worker gets a uid (and gid) of its own.
PER_WORKER = "per-worker"
#: A per-worker uid is this plus the worker's pid (unique among live processes of its pid
#: namespace), above any uid a distribution hands out. In a pid namespace other than the
#: initial one, a slot derived from the namespace is added (see :func:`target_ids`).
PER_WORKER_UID_BASE = 2_000_000_000
_PID_SPACE = 1 << 22  # pid_max can be at most 2**22
_INITIAL_PID_NS = 0xEFFFFFFC  # the initial pid namespace's inode number (PROC_PID_INIT_INO)

CLONE_NEWNS = 0x00020000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_CAPBSET_DROP = 24
_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_CLEAR = 7
KEY_SPEC_USER_KEYRING = -4
KEY_SPEC_USER_SESSION_KEYRING = -5
CAP_CHOWN, CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN = 0, 6, 7, 21


class LayerUnavailable(OSError):
    """This process cannot change its uid here (not root, or missing capabilities); nothing
    was changed."""


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
    """The uid and gid this worker process will run as.

    Per worker: :data:`PER_WORKER_UID_BASE` + pid in the initial pid namespace, which makes it
    unique among live workers of every pool on the machine. In another pid namespace pids
    repeat across namespaces, so one of 500 slots derived from the namespace's identity is
    added: two such namespaces still collide if their slots and pids are equal (1 in 500 per
    pair of equal pids).
    """
    if user == PER_WORKER:
        ident = PER_WORKER_UID_BASE + os.getpid()
        try:
            namespace = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            namespace = _INITIAL_PID_NS
        if namespace != _INITIAL_PID_NS:
            ident += _PID_SPACE * (1 + namespace % 500)
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


def _entry_providing(module: str) -> str | None:
    """The ``sys.path`` entry an import of ``module`` would find first (nothing imported)."""
    top = module.split(".")[0]
    for entry in sys.path:
        entry = entry or os.getcwd()
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for name in names:
            if name == top or name.partition(".")[0] == top:
                return os.path.realpath(entry)
    return None


def interpreter_paths() -> set[str]:
    """The interpreter's own directories: the worker cannot run without them."""
    found = {os.path.dirname(os.path.realpath(sys.executable))}
    found.update(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix))
    return found


def needed_paths(tools_module: str | None = None) -> list[str]:
    """Directories the worker must still read after the uid change: the interpreter's,
    site-packages, toolpool's own, and the ``sys.path`` entry providing ``tools_module``."""
    paths = set(interpreter_paths())
    prefixes = tuple(p.rstrip("/") + "/" for p in paths)
    for entry in sys.path:
        real = os.path.realpath(entry or os.getcwd())
        if real.startswith(prefixes) or os.path.basename(real) in (
            "site-packages",
            "dist-packages",
        ):
            paths.add(real)
    paths.add(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
    provider = _entry_providing(tools_module) if tools_module else None
    if provider is not None:
        paths.add(provider)
    return sorted(p for p in paths if os.path.isdir(p))


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
    paths: Iterable[str],
    uid: int,
    gid: int,
    essential: set[str] | None = None,
    writable: Iterable[str] = (),
) -> tuple[list[str], list[str]]:
    """In a new private mount namespace, make the paths in ``paths`` reachable by uid.

    What is bound back is read-only, except on the way to a ``writable`` path (the worker's
    scratch directory, should the pool's directory live under a covered one). A path uid may
    not search itself (a 0700 directory of another user) stays unreachable. Returns the
    directories that were covered (their other entries are hidden) and the paths left
    unreachable. Raises OSError if an ``essential`` path cannot be made reachable.
    """
    keep_writable = [w.rstrip("/") + "/" for w in writable]
    wanted, unreachable = sorted(set(paths)), []
    namespace = False
    covered: list[str] = []
    for _ in range(16):  # one covered directory per round; nested ones take more rounds
        blocked: dict[str, set[str]] = {}
        for p in list(wanted):
            try:
                hit = _first_blocked(p, uid, gid)
            except OSError:  # gone meanwhile
                hit = (p, "")
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
                remount = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV
                if not any(w.startswith(target + "/") for w in keep_writable):
                    remount |= MS_RDONLY
                _mount(None, target, None, remount, "")
        finally:
            for fd in fds.values():
                os.close(fd)
        covered.append(directory)
    raise OSError("too many nested directories to make reachable")


def _capabilities() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def _fatal(what: str, exc: BaseException | None = None) -> RuntimeError:
    detail = f": {exc}" if exc is not None else ""
    return RuntimeError(f"the uid change failed half way ({what}{detail}); not running tools")


def drop_privileges(
    user: str | int,
    own: Iterable[str] = (),
    tools_module: str | None = None,
    before_drop: Callable[[], None] | None = None,
) -> str:
    """Become ``user`` for good (see the module docstring). Returns what was done.
    ``before_drop`` runs as root once the worker's view and its files are ready, just before
    the capabilities go (the read-only mounts: a mount needs them).

    Raises :class:`LayerUnavailable` if this process cannot do it (nothing changed), and
    :class:`RuntimeError` if it failed once begun (the worker must not go on).
    """
    uid, gid = target_ids(user)
    if os.geteuid() != 0:
        raise LayerUnavailable(f"changing uid needs root; running as uid {os.getuid()}")
    caps = _capabilities()
    wanted = {"CAP_SETUID": CAP_SETUID, "CAP_SETGID": CAP_SETGID, "CAP_CHOWN": CAP_CHOWN}
    missing = [name for name, bit in wanted.items() if not caps & (1 << bit)]
    if missing:
        raise LayerUnavailable(f"root without {', '.join(missing)}")
    own = [p for p in own if os.path.exists(p)]
    needed = [*needed_paths(tools_module), *({os.path.dirname(p) for p in own} - set(own))]
    try:
        covered, unreachable = make_reachable(needed, uid, gid, interpreter_paths(), own)
    except PermissionError as exc:  # no CAP_SYS_ADMIN for a mount namespace (a container)
        raise LayerUnavailable(
            f"cannot make the interpreter readable for uid {uid}: {exc}"
        ) from exc
    except OSError as exc:
        raise _fatal("building the worker's view of the filesystem", exc) from exc
    try:
        for path in own:  # the worker's own: nobody else may use them
            os.chown(path, uid, gid)
            os.chmod(path, 0o700 if os.path.isdir(path) else 0o600)
        if before_drop is not None:
            before_drop()
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
        for cap in range(last + 1):
            if not prctl(PR_CAPBSET_DROP, cap):
                raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP({cap})")
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if not prctl(PR_SET_NO_NEW_PRIVS, 1):
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    except (OSError, ValueError) as exc:
        raise _fatal(f"to uid {uid}", exc) from exc
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise _fatal(f"ids are {os.getresuid()}/{os.getresgid()}, not {uid}/{gid}")
    if os.getgroups():
        raise _fatal(f"supplementary groups {os.getgroups()} remain")
    if _capabilities():
        raise _fatal(f"effective capabilities {_capabilities():#x} remain")
    cleared = _clear_user_keyrings()
    hidden = f"; {', '.join(covered)} hidden but for what the worker needs" if covered else ""
    if unreachable:
        hidden += f"; not readable by it, left out of its view: {', '.join(unreachable)}"
    kind = "own uid" if user == PER_WORKER else "uid"
    keys = ", its keyrings emptied" if cleared else ""
    return f"{kind} {uid} (gid {gid}), no capabilities, no new privileges{keys}{hidden}"


def _clear_user_keyrings() -> bool:
    """Empty the uid's kernel keyrings: they outlive processes, so keys an earlier worker with
    this uid left (a pid, hence a per-worker uid, comes round again) must not reach this one."""
    import platform

    number = _KEYCTL.get(platform.machine())
    if number is None:
        return False
    libc = _libc()
    return all(
        libc.syscall(number, KEYCTL_CLEAR, ctypes.c_long(ring)) == 0
        for ring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING)
    )
