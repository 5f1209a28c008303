"""Reading a batch's input: one JSON object per line, streamed, never held whole.

A line becomes a :class:`Job` (a call to make), a :class:`Rejection` (a line that cannot be
one: its number and why), or is skipped (its id is recorded already: a resumed run). The only
state kept across lines is the set of ids seen (to reject a repeated id): about 100 bytes per
id, so 1,000,000 ids take about 100 MB. Nothing else of a line outlives its call.
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from collections.abc import Container, Iterator, Mapping
from typing import Any, BinaryIO, Final, final

import anyio
import anyio.from_thread

__all__ = ("FIELDS", "Job", "PipeLines", "Rejection", "count_lines", "read_jobs")

#: The fields an input line may have; the first three are required.
FIELDS: Final = ("id", "tool", "args", "timeout", "group")
_REQUIRED: Final = ("id", "tool", "args")
#: How many known tool names an "unknown tool" rejection lists at most.
_NAMES_SHOWN: Final = 10

Id = str | int


@final
class Job:
    """One call to make: an input line that passed every check."""

    __slots__ = (
        "args",
        "attempts",
        "first_submitted",
        "group",
        "id",
        "line",
        "queued",
        "ran",
        "timeout",
        "tool",
    )

    def __init__(
        self,
        line: int,
        id: Id,
        tool: str,
        args: dict[str, Any],
        timeout: float | None,
        group: str | None,
    ) -> None:
        self.line = line
        self.id = id
        self.tool = tool
        self.args = args
        self.timeout = timeout
        self.group = group
        self.attempts = 0
        """Runs submitted so far."""
        self.first_submitted: float | None = None
        """When the first run was submitted (``time.monotonic()``)."""
        self.queued = 0.0
        """Seconds its runs so far waited before their body started (in the pool's queue,
        or queued in a busy worker)."""
        self.ran = 0.0
        """Seconds its runs so far took, from their body's start to their settlement."""

    def count_run(self, result: Any) -> None:
        """Add a settled run's times (``result``: its :class:`toolpool.Result`) to
        :attr:`queued` and :attr:`ran`: one whose body never started (as far as was
        observed) only queued."""
        times = result.timeline
        if times.settled is None:
            return
        taken = times.started if times.started is not None else times.settled
        self.queued += max(0.0, taken - times.submitted)
        self.ran += max(0.0, times.settled - taken)


@final
class Rejection:
    """An input line that is not a call: its number, why, and its id where it had a valid
    one."""

    __slots__ = ("id", "line", "reason")

    def __init__(self, line: int, reason: str, id: Id | None = None) -> None:
        self.line = line
        self.reason = reason
        self.id = id


class _Skip:
    __slots__ = ()


#: Yielded for a line whose id is recorded already.
SKIPPED: Final = _Skip()


@final
class PipeLines:
    """The lines of an input that is not a regular file (standard input, a pipe), read by a
    thread so that the event loop never blocks on a silent writer: Ctrl-C is heard, calls
    settle and records are written meanwhile. At most ``limit`` lines wait in memory (then
    the thread waits for the batch).

    Iterate it (what :func:`read_jobs` does) only while :meth:`ready`: a non-blank line is
    buffered (each one :func:`read_jobs` takes ends at one), or the input ended.
    """

    def __init__(self, stream: BinaryIO, *, limit: int = 4096) -> None:
        self._stream = stream
        self._limit = limit
        self._lines: deque[bytes] = deque()
        self._lock = threading.Condition()
        self._whole = 0  # non-blank lines buffered
        self._ended = False
        self._error: OSError | None = None
        self._changed: anyio.Event | None = None

    def ready(self) -> bool:
        """A line can be taken without waiting (or the input ended)."""
        return self._whole > 0 or self._ended

    async def wait(self) -> None:
        """Until :meth:`ready`, or :meth:`wake`."""
        if not self.ready():
            self._changed = anyio.Event()
            await self._changed.wait()

    def wake(self) -> None:
        """End a :meth:`wait` (in the event loop's thread)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def read(self) -> None:
        """The reading thread's work: every line, then the end (in a worker thread of the
        event loop's: ``anyio.to_thread.run_sync``)."""
        try:
            for line in self._stream:
                with self._lock:
                    while len(self._lines) >= self._limit:
                        self._lock.wait()
                    self._lines.append(line)
                    whole = bool(line.strip())
                    self._whole += whole
                if whole:
                    self._tell()
        except OSError as exc:
            self._error = exc
        finally:
            with self._lock:
                self._ended = True
                self._lock.notify_all()
            self._tell()

    def _tell(self) -> None:
        try:
            anyio.from_thread.run_sync(self.wake)
        except RuntimeError:  # (the event loop is gone: nobody waits)
            pass

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        with self._lock:
            while not self._lines and not self._ended:
                self._lock.wait()  # (not reached while ready(): only if misused)
            if not self._lines:
                if self._error is not None:
                    raise ValueError(f"cannot read the input: {self._error.strerror}")
                raise StopIteration
            line = self._lines.popleft()
            self._whole -= bool(line.strip())
            self._lock.notify()
        return line


def count_lines(path: str) -> int | None:
    """The number of non-empty lines of the file at ``path`` (for a progress total), or None
    when it is not a regular file (a pipe can be read once only)."""
    import os
    import stat

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    n = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                n += 1
    return n


def read_jobs(
    stream: BinaryIO | PipeLines,
    *,
    tools: Mapping[str, object],
    recorded: Container[Id],
    default_timeout: float | None,
) -> Iterator[Job | Rejection | _Skip]:
    """Each non-empty line of ``stream`` as a :class:`Job`, a :class:`Rejection` or
    :data:`SKIPPED` (its id is in ``recorded``), in order. Blank lines are ignored (a
    trailing newline is no line)."""
    seen: set[Id] = set()
    for number, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw.decode())  # (decoded here: quicker than loads' own sniffing)
        except json.JSONDecodeError as exc:
            # Its position as a column of this line (the text ends at the line's end: an
            # error found at its newline is at the column after the last character).
            column = min(exc.pos, len(exc.doc.rstrip("\r\n"))) + 1
            yield Rejection(number, f"line {number}: not valid JSON ({exc.msg}, column {column})")
            continue
        except (ValueError, UnicodeDecodeError) as exc:
            yield Rejection(number, f"line {number}: not valid JSON ({exc})")
            continue
        if not isinstance(line, dict):
            yield Rejection(
                number, f"line {number}: a line is a JSON object, not {_json_type(line)}"
            )
            continue
        raw_id = line.get("id")
        kind = type(raw_id)
        if not ((kind is str and raw_id) or kind is int):
            why = _check_id(raw_id) if "id" in line else "has no 'id'"
            yield Rejection(number, f"line {number}: {why}")
            continue
        job_id: Id = raw_id  # type: ignore[assignment]  # (checked just above)
        if job_id in seen:
            yield Rejection(
                number, f"line {number}: repeats the id {job_id!r} of an earlier line", job_id
            )
            continue
        seen.add(job_id)
        if job_id in recorded:
            yield SKIPPED
            continue
        if not _looks_fine(line, tools):  # (the quick check; the slow one says why)
            problem = _check_fields(line, tools)
            if problem is not None:
                yield Rejection(number, f"line {number}: {problem}", job_id)
                continue
        timeout = line.get("timeout")
        yield Job(
            number,
            job_id,
            line["tool"],
            line["args"],
            default_timeout if timeout is None else float(timeout),
            line.get("group"),
        )


_FIELD_SET: Final = frozenset(FIELDS)


def _looks_fine(line: dict[str, Any], tools: Mapping[str, object]) -> bool:
    """True if the line is certainly a call; False if :func:`_check_fields` must look."""
    if len(line) != 3 and not _FIELD_SET.issuperset(line):
        return False
    tool = line.get("tool")
    if type(tool) is not str or tool not in tools or type(line.get("args")) is not dict:
        return False
    timeout = line.get("timeout")
    if timeout is not None and not (type(timeout) in (int, float) and 0 < timeout < math.inf):
        return False
    group = line.get("group")
    return group is None or (type(group) is str and group != "")


def _check_id(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return f"its 'id' must be a string or an integer, not {_json_type(value)}"
    return "its 'id' is an empty string"


def _check_fields(line: Mapping[str, Any], tools: Mapping[str, object]) -> str | None:
    """Why the line (with a valid id) is not a call, or None."""
    unknown = sorted(k for k in line if k not in FIELDS)
    if unknown:
        return f"unknown field(s) {', '.join(map(repr, unknown))}; a line has {', '.join(FIELDS)}"
    missing = [k for k in _REQUIRED if k not in line]
    if missing:
        return f"has no {', '.join(repr(k) for k in missing)}"
    tool = line["tool"]
    if not isinstance(tool, str):
        return f"its 'tool' must be a string, not {_json_type(tool)}"
    if tool not in tools:
        names = sorted(tools)
        shown = ", ".join(names[:_NAMES_SHOWN]) + (", ..." if len(names) > _NAMES_SHOWN else "")
        return f"unknown tool {tool!r}; known: {shown}"
    if not isinstance(line["args"], dict):
        return f"its 'args' must be a JSON object, not {_json_type(line['args'])}"
    timeout = line.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        shown = repr(timeout) if isinstance(timeout, (int, float)) else _json_type(timeout)
        return f"its 'timeout' must be a positive number of seconds, not {shown}"
    group = line.get("group")
    if group is not None and (not isinstance(group, str) or not group):
        return f"its 'group' must be a non-empty string, not {_json_type(group)}"
    return None


def _json_type(value: object) -> str:
    """What ``value`` is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string" if value else "an empty string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__  # pragma: no cover (json.loads makes nothing else)
