"""The reaper's messages (``docs/protocol.md`` §9), typed, and their strict codec.

The supervisor sends commands (``op``), the reaper sends reports (``ev``): one JSON object per
``SOCK_SEQPACKET`` datagram. Each kind is a frozen class here; :func:`encode_reaper` writes
every field of one, :func:`decode_command` and :func:`decode_report` accept exactly the fields
of a known kind, each of its type, and raise :class:`ProtocolViolation` on anything else (an
unknown ``op`` or ``ev`` included).

Stdlib only, and so is ``_checks.py``, all this file imports of toolpool: the reaper process
loads both by path, under a stand-in package name (``reaper/_main.py``), and never imports
toolpool itself, msgpack or the supervisor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, ClassVar, Final, TypeAlias

from ._checks import MAX_TEXT, ProtocolViolation, int_id, text

__all__ = (
    "ByeReport",
    "CleanCommand",
    "CleanedReport",
    "CleanupDoneReport",
    "CleanupPendingReport",
    "ExitCommand",
    "ExitedReport",
    "ForkUnavailableReport",
    "GoneReport",
    "KillCommand",
    "LostReport",
    "OwnCommand",
    "PreloadCommand",
    "PreloadedReport",
    "ReadyReport",
    "ReaperCommand",
    "ReaperReport",
    "SignalCommand",
    "SpawnCommand",
    "SpawnFailedReport",
    "SpawnedReport",
    "StuckReport",
    "decode_command",
    "decode_report",
    "encode_reaper",
)

#: The longest path a report or command names (Linux's PATH_MAX), in characters.
MAX_PATH: Final = 4096
#: The longest string of a command (an argument, an environment value, the worker's stdin):
#: a command is read whole, at most 1 MiB.
MAX_ARG: Final = 1 << 20


# --------------------------------------------------------------------------- messages


class _Message:
    """A message: frozen (its fields are set once, by ``__init__``), equal to another of its
    class with equal fields. Plain classes with ``__slots__``, not dataclasses: the reaper's
    start makes them all, and twenty frozen dataclasses cost it about 20 ms (their methods are
    compiled from source as each class is made)."""

    FIELDS: ClassVar[tuple[str, ...]] = ()  # its fields, in the constructor's order
    __slots__ = FIELDS
    TYPE: ClassVar[str]

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"{type(self).__name__}({fields})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")


def _fill(message: _Message, *values: Any) -> None:
    """Set ``message``'s fields, in the order of its ``FIELDS``."""
    for name, value in zip(message.FIELDS, values, strict=True):
        object.__setattr__(message, name, value)


# --------------------------------------------------------------------------- commands
# Supervisor -> reaper: the key "op" names the kind.


class SpawnCommand(_Message):
    """Start worker ``wid``: ``argv`` in a new session, ``stdin`` written to its stdin pipe
    (its secret). ``output``: ``"discard"`` or ``"inherit"``. ``cwd``: its scratch directory;
    ``cgroup``: its v2 cgroup (the kill barrier); ``groups``: its cgroup directories;
    ``cleanup``: what to remove once its tree is gone; ``start``: ``"spawn"`` or ``"fork"``.
    Answered by ``spawned`` or ``spawn_failed`` (after ``fork_unavailable``, maybe)."""

    FIELDS: ClassVar[tuple[str, ...]] = (
        "wid",
        "argv",
        "env",
        "stdin",
        "output",
        "cwd",
        "cgroup",
        "groups",
        "cleanup",
        "start",
    )
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "spawn"
    wid: int
    argv: tuple[str, ...]
    env: dict[str, str] | None
    stdin: str
    output: str
    cwd: str | None
    cgroup: str | None
    groups: tuple[str, ...]
    cleanup: tuple[str, ...]
    start: str

    def __init__(
        self,
        wid: int,
        argv: tuple[str, ...],
        env: dict[str, str] | None,
        stdin: str,
        output: str = "discard",
        cwd: str | None = None,
        cgroup: str | None = None,
        groups: tuple[str, ...] = (),
        cleanup: tuple[str, ...] = (),
        start: str = "spawn",
    ) -> None:
        _fill(self, wid, argv, env, stdin, output, cwd, cgroup, groups, cleanup, start)


class SignalCommand(_Message):
    """Send ``sig`` to the worker's descendants, then to the worker. Not answered."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "sig")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "signal"
    wid: int
    sig: int

    def __init__(self, wid: int, sig: int) -> None:
        _fill(self, wid, sig)


class KillCommand(_Message):
    """Kill the worker's tree, once. Not answered: ``gone`` says when it is done."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid",)
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "kill"
    wid: int

    def __init__(self, wid: int) -> None:
        _fill(self, wid)


class CleanCommand(_Message):
    """Kill the worker's descendants, not the worker. Answered by ``cleaned``."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid",)
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "clean"
    wid: int

    def __init__(self, wid: int) -> None:
        _fill(self, wid)


class PreloadCommand(_Message):
    """Import the worker's modules (the template) from ``paths``. Answered by ``preloaded``."""

    FIELDS: ClassVar[tuple[str, ...]] = ("paths",)
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "preload"
    paths: tuple[str, ...]

    def __init__(self, paths: tuple[str, ...]) -> None:
        _fill(self, paths)


class OwnCommand(_Message):
    """The pool's directories, removed when the reaper exits. Not answered."""

    FIELDS: ClassVar[tuple[str, ...]] = ("paths",)
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "own"
    paths: tuple[str, ...]

    def __init__(self, paths: tuple[str, ...]) -> None:
        _fill(self, paths)


class ExitCommand(_Message):
    """Kill every tree, remove what is owned for at most ``cleanup_budget`` seconds, say
    ``bye`` and exit; killed workers are waited for at most ``kill_wait`` seconds."""

    FIELDS: ClassVar[tuple[str, ...]] = ("cleanup_budget", "kill_wait")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "exit"
    cleanup_budget: float
    kill_wait: float

    def __init__(self, cleanup_budget: float = 2.0, kill_wait: float = 2.0) -> None:
        _fill(self, cleanup_budget, kill_wait)


ReaperCommand: TypeAlias = (
    SpawnCommand
    | SignalCommand
    | KillCommand
    | CleanCommand
    | PreloadCommand
    | OwnCommand
    | ExitCommand
)


# --------------------------------------------------------------------------- reports
# Reaper -> supervisor: the key "ev" names the kind.


class ReadyReport(_Message):
    """The reaper runs (``pid``); ``subreaper``: whether it became a child subreaper."""

    FIELDS: ClassVar[tuple[str, ...]] = ("pid", "subreaper")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "ready"
    pid: int
    subreaper: bool

    def __init__(self, pid: int, subreaper: bool) -> None:
        _fill(self, pid, subreaper)


class SpawnedReport(_Message):
    """Worker ``wid`` is process ``pid``, started by ``method`` (``"spawn"`` or ``"fork"``)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "pid", "method")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "spawned"
    wid: int
    pid: int
    method: str

    def __init__(self, wid: int, pid: int, method: str) -> None:
        _fill(self, wid, pid, method)


class ForkUnavailableReport(_Message):
    """Worker ``wid`` could not be forked (``reason``): it is spawned instead."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "reason")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "fork_unavailable"
    wid: int
    reason: str

    def __init__(self, wid: int, reason: str) -> None:
        _fill(self, wid, reason)


class SpawnFailedReport(_Message):
    """Worker ``wid`` could not be started: ``error``."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "error")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "spawn_failed"
    wid: int
    error: str

    def __init__(self, wid: int, error: str) -> None:
        _fill(self, wid, error)


class ExitedReport(_Message):
    """Worker ``wid`` (``pid``) was reaped with ``status`` (``os.waitstatus_to_exitcode``);
    ``oom_kills``: the OOM kills its memory cgroup recorded. Its ``gone`` follows."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "pid", "status", "oom_kills")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "exited"
    wid: int
    pid: int
    status: int
    oom_kills: int

    def __init__(self, wid: int, pid: int, status: int, oom_kills: int) -> None:
        _fill(self, wid, pid, status, oom_kills)


class GoneReport(_Message):
    """Worker ``wid`` was reaped and every process of its tree is gone. ``pid``, ``status``
    and ``oom_kills`` (as in ``exited``) are its exit when no ``exited`` came before: all
    three or none (None). ``removing``: the worker's directories the reaper removes from
    now on, after this report (each ends with a ``cleanup_done``)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "pid", "status", "oom_kills", "removing")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "gone"
    wid: int
    pid: int | None
    status: int | None
    oom_kills: int | None
    removing: tuple[str, ...]

    def __init__(
        self,
        wid: int,
        pid: int | None = None,
        status: int | None = None,
        oom_kills: int | None = None,
        removing: tuple[str, ...] = (),
    ) -> None:
        _fill(self, wid, pid, status, oom_kills, removing)

    @property
    def exit(self) -> ExitedReport | None:
        """The worker's exit, when this report carries it."""
        if self.pid is None or self.status is None or self.oom_kills is None:
            return None
        return ExitedReport(self.wid, self.pid, self.status, self.oom_kills)


class StuckReport(_Message):
    """Worker ``wid`` was reaped, but its tree is not gone yet (its cgroup is not empty, or
    orphans ``pids`` did not die): the reaper retries, and says ``gone`` then."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "pids")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "stuck"
    wid: int
    pids: tuple[int, ...]

    def __init__(self, wid: int, pids: tuple[int, ...] = ()) -> None:
        _fill(self, wid, pids)


class CleanedReport(_Message):
    """A ``clean`` of worker ``wid`` ended: ``count`` processes were killed."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "count")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "cleaned"
    wid: int
    count: int

    def __init__(self, wid: int, count: int) -> None:
        _fill(self, wid, count)


class PreloadedReport(_Message):
    """A ``preload`` ended: the template is loaded, or ``error`` says why not."""

    FIELDS: ClassVar[tuple[str, ...]] = ("error",)
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "preloaded"
    error: str | None

    def __init__(self, error: str | None = None) -> None:
        _fill(self, error)


class CleanupPendingReport(_Message):
    """Directory ``path`` of worker ``wid`` (None: the pool's) is still being removed, in
    the background (``removed`` entries so far)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "path", "removed")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "cleanup_pending"
    wid: int | None
    path: str
    removed: int

    def __init__(self, wid: int | None, path: str, removed: int) -> None:
        _fill(self, wid, path, removed)


class CleanupDoneReport(_Message):
    """A removal reported pending ended, or one ended with something left (``finished``
    false, ``error`` says what and why)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("wid", "path", "removed", "finished", "error")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "cleanup_done"
    wid: int | None
    path: str
    removed: int
    finished: bool
    error: str | None

    def __init__(
        self, wid: int | None, path: str, removed: int, finished: bool, error: str | None = None
    ) -> None:
        _fill(self, wid, path, removed, finished, error)


class ByeReport(_Message):
    """The reaper exits. ``unfinished``: what it goes on removing after this; ``failed``:
    what could not be removed, and why; ``unkillable``: processes alive after every kill."""

    FIELDS: ClassVar[tuple[str, ...]] = ("unfinished", "failed", "unkillable")
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "bye"
    unfinished: tuple[str, ...]
    failed: tuple[str, ...]
    unkillable: tuple[int, ...]

    def __init__(
        self,
        unfinished: tuple[str, ...] = (),
        failed: tuple[str, ...] = (),
        unkillable: tuple[int, ...] = (),
    ) -> None:
        _fill(self, unfinished, failed, unkillable)


class LostReport(_Message):
    """The client's own report, never on the wire: the reaper's socket closed without a
    ``bye``, or the reaper broke the protocol (``error``; the client killed it then)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("error",)
    __slots__ = FIELDS
    TYPE: ClassVar[str] = "lost"
    error: str | None

    def __init__(self, error: str | None = None) -> None:
        _fill(self, error)


ReaperReport: TypeAlias = (
    ReadyReport
    | SpawnedReport
    | ForkUnavailableReport
    | SpawnFailedReport
    | ExitedReport
    | GoneReport
    | StuckReport
    | CleanedReport
    | PreloadedReport
    | CleanupPendingReport
    | CleanupDoneReport
    | ByeReport
    | LostReport
)


# --------------------------------------------------------------------------- field checks

_Check: TypeAlias = Callable[[Any, str], Any]


def _id(value: Any, what: str) -> int:
    return int_id(value, what)


def _pid(value: Any, what: str) -> int:
    if type(value) is not int or not 0 < value <= 2**31:
        raise ProtocolViolation(f"{what} must be a process id")
    return value


def _status(value: Any, what: str) -> int:
    """``os.waitstatus_to_exitcode``: an exit code (0 to 255) or minus a signal's number."""
    if type(value) is not int or not -128 <= value <= 255:
        raise ProtocolViolation(f"{what} must be an exit status (-128 to 255)")
    return value


def _sig(value: Any, what: str) -> int:
    if type(value) is not int or not 0 < value < 128:
        raise ProtocolViolation(f"{what} must be a signal number")
    return value


def _bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise ProtocolViolation(f"{what} must be a boolean")
    return value


def _seconds(value: Any, what: str) -> float:
    if type(value) is int and 0 <= value <= 2**31:
        return float(value)
    if type(value) is not float or not 0.0 <= value < math.inf:
        raise ProtocolViolation(f"{what} must be a finite, non-negative number of seconds")
    return value


def _str(limit: int) -> _Check:
    def check(value: Any, what: str) -> str:
        result: str = text(value, what, limit)
        return result

    return check


def _one_of(*choices: str) -> _Check:
    def check(value: Any, what: str) -> str:
        if type(value) is not str or value not in choices:
            raise ProtocolViolation(f"{what} must be one of {', '.join(choices)}")
        return value

    return check


def _optional(inner: _Check) -> _Check:
    def check(value: Any, what: str) -> Any:
        return None if value is None else inner(value, what)

    return check


def _tuple(inner: _Check, *, least: int = 0) -> _Check:
    def check(value: Any, what: str) -> tuple[Any, ...]:
        if type(value) is not list or len(value) < least:
            raise ProtocolViolation(f"{what} must be an array of at least {least} items")
        return tuple(inner(item, f"an item of {what}") for item in value)

    return check


def _env(value: Any, what: str) -> dict[str, str] | None:
    if value is None:
        return None
    if type(value) is not dict or not all(
        type(v) is str and len(v) <= MAX_ARG for v in value.values()
    ):
        raise ProtocolViolation(f"{what} must map names to strings")
    return value  # (a JSON object's keys are strings)


_PATH = _str(MAX_PATH)
_PATHS = _tuple(_PATH)

#: Each kind's class and its fields' checks, in order (every field is on the wire).
_COMMANDS: Final[dict[str, tuple[type[Any], dict[str, _Check]]]] = {
    "spawn": (
        SpawnCommand,
        {
            "wid": _id,
            "argv": _tuple(_str(MAX_ARG), least=1),
            "env": _env,
            "stdin": _str(MAX_ARG),
            "output": _one_of("discard", "inherit"),
            "cwd": _optional(_PATH),
            "cgroup": _optional(_PATH),
            "groups": _PATHS,
            "cleanup": _PATHS,
            "start": _one_of("spawn", "fork"),
        },
    ),
    "signal": (SignalCommand, {"wid": _id, "sig": _sig}),
    "kill": (KillCommand, {"wid": _id}),
    "clean": (CleanCommand, {"wid": _id}),
    "preload": (PreloadCommand, {"paths": _tuple(_str(MAX_ARG))}),
    "own": (OwnCommand, {"paths": _PATHS}),
    "exit": (ExitCommand, {"cleanup_budget": _seconds, "kill_wait": _seconds}),
}

_TEXT = _str(MAX_TEXT)
_REPORTS: Final[dict[str, tuple[type[Any], dict[str, _Check]]]] = {
    "ready": (ReadyReport, {"pid": _pid, "subreaper": _bool}),
    "spawned": (SpawnedReport, {"wid": _id, "pid": _pid, "method": _one_of("spawn", "fork")}),
    "fork_unavailable": (ForkUnavailableReport, {"wid": _id, "reason": _TEXT}),
    "spawn_failed": (SpawnFailedReport, {"wid": _id, "error": _TEXT}),
    "exited": (ExitedReport, {"wid": _id, "pid": _pid, "status": _status, "oom_kills": _id}),
    "gone": (
        GoneReport,
        {
            "wid": _id,
            "pid": _optional(_pid),
            "status": _optional(_status),
            "oom_kills": _optional(_id),
            "removing": _PATHS,
        },
    ),
    "stuck": (StuckReport, {"wid": _id, "pids": _tuple(_pid)}),
    "cleaned": (CleanedReport, {"wid": _id, "count": _id}),
    "preloaded": (PreloadedReport, {"error": _optional(_TEXT)}),
    "cleanup_pending": (
        CleanupPendingReport,
        {"wid": _optional(_id), "path": _PATH, "removed": _id},
    ),
    "cleanup_done": (
        CleanupDoneReport,
        {
            "wid": _optional(_id),
            "path": _PATH,
            "removed": _id,
            "finished": _bool,
            "error": _optional(_TEXT),
        },
    ),
    "bye": (
        ByeReport,
        {"unfinished": _PATHS, "failed": _tuple(_TEXT), "unkillable": _tuple(_pid)},
    ),
}


# --------------------------------------------------------------------------- codec


def encode_reaper(message: ReaperCommand | ReaperReport) -> bytes:
    """Encode a command or a report as one datagram: a JSON object of every field, with
    ``op`` (a command) or ``ev`` (a report) naming its kind. A :class:`LostReport` is never
    sent (TypeError)."""
    kind = message.TYPE
    command = _COMMANDS.get(kind)
    if command is not None and type(message) is command[0]:
        key, checks = "op", command[1]
    else:
        report = _REPORTS.get(kind)
        if report is None or type(message) is not report[0]:
            raise TypeError(f"{type(message).__name__} is not sent to or by the reaper")
        key, checks = "ev", report[1]
    obj: dict[str, Any] = {key: kind}
    for name in checks:  # (the class's FIELDS: a test holds them to that)
        obj[name] = getattr(message, name)
    return _ENCODER.encode(obj).encode()


def _no_constant(name: str) -> Any:
    raise ProtocolViolation(f"{name} is not a number a frame may carry")


# (One of each, made once: json.dumps and json.loads make a new one per call when given options.)
_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_DECODER: Final = json.JSONDecoder(parse_constant=_no_constant)


def _decode(frame: bytes, key: str, kinds: dict[str, tuple[type[Any], dict[str, _Check]]]) -> Any:
    try:
        obj = _DECODER.decode(frame.decode())
    except ProtocolViolation:
        raise
    except Exception as exc:  # ValueError, UnicodeDecodeError, RecursionError (deep nesting)...
        why = str(exc)[:200]
        raise ProtocolViolation(f"undecodable frame: {type(exc).__name__}: {why}") from None
    if type(obj) is not dict:
        raise ProtocolViolation("a frame is a JSON object")
    kind = obj.get(key)
    if type(kind) is not str:
        raise ProtocolViolation(f"a frame names its kind in {key!r}")
    entry = kinds.get(kind)
    if entry is None:
        raise ProtocolViolation(f"unknown {key} {kind[:64]!r}")
    cls, checks = entry
    if len(obj) != len(checks) + 1 or not all(name in obj for name in checks):
        missing = sorted(set(checks) - set(obj))
        extra = sorted(set(obj) - set(checks) - {key})
        raise ProtocolViolation(
            f"{kind!r}: missing {', '.join(missing) or 'nothing'}; "
            f"unknown {', '.join(n[:64] for n in extra[:8]) or 'nothing'}"
        )
    return cls(*[check(obj[name], name) for name, check in checks.items()])


def decode_command(frame: bytes) -> ReaperCommand:
    """Decode and validate one command (the reaper's side). Raises :class:`ProtocolViolation`."""
    command: ReaperCommand = _decode(frame, "op", _COMMANDS)
    return command


def decode_report(frame: bytes) -> ReaperReport:
    """Decode and validate one report (the supervisor's side). Raises
    :class:`ProtocolViolation`; ``lost`` is the client's own, never decoded."""
    report: ReaperReport = _decode(frame, "ev", _REPORTS)
    if type(report) is GoneReport:
        exit_fields = (report.pid, report.status, report.oom_kills)
        if None in exit_fields and exit_fields != (None, None, None):
            raise ProtocolViolation("'gone': pid, status and oom_kills come all three or none")
    return report
