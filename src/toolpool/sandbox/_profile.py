"""Containment profiles: what a worker may do, in human units (CONTRACT C4.3, C7)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final, final

from ._identity import PER_WORKER, resolve_user

__all__ = (
    "DEFAULT_ENV_ALLOWLIST",
    "LAYERS",
    "Profile",
    "parse_duration",
    "parse_size",
)

#: Every containment layer toolpool knows, by name (see ``toolpool doctor``).
LAYERS: Final = (
    "session",
    "subreaper",
    "pidfd",
    "cgroup_kill",
    "cgroup_memory",
    "cgroup_pids",
    "rlimits",
    "netns",
    "ipcns",
    "readonly_fs",
    "landlock",
    "uid",
    "scratch_dir",
    "env_allowlist",
)

#: Environment variables an ``untrusted`` worker keeps (plus what toolpool sets itself).
DEFAULT_ENV_ALLOWLIST: Final = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS: Final = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "ki": 1024,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mi": 1024**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gi": 1024**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ti": 1024**4,
    "tib": 1024**4,
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)


def parse_size(value: int | str | None) -> int | None:
    """``512MiB``, ``1GB``, ``4096`` (bytes) -> bytes. None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError("a size is an int of bytes or a string like '512MiB'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"a size must be positive, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"a size is an int of bytes or a string like '512MiB', not {value!r}")
    match = _SIZE.match(value)
    unit = (match.group(2) or "").lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size (try '512MiB', '2GB', '4096')")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return size


def parse_duration(value: float | str | None) -> float | None:
    """``30s``, ``500ms``, ``2m``, ``1.5`` (seconds) -> seconds. None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError("a duration is a number of seconds or a string like '30s'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(f"cannot read {value!r} as a duration (try '30s', '500ms', '2m')")
        scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[(match.group(2) or "s").lower()]
        seconds = float(match.group(1)) * scale
    else:
        raise TypeError(f"a duration is a number of seconds or a string like '30s', not {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a duration must be positive and finite, got {value!r}")
    return seconds


def _count(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """A containment profile: limits and isolation for every worker of a pool.

    Use :meth:`default` (breaks no ordinary tool) or :meth:`untrusted` (every available layer
    on), and :meth:`with_limits` to adjust: ``Profile.untrusted().with_limits(memory="256MiB")``.
    Layers the machine lacks are skipped and reported (``pool.containment()``), unless named
    in ``require``: then their absence is a start-up error.
    """

    name: str = "default"
    memory: int | None = None
    """Memory cap of each worker's whole tree, in bytes (cgroup; OOM-killed beyond it)."""
    max_processes: int | None = None
    """Processes and threads in each worker's tree (cgroup pids; stops fork bombs)."""
    cpu_time: float | None = None
    """CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL)."""
    max_open_files: int | None = None
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_file_size: int | None = None
    """Largest file a process may write, in bytes (RLIMIT_FSIZE)."""
    core_dumps: bool = False
    """Whether crashing tools may write core dumps (off: RLIMIT_CORE=0)."""
    network: bool = True
    """False: the worker gets an empty network namespace (no network at all)."""
    private_ipc: bool = False
    """True: the worker gets its own IPC namespace, so System V IPC objects and POSIX message
    queues a tool creates are invisible to every other process and die with the worker."""
    scratch_dir: bool = True
    """Run each worker in a private scratch directory, removed after it exits."""
    readonly_fs: bool = False
    """Every mount read-only but the scratch directory, in the worker's own mount namespace:
    the kernel refuses every change outside it, metadata (times, modes, owners, extended
    attributes) included, which Landlock's rights do not cover. Needs root or user
    namespaces; elsewhere the layer is reported inactive."""
    landlock: bool = False
    """Landlock: the filesystem is read-only except the scratch directory, and (kernel ABI 6+)
    no signal can reach a process outside the worker's sandbox (the supervisor, siblings)."""
    env_allowlist: tuple[str, ...] | None = None
    """None: workers inherit the supervisor's environment. Otherwise only these names."""
    user: str | int | None = None
    """None: workers run as the supervisor's user. ``"per-worker"``: each worker gets a uid and
    gid of its own (2,000,000,000 + its pid), so a tool cannot signal the supervisor or a
    sibling, leave its cgroup, or reach another worker's socket. A user name or uid: every
    worker runs as that user. Needs root; the interpreter is made reachable for the new uid in
    a private mount namespace (see docs/security.md)."""
    require: frozenset[str] = field(default_factory=frozenset)
    """Layers that must be active, or the pool refuses to start."""
    disable: frozenset[str] = field(default_factory=frozenset)
    """Mechanisms to leave off even where available: ``{"cgroups"}`` forces the fallback
    kill barrier (subreapers and a kill loop), e.g. to test the weakest set-up."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory", parse_size(self.memory))
        object.__setattr__(self, "max_file_size", parse_size(self.max_file_size))
        object.__setattr__(self, "cpu_time", parse_duration(self.cpu_time))
        _count("max_processes", self.max_processes)
        _count("max_open_files", self.max_open_files)
        allow: Any = self.env_allowlist
        if allow is not None:
            if isinstance(allow, str) or not all(isinstance(n, str) for n in allow):
                raise TypeError("env_allowlist is a sequence of variable names")
            object.__setattr__(self, "env_allowlist", tuple(allow))
        _check_user(self.user)
        require = frozenset(self.require)
        unknown = require - set(LAYERS)
        if unknown:
            raise ValueError(f"unknown layer(s) in require: {sorted(unknown)}; known: {LAYERS}")
        object.__setattr__(self, "require", require)
        disable = frozenset(self.disable)
        if disable - {"cgroups"}:
            raise ValueError(f"unknown mechanism(s) in disable: {sorted(disable - {'cgroups'})}")
        object.__setattr__(self, "disable", disable)

    @classmethod
    def default(cls) -> Profile:
        """The kill barrier, leftover clean-up and no core dumps; breaks no ordinary tool."""
        return cls(name="default")

    @classmethod
    def untrusted(cls) -> Profile:
        """Every layer on, with documented limits: 512 MiB and 256 processes per worker tree,
        60 CPU-seconds and 256 open files per process, 64 MiB files, no network, a scratch
        directory, a private IPC namespace, a read-only filesystem elsewhere (Landlock), no
        signals to processes outside the sandbox, a uid of its own per worker (where the
        supervisor is root), and an environment reduced to :data:`DEFAULT_ENV_ALLOWLIST`."""
        return cls(
            name="untrusted",
            memory=512 * 1024**2,
            max_processes=256,
            cpu_time=60.0,
            max_open_files=256,
            max_file_size=64 * 1024**2,
            network=False,
            private_ipc=True,
            readonly_fs=True,
            landlock=True,
            env_allowlist=DEFAULT_ENV_ALLOWLIST,
            user=PER_WORKER,
        )

    @classmethod
    def named(cls, name: str) -> Profile:
        """``"default"`` or ``"untrusted"``."""
        if name == "default":
            return cls.default()
        if name == "untrusted":
            return cls.untrusted()
        raise ValueError(f"unknown profile {name!r}; expected 'default' or 'untrusted'")

    def with_limits(self, **changes: Any) -> Profile:
        """A copy with some fields changed (human units accepted)."""
        return replace(self, **changes)

    def to_wire(self) -> dict[str, Any]:
        """A JSON-compatible dict (passed to workers on their command line)."""
        data = asdict(self)
        data["require"] = sorted(self.require)
        data["disable"] = sorted(self.disable)
        data["env_allowlist"] = list(self.env_allowlist) if self.env_allowlist else None
        return data

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Profile:
        """The inverse of :meth:`to_wire`."""
        fields = dict(data)
        if fields.get("env_allowlist") is not None:
            fields["env_allowlist"] = tuple(fields["env_allowlist"])
        fields["require"] = frozenset(fields.get("require") or ())
        fields["disable"] = frozenset(fields.get("disable") or ())
        return cls(**fields)

    def describe(self) -> dict[str, str]:
        """Human-readable limits, for reports."""

        def size(n: int | None) -> str:
            return "-" if n is None else _human(n)

        return {
            "memory": size(self.memory),
            "max_processes": str(self.max_processes or "-"),
            "cpu_time": "-" if self.cpu_time is None else f"{self.cpu_time:g}s",
            "max_open_files": str(self.max_open_files or "-"),
            "max_file_size": size(self.max_file_size),
            "core_dumps": "on" if self.core_dumps else "off",
            "network": "on" if self.network else "off",
            "ipc": "private" if self.private_ipc else "shared",
            "scratch_dir": "on" if self.scratch_dir else "off",
            "filesystem": _describe_filesystem(self),
            "environment": "inherited" if self.env_allowlist is None else "allowlist",
            "user": _describe_user(self.user),
        }


def _check_user(user: object) -> None:
    if user is None or user == PER_WORKER:
        return
    if isinstance(user, bool) or not isinstance(user, (int, str)):
        raise TypeError(f"user is None, 'per-worker', a user name or a uid, not {user!r}")
    if isinstance(user, int) and not 0 <= user < 2**32 - 1:
        raise ValueError(f"a uid is between 0 and 2**32-2, got {user}")
    if resolve_user(user)[0] == 0:
        raise ValueError(f"user {user!r} is root: running workers as root drops nothing")


def _describe_filesystem(profile: Profile) -> str:
    if profile.readonly_fs and profile.landlock:
        return "read-only but scratch (read-only mounts + Landlock)"
    if profile.readonly_fs:
        return "read-only but scratch (read-only mounts)"
    if profile.landlock:
        return "read-only but scratch (Landlock; metadata writable)"
    return "unrestricted"


def _describe_user(user: str | int | None) -> str:
    if user is None:
        return "unchanged"
    if user == PER_WORKER:
        return "own uid per worker"
    return str(user)


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"
