"""The core's state, its outbox, its timers and its waits: what every layer of it shares.

The core is layered, each layer a file and a concern, each building on the one below:

``_state.py``       (this file) the state, the actions out, timers, waits
``_settlement.py``  results: building them, settling, the post-mortem of a dead worker
``_dispatch.py``    the call queue: dispatch, prefetch, recall and stealing
``_escalation.py``  cancellation and the escalation ladder (C4.1, C4.2)
``_lifecycle.py``   workers: hello, messages, start failures, death, replacement, the reaper
``_core.py``        the events in, ``flush()`` out

Nothing here does I/O: no clock (every event carries ``now``), no socket, no process, no task.
What the core must know of the world between events (a worker's ledger marks, its cgroup's
members, its peak memory) it asks a :class:`Probe`, which the shell implements over the files
it holds open and a simulation implements over its model.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..core import WorkerStartError
from ._records import Action, CallRecord, ProviderRecord, ProviderSpec, WorkerRecord
from ._results import Histogram

__all__ = (
    "KILL_TO_REAPED_BOUNDS",
    "SETTLE_LATENCY_BOUNDS",
    "Buckets",
    "CoreConfig",
    "CoreState",
    "Probe",
    "Proc",
    "Wait",
)

#: The upper bounds (seconds) of the settle-latency histogram's buckets: from a no-op call's
#: 50 us to a long tool's 10 minutes.
SETTLE_LATENCY_BOUNDS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
#: The upper bounds (seconds) of the kill-to-reaped histogram's buckets (SIGKILL of a tree to
#: the report that it is gone; past ``unkillable_after`` the worker is unkillable).
KILL_TO_REAPED_BOUNDS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class Buckets:
    """Observations counted in buckets, for a histogram read when someone asks (a scrape):
    one bisect and two additions each, no lock, no allocation."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, Prometheus's "le" (at most the bound).
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> Histogram:
        return Histogram(self.bounds, tuple(self.counts), self.sum)


class Tally:
    """What a provider's calls and workers came to (one per provider name, kept after it is
    removed, so that its counters never go back; the pool's are their sums)."""

    __slots__ = (
        "by_tool",
        "escalations",
        "kill_to_reaped",
        "replaced",
        "settle_latency",
        "settled",
        "started",
        "submitted",
        "unkillable",
    )

    def __init__(self) -> None:
        self.settled: collections.Counter[str] = collections.Counter()
        self.by_tool: collections.Counter[tuple[str, str]] = collections.Counter()
        self.escalations: collections.Counter[str] = collections.Counter()
        self.submitted = 0
        self.started = 0
        self.replaced = 0
        self.unkillable = 0
        self.settle_latency = Buckets(SETTLE_LATENCY_BOUNDS)
        self.kill_to_reaped = Buckets(KILL_TO_REAPED_BOUNDS)

    @classmethod
    def total(cls, tallies: list[Tally]) -> Tally:
        out = cls()
        for t in tallies:
            out.settled.update(t.settled)
            out.by_tool.update(t.by_tool)
            out.escalations.update(t.escalations)
            out.submitted += t.submitted
            out.started += t.started
            out.replaced += t.replaced
            out.unkillable += t.unkillable
            for mine, theirs in (
                (out.settle_latency, t.settle_latency),
                (out.kill_to_reaped, t.kill_to_reaped),
            ):
                mine.counts = [a + b for a, b in zip(mine.counts, theirs.counts, strict=True)]
                mine.sum += theirs.sum
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """The pool's options that its decisions depend on. ``tools_spec`` and the fields up to
    ``memory_cap`` are the ``"default"`` provider's (none when ``tools_spec`` is empty);
    more providers come with :meth:`PoolCore.add_provider`."""

    tools_spec: str = ""
    size: int = 0
    warm_spares: int = 0
    prefetch: int = 0
    cancel_grace: float = 5.0
    term_grace: float = 2.0
    start_timeout: float = 30.0
    max_frame: int = 1 << 20
    max_start_failures: int = 3
    allow_background: bool = False
    memory_cap: int | None = None  # the profile's, for the OOM text
    has_reaper_cleanup: bool = True  # the reaper kills leftovers (False: nobody can)
    drain_grace: float = 30.0  # a removed provider's running calls' time to finish
    unkillable_after: float = 10.0  # seconds after SIGKILL: a tree still there is unkillable
    max_calls_per_worker: int | None = None  # the default provider's ProviderSpec.max_calls

    def default_spec(self) -> ProviderSpec | None:
        if not self.tools_spec:
            return None
        return ProviderSpec(
            tools_spec=self.tools_spec,
            size=self.size,
            warm_spares=self.warm_spares,
            prefetch=self.prefetch,
            allow_background=self.allow_background,
            memory_cap=self.memory_cap,
            max_calls=self.max_calls_per_worker,
        )

    heartbeat: float | None = None  # seconds between a worker's heartbeats (None: none sent)


class Probe(Protocol):
    """What the core reads of a live worker between events (the shell: files it holds open)."""

    def marks(self, wid: int) -> tuple[int, int] | None:
        """The worker's ledger marks (taken up, invoked: call id + 1, or 0), or None."""

    def ledger(self, wid: int) -> tuple[tuple[int, int], list[tuple[int, bytes]]] | None:
        """Once the worker is gone: its marks and the results it kept, then forget it."""

    def other_members(self, wid: int, pid: int | None) -> int | None:
        """How many processes other than ``pid`` its cgroup holds; None without a cgroup."""

    def peak(self, wid: int) -> int | None:
        """Its tree's peak memory since the last reset, or None."""

    def reset_peak(self, wid: int) -> None:
        """Start its tree's peak memory afresh."""

    def tree_pids(self, wid: int, pid: int | None) -> tuple[int, ...]:
        """The pids of the processes of its tree still alive (``pid``, the worker's, among
        them if it is), as far as they can be found: its cgroup's members, else the
        worker's descendants."""


class Wait(NamedTuple):
    """What a :data:`Proc` waits for: ``done()`` true, or ``until`` reached. Conditions that
    no event announces (a worker's ledger) are looked at again every ``poll`` seconds."""

    until: float
    done: Callable[[], bool]
    poll: float = math.inf


#: A small procedure of the core that waits (the escalation ladder, for one): a generator
#: that yields what it waits for and is resumed when that holds, or on time out.
Proc = Generator[Wait, None, None]


class CoreState:
    """The state every layer of the core shares, its outbox, its timers and its procs."""

    def __init__(self, config: CoreConfig, probe: Probe, new_secret: Callable[[], bytes]) -> None:
        self.config = config
        self.probe = probe
        self._new_secret = new_secret
        self.now = 0.0  # the time of the event being handled (the core reads no clock)
        self.closing = False  # no call is dispatched any more; the queue settles as disposed
        self.starting = True  # the pool's start-up (its default provider's)
        # The pool cannot serve at all (its reaper went away and no new one started; its
        # default provider failed to start).
        self.broken: WorkerStartError | None = None
        self.reaper_up = True  # False from the reaper's death until a new one is ready
        self.restarting = False  # a new reaper is being started
        self.reaper_failures = 0  # new reapers that failed to start, in a row
        self.workers: dict[int, WorkerRecord] = {}
        self.calls: dict[int, CallRecord] = {}
        # Providers by name (the current generation: starting or active), and the older
        # generations and removed ones whose workers are still draining.
        self.providers: dict[str, ProviderRecord] = {}
        self.pending: dict[str, ProviderRecord] = {}  # starting: an add, or a reload's
        self.draining: list[ProviderRecord] = []
        self.catalog: dict[str, dict[str, Any]] = {}  # the active providers' tools
        self.owner: dict[str, ProviderRecord] = {}  # tool name -> its active provider
        self._provider_ids = itertools.count(1)
        self._providers_by_id: dict[int, ProviderRecord] = {}
        self._wids = itertools.count(1)
        self._out: list[Action] = []
        self._dispatch_due = False
        # (when, seq, kind, key): call deadlines by id, so that a settled call (and its
        # result) is not kept alive until its deadline; hello deadlines; respawns; wakes.
        self.timers: list[tuple[float, int, str, int]] = []
        self._seq = itertools.count()
        self._procs: list[list[Any]] = []  # [proc, its Wait or None]
        # statistics
        # What calls and workers came to, by provider name ("": calls no provider took);
        # ``tally()`` sums them.
        self.tallies: dict[str, Tally] = {"": Tally()}

        spec = config.default_spec()
        if spec is not None:
            self.pending["default"] = self._new_provider("default", spec)

    def _new_provider(self, name: str, spec: ProviderSpec, generation: int = 1) -> ProviderRecord:
        p = ProviderRecord(next(self._provider_ids), name, spec, generation)
        self._providers_by_id[p.id] = p
        p.tally = self.tallies.setdefault(name, Tally())
        return p

    def tally(self, provider: str | None = None) -> Tally:
        """The statistics of provider ``provider``'s calls and workers (None: the pool's)."""
        if provider is not None:
            return self.tallies.get(provider) or Tally()
        return Tally.total(list(self.tallies.values()))

    # The default provider's queue, ready list and tools (the single-provider view).

    @property
    def default(self) -> ProviderRecord | None:
        return self.providers.get("default") or self.pending.get("default")

    @property
    def queue(self) -> collections.deque[CallRecord]:
        """Every queued call, of every provider (a new deque: read only)."""
        out: collections.deque[CallRecord] = collections.deque()
        for p in self.providers.values():
            out.extend(p.queue)
        return out

    @property
    def ready(self) -> list[WorkerRecord]:
        """The idle workers of every provider (a new list: read only)."""
        return [w for p in self.providers.values() for w in p.ready]

    @property
    def threaded(self) -> set[str]:
        return {t for p in [*self.providers.values(), *self.pending.values()] for t in p.threaded}

    @property
    def worker_layers(self) -> dict[str, Any] | None:
        p = self.default
        return p.worker_layers if p is not None else None

    @worker_layers.setter
    def worker_layers(self, layers: dict[str, Any] | None) -> None:
        p = self.default
        if p is not None:
            p.worker_layers = layers

    # ------------------------------------------------------------------ the outbox

    def _act(self, action: Action) -> None:
        self._out.append(action)

    # ------------------------------------------------------------------ timers

    def _arm(self, when: float, kind: str, key: int = 0) -> None:
        if kind == "deadline" and len(self.timers) > 2 * len(self.calls) + 1024:
            # Mostly calls settled long before their deadline: keep only the live ones.
            self.timers = [t for t in self.timers if t[2] != "deadline" or t[3] in self.calls]
            heapq.heapify(self.timers)
        heapq.heappush(self.timers, (when, next(self._seq), kind, key))

    def next_deadline(self) -> float | None:
        """When the core next needs ``timer()`` called (None: not until another event)."""
        return self.timers[0][0] if self.timers else None

    # ------------------------------------------------------------------ procs

    def _spawn_proc(self, proc: Proc) -> None:
        entry: list[Any] = [proc, None, math.inf]  # the proc, its Wait, its next look
        self._procs.append(entry)
        self._step(entry)

    def _step(self, entry: list[Any]) -> None:
        """Run a proc until it waits for something that does not hold yet, or ends."""
        proc = entry[0]
        while True:
            wait: Wait | None = entry[1]
            if wait is not None and not wait.done() and self.now < wait.until:
                self._look_again(entry, wait)
                return
            try:
                entry[1] = next(proc)
            except StopIteration:
                self._procs.remove(entry)
                return

    def _look_again(self, entry: list[Any], wait: Wait) -> None:
        when = min(wait.until, self.now + wait.poll)
        entry[2] = when
        if when != math.inf:
            self._arm(when, "wake")

    def _run_procs(self) -> None:
        """Resume every proc whose wait is over; again while one going on frees another."""
        for _ in range(1000):
            moved = False
            for entry in list(self._procs):
                wait: Wait = entry[1]
                if wait.done() or self.now >= wait.until:
                    self._step(entry)
                    moved = True
                elif self.now >= entry[2]:
                    self._look_again(entry, wait)
            if not moved:
                return
