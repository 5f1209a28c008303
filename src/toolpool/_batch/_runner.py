"""The batch runner: input lines in, calls through a pool, records out; see docs/batch.md.

One task does the work: it reads lines while fewer than ``window`` calls are in the pool,
waits for the oldest call, and writes the records of every call settled by then. No task per
call: that is what keeps the batch close to the pool's own ``submit`` rate. A call that settles
behind a slow one is picked up within :data:`TICK` seconds (then every call is looked at).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import stat
import sys
import time
from collections import Counter
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Final, Protocol, final

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

from ..core import DEFAULT_GRACES, Graces, Outcome, ToolpoolError, UnknownToolError
from ..sandbox import Profile
from ..supervisor import Call, Group, Pool
from ..supervisor._interrupts import EXIT_INTERRUPTED
from ..supervisor._pool import port_of
from ._input import SKIPPED, Id, Job, PipeLines, Rejection, count_lines, read_jobs
from ._output import ResultsFile, call_record, rejection_record

__all__ = ("EXIT_INTERRUPTED", "TICK", "Batch", "BatchOptions", "Recorder", "Source", "Summary")

#: Seconds between two looks at every call in flight when the oldest is slow.
TICK: Final = 0.05
#: Seconds of calls (at the rate they settle) the batch keeps queued in the pool beyond what
#: its workers hold; at least twice TICK, so that the window grows while a slow call holds
#: the oldest place.
QUEUE_FOR: Final = 0.1
#: The most lines read between two awaits.
READ_AT_ONCE: Final = 1024
#: The most calls the batch keeps in the pool at once (with 10 KiB of args each, 10 MiB).
MAX_WINDOW: Final = 1024
#: Seconds between two measurements of the rate.
RATE_EVERY: Final = 0.2
#: Outcomes a retry is for (issue 18: "retry policy by body_started").
RETRIED: Final = frozenset({Outcome.WORKER_LOST, Outcome.KILLED})
#: Outcomes of a call the interrupt stopped before its body started: not recorded, so that a
#: resumed run makes the call (nothing ran; nothing is lost).
UNSTARTED_BY_STOP: Final = frozenset({Outcome.ABORTED_BEFORE_DISPATCH, Outcome.KILLED})
#: Outcomes of a call the interrupt cut short: with ``rerun_interrupted``, not recorded.
CUT_SHORT_BY_STOP: Final = frozenset(
    {Outcome.ABORTED_BEFORE_DISPATCH, Outcome.ABORTED, Outcome.KILLED}
)


@final
@dataclass(frozen=True, kw_only=True)
class BatchOptions:
    """What ``toolpool batch`` was asked to do."""

    tools: str
    """``module:attribute`` naming the Registry ("" with :attr:`servers`)."""
    input: str
    """The input file: one JSON object per line."""
    output: str
    """The results file (appended to; a second run resumes)."""
    workers: int = 4
    profile: Profile | str = "default"
    timeout: float | None = None
    """Seconds per call, for lines without their own ``timeout``."""
    retries: int = 0
    """Extra runs for a call that ends ``worker_lost`` or ``killed``: always when its body
    never started, with ``idempotent`` also when it did (or may have)."""
    idempotent: bool = False
    rerun: frozenset[str] = frozenset()
    """Outcomes whose records a resumed run forgets, so that their calls run again (where
    a body started, only with ``idempotent``)."""
    cancel_grace: float = DEFAULT_GRACES.cancel
    term_grace: float = DEFAULT_GRACES.term
    servers: tuple[str, ...] = ()
    """MCP endpoints of toolpool services to send the calls to, instead of a pool of this
    process's own; :attr:`workers` is then how many calls are in flight at once."""
    token: str | None = None
    """The bearer token for :attr:`servers`."""
    prefetch: int | None = None
    """``Pool(prefetch=...)``: None, the pool's default."""
    rerun_interrupted: bool = False
    """A call the stop (Ctrl-C, SIGTERM) cut short is not recorded even if its body started
    (it ended ``aborted`` or ``killed``): the next run makes it again. For tools whose result
    is worth nothing unfinished and that may run twice (``toolpool eval``)."""
    allow_background: bool = False
    """Keep processes a call leaves running (``Pool(allow_background=...)``): for tools that
    keep a helper of their own and kill what each call started themselves (``toolpool
    eval``)."""


class Source(Protocol):
    """Where a batch's calls come from (by default, the input file's lines)."""

    def total(self) -> int | None:
        """How many items there are, for the progress bar; None if unknown."""

    def jobs(
        self, *, tools: Mapping[str, object], recorded: Container[Id], default_timeout: float | None
    ) -> Iterator[Job | Rejection | object]:
        """Each item as a :class:`Job`, a :class:`Rejection`, or ``SKIPPED`` (its id is in
        ``recorded``), in order."""

    def close(self) -> None:
        """Release what :meth:`jobs` holds."""


class _InputFile:
    """The input file as a :class:`Source` (docs/batch.md, "Input lines")."""

    def __init__(self, path: str) -> None:
        self._path = path
        self.stream = _open_input(path)
        #: What the lines are read from: the stream, or a thread's reading of it (a pipe).
        self.lines: BinaryIO | PipeLines = self.stream

    def total(self) -> int | None:
        return None if self._path == "-" else count_lines(self._path)

    def jobs(
        self, *, tools: Mapping[str, object], recorded: Container[Id], default_timeout: float | None
    ) -> Iterator[Job | Rejection | object]:
        return read_jobs(
            self.lines, tools=tools, recorded=recorded, default_timeout=default_timeout
        )

    def close(self) -> None:
        if self.stream is not sys.stdin.buffer:
            self.stream.close()


#: Makes the record of a settled call: the line to write, and the outcome it counts as.
Recorder = Callable[[Job, Any], tuple[bytes, str]]


@dataclass
class Summary:
    """What a batch run did (the summary table, and ``--json``)."""

    input: str
    output: str
    total: int | None = None
    """Non-empty lines in the input, when it is a regular file."""
    lines: int = 0
    """Non-empty input lines handled."""
    recorded: Counter[str] = field(default_factory=Counter)
    """Records this run wrote, by outcome (``rejected`` for rejected lines)."""
    skipped: int = 0
    """Lines whose id a previous run recorded."""
    rerun: int = 0
    """Records of earlier runs forgotten by ``--rerun``: their calls run again."""
    rejected_before: int = 0
    """Lines rejected again: an earlier run recorded their rejection (not written twice)."""
    previous: Counter[str] = field(default_factory=Counter)
    """The records of previous runs, by outcome."""
    retries: int = 0
    """Runs beyond the first, over every call."""
    not_recorded: int = 0
    """Calls the interrupt stopped before their body started: left for the next run."""
    in_flight: int = 0
    queued: int = 0
    interrupted: bool = False
    error: str | None = None
    """Why the batch stopped early, when the pool broke."""
    elapsed_s: float = 0.0
    """From the first line read to the last record written."""
    cpu_s: float = 0.0
    """CPU seconds this process (every thread of it) used over :attr:`elapsed_s`."""
    peak_rss_mib: float = 0.0
    """This process's peak resident memory (the supervisor; not the workers)."""

    @property
    def rejected(self) -> int:
        """Lines rejected by this run."""
        return self.recorded["rejected"]

    @property
    def calls_per_s(self) -> float:
        """Calls recorded per second of :attr:`elapsed_s`."""
        calls = sum(self.recorded.values()) - self.rejected
        return calls / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def exit_status(self) -> int:
        """130 interrupted; 0 every record of the results file ``ok`` and no line rejected;
        1 otherwise."""
        if self.interrupted:
            return EXIT_INTERRUPTED
        not_ok = {k: v for k, v in (self.recorded + self.previous).items() if k != "ok"}
        return 1 if not_ok or self.rejected_before or self.error else 0

    def as_json(self) -> dict[str, Any]:
        """The summary as one JSON object."""
        return {
            "input": self.input,
            "output": self.output,
            "total_lines": self.total,
            "lines": self.lines,
            "recorded": dict(self.recorded),
            "rejected": self.rejected,
            "rejected_before": self.rejected_before,
            "skipped": self.skipped,
            "rerun": self.rerun,
            "previous": dict(self.previous),
            "retries": self.retries,
            "not_recorded": self.not_recorded,
            "interrupted": self.interrupted,
            "error": self.error,
            "elapsed_s": round(self.elapsed_s, 3),
            "calls_per_s": round(self.calls_per_s, 1),
            "cpu_s": round(self.cpu_s, 3),
            "peak_rss_mib": round(self.peak_rss_mib, 1),
            "exit_status": self.exit_status,
        }


class Watcher:
    """What the runner tells a progress display (all optional)."""

    def started(self, batch: Batch) -> None:
        """The pool is ready and the first line is about to be read."""

    def refresh(self, batch: Batch) -> None:
        """Called a few times a second while the batch runs."""

    def stopped(self, batch: Batch) -> None:
        """Every call settled; the pool is closing."""


@final
class Batch:
    """One run of ``toolpool batch``: ``await Batch(options).run()`` gives its summary."""

    def __init__(
        self,
        options: BatchOptions,
        *,
        say: Callable[[str], None],
        watcher: Watcher | None = None,
        source: Source | None = None,
        record: Recorder = call_record,
    ) -> None:
        """``source`` replaces the input file (``options.input`` then only names it in the
        summary); ``record`` makes each call's record (:func:`call_record` by default)."""
        if options.retries < 0:
            raise ValueError(f"retries must be 0 or more, got {options.retries}")
        self.options = options
        self.summary = Summary(input=options.input, output=options.output)
        self._say = say
        self._source = source
        self._record = record
        self._watcher = watcher or Watcher()
        self._pool: Pool | None = None
        self._results: ResultsFile | None = None
        self._pipe: PipeLines | None = None
        self._pending: dict[Call, Job] = {}
        self._groups: dict[str, list[Any]] = {}  # name -> [Group, calls of it in flight]
        self._stopping = False
        self._interrupts = 0
        self._syncing: anyio.Event | None = None
        self._out: list[bytes] = []
        self._outcomes: list[str] = []
        self._started_at = 0.0
        self._known_rejections: set[tuple[int, Any]] = set()
        self._timeouts = options.timeout is not None
        """Whether a call with a timeout was submitted (or will be: --timeout)."""

    @property
    def in_window(self) -> int:
        """Calls submitted and not settled yet."""
        return len(self._pending)

    def rate(self) -> float:
        """Calls recorded per second so far."""
        elapsed = time.monotonic() - self._started_at if self._started_at else 0.0
        calls = sum(self.summary.recorded.values()) - self.summary.rejected
        return calls / elapsed if elapsed > 0 else 0.0

    def group(self, name: str) -> Group | None:
        """The pool group the lines with ``"group": name`` share, while one of its calls is
        in flight (a group is dropped when its last call in flight settles)."""
        entry = self._groups.get(name)
        return None if entry is None else entry[0]

    @property
    def pool(self) -> Pool | None:
        """The pool, while it runs."""
        return self._pool

    async def run(self) -> Summary:
        """Run the batch to its end (or its interruption); the summary."""
        options = self.options
        # Everything is checked before the results file is created: a new one only once the
        # pool is up (its tools load); an existing one is read (and --rerun checked) first.
        source = self._source if self._source is not None else _InputFile(options.input)
        try:
            if os.path.lexists(options.output):  # noqa: ASYNC240 (one lstat)
                self._results = self._open_results()
            else:
                _check_creatable(options.output)
            self.summary.total = source.total()
            try:
                failure: list[Exception] = []
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._watch_signals, signals)
                        try:
                            await self._run_pool(source, tg)
                        except Exception as exc:  # kept out of the task group's exception group
                            failure.append(exc)
                        finally:
                            tg.cancel_scope.cancel()
                if failure:
                    raise failure[0]
            finally:
                if self._results is not None:
                    self._results.close()
        finally:
            source.close()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.summary.peak_rss_mib = usage.ru_maxrss / 1024
        self.summary.interrupted = self._interrupts > 0
        return self.summary

    def _open_results(self) -> ResultsFile:
        """Open (or create) the results file; forget the records ``--rerun`` names."""
        results = ResultsFile(self.options.output, say=self._say)
        try:
            rerun = self.options.rerun
            if rerun:
                self.summary.rerun = results.previous.rerun(
                    rerun, idempotent=self.options.idempotent
                )
        except BaseException:
            results.close()
            raise
        self.summary.previous = results.previous.outcomes
        return results

    async def _run_pool(self, source: Source, tg: anyio.abc.TaskGroup) -> None:
        options = self.options
        backend: Any
        if options.servers:
            from ._remote import RemotePool

            backend = RemotePool(options.servers, token=options.token, concurrency=options.workers)
        else:
            backend = Pool(
                options.tools,
                workers=options.workers,
                profile=options.profile,
                cancel_grace=options.cancel_grace,
                term_grace=options.term_grace,
                allow_background=options.allow_background,
                prefetch=options.prefetch,
            )
        async with backend as pool:
            self._pool = pool
            if self._stopping:
                return  # interrupted while the workers started
            if self._results is None:
                self._results = self._open_results()
            results = self._results
            self._known_rejections = results.previous.rejections
            if isinstance(source, _InputFile) and not stat.S_ISREG(
                os.fstat(source.stream.fileno()).st_mode
            ):
                # (A pipe, a terminal: read by a thread, never blocking the event loop.)
                self._pipe = source.lines = PipeLines(source.stream)
                tg.start_soon(self._read_pipe, self._pipe)
            jobs = source.jobs(
                tools=pool.catalog,
                recorded=results.previous.ids,
                default_timeout=options.timeout,
            )
            self._watcher.started(self)
            tg.start_soon(self._refresh)
            self._started_at = time.monotonic()
            cpu = time.process_time()
            try:
                await self._loop(pool, jobs, results, tg)
            finally:
                self.summary.elapsed_s = time.monotonic() - self._started_at
                self.summary.cpu_s = time.process_time() - cpu
                if not self._pending:
                    self.summary.in_flight = self.summary.queued = 0
                self._watcher.stopped(self)

    async def _loop(
        self,
        pool: Pool,
        jobs: Iterator[Job | Rejection | object],
        results: ResultsFile,
        tg: anyio.abc.TaskGroup,
    ) -> None:
        # The window: how many calls the batch keeps in the pool. Calls queued in the pool
        # beyond what the workers hold are what let it send a worker several calls at a time:
        # with no-op calls (bench/batch.py, a loaded machine) 36 in the pool cost 244 us of
        # this process's CPU per call, 576 cost 149-164 us, the pool.submit path 131 us. But
        # a call's timeout counts from its submission: while no line has a timeout, the
        # window is MAX_WINDOW; once one has, it is what every worker runs and holds
        # (Pool(prefetch=...)) plus QUEUE_FOR seconds of calls at the rate they settle.
        base = self.options.workers * (pool.prefetch + 2)
        if self.options.servers:  # (calls in flight over the network: the window is all)
            base = self.options.workers
            self._timeouts = True
        window = base  # (while a timeout is in play)
        pending = self._pending
        summary = self.summary
        more = True
        measured_at = time.monotonic()
        settled_since = 0
        while True:
            # At most READ_AT_ONCE lines between two awaits: lines that make no call
            # (skipped, rejected) must not keep the signals and the progress waiting, nor
            # pile up records unwritten.
            budget = READ_AT_ONCE
            pipe = self._pipe
            while (
                more
                and not self._stopping
                and len(pending) < (window if self._timeouts else MAX_WINDOW)
                and budget
                and (pipe is None or pipe.ready())
            ):
                budget -= 1
                item = next(jobs, None)
                if item is None:
                    more = False
                    break
                summary.lines += 1
                if item is SKIPPED:
                    summary.skipped += 1
                elif type(item) is Job:
                    self._submit(pool, item)
                else:
                    assert isinstance(item, Rejection)
                    self._reject(item)
            if self._out:
                await self._flush(results, tg)
            if not pending:
                if not more or self._stopping:
                    break
                if pipe is not None:
                    await pipe.wait()  # (a line, the end, or a stop: _stop wakes it)
                else:
                    await anyio.lowlevel.checkpoint()
                continue
            head = next(iter(pending))
            everything = False
            if not head.done():
                with anyio.move_on_after(TICK) as scope:
                    await head.wait()
                everything = scope.cancelled_caught
            settled: list[Call] = []
            for call in pending:
                if call.done():
                    settled.append(call)
                elif not everything:
                    break
            for call in settled:
                self._settled(pool, call, pending.pop(call))
            settled_since += len(settled)
            now = time.monotonic()
            if now - measured_at >= RATE_EVERY:
                if self._timeouts and not self.options.servers:
                    rate = settled_since / (now - measured_at)
                    window = max(base, min(MAX_WINDOW, int(rate * QUEUE_FOR)))
                measured_at, settled_since = now, 0
            if self._out:
                await self._flush(results, tg)

    # ------------------------------------------------------------------ calls

    def _submit(self, pool: Pool, job: Job, *, retry_of: Call | None = None) -> bool:
        """Submit ``job``'s next run (``retry_of``: its last one, settled); False if it could
        not be (rejected, or the pool broke)."""
        group: Group | None = None
        if job.group is not None:
            entry = self._groups.get(job.group)
            if entry is None:
                entry = self._groups[job.group] = [pool.group(), 0]
            group = entry[0]
        now = time.monotonic()
        # With --server, a retry goes to a server its last run was not lost with (_remote.py).
        extra: dict[str, Any] = {}
        if retry_of is not None and self.options.servers:
            extra["retry_of"] = retry_of
        try:
            if group is not None:
                call = group.submit(job.tool, job.args, timeout=job.timeout, **extra)
            else:
                call = pool.submit(job.tool, job.args, timeout=job.timeout, **extra)
        except UnknownToolError as exc:
            self._reject(Rejection(job.line, f"line {job.line}: {exc}", job.id))
        except ToolpoolError as exc:  # the pool broke (its workers cannot start)
            if self.summary.error is None:
                self.summary.error = f"{type(exc).__name__}: {exc}"
                self._say(f"the pool broke, stopping: {self.summary.error}")
            self._stopping = True
        except (TypeError, ValueError, OverflowError) as exc:
            self._reject(
                Rejection(job.line, f"line {job.line}: its args cannot be sent: {exc}", job.id)
            )
        else:
            job.attempts += 1
            if job.timeout is not None:
                self._timeouts = True
            if job.first_submitted is None:
                job.first_submitted = now
                if group is not None:
                    self._groups[job.group][1] += 1  # type: ignore[index]
            self._pending[call] = job
            return True
        if group is not None and job.first_submitted is None:
            self._release(job)
        return False

    def _release(self, job: Job) -> None:
        """``job`` is done with its group."""
        if job.group is None:
            return
        entry = self._groups.get(job.group)
        if entry is not None and job.first_submitted is not None:
            entry[1] -= 1
        if entry is not None and entry[1] <= 0:
            del self._groups[job.group]

    def _settled(self, pool: Pool, call: Call, job: Job) -> None:
        try:
            result = call.result()
        except ToolpoolError as exc:  # (remote: no server took the call; it never ran)
            if self.summary.error is None:
                self.summary.error = f"{type(exc).__name__}: {exc}"
                self._say(f"stopping: {self.summary.error}")
            self._stopping = True
            self._release(job)
            self.summary.not_recorded += 1
            return
        outcome = result.outcome
        if (
            outcome in RETRIED
            and not self._stopping
            and job.attempts <= self.options.retries
            and (result.body_started is False or self.options.idempotent)
        ):
            queued, ran = job.queued, job.ran
            job.count_run(result)  # (this run's times count in the record)
            if self._submit(pool, job, retry_of=call):
                self.summary.retries += 1
                return
            job.queued, job.ran = queued, ran  # (the pool broke: this result is the record)
        self._release(job)
        if self._stopping and (
            (outcome in UNSTARTED_BY_STOP and result.body_started is False)
            or (self.options.rerun_interrupted and outcome in CUT_SHORT_BY_STOP)
        ):
            self.summary.not_recorded += 1
            return
        data, recorded = self._record(job, result)
        self._out.append(data)
        self._outcomes.append(recorded)

    def _reject(self, rejection: Rejection) -> None:
        if (rejection.line, rejection.id) in self._known_rejections:
            self.summary.rejected_before += 1  # recorded by an earlier run: not again
            return
        self._out.append(rejection_record(rejection))
        self._outcomes.append("rejected")

    async def _flush(self, results: ResultsFile, tg: anyio.abc.TaskGroup) -> None:
        """Write the records collected; they count as done once written."""
        due = results.write(b"".join(self._out), len(self._out))
        self.summary.recorded.update(self._outcomes)
        self._out.clear()
        self._outcomes.clear()
        if due:
            if self._syncing is not None:
                await self._syncing.wait()  # at most 2 x FSYNC_EVERY records unsynced
            self._syncing = anyio.Event()
            tg.start_soon(self._sync, results, self._syncing)

    @staticmethod
    async def _sync(results: ResultsFile, done: anyio.Event) -> None:
        try:
            await results.sync()
        finally:
            done.set()

    # ------------------------------------------------------------------ interrupts

    async def _watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            self._interrupts += 1
            what = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
            if self._interrupts == 1:
                o = self.options
                self._say(
                    f"{what}: stopping. Every call is cancelled; "
                    f"{Graces(cancel=o.cancel_grace, term=o.term_grace).ladder()}. "
                    "What settles is recorded. Ctrl-C again to kill them now."
                )
                self._stop()
                continue
            running = [c for c in self._pending if not c.done()]
            for call in running:
                call.cancel(force=True)
            calls = "1 call" if len(running) == 1 else f"{len(running)} calls"
            self._say(f"{what} again: killing {calls} now (SIGKILL)")

    def _stop(self) -> None:
        """Stop reading; cancel every call in flight (cause ``user``), group by group."""
        self._stopping = True
        if self._pipe is not None:
            self._pipe.wake()
        pool = self._pool
        # One pump once every call is cancelled: a pump between two groups' cancels reads the
        # sockets, and a worker that a cancel freed could take up a queued call of a group
        # not cancelled yet, start it, and record it cut short (a run seen in tests).
        with port_of(pool).batch() if isinstance(pool, Pool) else contextlib.nullcontext():
            for group, _ in list(self._groups.values()):
                group.cancel()
            for call, job in list(self._pending.items()):
                if job.group is None:
                    call.cancel()

    @staticmethod
    async def _read_pipe(pipe: PipeLines) -> None:
        # (Abandoned when the batch ends first: the thread ends with the input, or the
        # process.)
        await anyio.to_thread.run_sync(pipe.read, abandon_on_cancel=True)

    # ------------------------------------------------------------------ progress

    async def _refresh(self) -> None:
        while True:
            await anyio.sleep(0.25)
            pool = self._pool
            if pool is not None:
                stats = pool.statistics()
                self.summary.in_flight = stats.in_flight
                self.summary.queued = stats.queued
            self._watcher.refresh(self)


def _open_input(path: str) -> BinaryIO:
    """The input, opened for reading (``-``: standard input). A regular file is read in the
    event loop, a line at a time when a call can be submitted (its lines are at hand); any
    other input by a thread (:class:`PipeLines`), so that a silent writer blocks nothing."""
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None


def _check_creatable(path: str) -> None:
    """A results file can be created at ``path`` (its directory is there and writable):
    said before the pool starts, and without creating it."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"cannot create {path}: no directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create {path}: {directory} is not writable")
