"""The worker side: the in-process tool registry (CONTRACT C2) and the worker process.

Never imports :mod:`toolpool.supervisor`.
"""

from ._helpers import forget_helper, keep_helper
from ._registry import (
    AroundDispatch,
    DispatchExecution,
    Registry,
    ToolExecution,
    ToolResult,
    ToolSpec,
)

__all__ = (
    "AroundDispatch",
    "DispatchExecution",
    "Registry",
    "ToolExecution",
    "ToolResult",
    "ToolSpec",
    "forget_helper",
    "keep_helper",
)
