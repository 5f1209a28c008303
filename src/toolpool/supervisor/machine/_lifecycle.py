"""Workers' lives: start (hello, start failures), what they say (C7: every message checked),
death and replacement (C4.3, C4.6), and the reaper's own death."""

from __future__ import annotations

import functools
import hmac
import logging
import signal
from typing import Any, Final

from ...core import WorkerStartError
from ...protocol import (
    PROGRESS_INTERVAL,
    PROTOCOL_VERSION,
    Ack,
    CancelAck,
    Fatal,
    Heartbeat,
    Hello,
    Pong,
    ProgressMessage,
    ProtocolViolation,
    ResultMessage,
    Resume,
    StartedMessage,
    Withdrawn,
    encode,
)
from .._results import Progress, Rung, WorkerState
from ._actions import (
    Changed,
    Clean,
    Close,
    FirstHello,
    Orphaned,
    Progressed,
    RestartReaper,
    Started,
    Unkillable,
    WorkerDown,
    WorkerUp,
)
from ._dispatch import Dispatch
from ._fleet import Fleet
from ._ladder import Ladder
from ._records import CallState, ProviderState, WorkerRecord
from ._settlement import Settlement, describe_exit
from ._state import Proc, State, Wait

__all__ = ("EXIT_TOOLS_FAILED", "HUNG_AFTER_BEATS", "Lifecycle")

_log = logging.getLogger("toolpool.supervisor")

#: The worker's exit status after it sent 'fatal' (see worker/_main.py).
EXIT_TOOLS_FAILED: Final = 71
#: How long a worker that exited with EXIT_TOOLS_FAILED may take for its 'fatal' (with the
#: traceback) to arrive after the reaper's report of its exit (seconds).
_FATAL_TRAILS_BY = 2.0
REAPER_DIED: Final = "the pool's reaper process died"
#: A new reaper that fails to start is started again, up to this many attempts in a row,
#: before the pool is broken: whatever killed the last one may kill the next while it starts
#: (an operator's wrong pid, a tool of the same uid), which says nothing of the machine.
REAPER_START_ATTEMPTS: Final = 3
#: A worker that sent no heartbeat for this many heartbeat intervals is hung.
HUNG_AFTER_BEATS: Final = 3
#: What a worker may send unasked (heartbeats, progress): at most this many in a burst, and
#: on average twice what an honest worker sends. More is a flood, which breaks the protocol
#: (C7: it would cost the supervisor for free).
_BUDGET_BURST: Final = 1000.0


def _spawning(w: WorkerRecord) -> bool:
    return w.state is WorkerState.SPAWNING and not w.gone


class Lifecycle:
    """Workers' lives and messages, and the reaper's death."""

    def __init__(
        self, state: State, settlement: Settlement, dispatch: Dispatch, ladder: Ladder, fleet: Fleet
    ) -> None:
        self.s = state
        self.settlement = settlement
        self.dispatch = dispatch
        self.ladder = ladder
        self.fleet = fleet

    # ------------------------------------------------------------------ start

    def hello_overdue(self, wid: int) -> None:
        w = self.s.workers.get(wid)
        if w is not None and _spawning(w):
            self.start_failure(w, "the worker did not say hello in time")

    def start_failure(self, w: WorkerRecord, reason: str) -> None:
        w.start_failed = True
        w.answered = True
        self.ladder.quarantine(w, None)
        p = w.provider
        p.start_failures += 1
        _log.log(
            # At start the caller gets the error (WorkerStartError); later, only the log.
            logging.INFO if p.starting else logging.WARNING,
            "worker %s (pid %s) failed to start: %s",
            w.wid,
            w.pid,
            reason.strip().splitlines()[-1] if reason.strip() else reason,
            extra={"worker_pid": w.pid, "reason": reason},
        )
        if p.broken is None and (
            p.start_failures >= self.s.config.max_start_failures or p.starting
        ):
            p.broken = WorkerStartError(
                f"workers for {p.spec.tools_spec!r} fail to start: {reason.strip()}"
            )
            if p.starting:
                self.fleet.failed(p, p.broken)
            else:
                self.settlement.fail_queue(p)
        self.s.act(Changed())

    def violated(self, w: WorkerRecord, violation: str) -> None:
        """w broke the protocol: quarantine it; before its hello, that is a start failure."""
        spawning = _spawning(w)  # before the quarantine changes its state
        self.ladder.quarantine(w, violation)
        if spawning:
            self.start_failure(w, violation)

    def _await_fatal(self, w: WorkerRecord) -> Proc:
        """w exited at start saying its tools failed: wait briefly for its 'fatal'."""
        yield Wait(self.s.now + _FATAL_TRAILS_BY, lambda: w.answered)
        if not w.start_failed:
            self.start_failure(w, f"the worker exited with status {w.exit_status} at start")
        w.awaiting_fatal = False
        if w.gone_deferred:  # its tree's end came meanwhile: now it counts
            self.worker_gone(w)
        elif w.gone:
            self.maybe_replace(w)

    # ------------------------------------------------------------------ messages

    def on_message(self, w: WorkerRecord, msg: Any, peer_pid: int | None) -> None:
        if isinstance(msg, ResultMessage):
            self.on_result(w, msg)
        elif isinstance(msg, StartedMessage):
            call = w.call
            if call is None or call.id != msg.call_id or call._started:
                raise ProtocolViolation(f"'started' for call {msg.call_id}, which it does not run")
            call._started = True
            call.advance(CallState.RUNNING)
            call._times["started"] = self.s.now
            self.s.act(Started(call))
        elif isinstance(msg, CancelAck):
            # One per cancel it was sent, for its current or just-settled call: anything else
            # is a violation (a flood of acks would otherwise cost the supervisor for free).
            if msg.call_id not in w.acks_expected:
                raise ProtocolViolation(f"cancel_ack for call {msg.call_id}, which it was not sent")
            w.acks_expected.discard(msg.call_id)
            call = w.call
            if call is not None and call.id == msg.call_id:
                call._times.setdefault("cancel_delivered", self.s.now)
        elif isinstance(msg, Withdrawn):
            self._on_withdrawn(w, msg)
        elif isinstance(msg, Hello):
            self._on_hello(w, msg, peer_pid)
        elif isinstance(msg, Fatal):
            if w.start_failed and hmac.compare_digest(msg.secret, w.secret):
                return  # its start already counted as failed; the details came late
            if w.state is not WorkerState.SPAWNING or not hmac.compare_digest(msg.secret, w.secret):
                raise ProtocolViolation("an unexpected 'fatal' message")
            w.fatal = msg.error
            self.start_failure(w, msg.error)
        elif isinstance(msg, Heartbeat):
            if not w.answered:
                raise ProtocolViolation("a heartbeat before its hello")
            self._spend(w)
            self.on_heartbeat(w)
        elif isinstance(msg, ProgressMessage):
            self._spend(w)
            self._on_progress(w, msg)
        elif isinstance(msg, Pong):
            # The supervisor sends no pings: every pong is unsolicited. Harmless alone, but a
            # flood of them would cost the supervisor CPU and delay every other worker.
            raise ProtocolViolation("a pong it was not asked for")
        else:
            raise ProtocolViolation(f"unexpected message {type(msg).__name__}")

    # ------------------------------------------------------------------ liveness, progress

    def _hung_after(self) -> float | None:
        beat = self.s.config.heartbeat
        return None if beat is None else beat * HUNG_AFTER_BEATS

    def on_heartbeat(self, w: WorkerRecord) -> None:
        """w's threads run (its hello counts as the first heartbeat)."""
        silent, w.beat_at = self.s.now - w.beat_at, self.s.now
        hung_after = self._hung_after()
        if hung_after is None:
            return
        if w.hung:
            w.hung = False
            self.s.act(Changed())  # (statistics' `hung` waiters)
            _log.info(
                "worker %s (pid %s) answers again: a heartbeat after %.1f s of none",
                w.wid,
                w.pid,
                silent,
                extra={"worker_pid": w.pid},
            )
        if not w.answered:  # (the hello: from now on a heartbeat is expected)
            self.s.arm(self.s.now + hung_after, "beat", w.wid)

    def beat_overdue(self, wid: int) -> None:
        """The time by which w's next heartbeat was due when this timer was set: hung now,
        or (a heartbeat came since) look again when the next one is due."""
        w = self.s.workers.get(wid)
        hung_after = self._hung_after()
        if w is None or w.gone or hung_after is None:
            return
        due = w.beat_at + hung_after
        if self.s.now < due:
            self.s.arm(due, "beat", wid)
            return
        if not w.hung:
            w.hung = True
            self.s.act(Changed())
            call = w.call
            _log.warning(
                "worker %s (pid %s) is hung: no heartbeat for %.1f s (no thread of it runs: "
                "a C extension holding the GIL, a stopped process)%s",
                w.wid,
                w.pid,
                self.s.now - w.beat_at,
                f"; it runs call {call.id} ({call.tool})" if call is not None else "",
                extra={"worker_pid": w.pid, "call_id": call.id if call else None},
            )
        self.s.arm(self.s.now + hung_after, "beat", wid)

    def _spend(self, w: WorkerRecord) -> None:
        """One message w sent unasked: a flood of them breaks the protocol (C7)."""
        beat = self.s.config.heartbeat
        rate = 2.0 * ((1.0 / beat if beat else 0.0) + 1.0 / PROGRESS_INTERVAL)
        budget = min(_BUDGET_BURST, w.budget + (self.s.now - w.budget_at) * rate) - 1.0
        w.budget, w.budget_at = budget, self.s.now
        if budget < 0:
            raise ProtocolViolation("a flood of heartbeat and progress messages")

    def _on_progress(self, w: WorkerRecord, msg: ProgressMessage) -> None:
        call = w.call
        if call is None or call.id != msg.call_id or not call._started:
            raise ProtocolViolation(f"progress for call {msg.call_id}, whose body it does not run")
        call._progress = Progress(msg.done, msg.total, msg.message)
        self.s.act(Progressed(call))

    def on_result(self, w: WorkerRecord, msg: ResultMessage) -> None:
        """w's result (``Machine.message`` comes here at once for one: the hot path)."""
        calls = w.calls
        call = calls[0] if calls else None  # (w.call, inline)
        if call is None or call.id != msg.call_id:
            raise ProtocolViolation(f"result for call {msg.call_id}, which it does not own")
        settlement = self.settlement
        facts = settlement.result_facts(w, call, msg)
        if len(calls) > 1 and not msg.extras.get("kept", False):
            # Not in its ledger: it takes up nothing more until it knows this arrived.
            self.dispatch.send(w, encode(Ack(w.results)))
        background = w.provider.spec.allow_background
        leftovers = msg.leftovers
        # With a leftover it reported, the worker takes up nothing more until 'resume'.
        w.holding = leftovers > 0 and not background
        probe = self.s.probe
        if not leftovers and not background and len(calls) == 1 and probe.cgroups:
            # The worker's count is its tool's claim; its cgroup is not: any process in it
            # but the worker (a child re-parented away with clone(CLONE_PARENT), or one a
            # tool hid by patching the worker) is left over too. Only while no other call
            # is in the worker: one taken up since could own them.
            leftovers = probe.other_members(w.wid, w.pid) or 0
        if leftovers and not background and self.s.reaper_up:
            # The call left processes behind: kill them before settling, so the result
            # can say how many, and the next call never inherits them.
            w.pending = functools.partial(
                settlement.settle_facts, call, facts, msg.outcome, msg.body_started
            )
            if w.state is WorkerState.BUSY:
                w.advance(WorkerState.CLEANING)
            self.s.act(Clean(w.wid))
            return
        if call._facts is None:  # (settle_facts, inline: nothing left over to count)
            call._facts = facts
            settlement._settled(call, msg.outcome, msg.body_started)
        if calls and probe.cgroups:
            probe.reset_peak(w.wid)  # the next call's peak starts about now
        if self.dispatch.resume(w):  # (_resume, inline)
            self.fleet.owe_replacement(w.provider)

    def _on_withdrawn(self, w: WorkerRecord, msg: Withdrawn) -> None:
        # Only a queued call it was asked to give back (a cancel, a recall, a shutdown).
        call = next((c for c in w.calls if c.id == msg.call_id), None)
        if call is None or not (call._recalling or msg.call_id in w.acks_expected):
            raise ProtocolViolation(f"withdrew call {msg.call_id}, which it was not asked to")
        if call._started:
            raise ProtocolViolation(f"withdrew call {msg.call_id}, whose body it started")
        w.calls.remove(call)
        w.acks_expected.discard(call.id)
        if call._cause is not None:
            call._times.setdefault("cancel_delivered", self.s.now)
            call._worker = None
            call._rung = Rung.CANCEL
            self.settlement.settle_unstarted(call, call._cause)
        else:
            self.dispatch.requeue(call)
        self._resume(w)

    def _on_hello(self, w: WorkerRecord, msg: Hello, peer_pid: int | None) -> None:
        if w.state is not WorkerState.SPAWNING:
            raise ProtocolViolation("a second hello")
        if not hmac.compare_digest(msg.secret, w.secret):
            raise ProtocolViolation("hello with a wrong secret")
        if msg.version != PROTOCOL_VERSION:
            w.fatal = f"protocol version {msg.version}, expected {PROTOCOL_VERSION}"
            self.start_failure(w, w.fatal)
            return
        if w.pid is not None and msg.pid != w.pid:
            raise ProtocolViolation(f"hello from pid {msg.pid}, but the worker is {w.pid}")
        if peer_pid is not None and peer_pid != msg.pid:
            # The secret alone is not enough: the process at the other end of the socket
            # must be the worker itself (a stolen secret cannot stand in for it).
            raise ProtocolViolation(
                f"hello sent by process {peer_pid}, which is not the worker ({msg.pid})"
            )
        w.peer_pid = peer_pid
        if w.pid is None and peer_pid == msg.pid:
            # The reaper's report of its pid can come after the hello. Until then, the pid
            # the kernel vouches for stands in (results, the cgroup's member count); the
            # report is checked against it ("spawned").
            w.pid = msg.pid
        catalog: dict[str, dict[str, Any]] = {}
        threaded: set[str] = set()
        for entry in msg.tools:
            desc = dict(entry)
            if desc.pop("runs_in_thread", False):
                threaded.add(desc["name"])
            catalog[desc["name"]] = desc
        p = w.provider
        if p.catalog and set(catalog) != set(p.catalog):
            raise ProtocolViolation("its tools differ from the other workers'")
        for name, desc in catalog.items():
            known = p.catalog.get(name)
            # Where its body runs decides whether calls may queue behind it: a worker
            # that says otherwise than the others is refused, and changes nothing.
            if known is not None and (known != desc or (name in threaded) != (name in p.threaded)):
                raise ProtocolViolation(f"tool {name!r} differs from the other workers'")
        p.threaded |= threaded
        p.catalog.update(catalog)
        w.catalog = catalog
        if p.worker_layers is None:
            p.worker_layers = dict(msg.containment)
            self.s.act(FirstHello(p.worker_layers, p.name))
        w.advance(WorkerState.READY)
        self.on_heartbeat(w)
        w.budget, w.budget_at = _BUDGET_BURST, self.s.now
        w.answered = True
        w.head_since = self.s.now  # (idle since: the autoscaler reads it)
        p.start_failures = 0
        _log.debug("worker %s (pid %s) ready", w.wid, w.pid, extra={"worker_pid": w.pid})
        self.s.act(WorkerUp(w.wid, w.pid, p.name))
        if self.s.closing or not p.live or w.draining:
            self.dispatch.retire(w)
        else:
            p.ready.append(w)
            self.fleet.maybe_activate(p)
            self.dispatch.schedule()
        self.s.act(Changed())

    # ------------------------------------------------------------------ the reaper's reports

    def on_spawned(self, w: WorkerRecord, pid: int, method: str) -> None:
        w.pid = pid
        if w.peer_pid is not None and w.peer_pid != pid and w.answered:
            # Its hello (handled before this report) came from another process.
            self.ladder.quarantine(w, f"hello sent by process {w.peer_pid}, not the worker")
        w.start_method = method
        _log.debug("worker %s started (pid %s, %s)", w.wid, pid, method, extra={"worker_pid": pid})
        if w.state is WorkerState.READY:
            self.fleet.maybe_activate(w.provider)
        self.s.act(Changed())

    def on_exited(self, w: WorkerRecord, status: int, oom_kills: int) -> None:
        w.exit_status = status
        w.oom_kills = oom_kills
        if w.state is WorkerState.SPAWNING and not w.start_failed:
            if status == EXIT_TOOLS_FAILED:
                # It sent 'fatal' (with the traceback) before exiting: the message can
                # trail the exit report by a moment. Wait for it, briefly.
                w.awaiting_fatal = True
                self.s.spawn_proc(self._await_fatal(w))
            else:
                self.start_failure(w, f"the worker exited with status {status} at start")

    def on_gone(self, w: WorkerRecord) -> None:
        if w.awaiting_fatal:
            # Its 'fatal' can trail this report too (the socket's I/O thread lags under
            # load): its socket stays open and read until _await_fatal is done.
            w.gone_deferred = True
        else:
            self.worker_gone(w)

    def _resume(self, w: WorkerRecord) -> None:
        """w serves on (:meth:`Dispatch.resume`); one that retired having served its
        ``max_calls`` is replaced (on the loop's next turn: ``Fleet.owe_replacement``)."""
        if self.dispatch.resume(w):
            self.fleet.owe_replacement(w.provider)

    def on_cleaned(self, w: WorkerRecord, count: int) -> None:
        pending, w.pending = w.pending, None
        if pending is not None:
            pending(leftovers_killed=count)
        if w.holding and not w.gone:
            w.holding = False
            if w.calls:
                self.s.probe.reset_peak(w.wid)  # the next call's peak starts now
            self.dispatch.send(w, encode(Resume()))
        self._resume(w)

    def worker_gone(self, w: WorkerRecord) -> None:
        """The worker and every process it spawned are gone: settle, replace (C4.3, C4.6).

        The shell read what it sent before it died first: a result may have been unread.
        """
        if w.gone:
            return
        was_serving = w.state in (WorkerState.READY, WorkerState.BUSY, WorkerState.QUARANTINED)
        was_serving = was_serving and w.answered and not w.start_failed
        retired = w.state is WorkerState.RETIRING
        unkillable = w.state is WorkerState.UNKILLABLE
        w.advance(WorkerState.EXITED)  # (gone)
        p = w.provider
        if w.killed_at is not None and not w.orphaned:
            p.tally.kill_to_reaped.observe(self.s.now - w.killed_at)
        if w in p.ready:
            p.ready.remove(w)
        pending, w.pending = w.pending, None
        if pending is not None:  # its body returned; the clean-up was overtaken by its death
            pending()
        held = bool(w.calls)
        requeue = self.settlement.settle_calls_of_dead(w)
        for call in reversed(requeue):
            self.dispatch.requeue(call)  # in order, at the front
        del self.s.workers[w.wid]
        self.s.act(Close(w.wid))
        if not unkillable:  # (an unkillable one was announced when it went out of service)
            self.s.act(WorkerDown(w.wid, w.pid, p.name, self._exit_kind(w, retired)))
        self.s.act(Changed())
        if unkillable:
            _log.warning(
                "unkillable worker %s (pid %s): its tree is gone at last, %.1f s after SIGKILL",
                w.wid,
                w.pid,
                self.s.now - (w.killed_at or self.s.now),
                extra={"worker_pid": w.pid, "pids": list(w.unkillable_pids)},
            )
        else:
            self._log_gone(w, retired=retired, held=held)
        if p.state in (ProviderState.DRAINING, ProviderState.FAILED) and not any(
            x.provider is p for x in self.s.workers.values()
        ):
            self.fleet.gone(p)
        if not w.awaiting_fatal and not w.replaced:  # else: decided once the start failure
            self.maybe_replace(w, counts=was_serving)  # is known; or replaced already
        if not self.s.reaper_up:
            self._restart_reaper_when_clear()
        self.dispatch.schedule()  # a warm spare (or any idle worker) takes what is queued

    def kill_overdue(self, wid: int) -> None:
        """``unkillable_after`` seconds since w's tree was first asked SIGKILLed: if it is
        not gone, a process of it does not die (uninterruptible sleep: a hung NFS or FUSE
        mount, a frozen cgroup v1, a device driver). w is unkillable: out of service,
        reported, replaced now. Its calls are not settled (C4.3: never while its tree is
        known alive), nor the calls behind its first run elsewhere (a reaper that could not
        deliver the SIGKILL would leave w running them): both wait for its tree's end, which
        the reaper goes on waiting for (or, its reaper dead, the shell: ``Orphaned``)."""
        w = self.s.workers.get(wid)
        if w is None or w.gone or w.state is WorkerState.UNKILLABLE:
            return
        was_serving = w.state in (WorkerState.READY, WorkerState.BUSY, WorkerState.QUARANTINED)
        was_serving = was_serving and w.answered and not w.start_failed
        if w in w.provider.ready:
            w.provider.ready.remove(w)
        w.advance(WorkerState.UNKILLABLE)
        w.unkillable_pids = tuple(self.s.probe.tree_pids(wid, w.pid))
        w.provider.tally.unkillable += 1
        call = w.call
        _log.error(
            "worker %s (pid %s) is unkillable: its tree is still there %g s after SIGKILL "
            "(processes %s; uninterruptible sleep?). %s; it is replaced, and reaped whenever "
            "its processes die",
            w.wid,
            w.pid,
            self.s.config.graces.unkillable_after,
            ", ".join(map(str, w.unkillable_pids)) or "unknown",
            f"Its call {call.id} ({call.tool}) stays unsettled until then"
            if call is not None
            else "It held no call",
            extra={
                "worker_pid": w.pid,
                "pids": list(w.unkillable_pids),
                "call_id": call.id if call is not None else None,
            },
        )
        self.s.act(Unkillable(wid, w.unkillable_pids))
        self.s.act(Changed())
        if not w.awaiting_fatal:
            w.replaced = True
            self.maybe_replace(w, counts=was_serving)
        if not self.s.reaper_up:  # an orphan: the new reaper need not wait for its tree
            self._restart_reaper_when_clear()

    def _log_gone(self, w: WorkerRecord, *, retired: bool, held: bool) -> None:
        why = (
            w.violation
            or w.lost_reason
            or describe_exit(w.exit_status, w.disconnected, w.oom_kills, w.provider.spec.memory_cap)
        )
        extra = {"worker_pid": w.pid, "exit_status": w.exit_status, "why": why}
        if w.retired and w.violation is None and not w.escalated:
            # On purpose: the reason is the pool's, and a connection that dropped as it
            # exited (and the kill that follows, to be sure) is no sign of anything.
            how = describe_exit(w.exit_status)
            if w.disconnected and w.exit_status == -signal.SIGKILL:
                how = "its connection dropped as it exited; its tree was killed to be sure"
            why = f"retired ({w.retire_reason}); {how}"
            extra["why"] = why
            _log.debug("worker %s (pid %s) %s", w.wid, w.pid, why, extra=extra)
        elif retired or w.start_failed:
            _log.debug("worker %s (pid %s) exited: %s", w.wid, w.pid, why, extra=extra)
        elif w.escalated or self.s.closing:
            _log.info("worker %s (pid %s) is gone: %s", w.wid, w.pid, why, extra=extra)
        else:
            during = " during a call" if held else ""
            _log.warning("worker %s (pid %s) died%s: %s", w.wid, w.pid, during, why, extra=extra)

    def _exit_kind(self, w: WorkerRecord, retired: bool) -> str:
        """Why w's tree is gone, as events say it: retired, crashed, killed or lost."""
        if w.orphaned or w.violation is not None:
            return "lost"
        if w.escalated:
            return "killed"
        if retired or w.retired:  # (its connection drops as it exits: still retired)
            return "retired"
        if w.exit_status is None or (w.disconnected and w.exit_status == -9):
            return "lost"  # (its connection dropped, and it was killed for that)
        return "crashed"  # it died on its own (its connection dropped as it did)

    def maybe_replace(self, w: WorkerRecord, *, counts: bool = False) -> None:
        p = w.provider
        if self.s.closing or self.s.broken is not None or p.broken is not None or not p.live:
            return
        if counts:
            p.tally.replaced += 1
        if not self.s.reaper_up:
            return  # the new reaper starts a full complement
        if w.start_failed:
            self.s.arm(self.s.now + min(2.0, 0.05 * 2**p.start_failures), "respawn", p.id)
        else:
            self.fleet.owe_replacement(p, w)  # (after the caller it settled runs)

    def respawn_due(self, provider_id: int) -> None:
        p = self.s.providers_by_id.get(provider_id)
        if p is not None:
            self.fleet.top_up(p)

    # ------------------------------------------------------------------ the reaper's death

    def reaper_lost(self, error: str | None = None) -> None:
        """The reaper died (or was killed for ``error``: it broke the protocol). Its workers
        die with it (PDEATHSIG), their descendants may not: the shell ends each tree itself
        (``Orphaned``) and reports it gone, saying whether that was verified. No call settles
        before. Then a new reaper starts (C4.3, C4.6)."""
        if not self.s.reaper_up:
            return
        self.s.reaper_up = False
        if self.s.starting and self.s.broken is None:
            self.s.broken = WorkerStartError(error or "the pool's reaper process went away")
            self.settlement.fail_queues()
        _log.error(
            "the pool's reaper process %s; ending its workers' trees without it%s",
            "died" if error is None else "was killed (it broke the protocol)",
            "" if self.s.closing or self.s.broken else ", then starting a new one",
        )
        for w in list(self.s.workers.values()):
            if w.gone or w.orphaned:  # (orphaned: an earlier reaper's, being ended already)
                continue
            w.orphaned = True
            w.lost_reason = REAPER_DIED
            if w in w.provider.ready:
                w.provider.ready.remove(w)
            if w.state not in (WorkerState.RETIRING, WorkerState.UNKILLABLE):
                w.advance(WorkerState.QUARANTINED)  # no call is sent to it any more
            self.s.act(Orphaned(w.wid))
            self.ladder.start_kill_clock(w)  # (the shell SIGKILLs its tree now)
        self.s.act(Changed())
        self._restart_reaper_when_clear()

    def all_gone_or_unkillable(self) -> bool:
        """Every worker is gone, or unkillable (the close waits no longer for those, nor does
        a new reaper's start)."""
        return all(w.state is WorkerState.UNKILLABLE for w in self.s.workers.values())

    def _restart_reaper_when_clear(self) -> None:
        if self.s.reaper_up or self.s.restarting or self.s.closing or self.s.broken is not None:
            return
        if not self.all_gone_or_unkillable():
            # The calls in flight settle truthfully first. (An unkillable tree may never end:
            # its calls wait for it, the pool does not.)
            return
        self.s.restarting = True
        self.s.act(RestartReaper())

    def reaper_ready(self) -> None:
        self.s.restarting = False
        self.s.reaper_up = True
        self.s.reaper_failures = 0
        if self.s.closing or self.s.broken is not None:
            return
        _log.info("a new reaper serves the pool")
        for p in [*self.s.pending.values(), *self.s.providers.values()]:
            self.fleet.top_up(p)

    def reaper_failed(self, error: str) -> None:
        self.s.restarting = False
        self.s.reaper_up = False
        self.s.reaper_failures += 1
        if (
            not self.s.closing
            and self.s.broken is None
            and self.s.reaper_failures < REAPER_START_ATTEMPTS
        ):
            _log.warning(
                "a new reaper did not start (%s); starting another (attempt %d of %d)",
                error,
                self.s.reaper_failures + 1,
                REAPER_START_ATTEMPTS,
            )
            self._restart_reaper_when_clear()
            return
        if self.s.broken is None:
            self.s.broken = WorkerStartError(
                f"the pool's reaper process went away and a new one did not start: {error}"
            )
            self.settlement.fail_queues()
        self.s.act(Changed())
