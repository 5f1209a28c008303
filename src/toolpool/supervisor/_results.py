"""What the supervisor reports: results with their timeline, and pool statistics."""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, final

from ..core import CancelCause, Outcome

__all__ = (
    "CallableDict",
    "CallableList",
    "ContainmentReport",
    "Histogram",
    "Layer",
    "Progress",
    "Result",
    "Rung",
    "Statistics",
    "Timeline",
    "WorkerState",
)


class Rung(enum.StrEnum):
    """How far the escalation ladder went for a call (CONTRACT C4.2)."""

    NONE = "none"
    """No cancellation was delivered."""
    CANCEL = "cancel"
    """A cooperative cancel message was sent."""
    SIGTERM = "sigterm"
    """The worker's process tree got SIGTERM."""
    SIGKILL = "sigkill"
    """The worker's process tree got SIGKILL."""


class WorkerState(enum.StrEnum):
    """Where a worker process is in its life."""

    SPAWNING = "spawning"
    READY = "ready"
    BUSY = "busy"
    CLEANING = "cleaning"
    """Its call returned leaving processes behind; they are being killed."""
    RETIRING = "retiring"
    """Told to exit when idle (the pool is closing)."""
    QUARANTINED = "quarantined"
    """Escalation or a protocol violation: it never gets another call."""
    UNKILLABLE = "unkillable"
    """Its tree was SIGKILLed but a process of it is still there after
    ``Pool(unkillable_after=...)`` seconds (uninterruptible sleep): out of service and
    replaced; its call settles only once every process of its tree is gone."""
    EXITED = "exited"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """Monotonic timestamps (``time.monotonic()``) of a call's steps; None where not reached."""

    submitted: float
    dispatched: float | None = None
    """The call message was sent to a worker."""
    started: float | None = None
    """The worker reported that the body was about to be invoked."""
    cancel_requested: float | None = None
    cancel_delivered: float | None = None
    """The worker acknowledged the cancel message."""
    returned: float | None = None
    """The worker's result arrived."""
    sigterm: float | None = None
    sigkill: float | None = None
    reaped: float | None = None
    """The worker and every process it spawned were gone."""
    settled: float | None = None

    def steps(self) -> list[tuple[str, float]]:
        """The steps reached, in time order, as (name, seconds since submitted)."""
        out = [
            (f.name, getattr(self, f.name) - self.submitted)
            for f in fields(self)
            if getattr(self, f.name) is not None
        ]
        return sorted(out, key=lambda item: item[1])

    def as_dict(self) -> dict[str, float | None]:
        """The timestamps by step name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Deferred:
    """The base of :class:`Result`: the pool makes a result with its first fields only
    (``call_id``, ``tool``, ``outcome``, ``value``) and fills the rest from the facts it
    settled with the first time one of them is read (the hot path reads ``ok`` and
    ``value``). ``_pending`` holds those facts until then; ``_fill`` (set by
    ``machine/_records.py``, whose layout they are) fills the fields from them. A result made
    by its own ``__init__`` has every field, and never looks here."""

    __slots__ = ("_pending",)
    _fill: ClassVar[Callable[[Any, tuple[Any, ...]], None]]

    if not TYPE_CHECKING:  # (for mypy, no attribute of a Result is dynamic)

        def __getattr__(self, name: str) -> Any:
            # Only a field not set yet comes here (or a name no Result has).
            try:
                facts = _get_pending(self)
            except AttributeError:
                pass  # (none pending; or another thread just filled them)
            else:
                _Deferred._fill(self, facts)
                try:
                    _del_pending(self)
                except AttributeError:
                    pass  # (another thread's fill did)
            return object.__getattribute__(self, name)


_get_pending = _Deferred.__dict__["_pending"].__get__
_del_pending = _Deferred.__dict__["_pending"].__delete__


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Result(_Deferred):
    """The settled result of a pool call: what happened to the tool body, and the facts.

    Created by the pool only.
    """

    call_id: int
    tool: str
    outcome: Outcome
    """What happened to the body (CONTRACT C3)."""
    value: Any = None
    """The body's return value, for ``ok``."""
    error: str | None = None
    """The model-visible error text, for every outcome but ``ok``."""
    error_name: str | None = None
    body_started: bool | None = None
    """True: the body was invoked; False: it never was; None: unknown (the worker died first)."""
    cause: CancelCause | None = None
    """The cancel cause that applied, if the call was cancelled (a runtime fact)."""
    rung: Rung = Rung.NONE
    """How far escalation went."""
    worker_pid: int | None = None
    exit_code: int | None = None
    """The worker's exit code, where it exited during this call."""
    exit_signal: int | None = None
    """The signal that ended the worker, where one did during this call."""
    context: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    leftovers_killed: int = 0
    """Processes the call left running when its body returned, killed before the next call."""
    cpu_time: float | None = None
    """CPU seconds the worker (all its threads) and the children it reaped used during the
    call, where the worker reported it."""
    max_rss: int | None = None
    """High-water mark of resident memory, in bytes: the worker's or its largest reaped
    child's, over the worker's life so far (not reset per call)."""
    tree_max_memory: int | None = None
    """Peak memory of the worker's whole tree during the call, in bytes, from its memory
    cgroup (v1 ``memory.max_usage_in_bytes``, reset at dispatch); None without one."""
    output: str | None = None
    """What the tool and its children wrote to stdout and stderr during the call (UTF-8,
    invalid bytes replaced), with ``Pool(capture_output=...)``; None when not captured."""
    output_dropped: int = 0
    """Bytes of output beyond the per-call cap, read and discarded."""
    tree_verified: bool | None = None
    """Where the worker died during the call (``killed``, ``worker_lost``): True if its whole
    process tree was verified gone before the call settled, False if it could not be (the
    pool's reaper died and no cgroup held the tree: see ``docs/pool.md``). None where the
    worker did not die of the call (it sent a result, or never took the call up)."""
    timeline: Timeline
    index: int | None = None
    """The position, from 0, of the call's arguments in the iterable given to
    :meth:`Pool.map` or :meth:`SyncPool.map`; None for a call submitted otherwise."""

    @property
    def ok(self) -> bool:
        """True for outcome ``ok``."""
        return self.outcome is Outcome.OK

    def duration(self) -> float:
        """Seconds from submission to settlement."""
        settled = self.timeline.settled
        return 0.0 if settled is None else settled - self.timeline.submitted


@final
@dataclass(frozen=True, slots=True)
class Histogram:
    """Observations counted in buckets (a snapshot): ``counts[i]`` observations were at most
    ``bounds[i]`` and above the bound before it; the last count is of those above every
    bound. ``sum`` is the sum of every observation (seconds, for the pool's histograms)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        """How many observations."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at most that), the last bound ``inf`` (Prometheus's
        ``le`` buckets)."""
        out: list[tuple[float, int]] = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Statistics:
    """A frozen snapshot of a pool."""

    workers: Mapping[str, int]
    """Worker processes by state (``ready``, ``busy``, ``spawning``, ``quarantined``...)."""
    queued: int
    """Calls not begun yet: waiting in the pool's queue, or in a worker's queue behind the
    call it runs (``Pool(prefetch=...)``)."""
    in_flight: int
    """Calls a worker runs, or takes up next: at most one per worker."""
    settled: Mapping[str, int]
    """Settled calls by outcome."""
    escalations: Mapping[str, int]
    """Calls by the highest rung their escalation reached (``cancel``, ``sigterm``...)."""
    workers_started: int
    workers_replaced: int
    submitted: int
    settled_by_tool: Mapping[str, Mapping[str, int]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    """Settled calls by tool, then by outcome."""
    oldest_queued_wait: float | None = None
    """Seconds the oldest call in the pool's queue (not yet sent to a worker) has waited;
    None when that queue is empty."""
    unkillable: tuple[int, ...] = ()
    """Pids of the processes still alive in the trees of ``unkillable`` workers (see
    :attr:`WorkerState.UNKILLABLE`), as they are now."""
    workers_unkillable: int = 0
    """Workers ever found unkillable (each was replaced)."""
    settle_latency: Histogram | None = None
    """Seconds from submission to settlement of every settled call."""
    kill_to_reaped: Histogram | None = None
    """Seconds from the SIGKILL of a worker's tree to the report that every process of it
    is gone."""
    hung: int = 0
    """Live workers that sent no heartbeat for ``HUNG_AFTER_BEATS`` heartbeat intervals: no
    thread of theirs runs (a C extension holding the GIL, a stopped process). Counted in
    :attr:`workers` by state as well (usually ``busy``); 0 with ``Pool(heartbeat=None)``."""


@final
@dataclass(frozen=True, slots=True)
class Progress:
    """What a call's body last reported of its progress (``execution.report_progress``):
    ``call.progress`` and ``call.progress_updates()``."""

    done: float
    """How much is done (a finite, non-negative number, in the tool's own unit)."""
    total: float | None = None
    """Out of how much, if the tool said."""
    message: str | None = None
    """What the tool said it is doing (at most 1,024 characters)."""


@final
@dataclass(frozen=True, slots=True)
class Layer:
    """One containment layer: whether it is active for the pool's workers, and why (not)."""

    name: str
    active: bool
    detail: str


@final
@dataclass(frozen=True, slots=True)
class ContainmentReport:
    """What protects a pool's workers, layer by layer (``pool.containment()``)."""

    profile: str
    limits: Mapping[str, str]
    layers: tuple[Layer, ...]

    def active(self, name: str) -> bool:
        """Whether the layer called ``name`` is active."""
        return any(layer.name == name and layer.active for layer in self.layers)

    def format(self) -> str:
        """A readable table."""
        width = max(len(layer.name) for layer in self.layers)
        lines = [f"profile: {self.profile}"]
        lines += [f"  {k}: {v}" for k, v in self.limits.items()]
        lines.append("layers:")
        for layer in self.layers:
            mark = "active  " if layer.active else "inactive"
            lines.append(f"  {layer.name.ljust(width)}  {mark}  {layer.detail}")
        return "\n".join(lines)


class CallableList(list[int]):
    """``pool.worker_pids``: a list that may still be called, as the method it once was
    (with a DeprecationWarning)."""

    def __init__(self, items: list[int], name: str) -> None:
        super().__init__(items)
        self._name = name

    def __call__(self) -> list[int]:
        _warn_called(self._name)
        return list(self)


class CallableDict(dict[int, str]):
    """``pool.worker_start_methods``: a dict that may still be called, as the method it once
    was (with a DeprecationWarning)."""

    def __init__(self, items: dict[int, str], name: str) -> None:
        super().__init__(items)
        self._name = name

    def __call__(self) -> dict[int, str]:
        _warn_called(self._name)
        return dict(self)


def _warn_called(name: str) -> None:
    warnings.warn(
        f"pool.{name}() is deprecated: read the property pool.{name}",
        DeprecationWarning,
        stacklevel=3,
    )
