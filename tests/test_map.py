"""``pool.map``: real workers, real crashes, real cancellation (``SyncPool.map``: see
``test_sync_map.py``).

The tools are ``map_tools:registry`` (one tool, ``varied``, that misbehaves as its arguments
say, with the kit of ``toolpool.testing``). The async tests run on asyncio and trio.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import toolpool
from map_tools import Pulled, cancelled, oks
from pool_support import running_pool
from toolpool import Outcome, Result

TOOLS = "map_tools:registry"

pytestmark = pytest.mark.anyio


async def collect(
    results: toolpool.MapIterator,
    into: list[Result],
    then: Callable[[Result], Awaitable[None]] | None = None,
) -> None:
    """Append every result to ``into`` (awaiting ``then(result)`` after each)."""
    async for result in results:
        into.append(result)
        if then is not None:
            await then(result)


@pytest.mark.timeout(60)
async def test_unordered_yields_every_result_once_with_its_index() -> None:
    async with running_pool(TOOLS, workers=2) as pool:
        seen: dict[int, Any] = {}
        async with pool.map("square", ({"i": i} for i in range(300))) as results:
            async for result in results:
                assert result.index not in seen
                seen[result.index] = result
        assert sorted(seen) == list(range(300))
        assert all(r.ok and r.value == i * i for i, r in seen.items())
        assert pool.statistics().submitted == 300
        # A call submitted otherwise carries no index.
        assert (await pool.call("square", {"i": 3})).index is None


@pytest.mark.timeout(60)
async def test_ordered_yields_in_input_order_though_they_settle_out_of_it(
    tmp_path: Path,
) -> None:
    flag = str(tmp_path / "last-ran")
    n = 20
    items = [{"kind": "gate", "i": 0, "path": flag}]
    items += [{"kind": "ok", "i": i} for i in range(1, n - 1)]
    items.append({"kind": "touch", "i": n - 1, "path": flag})
    # prefetch=0: no call waits in the gate's worker; the other worker runs the rest. The
    # window must hold them all: the gate, at the head, holds back what comes after it.
    async with running_pool(TOOLS, workers=2, prefetch=0) as pool:
        results = [r async for r in pool.map("varied", items, ordered=True, max_in_flight=n)]
    assert [r.index for r in results] == list(range(n))
    assert [r.value for r in results] == list(range(n))
    gate = results[0].timeline.settled
    assert gate is not None
    assert all(r.timeline.settled is not None and r.timeline.settled < gate for r in results[1:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ordered", [False, True])
async def test_backpressure_pulls_at_most_max_in_flight_ahead(ordered: bool) -> None:
    source = Pulled(oks(200))
    async with running_pool(TOOLS, workers=2) as pool:
        results = pool.map("varied", source, ordered=ordered, max_in_flight=5)
        assert source.pulled == 0  # nothing is pulled before the first result is asked for
        got = []
        for _ in range(3):
            source.asked += 1
            got.append(await results.__anext__())
        await pool.wait_idle()  # everything submitted settled; the consumer asks nothing
        assert source.pulled == 3 + 5
        assert pool.statistics().submitted == 8
        async with results:
            while True:
                source.asked += 1
                try:
                    got.append(await results.__anext__())
                except StopAsyncIteration:
                    break
    assert sorted(r.index for r in got) == list(range(200))
    assert max(source.ahead) == 5


@pytest.mark.timeout(30)
async def test_default_max_in_flight_is_twice_what_the_workers_hold() -> None:
    async with running_pool(TOOLS, workers=3, prefetch=4) as pool:
        results = pool.map("square", [])
        assert results.max_in_flight == 2 * 3 * (4 + 1)
        assert [r async for r in results] == []


@pytest.mark.timeout(90)
async def test_break_inside_async_with_cancels_and_settles_the_rest() -> None:
    # One quick call, then calls that only a cancel ends: cooperative ones, and stubborn
    # ones that ignore SIGTERM (so closing the map waits for SIGKILL of their trees).
    items = [{"kind": "ok", "i": 0}] + [
        {"kind": "stubborn" if i % 4 == 0 else "nap", "i": i} for i in range(1, 1000)
    ]
    source = Pulled(items)
    async with running_pool(TOOLS, workers=2, cancel_grace=0.5, term_grace=0.5) as pool:
        async with pool.map("varied", source, max_in_flight=6) as results:
            async for result in results:
                assert result.index == 0
                break
        stats = pool.statistics()  # aclose returned: every call the map made has settled
        assert stats.in_flight == 0
        assert stats.queued == 0
        assert stats.submitted == source.pulled <= 1 + 6
        assert sum(stats.settled.values()) == stats.submitted
        assert stats.settled.get("ok") == 1
        stopped = ("aborted", "aborted_before_dispatch", "killed")
        assert sum(stats.settled.get(o, 0) for o in stopped) == stats.submitted - 1
        # The pool goes on: a new map runs on replaced workers.
        assert [r.value async for r in pool.map("square", [{"i": 4}])] == [16]


@pytest.mark.timeout(60)
async def test_a_bare_break_cancels_the_rest_when_the_iterator_is_collected() -> None:
    items = [{"kind": "ok", "i": 0}] + [{"kind": "nap", "i": i} for i in range(1, 100)]
    async with running_pool(TOOLS, workers=2) as pool:
        async for result in pool.map("varied", items, max_in_flight=4):
            assert result.ok
            break
        with anyio.fail_after(30):  # the naps end only by a cancel
            await pool.wait_idle()
        stats = pool.statistics()
        assert stats.submitted <= 5
        assert stats.settled.get("ok") == 1
        assert cancelled(stats.settled) == stats.submitted - 1


@pytest.mark.timeout(60)
async def test_cancelling_the_consumer_cancels_the_calls_and_aclose_waits_for_them() -> None:
    items = [{"kind": "ok", "i": 0}] + [{"kind": "nap", "i": i} for i in range(1, 50)]
    async with running_pool(TOOLS, workers=2) as pool:
        got = []
        with anyio.CancelScope() as scope:
            async with pool.map("varied", items, max_in_flight=4) as results:
                async for result in results:
                    got.append(result)
                    scope.cancel()
        assert scope.cancelled_caught
        assert [r.index for r in got] == [0]
        stats = pool.statistics()  # settled before aclose (leaving the block) returned
        assert stats.in_flight == 0
        assert stats.queued == 0
        assert cancelled(stats.settled) == stats.submitted - 1


@pytest.mark.timeout(60)
async def test_a_cancelled_consumer_gets_its_cancellation_at_once() -> None:
    """The cancellation is not held up by the calls (C4.5): they are cancelled with cause
    ``parent``, and the pool settles them; ``aclose`` waits for that."""
    items = [{"kind": "nap", "i": i} for i in range(3)]
    async with running_pool(TOOLS, workers=3) as pool:
        results = pool.map("varied", items)
        # The naps never end by themselves: this always times out. 3 s, not less: the map
        # must have submitted all three by then, on a loaded machine too (a full suite run
        # beside a simulation once saw only two submitted after 0.5 s).
        # (white box: to see each call's cause; the group's record holds the machine's
        # records of its calls, the port their faces, and only while a call is unsettled:
        # taken as soon as the map submitted them, before any can settle)
        calls: list[Any] = []

        async def take_the_calls() -> None:  # (runs once __anext__ submitted and waits)
            port = results._pool
            calls.extend(port.call_of(record.id) for record in results._group._record._calls)

        done_at_cancel: list[bool] = []
        with anyio.move_on_after(3.0) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(take_the_calls)
                try:
                    await results.__anext__()
                finally:  # (no checkpoint since the cancel: no reply read meanwhile)
                    done_at_cancel = [c.done() for c in calls]
        assert scope.cancelled_caught
        assert len(calls) == 3, calls
        assert None not in calls, calls
        assert not all(done_at_cancel)  # a cooperative cancel takes a round trip
        await results.aclose()
        assert pool.statistics().in_flight == 0
        for call in calls:
            result = call.result()
            assert result.outcome in (Outcome.ABORTED, Outcome.ABORTED_BEFORE_DISPATCH)
            assert result.cause is not None
            assert result.cause.kind == "parent"


@pytest.mark.timeout(120)
async def test_failures_and_crashes_are_results_and_the_map_goes_on() -> None:
    kinds = ["ok", "fail", "exit", "ok", "segv", "kill", "fail", "ok", "exit", "ok"]
    items = [{"kind": k, "i": i} for i, k in enumerate(kinds)]
    # Last, so that no quick call waits behind them past its timeout. (prefetch=0: a call
    # is sent only to an idle worker, in the order queued. With calls queued in workers, a
    # crash puts the ones it held back at the front of the queue, which can set the two
    # long ones ahead of a quick one on two workers: the pool promises no order.)
    items += [{"kind": "hang", "i": len(items)}, {"kind": "nap", "i": len(items) + 1}]
    async with running_pool(TOOLS, workers=2, cancel_grace=0.5, term_grace=0.5, prefetch=0) as pool:
        by_index = {r.index: r async for r in pool.map("varied", items, timeout=6)}
        stats = pool.statistics()
    assert sorted(by_index) == list(range(len(items)))
    expected = {
        "ok": Outcome.OK,
        "fail": Outcome.ERROR,
        "exit": Outcome.WORKER_LOST,
        "segv": Outcome.WORKER_LOST,
        "kill": Outcome.WORKER_LOST,
        "hang": Outcome.KILLED,
        "nap": Outcome.TIMEOUT,
    }
    for i, item in enumerate(items):
        result = by_index[i]
        assert result.outcome is expected[item["kind"]], (i, item, result)
        if item["kind"] == "ok":
            assert result.value == i
    assert stats.workers_replaced >= 5  # 2 exits, a segfault, a SIGKILL, the hang's kill


@pytest.mark.timeout(30)
async def test_bad_arguments_raise_at_once(tmp_path: Path) -> None:
    async def agen() -> AsyncIterator[dict[str, Any]]:
        yield {}

    async with running_pool(TOOLS, workers=1) as pool:
        with pytest.raises(toolpool.UnknownToolError, match="nope"):
            pool.map("nope", [{}])
        with pytest.raises(TypeError, match="a tool name is a str"):
            pool.map(b"square", [{}])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not int"):
            pool.map("square", 5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not one mapping"):
            pool.map("square", {"i": 1})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not a str"):
            pool.map("square", "abc")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not an async iterable"):
            pool.map("square", agen())  # type: ignore[arg-type]
        for bad in (0, -1, 1.5, True, "4"):
            with pytest.raises(ValueError, match="max_in_flight must be a positive integer"):
                pool.map("square", [{}], max_in_flight=bad)  # type: ignore[arg-type]
        for timeout in (0, -1, float("nan"), float("inf"), "1"):
            with pytest.raises(ValueError, match="timeout must be a positive number"):
                pool.map("square", [{}], timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ordered must be a bool"):
            pool.map("square", [{}], ordered=1)  # type: ignore[arg-type]
        assert pool.statistics().submitted == 0
    with pytest.raises(toolpool.PoolClosedError):
        pool.map("square", [{}])
    with pytest.raises(toolpool.PoolClosedError, match="not started"):
        toolpool.Pool(TOOLS).map("square", [{}])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ordered", [False, True])
async def test_a_bad_item_ends_the_map_after_the_results_before_it(ordered: bool) -> None:
    # (7 is no mapping: a bad item for "varied", which has several parameters; "square",
    # with one, takes it as its value: test_items_are_the_value_of_a_one_parameter_tool)
    source = Pulled([{"kind": "ok", "i": 1}, {"kind": "ok", "i": 2}, 7, {"kind": "ok"}])
    async with running_pool(TOOLS, workers=1) as pool:
        got = []
        with pytest.raises(TypeError, match="args at index 2: expected a mapping of arguments"):
            await collect(pool.map("varied", source, ordered=ordered), got)
        assert sorted(r.value for r in got) == [1, 2]  # the two before it, then the error
        assert source.pulled == 3  # nothing after it was pulled
        assert pool.statistics().submitted == 2

        def broken() -> Iterator[dict[str, Any]]:
            yield {"i": 5}
            raise LookupError("the source broke")

        got = []
        with pytest.raises(LookupError, match="the source broke"):
            await collect(pool.map("square", broken(), ordered=ordered), got)
        assert [r.value for r in got] == [25]
        # Unserializable and too large: also errors naming the index.
        with pytest.raises(TypeError, match="args at index 0"):
            await collect(pool.map("square", [{"i": object()}]), [])
        got = []
        with pytest.raises(ValueError, match="args at index 1"):
            await collect(pool.map("square", [{"i": 1}, {"i": b"x" * (9 << 20)}]), got)
        assert [r.value for r in got] == [1]


@pytest.mark.timeout(60)
async def test_closing_the_pool_ends_a_running_map_with_pool_closed() -> None:
    items = [{"kind": "ok", "i": 0}] + [{"kind": "nap", "i": i} for i in range(1, 100)]
    pool = toolpool.Pool(TOOLS, workers=2, cancel_grace=0.5, term_grace=0.5)
    got = []

    async def close_after_the_first(result: Result) -> None:
        if result.index == 0:
            await pool.aclose()

    async with pool:
        with pytest.raises(toolpool.PoolClosedError):
            await collect(pool.map("varied", items, max_in_flight=4), got, close_after_the_first)
    # The quick one, then the 4 the map had out (settled by the close, cause disposed, not
    # lost), then the error.
    assert [r.index for r in got[:1]] == [0]
    assert sorted(r.index for r in got[1:]) == [1, 2, 3, 4]
    assert all(r.cause is not None and r.cause.kind == "disposed" for r in got[1:])


@pytest.mark.timeout(60)
async def test_items_are_the_value_of_a_one_parameter_tool() -> None:
    async with running_pool(TOOLS, workers=1) as pool:
        results = [r async for r in pool.map("square", range(5), ordered=True)]
        assert [r.value for r in results] == [0, 1, 4, 9, 16]
        # A mapping is still the arguments; None is still none (here: one missing).
        mixed = [r async for r in pool.map("square", [{"i": 3}, 4, None], ordered=True)]
        assert [r.value for r in mixed[:2]] == [9, 16]
        assert mixed[2].outcome is Outcome.ERROR
        # A tool of several parameters takes mappings only, and says which it has.
        with pytest.raises(TypeError, match=r"'varied' has 3: i, kind, path"):
            await collect(pool.map("varied", [1]), [])
