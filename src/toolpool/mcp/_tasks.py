"""Task-augmented ``tools/call`` (the tasks utility of MCP 2025-11-25): the task records.

A client that sends ``tools/call`` with ``params.task`` gets a task at once (``working``)
instead of waiting on the request; ``tasks/get`` reports its state, ``tasks/result`` waits for
the tool's result, ``tasks/cancel`` cancels it and answers only once the pool call settled
(CONTRACT C8.2): a task is never reported terminal before its call settled, which for a killed
call means its worker's whole process tree is gone.

Status: ``completed`` (outcome ``ok``), ``failed`` (any other outcome: the tool result has
``isError``), ``cancelled`` (``tasks/cancel`` asked and the call ended by that cancellation,
its cause ``user``: a call its deadline or the server's shutdown had stopped first is
``failed``, the first cause wins).
``statusMessage`` says what happened to the tool body, in the outcome's words.

Tasks belong to the connection that created them: another connection neither sees nor
cancels them, and when their connection ends they are cancelled with cause ``parent``.
"""

from __future__ import annotations

import datetime
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio

if TYPE_CHECKING:
    from ..supervisor import Call, Result

__all__ = ("DEFAULT_TASK_TTL_MS", "POLL_INTERVAL_MS", "Task", "TaskStore")

#: How long a task is kept from its creation when the client asks for no ttl: one hour.
DEFAULT_TASK_TTL_MS: Final = 3_600_000
#: The polling interval suggested to clients.
POLL_INTERVAL_MS: Final = 500

_CANCEL_OUTCOMES: Final = frozenset({"aborted", "aborted_before_dispatch", "killed", "worker_lost"})


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def status_message(result: Result) -> str:
    """What happened to the tool body, for a task's ``statusMessage``."""
    outcome = result.outcome.value
    if outcome == "ok":
        return "ok: the tool returned a value"
    if outcome == "killed":
        return (
            f"killed (escalation reached {result.rung.value}): the tool's worker and every "
            "process it started are gone"
        )
    if outcome == "aborted":
        return "aborted: the tool stopped cooperatively after its body started"
    if outcome == "aborted_before_dispatch":
        return "aborted before dispatch: the tool body never ran"
    return f"{outcome}: {result.error or ''}".rstrip(": ")


@dataclass(eq=False)
class Task:
    """One task: a pool call the client follows by id."""

    id: str
    owner: object
    call: Call
    ttl_ms: int
    created_at: str = field(default_factory=_now)
    created: float = field(default_factory=time.monotonic)
    updated_at: str = ""
    status: str = "working"
    message: str | None = None
    cancel_requested: bool = False
    payload: dict[str, Any] | None = None
    done: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        self.updated_at = self.created_at

    @property
    def terminal(self) -> bool:
        return self.status != "working"

    def settle(self, result: Result, payload: dict[str, Any]) -> None:
        """The call settled: the task takes its final state."""
        outcome = result.outcome.value
        cause = result.cause["kind"] if result.cause is not None else None
        if outcome == "ok":
            self.status = "completed"
        elif self.cancel_requested and cause == "user" and outcome in _CANCEL_OUTCOMES:
            # Only when its cancel is the one that stuck (the first cause wins): a call
            # its deadline or the server's shutdown had already stopped is not "cancelled".
            self.status = "cancelled"
        else:
            self.status = "failed"
        self.message = status_message(result)
        self.payload = payload
        self.updated_at = _now()
        self.done.set()

    def unsettled(self, why: str) -> None:
        """The pool closed without settling the call (its tree would not die)."""
        self.status = "failed"
        self.message = f"unsettled: {why}"
        self.updated_at = _now()
        self.done.set()

    def wire(self) -> dict[str, Any]:
        """The task as MCP's ``Task`` object."""
        out: dict[str, Any] = {
            "taskId": self.id,
            "status": self.status,
            "createdAt": self.created_at,
            "lastUpdatedAt": self.updated_at,
            "ttl": self.ttl_ms,
            "pollInterval": POLL_INTERVAL_MS,
        }
        message = self.message
        if message is None:  # working: where the call is, truthfully
            message = "running: the tool body started" if self.call.started else "queued"
        out["statusMessage"] = message
        return out


class TaskStore:
    """The tasks of one server, by id; expired ones are dropped as new ones come."""

    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}

    def create(self, owner: object, call: Call, ttl_ms: int | None) -> Task:
        if owner is None:  # fail closed: an ownerless task would be every client's
            raise ValueError("a task needs an owner (the connection that created it)")
        self._expire()
        ttl = DEFAULT_TASK_TTL_MS if ttl_ms is None else max(1, min(int(ttl_ms), 86_400_000))
        task = Task(id=secrets.token_urlsafe(16), owner=owner, call=call, ttl_ms=ttl)
        self._tasks[task.id] = task
        return task

    def get(self, owner: object, task_id: str) -> Task | None:
        task = self._tasks.get(task_id)
        return task if task is not None and owner is not None and task.owner is owner else None

    def of(self, owner: object) -> Iterator[Task]:
        if owner is None:
            return iter(())
        return (t for t in list(self._tasks.values()) if t.owner is owner)

    def _expire(self) -> None:
        now = time.monotonic()
        for task in list(self._tasks.values()):
            if task.terminal and now - task.created > task.ttl_ms / 1000:
                del self._tasks[task.id]
