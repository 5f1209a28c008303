"""A reaper started ahead of its pool (``toolpool/reaper/_ahead.py``).

Real processes: the next pool of the process adopts the reaper started ahead (and its workers
are forked from the template it preloaded); a pool whose workers get another path does not,
and that reaper is killed and waited for; one that no pool adopted is gone when the process
exits, and a forked child never adopts its parent's. ``toolpool eval`` and ``toolpool batch``
start theirs first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import toolpool
from toolpool.reaper import _ahead

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
TOOLS = "toolpool.testing.examples:registry"


@pytest.fixture(autouse=True)
def _nothing_ahead() -> Iterator[None]:
    assert _ahead._ahead is None
    yield
    _ahead.discard_ahead()  # (a test that failed half-way)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _pool_paths() -> list[str]:
    # What Pool(TOOLS) preloads from: this process's path, the environment's PYTHONPATH.
    return _ahead.pythonpath(os.environ, None).split(os.pathsep)


@pytest.mark.anyio
@pytest.mark.parametrize("preload", [True, False], ids=["preloaded", "not-told"])
async def test_the_next_pool_adopts_it_and_forks_from_its_template(preload: bool) -> None:
    _ahead.start_ahead()
    assert _ahead._ahead is not None
    pid = _ahead._ahead.proc.pid
    if preload:
        _ahead.preload_ahead(_pool_paths())
    async with toolpool.Pool(TOOLS, workers=2) as pool:
        assert pool.reaper_pid == pid
        assert _ahead._ahead is None
        assert sorted(pool.worker_start_methods.values()) == ["fork", "fork"]
        assert {psutil.Process(p).ppid() for p in pool.worker_pids} == {pid}
        assert (await pool.call("echo", {"value": 7})).value == 7
    assert _gone(pid)


@pytest.mark.anyio
async def test_a_pool_with_another_path_starts_its_own_and_the_other_is_ended() -> None:
    _ahead.start_ahead()
    assert _ahead._ahead is not None
    ahead = _ahead._ahead.proc
    _ahead.preload_ahead(["/nonexistent/toolpool-test-path"])
    async with toolpool.Pool(TOOLS, workers=1) as pool:
        assert pool.reaper_pid != ahead.pid
        assert ahead.returncode is not None  # killed and waited for: no zombie, no orphan
        assert (await pool.call("echo", {"value": 1})).value == 1


def _run_script(body: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_one_no_pool_adopted_is_gone_when_the_process_exits() -> None:
    (pid,) = _run_script(
        """
        from toolpool.reaper import _ahead
        _ahead.start_ahead()
        _ahead.preload_ahead(["/nowhere"])
        print(_ahead._ahead.proc.pid)
        """
    )
    assert not psutil.pid_exists(int(pid))  # killed and reaped before the process ended


def test_a_forked_child_never_adopts_nor_ends_its_parents() -> None:
    child_saw, parent_pool_reaper, ahead_pid = _run_script(
        """
        import os, anyio, toolpool
        from toolpool.reaper import _ahead
        _ahead.start_ahead()
        pid = _ahead._ahead.proc.pid
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(r)
            os.write(w, b"none" if _ahead.take_ahead(None) is None else b"took")
            os._exit(0)
        os.close(w)
        saw = os.read(r, 10).decode()
        os.waitpid(child, 0)
        async def main():
            async with toolpool.Pool("toolpool.testing.examples:registry", workers=1) as p:
                assert (await p.call("echo", {"value": 2})).value == 2
                return p.reaper_pid
        print(saw, anyio.run(main), pid)
        """
    )
    assert child_saw == "none"
    assert parent_pool_reaper == ahead_pid  # still alive after the child, and adopted


def _eval_debug(*args: str) -> subprocess.CompletedProcess[str]:
    """``toolpool --log-level debug eval ARGS --json``, run as users run it."""
    return subprocess.run(
        [sys.executable, "-m", "toolpool", "--log-level", "debug", "eval", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_toolpool_eval_adopts_the_reaper_it_started_first(tmp_path: Path) -> None:
    problems = tmp_path / "problems.jsonl"
    problems.write_text(
        json.dumps(
            {
                "task_id": "t/0",
                "prompt": 'def add(a, b):\n    """a + b"""\n',
                "entry_point": "add",
                "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
            }
        )
        + "\n"
    )
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"task_id": "t/0", "completion": "    return a + b\n"}) + "\n")
    done = _eval_debug(
        str(problems), str(samples), "-o", str(tmp_path / "results.jsonl"), "--workers", "1"
    )
    assert done.returncode == 0, done.stderr
    assert "the reaper started ahead (pid" in done.stderr, done.stderr
    assert json.loads(done.stdout)["pass_at_k"]["1"] == 1.0, done.stdout


def test_a_command_that_fails_first_leaves_no_reaper(tmp_path: Path) -> None:
    samples = tmp_path / "samples.jsonl"
    samples.write_text("")
    done = _eval_debug(
        str(tmp_path / "no-such-problems.jsonl"), str(samples), "-o", str(tmp_path / "r.jsonl")
    )
    assert done.returncode == 2, done.stderr
    found = re.search(r"reaper ahead \(pid (\d+)\)", done.stderr)
    assert found, done.stderr
    assert not psutil.pid_exists(int(found.group(1)))  # killed and reaped before the exit
