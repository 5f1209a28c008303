"""The machine's state, its outbox, its timers and its waits: what every part of it shares.

The machine is a few parts, each a class and a concern, each given the parts below it that
it uses (``docs/core.md``, "Where things are"):

``_state.py``       (this file) the records kept, the actions out, timers, waits
``_settlement.py``  results: building them, settling, the post-mortem of a dead worker
``_dispatch.py``    the call queue: dispatch, prefetch, recall and stealing, retiring
``_ladder.py``      cancellation and the escalation ladder (C4.1, C4.2), quarantine
``_fleet.py``       providers: their workers' complement, add, remove, resize, reload
``_lifecycle.py``   workers: hello, messages, start failures, death, replacement, the reaper
``_machine.py``     :class:`Machine`: owns the parts; the events in, ``flush()`` out

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

from ...core import DEFAULT_GRACES, Graces, WorkerStartError
from .._results import Histogram
from ._actions import Action
from ._records import CallRecord, ProviderRecord, ProviderSpec, WorkerRecord

__all__ = (
    "KILL_TO_REAPED_BOUNDS",
    "SETTLE_LATENCY_BOUNDS",
    "Buckets",
    "CoreConfig",
    "State",
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
        "started",
        "submitted",
        "unkillable",
    )

    def __init__(self) -> None:
        #: Settled calls by tool, then outcome; by outcome alone: ``settled``, summed when
        #: read. Plain dicts: a Counter defines ``__delitem__`` in Python, which makes each of
        #: its item assignments a call of ``__setitem__`` through a method wrapper; a (tool,
        #: outcome) key is a tuple made, hashed and compared per settle (the hot path).
        self.by_tool: dict[str, dict[str, int]] = {}
        self.escalations: collections.Counter[str] = collections.Counter()
        self.submitted = 0
        self.started = 0
        self.replaced = 0
        self.unkillable = 0
        self.settle_latency = Buckets(SETTLE_LATENCY_BOUNDS)
        self.kill_to_reaped = Buckets(KILL_TO_REAPED_BOUNDS)

    @property
    def settled(self) -> collections.Counter[str]:
        """Settled calls by outcome (from ``by_tool``: one count per settle, not two)."""
        out: collections.Counter[str] = collections.Counter()
        for counts in self.by_tool.values():
            out.update(counts)
        return out

    @classmethod
    def total(cls, tallies: list[Tally]) -> Tally:
        out = cls()
        for t in tallies:
            for tool, counts in t.by_tool.items():
                into = out.by_tool.setdefault(tool, {})
                for kind, n in counts.items():
                    into[kind] = into.get(kind, 0) + n
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
    """The pool's options that its decisions depend on. A provider's own (the
    ``"default"`` one's too) come with it: :meth:`Machine.add_provider`."""

    graces: Graces = DEFAULT_GRACES  # the ladder's, a drain's, and when a tree is unkillable
    start_timeout: float = 30.0
    max_frame: int = 1 << 20
    max_start_failures: int = 3
    has_reaper_cleanup: bool = True  # the reaper kills leftovers (False: nobody can)
    heartbeat: float | None = None  # seconds between a worker's heartbeats (None: none sent)


class Probe(Protocol):
    """What the core reads of a live worker between events (the shell: files it holds open)."""

    #: Whether a worker may have cgroup files to read: False while none has (no cgroups in
    #: use), and then :meth:`other_members`, :meth:`peak` and :meth:`reset_peak` would only
    #: answer None or do nothing: the core calls none of them (three calls a call saved).
    cgroups: bool

    def marks(self, wid: int) -> tuple[int, int] | None:
        """The worker's ledger marks (taken up, invoked: call id + 1, or 0), or None."""

    def ledger(self, wid: int) -> tuple[tuple[int, int], list[tuple[int, bytes]]] | None:
        """Once the worker is gone: its marks and the results it kept, then forget it."""

    def spill(self, wid: int, offset: int, lengths: list[int]) -> list[bytes] | None:
        """The parts a result names in the worker's spill: ``lengths`` bytes each, back to
        back from ``offset``; None if they are not all within it (or it cannot be read)."""

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


class State:
    """The records every part of the machine reads and changes, its outbox, its timers and
    its procs. The parts share this one object; :class:`Machine` owns it."""

    def __init__(self, config: CoreConfig, probe: Probe, new_secret: Callable[[], bytes]) -> None:
        self.config = config
        self.probe = probe
        self.new_secret = new_secret
        self.now = 0.0  # the time of the event being handled (the machine reads no clock)
        self.closing = False  # no call is dispatched any more; the queue settles as disposed
        self.started = False  # the pool's start() came: providers' workers may start
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
        self.providers_by_id: dict[int, ProviderRecord] = {}
        self.wids = itertools.count(1)
        self.out: list[Action] = []
        self.dispatch_due = False
        # When the last submit came whose dispatch pass is owed (``Machine._pay_owed``), or
        # None: nothing owed.
        self.owed_at: float | None = None
        # (when, seq, kind, key): call deadlines by id, so that a settled call (and its
        # result) is not kept alive until its deadline; hello deadlines; respawns; wakes.
        self.timers: list[tuple[float, int, str, int]] = []
        self._seq = itertools.count()
        self.procs: list[list[Any]] = []  # [proc, its Wait or None, its next look]
        # statistics
        # What calls and workers came to, by provider name ("": calls no provider took);
        # ``tally()`` sums them.
        self.tallies: dict[str, Tally] = {"": Tally()}

    def new_provider(self, name: str, spec: ProviderSpec, generation: int = 1) -> ProviderRecord:
        p = ProviderRecord(next(self._provider_ids), name, spec, generation)
        self.providers_by_id[p.id] = p
        p.tally = self.tallies.setdefault(name, Tally())
        return p

    def tally(self, provider: str | None = None) -> Tally:
        """The statistics of provider ``provider``'s calls and workers (None: the pool's)."""
        if provider is not None:
            return self.tallies.get(provider) or Tally()
        return Tally.total(list(self.tallies.values()))

    # ------------------------------------------------------------------ the outbox

    def act(self, action: Action) -> None:
        self.out.append(action)

    # ------------------------------------------------------------------ timers

    def arm(self, when: float, kind: str, key: int = 0) -> None:
        if kind == "deadline" and len(self.timers) > 2 * len(self.calls) + 1024:
            # Mostly calls settled long before their deadline: keep only the live ones.
            timers = self.timers  # (in place: the machine hands this list to the shell)
            timers[:] = [t for t in timers if t[2] != "deadline" or t[3] in self.calls]
            heapq.heapify(timers)
        heapq.heappush(self.timers, (when, next(self._seq), kind, key))

    def next_deadline(self) -> float | None:
        """When the machine next needs ``timer()`` called (None: not until another event)."""
        return self.timers[0][0] if self.timers else None

    # ------------------------------------------------------------------ procs

    def spawn_proc(self, proc: Proc) -> None:
        """Run ``proc`` until it first waits; ``run_procs`` resumes it when its wait is over."""
        entry: list[Any] = [proc, None, math.inf]  # the proc, its Wait, its next look
        self.procs.append(entry)
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
                self.procs.remove(entry)
                return

    def _look_again(self, entry: list[Any], wait: Wait) -> None:
        when = min(wait.until, self.now + wait.poll)
        entry[2] = when
        if when != math.inf:
            self.arm(when, "wake")

    def run_procs(self) -> None:
        """Resume every proc whose wait is over; again while one going on frees another."""
        for _ in range(1000):
            moved = False
            for entry in list(self.procs):
                wait: Wait = entry[1]
                if wait.done() or self.now >= wait.until:
                    self._step(entry)
                    moved = True
                elif self.now >= entry[2]:
                    self._look_again(entry, wait)
            if not moved:
                return
