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

import collections
import heapq
import itertools
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..core import WorkerStartError
from ._records import Action, CallRecord, WorkerRecord

__all__ = ("CoreConfig", "CoreState", "Probe", "Proc", "Wait")


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """The pool's options that its decisions depend on."""

    tools_spec: str
    size: int
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
        self.starting = True  # start-up: a start failure breaks the pool at once
        self.broken: WorkerStartError | None = None
        self.reaper_up = True  # False from the reaper's death until a new one is ready
        self.restarting = False  # a new reaper is being started
        self.workers: dict[int, WorkerRecord] = {}
        self.ready: list[WorkerRecord] = []
        self.queue: collections.deque[CallRecord] = collections.deque()
        self._settled_in_queue = 0  # calls settled while queued, not yet dropped from it
        self.calls: dict[int, CallRecord] = {}
        self.catalog: dict[str, dict[str, Any]] = {}
        self.threaded: set[str] = set()  # tools whose bodies leave the worker's loop free
        self.worker_layers: dict[str, Any] | None = None
        self.start_failures = 0
        self._wids = itertools.count(1)
        self._out: list[Action] = []
        self._dispatch_due = False
        # (when, seq, kind, key): call deadlines by id, so that a settled call (and its
        # result) is not kept alive until its deadline; hello deadlines; respawns; wakes.
        self.timers: list[tuple[float, int, str, int]] = []
        self._seq = itertools.count()
        self._procs: list[list[Any]] = []  # [proc, its Wait or None]
        # statistics
        self.settled_counts: collections.Counter[str] = collections.Counter()
        self.escalation_counts: collections.Counter[str] = collections.Counter()
        self.submitted = 0
        self.started_count = 0
        self.replaced = 0

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
