"""The in-process tool registry: stages, views, order and classification (CONTRACT C2, C3).

Every async test runs on asyncio and trio (see ``conftest.py``). Tests synchronise on events,
never on sleeps; the only real time used is the deadline of the timeout policy.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import logging
import pathlib
import re
import threading
import time
from collections.abc import Awaitable, Callable
from types import MappingProxyType
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest

from toolpool import (
    AbortError,
    CancelCause,
    CancelController,
    CancelSignal,
    ConfigurationError,
    DispatchExecution,
    Outcome,
    Registry,
    ToolDenied,
    ToolExecution,
    ToolResult,
    fuse,
)
from toolpool.core import BODY_STARTED
from toolpool.worker._registry import DecodedArgs

BEFORE_DISPATCH_TEXT = "Error: tool call aborted before dispatch"
ABORTED_TEXT = "Error: tool call aborted"
CallNext = Callable[[], Awaitable[Any]]

#: Bounds every wait inside a tool body or stage. The registry never abandons a started body,
#: so a body parked forever would turn a failing assertion into a hang; with this bound a
#: regression fails in seconds instead.
WAIT = 10.0


async def bounded(waiting: Awaitable[Any]) -> None:
    with anyio.fail_after(WAIT):
        await waiting


# ----------------------------------------------------------------------------- helpers


async def cancel_at(
    reached: anyio.Event,
    registry: Registry,
    tool: str,
    controller: CancelController,
    *,
    cause: Any = None,
) -> ToolResult:
    """Run ``tool``, cancel ``controller`` (with ``cause``) once ``reached`` is set, and
    return the call's result."""
    results: list[ToolResult] = []
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            results.append(await registry.execute(tool, {}, signal=controller.signal))

        tg.start_soon(call)
        await reached.wait()
        controller.cancel(cause)
    [result] = results
    return result


def assert_aborted_before_dispatch(result: ToolResult) -> None:
    assert result.outcome is Outcome.ABORTED_BEFORE_DISPATCH
    assert result.error == BEFORE_DISPATCH_TEXT
    assert result.error_name == "AbortError"
    assert result.body_started is False
    assert result.value is None


def assert_aborted(result: ToolResult) -> None:
    assert result.outcome is Outcome.ABORTED
    assert result.error == ABORTED_TEXT
    assert result.error_name == "AbortError"
    assert result.body_started is True
    assert result.value is None


def assert_timeout(result: ToolResult, *, started: bool) -> None:
    assert result.outcome is Outcome.TIMEOUT
    assert result.error is not None
    assert result.error.startswith("Error: ")
    assert result.error_name == "TimeoutError"
    assert result.body_started is started
    assert result.value is None


class Recorder:
    """A registry whose every stage records that it ran, in order."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.calls: list[str] = []
        self.published: list[ToolResult] = []
        self.finalized: list[ToolResult] = []
        self.controller = CancelController()
        registry = self.registry

        @registry.pre_execute
        def pre(execution: ToolExecution) -> None:
            self.calls.append("pre")

        @registry.approval
        def approve(execution: ToolExecution) -> bool:
            self.calls.append("approval")
            return True

        @registry.around_dispatch
        async def wrapper(dispatch: DispatchExecution, call_next: CallNext) -> Any:
            self.calls.append("wrapper")
            return await call_next()

        @registry.post_execute
        def post(execution: ToolExecution, value: Any) -> None:
            self.calls.append("post")

        registry.observe(self.published.append)

        def finalize(result: ToolResult) -> ToolResult:
            self.finalized.append(result)
            return result

        @registry.tool(finalize=finalize)
        def body(x: int) -> int:
            self.calls.append("body")
            return x

    async def run(self, args: dict[str, Any] | None = None) -> ToolResult:
        args = {"x": 1} if args is None else args
        return await self.registry.execute("body", args, signal=self.controller.signal)


# ----------------------------------------------------------------------------- C3: ok


@pytest.mark.anyio
async def test_ok_async_tool() -> None:
    registry = Registry()

    @registry.tool
    async def add(a: int, b: int) -> dict[str, int]:
        return {"sum": a + b}

    result = await registry.execute("add", {"a": 2, "b": 3}, signal=CancelController().signal)
    assert result.outcome is Outcome.OK
    assert result.value == {"sum": 5}
    assert result.error is None
    assert result.error_name is None
    assert result.body_started is True
    assert result.tool == "add"
    assert BODY_STARTED[result.outcome] is True


@pytest.mark.anyio
async def test_ok_sync_tool_runs_in_a_worker_thread() -> None:
    registry = Registry()
    loop_thread = threading.get_ident()

    @registry.tool
    def where() -> bool:
        return threading.get_ident() != loop_thread

    result = await registry.execute("where", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.OK
    assert result.value is True
    assert result.body_started is True


@pytest.mark.anyio
async def test_all_stages_run_in_order() -> None:
    recorder = Recorder()
    result = await recorder.run({"x": 7})
    assert result.outcome is Outcome.OK
    assert result.value == 7
    assert recorder.calls == ["pre", "approval", "wrapper", "body", "post"]
    assert recorder.published == [result]
    assert len(recorder.finalized) == 1


@pytest.mark.anyio
async def test_result_is_frozen_and_detached() -> None:
    registry = Registry()
    kept: list[list[int]] = []

    @registry.tool
    def make() -> list[int]:
        value = [1, 2]
        kept.append(value)
        return value

    result = await registry.execute("make", {}, signal=CancelController().signal)
    kept[0].append(3)
    assert result.value == [1, 2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.outcome = Outcome.ERROR  # type: ignore[misc]
    with pytest.raises(TypeError):
        result.context["x"] = 1  # type: ignore[index]


# ----------------------------------------------------------------------------- C3: error


@pytest.mark.anyio
@pytest.mark.parametrize("is_async", [False, True])
async def test_error_when_the_body_raises(is_async: bool) -> None:
    registry = Registry()

    if is_async:

        @registry.tool(name="fail")
        async def fail_async() -> None:
            raise ValueError("bad input")
    else:

        @registry.tool(name="fail")
        def fail_sync() -> None:
            raise ValueError("bad input")

    result = await registry.execute("fail", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.ERROR
    assert result.error == "Error: ValueError: bad input"
    assert result.error_name == "ValueError"
    assert result.body_started is True


@pytest.mark.anyio
async def test_error_for_an_unknown_tool() -> None:
    registry = Registry()
    published: list[ToolResult] = []
    registry.observe(published.append)
    result = await registry.execute("nope", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.ERROR
    assert result.error is not None
    assert "unknown tool 'nope'" in result.error
    assert result.body_started is False
    assert published == [result]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "value",
    [object(), {1: "one"}, {"nested": {None: 1}}, [{2.5: "x"}]],
    ids=["object", "int-key", "nested-none-key", "float-key-in-list"],
)
async def test_error_when_the_result_cannot_be_snapshotted(value: Any) -> None:
    """Also a value msgpack packs but the protocol cannot carry (a map key other than str or
    bytes): the supervisor would take it for a protocol violation and kill the worker, so it
    is an ordinary error here instead (C2.4)."""
    registry = Registry()

    @registry.tool
    def odd() -> Any:
        return value

    result = await registry.execute("odd", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.ERROR
    assert result.error_name == "UnserializableResult"
    assert result.error is not None
    assert "not serializable" in result.error
    assert result.body_started is True


@pytest.mark.anyio
async def test_context_that_cannot_be_carried_is_noted_never_raised() -> None:
    """What a stage attaches travels with the result. An entry that cannot be carried (a map
    key the wire refuses, a value containing itself, a repr that raises) is replaced by a note;
    the others stay, and the call's outcome is its own (C2.6: never a crash of the worker)."""
    registry = Registry()

    class BadRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    @registry.tool
    def attach_all(execution: ToolExecution) -> str:
        looped: list[Any] = []
        looped.append(looped)
        execution.attach("int_keyed", {1: 2})
        execution.attach("looped", looped)
        execution.attach("bad_repr", BadRepr())
        execution.attach("fine", [1, "two"])
        execution.attach("odd_object", object())  # carried as its repr, as before
        return "returned"

    result = await registry.execute("attach_all", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.OK, result
    assert result.value == "returned"
    context = dict(result.context)
    assert context["fine"] == [1, "two"]
    assert context["odd_object"].startswith("<object object at ")
    for key in ("int_keyed", "looped", "bad_repr"):
        assert context[key].startswith("<not serializable: "), (key, context[key])


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        ("pre", "Error: pre-execute policy failed: RuntimeError: stage broke"),
        ("approval", "Error: approval failed: RuntimeError: stage broke"),
        ("wrapper", "Error: wrapper failed: RuntimeError: stage broke"),
        ("post", "Error: post-execute policy failed: RuntimeError: stage broke"),
    ],
)
async def test_error_when_a_stage_raises(stage: str, expected: str) -> None:
    registry = Registry()
    ran: list[str] = []

    def broken(*args: Any) -> Any:
        raise RuntimeError("stage broke")

    async def broken_wrapper(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        raise RuntimeError("stage broke")

    if stage == "pre":
        registry.pre_execute(broken)
    elif stage == "approval":
        registry.approval(broken)
    elif stage == "wrapper":
        registry.around_dispatch(broken_wrapper)
    else:
        registry.post_execute(broken)

    @registry.tool
    def body() -> str:
        ran.append("body")
        return "done"

    result = await registry.execute("body", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.ERROR
    assert result.error == expected
    assert result.error_name == "RuntimeError"
    assert result.body_started is (stage == "post")
    assert ran == (["body"] if stage == "post" else [])


# ----------------------------------------------------------------------------- C3: denied


def deny_by_raising(execution: ToolExecution) -> None:
    raise ToolDenied("path outside the sandbox")


def deny_by_returning_false(execution: ToolExecution) -> bool:
    return False


async def deny_async(execution: ToolExecution) -> None:
    raise ToolDenied("path outside the sandbox")


@pytest.mark.anyio
@pytest.mark.parametrize("policy", [deny_by_raising, deny_by_returning_false, deny_async])
async def test_denied_by_a_pre_execute_policy(policy: Callable[[ToolExecution], Any]) -> None:
    recorder = Recorder()
    recorder.registry.pre_execute(policy)
    result = await recorder.run()
    assert result.outcome is Outcome.DENIED
    assert result.error_name == "Denied"
    assert result.body_started is False
    assert result.error is not None
    assert result.error.startswith("Error: tool call denied: ")
    if policy is not deny_by_returning_false:
        assert "path outside the sandbox" in result.error
    assert recorder.calls == ["pre"]  # approval, wrappers, body, post never ran
    assert recorder.published == [result]


@pytest.mark.anyio
@pytest.mark.parametrize("verdict", [False, None, "yes", ToolDenied("no way")])
async def test_denied_by_approval(verdict: Any) -> None:
    registry = Registry()
    ran: list[str] = []

    @registry.approval
    async def approve(execution: ToolExecution) -> Any:
        if isinstance(verdict, BaseException):
            raise verdict
        return verdict

    @registry.tool
    def body() -> None:
        ran.append("body")

    result = await registry.execute("body", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.DENIED
    assert result.body_started is False
    assert result.error is not None
    assert result.error.startswith("Error: tool call denied: ")
    if isinstance(verdict, ToolDenied):
        assert "no way" in result.error
    assert ran == []


# ------------------------------------------------------------------- aborted_before_dispatch


@pytest.mark.anyio
async def test_cancelled_on_entry_skips_every_stage_but_finalizes_and_publishes_once() -> None:
    recorder = Recorder()
    recorder.controller.cancel()
    result = await recorder.run()
    assert_aborted_before_dispatch(result)
    assert recorder.calls == []
    assert len(recorder.finalized) == 1
    assert recorder.finalized[0].outcome is Outcome.ABORTED_BEFORE_DISPATCH
    assert recorder.published == [result]
    assert recorder.registry.idle


@pytest.mark.anyio
@pytest.mark.parametrize("cooperative", [False, True])
async def test_cancelled_during_a_pre_execute_policy(cooperative: bool) -> None:
    recorder = Recorder()
    later: list[str] = []
    in_policy = anyio.Event()

    @recorder.registry.pre_execute
    async def waits(execution: ToolExecution) -> None:
        if cooperative:
            in_policy.set()
            await bounded(execution.signal.wait())
            execution.signal.raise_if_cancelled()
        else:
            recorder.controller.cancel()

    @recorder.registry.pre_execute
    def never(execution: ToolExecution) -> None:
        later.append("second policy")

    results: list[ToolResult] = []
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            results.append(await recorder.run())

        tg.start_soon(call)
        if cooperative:
            await in_policy.wait()
            recorder.controller.cancel()
    [result] = results
    assert_aborted_before_dispatch(result)
    assert recorder.calls == ["pre"]
    assert later == []
    assert recorder.published == [result]


@pytest.mark.anyio
@pytest.mark.parametrize("ending", ["raise_if_cancelled", "approve-anyway"])
async def test_cancelled_while_approval_waits_on_the_signal(ending: str) -> None:
    registry = Registry()
    ran: list[str] = []
    waiting = anyio.Event()
    controller = CancelController()

    @registry.approval
    async def approve(execution: ToolExecution) -> bool:
        waiting.set()
        await bounded(execution.signal.wait())
        if ending == "raise_if_cancelled":
            execution.signal.raise_if_cancelled()
        return True

    @registry.around_dispatch
    async def wrapper(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        ran.append("wrapper")
        return await call_next()

    @registry.tool
    def body() -> None:
        ran.append("body")

    results: list[ToolResult] = []
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            results.append(await registry.execute("body", {}, signal=controller.signal))

        tg.start_soon(call)
        await waiting.wait()
        await anyio.wait_all_tasks_blocked()
        assert results == []  # approval really is waiting
        controller.cancel()
    [result] = results
    assert_aborted_before_dispatch(result)
    assert ran == []  # neither the wrappers nor the body started


@pytest.mark.anyio
@pytest.mark.parametrize("wrapper_behaviour", ["propagate", "swallow-and-return"])
async def test_wrapper_replaced_signal_already_cancelled(wrapper_behaviour: str) -> None:
    registry = Registry()
    ran: list[str] = []
    refused: list[BaseException] = []

    @registry.around_dispatch
    async def scope(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        nested = CancelController()
        nested.cancel()
        dispatch.signal = nested.signal
        if wrapper_behaviour == "propagate":
            return await call_next()
        try:
            return await call_next()
        except AbortError as exc:
            refused.append(exc)
            return "fallback"

    @registry.tool
    def body() -> None:
        ran.append("body")

    controller = CancelController()
    result = await registry.execute("body", {}, signal=controller.signal)
    assert_aborted_before_dispatch(result)
    assert ran == []
    assert not controller.signal.cancelled
    assert controller.signal.listener_count == 0
    if wrapper_behaviour == "swallow-and-return":
        assert len(refused) == 1


@pytest.mark.anyio
async def test_wrapper_returned_before_delegating_after_the_caller_cancelled() -> None:
    registry = Registry()
    ran: list[str] = []
    controller = CancelController()

    @registry.around_dispatch
    async def cache(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        controller.cancel()  # the caller's cancel comes first...
        return "cached value"  # ...then the wrapper returns success without delegating

    @registry.tool
    def body() -> None:
        ran.append("body")

    result = await registry.execute("body", {}, signal=controller.signal)
    assert_aborted_before_dispatch(result)
    assert ran == []


@pytest.mark.anyio
async def test_wrapper_delegating_after_the_caller_cancelled_is_refused() -> None:
    registry = Registry()
    ran: list[str] = []
    controller = CancelController()

    @registry.around_dispatch
    async def late(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        controller.cancel({"kind": "parent"})
        return await call_next()

    @registry.tool
    def body() -> None:
        ran.append("body")

    result = await registry.execute("body", {}, signal=controller.signal)
    assert_aborted_before_dispatch(result)
    assert ran == []


# ----------------------------------------------------------------------------- aborted


@pytest.mark.anyio
@pytest.mark.parametrize("style", ["async-wait", "sync-wait_blocking", "sync-poll"])
async def test_aborted_when_the_body_stops_cooperatively(style: str) -> None:
    registry = Registry()
    started = anyio.Event()
    seen: list[CancelCause | None] = []
    controller = CancelController()

    if style == "async-wait":

        @registry.tool(name="work")
        async def work_async(execution: ToolExecution) -> str:
            started.set()
            await bounded(execution.signal.wait())
            seen.append(execution.signal.reason)
            execution.signal.raise_if_cancelled()
            return "unreachable"
    elif style == "sync-wait_blocking":

        @registry.tool(name="work")
        def work_blocking(execution: ToolExecution) -> str:
            anyio.from_thread.run_sync(started.set)
            assert execution.signal.wait_blocking(timeout=WAIT)
            seen.append(execution.signal.reason)
            execution.signal.raise_if_cancelled()
            return "unreachable"
    else:

        @registry.tool(name="work")
        def work_poll(execution: ToolExecution) -> str:
            anyio.from_thread.run_sync(started.set)
            deadline = time.monotonic() + WAIT
            while not execution.signal.cancelled:  # a cheap check between units of work
                assert time.monotonic() < deadline, "never saw the cancellation"
                threading.Event().wait(0.001)  # a unit of real work
            seen.append(execution.signal.reason)
            execution.signal.raise_if_cancelled()
            return "unreachable"

    result = await cancel_at(started, registry, "work", controller, cause={"kind": "parent"})
    assert_aborted(result)
    assert seen == [{"kind": "parent"}]
    assert controller.signal.listener_count == 0


@pytest.mark.anyio
async def test_a_value_returned_after_cancellation_is_replaced_by_aborted() -> None:
    registry = Registry()
    started = anyio.Event()
    controller = CancelController()

    @registry.tool
    async def work(execution: ToolExecution) -> str:
        started.set()
        await bounded(execution.signal.wait())
        return "partial"

    result = await cancel_at(started, registry, "work", controller)
    assert_aborted(result)


@pytest.mark.anyio
@pytest.mark.parametrize("ending", ["raise_if_cancelled", "return"])
async def test_aborted_when_cancelled_during_a_post_policy_wait(ending: str) -> None:
    registry = Registry()
    in_post = anyio.Event()
    body_done: list[str] = []
    controller = CancelController()

    @registry.post_execute
    async def audit(execution: ToolExecution, value: Any) -> None:
        assert value == "written"
        in_post.set()
        await bounded(execution.signal.wait())
        if ending == "raise_if_cancelled":
            execution.signal.raise_if_cancelled()

    @registry.tool
    def write() -> str:
        body_done.append("written")
        return "written"

    result = await cancel_at(in_post, registry, "write", controller)
    assert_aborted(result)
    assert body_done == ["written"]


@pytest.mark.anyio
@pytest.mark.parametrize("ending", ["raise_if_cancelled", "return"])
async def test_aborted_when_cancelled_during_a_wrapper_wait_after_the_body(ending: str) -> None:
    registry = Registry()
    waiting = anyio.Event()
    body_done: list[str] = []
    controller = CancelController()

    @registry.around_dispatch
    async def settle(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        value = await call_next()
        waiting.set()
        await bounded(dispatch.signal.wait())
        if ending == "raise_if_cancelled":
            dispatch.signal.raise_if_cancelled()
        return value

    @registry.tool
    async def write() -> str:
        body_done.append("written")
        return "written"

    result = await cancel_at(waiting, registry, "write", controller)
    assert_aborted(result)
    assert body_done == ["written"]


# ----------------------------------------------------------------------------- timeout


@pytest.mark.anyio
@pytest.mark.parametrize("is_async", [True, False])
async def test_timeout_when_the_body_stops_cooperatively_after_the_deadline(
    is_async: bool,
) -> None:
    registry = Registry()
    seen: list[CancelCause | None] = []

    if is_async:

        @registry.tool(name="slow")
        async def slow_async(execution: ToolExecution) -> str:
            await bounded(execution.signal.wait())
            seen.append(execution.signal.reason)
            execution.signal.raise_if_cancelled()
            return "unreachable"
    else:

        @registry.tool(name="slow")
        def slow_sync(execution: ToolExecution) -> str:
            assert execution.signal.wait_blocking(timeout=WAIT)
            seen.append(execution.signal.reason)
            return "stopped early"

    controller = CancelController()
    result = await registry.execute("slow", {}, signal=controller.signal, timeout=0.05)
    assert_timeout(result, started=True)
    assert seen == [{"kind": "timeout"}]
    assert not controller.signal.cancelled  # the deadline is the policy's, not the caller's
    assert controller.signal.listener_count == 0


@pytest.mark.anyio
async def test_timeout_while_approval_waits() -> None:
    registry = Registry()
    ran: list[str] = []

    @registry.approval
    async def approve(execution: ToolExecution) -> bool:
        await bounded(execution.signal.wait())
        execution.signal.raise_if_cancelled()
        return True

    @registry.tool
    def body() -> None:
        ran.append("body")

    result = await registry.execute("body", {}, signal=CancelController().signal, timeout=0.05)
    assert_timeout(result, started=False)
    assert ran == []


@pytest.mark.anyio
async def test_a_user_cancel_before_the_deadline_is_aborted_not_timeout() -> None:
    registry = Registry()
    started = anyio.Event()
    controller = CancelController()

    @registry.tool
    async def work(execution: ToolExecution) -> None:
        started.set()
        await bounded(execution.signal.wait())
        execution.signal.raise_if_cancelled()

    results: list[ToolResult] = []
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            results.append(
                await registry.execute("work", {}, signal=controller.signal, timeout=100)
            )

        tg.start_soon(call)
        await started.wait()
        controller.cancel()
    assert_aborted(results[0])


@pytest.mark.anyio
async def test_a_deadline_that_does_not_expire_changes_nothing() -> None:
    # The deadline (100 s) exceeds the test timeout: if execute() waited for it, the test fails.
    registry = Registry()

    @registry.tool
    async def quick() -> int:
        return 1

    result = await registry.execute("quick", {}, signal=CancelController().signal, timeout=100)
    assert result.outcome is Outcome.OK
    assert result.value == 1


@pytest.mark.anyio
@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), True, "1"])
async def test_invalid_timeouts_are_rejected(timeout: Any) -> None:
    registry = Registry()
    ran: list[str] = []

    @registry.tool
    def body() -> None:
        ran.append("body")

    with pytest.raises(ValueError, match="timeout"):
        await registry.execute("body", {}, signal=CancelController().signal, timeout=timeout)
    assert ran == []
    assert registry.idle


# ----------------------------------------------------------------------------- precedence


@pytest.mark.anyio
@pytest.mark.parametrize("stage", ["pre", "approval"])
async def test_denial_wins_over_abort(stage: str) -> None:
    registry = Registry()
    controller = CancelController()

    def deny(execution: ToolExecution) -> bool:
        controller.cancel()
        raise ToolDenied("not today")

    async def approval_denies_after_waiting(execution: ToolExecution) -> bool:
        controller.cancel()
        await bounded(execution.signal.wait())
        return False

    if stage == "pre":
        registry.pre_execute(deny)
    else:
        registry.approval(approval_denies_after_waiting)

    @registry.tool
    def body() -> None:
        pass

    result = await registry.execute("body", {}, signal=controller.signal)
    assert result.outcome is Outcome.DENIED
    assert result.body_started is False


@pytest.mark.anyio
@pytest.mark.parametrize("when", ["before-delegating", "after-body"])
async def test_wrapper_failure_wins_over_abort(when: str) -> None:
    registry = Registry()
    controller = CancelController()

    @registry.around_dispatch
    async def faulty(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        if when == "after-body":
            await call_next()
        controller.cancel()
        raise KeyError("wrapper state")

    @registry.tool
    async def body() -> str:
        return "ok"

    result = await registry.execute("body", {}, signal=controller.signal)
    assert result.outcome is Outcome.ERROR
    assert result.error_name == "KeyError"
    assert result.error is not None
    assert "wrapper failed" in result.error
    assert result.body_started is (when == "after-body")


@pytest.mark.anyio
@pytest.mark.parametrize("is_async", [True, False])
async def test_tool_failure_wins_over_abort(is_async: bool) -> None:
    registry = Registry()
    controller = CancelController()

    if is_async:

        @registry.tool(name="fail")
        async def fail_async(execution: ToolExecution) -> None:
            controller.cancel()
            await bounded(execution.signal.wait())
            raise OSError("disk full")
    else:

        @registry.tool(name="fail")
        def fail_sync(execution: ToolExecution) -> None:
            controller.cancel()
            assert execution.signal.cancelled
            raise OSError("disk full")

    result = await registry.execute("fail", {}, signal=controller.signal)
    assert result.outcome is Outcome.ERROR
    assert result.error == "Error: OSError: disk full"
    assert result.error_name == "OSError"
    assert result.body_started is True


@pytest.mark.anyio
async def test_post_policy_failure_wins_over_abort() -> None:
    registry = Registry()
    controller = CancelController()

    @registry.post_execute
    def check(execution: ToolExecution, value: Any) -> None:
        controller.cancel()
        raise ValueError("value leaks a secret")

    @registry.tool
    def body() -> str:
        return "secret"

    result = await registry.execute("body", {}, signal=controller.signal)
    assert result.outcome is Outcome.ERROR
    assert result.error == "Error: post-execute policy failed: ValueError: value leaks a secret"
    assert result.error_name == "ValueError"
    assert result.body_started is True
    assert result.value is None


@pytest.mark.anyio
async def test_a_post_policy_denial_is_an_error_since_the_body_ran() -> None:
    registry = Registry()

    @registry.post_execute
    def check(execution: ToolExecution, value: Any) -> None:
        raise ToolDenied("too late to deny")

    @registry.tool
    def body() -> str:
        return "done"

    result = await registry.execute("body", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.ERROR
    assert result.body_started is True
    assert result.error is not None
    assert "too late to deny" in result.error


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"x": object()}, "not serializable"),
        ({}, "missing required argument(s): x"),
        ({"x": "one"}, "argument 'x' must be an integer, got str"),
        ({"x": 1, "y": 2}, "unexpected argument(s): y"),
    ],
)
async def test_argument_failure_wins_over_cancellation(args: dict[str, Any], problem: str) -> None:
    recorder = Recorder()
    recorder.controller.cancel()
    result = await recorder.run(args)
    assert result.outcome is Outcome.ERROR
    assert result.error is not None
    assert problem in result.error
    assert result.body_started is False
    assert recorder.calls == []
    assert recorder.published == [result]
    assert len(recorder.finalized) == 1


@pytest.mark.anyio
async def test_context_attached_before_cancellation_is_kept() -> None:
    registry = Registry()
    controller = CancelController()

    @registry.pre_execute
    def pre(execution: ToolExecution) -> None:
        execution.attach("policy", "checked")

    @registry.around_dispatch
    async def wrapper(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        dispatch.attach("wrapper", 1)
        return await call_next()

    @registry.tool
    async def body(execution: ToolExecution) -> str:
        execution.attach("progress", [1, 2])
        controller.cancel()
        execution.signal.raise_if_cancelled()
        return "unreachable"

    result = await registry.execute("body", {}, signal=controller.signal)
    assert_aborted(result)
    assert dict(result.context) == {"policy": "checked", "wrapper": 1, "progress": [1, 2]}


@pytest.mark.anyio
async def test_context_attached_before_an_abort_before_dispatch_is_kept() -> None:
    registry = Registry()
    controller = CancelController()

    @registry.pre_execute
    def pre(execution: ToolExecution) -> None:
        execution.attach("risk", "low")

    @registry.approval
    async def approve(execution: ToolExecution) -> bool:
        execution.attach("asked", True)
        controller.cancel()
        execution.signal.raise_if_cancelled()
        return True

    @registry.tool
    def body() -> None:
        pass

    result = await registry.execute("body", {}, signal=controller.signal)
    assert_aborted_before_dispatch(result)
    assert dict(result.context) == {"risk": "low", "asked": True}


# ----------------------------------------------------------------------------- wrappers


@pytest.mark.anyio
async def test_a_wrapper_cannot_cut_the_caller_off() -> None:
    registry = Registry()
    started = anyio.Event()
    controller = CancelController()
    own = CancelController()
    body_signals: list[CancelSignal] = []
    seen: list[CancelCause | None] = []

    @registry.around_dispatch
    async def detach(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        dispatch.signal = own.signal  # not derived from the caller's signal at all
        return await call_next()

    @registry.tool
    async def body(execution: ToolExecution) -> None:
        body_signals.append(execution.signal)
        started.set()
        await bounded(execution.signal.wait())
        seen.append(execution.signal.reason)
        execution.signal.raise_if_cancelled()

    result = await cancel_at(started, registry, "body", controller, cause={"kind": "parent"})
    assert_aborted(result)
    assert seen == [{"kind": "parent"}]
    assert body_signals[0] is not own.signal
    assert body_signals[0] is not controller.signal
    assert not own.signal.cancelled
    assert own.signal.listener_count == 0
    assert controller.signal.listener_count == 0


@pytest.mark.anyio
async def test_a_wrapper_replacement_reaches_the_body() -> None:
    registry = Registry()
    started = anyio.Event()
    scope = CancelController()

    @registry.around_dispatch
    async def nested(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        with fuse(dispatch.signal, scope.signal) as derived:
            dispatch.signal = derived
            return await call_next()

    @registry.tool
    async def body(execution: ToolExecution) -> None:
        started.set()
        await bounded(execution.signal.wait())
        execution.signal.raise_if_cancelled()

    controller = CancelController()
    results: list[ToolResult] = []
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            results.append(await registry.execute("body", {}, signal=controller.signal))

        tg.start_soon(call)
        await started.wait()
        scope.cancel()
    assert_aborted(results[0])
    assert not controller.signal.cancelled
    assert scope.signal.listener_count == 0
    assert controller.signal.listener_count == 0


@pytest.mark.anyio
async def test_wrappers_compose_outermost_first() -> None:
    registry = Registry()
    order: list[str] = []
    outer_scope, inner_scope = CancelController(), CancelController()
    started = anyio.Event()

    @registry.around_dispatch
    async def outer(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        order.append("outer in")
        with fuse(dispatch.signal, outer_scope.signal) as derived:
            dispatch.signal = derived
            try:
                return await call_next()
            finally:
                order.append("outer out")

    @registry.around_dispatch
    async def inner(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        order.append("inner in")
        with fuse(dispatch.signal, inner_scope.signal) as derived:
            dispatch.signal = derived
            try:
                return await call_next()
            finally:
                order.append("inner out")

    @registry.tool
    async def body(execution: ToolExecution) -> None:
        order.append("body")
        started.set()
        await bounded(execution.signal.wait())
        execution.signal.raise_if_cancelled()

    results: list[ToolResult] = []
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            results.append(await registry.execute("body", {}, signal=CancelController().signal))

        tg.start_soon(call)
        await started.wait()
        outer_scope.cancel()  # the outer wrapper's scope still reaches the body
    assert_aborted(results[0])
    assert order == ["outer in", "inner in", "body", "inner out", "outer out"]


@pytest.mark.anyio
@pytest.mark.parametrize("wrapper_raises", [False, True])
async def test_the_callers_signal_is_restored_after_dispatch(wrapper_raises: bool) -> None:
    registry = Registry()
    views: list[tuple[DispatchExecution, CancelSignal]] = []
    own = CancelController()

    @registry.around_dispatch
    async def replace(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        views.append((dispatch, dispatch.signal))
        dispatch.signal = own.signal
        assert dispatch.signal is own.signal
        value = await call_next()
        if wrapper_raises:
            raise RuntimeError("after the body")
        return value

    @registry.tool
    def body() -> int:
        return 1

    result = await registry.execute("body", {}, signal=CancelController().signal)
    assert result.outcome is (Outcome.ERROR if wrapper_raises else Outcome.OK)
    [(view, original)] = views
    assert view.signal is original
    assert view.signal is not own.signal


@pytest.mark.anyio
async def test_a_wrapper_can_never_remove_the_signal() -> None:
    registry = Registry()
    ran: list[str] = []
    rejected: list[BaseException] = []

    @registry.around_dispatch
    async def remove(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        try:
            dispatch.signal = None  # type: ignore[assignment]
        except TypeError as exc:
            rejected.append(exc)
            raise
        return await call_next()

    @registry.tool
    def body() -> None:
        ran.append("body")

    result = await registry.execute("body", {}, signal=CancelController().signal)
    assert len(rejected) == 1
    assert "never removed" in str(rejected[0])
    assert result.outcome is Outcome.ERROR
    assert result.error_name == "TypeError"
    assert result.body_started is False
    assert ran == []


@pytest.mark.anyio
async def test_only_wrappers_may_replace_the_signal() -> None:
    registry = Registry()
    attempts: list[str] = []
    other = CancelController()

    def try_replace(execution: ToolExecution, *rest: Any) -> None:
        assert isinstance(execution, ToolExecution)
        try:
            execution.signal = other.signal  # type: ignore[misc]
        except AttributeError:
            attempts.append("refused")

    registry.pre_execute(try_replace)
    registry.approval(lambda execution: try_replace(execution) or True)
    registry.post_execute(try_replace)

    @registry.tool
    def body(execution: ToolExecution) -> None:
        try_replace(execution)

    result = await registry.execute("body", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.OK
    assert attempts == ["refused"] * 4


@pytest.mark.anyio
async def test_fusion_leaves_no_listeners_after_10000_calls() -> None:
    registry = Registry()
    controller = CancelController()
    wrapper_signals: list[CancelSignal] = []
    during: list[int] = []

    @registry.around_dispatch
    async def replace(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        own = CancelController()
        wrapper_signals.append(own.signal)
        dispatch.signal = own.signal
        return await call_next()

    @registry.around_dispatch
    async def nested(dispatch: DispatchExecution, call_next: CallNext) -> Any:
        with fuse(dispatch.signal, CancelController().signal) as derived:
            dispatch.signal = derived
            return await call_next()

    @registry.tool
    async def echo(i: int) -> int:
        during.append(controller.signal.listener_count)
        return i

    for i in range(10_000):
        result = await registry.execute("echo", {"i": i}, signal=controller.signal)
        assert result.outcome is Outcome.OK
    assert result.value == 9_999
    assert min(during) >= 1  # the registry did listen while each call ran...
    assert controller.signal.listener_count == 0  # ...and removed every listener afterwards
    assert len(wrapper_signals) == 10_000
    assert all(s.listener_count == 0 for s in wrapper_signals)
    assert registry.idle


# ----------------------------------------------------------------------------- never abandoned


@pytest.mark.anyio
@pytest.mark.parametrize("is_async", [True, False])
async def test_body_keeps_running_when_the_awaiting_task_is_cancelled(is_async: bool) -> None:
    registry = Registry()
    started = anyio.Event()
    saw_cancel = anyio.Event()
    release_async = anyio.Event()
    release_sync = threading.Event()
    log: list[Any] = []
    published: list[ToolResult] = []
    registry.observe(published.append)

    if is_async:

        @registry.tool(name="slow")
        async def slow_async(execution: ToolExecution) -> str:
            started.set()
            await bounded(execution.signal.wait())
            log.append(execution.signal.reason)
            saw_cancel.set()
            await bounded(release_async.wait())
            log.append("finished")
            return "done"
    else:

        @registry.tool(name="slow")
        def slow_sync(execution: ToolExecution) -> str:
            anyio.from_thread.run_sync(started.set)
            assert execution.signal.wait_blocking(timeout=WAIT)
            log.append(execution.signal.reason)
            anyio.from_thread.run_sync(saw_cancel.set)
            assert release_sync.wait(timeout=WAIT)
            log.append("finished")
            return "done"

    controller = CancelController()
    outcome: list[Any] = []
    scope = anyio.CancelScope()

    async def caller() -> None:
        with scope:
            try:
                await registry.execute("slow", {}, signal=controller.signal)
                outcome.append("returned")
            except anyio.get_cancelled_exc_class():
                outcome.append(("cancelled", list(log)))
                raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await started.wait()
        scope.cancel()
        await saw_cancel.wait()
        await anyio.wait_all_tasks_blocked()
        assert outcome == []  # the cancellation is held until the body settles
        assert not registry.idle
        assert registry.in_flight == 1
        release_async.set()
        release_sync.set()
    assert outcome == [("cancelled", [{"kind": "parent"}, "finished"])]
    assert not controller.signal.cancelled  # the caller's own signal is not touched
    assert controller.signal.listener_count == 0
    assert registry.idle
    [result] = published  # the result was recorded, though not delivered
    assert_aborted(result)


@pytest.mark.anyio
async def test_a_sync_body_ignoring_its_signal_is_waited_for() -> None:
    registry = Registry()
    started = anyio.Event()
    release = threading.Event()
    finished: list[str] = []
    controller = CancelController()

    @registry.tool
    def stubborn() -> str:
        anyio.from_thread.run_sync(started.set)
        assert release.wait(timeout=WAIT)
        finished.append("finished")
        return "done anyway"

    results: list[ToolResult] = []
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            results.append(await registry.execute("stubborn", {}, signal=controller.signal))

        tg.start_soon(call)
        await started.wait()
        controller.cancel()
        await anyio.wait_all_tasks_blocked()
        assert results == []
        assert finished == []
        assert not registry.idle
        release.set()
    assert finished == ["finished"]
    assert_aborted(results[0])
    assert registry.idle


# ----------------------------------------------------------------------------- execute() API


@pytest.mark.anyio
@pytest.mark.parametrize(
    "signal",
    [None, "signal", {"cancelled": False}, object()],
    ids=["none", "str", "dict", "object"],
)
async def test_execute_needs_a_real_signal(signal: Any) -> None:
    registry = Registry()
    ran: list[str] = []
    published: list[ToolResult] = []
    registry.observe(published.append)

    @registry.tool
    def body() -> None:
        ran.append("body")

    with pytest.raises(TypeError, match="CancelSignal"):
        await registry.execute("body", {}, signal=signal)
    controller = CancelController()
    with pytest.raises(TypeError, match="CancelSignal"):
        await registry.execute("body", {}, signal=controller)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await registry.execute("body", {})  # type: ignore[call-arg]
    assert ran == []
    assert published == []
    assert registry.idle


@pytest.mark.anyio
async def test_call_ids_and_the_execution_view() -> None:
    registry = Registry()
    views: list[ToolExecution] = []
    controller = CancelController()

    @registry.tool
    def inspect_me(path: str, ctx: ToolExecution) -> str:
        views.append(ctx)
        with pytest.raises(TypeError):
            ctx.args["path"] = "elsewhere"  # type: ignore[index]
        return ctx.call_id

    result = await registry.execute(
        "inspect_me", {"path": "/tmp"}, signal=controller.signal, call_id="call-7"
    )
    assert result.outcome is Outcome.OK
    assert result.value == "call-7"
    assert result.call_id == "call-7"
    [view] = views
    assert view.tool == "inspect_me"
    assert dict(view.args) == {"path": "/tmp"}
    assert isinstance(view.signal, CancelSignal)

    other = await registry.execute("inspect_me", {"path": "/"}, signal=controller.signal)
    assert other.call_id
    assert other.call_id != "call-7"


@pytest.mark.anyio
async def test_arguments_are_snapshotted() -> None:
    registry = Registry()
    seen: list[Any] = []

    @registry.tool
    def take(items: list[int]) -> None:
        seen.append(items)

    args = {"items": [1, 2]}
    result = await registry.execute("take", args, signal=CancelController().signal)
    assert result.outcome is Outcome.OK
    assert seen == [[1, 2]]
    assert seen[0] is not args["items"]


@pytest.mark.anyio
async def test_on_dispatch_runs_immediately_before_the_body() -> None:
    recorder = Recorder()
    result = await recorder.registry.execute(
        "body",
        {"x": 1},
        signal=recorder.controller.signal,
        on_dispatch=lambda: recorder.calls.append("dispatched"),
    )
    assert result.outcome is Outcome.OK
    assert recorder.calls == ["pre", "approval", "wrapper", "dispatched", "body", "post"]


@pytest.mark.anyio
async def test_idle_and_wait_idle_are_truthful() -> None:
    registry = Registry()
    started = [anyio.Event(), anyio.Event()]
    release = [anyio.Event(), anyio.Event()]
    settled = [anyio.Event(), anyio.Event()]
    events: list[str] = []
    controller = CancelController()

    @registry.tool
    async def work(n: int) -> None:
        started[n].set()
        await bounded(release[n].wait())
        events.append(f"body {n} settled")

    assert registry.idle
    assert registry.in_flight == 0
    await registry.wait_idle()  # returns at once when idle

    async def call(n: int) -> None:
        await registry.execute("work", {"n": n}, signal=controller.signal)
        settled[n].set()

    async def waiter() -> None:
        await registry.wait_idle()
        events.append("idle")

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 0)
        tg.start_soon(call, 1)
        await started[0].wait()
        await started[1].wait()
        assert registry.in_flight == 2
        tg.start_soon(waiter)
        controller.cancel()  # cancelling does not make a running body settle
        await anyio.wait_all_tasks_blocked()
        assert events == []
        assert not registry.idle
        release[0].set()
        await settled[0].wait()
        await anyio.wait_all_tasks_blocked()
        assert events == ["body 0 settled"]
        assert not registry.idle
        assert registry.in_flight == 1
        release[1].set()
    assert events == ["body 0 settled", "body 1 settled", "idle"]
    assert registry.idle
    assert registry.in_flight == 0


@pytest.mark.anyio
async def test_raising_observers_break_nothing(caplog: pytest.LogCaptureFixture) -> None:
    registry = Registry()
    seen: list[ToolResult] = []

    @registry.observe
    def broken(result: ToolResult) -> None:
        raise RuntimeError("observer broke")

    registry.observe(seen.append)

    @registry.tool
    def body() -> int:
        return 3

    with caplog.at_level(logging.ERROR, logger="toolpool.worker"):
        first = await registry.execute("body", {}, signal=CancelController().signal)
        second = await registry.execute("body", {}, signal=CancelController().signal)
    assert first.outcome is Outcome.OK
    assert first.value == 3
    assert seen == [first, second]
    assert sum("observer" in r.getMessage() for r in caplog.records) == 2
    assert registry.idle


# ----------------------------------------------------------------------------- finalizers


@pytest.mark.anyio
async def test_a_finalizer_rewrites_content_but_not_the_outcome() -> None:
    registry = Registry()

    def truncate(result: ToolResult) -> ToolResult:
        if result.outcome is Outcome.OK:
            return result.replace_content(value=str(result.value)[:3])
        return dataclasses.replace(result, outcome=Outcome.OK, body_started=True)

    @registry.tool(finalize=truncate)
    def long(fail: bool = False) -> str:
        if fail:
            raise ValueError("nope")
        return "abcdefgh"

    ok = await registry.execute("long", {}, signal=CancelController().signal)
    assert ok.outcome is Outcome.OK
    assert ok.value == "abc"
    failed = await registry.execute("long", {"fail": True}, signal=CancelController().signal)
    assert failed.outcome is Outcome.ERROR
    assert failed.error == "Error: ValueError: nope"


@pytest.mark.anyio
@pytest.mark.parametrize("bad", ["raises", "wrong-type", "unserializable"])
async def test_a_failing_finalizer_gives_error(bad: str) -> None:
    registry = Registry()

    def finalize(result: ToolResult) -> Any:
        if bad == "raises":
            raise RuntimeError("finalizer broke")
        if bad == "wrong-type":
            return "not a result"
        return result.replace_content(value=object())

    @registry.tool(finalize=finalize)
    def body() -> int:
        return 1

    result = await registry.execute("body", {}, signal=CancelController().signal)
    assert result.outcome is Outcome.ERROR
    assert result.error is not None
    assert result.error.startswith("Error: content finalizer failed: ")
    assert result.value is None
    assert result.body_started is True


# ----------------------------------------------------------------------------- arguments


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({}, "missing required argument(s): path"),
        ({"path": 3}, "argument 'path' must be a string, got int"),
        ({"path": "a", "count": "3"}, "argument 'count' must be an integer, got str"),
        ({"path": "a", "count": True}, "argument 'count' must be an integer, got bool"),
        ({"path": "a", "mode": "rw"}, "argument 'mode' must be"),
        ({"path": "a", "tags": [1]}, "argument 'tags' must be"),
        ({"path": "a", "ratio": "x"}, "argument 'ratio' must be a number, got str"),
        ({"path": "a", "force": 1}, "unexpected argument(s): force"),
        ({"path": "a", "ctx": 1}, "argument 'ctx' is supplied by the runtime"),
        ({"path": object()}, "not serializable"),
        ({1: "a"}, "argument names must be strings"),
        (["path"], "arguments must be a mapping"),
    ],
)
async def test_invalid_arguments_are_named_and_the_body_never_starts(
    args: Any, message: str
) -> None:
    registry = Registry()
    ran: list[str] = []

    @registry.tool
    def read(
        path: str,
        ctx: ToolExecution,
        count: int = 1,
        ratio: float = 0.5,
        mode: Literal["r", "w"] = "r",
        tags: list[str] | None = None,
    ) -> None:
        ran.append("body")

    result = await registry.execute("read", args, signal=CancelController().signal)
    assert result.outcome is Outcome.ERROR
    assert result.error_name == "InvalidArguments"
    assert result.error is not None
    assert result.error.startswith("Error: invalid arguments for tool 'read': ")
    assert message in result.error
    assert result.body_started is False
    assert ran == []


@pytest.mark.anyio
async def test_arguments_fresh_from_msgpack_are_frozen_without_a_copy() -> None:
    """The worker's arguments, just decoded (DecodedArgs), need no snapshot: the body sees
    them read-only, bound and checked as any others, and their values are not copied again
    (a large payload is not copied twice more); any other mapping is still snapshotted."""
    registry = Registry()
    seen: list[Any] = []

    @registry.tool
    def keep(args_view: ToolExecution, data: bytes, items: list[int]) -> None:
        seen.append((args_view.args, data, items))

    data, items = b"x" * 100_000, [1, 2]
    for args, copied in (
        (DecodedArgs(data=data, items=items), False),
        ({"data": data, "items": items}, True),
    ):
        seen.clear()
        result = await registry.execute("keep", args, signal=CancelController().signal)
        assert result.outcome is Outcome.OK, result
        ((view, got_data, got_items),) = seen
        assert isinstance(view, MappingProxyType)
        with pytest.raises(TypeError):
            view["data"] = b""  # type: ignore[index]
        assert (got_data, got_items) == (data, items)
        assert (got_items is not items) is copied
        assert (got_data is not data) is copied

    bad = await registry.execute(
        "keep",
        DecodedArgs({1: "a"}),
        signal=CancelController().signal,  # type: ignore[dict-item]
    )
    assert bad.error_name == "InvalidArguments"
    assert bad.error is not None
    assert "argument names must be strings" in bad.error
    assert bad.body_started is False


@pytest.mark.anyio
async def test_valid_arguments_reach_the_body() -> None:
    registry = Registry()

    @registry.tool
    def read(path: str, count: int = 1, ratio: float = 0.5, **extra: Any) -> list[Any]:
        return [path, count, ratio, extra]

    result = await registry.execute(
        "read", {"path": "a", "ratio": 2, "other": None}, signal=CancelController().signal
    )
    assert result.outcome is Outcome.OK
    assert result.value == ["a", 1, 2, {"other": None}]


# ----------------------------------------------------------------------------- catalog


def test_catalog_and_describe_are_json_schema() -> None:
    registry = Registry()

    @registry.tool
    def read_file(
        path: str,
        ctx: ToolExecution,
        limit: int = 100,
        encoding: Literal["utf-8", "latin-1"] = "utf-8",
        tags: list[str] | None = None,
    ) -> str:
        """Read a file.

        Returns its text.
        """
        return path

    @registry.tool(name="sum", description="Add numbers.")
    async def add(values: list[float], options: dict[str, bool]) -> float:
        return sum(values)

    assert list(registry.catalog) == ["read_file", "sum"]
    catalog = list(registry.catalog.values())
    assert json.loads(json.dumps(catalog)) == catalog
    assert catalog == [
        {
            "name": "read_file",
            "description": "Read a file.\n\nReturns its text.",
            "input_schema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "limit": {"type": "integer", "default": 100},
                    "encoding": {"enum": ["utf-8", "latin-1"], "default": "utf-8"},
                    "tags": {
                        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                        "default": None,
                    },
                },
                "required": ["path"],
                "additionalProperties": False,
            },
        },
        {
            "name": "sum",
            "description": "Add numbers.",
            "input_schema": {
                "type": "object",
                "properties": {
                    "values": {"type": "array", "items": {"type": "number"}},
                    "options": {"type": "object", "additionalProperties": {"type": "boolean"}},
                },
                "required": ["values", "options"],
                "additionalProperties": False,
            },
        },
    ]
    assert registry.tools["sum"].describe() == catalog[1] == registry.catalog["sum"]
    assert registry.tools["sum"].is_async
    assert not registry.tools["read_file"].is_async


def test_calling_the_catalog_still_works_but_is_deprecated() -> None:
    registry = Registry()

    @registry.tool
    def one() -> int:
        return 1

    with pytest.warns(DeprecationWarning, match=r"registry\.catalog\(\) is deprecated"):
        listed = registry.catalog()
    assert listed == list(registry.catalog.values())
    assert listed == [registry.tools["one"].describe()]
    with pytest.raises(TypeError):
        registry.catalog["two"] = {}  # type: ignore[index]


def test_registration_errors() -> None:
    registry = Registry()

    @registry.tool
    def dup() -> None:
        pass

    with pytest.raises(ConfigurationError, match="already registered"):
        registry.add_tool(dup)
    with pytest.raises(ConfigurationError, match="invalid tool name"):
        registry.add_tool(dup, name="")
    with pytest.raises(TypeError, match="two execution parameters"):

        @registry.tool
        def twice(a: ToolExecution, b: ToolExecution) -> None:
            pass

    with pytest.raises(TypeError, match="cannot be passed by keyword"):

        @registry.tool
        def positional(a: int, /) -> None:
            pass

    registry.approval(lambda execution: True)
    with pytest.raises(ConfigurationError, match="approval hook is already set"):
        registry.approval(lambda execution: False)
    assert list(registry.tools) == ["dup"]


# ----------------------------------------------------------------------------- authority ends


@pytest.mark.anyio
async def test_a_signal_kept_past_its_call_has_no_authority_left() -> None:
    """C2.1: a stray task that outlives its call sees its signal cancelled (disposed)."""
    registry = Registry()
    kept: list[CancelSignal] = []

    @registry.tool
    async def keeper(execution: ToolExecution) -> str:
        kept.append(execution.signal)
        return "done"

    caller = CancelController()
    result = await registry.execute("keeper", {}, signal=caller.signal)
    assert result.outcome is Outcome.OK
    (stray,) = kept
    assert stray.cancelled
    assert stray.reason == {"kind": "disposed"}
    assert not caller.signal.cancelled  # the caller's own signal is untouched
    assert caller.signal.listener_count == 0


@pytest.mark.anyio
async def test_on_dispatch_failure_is_not_a_started_body() -> None:
    registry = Registry()
    ran: list[bool] = []

    @registry.tool
    def body() -> None:
        ran.append(True)

    def broken_notifier() -> None:
        raise RuntimeError("cannot announce the start")

    caller = CancelController()
    result = await registry.execute("body", {}, signal=caller.signal, on_dispatch=broken_notifier)
    assert result.outcome is Outcome.ERROR
    assert result.body_started is False
    assert ran == []


# ------------------------------------------------------------- Enum, dataclass, datetime


class Shade(enum.Enum):
    LIGHT = "light"
    DARK = "dark"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass(frozen=True)
class Spot:
    x: int
    y: int
    label: str = ""


@dataclasses.dataclass
class Route:
    start: Spot
    stops: list[Spot]
    shade: Shade | None = None


def _typed_registry(seen: list[tuple[Any, ...]]) -> Registry:
    registry = Registry()

    @registry.tool
    def plan(
        shade: Shade,
        at: datetime.datetime,
        route: Route,
        level: Level = Level.LOW,
        day: datetime.date | None = None,
        tags: dict[str, Shade] | None = None,
    ) -> str:
        """Plan a route."""
        seen.append((shade, at, route, level, day, tags))
        return "planned"

    return registry


@pytest.mark.anyio
async def test_enum_dataclass_and_datetime_arguments_are_converted() -> None:
    seen: list[tuple[Any, ...]] = []
    registry = _typed_registry(seen)
    args = {
        "shade": "dark",
        "at": "2026-12-01T21:30:00+00:00",
        "route": {"start": {"x": 1, "y": 2}, "stops": [{"x": 3, "y": 4, "label": "b"}]},
        "level": 2,
        "day": "2026-12-02",
        "tags": {"sky": "light"},
    }
    result = await registry.execute("plan", args, signal=CancelController().signal)
    assert result.outcome is Outcome.OK, result
    [(shade, at, route, level, day, tags)] = seen
    assert shade is Shade.DARK
    assert at == datetime.datetime(2026, 12, 1, 21, 30, tzinfo=datetime.UTC)
    assert route == Route(Spot(1, 2), [Spot(3, 4, "b")])
    assert level is Level.HIGH
    assert day == datetime.date(2026, 12, 2)
    assert tags == {"sky": Shade.LIGHT}
    # A date where a date and time is wanted is midnight; defaults stay as declared.
    seen.clear()
    result = await registry.execute(
        "plan",
        {"shade": "light", "at": "2026-01-01", "route": {"start": {"x": 0, "y": 0}, "stops": []}},
        signal=CancelController().signal,
    )
    assert result.outcome is Outcome.OK, result
    assert seen[0][1] == datetime.datetime(2026, 1, 1)
    assert seen[0][3:] == (Level.LOW, None, None)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shade": "grey"}, "argument 'shade' must be one of 'light', 'dark' (Shade), got 'grey'"),
        ({"shade": None}, "argument 'shade' must be one of 'light', 'dark' (Shade), got NoneType"),
        ({"level": True}, "argument 'level' must be one of 1, 2 (Level), got True"),
        ({"at": "yesterday"}, "argument 'at' must be an ISO 8601 date and time (text)"),
        (
            {"at": 1700000000},
            "argument 'at' must be an ISO 8601 date and time (text), got 1700000000",
        ),
        ({"day": "2026-13-01"}, "argument 'day' must be an ISO 8601 date (text), got '2026-13-01'"),
        ({"route": [1, 2]}, "argument 'route' must be an object with the fields of Route"),
        (
            {"route": {"start": {"x": 1}, "stops": []}},
            "argument 'route'.start lacks field(s) of Spot: y",
        ),
        (
            {"route": {"start": {"x": 1, "y": 2, "z": 3}, "stops": []}},
            "argument 'route'.start has unexpected field(s) for Spot: z",
        ),
        (
            {"route": {"start": {"x": 1, "y": 2}, "stops": [{"x": "a", "y": 2}]}},
            "argument 'route'.stops[0].x must be an integer, got 'a'",
        ),
        ({"tags": {"sky": "pink"}}, "argument 'tags'['sky'] must be one of 'light', 'dark'"),
        ({"tags": ["sky"]}, "argument 'tags' must be an object, got list"),
    ],
)
async def test_arguments_that_do_not_convert_are_named(
    change: dict[str, Any], message: str
) -> None:
    seen: list[tuple[Any, ...]] = []
    registry = _typed_registry(seen)
    args = {
        "shade": "dark",
        "at": "2026-12-01T21:30:00",
        "route": {"start": {"x": 1, "y": 2}, "stops": []},
        **change,
    }
    result = await registry.execute("plan", args, signal=CancelController().signal)
    assert result.outcome is Outcome.ERROR
    assert result.error_name == "InvalidArguments"
    assert result.error is not None
    assert message in result.error
    assert seen == []


def test_enum_dataclass_and_datetime_parameters_are_described() -> None:
    schema = _typed_registry([]).catalog["plan"]["input_schema"]
    spot = {
        "type": "object",
        "title": "Spot",
        "properties": {
            "x": {"type": "integer"},
            "y": {"type": "integer"},
            "label": {"type": "string"},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    }
    shade = {"type": "string", "enum": ["light", "dark"], "title": "Shade"}
    assert schema == {
        "type": "object",
        "properties": {
            "shade": shade,
            "at": {"type": "string", "format": "date-time"},
            "route": {
                "type": "object",
                "title": "Route",
                "properties": {
                    "start": spot,
                    "stops": {"type": "array", "items": spot},
                    "shade": {"anyOf": [shade, {"type": "null"}]},
                },
                "required": ["start", "stops"],
                "additionalProperties": False,
            },
            "level": {"type": "integer", "enum": [1, 2], "title": "Level", "default": 1},
            "day": {
                "anyOf": [{"type": "string", "format": "date"}, {"type": "null"}],
                "default": None,
            },
            "tags": {
                "anyOf": [{"type": "object", "additionalProperties": shade}, {"type": "null"}],
                "default": None,
            },
        },
        "required": ["shade", "at", "route"],
        "additionalProperties": False,
    }
    assert json.loads(json.dumps(schema)) == schema


class Pair(enum.Enum):
    ONE = (1, 2)


@dataclasses.dataclass
class Holder:
    where: pathlib.Path


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        (pathlib.Path, "parameter 'p' is annotated Path, which no argument can be"),
        (list[pathlib.Path], "parameter 'p' is annotated Path, which no argument can be"),
        (Holder, "parameter 'p', field 'where' is annotated Path"),
        (Pair, "Enum Pair has members whose values are not a string or a number (ONE)"),
        (datetime.time, "parameter 'p' is annotated time, which no argument can be"),
    ],
)
def test_parameters_no_argument_can_satisfy_are_refused_at_registration(
    annotation: Any, message: str
) -> None:
    registry = Registry()

    def tool(p: Any) -> None:
        pass

    tool.__annotations__["p"] = annotation
    with pytest.raises(TypeError, match=re.escape(message)):
        registry.add_tool(tool)
    assert "tool" not in registry.tools
