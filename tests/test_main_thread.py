"""A worker runs a sync tool as a script runs: on its main thread (CONTRACT C2.5, issue 15).
Signal handlers, setitimer and faulthandler work in a tool; a cancel still reaches the call's
signal while its body runs, whatever the body does; the ladder still ends a body that
ignores it. Real workers, real signals."""

from __future__ import annotations

import os
import sys
from typing import Any

import anyio
import pytest
import zmq

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


# The worker's lean path (``_server._Server._run_lean``: a plain sync body with arguments that
# bind as they are, called with no controller and no result object) against the registry's
# staged path: the same tool, the same result, also when a cancel comes before the body is
# invoked or while it runs. In process, the worker's server fed by a fake socket.


@plain.tool
def takes(a: int, b: float = 1.5, c: str | None = None, d: Any = None) -> list[Any]:
    return [a, b, c, d]


@plain.tool
def takes_a_list(items: list[int]) -> int:
    return len(items)


@plain.tool
def returns_a_map_with_an_int_key() -> dict[Any, int]:
    return {1: 2}


@plain.tool
def returns_a_large_int() -> int:
    return 2**70


@plain.tool
def returns_a_lone_surrogate() -> str:
    return "\udc80"


@plain.tool
def returns_a_map() -> dict[str, Any]:
    return {"a": [1, 2.5, None, True], "b": b"x"}


class _OneCall:
    """Stands in for a worker's socket: one call, then, once its result came, shutdown;
    keeps the results sent."""

    def __init__(self, tool: str, args: bytes) -> None:
        from toolpool.protocol import CallMessage, encode

        self.inbox = [encode(CallMessage(1, tool, args, 0))]
        self.results: list[Any] = []
        self._never_r, self._never_w = os.pipe()  # its "notification fd": never readable

    def close(self) -> None:
        os.close(self._never_r)
        os.close(self._never_w)

    def getsockopt(self, option: int) -> int:
        return self._never_r if option == zmq.FD else 0  # (RCVMORE: one frame a message)

    def get(self, option: int) -> int:
        return int(zmq.POLLIN) if self.inbox else 0

    def setsockopt(self, option: int, value: int) -> None:
        pass

    def recv(self, flags: int = 0, copy: bool = True) -> bytes:
        return self.inbox.pop(0)

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        from toolpool.protocol import ResultMessage, Shutdown, decode_from_worker, encode

        msg = decode_from_worker(frame)
        if isinstance(msg, ResultMessage):
            self.results.append(msg)
            self.inbox.append(encode(Shutdown()))

    def send_multipart(self, frames: list[bytes], flags: int = 0, copy: bool = True) -> None:
        for frame in frames:
            self.send(frame)


def _served(tool: str, args: dict[Any, Any], when: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The result message of one call of ``tool``, served in process by a worker's server;
    cancelled (as by a cancel message) ``when`` "before" its body is invoked, or "during"
    it (by the tools that cancel their own call)."""
    import msgpack

    from toolpool.worker import _server
    from toolpool.worker._machine import FireCancel

    monkeypatch.setattr(plain, "_sync_caller", None)  # (the server sets them: restored after)
    monkeypatch.setattr(plain, "_progress_sink", None)
    sock = _OneCall(tool, msgpack.packb(args))
    server = _server._Server(sock, plain, 1 << 20)  # type: ignore[arg-type]

    def cancel() -> None:  # what the control thread does with a cancel message
        with server.mu:
            server._perform([FireCancel(1, "user")])
        server._fire_cancels()

    lean_body = plain._lean_body

    def cancelled_lean_body(name: str, args: Any) -> Any:
        # (The call is taken up, its body not yet invoked, whichever path it takes.)
        cancel()
        return lean_body(name, args)

    if when == "before":
        monkeypatch.setattr(plain, "_lean_body", cancelled_lean_body)
    monkeypatch.setattr(sys.modules[__name__], "_cancel_own_call", cancel)
    try:
        server.serve()
    finally:
        sock.close()
    (result,) = sock.results
    return result


_ARGS: list[tuple[str, dict[Any, Any]]] = [
    *((tool, {}) for tool in sorted(plain.tools) if tool not in ("takes", "takes_a_list")),
    ("takes", {"a": 1}),
    ("takes", {"a": 1, "b": 2, "c": "x", "d": {"k": [1]}}),
    ("takes", {"a": 1, "b": 2.5, "c": None}),
    ("takes", {"a": True}),
    ("takes", {"a": 1.0}),
    ("takes", {"a": 1, "b": True}),
    ("takes", {"a": 1, "c": 3}),
    ("takes", {"a": 1, "e": 3}),
    ("takes", {"b": 2.0}),
    ("takes", {}),
    ("takes_a_list", {"items": [1, 2]}),
    ("takes_a_list", {"items": [1, "x"]}),
    ("returns", {b"a": 1}),  # (a name that is not a string)
]


@pytest.mark.parametrize("when", ["live", "before"])
@pytest.mark.parametrize(("tool", "args"), _ARGS, ids=[f"{t}-{a}" for t, a in _ARGS])
async def test_the_lean_path_settles_each_call_as_the_staged_path(
    tool: str, args: dict[Any, Any], when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toolpool.protocol import unpack_value

    served = _served(tool, args, when, monkeypatch)
    monkeypatch.undo()
    _controllers.append(CancelController())
    if when == "before":
        _controllers[-1].cancel()
    staged = await plain.execute_owned(tool, args, controller=_controllers[-1], call_id="1")
    value = None if served.value is None else unpack_value(served.value)
    assert (served.outcome, value, served.error, served.error_name, served.body_started) == (
        staged.outcome.value,
        staged.value,
        staged.error,
        staged.error_name,
        staged.body_started,
    )
    assert served.context == dict(staged.context)


def test_which_calls_run_lean() -> None:
    """A sync tool with no stage, no execution view and no finalizer, called with arguments
    whose types its annotations admit as they are; any other call runs the pipeline."""
    assert plain._lean_body("returns", {}) is not None
    assert plain._lean_body("takes", {"a": 1, "b": 2, "c": None, "d": [b"x"]}) is not None
    assert plain._lean_body("takes", {"a": 1, "b": True}) is None  # (an error, from bind)
    assert plain._lean_body("takes", {"b": 2.0}) is None  # (a required one missing)
    assert plain._lean_body("takes", {"a": 1, "e": 3}) is None  # (an unknown one)
    assert plain._lean_body("takes_a_list", {"items": [1]}) is None  # (list[int]: bind's)
    assert plain._lean_body("returns", {b"a": 1}) is None
    assert plain._lean_body("returns", []) is None
    assert plain._lean_body("finalized", {}) is None
    assert plain._lean_body("cancelled_then_raises_abort_error", {}) is None  # (a view)
    assert plain._lean_body("unknown", {}) is None
    staged = toolpool.Registry()
    staged.tool(returns)
    assert staged._lean_body("returns", {}) is not None
    staged.observe(lambda result: None)  # (a stage: nothing runs lean from now on)
    assert staged._lean_body("returns", {}) is None
