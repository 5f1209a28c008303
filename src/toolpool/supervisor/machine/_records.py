"""What the machine knows of calls, groups, providers and workers: plain data, no I/O.

The parts of the machine (``_machine.py`` and the parts it owns) read and change these
records; the shell (``supervisor/_pool.py``) creates calls and groups: the public
:class:`toolpool.Call` and :class:`toolpool.Group` (``supervisor/_calls.py``) each hold
their record here, and the machine knows nothing of them.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from ...core import CancelCause, CancelController, CancelSignal, Outcome, WorkerStartError
from .._results import Progress, Result, Rung, Timeline, WorkerState, _Deferred

__all__ = (
    "KILLED_TEXT",
    "TIMEOUT_TEXT",
    "WORKER_LOST_TEXT",
    "Autoscale",
    "CallRecord",
    "CALL_MOVES",
    "PROVIDER_MOVES",
    "WORKER_MOVES",
    "CallState",
    "GroupRecord",
    "BrokenInvariant",
    "IllegalMove",
    "ProviderRecord",
    "ProviderSpec",
    "ProviderState",
    "WorkerRecord",
)

WORKER_LOST_TEXT: Final = "Error: worker lost"
KILLED_TEXT: Final = "Error: tool call killed"
TIMEOUT_TEXT: Final = "Error: tool call timed out"


class IllegalMove(RuntimeError):
    """A record was asked to move where its transition table does not let it: a bug of the
    machine, never the world's doing."""


def _illegal(record: object, old: enum.Enum, new: enum.Enum) -> IllegalMove:
    return IllegalMove(f"{record!r}: {old.value} -> {new.value} is not a legal move")


def _by_name(moves: dict[Any, frozenset[Any]]) -> dict[str, frozenset[str]]:
    """A transition table keyed by the states' names: an enum member's hash is computed in
    Python (``Enum.__hash__``), a name's is cached (``advance`` is on the hot path)."""
    return {old._name_: frozenset(new._name_ for new in news) for old, news in moves.items()}


class BrokenInvariant(AssertionError):
    """An invariant of the machine's records broke (``Machine.check``): a bug of the
    machine."""


def require(holds: bool, *what: object) -> None:
    if not holds:
        raise BrokenInvariant(*what)


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


#: A call's legal moves: from each state, where it may go (``CallRecord.advance``). A call
#: withdrawn from its worker, or never taken up by one that died, goes back to the queue.
CALL_MOVES: Final[dict[CallState, frozenset[CallState]]] = {
    CallState.QUEUED: frozenset((CallState.SENT, CallState.SETTLED)),
    CallState.SENT: frozenset((CallState.QUEUED, CallState.RUNNING, CallState.SETTLED)),
    CallState.RUNNING: frozenset((CallState.SETTLED,)),
    CallState.SETTLED: frozenset(),
}
_CALL_NEXT: Final = _by_name(CALL_MOVES)
# (bound once, for a new call's fields: a member read through its class is slow)
_NEW_STATE: Final = CallState.QUEUED
_NO_RUNG: Final = Rung.NONE


class CallRecord:
    """A call as the core tracks it. The public :class:`toolpool.Call` holds it."""

    __slots__ = (
        "_args",
        "_cause",
        "_deadline",
        "_facts",
        "_forced",
        "_group",
        "_index",
        "_laddering",
        "_owner",
        "_parts",
        "_progress",
        "_provider",
        "_queued",
        "_recalling",
        "_requeued",
        "_res",
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
        self._parts: tuple[bytes, ...] = ()  # their parts (large byte strings), sent after it
        self._group = group
        self._index: int | None = None  # its position in a map's input (Result.index)
        self._state = _NEW_STATE
        self._worker: WorkerRecord | None = None
        self._cause: CancelCause | None = None
        self._rung = _NO_RUNG
        self._started = False
        # What it settled with (``Settlement.settle``): a tuple, made into its Result (and
        # Timeline) when someone first reads ``_result``; None until it settled.
        self._facts: tuple[Any, ...] | None = None
        self._res: Result | None = None  # its Result, once built
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

    @property
    def _result(self) -> Result | None:
        """Its :class:`Result` once settled (built on the first read), else None. Whether it
        settled, without building it: ``_facts is not None``."""
        res = self._res
        if res is None:
            facts = self._facts
            if facts is not None:  # (_build_result, inline)
                res = self._res = _make_result(self.id, self.tool, facts)
        return res

    @_result.setter
    def _result(self, result: Result | None) -> None:  # (a test's, or a shell's, own result)
        self._res = result
        self._facts = None if result is None else ()

    def advance(self, to: CallState) -> None:
        """Move to ``to``, if ``CALL_MOVES`` lets it (else :class:`IllegalMove`)."""
        if to._name_ not in _CALL_NEXT[self._state._name_]:
            raise _illegal(self, self._state, to)
        self._state = to

    def check(self) -> None:
        """The invariants between its fields (``Machine.check``)."""
        state, worker = self._state, self._worker
        # Settled exactly when it has its result.
        require((state is CallState.SETTLED) == (self._facts is not None), self)
        # A queued call has no worker; a sent or running one has the worker that holds it.
        if state is CallState.QUEUED:
            require(worker is None, self)
        elif state is not CallState.SETTLED:
            require(worker is not None and self in worker.calls, self)
        # In a provider's queue only while queued (a settled one is dropped at once, or
        # counted in the queue's settled_in_queue).
        if self._queued:
            require(state is CallState.QUEUED and self._provider is not None, self)
        # Running: its worker said its body started.
        if state is CallState.RUNNING:
            require(self._started, self)
        # A ladder, a force and a rung only for a cancelled call.
        if self._laddering or self._forced:
            require(self._cause is not None, self)

    def __repr__(self) -> str:
        return f"<call {self.id} {self.tool} {self._state.value}>"


#: Outcome by its value: a dict lookup, not ``Outcome(value)`` (an Enum call) per result.
OUTCOME_OF: Final[dict[str, Outcome]] = {o._value_: o for o in Outcome}
#: A Result's empty context: read-only, one serves all.
NO_CONTEXT: Final[MappingProxyType[str, Any]] = MappingProxyType({})


def _setters(cls: type, names: tuple[str, ...]) -> dict[str, Any]:
    return {f"_set_{n}": cls.__dict__[n].__set__ for n in names}  # (slot descriptors)


_RESULT_FIELDS: Final = tuple(Result.__slots__)
_TIMELINE_FIELDS: Final = tuple(Timeline.__slots__)
#: A call's facts (``CallRecord._facts``, made by ``Settlement.settle`` and
#: ``result_facts``): its Result's fields after ``call_id`` and ``tool``, in their order,
#: with the step times in place of the Timeline (a dict the call no longer writes to).
FACT_FIELDS: Final = _RESULT_FIELDS[2:]
# A Result and a Timeline are frozen dataclasses: their __init__ takes keywords and sets each
# field through object.__setattr__ (a call of a method per field). Each is made here as an
# instance of a twin class (its slots, in its order, on the same base: a plain __init__ that
# stores them, the cheapest way Python sets a slot) that then becomes one (``__class__``:
# the two have the same layout). A Result gets its first fields when it is made (what ``ok``
# and a caller's first look read), the others from its facts when one of them is first read
# (``_results._Deferred``: slot by slot, through the slots' own setters, on a result that
# others may already hold); every field is set, as __init__ would.
_BUILD_SRC = "\n".join(
    (
        "class _NewResult(_Deferred):",
        f"    __slots__ = {_RESULT_FIELDS!r}",
        "    def __init__(self, call_id, tool, facts):",
        "        self.call_id = call_id",
        "        self.tool = tool",
        "        self.outcome = facts[0]",
        "        self.value = facts[1]",
        "        self._pending = facts",
        "        self.__class__ = Result",
        "class _NewTimeline:",
        f"    __slots__ = {_TIMELINE_FIELDS!r}",
        "    def __init__(self, times):",
        "        get = times.get",
        *(f"        self.{n} = get({n!r})" for n in _TIMELINE_FIELDS),
        "        self.__class__ = Timeline",
        "def _fill(r, facts):",
        *(
            f"    _set_{n}(r, _NewTimeline(facts[{i}]))"
            if n == "timeline"
            else f"    _set_{n}(r, facts[{i}])"
            for i, n in enumerate(FACT_FIELDS)
            if i > 1
        ),
    )
)
_ns: dict[str, Any] = {
    "_Deferred": _Deferred,
    "Result": Result,
    "Timeline": Timeline,
    **_setters(Result, _RESULT_FIELDS),
}
exec(_BUILD_SRC, _ns)
_make_result: Final[Callable[[int, str, tuple[Any, ...]], Result]] = _ns["_NewResult"]
_timeline: Final[Callable[[dict[str, float]], Timeline]] = _ns["_NewTimeline"]
_Deferred._fill = _ns["_fill"]


def _build_result(call: CallRecord) -> Result:
    """call's Result, from the facts it settled with (``FACT_FIELDS``): its first fields now,
    the rest (and its Timeline) when one of them is first read."""
    facts = call._facts
    assert facts is not None
    return _make_result(call.id, call.tool, facts)


class GroupRecord:
    """A group (turn) as the core tracks it: its cancel controller and its unsettled calls.
    The public :class:`toolpool.Group` holds it."""

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


class ProviderState(enum.StrEnum):
    """Where a provider is (``ProviderRecord.advance``)."""

    STARTING = "starting"
    """Its first workers start; its tools resolve to it once they are all ready."""
    ACTIVE = "active"
    """Its tools resolve to it."""
    DRAINING = "draining"
    """Removed or replaced: its running calls finish, nothing new comes."""
    GONE = "gone"
    """Every worker of it is gone, after draining."""
    FAILED = "failed"
    """It never became active (a start failure, a conflict, removed while starting)."""


#: A provider's legal moves.
PROVIDER_MOVES: Final[dict[ProviderState, frozenset[ProviderState]]] = {
    ProviderState.STARTING: frozenset((ProviderState.ACTIVE, ProviderState.FAILED)),
    ProviderState.ACTIVE: frozenset((ProviderState.DRAINING,)),
    ProviderState.DRAINING: frozenset((ProviderState.GONE,)),
    ProviderState.GONE: frozenset(),
    ProviderState.FAILED: frozenset(),
}
_PROVIDER_NEXT: Final = _by_name(PROVIDER_MOVES)


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
        self.state = ProviderState.STARTING  # (moved by ``advance`` only)
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
        self.drain_by: float | None = None  # when its running calls get a cancel (draining)
        self.tally: Any = None  # its statistics (_state.Tally), shared by its generations
        self.autoscale: Autoscale | None = None
        self.scale_armed = False  # its autoscaler's next look is in the timers
        # A replacement's start is owed: a "replace" timer due when it was owed is in the
        # timers (the shell fires it on a later turn of its loop, after whoever the death or
        # the last call woke); ``replacing``: the (wid, pid) replaced, for the log.
        self.replace_owed = False
        self.replacing: list[tuple[int, int | None]] = []

    def advance(self, to: ProviderState) -> None:
        """Move to ``to``, if ``PROVIDER_MOVES`` lets it (staying is no move); else
        :class:`IllegalMove`."""
        if to is not self.state and to._name_ not in _PROVIDER_NEXT[self.state._name_]:
            raise _illegal(self, self.state, to)
        self.state = to

    @property
    def starting(self) -> bool:
        """It never became active (yet): a start failure breaks it at once."""
        return self.state is ProviderState.STARTING or self.state is ProviderState.FAILED

    def check(self) -> None:
        """The invariants between its fields (``Machine.check``)."""
        # Its idle workers are its own, ready, and hold no call.
        for w in self.ready:
            require(w.provider is self and w.state is WorkerState.READY and not w.calls, w)
        # The settled calls still in its queue are counted, never more than it holds.
        require(0 <= self.settled_in_queue <= len(self.queue), self)
        # A drain's deadline only once draining.
        if self.drain_by is not None:
            require(self.state in (ProviderState.DRAINING, ProviderState.GONE), self)

    @property
    def size(self) -> int:
        return self.spec.size

    @property
    def live(self) -> bool:
        """It takes calls (or will, once started)."""
        return self.state is ProviderState.STARTING or self.state is ProviderState.ACTIVE

    def __repr__(self) -> str:
        return f"<provider {self.name!r} gen {self.generation} {self.state}>"


_W = WorkerState
#: A worker's legal moves (``WorkerRecord.advance``; staying is no move). Out of service
#: (retiring, quarantined, unkillable) it never serves again; exited is its end.
WORKER_MOVES: Final[dict[WorkerState, frozenset[WorkerState]]] = {
    _W.SPAWNING: frozenset((_W.READY, _W.RETIRING, _W.QUARANTINED, _W.UNKILLABLE, _W.EXITED)),
    _W.READY: frozenset((_W.BUSY, _W.RETIRING, _W.QUARANTINED, _W.UNKILLABLE, _W.EXITED)),
    _W.BUSY: frozenset(
        (_W.READY, _W.CLEANING, _W.RETIRING, _W.QUARANTINED, _W.UNKILLABLE, _W.EXITED)
    ),
    _W.CLEANING: frozenset((_W.BUSY, _W.RETIRING, _W.QUARANTINED, _W.UNKILLABLE, _W.EXITED)),
    _W.RETIRING: frozenset((_W.QUARANTINED, _W.UNKILLABLE, _W.EXITED)),
    _W.QUARANTINED: frozenset((_W.UNKILLABLE, _W.EXITED)),
    _W.UNKILLABLE: frozenset((_W.EXITED,)),
    _W.EXITED: frozenset(),
}
_WORKER_NEXT: Final = _by_name(WORKER_MOVES)
_EXITED = WorkerState.EXITED  # (bound once: a member read through its class is slow)


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
        "violation",
        "wid",
    )

    def __init__(self, wid: int, secret: bytes, provider: ProviderRecord) -> None:
        self.wid = wid
        self.secret = secret  # what its hello must carry
        self.provider = provider  # whose tools it runs
        self.state = WorkerState.SPAWNING  # (moved by ``advance`` only)
        #: It and every process of its tree are gone: its state is ``exited`` (kept by
        #: ``advance``, read on the hot path).
        self.gone = False
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
        self.lost_reason: str | None = None  # why its call is lost, if not its exit (reaper)
        self.start_failed = False
        self.answered = False  # it said hello, or its start failed
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

    def advance(self, to: WorkerState) -> None:
        """Move to ``to``, if ``WORKER_MOVES`` lets it (staying is no move); else
        :class:`IllegalMove`."""
        if to is not self.state and to._name_ not in _WORKER_NEXT[self.state._name_]:
            raise _illegal(self, self.state, to)
        self.state = to
        self.gone = to is _EXITED

    @property
    def violated(self) -> bool:
        """Quarantined for breaking the protocol: its word counts no more."""
        return self.violation is not None

    def check(self) -> None:
        """The invariants between its fields (``Machine.check``)."""
        state = self.state
        require(self.gone == (state is WorkerState.EXITED), self)
        # Its calls are its own, sent or running, and only the first can be running.
        for i, call in enumerate(self.calls):
            require(call._worker is self, (self, call))
            running = i == 0 and call._state is CallState.RUNNING
            require(call._state is CallState.SENT or running, self, call)
        # Idle when ready: a ready worker holds no call; a busy or cleaning one holds one.
        if state is WorkerState.READY:
            require(not self.calls, self)
        # A failed start is an answer (its hello will never come).
        if self.start_failed:
            require(self.answered, self)
        # Cleaning: a result waits for its leftovers' end.
        if state is WorkerState.CLEANING:
            require(self.pending is not None or self.holding, self)
        # Unkillable only once its tree was asked SIGKILLed.
        if state is WorkerState.UNKILLABLE:
            require(self.killed_at is not None, self)
        # Hung only once it said hello.
        if self.hung:
            require(self.answered, self)

    def __repr__(self) -> str:
        return f"<worker {self.wid} pid={self.pid} {self.state.value}>"
