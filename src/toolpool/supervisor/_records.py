"""What the pool's core knows of calls, groups and workers, and the actions it asks for.

Plain data, no I/O: the core (``_core.py`` and the layers below it) reads and changes these
records; the shell (``_pool.py``) creates calls and groups (the public :class:`toolpool.Call`
and :class:`toolpool.Group` extend the records here with their awaitable faces) and performs
the actions.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from ..core import CancelCause, CancelController, CancelSignal, WorkerStartError
from ._results import Progress, Result, Rung, WorkerState

__all__ = (
    "KILLED_TEXT",
    "TIMEOUT_TEXT",
    "WORKER_LOST_TEXT",
    "Action",
    "Autoscale",
    "CallRecord",
    "CallState",
    "Changed",
    "Clean",
    "Close",
    "FirstHello",
    "GroupRecord",
    "Kill",
    "Orphaned",
    "ProviderDown",
    "ProviderRecord",
    "ProviderResized",
    "ProviderSpec",
    "ProviderUp",
    "Progressed",
    "RestartReaper",
    "Send",
    "Settled",
    "Spawn",
    "Started",
    "Terminate",
    "WorkerDown",
    "Unkillable",
    "WorkerRecord",
    "WorkerUp",
)

WORKER_LOST_TEXT: Final = "Error: worker lost"
KILLED_TEXT: Final = "Error: tool call killed"
TIMEOUT_TEXT: Final = "Error: tool call timed out"


class CallState(enum.Enum):
    """Where a call is, as the supervisor sees it (``docs/pool.md``, "The core")."""

    QUEUED = "queued"
    """In the pool's queue: no worker has it."""
    SENT = "sent"
    """Sent to a worker: it runs it, or holds it queued behind the call it runs."""
    RUNNING = "running"
    """Its worker reported the body started."""
    SETTLED = "settled"
    """It has its result; the pool holds no reference to it any more."""


class CallRecord:
    """A call as the core tracks it. The public :class:`toolpool.Call` extends it."""

    __slots__ = (
        "_args",
        "_cause",
        "_deadline",
        "_forced",
        "_group",
        "_index",
        "_laddering",
        "_owner",
        "_progress",
        "_provider",
        "_queued",
        "_recalling",
        "_requeued",
        "_result",
        "_rung",
        "_started",
        "_state",
        "_times",
        "_worker",
        "id",
        "tool",
    )

    def __init__(
        self, call_id: int, tool: str, args: bytes, group: GroupRecord | None, now: float
    ) -> None:
        self.id = call_id
        """The pool-wide call id."""
        self.tool = tool
        """The tool's name."""
        self._args = args  # msgpack of the arguments, as sent
        self._group = group
        self._index: int | None = None  # its position in a map's input (Result.index)
        self._state = CallState.QUEUED
        self._worker: WorkerRecord | None = None
        self._cause: CancelCause | None = None
        self._rung = Rung.NONE
        self._started = False
        self._result: Result | None = None
        self._deadline: float | None = None
        self._laddering = False  # its escalation ladder runs
        self._queued = False  # it is in a provider's queue (settled ones may linger there)
        self._provider: ProviderRecord | None = None  # whose queue holds it, if queued
        self._owner: ProviderRecord | None = None  # whose tool it called (its statistics)
        self._forced = False
        self._recalling = False  # a recall (or the worker's shutdown) may withdraw it
        self._requeued = False  # run elsewhere once, first in line in a worker that died
        self._times: dict[str, float] = {"submitted": now}
        self._progress: Progress | None = None  # what its body last reported


class GroupRecord:
    """A group (turn) as the core tracks it: its cancel controller and its unsettled calls.
    The public :class:`toolpool.Group` extends it."""

    def __init__(self) -> None:
        self._controller = CancelController()
        self._calls: set[CallRecord] = set()

    @property
    def signal(self) -> CancelSignal:
        """The group's cancel signal (read-only)."""
        return self._controller.signal

    @property
    def cancelled(self) -> bool:
        """True once the group was cancelled."""
        return self._controller.signal.cancelled


@dataclass(frozen=True, slots=True, kw_only=True)
class ProviderSpec:
    """What the core's decisions need of a provider's options (the shell keeps the rest:
    its profile, environment, output capture)."""

    tools_spec: str
    size: int
    warm_spares: int = 0
    prefetch: int = 0
    allow_background: bool = False
    memory_cap: int | None = None  # the profile's, for the OOM text
    max_calls: int | None = None  # a worker retires after this many calls (None: never)


@dataclass(frozen=True, slots=True, kw_only=True)
class Autoscale:
    """An autoscaled provider's bounds and thresholds (``pool.autoscale``)."""

    minimum: int
    maximum: int
    grow_after: float  # a call waiting this long (seconds) for a worker adds one
    idle_after: float  # a worker idle this long (seconds) goes, down to ``minimum``


class ProviderRecord:
    """A provider as the core tracks it: one generation of workers running one tools module.

    A reload makes a new record of the same name (``generation`` + 1) that takes over the
    old one's queue the moment every new worker is ready; the old one drains.
    """

    def __init__(self, pid: int, name: str, spec: ProviderSpec, generation: int = 1) -> None:
        self.id = pid  # unique in the pool (timers are keyed by it)
        self.name = name
        self.spec = spec
        self.generation = generation
        #: ``starting`` (its first workers start), ``active`` (its tools resolve to it),
        #: ``draining`` (removed or replaced: its running calls finish, nothing new comes),
        #: ``gone`` (every worker of it is gone), ``failed`` (it never became active).
        self.state = "starting"
        self.reason = ""  # why it was removed
        self.queue: collections.deque[CallRecord] = collections.deque()
        self.settled_in_queue = 0  # calls settled while queued, not yet dropped from it
        self.ready: list[WorkerRecord] = []
        self.catalog: dict[str, dict[str, Any]] = {}
        self.threaded: set[str] = set()  # tools whose bodies leave the worker's loop free
        self.worker_layers: dict[str, Any] | None = None
        self.start_failures = 0
        self.broken: WorkerStartError | None = None
        self.error: Exception | None = None  # why it failed to start (a conflict, ...)
        self.starting = True  # a start failure now breaks it at once
        self.drain_by: float | None = None  # when its running calls get a cancel (draining)
        self.tally: Any = None  # its statistics (_state.Tally), shared by its generations
        self.autoscale: Autoscale | None = None
        self.scale_armed = False  # its autoscaler's next look is in the timers

    @property
    def size(self) -> int:
        return self.spec.size

    @property
    def live(self) -> bool:
        """It takes calls (or will, once started)."""
        return self.state in ("starting", "active")

    def __repr__(self) -> str:
        return f"<provider {self.name!r} gen {self.generation} {self.state}>"


class WorkerRecord:
    """A worker process as the core tracks it. Its socket, files and directories are the
    shell's (``_pool.py``: ``_WorkerIO``)."""

    __slots__ = (
        "acks_expected",
        "answered",
        "awaiting_fatal",
        "beat_at",
        "budget",
        "budget_at",
        "calls",
        "catalog",
        "disconnected",
        "draining",
        "escalated",
        "exit_status",
        "fatal",
        "gone",
        "gone_deferred",
        "head_since",
        "holding",
        "hung",
        "killed_at",
        "lost_reason",
        "oom_kills",
        "orphaned",
        "peer_pid",
        "pending",
        "pid",
        "provider",
        "replaced",
        "results",
        "retire_reason",
        "retired",
        "secret",
        "served",
        "signals",
        "start_failed",
        "start_method",
        "state",
        "unkillable_pids",
        "verified",
        "violated",
        "violation",
        "wid",
    )

    def __init__(self, wid: int, secret: bytes, provider: ProviderRecord) -> None:
        self.wid = wid
        self.secret = secret  # what its hello must carry
        self.provider = provider  # whose tools it runs
        self.state = WorkerState.SPAWNING
        self.pid: int | None = None
        self.start_method: str | None = None  # how the reaper started it, once it said
        # Its calls in the order sent: the first runs (or is next), the rest wait in its queue.
        self.calls: collections.deque[CallRecord] = collections.deque()
        self.head_since = 0.0  # when the first of them became first
        self.holding = False  # its last call left processes behind: it waits for 'resume'
        self.results = 0  # results received from it (found in its ledger, too)
        self.signals: dict[str, float] = {}  # "sigterm"/"sigkill": when its tree first got it
        self.acks_expected: set[int] = set()  # calls it was sent a cancel for, not yet acked
        self.catalog: dict[str, dict[str, Any]] = {}
        self.exit_status: int | None = None
        self.fatal: str | None = None
        self.violation: str | None = None
        self.violated = False  # quarantined for breaking the protocol: its word counts no more
        self.lost_reason: str | None = None  # why its call is lost, if not its exit (reaper)
        self.start_failed = False
        self.answered = False  # it said hello, or its start failed
        self.gone = False  # it and every process of its tree are gone
        self.verified = True  # ... and that was checked (False: its reaper died, no cgroup)
        self.orphaned = False  # its reaper died: the shell ends its tree itself
        self.disconnected = False
        self.draining = False  # it exits once its calls end (a shrink): none is sent to it
        self.retired = False  # it was told to exit (Shutdown)
        self.served = 0  # calls it settled whose body it may have started (max_calls)
        self.retire_reason = ""  # why, in words (logged at DEBUG when it is gone)
        self.escalated = False
        self.awaiting_fatal = False
        self.gone_deferred = False  # its tree is gone, handled once its 'fatal' is read
        self.peer_pid: int | None = None  # who sent its first message (SO_PEERCRED)
        self.oom_kills = 0  # OOM kills in its memory cgroup, as the reaper read them at exit
        self.pending: Callable[..., None] | None = None  # settles its call once cleaned up
        self.killed_at: float | None = None  # when its tree was first asked SIGKILLed
        self.unkillable_pids: tuple[int, ...] = ()  # its tree's, when found unkillable
        self.replaced = False  # a replacement was started before it was gone (unkillable)
        # Liveness (Pool(heartbeat=...)): when it last said hello or sent a heartbeat, and
        # whether it sent none for HUNG_AFTER_BEATS intervals since.
        self.beat_at = 0.0
        self.hung = False
        # What it may still send unasked (heartbeats, progress) before it floods (C7).
        self.budget = 0.0
        self.budget_at = 0.0

    @property
    def call(self) -> CallRecord | None:
        """The call it runs, or takes up next."""
        return self.calls[0] if self.calls else None

    def __repr__(self) -> str:
        return f"<worker {self.wid} pid={self.pid} {self.state.value}>"


# --------------------------------------------------------------------------- actions
# What the core asks the shell to do (``PoolCore.flush`` returns them in order).


class Send(NamedTuple):
    """Send ``frames`` to worker ``wid`` as one multipart message. ``calls`` are the calls
    whose ``call`` frames these are: if the send fails, report ``send_failed``."""

    wid: int
    frames: list[bytes]
    calls: tuple[CallRecord, ...] = ()


class Spawn(NamedTuple):
    """Start worker ``wid`` of ``provider`` (its socket, files, the reaper's spawn); its
    hello must carry ``secret``."""

    wid: int
    secret: bytes
    provider: str = "default"


class Terminate(NamedTuple):
    """SIGTERM worker ``wid``'s whole tree."""

    wid: int


class Kill(NamedTuple):
    """SIGKILL worker ``wid``'s whole tree (the reaper freezes it and loops until empty)."""

    wid: int


class Clean(NamedTuple):
    """Kill what worker ``wid``'s last call left running (never the worker); answered by
    ``cleaned``."""

    wid: int


class Close(NamedTuple):
    """Worker ``wid`` is gone: close its socket and files."""

    wid: int


class Unkillable(NamedTuple):
    """Worker ``wid``'s tree is still there ``unkillable_after`` seconds after its SIGKILL
    (``pids``: its processes then): report it (the core has logged it, taken the worker out
    of service and started its replacement; the reaper goes on reaping it)."""

    wid: int
    pids: tuple[int, ...]


class Orphaned(NamedTuple):
    """The reaper died: end worker ``wid``'s tree without it (its cgroup, where it has one),
    then report ``worker_gone`` saying whether the whole tree was verified gone."""

    wid: int


class RestartReaper(NamedTuple):
    """Every worker of the dead reaper is gone: start a new one, then report
    ``reaper_ready`` (or ``reaper_failed``)."""


class Settled(NamedTuple):
    """``call`` settled: wake whoever waits for it."""

    call: CallRecord


class Started(NamedTuple):
    """``call``'s body started: wake whoever waits for that."""

    call: CallRecord


class Progressed(NamedTuple):
    """``call``'s body reported progress (``call._progress``): wake whoever follows it."""

    call: CallRecord


class Changed(NamedTuple):
    """The workers changed (one became ready, failed, or is gone)."""


class FirstHello(NamedTuple):
    """The first hello of a provider's worker: the containment layers it applied."""

    containment: Mapping[str, Any]
    provider: str = "default"


class ProviderUp(NamedTuple):
    """``provider`` became resolvable: every worker it started with is ready (an add, or a
    reload swapped in). ``replaced``: the generation it took over from (a reload)."""

    provider: ProviderRecord
    replaced: ProviderRecord | None = None


class ProviderDown(NamedTuple):
    """``provider`` is no longer resolvable (removed, rolled back, failed to start,
    replaced by a reload): announce its removal."""

    provider: ProviderRecord
    reason: str


class ProviderResized(NamedTuple):
    """``provider`` was resized from ``old`` to ``new`` workers (``reason``: a ``resize``
    call, or the autoscaler's decision and why)."""

    provider: ProviderRecord
    old: int
    new: int
    reason: str


class WorkerUp(NamedTuple):
    """Worker ``wid`` (``pid``) of ``provider`` said hello: it serves."""

    wid: int
    pid: int | None
    provider: str


class WorkerDown(NamedTuple):
    """Worker ``wid`` and its tree are gone; ``why``: retired, crashed, killed, lost."""

    wid: int
    pid: int | None
    provider: str
    why: str


Action = (
    Send
    | Spawn
    | Terminate
    | Kill
    | Clean
    | Close
    | Orphaned
    | Unkillable
    | RestartReaper
    | Settled
    | Started
    | Progressed
    | Changed
    | FirstHello
    | ProviderUp
    | ProviderDown
    | ProviderResized
    | WorkerUp
    | WorkerDown
)
