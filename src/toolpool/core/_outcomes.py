"""Outcomes: what happened to the tool body (CONTRACT C3)."""

from __future__ import annotations

import enum
from typing import Final

__all__ = (
    "ABORTED_BEFORE_DISPATCH_TEXT",
    "ABORTED_TEXT",
    "ABORT_ERROR_NAME",
    "BODY_STARTED",
    "Outcome",
)


class Outcome(enum.StrEnum):
    """Exactly one per settled call; it says whether the body may have had side effects."""

    OK = "ok"
    """The body returned a value."""
    ERROR = "error"
    """Arguments could not be materialized, or the body, a wrapper or a post policy raised."""
    DENIED = "denied"
    """A pre-execute policy or approval refused it; the body never started."""
    ABORTED_BEFORE_DISPATCH = "aborted_before_dispatch"
    """Cancellation stopped it before the body was invoked."""
    ABORTED = "aborted"
    """The body was invoked and the call then ended by cancellation."""
    TIMEOUT = "timeout"
    """The deadline owned by the timeout policy expired."""
    KILLED = "killed"
    """The supervisor escalated and the worker's process tree was killed."""
    WORKER_LOST = "worker_lost"
    """The worker died or broke the protocol on its own."""


#: Model-visible text of ``aborted_before_dispatch``.
ABORTED_BEFORE_DISPATCH_TEXT: Final = "Error: tool call aborted before dispatch"
#: Model-visible text of ``aborted``.
ABORTED_TEXT: Final = "Error: tool call aborted"
#: Error name carried by ``aborted_before_dispatch``.
ABORT_ERROR_NAME: Final = "AbortError"

#: Whether the body started, per outcome: True (yes), False (no) or None (maybe).
BODY_STARTED: Final[dict[Outcome, bool | None]] = {
    Outcome.OK: True,
    Outcome.ERROR: None,
    Outcome.DENIED: False,
    Outcome.ABORTED_BEFORE_DISPATCH: False,
    Outcome.ABORTED: True,
    Outcome.TIMEOUT: None,
    Outcome.KILLED: None,
    Outcome.WORKER_LOST: None,
}
