"""Hostile wire input and supervisor death, with real worker processes (CONTRACT C7, C4.3).

The attacking tools live in ``tests/hostile_tools.py``: they run inside real workers, find the
worker's own zmq socket and send what a compromised worker could send. A violating worker must
be killed with its whole tree, its call must settle ``worker_lost``, and the pool must keep
serving. The last tests run a supervisor in a subprocess and SIGKILL it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import toolpool
from toolpool import Outcome, Rung

TOOLS = "hostile_tools:registry"
EXAMPLES = "toolpool.testing.examples:registry"
MAX_FRAME = 64 * 1024
TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture
def anyio_backend() -> str:
    """Pool tests run on asyncio only."""
    return "asyncio"


# --------------------------------------------------------------------------- helpers


def marked(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(marker in a for a in cmdline):
            found.append(proc)
    return found


def gone(proc: psutil.Process) -> bool:
    """The process exited (a zombie has exited; its reaping may be up to PID 1)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll process state until ``predicate()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout}s: {what}")
        time.sleep(0.02)


async def await_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """The same, without blocking the event loop (the pool must keep running)."""
    with anyio.move_on_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)
    if not predicate():
        pytest.fail(f"not within {timeout}s: {what}")


def kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


@pytest.fixture
def make_marker() -> Iterator[Callable[[], str]]:
    """Unique markers for daemons a test's tools leave behind; any survivor is killed after."""
    markers: list[str] = []

    def make() -> str:
        markers.append(f"toolpool-hostile-{uuid.uuid4().hex}")
        return markers[-1]

    yield make
    for marker in markers:
        for _ in range(50):  # a fork bomb can still be forking: until none is left
            survivors = marked(marker)
            if not survivors:
                break
            kill_all(survivors)
            psutil.wait_procs(survivors, timeout=0.2)


# --------------------------------------------------------------------------- violations

VIOLATIONS = {
    "garbage": "protocol violation: undecodable frame",
    "truncated": "protocol violation: undecodable frame",
    "not_an_array": "protocol violation: a frame is an array",
    # Its first part is a pong, which no worker may send unasked: refused before the garbage.
    "multipart_garbage": "protocol violation: a pong it was not asked for",
    # Garbage, then in the same message its own call's result: believed, it would settle ok.
    "garbage_then_own_result": "protocol violation: undecodable frame",
    "oversized": "its connection dropped",
    "unknown_type": "protocol violation: unknown message type",
    "wrong_arity": "protocol violation: 'started' takes 1 fields",
    "ext_type": "protocol violation: undecodable frame",
    "killed_outcome": "protocol violation: unknown outcome 'killed'",
    "bad_value": "protocol violation: undecodable frame",
    # Out of band (issue 26 step 3): a value's parts lie in the worker's spill.
    "missing_part": "protocol violation: a reference to part 1, which does not exist",
    "spill_beyond": "protocol violation: its result names parts beyond its spill",
    "spill_too_large": "protocol violation: parts of 131072 bytes in all, with the frame",
    "too_many_parts": "protocol violation: spill must be [offset, [length, ...]] of 1 to 64",
    "result_for_other_call": "protocol violation: result for call",
    "started_for_other_call": "protocol violation: 'started' for call",
    "started_twice": "protocol violation: 'started' for call",
    "cancel_ack_for_other_call": "protocol violation: cancel_ack for call",
    "second_hello": "protocol violation: a second hello",
    "late_fatal": "protocol violation: an unexpected 'fatal'",
}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "reason"), [pytest.param(k, r, id=k) for k, r in sorted(VIOLATIONS.items())]
)
async def test_violating_worker_is_killed_and_the_pool_keeps_serving(
    kind: str, reason: str, make_marker: Callable[[], str]
) -> None:
    marker = make_marker()
    async with toolpool.Pool(TOOLS, workers=2, max_frame=MAX_FRAME, cancel_grace=5) as pool:
        workers = {pid: psutil.Process(pid) for pid in pool.worker_pids}
        assert len(workers) == 2
        # A call running on the other worker: its id is the target of the forgeries.
        bystander = pool.submit("nap", {"seconds": 60})
        with anyio.fail_after(20):
            lost = await pool.call(
                "attack",
                {"kind": kind, "target": bystander.id, "size": 2 * MAX_FRAME, "marker": marker},
            )

        # The call settled worker_lost, and only once its worker's whole tree was gone (C4.3).
        assert lost.outcome is Outcome.WORKER_LOST, lost
        assert lost.error is not None
        assert lost.error.startswith("Error: worker lost")
        assert reason in lost.error
        assert lost.error_name == "WorkerLost"
        assert lost.body_started is True
        assert lost.exit_signal == signal.SIGKILL
        assert lost.exit_code is None
        assert lost.value is None
        assert lost.timeline.reaped is not None
        assert lost.timeline.settled is not None
        assert lost.timeline.reaped <= lost.timeline.settled
        attacker = workers.pop(lost.worker_pid)  # it was one of the pool's workers
        assert gone(attacker)
        assert marked(marker) == [], "the attacker's daemon outlived its worker"

        # The other worker and its call were not touched.
        (other,) = workers.values()
        assert not gone(other)
        assert not bystander.done()

        # The pool replaced the worker and keeps serving.
        with anyio.fail_after(20):
            nxt = await pool.call("echo", {"value": kind})
        assert nxt.outcome is Outcome.OK
        assert nxt.value == kind
        assert nxt.worker_pid not in (attacker.pid, other.pid)

        bystander.cancel()
        with anyio.fail_after(20):
            by = await bystander
        assert by.outcome is Outcome.ABORTED
        assert by.worker_pid == other.pid
        assert by.value is None

        stats = pool.statistics()
        assert dict(stats.settled) == {"worker_lost": 1, "ok": 1, "aborted": 1}
        assert stats.submitted == 3
        assert stats.queued == 0
        assert stats.in_flight == 0
        assert dict(stats.workers) == {"ready": 2}
        assert stats.workers_started == 3
        assert stats.workers_replaced == 1
        # A violator's tree gets SIGKILL (rung sigkill); an oversized frame only shows as a
        # dropped connection, which a crash also causes, so no rung is claimed for it.
        expected_rung = Rung.NONE if kind == "oversized" else Rung.SIGKILL
        assert lost.rung is expected_rung
        expected = {"cancel": 1} | ({"sigkill": 1} if expected_rung is Rung.SIGKILL else {})
        assert dict(stats.escalations) == expected
        survivors = [psutil.Process(pid) for pid in pool.worker_pids]
    assert all(gone(proc) for proc in survivors)


@pytest.mark.anyio
async def test_a_second_result_for_a_settled_call_kills_the_worker(
    make_marker: Callable[[], str],
) -> None:
    """The worker's first result settles its call; the second is for a call it no longer owns."""
    async with toolpool.Pool(TOOLS, workers=1, max_frame=MAX_FRAME) as pool:
        (pid,) = pool.worker_pids
        worker = psutil.Process(pid)
        with anyio.fail_after(20):
            first = await pool.call("forge_own_result")
        # Settled exactly once, by the first result the worker sent for its own call.
        assert first.outcome is Outcome.OK
        assert first.value == "forged"
        await await_until(lambda: gone(worker), 10, "the worker that sent two results is killed")
        with anyio.fail_after(20):
            nxt = await pool.call("echo", {"value": 2})
        assert nxt.outcome is Outcome.OK
        assert nxt.worker_pid != pid
        stats = pool.statistics()
        assert dict(stats.settled) == {"ok": 2}
        assert stats.workers_started == 2
        assert stats.workers_replaced == 1
        assert dict(stats.workers) == {"ready": 1}


@pytest.mark.anyio
async def test_a_flood_of_unsolicited_pongs_does_not_stop_the_supervisor() -> None:
    """The supervisor sends no pings: the first unsolicited pong is a violation, so a flood of
    them costs nothing (it once cost the supervisor half a core and delayed other workers)."""
    async with toolpool.Pool(TOOLS, workers=2, max_frame=MAX_FRAME) as pool:
        flood = pool.submit("flood_pongs", {"seconds": 6.0})
        with anyio.fail_after(20):
            flooded = await flood
        assert flooded.outcome is Outcome.WORKER_LOST
        assert flooded.error is not None
        assert "a pong it was not asked for" in flooded.error
        for i in range(3):
            with anyio.fail_after(10):
                result = await pool.call("echo", {"value": i})
            assert result.outcome is Outcome.OK
            assert result.value == i
        assert dict(pool.statistics().settled) == {"ok": 3, "worker_lost": 1}


@pytest.mark.anyio
async def test_a_worker_cannot_disturb_another_workers_connection() -> None:
    async with toolpool.Pool(TOOLS, workers=2, max_frame=MAX_FRAME) as pool:
        workers = {pid: psutil.Process(pid) for pid in pool.worker_pids}
        victim_call = pool.submit("nap", {"seconds": 1.5})
        # Connect to the victim's endpoint (same uid, same 0700 directory), wait, leave.
        with anyio.fail_after(20):
            poke = await pool.call("poke_neighbours", {"hold": 0.3})
        assert poke.outcome is Outcome.OK
        assert poke.value == 1  # it reached the victim's endpoint
        with anyio.fail_after(20):
            victim = await victim_call
        assert victim.worker_pid in workers
        assert not gone(workers[victim.worker_pid]), "the victim worker was killed"
        assert victim.outcome is Outcome.OK, victim.error


@pytest.mark.anyio
async def test_a_stolen_secret_does_not_make_another_process_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """C7: the hello must come from the worker process itself (its socket peer's credentials),
    not merely carry its secret and claim its pid."""
    from toolpool.reaper import ReaperClient

    real_spawn = ReaperClient.spawn
    impostors: list[int] = []

    def spawn_impostor(self: ReaperClient, wid: int, argv: list[str], **kwargs: Any) -> None:
        assert argv[1:3] == ["-m", "toolpool.worker"]
        impostors.append(wid)
        kwargs["start"] = "spawn"
        real_spawn(self, wid, [argv[0], str(TESTS_DIR / "impostor_shim.py"), *argv[3:]], **kwargs)

    monkeypatch.setattr(ReaperClient, "spawn", spawn_impostor)
    pool = toolpool.Pool(TOOLS, workers=1, max_start_failures=2, start_timeout=10)
    try:
        with anyio.fail_after(30), pytest.raises(toolpool.WorkerStartError, match="not the worker"):
            await pool.start()
    finally:
        await pool.aclose()
    assert impostors == [1]  # refused at once: a start failure while starting
    # Both impostor processes (the stand-in and its child) were killed with the tree.
    assert marked(str(TESTS_DIR / "impostor_shim.py")) == []


# --------------------------------------------------------------------------- subprocess supervisors


class Supervisor:
    """A supervisor script running in a subprocess, emitting one JSON object per stdout line."""

    def __init__(self, tmp_path: Path, body: str) -> None:
        script = tmp_path / "supervisor.py"
        script.write_text(
            textwrap.dedent(
                """
                import json, os, sys
                import anyio, toolpool

                def emit(**fields):
                    print(json.dumps(fields), flush=True)

                """
            )
            + textwrap.dedent(body)
            + "\nanyio.run(main)\n"
        )
        self.stderr_path = tmp_path / "supervisor.stderr"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH")) if p)
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(script)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                cwd=tmp_path,
            )
        self.ps = psutil.Process(self.proc.pid)
        self._buffer = b""
        self.known: list[psutil.Process] = []  # processes to end if the test fails

    def read(self, timeout: float) -> dict[str, Any]:
        """The next line the script emitted, waiting at most ``timeout`` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    pytest.fail(f"the supervisor said nothing for {timeout}s{self.stderr()}")
                chunk = os.read(fd, 65536)
                if not chunk:
                    pytest.fail(f"the supervisor exited early{self.stderr()}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        event: dict[str, Any] = json.loads(line)
        return event

    def stderr(self) -> str:
        text = self.stderr_path.read_text(errors="replace")[-4000:]
        return f"; its stderr:\n{text}" if text else ""

    def track(self, *pids: int) -> list[psutil.Process]:
        procs = [psutil.Process(pid) for pid in pids]
        self.known.extend(procs)
        return procs

    def close(self) -> None:
        """End the supervisor and anything of its pool that is still around.

        The reaper kills every tree once the supervisor is gone: give it the chance before
        killing what is known (killing the reaper first would orphan the workers' children)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        psutil.wait_procs([p for p in self.known if not gone(p)], timeout=10)
        kill_all([proc for proc in self.known if not gone(proc)])


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Callable[[str], Supervisor]]:
    started: list[Supervisor] = []

    def start(body: str) -> Supervisor:
        started.append(Supervisor(tmp_path, body))
        return started[-1]

    yield start
    for sup in started:
        sup.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_supervisor_sigkill_leaves_no_process_behind(
    supervisor: Callable[[str], Supervisor], make_marker: Callable[[], str], start_method: str
) -> None:
    marker = make_marker()
    sup = supervisor(
        f"""
        async def main():
            # allow_background: the first daemon must outlive its call (by default the pool
            # kills what a call leaves behind), so the supervisor's death must be what kills it.
            async with toolpool.Pool(
                {EXAMPLES!r}, workers=2, allow_background=True, start_method={start_method!r}
            ) as pool:
                daemon = await pool.call("spawn_daemon", {{"marker": {marker!r}, "seconds": 600}})
                assert daemon.ok, daemon
                blocker = pool.submit(
                    "spawn_daemon_and_block", {{"marker": {marker!r}, "seconds": 600}}
                )
                emit(
                    workers=pool.worker_pids,
                    methods=sorted(pool.worker_start_methods.values()),
                    reaper=pool.reaper_pid,
                    daemon=daemon.value,
                    blocker=blocker.id,
                )
                await anyio.sleep_forever()
        """
    )
    info = sup.read(timeout=30)
    workers = sup.track(*info["workers"])
    (reaper,) = sup.track(info["reaper"])
    (daemon,) = sup.track(info["daemon"])
    assert len(workers) == 2
    assert info["methods"] == [start_method] * 2
    assert reaper.pid not in info["workers"]
    # Every worker is a child of the reaper, which is a child of the supervisor.
    assert reaper.ppid() == sup.proc.pid
    assert all(w.ppid() == reaper.pid for w in workers)
    assert marker in " ".join(daemon.cmdline())
    # The blocking tool has started when its own daemon exists: two daemons in all.
    wait_until(lambda: len(marked(marker)) == 2, 20, "the blocking tool's daemon to appear")
    daemons = marked(marker)
    sup.known.extend(daemons)
    assert daemon.pid in {d.pid for d in daemons}
    everything = [*workers, reaper, *daemons]
    assert not any(gone(p) for p in everything)

    sup.proc.send_signal(signal.SIGKILL)
    sup.proc.wait(timeout=10)
    assert sup.proc.returncode == -signal.SIGKILL

    wait_until(
        lambda: all(gone(p) for p in everything),
        5,
        "every worker, the reaper and the daemons gone after the supervisor died: "
        + ", ".join(f"{p.pid}" for p in everything if not gone(p)),
    )
    assert marked(marker) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("no_cgroups", [False, True], ids=["untrusted", "untrusted-no-cgroups"])
def test_supervisor_sigkill_while_hostile_tools_run(
    supervisor: Callable[[str], Supervisor], make_marker: Callable[[], str], no_cgroups: bool
) -> None:
    """Issue 4: a fork bomb and a cgroup escaper running; the supervisor is SIGKILLed;
    nothing of the pool is left within a few seconds, nor its cgroup and scratch dirs."""
    marker = make_marker()
    profile = "Profile.untrusted()"
    if no_cgroups:
        profile += ".with_limits(disable=frozenset({'cgroups'}))"
    sup = supervisor(
        f"""
        from toolpool.sandbox import Profile

        async def main():
            pool = toolpool.Pool(
                "toolpool.testing.hostile:registry", workers=2, profile={profile}
            )
            async with pool:
                bomb = pool.submit("fork_bomb", {{"marker": {marker!r}, "cap": 100}})
                escaper = pool.submit("leave_cgroup", {{"marker": {marker!r}}})
                await bomb.wait_started()
                await escaper.wait_started()
                cgroup_set = pool._options["default"].cgroups  # (white box)
                cgroups = sorted(set(cgroup_set.base.values())) if cgroup_set else []
                emit(
                    workers=pool.worker_pids,
                    methods=sorted(pool.worker_start_methods.values()),
                    reaper=pool.reaper_pid,
                    pool_dir=pool._dir,
                    cgroups=cgroups,
                )
                await anyio.sleep_forever()
        """
    )
    info = sup.read(timeout=30)
    workers = sup.track(*info["workers"])
    (reaper,) = sup.track(info["reaper"])
    if os.geteuid() == 0:  # the untrusted profile gives each worker a uid of its own
        assert all(w.uids().real == 2_000_000_000 + w.pid for w in workers), [
            (w.pid, w.uids(), w.cmdline()[:3]) for w in workers
        ]
    # Both tools are running and have spawned (the escaper's daemon, the bomb's children).
    wait_until(lambda: len(marked(marker)) >= 2, 20, "the hostile tools' processes to appear")
    spawned = marked(marker)
    sup.known.extend(spawned)
    everything = [*workers, reaper, *spawned]

    sup.proc.send_signal(signal.SIGKILL)
    sup.proc.wait(timeout=10)

    wait_until(
        lambda: all(gone(p) for p in everything) and marked(marker) == [],
        5,
        "every process of the pool gone after the supervisor died: "
        + ", ".join(f"{p.pid}" for p in everything if not gone(p)),
    )
    # The reaper cleaned up what the dead supervisor could not: cgroups and the private dir.
    wait_until(
        lambda: not any(Path(d).exists() for d in [*info["cgroups"], info["pool_dir"]]),
        5,
        "the pool's cgroup and private directories removed",
    )


@pytest.mark.timeout(60)
def test_unhashable_outcome_kills_the_worker_not_the_supervisor(
    supervisor: Callable[[str], Supervisor], make_marker: Callable[[], str]
) -> None:
    marker = make_marker()
    sup = supervisor(
        f"""
        async def main():
            async with toolpool.Pool({TOOLS!r}, workers=1, max_frame={MAX_FRAME}) as pool:
                emit(workers=pool.worker_pids, reaper=pool.reaper_pid)
                try:
                    with anyio.fail_after(20):
                        lost = await pool.call(
                            "attack", {{"kind": "unhashable_outcome", "marker": {marker!r}}}
                        )
                        emit(outcome=lost.outcome.value, error=lost.error)
                        nxt = await pool.call("echo", {{"value": 1}})
                        emit(outcome=nxt.outcome.value, error=nxt.error)
                except BaseException as exc:
                    emit(raised=repr(exc))
                    raise
            emit(closed=True)
        """
    )
    info = sup.read(timeout=30)
    sup.track(*info["workers"], info["reaper"])
    lost = sup.read(timeout=25)
    assert lost.get("outcome") == "worker_lost", lost
    assert "protocol violation" in lost["error"]
    nxt = sup.read(timeout=25)
    assert nxt.get("outcome") == "ok", nxt
    assert sup.read(timeout=25) == {"closed": True}
    assert sup.proc.wait(timeout=10) == 0
    assert marked(marker) == []


def test_a_worker_that_says_a_tool_runs_elsewhere_than_the_others_say_is_refused() -> None:
    """Where a tool's body runs decides whether calls may wait behind it (only behind a body
    in a thread, which leaves the worker's loop free to withdraw them). A worker whose hello
    says otherwise than the workers before it breaks the protocol, and changes nothing: calls
    never queue behind an async body on its word. (White box: the pool's core, fed hellos
    directly.)"""
    from core_support import FakeProbe, serve
    from toolpool.protocol import PROTOCOL_VERSION, Hello
    from toolpool.supervisor._results import WorkerState
    from toolpool.supervisor.machine import CoreConfig, Machine, ProviderSpec, WorkerRecord

    core = Machine(CoreConfig(), FakeProbe(), lambda: b"s" * 32)
    core.add_provider("default", ProviderSpec(tools_spec="x:y", size=2), 0.0)
    core.starting = False
    provider = serve(core, [])  # (after its start: a start failure does not fail it at once)
    first, second = (WorkerRecord(wid, b"s" * 32, provider) for wid in (1, 2))
    for w in (first, second):
        core.workers[w.wid] = w
    tools = [{"name": "wait", "runs_in_thread": False}, {"name": "nap", "runs_in_thread": True}]
    core.message(1, Hello(PROTOCOL_VERSION, 101, b"s" * 32, tools, {}), 1.0)
    assert first.state is WorkerState.READY
    assert core.threaded == {"nap"}
    lying = [{"name": "wait", "runs_in_thread": True}, {"name": "nap", "runs_in_thread": True}]
    core.message(2, Hello(PROTOCOL_VERSION, 102, b"s" * 32, lying, {}), 1.0)
    assert second.violation is not None
    assert "'wait' differs from the other workers'" in second.violation
    assert core.threaded == {"nap"}
    assert second.catalog == {}
    assert second.state is WorkerState.QUARANTINED
    assert second not in provider.ready
