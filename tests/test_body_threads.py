"""In-process, sync tool bodies run in a thread, never on the event loop, and are never
abandoned (C2.5). (A worker process runs them on its main thread: test_main_thread.py.)

The registry uses anyio's worker threads; a native cancellation of the caller's task does not
reach the body's wait. Tests synchronise on events, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import anyio
import anyio.from_thread
import pytest

from toolpool import CancelController, Outcome, Registry

WAIT = 10.0
_var: contextvars.ContextVar[str] = contextvars.ContextVar("_var", default="unset")


@pytest.mark.anyio
async def test_sync_bodies_run_off_the_loop_and_see_the_callers_context() -> None:
    registry = Registry()
    loop_thread = threading.get_ident()

    @registry.tool
    def where() -> dict[str, Any]:
        back = anyio.from_thread.run_sync(threading.get_ident)  # a token, as in anyio's threads
        return {"thread": threading.get_ident(), "back": back, "var": _var.get()}

    _var.set("caller")
    for _ in range(3):  # the thread is reused; each call still sees the caller's context
        result = await registry.execute("where", {}, signal=CancelController().signal)
        assert result.outcome is Outcome.OK, result
        assert result.value["thread"] != loop_thread
        assert result.value["back"] == loop_thread
        assert result.value["var"] == "caller"


@pytest.mark.anyio
async def test_a_body_exception_is_the_calls_error() -> None:
    registry = Registry()

    @registry.tool
    def boom() -> None:
        raise KeyError("nope")

    result = await registry.execute("boom", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.ERROR
    assert result.error_name == "KeyError"
    assert result.body_started is True


@pytest.mark.anyio
async def test_sync_bodies_that_wait_for_each_other_run_at_once() -> None:
    registry = Registry()
    first_in = threading.Event()

    @registry.tool
    def first() -> str:
        assert first_in.wait(WAIT)
        return "first"

    @registry.tool
    def second() -> str:
        first_in.set()
        return "second"

    results: dict[str, Any] = {}

    async def run(name: str) -> None:
        results[name] = await registry.execute(name, {}, signal=CancelController().signal)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "first")
        tg.start_soon(run, "second")
    assert results["first"].value == "first"
    assert results["second"].value == "second"


async def _natively_cancelled_waiter() -> None:
    """A native cancellation of the caller's task (the registry shields the body from anyio's):
    the body is still waited for, and the caller's task ends only once it returned."""
    registry = Registry()
    release = threading.Event()
    entered = asyncio.Event()
    loop = asyncio.get_running_loop()
    settled: list[str] = []

    @registry.tool
    def body() -> str:
        loop.call_soon_threadsafe(entered.set)
        assert release.wait(WAIT)
        settled.append("body")
        return "done"

    task = asyncio.ensure_future(registry.execute("body", {}, signal=CancelController().signal))
    await asyncio.wait_for(entered.wait(), WAIT)
    task.cancel()
    for _ in range(3):  # loop turns: the waiter got the cancellation and held it
        await asyncio.sleep(0)
    assert not task.done()
    assert settled == []
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT)
    assert settled == ["body"]


def test_a_natively_cancelled_waiter_still_waits_for_the_body() -> None:
    asyncio.run(_natively_cancelled_waiter())
