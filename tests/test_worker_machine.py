"""The worker's decisions, sans I/O (``worker/_machine.py``): its transition table, and what
it does with each message and each call, events in and actions out, no socket, no clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from toolpool.protocol import (
    PROGRESS_INTERVAL,
    Ack,
    CallMessage,
    Cancel,
    CancelAck,
    Heartbeat,
    Ping,
    Pong,
    ProgressMessage,
    Recall,
    ResultMessage,
    Resume,
    Shutdown,
    StartedMessage,
    Withdrawn,
    decode_from_worker,
    encode,
    pack_parts,
    pack_value,
)
from toolpool.protocol._ledger import SLOT_PAYLOAD, SLOTS
from toolpool.worker._machine import (
    HOLD_BACK,
    PHASE_MOVES,
    FireCancel,
    IllegalPhaseMove,
    KeepResult,
    MarkInvoked,
    Phase,
    RunCall,
    SendFrames,
    SpillParts,
    WorkerMachine,
)

pytestmark = pytest.mark.timeout(10)


def _call(call_id: int, acked: int = 0) -> CallMessage:
    return CallMessage(call_id, "t", b"\x80", acked)


def _reply(call_id: int, *, value: Any = 1, leftovers: int = 0) -> ResultMessage:
    return ResultMessage(call_id, "ok", pack_value(value), None, None, True, {}, leftovers, {})


def _sent(actions: Sequence[Any]) -> list[Any]:
    """The messages the actions send, decoded, in order."""
    return [decode_from_worker(f) for a in actions if isinstance(a, SendFrames) for f in a.frames]


def _phase(m: WorkerMachine) -> Phase:
    return m.phase  # (read afresh: an event moves it)


def _take(m: WorkerMachine, call_id: int) -> None:
    (run,) = m.next()
    assert isinstance(run, RunCall), run
    assert run.msg.call_id == call_id, run
    m.check()


def test_the_table_says_every_move_and_advance_refuses_the_others() -> None:
    assert set(PHASE_MOVES) == set(Phase)
    assert PHASE_MOVES[Phase.IDLE] == {Phase.RUNNING}
    assert PHASE_MOVES[Phase.RUNNING] == {Phase.IDLE, Phase.HELD}
    assert PHASE_MOVES[Phase.HELD] == {Phase.IDLE}
    for old in Phase:
        for new in Phase:
            m = WorkerMachine(max_frame=1 << 20, ledger=True)
            m.phase = old
            if new is old or new in PHASE_MOVES[old]:
                m.advance(new)
                assert _phase(m) is new
            else:
                with pytest.raises(IllegalPhaseMove, match="not a legal move"):
                    m.advance(new)
                assert _phase(m) is old


def test_calls_are_taken_up_in_order_one_at_a_time_ledger_marked_first() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    assert not m.next()  # nothing queued
    for i in (1, 2):
        assert not m.receive(_call(i))
    assert m.next() == (RunCall(_call(1), True),)  # marked taken up in the ledger, then run
    assert _phase(m) is Phase.RUNNING
    assert m.current == 1
    m.check()
    assert not m.next()  # one at a time
    assert m.invoked(1, False) == [MarkInvoked(1)]
    out = m.conclude(_reply(1))
    # Kept in a slot, and held back: call 2 waits behind it and may be quick.
    assert [type(a) for a in out] == [KeepResult]
    assert m.pending
    assert _phase(m) is Phase.IDLE
    m.check()
    assert m.next() == (RunCall(_call(2), True),)
    out = m.conclude(_reply(2))
    # Nothing queued behind: what was held back goes first, then this one.
    results = [msg.call_id for msg in _sent(out)]
    assert results == [1, 2]
    assert [len(a.frames) for a in out if isinstance(a, SendFrames)] == [1, 1]
    m.check()


def test_no_ledger_no_marks_and_every_result_waits_for_its_ack() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=False)
    m.receive(_call(1))
    m.receive(_call(2))
    assert m.next() == (RunCall(_call(1), False),)  # no mark
    assert not m.invoked(1, False)
    out = m.conclude(_reply(1))
    (result,) = _sent(out)
    assert result.extras["kept"] is False
    assert m.need_ack == 1
    assert m.next() == ()  # not until the supervisor said it has result 1
    m.receive(Ack(1))
    _take(m, 2)


def test_a_result_too_large_for_a_slot_is_sent_at_once_and_waits_for_its_ack() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    for i in (1, 2):
        m.receive(_call(i))
    _take(m, 1)
    out = m.conclude(_reply(1, value="x" * SLOT_PAYLOAD))
    assert not any(isinstance(a, KeepResult) for a in out)
    (result,) = _sent(out)
    assert result.extras["kept"] is False
    assert m.next() == ()
    m.receive(_call(3, acked=1))  # an ack may come with a call
    _take(m, 2)


def test_a_slot_is_reused_only_once_its_result_was_acked() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    slots: list[int] = []
    for i in range(1, SLOTS + 2):
        m.receive(_call(i, acked=0))
        _take(m, i)
        out = m.conclude(_reply(i))
        slots.extend(a.slot for a in out if isinstance(a, KeepResult))
    # SLOTS results kept, one in each slot; the next one found none free: not kept.
    assert sorted(slots) == list(range(SLOTS))
    assert m.need_ack == SLOTS + 1
    m.receive(Ack(SLOTS + 1))
    m.receive(_call(SLOTS + 2))
    _take(m, SLOTS + 2)
    out = m.conclude(_reply(SLOTS + 2))
    assert [a.slot for a in out if isinstance(a, KeepResult)] == [0]
    m.check()


def test_at_most_hold_back_results_are_held_back() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    for i in range(1, HOLD_BACK + 3):
        m.receive(_call(i))
    sent: list[Any] = []
    for i in range(1, HOLD_BACK + 2):
        _take(m, i)
        sent += _sent(m.conclude(_reply(i)))
    # HOLD_BACK held back; the next one sends them, then itself.
    assert [r.call_id for r in sent] == list(range(1, HOLD_BACK + 2))


def test_leftovers_hold_the_worker_until_resume() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    m.receive(_call(1))
    m.receive(_call(2))
    _take(m, 1)
    out = m.conclude(_reply(1, leftovers=2))
    assert _phase(m) is Phase.HELD
    assert [r.call_id for r in _sent(out)] == [1]  # never held back while held
    assert m.next() == ()
    m.receive(Resume())
    assert _phase(m) is Phase.IDLE
    _take(m, 2)
    m.receive(Resume())  # a stray one: no move
    assert _phase(m) is Phase.RUNNING


def test_background_allowed_never_holds() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True, allow_background=True)
    m.receive(_call(1))
    _take(m, 1)
    m.conclude(_reply(1, leftovers=1))
    assert _phase(m) is Phase.IDLE


def test_cancel_fires_the_running_call_or_withdraws_a_queued_one() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    for i in (1, 2, 3):
        m.receive(_call(i))
    _take(m, 1)
    out = m.receive(Cancel(1, "user"))
    assert _sent(out) == [CancelAck(1)]
    assert out[-1] == FireCancel(1, "user")
    assert _sent(m.receive(Cancel(2, "user"))) == [Withdrawn(2)]
    assert _sent(m.receive(Recall(3))) == [Withdrawn(3)]
    assert not m.receive(Recall(3))  # not queued (any more): nothing to say
    assert not m.queue
    m.check()


def test_shutdown_withdraws_every_queued_call_and_is_done_once_none_runs() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    for i in (1, 2, 3):
        m.receive(_call(i))
    _take(m, 1)
    out = m.receive(Shutdown())
    assert _sent(out) == [Withdrawn(2), Withdrawn(3)]
    assert not m.done  # call 1 still runs
    assert m.next() == ()
    m.conclude(_reply(1))
    assert m.done


def test_a_message_sent_goes_after_the_results_held_back() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    m.receive(_call(1))
    m.receive(_call(2))
    _take(m, 1)
    m.conclude(_reply(1))
    assert m.pending
    out = m.receive(Ping(7))
    assert [type(x) for x in _sent(out)] == [ResultMessage, Pong]
    assert not m.pending


def test_started_async_at_once_sync_once_it_runs_and_said_once() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    m.receive(_call(1))
    m.receive(_call(2))
    _take(m, 1)
    out = m.invoked(1, True)
    assert out[0] == MarkInvoked(1)
    assert _sent(out) == [StartedMessage(1)]
    assert m.body_running(1) == ()  # said already
    m.conclude(_reply(1))
    _take(m, 2)
    m.invoked(2, False)
    # What was held back goes before 'started'.
    assert [type(x) for x in _sent(m.body_running(2))] == [ResultMessage, StartedMessage]
    assert m.body_running(2) == ()


def test_heartbeats_every_interval() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True, heartbeat=1.0)
    assert _sent(m.beat(10.0)) == [Heartbeat()]
    assert m.beat(10.5) == ()
    assert m.beat_wait(10.5) == 500
    assert _sent(m.beat(11.0)) == [Heartbeat()]
    silent = WorkerMachine(max_frame=1 << 20, ledger=True)
    assert silent.beat(1e9) == ()
    assert silent.beat_wait(0.0) is None


def test_progress_latest_only_at_most_every_interval_and_dropped_with_the_result() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    m.receive(_call(1))
    _take(m, 1)
    assert m.report_progress("1", 1.0, None, None) is True
    assert m.report_progress("1", 2.0, 4.0, "half") is False  # one already waits
    out, wait = m.send_progress(5.0, 1)
    assert _sent(out) == [ProgressMessage(1, 2.0, 4.0, "half")]
    assert wait is None
    m.report_progress("1", 3.0, 4.0, None)
    out, wait = m.send_progress(5.0 + PROGRESS_INTERVAL / 2, 1)
    assert not out
    assert wait is not None
    assert wait > 0
    m.conclude(_reply(1))
    assert m.send_progress(100.0, 1) == ((), None)  # the result says the rest


def test_a_result_too_large_for_max_frame_is_cut_down_and_said() -> None:
    m = WorkerMachine(max_frame=4096, ledger=True)
    m.receive(_call(1))
    _take(m, 1)
    (result,) = _sent(m.conclude(_reply(1, value="x" * 10_000)))
    assert result.outcome == "error"
    assert result.error_name == "ResultTooLarge"
    assert len(encode(result)) <= 4096


def test_concluding_a_call_not_taken_up_is_refused() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    with pytest.raises(IllegalPhaseMove):
        m.conclude(_reply(1))


def test_check_catches_a_broken_invariant() -> None:
    m = WorkerMachine(max_frame=1 << 20, ledger=True)
    m.check()
    m.phase = Phase.RUNNING  # running, with no call taken up
    with pytest.raises(AssertionError):
        m.check()
    m = WorkerMachine(max_frame=1 << 20, ledger=False)
    m.pending.append(b"x")  # held back with no ledger to keep it in
    with pytest.raises(AssertionError):
        m.check()


# --------------------------------------------------------------------------- the spill


def _parts_reply(call_id: int, *sizes: int) -> tuple[ResultMessage, list[bytes]]:
    """A result whose value is a list of byte strings of ``sizes``, taken out as parts."""
    packed, parts = pack_parts([bytes([call_id % 256]) * n for n in sizes])
    assert len(parts) == len(sizes)
    return ResultMessage(call_id, "ok", packed, None, None, True, {}, 0, {}), parts


def test_a_large_result_goes_to_the_spill_and_is_kept_no_ack_waited_for() -> None:
    """Issue 26 step 3: its bytes in the spill, its small frame in a slot (kept), so the
    worker takes up its next call at once; the frame says where the parts lie."""
    m = WorkerMachine(max_frame=8 << 20, ledger=True, spill=16 << 20)
    for i in (1, 2):
        m.receive(_call(i))
    _take(m, 1)
    reply, parts = _parts_reply(1, 1 << 20, 20_000)
    out = m.conclude(reply, parts)
    m.check()
    assert [type(a) for a in out] == [SpillParts, KeepResult]  # the parts first; held back
    spill, keep = out
    assert isinstance(spill, SpillParts)
    assert isinstance(keep, KeepResult)
    assert spill.at == 0
    assert spill.parts == tuple(parts)
    kept = decode_from_worker(keep.frame)
    assert isinstance(kept, ResultMessage)
    assert kept.extras["kept"] is True
    assert kept.extras["spill"] == [0, [1 << 20, 20_000]]
    assert len(keep.frame) <= SLOT_PAYLOAD
    assert m.need_ack == 0
    _take(m, 2)  # no Ack waited for
    reply, parts = _parts_reply(2, 3 << 20)
    out = m.conclude(reply, parts)
    spill2 = out[0]
    assert isinstance(spill2, SpillParts)
    assert [msg.call_id for msg in _sent(out)] == [1, 2]  # what was held back first
    assert spill2.at == (1 << 20) + 20_000  # after the unacknowledged first
    m.check()


def test_the_spill_is_a_ring_reused_once_acked_and_a_full_one_sends_inline() -> None:
    m = WorkerMachine(max_frame=8 << 20, ledger=True, spill=10 << 20)
    regions = []
    for call_id, size in ((1, 4 << 20), (2, 4 << 20), (3, 4 << 20)):
        m.receive(_call(call_id))
        _take(m, call_id)
        reply, parts = _parts_reply(call_id, size)
        out = m.conclude(reply, parts)
        m.check()
        regions.append(out)
    # Two fit (0 and 4 MiB); the third finds no room while neither is acked: inline, not
    # kept, and the worker waits for its Ack as it would without a spill.
    assert [type(a) for a in regions[0]] == [SpillParts, KeepResult, SendFrames]
    assert [a.at for a in regions[1] if isinstance(a, SpillParts)] == [4 << 20]
    assert [type(a) for a in regions[2]] == [SendFrames]
    (third,) = _sent(regions[2])
    assert third.extras["kept"] is False
    assert "spill" not in third.extras
    assert third.value == pack_value([bytes([3]) * (4 << 20)])
    assert m.need_ack == 3
    # Acked: the ring starts over at 0 (the tail had no room).
    m.receive(_call(4, acked=3))
    _take(m, 4)
    reply, parts = _parts_reply(4, 6 << 20)
    out = m.conclude(reply, parts)
    assert [a.at for a in out if isinstance(a, SpillParts)] == [0]
    m.receive(_call(5, acked=3))
    _take(m, 5)
    reply, parts = _parts_reply(5, 3 << 20)  # after 4's region: 6 to 9 MiB
    out = m.conclude(reply, parts)
    assert [a.at for a in out if isinstance(a, SpillParts)] == [6 << 20]
    m.receive(_call(6, acked=4))  # 4 acked, 5 not: room before 5, wrapped
    _take(m, 6)
    reply, parts = _parts_reply(6, 5 << 20)
    out = m.conclude(reply, parts)
    assert [a.at for a in out if isinstance(a, SpillParts)] == [0]
    m.check()
    m.receive(_call(7, acked=4))
    _take(m, 7)
    reply, parts = _parts_reply(7, 2 << 20)  # wrapped: only 5 to 6 MiB is free
    out = m.conclude(reply, parts)
    assert not [a for a in out if isinstance(a, SpillParts)]
    m.check()


def test_without_a_ledger_parts_go_inline() -> None:
    m = WorkerMachine(max_frame=8 << 20, ledger=False, spill=16 << 20)
    m.receive(_call(1))
    _take(m, 1)
    reply, parts = _parts_reply(1, 1 << 20)
    (result,) = _sent(m.conclude(reply, parts))
    assert result.value == pack_value([bytes([1]) * (1 << 20)])
    assert m.need_ack == 1


def test_a_result_and_its_parts_over_max_frame_are_cut_as_one_frame_would_be() -> None:
    """The limit is the frame's and its parts' together, as when the parts were inside it:
    the captured output goes first (the value then inline, not spilled)."""
    m = WorkerMachine(max_frame=64 * 1024, ledger=True, spill=128 * 1024)
    m.receive(_call(1))
    _take(m, 1)
    packed, parts = pack_parts(bytes(32 * 1024))
    extras = {"output": b"o" * 40_000, "output_dropped": 0}
    reply = ResultMessage(1, "ok", packed, None, None, True, {}, 0, extras)
    out = m.conclude(reply, parts)
    m.check()
    (result,) = _sent(out)
    assert not [a for a in out if isinstance(a, SpillParts)]
    assert "output" not in result.extras
    assert result.extras["output_dropped"] == 40_000
    assert result.value == pack_value(bytes(32 * 1024))
    assert "spill" not in result.extras
