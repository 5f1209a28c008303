"""Cancel signals, controllers and fusion (CONTRACT C1.1, C1.4)."""

from __future__ import annotations

import logging
import threading

import anyio
import pytest

from toolpool import AbortError, CancelCause, CancelController, CancelSignal, Fusion, fuse

USER = {"kind": "user"}
PARENT = {"kind": "parent"}


# ----------------------------------------------------------------------------- controller


def test_a_new_signal_is_not_cancelled() -> None:
    signal = CancelController().signal
    assert signal.cancelled is False
    assert signal.reason is None
    assert signal.listener_count == 0
    signal.raise_if_cancelled()  # a no-op while active


def test_the_signal_is_a_read_only_view() -> None:
    controller = CancelController()
    signal = controller.signal
    assert not hasattr(signal, "cancel")
    assert not hasattr(signal, "_controller")
    with pytest.raises(AttributeError):
        signal.cancelled = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        signal.reason = CancelCause("user")  # type: ignore[misc]
    with pytest.raises(TypeError, match="created by CancelController"):
        CancelSignal(object())
    assert controller.signal is signal
    assert not signal.cancelled


def test_first_cancel_wins() -> None:
    controller = CancelController()
    assert controller.cancel(PARENT) is True
    assert controller.signal.cancelled
    assert controller.signal.reason == PARENT
    assert controller.cancel(USER) is False
    assert controller.cancel() is False
    assert controller.signal.reason == PARENT


def test_cancel_without_a_cause_means_user() -> None:
    controller = CancelController()
    controller.cancel()
    assert controller.signal.reason is CancelCause("user")


@pytest.mark.parametrize("bad", ["user", {"kind": "timeout"}, {"kind": "user", "x": 1}, ["user"]])
def test_cause_is_validated_even_when_already_cancelled(bad: object) -> None:
    controller = CancelController()
    controller.cancel(PARENT)
    with pytest.raises((TypeError, ValueError)):
        controller.cancel(bad)
    assert controller.signal.reason == PARENT


def test_an_invalid_cause_does_not_cancel() -> None:
    controller = CancelController()
    with pytest.raises(TypeError):
        controller.cancel("parent")
    assert not controller.signal.cancelled
    assert controller.cancel(PARENT) is True
    assert controller.signal.reason == PARENT


def test_raise_if_cancelled() -> None:
    controller = CancelController()
    controller.signal.raise_if_cancelled()
    controller.cancel(PARENT)
    with pytest.raises(AbortError, match="parent") as info:
        controller.signal.raise_if_cancelled()
    assert info.value.cause == PARENT


def test_repr_shows_state() -> None:
    controller = CancelController()
    assert "active" in repr(controller.signal)
    controller.cancel(PARENT)
    assert "cancelled, parent" in repr(controller.signal)
    assert "cancelled, parent" in repr(controller)


# ----------------------------------------------------------------------------- callbacks


def test_callbacks_fire_once_with_the_cause() -> None:
    controller = CancelController()
    seen: list[CancelCause] = []
    controller.signal.add_callback(seen.append)
    controller.signal.add_callback(seen.append)
    assert controller.signal.listener_count == 2
    controller.cancel(PARENT)
    controller.cancel(USER)
    assert seen == [PARENT, PARENT]
    assert controller.signal.listener_count == 0


def test_add_callback_on_a_cancelled_signal_runs_at_once() -> None:
    controller = CancelController()
    controller.cancel(PARENT)
    seen: list[CancelCause] = []
    handle = controller.signal.add_callback(seen.append)
    assert seen == [PARENT]
    assert controller.signal.listener_count == 0
    controller.signal.remove_callback(handle)  # harmless
    assert seen == [PARENT]


def test_remove_callback() -> None:
    controller = CancelController()
    seen: list[str] = []
    first = controller.signal.add_callback(lambda c: seen.append("first"))
    controller.signal.add_callback(lambda c: seen.append("second"))
    controller.signal.remove_callback(first)
    controller.signal.remove_callback(first)  # twice is harmless
    controller.signal.remove_callback(123_456_789)  # unknown handles are ignored
    assert controller.signal.listener_count == 1
    controller.cancel()
    assert seen == ["second"]


def test_a_raising_callback_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller = CancelController()
    seen: list[CancelCause] = []

    def boom(cause: CancelCause) -> None:
        raise RuntimeError("listener failed")

    controller.signal.add_callback(boom)
    controller.signal.add_callback(seen.append)
    with caplog.at_level(logging.ERROR, logger="toolpool"):
        assert controller.cancel(PARENT) is True
    assert seen == [PARENT]
    assert controller.signal.reason == PARENT
    assert any("listener failed" in (r.exc_text or "") for r in caplog.records)


def test_callbacks_fire_once_under_concurrent_cancels() -> None:
    controller = CancelController()
    seen: list[CancelCause] = []
    controller.signal.add_callback(seen.append)
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def cancel(cause: dict[str, str]) -> None:
        barrier.wait()
        results.append(controller.cancel(cause))

    threads = [threading.Thread(target=cancel, args=(USER if i % 2 else PARENT,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]
    assert len(seen) == 1
    assert seen[0] == controller.signal.reason


# ----------------------------------------------------------------------------- waiting


@pytest.mark.anyio
async def test_wait_returns_at_once_when_already_cancelled() -> None:
    controller = CancelController()
    controller.cancel()
    await controller.signal.wait()
    assert controller.signal.listener_count == 0


@pytest.mark.anyio
async def test_wait_wakes_on_cancel_from_the_loop() -> None:
    controller = CancelController()
    woke: list[CancelCause | None] = []

    async def waiter() -> None:
        await controller.signal.wait()
        woke.append(controller.signal.reason)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert woke == []
        assert controller.signal.listener_count == 1
        controller.cancel(PARENT)
    assert woke == [PARENT]
    assert controller.signal.listener_count == 0


@pytest.mark.anyio
async def test_wait_wakes_on_cancel_from_another_thread() -> None:
    controller = CancelController()
    woke = anyio.Event()

    async def waiter() -> None:
        await controller.signal.wait()
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert not woke.is_set()
        assert await anyio.to_thread.run_sync(controller.cancel, PARENT) is True
        with anyio.fail_after(10):
            await woke.wait()
    assert controller.signal.reason == PARENT
    assert controller.signal.listener_count == 0


@pytest.mark.anyio
async def test_a_cancelled_wait_removes_its_listener() -> None:
    controller = CancelController()
    async with anyio.create_task_group() as tg:
        tg.start_soon(controller.signal.wait)
        await anyio.wait_all_tasks_blocked()
        assert controller.signal.listener_count == 1
        tg.cancel_scope.cancel()
    assert controller.signal.listener_count == 0
    assert not controller.signal.cancelled


def test_wait_blocking_from_a_thread() -> None:
    controller = CancelController()
    waiting = threading.Event()
    result: list[bool] = []

    def worker() -> None:
        waiting.set()
        result.append(controller.signal.wait_blocking(timeout=30))

    thread = threading.Thread(target=worker)
    thread.start()
    assert waiting.wait(10)
    controller.cancel(PARENT)
    thread.join(10)
    assert not thread.is_alive()
    assert result == [True]


def test_wait_blocking_times_out_when_not_cancelled() -> None:
    controller = CancelController()
    assert controller.signal.wait_blocking(timeout=0.01) is False
    controller.cancel()
    assert controller.signal.wait_blocking(timeout=0) is True
    assert controller.signal.wait_blocking() is True


# ----------------------------------------------------------------------------- fusion


def test_fusion_fires_on_any_input_with_the_first_cause() -> None:
    a, b, c = CancelController(), CancelController(), CancelController()
    fusion = fuse(a.signal, b.signal, c.signal)
    assert isinstance(fusion, Fusion)
    assert not fusion.signal.cancelled
    b.cancel(PARENT)
    assert fusion.signal.cancelled
    assert fusion.signal.reason == PARENT
    a.cancel(USER)
    assert fusion.signal.reason == PARENT
    assert not c.signal.cancelled  # fusion never cancels its inputs
    fusion.close()


def test_fusion_close_removes_its_listeners() -> None:
    a, b = CancelController(), CancelController()
    a.signal.add_callback(lambda cause: None)  # somebody else's listener stays
    fusion = fuse(a.signal, b.signal)
    assert a.signal.listener_count == 2
    assert b.signal.listener_count == 1
    fusion.close()
    assert a.signal.listener_count == 1
    assert b.signal.listener_count == 0
    fusion.close()  # idempotent
    a.cancel()
    assert not fusion.signal.cancelled  # a closed fusion no longer follows its inputs


def test_fusion_close_after_firing_removes_the_remaining_listeners() -> None:
    a, b = CancelController(), CancelController()
    fusion = fuse(a.signal, b.signal)
    a.cancel()
    assert fusion.signal.cancelled
    assert b.signal.listener_count == 1
    fusion.close()
    assert b.signal.listener_count == 0


def test_fusion_as_a_context_manager() -> None:
    a, b = CancelController(), CancelController()
    with fuse(a.signal, b.signal) as fused:
        assert isinstance(fused, CancelSignal)
        assert a.signal.listener_count == 1
        b.cancel(PARENT)
        assert fused.reason == PARENT
    assert a.signal.listener_count == 0
    assert b.signal.listener_count == 0


def test_fusion_of_an_already_cancelled_input() -> None:
    a, b, c = CancelController(), CancelController(), CancelController()
    b.cancel(PARENT)
    fusion = fuse(a.signal, b.signal, c.signal)
    assert fusion.signal.cancelled
    assert fusion.signal.reason == PARENT
    # Nothing is left listening: the fusion cleaned up after itself at once.
    assert a.signal.listener_count == 0
    assert c.signal.listener_count == 0
    a.cancel(USER)
    assert fusion.signal.reason == PARENT


def test_fusions_nest() -> None:
    a, b, c = CancelController(), CancelController(), CancelController()
    inner = fuse(a.signal, b.signal)
    outer = fuse(inner.signal, c.signal)
    a.cancel(PARENT)
    assert outer.signal.reason == PARENT
    outer.close()
    inner.close()
    for s in (a.signal, b.signal, c.signal, inner.signal):
        assert s.listener_count == 0


def test_fuse_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        fuse()
    controller = CancelController()
    with pytest.raises(TypeError, match="CancelSignal"):
        fuse(controller.signal, controller)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CancelSignal"):
        fuse(None)  # type: ignore[arg-type]
    assert controller.signal.listener_count == 0


def test_many_fusions_leave_no_listeners() -> None:
    controller = CancelController()
    for _ in range(1000):
        other = CancelController()
        with fuse(controller.signal, other.signal):
            pass
    assert controller.signal.listener_count == 0


@pytest.mark.anyio
async def test_a_fused_signal_can_be_awaited() -> None:
    a, b = CancelController(), CancelController()
    fusion = fuse(a.signal, b.signal)
    async with anyio.create_task_group() as tg:
        tg.start_soon(fusion.signal.wait)
        await anyio.wait_all_tasks_blocked()
        b.cancel(PARENT)
    assert fusion.signal.reason == PARENT
    fusion.close()
    assert a.signal.listener_count == 0
