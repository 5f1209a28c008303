"""What both sides of toolpool share: cancel causes and signals, outcomes, errors, graces.

A leaf: stdlib only (anyio is imported lazily by ``CancelSignal.wait``).
"""

from ._causes import CALLER_KINDS, RUNTIME_KINDS, CancelCause, CauseKind, validate_cause
from ._errors import (
    AbortError,
    ConfigurationError,
    PoolClosedError,
    RemoteProtocolError,
    ToolConflictError,
    ToolDenied,
    ToolpoolError,
    UnknownToolError,
    WorkerLost,
    WorkerStartError,
)
from ._graces import DEFAULT_GRACES, Graces, check_seconds
from ._outcomes import (
    ABORT_ERROR_NAME,
    ABORTED_BEFORE_DISPATCH_TEXT,
    ABORTED_TEXT,
    BODY_STARTED,
    Outcome,
)
from ._signals import (
    CallbackHandle,
    CancelController,
    CancelSignal,
    Fusion,
    cancel_with_runtime_cause,
    fuse,
)

__all__ = (
    "ABORTED_BEFORE_DISPATCH_TEXT",
    "ABORTED_TEXT",
    "ABORT_ERROR_NAME",
    "BODY_STARTED",
    "CALLER_KINDS",
    "DEFAULT_GRACES",
    "RUNTIME_KINDS",
    "AbortError",
    "CallbackHandle",
    "CancelCause",
    "CancelController",
    "CancelSignal",
    "CauseKind",
    "ConfigurationError",
    "Fusion",
    "Graces",
    "Outcome",
    "PoolClosedError",
    "RemoteProtocolError",
    "ToolDenied",
    "ToolpoolError",
    "ToolConflictError",
    "UnknownToolError",
    "WorkerLost",
    "WorkerStartError",
    "cancel_with_runtime_cause",
    "check_seconds",
    "fuse",
    "validate_cause",
)
