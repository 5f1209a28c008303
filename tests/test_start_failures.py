"""A worker that dies before its hello is a start failure, whoever ended it (docs/pool.md,
"Start failures"): the pool cannot tell an outside SIGKILL (an operator, a chaos test, the OOM
killer) from a tools module that kills its own process at import, and the second must not make
a respawn storm. Only consecutive failures count: one worker that says hello resets the count.

White-box, on the core (no processes): the rule is the core's, and exact times matter (the
back-off between respawns).
"""

from __future__ import annotations

import pytest

from core_support import core_with_workers
from toolpool.core import WorkerStartError
from toolpool.protocol import PROTOCOL_VERSION, Hello
from toolpool.supervisor._results import WorkerState
from toolpool.supervisor.machine import Machine, Spawn


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


def _starting(core: Machine) -> int:
    (wid,) = [w.wid for w in core.workers.values() if w.state is WorkerState.SPAWNING]
    return wid


def _sigkill_at_start(core: Machine, clock: Clock) -> None:
    """The starting worker is SIGKILLed from outside before its hello; the pool's back-off
    passes and it starts the next one (unless it stopped)."""
    wid = _starting(core)
    core.spawned(wid, 2000 + wid, "fork", clock.now)
    core.exited(wid, -9, 0, clock.now)
    core.gone(wid, clock.now)
    core.flush(clock.now)
    clock.now += 2.0  # the longest back-off
    core.timer(clock.now)
    core.flush(clock.now)


def _hello(core: Machine, clock: Clock) -> None:
    wid = _starting(core)
    pid = 2000 + wid
    core.spawned(wid, pid, "fork", clock.now)
    tools = [{"name": "noop", "runs_in_thread": True}]
    core.message(wid, Hello(PROTOCOL_VERSION, pid, b"secret", tools), clock.now, peer_pid=pid)
    core.flush(clock.now)
    assert core.workers[wid].state is WorkerState.READY


def _lose_ready_worker(core: Machine, clock: Clock) -> None:
    (w,) = core.ready
    core.exited(w.wid, -9, 0, clock.now)
    core.gone(w.wid, clock.now)
    actions = core.flush(clock.now)
    # Replaced at once (no start failure, no back-off), on the loop's next turn: the turn
    # that settles its call starts nothing; the timer it armed is due now.
    assert not any(isinstance(a, Spawn) for a in actions)
    assert core.next_deadline() == clock.now
    core.timer(clock.now)
    assert any(isinstance(a, Spawn) for a in core.flush(clock.now))


@pytest.mark.timeout(10)
def test_sigkills_of_starting_workers_in_a_row_stop_the_respawns() -> None:
    core, (w,), _ = core_with_workers(1, max_start_failures=3)
    provider = w.provider  # the count is its workers' (the pool's one provider here)
    clock = Clock()
    _lose_ready_worker(core, clock)
    for _ in range(2):
        _sigkill_at_start(core, clock)
        assert provider.broken is None
    _sigkill_at_start(core, clock)
    assert isinstance(provider.broken, WorkerStartError)
    assert "exited with status -9 at start" in str(provider.broken)
    assert not [w for w in core.workers.values() if not w.gone]  # no respawn storm


@pytest.mark.timeout(10)
def test_one_worker_that_says_hello_resets_the_count() -> None:
    core, (w,), _ = core_with_workers(1, max_start_failures=3)
    clock = Clock()
    _lose_ready_worker(core, clock)
    for _ in range(2):
        _sigkill_at_start(core, clock)
    _hello(core, clock)
    _lose_ready_worker(core, clock)  # a worker that served dies: replaced, no failure
    for _ in range(2):
        _sigkill_at_start(core, clock)
    assert core.broken is None
    assert w.provider.broken is None
    assert _starting(core)  # and it goes on trying
