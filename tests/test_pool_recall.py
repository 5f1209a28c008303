"""Recalling calls waiting in a worker's queue (white box, on the pool's internal API).

Fake worker sockets make the order of messages deterministic: what a real worker answers
arrives whenever the supervisor next reads its socket, and a send reads it (see
``Pool._send``), so one recall can hand the supervisor the answer to an earlier one.
"""

from __future__ import annotations

import time

import pytest

import toolpool
import toolpool.supervisor._pool as pool_module
from pool_support import FakeWorkerSocket
from toolpool.protocol import Recall, Withdrawn, decode_from_supervisor, encode
from toolpool.supervisor._pool import WorkerState, _Worker

#: Older than any QUEUE_BEHIND_FOR these tests set.
LONG_AGO = 10 * 3600.0


class _QuietWorker(FakeWorkerSocket):
    """Records what it is sent; answers only what the test puts in its inbox."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[object] = []

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        self.sent.append(decode_from_supervisor(frame))

    def recalled(self) -> list[int]:
        return [m.call_id for m in self.sent if isinstance(m, Recall)]


def _pool_with(*socks: _QuietWorker) -> tuple[toolpool.Pool, list[_Worker]]:
    pool = toolpool.Pool("toolpool.testing.examples:registry", workers=len(socks))
    pool._catalog["noop"] = {"name": "noop"}
    pool._threaded.add("noop")  # calls may wait behind its calls
    pool._state = "running"
    workers = []
    for wid, sock in enumerate(socks, 1):
        w = _Worker(wid, "ipc://fake", sock, b"secret")  # type: ignore[arg-type]
        w.state = WorkerState.READY
        pool._workers[wid] = w
        workers.append(w)
    return pool, workers


@pytest.mark.timeout(30)
def test_a_call_back_in_the_pools_queue_is_not_marked_as_being_recalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A recall's send reads what the worker answered to an earlier recall: that call is back
    in the pool's queue before the same pass reaches it. It must not be marked as being
    recalled there: marked, it went to the next worker as if a recall were on its way, and
    could never be recalled from behind a long call there (nor before a kill for it)."""
    monkeypatch.setattr(pool_module, "QUEUE_BEHIND_FOR", 3600.0)  # young unless made old
    s1, s2 = _QuietWorker(), _QuietWorker()
    pool, (w1, w2) = _pool_with(s1, s2)
    pool._ready.append(w1)
    head1, a, b = (pool.submit("noop") for _ in range(3))
    assert list(w1.calls) == [head1, a, b]
    pool._ready.append(w2)
    head2 = pool.submit("noop")
    assert list(w2.calls) == [head2]
    # w1 was asked for a back (an idle worker's steal, say); its answer is not read yet.
    assert pool._recall(w1, a)
    s1.inbox.append(encode(Withdrawn(a.id)))
    # w1's first call is now old: the next pass recalls b, which reads a's withdrawal; a
    # goes to the front of the pool's queue, then behind w2's young first call.
    w1.head_since = time.monotonic() - LONG_AGO
    pool._dispatch()
    assert list(w2.calls) == [head2, a]
    assert s1.recalled() == [a.id, b.id]
    # Now w2's first call is old too: a is taken back from behind it.
    w2.head_since = time.monotonic() - LONG_AGO
    pool._dispatch()
    assert s2.recalled() == [a.id]
