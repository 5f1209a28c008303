"""The pool's core under seeded random schedules (``tests/sim_world.py``; ``make sim`` runs
many more). A failure names its seed and the shrunk steps that replay it."""

from __future__ import annotations

import os

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
    from toolpool.supervisor._settlement import Settlement

    monkeypatch.setattr(Settlement, "_read_ledger", lambda self, w: (0, 0))
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
    from toolpool.supervisor._lifecycle import Lifecycle

    def overdue(self: Lifecycle, wid: int) -> None:
        w = self.workers.get(wid)
        if broken == "gone" and w is not None and not w.gone:
            self._worker_gone(w)

    monkeypatch.setattr(Lifecycle, "_kill_overdue", overdue)
    summary = sim_world.simulate(0, 300, 300)
    assert summary.failures
    seed, error, shrunk = summary.failures[0]
    assert caught in error, error
    with pytest.raises(sim_world.Violation):
        sim_world.run(seed, shrunk)


@pytest.mark.timeout(120)
def test_the_max_calls_checks_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Schedules run with ``max_calls_per_worker`` (1 or 3) half the time; a core that
    never retires a worker that served them all is caught."""
    from toolpool.supervisor import _dispatch

    monkeypatch.setattr(_dispatch, "_used_up", lambda w: False)
    summary = sim_world.simulate(1000, 300, 300)
    assert summary.failures
    seed, error, shrunk = summary.failures[0]
    assert "max_calls" in error, error
    with pytest.raises(sim_world.Violation):
        sim_world.run(seed, shrunk)
