"""Settlement: building a call's result, settling it exactly once, and the post-mortem of a
worker that died with calls in it (CONTRACT C3, C4.3)."""

from __future__ import annotations

import functools
import logging
import signal
from bisect import bisect_left
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from ...core import (
    ABORT_ERROR_NAME,
    ABORTED_BEFORE_DISPATCH_TEXT,
    CancelCause,
    Outcome,
)
from ...protocol import ProtocolViolation, ResultMessage, decode_from_worker, unpack_value
from ...sandbox._profile import _human as _human_size
from .._results import Rung
from ._records import (
    KILLED_TEXT,
    NO_CONTEXT,
    OUTCOME_OF,
    TIMEOUT_TEXT,
    WORKER_LOST_TEXT,
    CallRecord,
    CallState,
    ProviderRecord,
    WorkerRecord,
)
from ._state import State

__all__ = ("Settlement", "describe_exit")

_log = logging.getLogger("toolpool.supervisor")

_DISPOSED: Final = CancelCause("disposed")
_SETTLED, _NO_RUNG = CallState.SETTLED, Rung.NONE  # (bound once: see _dispatch.py)
RUNG_ORDER: Final = {Rung.NONE: 0, Rung.CANCEL: 1, Rung.SIGTERM: 2, Rung.SIGKILL: 3}


class Settlement:
    """Results and settlement: the one place a call gets its result (``settle``)."""

    def __init__(self, state: State) -> None:
        self.s = state
        # The last ledger read held a result in turn that was not valid (a tool wrote over
        # it): its marks are not read as withdrawals (``settle_calls_of_dead``).
        self.ledger_spoilt = False

    def settle(
        self,
        call: CallRecord,
        outcome: Outcome,
        *,
        value: Any = None,
        error: str | None = None,
        error_name: str | None = None,
        body_started: bool | None,
        context: Mapping[str, Any] | None = None,
        exit_status: int | None = None,
        leftovers_killed: int = 0,
        cpu_time: float | None = None,
        max_rss: int | None = None,
        output: str | None = None,
        output_dropped: int = 0,
        tree_max_memory: int | None = None,
        tree_verified: bool | None = None,
    ) -> None:
        """Settle ``call`` with this result, once (later attempts change nothing). Its
        :class:`Result` is built when someone first reads it (``CallRecord._result``)."""
        if call._facts is not None:
            return
        w = call._worker
        exit_code = exit_signal = None
        if exit_status is not None:
            if exit_status < 0:
                exit_signal = -exit_status
            else:
                exit_code = exit_status
        call._facts = (  # (FACT_FIELDS)
            outcome,
            value,
            error,
            error_name,
            body_started,
            call._cause,
            call._rung,
            w.pid if w is not None else None,
            exit_code,
            exit_signal,
            MappingProxyType(dict(context)) if context else NO_CONTEXT,
            leftovers_killed,
            cpu_time,
            max_rss,
            tree_max_memory,
            output,
            output_dropped,
            tree_verified,
            call._times,
            call._index,
        )
        self._settled(call, outcome._value_, body_started)

    def settle_facts(
        self,
        call: CallRecord,
        facts: tuple[Any, ...],
        kind: str,
        body_started: bool,
        leftovers_killed: int = 0,
    ) -> None:
        """Settle ``call`` with the facts of its worker's result (:meth:`result_facts`),
        later (its leftovers killed since, ``leftovers_killed``, or found in its ledger):
        with its cancel's cause and rung as they are now."""
        if call._facts is not None:
            return
        call._facts = (  # (FACT_FIELDS)
            *facts[:5],
            call._cause,
            call._rung,
            *facts[7:11],
            leftovers_killed,
            *facts[12:],
        )
        self._settled(call, kind, body_started)

    def _settled(self, call: CallRecord, kind: str, body_started: bool | None) -> None:
        """call just got its facts: the bookkeeping of its settlement."""
        s = self.s
        now = s.now
        times = call._times  # (the facts hold it: its Timeline is what it says now)
        times["settled"] = now
        call._times = times.copy()  # (a stamp written after, by a ladder, changes no Result)
        w = call._worker
        if call._queued:
            self._forget_queued(call)
        # (call.advance, inline: a call not settled may always settle; its facts were
        # None, so it was not.)
        call._state = _SETTLED
        owner = call._owner
        tally = owner.tally if owner is not None else s.tallies[""]
        counts = tally.by_tool.get(call.tool)
        if counts is None:
            counts = tally.by_tool[call.tool] = {}
        counts[kind] = counts.get(kind, 0) + 1  # (and so ``settled``, by outcome)
        latency = now - times["submitted"]  # (Buckets.observe, inline: the hot path)
        buckets = tally.settle_latency
        buckets.counts[bisect_left(buckets.bounds, latency)] += 1
        buckets.sum += latency
        if call._rung is not _NO_RUNG:
            tally.escalations[call._rung.value] += 1
        del s.calls[call.id]
        if call._group is not None:
            call._group._calls.discard(call)
        if w is not None and w.calls and (w.calls[0] is call or call in w.calls):
            if body_started is not False:
                w.served += 1  # (ProviderSpec.max_calls)
            if w.calls[0] is call:
                w.calls.popleft()
                w.head_since = now
            else:
                w.calls.remove(call)
            if w.acks_expected:  # an ack may still be on its way for this call, no older one
                w.acks_expected &= {call.id, *(c.id for c in w.calls)}
        # Its action, ``Settled``: the record itself (an object made and freed per call, even
        # a named tuple's, cost 2,200 instructions of a no-op call's 107,000).
        s.out.append(call)

    def _forget_queued(self, call: CallRecord) -> None:
        """A call settled while in its provider's queue: drop it there, at once where it is
        at an end of the queue (a lone cancel, a timeout), else once such calls make up half
        of it (a group's or the close's cancel settles many: one pass for all of them)."""
        call._queued = False
        p = call._provider
        if p is None:
            return
        queue = p.queue
        if queue and queue[0] is call:
            queue.popleft()
        elif queue and queue[-1] is call:
            queue.pop()
        else:
            p.settled_in_queue += 1
        self.compact_queue(p)

    def compact_queue(self, p: ProviderRecord) -> None:
        """Drop the settled calls from p's queue once they are half of it."""
        queue = p.queue
        if p.settled_in_queue and p.settled_in_queue * 2 >= len(queue):
            live = [c for c in queue if c._queued]
            queue.clear()
            queue.extend(live)
            p.settled_in_queue = 0

    def record_cause(self, call: CallRecord, cause: CancelCause) -> None:
        """The first cause wins; ``disposed`` takes priority over a user or parent cancel
        in classification (C5.3)."""
        if call._cause is None:
            call._cause = cause
            call._times["cancel_requested"] = self.s.now
        elif cause.kind == "disposed" and call._cause.kind in ("user", "parent"):
            call._cause = cause

    def abort_queued(self, call: CallRecord, cause: CancelCause) -> None:
        """A call no worker has is cancelled: it settles at once, never started (C4.4)."""
        self.record_cause(call, cause)
        self.settle_unstarted(call, call._cause or cause)

    def settle_unstarted(self, call: CallRecord, cause: CancelCause) -> None:
        if cause.kind == "timeout":
            self.settle(
                call,
                Outcome.TIMEOUT,
                error=TIMEOUT_TEXT,
                error_name="TimeoutError",
                body_started=False,
            )
        else:
            self.settle(
                call,
                Outcome.ABORTED_BEFORE_DISPATCH,
                error=ABORTED_BEFORE_DISPATCH_TEXT,
                error_name=ABORT_ERROR_NAME,
                body_started=False,
            )

    def fail_queue(self, p: ProviderRecord) -> None:
        """p is broken: every call queued for it settles as lost, never started."""
        queue = p.queue
        while queue:
            call = queue[0]
            if call._facts is not None:
                queue.popleft()
                continue
            self.settle(  # (drops it from the queue)
                call,
                Outcome.WORKER_LOST,
                error=f"{WORKER_LOST_TEXT}: {p.broken or self.s.broken}",
                error_name="WorkerStartError",
                body_started=False,
            )
        p.settled_in_queue = 0

    def fail_queues(self) -> None:
        """The pool is broken: every queued call settles as lost."""
        for p in list(self.s.providers.values()):
            self.fail_queue(p)

    def raise_rung(self, call: CallRecord, rung: Rung) -> None:
        if RUNG_ORDER[rung] > RUNG_ORDER[call._rung]:
            call._rung = rung

    def received(self, w: WorkerRecord, msg: ResultMessage) -> functools.partial[None]:
        """w's next result arrived (or was found in its ledger): check it is for the call w
        runs, and return what settles that call."""
        calls = w.calls
        call = calls[0] if calls else None  # (w.call, inline)
        if call is None or call.id != msg.call_id:
            raise ProtocolViolation(f"result for call {msg.call_id}, which it does not own")
        facts = self.result_facts(w, call, msg)
        return functools.partial(self.settle_facts, call, facts, msg.outcome, msg.body_started)

    def result_facts(
        self, w: WorkerRecord, call: CallRecord, msg: ResultMessage
    ) -> tuple[Any, ...]:
        """The facts (``FACT_FIELDS``) w's result ``msg`` for its first call ``call`` says,
        its value unpacked; stamps the call's ``returned`` (and ``started``, from the
        worker's clock, where this side saw nothing say otherwise)."""
        w.results += 1
        s = self.s
        value = msg.value
        extras = msg.extras
        if value is not None:
            spill = extras.get("spill")
            if spill is not None:
                # Its value's parts lie in its ledger's spill (checked by the decoder: at most
                # max_frame bytes in all; the probe checks they are within the file).
                parts = s.probe.spill(w.wid, spill[0], spill[1])
                if parts is None:
                    raise ProtocolViolation("its result names parts beyond its spill")
                value = unpack_value(value, s.config.max_frame, parts)
            else:
                # (b"\xc0" is msgpack's nil: a body that returned None, no unpack needed)
                value = None if value == b"\xc0" else unpack_value(value, s.config.max_frame)
        times = call._times
        now = times["returned"] = s.now
        body_started = msg.body_started
        if body_started:
            call._started = True
            started_at = extras.get("started_at")
            if started_at is not None and "started" not in times:
                # The worker's monotonic clock is this one (same host); trust it only within
                # what this side saw. (min(max(...)), as comparisons: builtin min and max
                # parse their arguments as keywords, 500 instructions a result; and a NaN
                # lands on ``dispatched``, not in the Timeline.)
                dispatched = times["dispatched"]
                started_at = started_at if started_at > dispatched else dispatched
                times["started"] = started_at if started_at < now else now
        probe = s.probe
        output = extras.get("output")
        context = msg.context
        return (  # (FACT_FIELDS)
            OUTCOME_OF[msg.outcome],
            value,
            msg.error,
            msg.error_name,
            body_started,
            call._cause,
            call._rung,
            w.pid,
            None,
            None,
            MappingProxyType(context) if context else NO_CONTEXT,
            0,
            extras.get("cpu_time"),
            extras.get("max_rss"),
            probe.peak(w.wid) if probe.cgroups else None,
            None if output is None else output.decode("utf-8", "replace"),
            extras.get("output_dropped", 0),
            None,
            times,
            call._index,
        )

    # ------------------------------------------------------------------ post-mortem

    def settle_calls_of_dead(self, w: WorkerRecord) -> list[CallRecord]:
        """Settle the calls w held when it died (its kept results are settled first); return
        those never taken up, to run elsewhere (in order).

        Only its first call can have been taken up: w takes a call only once the result of
        the one before is in the supervisor's hands or in its ledger, or withdrawn. The calls
        behind it run elsewhere (or, cancelled, settle as never started). The ledger's marks
        say which call was taken up last (before it, only calls w was asked to give back
        and may have withdrawn) and whether
        the first one was taken up and its body invoked; they are the worker's own word,
        believed only where they are consistent with what this side saw, and never to run a
        call again more than once.
        """
        self.ledger_spoilt = False
        ledger = self.read_ledger(w)
        calls = list(w.calls)
        w.calls.clear()
        if not calls:
            return []
        named = 0
        if ledger is not None:
            named = next((i for i, c in enumerate(calls[1:], 1) if ledger[0] == c.id + 1), 0)
        withdrawn: list[CallRecord] = []
        if (
            named
            and not w.violated
            and not self.ledger_spoilt
            and all(self._may_have_withdrawn(w, c) for c in calls[:named])
        ):
            # Took up a call behind others with no result of theirs, each of which it was
            # asked to give back: it withdrew them, and its 'withdrawn' was lost with it (a
            # process that dies drops what its zmq thread had not sent yet). The call named
            # is the one taken up; whether its body began, only its 'started' says (the
            # marks may be a call's before it, written by its tool).
            withdrawn, calls, named = calls[:named], calls[named:], 0
        head = calls[0]
        taken: bool
        started: bool | None = None
        maybe: list[CallRecord] = []  # behind the first, and may have run too
        if head._started:
            taken, started = True, True
        elif ledger is None or "sigterm" in head._times:
            # No ledger; or w did not answer a cancel of its first call within the grace
            # period, which an idle worker always does (it withdraws a call not taken up).
            taken = True
        elif ledger[0] == head.id + 1:
            taken, started = True, None if withdrawn else ledger[1] == head.id + 1
        elif named:
            taken = True
        else:
            # Not taken up, by the marks. But if it was already put back once this way, the
            # marks are suspect: it is not run a third time (a cancelled one settles below).
            taken = head._requeued and head._cause is None
        if taken and named:
            # Names a call behind the first, which w takes up only once the result before
            # it is here or in its ledger; none arrived, or its ledger's are not believed (a
            # violator's). Either the marks lie or this side did not see what was there:
            # every call up to the one named may have run. None is run again, and none is
            # said not to have started.
            maybe = calls[1 : named + 1]
        requeue: list[CallRecord] = []
        for call in withdrawn:
            if call._cause is None:  # recalled: it runs elsewhere, on the worker's word
                if call._requeued:  # put back once on such a word already: not again
                    self._settle_dead(w, call, None)
                call._requeued = True
        for call in [*withdrawn, *(calls[1 + len(maybe) :] if taken else calls)]:
            if call._facts is not None:
                continue  # (settled just above)
            call._worker = None
            if call._cause is not None:  # never taken up, and cancelled meanwhile
                call._rung = Rung.CANCEL
                call._times.pop("sigterm", None)
                call._times.pop("sigkill", None)
                self.settle_unstarted(call, call._cause)
            else:
                requeue.append(call)
        if taken:
            for step, rung in (("sigterm", Rung.SIGTERM), ("sigkill", Rung.SIGKILL)):
                if step in w.signals:  # it died of them, whichever call they were sent for
                    self.raise_rung(head, rung)
                    head._times.setdefault(step, w.signals[step])
            self._settle_dead(w, head, started)
            for call in maybe:
                self._settle_dead(w, call, None)
        if requeue and requeue[0] is head:
            head._requeued = True
        return requeue

    @staticmethod
    def _may_have_withdrawn(w: WorkerRecord, call: CallRecord) -> bool:
        """w was asked to give call back (a cancel, a recall, a shutdown) and did not say
        its body started: it may have withdrawn it (as ``on_withdrawn`` accepts); unless it
        left a cancel of it unanswered for the whole grace period, which a worker that
        withdraws a call does at once."""
        return (
            not call._started
            and (call._recalling or call.id in w.acks_expected)
            and "sigterm" not in call._times
        )

    def _settle_dead(self, w: WorkerRecord, call: CallRecord, started: bool | None) -> None:
        """call was (or may have been) taken up by w, whose tree is gone."""
        call._times["reaped"] = self.s.now
        if w.escalated and w.violation is None:
            self.settle(
                call,
                Outcome.KILLED,
                error=KILLED_TEXT,
                error_name="Killed",
                body_started=started,
                exit_status=w.exit_status,
                tree_verified=w.verified,
            )
            return
        reason = (
            w.violation
            or w.lost_reason
            or describe_exit(w.exit_status, w.disconnected, w.oom_kills, w.provider.spec.memory_cap)
        )
        if not w.verified:
            reason += "; its tree could not be verified gone (no cgroup holds it)"
        self.settle(
            call,
            Outcome.WORKER_LOST,
            error=f"{WORKER_LOST_TEXT}: {reason}",
            error_name="WorkerLost",
            body_started=started,
            exit_status=w.exit_status,
            tree_verified=w.verified,
        )

    def read_ledger(self, w: WorkerRecord) -> tuple[int, int] | None:
        """Read w's ledger once it is gone: settle the calls whose results it kept there but
        that never arrived (sent just before it died, or not sent); return its marks."""
        found = self.s.probe.ledger(w.wid)
        if found is None:
            return None
        marks, kept = found
        if w.violated:
            # Its messages stopped counting at the violation (C7: its call is lost), and so
            # do the results it kept: a violator could forge one there, as its last word.
            kept = []
        for seq, frame in kept:
            if seq != w.results + 1 or not w.calls:
                continue  # received already (or out of turn: not what it sent)
            try:
                msg = decode_from_worker(frame, max_len=self.s.config.max_frame)
                if not isinstance(msg, ResultMessage):
                    raise ProtocolViolation(f"a {type(msg).__name__} in its ledger")
                settle = self.received(w, msg)
            except ProtocolViolation as exc:
                _log.warning("worker %s: its ledger holds no valid result: %s", w.wid, exc)
                self.ledger_spoilt = True
                break
            settle()
        return marks


def describe_exit(
    status: int | None, disconnected: bool = False, oom_kills: int = 0, cap: int | None = None
) -> str:
    """Why a worker ended, in words (for a ``worker_lost`` result)."""
    if oom_kills and status == -signal.SIGKILL:
        limit = f" of {_human_size(cap)}" if cap is not None else ""
        return (
            f"the worker was killed by SIGKILL: out of memory (its tree reached the memory "
            f"cap{limit}; {oom_kills} OOM kill(s) in its cgroup)"
        )
    if disconnected and status == -signal.SIGKILL:
        return "its connection dropped (an oversized frame?) and it was killed"
    if status is None:
        return "the worker died"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"the worker was killed by {name}"
    return f"the worker exited with status {status}"
