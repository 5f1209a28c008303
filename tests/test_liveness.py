"""Two-level liveness and progress (issue 17), with real workers and real signals.

A worker's heartbeat comes from a thread that never runs tool code, so a worker whose tool
holds the GIL in C is told apart ("hung": no heartbeat) from one whose tool ignores its
signal in pure Python (it answers, the tool goes on). A tool's progress reports reach the
caller as ``call.progress`` and ``call.progress_updates()``, coalesced."""

from __future__ import annotations

import logging
import os
import tempfile

import anyio
import pytest

import toolpool
from pool_support import running_pool
from toolpool import CancelController, Outcome, Progress, Registry, Rung, ToolExecution

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120, method="thread")]

TOOLS = "liveness_tools:registry"
HEARTBEAT = 0.5  # hung after 1.5 s without one


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _until_hung(pool: toolpool.Pool, count: int) -> None:
    # A worker found hung (or answering again) is a change of the pool's: an event.
    with anyio.fail_after(60):
        while pool.statistics().hung < count:
            await pool._wait_changed()


async def test_a_worker_held_by_the_gil_is_hung_one_that_ignores_its_signal_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="toolpool")
    async with running_pool(
        TOOLS, workers=3, heartbeat=HEARTBEAT, cancel_grace=2.0, term_grace=5.0, prefetch=0
    ) as pool:
        gil = pool.submit("hold_gil")
        spin = pool.submit("spin_ignoring")
        assert await spin.wait_started()
        await _until_hung(pool, 1)
        # Only the worker whose tool holds the GIL: not the one that spins in Python, nor the
        # idle third one (each sends its heartbeats from a thread the tool cannot block).
        assert pool.statistics().hung == 1
        (hung,) = [r for r in caplog.records if "is hung" in r.getMessage()]
        assert hung.levelno == logging.WARNING
        assert hung.call_id == gil.id  # type: ignore[attr-defined]
        gil.cancel()
        spin.cancel()
        with anyio.fail_after(60):
            held, spun = await gil, await spin
        for result in (held, spun):
            assert result.outcome is Outcome.KILLED, result
            assert result.rung is Rung.SIGTERM, result
        # The hung worker's call still had its whole cooperative grace (C4.1); the spinning
        # one acknowledged its cancel, the held one could not read it.
        assert held.timeline.cancel_delivered is None
        assert spun.timeline.cancel_delivered is not None
        for result in (held, spun):
            assert result.timeline.sigterm is not None
            assert result.timeline.cancel_requested is not None
            assert result.timeline.sigterm - result.timeline.cancel_requested >= 2.0 - 1e-6
        whys = {
            r.call_id: r.why  # type: ignore[attr-defined]
            for r in caplog.records
            if getattr(r, "rung", None) == "sigterm"
        }
        assert whys == {gil.id: "hung", spin.id: "ignores_signal"}
        with anyio.fail_after(60):  # the hung one is gone (and replaced)
            while pool.statistics().hung:
                await pool._wait_changed()


async def test_without_heartbeats_nothing_is_hung() -> None:
    async with running_pool(TOOLS, workers=1, heartbeat=None, cancel_grace=0.5) as pool:
        call = pool.submit("hold_gil")
        assert await call.wait_started()
        call.cancel()
        with anyio.fail_after(60):
            result = await call
        assert result.outcome is Outcome.KILLED
        assert pool.statistics().hung == 0


@pytest.mark.parametrize("tool", ["steps_sync", "steps_async"])
async def test_progress_reaches_the_caller_coalesced_and_ends_with_the_call(tool: str) -> None:
    n = 200_000  # reported in a tight loop: far more reports than ever reach the caller
    with tempfile.TemporaryDirectory() as where:
        gate = os.path.join(where, "gate")
        async with running_pool(TOOLS, workers=1) as pool:
            call = pool.submit(tool, {"n": n, "gate": gate})
            seen: list[Progress] = []
            with anyio.fail_after(60):
                async for update in call.progress_updates():
                    seen.append(update)
                    if update.done == n and not os.path.exists(gate):
                        open(gate, "w").close()  # the tool may return now
                result = await call  # (the updates ended: it settled)
            assert result.ok, result
            assert result.value == n
            assert seen, "no progress reached the caller"
            assert seen[-1] == Progress(float(n), float(n), f"step {n}")
            assert call.progress == seen[-1]
            dones = [p.done for p in seen]
            assert dones == sorted(dones)
            assert len(seen) < n // 100, len(seen)  # coalesced: the latest wins
            # A consumer that starts after the call settled gets the last report and ends.
            late = [p async for p in call.progress_updates()]
            assert late == [seen[-1]]


async def test_bad_progress_is_the_tools_error_and_the_worker_serves_on() -> None:
    async with running_pool(TOOLS, workers=1) as pool:
        pid = None
        for how, error in (
            ("negative", "ValueError"),
            ("text", "TypeError"),
            ("nan", "ValueError"),
            ("message", "TypeError"),
        ):
            result = await pool.call("bad_progress", {"how": how}, timeout=30)
            assert result.outcome is Outcome.ERROR, result
            assert result.error_name == error, result
            pid = pid or result.worker_pid
            assert result.worker_pid == pid  # the same worker: nothing broke
        assert (await pool.call("bad_progress", {"how": "none"}, timeout=30)).value == "reported"


async def test_in_process_a_report_is_checked_and_dropped() -> None:
    registry = Registry()

    @registry.tool
    def reports(execution: ToolExecution, amount: float) -> str:
        execution.report_progress(amount, 10, "x" * 5000)
        return "ok"

    ok = await registry.execute("reports", {"amount": 3}, signal=CancelController().signal)
    assert ok.outcome is Outcome.OK
    assert ok.value == "ok"
    bad = await registry.execute("reports", {"amount": -3}, signal=CancelController().signal)
    assert bad.outcome is Outcome.ERROR
    assert bad.error_name == "ValueError"


def test_heartbeat_must_be_a_positive_number_or_none() -> None:
    for bad in (0, -1, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="heartbeat"):
            toolpool.Pool(TOOLS, heartbeat=bad)  # type: ignore[arg-type]
    assert toolpool.Pool(TOOLS, heartbeat=None).heartbeat is None
    assert toolpool.Pool(TOOLS).heartbeat == 1.0


# ---------------------------------------------------------------- the wire (C7)


def _frame(*parts: object) -> bytes:
    import msgpack

    return msgpack.packb(list(parts), use_bin_type=True)


def test_heartbeat_and_progress_frames_are_validated() -> None:
    from toolpool.protocol import (
        Heartbeat,
        ProgressMessage,
        ProtocolViolation,
        decode_from_supervisor,
        decode_from_worker,
        encode,
    )

    for message in (
        Heartbeat(),
        ProgressMessage(7, 3.0, None, None),
        ProgressMessage(7, 0.0, 10.0, "copying"),
    ):
        assert decode_from_worker(encode(message)) == message
    assert decode_from_worker(_frame("progress", 7, 3, 4, None)) == ProgressMessage(
        7, 3.0, 4.0, None
    )
    for garbage in (
        _frame("heartbeat", 1),
        _frame("progress", 7, 1.0, None),
        _frame("progress", -1, 1.0, None, None),
        _frame("progress", 7, -1.0, None, None),
        _frame("progress", 7, float("nan"), None, None),
        _frame("progress", 7, float("inf"), None, None),
        _frame("progress", 7, True, None, None),
        _frame("progress", 7, "1", None, None),
        _frame("progress", 7, 1.0, -2.0, None),
        _frame("progress", 7, 1.0, None, 5),
        _frame("progress", 7, 1.0, None, "x" * 1025),
    ):
        with pytest.raises(ProtocolViolation):
            decode_from_worker(garbage)
    for frame in (encode(Heartbeat()), encode(ProgressMessage(7, 1.0, None, None))):
        with pytest.raises(ProtocolViolation):  # the worker's to send, never the supervisor's
            decode_from_supervisor(frame)


def test_the_core_tells_hung_from_answering_and_refuses_stray_progress() -> None:
    """White box, no processes: the core's clock is its events' ``now``."""
    from core_support import core_with_workers
    from toolpool.protocol import Heartbeat, ProgressMessage

    core, (w1, w2), _ = core_with_workers(2, heartbeat=1.0)
    for w in (w1, w2):
        w.answered = False  # (as before its hello: from it the heartbeat is expected)
        core.lifecycle.on_heartbeat(w)
        w.answered = True
    core.heartbeat(1, 2.5)
    core.timer(3.0)  # w2 silent since 0 for 3 intervals: hung; w1 heard at 2.5: not
    assert (w1.hung, w2.hung) == (False, True)
    assert core.hung_count() == 1
    core.message(2, Heartbeat(), 3.5)
    assert not w2.hung
    core.timer(5.4)
    assert not w1.hung
    assert not w2.hung
    core.timer(6.6)  # w2 heard at 3.5, w1 at 2.5: both silent for 3 intervals now
    assert w1.hung
    assert w2.hung
    # Progress for a call w1 does not run breaks the protocol (C7): it is quarantined.
    core.message(1, ProgressMessage(99, 1.0, None, None), 7.0)
    assert w1.violation is not None
    assert "progress" in w1.violation
