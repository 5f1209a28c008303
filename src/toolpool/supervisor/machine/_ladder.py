"""Cancellation and the escalation ladder: cancel message, SIGTERM, SIGKILL (CONTRACT C4.1,
C4.2), and taking a worker out of service for good (quarantine)."""

from __future__ import annotations

import logging

from ...core import CancelCause
from ...protocol import Cancel, encode
from .._results import Rung, WorkerState
from ._actions import Kill, Terminate
from ._dispatch import Dispatch
from ._records import CallRecord, CallState, WorkerRecord
from ._settlement import Settlement
from ._state import Proc, State, Wait

__all__ = ("Ladder",)

_log = logging.getLogger("toolpool.supervisor")

#: How often the ladder looks at a worker's ledger while it waits for a call queued there to
#: become first in line (no message announces that), and while it waits for the calls
#: behind an escalated one to be withdrawn. Rare paths: only escalating workers are looked at.
_LOOK_FIRST_IN_LINE = 0.05
_LOOK_CLEARED = 0.005


class Ladder:
    """Cancellation, the escalation ladder, quarantine."""

    def __init__(self, state: State, settlement: Settlement, dispatch: Dispatch) -> None:
        self.s = state
        self.settlement = settlement
        self.dispatch = dispatch

    def cancel(self, call: CallRecord, cause: CancelCause, *, force: bool) -> None:
        if call._facts is not None:
            return
        self.settlement.record_cause(call, cause)
        if call._state is CallState.QUEUED:
            self.settlement.settle_unstarted(call, call._cause or cause)
            return
        w = call._worker
        assert w is not None
        assert call._cause is not None
        progress = self._progress(w, call)
        if force:
            call._forced = True
            if progress == 0 or (progress < 0 and call is w.call):
                # It runs (or is next and nothing runs before it): kill, once no call
                # waiting behind it can be taken up in the moment before the kill lands.
                if not self.dispatch.behind(w, call):
                    self._kill(w, call)
                else:
                    self.s.spawn_proc(self._kill_when_clear(w, call))
                return
            # Waiting behind another: withdraw it like any other; kill only if it becomes
            # the call its worker runs. Or w is done with it (it took up a call sent after
            # it): its result is on its way, which the ladder waits for; a kill now would
            # take the next call.
        if call._rung is Rung.NONE:
            self.settlement.raise_rung(call, Rung.CANCEL)
            w.acks_expected.add(call.id)
            self.dispatch.send(w, encode(Cancel(call.id, call._cause.kind)))
            if progress == 0 or call is w.call:
                # Its worker may be killed for it: take back what waits behind it first.
                self.dispatch.recall_behind(w, call)
        if not call._laddering:
            call._laddering = True
            self.s.spawn_proc(self._climb(w, call))

    def _climb(self, w: WorkerRecord, call: CallRecord) -> Proc:
        """The escalation ladder of one call in w: cancel message, SIGTERM, SIGKILL (C4.2).

        A call waiting behind another in w's queue is withdrawn at once, unless w's loop is
        held up (a body keeps the GIL): then it is withdrawn later, or taken up and sees its
        cancelled signal. Never kill a worker, and the call it runs, for a call waiting
        behind it; unless every call in w is cancelled too, and w has neither given it back
        nor taken it up within cancel_grace: a worker a tool patched could otherwise hold it
        (and the pool's close) for ever. Once it is w's first call, nothing else runs there.
        """
        config = self.s.config
        deadline = self.s.now + config.graces.cancel
        unanswered = False
        while call._facts is None and not w.gone and not self._at_or_past(w, call):
            if self.s.now >= deadline and all(c._cause is not None for c in w.calls):
                unanswered = True
                break
            look = self.s.now + _LOOK_FIRST_IN_LINE
            yield Wait(
                look if self.s.now >= deadline else min(deadline, look),
                lambda: call._facts is not None or w.gone or call is w.call,
            )
        if call._forced and call._facts is None and not w.gone:
            yield from self._kill_when_clear(w, call)
            return
        if not unanswered:
            yield Wait(self.s.now + config.graces.cancel, lambda: call._facts is not None)
        if call._facts is None and call._rung is not Rung.SIGKILL:
            yield from self._clear_behind(w, call)
        yield from self._await_sent_result(w, call)
        if call._facts is not None and w.state is not WorkerState.QUARANTINED:
            return
        if w.gone or w.violation is not None:
            return
        if call._facts is None and call._rung is not Rung.SIGKILL:
            self._terminate(w, call)
        yield Wait(self.s.now + config.graces.term, lambda: w.gone)
        if not w.gone:
            self._kill(w, call)

    def _kill_when_clear(self, w: WorkerRecord, call: CallRecord) -> Proc:
        """Kill w for call (forced), once no other call of w can die of it."""
        yield from self._clear_behind(w, call)
        yield from self._await_sent_result(w, call)
        if call._facts is None and not w.gone and w.violation is None:
            self._kill(w, call)

    def _clear_behind(self, w: WorkerRecord, call: CallRecord) -> Proc:
        """Before a signal to w's tree for call, which w runs: take back the calls waiting
        behind it, and wait (up to term_grace: w's loop may be held up) until they are
        withdrawn, or w is done with call (it took one up), or call settled. Else call
        could end just before the signal lands, and the call w took up next die of it. Also
        while w has not taken call up yet: it may take it up, end it and take up the next in
        the moment before the signal lands."""
        if not self._exposed(w, call):
            return
        self.dispatch.recall_behind(w, call)
        yield Wait(
            self.s.now + self.s.config.graces.term,
            lambda: call._facts is not None or w.gone or not self._exposed(w, call),
            _LOOK_CLEARED,
        )

    def _await_sent_result(self, w: WorkerRecord, call: CallRecord) -> Proc:
        """If w is done with call, its result is on its way: give it term_grace to arrive
        before escalating against w, which may run an uncancelled call since. Bounded: the
        ledger is the worker's to scribble on."""
        if call._facts is None and not w.gone and self._progress(w, call) == 1:
            yield Wait(self.s.now + self.s.config.graces.term, lambda: call._facts is not None)
            if call._facts is None and not w.gone and self._progress(w, call) == 1:
                # Its word, and no result to show for it: a worker that lies in its ledger,
                # or withholds results. It is out of service for breaking the protocol (C7),
                # not killed for this call: the call it runs since is lost to its breach.
                self.quarantine(
                    w,
                    f"protocol violation: its ledger says call {call.id} is done, but no "
                    f"result came within term_grace ({self.s.config.graces.term:g} s)",
                )

    def _at_or_past(self, w: WorkerRecord, call: CallRecord) -> bool:
        """Whether w is at call or past it: call is first in its line (nothing else of w's
        runs before it), or w took it up. Marks that lie can only get their own worker
        killed sooner, never keep a call first in line from escalating."""
        return call is w.call or self._progress(w, call) >= 0

    def _progress(self, w: WorkerRecord, call: CallRecord) -> int:
        """Where w is with call: -1, not taken up yet; 0, taken up (it may run it still);
        1, done with it: its ledger names a call sent after it, which w takes up only once
        it sent call's result (kept in its ledger, or acknowledged)."""
        ledger = self.s.probe.marks(w.wid)
        if ledger is None:
            return 0
        seen = False
        for c in w.calls:
            if c is call:
                seen = True
            elif seen and ledger[0] == c.id + 1:
                return 1
        return 0 if call._started or ledger[0] == call.id + 1 else -1

    def _exposed(self, w: WorkerRecord, call: CallRecord) -> list[CallRecord]:
        """The calls behind call in w that a signal for call could take instead: none once
        w is done with call (it took up one sent after it). Before w took call up, only
        uncancelled ones count: there is no body of call to stop yet, and waiting for
        cancelled ones (which a worker that does not answer keeps) would only delay the
        escalation against call."""
        behind = self.dispatch.behind(w, call)
        if not behind:
            return behind
        progress = self._progress(w, call)  # (one look at the ledger)
        if progress > 0:
            return []
        if progress < 0:
            behind = [c for c in behind if c._cause is None]
        return behind

    def _terminate(self, w: WorkerRecord, call: CallRecord) -> None:
        """SIGTERM w's tree, escalating ``call``."""
        w.escalated = True
        if w.state is not WorkerState.UNKILLABLE:
            w.advance(WorkerState.QUARANTINED)
        self.signalled(w, call, Rung.SIGTERM)
        why, text = self._why_unsettled(w, call)
        _log.info(
            "worker %s (pid %s): SIGTERM to its tree for call %s (%s): %s",
            w.wid,
            w.pid,
            call.id,
            call.tool,
            text,
            extra={
                "worker_pid": w.pid,
                "call_id": call.id,
                "tool": call.tool,
                "rung": "sigterm",
                "why": why,
            },
        )
        if not w.gone:
            self.s.act(Terminate(w.wid))

    def _why_unsettled(self, w: WorkerRecord, call: CallRecord) -> tuple[str, str]:
        """Why a cancelled call did not settle cooperatively (the two levels of liveness):
        ``hung``, its worker sends no heartbeat (no thread of it runs); ``ignores_signal``,
        its worker answers and acknowledged the cancel, the tool goes on; ``unacknowledged``,
        no cancel acknowledgement (without heartbeats, a worker too busy or hung to read it
        looks the same)."""
        if w.hung:
            return "hung", f"its worker is hung (no heartbeat for {self.s.now - w.beat_at:.1f} s)"
        if "cancel_delivered" in call._times:
            return "ignores_signal", "the tool ignores its signal (its worker answers)"
        return "unacknowledged", "its worker did not acknowledge the cancel"

    def _kill(self, w: WorkerRecord, call: CallRecord) -> None:
        """SIGKILL w's tree, escalating ``call``."""
        w.escalated = True
        _log.info(
            "worker %s (pid %s): SIGKILL to its tree for call %s (%s)",
            w.wid,
            w.pid,
            call.id,
            call.tool,
            extra={"worker_pid": w.pid, "call_id": call.id, "tool": call.tool, "rung": "sigkill"},
        )
        self.quarantine(w, None)
        self.signalled(w, call, Rung.SIGKILL)

    def signalled(self, w: WorkerRecord, call: CallRecord | None, rung: Rung) -> None:
        """Record a rung reached against w's tree: on the escalated call now; on whichever
        call w had taken up when it died, once its ledger tells (_settle_calls_of_dead)."""
        step = "sigterm" if rung is Rung.SIGTERM else "sigkill"
        w.signals.setdefault(step, self.s.now)
        if call is not None:
            self.settlement.raise_rung(call, rung)
            call._times.setdefault(step, self.s.now)

    def quarantine(self, w: WorkerRecord, violation: str | None) -> None:
        """Take w out of service for good and kill its tree (C4.2, C7)."""
        if violation is not None and w.violation is None:
            w.violation = violation
            _log.warning(
                "worker %s (pid %s) quarantined: %s",
                w.wid,
                w.pid,
                violation,
                extra={"worker_pid": w.pid, "violation": violation},
            )
        if w in w.provider.ready:
            w.provider.ready.remove(w)
        if w.gone:
            return
        if w.state is not WorkerState.UNKILLABLE:
            w.advance(WorkerState.QUARANTINED)
        if not w.orphaned:
            self.kill_tree(w)
            if violation is not None:
                self.signalled(w, None, Rung.SIGKILL)

    def kill_tree(self, w: WorkerRecord) -> None:
        """Ask the reaper to SIGKILL w's tree, once (``start_kill_clock``): a kill once asked
        ends the whole tree (the reaper kills what is left of it when it reaps w), so a
        second one (w's connection dropping as it dies, the close's last resort) would only
        make the reaper look at a dying tree again."""
        if w.killed_at is None:
            self.s.act(Kill(w.wid))
        self.start_kill_clock(w)

    def start_kill_clock(self, w: WorkerRecord) -> None:
        """w's tree is being SIGKILLed (by the reaper, or by the shell when the reaper is
        dead): the first time, start the clock after which a tree still there is unkillable
        (``_kill_overdue``)."""
        if w.killed_at is None:
            w.killed_at = self.s.now
            self.s.arm(self.s.now + self.s.config.graces.unkillable_after, "unkillable", w.wid)
