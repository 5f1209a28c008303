"""The in-process tool registry: the cooperative pipeline that runs inside every worker.

CONTRACT C2 (stages, views, order) and C3 (classification). Inside this module nothing is ever
interrupted or abandoned: a started body is awaited until it settles, and the only way a body
learns of cancellation is its signal.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Final, TypeVar, final, overload

import anyio

from ..core import (
    ABORTED_BEFORE_DISPATCH_TEXT,
    AbortError,
    CancelCause,
    CancelController,
    CancelSignal,
    ConfigurationError,
    Fusion,
    Outcome,
    cancel_with_runtime_cause,
)
from ..schema import inspect_tool
from ._call import (
    ApprovalHook,
    AroundDispatch,
    ContentFinalizer,
    DispatchExecution,
    PostPolicy,
    PrePolicy,
    ProgressSink,
    ResultObserver,
    ToolExecution,
    ToolResult,
    ToolSpec,
    _body_kwargs,
    _call_sync_body,
    _cancelled,
    _classify_failure,
    _deadline_timer,
    _denied,
    _DispatchState,
    _error,
    _finalize,
    _invoke_plain,
    _ok,
    _prepare,
    _reason,
    _Run,
    _run_body_in_thread,
    _stage,
)
from ._call import (
    DecodedArgs as DecodedArgs,
)

__all__ = (
    "AroundDispatch",
    "DispatchExecution",
    "Registry",
    "ToolExecution",
    "ToolResult",
    "ToolSpec",
)

_log = logging.getLogger("toolpool.worker")

_PARENT_CAUSE: Final = CancelCause("parent")
_DISPOSED_CAUSE: Final = CancelCause("disposed")
_call_ids = itertools.count(1)

F = TypeVar("F", bound=Callable[..., Any])


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
        #: How sync bodies are invoked: None in a thread (in-process, C2.5); the worker
        #: process sets it to invoke them inline, on its main thread: ``caller(fn, kwargs)``.
        self._sync_caller: Callable[[Callable[..., Any], dict[str, Any]], Any] | None = None
        #: Where ``execution.report_progress()`` goes: None drops it (in-process); the worker
        #: process sets it to send the reports to the supervisor.
        self._progress_sink: ProgressSink | None = None
        #: The tools whose calls may run lean (:meth:`_lean_body`), made when first needed;
        #: None again whenever a tool or a stage is added.
        self._lean: (
            dict[str, tuple[Callable[..., Any], dict[str, frozenset[type]], frozenset[str]]] | None
        ) = None

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
        self._lean = None
        return spec

    def pre_execute(self, policy: PrePolicy) -> PrePolicy:
        """Add a pre-execute policy (decorator). It may deny; it never sees a replaceable
        signal."""
        self._pre.append(policy)
        self._lean = None
        return policy

    def approval(self, hook: ApprovalHook) -> ApprovalHook:
        """Set the approval hook (decorator). It may wait, cooperatively, on the signal."""
        if self._approval is not None:
            raise ConfigurationError("an approval hook is already set")
        self._approval = hook
        self._lean = None
        return hook

    def around_dispatch(self, wrapper: AroundDispatch) -> AroundDispatch:
        """Add an around-dispatch wrapper (decorator); the first added is the outermost."""
        self._wrappers.append(wrapper)
        self._lean = None
        return wrapper

    def post_execute(self, policy: PostPolicy) -> PostPolicy:
        """Add a post-execute policy (decorator), run after the body returned a value."""
        self._post.append(policy)
        self._lean = None
        return policy

    def observe(self, observer: ResultObserver) -> ResultObserver:
        """Add a result observer (decorator); it sees each published result exactly once."""
        self._observers.append(observer)
        self._lean = None
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
            self._call_ended()
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
            self._call_ended()

    def _call_ended(self) -> None:
        """A call counted in :attr:`in_flight` is over: wake :meth:`wait_idle` at zero."""
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
        prepared = _prepare(spec, name, args, call_id, caller, self._progress_sink)
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

    def _lean_body(self, name: str, args: Any) -> Callable[..., Any] | None:
        """The body of a call of ``name`` with ``args`` (as msgpack decoded them) that may run
        lean, in the worker (``_server.py``): no stage but the body, which is sync, takes no
        execution view and has no content finalizer, and ``args`` bind to themselves
        (:meth:`ToolSignature.plain_types`): the same result as :meth:`_execute_plain`, from
        the body called with ``args`` as they are. None: the call runs the whole pipeline."""
        lean = self._lean
        if lean is None:
            lean = self._lean = self._lean_tools()
        entry = lean.get(name)
        if entry is None or type(args) is not dict:
            return None
        fn, types, required = entry
        if args:
            for key, value in args.items():
                admitted = types.get(key)
                if admitted is None or type(value) not in admitted:
                    return None
            if required and not args.keys() >= required:
                return None
        elif required:
            return None
        return fn

    def _lean_tools(
        self,
    ) -> dict[str, tuple[Callable[..., Any], dict[str, frozenset[type]], frozenset[str]]]:
        """The tools :meth:`_lean_body` may run lean: each one's body and what its arguments
        may be (:meth:`ToolSignature.plain_types`)."""
        if self._pre or self._approval or self._wrappers or self._post or self._observers:
            return {}
        lean = {}
        for name, spec in self._tools.items():
            signature = spec.signature
            plain = signature.plain_types()
            if (
                spec.is_async
                or spec.finalize is not None
                or signature.execution_param is not None
                or plain is None
            ):
                continue
            lean[name] = (spec.fn, *plain)
        return lean

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
        calling thread, with no event loop (the worker's main thread): the same order,
        outcome and classification. For the worker process only. Not in :attr:`in_flight`."""
        spec = self._tools[name]
        finalizer = spec.finalize
        try:
            prepared = _prepare(spec, name, args, call_id, controller.signal, self._progress_sink)
            if isinstance(prepared, ToolResult):
                candidate = prepared
            else:
                candidate = _invoke_plain(spec, *prepared, on_dispatch, self._sync_caller)
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
            state.dispatch(body_signal, on_dispatch)
            call_kwargs = _body_kwargs(spec, run, body_signal, kwargs)
            sync_caller = self._sync_caller
            try:
                if spec.is_async:
                    value = await spec.fn(**call_kwargs)
                elif sync_caller is not None:
                    value = _call_sync_body(spec.fn, call_kwargs, sync_caller)
                else:
                    value = await _run_body_in_thread(spec.fn, call_kwargs)
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
