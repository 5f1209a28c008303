"""The reaper's kill with ``cgroup.kill`` (issue 26, "A kill at the kernel's pace"): it kills
the worker's cgroup and the worker, and looks for nothing; a process that left the cgroup is
still ended before the call settles (CONTRACT C4.3), as an orphan once its parent died.
Real pools, real processes, real cgroups (skipped where this process cannot move another
into the root cgroup: not root, or no cgroup v2 with ``cgroup.kill``)."""

from __future__ import annotations

import os
import uuid

import anyio
import psutil
import pytest

import toolpool

TOOLS = "kill_tools:registry"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in cmdline:
            found.append(proc)
    return found


def _cgroup_of(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return ""


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
async def test_a_process_that_left_the_cgroup_is_gone_before_the_kill_settles(
    start_method: str,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("only a root tool can leave its cgroup")
    marker = f"toolpool-kill-{uuid.uuid4().hex}"
    try:
        pool = toolpool.Pool(TOOLS, workers=1, start_method=start_method)  # type: ignore[arg-type]
        async with pool:
            if not pool.containment().active("cgroup_kill"):
                pytest.skip("no cgroup v2 with cgroup.kill here")
            (worker,) = pool.worker_pids
            call = pool.submit("escape_below", {"marker": marker})
            with anyio.fail_after(30):
                while not _marked(marker):
                    await anyio.sleep(0.02)
            (escaped,) = _marked(marker)
            assert _cgroup_of(escaped.pid) == "/", "the grandchild did not leave the cgroup"
            assert _cgroup_of(worker) != "/"
            call.cancel(force=True)
            result = await call
            # Checked before anything else can run: the tree is gone at settle time.
            left = _marked(marker)
            assert result.outcome is toolpool.Outcome.KILLED, result
            assert result.rung is toolpool.Rung.SIGKILL
            assert left == [], f"a process that left the cgroup outlived the settle: {left}"
            assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie"
            assert (await pool.call("noop")).ok  # a new worker serves
    finally:
        for proc in _marked(marker):
            proc.kill()
