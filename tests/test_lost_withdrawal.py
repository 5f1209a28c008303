"""A worker's 'withdrawn' lost with it (white box, on the pool's core).

A worker withdraws a queued call it is asked to give back (a cancel, a recall) and may take
up the next one at once; if that one kills it, its 'withdrawn' can die unsent in its zmq
thread. Its ledger then names a call behind the withdrawn one, with no result of the one
before it: the core must read that as the withdrawal it is, not as 'every call up to the one
named may have run' (C4.6: a lost worker loses no other call). Found by
``test_soak_mixed_calls``: a cancelled echo queued before a crash settled worker_lost.
"""

from __future__ import annotations

from typing import Any

import pytest

from core_support import core_with_workers, sent
from toolpool.core import CancelCause, Outcome
from toolpool.protocol import CallMessage, ResultMessage, decode_from_supervisor, pack_value
from toolpool.supervisor.machine import CallRecord

NOW = 100.0


def result_of(call: CallRecord) -> ResultMessage:
    """An ok result kept in the ledger, as the worker sends one."""
    return ResultMessage(
        call.id, "ok", pack_value(call.id), None, None, True, {}, 0, {"kept": True}
    )


def calls_sent(frames: list[bytes]) -> list[int]:
    msgs = [decode_from_supervisor(f) for f in frames]
    return [m.call_id for m in msgs if isinstance(m, CallMessage)]


def submitted(core: Any, now: float, *ids: int) -> list[CallRecord]:
    """Calls of the tool ``noop`` submitted and flushed (sent where they go)."""
    calls = [CallRecord(i, "noop", b"\x80", None, now) for i in ids]
    for call in calls:
        core.submit(call, timeout=None, now=now)
    core.flush(now)
    return calls


def dies(core: Any, wid: int, now: float) -> list[Any]:
    """Worker ``wid`` exits (status 5) and its tree is gone: its post-mortem runs."""
    core.exited(wid, 5, 0, now)
    core.gone(wid, now)
    return core.flush(now)


@pytest.mark.timeout(30)
def test_a_cancelled_call_withdrawn_before_a_crash_settles_as_never_started() -> None:
    core, (w,), probe = core_with_workers(1)
    a, b, c = submitted(core, NOW, 1, 2, 3)
    assert list(w.calls) == [a, b, c]
    core.cancel(b, CancelCause("user"), force=False, now=NOW)
    core.flush(NOW)
    core.message(w.wid, result_of(a), NOW)
    core.flush(NOW)
    assert a._result is not None
    assert a._result.ok
    # The worker withdrew b, took up c, invoked it and died of it: its 'withdrawn' never
    # came. Its ledger names c.
    probe.marks_of[w.wid] = (c.id + 1, c.id + 1)
    dies(core, w.wid, NOW + 1)
    assert b._result is not None
    assert c._result is not None
    assert b._result.outcome is Outcome.ABORTED_BEFORE_DISPATCH, b._result
    assert b._result.body_started is False
    assert b._result.timeline.cancel_delivered is None  # (never acknowledged: not said)
    assert c._result.outcome is Outcome.WORKER_LOST, c._result
    # Its 'invoked' mark may be a tool's of a call before it: only its 'started' says.
    assert c._result.body_started is None


@pytest.mark.timeout(30)
def test_a_recalled_call_withdrawn_before_a_crash_runs_elsewhere_and_not_a_third_time() -> None:
    core, (w1, w2), probe = core_with_workers(2, ready=False)
    w1.provider.ready.append(w1)
    a, b, c = submitted(core, NOW, 1, 2, 3)
    w2.provider.ready.append(w2)
    (e,) = submitted(core, NOW, 5)
    assert list(w1.calls) == [a, b, c]
    assert list(w2.calls) == [e]
    assert core.dispatch.recall(w1, b)
    core.flush(NOW)
    core.message(w1.wid, result_of(a), NOW)
    core.flush(NOW)
    probe.marks_of[w1.wid] = (c.id + 1, c.id + 1)
    out = dies(core, w1.wid, NOW + 1)
    assert c._result is not None
    assert c._result.outcome is Outcome.WORKER_LOST
    assert b._result is None  # not settled: it runs elsewhere
    assert list(w1.provider.queue) == [b]  # at the front of the queue, w2 being busy
    # On w2 the same again: asked back, a call behind it named by a ledger with no word
    # of it. Put back once on a worker's word already, it is not run a third time.
    d = CallRecord(4, "noop", b"\x80", None, NOW + 1)
    core.submit(d, timeout=None, now=NOW + 1)
    core.message(w2.wid, result_of(e), NOW + 1)
    out = core.flush(NOW + 1)
    assert calls_sent(sent(out, w2.wid)) == [b.id, d.id]
    assert list(w2.calls) == [b, d]
    assert core.dispatch.recall(w2, b)
    core.flush(NOW + 1)
    probe.marks_of[w2.wid] = (d.id + 1, d.id + 1)
    dies(core, w2.wid, NOW + 2)
    assert d._result is not None
    assert d._result.outcome is Outcome.WORKER_LOST
    assert b._result is not None
    assert b._result.outcome is Outcome.WORKER_LOST
    assert b._result.body_started is None


@pytest.mark.timeout(30)
def test_marks_written_by_a_tool_never_report_a_call_behind_it_as_begun() -> None:
    """The first call's body keeps the GIL (no 'started', no cancel ack); cancelled, it
    recalls the calls behind; its tool writes 'taken' and 'invoked' naming the last and dies
    within the grace. Read as withdrawals, the call named becomes the first: but its body is
    not said to have begun on marks a tool could have written (a hostile review's case)."""
    core, (w,), probe = core_with_workers(1)
    a, _b, c = submitted(core, NOW, 1, 2, 3)
    core.cancel(a, CancelCause("user"), force=False, now=NOW)
    core.flush(NOW)
    probe.marks_of[w.wid] = (c.id + 1, c.id + 1)
    dies(core, w.wid, NOW + 1)
    assert c._result is not None
    assert c._result.outcome is Outcome.WORKER_LOST
    assert c._result.body_started is None


@pytest.mark.timeout(30)
def test_a_result_in_turn_that_is_not_valid_is_no_withdrawal() -> None:
    """Every call was asked back (the worker told to shut down); the ledger holds a result
    numbered as the first call's, but not a valid one (a tool wrote over it), and names the
    second as taken up. The first was taken up, then: it is not read as withdrawn and run
    again (a hostile review's case); it settles lost, not said to have begun or not."""
    core, (w,), probe = core_with_workers(1)
    a, b, _c = submitted(core, NOW, 1, 2, 3)
    core.dispatch.retire(w)  # every call asked back
    core.flush(NOW)
    probe.marks_of[w.wid] = (b.id + 1, b.id + 1)
    probe.kept_of[w.wid] = [(1, b"\xff" * 40)]
    dies(core, w.wid, NOW + 1)
    assert a._result is not None
    assert a._result.outcome is Outcome.WORKER_LOST
    assert a._result.body_started is None
    assert a not in w.provider.queue
