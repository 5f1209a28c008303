"""``SyncPool.map``: the blocking face of ``pool.map``, with real workers and threads.

The map runs in the SyncPool's event-loop thread and hands results to the caller's thread in
batches; these tests check that it keeps every promise of the async map from that side.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import toolpool
from map_tools import Pulled, cancelled, oks
from pool_support import alive, pool_processes
from toolpool import Outcome

TOOLS = "map_tools:registry"


def sync_pool(**options: Any) -> toolpool.SyncPool:
    options.setdefault("workers", 2)
    options.setdefault("cancel_grace", 0.5)
    options.setdefault("term_grace", 0.5)
    return toolpool.SyncPool(TOOLS, **options)


async def _idle(pool: toolpool.Pool, timeout: float) -> None:
    with anyio.fail_after(timeout):
        await pool.wait_idle()


def wait_idle(pool: toolpool.SyncPool, timeout: float = 30.0) -> None:
    """Block until no call of the pool is queued or running (in the pool's loop)."""
    pool._running().call(functools.partial(_idle, pool._pool, timeout))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ordered", [False, True])
def test_sync_map_yields_every_result_with_its_index(ordered: bool) -> None:
    source = ({"i": i} for i in range(500))
    with sync_pool() as pool, pool.map("square", source, ordered=ordered) as results:
        got = list(results)
        assert list(results) == []  # exhausted
    indices = [r.index for r in got]
    assert sorted(indices) == list(range(500))
    if ordered:
        assert indices == list(range(500))
    assert all(r.ok and r.value == r.index * r.index for r in got)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ordered", [False, True])
def test_sync_map_backpressure_pulls_at_most_max_in_flight_ahead(ordered: bool) -> None:
    source = Pulled(oks(300))
    full = source.when_pulled(7)
    with sync_pool() as pool:
        results = pool.map("varied", source, ordered=ordered, max_in_flight=7)
        assert full.wait(30)  # the loop fills the window at once, before any next()
        got = []
        with results:
            while True:
                source.asked += 1
                try:
                    got.append(next(results))
                except StopIteration:
                    break
    assert sorted(r.index for r in got) == list(range(300))
    assert max(source.ahead) == 7


@pytest.mark.timeout(90)
def test_sync_map_close_cancels_and_settles_the_rest() -> None:
    items = [{"kind": "ok", "i": 0}] + [
        {"kind": "stubborn" if i % 3 == 0 else "nap", "i": i} for i in range(1, 500)
    ]
    with sync_pool() as pool:
        with pool.map("varied", items, max_in_flight=5) as results:
            first = next(results)
            procs = pool_processes(pool._pool)  # the reaper, the workers, what they run
        assert first.index == 0
        stats = pool.statistics()  # close returned: all settled
        assert stats.in_flight == 0
        assert stats.queued == 0
        assert stats.submitted <= 6
        assert stats.settled.get("ok") == 1
        assert sum(stats.settled.values()) == stats.submitted
        assert list(results) == []  # closed
    assert alive(procs) == []  # the killed workers and every other process of the pool


@pytest.mark.timeout(60)
def test_sync_map_dropped_after_a_break_cancels_the_rest() -> None:
    items = [{"kind": "ok", "i": 0}] + [{"kind": "nap", "i": i} for i in range(1, 500)]
    with sync_pool() as pool:
        for result in pool.map("varied", items, max_in_flight=5):
            assert result.ok
            break
        wait_idle(pool)  # the naps end only by a cancel
        stats = pool.statistics()
        assert stats.submitted <= 6
        assert stats.settled.get("ok") == 1
        assert cancelled(stats.settled) == stats.submitted - 1


@pytest.mark.timeout(90)
def test_sync_map_failures_and_crashes_are_results() -> None:
    kinds = ["ok", "fail", "exit", "segv", "kill"] * 3
    items = [{"kind": k, "i": i} for i, k in enumerate(kinds)]
    expected = {
        "ok": Outcome.OK,
        "fail": Outcome.ERROR,
        "exit": Outcome.WORKER_LOST,
        "segv": Outcome.WORKER_LOST,
        "kill": Outcome.WORKER_LOST,
    }
    with sync_pool() as pool, pool.map("varied", items, ordered=True) as results:
        outcomes = [r.outcome for r in results]
    assert outcomes == [expected[k] for k in kinds]


@pytest.mark.timeout(30)
def test_sync_map_errors() -> None:
    with sync_pool(workers=1) as pool:
        with pytest.raises(toolpool.UnknownToolError):
            pool.map("nope", [{}])
        with pytest.raises(ValueError, match="max_in_flight"):
            pool.map("square", [{}], max_in_flight=0)
        with pytest.raises(TypeError, match="not one mapping"):
            pool.map("square", {"i": 1})  # type: ignore[arg-type]
        got = []
        # ("x" is no mapping: a bad item for "varied", of several parameters; "square", of
        # one, would take it as its value.)
        with pytest.raises(TypeError, match="args at index 2"):
            got.extend(pool.map("varied", [{"kind": "ok", "i": 4}, None, "x"]))
        # (None is "no arguments": varied then fails in the worker, a result like any other.)
        assert [r.value for r in got if r.ok] == [4]
        assert [r.outcome for r in got if not r.ok] == [Outcome.ERROR]
        assert pool.statistics().submitted == 2
    with pytest.raises(toolpool.PoolClosedError):
        pool.map("square", [{}])


@pytest.mark.timeout(60)
def test_sync_pool_close_ends_a_map_still_running() -> None:
    pool = sync_pool()
    with pool:
        results = pool.map("varied", oks(10_000), max_in_flight=3)
        first = next(results)
    # The pool closed with the map half-way: what it had out is returned (nothing lost),
    # then PoolClosedError.
    rest = []
    with pytest.raises(toolpool.PoolClosedError):
        rest.extend(results)
    assert first.ok
    submitted = pool.statistics().submitted
    assert submitted <= 1 + 3
    assert len(rest) == submitted - 1
    assert sorted(r.index for r in [first, *rest]) == list(range(submitted))


@pytest.mark.timeout(30)
def test_the_loop_thread_pulls_and_the_consumer_thread_gets_results() -> None:
    """The documented split: the iterable runs in the loop's thread, not the caller's."""
    threads = set()

    def source() -> Iterator[dict[str, Any]]:
        for i in range(5):
            threads.add(threading.get_ident())
            yield {"i": i}

    with sync_pool(workers=1) as pool:
        assert sorted(r.value for r in pool.map("square", source())) == [0, 1, 4, 9, 16]
    assert threads
    assert threading.get_ident() not in threads


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_in_flight", [1, 2, 7])
def test_sync_map_hands_over_through_a_narrow_window(max_in_flight: int) -> None:
    """A window so narrow that the loop waits for the consumer's credit over and over: each
    hand-over, in both directions, races the other thread (a lost wake-up hangs here)."""
    n = 3000
    with sync_pool() as pool:
        for ordered in (False, True):
            source = Pulled(oks(n))
            with pool.map("varied", source, ordered=ordered, max_in_flight=max_in_flight) as m:
                got = []
                for _ in range(n + 1):
                    source.asked += 1
                    result = next(m, None)
                    if result is None:
                        break
                    got.append(result.index)
            assert sorted(got) == list(range(n))
            if ordered:
                assert got == list(range(n))
            assert max(source.ahead) <= max_in_flight


@pytest.mark.timeout(60)
def test_sync_map_items_are_the_value_of_a_one_parameter_tool() -> None:
    with sync_pool(workers=1) as pool, pool.map("square", range(5), ordered=True) as results:
        assert [r.value for r in results] == [0, 1, 4, 9, 16]
