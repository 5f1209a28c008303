"""Unkillable workers, with real processes that do not die of SIGKILL.

A process in a frozen cgroup-v1 freezer is in uninterruptible sleep ("D"): SIGKILL stays
pending until the cgroup is thawed, then it dies. That is a safe way to make one: nothing
else on the machine is touched, and the test thaws it (and so ends it) whatever happens.
Where no v1 freezer can be made (not root, cgroup v2 only), these tests are skipped: the
core's side is proved by the simulation (``tests/sim_world.py``, its ``freeze`` steps).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress

import anyio
import psutil
import pytest

import toolpool
from pool_support import Readiness, new_marker, pool_processes, running_pool
from toolpool.sandbox import _cgroups as cgroups
from toolpool.supervisor._workerio import wait_pid_gone

pytestmark = pytest.mark.anyio

FREEZER = "/sys/fs/cgroup/freezer"
UNKILLABLE_AFTER = 1.0


class Freezer:
    """A cgroup-v1 freezer of this test's own."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.frozen: list[int] = []

    def _state(self, value: str) -> None:
        with open(os.path.join(self.path, "freezer.state"), "w") as f:
            f.write(value)
        deadline = time.monotonic() + 10  # (no event announces the state's change)
        while time.monotonic() < deadline:
            with open(os.path.join(self.path, "freezer.state")) as f:
                if f.read().strip() == value:
                    return
            time.sleep(0.001)
        raise AssertionError(f"the freezer did not become {value}")

    def freeze(self, pid: int) -> None:
        """Move ``pid`` (all its threads) in, and freeze it: it is in state D from now."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        self.frozen.append(pid)
        self._state("FROZEN")
        assert psutil.Process(pid).status() == psutil.STATUS_DISK_SLEEP

    def thaw(self) -> None:
        self._state("THAWED")

    def members(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]


@pytest.fixture
def freezer() -> Iterator[Freezer]:
    path = os.path.join(FREEZER, f"toolpool-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"no cgroup-v1 freezer to make a process unkillable: {exc.strerror}")
    f = Freezer(path)
    try:
        yield f
    finally:
        # Whatever happened: thaw, and end what is still there (a test that failed before
        # its SIGKILL), then remove the freezer.
        f.thaw()
        for pid in f.members():
            with suppress(OSError):
                os.kill(pid, 9)
        deadline = time.monotonic() + 30
        while f.members() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert cgroups.remove(path), f"{path} still holds {f.members()}"


async def wait_for(pool: toolpool.Pool, what: str, predicate: object) -> None:
    """Until ``predicate()`` (each time the pool's workers change: an event)."""
    assert callable(predicate)
    with anyio.fail_after(30):
        while not predicate():
            await pool._wait_changed()


def unkillable_workers(pool: toolpool.Pool) -> int:
    return pool.statistics().workers.get("unkillable", 0)


async def started_call(
    pool: toolpool.Pool, ready: Readiness, tool: str = "ready_nap", **args: object
) -> tuple[toolpool.Call, list[int]]:
    call = pool.submit(tool, {"ready": ready.path, "seconds": 600, **args})
    return call, await ready.started()


@pytest.mark.timeout(90)
async def test_an_unkillable_worker_is_replaced_and_its_call_settles_when_its_tree_goes(
    freezer: Freezer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="toolpool")
    async with (
        running_pool(workers=1, unkillable_after=UNKILLABLE_AFTER) as pool,
        Readiness.open() as ready,
    ):
        call, [pid] = await started_call(pool, ready)
        freezer.freeze(pid)
        call.cancel(force=True)
        await wait_for(pool, "unkillable", lambda: unkillable_workers(pool) == 1)

        stats = pool.statistics()
        assert stats.unkillable == (pid,)
        assert stats.workers_unkillable == 1
        assert not call.done()  # its tree lives: not settled (C4.3)
        assert psutil.Process(pid).status() == psutil.STATUS_DISK_SLEEP
        [line] = [r for r in caplog.records if "is unkillable" in r.getMessage()]
        assert line.levelno == logging.ERROR
        assert str(pid) in line.getMessage()
        assert f"call {call.id}" in line.getMessage()

        # Its slot is served by a replacement.
        result = await pool.call("pid")
        assert result.ok
        assert result.value != pid
        assert result.value in pool.worker_pids

        # Its tree goes: the call settles, killed, at the time it went.
        thawed = time.monotonic()
        freezer.thaw()
        with anyio.fail_after(30):
            killed = await call
        assert killed.outcome is toolpool.Outcome.KILLED
        assert killed.rung is toolpool.Rung.SIGKILL
        assert killed.exit_signal == 9
        assert killed.tree_verified is True
        assert killed.timeline.reaped is not None
        assert killed.timeline.reaped >= thawed
        stats = pool.statistics()
        assert unkillable_workers(pool) == 0
        assert stats.unkillable == ()
        assert stats.workers_unkillable == 1
        assert stats.kill_to_reaped is not None
        assert stats.kill_to_reaped.count == 1
        assert stats.kill_to_reaped.sum >= UNKILLABLE_AFTER
        assert any("gone at last" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(90)
async def test_close_returns_reporting_what_did_not_die(freezer: Freezer) -> None:
    pool = toolpool.Pool(
        "pool_support:registry",
        workers=2,
        cancel_grace=0.2,
        term_grace=0.2,
        unkillable_after=UNKILLABLE_AFTER,
    )
    await pool.start()
    try:
        async with Readiness.open() as ready:
            call, [busy_pid] = await started_call(pool, ready)
        [idle_pid] = [p for p in pool.worker_pids if p != busy_pid]
        freezer.freeze(busy_pid)  # frozen in a call: the close's cancel, then its ladder
        freezer.freeze(idle_pid)  # frozen idle: the close's shutdown, then its kill
        procs = pool_processes(pool)
        reaper = pool.reaper_pid
        assert pool._options["default"].cgroups is not None
        bases = sorted(set(pool._options["default"].cgroups.base.values()))
    except BaseException:
        await pool.aclose()
        raise
    began = time.monotonic()
    report = await pool.aclose()  # (bounded by the test's timeout: the same scope as start)
    took = time.monotonic() - began
    assert report.unkillable == tuple(sorted((busy_pid, idle_pid)))
    assert report.unsettled == (call.id,)
    assert "did not die of SIGKILL" in report.format()
    assert not call.done()
    with pytest.raises(toolpool.PoolClosedError, match="did not die of SIGKILL"):
        await call
    # Nothing else of the pool is left (its reaper included), and it took no longer than
    # its bounds (the ladder, the wait for unkillable, the reaper's own wait), with room.
    others = [p for p in procs if p.pid not in (busy_pid, idle_pid)]
    assert [p for p in others if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert reaper is not None
    assert reaper not in [p.pid for p in psutil.Process().children()]  # (reaped: not a zombie)
    assert took < 30, took
    # Thawed, they die of the SIGKILL they got.
    freezer.thaw()
    with anyio.fail_after(30):
        for pid in (busy_pid, idle_pid):
            await wait_pid_gone(pid)
    # What their cgroups kept from being removed, the report named; remove it now.
    left = [f for f in report.failed if "cgroup" in f]
    assert left, report
    for base in bases:
        for path, _dirs, _files in os.walk(base, topdown=False):
            assert cgroups.remove(path), path


@pytest.mark.timeout(90)
async def test_a_daemon_that_does_not_die_keeps_its_call_unsettled(freezer: Freezer) -> None:
    """The worker dies; a daemon it left (re-parented to the reaper) does not: the reaper
    goes on serving, the worker is unkillable until the daemon dies."""
    marker = new_marker()
    async with (
        running_pool(workers=1, unkillable_after=UNKILLABLE_AFTER) as pool,
        Readiness.open() as ready,
    ):
        call, [pid, daemon] = await started_call(
            pool, ready, tool="ready_spawn_daemon_and_block", marker=marker
        )
        freezer.freeze(daemon)
        call.cancel(force=True)
        await wait_for(pool, "unkillable", lambda: unkillable_workers(pool) == 1)
        assert daemon in pool.statistics().unkillable
        assert not call.done()
        with anyio.fail_after(30):
            await wait_pid_gone(pid)  # the worker itself died
        result = await pool.call("pid")  # the replacement, and the reaper, serve on
        assert result.ok
        freezer.thaw()
        with anyio.fail_after(30):
            killed = await call
        assert killed.outcome is toolpool.Outcome.KILLED
        assert not psutil.pid_exists(daemon) or (
            psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE
        )
        assert pool.statistics().unkillable == ()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_cgroup", [True, False], ids=["cgroup", "no-cgroup"])
async def test_the_reaper_dies_while_a_worker_does_not_die(
    freezer: Freezer, with_cgroup: bool
) -> None:
    """The reaper dies while a worker is in uninterruptible sleep. The shell ends the
    orphan's tree itself and waits for it, however long: its call does not settle while the
    tree is known alive (C4.3), with or without a cgroup to see it through. The worker is
    unkillable meanwhile, and a new reaper serves the pool; once the tree is thawed (and so
    dies), the call settles."""
    profile = toolpool.Profile.default()
    if not with_cgroup:
        profile = profile.with_limits(disable=frozenset({"cgroups"}))
    async with (
        running_pool(workers=1, unkillable_after=UNKILLABLE_AFTER, profile=profile) as pool,
        Readiness.open() as ready,
    ):
        call, [pid] = await started_call(pool, ready)
        freezer.freeze(pid)
        first = pool.reaper_pid
        assert first is not None
        os.kill(first, 9)
        await wait_for(pool, "unkillable", lambda: unkillable_workers(pool) == 1)
        assert pool.statistics().unkillable == (pid,)
        await wait_for(pool, "a new reaper", lambda: pool.reaper_pid not in (None, first))
        result = await pool.call("pid")
        assert result.ok, result
        assert result.value != pid
        assert not call.done()  # its tree lives: not settled
        assert psutil.Process(pid).status() == psutil.STATUS_DISK_SLEEP
        freezer.thaw()
        with anyio.fail_after(60):
            lost = await call
        assert lost.outcome is toolpool.Outcome.WORKER_LOST, lost
        assert lost.tree_verified is with_cgroup
        with anyio.fail_after(30):
            await wait_pid_gone(pid)
        assert unkillable_workers(pool) == 0
