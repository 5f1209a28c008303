"""The supervisor's drain of a worker socket does not recurse once per call (white box).

A result makes the pool dispatch the next queued call to the same worker, and a send checks
the socket for what arrived meanwhile. When the worker had already answered by then (a
preempted supervisor, a fast worker), that check used to drain again from inside the drain:
one level of recursion per call, until a RecursionError quarantined a healthy worker. A fake
socket that answers every call at once makes this deterministic.
"""

from __future__ import annotations

from typing import Any

import pytest

import toolpool
from pool_support import FakeWorkerSocket
from toolpool import Outcome
from toolpool.protocol import Call, Result, Started, decode_from_supervisor, encode, pack_value
from toolpool.supervisor._pool import WorkerState, _Worker

CALLS = 3000  # several times Python's default recursion limit, in calls


class _InstantWorker(FakeWorkerSocket):
    """Every call is answered before send() returns."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        msg = decode_from_supervisor(frame)
        assert isinstance(msg, Call)
        self.served += 1
        self.inbox.append(encode(Started(msg.call_id)))
        value = pack_value(msg.call_id)
        self.inbox.append(encode(Result(msg.call_id, "ok", value, None, None, True, {}, 0, {})))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_draining_a_fast_worker_does_not_nest_per_call(anyio_backend: str) -> None:
    pool = toolpool.Pool("toolpool.testing.examples:registry", workers=1)
    sock = _InstantWorker()
    w = _Worker(1, "ipc://fake", sock, b"secret")  # type: ignore[arg-type]
    w.state = WorkerState.READY
    pool._workers[w.wid] = w
    pool._catalog["noop"] = {"name": "noop"}
    pool._state = "running"
    # Queue every call first, then let the worker become ready: one drain serves them all.
    pool._ready.clear()
    calls = [pool.submit("noop") for _ in range(CALLS)]
    pool._ready.append(w)
    pool._dispatch()  # the first call; each later one is dispatched from a result
    pool._drain(w)
    results: list[Any] = [call.result() for call in calls]
    assert sock.served == CALLS
    assert all(r.outcome is Outcome.OK for r in results), results[-1]
    assert [r.value for r in results] == [call.id for call in calls]
    assert w.violation is None
    assert w.state is WorkerState.READY
