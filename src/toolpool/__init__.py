"""toolpool: run tool calls in isolated worker processes and stop them truthfully.

The public API. Everything here is re-exported from a private module; ``__module__`` is
rewritten so tracebacks and reprs read ``toolpool.X``.
"""

from __future__ import annotations

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
    ToolDenied,
    ToolpoolError,
    UnknownToolError,
    WorkerLost,
    WorkerStartError,
    fuse,
    validate_cause,
)
from .sandbox import Profile
from .supervisor import (
    Call,
    ContainmentReport,
    Group,
    Pool,
    Result,
    Rung,
    Statistics,
    SyncCall,
    SyncPool,
    Timeline,
    WorkerState,
)
from .worker import (
    DispatchExecution,
    Registry,
    ToolExecution,
    ToolResult,
)

__version__ = "0.1.0.dev0"

__all__ = (
    "ABORTED_BEFORE_DISPATCH_TEXT",
    "ABORTED_TEXT",
    "AbortError",
    "Call",
    "CancelCause",
    "CancelController",
    "CancelSignal",
    "CauseKind",
    "ConfigurationError",
    "ContainmentReport",
    "DispatchExecution",
    "Fusion",
    "Group",
    "Outcome",
    "Pool",
    "PoolClosedError",
    "Profile",
    "Registry",
    "RemoteProtocolError",
    "Result",
    "Rung",
    "Statistics",
    "SyncCall",
    "SyncPool",
    "Timeline",
    "ToolDenied",
    "ToolExecution",
    "ToolResult",
    "ToolpoolError",
    "UnknownToolError",
    "WorkerLost",
    "WorkerState",
    "WorkerStartError",
    "__version__",
    "fuse",
    "validate_cause",
)


def _rewrite_modules() -> None:
    for name in __all__:
        obj = globals()[name]
        if isinstance(obj, type) or callable(obj):
            try:
                obj.__module__ = __name__
            except (AttributeError, TypeError):
                pass


_rewrite_modules()
