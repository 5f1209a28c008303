"""Providers at runtime (issue 17, seed 002): added, removed, reloaded and resized while the
pool serves, with the lifecycle events consumers mirror. Real worker processes and sockets.

Every test closes its pool and checks that nothing of it is left (the reaper's tree gone).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import toolpool
from pool_support import alive, pool_processes
from toolpool import Outcome

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60, method="thread")]

ALPHA = "provider_tools:alpha"
BETA = "provider_tools:beta"
CLASH = "provider_tools:clash"
VERSIONED = "provider_tools:versioned"
DISPOSED = {"kind": "disposed"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def empty_pool(**kwargs: Any) -> AsyncIterator[toolpool.Pool]:
    """A pool started with no provider; after it closes, none of its processes is left."""
    kwargs.setdefault("cancel_grace", 0.5)
    kwargs.setdefault("term_grace", 0.5)
    pool = toolpool.Pool(**kwargs)
    async with pool:
        yield pool
        procs = pool_processes(pool)
    with anyio.fail_after(10):
        while alive(procs):
            await anyio.sleep(0.02)  # (the reaper's own exit: no event to await)


class Recorder:
    """A listener that keeps what it was told, in order."""

    def __init__(self, fail_on: type | None = None) -> None:
        self.events: list[Any] = []
        self.fail_on = fail_on

    def __call__(self, event: Any) -> None:
        self.events.append(event)
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        if self.fail_on is not None and isinstance(event, self.fail_on):
            raise RuntimeError(f"listener refuses {type(event).__name__}")

    _changed: anyio.Event | None = None

    async def until(self, count: int, kind: type) -> list[Any]:
        """Wait until ``count`` events of ``kind`` came; return them."""
        while True:
            found = [e for e in self.events if isinstance(e, kind)]
            if len(found) >= count:
                return found
            self._changed = anyio.Event()
            await self._changed.wait()

    def events_of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def kinds(self, *types: type) -> list[tuple[str, str]]:
        out = []
        for e in self.events:
            if types and not isinstance(e, types):
                continue
            name = getattr(e, "name", None) or getattr(getattr(e, "provider", None), "name", "")
            out.append((type(e).__name__, str(name)))
        return out


async def test_a_pool_with_no_provider_then_two_added() -> None:
    seen = Recorder()
    async with empty_pool() as pool:
        assert dict(pool.providers) == {}
        assert dict(pool.catalog) == {}
        with pytest.raises(toolpool.UnknownToolError):
            pool.submit("a_echo", {"value": 1})
        pool.subscribe(seen)
        info = await pool.add_provider("alpha", ALPHA, workers=2)
        assert info.name == "alpha"
        assert info.workers == 2
        assert info.generation == 1
        assert set(info.tools) == {"a_echo", "a_nap"}
        await pool.add_provider("beta", BETA, workers=1, profile="untrusted")
        assert set(pool.providers) == {"alpha", "beta"}
        catalog = pool.catalog
        assert catalog["a_echo"]["provider"] == "alpha"
        assert catalog["b_echo"]["provider"] == "beta"
        assert (await pool.call("a_echo", {"value": 7})).value == 7
        assert (await pool.call("b_echo", {"value": 8})).value == 8
        # The facts of where each tool runs come from its provider's containment.
        beta_runs = catalog["b_echo"]["runs_in"]
        alpha_runs = catalog["a_echo"]["runs_in"]
        assert alpha_runs["profile"] == "default"
        assert beta_runs["profile"] == "untrusted"
        assert alpha_runs["network"] == "host"
        expected_net = "none" if pool.containment("beta").active("netns") else "host"
        assert beta_runs["network"] == expected_net
    started = [e for e in seen.events if isinstance(e, toolpool.WorkerStarted)]
    assert sorted(e.provider for e in started) == ["alpha", "alpha", "beta"]
    exited = [e for e in seen.events if isinstance(e, toolpool.WorkerExited)]
    assert sorted((e.provider, e.why) for e in exited) == [
        ("alpha", "retired"),
        ("alpha", "retired"),
        ("beta", "retired"),
    ]
    assert {e.pid for e in exited} == {e.pid for e in started}
    adds = seen.kinds(toolpool.ProviderAdded, toolpool.ProviderRemoved)
    assert adds == [
        ("ProviderAdded", "alpha"),
        ("ProviderAdded", "beta"),
        ("ProviderRemoved", "alpha"),
        ("ProviderRemoved", "beta"),
    ]
    # Each add is announced after its workers started, and followed by the new catalog.
    first_add = next(i for i, e in enumerate(seen.events) if isinstance(e, toolpool.ProviderAdded))
    assert isinstance(seen.events[first_add - 1], toolpool.WorkerStarted)
    changed = seen.events[first_add + 1]
    assert isinstance(changed, toolpool.ToolsChanged)
    assert set(changed.catalog) == {"a_echo", "a_nap"}
    assert [e.reason for e in seen.events if isinstance(e, toolpool.ProviderRemoved)] == [
        "closed",
        "closed",
    ]


async def test_a_failing_add_listener_rolls_the_add_back() -> None:
    first, refusing, last = Recorder(), Recorder(fail_on=toolpool.ProviderAdded), Recorder()
    async with empty_pool() as pool:
        await pool.add_provider("beta", BETA, workers=1)
        pool.subscribe(first)
        unsubscribe = pool.subscribe(refusing)
        pool.subscribe(last)
        with pytest.raises(RuntimeError, match="listener refuses ProviderAdded"):
            await pool.add_provider("alpha", ALPHA, workers=2)
        # The catalog is as before; its workers are gone.
        assert set(pool.catalog) == {"b_echo"}
        assert set(pool.providers) == {"beta"}
        with pytest.raises(toolpool.UnknownToolError):
            pool.submit("a_echo", {"value": 1})
        assert len(pool.worker_pids) == 1
        # Whoever saw it added sees it removed, "rolled back"; whoever did not, neither.
        assert first.kinds(toolpool.ProviderAdded, toolpool.ProviderRemoved) == [
            ("ProviderAdded", "alpha"),
            ("ProviderRemoved", "alpha"),
        ]
        removed = [e for e in first.events if isinstance(e, toolpool.ProviderRemoved)]
        assert removed[0].reason == "rolled back"
        assert refusing.kinds(toolpool.ProviderAdded, toolpool.ProviderRemoved) == [
            ("ProviderAdded", "alpha")
        ]
        assert last.kinds(toolpool.ProviderAdded, toolpool.ProviderRemoved) == []
        # The same add succeeds once the refusing listener is gone.
        unsubscribe()
        await pool.add_provider("alpha", ALPHA, workers=1)
        assert (await pool.call("a_echo", {"value": 3})).value == 3


async def test_a_failing_remove_listener_is_isolated(caplog: pytest.LogCaptureFixture) -> None:
    refusing, other = Recorder(fail_on=toolpool.ProviderRemoved), Recorder()
    async with empty_pool() as pool:
        await pool.add_provider("alpha", ALPHA, workers=1)
        pool.subscribe(refusing)
        pool.subscribe(other)
        with caplog.at_level(logging.ERROR, logger="toolpool.events"):
            await pool.remove_provider("alpha")
        assert set(pool.providers) == set()
        assert dict(pool.catalog) == {}
        assert ("ProviderRemoved", "alpha") in other.kinds(toolpool.ProviderRemoved)
        assert ("ProviderRemoved", "alpha") in refusing.kinds(toolpool.ProviderRemoved)
        assert any("listener raised on ProviderRemoved" in r.getMessage() for r in caplog.records)
        assert any(r.exc_info for r in caplog.records), "logged without its traceback"
        assert pool.worker_pids == []


async def test_replay_hands_a_late_subscriber_the_providers_there_are() -> None:
    async with empty_pool() as pool:
        await pool.add_provider("alpha", ALPHA, workers=1)
        await pool.add_provider("beta", BETA, workers=1)
        late = Recorder()
        pool.subscribe(late, replay=True)
        assert late.kinds() == [
            ("ProviderAdded", "alpha"),
            ("ProviderAdded", "beta"),
            ("ToolsChanged", ""),
        ]
        assert set(late.events[-1].catalog) == {"a_echo", "a_nap", "b_echo"}
        no_replay = Recorder()
        pool.subscribe(no_replay)
        assert no_replay.events == []


async def test_a_conflicting_tool_name_changes_nothing() -> None:
    seen = Recorder()
    async with empty_pool() as pool:
        await pool.add_provider("alpha", ALPHA, workers=1)
        pool.subscribe(seen)
        before = dict(pool.catalog)
        with pytest.raises(toolpool.ToolConflictError) as info:
            await pool.add_provider("other", CLASH, workers=1)
        text = str(info.value)
        assert "'a_echo'" in text
        assert "'other'" in text
        assert "'alpha'" in text
        assert dict(pool.catalog).keys() == before.keys()
        assert set(pool.providers) == {"alpha"}
        assert not any(
            isinstance(e, toolpool.ProviderAdded | toolpool.ProviderRemoved) for e in seen.events
        )
        with pytest.raises(toolpool.UnknownToolError):
            pool.submit("c_only", {"value": 1})
        assert len(pool.worker_pids) == 1


async def test_bad_provider_arguments_are_clear_errors() -> None:
    async with empty_pool() as pool:
        await pool.add_provider("alpha", ALPHA, workers=1)
        with pytest.raises(ValueError, match="exists"):
            await pool.add_provider("alpha", BETA, workers=1)
        with pytest.raises(toolpool.ConfigurationError, match="module:attribute"):
            await pool.add_provider("x", "no-colon", workers=1)
        with pytest.raises(ValueError, match="workers"):
            await pool.add_provider("x", BETA, workers=0)
        with pytest.raises(LookupError, match="no provider named 'nope'"):
            await pool.remove_provider("nope")
        with pytest.raises(LookupError):
            await pool.resize("nope", 2)
        with pytest.raises(toolpool.WorkerStartError):
            await pool.add_provider("broken", "provider_tools:no_such_registry", workers=1)
        assert set(pool.providers) == {"alpha"}
        assert (await pool.call("a_echo", {"value": 1})).value == 1


async def test_a_call_queued_across_a_removal_is_never_sent_and_running_ones_drain() -> None:
    async with empty_pool(drain_grace=0.3) as pool:
        await pool.add_provider("alpha", ALPHA, workers=1, prefetch=0)
        running = pool.submit("a_nap", {"seconds": 30})
        await running.wait_started()
        queued = pool.submit("a_echo", {"value": 1})
        await pool.remove_provider("alpha")
        q = await queued
        assert q.outcome is Outcome.ABORTED_BEFORE_DISPATCH
        assert q.cause == DISPOSED
        assert q.body_started is False
        r = await running
        # It had drain_grace to finish, then a cooperative cancel with cause disposed.
        assert r.outcome is Outcome.ABORTED
        assert r.cause == DISPOSED
        assert r.timeline.cancel_requested is not None
        assert r.timeline.cancel_requested - r.timeline.submitted >= 0.3
        with pytest.raises(toolpool.UnknownToolError):
            pool.submit("a_echo", {"value": 2})
        assert pool.worker_pids == []


async def test_a_drained_call_that_finishes_in_time_returns_ok() -> None:
    async with empty_pool(drain_grace=20) as pool:
        await pool.add_provider("alpha", ALPHA, workers=1, prefetch=0)
        running = pool.submit("a_nap", {"seconds": 0.5})
        await running.wait_started()
        await pool.remove_provider("alpha")
        result = await running
        assert result.outcome is Outcome.OK
        assert result.value == "slept"


async def test_reload_under_load_loses_no_call_and_never_misses_the_tool(
    tmp_path: Path,
) -> None:
    version = tmp_path / "version"
    version.write_text("v1")
    env = {**os.environ, "TP_VERSION_FILE": str(version)}
    results: list[toolpool.Result] = []
    by_task: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    seen = Recorder()
    async with empty_pool() as pool:
        await pool.add_provider("v", VERSIONED, workers=2, env=env)
        pool.subscribe(seen)
        old_pids = set(pool.worker_pids)
        stop = anyio.Event()

        async def load(offset: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    result = await pool.call("version", {"value": offset + i})
                except Exception as exc:  # an UnknownToolError here is the bug under test
                    errors.append(exc)
                else:
                    results.append(result)
                    if result.outcome is Outcome.OK:
                        by_task.setdefault(offset, []).append(result.value["version"])
                i += 1
                if i % 10 == 0:
                    await anyio.sleep(0)

        async with anyio.create_task_group() as tg:
            for k in range(4):
                tg.start_soon(load, k * 1_000_000)
            version.write_text("v2")
            info = await pool.reload_provider("v")
            assert info.generation == 2
            # Calls go on after the swap, on the new generation only.
            n = len(results)
            with anyio.fail_after(20):
                while len(results) < n + 20:
                    await anyio.sleep(0.01)
            stop.set()
        assert errors == []
        assert all(r.outcome is Outcome.OK for r in results), [
            r for r in results if r.outcome is not Outcome.OK
        ][:3]
        values = [r.value["value"] for r in results]
        assert len(values) == len(set(values)), "a call ran twice"
        versions = [r.value["version"] for r in results]
        assert versions[-1] == "v2"
        assert "v1" in versions
        # Once a call got v2, none after it (in the same task) got v1 again: the swap is one
        # moment, not a mix.
        for versions_seen in by_task.values():
            first_v2 = versions_seen.index("v2")
            assert set(versions_seen[first_v2:]) == {"v2"}
        assert set(pool.worker_pids).isdisjoint(old_pids)
        kinds = seen.kinds(toolpool.ProviderAdded, toolpool.ProviderRemoved)
        assert kinds == [("ProviderRemoved", "v"), ("ProviderAdded", "v")]
        removed = [e for e in seen.events if isinstance(e, toolpool.ProviderRemoved)]
        assert removed[0].reason == "reloaded"
        for old in old_pids:
            assert not psutil.pid_exists(old) or psutil.Process(old).status() == "zombie"


async def test_resize_up_and_down_under_load_loses_and_repeats_no_call() -> None:
    results: list[toolpool.Result] = []
    async with empty_pool() as pool:
        await pool.add_provider("alpha", ALPHA, workers=1)
        stop = anyio.Event()

        async def load(offset: int) -> None:
            i = 0
            while not stop.is_set():
                results.append(await pool.call("a_echo", {"value": offset + i}))
                i += 1
                if i % 10 == 0:
                    await anyio.sleep(0)

        async with anyio.create_task_group() as tg:
            for k in range(4):
                tg.start_soon(load, k * 1_000_000)
            await pool.resize("alpha", 3)
            assert len(pool.worker_pids) == 3
            assert pool.providers["alpha"].workers == 3
            await pool.resize("alpha", 1)
            assert len(pool.worker_pids) == 1
            await pool.resize("alpha", 2)
            assert len(pool.worker_pids) == 2
            n = len(results)
            with anyio.fail_after(20):
                while len(results) < n + 20:
                    await anyio.sleep(0.01)
            stop.set()
        assert all(r.outcome is Outcome.OK for r in results)
        values = [r.value for r in results]
        assert len(values) == len(set(values)), "a call ran twice"
        stats = pool.statistics()
        assert stats.settled.get("ok") == len(results)


async def test_shrinking_drains_a_busy_worker_unless_forced() -> None:
    async with empty_pool() as pool:
        await pool.add_provider("alpha", ALPHA, workers=2, prefetch=0)
        long = pool.submit("a_nap", {"seconds": 0.5})
        await long.wait_started()
        await pool.resize("alpha", 1)  # the idle one goes first: the busy one serves on
        assert (await long).outcome is Outcome.OK
        a = pool.submit("a_nap", {"seconds": 30})
        await a.wait_started()
        await pool.resize("alpha", 2)
        b = pool.submit("a_nap", {"seconds": 30})
        await b.wait_started()
        await pool.resize("alpha", 1, force=True)
        # One worker went, and its call with it (cancelled, cause disposed); the other runs on.
        done = [c for c in (a, b) if c.done()]
        assert len(done) == 1
        assert done[0].result().outcome is Outcome.ABORTED
        assert done[0].result().cause == DISPOSED
        other = b if done[0] is a else a
        assert not other.done()
        other.cancel()
        assert (await other).cause == {"kind": "user"}


async def test_the_default_provider_of_a_pool_given_tools() -> None:
    seen = Recorder()
    async with toolpool.Pool(ALPHA, workers=1) as pool:
        assert set(pool.providers) == {"default"}
        pool.subscribe(seen, replay=True)
        assert seen.kinds(toolpool.ProviderAdded) == [("ProviderAdded", "default")]
        assert pool.catalog["a_echo"]["provider"] == "default"
        await pool.add_provider("beta", BETA, workers=1)
        assert (await pool.call("b_echo", {"value": 2})).value == 2
        assert (await pool.call("a_echo", {"value": 3})).value == 3


async def test_autoscale_grows_under_load_and_shrinks_when_idle() -> None:
    seen = Recorder()
    async with empty_pool() as pool:
        await pool.add_provider("alpha", ALPHA, workers=1, prefetch=0)
        pool.subscribe(seen)
        with pytest.raises(ValueError, match="at least min"):
            await pool.autoscale("alpha", min=3, max=2)
        await pool.autoscale("alpha", min=1, max=3, grow_after=0.05, idle_after=0.3)
        # Four long calls on one worker: three wait, so it grows to its max (not beyond).
        calls = [pool.submit("a_nap", {"seconds": 30}) for _ in range(4)]
        with anyio.fail_after(30):
            grown = await seen.until(2, toolpool.ProviderResized)
            for call in calls[:3]:  # (queued in order: the first three get the workers)
                await call.wait_started()
        assert pool.providers["alpha"].workers == 3
        assert [(e.old, e.new) for e in grown] == [(1, 2), (2, 3)]
        assert all("waited" in e.reason for e in grown)
        assert not calls[3].started
        for call in calls:
            call.cancel()
        for call in calls:
            await call
        # Idle now: back to its minimum, one worker at a time.
        with anyio.fail_after(30):
            resized = await seen.until(4, toolpool.ProviderResized)
            await seen.until(2, toolpool.WorkerExited)
        assert [(e.old, e.new) for e in resized[2:]] == [(3, 2), (2, 1)]
        assert all("idle" in e.reason for e in resized[2:])
        assert pool.providers["alpha"].workers == 1
        assert len(pool.worker_pids) == 1
        # A resize by hand ends autoscaling.
        await pool.resize("alpha", 2)
        busy = [pool.submit("a_nap", {"seconds": 30}) for _ in range(3)]
        with anyio.fail_after(30):
            for call in busy[:2]:
                await call.wait_started()
        # The third waits well past grow_after, and nothing grows the provider any more.
        with anyio.move_on_after(0.5):
            await busy[2].wait_started()
        assert not busy[2].started
        assert pool.providers["alpha"].workers == 2
        assert len(seen.events_of(toolpool.ProviderResized)) == 5  # (4, and the resize by hand)
        for call in busy:
            call.cancel()


async def test_worker_events_say_why_a_worker_went() -> None:
    seen = Recorder()
    async with empty_pool() as pool:
        pool.subscribe(seen)
        await pool.add_provider("ex", "toolpool.testing.examples:registry", workers=1)
        first = pool.worker_pids[0]
        crashed = await pool.call("crash", {"code": 3})
        assert crashed.outcome is Outcome.WORKER_LOST
        killed = pool.submit("busy_loop", {"seconds": 60})
        await killed.wait_started()
        second = pool.worker_pids[0]
        killed.cancel(force=True)
        assert (await killed).outcome is Outcome.KILLED
        with anyio.fail_after(20):
            exits = await seen.until(2, toolpool.WorkerExited)
        assert [(e.pid, e.why) for e in exits[:2]] == [(first, "crashed"), (second, "killed")]
        assert all(e.provider == "ex" for e in exits)
        with anyio.fail_after(20):
            await seen.until(3, toolpool.WorkerStarted)  # the replacements
