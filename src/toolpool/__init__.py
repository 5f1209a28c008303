"""toolpool: run tool calls in isolated worker processes and stop them truthfully.

The public API. Everything here is re-exported from a private module, on first use (so a
worker process, which needs the registry but not the supervisor, imports only what it uses);
``__module__`` is rewritten so tracebacks and reprs read ``toolpool.X``.
"""

from __future__ import annotations

import importlib as _importlib
import logging as _logging
import typing as _typing

# A library logs; the application decides where it goes. Without a handler of its own, an
# application that configured no logging sees nothing (not Python's bare fallback lines).
_logging.getLogger("toolpool").addHandler(_logging.NullHandler())

# isort: off
if _typing.TYPE_CHECKING:
    from .core import (
        ABORTED_BEFORE_DISPATCH_TEXT as ABORTED_BEFORE_DISPATCH_TEXT,
        ABORTED_TEXT as ABORTED_TEXT,
        AbortError as AbortError,
        CancelCause as CancelCause,
        CancelController as CancelController,
        CancelSignal as CancelSignal,
        CauseKind as CauseKind,
        ConfigurationError as ConfigurationError,
        Fusion as Fusion,
        Graces as Graces,
        Outcome as Outcome,
        PoolClosedError as PoolClosedError,
        RemoteProtocolError as RemoteProtocolError,
        ToolConflictError as ToolConflictError,
        ToolDenied as ToolDenied,
        ToolpoolError as ToolpoolError,
        UnknownToolError as UnknownToolError,
        WorkerLost as WorkerLost,
        WorkerStartError as WorkerStartError,
        fuse as fuse,
        validate_cause as validate_cause,
    )
    from .reaper import CloseReport as CloseReport
    from .remote import connect as connect
    from .sandbox import Profile as Profile
    from .supervisor import (
        Call as Call,
        CallFailed as CallFailed,
        ContainmentReport as ContainmentReport,
        Executor as Executor,
        ExecutorFuture as ExecutorFuture,
        Group as Group,
        Histogram as Histogram,
        MapIterator as MapIterator,
        Pool as Pool,
        PoolEvent as PoolEvent,
        Progress as Progress,
        ProviderAdded as ProviderAdded,
        ProviderInfo as ProviderInfo,
        ProviderRemoved as ProviderRemoved,
        ProviderResized as ProviderResized,
        RemoteError as RemoteError,
        RemoteTraceback as RemoteTraceback,
        Result as Result,
        Rung as Rung,
        Statistics as Statistics,
        SyncCall as SyncCall,
        SyncMapIterator as SyncMapIterator,
        SyncPool as SyncPool,
        Timeline as Timeline,
        ToolsChanged as ToolsChanged,
        WorkerExited as WorkerExited,
        WorkerStarted as WorkerStarted,
        WorkerState as WorkerState,
        terminate as terminate,
    )
    from .worker import (
        DispatchExecution as DispatchExecution,
        Registry as Registry,
        ToolExecution as ToolExecution,
        ToolResult as ToolResult,
    )
# isort: on

#: Where each public name lives (sorted; the names are :data:`__all__`'s, checked by
#: ``tests/test_public_api.py``, as the type checkers' imports above are).
_EXPORTS: dict[str, str] = {
    "ABORTED_BEFORE_DISPATCH_TEXT": "core",
    "ABORTED_TEXT": "core",
    "AbortError": "core",
    "Call": "supervisor",
    "CallFailed": "supervisor",
    "CancelCause": "core",
    "CancelController": "core",
    "CancelSignal": "core",
    "CauseKind": "core",
    "CloseReport": "reaper",
    "ConfigurationError": "core",
    "ContainmentReport": "supervisor",
    "DispatchExecution": "worker",
    "Executor": "supervisor",
    "ExecutorFuture": "supervisor",
    "Fusion": "core",
    "Graces": "core",
    "Group": "supervisor",
    "Histogram": "supervisor",
    "MapIterator": "supervisor",
    "Outcome": "core",
    "Pool": "supervisor",
    "PoolClosedError": "core",
    "PoolEvent": "supervisor",
    "Profile": "sandbox",
    "Progress": "supervisor",
    "ProviderAdded": "supervisor",
    "ProviderInfo": "supervisor",
    "ProviderRemoved": "supervisor",
    "ProviderResized": "supervisor",
    "Registry": "worker",
    "RemoteError": "supervisor",
    "RemoteProtocolError": "core",
    "RemoteTraceback": "supervisor",
    "Result": "supervisor",
    "Rung": "supervisor",
    "Statistics": "supervisor",
    "SyncCall": "supervisor",
    "SyncMapIterator": "supervisor",
    "SyncPool": "supervisor",
    "Timeline": "supervisor",
    "ToolConflictError": "core",
    "ToolDenied": "core",
    "ToolExecution": "worker",
    "ToolResult": "worker",
    "ToolpoolError": "core",
    "ToolsChanged": "supervisor",
    "UnknownToolError": "core",
    "WorkerExited": "supervisor",
    "WorkerLost": "core",
    "WorkerStartError": "core",
    "WorkerStarted": "supervisor",
    "WorkerState": "supervisor",
    "connect": "remote",
    "fuse": "core",
    "terminate": "supervisor",
    "validate_cause": "core",
}

__version__ = "0.1.0.dev0"

#: The public names: :data:`_EXPORTS`' and ``__version__``, sorted (one list to keep).
__all__ = tuple(sorted((*_EXPORTS, "__version__")))


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'toolpool' has no attribute {name!r}")
    return _reexport(globals(), name, _importlib.import_module(f"toolpool.{module}"))


def _reexport(namespace: dict[str, _typing.Any], name: str, module: _typing.Any) -> _typing.Any:
    """``module.name``, cached in ``namespace`` (a package's globals) with ``__module__``
    rewritten to that package, so tracebacks and reprs read ``package.Name``."""
    obj = getattr(module, name)
    if isinstance(obj, type) or callable(obj):
        try:
            obj.__module__ = namespace["__name__"]
        except (AttributeError, TypeError):
            pass
    namespace[name] = obj
    return obj


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
