"""One registry call's parts that need no registry: its frozen result, the read-only views its
stages see (CONTRACT C2.2), the stage types, a tool's spec; and the steps: arguments frozen and
bound, a plain body invoked, failures classified (C2.4, C3), results made. Split out of
``_registry.py``, which re-exports the public names."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final, final

import anyio
import anyio.to_thread
import msgpack

from ..core import (
    ABORT_ERROR_NAME,
    ABORTED_BEFORE_DISPATCH_TEXT,
    ABORTED_TEXT,
    AbortError,
    CancelCause,
    CancelController,
    CancelSignal,
    Outcome,
    ToolDenied,
    cancel_with_runtime_cause,
)
from ..protocol import MAX_PROGRESS_MESSAGE, unpack_value
from ..protocol._values import extract_parts
from ..schema import ToolSignature

# --------------------------------------------------------------------------- results


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult:
    """The frozen result of one registry call. Created by the registry only."""

    tool: str
    """The tool's name, as called."""
    call_id: str
    """The call's id (given by the caller, or made up by the registry)."""
    outcome: Outcome
    """What happened to the body (CONTRACT C3)."""
    value: Any = None
    """The body's value (a detached msgpack-compatible snapshot), for ``ok``."""
    error: str | None = None
    """Model-visible error text, for every outcome but ``ok``."""
    error_name: str | None = None
    """A short error class name: the exception type, ``AbortError``, ``Denied``..."""
    body_started: bool = False
    """Whether the body was invoked."""
    context: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Context that stages attached with ``execution.attach()``; kept whatever the outcome."""
    _packed_value: bytes | None = field(default=None, repr=False, compare=False)
    _packed_parts: tuple[bytes, ...] = field(default=(), repr=False, compare=False)
    """The parts of ``_packed_value`` (``protocol.pack_parts``): large byte strings."""

    def replace_content(self, *, value: Any = None, error: str | None = None) -> ToolResult:
        """A copy with new content (``value`` for ``ok``, ``error`` text otherwise).

        For content finalizers: outcome, flags and context cannot be changed.
        """
        if self.outcome is Outcome.OK:
            return replace(self, value=value, _packed_value=None, _packed_parts=())
        return replace(self, error=self.error if error is None else str(error))


# --------------------------------------------------------------------------- views


class _Run:
    """The registry's private, mutable state of one call. Stages only ever see views of it."""

    __slots__ = (
        "args",
        "call_id",
        "caller_signal",
        "context",
        "dispatch_signal",
        "progress",
        "tool",
    )

    def __init__(
        self, tool: str, call_id: str, args: Mapping[str, Any], caller_signal: CancelSignal
    ) -> None:
        self.tool = tool
        self.call_id = call_id
        self.args = args
        self.caller_signal = caller_signal
        self.dispatch_signal = caller_signal
        self.context: dict[str, Any] = {}
        self.progress: ProgressSink | None = None  # where report_progress() goes


class _ViewBase:
    __slots__ = ("_run",)

    def __init__(self, run: _Run) -> None:
        self._run = run

    @property
    def tool(self) -> str:
        """The name of the tool being called."""
        return self._run.tool

    @property
    def call_id(self) -> str:
        """The call's id."""
        return self._run.call_id

    @property
    def args(self) -> Mapping[str, Any]:
        """The frozen arguments."""
        return self._run.args

    def attach(self, key: str, value: Any) -> None:
        """Attach context to the call's result; it is kept even if cancellation replaces it."""
        if not isinstance(key, str):
            raise TypeError("context keys are strings")
        self._run.context[key] = value


@final
class ToolExecution(_ViewBase):
    """The read-only execution view given to tool bodies, policies, approval and observers.

    A tool asks for it by declaring a parameter annotated ``toolpool.ToolExecution``.
    Its :attr:`signal` is always present and can only be observed.
    """

    __slots__ = ("_signal",)

    def __init__(self, run: _Run, signal: CancelSignal) -> None:
        super().__init__(run)
        self._signal = signal

    @property
    def signal(self) -> CancelSignal:
        """The call's cancel signal: the only way a body learns of cancellation."""
        return self._signal

    def report_progress(
        self, done: float, total: float | None = None, message: str | None = None
    ) -> None:
        """Report how far the call has come: ``done`` (of ``total``, if known), with an
        optional ``message`` (at most 1,024 characters are kept).

        Cheap enough for a tight loop: reports are coalesced, the latest wins, and a worker
        sends one at most every 50 ms, once the body has started; callers see it as
        ``call.progress`` and ``call.progress_updates()``. Used directly in-process (no
        pool), a registry drops the reports. Raises TypeError or ValueError for amounts
        that are not finite, non-negative numbers, and a message that is not text.
        """
        done_f = _amount(done, "done")
        total_f = None if total is None else _amount(total, "total")
        if message is not None:
            if not isinstance(message, str):
                raise TypeError(f"message must be a str or None, not {type(message).__name__}")
            message = message[:MAX_PROGRESS_MESSAGE]
        sink = self._run.progress
        if sink is not None:
            sink(self._run.call_id, done_f, total_f, message)

    def __repr__(self) -> str:
        return f"<ToolExecution {self.tool!r} id={self.call_id!r} {self._signal!r}>"


def _amount(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    amount = float(value)
    if not (0.0 <= amount < math.inf):
        raise ValueError(f"{name} must be a finite, non-negative number, got {value!r}")
    return amount


@final
class DispatchExecution(_ViewBase):
    """The view given to around-dispatch wrappers: the only one whose signal may be replaced.

    Set :attr:`signal` to a derived signal (a deadline, a nested scope) before delegating. The
    registry fuses every replacement with the caller's signal, so the caller is never cut off,
    and restores the caller's signal when dispatch ends. The signal can never be removed.
    """

    __slots__ = ()

    @property
    def signal(self) -> CancelSignal:
        """The signal the body will see (fused with the caller's when it is invoked)."""
        return self._run.dispatch_signal

    @signal.setter
    def signal(self, value: CancelSignal) -> None:
        if not isinstance(value, CancelSignal):
            raise TypeError(
                f"a dispatch signal must be a CancelSignal, not {type(value).__name__}; "
                "it can be replaced, never removed"
            )
        self._run.dispatch_signal = value

    def __repr__(self) -> str:
        return f"<DispatchExecution {self.tool!r} id={self.call_id!r} {self.signal!r}>"


# --------------------------------------------------------------------------- stage types

ProgressSink = Callable[[str, float, float | None, str | None], None]
"""Where a call's progress reports go: ``sink(call_id, done, total, message)``."""

PrePolicy = Callable[[ToolExecution], Any]
"""``policy(execution)``: raise :class:`toolpool.ToolDenied` (or return False) to deny."""
ApprovalHook = Callable[[ToolExecution], Any]
"""``hook(execution) -> bool``: True approves; False or :class:`ToolDenied` denies. May wait."""
AroundDispatch = Callable[[DispatchExecution, Callable[[], Awaitable[Any]]], Awaitable[Any]]
"""``async wrapper(dispatch, call_next) -> value``: may replace ``dispatch.signal``."""
PostPolicy = Callable[[ToolExecution, Any], Any]
"""``policy(execution, value)``: inspect the value; raise to fail the call."""
ResultObserver = Callable[[ToolResult], object]
"""``observer(result)``: sees every published result exactly once."""
ContentFinalizer = Callable[[ToolResult], ToolResult]
"""``finalize(result) -> result.replace_content(...)``: runs for every outcome."""


@final
@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A registered tool: its function, description and signature."""

    name: str
    description: str
    fn: Callable[..., Any]
    signature: ToolSignature
    is_async: bool
    finalize: ContentFinalizer | None

    def describe(self) -> dict[str, Any]:
        """JSON-compatible description: ``name``, ``description``, ``input_schema``."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.signature.json_schema(),
        }


class _DispatchState:
    __slots__ = ("body_cancelled", "body_exc", "body_signal", "body_started", "refused")

    def __init__(self) -> None:
        self.body_started = False
        self.refused = False
        self.body_exc: BaseException | None = None
        self.body_cancelled = False
        self.body_signal: CancelSignal | None = None

    def dispatch(self, signal: CancelSignal, on_dispatch: Callable[[], object] | None) -> None:
        """The body is about to be invoked, with ``signal``: ``on_dispatch`` is told first."""
        self.body_signal = signal
        if on_dispatch is not None:
            on_dispatch()
        self.body_started = True


_log = logging.getLogger("toolpool.worker")

TIMEOUT_TEXT: Final = "Error: tool call timed out"
_TIMEOUT_CAUSE: Final = CancelCause("timeout")

# --------------------------------------------------------------------------- helpers


def _prepare(
    spec: ToolSpec | None,
    name: str,
    args: Mapping[str, Any],
    call_id: str,
    caller: CancelSignal,
    progress: ProgressSink | None = None,
) -> tuple[_Run, dict[str, Any]] | ToolResult:
    """A call's first steps (C2.4): its arguments frozen and bound, then the caller's signal
    checked; a result if the call ends here."""
    if spec is None:
        return _error(name, call_id, f"Error: unknown tool {name!r}", "UnknownTool")
    try:
        frozen = _freeze_args(args)
        kwargs = spec.signature.bind(frozen)
    except Exception as exc:
        return _error(
            name,
            call_id,
            f"Error: invalid arguments for tool {name!r}: {_text(exc)}",
            "InvalidArguments",
        )
    run = _Run(name, call_id, frozen, caller)
    run.progress = progress
    if caller.cancelled:
        return _cancelled(run, started=False, reason=caller.reason)
    return run, kwargs


def _invoke_plain(
    spec: ToolSpec,
    run: _Run,
    kwargs: dict[str, Any],
    on_dispatch: Callable[[], object] | None,
    sync_caller: Callable[[Callable[..., Any], dict[str, Any]], Any] | None = None,
) -> ToolResult:
    """The body of a plain call (no wrappers, no post policies), invoked in this thread
    (through ``sync_caller``, if given), and its outcome, classified as
    :meth:`Registry._stages` would."""
    caller = run.caller_signal
    reason = caller.reason
    if reason is not None:  # cancelled since the check in _prepare: never dispatched
        return _cancelled(run, started=False, reason=reason)
    state = _DispatchState()
    state.dispatch(caller, on_dispatch)
    try:
        value = _call_sync_body(spec.fn, _body_kwargs(spec, run, caller, kwargs), sync_caller)
    except BaseException as exc:  # a result, like any failure of a body (C2.6)
        state.body_cancelled = caller.cancelled
        state.body_exc = exc
        # The worker's loop is asyncio's: its cancellation is asyncio.CancelledError.
        return _classify_failure(run, state, exc, asyncio.CancelledError)
    if caller.cancelled:
        return _cancelled(run, started=True, reason=caller.reason)
    return _ok(run, value, started=True)


#: Packs a lean call's value of a scalar type (``_lean_value``), on the worker's main
#: thread only (packing a scalar runs no Python code, so never lets another in meanwhile).
_pack_scalar: Final = msgpack.Packer(use_bin_type=True).pack
_NIL: Final = msgpack.packb(None)
_SCALARS: Final = frozenset((str, int, float, bool))
_NO_ARGS: Final[Mapping[str, Any]] = MappingProxyType({})


def _lean_value(value: Any) -> tuple[bytes, tuple[bytes, ...]] | None:
    """The packed value and parts of what a lean call's body returned (a call of
    ``Registry._lean_body``'s): those of :func:`_ok`'s result, checked as it checks them.
    None where :func:`_ok` makes an error of it (:func:`_lean_result` then). A scalar is
    packed as it is: its snapshot is itself."""
    if value is None:
        return _NIL, ()
    try:
        if type(value) in _SCALARS:
            return _pack_scalar(value), ()
        _, packed, parts = _snapshot_result(value)
    except Exception:
        return None
    return packed, parts


def _lean_result(
    tool: str,
    call_id: str,
    cause: str | None,
    *,
    started: bool,
    exc: BaseException | None = None,
    value: Any = None,
) -> ToolResult:
    """The result :func:`_invoke_plain` makes of a lean call (``Registry._lean_body``'s) whose
    body was not invoked (``started`` False: ``cause`` is set), raised ``exc``, or returned
    ``value`` that :func:`_lean_value` could not pack; ``cause``: the kind of the cancel the
    worker received for the call before this (None: none), as its signal's reason would be."""
    controller = CancelController()
    if cause is not None:
        cancel_with_runtime_cause(controller, CancelCause(cause))  # type: ignore[arg-type]
    caller = controller.signal
    run = _Run(tool, call_id, _NO_ARGS, caller)
    if not started or (exc is None and caller.cancelled):
        return _cancelled(run, started=started, reason=caller.reason)
    if exc is None:
        return _ok(run, value, started=True)
    state = _DispatchState()
    state.dispatch(caller, None)
    state.body_cancelled = caller.cancelled
    state.body_exc = exc
    return _classify_failure(run, state, exc, asyncio.CancelledError)


def _body_kwargs(
    spec: ToolSpec, run: _Run, signal: CancelSignal, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The body's keyword arguments: with its execution view (seeing ``signal``), if it
    declares one."""
    param = spec.signature.execution_param
    return kwargs if param is None else {**kwargs, param: ToolExecution(run, signal)}


def _call_sync_body(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    sync_caller: Callable[[Callable[..., Any], dict[str, Any]], Any] | None,
) -> Any:
    """A sync body invoked in this thread (through ``sync_caller``, if given). Its
    StopIteration becomes what a coroutine turns it into (PEP 479): the same on every path,
    in a thread of :func:`_run_body_in_thread` too."""
    try:
        return fn(**kwargs) if sync_caller is None else sync_caller(fn, kwargs)
    except StopIteration as raised:
        raise RuntimeError("coroutine raised StopIteration") from raised


async def _run_body_in_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """A sync body of a registry used in-process (outside a pool's worker, which runs it on
    its main thread): in one of anyio's worker threads, never on the event loop (C2.5), and
    never abandoned. No cancellation reaches this wait: the registry shields its pipeline
    from anyio's, and :meth:`Registry.execute` runs the pipeline in a task of its own, which
    a native cancellation of the caller's task (``asyncio.timeout``) does not reach."""
    body = functools.partial(_call_sync_body, fn, kwargs, None)
    return await anyio.to_thread.run_sync(body, abandon_on_cancel=False)


def _classify_failure(
    run: _Run, state: _DispatchState, exc: BaseException, cancelled_class: type[BaseException]
) -> ToolResult:
    caller = run.caller_signal
    cancelled_exc = isinstance(exc, (AbortError, cancelled_class))
    if exc is state.body_exc:
        if cancelled_exc and (state.body_cancelled or caller.cancelled):
            reason = _reason(state) if state.body_cancelled else caller.reason
            return _cancelled(run, started=True, reason=reason)
        return _failure(run, exc, started=True, what="tool")
    if not state.body_started and state.refused and isinstance(exc, AbortError):
        return _cancelled(run, started=False, reason=caller.reason or _reason(state, exc))
    if cancelled_exc and caller.cancelled:
        return _cancelled(run, started=state.body_started, reason=caller.reason)
    return _failure(run, exc, started=state.body_started, what="wrapper")


async def _deadline_timer(deadline: CancelController, timeout: float | None) -> None:
    assert timeout is not None
    await anyio.sleep(timeout)
    cancel_with_runtime_cause(deadline, _TIMEOUT_CAUSE)


async def _stage(run: _Run, what: str, invoke: Callable[[], Any]) -> Any:
    """Run a policy or hook, sync or async. Denials and failures become results (C2.6)."""
    try:
        verdict = invoke()
        if inspect.isawaitable(verdict):
            verdict = await verdict
    except ToolDenied as exc:
        return _denied(run, _text(exc) or f"refused by {what}")
    except BaseException as exc:
        if isinstance(exc, (AbortError, anyio.get_cancelled_exc_class())) and (
            run.caller_signal.cancelled
        ):
            return _cancelled(run, started=False, reason=run.caller_signal.reason)
        if not isinstance(exc, Exception):
            _log.warning("%s raised %s; reported as an error", what, type(exc).__name__)
        return _error(
            run.tool,
            run.call_id,
            f"Error: {what} failed: {type(exc).__name__}: {_text(exc)}",
            type(exc).__name__,
            context=run.context,
        )
    return verdict


def _reason(state: _DispatchState, exc: BaseException | None = None) -> CancelCause | None:
    if state.body_signal is not None and state.body_signal.reason is not None:
        return state.body_signal.reason
    if isinstance(exc, AbortError):
        return exc.cause
    return None


def _snapshot(
    value: Any, *, wire: bool = True, default: Callable[[Any], Any] | None = None
) -> tuple[Any, bytes]:
    """A detached copy of ``value`` and its msgpack bytes. ``wire``: only what the other
    side of the wire decodes (map keys str or bytes, as protocol._unpack demands); a value
    that passes here and fails there would cost the worker its life, not the call a result.
    ``default``: what stands for an object msgpack cannot pack (as in ``msgpack.packb``)."""
    packed = msgpack.packb(value, use_bin_type=True, default=default)
    return msgpack.unpackb(packed, raw=False, strict_map_key=wire), packed


def _snapshot_result(value: Any) -> tuple[Any, bytes, tuple[bytes, ...]]:
    """:func:`_snapshot` of a result's value, without copying its large byte strings: each
    ``bytes`` of at least ``PART_MIN`` bytes is its own snapshot (it is immutable), and a
    ``bytearray`` is copied once, into the ``bytes`` the snapshot holds. Returns the snapshot,
    its msgpack bytes and their parts (``protocol.pack_parts``: sent without another copy)."""
    out, parts = extract_parts(value)
    if not parts:
        snapshot, packed = _snapshot(value)
        return snapshot, packed, ()
    packed = msgpack.packb(out, use_bin_type=True)
    return unpack_value(packed, len(packed), parts), packed, tuple(parts)


class DecodedArgs(dict[str, Any]):
    """Arguments just decoded from msgpack (the worker's, from a call message): nobody else
    holds them and they are what a snapshot would make, so freezing them takes no copy."""

    __slots__ = ()


def _freeze_args(args: Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(args, Exception):  # the worker could not decode them (protocol._unpack)
        raise TypeError(f"arguments could not be decoded: {args}")
    if not isinstance(args, Mapping):
        raise TypeError(f"arguments must be a mapping, not {type(args).__name__}")
    if any(not isinstance(k, str) for k in args):
        raise TypeError("argument names must be strings")
    if type(args) is DecodedArgs:
        return MappingProxyType(args)
    try:
        copied, _ = _snapshot(dict(args), wire=False)  # (in-process; the wire checks its own)
    except Exception as exc:
        raise TypeError(f"arguments are not serializable: {_text(exc)}") from None
    return MappingProxyType(copied)


def _freeze_context(context: Mapping[str, Any]) -> Mapping[str, Any]:
    """A detached, wire-safe copy of what stages attached (anything msgpack cannot carry as
    its ``repr``). Never raises (C2.6): an entry that cannot be carried at all (a map key
    msgpack or the wire refuses, a value that contains itself, a ``repr`` that raises) is
    replaced by a note saying so."""
    if not context:
        return MappingProxyType({})
    try:
        return MappingProxyType(_snapshot(dict(context), default=repr)[0])
    except Exception:
        pass
    frozen: dict[str, Any] = {}
    for key, value in context.items():  # str keys: attach() checks
        try:
            frozen[key] = _snapshot(value, default=repr)[0]
        except Exception as exc:
            frozen[key] = f"<not serializable: {type(exc).__name__}>"
    return MappingProxyType(frozen)


def _ok(run: _Run, value: Any, *, started: bool) -> ToolResult:
    try:
        snapshot, packed, parts = _snapshot_result(value)
    except Exception as exc:
        return _error(
            run.tool,
            run.call_id,
            f"Error: tool result is not serializable: {_text(exc)}",
            "UnserializableResult",
            started=started,
            context=run.context,
        )
    return ToolResult(
        tool=run.tool,
        call_id=run.call_id,
        outcome=Outcome.OK,
        value=snapshot,
        body_started=started,
        context=_freeze_context(run.context),
        _packed_value=packed,
        _packed_parts=parts,
    )


def _error(
    tool: str,
    call_id: str,
    text: str,
    name: str,
    *,
    started: bool = False,
    context: Mapping[str, Any] | None = None,
) -> ToolResult:
    return ToolResult(
        tool=tool,
        call_id=call_id,
        outcome=Outcome.ERROR,
        error=text,
        error_name=name,
        body_started=started,
        context=_freeze_context(context or {}),
    )


def _text(exc: BaseException) -> str:
    """``str(exc)``, or what the traceback module says when that raises too: the text of an
    error result never fails (C2.6)."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


def _failure(run: _Run, exc: BaseException, *, started: bool, what: str) -> ToolResult:
    if not isinstance(exc, Exception):
        _log.warning("%s raised %s; reported as an error", what, type(exc).__name__)
    _log.debug("%s %r failed", what, run.tool, exc_info=exc)
    return _error(
        run.tool,
        run.call_id,
        f"Error: {type(exc).__name__}: {_text(exc)}"
        if what == "tool"
        else f"Error: {what} failed: {type(exc).__name__}: {_text(exc)}",
        type(exc).__name__,
        started=started,
        context=run.context,
    )


def _denied(run: _Run, reason: str) -> ToolResult:
    return ToolResult(
        tool=run.tool,
        call_id=run.call_id,
        outcome=Outcome.DENIED,
        error=f"Error: tool call denied: {reason}",
        error_name="Denied",
        body_started=False,
        context=_freeze_context(run.context),
    )


def _cancelled(run: _Run, *, started: bool, reason: CancelCause | None) -> ToolResult:
    if reason is not None and reason.kind == "timeout":
        outcome, text, name = Outcome.TIMEOUT, TIMEOUT_TEXT, "TimeoutError"
    elif started:
        outcome, text, name = Outcome.ABORTED, ABORTED_TEXT, ABORT_ERROR_NAME
    else:
        outcome, text, name = (
            Outcome.ABORTED_BEFORE_DISPATCH,
            ABORTED_BEFORE_DISPATCH_TEXT,
            ABORT_ERROR_NAME,
        )
    return ToolResult(
        tool=run.tool,
        call_id=run.call_id,
        outcome=outcome,
        error=text,
        error_name=name,
        body_started=started,
        context=_freeze_context(run.context),
    )


def _finalize(finalizer: ContentFinalizer | None, candidate: ToolResult) -> ToolResult:
    if finalizer is None:
        return candidate
    try:
        final = finalizer(candidate)
        if not isinstance(final, ToolResult):
            raise TypeError(f"returned {type(final).__name__}, not a ToolResult")
        if final.outcome is Outcome.OK:
            value, packed, parts = _snapshot_result(final.value)
            return replace(candidate, value=value, _packed_value=packed, _packed_parts=parts)
        return replace(candidate, error=final.error)
    except Exception as exc:
        return replace(
            candidate,
            outcome=Outcome.ERROR,
            value=None,
            _packed_value=None,
            _packed_parts=(),
            error=f"Error: content finalizer failed: {type(exc).__name__}: {_text(exc)}",
            error_name=type(exc).__name__,
        )
