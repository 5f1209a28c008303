"""``toolpool.Executor``: a :class:`concurrent.futures.Executor` whose calls run in a pool.

Plain module-level functions run in the workers through the built-in registry
``toolpool.worker._functions`` (named here by its spec only: the supervisor never imports
the worker). A function travels by reference (``"module:qualname"``); its arguments are
pickled (the workers trust what the supervisor sends); its results come back pickled only
from workers this process trusts (``results``, ``docs/executor.md``): unpickling runs code,
and a worker under an isolating profile may run code that must never run here.

Each submitted function call is one pool call; ``map`` packs ``chunksize`` items into one.
The futures are completed in the pool's event-loop thread, when the call settles.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Final, Generic, Literal, TypeVar, final

from ..core import ConfigurationError, Outcome, PoolClosedError, ToolpoolError
from ..sandbox import Profile
from ._calls import Call
from ._results import Result
from ._sync import SyncCall, SyncPool, _InterruptedClose

__all__ = (
    "CallFailed",
    "Executor",
    "ExecutorFuture",
    "RemoteError",
    "RemoteTraceback",
    "terminate",
)

T = TypeVar("T")

ResultCodec = Literal["pickle", "values"]

# The built-in registry's names (toolpool/worker/_functions.py: SPEC, TOOL, CONTEXT_KEY).
_SPEC: Final = "toolpool.worker._functions:registry"
_TOOL: Final = "toolpool.function"
_CONTEXT_KEY: Final = "toolpool.function"

#: Function calls submitted to the pool per round trip to its loop (``map``).
_BATCH: Final = 256


class CallFailed(ToolpoolError):
    """An :class:`Executor` call ended without a value from the function: it was killed or
    timed out (``toolpool.terminate``, ``timeout``), its worker died (``worker_lost``), or
    its result could not be carried back (``error``: too large, not serializable).

    ``result`` is the call's :class:`toolpool.Result`: what happened, and the facts behind it.
    """

    def __init__(self, result: Result) -> None:
        detail = f": {result.error}" if result.error else ""
        super().__init__(f"the call ended {result.outcome.value}{detail}")
        self.result: Final = result
        """The call's :class:`toolpool.Result`."""


class RemoteError(CallFailed):
    """The function raised, in the worker, an exception that is not brought back as itself:
    results are not pickled (``results="values"``), or the exception did not pickle.

    ``type_name`` (``"builtins.ValueError"``), ``message`` (its ``str()``) and
    ``traceback`` (the worker's text) say what it was.
    """

    def __init__(self, result: Result, type_name: str, message: str, tb: str) -> None:
        ToolpoolError.__init__(self, f"{type_name}: {message}" if message else type_name)
        self.result = result  # type: ignore[misc]  # (set once, as CallFailed's)
        self.type_name: Final = type_name
        self.message: Final = message
        self.traceback: Final = tb


class RemoteTraceback(Exception):
    """The ``__cause__`` of an exception a function raised in a worker: the worker's
    traceback, as text (``concurrent.futures.ProcessPoolExecutor`` does the same)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


# Tracebacks and pickles name the errors as users import them, from their first raise.
for _cls in (CallFailed, RemoteError, RemoteTraceback):
    _cls.__module__ = "toolpool"


@final
class ExecutorFuture(concurrent.futures.Future[T], Generic[T]):
    """The future of a call submitted to a :class:`toolpool.Executor`.

    A :class:`concurrent.futures.Future` in every way (``wait``, ``as_completed``,
    callbacks): ``result()`` is the function's return value, or raises what it raised
    (with the worker's traceback as ``__cause__``), or :class:`toolpool.CallFailed`.

    - ``cancel()`` withdraws a call that no worker has taken yet, and returns True; a call
      a worker took (``running()``) is not touched, and it returns False. Stop one with
      :func:`toolpool.terminate`.
    - :meth:`call_result` gives the call's :class:`toolpool.Result` (outcome, escalation,
      worker, timeline), whatever happened to it.

    Created by :meth:`Executor.submit` and :meth:`Executor.map` only. Callbacks added with
    ``add_done_callback`` run in the pool's event-loop thread: keep them quick, and do not
    call the executor from them.
    """

    def __init__(self, executor: Executor, call: Call, target: str, single: bool) -> None:
        super().__init__()
        self._executor = executor
        self._call = call
        self.target: Final = target
        """The function, as ``"module:qualname"``."""
        self._single = single  # one function call (submit), or a chunk's list (map)
        self._record: Result | None = None

    @property
    def id(self) -> int:
        """The pool-wide call id."""
        return self._call.id

    def running(self) -> bool:
        """True while a worker has the call (it runs it) and it has not settled."""
        return not self.done() and not self._call._queued()

    def cancel(self) -> bool:
        """Withdraw the call if no worker has taken it yet: True then (the future is
        cancelled; ``result()`` raises :class:`concurrent.futures.CancelledError`), and if it
        was cancelled before. False if a worker took it (it runs on: stop it with
        :func:`toolpool.terminate`) or it has finished."""
        if self.done():
            return self.cancelled()
        return bool(self._executor._in_loop(self._withdraw))

    def _withdraw(self) -> bool:
        call = self._call
        if not call.done() and call._queued():
            call.cancel()  # a call in the pool's queue settles at once (CONTRACT C4.4)
        return self.cancelled()

    def call_result(self, timeout: float | None = None) -> Result:
        """The call's :class:`toolpool.Result`, once it settled (waiting up to ``timeout``
        seconds: :class:`TimeoutError` after that): its outcome, escalation rung, worker,
        timeline. Raises :class:`toolpool.PoolClosedError` for a call the executor's close
        left unsettled (its worker's tree did not die of SIGKILL)."""
        concurrent.futures.wait([self], timeout)
        if not self.done():
            raise TimeoutError("the call has not settled yet")
        if self._record is None:
            exc = self.exception()
            assert exc is not None
            raise exc
        return self._record

    # ---- the loop's side (SyncPool completes it: _sync.Followed)

    def _settle(self, result: Result) -> None:
        self._record = result
        if result.outcome is Outcome.ABORTED_BEFORE_DISPATCH:  # the function never started
            super().cancel()
            self.set_running_or_notify_cancel()
            return
        self.set_running_or_notify_cancel()
        try:
            values = _decode(result, self._executor.results)
        except BaseException as exc:
            self.set_exception(exc)
        else:
            self.set_result(values[0] if self._single else values)  # type: ignore[arg-type]

    def _fail(self, exc: BaseException) -> None:
        if self.set_running_or_notify_cancel():
            self.set_exception(exc)

    def __repr__(self) -> str:
        return f"<toolpool.ExecutorFuture {self.id} {self.target} {self._state.lower()}>"


def _decode(result: Result, results: ResultCodec) -> list[Any]:
    """A settled call's values, or raise what it says was raised."""
    if result.outcome is Outcome.OK:
        value = result.value
        return pickle.loads(value) if results == "pickle" else list(value)
    raised = result.context.get(_CONTEXT_KEY) if result.outcome is Outcome.ERROR else None
    if not isinstance(raised, Mapping):
        raise CallFailed(result)
    tb = str(raised.get("traceback", ""))
    exc: object = None
    blob = raised.get("exception")
    if isinstance(blob, bytes) and results == "pickle":
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if not isinstance(exc, Exception):  # (a SystemExit must not end this process)
        exc = RemoteError(result, str(raised.get("type", "")), str(raised.get("message", "")), tb)
    raise exc from RemoteTraceback(tb)


@final
class Executor(concurrent.futures.Executor):
    """A :class:`concurrent.futures.Executor` whose calls run in toolpool's worker processes.

    >>> with toolpool.Executor(max_workers=4) as executor:  # doctest: +SKIP
    ...     print(list(executor.map(math.factorial, range(10))))

    Functions are passed by reference: a module-level function (or class, builtin,
    ``functools.partial`` of one, or bound method of a picklable object), imported in the
    worker by module and qualified name; a lambda or a nested function is refused with a
    :class:`TypeError`. Arguments are pickled. Results are pickled back (``results``) only
    when the workers are trusted: see ``docs/executor.md``.

    :param max_workers: worker processes; None (default): one per CPU this process may use.
    :param profile: the containment profile (``"default"``, ``"untrusted"``, a
        :class:`toolpool.Profile`).
    :param results: how results (and exceptions) come back: ``"pickle"`` (any picklable
        object; the function's own exception) or ``"values"`` (msgpack's values only: None,
        bool, int, float, str, bytes, lists and dicts; an exception comes back as
        :class:`toolpool.RemoteError`). None (default): ``"pickle"`` unless the profile
        isolates the workers as untrusted (``"untrusted"``, another uid, Landlock), where
        ``"pickle"`` is refused: unpickling what such a worker sends would run its code here.
    :param cancel_grace: seconds a call stopped by :func:`toolpool.terminate` has before
        SIGTERM (a plain function never sees the cancel message; a ``map`` chunk stops
        between two items).
    :param prefetch: as :class:`toolpool.Pool`'s, but 0 by default: a call waits in the
        pool's queue until a worker is free, so ``cancel()`` can withdraw it.
    :param options: any other option of :class:`toolpool.Pool` (``term_grace``,
        ``max_calls_per_worker``, ``start_method``, ``env``...).

    The pool starts here (raising :class:`toolpool.WorkerStartError` if it cannot);
    :meth:`shutdown` (or leaving ``with``) stops it.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        profile: Profile | str = "default",
        results: ResultCodec | None = None,
        cancel_grace: float = 1.0,
        prefetch: int = 0,
        **options: Any,
    ) -> None:
        if max_workers is not None and (
            isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1
        ):
            raise ValueError(f"max_workers must be greater than 0, got {max_workers!r}")
        named = Profile.named(profile) if isinstance(profile, str) else profile
        if not isinstance(named, Profile):
            raise TypeError(f"profile must be a toolpool.Profile or a name, not {profile!r}")
        trusted = named.name != "untrusted" and named.user is None and not named.landlock
        if results is None:
            results = "pickle" if trusted else "values"
        elif results not in ("pickle", "values"):
            raise ValueError(f"results must be 'pickle' or 'values', got {results!r}")
        elif results == "pickle" and not trusted:
            raise ConfigurationError(
                f"results='pickle' under the {named.name!r} profile: unpickling what an "
                "isolated worker sends would run its code in this process; use "
                "results='values'"
            )
        self.results: Final[ResultCodec] = results
        """How results come back: ``"pickle"`` or ``"values"``."""
        self._sync = SyncPool(
            _SPEC,
            workers=max_workers,
            profile=named,
            cancel_grace=cancel_grace,
            prefetch=prefetch,
            **options,
        )
        self.max_workers: Final[int] = self._sync._pool.size
        """How many worker processes run calls."""
        self._lock = threading.Lock()
        self._shutdown = False
        self._sync.__enter__()
        self._loop_thread = self._sync._running().call(threading.get_ident)
        self._closer = _Closer(self._sync)
        # Closed at exit if nobody shut it down, before the interpreter joins its threads
        # (the pool's loop runs in one), as the standard library's executors are; and
        # once collected (no call of it is outstanding then: each future refers to it).
        threading._register_atexit(self._closer.at_exit)  # type: ignore[attr-defined]
        weakref.finalize(self, self._closer.close_later, [])

    # ---- submitting

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> ExecutorFuture[T]:
        """Run ``fn(*args, **kwargs)`` in a worker; returns its future at once.

        Raises :class:`TypeError` for a function that cannot be imported by reference, or
        arguments that do not pickle, and :class:`RuntimeError` after :meth:`shutdown`."""
        target, main_path, bound, fn_args, fn_kwargs = _reference(fn)
        payload = _pack(target, bound, [(fn_args + args, {**fn_kwargs, **kwargs})])
        futures = self._start(target, main_path, [payload], single=True)
        return futures[0]

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[T]:
        """``fn`` over the items of ``iterables`` (zipped), as ``builtins.map``: the results
        in order. As :meth:`concurrent.futures.Executor.map`: the iterables are read at
        once and every call submitted (``chunksize`` items per pool call); ``next()`` raises
        what a call raised, and :class:`TimeoutError` once ``timeout`` seconds have passed
        since this call; closing the iterator early cancels the calls no worker took.
        ``buffersize`` is not supported (TypeError), as on Python before 3.14."""
        if buffersize is not None:
            raise TypeError("buffersize is not supported by toolpool.Executor.map")
        if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        end_time = None if timeout is None else timeout + time.monotonic()
        target, main_path, bound, fn_args, fn_kwargs = _reference(fn)
        futures: list[ExecutorFuture[list[T]]] = []
        items = zip(*iterables, strict=False)
        payloads: list[bytes] = []
        while True:
            chunk = [(fn_args + tuple(item), fn_kwargs) for item in _take(items, chunksize)]
            if chunk:
                payloads.append(_pack(target, bound, chunk))
            if len(payloads) == _BATCH or (not chunk and payloads):
                futures += self._start(target, main_path, payloads, single=False)
                payloads = []
            if not chunk:
                break
        return _ordered(futures, end_time)

    def _start(
        self, target: str, main_path: str, payloads: list[bytes], *, single: bool
    ) -> list[ExecutorFuture[Any]]:
        with self._lock:
            if self._shutdown or self._closer.started:  # (or closed at the interpreter's exit)
                raise RuntimeError("cannot schedule new futures after shutdown")
            sync = self._sync
            portal = sync._running()

            def start_all() -> list[ExecutorFuture[Any]]:
                def make(call: Call) -> ExecutorFuture[Any]:
                    return ExecutorFuture(self, call, target, single)

                return [
                    sync._start(
                        _TOOL,
                        {
                            "target": target,
                            "calls": payload,
                            "results": self.results,
                            "main_path": main_path,
                        },
                        None,
                        make,
                    )
                    for payload in payloads
                ]

            return portal.call(start_all)

    def _in_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the pool's loop (at once if this is the loop's thread)."""
        if threading.get_ident() == self._loop_thread:
            return fn()
        return self._sync._running().call(fn)

    # ---- shutting down

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Submit nothing more; ``cancel_futures``: withdraw the calls no worker has taken
        yet (their futures are cancelled). ``wait``: return once every call settled and the
        pool is closed (every worker process gone); else the pool closes in a background
        thread once they have. Calls that run are not stopped (see :func:`toolpool.terminate`).
        Idempotent."""
        with self._lock:
            first = not self._shutdown
            self._shutdown = True
        closer = self._closer
        if first and wait:
            try:
                closer.close_after(cancel_futures)
            except KeyboardInterrupt:  # (one before the wait took Ctrl-C over: stop the calls)
                closer.close(interrupted=True)  # (nothing to do if the wait closed the pool)
                raise
        elif first:
            closer.close_later(closer.outstanding(cancel_futures))
        elif wait:
            closer.join()

    def __enter__(self) -> Executor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, KeyboardInterrupt):  # stop the calls, as a SyncPool does
            with self._lock:
                self._shutdown = True
            self._closer.close(interrupted=True)
            return
        self.shutdown(wait=True)

    def __repr__(self) -> str:
        state = "shut down" if self._shutdown else "running"
        return f"<toolpool.Executor max_workers={self.max_workers} {state}>"


def terminate(future: concurrent.futures.Future[Any], *, force: bool = False) -> bool:
    """Stop the call behind ``future`` (an :class:`ExecutorFuture` or a
    :class:`toolpool.SyncCall`), running or not: the escalation ladder (a cancel message,
    SIGTERM of its worker's tree after ``cancel_grace``, SIGKILL ``term_grace`` later), or
    with ``force=True`` SIGKILL at once. Returns True if the call had not settled yet.

    The future then completes as the call settles: a call no worker had taken is cancelled;
    one that ran raises :class:`toolpool.CallFailed` (``killed``, ``aborted``...), unless the
    function returned first. :meth:`ExecutorFuture.call_result` says what happened."""
    if isinstance(future, SyncCall):
        return future.cancel(force=force)
    if not isinstance(future, ExecutorFuture):
        raise TypeError(
            "terminate() takes a future of toolpool.Executor or toolpool.SyncPool, "
            f"not {type(future).__name__}"
        )
    if future.done():
        return False
    call = future._call

    def stop() -> bool:
        settled = call.done()
        call.cancel(force=force)
        return not settled

    return bool(future._executor._in_loop(stop))


# ====================================================================== the function's reference


def _reference(
    fn: object,
) -> tuple[str, str, object | None, tuple[Any, ...], dict[str, Any]]:
    """``(target, main_path, bound, args, kwargs)`` for ``fn``: how the worker finds it
    (``"module:qualname"``; ``main_path``: the ``__main__`` script it is in; ``bound``: a
    bound method, sent pickled with its object), and what a ``functools.partial`` adds.
    Raises :class:`TypeError` with what to do instead."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    while isinstance(fn, functools.partial):
        args = fn.args + args
        kwargs = {**fn.keywords, **kwargs}
        fn = fn.func
    if not callable(fn):
        raise TypeError(f"{type(fn).__name__!r} object is not callable")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    owner = getattr(fn, "__self__", None)
    objclass = getattr(fn, "__objclass__", None)
    if module is None and isinstance(objclass, type):
        module = objclass.__module__  # (a method descriptor: str.upper)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise TypeError(
            f"{fn!r} has no module and qualified name to import it by in a worker: "
            "pass a function defined at module level"
        )
    what = f"{module}:{qualname}"
    if "<lambda>" in qualname:
        raise TypeError(
            f"a lambda ({what}) cannot be imported in a worker: define a function with "
            "'def' at module level"
        )
    if "<locals>" in qualname:
        raise TypeError(
            f"{what} is defined inside a function (a nested function or closure) and cannot "
            "be imported in a worker: define it at module level, and pass what it closes "
            "over as arguments"
        )
    bound: object | None = None
    if owner is not None and not inspect.ismodule(owner) and not isinstance(owner, type):
        # A method bound to an object: sent pickled, object and all (as pickle would).
        try:
            pickle.dumps(fn, pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"{what} is a method bound to a {type(owner).__name__} object that cannot be "
                f"pickled ({exc}): pass a module-level function, and the object's state as "
                "arguments"
            ) from exc
        bound = fn
    main_path = ""
    if module == "__main__":
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        file = getattr(main, "__file__", None)
        if spec is not None and spec.name and spec.name != "__main__":
            module = spec.name  # (run with python -m: importable by its name)
        elif isinstance(file, str):
            main_path = os.path.abspath(file)
            # The worker imports the script as __mp_main__: what its classes pickle as
            # there must resolve here too (as multiprocessing's spawn arranges).
            sys.modules.setdefault("__mp_main__", main)  # type: ignore[arg-type]
        else:
            raise TypeError(
                f"{qualname} is defined in an interactive session, which a worker cannot "
                "import: define it in a module"
            )
    home = sys.modules.get(what.partition(":")[0])
    found = _lookup(home, qualname)
    if bound is None and found is not fn and found != fn:  # (a classmethod: bound anew)
        raise TypeError(
            f"{what} does not name this object in its module (it was replaced, or "
            "decorated without functools.wraps?): pass a function the worker can import "
            "by that name"
        )
    return f"{module}:{qualname}", main_path, bound, args, kwargs


def _lookup(module: object, qualname: str) -> object:
    obj: object = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _pack(
    target: str, bound: object | None, items: list[tuple[tuple[Any, ...], dict[str, Any]]]
) -> bytes:
    try:
        return pickle.dumps((bound, items), pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"the arguments of {target} cannot be pickled: {exc}") from exc


def _take(items: Iterator[tuple[Any, ...]], n: int) -> list[tuple[Any, ...]]:
    out = []
    for item in items:
        out.append(item)
        if len(out) == n:
            break
    return out


def _ordered(futures: list[ExecutorFuture[list[T]]], end_time: float | None) -> Iterator[T]:
    """The values of ``futures``' chunks in order (as the standard library's ``map``)."""
    try:
        futures.reverse()  # (popped from the end: the iterator holds no reference to a
        while futures:  # future it has yielded the values of)
            future = futures.pop()
            try:
                if end_time is None:
                    chunk = future.result()
                else:
                    chunk = future.result(end_time - time.monotonic())
            except BaseException:
                future.cancel()
                raise
            del future
            chunk.reverse()  # (popped as yielded: no reference is kept to a value yielded)
            while chunk:
                yield chunk.pop()
    finally:
        for future in futures:
            future.cancel()


class _Closer:
    """Closes an executor's pool, once: after the calls outstanding settled (in the calling
    thread, or in a thread of its own), or at once after Ctrl-C (the calls then cancelled)."""

    def __init__(self, sync: SyncPool) -> None:
        self._sync = sync
        self._lock = threading.Lock()  # held while the pool closes
        self._thread: threading.Thread | None = None
        self.started = False

    def outstanding(self, cancel_futures: bool) -> list[concurrent.futures.Future[Any]]:
        """The executor's futures not done; ``cancel_futures``: withdraw those no worker
        took first."""
        self.started = True
        sync = self._sync

        def outstanding() -> list[concurrent.futures.Future[Any]]:
            futures = [f for f in sync._following.values() if isinstance(f, ExecutorFuture)]
            if cancel_futures:
                for future in futures:
                    future._withdraw()
            return [f for f in futures if not f.done()]

        try:
            return sync._running().call(outstanding)
        except PoolClosedError:
            return []

    def close_after(
        self,
        cancel_futures: bool,
        pending: list[concurrent.futures.Future[Any]] | None = None,
    ) -> None:
        """Wait for ``pending`` (by default the futures :meth:`outstanding` now), then close.
        Where Ctrl-C lands (the main thread) it closes at once instead, as a SyncPool does:
        the calls are cancelled, a second Ctrl-C kills them, and one KeyboardInterrupt is
        raised once all is gone. Nothing raises in the middle of the wait (see
        ``_InterruptedClose``)."""
        self.started = True
        sync = self._sync
        with _InterruptedClose(sync) as interrupts:
            if pending is None:
                pending = self.outstanding(cancel_futures)
            interrupts.wait(pending)
            with self._lock:
                sync._close_under()
        interrupts.over()

    def close_later(self, pending: list[concurrent.futures.Future[Any]]) -> None:
        if self._thread is not None or self._sync._closed:
            return
        self.started = True
        self._thread = threading.Thread(
            target=self.close_after, args=(False, pending), name="toolpool-executor-shutdown"
        )
        self._thread.start()

    def close(self, *, interrupted: bool) -> None:
        self.started = True
        with self._lock:
            self._sync._close(interrupted=interrupted)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def at_exit(self) -> None:
        if not self.started:
            if _ended_by_ctrl_c():  # (it escaped the executor's own handling: stop the calls)
                self.close(interrupted=True)
            else:
                self.close_after(False)
        self.join()


def _ended_by_ctrl_c() -> bool:
    """At the interpreter's exit: a script (not an interactive session) ends because of a
    KeyboardInterrupt it did not catch (Python keeps the exception it printed)."""
    interactive = sys.flags.interactive or hasattr(sys, "ps1")
    return not interactive and isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
