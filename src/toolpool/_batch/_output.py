"""The results file: its records, reading it back to resume, and writing it durably.

One JSON object per line. A call's record is the persisted record of seed 004: the coarse
outcome (CONTRACT C3) and the model-visible error text, never runtime detail (no cancel cause,
no stack trace, no signal, no pid). A rejected input line gets a record of its own
(``"outcome": "rejected"``, with its line number), which never counts as its id's record.

Writing: a record is written with ``write(2)`` (no buffer in this process) before the batch
counts it done, so a SIGKILL of the batch loses no record it counted; ``fsync(2)`` runs after
every :data:`FSYNC_EVERY` records and at the end, so after a crash of the machine at most
2 x :data:`FSYNC_EVERY` counted records may be missing (the next fsync waits for the last).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, final

import anyio
import anyio.to_thread

from ..core import Outcome
from ._input import Id, Job, Rejection

__all__ = (
    "FSYNC_EVERY",
    "REJECTED",
    "Previous",
    "ResultsFile",
    "ResultsFileError",
    "call_record",
    "encode",
    "rejection_record",
)

#: Records between two fsyncs of the results file.
FSYNC_EVERY: Final = 1000
#: The outcome of a rejected input line's record.
REJECTED: Final = "rejected"
_OK: Final = Outcome.OK
#: Error name of a record whose value JSON cannot hold.
UNRECORDABLE: Final = "UnrecordableValue"


class ResultsFileError(ValueError):
    """The results file cannot be used: not one this command wrote, or busy."""


@dataclass
class Previous:
    """What a results file held before this run (all empty for a new file)."""

    ids: dict[Id, tuple[str, bool | None]] = field(default_factory=dict)
    """Ids with a call record, with its outcome and ``body_started`` (the last record of an
    id wins: a rerun appends one): a resumed run skips them."""
    rejections: set[tuple[int, Id | None]] = field(default_factory=set)
    """(line, input id) of the rejection records: not written again for the same line (its
    reason may differ: it lists the tools known then)."""
    repaired: int = 0
    """Bytes of a torn last line cut off (0: none)."""

    @property
    def outcomes(self) -> Counter[str]:
        """The records by outcome (one per id)."""
        return Counter(outcome for outcome, _ in self.ids.values())

    def rerun(self, outcomes: frozenset[str], *, idempotent: bool) -> int:
        """Forget the records of ``outcomes`` so that their calls run again; how many.
        Without ``idempotent``, refuse (ValueError, nothing forgotten) where a body started
        or may have (``body_started`` true or null): the tool would run twice."""
        chosen = [i for i, (outcome, _) in self.ids.items() if outcome in outcomes]
        started = [i for i in chosen if self.ids[i][1] is not False]
        if started and not idempotent:
            shown = ", ".join(map(repr, started[:5])) + (", ..." if len(started) > 5 else "")
            raise ValueError(
                f"--rerun would run {len(started)} call(s) again whose body started or may "
                f"have (ids {shown}): their tools would run twice. Add --idempotent if they "
                "are safe to run again"
            )
        for i in chosen:
            del self.ids[i]
        return len(chosen)


#: One encoder for every record (json.dumps with options builds one per call).
_ENCODER: Final = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


#: Text as it is (UTF-8): an id "café" reads "café" in the file, not "caf\\u00e9".
_UTF8_ENCODER: Final = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def encode(record: dict[str, Any]) -> bytes:
    """One record as a line of JSON, in UTF-8; where the text cannot be UTF-8 (a lone
    surrogate from a ``\\ud800`` escape in the input), escaped as ASCII, so any text
    survives."""
    try:
        return (_UTF8_ENCODER.encode(record) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (_ENCODER.encode(record) + "\n").encode("ascii")


def call_record(job: Job, result: Any) -> tuple[bytes, str]:
    """The record of ``job``'s settled call (``result`` a :class:`toolpool.Result`), and the
    outcome it records: the fields of issue 18, in that order. A value JSON cannot hold makes
    an ``error`` record saying so."""
    outcome: Outcome = result.outcome
    job.count_run(result)
    duration, queued = round(job.ran, 6), round(job.queued, 6)
    record: dict[str, Any] = {"id": job.id, "outcome": outcome.value}
    if outcome is _OK:
        record["value"] = result.value
    else:
        record["error"] = result.error
        record["error_name"] = result.error_name
    record["body_started"] = result.body_started
    record["attempts"] = job.attempts
    record["duration_s"] = duration
    record["queued_s"] = queued
    try:
        return encode(record), outcome.value
    except (TypeError, ValueError, OverflowError) as exc:
        for name in ("value", "body_started", "attempts", "duration_s", "queued_s"):
            record.pop(name, None)
        record["outcome"] = Outcome.ERROR.value
        record["error"] = f"the tool's value cannot be recorded as JSON: {exc}"
        record["error_name"] = UNRECORDABLE
        record["body_started"] = True
        record["attempts"] = job.attempts
        record["duration_s"] = duration
        record["queued_s"] = queued
        return encode(record), Outcome.ERROR.value


def rejection_record(rejection: Rejection) -> bytes:
    """The record of a rejected input line."""
    record: dict[str, Any] = {"line": rejection.line, "outcome": REJECTED}
    if rejection.id is not None:
        record["input_id"] = rejection.id
    record["error"] = rejection.reason
    return encode(record)


@final
class ResultsFile:
    """The results file, opened for appending and locked (one batch writes it at a time)."""

    def __init__(self, path: str, *, say: Callable[[str], None]) -> None:
        """Open (or create) ``path``, lock it, read what it holds and cut off a torn last
        line (saying so through ``say``). Raises :class:`ResultsFileError`."""
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ResultsFileError(f"cannot open {path}: {exc.strerror}") from None
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ResultsFileError(
                        f"{path} is being written by another toolpool batch"
                    ) from None
                raise
            self.previous = self._read()
            if self.previous.repaired:
                say(
                    f"{path}: its last line was incomplete ({self.previous.repaired} bytes, "
                    "cut short by an interrupted run): removed; that call runs again"
                )
        except BaseException:
            os.close(self._fd)
            raise
        self._unsynced = 0
        self.written = 0
        """Records written by this run."""

    def _read(self) -> Previous:
        previous = Previous()
        end = 0  # offset after the last complete line
        with open(self._fd, "rb", closefd=False) as f:
            f.seek(0)
            for number, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):
                    break  # torn: the last line, cut short
                end += len(raw)
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except ValueError:
                    record = None
                if not isinstance(record, dict) or not isinstance(record.get("outcome"), str):
                    raise ResultsFileError(
                        f"{self.path} line {number} is not a batch record (is it the results "
                        "file of a toolpool batch?)"
                    )
                outcome = record["outcome"]
                if outcome == REJECTED:
                    line, input_id = record.get("line"), record.get("input_id")
                    if isinstance(line, int):
                        previous.rejections.add((line, input_id))
                    continue
                rid = record.get("id")
                if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                    raise ResultsFileError(f"{self.path} line {number}: a record without an id")
                started = record.get("body_started")
                previous.ids[rid] = (outcome, started if isinstance(started, bool) else None)
        size = os.fstat(self._fd).st_size
        if size > end:
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)
            previous.repaired = size - end
        return previous

    def write(self, data: bytes, records: int) -> bool:
        """Write ``records`` records (``data``, whole lines) to the file: once this returns
        they are in the kernel's hands (a SIGKILL of this process loses none). Returns True
        when an fsync is due (:meth:`sync`)."""
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as exc:  # (a full disk, say): the batch stops, what is written stands
            raise ResultsFileError(f"cannot write {self.path}: {exc.strerror}") from None
        self.written += records
        self._unsynced += records
        return self._unsynced >= FSYNC_EVERY

    async def sync(self) -> None:
        """fsync the file, in a thread: writing goes on meanwhile."""
        self._unsynced = 0
        await anyio.to_thread.run_sync(os.fsync, self._fd)

    def close(self) -> None:
        """fsync, unlock and close."""
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1
