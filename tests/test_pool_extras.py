"""Pool options beyond the core ladder: warm spares, and the pool on trio."""

from __future__ import annotations

import concurrent.futures

import anyio
import pytest

import toolpool
from toolpool import Outcome, Rung

EXAMPLES = "toolpool.testing.examples:registry"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_warm_spare_serves_the_next_call_after_a_kill(anyio_backend: str) -> None:
    async with toolpool.Pool(EXAMPLES, workers=1, warm_spares=1) as pool:
        before = set(pool.worker_pids)
        assert len(before) == 2  # one serving, one spare
        # At most `workers` calls run at once: the second waits although a process is idle.
        first = pool.submit("nap", {"seconds": 30})
        second = pool.submit("echo", {"value": "after"})
        assert await first.wait_started()
        assert pool.statistics().queued == 1
        first.cancel(force=True)
        killed = await first
        served = await second
        assert killed.outcome is Outcome.KILLED
        assert killed.rung is Rung.SIGKILL
        assert served.ok
        # The spare (a process that existed before the kill) served it: no start-up on the path.
        assert served.worker_pid in before - {killed.worker_pid}
        assert served.timeline.dispatched is not None
        assert killed.timeline.settled is not None
        assert served.timeline.dispatched >= killed.timeline.settled
        with anyio.fail_after(30):  # a new spare is started in the background
            while len(pool.worker_pids) < 2 or pool.statistics().workers.get("ready") != 2:
                await pool.call("noop")
        assert killed.worker_pid not in pool.worker_pids


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_warm_spares_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="warm_spares"):
        toolpool.Pool(EXAMPLES, warm_spares=bad)  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_pool_runs_on_trio(anyio_backend: str) -> None:
    async with toolpool.Pool(EXAMPLES, workers=2, cancel_grace=0.2, term_grace=0.2) as pool:
        ok = await pool.call("echo", {"value": [1, 2]})
        cooperative = pool.submit("nap", {"seconds": 30})
        assert await cooperative.wait_started()
        cooperative.cancel()
        stubborn = pool.submit("busy_loop", {})
        assert await stubborn.wait_started()
        stubborn.cancel()
        aborted, killed = await cooperative, await stubborn
        pids = pool.worker_pids
    assert ok.value == [1, 2]
    assert aborted.outcome is Outcome.ABORTED
    assert killed.outcome is Outcome.KILLED
    assert killed.rung is Rung.SIGTERM
    assert pids


def test_the_blocking_facade_for_scripts() -> None:
    with toolpool.SyncPool(EXAMPLES, workers=1, cancel_grace=0.2) as pool:
        assert pool.call("echo", {"value": 3}).value == 3
        call = pool.submit("sync_nap", {"seconds": 30})
        call.cancel({"kind": "parent"})
        result = call.result()
        assert result.outcome in (Outcome.ABORTED, Outcome.ABORTED_BEFORE_DISPATCH)
        assert result.cause == {"kind": "parent"}
        assert call.done()
        with pytest.raises(ValueError, match="kind"):
            call.cancel({"kind": "bogus"})
        assert pool.statistics().submitted == 2
        pids = pool._pool.worker_pids
    assert pids
    with pytest.raises(toolpool.PoolClosedError, match="closed"):
        pool.call("echo")


def test_a_sync_call_is_a_future_that_wait_and_as_completed_take() -> None:
    with toolpool.SyncPool(EXAMPLES, workers=2, cancel_grace=0.2) as pool:
        long = pool.submit("sync_nap", {"seconds": 30})
        quick = pool.submit("echo", {"value": "quick"})
        assert isinstance(long, concurrent.futures.Future)
        first = next(concurrent.futures.as_completed([long, quick], timeout=30))
        assert first is quick
        assert first.result().value == "quick"
        done, pending = concurrent.futures.wait([long, quick], timeout=0.05)
        assert (done, pending) == ({quick}, {long})
        with pytest.raises(TimeoutError):
            long.result(timeout=0.05)
        assert long.cancel() is True  # the call is cancelled; the future gets its result
        done, pending = concurrent.futures.wait([long], timeout=30)
        assert done == {long}
        cancelled = long.result(timeout=0)
        assert cancelled.outcome in (Outcome.ABORTED, Outcome.ABORTED_BEFORE_DISPATCH)
        assert cancelled.cause == {"kind": "user"}
        assert not long.cancelled()
        assert long.exception() is None
        assert long.cancel() is False  # settled: nothing to cancel...
        with pytest.raises(ValueError, match="kind"):
            long.cancel({"kind": "bogus"})  # ...and the cause is still validated
        assert quick.id != long.id
        assert quick.tool == "echo"
        assert repr(quick) == f"<toolpool.SyncCall {quick.id} 'echo' ok>"


def test_closing_the_sync_pool_completes_every_future() -> None:
    seen: list[toolpool.Result] = []
    # prefetch=0: the second call waits in the pool's queue, not in the worker's (where it
    # could be taken up in the moment the first ends).
    with toolpool.SyncPool(EXAMPLES, workers=1, cancel_grace=0.2, prefetch=0) as pool:
        running = pool.submit("sync_nap", {"seconds": 30})
        queued = pool.submit("echo", {"value": "never"})
        queued.add_done_callback(lambda future: seen.append(future.result()))
    assert running.done()
    assert queued.done()
    assert running.result(timeout=0).cause == {"kind": "disposed"}
    assert queued.result(timeout=0).outcome is Outcome.ABORTED_BEFORE_DISPATCH
    assert seen == [queued.result()]


def test_a_closed_or_unstarted_sync_pool_raises_as_the_async_pool_does() -> None:
    pool = toolpool.SyncPool(EXAMPLES, workers=1)
    with pytest.raises(toolpool.PoolClosedError, match="not started"):
        pool.submit("echo")
    assert pool.statistics().submitted == 0
    with pool:
        pool.call("echo", {"value": 1})
        with pytest.raises(toolpool.UnknownToolError):
            pool.submit("no_such_tool")
        with pytest.raises(ValueError, match="timeout"):
            pool.submit("echo", timeout=-1)
    with pytest.raises(toolpool.PoolClosedError, match="the pool is closed"):
        pool.submit("echo")
    with pytest.raises(toolpool.PoolClosedError, match="the pool is closed"):
        pool.call("echo")
    stats = pool.statistics()  # the last snapshot, as the async pool gives it once closed
    assert stats.submitted == 1
    assert stats.settled == {"ok": 1}
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="started once"), pool:
        pass


# ------------------------------------------------------------------ results over max_frame

SIZED = "hostile_tools:registry"
SMALL_FRAME = 64 * 1024


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_result_over_max_frame_is_an_error_and_the_worker_keeps_serving(
    anyio_backend: str,
) -> None:
    async with toolpool.Pool(SIZED, workers=1, max_frame=SMALL_FRAME) as pool:
        fits = await pool.call("sized", {"value": SMALL_FRAME - 1024})
        big = await pool.call("sized", {"value": SMALL_FRAME})
        after = await pool.call("echo", {"value": "still here"})
        stats = pool.statistics()
    assert fits.ok, fits
    assert len(fits.value) == SMALL_FRAME - 1024
    assert big.outcome is Outcome.ERROR, big
    assert big.error_name == "ResultTooLarge"
    assert big.body_started is True
    assert big.value is None
    assert big.error is not None
    assert big.error.startswith("Error: the tool's result is too large to send")
    assert f"the value packs to {SMALL_FRAME + 5:,} bytes" in big.error  # msgpack bin 32
    assert f"the pool's max_frame allows {SMALL_FRAME:,}" in big.error
    assert after.value == "still here"
    assert after.worker_pid == big.worker_pid == fits.worker_pid
    assert stats.workers_replaced == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_over_max_frame_the_output_goes_first_then_the_context(anyio_backend: str) -> None:
    half = SMALL_FRAME // 2
    async with toolpool.Pool(SIZED, workers=1, max_frame=SMALL_FRAME, capture_output=half) as pool:
        # The value fits alone; with the captured output it would not: the output goes.
        loud = await pool.call("sized", {"value": half, "printed": half})
        # The value does not fit: an error, which keeps the context that fits...
        kept = await pool.call("sized", {"value": SMALL_FRAME, "context": 1000})
        # ...and drops what does not.
        dropped = await pool.call("sized", {"value": SMALL_FRAME, "context": SMALL_FRAME})
        after = await pool.call("echo", {"value": 1})
    assert loud.ok, loud
    assert len(loud.value) == half
    assert loud.output is None
    assert loud.output_dropped >= half
    assert kept.error_name == "ResultTooLarge"
    assert len(kept.context["blob"]) == 1000
    assert dropped.error_name == "ResultTooLarge"
    assert dict(dropped.context) == {}
    assert after.ok
    assert after.worker_pid == loud.worker_pid == dropped.worker_pid


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_enum_dataclass_and_datetime_arguments_reach_a_worker_converted(
    anyio_backend: str,
) -> None:
    args = {"tint": "blue", "at": "2026-12-01T21:30:00", "where": {"x": 3, "y": 4}}
    async with toolpool.Pool(SIZED, workers=1) as pool:
        typed = await pool.call("typed", args)
        wrong = await pool.call("typed", {**args, "tint": "green"})
        schema = pool.catalog["typed"]["input_schema"]
    assert typed.value == ["Tint", "BLUE", "2026-12-01T21:30:00", "Where", 3], typed
    assert wrong.error_name == "InvalidArguments"
    assert wrong.error is not None
    assert "argument 'tint' must be one of 'red', 'blue' (Tint), got 'green'" in wrong.error
    assert schema["properties"]["tint"] == {
        "type": "string",
        "enum": ["red", "blue"],
        "title": "Tint",
    }
    assert schema["properties"]["at"] == {"type": "string", "format": "date-time"}
    assert schema["properties"]["where"]["required"] == ["x", "y"]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_pool_in_a_scope_that_is_cancelled_still_escalates_and_closes() -> None:
    """The scope around a pool is cancelled while a call ignores its cancel: the caller's
    cancellation reaches it at once, and the pool still runs the ladder to the end (its
    clock, its sockets' readers and the reaper's pump are its own, not the scope's) and
    closes with every call settled and every worker gone."""
    with anyio.CancelScope() as scope:
        async with toolpool.Pool(
            "toolpool.testing.examples:registry", workers=1, cancel_grace=0.2, term_grace=0.2
        ) as pool:
            call = pool.submit("busy_loop", {"seconds": 60})
            assert await call.wait_started()
            pids = pool.worker_pids
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    result = call.result()  # settled before the pool's close returned
    assert result.outcome is Outcome.KILLED, result
    assert result.cause is not None
    assert result.cause.kind == "disposed"
    assert result.rung in (Rung.SIGTERM, Rung.SIGKILL)
    assert pool.worker_pids == []
    import psutil

    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_introspection_is_spelled_as_properties(anyio_backend: str) -> None:
    """One spelling (issue 16): properties; the old call forms warn and still answer."""
    async with toolpool.Pool("toolpool.testing.examples:registry", workers=2) as pool:
        pids = pool.worker_pids
        assert isinstance(pids, list)
        assert len(pids) == 2
        assert set(pool.worker_start_methods) == set(pids)
        with pytest.warns(DeprecationWarning, match=r"pool.worker_pids\(\) is deprecated"):
            assert pool.worker_pids() == pids  # type: ignore[operator]
        with pytest.warns(DeprecationWarning, match="worker_start_methods"):
            called = pool.worker_start_methods()  # type: ignore[operator]
        assert called == dict(pool.worker_start_methods)


@pytest.mark.parametrize("bad", [0, -1, "x", True, 1.5, None])
def test_max_start_failures_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="max_start_failures must be a positive integer"):
        toolpool.Pool("toolpool.testing.examples:registry", max_start_failures=bad)  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_args_over_the_frame_limit_name_the_usable_size(anyio_backend: str) -> None:
    async with toolpool.Pool(
        "toolpool.testing.examples:registry", workers=1, max_frame=4096
    ) as pool:
        with pytest.raises(ValueError, match="exceed the 3072 bytes a call can carry"):
            pool.submit("echo", {"value": "x" * 5000})
        fits = await pool.call("echo", {"value": "x" * 2900})
        assert fits.ok, fits
