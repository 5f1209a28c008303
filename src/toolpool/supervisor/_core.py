"""The pool's core: a deterministic state machine, events in, actions out (no I/O).

Every event is a method taking ``now`` (the core reads no clock). Handling it only changes
the records and queues actions; :meth:`PoolCore.flush` then runs what the event made due
(dispatch, the waits of the escalation ladders) and returns the actions, in order, for the
shell to perform: :class:`~._records.Send` frames to a worker, signal or kill its tree,
start a worker, wake whoever waits for a settled call... The shell (``_pool.py``) turns
sockets, the reaper's reports and timers into these events; a simulation
(``tests/sim/``) does the same over a model of workers and reaper, with virtual time, and
checks the contract's invariants after every step.

The states and events, and where each promise is decided, are in ``docs/pool.md``
("The core").
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Mapping
from typing import Any, Final

from ..core import CancelCause
from ..protocol import ProtocolViolation
from ._providers import Providers
from ._records import Action, CallRecord, CallState, GroupRecord, WorkerRecord
from ._results import WorkerState

__all__ = ("PoolCore",)

_log = logging.getLogger("toolpool.supervisor")

_DISPOSED: Final = CancelCause("disposed")
_PARENT: Final = CancelCause("parent")
_TIMEOUT: Final = CancelCause("timeout")


class PoolCore(Providers):
    """The pool's decisions (CONTRACT C4, C5, C7), as a synchronous state machine."""

    # ------------------------------------------------------------------ the pool

    def start(self, now: float) -> None:
        """Start the workers of the providers there are (the default one: its size, plus
        warm spares)."""
        self.now = now
        for p in list(self.pending.values()):
            self._top_up(p)

    def started(self) -> None:
        """The pool's start-up is over."""
        self.starting = False

    def ready_count(self) -> int:
        """Workers that said hello and that the reaper reported."""
        return sum(
            1
            for w in self.workers.values()
            if w.state is WorkerState.READY and w.start_method is not None
        )

    def close(self, now: float) -> None:
        """Closing (C5.3): nothing is dispatched any more; every call is cancelled with cause
        ``disposed`` (the shell cancels the groups first)."""
        self.now = now
        self.closing = True
        for call in list(self.calls.values()):
            self._cancel_call(call, _DISPOSED, force=False)

    def retire_idle(self, now: float) -> None:
        """Tell every idle worker to exit (a spawning one is retired when its hello comes)."""
        self.now = now
        for w in list(self.workers.values()):
            if w.state is WorkerState.READY and not w.gone:
                self._retire(w)

    def kill_remaining(self, now: float) -> None:
        """SIGKILL the tree of every worker not gone yet (the close's last resort)."""
        self.now = now
        for w in list(self.workers.values()):
            if not w.gone and not w.orphaned:
                self._kill_tree(w)

    def all_gone(self) -> bool:
        return not self.workers

    def idle_or_stuck(self) -> bool:
        """Every call has settled, or is held by an unkillable worker (whose calls settle
        only once its tree is gone: the close waits no longer for those)."""
        held = sum(len(w.calls) for w in self.unkillable())
        return len(self.calls) == held

    def unkillable(self) -> list[WorkerRecord]:
        """The unkillable workers (not gone yet)."""
        return [w for w in self.workers.values() if w.state is WorkerState.UNKILLABLE]

    # ------------------------------------------------------------------ calls

    def submit(self, call: CallRecord, *, timeout: float | None, now: float) -> None:
        """A new call (checked and packed by the shell)."""
        self.now = now
        owner = call._owner = self.owner.get(call.tool)
        (owner.tally if owner is not None else self.tallies[""]).submitted += 1
        self.calls[call.id] = call
        group = call._group
        if group is not None:
            group._calls.add(call)
            if group.cancelled:  # C5.2: settled at once
                self._abort_queued(call, group.signal.reason or _PARENT)
                return
        if timeout is not None:
            call._deadline = now + timeout
            self._arm(call._deadline, "deadline", call.id)
        self._enqueue(call)

    def cancel(self, call: CallRecord, cause: CancelCause, *, force: bool, now: float) -> None:
        """A cancel request for one call (validated by the shell)."""
        self.now = now
        self._cancel_call(call, cause, force=force)

    def cancel_group(self, group: GroupRecord, cause: CancelCause, now: float) -> None:
        """A group was cancelled (C5.2): its queued calls first (cancelling a running one can
        settle it at once, which frees its worker for the next queued call)."""
        self.now = now
        for call in sorted(group._calls, key=lambda c: c._state is not CallState.QUEUED):
            self._cancel_call(call, cause, force=False)

    # ------------------------------------------------------------------ workers

    def message(self, wid: int, msg: Any, now: float, *, peer_pid: int | None = None) -> None:
        """A decoded message from worker ``wid`` (``peer_pid``: who sent it, where the
        socket tells, for a worker that has not said hello)."""
        self.now = now
        w = self.workers.get(wid)
        if w is None or w.gone or w.violation is not None:
            return  # a quarantined violator: nothing it says counts any more
        try:
            self._on_message(w, msg, peer_pid)
        except ProtocolViolation as exc:
            self._violated(w, f"protocol violation: {exc}")

    def heartbeat(self, wid: int, now: float) -> None:
        """Worker ``wid`` sent a heartbeat (its threads run). The shell passes heartbeat
        messages to :meth:`message`, which comes here; a model may call it directly."""
        self.now = now
        w = self.workers.get(wid)
        if w is not None and not w.gone and w.violation is None and w.answered:
            self._on_heartbeat(w)

    def violation(self, wid: int, text: str, now: float) -> None:
        """Worker ``wid`` sent what cannot be decoded (C7)."""
        self.now = now
        w = self.workers.get(wid)
        if w is not None and not w.gone and w.violation is None:
            self._violated(w, text)

    def disconnected(self, wid: int, now: float) -> None:
        """Worker ``wid``'s connection dropped (dead, dying, or an oversized frame): never
        trust it again; the reaper reports when its tree is gone."""
        self.now = now
        w = self.workers.get(wid)
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
            self._quarantine(w, None)

    def send_failed(self, wid: int, calls: tuple[CallRecord, ...], now: float) -> None:
        """The shell could not hand worker ``wid`` these calls: no body can have started.
        Put them back and retire it: its peer is gone (it died, or is dying of what it
        runs), not misbehaving."""
        self.now = now
        w = self.workers.get(wid)
        for call in reversed(calls):
            if w is not None and call in w.calls and not call._started:
                w.calls.remove(call)
                self._requeue(call)
        if w is not None and not w.gone:
            _log.info("worker %s: its socket refused a call; retiring it", wid)
            self._quarantine(w, None)

    def spawn_failed(self, wid: int, error: str, now: float) -> None:
        self.now = now
        w = self.workers.get(wid)
        if w is not None:
            w.fatal = error
            self._start_failure(w, error)
            self._worker_gone(w)

    def spawned(self, wid: int, pid: int, method: str, now: float) -> None:
        self.now = now
        w = self.workers.get(wid)
        if w is not None:
            self._on_spawned(w, pid, method)

    def exited(self, wid: int, status: int, oom_kills: int, now: float) -> None:
        """The worker process exited (its tree may live on: ``gone`` says when it is not)."""
        self.now = now
        w = self.workers.get(wid)
        if w is not None:
            self._on_exited(w, status, oom_kills)

    def gone(self, wid: int, now: float, *, verified: bool = True) -> None:
        """The worker and every process of its tree are gone (``verified=False``: its
        reaper died and nothing could check its descendants)."""
        self.now = now
        w = self.workers.get(wid)
        if w is not None:
            w.verified = verified
            self._on_gone(w)

    def cleaned(self, wid: int, count: int, now: float) -> None:
        """What the worker's last call left running was killed (``count`` processes)."""
        self.now = now
        w = self.workers.get(wid)
        if w is not None:
            self._on_cleaned(w, count)

    def reaper_lost(self, now: float) -> None:
        self.now = now
        self._reaper_lost()

    def reaper_ready(self, now: float) -> None:
        self.now = now
        self._reaper_ready()

    def reaper_failed(self, error: str, now: float) -> None:
        self.now = now
        self._reaper_failed(error)

    # ------------------------------------------------------------------ time

    def timer(self, now: float) -> None:
        """Time passed: handle the deadlines due (call timeouts, hello deadlines, respawns;
        the waits of the ladders are looked at in ``flush``)."""
        self.now = now
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, _, kind, key = heapq.heappop(timers)
            if kind == "deadline":
                call = self.calls.get(key)  # settled calls are no longer there
                if call is not None and call._result is None:
                    self._cancel_call(call, _TIMEOUT, force=False)
            elif kind == "hello":
                self._hello_overdue(key)
            elif kind == "respawn":
                self._respawn_due(key)
            elif kind == "drain":
                self.drain_due(key)
            elif kind == "scale":
                self.scale_due(key)
            elif kind == "unkillable":
                self._kill_overdue(key)
            elif kind == "beat":
                self._beat_overdue(key)

    def due(self) -> bool:
        """Whether ``flush`` has anything to do or return."""
        return bool(self._out) or self._dispatch_due or bool(self._procs)

    def flush(self, now: float) -> list[Action]:
        """Run what the events so far made due; return the actions to perform, in order."""
        self.now = now
        for _ in range(1000):
            if self._procs:
                self._run_procs()
            if not self._dispatch_due:
                break
            self._dispatch_due = False
            self._dispatch_once()
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------ introspection

    def live_workers(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if not w.gone]

    def states(self) -> Mapping[str, int]:
        counts: dict[str, int] = {}
        for w in self.workers.values():
            counts[w.state.value] = counts.get(w.state.value, 0) + 1
        return counts

    def in_flight(self) -> int:
        return sum(1 for w in self.workers.values() if w.calls)

    def hung_count(self) -> int:
        """Live workers that sent no heartbeat for HUNG_AFTER_BEATS intervals."""
        return sum(1 for w in self.workers.values() if w.hung and not w.gone)
