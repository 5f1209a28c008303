"""Operators see what the pool does: one log line per lifecycle fact, with structured fields
(issue 16, item 2), and none per successful call."""

from __future__ import annotations

import logging

import anyio
import pytest

import toolpool
from toolpool import Outcome

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

EXAMPLES = "toolpool.testing.examples:registry"


def _lines(caplog: pytest.LogCaptureFixture, needle: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if needle in r.getMessage()]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_crashes_kills_and_replacements_are_logged(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="toolpool")
    async with toolpool.Pool(EXAMPLES, workers=1, cancel_grace=0.2, term_grace=0.3) as pool:
        (first,) = pool.worker_pids
        assert _lines(caplog, "ready"), caplog.text
        quiet = len(caplog.records)
        for _ in range(20):
            assert (await pool.call("noop")).ok
        assert [r for r in caplog.records[quiet:] if r.levelno >= logging.INFO] == []

        crashed = await pool.call("crash", {"code": 3})
        assert crashed.outcome is Outcome.WORKER_LOST
        (died,) = _lines(caplog, "died during a call")
        assert died.levelno == logging.WARNING
        assert died.worker_pid == first  # type: ignore[attr-defined]
        assert "status 3" in died.why  # type: ignore[attr-defined]
        # Its replacement starts on the loop's next turn, once this caller ran: a call it
        # serves comes after.
        assert (await pool.call("noop")).ok
        assert _lines(caplog, "replaced by worker")

        call = pool.submit("busy_loop", {"seconds": 60})  # only SIGTERM stops it
        assert await call.wait_started()
        call.cancel()
        with anyio.fail_after(20):
            killed = await call
        assert killed.outcome is Outcome.KILLED
        (term,) = _lines(caplog, "SIGTERM to its tree")
        assert term.levelno == logging.INFO
        assert term.rung == "sigterm"  # type: ignore[attr-defined]
        assert term.call_id == call.id  # type: ignore[attr-defined]
        assert term.tool == "busy_loop"  # type: ignore[attr-defined]

        stubborn = pool.submit("ignore_sigterm", {"seconds": 60})
        assert await stubborn.wait_started()
        stubborn.cancel(force=True)
        with anyio.fail_after(20):
            assert (await stubborn).outcome is Outcome.KILLED
        (kill,) = _lines(caplog, "SIGKILL to its tree")
        assert kill.rung == "sigkill"  # type: ignore[attr-defined]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_caller_of_a_lost_call_runs_before_its_workers_replacement_starts(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 26 step 5: the turn of the loop that settles a dead worker's call wakes its
    caller and starts nothing; the replacement starts on a later turn (its log line says
    when)."""
    caplog.set_level(logging.INFO, logger="toolpool")
    async with toolpool.Pool(EXAMPLES, workers=1) as pool:
        for n in range(3):
            crashed = await pool.call("crash", {"code": 3})
            assert crashed.outcome is Outcome.WORKER_LOST
            assert len(_lines(caplog, "replaced by worker")) == n  # not yet
            assert (await pool.call("noop")).ok  # on the replacement
            assert len(_lines(caplog, "replaced by worker")) == n + 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_start_failure_is_logged(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="toolpool")
    pool = toolpool.Pool("toolpool_no_such_module_xyz:registry", workers=1)
    with anyio.fail_after(30), pytest.raises(toolpool.WorkerStartError):
        await pool.start()
    (failed,) = _lines(caplog, "failed to start")
    assert failed.levelno == logging.INFO  # (the caller has the error: start() raised it)
    assert "ModuleNotFoundError" in failed.getMessage()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_worker_retired_on_purpose_is_logged_at_debug_with_the_real_reason(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 27: a reload, a shrink, the rollback after a ToolConflictError and the close
    retire workers on purpose. None of that is a warning, nor a dropped connection's guess
    ("an oversized frame?"): one DEBUG line per worker says why it was retired."""
    caplog.set_level(logging.DEBUG, logger="toolpool")
    async with toolpool.Pool("provider_tools:alpha", workers=2) as pool:
        assert (await pool.call("a_echo", {"value": 1})).ok
        await pool.reload_provider("default")
        await pool.resize("default", 1)
        with pytest.raises(toolpool.ToolConflictError):
            await pool.add_provider("other", "provider_tools:clash", workers=1)
    retired = _lines(caplog, ") retired (")
    reasons = [r.why for r in retired]  # type: ignore[attr-defined]
    assert sum("provider 'default' was reloaded" in w for w in reasons) == 2, reasons
    assert sum("provider 'default' was shrunk" in w for w in reasons) == 1, reasons
    rolled_back = "the start of provider 'other' was rolled back: ToolConflictError"
    assert sum(rolled_back in w for w in reasons) == 1, reasons
    assert sum("the pool is closing" in w for w in reasons) == 1, reasons
    assert {r.levelno for r in retired} == {logging.DEBUG}
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == [], caplog.text
    assert not _lines(caplog, "oversized frame"), caplog.text
    assert not _lines(caplog, "died"), caplog.text


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_pools_directory_removal_is_logged_once(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="toolpool")
    async with toolpool.Pool(EXAMPLES, workers=1) as pool:
        await pool.add_provider("more", "provider_tools:beta", workers=1)  # (owned again)
        assert (await pool.call("noop")).ok
        pool_dir = pool._dir
    assert pool_dir is not None
    removals = _lines(caplog, "the pool's directory")
    assert len(removals) == 1, caplog.text
    assert pool_dir in removals[0].getMessage()
