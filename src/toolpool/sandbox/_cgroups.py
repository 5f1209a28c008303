"""cgroups for worker trees: v2 ``cgroup.kill`` as the kill barrier, v1/v2 memory and pids caps.

Stdlib only: the reaper process loads this file by path. Every function degrades to "not
available" (None / False) instead of raising where the machine has no such cgroup.
"""

from __future__ import annotations

import errno
import os
import select
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ._linux import read_proc

__all__ = (
    "CgroupSet",
    "WorkerCgroups",
    "cgroup_kill",
    "members",
    "oom_kills",
    "populated",
    "remove",
    "wait_empty",
)


def _mounts() -> dict[str, str]:
    """cgroup mount points: ``{"v2": path, "memory": path, "pids": path}`` where present."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(" - ", 1)
        if len(parts) != 2:
            continue
        left, right = parts[0].split(), parts[1].split()
        fstype, options = right[0], right[2] if len(right) > 2 else ""
        mount_point = left[4]
        if fstype == "cgroup2":
            found.setdefault("v2", mount_point)
        elif fstype == "cgroup":
            for controller in ("memory", "pids"):
                if controller in options.split(","):
                    found.setdefault(controller, mount_point)
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``{"v2": "/x", "memory": "/y", ...}``."""
    paths: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return paths
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            paths["v2"] = path
        for controller in controllers.split(","):
            if controller in ("memory", "pids"):
                paths[controller] = path
    return paths


def _write(path: str, value: str) -> None:
    """Write a cgroup file in three system calls (a buffered ``open()`` takes seven)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    return read_proc(path).decode()


@dataclass
class CgroupSet:
    """The pool's cgroup directories, one per hierarchy in use, created on :meth:`create`."""

    base: dict[str, str] = field(default_factory=dict)
    """Hierarchy -> directory of this pool (``v2``, ``memory``, ``pids``)."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Why a hierarchy is not in use."""

    @classmethod
    def create(cls, name: str, *, memory: bool, pids: bool) -> CgroupSet:
        """Create ``name`` under this process's own cgroup in every usable hierarchy."""
        mounts, own = _mounts(), _own_paths()
        result = cls()
        wanted = ["v2"] + (["memory"] if memory else []) + (["pids"] if pids else [])
        for hierarchy in wanted:
            mount = mounts.get(hierarchy)
            if mount is None:
                result.reasons[hierarchy] = "not mounted"
                continue
            parent = os.path.join(mount, own.get(hierarchy, "/").lstrip("/"))
            path = os.path.join(parent, name)
            try:
                os.mkdir(path, 0o755)
            except OSError as exc:
                result.reasons[hierarchy] = f"cannot create a cgroup: {exc.strerror}"
                continue
            if hierarchy == "v2" and not os.path.exists(os.path.join(path, "cgroup.kill")):
                os.rmdir(path)
                result.reasons[hierarchy] = "no cgroup.kill (kernel older than 5.14)"
                continue
            result.base[hierarchy] = path
        # cgroup v2 memory/pids controllers, where delegated to us, replace the v1 ones.
        v2 = result.base.get("v2")
        if v2 is not None:
            available = _read(os.path.join(v2, "cgroup.controllers")).split()
            for controller in ("memory", "pids"):
                if controller in available and controller not in result.base:
                    try:
                        _write(os.path.join(v2, "cgroup.subtree_control"), f"+{controller}")
                        result.base[controller] = v2
                        result.reasons.pop(controller, None)
                    except OSError as exc:
                        result.reasons.setdefault(controller, f"v2: {exc.strerror}")
        return result

    def for_worker(
        self, wid: int, *, memory: int | None, max_processes: int | None
    ) -> WorkerCgroups:
        """Create the worker's cgroups (one directory per hierarchy) and set their limits."""
        dirs: dict[str, str] = {}
        for hierarchy, base in self.base.items():
            path = os.path.join(base, f"w{wid}")
            if path in dirs.values():
                dirs[hierarchy] = path
                continue
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                pass
            dirs[hierarchy] = path
        if memory is not None and "memory" in dirs:
            path = dirs["memory"]
            if os.path.exists(os.path.join(path, "memory.max")):
                _write(os.path.join(path, "memory.max"), str(memory))
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    _write(os.path.join(path, "memory.swap.max"), "0")
            else:
                _write(os.path.join(path, "memory.limit_in_bytes"), str(memory))
                memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    _write(memsw, str(memory))
        if max_processes is not None and "pids" in dirs:
            _write(os.path.join(dirs["pids"], "pids.max"), str(max_processes))
        return WorkerCgroups(dirs)

    def remove(self) -> list[str]:
        """Remove the pool's directories, workers' ones left behind included (when the
        reaper, which removes those, died first). They must be empty of processes: return
        those that could not be removed (a process that did not die still holds them)."""
        left = []
        for base in set(self.base.values()):
            for path, _dirs, _files in os.walk(base, topdown=False):
                if not remove(path):
                    left.append(path)
        return left


@dataclass
class WorkerCgroups:
    """One worker's cgroup directories by hierarchy."""

    dirs: dict[str, str]

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the worker writes itself into, first thing."""
        return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

    @property
    def kill_dir(self) -> str | None:
        """The v2 directory whose ``cgroup.kill`` kills the tree, if any."""
        return self.dirs.get("v2")


def join(procs_files: list[str]) -> list[str]:
    """Move the calling process into each cgroup; return the errors (empty if all joined)."""
    errors = []
    for path in procs_files:
        try:
            _write(path, "0")
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
    return errors


def cgroup_kill(path: str) -> bool:
    """SIGKILL every process of the v2 cgroup at ``path`` atomically."""
    try:
        _write(os.path.join(path, "cgroup.kill"), "1")
        return True
    except OSError:
        return False


def populated(path: str) -> bool:
    """Whether the v2 cgroup at ``path`` still holds a process."""
    try:
        for line in _read(os.path.join(path, "cgroup.events")).splitlines():
            key, _, value = line.partition(" ")
            if key == "populated":
                return value.strip() == "1"
    except OSError:
        return False
    return False


def wait_empty(path: str, timeout: float) -> bool:
    """Wait (POLLPRI on ``cgroup.events``) until the cgroup is empty; False on timeout."""
    deadline = time.monotonic() + timeout
    try:
        fd = os.open(os.path.join(path, "cgroup.events"), os.O_RDONLY)
    except OSError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        while populated(path):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller.poll(min(left, 0.05) * 1000)
        return True
    finally:
        os.close(fd)


def remove(path: str, attempts: int = 50) -> bool:
    """rmdir a cgroup, retrying briefly while the kernel finishes releasing it."""
    for _ in range(attempts):
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                return False
            time.sleep(0.002)
    return False


def oom_kills(dirs: Iterable[str]) -> int:
    """OOM kills recorded in the memory cgroup among ``dirs`` (v2 ``memory.events``, v1
    ``memory.oom_control``): 0 where there is none."""
    for directory in dirs:
        for name in ("memory.events", "memory.oom_control"):
            try:
                for line in _read(os.path.join(directory, name)).splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except (OSError, ValueError):
                continue
    return 0


def others_listed(listed: bytes, pid: int | None) -> int:
    """How many processes other than ``pid`` a ``cgroup.procs`` content lists."""
    own = str(pid).encode()
    return sum(1 for member in listed.split() if member != own)


def members(dirs: Iterable[str]) -> set[int]:
    """The pids listed in the ``cgroup.procs`` of each of ``dirs`` that has one."""
    found: set[int] = set()
    for directory in dirs:
        try:
            found.update(int(p) for p in read_proc(os.path.join(directory, "cgroup.procs")).split())
        except (OSError, ValueError):
            continue
    return found
