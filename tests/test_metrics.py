"""toolpool.metrics: a real pool's state and history, scraped and parsed by prometheus_client's
own text parser, and checked value by value."""

from __future__ import annotations

import bisect
import gc
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import toolpool
import toolpool.metrics
from pool_support import Readiness, running_pool
from toolpool.supervisor.machine import KILL_TO_REAPED_BOUNDS, SETTLE_LATENCY_BOUNDS

pytestmark = pytest.mark.anyio

LABELS = {"pool": "test"}


def scrape(registry: CollectorRegistry) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> (its labels but the collector's own ``pool``, sorted) -> value."""
    text = generate_latest(registry).decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("pool") == "test", sample
            out.setdefault(sample.name, {})[tuple(sorted(labels.items()))] = sample.value
    return out


def one(samples: dict[tuple[tuple[str, str], ...], float], **labels: str) -> float:
    return samples[tuple(sorted({"provider": "default", **labels}.items()))]


def expected_buckets(values: list[float], bounds: tuple[float, ...]) -> list[int]:
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    total, out = 0, []
    for n in counts:
        total += n
        out.append(total)
    return out


def histogram(samples: dict[str, Any], name: str, bounds: tuple[float, ...]) -> list[float]:
    buckets = samples[f"{name}_bucket"]
    got = []
    for bound in (*bounds, float("inf")):
        le = "+Inf" if bound == float("inf") else toolpool.metrics._go_float(bound)
        got.append(buckets[(("le", le), ("provider", "default"))])
    return got


async def wait_for_workers(pool: toolpool.Pool, state: str, n: int) -> None:
    with anyio.fail_after(30):
        while pool.statistics().workers.get(state, 0) != n:
            await pool._wait_changed()


@pytest.mark.timeout(90)
async def test_a_scrape_reports_what_the_pool_did_value_by_value() -> None:
    registry = CollectorRegistry()
    results: list[toolpool.Result] = []
    async with running_pool(workers=2, prefetch=0) as pool:
        collector = toolpool.metrics.register(pool, registry, labels=LABELS)
        for i in range(3):
            results.append(await pool.call("echo", {"value": i}))
        results.append(await pool.call("fail", {"message": "no"}))
        async with Readiness.open() as ready:
            call = pool.submit("ready_nap", {"ready": ready.path, "seconds": 600})
            [killed_pid] = (await ready.started())[:1]
            call.cancel(force=True)
            results.append(await call)
        await wait_for_workers(pool, "ready", 2)  # the killed worker's replacement

        assert [r.outcome.value for r in results] == ["ok"] * 3 + ["error", "killed"]
        assert results[-1].worker_pid == killed_pid
        m = scrape(registry)
        settled = m["toolpool_calls_settled_total"]
        assert one(settled, tool="echo", outcome="ok") == 3
        assert one(settled, tool="fail", outcome="error") == 1
        assert one(settled, tool="ready_nap", outcome="killed") == 1
        assert len(settled) == 3  # no other (tool, outcome) was reported
        assert one(m["toolpool_calls_submitted_total"]) == 5
        escalations = m["toolpool_escalations_total"]
        assert one(escalations, rung="sigkill") == 1
        assert one(escalations, rung="sigterm") == one(escalations, rung="cancel") == 0
        workers = m["toolpool_workers"]
        assert one(workers, state="ready") == 2
        assert one(workers, state="busy") == one(workers, state="unkillable") == 0
        assert one(m["toolpool_workers_started_total"]) == 3
        assert one(m["toolpool_workers_replaced_total"]) == 1
        assert one(m["toolpool_workers_unkillable_total"]) == 0
        assert one(m["toolpool_unkillable_processes"]) == 0
        assert one(m["toolpool_queue_depth"]) == 0
        assert one(m["toolpool_oldest_queued_wait_seconds"]) == 0
        assert one(m["toolpool_calls_in_flight"]) == 0

        # The settle latencies: each call's submission-to-settlement, in its bucket.
        durations = [r.duration() for r in results]
        assert histogram(m, "toolpool_settle_latency_seconds", SETTLE_LATENCY_BOUNDS) == (
            expected_buckets(durations, SETTLE_LATENCY_BOUNDS)
        )
        assert one(m["toolpool_settle_latency_seconds_count"]) == 5
        assert one(m["toolpool_settle_latency_seconds_sum"]) == pytest.approx(sum(durations))
        # One tree killed: its SIGKILL to its reaping, at most the call's own sigkill-to-reaped
        # span (the kill was asked for when the call's sigkill step was recorded).
        kill = m["toolpool_kill_to_reaped_seconds_count"]
        assert one(kill) == 1
        timeline = results[-1].timeline
        assert timeline.sigkill is not None
        assert timeline.reaped is not None
        span = timeline.reaped - timeline.sigkill
        assert one(m["toolpool_kill_to_reaped_seconds_sum"]) == pytest.approx(span)
        assert histogram(m, "toolpool_kill_to_reaped_seconds", KILL_TO_REAPED_BOUNDS) == (
            expected_buckets([span], KILL_TO_REAPED_BOUNDS)
        )

        # Queued calls: both workers busy, a third call waits in the pool's queue.
        async with Readiness.open() as ready:
            busy = [
                pool.submit("ready_nap", {"ready": ready.path, "seconds": 600}) for _ in range(2)
            ]
            for _ in busy:
                await ready.started()
            waiting = pool.submit("echo", {"value": "late"})
            m = scrape(registry)
            assert one(m["toolpool_queue_depth"]) == 1
            assert one(m["toolpool_calls_in_flight"]) == 2
            assert one(m["toolpool_workers"], state="busy") == 2
            assert one(m["toolpool_oldest_queued_wait_seconds"]) > 0
            for c in busy:
                c.cancel()
            assert (await waiting).value == "late"
            assert {(await c).outcome.value for c in busy} == {"aborted"}
        m = scrape(registry)
        assert one(m["toolpool_escalations_total"], rung="cancel") == 2
        assert one(m["toolpool_calls_settled_total"], tool="ready_nap", outcome="aborted") == 2

    # Closed: no worker, and what it did stays.
    m = scrape(registry)
    assert sum(m["toolpool_workers"].values()) == 0
    assert one(m["toolpool_calls_settled_total"], tool="echo", outcome="ok") == 4
    registry.unregister(collector)
    assert "toolpool_workers" not in scrape(registry)


async def test_pools_share_a_registry_by_their_labels_and_are_held_weakly() -> None:
    registry = CollectorRegistry()
    pool = toolpool.Pool("pool_support:registry", workers=1)  # never started
    collector = toolpool.metrics.register(pool, registry, labels=LABELS)
    m = scrape(registry)
    assert one(m["toolpool_workers"], state="ready") == 0
    assert one(m["toolpool_calls_submitted_total"]) == 0
    with pytest.raises(ValueError, match="already"):  # the same series twice
        toolpool.metrics.register(pool, registry, labels={"pool": "again"})
    with pytest.raises(ValueError, match="already"):
        toolpool.metrics.register(toolpool.Pool("x:y"), registry, labels=LABELS)
    with pytest.raises(ValueError, match="not this collector's"):
        toolpool.metrics.register(toolpool.Pool("x:y"), registry, labels={"other": "a"})
    second = toolpool.Pool("pool_support:registry", workers=1)
    assert toolpool.metrics.register(second, registry, labels={"pool": "second"}) is collector
    text = generate_latest(registry).decode()
    pools = {
        s.labels["pool"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "toolpool_calls_submitted_total"
    }
    assert pools == {"test", "second"}
    collector.remove(second)
    del second, pool
    gc.collect()
    assert all(not f.samples for f in collector.collect())  # both gone: no sample
    registry.unregister(collector)
    again = toolpool.Pool("pool_support:registry", workers=1)
    assert toolpool.metrics.register(again, registry, labels=LABELS) is not collector
    assert one(scrape(registry)["toolpool_calls_submitted_total"]) == 0


def test_bad_labels_and_namespaces_are_refused() -> None:
    pool = toolpool.Pool("pool_support:registry", workers=1)
    for bad in ({"provider": "x"}, {"le": "1"}, {"1x": "y"}):
        with pytest.raises(ValueError, match="label name"):
            toolpool.metrics.PoolCollector(pool, labels=bad)
    with pytest.raises(TypeError, match="str value"):
        toolpool.metrics.PoolCollector(pool, labels={"pool": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="namespace"):
        toolpool.metrics.PoolCollector(pool, namespace="a-b")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_each_provider_is_its_own_series_and_a_removed_ones_counters_stay() -> None:
    registry = CollectorRegistry()
    async with toolpool.Pool(cancel_grace=0.5, term_grace=0.5) as pool:
        toolpool.metrics.register(pool, registry, labels=LABELS)
        await pool.add_provider("alpha", "provider_tools:alpha", workers=2)
        await pool.add_provider("beta", "provider_tools:beta", workers=1)
        for i in range(3):
            assert (await pool.call("a_echo", {"value": i})).ok
        assert (await pool.call("b_echo", {"value": 1})).ok
        m = scrape(registry)
        settled = m["toolpool_calls_settled_total"]
        key = (("outcome", "ok"), ("provider", "alpha"), ("tool", "a_echo"))
        assert settled[key] == 3
        assert settled[(("outcome", "ok"), ("provider", "beta"), ("tool", "b_echo"))] == 1
        assert not any(dict(k).get("provider") == "default" for k in settled)
        workers = m["toolpool_workers"]
        assert workers[(("provider", "alpha"), ("state", "ready"))] == 2
        assert workers[(("provider", "beta"), ("state", "ready"))] == 1
        assert m["toolpool_calls_submitted_total"][(("provider", "alpha"),)] == 3
        assert pool.statistics("alpha").submitted == 3
        assert pool.statistics().submitted == 4
        await pool.remove_provider("beta")
        m = scrape(registry)
        # Its counters stay (a counter never goes back); it has no workers any more.
        assert (
            m["toolpool_calls_settled_total"][
                (("outcome", "ok"), ("provider", "beta"), ("tool", "b_echo"))
            ]
            == 1
        )
        assert m["toolpool_workers"][(("provider", "beta"), ("state", "ready"))] == 0
        with pytest.raises(LookupError):
            pool.statistics("nope")
