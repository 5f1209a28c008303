"""Workers forked from the reaper's pre-forked template (``Pool(start_method="fork")``).

Real pools, real processes: a forked worker is the reaper's child, holds no descriptor it
inherited from the reaper, gets the same process state and set-up as a spawned worker (checked
side by side from inside a tool), imports the tools module only after its set-up, and never
outlives the pool. The containment kit (test_containment.py) and the supervisor-SIGKILL test
(test_hostile_wire.py) run with both start methods.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import psutil
import pytest

import toolpool
from pool_support import workers_of_reaper

TOOLS = "template_tools:registry"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _fd_targets(pid: int) -> dict[int, str]:
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return out


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_forked_workers_are_children_of_the_reaper_holding_none_of_its_descriptors() -> None:
    async with toolpool.Pool(TOOLS, workers=2, warm_spares=1, start_method="fork") as pool:
        reaper = pool.reaper_pid
        assert reaper is not None
        methods = pool.worker_start_methods
        assert sorted(methods.values()) == ["fork"] * 3
        reaper_fds = set(_fd_targets(reaper).values()) - {"/dev/null"}
        assert any(t.startswith("socket:") for t in reaper_fds)  # its line to the supervisor
        wids = {w.pid: wid for wid, w in pool._core.workers.items()}
        for pid in methods:
            wid = wids[pid]
            proc = psutil.Process(pid)
            assert proc.ppid() == reaper
            assert os.getsid(pid) == pid  # its own session, like a spawned worker
            assert proc.cmdline()[-2:] == ["--parent-pid", str(reaper)]
            fds = _fd_targets(pid)
            assert [fds[0], fds[1], fds[2]] == ["/dev/null"] * 3
            shared = set(fds.values()) & reaper_fds
            assert shared == set(), f"worker {pid} inherited {shared} from the reaper"
            # Beyond stdio: libzmq's and the event loop's descriptors, its one connection,
            # its ledger (mmap keeps a descriptor of its file), and the member list of its own
            # cgroup (where cgroup v2 is set up).
            assert all(
                t.startswith(("socket:", "anon_inode:"))
                or t == f"{pool._io[wid].endpoint[6:-5]}/ledger"
                or (t.startswith("/sys/fs/cgroup/") and t.endswith("/cgroup.procs"))
                for fd, t in fds.items()
                if fd > 2
            ), fds
        assert {p.pid for p in workers_of_reaper(reaper)} == set(methods)
        result = await pool.call("at_import")
        assert result.ok, result
    assert not psutil.pid_exists(reaper)
    assert workers_of_reaper(reaper) == []
    for pid in methods:
        assert not psutil.pid_exists(pid)


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("profile", ["default", "untrusted"])
async def test_the_tools_module_is_imported_after_set_up_in_the_worker_itself(profile: str) -> None:
    async with toolpool.Pool(TOOLS, workers=1, start_method="fork", profile=profile) as pool:
        (pid,) = pool.worker_pids
        assert pool.worker_start_methods == {pid: "fork"}
        facts = (await pool.call("at_import")).value
    assert facts["pid"] == facts["now_pid"] == pid  # not imported in the reaper
    assert facts["ppid"] == pool.reaper_pid
    assert facts["pdeathsig"] == signal.SIGKILL
    if profile == "untrusted":
        assert facts["netns"] != os.readlink("/proc/self/ns/net")
        assert facts["no_new_privs"] == "1"  # Landlock was applied before the import


async def _process_state(method: str, profile: str) -> dict[str, Any]:
    async with toolpool.Pool(TOOLS, workers=1, start_method=method, profile=profile) as pool:
        assert set(pool.worker_start_methods.values()) == {method}
        result = await pool.call("process_state")
        assert result.ok, result
        state: dict[str, Any] = result.value
        return state


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("profile", ["default", "untrusted"])
async def test_a_forked_worker_looks_like_a_spawned_one_from_inside(profile: str) -> None:
    forked = await _process_state("fork", profile)
    spawned = await _process_state("spawn", profile)
    # The endpoint and cgroup paths in argv name the worker (w1 of two different pools).
    assert len(forked.pop("argv_rest")) == len(spawned.pop("argv_rest"))
    for key in spawned:
        assert forked[key] == spawned[key], key
    assert forked["pdeathsig"] == signal.SIGKILL
    assert forked["session_leader"]
    assert forked["group_leader"]
    assert forked["reaper_helpers"] == []
    assert forked["blocked"] == []


def _load_reaper_main() -> Any:
    import importlib.util

    from toolpool.reaper import SCRIPT

    spec = importlib.util.spec_from_file_location("_test_reaper_main", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(30)
def test_the_template_refuses_to_fork_with_threads_or_a_foreign_command() -> None:
    reaper_main = _load_reaper_main()
    template = reaper_main.Template()
    spawn = reaper_main.proto.SpawnCommand
    msg = spawn(1, (sys.executable, "-m", "toolpool.worker"), {"PYTHONPATH": ""}, "")
    assert "not a toolpool worker" in template.unusable(spawn(1, ("/bin/true",), None, ""))
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        why = template.unusable(msg)
    finally:
        release.set()
        thread.join(10)
    assert template.module is not None  # it loaded; the threads are what stops it
    assert why is not None
    assert "threads" in why


@pytest.mark.timeout(30)
def test_start_method_is_validated() -> None:
    with pytest.raises(ValueError, match="start_method"):
        toolpool.Pool(TOOLS, start_method="forkserver")  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
async def test_workers_die_with_their_reaper(start_method: Any) -> None:
    """PDEATHSIG names the reaper: a forked worker is its child like a spawned one."""
    async with toolpool.Pool(TOOLS, workers=2, start_method=start_method) as pool:
        reaper = pool.reaper_pid
        assert reaper is not None
        workers = [psutil.Process(pid) for pid in pool.worker_pids]
        assert len(workers) == 2
        assert all(w.ppid() == reaper for w in workers)
        cgroups = pool._options["default"].cgroups
        bases = sorted(set(cgroups.base.values())) if cgroups is not None else []
        pool_dir = pool._dir
        os.kill(reaper, signal.SIGKILL)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert alive == [], "workers outlived their reaper"
        closing = time.monotonic()
    # Closing at once (the pool may not have seen the reaper go yet) must not wait for workers
    # that nothing can report gone any more (it waited term_grace + 30 s).
    assert time.monotonic() - closing < 10
    assert workers_of_reaper(reaper) == []
    # What the reaper would have removed, the pool removes: its cgroups (workers' included).
    assert [b for b in bases if os.path.exists(b)] == []
    assert pool_dir is not None
    assert not os.path.exists(pool_dir)
