"""A short chaos soak (``bench/soak.py``; ``make soak`` runs the long one).

300 calls of the whole tool mix on 2 real workers, with random worker, descendant and reaper
kills, cancels and timeouts. Every must-be-zero number of the soak is 0, and the run did
exercise what it claims to (calls ended ok, killed and lost; the reaper died twice), so the
test cannot pass vacuously. A second test shows the soak's checker sees what it looks for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import psutil
import pytest

import toolpool

BENCH = Path(__file__).resolve().parent.parent / "bench"
SEED = int(os.environ.get("TOOLPOOL_SOAK_SEED", "1"))


def _load_soak() -> ModuleType:
    name = "toolpool_bench_soak"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, BENCH / "soak.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (dataclasses look their module up)
        spec.loader.exec_module(module)
    return module


soak = _load_soak()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_short_soak_breaks_no_promise() -> None:
    config = soak.Config(
        calls=300,
        workers=2,
        seed=SEED,
        profile="default",
        reaper_kills=2,
        cancel_rate=0.3,
        force_rate=0.5,
        stall_timeout=30.0,
    )
    report = soak.run_soak(config)
    text = report.format()
    assert report.numbers() == dict.fromkeys(report.numbers(), 0), text
    assert not report.failed, text
    assert report.submitted == report.settled == config.calls, text
    # Not vacuous: the chaos happened, and calls ended every way that matters.
    assert report.chaos.get("reaper_kills") == 2, text
    assert report.chaos.get("worker_kills", 0) > 0, text
    assert report.chaos.get("descendant_kills", 0) > 0, text
    assert report.chaos.get("cancels", 0) > 0, text
    outcomes = report.outcomes
    for outcome in ("ok", "error", "killed", "worker_lost", "aborted_before_dispatch"):
        assert outcomes.get(outcome, 0) > 0, (outcome, text)
    assert outcomes.get("aborted", 0) + outcomes.get("timeout", 0) > 0, text
    assert report.rungs.get("sigkill", 0) > 0, text
    assert report.death_checks >= outcomes["killed"] + outcomes["worker_lost"], text
    assert report.leftovers_killed > 0, text  # forked children and daemons were made
    assert report.workers_replaced > 0, text


def _started(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start ``argv``; return once the process runs it (its command line is ``argv``)."""
    proc = subprocess.Popen(argv, **kwargs)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # no event exists for an exec: a short poll
        try:
            if psutil.Process(proc.pid).cmdline() == argv:
                return proc
        except psutil.Error:
            pass
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    raise AssertionError(f"{argv} did not start")


def _tagged_sleeper(tag: str) -> subprocess.Popen[bytes]:
    """A process like those the soak's tools start: ``sleep`` with ``argv[0]`` = tag."""
    return _started([tag, "60"], executable="/bin/sleep", env={soak.TAG_ENV: tag})


SLEEP_60 = "import time; time.sleep(60)"
#: A stand-in for a reaper: starts the processes it is given (``{reaper}`` in an argv is its
#: own pid), prints their pids, and sleeps. Its children look like a pool's workers.
FAKE_REAPER = """
import json, os, subprocess, sys, time
me = str(os.getpid())
procs = []
for spec in json.loads(sys.argv[1]):
    exe, *argv = [me if part == "{reaper}" else part for part in spec]
    procs.append(subprocess.Popen(argv, executable=exe))
print(json.dumps([p.pid for p in procs]), flush=True)
time.sleep(60)
"""
#: Leaves an orphan (its parent: pid 1) whose command line reads as a worker forked just as
#: its reaper died: ``--parent-pid 1``. Nothing of it belongs to any pool.
ORPHAN = """
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.argv[1], "-c", "import time; time.sleep(60)",
                                  "--parent-pid", "1"])
    os._exit(0)
os.wait()
"""
FORKED_ARGV0 = "python -m toolpool.worker" + " " * 20


def _wait_cmdline(pid: int, argv: list[str]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # no event exists for an exec: a short poll
        try:
            if psutil.Process(pid).cmdline() == argv:
                return
        except psutil.Error:
            pass
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} never ran {argv}")


def _fake_reaper(specs: list[list[str]]) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A fake reaper (a child of this process) and the pids of its fake workers."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_REAPER, json.dumps(specs)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    pids: list[int] = json.loads(proc.stdout.readline())
    for pid, spec in zip(pids, specs, strict=True):
        _wait_cmdline(pid, [str(proc.pid) if a == "{reaper}" else a for a in spec[1:]])
    return proc, pids


def _orphan(marker: str) -> psutil.Process:
    subprocess.run([sys.executable, "-c", ORPHAN, FORKED_ARGV0 + marker], check=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # (it execs after its parent has exited)
        for proc in psutil.process_iter(["cmdline"]):
            if (proc.info["cmdline"] or [""])[0] == FORKED_ARGV0 + marker:
                return proc
        time.sleep(0.001)
    raise AssertionError("the orphan did not start")


def _wait_zombie(proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``proc`` has exited, without reaping it: it stays a zombie."""
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)


def _result(outcome: toolpool.Outcome, worker_pid: int | None) -> toolpool.Result:
    timeline = toolpool.Timeline(submitted=0.0, settled=0.0)
    return toolpool.Result(
        call_id=1, tool="fork_child", outcome=outcome, worker_pid=worker_pid, timeline=timeline
    )


@pytest.mark.timeout(60)
def test_the_soak_checker_sees_live_trees_and_leftovers(tmp_path: Path) -> None:
    """Without this, a checker that never looks would pass the soak."""
    token = "feedc0ffee"
    observer = soak.Observer(token)
    tagged = _tagged_sleeper(soak.tag_of(token, 7))
    earlier = _tagged_sleeper(soak.tag_of(token, 3))
    member = _tagged_sleeper("untagged-but-in-the-cgroup")
    endpoint = f"ipc:///nonexistent/toolpool-{token}/w1/sock"
    spawned = [sys.executable, sys.executable, "-c", SLEEP_60, "toolpool.worker"]
    reaper, (worker, copy, forked) = _fake_reaper(
        [
            [*spawned, "--endpoint", endpoint],
            [*spawned, "--endpoint", endpoint],
            [sys.executable, FORKED_ARGV0, "-c", SLEEP_60, "--parent-pid", "{reaper}"],
        ]
    )
    try:
        assert observer.add_reaper(reaper.pid)
        # The call's own tag.
        killed = _result(toolpool.Outcome.KILLED, None)
        alive = observer.tree_alive(7, killed)
        assert len(alive) == 1, alive
        assert f"pid {tagged.pid} (tagged" in alive[0], alive
        # The worker itself, a copy of it (same endpoint), and what an earlier call of the
        # same worker left; not what a call of another worker left.
        observer.observe_worker(worker)
        assert observer.workers[worker].endpoint == endpoint
        lost = _result(toolpool.Outcome.WORKER_LOST, worker)
        alive = observer.tree_alive(8, lost)
        assert len(alive) == 2, alive
        assert any(f"pid {worker} (the worker itself" in a for a in alive), alive
        assert any(f"pid {copy} (a forked copy" in a for a in alive), alive
        observer.calls_on[worker].append(3)
        alive = observer.tree_alive(8, lost)
        assert any(f"pid {earlier.pid} (tagged" in a for a in alive), alive
        # A forked worker (no endpoint in its command line): itself, and its cgroup's members.
        observer.observe_worker(forked)
        assert forked in observer.workers
        fake_cgroup = tmp_path / "w9"
        fake_cgroup.mkdir()
        (fake_cgroup / "cgroup.procs").write_text(f"{member.pid}\n")
        observer.workers[forked].cgroups = [str(fake_cgroup)]
        alive = observer.tree_alive(9, _result(toolpool.Outcome.KILLED, forked))
        assert len(alive) == 2, alive
        assert any(f"pid {forked} (the worker itself" in a for a in alive), alive
        assert any(f"pid {member.pid} (in its cgroup" in a for a in alive), alive
        # After close: every tagged process, the reaper, and its workers.
        live, _ = observer.leftovers(before=set())
        found = {proc.pid: seq for proc, _, seq in live}
        want = {tagged.pid, earlier.pid, reaper.pid, worker, copy, forked}
        assert found.keys() >= want, live
        assert (found[tagged.pid], found[earlier.pid], found[worker]) == (7, 3, None)
        # A zombie is dead: never reported.
        tagged.kill()
        _wait_zombie(tagged)
        assert observer.tree_alive(7, killed) == []
    finally:
        for p in (tagged, earlier, member):
            p.kill()
            p.wait()
        soak._kill([psutil.Process(reaper.pid), *psutil.Process(reaper.pid).children()])
        reaper.wait()
        if reaper.stdout is not None:
            reaper.stdout.close()


@pytest.mark.timeout(60)
def test_the_soak_checker_claims_nothing_that_is_not_its_own() -> None:
    """A worker forked just as its reaper died names pid 1 as its parent in its command line.
    The checker must never take pid 1 (or what it adopted) for a reaper of its run: it kills
    what it finds after close."""
    observer = soak.Observer("feedc0ffee")
    orphan = _orphan(f" soak-test-orphan-{os.getpid()}-{time.monotonic_ns()}")
    try:
        assert orphan.ppid() != os.getpid()
        assert not observer.add_reaper(1)
        assert not observer.add_reaper(orphan.pid)
        observer.observe_worker(orphan.pid)
        assert orphan.pid not in observer.workers
        assert 1 not in observer.reapers
        live, _ = observer.leftovers(before={p.pid for p in psutil.Process().children()})
        assert live == [], live
    finally:
        orphan.kill()


#: A stand-in for the cleaner ``aclose()`` names: removes a directory once its stdin closes.
CLEANER = "import shutil, sys; sys.stdin.read(); shutil.rmtree(sys.argv[1]); print('done')"


def _cleaner(directory: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", CLEANER, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )


def _pool_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "toolpool-fake"
    (directory / "w7").mkdir(parents=True)
    (directory / "w7" / "ledger").write_text("")
    return directory


@pytest.mark.timeout(60)
def test_the_soak_checker_waits_for_the_cleaner_aclose_names(tmp_path: Path) -> None:
    """aclose() may return while its reaper still removes files (CloseReport): the checker
    gives that process time to finish, and then finds nothing left."""
    run = soak.Soak(soak.Config(calls=1, cleanup_timeout=30.0))
    directory = _pool_dir(tmp_path)
    run.observer.pool_dirs.add(str(directory))
    before = {p.pid for p in psutil.Process().children()}
    cleaner = _cleaner(directory)
    report = toolpool.CloseReport(False, (str(directory),), (), cleaner.pid)
    stdin = cleaner.stdin
    assert stdin is not None

    async def check() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.check_after_close, before, report)
            await anyio.wait_all_tasks_blocked()  # the checker waits for the cleaner now
            assert directory.exists()  # nothing removed it yet: the wait is real
            stdin.close()  # the cleaner may finish

    try:
        anyio.run(check)
    finally:
        cleaner.kill()
        cleaner.wait()
    r = run.report
    assert (r.left, r.dirs_left) == (0, 0), r.problems
    assert r.cleaner_wait is not None
    assert "still being removed by process" in r.close_report
    assert not directory.exists()


@pytest.mark.timeout(60)
def test_the_soak_checker_counts_a_cleaner_that_does_not_finish_and_anything_else(
    tmp_path: Path,
) -> None:
    """The cleaner's time is bounded; past it, it is a leftover (and what it did not remove
    a directory left). Any other process of the run counts at once, whatever aclose() said."""
    run = soak.Soak(soak.Config(calls=1, cleanup_timeout=0.5))
    directory = _pool_dir(tmp_path)
    run.observer.pool_dirs.add(str(directory))
    before = {p.pid for p in psutil.Process().children()}
    cleaner = _cleaner(directory)  # its stdin stays open: it never finishes
    other = subprocess.Popen(["sleep", "60"])  # a new child of the run: no cleaner
    watched = [psutil.Process(cleaner.pid), psutil.Process(other.pid)]
    report = toolpool.CloseReport(False, (str(directory),), (), cleaner.pid)
    try:
        anyio.run(run.check_after_close, before, report)
        r = run.report
        assert (r.left, r.dirs_left) == (2, 1), r.problems
        assert r.cleaner_wait is None
        assert any(f"cleaner aclose() named (pid {cleaner.pid})" in p for p in r.problems)
        assert any(f"pid {other.pid} (a new child of the soak" in p for p in r.problems)
        assert any("1 entries: w7" in p for p in r.problems), r.problems
        # Both were killed (and reaped by the checker's kill: the pool reaps its own).
        assert not watched[0].is_running()
        assert not watched[1].is_running()
    finally:
        for proc in (cleaner, other):
            proc.kill()
            proc.wait()
        if cleaner.stdin is not None:
            cleaner.stdin.close()
