"""The reaper's death is survived (CONTRACT C4.3, C4.6), with real processes.

When the pool's reaper dies (an operator's wrong pid, the OOM killer, a tool under the
default profile, which shares the uid), its workers die with it (PDEATHSIG) but what they
spawned may not. No call settles while a process of its worker's tree lives: the pool kills
the tree through the worker's cgroup and waits until it is empty; where there is no cgroup,
the result says the tree could not be verified. Then a new reaper starts and the pool goes on
serving; closing it removes every cgroup and directory it made.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import psutil
import pytest

import toolpool
from pool_support import (
    TOOLS,
    Readiness,
    find_by_marker,
    new_marker,
    workers_of_reaper,
)
from toolpool import Outcome, Profile

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

NO_CGROUPS = Profile.default().with_limits(disable=frozenset({"cgroups"}))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pool_leftovers(pool_dir: str | None, cgroup_dirs: list[str]) -> list[str]:
    return [d for d in [pool_dir, *cgroup_dirs] if d is not None and os.path.exists(d)]


async def _kill_reaper_during_a_call(pool: toolpool.Pool, ready: Readiness, marker: str) -> Any:
    """Start a call whose body left a setsid daemon (a grandchild that escaped the worker's
    session), SIGKILL the reaper, and return (result, daemon pid, whether the daemon was
    alive when the call settled)."""
    call = pool.submit("ready_spawn_daemon_and_block", {"ready": ready.path, "marker": marker})
    worker, daemon = await ready.started()
    assert _alive(daemon)
    reaper = pool.reaper_pid
    assert reaper is not None
    os.kill(reaper, signal.SIGKILL)
    with anyio.fail_after(40):
        result = await call
    return result, worker, daemon, _alive(daemon)


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root here")
async def test_the_reaper_killed_mid_call_with_a_cgroup() -> None:
    marker = new_marker()
    async with Readiness.open() as ready:
        pool = toolpool.Pool(TOOLS, workers=2, cancel_grace=1, term_grace=1)
        async with pool:
            if not pool.containment().active("cgroup_kill"):
                pytest.skip("no cgroup v2 here")
            old_reaper = pool.reaper_pid
            assert old_reaper is not None
            pool_dir = pool._dir
            cgroup_dirs = (
                sorted(set(pool._options["default"].cgroups.base.values()))
                if pool._options["default"].cgroups
                else []
            )
            result, worker, _daemon, daemon_alive = await _kill_reaper_during_a_call(
                pool, ready, marker
            )
            # Settled only once the whole tree was gone, the escaped daemon included.
            assert not daemon_alive
            assert not _alive(worker)
            assert result.outcome is Outcome.WORKER_LOST, result
            assert "reaper" in (result.error or ""), result.error
            assert result.tree_verified is True
            assert result.body_started is True
            # A new reaper; the pool serves on, at full size.
            with anyio.fail_after(40):
                after = await pool.call("pid")
            assert after.ok, after
            assert pool.reaper_pid not in (None, old_reaper)
            assert len(pool.worker_pids) == 2
            new_reaper = pool.reaper_pid
            assert new_reaper is not None
        assert find_by_marker(marker) == []
        assert workers_of_reaper(old_reaper) == []
        assert workers_of_reaper(new_reaper) == []
        assert not psutil.pid_exists(new_reaper) or not _alive(new_reaper)
        assert _pool_leftovers(pool_dir, cgroup_dirs) == []


async def test_the_reaper_killed_mid_call_without_a_cgroup() -> None:
    """Without a cgroup nothing can find a daemon that left the worker's session once the
    reaper (their subreaper) is gone: the call settles once the worker itself is gone, and
    its result says the tree was not verified."""
    marker = new_marker()
    try:
        async with (
            Readiness.open() as ready,
            toolpool.Pool(TOOLS, workers=1, profile=NO_CGROUPS) as pool,
        ):
            old_reaper = pool.reaper_pid
            result, worker, _daemon, _ = await _kill_reaper_during_a_call(pool, ready, marker)
            assert not _alive(worker)
            assert result.outcome is Outcome.WORKER_LOST, result
            assert result.tree_verified is False
            assert "could not be verified" in (result.error or ""), result.error
            with anyio.fail_after(40):
                after = await pool.call("pid")
            assert after.ok, after
            assert pool.reaper_pid not in (None, old_reaper)
    finally:
        for proc in find_by_marker(marker):  # what nothing could verify: this test's own
            proc.kill()


async def test_without_a_cgroup_a_child_in_the_workers_group_still_dies_with_it() -> None:
    """Without a cgroup the pool still kills the dead worker's process group (it leads its
    own): a child that did not leave it is gone before the call settles."""
    marker = new_marker()
    try:
        async with (
            Readiness.open() as ready,
            toolpool.Pool(TOOLS, workers=1, profile=NO_CGROUPS) as pool,
        ):
            call = pool.submit("ready_child_and_block", {"ready": ready.path, "marker": marker})
            _, child = await ready.started()
            reaper = pool.reaper_pid
            assert reaper is not None
            os.kill(reaper, signal.SIGKILL)
            with anyio.fail_after(40):
                result = await call
            assert not _alive(child)
            assert result.outcome is Outcome.WORKER_LOST, result
            assert result.tree_verified is False  # (one that left the group: nobody knows)
    finally:
        for proc in find_by_marker(marker):
            proc.kill()


async def test_a_call_queued_in_a_worker_runs_elsewhere_when_the_reaper_dies() -> None:
    """A call waiting in a worker's queue when the reaper dies was never taken up: it runs
    on a worker of the new reaper. The one that ran is lost, once its tree is gone."""
    async with Readiness.open() as ready:
        async with toolpool.Pool(TOOLS, workers=1) as pool:
            running = pool.submit("ready_sync_nap", {"ready": ready.path, "seconds": 30})
            await ready.started()
            queued = pool.submit("echo", {"value": 1})
            assert pool.statistics().queued == 1
            reaper = pool.reaper_pid
            assert reaper is not None
            os.kill(reaper, signal.SIGKILL)
            with anyio.fail_after(40):
                lost = await running
                result = await queued
            assert lost.outcome is Outcome.WORKER_LOST, lost
            assert lost.body_started is True
            assert result.ok, result
            assert result.value == 1
            assert result.worker_pid != lost.worker_pid
        assert workers_of_reaper(reaper) == []


async def test_the_reaper_killed_while_idle_and_while_closing() -> None:
    """An idle pool whose reaper dies gets a new one; a pool whose reaper dies while it
    closes still closes (its workers' trees ended without the reaper)."""
    async with toolpool.Pool(TOOLS, workers=2) as pool:
        first = pool.reaper_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        with anyio.fail_after(40):
            # (A call submitted before the pool heard of it could go to a dying worker.)
            while pool.reaper_pid == first or len(pool.worker_pids) < 2:
                await pool._wait_changed()
            result = await pool.call("pid")
        assert result.ok, result
        second = pool.reaper_pid
        assert second not in (None, first)
        pids = pool.worker_pids
        assert second is not None
        os.kill(second, signal.SIGKILL)  # its death is read while the pool closes
        await pool.aclose()  # (in the nesting that started it: see Pool.aclose)
    assert not any(_alive(p) for p in pids)
    assert workers_of_reaper(first) == []


def _reaper_killed_as_it_starts(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, kills: int) -> Any:
    """From now on the pool's next `kills` reapers are SIGKILLed as they start, before they
    say they are ready (a real process, a real signal); later ones start as ever. Returns the
    file that counts the starts."""
    from toolpool.reaper import _ahead

    starts = tmp_path / "starts"
    starts.write_text("")
    script = tmp_path / "reaper_that_dies.py"
    script.write_text(
        "import os, signal, sys\n"
        f"with open({str(starts)!r}, 'a') as f:\n"
        "    f.write('x')\n"
        f"if os.path.getsize({str(starts)!r}) <= {kills}:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"real = {str(_ahead.SCRIPT)!r}\n"
        "os.execv(sys.executable, [sys.executable, '-P', real, *sys.argv[1:]])\n"
    )
    monkeypatch.setattr(_ahead, "SCRIPT", script)
    return starts


async def test_a_new_reaper_killed_as_it_starts_is_started_again(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand that killed the reaper kills its replacement too, twice: the pool starts a
    third, and serves."""
    async with toolpool.Pool(TOOLS, workers=1) as pool:
        first = pool.reaper_pid
        assert first is not None
        starts = _reaper_killed_as_it_starts(tmp_path, monkeypatch, kills=2)
        os.kill(first, signal.SIGKILL)
        with anyio.fail_after(40):
            while pool.reaper_pid in (None, first) or not pool.worker_pids:
                await pool._wait_changed()
            result = await pool.call("pid")
        assert result.ok, result
        assert starts.read_text() == "xxx"  # two killed as they started, the third serves
        assert _alive(pool.reaper_pid)
    assert workers_of_reaper(first) == []


async def test_a_reaper_that_never_starts_again_breaks_the_pool_clearly(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every replacement dies as it starts: after three attempts the pool is broken, and says
    why; closing it still removes everything it made."""
    from toolpool.supervisor.machine import REAPER_START_ATTEMPTS

    pool = toolpool.Pool(TOOLS, workers=1)
    async with pool:
        first = pool.reaper_pid
        assert first is not None
        pool_dir = pool._dir
        starts = _reaper_killed_as_it_starts(tmp_path, monkeypatch, kills=1_000)
        os.kill(first, signal.SIGKILL)
        with anyio.fail_after(40):
            while pool._core.broken is None:
                await pool._wait_changed()
        with pytest.raises(toolpool.WorkerStartError, match="a new one did not start"):
            pool.submit("pid")
        assert len(starts.read_text()) == REAPER_START_ATTEMPTS
    assert _pool_leftovers(pool_dir, []) == []
    assert workers_of_reaper(first) == []
