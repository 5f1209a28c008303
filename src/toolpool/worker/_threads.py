"""Where sync tool bodies run: a thread, never the event loop (CONTRACT C2.5).

On asyncio, bodies run on persistent body threads with a light hand-off: the loop puts the
job on the thread's queue, the thread runs it and wakes the loop with one
``call_soon_threadsafe``. This costs about half of ``anyio.to_thread.run_sync``, which per
call also takes a capacity limiter, enters a cancel scope and yields to the loop once before
the hand-off. The body sees what it would see in one of anyio's worker threads: a copy of the
caller's context, and an event loop token, so ``anyio.from_thread.run_sync()`` works in it.

This is for the registry used in-process (tests, embedding): the worker process runs sync
bodies on its main thread instead (``_server.py``, CONTRACT C2.5).

A started body is never abandoned: if the awaiting task is cancelled anyway (the registry
shields it, so only a native ``Task.cancel()`` can), the body is still waited for, and the
cancellation is raised after it settled. On other event loops (trio), or when more bodies run
at once than :data:`MAX_THREADS`, bodies go through ``anyio.to_thread.run_sync`` as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, Final

import anyio.to_thread


def _anyio_internals() -> tuple[Any, Any, Any, Any] | None:
    """What anyio's own worker threads set up (private to anyio, hence the guard)."""
    try:
        from anyio._backends._asyncio import AsyncIOBackend
        from anyio._core._eventloop import set_current_async_library, threadlocals
        from anyio.lowlevel import EventLoopToken
    except ImportError:  # pragma: no cover - an anyio without them: use its thread pool
        return None
    return AsyncIOBackend, EventLoopToken, threadlocals, set_current_async_library


_AsyncIOBackend: Any = None
_EventLoopToken: Any = None
_anyio_threadlocals: Any = None
_set_async_library: Any = None
_internals = _anyio_internals()
if _internals is not None:
    _AsyncIOBackend, _EventLoopToken, _anyio_threadlocals, _set_async_library = _internals

__all__ = ("run_body_in_thread",)

#: At most this many body threads; beyond it (many sync bodies at once, in-process), bodies
#: use anyio's thread pool and its capacity limiter.
MAX_THREADS: Final = 40


class _Job:
    __slots__ = (
        "awaiting",
        "context",
        "done",
        "error",
        "finished",
        "fn",
        "loop",
        "token",
        "value",
    )

    def __init__(
        self,
        fn: Callable[[], Any],
        loop: asyncio.AbstractEventLoop,
        token: Any,
        done: asyncio.Future[None],
    ) -> None:
        self.fn = fn
        self.loop = loop
        self.token = token
        self.context = context = contextvars.copy_context()
        context.run(_set_async_library, None)  # as in anyio's threads: no async library here
        self.done = done
        self.finished = False
        self.value: Any = None
        self.error: BaseException | None = None


def _deliver(job: _Job) -> None:
    """On the loop: the body settled; wake whoever waits (unless its future was cancelled)."""
    job.finished = True
    if not job.done.done():
        job.done.set_result(None)


class _BodyThread(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="toolpool body", daemon=True)
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()

    def run(self) -> None:
        local = _anyio_threadlocals
        jobs = self.jobs
        while True:
            job = jobs.get()
            if local is not None:
                local.current_token = job.token
                local.current_cancel_scope = None  # shielded: check_cancelled() never raises
            try:
                job.value = job.context.run(job.fn)
            except BaseException as exc:  # delivered to the awaiting task, like a return
                job.error = exc
            loop = job.loop
            del job.fn, job.context
            _idle.append(self)
            try:
                loop.call_soon_threadsafe(_deliver, job)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
            del job, loop


_idle: collections.deque[_BodyThread] = collections.deque()
_count = 0
_token_cache: tuple[Any, Any] = (None, None)


def _reset_after_fork() -> None:
    global _count, _token_cache
    _idle.clear()  # the threads did not survive the fork
    _count = 0
    _token_cache = (None, None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _token_for(loop: asyncio.AbstractEventLoop) -> Any:
    global _token_cache
    cached_loop, token = _token_cache
    if cached_loop is not loop:
        token = _EventLoopToken(_AsyncIOBackend, loop)
        _token_cache = (loop, token)
    return token


async def run_body_in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn()`` in a thread and return its value (or raise its exception).

    Never abandons ``fn``: it is waited for even if the awaiting task is cancelled.
    """
    global _count
    loop = asyncio._get_running_loop()
    if loop is None or _EventLoopToken is None or (not _idle and _count >= MAX_THREADS):
        return await anyio.to_thread.run_sync(fn, abandon_on_cancel=False)
    if _idle:
        thread = _idle.pop()
    else:
        thread = _BodyThread()
        thread.start()
        _count += 1
    job = _Job(fn, loop, _token_for(loop), loop.create_future())
    thread.jobs.put(job)
    cancelled: BaseException | None = None
    while True:
        try:
            await job.done
            break
        except asyncio.CancelledError as exc:
            # Not from anyio (the registry shields the body): never abandon it anyway.
            if job.finished:
                break
            cancelled = exc
            job.done = loop.create_future()
    if cancelled is not None:
        raise cancelled
    return _outcome(job)


def _outcome(job: _Job) -> Any:
    if job.error is not None:
        error, job.error = job.error, None
        raise error
    return job.value
