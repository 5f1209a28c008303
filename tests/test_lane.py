"""The worker's lane: sync calls that queue up in a worker, with no stage but their bodies,
run in one thread from take-up to result, one after the other, without a hand-off to the
worker's loop and back per call. Real workers; what the lane must keep is what every sync call
has (CONTRACT C2.5): a body in a thread, its start reported while it runs, the loop free to
read a cancel meanwhile, and every call settled in order."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import anyio.to_thread
import pytest

import toolpool
import toolpool.supervisor._dispatch as dispatch_module
from pool_support import running_pool
from toolpool import CancelController, Outcome
from toolpool.worker._threads import body_thread_context, enter_body_thread

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60, method="thread")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def queue_behind_any_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls are queued behind a call of any age here (see test_prefetch)."""
    monkeypatch.setattr(dispatch_module, "QUEUE_BEHIND_FOR", 3600.0)


async def queued_up(pool: toolpool.Pool, tool: str, args: dict[str, Any]) -> Any:
    """Submit ``tool`` so that it waits in the worker's queue with another call behind it:
    the lane takes the two up once the call before them ends. (A lone call takes the loop's
    path.)"""
    pool.submit("sync_nap", {"seconds": 0.3})
    call = pool.submit(tool, args)
    pool.submit("echo", {"value": "behind"})
    return call


async def test_queued_plain_sync_calls_run_in_the_lane_and_others_as_before() -> None:
    async with running_pool() as pool:
        assert (await pool.call("thread_name")).value == "toolpool body"  # alone
        lane = await queued_up(pool, "thread_name", {})
        assert (await lane).value == "toolpool lane"
    async with running_pool("pool_support:approving") as pool:  # an approval stage
        staged = [pool.submit("thread_name") for _ in range(3)]
        assert [(await call).value for call in staged] == ["toolpool body"] * 3


async def test_a_body_in_the_lane_reaches_its_workers_loop() -> None:
    async with running_pool() as pool:
        result = await (await queued_up(pool, "reach_the_loop", {}))
        assert result.ok, result
        assert result.value is True


async def test_a_long_body_in_the_lane_is_reported_started_while_it_runs() -> None:
    async with running_pool() as pool:
        call = await queued_up(pool, "sync_nap", {"seconds": 30})
        with anyio.fail_after(10):
            assert await call.wait_started()
        assert not call.done()  # said by the worker while the body runs, not by its result
        call.cancel()
        result = await call
        assert result.outcome is Outcome.ABORTED
        assert result.body_started is True


async def test_the_worker_idles_while_a_body_in_the_lane_waits() -> None:
    """Once a body's start is said, the loop stops looking at the lane until the call ends:
    a body that waits two seconds costs its worker about nothing (a look every 1 ms would
    cost tens of milliseconds of CPU)."""
    async with running_pool() as pool:
        result = await (await queued_up(pool, "sync_nap", {"seconds": 2}))
        assert result.ok, result
        assert result.cpu_time is not None
        assert result.cpu_time < 0.015, result.cpu_time


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


@pytest.mark.parametrize("background", [False, True], ids=["held", "allow_background"])
async def test_the_child_of_a_body_that_forks_in_the_lane_runs_no_queued_call(
    background: bool, tmp_path: Any
) -> None:
    """A body that forks and returns in both processes: the child is a leftover of that
    call, never a second worker. It must not go on as the lane and take up the calls queued
    behind, which would then run twice: there, and in the worker. (Held for leftovers, a
    child that counts the worker's cgroup as its own leftovers holds too; with background
    processes allowed, nothing holds it.)"""
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


# The lane's registry path against the loop's: the same tool, the same result. (In-process:
# Registry._execute_plain in a thread set up as the lane's, Registry.execute_owned on the loop.)

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


@pytest.mark.parametrize("cancelled", [False, True], ids=["live", "cancelled-before"])
@pytest.mark.parametrize("tool", sorted(plain.tools))
async def test_the_lanes_registry_path_settles_each_call_as_the_loops(
    tool: str, cancelled: bool
) -> None:
    loop = asyncio.get_running_loop()
    token, context = body_thread_context(loop)

    def controller() -> CancelController:
        _controllers.append(CancelController())
        if cancelled:
            _controllers[-1].cancel()
        return _controllers[-1]

    on_loop = await plain.execute_owned(tool, {}, controller=controller(), call_id="1")

    def in_the_lane() -> toolpool.ToolResult:
        enter_body_thread(token)
        return context.copy().run(
            plain._execute_plain, tool, {}, controller=controller(), call_id="1"
        )

    in_lane = await anyio.to_thread.run_sync(in_the_lane)

    def facts(r: toolpool.ToolResult) -> tuple[Any, ...]:
        return (r.outcome, r.value, r.error, r.error_name, r.body_started)

    assert facts(in_lane) == facts(on_loop)


async def test_an_exception_that_cannot_say_what_it_is_is_still_an_error() -> None:
    result = await plain.execute_owned(
        "raises_unprintable", {}, controller=CancelController(), call_id="1"
    )
    assert result.outcome is toolpool.Outcome.ERROR
    assert result.error_name == "_Unprintable"
    assert result.error == "Error: _Unprintable: <exception str() failed>"
    assert result.body_started is True
