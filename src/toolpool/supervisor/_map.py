"""``pool.map`` and ``SyncPool.map``: one tool over an iterable of arguments, with backpressure.

A :class:`MapIterator` pulls arguments from its iterable only while fewer than
``max_in_flight`` of its calls are submitted and not yet yielded, submits each in a group of
its own (so that stopping early cancels every call still out in one pass), and yields the
results as they settle (or in input order). Calls tell it that they settled through
``Call._on_settled``, set to a small collector that holds no reference back to the iterator:
an iterator the consumer dropped is collected, and cancels what it left.

For blocking code the same iterator runs in the pool's event-loop thread (a task of the
:class:`SyncPool`'s portal) and hands the results over to the consumer's thread in chunks,
through a queue: the threads meet once per chunk, not once per call. The consumer gives
credit back (results it took) under a lock; the loop is woken for it only when it waits for
credit, and then once per batch, not per result.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import queue
import threading
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, final

import anyio

from ..core import CancelCause, PoolClosedError, UnknownToolError
from ._calls import Call, Group, PoolPort
from ._results import Result

if TYPE_CHECKING:
    from anyio.abc import TaskStatus
    from anyio.from_thread import BlockingPortal

__all__ = ("MapIterator", "SyncMapIterator", "drive_sync_map", "thread_safe_caller")

_PARENT: Final = CancelCause("parent")
_log = logging.getLogger("toolpool.supervisor")


class _Collector:
    """Where a map's calls report that they settled (called by the pool, in the loop)."""

    __slots__ = ("ordered", "ready", "wake")

    def __init__(self, ordered: bool) -> None:
        self.ordered = ordered
        self.ready: collections.deque[Call] = collections.deque()  # unordered: settled ones
        self.wake: anyio.Event | None = None  # set while the map waits

    def __call__(self, call: Call) -> None:
        if not self.ordered:
            self.ready.append(call)
        self.poke()

    def poke(self) -> None:
        """Wake the map if it waits (for a settled call, or for credit)."""
        wake = self.wake
        if wake is not None:
            self.wake = None
            wake.set()

    async def wait(self) -> None:
        self.wake = wake = anyio.Event()
        await wake.wait()


@final
class MapIterator(AsyncIterator[Result]):
    """The async iterator :meth:`toolpool.Pool.map` returns: the settled :class:`Result` of
    each call, one call per item of the arguments iterable.

    - **Items.** Each item is the arguments of one call, as :meth:`Pool.submit` takes them: a
      mapping of keyword arguments, or None for none. For a tool with exactly one parameter
      an item may also be that parameter's value (``pool.map("square", range(10))``); a
      mapping is still taken as the arguments (wrap one meant as the value:
      ``{"param": mapping}``). ``result.index`` is the item's position, from 0.
    - **Backpressure.** Items are pulled lazily, in the event loop: at most
      :attr:`max_in_flight` calls are submitted and not yet yielded (queued, running, or
      settled and waiting to be yielded). A consumer that stops asking stops the pulling.
    - **Order.** By default results come as calls settle. With ``ordered=True`` they come
      in input order: a call that settled early waits for those before it, within the same
      bound (a slow call at the head holds back the submission of new ones).
    - **Failures.** A call that fails, crashes its worker, times out or is killed is a result
      like any other (its ``outcome`` says what happened); the map goes on.
    - **Errors.** Bad arguments to :meth:`Pool.map` raise at once: :class:`TypeError` (not
      an iterable; a mapping, string or async iterable given as the iterable; ``ordered``
      not a bool), :class:`toolpool.UnknownToolError`, :class:`ValueError` (a bad
      ``timeout`` or ``max_in_flight``), :class:`toolpool.PoolClosedError`. An item that
      cannot be submitted (not a mapping, not serializable, too large: ``TypeError`` or
      ``ValueError`` naming its index), an exception raised by the iterable itself, or the
      pool closing ends the map in order: nothing more is pulled, the results of the calls
      submitted before are yielded, then the exception is raised.
    - **Stopping early.** :meth:`aclose` (or leaving ``async with``) cancels every call the
      map submitted and did not yield, with cause ``parent``, and returns once they all
      settled. If the task iterating is cancelled, the calls are cancelled the same way
      and the cancellation goes on at once (CONTRACT C4.5); the pool tracks the calls until
      they settle, and :meth:`aclose` still waits for them. An iterator dropped without
      :meth:`aclose` (a bare ``break``) cancels its calls when it is collected, and the pool
      tracks them until they settle.

    >>> async with pool.map("fetch", ({"url": u} for u in urls)) as results:  # doctest: +SKIP
    ...     async for result in results:
    ...         print(result.index, result.outcome)
    """

    def __init__(
        self,
        pool: PoolPort,
        tool: str,
        args_iterable: Iterable[Any],
        *,
        timeout: float | None = None,
        ordered: bool = False,
        max_in_flight: int | None = None,
    ) -> None:
        pool.check_open()
        if not isinstance(tool, str):
            raise TypeError(f"a tool name is a str, not {type(tool).__name__}")
        if tool not in pool.catalog:
            raise UnknownToolError(
                f"no worker provides a tool named {tool!r}; known: {sorted(pool.catalog)}"
            )
        _check_timeout(timeout)
        if not isinstance(ordered, bool):
            raise TypeError(f"ordered must be a bool, not {type(ordered).__name__}")
        if max_in_flight is None:
            max_in_flight = default_max_in_flight(pool.size, pool.prefetch)
        elif (
            isinstance(max_in_flight, bool)
            or not isinstance(max_in_flight, int)
            or max_in_flight < 1
        ):
            raise ValueError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        self._items = _iterate(args_iterable)
        self._only = only_parameter(pool.catalog[tool])  # items may be its value
        self._pool = pool
        self.tool: Final = tool
        """The tool every call runs."""
        self.ordered: Final = ordered
        """True: results come in input order."""
        self.max_in_flight: Final = max_in_flight
        """The most calls submitted and not yet yielded."""
        self._timeout = timeout
        # Refill once this many slots are free (or none is out): a batch of submissions per
        # pump of the pool, not one; the workers' queues stay full meanwhile (the default
        # window is twice what they hold).
        self._refill_at = max(1, max_in_flight // 4)
        self._group = pool.new_group()
        self._collector = _Collector(ordered)
        self._window: collections.deque[Call] = collections.deque()  # ordered: not taken yet
        self._submitted = 0  # calls submitted: the next item's index
        self._taken = 0  # results taken out (yielded, or handed to a SyncPool's consumer)
        self._pulling = True  # the iterable may have more items
        self._error: BaseException | None = None  # raised once what came before is yielded
        self._closed = False
        self._call_soon = thread_safe_caller()  # (for __del__, and a SyncPool's consumer)

    # ------------------------------------------------------------------ the steps

    def _can_fill(self, released: int) -> bool:
        """Whether :meth:`_fill` would pull now."""
        out = self._submitted - released
        return self._pulling and (self.max_in_flight - out >= self._refill_at or out == 0)

    def _fill(self, released: int) -> None:
        """Pull and submit items while fewer than max_in_flight calls are submitted and not
        ``released`` (yielded, or given back by a SyncPool's consumer); only once a batch of
        slots is free, or none is out."""
        if not self._can_fill(released):
            return
        with self._pool.batch():  # one pump for the whole batch
            self._submit_batch(self.max_in_flight - (self._submitted - released))

    def _submit_batch(self, room: int) -> None:
        pool, tool, timeout, group = self._pool, self.tool, self._timeout, self._group
        collector, window, ordered = self._collector, self._window, self.ordered
        items = self._items
        while room > 0:
            try:
                args = next(items)
            except StopIteration:
                self._pulling = False
                return
            except Exception as exc:
                self._fail(exc)
                return
            index = self._submitted
            if args is not None and not isinstance(args, Mapping):
                if self._only is not None:
                    args = {self._only: args}
                else:
                    self._fail(
                        TypeError(
                            f"pool.map: the args at index {index}: expected a mapping of "
                            f"arguments, got {type(args).__name__} (only a tool with one "
                            "parameter takes its value alone; "
                            f"{tool!r} has {_parameters(pool.catalog.get(tool))})"
                        )
                    )
                    return
            try:
                call = pool.submit_call(tool, args, timeout=timeout, group=group, index=index)
            except (TypeError, ValueError) as exc:
                kind = TypeError if isinstance(exc, TypeError) else ValueError
                error = kind(f"pool.map: the args at index {index}: {exc}")
                error.__cause__ = exc
                self._fail(error)
                return
            except Exception as exc:  # the pool closed, or broke
                self._fail(exc)
                return
            self._submitted = index + 1
            room -= 1
            if ordered:
                window.append(call)
            if not call.done():
                call._on_settled = collector
            elif not ordered:
                collector.ready.append(call)  # settled at once (a cancelled group...)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._pulling = False

    def _take(self) -> Result | None:
        """The next result to hand out, if one is there."""
        if self.ordered:
            window = self._window
            if not window or not window[0].done():
                return None
            call = window.popleft()
        else:
            ready = self._collector.ready
            if not ready:
                return None
            call = ready.popleft()
        self._taken += 1
        return call.result()

    def _take_all(self) -> list[Result]:
        out = []
        while (result := self._take()) is not None:
            out.append(result)
        return out

    def _finished(self) -> bool:
        """Nothing more to pull, and every result taken out."""
        return not self._pulling and self._taken == self._submitted

    def _abandon(self) -> None:
        """Pull no more, and cancel every call not settled (cause ``parent``)."""
        self._closed = True
        self._pulling = False
        self._group._cancel_unsettled(_PARENT)
        self._collector.poke()  # (a SyncPool's loop side may wait for credit)

    async def _settle_all(self) -> None:
        """Wait, shielded, until every call of the map settled; drop what was not taken."""
        with anyio.CancelScope(shield=True):
            await self._group.wait()
        self._window.clear()
        self._collector.ready.clear()
        self._taken = self._submitted

    # ------------------------------------------------------------------ the async face

    def __aiter__(self) -> MapIterator:
        return self

    async def __anext__(self) -> Result:
        """The next settled result; StopAsyncIteration after the last one."""
        if self._closed:
            raise StopAsyncIteration
        try:
            while True:
                self._fill(self._taken)
                result = self._take()
                if result is not None:
                    self._fill(self._taken)  # (its worker starts on the next while we return)
                    return result
                if self._finished():
                    self._closed = True
                    error, self._error = self._error, None
                    if error is not None:
                        raise error
                    raise StopAsyncIteration
                await self._collector.wait()
                if self._closed:  # closed by another task meanwhile
                    raise StopAsyncIteration
        except StopAsyncIteration:
            raise
        except BaseException:
            self._abandon()  # cancelled, or the error: cancel what is still out
            raise

    async def aclose(self) -> None:
        """Stop: cancel every call submitted and not yielded (cause ``parent``), and return
        once each has settled (shielded: a cancelled caller still waits for it). Their
        results are dropped. Idempotent; a map that ran to its end has nothing to cancel."""
        self._abandon()
        await self._settle_all()

    async def __aenter__(self) -> MapIterator:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # A map dropped before its end (a bare ``break``): cancel what it left, from the
        # loop, soon (not here: a collection may run in the middle of the pool's own code);
        # the pool tracks those calls until they settle.
        try:
            if self._group._unsettled():
                self._call_soon(functools.partial(_cancel_group, self._group))
        except Exception:  # (the loop is gone, interpreter shutdown: nothing to cancel)
            pass

    def __repr__(self) -> str:
        out = self._submitted - self._taken
        state = "closed" if self._closed else f"{out} out, {self._taken} yielded"
        return f"<toolpool.MapIterator {self.tool!r} {state}>"


def _cancel_group(group: Group) -> None:
    try:
        group._cancel_unsettled(_PARENT)
    except Exception:  # (a loop callback: never let it take the loop down)
        _log.exception("could not cancel the calls of a dropped map")


def only_parameter(description: Mapping[str, Any]) -> str | None:
    """The name of a tool's one parameter (besides its execution view), if it has exactly
    one and takes no ``**kwargs``; else None."""
    schema = description.get("input_schema")
    if not isinstance(schema, Mapping) or schema.get("additionalProperties", True):
        return None
    properties = schema.get("properties")
    if isinstance(properties, Mapping) and len(properties) == 1:
        return str(next(iter(properties)))
    return None


def _parameters(description: Mapping[str, Any] | None) -> str:
    schema = (description or {}).get("input_schema")
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    names = sorted(properties) if isinstance(properties, Mapping) else []
    if not names:
        return "none"
    return f"{len(names)}: {', '.join(names)}"


def default_max_in_flight(workers: int, prefetch: int) -> int:
    """Twice what the workers can hold (one call each, running, plus ``prefetch`` queued):
    the pool's queue holds as many again, so a worker never waits on the consumer."""
    return 2 * workers * (prefetch + 1)


def _check_timeout(timeout: object) -> None:
    if timeout is None:
        return
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _iterate(args_iterable: object) -> Iterator[Any]:
    """``iter(args_iterable)``, refusing what is surely a mistake."""
    if isinstance(args_iterable, Mapping):
        raise TypeError(
            "pool.map takes an iterable of argument mappings, not one mapping: "
            "wrap it in a list ([args]) for a single call"
        )
    if isinstance(args_iterable, (str, bytes, bytearray)):
        raise TypeError(
            f"pool.map takes an iterable of argument mappings, not a {type(args_iterable).__name__}"
        )
    if isinstance(args_iterable, AsyncIterable) and not isinstance(args_iterable, Iterable):
        raise TypeError(
            "pool.map takes a (sync) iterable of argument mappings, not an async iterable: "
            "submit from an async source with pool.submit"
        )
    try:
        return iter(args_iterable)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise TypeError(
            f"pool.map takes an iterable of argument mappings, not {type(args_iterable).__name__}"
        ) from None


# ====================================================================== SyncPool.map


class _End:
    """The last thing a map's loop side hands over: None, or the exception to raise."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _Feed:
    """What a SyncPool map's two sides share: the handover queue, and the credit."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[list[Result] | _End] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.consumed = 0  # results the consumer took (written under the lock)
        self.wanted = False  # the loop side waits for credit
        self.wanted_at = 0  # consumed when it began to
        self.call_soon: Callable[[Callable[[], object]], object] | None = None
        self.poke: Callable[[], None] | None = None


async def drive_sync_map(
    pool: PoolPort,
    maps: weakref.WeakSet[MapIterator],
    feed: _Feed,
    tool: str,
    args_iterable: Iterable[Any],
    timeout: float | None,
    ordered: bool,
    max_in_flight: int | None,
    *,
    task_status: TaskStatus[MapIterator],
) -> None:
    """The loop side of :meth:`SyncPool.map`, a task of the SyncPool's portal: run the map,
    hand each batch of settled results to the consumer's thread, end with an :class:`_End`.
    Errors in the arguments raise before ``task_status.started``: in the caller, at once."""
    it = MapIterator(
        pool, tool, args_iterable, timeout=timeout, ordered=ordered, max_in_flight=max_in_flight
    )
    feed.call_soon = it._call_soon
    feed.poke = it._collector.poke
    maps.add(it)
    task_status.started(it)
    put = feed.queue.put
    end = _End(PoolClosedError("the pool closed while the map ran"))
    try:
        while True:
            it._fill(feed.consumed)
            chunk = it._take_all()
            if chunk:
                put(chunk)
            if it._finished():
                end, it._error = _End(it._error), None
                return
            if it._pulling:
                with feed.lock:
                    # (The consumer may have taken more since the fill: then fill again.)
                    can_fill = it._can_fill(feed.consumed)
                    if not can_fill:
                        feed.wanted = True
                        feed.wanted_at = feed.consumed
                if can_fill:
                    continue
            await it._collector.wait()
    except anyio.get_cancelled_exc_class():
        it._abandon()  # (the portal stops: the pool closed)
        raise
    except BaseException as exc:  # from the iterable, in this thread: the consumer's to see
        it._abandon()
        end = _End(exc)
    finally:
        put(end)


def thread_safe_caller() -> Callable[[Callable[[], object]], object]:
    """In the loop's thread: a function any thread may call to run a callback in the loop
    soon, without waiting for it (a SyncPool runs asyncio; trio works too)."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


@final
class SyncMapIterator(Iterator[Result]):
    """The iterator :meth:`toolpool.SyncPool.map` returns: :class:`MapIterator` for blocking
    code, with the same arguments, bounds, order, errors and results.

    The map runs in the pool's event-loop thread and hands the results over to the thread
    iterating in batches: ``max_in_flight`` bounds the calls submitted whose results this
    iterator has not returned yet; the first of them are submitted as soon as
    :meth:`SyncPool.map` returns. The arguments iterable is pulled in the event-loop thread
    (keep it quick, and do not share it with another thread meanwhile); an exception it
    raises comes out of ``next()`` here, after the results of the calls before it.

    :meth:`close` (leaving ``with``) cancels every call not yet returned (cause ``parent``)
    and returns once each settled. An iterator dropped without :meth:`close` (a bare
    ``break``) cancels them when it is collected, without waiting. Closing the
    :class:`SyncPool` ends a map still running: its remaining results, then
    :class:`toolpool.PoolClosedError`.
    """

    def __init__(self, portal: BlockingPortal, feed: _Feed, it: MapIterator) -> None:
        self._portal = portal
        self._feed = feed
        self._it = it
        self._buffer: collections.deque[Result] = collections.deque()
        self._end: _End | None = None
        self._closed = False
        # Give credit back to a loop that waits for it once this many results were taken
        # (as many as it refills at once).
        self._batch = it._refill_at

    @property
    def max_in_flight(self) -> int:
        """The most calls submitted and not yet returned by this iterator."""
        return self._it.max_in_flight

    @property
    def ordered(self) -> bool:
        """True: results come in input order."""
        return self._it.ordered

    def __iter__(self) -> SyncMapIterator:
        return self

    def __next__(self) -> Result:
        """The next settled result (blocking); StopIteration after the last one."""
        buffer = self._buffer
        if not buffer:
            if self._closed:
                raise StopIteration
            self._refill()
        result = buffer.popleft()
        feed = self._feed
        with feed.lock:
            feed.consumed += 1
            wake = feed.wanted and feed.consumed - feed.wanted_at >= self._batch
            if wake:
                feed.wanted = False
        if wake:
            self._wake_loop()
        return result

    def _refill(self) -> None:
        feed, buffer = self._feed, self._buffer
        while not buffer:
            if self._end is not None:
                self._closed = True
                error, self._end.error = self._end.error, None
                if error is not None:
                    raise error
                raise StopIteration
            with feed.lock:  # everything taken was consumed: all credit back
                wake = feed.wanted
                feed.wanted = False
            if wake:
                self._wake_loop()
            item = feed.queue.get()
            while True:
                if isinstance(item, _End):
                    self._end = item
                    break
                buffer.extend(item)
                try:
                    item = feed.queue.get_nowait()
                except queue.Empty:
                    break

    def _wake_loop(self) -> None:
        feed = self._feed
        if feed.call_soon is not None and feed.poke is not None:
            try:
                feed.call_soon(feed.poke)
            except RuntimeError:  # the loop stopped: the map ended with the pool
                pass

    def close(self) -> None:
        """Cancel every call not yet returned (cause ``parent``) and return once each
        settled; their results are dropped. Idempotent."""
        if self._closed and self._end is not None:
            return
        self._closed = True
        self._buffer.clear()
        if self._end is None:
            try:
                self._portal.call(self._it.aclose)
            except RuntimeError:  # the portal stopped (the pool closed: all settled), or
                self._cancel_soon()  # this is the loop's own thread: cancel, not waiting

    def __enter__(self) -> SyncMapIterator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _cancel_soon(self) -> None:
        """Have the loop cancel what is out, without waiting for it."""
        try:
            if self._end is None and self._feed.call_soon is not None:
                self._feed.call_soon(self._it._abandon)
        except Exception:  # (the loop stopped, interpreter shutdown: nothing left to do)
            pass

    def __del__(self) -> None:
        self._cancel_soon()  # dropped before its end (a bare ``break``)

    def __repr__(self) -> str:
        return f"<toolpool.SyncMapIterator {self._it.tool!r}>"
