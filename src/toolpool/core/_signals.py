"""Cancel signals, their controllers and fusion (CONTRACT C1.1, C1.4).

A :class:`CancelSignal` is a read-only view; only the :class:`CancelController` that owns it
can cancel it. The first cancel request wins and fixes the cause. Callbacks run synchronously
in the thread that cancels; a sync tool running in a thread can poll ``signal.cancelled``
(a plain attribute read) or block on :meth:`CancelSignal.wait_blocking`.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Final, final

from ._causes import CancelCause, validate_cause
from ._errors import AbortError

if TYPE_CHECKING:
    import asyncio

__all__ = ("CallbackHandle", "CancelController", "CancelSignal", "Fusion", "fuse")

_log = logging.getLogger("toolpool")
_handles = itertools.count(1)

CallbackHandle = int
"""An opaque token returned by :meth:`CancelSignal.add_callback`."""

#: A handle that refers to no callback (returned when the callback already ran).
_DEAD_HANDLE: Final = 0


@final
class CancelSignal:
    """The read-only view of a cancellation: is it cancelled, why, wait for it, listen to it.

    Signals are created by a :class:`CancelController` (or by :func:`fuse`); user code never
    constructs one. Nothing on a signal can cancel it.
    """

    __slots__ = ("__weakref__", "_callbacks", "_lock", "_reason", "_sync_event")

    def __init__(self, _token: object) -> None:
        if _token is not _CONTROLLER_TOKEN:
            raise TypeError("CancelSignal is created by CancelController, not directly")
        self._reason: CancelCause | None = None
        self._callbacks: dict[int, Callable[[CancelCause], object]] = {}
        self._lock = threading.Lock()
        self._sync_event: threading.Event | None = None

    @property
    def cancelled(self) -> bool:
        """True once cancellation was requested. Cheap: safe to poll from any thread."""
        return self._reason is not None

    @property
    def reason(self) -> CancelCause | None:
        """The first cause requested, or None while not cancelled."""
        return self._reason

    @property
    def listener_count(self) -> int:
        """How many callbacks are registered (introspection; fusion cleans up after itself)."""
        return len(self._callbacks)

    def raise_if_cancelled(self) -> None:
        """Raise :class:`toolpool.AbortError` if the signal is cancelled: a safe point."""
        reason = self._reason
        if reason is not None:
            raise AbortError(f"cancelled ({reason.kind})", cause=reason)

    def add_callback(self, callback: Callable[[CancelCause], object]) -> CallbackHandle:
        """Call ``callback(cause)`` when the signal is cancelled.

        If the signal is already cancelled the callback runs at once, synchronously, and the
        returned handle refers to nothing. Exceptions from callbacks are logged, never raised
        into the canceller.
        """
        with self._lock:
            if self._reason is None:
                handle = next(_handles)
                self._callbacks[handle] = callback
                return handle
            reason = self._reason
        _run_callback(callback, reason)
        return _DEAD_HANDLE

    def remove_callback(self, handle: CallbackHandle) -> None:
        """Remove a callback added with :meth:`add_callback`; unknown handles are ignored."""
        with self._lock:
            self._callbacks.pop(handle, None)

    async def wait(self) -> None:
        """Wait until the signal is cancelled (returns at once if it already is)."""
        if self._reason is not None:
            return
        import anyio
        import anyio.from_thread
        import anyio.lowlevel

        event = anyio.Event()
        token = anyio.lowlevel.current_token()
        loop_thread = threading.get_ident()
        loop = _running_asyncio_loop()

        def wake(_cause: CancelCause) -> None:
            # From another thread, never wait for the loop: it may be blocked by the very
            # body whose signal this thread cancels (a sync body on the worker's main thread).
            try:
                if threading.get_ident() == loop_thread:
                    event.set()
                elif loop is not None:
                    loop.call_soon_threadsafe(event.set)
                else:
                    anyio.from_thread.run_sync(event.set, token=token)
            except RuntimeError:  # the loop is gone: nobody waits any more
                pass

        handle = self.add_callback(wake)
        try:
            await event.wait()
        finally:
            self.remove_callback(handle)

    def wait_blocking(self, timeout: float | None = None) -> bool:
        """Block the current thread until cancelled or ``timeout`` passes; True if cancelled.

        For sync tools running in a worker thread. Never call it on an event loop.
        """
        if self._reason is not None:
            return True
        with self._lock:
            event = self._sync_event
            if event is None:
                event = self._sync_event = threading.Event()
                if self.cancelled:  # cancelled between the check above and the lock
                    event.set()
        return event.wait(timeout)

    def _fire(self, cause: CancelCause) -> bool:
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = cause
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
            if self._sync_event is not None:
                self._sync_event.set()
        for callback in callbacks:
            _run_callback(callback, cause)
        return True

    def __repr__(self) -> str:
        state = f"cancelled, {self._reason.kind}" if self._reason else "active"
        return f"<CancelSignal {state}>"


def _running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    # No loop runs where asyncio was never imported: this module (imported by the CLI's
    # ``--help`` and by every ``toolpool.core`` user) does not import it (26 ms).
    module = sys.modules.get("asyncio")
    if module is None:
        return None
    try:
        return module.get_running_loop()  # type: ignore[no-any-return]
    except RuntimeError:  # on trio
        return None


_CONTROLLER_TOKEN: Final = object()
_DISPOSED: Final = CancelCause("disposed")


def _run_callback(callback: Callable[[CancelCause], object], cause: CancelCause) -> None:
    try:
        callback(cause)
    except Exception:
        _log.exception("cancel callback %r raised", callback)


@final
class CancelController:
    """Owns one :class:`CancelSignal` and is the only way to cancel it."""

    __slots__ = ("_signal",)

    def __init__(self) -> None:
        self._signal = CancelSignal(_CONTROLLER_TOKEN)

    @property
    def signal(self) -> CancelSignal:
        """The read-only signal this controller owns."""
        return self._signal

    def cancel(self, cause: object = None) -> bool:
        """Request cancellation; the first request wins.

        ``cause`` is ``None`` (meaning ``{"kind": "user"}``) or a dict with exactly one key,
        ``kind``, set to ``"user"`` or ``"parent"``. It is validated strictly even if the signal
        is already cancelled. Returns True if this request cancelled the signal, False if an
        earlier request already had (its cause stands).
        """
        return self._signal._fire(validate_cause(cause))

    def __repr__(self) -> str:
        return f"<CancelController {self._signal!r}>"


def cancel_with_runtime_cause(controller: CancelController, cause: CancelCause) -> bool:
    """Cancel with any cause, including the runtime-only kinds. For toolpool's own runtime."""
    return controller.signal._fire(cause)


@final
class Fusion:
    """A signal that fires when any of its inputs fires, carrying the first cause.

    Dispose it (``close()`` or leave the ``with`` block) to remove the listeners it added to its
    inputs: fusion never leaks a listener per call.
    """

    __slots__ = ("_controller", "_handles")

    def __init__(self, signals: tuple[CancelSignal, ...]) -> None:
        if not signals:
            raise ValueError("fuse() needs at least one signal")
        for s in signals:
            if not isinstance(s, CancelSignal):
                raise TypeError(f"fuse() takes CancelSignal objects, not {type(s).__name__}")
        self._controller = CancelController()
        self._handles: list[tuple[CancelSignal, CallbackHandle]] = []
        fire = self._controller.signal._fire
        for s in signals:
            handle = s.add_callback(fire)
            if handle != _DEAD_HANDLE:
                self._handles.append((s, handle))
            if self._controller.signal.cancelled:
                break
        if self._controller.signal.cancelled:
            self.close()

    @property
    def signal(self) -> CancelSignal:
        """The fused signal."""
        return self._controller.signal

    def close(self, *, expire: bool = False) -> None:
        """Remove every listener this fusion added. Idempotent.

        With ``expire=True`` the fused signal is also cancelled with cause ``disposed`` (if it
        was not cancelled already): its scope is over, and whoever still holds it must see
        that it has no authority left.
        """
        handles, self._handles = self._handles, []
        for s, handle in handles:
            s.remove_callback(handle)
        if expire:
            self._controller.signal._fire(_DISPOSED)

    def __enter__(self) -> CancelSignal:
        return self.signal

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def fuse(*signals: CancelSignal) -> Fusion:
    """Fuse signals: the result fires when any input fires, with the first cause (C1.4)."""
    return Fusion(signals)
