"""The supervisor's reading of a worker socket does not recurse once per call (white box).

A result makes the pool dispatch the next queued call to the same worker, and after a send
the shell reads what arrived meanwhile (zmq's notification fd is edge-triggered). When the
worker had already answered by then (a preempted supervisor, a fast worker), that read once
happened inside the read that sent: one level of recursion per call, until a RecursionError
quarantined a healthy worker. A fake socket that answers every call at once makes this
deterministic; the shell's loop must serve every call iteratively.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest

import toolpool
from core_support import serve
from pool_support import FakeWorkerSocket
from toolpool import Outcome
from toolpool.protocol import CallMessage as Call
from toolpool.protocol import ResultMessage as Result
from toolpool.protocol import StartedMessage as Started
from toolpool.protocol import decode_from_supervisor, encode, pack_value
from toolpool.supervisor._results import WorkerState
from toolpool.supervisor._workerio import WorkerIO
from toolpool.supervisor.machine import WorkerRecord

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
async def test_serving_a_fast_worker_does_not_nest_per_call(anyio_backend: str) -> None:
    pool = toolpool.Pool("toolpool.testing.examples:registry", workers=1)
    sock = _InstantWorker()
    with tempfile.TemporaryFile() as ledger:
        io = WorkerIO(1, "ipc://fake", sock, os.dup(ledger.fileno()))  # type: ignore[arg-type]
        pool._io[1] = io
        core = pool._core
        p = serve(core, ["noop"])
        w = WorkerRecord(1, b"secret", p)
        w.state = WorkerState.READY
        w.answered = True
        core.workers[1] = w
        core.starting = False
        pool._state = "running"
        # Queue every call first, then let the worker become ready: one pump serves them all.
        calls = [pool.submit("noop") for _ in range(CALLS)]
        p.ready.append(w)
        core.dispatch.schedule()  # the first call; each later one is dispatched from a result
        pool._pump()
        results: list[Any] = [call.result() for call in calls]
        io.close_files()
    assert sock.served == CALLS
    assert all(r.outcome is Outcome.OK for r in results), results[-1]
    assert [r.value for r in results] == [call.id for call in calls]
    assert w.violation is None
    assert w.state is WorkerState.READY
