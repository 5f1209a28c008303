"""The pool end to end: real worker processes, real zmq sockets, real signals (CONTRACT C3-C5).

Every test starts its own pool and checks, after closing it, that no process of the pool is
left (the reaper, the workers, everything they spawned). Tests that need a call's body to be
running before they cancel it use the ``ready_*`` tools of :mod:`pool_support`, which announce
the start of the body over a unix socket: the test awaits that announcement, never a sleep.
"""

from __future__ import annotations

import collections
import math
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import anyio
import anyio.lowlevel
import psutil
import pytest

import toolpool
from pool_support import (
    CANCEL_GRACE,
    EXAMPLES,
    TERM_GRACE,
    TOOLS,
    Readiness,
    alive,
    find_by_marker,
    new_marker,
    pool_processes,
    process_tree,
    running_pool,
    workers_of_reaper,
)
from toolpool import Outcome, Rung
from toolpool.protocol import ByeReport, GoneReport, SpawnedReport

#: A pool that cannot close would hang the event loop's teardown, where the signal method of
#: pytest-timeout cannot reach: the thread method ends the run instead (with every stack).
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30, method="thread")]

USER = {"kind": "user"}
PARENT = {"kind": "parent"}
DISPOSED = {"kind": "disposed"}
TIMEOUT = {"kind": "timeout"}

#: Timestamps are taken in different tasks; allow for clock granularity when comparing.
EPS = 0.05


@pytest.fixture
def anyio_backend() -> str:
    """Pool tests run on asyncio only."""
    return "asyncio"


def assert_tree_gone(procs: list[psutil.Process]) -> None:
    """Every process is gone and reaped: not even a zombie is left."""
    # is_running() is True for a zombie, and False for a pid that was reaped (or reused).
    left = alive(procs)
    assert left == [], f"still there: {left}"


def assert_in_order(result: toolpool.Result, *steps: str) -> None:
    """The named timeline steps were all reached, in this order."""
    times = [getattr(result.timeline, step) for step in steps]
    assert None not in times, result.timeline
    assert times == sorted(times), result.timeline


def hold_spawn_reports(monkeypatch: pytest.MonkeyPatch, until: Any) -> dict[int, Any]:
    """The reaper's report of a new worker (its pid, how it started it) reaches the pool only
    once ``until(worker)`` returns, so the worker's hello can come first (as seen under load).
    Returns, by worker id, an event set once its held report was handled."""
    import toolpool.supervisor._pool as pool_module

    handle = pool_module.Pool._on_reaper_event
    held: dict[int, anyio.Event] = {}

    def late(pool: Any, report: Any) -> None:
        w = pool._core.workers.get(getattr(report, "wid", None))
        if type(report) is not SpawnedReport or w is None:
            handle(pool, report)
            return
        handled = held[w.wid] = anyio.Event()

        async def later() -> None:
            await until(pool, w)
            handle(pool, report)
            handled.set()

        pool._tg.start_soon(later)

    monkeypatch.setattr(pool_module.Pool, "_on_reaper_event", late)
    return held


async def test_start_returns_once_the_reaper_reported_every_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """start() returns only when every worker said hello and the reaper said which process it
    is and how it started it, in whichever order they came."""

    async def some_turns_after_hello(pool: Any, w: Any) -> None:
        while not w.answered:
            await pool._wait_changed()
        for _ in range(20):
            await anyio.lowlevel.checkpoint()

    held = hold_spawn_reports(monkeypatch, some_turns_after_hello)
    async with toolpool.Pool(TOOLS, workers=2) as pool:
        assert len(held) == 2  # both reports came after the hellos
        pids = pool.worker_pids
        assert len(pids) == 2
        assert all(psutil.pid_exists(pid) for pid in pids)
        assert pool.worker_start_methods == dict.fromkeys(pids, "fork")


async def test_a_call_served_before_the_reaper_reported_its_worker_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replacement can serve before the reaper's report of it arrives: its result still
    names the worker's pid (the one the kernel vouched for at its hello), and its calls are
    not taken for leftovers of themselves (the worker in its own cgroup)."""
    released = anyio.Event()
    replacing = False

    async def until_released(pool: Any, w: Any) -> None:
        if replacing:  # not the first worker's: the replacement's
            await released.wait()

    held = hold_spawn_reports(monkeypatch, until_released)  # the reaper's handler is bound
    async with toolpool.Pool(EXAMPLES, workers=1, warm_spares=0) as pool:
        (first,) = pool.worker_pids
        held.clear()
        replacing = True
        os.kill(first, signal.SIGKILL)
        with anyio.fail_after(20):
            result = await pool.call("pid")
        (replacement,) = held  # it served with its report held back
        assert result.ok, result
        assert result.worker_pid == result.value != first
        assert result.leftovers_killed == 0
        assert pool.worker_start_methods == {}
        released.set()
        with anyio.fail_after(20):
            # The report itself: a call cannot stand for the loop turning (under load its
            # result can be there already when the send returns, and be read at once).
            await held[replacement].wait()
            again = await pool.call("pid")
        assert again.value == result.value
        assert pool.worker_start_methods == {result.value: "fork"}


async def test_a_call_settled_before_its_timeout_is_not_kept_until_then() -> None:
    """A batch of calls with a long timeout that settle at once: once nobody holds them,
    neither the calls nor their results may stay alive until their deadlines (an hour here)."""
    import gc

    async with running_pool(EXAMPLES, workers=1) as pool:
        calls = [pool.submit("echo", {"value": "x" * 1000}, timeout=3600) for _ in range(300)]
        ids = {call.id for call in calls}
        with anyio.fail_after(20):
            for call in calls:
                assert (await call).ok
        del calls, call
        gc.collect()
        kept = [o for o in gc.get_objects() if isinstance(o, toolpool.Call) and o.id in ids]
        assert kept == []
        # Nor do their deadlines pile up: the pool drops those of settled calls as it goes.
        for _ in range(5):
            with anyio.fail_after(20):
                for call in [pool.submit("noop", timeout=3600) for _ in range(600)]:
                    await call
        assert len(pool._core.timers) < 1024 + 3 * 600  # of 3,300 set, all settled
        # The pool still times out a call that runs past its deadline.
        with anyio.fail_after(20):
            late = await pool.call("nap", {"seconds": 30}, timeout=0.2)
        assert late.outcome is Outcome.TIMEOUT, late


# =========================================================================== C3 outcomes


async def test_a_result_or_context_the_wire_cannot_carry_is_an_error_not_a_dead_worker() -> None:
    """A result with a map key msgpack packs but the protocol refuses (an int), or a context
    entry that cannot be carried at all: before, the worker sent them, the supervisor took it
    for a protocol violator and killed it (worker_lost). Each call, alone or queued up in the
    worker (its lane), settles with its own outcome, and the worker serves on."""
    async with running_pool(workers=1) as pool:
        (pid,) = pool.worker_pids
        calls = [pool.submit("int_keyed") for _ in range(3)]
        calls.append(pool.submit("unserializable_context"))
        with anyio.fail_after(20):
            results = [await call for call in calls]
        for result in results[:3]:
            assert result.outcome is Outcome.ERROR, result
            assert result.error_name == "UnserializableResult"
        noted = results[3]
        assert noted.ok, noted
        assert noted.value == "returned"
        assert noted.context["fine"] == [1, "two"]
        assert noted.context["int_keyed"].startswith("<not serializable: ")
        assert noted.context["looped"].startswith("<not serializable: ")
        assert pool.worker_pids == [pid]
        assert pool.statistics().workers_replaced == 0


async def test_outcome_ok() -> None:
    async with running_pool(EXAMPLES) as pool:
        result = await pool.call("echo", {"value": {"a": [1, 2, "three"]}})
        assert result.outcome is Outcome.OK
        assert result.ok
        assert result.value == {"a": [1, 2, "three"]}
        assert result.error is None
        assert result.body_started is True
        assert result.rung is Rung.NONE
        assert result.cause is None
        assert result.worker_pid in pool.worker_pids
        assert result.exit_code is None
        assert result.exit_signal is None
        assert_in_order(result, "submitted", "dispatched", "started", "returned", "settled")
        assert result.timeline.reaped is None
        assert result.timeline.cancel_requested is None


async def test_outcome_error() -> None:
    async with running_pool(EXAMPLES) as pool:
        result = await pool.call("fail", {"message": "kaboom"})
        assert result.outcome is Outcome.ERROR
        assert result.body_started is True
        assert result.rung is Rung.NONE
        assert result.error is not None
        assert "kaboom" in result.error
        assert result.error_name == "RuntimeError"
        # An error is an ordinary result: the worker is still serving.
        again = await pool.call("pid")
        assert again.ok
        assert again.value == result.worker_pid


async def test_outcome_error_for_args_the_tool_rejects() -> None:
    async with running_pool(EXAMPLES) as pool:
        result = await pool.call("nap", {"seconds": "soon"})
        assert result.outcome is Outcome.ERROR
        assert result.body_started is False
        assert result.rung is Rung.NONE
        assert result.timeline.started is None


async def test_outcome_aborted_before_dispatch_while_queued() -> None:
    # prefetch=0: the call waits in the pool's own queue (test_prefetch.py: in a worker's).
    async with Readiness.open() as ready, running_pool(workers=1, prefetch=0) as pool:
        blocker = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
        await ready.started()
        queued = pool.submit("echo", {"value": 1})
        assert pool.statistics().queued == 1
        queued.cancel()
        # C4.4: settled at once, synchronously, without a worker.
        assert queued.done()
        result = queued.result()
        assert result.outcome is Outcome.ABORTED_BEFORE_DISPATCH
        assert result.error == toolpool.ABORTED_BEFORE_DISPATCH_TEXT
        assert result.error_name == "AbortError"
        assert result.body_started is False
        assert result.rung is Rung.NONE
        assert result.cause == USER
        assert result.worker_pid is None
        assert result.timeline.dispatched is None
        assert_in_order(result, "submitted", "cancel_requested", "settled")
        assert not blocker.done()
        blocker.cancel()
        assert (await blocker).outcome is Outcome.ABORTED
        assert pool.statistics().settled["aborted_before_dispatch"] == 1


async def test_outcome_aborted_before_dispatch_in_a_cancelled_group() -> None:
    async with running_pool(EXAMPLES) as pool:
        async with pool.group() as group:
            assert group.cancel() is True
            call = group.submit("echo", {"value": 1})
            # C5.2: settled at once; new work belongs in a new group.
            assert call.done()
            result = call.result()
            assert result.outcome is Outcome.ABORTED_BEFORE_DISPATCH
            assert result.body_started is False
            assert result.rung is Rung.NONE
            assert result.cause == USER
            assert result.timeline.dispatched is None
        stats = pool.statistics()
        assert stats.submitted == 1
        assert stats.settled == {"aborted_before_dispatch": 1}
        async with pool.group() as fresh:
            assert not fresh.cancelled
            assert (await fresh.call("echo", {"value": 2})).value == 2


async def test_outcome_aborted() -> None:
    async with Readiness.open() as ready, running_pool() as pool:
        call = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
        [worker_pid] = await ready.started()
        call.cancel()
        result = await call
        assert result.outcome is Outcome.ABORTED
        assert result.error == toolpool.ABORTED_TEXT
        assert result.body_started is True
        assert result.rung is Rung.CANCEL
        assert result.cause == USER
        assert result.worker_pid == worker_pid
        assert_in_order(result, "dispatched", "cancel_requested", "cancel_delivered", "returned")
        assert_in_order(result, "dispatched", "started", "returned")
        assert result.timeline.sigterm is None
        assert result.timeline.sigkill is None
        # Cooperative: the same worker keeps serving.
        assert pool.worker_pids == [worker_pid]
        assert (await pool.call("pid")).value == worker_pid


async def test_outcome_timeout_cooperative() -> None:
    async with running_pool(EXAMPLES) as pool:
        result = await pool.call("nap", {"seconds": 60}, timeout=0.5)
        assert result.outcome is Outcome.TIMEOUT
        assert result.error_name == "TimeoutError"
        assert result.body_started is True
        assert result.rung is Rung.CANCEL
        assert result.cause == TIMEOUT
        assert result.timeline.cancel_requested is not None
        assert result.timeline.cancel_requested - result.timeline.submitted >= 0.5 - EPS
        assert result.duration() < 0.5 + CANCEL_GRACE
        assert result.timeline.sigterm is None
        assert (await pool.call("echo", {"value": "after"})).ok


async def test_outcome_timeout_while_queued() -> None:
    # prefetch=0: the call waits in the pool's own queue (test_prefetch.py: in a worker's).
    async with Readiness.open() as ready, running_pool(prefetch=0) as pool:
        blocker = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
        await ready.started()
        result = await pool.call("echo", {"value": 1}, timeout=0.2)
        assert result.outcome is Outcome.TIMEOUT
        assert result.body_started is False
        assert result.rung is Rung.NONE
        assert result.cause == TIMEOUT
        assert result.timeline.dispatched is None
        blocker.cancel()
        await blocker


async def test_outcome_timeout_escalates_when_the_tool_ignores_it() -> None:
    async with Readiness.open() as ready, running_pool() as pool:
        # (The deadline leaves the body time to start even on a loaded machine.)
        call = pool.submit("ready_busy_loop", {"ready": ready.path}, timeout=1.0)
        tree = process_tree((await ready.started())[0])
        result = await call
        assert_tree_gone(tree)
        assert result.outcome is Outcome.KILLED
        assert result.cause == TIMEOUT
        assert result.rung is Rung.SIGTERM
        assert result.exit_signal == signal.SIGTERM
        assert result.timeline.sigterm is not None
        assert result.timeline.cancel_requested is not None
        assert result.timeline.sigterm - result.timeline.cancel_requested >= CANCEL_GRACE - EPS
        assert (await pool.call("echo", {"value": "after"})).ok


async def test_outcome_killed() -> None:
    async with Readiness.open() as ready, running_pool() as pool:
        call = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
        tree = process_tree((await ready.started())[0])
        call.cancel(force=True)
        result = await call
        assert_tree_gone(tree)
        assert result.outcome is Outcome.KILLED
        assert result.body_started is True
        assert result.rung is Rung.SIGKILL
        assert result.exit_signal == signal.SIGKILL
        assert result.timeline.sigterm is None
        assert result.timeline.started is not None
        assert_in_order(result, "cancel_requested", "sigkill", "reaped", "settled")


async def test_outcome_worker_lost() -> None:
    async with running_pool(EXAMPLES) as pool:
        [worker_pid] = pool.worker_pids
        tree = process_tree(worker_pid)
        result = await pool.call("crash", {"code": 7})
        assert_tree_gone(tree)
        assert result.outcome is Outcome.WORKER_LOST
        # The worker may die before its "started" message leaves: True or unknown, never False.
        assert result.body_started is not False
        assert result.rung is Rung.NONE
        assert result.cause is None
        assert result.worker_pid == worker_pid
        assert result.exit_code == 7
        assert result.exit_signal is None
        assert result.error is not None
        assert result.error.startswith("Error: worker lost")
        assert_in_order(result, "dispatched", "reaped", "settled")
        # C4.6: replaced; the pool returns to its size.
        after = await pool.call("pid")
        assert after.ok
        assert after.value != worker_pid
        stats = pool.statistics()
        assert stats.workers_replaced == 1
        assert stats.workers_started == 2
        assert stats.settled["worker_lost"] == 1


# =========================================================================== C4 escalation

LADDER = [
    pytest.param("nap", False, Rung.CANCEL, id="nap-cancel"),
    pytest.param("sync_nap", False, Rung.CANCEL, id="sync_nap-cancel"),
    pytest.param("busy_loop", False, Rung.SIGTERM, id="busy_loop-sigterm"),
    pytest.param("ignore_sigterm", False, Rung.SIGKILL, id="ignore_sigterm-sigkill"),
    # The daemon is in the worker's tree (the worker is a subreaper); the worker dies of
    # SIGTERM (its body blocks in a thread) and the daemon gets the SIGTERM too.
    pytest.param("spawn_daemon_and_block", False, Rung.SIGTERM, id="daemon-sigterm"),
    pytest.param("nap", True, Rung.SIGKILL, id="nap-force"),
    pytest.param("busy_loop", True, Rung.SIGKILL, id="busy_loop-force"),
    pytest.param("spawn_daemon_and_block", True, Rung.SIGKILL, id="daemon-force"),
]


@pytest.mark.parametrize(("tool", "force", "rung"), LADDER)
async def test_escalation_ladder(tool: str, force: bool, rung: Rung) -> None:
    marker = new_marker()
    args: dict[str, Any] = {"seconds": 3600}
    if tool == "spawn_daemon_and_block":
        args["marker"] = marker
    async with Readiness.open() as ready, running_pool(workers=1) as pool:
        call = pool.submit(f"ready_{tool}", {"ready": ready.path, **args})
        worker_pid, *daemon_pids = await ready.started()
        assert pool.worker_pids == [worker_pid]
        tree = process_tree(worker_pid)
        if tool == "spawn_daemon_and_block":
            [daemon] = find_by_marker(marker)
            assert daemon_pids == [daemon.pid]
            # It escaped with setsid and a double fork, but stays in the worker's tree.
            assert daemon in tree
            assert daemon.ppid() == worker_pid
            assert daemon.pid not in pool.worker_pids
        call.cancel(force=force)
        result = await call
        # Checked before anything else can run: the tree is gone at settle time.
        left_at_settle = alive(tree)
        marked_at_settle = find_by_marker(marker)

        assert result.rung is rung
        assert result.body_started is True
        assert result.cause == USER
        assert result.worker_pid == worker_pid
        timeline = result.timeline
        assert timeline.cancel_requested is not None
        if rung is Rung.CANCEL:
            assert result.outcome is Outcome.ABORTED
            assert timeline.reaped is None
            assert timeline.sigterm is None
            assert alive(tree) == tree
            assert pool.worker_pids == [worker_pid]
        else:
            assert result.outcome is Outcome.KILLED
            assert left_at_settle == []
            assert marked_at_settle == []
            assert_tree_gone(tree)
            assert timeline.reaped is not None
            assert timeline.settled is not None
            assert timeline.reaped <= timeline.settled
            assert worker_pid not in pool.worker_pids
            if force:
                assert timeline.sigterm is None
                assert result.exit_signal == signal.SIGKILL
                assert_in_order(result, "cancel_requested", "sigkill", "reaped", "settled")
                assert timeline.sigkill is not None
                assert timeline.sigkill - timeline.cancel_requested < CANCEL_GRACE
            else:
                assert timeline.sigterm is not None
                assert timeline.sigterm - timeline.cancel_requested >= CANCEL_GRACE - EPS
                if rung is Rung.SIGTERM:
                    assert timeline.sigkill is None
                    assert result.exit_signal == signal.SIGTERM
                else:
                    assert timeline.sigkill is not None
                    assert timeline.sigkill - timeline.sigterm >= TERM_GRACE - EPS
                    assert result.exit_signal == signal.SIGKILL
        stats = pool.statistics()
        assert stats.escalations == {rung.value: 1}

        nxt = await pool.call("echo", {"value": "next"})
        assert nxt.ok
        assert nxt.value == "next"
        if rung is not Rung.CANCEL:
            assert nxt.worker_pid != worker_pid
            assert pool.statistics().workers_replaced == 1
        assert find_by_marker(marker) == []


async def test_force_after_a_cooperative_cancel_keeps_the_first_cause() -> None:
    async with Readiness.open() as ready, running_pool(cancel_grace=30) as pool:
        call = pool.submit("ready_busy_loop", {"ready": ready.path})
        tree = process_tree((await ready.started())[0])
        call.cancel(PARENT)
        call.cancel(force=True)
        result = await call
        assert_tree_gone(tree)
        assert result.outcome is Outcome.KILLED
        assert result.rung is Rung.SIGKILL
        assert result.cause == PARENT
        assert result.duration() < 30


# =========================================================================== cancellation


async def test_cancel_while_queued_leaves_the_others_alone() -> None:
    # prefetch=0: the call waits in the pool's own queue (test_prefetch.py: in a worker's).
    async with Readiness.open() as ready, running_pool(workers=1, prefetch=0) as pool:
        blocker = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
        await ready.started()
        queued = [pool.submit("echo", {"value": i}) for i in range(3)]
        assert pool.statistics().queued == 3
        assert pool.statistics().in_flight == 1
        queued[1].cancel()
        assert queued[1].done()
        assert not queued[0].done()
        assert not queued[2].done()
        blocker.cancel()
        assert (await blocker).outcome is Outcome.ABORTED
        assert (await queued[0]).value == 0
        assert (await queued[2]).value == 2
        assert queued[1].result().outcome is Outcome.ABORTED_BEFORE_DISPATCH


async def test_cancel_racing_the_result_settles_once() -> None:
    rng = random.Random(20240603)
    seen: collections.Counter[Outcome] = collections.Counter()
    async with running_pool(EXAMPLES, workers=2) as pool:
        for i in range(60):
            before = pool.statistics()
            call = pool.submit("nap", {"seconds": 0.004})
            # A random delay (jitter, not synchronisation) so the cancel races the result.
            await anyio.sleep(rng.uniform(0, 0.010))
            call.cancel()
            first = await call
            call.cancel()
            call.cancel(PARENT, force=True)
            assert (await call) is first
            assert call.result() is first
            seen[first.outcome] += 1
            assert first.outcome in (
                Outcome.OK,
                Outcome.ABORTED,
                Outcome.ABORTED_BEFORE_DISPATCH,
            ), first
            assert first.rung in (Rung.NONE, Rung.CANCEL)
            if first.outcome is Outcome.OK:
                assert first.value == "slept 0.004s"
            else:
                assert first.cause == USER
            after = pool.statistics()
            assert sum(after.settled.values()) == sum(before.settled.values()) + 1, i
            assert after.submitted == before.submitted + 1
            assert after.in_flight == 0
        stats = pool.statistics()
        assert "sigterm" not in stats.escalations
        assert "sigkill" not in stats.escalations
        assert stats.workers_started == 2, "a late cancel must never kill a worker"
        assert sum(seen.values()) == 60


async def test_first_cancel_wins_running() -> None:
    async with Readiness.open() as ready, running_pool() as pool:
        call = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
        await ready.started()
        call.cancel(PARENT)
        call.cancel()
        call.cancel(USER)
        result = await call
        assert result.outcome is Outcome.ABORTED
        assert result.cause == PARENT
        assert isinstance(result.cause, toolpool.CancelCause)
        assert result.cause.kind == "parent"


async def test_first_cancel_wins_queued_and_group() -> None:
    # prefetch=0: the call waits in the pool's own queue (test_prefetch.py: in a worker's).
    async with Readiness.open() as ready, running_pool(prefetch=0) as pool:
        blocker = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
        await ready.started()
        queued = pool.submit("echo")
        queued.cancel(PARENT)
        queued.cancel()
        assert queued.result().cause == PARENT
        async with pool.group() as group:
            g_call = group.submit("echo")
            assert group.cancel(PARENT) is True
            assert group.cancel() is False
            assert group.signal.reason == PARENT
            g_call.cancel()
            assert g_call.result().cause == PARENT
        blocker.cancel()
        await blocker


INVALID_CAUSES = [
    pytest.param("user", id="str"),
    pytest.param(["user"], id="list"),
    pytest.param({"kind": "bogus"}, id="unknown-kind"),
    pytest.param({"kind": "user", "why": "x"}, id="extra-field"),
    pytest.param({}, id="empty"),
    pytest.param({"kind": 1}, id="int-kind"),
    pytest.param({"kind": "timeout"}, id="runtime-timeout"),
    pytest.param({"kind": "disposed"}, id="runtime-disposed"),
    pytest.param(ValueError("user"), id="exception"),
    pytest.param(object(), id="object"),
]


@pytest.mark.parametrize("cause", INVALID_CAUSES)
async def test_invalid_cause_is_rejected_everywhere(cause: object) -> None:
    async with Readiness.open() as ready, running_pool() as pool:
        settled = await pool.call("echo", {"value": 1})
        running = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
        await ready.started()
        queued = pool.submit("echo", {"value": 2})
        with pytest.raises((TypeError, ValueError)):
            pool.submit("echo").cancel(cause)  # the queued call made just for this
        for call in (running, queued):
            with pytest.raises((TypeError, ValueError)):
                call.cancel(cause)
            with pytest.raises((TypeError, ValueError)):
                call.cancel(cause, force=True)
            assert not call.done()
        async with pool.group() as group:
            with pytest.raises((TypeError, ValueError)):
                group.cancel(cause)
            assert not group.cancelled
        # Settled calls validate too (C1.3), and stay as they were.
        settled_call = pool.submit("echo", {"value": 3})
        queued.cancel()
        running.cancel()
        assert (await running).cause == USER
        assert queued.result().cause == USER
        settled_result = await settled_call
        with pytest.raises((TypeError, ValueError)):
            settled_call.cancel(cause)
        assert settled_call.result() is settled_result
        assert settled_result.ok
        assert settled.ok
        # The stray call submitted inside pytest.raises above is still tracked; drain it.
        await pool.wait_idle()


async def test_statistics_queued_excludes_settled_calls() -> None:
    async with Readiness.open() as ready:
        # prefetch=0: the calls wait in the pool's own queue (test_prefetch.py: in a worker's).
        async with running_pool(workers=1, prefetch=0) as pool:
            blocker = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
            await ready.started()
            queued = [pool.submit("echo", {"value": i}) for i in range(3)]
            assert pool.statistics().queued == 3
            queued[1].cancel()
            assert queued[1].done()
            stats = pool.statistics()
            # Every submitted call is exactly one of: queued, in flight, settled.
            assert stats.queued + stats.in_flight + sum(stats.settled.values()) == stats.submitted
            assert stats.queued == 2
        # Closing settles the queued calls as aborted_before_dispatch: none is queued any more.
        assert all(call.done() for call in queued)
        assert blocker.done()
        assert pool.statistics().queued == 0


async def test_close_never_dispatches_a_queued_call() -> None:
    # prefetch=0: the call waits in the pool's own queue (test_prefetch.py: in a worker's).
    pool = toolpool.Pool(EXAMPLES, workers=1, prefetch=0)
    async with pool:
        first = pool.submit("nap", {"seconds": 0.05})
        queued = pool.submit("echo", {"value": "queued"})
        # Hold the event loop past the nap: the first call's result is waiting, unread, when
        # aclose() starts (a loaded machine produces the same interleaving by itself).
        time.sleep(1.0)
        await pool.aclose()
        assert first.done()
        result = queued.result()
        assert result.timeline.dispatched is None, result
        assert result.worker_pid is None
        assert result.outcome is Outcome.ABORTED_BEFORE_DISPATCH
        assert result.cause == DISPOSED


# =========================================================================== C5 groups


async def test_group_cancel_over_queued_and_running_calls() -> None:
    # prefetch=0: the calls wait in the pool's own queue (test_prefetch.py: in a worker's).
    async with Readiness.open() as ready, running_pool(workers=2, prefetch=0) as pool:
        async with pool.group() as group:
            running = [
                group.submit("ready_nap", {"ready": ready.path, "seconds": 60}) for _ in range(2)
            ]
            pids = {(await ready.started())[0] for _ in range(2)}
            assert pids == set(pool.worker_pids)
            queued = [group.submit("echo", {"value": i}) for i in range(2)]
            outsider = pool.submit("echo", {"value": "outside"})
            assert pool.statistics().queued == 3
            assert group.cancel() is True
            assert all(q.done() for q in queued)
            late = group.submit("echo", {"value": "late"})
            assert late.done()
        # Leaving the block waited for every call of the group.
        for call in running:
            result = call.result()
            assert result.outcome is Outcome.ABORTED
            assert result.body_started is True
            assert result.rung is Rung.CANCEL
            assert result.cause == USER
        for call in [*queued, late]:
            result = call.result()
            assert result.outcome is Outcome.ABORTED_BEFORE_DISPATCH
            assert result.body_started is False
            assert result.rung is Rung.NONE
            assert result.cause == USER
            assert result.timeline.dispatched is None
        other = await outsider
        assert other.ok
        assert other.cause is None
        assert set(pool.worker_pids) == pids


async def test_concurrent_groups_are_independent() -> None:
    async with Readiness.open() as ready, running_pool(workers=2) as pool:
        async with pool.group() as first, pool.group() as second:
            assert first.signal is not second.signal
            a = first.submit("ready_nap", {"ready": ready.path, "seconds": 60})
            await ready.started()
            b = second.submit("ready_nap", {"ready": ready.path, "seconds": 60})
            await ready.started()
            first.cancel()
            result_a = await a
            assert result_a.outcome is Outcome.ABORTED
            assert result_a.cause == USER
            assert not b.done()
            assert not second.cancelled
            c = second.submit("echo", {"value": "second still works"})
            assert (await c).value == "second still works"
            assert not b.done()
            second.cancel(PARENT)
            result_b = await b
            assert result_b.outcome is Outcome.ABORTED
            assert result_b.cause == PARENT
        assert first.signal.reason == USER
        assert second.signal.reason == PARENT


async def test_group_left_by_an_exception_cancels_its_calls_with_cause_parent() -> None:
    # prefetch=0: the call waits in the pool's own queue (test_prefetch.py: in a worker's).
    async with Readiness.open() as ready, running_pool(workers=1, prefetch=0) as pool:
        group = pool.group()
        calls: list[toolpool.Call] = []

        async def turn() -> None:
            async with group:
                calls.append(group.submit("ready_nap", {"ready": ready.path, "seconds": 60}))
                await ready.started()
                calls.append(group.submit("echo", {"value": 1}))
                raise RuntimeError("leave the turn")

        with pytest.raises(RuntimeError, match="leave the turn"):
            await turn()
        running, queued = calls
        assert group.signal.reason == PARENT
        assert queued.done()
        assert queued.result().outcome is Outcome.ABORTED_BEFORE_DISPATCH
        assert queued.result().cause == PARENT
        # The running call is not abandoned: it is tracked to settlement.
        result = await running
        assert result.outcome is Outcome.ABORTED
        assert result.cause == PARENT


async def test_a_cancelled_groups_queued_call_is_never_dispatched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """C5.2, found under load: cancelling a group's running call could settle it at once,
    free its worker and dispatch the group's next queued call before the group's cancel
    reached that call, which then ran. Whatever the order, a queued call of a cancelled group
    settles as aborted_before_dispatch and never reaches a worker."""
    # The worst order: the group is cancelled, but before its queued call is reached, its
    # running call settles and frees the worker (here: the group reaches none of its calls).
    monkeypatch.setattr(toolpool.Group, "_on_cancel", lambda self, cause: None)
    async with Readiness.open() as ready, running_pool(workers=1) as pool:
        group = pool.group()
        running = group.submit("ready_nap", {"ready": ready.path, "seconds": 60})
        await ready.started()
        queued = group.submit("echo", {"value": 1})
        group.cancel()
        running.cancel()
        result = await running
        assert result.outcome is Outcome.ABORTED
        with anyio.fail_after(10):
            skipped = await queued
        assert skipped.outcome is Outcome.ABORTED_BEFORE_DISPATCH
        assert skipped.cause == {"kind": "user"}
        assert skipped.body_started is False
        assert skipped.timeline.dispatched is None


async def test_pool_close_with_calls_running() -> None:
    marker = new_marker()
    # allow_background: the daemon a finished call leaves behind lives on until the close.
    # prefetch=0: the queued calls wait in the pool's own queue (test_prefetch.py: in a
    # worker's, where one may be taken up before the close's cancel arrives).
    pool = toolpool.Pool(
        TOOLS,
        workers=3,
        cancel_grace=CANCEL_GRACE,
        term_grace=TERM_GRACE,
        allow_background=True,
        prefetch=0,
    )
    async with Readiness.open() as ready:
        async with pool:
            daemon_pid = (await pool.call("spawn_daemon_execd", {"marker": marker})).value
            assert [p.pid for p in find_by_marker(marker)] == [daemon_pid]
            napping = pool.submit("ready_nap", {"ready": ready.path, "seconds": 60})
            await ready.started()
            busy = pool.submit("ready_busy_loop", {"ready": ready.path})
            await ready.started()
            group = pool.group()
            g_running = group.submit("ready_sync_nap", {"ready": ready.path, "seconds": 60})
            await ready.started()
            g_queued = group.submit("echo", {"value": 1})
            queued = pool.submit("echo", {"value": 2})
            assert pool.statistics().queued == 2
            assert pool.statistics().in_flight == 3
            procs = pool_processes(pool)
            reaper_pid = pool.reaper_pid
            assert reaper_pid is not None
            assert len(procs) == 1 + 3 + 1  # reaper, workers, the daemon
            # A user cancel racing with close: disposed takes priority (C5.3). (On the tool
            # that ignores its signal: a cooperative one could settle within cancel(), as
            # the worker's answer may be read there, and free its worker for a queued call.)
            busy.cancel()
            assert not busy.done()
        closed_at = time.monotonic()
        calls = [napping, busy, g_running, g_queued, queued]
        # aclose() returned only when every call had settled.
        assert all(call.done() for call in calls)
        results = [call.result() for call in calls]
        for result in results:
            assert result.cause == DISPOSED, result
            assert result.timeline.settled is not None
            assert result.timeline.settled <= closed_at
        assert results[0].outcome is Outcome.ABORTED
        assert results[1].outcome is Outcome.KILLED
        assert results[1].rung is Rung.SIGTERM
        assert results[2].outcome is Outcome.ABORTED
        assert results[3].outcome is Outcome.ABORTED_BEFORE_DISPATCH
        assert results[4].outcome is Outcome.ABORTED_BEFORE_DISPATCH
        assert group.cancelled
        assert group.signal.reason == DISPOSED
        # Nothing of the pool is left: reaper, workers, the daemon.
        assert_tree_gone(procs)
        assert procs[0].pid == reaper_pid
        assert not psutil.pid_exists(reaper_pid)
        assert find_by_marker(marker) == []
        assert workers_of_reaper(reaper_pid) == []
        assert pool.worker_pids == []
        stats = pool.statistics()
        assert stats.in_flight == 0
        assert sum(stats.settled.values()) == stats.submitted == 6
        # Closed for good, and aclose() is idempotent.
        with pytest.raises(toolpool.PoolClosedError):
            pool.submit("echo")
        with pytest.raises(toolpool.PoolClosedError):
            pool.group()
        await pool.aclose()


# =========================================================================== C4.5 caller cancelled


def spy_on_submit(pool: toolpool.Pool, monkeypatch: pytest.MonkeyPatch) -> list[toolpool.Call]:
    """Record the Call objects that ``pool.call`` creates (it submits through ``submit``)."""
    calls: list[toolpool.Call] = []
    submit = pool.submit

    def spy(*args: Any, **kwargs: Any) -> toolpool.Call:
        call = submit(*args, **kwargs)
        calls.append(call)
        return call

    monkeypatch.setattr(pool, "submit", spy)
    return calls


async def cancel_caller_of(pool: toolpool.Pool, ready: Readiness, bound: float) -> float:
    """Run ``pool.call`` of a tool that ignores its signal in a task, cancel that task once
    the body runs, and return how long the task took to finish after the cancel."""
    scope = anyio.CancelScope()
    finished = anyio.Event()

    async def caller() -> None:
        with scope:
            await pool.call("ready_busy_loop", {"ready": ready.path})
        finished.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await ready.started()
        cancelled_at = time.monotonic()
        scope.cancel()
        with anyio.fail_after(bound):
            await finished.wait()
        elapsed = time.monotonic() - cancelled_at
    assert scope.cancelled_caught
    return elapsed


async def test_caller_cancelled_the_call_is_tracked_with_cause_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Readiness.open() as ready, running_pool(cancel_grace=2.0) as pool:
        calls = spy_on_submit(pool, monkeypatch)
        elapsed = await cancel_caller_of(pool, ready, bound=1.0)
        assert elapsed < 1.0
        [call] = calls
        # Not abandoned: the pool still tracks it while the tool ignores the cancel.
        assert not call.done()
        assert pool.statistics().in_flight == 1
        result = await call
        assert result.cause == PARENT
        assert result.outcome is Outcome.KILLED
        assert result.rung is Rung.SIGTERM
        assert result.timeline.cancel_requested is not None
        assert result.timeline.sigterm is not None
        assert result.timeline.sigterm - result.timeline.cancel_requested >= 2.0 - EPS
        assert pool.statistics().settled == {"killed": 1}


async def test_caller_cancelled_aclose_waits_for_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Readiness.open() as ready:
        async with running_pool() as pool:
            calls = spy_on_submit(pool, monkeypatch)
            await cancel_caller_of(pool, ready, bound=CANCEL_GRACE)
            [call] = calls
            assert not call.done()
            assert pool.statistics().in_flight == 1
            tree = pool_processes(pool)
        # running_pool closed the pool: aclose() waited for the call and the tree.
        assert call.done()
        assert_tree_gone(tree)
        result = call.result()
        assert result.outcome is Outcome.KILLED
        assert result.rung is Rung.SIGTERM
        # The parent cancel came first; the close raced with it (C5.3 lets disposed win).
        assert result.cause in (PARENT, DISPOSED)


# =========================================================================== errors at the API


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param("toolpool_no_such_module_xyz:registry", "ModuleNotFoundError", id="module"),
        pytest.param("toolpool.testing.examples:no_such_registry", "AttributeError", id="attr"),
        pytest.param("pool_support:not_a_registry", "TypeError", id="not-a-registry"),
        pytest.param("pool_support:broken_registry", "broken on purpose", id="factory-raises"),
    ],
)
async def test_tools_that_fail_to_load_give_worker_start_error(spec: str, expected: str) -> None:
    pool = toolpool.Pool(spec, workers=2, start_timeout=20)
    started = time.monotonic()
    with pytest.raises(toolpool.WorkerStartError) as info:
        await pool.start()
    elapsed = time.monotonic() - started
    assert spec in str(info.value)
    # The traceback text is checked in test_worker_start_error_carries_the_traceback.
    assert elapsed < 10, "start failures must be reported promptly, not at start_timeout"
    # No respawn storm: only the workers of the first attempt were started.
    assert pool.statistics().workers_started <= 2
    reaper_pid = pool.reaper_pid
    assert reaper_pid is not None
    assert not psutil.pid_exists(reaper_pid)  # exited and reaped
    assert workers_of_reaper(reaper_pid) == []
    with pytest.raises(toolpool.PoolClosedError):
        pool.submit("echo")
    await pool.aclose()


@pytest.mark.timeout(60, method="thread")
async def test_worker_start_error_carries_the_traceback() -> None:
    # Load the machine so that the supervisor's zmq I/O thread can lag behind the reaper.
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        for _ in range(10):
            # Several workers: each start is one more chance for the race.
            pool = toolpool.Pool("toolpool_no_such_module_xyz:registry", workers=6)
            with pytest.raises(toolpool.WorkerStartError) as info:
                await pool.start()
            message = str(info.value)
            assert "Traceback" in message, message
            assert "ModuleNotFoundError" in message, message
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


async def test_a_workers_fatal_read_only_after_its_tree_is_reported_gone_still_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The order the test above provokes with load, forced: the worker's 'fatal' reaches the
    supervisor only after the reaper reported the worker exited *and* its tree gone (the
    socket's I/O thread lagging behind the reaper). The traceback must still be reported:
    the socket stays open and read until the fatal is in, or the wait for it ends."""
    import toolpool._transport as transport
    import toolpool.supervisor._pool as pool_module
    import toolpool.supervisor._workerio as workerio

    read, on_event = pool_module.Pool._read, pool_module.Pool._on_reaper_event
    gone_reported: set[int] = set()

    def lagging_read(pool: Any, io: Any) -> None:
        if io.wid in gone_reported:
            read(pool, io)
        elif not io.sock.closed:
            # Nothing has arrived yet, as far as the supervisor can tell. (Looking consumes
            # the socket's notification, so its reader is not called again and again.)
            transport.readable(io.sock)

    def reaper_event(pool: Any, report: Any) -> None:
        on_event(pool, report)
        if type(report) is GoneReport:
            gone_reported.add(report.wid)
            io = pool._io.get(report.wid)
            if io is not None:
                pool._on_readable(io)  # what arrived meanwhile is read (the reader's next turn)

    async def no_disconnect_watch(pool: Any, io: Any) -> None:
        with workerio.scope(io):  # (its read would take the fatal before the gone report)
            await anyio.sleep_forever()

    monkeypatch.setattr(pool_module.Pool, "_read", lagging_read)
    monkeypatch.setattr(pool_module.Pool, "_on_reaper_event", reaper_event)
    monkeypatch.setattr(pool_module.Pool, "_watch_disconnect", no_disconnect_watch)
    pool = toolpool.Pool("toolpool_no_such_module_xyz:registry", workers=1)
    with anyio.fail_after(20), pytest.raises(toolpool.WorkerStartError) as info:
        await pool.start()
    assert gone_reported  # the gone report came before anything was read
    message = str(info.value)
    assert "Traceback" in message, message
    assert "ModuleNotFoundError" in message, message


async def test_a_workers_own_connection_is_known_even_if_its_watch_starts_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker connects before the supervisor's task that watches its socket runs (a
    busy loop, a slow machine): its connection is still its own, and its drop is noticed as
    a drop, never logged as a stranger's. (The watch used to attach to the socket when it
    started, and missed the worker's accept.) The reaper is held stopped meanwhile, so the
    drop can only be learnt from the socket."""
    import logging

    import toolpool.supervisor._pool as pool_module

    watch = pool_module.Pool._watch_disconnect
    connected = anyio.Event()
    dropped = anyio.Event()
    records: list[logging.LogRecord] = []

    async def late_watch(pool: Any, io: Any) -> None:
        await connected.wait()
        await watch(pool, io)

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)
            if "connection dropped" in record.getMessage():
                dropped.set()

    monkeypatch.setattr(pool_module.Pool, "_watch_disconnect", late_watch)
    seen = Seen(logging.DEBUG)
    logger = logging.getLogger("toolpool")
    logger.addHandler(seen)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        async with running_pool(EXAMPLES) as pool:
            assert (await pool.call("echo", {"value": 1})).value == 1  # connected, served
            connected.set()
            reaper = psutil.Process(pool.reaper_pid)
            (pid,) = pool.worker_pids
            reaper.suspend()
            try:
                os.kill(pid, signal.SIGKILL)
                with anyio.fail_after(20):
                    await dropped.wait()
            finally:
                reaper.resume()
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    strangers = [r.getMessage() for r in records if "stranger" in r.getMessage()]
    assert not strangers, strangers


async def test_reaper_client_close_while_its_event_pump_is_woken() -> None:
    # The pool's own pieces, driven directly (a last resort: no public hook reaches this
    # timing). The pool does the same: ReaperClient.run() in its task group, then aclose().
    from toolpool.reaper import ReaperClient

    for attempt in range(6):
        events: list[Any] = []
        client = ReaperClient(events.append)
        await client.start(10)
        reaper = psutil.Process(client.pid)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run)
            await anyio.sleep(0)
            tg.start_soon(client.aclose)
            for _ in range(4 + attempt):  # let aclose() send "exit" and wait for the process
                await anyio.sleep(0)
            # Hold the event loop while the reaper says "bye", exits and is reaped by
            # aclose()'s thread: when the loop runs again, aclose() resumes before run()
            # reads the "bye".
            deadline = time.monotonic() + 5
            while reaper.is_running() and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)
        assert not reaper.is_running()
        assert ByeReport() in events


async def test_bad_submissions_fail_at_once() -> None:
    async with running_pool(EXAMPLES) as pool:
        with pytest.raises(toolpool.UnknownToolError, match="no_such_tool"):
            pool.submit("no_such_tool")
        with pytest.raises(LookupError):
            await pool.call("no_such_tool", {})
        async with pool.group() as group:
            with pytest.raises(toolpool.UnknownToolError):
                group.submit("no_such_tool")
        with pytest.raises(TypeError):
            pool.submit(42)  # type: ignore[arg-type]
        for bad_args in (["value"], "value", 3, {"value": object()}, {"value": {1, 2}}):
            with pytest.raises(TypeError):
                pool.submit("echo", bad_args)  # type: ignore[arg-type]
        for bad_timeout in (0, -1, math.nan, math.inf, True, "1"):
            with pytest.raises((TypeError, ValueError)):
                pool.submit("echo", timeout=bad_timeout)  # type: ignore[arg-type]
        stats = pool.statistics()
        assert stats.submitted == 0
        assert stats.queued == 0
        assert stats.in_flight == 0
        assert (await pool.call("echo", {"value": "fine"})).value == "fine"


async def test_pool_not_started() -> None:
    pool = toolpool.Pool(EXAMPLES, workers=1)
    with pytest.raises(toolpool.PoolClosedError):
        pool.submit("echo")
    await pool.aclose()
    with pytest.raises(RuntimeError):
        await pool.start()


# =========================================================================== soak


@pytest.mark.slow
@pytest.mark.timeout(60, method="thread")
async def test_soak_mixed_calls() -> None:
    total = 2000
    rng = random.Random(31337)
    # Each call: (tool, args, what we do to it). Decided up front so the run is reproducible.
    plan: list[tuple[str, dict[str, Any], str]] = []
    for _ in range(total):
        roll = rng.random()
        if roll < 0.004:
            plan.append(("crash", {"code": 5}, "none"))
        elif roll < 0.008:
            plan.append(("ready_nap", {"seconds": 30}, "force"))
        elif roll < 0.45:
            plan.append(("nap", {"seconds": rng.uniform(0, 0.02)}, "none"))
        else:
            plan.append(("echo", {"value": rng.randrange(1 << 30)}, "none"))
        if plan[-1][0] != "crash" and plan[-1][2] == "none" and rng.random() < 0.25:
            plan[-1] = (plan[-1][0], plan[-1][1], "cancel")
    delays = [rng.uniform(0, 0.02) for _ in range(total)]

    results: dict[int, toolpool.Result] = {}
    settle_counts: collections.Counter[int] = collections.Counter()
    leftovers: list[psutil.Process] = []
    limiter = anyio.CapacityLimiter(12)
    started = time.monotonic()

    async with running_pool(TOOLS, workers=4, cancel_grace=5.0, term_grace=2.0) as pool:

        async def one(i: int) -> None:
            tool, args, action = plan[i]
            async with limiter:
                if action == "force":
                    # Kill a body that is really running: wait for its announcement.
                    async with Readiness.open() as ready:
                        call = pool.submit(tool, {"ready": ready.path, **args})
                        tree = process_tree((await ready.started())[0])
                        call.cancel(force=True)
                        result = await call
                        leftovers.extend(alive(tree))  # at settle time
                else:
                    call = pool.submit(tool, args)
                    if action == "cancel":
                        await anyio.sleep(delays[i])  # jitter: cancel at a random point
                        call.cancel()
                    result = await call
                settle_counts[i] += 1
                results[i] = result

        async with anyio.create_task_group() as tg:
            for i in range(total):
                tg.start_soon(one, i)
        stats = pool.statistics()
    elapsed = time.monotonic() - started

    assert leftovers == [], "a killed call settled before its tree was gone"
    assert len(results) == total
    assert set(settle_counts.values()) == {1}
    assert stats.submitted == total
    assert sum(stats.settled.values()) == total
    assert stats.in_flight == 0
    outcomes = collections.Counter(r.outcome.value for r in results.values())
    assert outcomes == collections.Counter(stats.settled)
    # The mix really exercised each path.
    for outcome in ("ok", "aborted", "aborted_before_dispatch", "killed", "worker_lost"):
        assert outcomes[outcome] > 0, outcomes
    assert stats.escalations.get("sigkill") == sum(a == "force" for _, _, a in plan)
    assert "sigterm" not in stats.escalations
    for i, result in results.items():
        tool, args, action = plan[i]
        if action == "none" and tool != "crash":
            # Forced kills and crashes of other workers never touch this call (C4.6).
            assert result.ok, (i, result)
            if tool == "echo":
                assert result.value == args["value"]
        elif action == "cancel":
            assert result.outcome in (
                Outcome.OK,
                Outcome.ABORTED,
                Outcome.ABORTED_BEFORE_DISPATCH,
            ), (i, result)
            assert result.rung in (Rung.NONE, Rung.CANCEL)
        elif action == "force":
            assert result.outcome is Outcome.KILLED, (i, result)
            assert result.rung is Rung.SIGKILL
            assert result.timeline.reaped is not None
            assert result.timeline.settled is not None
            assert result.timeline.reaped <= result.timeline.settled
        else:
            assert result.outcome is Outcome.WORKER_LOST, (i, result)
            assert result.exit_code == 5
    print(outcomes, dict(stats.escalations), f"{elapsed:.1f}s")
    assert elapsed < 30, f"the soak took {elapsed:.1f}s"
