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

if _typing.TYPE_CHECKING:
    from .core import (
        ABORTED_BEFORE_DISPATCH_TEXT,
        ABORTED_TEXT,
        AbortError,
        CancelCause,
        CancelController,
        CancelSignal,
        CauseKind,
        ConfigurationError,
        Fusion,
        Outcome,
        PoolClosedError,
        RemoteProtocolError,
        ToolConflictError,
        ToolDenied,
        ToolpoolError,
        UnknownToolError,
        WorkerLost,
        WorkerStartError,
        fuse,
        validate_cause,
    )
    from .reaper import CloseReport
    from .remote import connect
    from .sandbox import Profile
    from .supervisor import (
        Call,
        CallFailed,
        ContainmentReport,
        Executor,
        ExecutorFuture,
        Group,
        Histogram,
        MapIterator,
        Pool,
        PoolEvent,
        Progress,
        ProviderAdded,
        ProviderInfo,
        ProviderRemoved,
        ProviderResized,
        RemoteError,
        RemoteTraceback,
        Result,
        Rung,
        Statistics,
        SyncCall,
        SyncMapIterator,
        SyncPool,
        Timeline,
        ToolsChanged,
        WorkerExited,
        WorkerStarted,
        WorkerState,
        terminate,
    )
    from .worker import (
        DispatchExecution,
        Registry,
        ToolExecution,
        ToolResult,
    )

#: Where each public name lives.
_EXPORTS: dict[str, str] = {
    "ABORTED_BEFORE_DISPATCH_TEXT": "core",
    "ABORTED_TEXT": "core",
    "AbortError": "core",
    "Call": "supervisor",
    "CallFailed": "supervisor",
    "Executor": "supervisor",
    "ExecutorFuture": "supervisor",
    "RemoteError": "supervisor",
    "RemoteTraceback": "supervisor",
    "terminate": "supervisor",
    "CancelCause": "core",
    "CancelController": "core",
    "CancelSignal": "core",
    "CauseKind": "core",
    "ConfigurationError": "core",
    "CloseReport": "reaper",
    "ContainmentReport": "supervisor",
    "DispatchExecution": "worker",
    "Fusion": "core",
    "Group": "supervisor",
    "Histogram": "supervisor",
    "MapIterator": "supervisor",
    "Outcome": "core",
    "Pool": "supervisor",
    "PoolClosedError": "core",
    "Progress": "supervisor",
    "Profile": "sandbox",
    "Registry": "worker",
    "RemoteProtocolError": "core",
    "Result": "supervisor",
    "Rung": "supervisor",
    "Statistics": "supervisor",
    "SyncCall": "supervisor",
    "SyncMapIterator": "supervisor",
    "SyncPool": "supervisor",
    "Timeline": "supervisor",
    "ToolConflictError": "core",
    "ToolDenied": "core",
    "PoolEvent": "supervisor",
    "ProviderAdded": "supervisor",
    "ProviderInfo": "supervisor",
    "ProviderRemoved": "supervisor",
    "ProviderResized": "supervisor",
    "ToolsChanged": "supervisor",
    "WorkerExited": "supervisor",
    "WorkerStarted": "supervisor",
    "ToolExecution": "worker",
    "ToolResult": "worker",
    "ToolpoolError": "core",
    "UnknownToolError": "core",
    "WorkerLost": "core",
    "WorkerStartError": "core",
    "WorkerState": "supervisor",
    "connect": "remote",
    "fuse": "core",
    "validate_cause": "core",
}

__version__ = "0.1.0.dev0"

__all__ = (
    "ABORTED_BEFORE_DISPATCH_TEXT",
    "ABORTED_TEXT",
    "AbortError",
    "Call",
    "CallFailed",
    "CancelCause",
    "CancelController",
    "CancelSignal",
    "CauseKind",
    "CloseReport",
    "ConfigurationError",
    "ContainmentReport",
    "DispatchExecution",
    "Executor",
    "ExecutorFuture",
    "Fusion",
    "Group",
    "Histogram",
    "MapIterator",
    "Outcome",
    "Pool",
    "PoolClosedError",
    "PoolEvent",
    "Profile",
    "ProviderAdded",
    "ProviderInfo",
    "ProviderRemoved",
    "ProviderResized",
    "Progress",
    "Registry",
    "RemoteError",
    "RemoteProtocolError",
    "RemoteTraceback",
    "Result",
    "Rung",
    "Statistics",
    "SyncCall",
    "SyncMapIterator",
    "SyncPool",
    "Timeline",
    "ToolConflictError",
    "ToolDenied",
    "ToolExecution",
    "ToolResult",
    "ToolpoolError",
    "ToolsChanged",
    "UnknownToolError",
    "WorkerExited",
    "WorkerLost",
    "WorkerStarted",
    "WorkerState",
    "WorkerStartError",
    "__version__",
    "connect",
    "fuse",
    "terminate",
    "validate_cause",
)


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
