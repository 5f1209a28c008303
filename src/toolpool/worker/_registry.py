"""The in-process tool registry: the cooperative pipeline that runs inside every worker.

CONTRACT C2 (stages, views, order) and C3 (classification). Inside this module nothing is ever
interrupted or abandoned: a started body is awaited until it settles, and the only way a body
learns of cancellation is its signal.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import math
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final, TypeVar, final, overload

import anyio
import msgpack

from ..core import (
    ABORT_ERROR_NAME,
    ABORTED_BEFORE_DISPATCH_TEXT,
    ABORTED_TEXT,
    AbortError,
    CancelCause,
    CancelController,
    CancelSignal,
    ConfigurationError,
    Fusion,
    Outcome,
    ToolDenied,
    cancel_with_runtime_cause,
)
from ._schema import ToolSignature, inspect_tool
from ._threads import run_body_in_thread

__all__ = (
    "AroundDispatch",
    "DispatchExecution",
    "Registry",
    "ToolExecution",
    "ToolResult",
    "ToolSpec",
)

_log = logging.getLogger("toolpool.worker")

TIMEOUT_TEXT: Final = "Error: tool call timed out"
_PARENT_CAUSE: Final = CancelCause("parent")
_TIMEOUT_CAUSE: Final = CancelCause("timeout")
_DISPOSED_CAUSE: Final = CancelCause("disposed")
_call_ids = itertools.count(1)

F = TypeVar("F", bound=Callable[..., Any])


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

    def replace_content(self, *, value: Any = None, error: str | None = None) -> ToolResult:
        """A copy with new content (``value`` for ``ok``, ``error`` text otherwise).

        For content finalizers: outcome, flags and context cannot be changed.
        """
        if self.outcome is Outcome.OK:
            return replace(self, value=value, _packed_value=None)
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

    def __repr__(self) -> str:
        return f"<ToolExecution {self.tool!r} id={self.call_id!r} {self._signal!r}>"


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


@final
class _Catalog(Mapping[str, Mapping[str, Any]]):
    """``Registry.catalog``: a read-only mapping that may still be called, as it once was."""

    __slots__ = ("_descriptions",)

    def __init__(self, descriptions: dict[str, dict[str, Any]]) -> None:
        self._descriptions = descriptions

    def __getitem__(self, name: str) -> Mapping[str, Any]:
        return self._descriptions[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._descriptions)

    def __len__(self) -> int:
        return len(self._descriptions)

    def __call__(self) -> list[dict[str, Any]]:
        warnings.warn(
            "registry.catalog() is deprecated: read the property registry.catalog, a mapping "
            "by tool name (list(registry.catalog.values()) is the list this returns)",
            DeprecationWarning,
            stacklevel=2,
        )
        return list(self._descriptions.values())

    def __repr__(self) -> str:
        return f"<toolpool.Registry catalog {list(self._descriptions)}>"


# --------------------------------------------------------------------------- the registry


@final
class Registry:
    """A set of tools and the stages around them.

    >>> registry = Registry()
    >>> @registry.tool
    ... def add(a: int, b: int) -> int:
    ...     return a + b
    """

    def __init__(self) -> None:
        self._tools: dict[str, ToolSpec] = {}
        self._pre: list[PrePolicy] = []
        self._approval: ApprovalHook | None = None
        self._wrappers: list[AroundDispatch] = []
        self._post: list[PostPolicy] = []
        self._observers: list[ResultObserver] = []
        self._in_flight = 0
        self._idle: anyio.Event | None = None

    # ---- registration

    @overload
    def tool(self, fn: F, /) -> F: ...

    @overload
    def tool(
        self,
        *,
        name: str | None = None,
        description: str | None = None,
        finalize: ContentFinalizer | None = None,
    ) -> Callable[[F], F]: ...

    def tool(  # type: ignore[misc]  # mypy cannot match the positional-only overload
        self,
        fn: Any = None,
        /,
        *,
        name: str | None = None,
        description: str | None = None,
        finalize: ContentFinalizer | None = None,
    ) -> Any:
        """Register a sync or async function as a tool: ``@registry.tool`` or
        ``@registry.tool(name=..., description=..., finalize=...)``."""

        def register(f: F) -> F:
            self.add_tool(f, name=name, description=description, finalize=finalize)
            return f

        return register(fn) if fn is not None else register

    def add_tool(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        finalize: ContentFinalizer | None = None,
    ) -> ToolSpec:
        """Register ``fn`` as a tool (the non-decorator form of :meth:`tool`)."""
        if not callable(fn):
            raise TypeError("a tool must be a function")
        tool_name = name if name is not None else getattr(fn, "__name__", None)
        if not isinstance(tool_name, str) or not tool_name or len(tool_name) > 128:
            raise ConfigurationError(f"invalid tool name {tool_name!r}")
        if tool_name in self._tools:
            raise ConfigurationError(f"tool {tool_name!r} is already registered")
        spec = ToolSpec(
            name=tool_name,
            description=description
            if description is not None
            else inspect.cleandoc(fn.__doc__ or ""),
            fn=fn,
            signature=inspect_tool(fn, ToolExecution),
            is_async=inspect.iscoroutinefunction(fn),
            finalize=finalize,
        )
        self._tools[tool_name] = spec
        return spec

    def pre_execute(self, policy: PrePolicy) -> PrePolicy:
        """Add a pre-execute policy (decorator). It may deny; it never sees a replaceable
        signal."""
        self._pre.append(policy)
        return policy

    def approval(self, hook: ApprovalHook) -> ApprovalHook:
        """Set the approval hook (decorator). It may wait, cooperatively, on the signal."""
        if self._approval is not None:
            raise ConfigurationError("an approval hook is already set")
        self._approval = hook
        return hook

    def around_dispatch(self, wrapper: AroundDispatch) -> AroundDispatch:
        """Add an around-dispatch wrapper (decorator); the first added is the outermost."""
        self._wrappers.append(wrapper)
        return wrapper

    def post_execute(self, policy: PostPolicy) -> PostPolicy:
        """Add a post-execute policy (decorator), run after the body returned a value."""
        self._post.append(policy)
        return policy

    def observe(self, observer: ResultObserver) -> ResultObserver:
        """Add a result observer (decorator); it sees each published result exactly once."""
        self._observers.append(observer)
        return observer

    # ---- introspection

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        """The registered tools, by name (read-only)."""
        return MappingProxyType(self._tools)

    @property
    def catalog(self) -> Mapping[str, Mapping[str, Any]]:
        """JSON-compatible descriptions of the tools, by name, in the order registered
        (read-only; the same shape as :attr:`toolpool.Pool.catalog`). Each description has
        ``name``, ``description`` and ``input_schema``.

        Calling it (``registry.catalog()``, the spelling before 0.1) is deprecated: it
        warns, and returns the descriptions as a list, as it did.
        """
        return _Catalog({name: spec.describe() for name, spec in self._tools.items()})

    @property
    def in_flight(self) -> int:
        """How many calls are executing now."""
        return self._in_flight

    @property
    def idle(self) -> bool:
        """True when no call is executing: every started body has settled."""
        return self._in_flight == 0

    async def wait_idle(self) -> None:
        """Wait until no call is executing (truthfully: every body settled)."""
        while self._in_flight:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    # ---- execution

    async def execute(
        self,
        name: str,
        args: Mapping[str, Any],
        *,
        signal: CancelSignal,
        timeout: float | None = None,
        call_id: str | None = None,
        on_dispatch: Callable[[], object] | None = None,
    ) -> ToolResult:
        """Run one call through the pipeline and return its frozen result.

        ``signal`` is the caller's cancel signal and is required (CONTRACT C2.1). ``timeout``
        is a deadline in seconds owned by the timeout policy: a call it stops ends ``timeout``.
        ``on_dispatch`` is called immediately before the body is invoked.

        A started body is never abandoned. If the task awaiting this method is cancelled, the
        call's signal is cancelled with cause ``parent``, the body is still waited for, and then
        the cancellation propagates.
        """
        if not isinstance(signal, CancelSignal):
            raise TypeError(
                "execute() needs the caller's CancelSignal (signal=controller.signal); "
                f"got {type(signal).__name__}"
            )
        if not isinstance(name, str):
            raise TypeError(f"a tool name is a str, not {type(name).__name__}")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        cid = call_id if call_id is not None else f"local-{next(_call_ids)}"

        parent = CancelController()
        deadline = CancelController() if timeout is not None else None
        inputs = (
            (signal, parent.signal)
            if deadline is None
            else (
                signal,
                parent.signal,
                deadline.signal,
            )
        )
        fusion = Fusion(inputs)
        box: list[ToolResult] = []
        done = anyio.Event()

        async def run_shielded() -> None:
            try:
                box.append(
                    await self._run(name, args, cid, fusion.signal, deadline, timeout, on_dispatch)
                )
            finally:
                done.set()

        self._in_flight += 1
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_shielded)
                try:
                    await done.wait()
                except anyio.get_cancelled_exc_class():
                    cancel_with_runtime_cause(parent, _PARENT_CAUSE)
                    raise
        finally:
            # The call is over: its signal's authority ends with it. A stray task that kept
            # the signal sees it cancelled ("disposed"), never a signal that seems alive (C2.1).
            fusion.close(expire=True)
            self._in_flight -= 1
            if self._in_flight == 0 and self._idle is not None:
                self._idle.set()
                self._idle = None
        return box[0]

    async def execute_owned(
        self,
        name: str,
        args: Mapping[str, Any],
        *,
        controller: CancelController,
        call_id: str,
        on_dispatch: Callable[[], object] | None = None,
    ) -> ToolResult:
        """:meth:`execute` for a caller that owns the call's controller and never cancels the
        awaiting task (the worker process, which learns of cancellation only by message): the
        same pipeline, order and classification, without the machinery that turns a cancelled
        awaiting task into cause ``parent``. The controller's signal is the caller's signal;
        when the call is over it is expired (cancelled with cause ``disposed``), like the fused
        signal of :meth:`execute`. Not for general use."""
        self._in_flight += 1
        try:
            return await self._run(name, args, call_id, controller.signal, None, None, on_dispatch)
        finally:
            cancel_with_runtime_cause(controller, _DISPOSED_CAUSE)
            self._in_flight -= 1
            if self._in_flight == 0 and self._idle is not None:
                self._idle.set()
                self._idle = None

    async def _run(
        self,
        name: str,
        args: Mapping[str, Any],
        call_id: str,
        signal: CancelSignal,
        deadline: CancelController | None,
        timeout: float | None,
        on_dispatch: Callable[[], object] | None,
    ) -> ToolResult:
        """The pipeline, shielded from task cancellation, with the timeout policy's timer."""
        result: ToolResult | None = None
        with anyio.CancelScope(shield=True):
            if deadline is None:
                result = await self._pipeline(name, args, call_id, signal, on_dispatch)
            else:
                async with anyio.create_task_group() as inner:
                    inner.start_soon(_deadline_timer, deadline, timeout)
                    result = await self._pipeline(name, args, call_id, signal, on_dispatch)
                    inner.cancel_scope.cancel()
        assert result is not None  # the shield is never cancelled from outside
        return result

    async def _pipeline(
        self,
        name: str,
        args: Mapping[str, Any],
        call_id: str,
        caller: CancelSignal,
        on_dispatch: Callable[[], object] | None,
    ) -> ToolResult:
        spec = self._tools.get(name)
        finalizer = spec.finalize if spec is not None else None
        prepared = _prepare(spec, name, args, call_id, caller)
        if isinstance(prepared, ToolResult):
            candidate = prepared
        else:
            assert spec is not None
            candidate = await self._stages(spec, *prepared, on_dispatch)
        return self._publish(finalizer, candidate)

    def _publish(self, finalizer: ContentFinalizer | None, candidate: ToolResult) -> ToolResult:
        """The end of every call: the content finalizer, then the observers (C2.4)."""
        result = _finalize(finalizer, candidate)
        for observer in self._observers:
            try:
                observer(result)
            except Exception:
                _log.exception("result observer %r raised", observer)
        return result

    def _runs_plain(self, name: str) -> bool:
        """Whether a call of ``name`` may go through :meth:`_execute_plain`: a sync tool, and
        no stage but its body (no policies, approval, wrappers or observers, which may expect
        the event loop's thread or wait on it)."""
        spec = self._tools.get(name)
        return (
            spec is not None
            and not spec.is_async
            and not (self._pre or self._approval or self._wrappers or self._post or self._observers)
        )

    def _execute_plain(
        self,
        name: str,
        args: Mapping[str, Any],
        *,
        controller: CancelController,
        call_id: str,
        on_dispatch: Callable[[], object] | None = None,
    ) -> ToolResult:
        """:meth:`execute_owned` for a call that :meth:`_runs_plain`, run entirely in the
        calling thread, which is not the event loop's (the worker's body thread): the same
        order, outcome and classification; the body is invoked directly, in this thread.
        For the worker process only. Not counted in :attr:`in_flight`."""
        spec = self._tools[name]
        finalizer = spec.finalize
        try:
            prepared = _prepare(spec, name, args, call_id, controller.signal)
            if isinstance(prepared, ToolResult):
                candidate = prepared
            else:
                candidate = _invoke_plain(spec, *prepared, on_dispatch)
            return self._publish(finalizer, candidate)
        finally:
            cancel_with_runtime_cause(controller, _DISPOSED_CAUSE)

    async def _stages(
        self,
        spec: ToolSpec,
        run: _Run,
        kwargs: dict[str, Any],
        on_dispatch: Callable[[], object] | None,
    ) -> ToolResult:
        caller = run.caller_signal
        view = ToolExecution(run, caller)

        # Pre-execute policies, then approval: either may deny; a denial beats cancellation.
        for policy in self._pre:
            verdict = await _stage(run, "pre-execute policy", functools.partial(policy, view))
            if isinstance(verdict, ToolResult):
                return verdict
            if verdict is False:
                return _denied(run, "refused by a pre-execute policy")
            if caller.cancelled:
                return _cancelled(run, started=False, reason=caller.reason)
        if self._approval is not None:
            verdict = await _stage(run, "approval", functools.partial(self._approval, view))
            if isinstance(verdict, ToolResult):
                return verdict
            if verdict is not True:
                return _denied(run, "not approved")
            if caller.cancelled:
                return _cancelled(run, started=False, reason=caller.reason)

        # Around-dispatch wrappers and the body.
        state = _DispatchState()
        dispatch = DispatchExecution(run)
        fusions: list[Fusion] = []
        wrappers = self._wrappers

        async def invoke_body() -> Any:
            if state.body_started or state.refused:
                raise RuntimeError("call_next() may be called only once")
            replacement = run.dispatch_signal
            if replacement is caller:
                body_signal = caller
            else:
                fusion = Fusion((caller, replacement))
                fusions.append(fusion)
                body_signal = fusion.signal
            if body_signal.cancelled:
                state.refused = True
                raise AbortError(ABORTED_BEFORE_DISPATCH_TEXT, cause=body_signal.reason)
            state.body_signal = body_signal
            if on_dispatch is not None:
                on_dispatch()
            state.body_started = True
            call_kwargs = kwargs
            if spec.signature.execution_param is not None:
                call_kwargs = {
                    **kwargs,
                    spec.signature.execution_param: ToolExecution(run, body_signal),
                }
            try:
                if spec.is_async:
                    value = await spec.fn(**call_kwargs)
                else:
                    value = await run_body_in_thread(functools.partial(spec.fn, **call_kwargs))
            except BaseException as exc:
                state.body_cancelled = body_signal.cancelled
                state.body_exc = exc
                raise
            state.body_cancelled = body_signal.cancelled
            return value

        def chain(index: int) -> Callable[[], Awaitable[Any]]:
            if index == len(wrappers):
                return invoke_body
            wrapper = wrappers[index]

            async def call() -> Any:
                return await wrapper(dispatch, chain(index + 1))

            return call

        try:
            value = await chain(0)()
        except BaseException as exc:
            return _classify_failure(run, state, exc, anyio.get_cancelled_exc_class())
        finally:
            for fusion in fusions:
                fusion.close(expire=True)
            run.dispatch_signal = caller

        if not state.body_started:
            # A wrapper returned before delegating (or swallowed a refused dispatch).
            if state.refused or caller.cancelled:
                return _cancelled(run, started=False, reason=caller.reason or _reason(state))
            return _ok(run, value, started=False)

        # Post-execute policies see the value; they may fail the call or wait on the signal.
        for post in self._post:
            verdict = await _stage(run, "post-execute policy", functools.partial(post, view, value))
            if isinstance(verdict, ToolResult):
                if verdict.outcome in (Outcome.ABORTED_BEFORE_DISPATCH, Outcome.TIMEOUT):
                    return _cancelled(run, started=True, reason=caller.reason)
                if verdict.outcome is Outcome.DENIED:  # a post policy cannot un-run the body
                    verdict = _error(
                        run.tool,
                        run.call_id,
                        f"Error: post-execute policy failed: {verdict.error}",
                        "Denied",
                        context=run.context,
                    )
                return replace(verdict, body_started=True)

        if state.body_cancelled or caller.cancelled:
            reason = caller.reason if caller.cancelled else _reason(state)
            return _cancelled(run, started=True, reason=reason)
        return _ok(run, value, started=True)

    def __repr__(self) -> str:
        return f"<Registry tools={sorted(self._tools)}>"


# --------------------------------------------------------------------------- helpers


def _prepare(
    spec: ToolSpec | None,
    name: str,
    args: Mapping[str, Any],
    call_id: str,
    caller: CancelSignal,
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
    if caller.cancelled:
        return _cancelled(run, started=False, reason=caller.reason)
    return run, kwargs


def _invoke_plain(
    spec: ToolSpec,
    run: _Run,
    kwargs: dict[str, Any],
    on_dispatch: Callable[[], object] | None,
) -> ToolResult:
    """The body of a plain call (no wrappers, no post policies), invoked in this thread, and
    its outcome, classified as :meth:`Registry._stages` would."""
    caller = run.caller_signal
    reason = caller.reason
    if reason is not None:  # cancelled since the check in _prepare: never dispatched
        return _cancelled(run, started=False, reason=reason)
    state = _DispatchState()
    state.body_signal = caller
    if on_dispatch is not None:
        on_dispatch()
    state.body_started = True
    if spec.signature.execution_param is not None:
        kwargs = {**kwargs, spec.signature.execution_param: ToolExecution(run, caller)}
    try:
        value = spec.fn(**kwargs)
    except BaseException as exc:  # a result, like any failure of a body (C2.6)
        if isinstance(exc, StopIteration):
            # As on the loop's path, where the body's exception is raised again in a
            # coroutine, which turns a StopIteration into this (PEP 479).
            raised = exc
            exc = RuntimeError("coroutine raised StopIteration")
            exc.__cause__ = raised
        state.body_cancelled = caller.cancelled
        state.body_exc = exc
        # The worker's loop is asyncio's: its cancellation is asyncio.CancelledError.
        return _classify_failure(run, state, exc, asyncio.CancelledError)
    if caller.cancelled:
        return _cancelled(run, started=True, reason=caller.reason)
    return _ok(run, value, started=True)


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
        snapshot, packed = _snapshot(value)
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
            value, packed = _snapshot(final.value)
            return replace(candidate, value=value, _packed_value=packed)
        return replace(candidate, error=final.error)
    except Exception as exc:
        return replace(
            candidate,
            outcome=Outcome.ERROR,
            value=None,
            _packed_value=None,
            error=f"Error: content finalizer failed: {type(exc).__name__}: {_text(exc)}",
            error_name=type(exc).__name__,
        )
