"""A worker runs a sync tool as a script runs: on its main thread (CONTRACT C2.5, issue 15).
Signal handlers, setitimer and faulthandler work in a tool; a cancel still reaches the call's
signal while its body runs, whatever the body does; the ladder still ends a body that
ignores it. Real workers, real signals."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import toolpool
import toolpool.supervisor.machine._dispatch as dispatch_module
from pool_support import running_pool
from toolpool import CancelController, Outcome, Rung

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90, method="thread")]

TOOLS = "main_thread_tools:registry"
STAGED = "main_thread_tools:staged"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("tools", [TOOLS, STAGED], ids=["plain", "staged"])
async def test_a_tool_runs_on_its_workers_main_thread(tools: str) -> None:
    async with running_pool(tools) as pool:
        for tool in ("on_main_thread", "on_main_thread_async"):
            result = await pool.call(tool, timeout=30)
            assert result.ok, result
            assert result.value is True, tool
        result = await pool.call("runs_asyncio", timeout=30)  # no loop runs in its way
        assert result.ok, result
        assert result.value == 42


@pytest.mark.parametrize("tools", [TOOLS, STAGED], ids=["plain", "staged"])
@pytest.mark.parametrize("how", ["sleep", "select", "spin"])
async def test_a_tool_with_signal_handlers_and_setitimer_works_and_its_alarm_fires(
    tools: str, how: str
) -> None:
    """As HumanEval's guard: SIGALRM and SIGTERM handlers, setitimer, faulthandler. The
    alarm interrupts a blocking C call too: the signal reaches the main thread."""
    async with running_pool(tools) as pool:
        quick = await pool.call("guarded", {"how": how, "work": 0.01, "limit": 10}, timeout=30)
        assert quick.ok, quick
        assert quick.value == "finished"
        with anyio.fail_after(20):
            late = await pool.call("guarded", {"how": how, "work": 30, "limit": 0.2}, timeout=30)
        assert late.ok, late  # the tool's own timeout is an ordinary result
        assert late.value == "timed out"
        assert late.rung is Rung.NONE
        raised = await pool.call(
            "guarded", {"how": how, "work": 30, "limit": 0.2, "catch": False}, timeout=30
        )
        assert raised.outcome is Outcome.ERROR, raised
        assert raised.error_name == "TimeLimitExceeded"
        assert raised.body_started is True
        again = await pool.call("on_main_thread", timeout=30)  # the worker serves on
        assert again.ok
        assert again.worker_pid == quick.worker_pid


@pytest.mark.parametrize("tools", [TOOLS, STAGED], ids=["plain", "staged"])
@pytest.mark.parametrize("how", ["spin", "sleep", "select", "wait"])
async def test_a_cancel_reaches_the_signal_of_a_body_while_it_runs(tools: str, how: str) -> None:
    """Spinning in Python, blocked in C, or waiting on the signal itself: the cancel message
    is read while the body runs, and sets its signal; the body ends, cooperatively, long
    before the ladder would step in."""
    async with running_pool(tools, cancel_grace=60.0) as pool:
        call = pool.submit("cooperates", {"how": how})
        with anyio.fail_after(20):
            assert await call.wait_started()
            call.cancel()
            result = await call
        assert result.outcome is Outcome.ABORTED, result
        assert result.body_started is True
        assert result.rung is Rung.CANCEL
        assert result.timeline.cancel_delivered is not None
        assert result.timeline.returned is not None
        assert result.timeline.cancel_delivered <= result.timeline.returned


@pytest.mark.parametrize("term", [False, True], ids=["sigterm", "ignores-sigterm"])
@pytest.mark.parametrize("how", ["spin", "sleep", "select"])
async def test_a_body_that_ignores_its_signal_sees_the_cancel_and_the_ladder_ends_it(
    how: str, term: bool
) -> None:
    """The cancel is acknowledged while the body runs (deaf to it); the ladder then ends the
    worker: by SIGTERM, or, for a tool that ignores SIGTERM, by SIGKILL (C4)."""
    async with running_pool(TOOLS, cancel_grace=0.3, term_grace=0.5) as pool:
        call = pool.submit("ignores", {"how": how, "term": term})
        with anyio.fail_after(30):
            assert await call.wait_started()
            call.cancel()
            result = await call
            after = await pool.call("on_main_thread", timeout=30)
        assert result.outcome is Outcome.KILLED, result
        assert result.timeline.cancel_delivered is not None  # seen while the body ran
        assert result.rung is (Rung.SIGKILL if term else Rung.SIGTERM)
        assert after.ok, after


async def test_a_worker_whose_tools_queue_up_serves_them_in_order_on_its_main_thread() -> None:
    """Quick calls that queue up in one worker: each on the main thread, in order, with the
    results held back and sent in batches as before."""
    async with running_pool(TOOLS, prefetch=8) as pool:
        calls: list[Any] = [pool.submit("on_main_thread") for _ in range(200)]
        with anyio.fail_after(60):
            results = [await call for call in calls]
        assert all(r.ok and r.value is True for r in results), results
        returned = [r.timeline.returned or 0.0 for r in results]
        assert returned == sorted(returned)


# What the lane's tests asked of queued sync calls, asked of the main thread now.


@pytest.fixture
def queue_behind_any_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls are queued behind a call of any age here (see test_prefetch)."""
    monkeypatch.setattr(dispatch_module, "QUEUE_BEHIND_FOR", 3600.0)


async def queued_up(pool: toolpool.Pool, tool: str, args: dict[str, Any]) -> Any:
    """Submit ``tool`` so that it waits in the worker's queue behind a call, with another
    call behind it."""
    pool.submit("sync_nap", {"seconds": 0.3})
    call = pool.submit(tool, args)
    pool.submit("echo", {"value": "behind"})
    return call


@pytest.mark.usefixtures("queue_behind_any_call")
async def test_queued_calls_and_calls_with_stages_run_on_the_main_thread() -> None:
    async with running_pool() as pool:
        assert (await pool.call("thread_name")).value == "MainThread"  # alone
        queued = await queued_up(pool, "thread_name", {})
        assert (await queued).value == "MainThread"
    async with running_pool("pool_support:approving") as pool:  # an approval stage
        staged = [pool.submit("thread_name") for _ in range(3)]
        assert [(await call).value for call in staged] == ["MainThread"] * 3


@pytest.mark.usefixtures("queue_behind_any_call")
async def test_a_long_queued_body_is_reported_started_while_it_runs() -> None:
    async with running_pool() as pool:
        call = await queued_up(pool, "sync_nap", {"seconds": 30})
        with anyio.fail_after(10):
            assert await call.wait_started()
        assert not call.done()  # said by the worker while the body runs, not by its result
        call.cancel()
        result = await call
        assert result.outcome is Outcome.ABORTED
        assert result.body_started is True


@pytest.mark.usefixtures("queue_behind_any_call")
async def test_the_worker_idles_while_a_body_waits() -> None:
    """Once a body's start is said, the control thread stops looking until a message comes
    or the call ends: a body that waits two seconds costs its worker about nothing (a look
    every 1 ms would cost tens of milliseconds of CPU)."""
    async with running_pool() as pool:
        result = await (await queued_up(pool, "sync_nap", {"seconds": 2}))
        assert result.ok, result
        assert result.cpu_time is not None
        assert result.cpu_time < 0.015, result.cpu_time


@pytest.mark.usefixtures("queue_behind_any_call")
async def test_sync_and_async_calls_queued_in_one_worker_take_turns_in_order() -> None:
    async with running_pool(prefetch=8) as pool:
        calls = [
            pool.submit("echo", {"value": i}) if i % 3 else pool.submit("nap", {"seconds": 0})
            for i in range(60)
        ]
        with anyio.fail_after(30):
            results = [await call for call in calls]
        assert all(r.ok for r in results), results
        assert [r.value for i, r in enumerate(results) if i % 3] == [i for i in range(60) if i % 3]
        returned = [r.timeline.returned or 0.0 for r in results]
        assert returned == sorted(returned)  # one worker, one call at a time, in order


@pytest.mark.usefixtures("queue_behind_any_call")
@pytest.mark.parametrize("background", [False, True], ids=["held", "allow_background"])
async def test_the_child_of_a_body_that_forks_runs_no_queued_call(
    background: bool, tmp_path: Any
) -> None:
    """A body that forks and returns in both processes: the child is a leftover of that
    call, never a second worker. It must not go on as the worker and take up the calls
    queued behind, which would then run twice: there, and in the worker. (Held for
    leftovers, a child that counts the worker's cgroup as its own leftovers holds too; with
    background processes allowed, nothing holds it.)"""
    marks = tmp_path / "marks"
    async with running_pool(allow_background=background) as pool:
        forked = await queued_up(pool, "fork_and_return", {})
        after = [pool.submit("append_pid", {"path": str(marks)}) for _ in range(3)]
        with anyio.fail_after(30):
            result = await forked
            results = [await call for call in after]
        assert result.ok, result
        assert all(r.ok for r in results), results
        worker = str(result.worker_pid)
        assert marks.read_text().split() == [worker] * 3  # each ran once, in the worker


# The registry's plain path (the worker's, for a call with no stage but its body) against its
# staged path: the same tool, the same result, with sync bodies inline as in the worker, or
# in a thread as in-process.

plain = toolpool.Registry()
_controllers: list[CancelController] = []


def _cancel_own_call() -> None:
    _controllers[-1].cancel()


@plain.tool
def returns() -> int:
    return 1


@plain.tool
def raises() -> None:
    raise ValueError("no")


@plain.tool
def raises_stop_iteration() -> None:
    raise StopIteration("out")


@plain.tool
def raises_system_exit() -> None:
    raise SystemExit(3)


@plain.tool
def raises_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@plain.tool
def raises_abort_error() -> None:
    raise toolpool.AbortError("not cancelled")


@plain.tool
def cancelled_then_raises_abort_error(execution: toolpool.ToolExecution) -> None:
    _cancel_own_call()
    execution.signal.raise_if_cancelled()


@plain.tool
def cancelled_then_returns() -> int:
    _cancel_own_call()
    return 2


@plain.tool
def returns_unserializable() -> object:
    return object()


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("cannot say")


@plain.tool
def raises_unprintable() -> None:
    """An exception whose str() raises: still an ordinary error (C2.6), never a crash."""
    raise _Unprintable


@plain.tool(finalize=lambda result: result.replace_content("final"))
def finalized() -> str:
    return "raw"


def _inline(fn: Any, kwargs: dict[str, Any]) -> Any:
    return fn(**kwargs)


@pytest.mark.parametrize("cancelled", [False, True], ids=["live", "cancelled-before"])
@pytest.mark.parametrize("tool", sorted(plain.tools))
async def test_the_plain_path_settles_each_call_as_the_staged_path(
    tool: str, cancelled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def controller() -> CancelController:
        _controllers.append(CancelController())
        if cancelled:
            _controllers[-1].cancel()
        return _controllers[-1]

    in_thread = await plain.execute_owned(tool, {}, controller=controller(), call_id="1")
    monkeypatch.setattr(plain, "_sync_caller", _inline)
    inline = await plain.execute_owned(tool, {}, controller=controller(), call_id="1")
    straight = plain._execute_plain(tool, {}, controller=controller(), call_id="1")

    def facts(r: toolpool.ToolResult) -> tuple[Any, ...]:
        return (r.outcome, r.value, r.error, r.error_name, r.body_started)

    assert facts(inline) == facts(in_thread)
    assert facts(straight) == facts(in_thread)


async def test_an_exception_that_cannot_say_what_it_is_is_still_an_error() -> None:
    result = await plain.execute_owned(
        "raises_unprintable", {}, controller=CancelController(), call_id="1"
    )
    assert result.outcome is toolpool.Outcome.ERROR
    assert result.error_name == "_Unprintable"
    assert result.error == "Error: _Unprintable: <exception str() failed>"
    assert result.body_started is True
