"""Recalling calls waiting in a worker's queue (white box, on the pool's core).

The core is driven directly: each message a worker sends is an event, and what the core
sends back is read from the actions ``flush`` returns, so the order of messages is exactly
the test's.
"""

from __future__ import annotations

import pytest

import toolpool.supervisor.machine._dispatch as dispatch_module
from core_support import core_with_workers, sent
from toolpool.protocol import Recall, Withdrawn, decode_from_supervisor
from toolpool.supervisor.machine import CallRecord

#: Older than any QUEUE_BEHIND_FOR these tests set.
LONG_AGO = 10 * 3600.0


def recalled(frames: list[bytes]) -> list[int]:
    msgs = [decode_from_supervisor(f) for f in frames]
    return [m.call_id for m in msgs if isinstance(m, Recall)]


@pytest.mark.timeout(30)
def test_a_call_back_in_the_pools_queue_is_not_marked_as_being_recalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's answer to a recall puts its call back at the front of the pool's queue in
    the same pass that recalls more. That call must not stay marked as being recalled:
    marked, it went to the next worker as if a recall were on its way, and could never be
    recalled from behind a long call there (nor before a kill for it)."""
    monkeypatch.setattr(dispatch_module, "QUEUE_BEHIND_FOR", 3600.0)  # young unless made old
    core, (w1, w2), _ = core_with_workers(2, ready=False)
    now = 100.0
    w1.provider.ready.append(w1)
    head1, a, b = (CallRecord(i, "noop", b"\x80", None, now) for i in (1, 2, 3))
    for call in (head1, a, b):
        core.submit(call, timeout=None, now=now)
    out = core.flush(now)
    assert list(w1.calls) == [head1, a, b]
    w2.provider.ready.append(w2)
    head2 = CallRecord(4, "noop", b"\x80", None, now)
    core.submit(head2, timeout=None, now=now)
    out += core.flush(now)
    assert list(w2.calls) == [head2]
    # w1 was asked for a back (an idle worker's steal, say); its answer comes next.
    assert core.dispatch.recall(w1, a)
    out += core.flush(now)
    # w1's first call is now old: its answer puts a at the front of the pool's queue, then
    # behind w2's young first call; the same pass recalls b from behind w1's old call.
    w1.head_since = now - LONG_AGO
    core.message(w1.wid, Withdrawn(a.id), now)
    out += core.flush(now)
    assert list(w2.calls) == [head2, a]
    assert not a._recalling
    assert recalled(sent(out, w1.wid)) == [a.id, b.id]
    # Now w2's first call is old too: a is taken back from behind it.
    w2.head_since = now - LONG_AGO
    core.dispatch.schedule()
    out = core.flush(now)
    assert recalled(sent(out, w2.wid)) == [a.id]
