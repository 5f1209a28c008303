"""The machine: the pool's decisions as one deterministic object, events in, actions out.

Every event is a method taking ``now`` (the machine reads no clock). Handling it only
changes the records and queues actions; :meth:`Machine.flush` then runs what the event made
due (dispatch, the waits of the escalation ladders) and returns the actions, in order, for
the shell to perform: :class:`~._actions.Send` frames to a worker, signal or kill its tree,
start a worker, wake whoever waits for a settled call... The shell (``supervisor/_pool.py``)
turns sockets, the reaper's reports and timers into these events; a simulation
(``tests/sim_world.py``) does the same over a model of workers and reaper, with virtual time,
and checks the contract's invariants after every step.

The machine owns its parts and hands each the parts below it that it uses; no part knows
one above it (``docs/core.md``, "Where things are")::

    Machine -> Lifecycle -> Fleet -> Ladder -> Dispatch -> Settlement -> State
"""

from __future__ import annotations

import collections
import heapq
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from ...core import CancelCause, WorkerStartError
from ...protocol import ProtocolViolation, ResultMessage
from .._results import WorkerState
from ._actions import Action
from ._dispatch import Dispatch
from ._fleet import Fleet
from ._ladder import Ladder
from ._lifecycle import Lifecycle
from ._records import (
    Autoscale,
    CallRecord,
    CallState,
    GroupRecord,
    ProviderRecord,
    ProviderSpec,
    ProviderState,
    WorkerRecord,
    require,
)
from ._settlement import Settlement
from ._state import CoreConfig, Probe, State, Tally

__all__ = ("Machine",)

_log = logging.getLogger("toolpool.supervisor")

_DISPOSED: Final = CancelCause("disposed")
_PARENT: Final = CancelCause("parent")
_TIMEOUT: Final = CancelCause("timeout")


class Machine:
    """The pool's decisions (CONTRACT C4, C5, C7), as a synchronous state machine."""

    def __init__(self, config: CoreConfig, probe: Probe, new_secret: Callable[[], bytes]) -> None:
        self.state = s = State(config, probe, new_secret)
        self.settlement = Settlement(s)
        self.dispatch = Dispatch(s, self.settlement)
        self.ladder = Ladder(s, self.settlement, self.dispatch)
        self.fleet = Fleet(s, self.settlement, self.dispatch, self.ladder)
        self.lifecycle = Lifecycle(s, self.settlement, self.dispatch, self.ladder, self.fleet)
        self.s = s
        # What the shell and the simulation read between events: the state's own containers
        # (never replaced: one lookup, no property, on the hot path).
        self.config = s.config
        self.workers = s.workers  # the workers not gone yet, by id
        self.calls = s.calls  # the calls not settled yet, by id
        self.providers = s.providers  # the active generation of each provider, by name
        self.pending = s.pending  # the providers starting (an add, a reload's), by name
        self.draining = s.draining  # removed or replaced providers still draining
        self.catalog = s.catalog  # the active providers' tools
        self.owner = s.owner  # tool name -> the active provider that has it
        self.timers = s.timers  # (when, seq, kind, key), a heap
        self.tallies = s.tallies  # what calls and workers came to, by provider name

    # ------------------------------------------------------------------ the pool

    def start(self, now: float) -> None:
        """The pool starts: start the workers of the providers added so far (the default
        one, ``Pool(tools, ...)``: its size, plus warm spares); a provider added from now on
        starts its workers at once."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        self.s.started = True
        for p in list(self.s.pending.values()):
            self.fleet.top_up(p)

    def started(self) -> None:
        """The pool's start-up is over."""
        self.s.starting = False

    def ready_count(self) -> int:
        """Workers that said hello and that the reaper reported."""
        return sum(
            1
            for w in self.s.workers.values()
            if w.state is WorkerState.READY and w.start_method is not None
        )

    def close(self, now: float) -> None:
        """Closing (C5.3): nothing is dispatched any more; every call is cancelled with cause
        ``disposed`` (the shell cancels the groups first)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        self.s.closing = True
        for call in list(self.s.calls.values()):
            self.ladder.cancel(call, _DISPOSED, force=False)

    def retire_idle(self, now: float) -> None:
        """Tell every idle worker to exit (a spawning one is retired when its hello comes)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        for w in list(self.s.workers.values()):
            if w.state is WorkerState.READY and not w.gone:
                self.dispatch.retire(w)

    def kill_remaining(self, now: float) -> None:
        """SIGKILL the tree of every worker not gone yet (the close's last resort)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        for w in list(self.s.workers.values()):
            if not w.gone and not w.orphaned:
                self.ladder.kill_tree(w)

    def all_gone(self) -> bool:
        return not self.s.workers

    def idle_or_stuck(self) -> bool:
        """Every call has settled, or is held by an unkillable worker (whose calls settle
        only once its tree is gone: the close waits no longer for those)."""
        held = sum(len(w.calls) for w in self.unkillable())
        return len(self.s.calls) == held

    def unkillable(self) -> list[WorkerRecord]:
        """The unkillable workers (not gone yet)."""
        return [w for w in self.s.workers.values() if w.state is WorkerState.UNKILLABLE]

    # ------------------------------------------------------------------ calls

    def submit(self, call: CallRecord, timeout: float | None, now: float) -> None:
        """A new call (checked and packed by the shell). (Its arguments may be passed by
        position: keywords cost every call of the hot path more.)"""
        s = self.s
        s.now = now
        owner = call._owner = s.owner.get(call.tool)
        (owner.tally if owner is not None else s.tallies[""]).submitted += 1
        s.calls[call.id] = call
        group = call._group
        if group is not None:
            group._calls.add(call)
            if group.cancelled:  # C5.2: settled at once
                self.settlement.abort_queued(call, group.signal.reason or _PARENT)
                return
        if timeout is not None:
            call._deadline = now + timeout
            s.arm(call._deadline, "deadline", call.id)
        if owner is None or owner.broken is not None:
            self.dispatch.enqueue(call)  # (it settles: no provider has its tool, or it broke)
        else:  # (enqueue, inline: its provider is the owner looked up above, in this event)
            owner.queue.append(call)
            call._queued = True
            call._provider = owner
            s.dispatch_due = True
        # Its dispatch pass is owed: one for a burst of submits, run by the next flush, or
        # first thing in any other event (``_pay_owed``), so that every other event finds
        # the machine as if each submit had been flushed at once.
        s.owed_at = now

    def cancel(self, call: CallRecord, cause: CancelCause, *, force: bool, now: float) -> None:
        """A cancel request for one call (validated by the shell)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        self.ladder.cancel(call, cause, force=force)

    def cancel_group(self, group: GroupRecord, cause: CancelCause, now: float) -> None:
        """A group was cancelled (C5.2): its queued calls first (cancelling a running one can
        settle it at once, which frees its worker for the next queued call)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        # Queued first, then in the order they were submitted (not the set's: it follows
        # memory addresses, and a simulated seed must replay the same in any process).
        for call in sorted(group._calls, key=lambda c: (c._state is not CallState.QUEUED, c.id)):
            self.ladder.cancel(call, cause, force=False)

    # ------------------------------------------------------------------ workers

    def message(self, wid: int, msg: Any, now: float, peer_pid: int | None = None) -> None:
        """A decoded message from worker ``wid`` (``peer_pid``: who sent it, where the
        socket tells, for a worker that has not said hello; by position or keyword)."""
        s = self.s
        if s.owed_at is not None:
            self._pay_owed()
        s.now = now
        w = s.workers.get(wid)
        if w is None or w.gone or w.violation is not None:
            return  # a quarantined violator: nothing it says counts any more
        try:
            if type(msg) is ResultMessage:  # (the most frequent: no look through the rest)
                self.lifecycle.on_result(w, msg)
            else:
                self.lifecycle.on_message(w, msg, peer_pid)
        except ProtocolViolation as exc:
            self.lifecycle.violated(w, f"protocol violation: {exc}")

    def heartbeat(self, wid: int, now: float) -> None:
        """Worker ``wid`` sent a heartbeat (its threads run). The shell passes heartbeat
        messages to :meth:`message`, which comes here; a model may call it directly."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        w = self.s.workers.get(wid)
        if w is not None and not w.gone and w.violation is None and w.answered:
            self.lifecycle.on_heartbeat(w)

    def violation(self, wid: int, text: str, now: float) -> None:
        """Worker ``wid`` sent what cannot be decoded (C7)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        w = self.s.workers.get(wid)
        if w is not None and not w.gone and w.violation is None:
            self.lifecycle.violated(w, text)

    def disconnected(self, wid: int, now: float) -> None:
        """Worker ``wid``'s connection dropped (dead, dying, or an oversized frame): never
        trust it again; the reaper reports when its tree is gone."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        w = self.s.workers.get(wid)
        if w is not None and not w.gone:
            w.disconnected = True
            _log.log(
                logging.DEBUG if w.retired else logging.INFO,
                "worker %s (pid %s): its connection dropped (%s)",
                wid,
                w.pid,
                "it exits, retired" if w.retired else "dying, or an oversized frame",
                extra={"worker_pid": w.pid},
            )
            self.ladder.quarantine(w, None)

    def send_failed(self, wid: int, calls: tuple[CallRecord, ...], now: float) -> None:
        """The shell could not hand worker ``wid`` these calls: no body can have started.
        Put them back and retire it: its peer is gone (it died, or is dying of what it
        runs), not misbehaving."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        w = self.s.workers.get(wid)
        for call in reversed(calls):
            if w is not None and call in w.calls and not call._started:
                w.calls.remove(call)
                self.dispatch.requeue(call)
        if w is not None and not w.gone:
            _log.info("worker %s: its socket refused a call; retiring it", wid)
            self.ladder.quarantine(w, None)

    def spawn_failed(self, wid: int, error: str, now: float) -> None:
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        w = self.s.workers.get(wid)
        if w is not None:
            w.fatal = error
            self.lifecycle.start_failure(w, error)
            self.lifecycle.worker_gone(w)

    def spawned(self, wid: int, pid: int, method: str, now: float) -> None:
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        w = self.s.workers.get(wid)
        if w is not None:
            self.lifecycle.on_spawned(w, pid, method)

    def exited(self, wid: int, status: int, oom_kills: int, now: float) -> None:
        """The worker process exited (its tree may live on: ``gone`` says when it is not)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        w = self.s.workers.get(wid)
        if w is not None:
            self.lifecycle.on_exited(w, status, oom_kills)

    def gone(self, wid: int, now: float, *, verified: bool = True) -> None:
        """The worker and every process of its tree are gone (``verified=False``: its
        reaper died and nothing could check its descendants)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        w = self.s.workers.get(wid)
        if w is not None:
            w.verified = verified
            self.lifecycle.on_gone(w)

    def cleaned(self, wid: int, count: int, now: float) -> None:
        """What the worker's last call left running was killed (``count`` processes)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        w = self.s.workers.get(wid)
        if w is not None:
            self.lifecycle.on_cleaned(w, count)

    def reaper_lost(self, now: float, *, error: str | None = None) -> None:
        """The reaper went away; ``error``: why, when the client knows (it broke the protocol)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        self.lifecycle.reaper_lost(error)

    def reaper_ready(self, now: float) -> None:
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        self.lifecycle.reaper_ready()

    def reaper_failed(self, error: str, now: float) -> None:
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        self.lifecycle.reaper_failed(error)

    # ------------------------------------------------------------------ time

    def timer(self, now: float) -> None:
        """Time passed: handle the deadlines due (call timeouts, hello deadlines, respawns;
        the waits of the ladders are looked at in ``flush``)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        timers = self.s.timers
        while timers and timers[0][0] <= now:
            _, _, kind, key = heapq.heappop(timers)
            if kind == "deadline":
                call = self.s.calls.get(key)  # settled calls are no longer there
                if call is not None and call._facts is None:
                    self.ladder.cancel(call, _TIMEOUT, force=False)
            elif kind == "hello":
                self.lifecycle.hello_overdue(key)
            elif kind == "replace":
                self.fleet.replace_due(key)
            elif kind == "respawn":
                self.lifecycle.respawn_due(key)
            elif kind == "drain":
                self.fleet.drain_due(key)
            elif kind == "scale":
                self.fleet.scale_due(key)
            elif kind == "unkillable":
                self.lifecycle.kill_overdue(key)
            elif kind == "beat":
                self.lifecycle.beat_overdue(key)

    def pay_owed(self) -> None:
        """Run the dispatch pass the submits since the last flush owe, if any: for a reader
        of the records (``Pool.statistics``) that must find them as after each submit's
        flush. Its actions wait for the next flush."""
        if self.s.owed_at is not None:
            self._pay_owed()

    def _pay_owed(self) -> None:
        """Run the dispatch pass the submits since the last flush owe, at the time of the
        last of them; its actions wait in the outbox for the next flush, before the next
        event's."""
        s = self.s
        owed_at, s.owed_at = s.owed_at, None
        if owed_at is not None:
            s.now = owed_at
        self._run_due()

    def due(self) -> bool:
        """Whether ``flush`` has anything to do or return."""
        return bool(self.s.out) or self.s.dispatch_due or bool(self.s.procs)

    def flush(self, now: float) -> list[Action]:
        """Run what the events so far made due; return the actions to perform, in order."""
        s = self.s
        s.now = now
        s.owed_at = None  # (paid here)
        passes = 1000  # (_run_due, inline: once per call; no range made for it)
        while passes:
            if s.procs:
                s.run_procs()
            if not s.dispatch_due:
                break
            s.dispatch_due = False
            self.dispatch.run()
            passes -= 1
        out, s.out = s.out, []
        return out

    def _run_due(self) -> None:
        s = self.s
        passes = 1000  # (as in flush: no range made)
        while passes:
            if s.procs:
                s.run_procs()
            if not s.dispatch_due:
                break
            s.dispatch_due = False
            self.dispatch.run()
            passes -= 1

    # ------------------------------------------------------------------ introspection

    def live_workers(self) -> list[WorkerRecord]:
        return [w for w in self.s.workers.values() if not w.gone]

    def states(self) -> Mapping[str, int]:
        counts: dict[str, int] = {}
        for w in self.s.workers.values():
            counts[w.state.value] = counts.get(w.state.value, 0) + 1
        return counts

    def in_flight(self) -> int:
        return sum(1 for w in self.s.workers.values() if w.calls)

    def hung_count(self) -> int:
        """Live workers that sent no heartbeat for HUNG_AFTER_BEATS intervals."""
        return sum(1 for w in self.s.workers.values() if w.hung and not w.gone)

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        """Check every invariant of the records: each record's own (its ``check``, written
        beside its fields) and those between them. The simulation calls it after every
        step; it raises :class:`BrokenInvariant` where one breaks (a bug of the machine)."""
        s = self.s
        for call in s.calls.values():
            # Only unsettled calls are held (bounded memory).
            require(call._state is not CallState.SETTLED, call)
            call.check()
        for w in s.workers.values():
            # A gone worker is forgotten in the same event.
            require(not w.gone, w)
            w.check()
            for call in w.calls:
                require(s.calls.get(call.id) is call, (w, call))
        for name, p in s.providers.items():
            require(p.name == name and p.state is ProviderState.ACTIVE, p)
            p.check()
        for name, p in s.pending.items():
            require(p.name == name and p.state is ProviderState.STARTING, p)
            p.check()
        for p in s.draining:
            require(p.state is ProviderState.DRAINING, p)
            p.check()
        for p in s.providers_by_id.values():
            # A replacement owed is a timer armed (the shell's clock fires it).
            if p.replace_owed:
                require(any(t[2] == "replace" and t[3] == p.id for t in s.timers), p)
        for tool, p in s.owner.items():
            # A tool resolves to an active provider that has it, and is in the catalog.
            require(s.providers.get(p.name) is p and tool in p.catalog and tool in s.catalog, tool)

    # ------------------------------------------------------------------ providers

    def add_provider(self, name: str, spec: ProviderSpec, now: float) -> ProviderRecord:
        """Start a new provider's workers (once the pool started: :meth:`start`); it becomes
        active once they are all ready (or ``failed``: its ``broken`` says why). The shell
        checks ``name`` is free. ``Pool(tools, ...)`` adds the provider ``"default"`` so,
        before its start."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        return self.fleet.add(name, spec)

    def reload_provider(self, name: str, now: float) -> ProviderRecord:
        """Start a new generation of provider ``name``; it replaces the current one once
        every new worker is ready."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        return self.fleet.reload(name)

    def remove_provider(self, name: str, reason: str, now: float) -> ProviderRecord | None:
        """Take provider ``name`` out: its tools go at once, its workers drain."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        return self.fleet.remove(name, reason)

    def resize(self, name: str, size: int, now: float, *, force: bool = False) -> None:
        """Grow or shrink provider ``name`` to ``size`` workers, and stop autoscaling it."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        self.fleet.resize(name, size, force=force)

    def autoscale(self, name: str, policy: Autoscale | None, now: float) -> None:
        """Let the machine size provider ``name`` within ``policy``'s bounds (None: stop)."""
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.now = now
        self.fleet.autoscale(name, policy)

    def all_gone_or_unkillable(self) -> bool:
        """Every worker is gone, or unkillable."""
        return self.lifecycle.all_gone_or_unkillable()

    # ------------------------------------------------------------------ what the shell reads

    def tally(self, provider: str | None = None) -> Tally:
        """The statistics of provider ``provider``'s calls and workers (None: the pool's)."""
        return self.s.tally(provider)

    def next_deadline(self) -> float | None:
        """When the machine next needs ``timer()`` called (None: not until another event)."""
        return self.s.next_deadline()

    @property
    def closing(self) -> bool:
        return self.s.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        if self.s.owed_at is not None:
            self._pay_owed()
        self.s.closing = value

    @property
    def starting(self) -> bool:
        return self.s.starting

    @starting.setter
    def starting(self, value: bool) -> None:
        self.s.starting = value

    @property
    def broken(self) -> WorkerStartError | None:
        return self.s.broken

    @property
    def reaper_up(self) -> bool:
        return self.s.reaper_up

    @property
    def restarting(self) -> bool:
        return self.s.restarting

    # The default provider's queue, ready list and tools (the single-provider view).

    @property
    def default(self) -> ProviderRecord | None:
        return self.s.providers.get("default") or self.s.pending.get("default")

    @property
    def queue(self) -> collections.deque[CallRecord]:
        """Every queued call, of every provider (a new deque: read only)."""
        out: collections.deque[CallRecord] = collections.deque()
        for p in self.s.providers.values():
            out.extend(p.queue)
        return out

    @property
    def ready(self) -> list[WorkerRecord]:
        """The idle workers of every provider (a new list: read only)."""
        return [w for p in self.s.providers.values() for w in p.ready]

    @property
    def threaded(self) -> set[str]:
        s = self.s
        return {t for p in [*s.providers.values(), *s.pending.values()] for t in p.threaded}

    @property
    def worker_layers(self) -> dict[str, Any] | None:
        p = self.default
        return p.worker_layers if p is not None else None

    @worker_layers.setter
    def worker_layers(self, layers: dict[str, Any] | None) -> None:
        p = self.default
        if p is not None:
            p.worker_layers = layers
