"""The pool's core under seeded random schedules (``tests/sim_world.py``; ``make sim`` runs
many more). A failure names its seed and the shrunk steps that replay it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

import sim_world

SCHEDULES = int(os.environ.get("SIM_TEST_SCHEDULES", "300"))


@pytest.mark.timeout(120)
def test_the_core_keeps_its_promises_over_random_schedules() -> None:
    summary = sim_world.simulate(0, SCHEDULES, 300)
    assert not summary.failures, sim_world.report(summary)
    assert summary.schedules == SCHEDULES
    # Not vacuous: the schedules reached every outcome the model can produce.
    for outcome in ("ok", "aborted", "aborted_before_dispatch", "killed", "worker_lost"):
        assert summary.outcomes[outcome] > 0, summary.outcomes
    # ... and trees that did not die of SIGKILL: workers found unkillable, whose calls then
    # settled only once their trees went.
    assert summary.unkillable > 0
    assert summary.held_then_settled > 0
    # ... and replacements owed (a caller woken first) across a caller's steps: submits,
    # provider changes (add, remove, resize), and the pool's close.
    for kind in ("submit", "provider", "close"):
        assert summary.owed_across[kind] > 0, summary.owed_across


@pytest.mark.timeout(60)
def test_a_schedule_replays_exactly() -> None:
    steps = sim_world.make_schedule(7, 300)
    first, second = sim_world.run(7, steps), sim_world.run(7, steps)
    results = [
        [(c.id, c._result.outcome if c._result else None) for c in w.calls] for w in (first, second)
    ]
    assert results[0] == results[1]
    assert first.steps == second.steps == len(steps)


@pytest.mark.timeout(60)
def test_a_broken_promise_is_caught_and_shrunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks can fail: a core that believes no ledger (every call never taken up)
    reports bodies that ran as never started, and the simulation says so, with a seed."""
    from toolpool.supervisor.machine._settlement import Settlement

    monkeypatch.setattr(Settlement, "read_ledger", lambda self, w: (0, 0))
    summary = sim_world.simulate(0, 200, 300)
    assert summary.failures
    seed, error, shrunk = summary.failures[0]
    assert "but its body ran" in error or "ran 2 times" in error, error
    assert 0 < len(shrunk) < 300
    with pytest.raises(sim_world.Violation):
        sim_world.run(seed, shrunk)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("broken", "caught"),
    [
        ("never", "not unkillable"),  # a core that waits for ever for a tree that never goes
        ("gone", "while worker"),  # a core that takes an overdue tree for gone: settles early
    ],
)
def test_the_unkillable_checks_can_fail(
    monkeypatch: pytest.MonkeyPatch, broken: str, caught: str
) -> None:
    from toolpool.supervisor.machine._lifecycle import Lifecycle

    def overdue(self: Lifecycle, wid: int) -> None:
        w = self.s.workers.get(wid)
        if broken == "gone" and w is not None and not w.gone:
            self.worker_gone(w)

    monkeypatch.setattr(Lifecycle, "kill_overdue", overdue)
    summary = sim_world.simulate(0, 300, 300)
    assert summary.failures
    seed, error, shrunk = summary.failures[0]
    assert caught in error, error
    with pytest.raises(sim_world.Violation):
        sim_world.run(seed, shrunk)


@pytest.mark.timeout(120)
def test_a_replacement_started_in_the_turn_that_woke_its_caller_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A core that starts a dead worker's replacement at once (in the turn of the shell's
    loop that settles its call, before the caller runs) is caught; the shrunk schedule
    replays it."""
    from toolpool.supervisor.machine._fleet import Fleet

    monkeypatch.setattr(Fleet, "owe_replacement", lambda self, p, w=None: self.top_up(p))
    summary = sim_world.simulate(0, 100, 300)
    assert summary.failures
    seed, error, shrunk = summary.failures[0]
    assert "before the callers it woke run" in error, error
    with pytest.raises(sim_world.Violation):
        sim_world.run(seed, shrunk)


@pytest.mark.timeout(120)
def test_the_max_calls_checks_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Schedules run with ``max_calls_per_worker`` (1 or 3) half the time; a core that
    never retires a worker that served them all is caught."""
    from toolpool.supervisor.machine import _dispatch

    monkeypatch.setattr(_dispatch, "_used_up", lambda w: False)
    summary = sim_world.simulate(1000, 300, 300)
    assert summary.failures
    _seed, error, _shrunk = summary.failures[0]
    assert "max_calls" in error, error


def _kill_at_once_on_force(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced cancel SIGKILLs its worker at once, even while the call waits behind
    another (whose body nobody cancelled)."""
    from toolpool.supervisor.machine._ladder import Ladder

    cancel = Ladder.cancel

    def broken(self: Ladder, call: Any, cause: Any, *, force: bool) -> None:
        w = call._worker
        if force and w is not None and call._result is None:
            self.settlement.record_cause(call, cause)
            call._forced = True
            self._kill(w, call)
            return
        cancel(self, call, cause, force=force)

    monkeypatch.setattr(Ladder, "cancel", broken)


def _no_group_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine never sees a group cancelled: its later calls are queued and sent."""
    from toolpool.supervisor.machine import GroupRecord

    monkeypatch.setattr(GroupRecord, "cancelled", property(lambda self: False))


def _settle_on_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call settles as killed when its worker's SIGKILL is asked, not once its tree is
    gone."""
    from toolpool.core import Outcome
    from toolpool.supervisor.machine._ladder import Ladder

    kill = Ladder._kill

    def broken(self: Ladder, w: Any, call: Any) -> None:
        kill(self, w, call)
        self.settlement.settle(
            call, Outcome.KILLED, error="killed", error_name="Killed", body_started=None
        )

    monkeypatch.setattr(Ladder, "_kill", broken)


def _ledger_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The post-mortem believes no ledger: every call of a dead worker never taken up."""
    from toolpool.supervisor.machine._settlement import Settlement

    monkeypatch.setattr(Settlement, "read_ledger", lambda self, w: (0, 0))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("bug", "caught"),
    [
        (_kill_at_once_on_force, ("which nobody cancelled",)),
        (_no_group_check, ("sent after their group's cancel",)),
        (_settle_on_kill, ("while worker",)),
        (_ledger_ignored, ("but its body ran", "ran 2 times")),
    ],
    ids=["kill at once on force", "no group check", "settle on kill", "ledger ignored"],
)
def test_the_four_deliberate_bugs_are_caught_through_the_machines_parts(
    monkeypatch: pytest.MonkeyPatch,
    bug: Callable[[pytest.MonkeyPatch], None],
    caught: tuple[str, ...],
) -> None:
    """Each of the four bugs the simulation was first checked against, put into the part
    of the machine where it would live, is caught within a few dozen schedules, and its
    shrunk schedule replays the failure."""
    bug(monkeypatch)
    summary = sim_world.simulate(0, 300, 300)
    assert summary.failures, "not caught"
    seed, error, shrunk = summary.failures[0]
    assert any(text in error for text in caught), error
    assert seed < 100, f"caught only at seed {seed}"
    with pytest.raises(sim_world.Violation):
        sim_world.run(seed, shrunk)


def _ack_not_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker takes up its next call while a result it could not keep in its ledger is
    not acknowledged (the hold-back of a result bigger than a slot skipped)."""
    from toolpool.worker._machine import WorkerMachine

    monkeypatch.setattr(
        WorkerMachine, "_may_take", lambda self: not self.shutdown and bool(self.queue)
    )


def _resume_not_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker never holds after a call that left processes behind: it takes up the next
    call before the supervisor killed them and said 'resume'."""
    from toolpool.worker._machine import Phase, WorkerMachine

    advance = WorkerMachine.advance

    def broken(self: WorkerMachine, to: Phase) -> None:
        advance(self, Phase.IDLE if to is Phase.HELD else to)

    monkeypatch.setattr(WorkerMachine, "advance", broken)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("bug", "caught"),
    [
        (_ack_not_awaited, "not kept in its ledger"),
        (_resume_not_awaited, "before 'resume'"),
    ],
    ids=["ack not awaited", "resume not awaited"],
)
def test_two_deliberate_worker_bugs_are_caught_through_the_workers_machine(
    monkeypatch: pytest.MonkeyPatch, bug: Callable[[pytest.MonkeyPatch], None], caught: str
) -> None:
    """The simulated workers drive the real ``WorkerMachine``: a bug put into it is a bug
    of every simulated worker, caught within a few dozen schedules, and its shrunk schedule
    replays the failure."""
    bug(monkeypatch)
    summary = sim_world.simulate(0, 300, 300)
    assert summary.failures, "not caught"
    seed, error, shrunk = summary.failures[0]
    assert caught in error, error
    assert seed < 100, f"caught only at seed {seed}"
    with pytest.raises(sim_world.Violation):
        sim_world.run(seed, shrunk)
