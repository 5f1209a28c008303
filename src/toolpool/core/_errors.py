"""The exception tree: one root, subtrees by who is at fault."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._causes import CancelCause

__all__ = (
    "AbortError",
    "ConfigurationError",
    "PoolClosedError",
    "RemoteProtocolError",
    "ToolDenied",
    "ToolConflictError",
    "ToolpoolError",
    "UnknownToolError",
    "WorkerLost",
    "WorkerStartError",
)


class ToolpoolError(Exception):
    """The root of every error toolpool raises."""


class AbortError(ToolpoolError):
    """Raised at a safe point by a tool whose signal was cancelled (``signal.raise_if_cancelled``).

    The registry classifies a body that ends this way as ``aborted`` (or ``timeout``).
    """

    def __init__(self, message: str = "tool call aborted", *, cause: CancelCause | None = None):
        super().__init__(message)
        self.cause = cause


class ToolDenied(ToolpoolError):
    """Raised by a pre-execute policy or an approval hook to refuse a call (outcome ``denied``)."""


class ConfigurationError(ToolpoolError):
    """The pool or registry was configured inconsistently (bad tools spec, duplicate tool...)."""


class UnknownToolError(ToolpoolError, LookupError):
    """No ready worker provides a tool of that name."""


class ToolConflictError(ConfigurationError):
    """Two providers define a tool of the same name (the second is refused)."""


class PoolClosedError(ToolpoolError):
    """You closed the pool (or it is closing): no new calls are accepted."""


class WorkerStartError(ToolpoolError):
    """Workers could not be started (the tools module failed to import, a crash loop...)."""


class WorkerLost(ToolpoolError):
    """A worker died or broke the protocol on its own."""


class RemoteProtocolError(WorkerLost):
    """A worker sent something the protocol does not allow (garbage, oversized, forged)."""


# Tracebacks name each error as users import it (``toolpool.WorkerStartError``) from its first
# raise, not only once ``toolpool.WorkerStartError`` was looked up (``toolpool/__init__.py``
# rewrites the other public names on first use).
for _cls in (
    ToolpoolError,
    AbortError,
    ToolDenied,
    ConfigurationError,
    UnknownToolError,
    ToolConflictError,
    PoolClosedError,
    WorkerStartError,
    WorkerLost,
    RemoteProtocolError,
):
    _cls.__module__ = "toolpool"
del _cls
