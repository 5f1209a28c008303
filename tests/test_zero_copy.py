"""Large byte strings move without copies, and a large result never waits for an Ack
(issue 26 step 3): a call's large bytes travel as zmq parts after its frame, a result's go to
the spill after the ledger's slots, so the result is kept in the ledger and a worker that
dies before sending it still has it recovered, byte for byte (``docs/protocol.md`` §3, §6.3).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from pool_support import running_pool
from toolpool import Outcome
from toolpool.protocol import PART_MIN
from zero_copy_tools import pattern

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60, method="thread")]

TOOLS = "zero_copy_tools:registry"
MiB = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    "size", [PART_MIN - 1, PART_MIN, 32 * 1024, MiB, 3 * MiB + 5], ids=lambda s: f"{s}B"
)
async def test_large_bytes_round_trip_byte_exact(size: int) -> None:
    data = pattern(size, size)
    async with running_pool(TOOLS, workers=1) as pool:
        with anyio.fail_after(30):
            echoed = await pool.call("echo", {"value": data})
            nested = await pool.call("echo", {"value": {"a": [data, 1], "b": bytearray(data)}})
            made = await pool.call("make", {"seed": size, "size": size, "as_bytearray": True})
            seen = await pool.call("length", {"value": bytearray(data)})
    assert echoed.outcome is Outcome.OK, echoed
    assert type(echoed.value) is bytes
    assert echoed.value == data
    assert nested.value == {"a": [data, 1], "b": data}
    assert made.value == data  # a bytearray result arrives as bytes
    # A bytearray argument reaches the tool as bytes (as msgpack's bin always did).
    assert seen.value == ["bytes", size, data[:8], data[-8:]]


async def test_many_large_results_in_flight_come_back_intact() -> None:
    """Results of many sizes queued in one worker: their spill regions are reused as the
    supervisor acknowledges them (the spill is a ring), never while one is unread."""
    sizes = [PART_MIN, 3 * MiB, 700 * 1024, 5 * MiB, 20 * 1024, 2 * MiB, 6 * MiB, 100 * 1024] * 4
    async with running_pool(TOOLS, workers=1, prefetch=4) as pool:
        calls = [pool.submit("make", {"seed": i, "size": n}) for i, n in enumerate(sizes)]
        with anyio.fail_after(60):
            results = [await c for c in calls]
    for i, (n, result) in enumerate(zip(sizes, results, strict=True)):
        assert result.outcome is Outcome.OK, result
        assert result.value == pattern(i, n), f"call {i} ({n} bytes) came back changed"


async def test_a_large_result_its_worker_died_before_sending_is_recovered() -> None:
    """The worker keeps a large result in its ledger (the frame in a slot, the bytes in the
    spill) and is killed before the result leaves it: the supervisor settles the call with
    that result, read from the ledger, byte for byte; and the worker's death is not hidden
    (it is replaced). Before the spill, a result that large was not kept: the call settled
    as worker_lost."""
    async with running_pool(TOOLS, workers=1) as pool:
        (pid,) = pool.worker_pids
        with anyio.fail_after(30):
            result = await pool.call("make_then_die_unsent", {"seed": 7, "size": MiB})
            after = await pool.call("echo", {"value": 1})
        stats = pool.statistics()
    assert result.outcome is Outcome.OK, result
    assert result.value == pattern(7, MiB)
    assert result.body_started is True
    assert result.worker_pid == pid
    assert after.worker_pid != pid
    assert stats.workers_replaced == 1


async def test_a_bytearray_argument_is_taken_when_submitted() -> None:
    """A bytearray is copied once, at submit: the caller's later change does not reach the
    call, even one that waited in the pool's queue meanwhile."""
    async with running_pool(TOOLS, workers=1, prefetch=0) as pool:
        blocker = pool.submit("wait_for_cancel")
        with anyio.fail_after(30):
            assert await blocker.wait_started()
        data = bytearray(pattern(1, 64 * 1024))
        original = bytes(data)
        call = pool.submit("echo", {"value": data})
        data[:] = bytes(len(data))
        blocker.cancel()
        with anyio.fail_after(30):
            result = await call
            await blocker
    assert result.value == original


async def test_arguments_larger_than_max_frame_are_refused_at_submit() -> None:
    """The parts count against max_frame with the frame: what the worker's decoder would
    refuse is refused at submit (a ValueError), not sent."""
    async with running_pool(TOOLS, workers=1, max_frame=MiB) as pool:
        with pytest.raises(ValueError, match="exceed"):
            pool.submit("echo", {"value": [bytes(600 * 1024), bytes(600 * 1024)]})
        ok: Any = await pool.call("echo", {"value": bytes(600 * 1024)})
    assert ok.value == bytes(600 * 1024)
