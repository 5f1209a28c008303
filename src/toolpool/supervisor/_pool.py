"""The pool: queue, groups, workers, the escalation ladder and truthful settlement (C4, C5, C7).

Bookkeeping is synchronous (``_dispatch``, ``_cancel_call``, ``_settle``, message handling);
the awaits happen in a few small tasks: one reader per worker socket, one ladder per
escalating worker, the reaper's event pump, and the deadline clock.
"""

from __future__ import annotations

import collections
import enum
import functools
import heapq
import hmac
import itertools
import json
import logging
import math
import os
import secrets
import signal
import struct
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Generator, Mapping
from types import MappingProxyType, TracebackType
from typing import Any, Final, Literal, final

import anyio
import anyio.abc
import zmq

from .._transport import fd_of, on_readable, readable
from ..core import (
    ABORT_ERROR_NAME,
    ABORTED_BEFORE_DISPATCH_TEXT,
    CancelCause,
    CancelController,
    CancelSignal,
    ConfigurationError,
    Outcome,
    PoolClosedError,
    UnknownToolError,
    WorkerStartError,
    cancel_with_runtime_cause,
    validate_cause,
)
from ..protocol import (
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    Ack,
    Cancel,
    CancelAck,
    Fatal,
    Hello,
    Pong,
    ProtocolViolation,
    Recall,
    Resume,
    Shutdown,
    Started,
    Withdrawn,
    decode_from_worker,
    encode,
    pack_value,
    unpack_value,
)
from ..protocol import (
    Call as CallMessage,
)
from ..protocol import (
    Result as ResultMessage,
)
from ..protocol._ledger import LEDGER_SIZE, read_ledger, read_marks
from ..reaper import CloseReport, ReaperClient, finish_cleanup
from ..sandbox import LAYERS, Profile, parse_size
from ..sandbox._cgroups import CgroupSet, others_listed
from ..sandbox._profile import _human as _human_size
from ._results import (
    ContainmentReport,
    Layer,
    Result,
    Rung,
    Statistics,
    Timeline,
    WorkerState,
)

__all__ = ("Call", "Group", "Pool")

_log = logging.getLogger("toolpool.supervisor")

_DISPOSED: Final = CancelCause("disposed")
_PARENT: Final = CancelCause("parent")
_NO_CONTEXT: Final[Mapping[str, Any]] = MappingProxyType({})  # read-only: one serves all
_TIMEOUT: Final = CancelCause("timeout")
_RUNG_ORDER: Final = {Rung.NONE: 0, Rung.CANCEL: 1, Rung.SIGTERM: 2, Rung.SIGKILL: 3}
WORKER_LOST_TEXT: Final = "Error: worker lost"
KILLED_TEXT: Final = "Error: tool call killed"
TIMEOUT_TEXT: Final = "Error: tool call timed out"

WorkerOutput = Literal["discard", "inherit"]
StartMethod = Literal["fork", "spawn"]
#: Calls a busy worker may hold queued (``Pool(prefetch=None)``), but see there.
DEFAULT_PREFETCH: Final = 16
#: A call is sent to wait behind another in a busy worker only while the call first in line
#: there has been so for less than this (seconds); calls waiting behind one that has taken
#: longer are taken back to the front of the pool's queue at the next dispatch.
QUEUE_BEHIND_FOR: Final = 0.005
#: The worker's exit status after it sent 'fatal' (see worker/_main.py).
EXIT_TOOLS_FAILED: Final = 71


class _CallState(enum.Enum):
    QUEUED = "queued"
    SENT = "sent"
    RUNNING = "running"
    SETTLED = "settled"


# --------------------------------------------------------------------------- calls


@final
class Call:
    """A submitted call. ``await call`` gives its :class:`Result`; ``call.cancel()`` stops it.

    Created by :meth:`Pool.submit` and :meth:`Group.submit` only.
    """

    __slots__ = (
        "_args",
        "_cause",
        "_deadline",
        "_event",
        "_forced",
        "_group",
        "_laddering",
        "_pool",
        "_recalling",
        "_requeued",
        "_result",
        "_rung",
        "_started",
        "_started_event",
        "_state",
        "_times",
        "_worker",
        "id",
        "tool",
    )

    def __init__(
        self, pool: Pool, call_id: int, tool: str, args: bytes, group: Group | None
    ) -> None:
        self._pool = pool
        self.id = call_id
        """The pool-wide call id."""
        self.tool = tool
        """The tool's name."""
        self._args = args
        self._group = group
        self._state = _CallState.QUEUED
        self._worker: _Worker | None = None
        self._cause: CancelCause | None = None
        self._rung = Rung.NONE
        self._started = False
        self._started_event: anyio.Event | None = None
        self._result: Result | None = None
        self._event: anyio.Event | None = None
        self._deadline: float | None = None
        self._laddering = False
        self._forced = False
        self._recalling = False  # a recall (or the worker's shutdown) may withdraw it
        self._requeued = False  # run elsewhere once, first in line in a worker that died
        self._times: dict[str, float] = {"submitted": time.monotonic()}

    def cancel(self, cause: object = None, *, force: bool = False) -> None:
        """Cancel the call. ``cause`` is None (``{"kind": "user"}``) or ``{"kind": "parent"}``.

        Validated strictly, even when the call has already settled. A queued call settles at
        once as ``aborted_before_dispatch``; a running one gets a cooperative cancel message,
        then escalation per the pool's grace periods. ``force=True`` goes straight to SIGKILL
        of the worker's process tree. The first cause wins.
        """
        accepted = validate_cause(cause)
        self._pool._cancel_call(self, accepted, force=force)

    def done(self) -> bool:
        """True once the call has settled."""
        return self._result is not None

    def result(self) -> Result:
        """The settled result; raises :class:`RuntimeError` if the call has not settled."""
        if self._result is None:
            raise RuntimeError("the call has not settled yet; await it")
        return self._result

    async def wait(self) -> Result:
        """Wait until the call settles and return its result.

        If the waiting task is cancelled the call is not: cancel it explicitly, or use
        :meth:`Pool.call`, which does so with cause ``parent``.
        """
        if self._result is None:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        assert self._result is not None
        return self._result

    async def wait_started(self) -> bool:
        """Wait until the worker reports the body started, or the call settled first.

        Returns True if the body started (it may have finished since), False if the call
        settled without its body starting (or without the start being known, for a worker
        that died without a ledger). A worker reports the start of an async body at once,
        and that of a sync body once it has run for about 0.2 ms (a quicker body's result
        says it started).
        """
        if not self._started and self._result is None:
            if self._started_event is None:
                self._started_event = anyio.Event()
            await self._started_event.wait()
        return self._started

    @property
    def started(self) -> bool:
        """True once the worker reported that the body was invoked (see :meth:`wait_started`)."""
        return self._started

    def __await__(self) -> Generator[Any, None, Result]:
        return self.wait().__await__()

    def __repr__(self) -> str:
        state = self._result.outcome.value if self._result else self._state.value
        return f"<toolpool.Call {self.id} {self.tool!r} {state}>"


# --------------------------------------------------------------------------- groups


@final
class Group:
    """A turn: one cancel controller covering every call made in it (CONTRACT C5).

    Use ``async with pool.group() as turn:``. Leaving the block normally waits until every
    call of the group settled; leaving it by an exception or cancellation cancels the group
    with cause ``parent`` (the calls are still tracked to settlement by the pool).
    """

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._controller = CancelController()
        self._calls: set[Call] = set()
        self._controller.signal.add_callback(self._on_cancel)

    @property
    def signal(self) -> CancelSignal:
        """The group's cancel signal (read-only)."""
        return self._controller.signal

    @property
    def cancelled(self) -> bool:
        """True once the group was cancelled."""
        return self._controller.signal.cancelled

    def submit(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Call:
        """Submit a call in this group; after a cancel it settles at once as
        ``aborted_before_dispatch``."""
        return self._pool._submit(tool, args, timeout=timeout, group=self)

    async def call(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Result:
        """Submit in this group and wait; see :meth:`Pool.call`."""
        return await _await_call(self.submit(tool, args, timeout=timeout))

    def cancel(self, cause: object = None) -> bool:
        """Cancel every call of the group, queued or running. The first request wins."""
        return self._controller.cancel(cause)

    def _on_cancel(self, cause: CancelCause) -> None:
        # Queued calls first: cancelling a running one can settle it at once (its worker
        # answered already), which frees the worker for the next queued call.
        for call in sorted(self._calls, key=lambda c: c._state is not _CallState.QUEUED):
            self._pool._cancel_call(call, cause, force=False)

    async def wait(self) -> None:
        """Wait until every call submitted so far has settled."""
        while self._calls:
            await next(iter(self._calls)).wait()

    async def __aenter__(self) -> Group:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            if not self.cancelled:
                cancel_with_runtime_cause(self._controller, _PARENT)
            return
        await self.wait()


async def _await_call(call: Call) -> Result:
    try:
        return await call.wait()
    except anyio.get_cancelled_exc_class():
        # C4.5: the cancellation reaches the caller at once; the call is not abandoned.
        call._pool._cancel_call(call, _PARENT, force=False)
        raise


# --------------------------------------------------------------------------- workers


class _Worker:
    __slots__ = (
        "acks_expected",
        "awaiting_fatal",
        "calls",
        "catalog",
        "disconnected",
        "draining",
        "endpoint",
        "escalated",
        "exit_status",
        "fatal",
        "gone",
        "gone_deferred",
        "gone_event",
        "head_since",
        "hello_event",
        "holding",
        "ledger_fd",
        "members_fd",
        "members_file",
        "oom_kills",
        "peak_fd",
        "peer_pid",
        "pending",
        "pid",
        "results",
        "scopes",
        "secret",
        "signals",
        "sock",
        "start_failed",
        "start_method",
        "state",
        "violated",
        "violation",
        "wid",
    )

    def __init__(self, wid: int, endpoint: str, sock: zmq.Socket[bytes], secret: bytes) -> None:
        self.wid = wid
        self.endpoint = endpoint
        self.sock = sock
        self.secret = secret
        self.state = WorkerState.SPAWNING
        self.pid: int | None = None
        self.start_method: str | None = None  # how the reaper started it, once it said
        # Its calls in the order sent: the first runs (or is next), the rest wait in its queue.
        self.calls: collections.deque[Call] = collections.deque()
        self.head_since = 0.0  # when the first of them became first (time.monotonic())
        self.holding = False  # its last call left processes behind: it waits for 'resume'
        self.results = 0  # results received from it (found in its ledger, too)
        self.ledger_fd: int | None = None  # its ledger file, read with pread
        self.signals: dict[str, float] = {}  # "sigterm"/"sigkill": when its tree first got it
        self.acks_expected: set[int] = set()  # calls it was sent a cancel for, not yet acked
        self.members_file: str | None = None  # its cgroup's cgroup.procs: who is in its tree
        self.members_fd: int | None = None  # the same, kept open (v2: pread re-reads it)
        self.catalog: dict[str, dict[str, Any]] = {}
        self.exit_status: int | None = None
        self.fatal: str | None = None
        self.violation: str | None = None
        self.violated = False  # quarantined for breaking the protocol: its word counts no more
        self.start_failed = False
        self.gone = False
        self.gone_event = anyio.Event()
        self.hello_event = anyio.Event()
        self.scopes: list[anyio.CancelScope] = []
        self.disconnected = False
        self.draining = False
        self.escalated = False
        self.awaiting_fatal = False
        self.gone_deferred = False  # its tree is gone, handled once its 'fatal' is read
        self.peak_fd: int | None = None  # its cgroup's peak memory file, kept open
        self.peer_pid: int | None = None  # who sent its first message (SO_PEERCRED)
        self.oom_kills = 0  # OOM kills in its memory cgroup, as the reaper read them at exit
        self.pending: Callable[..., None] | None = None

    @property
    def call(self) -> Call | None:
        """The call it runs, or takes up next."""
        return self.calls[0] if self.calls else None

    def __repr__(self) -> str:
        return f"<worker {self.wid} pid={self.pid} {self.state.value}>"


# --------------------------------------------------------------------------- the pool


@final
class Pool:
    """A pool of worker processes running the tools of one registry.

    ``tools`` is ``"module:attribute"`` naming a :class:`toolpool.Registry` importable in the
    workers (they see this process's ``sys.path``).

    >>> async with toolpool.Pool("mytools:registry", workers=4) as pool:  # doctest: +SKIP
    ...     result = await pool.call("nap", {"seconds": 1.5}, timeout=30)
    """

    def __init__(
        self,
        tools: str,
        *,
        workers: int = 4,
        cancel_grace: float = 5.0,
        term_grace: float = 2.0,
        start_timeout: float = 30.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_start_failures: int = 3,
        worker_output: WorkerOutput = "discard",
        env: Mapping[str, str] | None = None,
        profile: Profile | str = "default",
        allow_background: bool = False,
        capture_output: int | str | None = None,
        warm_spares: int = 0,
        start_method: StartMethod = "fork",
        prefetch: int | None = None,
    ) -> None:
        """
        :param tools: ``"module:attribute"`` naming the Registry.
        :param workers: how many worker processes (each runs one call at a time).
        :param cancel_grace: seconds a cancelled call has to stop cooperatively before SIGTERM.
        :param term_grace: seconds after SIGTERM before SIGKILL of the whole tree.
        :param start_timeout: seconds a worker has to import the tools and say hello.
        :param max_frame: the largest message, in bytes, in either direction.
        :param max_start_failures: consecutive start failures before the pool stops respawning.
        :param worker_output: ``"discard"`` (default) or ``"inherit"`` the workers'
            stdout/stderr. Discarded output can never block a worker.
        :param env: the workers' environment (default: this process's, plus ``PYTHONPATH``).
        :param profile: the containment profile, a :class:`toolpool.Profile` or its name
            (``"default"``, ``"untrusted"``); see ``docs/security.md``.
        :param allow_background: keep processes a call leaves running when its body returns.
            By default they are killed before the worker takes its next call.
        :param capture_output: capture what tools (and their children) write to stdout and
            stderr, keeping at most this many bytes per call (``Result.output``); e.g.
            ``"64KiB"``. None (default) discards output, unless ``worker_output="inherit"``.
        :param warm_spares: extra worker processes kept started and idle: at most ``workers``
            calls run at once, and when a worker is killed or lost a spare serves the next call
            at once (no interpreter start-up on that path) while a new spare starts.
        :param start_method: ``"fork"`` (default): the reaper imports the worker's modules
            once and forks each worker from itself, which then sets itself up exactly like a
            spawned one; ``"spawn"``: each worker is a new ``python -m toolpool.worker``.
            Where forking is not possible the reaper spawns (see ``docs/pool.md``).
        :param prefetch: when every worker is busy, how many more calls each may hold in its
            queue, to take up the moment its running call ends (no round trip in between).
            A queued call is never lost or half-run: if its worker dies, or is killed for
            another call, it runs elsewhere; a cancel withdraws it; an idle worker takes
            queued calls back from a busy one; calls queued behind a call that has run for
            5 ms go back to the pool's queue. 0 sends a call only to an idle worker. None
            (default): 16, or 0 with a profile that runs workers under another uid (as
            ``untrusted`` does): there the supervisor then looks for leftover processes
            itself after every call, which it cannot while another call is already queued
            in the worker (``docs/pool.md``).
        """
        if not isinstance(tools, str) or ":" not in tools:
            raise ConfigurationError(f"tools must be 'module:attribute', got {tools!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        for name, value in (
            ("cancel_grace", cancel_grace),
            ("term_grace", term_grace),
            ("start_timeout", start_timeout),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ValueError(f"{name} must be a non-negative number of seconds")
        if worker_output not in ("discard", "inherit"):
            raise ValueError("worker_output must be 'discard' or 'inherit'")
        if not isinstance(max_frame, int) or max_frame < 1024:
            raise ValueError("max_frame must be an integer of at least 1024 bytes")
        self.tools_spec = tools
        self.size = workers
        self.cancel_grace = float(cancel_grace)
        self.term_grace = float(term_grace)
        self.start_timeout = float(start_timeout)
        self.max_frame = max_frame
        self.max_start_failures = max_start_failures
        self.worker_output: WorkerOutput = worker_output
        self._env = dict(env) if env is not None else None
        if isinstance(profile, str):
            profile = Profile.named(profile)
        if not isinstance(profile, Profile):
            raise TypeError(f"profile must be a toolpool.Profile or a name, not {profile!r}")
        self.profile = profile
        self.allow_background = bool(allow_background)
        if isinstance(warm_spares, bool) or not isinstance(warm_spares, int) or warm_spares < 0:
            raise ValueError(f"warm_spares must be a non-negative integer, got {warm_spares!r}")
        self.warm_spares = warm_spares
        if start_method not in ("fork", "spawn"):
            raise ValueError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")
        self.start_method: StartMethod = start_method
        if prefetch is None:
            prefetch = 0 if profile.user is not None else DEFAULT_PREFETCH
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
        self.prefetch = prefetch
        self.capture_output = parse_size(capture_output)
        if self.capture_output is not None and self.capture_output > max_frame // 2:
            raise ValueError("capture_output must be at most half of max_frame")
        self._cgroups: CgroupSet | None = None
        self._supervisor_layers: dict[str, tuple[bool, str]] = {}
        self._worker_layers: dict[str, list[Any]] | None = None

        self._state: Literal["new", "starting", "running", "closing", "closed"] = "new"
        self._tg: anyio.abc.TaskGroup | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._dir: str | None = None
        self._reaper: ReaperClient | None = None
        self._close_report = CloseReport()
        self._workers: dict[int, _Worker] = {}
        self._ready: list[_Worker] = []
        self._queue: collections.deque[Call] = collections.deque()
        self._draining = 0  # how many _drain calls are on the stack
        self._dispatching = False  # _dispatch is on the stack
        self._dispatch_due = False  # _dispatch was asked for meanwhile: it runs once more
        self._calls: dict[int, Call] = {}
        self._groups: weakref.WeakSet[Group] = weakref.WeakSet()
        self._catalog: dict[str, dict[str, Any]] = {}
        self._threaded: set[str] = set()  # tools whose bodies run in a thread (see _pick)
        self._wids = itertools.count(1)
        self._call_ids = itertools.count(1)
        # (when, call id): by id, so that a call settled before its deadline (and its result)
        # is not kept alive until then.
        self._deadlines: list[tuple[float, int]] = []
        self._deadline_wake: anyio.Event | None = None
        self._start_failures = 0
        self._broken: WorkerStartError | None = None
        self._fork_warned = False
        self._closed_event: anyio.Event | None = None
        self._workers_changed: anyio.Event | None = None
        # statistics
        self._settled_counts: collections.Counter[str] = collections.Counter()
        self._escalations: collections.Counter[str] = collections.Counter()
        self._submitted = 0
        self._started_count = 0
        self._replaced = 0

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Pool:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the reaper and the workers; returns when every worker is ready.

        Raises :class:`toolpool.WorkerStartError` (with the worker's traceback) if the tools
        cannot be loaded.
        """
        if self._state != "new":
            raise RuntimeError("a pool can be started once")
        self._state = "starting"
        self._closed_event = anyio.Event()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            self._dir = tempfile.mkdtemp(prefix="toolpool-")
            # Workers running as other uids must reach their own socket file (theirs, 0600
            # once they own it) by name; nobody but the supervisor can list the directory.
            os.chmod(self._dir, 0o700 if self.profile.user is None else 0o711)
            self._ctx = zmq.Context(io_threads=1)
            self._reaper = ReaperClient(self._on_reaper_event)
            await self._reaper.start(self.start_timeout)
            if self.start_method == "fork":  # the reaper imports while we set up containment
                paths = self._worker_env(None)["PYTHONPATH"].split(os.pathsep)
                self._reaper.preload(paths)
            self._setup_containment()
            self._tg.start_soon(self._reaper.run)
            self._tg.start_soon(self._deadline_clock)
            for _ in range(self.size + self.warm_spares):
                self._spawn()
            with anyio.fail_after(self.start_timeout + 5):
                while True:
                    if self._broken is not None:
                        raise self._broken
                    # Ready: it said hello, and the reaper said how it started it (the two
                    # can come in either order).
                    ready = (
                        w
                        for w in self._workers.values()
                        if w.state is WorkerState.READY and w.start_method is not None
                    )
                    if sum(1 for _ in ready) >= self.size + self.warm_spares:
                        break
                    await self._wait_workers_changed()
        except BaseException as exc:
            self._state = "closing"
            with anyio.CancelScope(shield=True):
                await self._teardown()
            await self._exit_task_group()
            if isinstance(exc, TimeoutError):
                raise WorkerStartError("workers did not become ready in time") from None
            raise
        self._state = "running"

    async def aclose(self) -> CloseReport:
        """Cancel every call with cause ``disposed`` and stop every worker (CONTRACT C5.3).

        Returns only when every call has settled and every worker process, and everything
        it spawned, is gone. Idempotent. Returns what is left on disk: a
        :class:`toolpool.CloseReport` (a huge scratch tree is removed in the background).

        Call it from the task and the cancel-scope nesting that called :meth:`start` (not,
        say, inside a ``fail_after`` entered after ``start()``): the pool's anyio task group
        must be left in order. Otherwise anyio raises RuntimeError, after every call has
        settled and every process is gone. ``async with Pool(...)`` gets this right.
        """
        if self._state in ("closed", "new"):
            self._state = "closed"
            return self._close_report
        if self._state == "closing":
            assert self._closed_event is not None
            await self._closed_event.wait()
            return self._close_report
        self._state = "closing"
        with anyio.CancelScope(shield=True):
            for group in list(self._groups):
                cancel_with_runtime_cause(group._controller, _DISPOSED)
            for call in list(self._calls.values()):
                self._cancel_call(call, _DISPOSED, force=False)
            while self._calls:
                await next(iter(self._calls.values())).wait()
            await self._teardown()
        await self._exit_task_group()
        return self._close_report

    async def _exit_task_group(self) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        self._state = "closed"
        if self._closed_event is not None:
            self._closed_event.set()

    async def _teardown(self) -> None:
        # Workers: idle ones exit on Shutdown; anything left after term_grace is killed.
        for w in list(self._workers.values()):
            if w.state is WorkerState.READY and not w.gone:
                self._retire(w)
            # A spawning worker is retired when its hello arrives (see _on_message).
        with anyio.move_on_after(self.term_grace):
            await self._wait_all_gone()
        for w in list(self._workers.values()):
            if not w.gone and self._reaper is not None:
                self._reaper.kill_tree(w.wid)
        with anyio.move_on_after(30):
            await self._wait_all_gone()
        if self._reaper is not None:
            await self._reaper.aclose()
        for w in list(self._workers.values()):
            self._close_worker(w)
            if w.ledger_fd is not None:
                os.close(w.ledger_fd)
                w.ledger_fd = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        if self._cgroups is not None:
            self._cgroups.remove()
            self._cgroups = None
        if self._dir is not None:
            self._close_report = await finish_cleanup(self._dir, self._reaper)
            self._dir = None

    def _setup_containment(self) -> None:
        """Detect and prepare the supervisor-side layers; refuse to start without required
        ones."""
        profile = self.profile
        layers = self._supervisor_layers
        layers["session"] = (True, "each worker leads its own session and process group")
        reaper = self._reaper
        assert reaper is not None
        layers["subreaper"] = (
            (True, "workers and the reaper are child subreapers: daemons stay in the tree")
            if reaper.subreaper
            else (False, "PR_SET_CHILD_SUBREAPER is not available")
        )
        try:
            os.close(os.pidfd_open(os.getpid()))
            layers["pidfd"] = (True, "process deaths are awaited without polling")
        except (AttributeError, OSError) as exc:
            layers["pidfd"] = (False, f"pidfd_open: {exc}")
        if "cgroups" in profile.disable:
            cg = CgroupSet(
                reasons=dict.fromkeys(("v2", "memory", "pids"), "disabled by the profile")
            )
        else:
            cg = CgroupSet.create(
                f"toolpool-{os.getpid()}-{id(self):x}",
                memory=profile.memory is not None,
                pids=profile.max_processes is not None,
            )
        self._cgroups = cg
        assert self._dir is not None
        reaper.own([self._dir, *sorted(set(cg.base.values()))])
        layers["cgroup_kill"] = (
            (True, f"cgroup v2 per worker, cgroup.kill + populated 0 ({cg.base['v2']})")
            if "v2" in cg.base
            else (False, f"cgroup v2: {cg.reasons.get('v2', 'unavailable')}")
        )
        for name, hierarchy, wanted in (
            ("cgroup_memory", "memory", profile.memory),
            ("cgroup_pids", "pids", profile.max_processes),
        ):
            if wanted is None:
                layers[name] = (False, "no limit requested by the profile")
            elif hierarchy in cg.base:
                shown = _human_size(wanted) if name == "cgroup_memory" else str(wanted)
                layers[name] = (True, f"limit {shown} per worker tree ({cg.base[hierarchy]})")
            else:
                layers[name] = (False, cg.reasons.get(hierarchy, "unavailable"))
        layers["scratch_dir"] = (
            (True, "a private working directory per worker, removed when it is gone")
            if profile.scratch_dir
            else (False, "not requested by the profile")
        )
        layers["env_allowlist"] = (
            (True, f"only {', '.join(profile.env_allowlist or ())} (+ toolpool's own)")
            if profile.env_allowlist is not None
            else (False, "workers inherit the supervisor's environment")
        )
        missing = [
            f"{name}: {layers[name][1]}"
            for name in sorted(profile.require)
            if name in layers and not layers[name][0]
        ]
        if missing:
            raise WorkerStartError(
                "the profile requires containment layers this machine lacks: " + "; ".join(missing)
            )

    def _warn_inactive_layers(self) -> None:
        """Say once, loudly, which layers the profile asked for that workers could not apply."""
        profile = self.profile
        asked = {
            "netns": not profile.network,
            "ipcns": profile.private_ipc,
            "readonly_fs": profile.readonly_fs,
            "landlock": profile.landlock,
            "uid": profile.user is not None,
        }
        for layer in self.containment().layers:
            if asked.get(layer.name) and not layer.active:
                _log.warning(
                    "profile %r asks for %s, which is not active: %s",
                    profile.name,
                    layer.name,
                    layer.detail,
                )

    def containment(self) -> ContainmentReport:
        """What protects this pool's workers, layer by layer: active or not, and why.

        Worker-side layers (rlimits, network namespace) are as the first worker reported them.
        """
        merged: dict[str, tuple[bool, str]] = dict(self._supervisor_layers)
        worker = self._worker_layers or {}
        if "rlimits" in worker:
            merged["rlimits"] = (bool(worker["rlimits"][0]), str(worker["rlimits"][1]))
        if self.profile.network:
            merged["netns"] = (False, "network allowed by the profile")
        elif "netns" in worker:
            merged["netns"] = (bool(worker["netns"][0]), str(worker["netns"][1]))
        requested = (
            ("ipcns", self.profile.private_ipc),
            ("readonly_fs", self.profile.readonly_fs),
            ("landlock", self.profile.landlock),
            ("uid", self.profile.user),
        )
        for layer, wanted in requested:
            if wanted is None or wanted is False:
                merged[layer] = (False, "not requested by the profile")
            elif layer in worker:
                merged[layer] = (bool(worker[layer][0]), str(worker[layer][1]))
        if "cgroups_joined" in worker and not worker["cgroups_joined"][0]:
            for name in ("cgroup_kill", "cgroup_memory", "cgroup_pids"):
                if merged.get(name, (False, ""))[0]:
                    merged[name] = (False, f"worker could not join: {worker['cgroups_joined'][1]}")
        order = {name: i for i, name in enumerate(LAYERS)}
        layers = tuple(
            Layer(name, active, detail)
            for name, (active, detail) in sorted(
                merged.items(), key=lambda kv: order.get(kv[0], 99)
            )
        )
        return ContainmentReport(self.profile.name, self.profile.describe(), layers)

    async def _wait_all_gone(self) -> None:
        while any(not w.gone for w in self._workers.values()):
            await self._wait_workers_changed()

    async def _wait_workers_changed(self) -> None:
        if self._workers_changed is None:
            self._workers_changed = anyio.Event()
        await self._workers_changed.wait()

    def _notify_workers_changed(self) -> None:
        if self._workers_changed is not None:
            self._workers_changed.set()
            self._workers_changed = None

    # ------------------------------------------------------------------ public API

    def submit(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Call:
        """Queue a call and return its :class:`Call` at once.

        Raises :class:`toolpool.UnknownToolError` if no worker provides ``tool``,
        :class:`toolpool.PoolClosedError` if the pool is closing, and :class:`TypeError` if
        ``args`` cannot be serialized. ``timeout`` (seconds from now) cancels the call with
        cause ``timeout`` when it expires, escalating like any cancel.
        """
        return self._submit(tool, args, timeout=timeout, group=None)

    async def call(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Result:
        """Submit a call and wait for its result.

        If the awaiting task is cancelled, the cancellation reaches it at once; the call gets a
        cooperative cancel with cause ``parent``, escalates per policy and is tracked until it
        settles (CONTRACT C4.5).
        """
        return await _await_call(self.submit(tool, args, timeout=timeout))

    def group(self) -> Group:
        """A new group (turn) with a fresh cancel signal (CONTRACT C5)."""
        self._check_open()
        group = Group(self)
        self._groups.add(group)
        return group

    @property
    def catalog(self) -> Mapping[str, Mapping[str, Any]]:
        """The tools the ready workers provide, by name: JSON-compatible descriptions."""
        return MappingProxyType(self._catalog)

    @property
    def reaper_pid(self) -> int | None:
        """The pid of the pool's reaper process (every worker is its child)."""
        return self._reaper.pid if self._reaper else None

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes that are alive now."""
        return [w.pid for w in self._workers.values() if w.pid is not None and not w.gone]

    def worker_start_methods(self) -> dict[int, str]:
        """How each live worker was started, by pid: ``"fork"`` (from the reaper's template)
        or ``"spawn"`` (a new interpreter). A worker the reaper has not reported yet (a
        replacement, a moment after it started) is not listed."""
        return {
            w.pid: w.start_method
            for w in self._workers.values()
            if w.pid is not None and w.start_method is not None and not w.gone
        }

    async def wait_idle(self) -> None:
        """Wait until no call is queued or running."""
        while self._calls:
            await next(iter(self._calls.values())).wait()

    def statistics(self) -> Statistics:
        """A frozen snapshot of the pool."""
        states = collections.Counter(w.state.value for w in self._workers.values())
        running = sum(1 for w in self._workers.values() if w.calls)
        return Statistics(
            workers=MappingProxyType(dict(states)),
            queued=len(self._calls) - running,
            in_flight=running,
            settled=MappingProxyType(dict(self._settled_counts)),
            escalations=MappingProxyType(dict(self._escalations)),
            workers_started=self._started_count,
            workers_replaced=self._replaced,
            submitted=self._submitted,
        )

    # ------------------------------------------------------------------ submission

    def _check_open(self) -> None:
        if self._state in ("closing", "closed"):
            raise PoolClosedError("the pool is closed")
        if self._state == "new":
            raise PoolClosedError("the pool is not started: use 'async with Pool(...)'")
        if self._broken is not None:
            raise self._broken

    def _submit(
        self,
        tool: str,
        args: Mapping[str, Any] | None,
        *,
        timeout: float | None,
        group: Group | None,
    ) -> Call:
        self._check_open()
        if not isinstance(tool, str):
            raise TypeError(f"a tool name is a str, not {type(tool).__name__}")
        if tool not in self._catalog:
            raise UnknownToolError(
                f"no worker provides a tool named {tool!r}; known: {sorted(self._catalog)}"
            )
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise TypeError(f"args must be a mapping, not {type(args).__name__}")
        packed = pack_value(dict(args), "args")
        if len(packed) > self.max_frame - 1024:
            raise ValueError(f"args of {len(packed)} bytes exceed max_frame={self.max_frame}")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        call = Call(self, next(self._call_ids), tool, packed, group)
        self._submitted += 1
        self._calls[call.id] = call
        if group is not None:
            group._calls.add(call)
            if group.cancelled:
                self._cancel_call(call, group.signal.reason or _PARENT, force=False)
                return call
        if timeout is not None:
            self._add_deadline(call, call._times["submitted"] + timeout)
        self._queue.append(call)
        self._dispatch()
        return call

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self) -> None:
        """Send queued calls to the workers that may take them."""
        if self._draining or self._dispatching:
            # Once the messages read so far are handled: the calls their results freed room
            # for then go in one message per worker, not one each. (Never nested: a worker
            # that answers at once costs a loop turn here, not a stack frame.)
            self._dispatch_due = True
            return
        self._dispatching = True
        try:
            self._dispatch_due = True
            while self._dispatch_due:
                self._dispatch_due = False
                self._dispatch_once()
        finally:
            self._dispatching = False

    def _dispatch_once(self) -> None:
        if self._state in ("closing", "closed"):
            return  # what is still queued settles as aborted_before_dispatch (disposed)
        queue = self._queue
        batches: dict[_Worker, list[Call]] = {}
        now = time.monotonic()
        while queue:
            w = self._pick(now)
            if w is None:
                break
            call = queue.popleft()
            if call._state is not _CallState.QUEUED:
                continue
            group = call._group
            if group is not None and group.cancelled:  # C5.2: never dispatched after its cancel
                self._cancel_call(call, group.signal.reason or _PARENT, force=False)
                continue
            if not w.calls:
                if w in self._ready:
                    self._ready.remove(w)
                w.head_since = now
                w.state = WorkerState.BUSY
                _reset_peak(w)  # the call's peak starts now
            w.calls.append(call)
            call._worker = w
            call._state = _CallState.SENT
            batches.setdefault(w, []).append(call)
        if batches:
            self._send_calls(batches)
        self._steal(now)

    def _send_calls(self, batches: dict[_Worker, list[Call]]) -> None:
        """Send each worker its new calls as one multipart message: one wake-up of zmq's
        I/O thread for all of them (each part is one ``call`` frame to the worker)."""
        now = time.monotonic()
        for w, calls in batches.items():
            frames = [encode(CallMessage(c.id, c.tool, c._args, w.results)) for c in calls]
            for call in calls:
                call._times["dispatched"] = now
            sent = False
            if not w.gone and not w.sock.closed:
                try:
                    w.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    sent = True
                except zmq.ZMQError:
                    pass
            if not sent:
                # Not handed over: no body can have started. Put them back and retire w:
                # its peer is gone (it died, or is dying of what it runs), not misbehaving.
                for call in reversed(calls):
                    w.calls.remove(call)
                    self._requeue(call)
                _log.info("worker %s: its socket refused a call; retiring it", w.wid)
                self._quarantine(w, None)
        for w in batches:  # sending may consume the edge of zmq's notification fd (_send)
            if not w.draining and not w.sock.closed and readable(w.sock):
                self._drain(w)

    def _pick(self, now: float) -> _Worker | None:
        """The worker for the next queued call: an idle one (within the warm-spare limit),
        else the busy one with the fewest calls that may queue one more (``prefetch``)."""
        ready = self._ready
        while ready and not (self.warm_spares and self._serving() >= self.size):
            w = ready[-1]
            if w.state is WorkerState.READY and not w.gone and not w.calls:
                return w
            ready.pop()
        if not self.prefetch:
            return None
        best: _Worker | None = None
        limit = self.prefetch + 1
        threaded = self._threaded
        for w in self._workers.values():
            n = len(w.calls)
            if (
                0 < n < limit
                and w.state is WorkerState.BUSY
                and not w.gone
                and (best is None or n < len(best.calls))
                # Only behind bodies that leave the worker's loop free to withdraw it: an
                # async body can hold the loop (and the queue) for as long as it runs. (The
                # last one is enough: a call joins only a queue of such bodies.)
                and w.calls[-1].tool in threaded
                # Not behind a call being cancelled: its worker may be killed for it.
                and w.calls[0]._cause is None
                # Not behind one that already takes long (the rest would wait as long).
                and now - w.head_since < QUEUE_BEHIND_FOR
            ):
                best = w
        return best

    def _steal(self, now: float) -> None:
        """Take back calls waiting in busy workers' queues: all of those waiting behind a
        call that has been first in line for ``QUEUE_BEHIND_FOR`` or longer (they go to the
        front of the pool's queue); and while nothing is queued here but a worker is idle,
        as many as there are idle workers, to run on them."""
        if not self.prefetch:
            return
        idle = len(self._ready)
        if self._queue or (self.warm_spares and self._serving() >= self.size):
            idle = 0
        for w in list(self._workers.values()):
            if len(w.calls) < 2 or w.state is not WorkerState.BUSY:
                continue
            stuck = now - w.head_since >= QUEUE_BEHIND_FOR
            if not stuck and idle <= 0:
                continue
            for call in list(w.calls)[:0:-1]:  # newest first, never the one it runs
                if stuck:
                    self._recall(w, call)
                elif idle <= 0:
                    break
                elif self._recall(w, call):
                    idle -= 1

    def _requeue(self, call: Call) -> None:
        """A call its worker never took up goes back to the front of the queue."""
        call._worker = None
        call._state = _CallState.QUEUED
        call._recalling = False
        call._rung = Rung.NONE
        for step in ("dispatched", "sigterm", "sigkill"):
            call._times.pop(step, None)
        if self._state in ("closing", "closed"):  # nothing is dispatched any more
            self._cancel_call(call, _DISPOSED, force=False)
            return
        self._queue.appendleft(call)
        if self._broken is not None:  # nor here: it fails like the rest of the queue did
            self._fail_queue()

    def _serving(self) -> int:
        return sum(1 for w in self._workers.values() if w.calls)

    def _send(self, w: _Worker, frame: bytes) -> bool:
        if w.gone or w.sock.closed:
            return False
        try:
            w.sock.send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
        except zmq.ZMQError:
            return False
        # Sending may consume the edge of zmq's notification fd: handle what arrived. Inside
        # w's own drain (a result dispatched the next call to it), that loop receives it: no
        # recursion, which a busy supervisor and a fast worker could otherwise nest per call.
        if not w.draining and readable(w.sock):
            self._drain(w)
        return True

    # ------------------------------------------------------------------ cancellation

    def _cancel_call(self, call: Call, cause: CancelCause, *, force: bool) -> None:
        if call._result is not None:
            return
        if call._cause is None:
            call._cause = cause
            call._times["cancel_requested"] = time.monotonic()
        elif cause is _DISPOSED and call._cause.kind in ("user", "parent"):
            call._cause = cause  # C5.3: disposed takes priority in classification
        if call._state is _CallState.QUEUED:
            self._settle_unstarted(call, cause)
            return
        w = call._worker
        assert w is not None
        progress = self._progress(w, call)
        if force:
            call._forced = True
            if progress == 0 or (progress < 0 and call is w.call):
                # It runs (or is next and nothing runs before it): kill, once no call
                # waiting behind it can be taken up in the moment before the kill lands.
                if not self._behind(w, call):
                    self._kill(w, call)
                elif self._tg is not None:
                    self._tg.start_soon(self._kill_when_clear, w, call)
                return
            # Waiting behind another: withdraw it like any other; kill only if it becomes
            # the call its worker runs. Or w is done with it (it took up a call sent after
            # it): its result is on its way, which the ladder waits for; a kill now would
            # take the next call.
        if call._rung is Rung.NONE:
            self._raise_rung(call, Rung.CANCEL)
            w.acks_expected.add(call.id)
            self._send(w, encode(Cancel(call.id, call._cause.kind)))
            if progress == 0 or call is w.call:
                # Its worker may be killed for it: take back what waits behind it first.
                self._recall_behind(w, call)
        if not call._laddering and self._tg is not None:
            call._laddering = True
            self._tg.start_soon(self._ladder, w, call)

    def _settle_unstarted(self, call: Call, cause: CancelCause) -> None:
        if cause.kind == "timeout":
            self._settle(
                call,
                Outcome.TIMEOUT,
                error=TIMEOUT_TEXT,
                error_name="TimeoutError",
                body_started=False,
            )
        else:
            self._settle(
                call,
                Outcome.ABORTED_BEFORE_DISPATCH,
                error=ABORTED_BEFORE_DISPATCH_TEXT,
                error_name=ABORT_ERROR_NAME,
                body_started=False,
            )

    async def _ladder(self, w: _Worker, call: Call) -> None:
        """The escalation ladder of one worker: cancel message, SIGTERM, SIGKILL (C4.2)."""
        # A call waiting behind another in w's queue is withdrawn at once, unless w's loop is
        # held up (a body keeps the GIL): then it is withdrawn later, or taken up and sees
        # its cancelled signal. Never kill a worker, and the call it runs, for a call
        # waiting behind it; unless every call in w is cancelled too, and w has neither
        # given it back nor taken it up within cancel_grace: a worker a tool patched could
        # otherwise hold it (and the pool's close) for ever. Once it is w's first call,
        # nothing else runs there.
        deadline = time.monotonic() + self.cancel_grace
        unanswered = False
        while call._result is None and not w.gone and not self._at_or_past(w, call):
            if time.monotonic() >= deadline and all(c._cause is not None for c in w.calls):
                unanswered = True
                break
            with anyio.move_on_after(0.05):
                await call.wait()
        if call._forced and call._result is None and not w.gone:
            await self._kill_when_clear(w, call)
            return
        if not unanswered:
            with anyio.move_on_after(self.cancel_grace):
                await call.wait()
        if call._result is None and call._rung is not Rung.SIGKILL:
            await self._clear_behind(w, call)
        await self._await_sent_result(w, call)
        if call._result is not None and w.state is not WorkerState.QUARANTINED:
            return
        if w.gone:
            return
        if call._result is None and call._rung is not Rung.SIGKILL:
            self._terminate(w, call)
        with anyio.move_on_after(self.term_grace):
            await w.gone_event.wait()
        if not w.gone:
            self._kill(w, call)

    def _at_or_past(self, w: _Worker, call: Call) -> bool:
        """Whether w is at call or past it: call is first in its line (nothing else of w's
        runs before it), or w took it up. Marks that lie can only get their own worker
        killed sooner, never keep a call first in line from escalating."""
        return call is w.call or self._progress(w, call) >= 0

    def _progress(self, w: _Worker, call: Call) -> int:
        """Where w is with call: -1, not taken up yet; 0, taken up (it may run it still);
        1, done with it: its ledger names a call sent after it, which w takes up only once
        it sent call's result (kept in its ledger, or acknowledged)."""
        ledger = _read_marks(w)
        if ledger is None:
            return 0
        seen = False
        for c in w.calls:
            if c is call:
                seen = True
            elif seen and ledger[0] == c.id + 1:
                return 1
        return 0 if call._started or ledger[0] == call.id + 1 else -1

    async def _kill_when_clear(self, w: _Worker, call: Call) -> None:
        """Kill w for call (forced), once no other call of w can die of it."""
        await self._clear_behind(w, call)
        await self._await_sent_result(w, call)
        if call._result is None and not w.gone:
            self._kill(w, call)

    def _behind(self, w: _Worker, call: Call) -> list[Call]:
        """The calls sent to w after call, still in w."""
        calls = list(w.calls)
        return calls[calls.index(call) + 1 :] if call in calls else []

    def _recall_behind(self, w: _Worker, call: Call) -> None:
        """Ask w to give back the calls waiting behind call (a cancelled one is withdrawn on
        its cancel)."""
        for queued in self._behind(w, call):
            self._recall(w, queued)

    def _recall(self, w: _Worker, call: Call) -> bool:
        """Ask w to give call back, unless that is asked already or it is cancelled (then its
        cancel withdraws it), or it is no longer w's: a send reads what w sent, so the caller's
        list of w's calls may be stale (one back in the pool's queue, marked, would go to its
        next worker as if recalled from there). True if asked now."""
        if call._recalling or call._cause is not None:
            return False
        if call._worker is not w or call._result is not None:
            return False
        call._recalling = True
        self._send(w, encode(Recall(call.id)))
        return True

    async def _clear_behind(self, w: _Worker, call: Call) -> None:
        """Before a signal to w's tree for call, which w runs: take back the calls waiting
        behind it, and wait (up to term_grace: w's loop may be held up) until they are
        withdrawn, or w is done with call (it took one up), or call settled. Else call
        could end just before the signal lands, and the call w took up next die of it. Also
        while w has not taken call up yet: it may take it up, end it and take up the next in
        the moment before the signal lands."""
        if not self._exposed(w, call):
            return
        self._recall_behind(w, call)
        with anyio.move_on_after(self.term_grace):
            while call._result is None and not w.gone and self._exposed(w, call):
                with anyio.move_on_after(0.005):
                    await call.wait()

    def _exposed(self, w: _Worker, call: Call) -> list[Call]:
        """The calls behind call in w that a signal for call could take instead: none once
        w is done with call (it took up one sent after it). Before w took call up, only
        uncancelled ones count: there is no body of call to stop yet, and waiting for
        cancelled ones (which a worker that does not answer keeps) would only delay the
        escalation against call."""
        behind = self._behind(w, call)
        if not behind:
            return behind
        progress = self._progress(w, call)  # (one look at the ledger)
        if progress > 0:
            return []
        if progress < 0:
            behind = [c for c in behind if c._cause is None]
        return behind

    async def _await_sent_result(self, w: _Worker, call: Call) -> None:
        """If w is done with call, its result is on its way: give it term_grace to arrive
        before escalating against w, which may run an uncancelled call since. Bounded: the
        ledger is the worker's to scribble on."""
        if call._result is None and not w.gone and self._progress(w, call) == 1:
            with anyio.move_on_after(self.term_grace):
                await call.wait()

    def _raise_rung(self, call: Call, rung: Rung) -> None:
        if _RUNG_ORDER[rung] > _RUNG_ORDER[call._rung]:
            call._rung = rung

    def _terminate(self, w: _Worker, call: Call) -> None:
        """SIGTERM w's tree, escalating ``call``."""
        w.escalated = True
        w.state = WorkerState.QUARANTINED
        self._signalled(w, call, Rung.SIGTERM)
        if self._reaper is not None and not w.gone:
            self._reaper.signal_tree(w.wid, signal.SIGTERM)

    def _kill(self, w: _Worker, call: Call) -> None:
        """SIGKILL w's tree, escalating ``call``."""
        w.escalated = True
        self._quarantine(w, None)
        self._signalled(w, call, Rung.SIGKILL)

    def _signalled(self, w: _Worker, call: Call | None, rung: Rung) -> None:
        """Record a rung reached against w's tree: on the escalated call now; on whichever
        call w had taken up when it died, once its ledger tells (_settle_calls_of_dead)."""
        step = "sigterm" if rung is Rung.SIGTERM else "sigkill"
        now = time.monotonic()
        w.signals.setdefault(step, now)
        if call is not None:
            self._raise_rung(call, rung)
            call._times.setdefault(step, now)

    def _retire(self, w: _Worker) -> None:
        if w in self._ready:
            self._ready.remove(w)
        w.state = WorkerState.RETIRING
        for call in w.calls:
            call._recalling = True  # it withdraws what it has not taken up
        self._send(w, encode(Shutdown()))

    def _violated(self, w: _Worker, violation: str) -> None:
        """w broke the protocol: quarantine it; before its hello, that is a start failure."""
        spawning = _spawning(w)  # before the quarantine changes its state
        self._quarantine(w, violation)
        if spawning:
            self._start_failure(w, violation)

    def _quarantine(self, w: _Worker, violation: str | None) -> None:
        """Take w out of service for good and kill its tree (C4.2, C7)."""
        if violation is not None:
            w.violated = True
        if violation is not None and w.violation is None:
            w.violation = violation
            _log.warning("worker %s (pid %s) quarantined: %s", w.wid, w.pid, violation)
        if w in self._ready:
            self._ready.remove(w)
        w.state = WorkerState.QUARANTINED
        if self._reaper is not None and not w.gone:
            self._reaper.kill_tree(w.wid)
            if violation is not None:
                self._signalled(w, None, Rung.SIGKILL)

    # ------------------------------------------------------------------ settlement

    def _settle(
        self,
        call: Call,
        outcome: Outcome,
        *,
        value: Any = None,
        error: str | None = None,
        error_name: str | None = None,
        body_started: bool | None,
        context: Mapping[str, Any] | None = None,
        exit_status: int | None = None,
        leftovers_killed: int = 0,
        cpu_time: float | None = None,
        max_rss: int | None = None,
        output: str | None = None,
        output_dropped: int = 0,
        tree_max_memory: int | None = None,
    ) -> None:
        if call._result is not None:
            return
        now = time.monotonic()
        call._times["settled"] = now
        w = call._worker
        exit_code = exit_signal = None
        if exit_status is not None:
            if exit_status < 0:
                exit_signal = -exit_status
            else:
                exit_code = exit_status
        call._result = Result(
            call_id=call.id,
            tool=call.tool,
            outcome=outcome,
            value=value,
            error=error,
            error_name=error_name,
            body_started=body_started,
            cause=call._cause,
            rung=call._rung,
            worker_pid=w.pid if w is not None else None,
            exit_code=exit_code,
            exit_signal=exit_signal,
            context=MappingProxyType(dict(context)) if context else _NO_CONTEXT,
            leftovers_killed=leftovers_killed,
            cpu_time=cpu_time,
            max_rss=max_rss,
            output=output,
            output_dropped=output_dropped,
            tree_max_memory=tree_max_memory,
            timeline=Timeline(**call._times),
        )
        call._state = _CallState.SETTLED
        self._settled_counts[outcome.value] += 1
        if call._rung is not Rung.NONE:
            self._escalations[call._rung.value] += 1
        del self._calls[call.id]
        if call._group is not None:
            call._group._calls.discard(call)
        if w is not None and call in w.calls:
            if w.calls[0] is call:
                w.calls.popleft()
                w.head_since = now
            else:
                w.calls.remove(call)
            if w.acks_expected:  # an ack may still be on its way for this call, no older one
                w.acks_expected &= {call.id, *(c.id for c in w.calls)}
        if call._event is not None:
            call._event.set()
        if call._started_event is not None:
            call._started_event.set()

    # ------------------------------------------------------------------ deadlines

    def _add_deadline(self, call: Call, when: float) -> None:
        call._deadline = when
        first = not self._deadlines or when < self._deadlines[0][0]
        if len(self._deadlines) > 2 * len(self._calls) + 1024:
            # Mostly calls settled long before their deadline: keep only the live ones.
            self._deadlines = [entry for entry in self._deadlines if entry[1] in self._calls]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (when, call.id))
        if first and self._deadline_wake is not None:
            self._deadline_wake.set()

    async def _deadline_clock(self) -> None:
        while True:
            self._deadline_wake = anyio.Event()
            delay = math.inf
            now = time.monotonic()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, call_id = heapq.heappop(self._deadlines)
                call = self._calls.get(call_id)  # settled calls are no longer there
                if call is not None and call._result is None:
                    self._cancel_call(call, _TIMEOUT, force=False)
            if self._deadlines:
                delay = self._deadlines[0][0] - now
            with anyio.move_on_after(delay):
                await self._deadline_wake.wait()

    # ------------------------------------------------------------------ workers

    def _spawn(self) -> _Worker:
        assert self._ctx is not None
        assert self._dir is not None
        assert self._reaper is not None
        assert self._tg is not None
        wid = next(self._wids)
        # Its own directory (0700, root's until the worker takes it for its uid): no other
        # worker can reach the socket, whatever the umask, even before this one connects.
        sock_dir = os.path.join(self._dir, f"w{wid}")
        os.mkdir(sock_dir, 0o700)
        endpoint = f"ipc://{sock_dir}/sock"
        ledger = os.path.join(sock_dir, "ledger")
        ledger_fd = os.open(ledger, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(ledger_fd, LEDGER_SIZE)
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
        sock.bind(endpoint)
        secret = secrets.token_hex(32).encode()
        w = _Worker(wid, endpoint, sock, secret)
        w.ledger_fd = ledger_fd
        self._workers[wid] = w
        profile = self.profile
        cleanup: list[str] = [sock_dir]
        procs: list[str] = []
        kill_dir: str | None = None
        groups: list[str] = []
        if self._cgroups is not None and self._cgroups.base:
            wc = self._cgroups.for_worker(
                wid, memory=profile.memory, max_processes=profile.max_processes
            )
            procs = wc.procs_files
            kill_dir = wc.kill_dir
            groups = sorted(set(wc.dirs.values()))
            if kill_dir is not None:  # v2 regenerates cgroup.procs on each read from 0
                w.members_file = os.path.join(kill_dir, "cgroup.procs")
                w.members_fd = os.open(w.members_file, os.O_RDONLY | os.O_CLOEXEC)
            elif procs:  # v1 caches the list per open file: open it each time
                w.members_file = procs[0]
            cleanup.extend(sorted(set(wc.dirs.values())))
            memory_dir = wc.dirs.get("memory", "/nonexistent")
            peak = os.path.join(memory_dir, "memory.max_usage_in_bytes")
            if os.path.exists(peak):
                # Kept open: a write and a read per call cost 1 us so, 20 us opening it each
                # time. (Where writing resets the peak per open file, this is also the file.)
                # Where it cannot be reset, no peak is reported: it would not be the call's.
                try:
                    w.peak_fd = os.open(peak, os.O_RDWR | os.O_CLOEXEC)
                except OSError:
                    w.peak_fd = None

        scratch: str | None = None
        if profile.scratch_dir:
            scratch = os.path.join(self._dir, f"scratch-w{wid}")
            os.mkdir(scratch, 0o700)
            cleanup.append(scratch)
        argv = [
            sys.executable,
            "-m",
            "toolpool.worker",
            "--endpoint",
            endpoint,
            "--tools",
            self.tools_spec,
            "--parent-pid",
            str(self._reaper.pid),
            "--max-frame",
            str(self.max_frame),
            "--profile",
            json.dumps(profile.to_wire()),
            "--cgroup-procs",
            ",".join(procs),
            "--capture",
            str(self.capture_output or 0),
            "--ledger",
            ledger,
            "--members",
            w.members_file if w.members_fd is not None and w.members_file else "",
        ]
        if self.allow_background:
            argv.append("--allow-background")
        self._reaper.spawn(
            wid,
            argv,
            env=self._worker_env(scratch),
            stdin=secret + b"\n",
            output=self.worker_output,
            cwd=scratch,
            cgroup=kill_dir,
            groups=groups,
            cleanup=cleanup,
            start=self.start_method,
        )
        self._started_count += 1
        self._tg.start_soon(self._serve_worker, w)
        self._tg.start_soon(self._watch_disconnect, w)
        return w

    def _worker_env(self, scratch: str | None) -> dict[str, str]:
        env = dict(os.environ) if self._env is None else dict(self._env)
        allow = self.profile.env_allowlist
        if allow is not None:
            env = {k: env[k] for k in allow if k in env}
        paths = [p or os.getcwd() for p in sys.path]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if scratch is not None:
            env["TMPDIR"] = scratch
            if allow is not None:
                env["HOME"] = scratch
        return env

    async def _serve_worker(self, w: _Worker) -> None:
        """Read w's messages until it is gone; then close its socket."""
        fd = fd_of(w.sock)
        try:
            with _scope(w), on_readable(fd, functools.partial(self._drain, w)) as installed:
                if installed:  # asyncio: messages are handled right in the reader callback
                    self._drain(w)
                    with anyio.move_on_after(self.start_timeout):
                        await w.hello_event.wait()
                    if _spawning(w):
                        self._start_failure(w, "the worker did not say hello in time")
                    await w.gone_event.wait()
                    return
                with anyio.move_on_after(self.start_timeout):
                    while _spawning(w):
                        self._drain(w)
                        if not _spawning(w):
                            break
                        await anyio.wait_readable(fd)
                if _spawning(w):
                    self._start_failure(w, "the worker did not say hello in time")
                while not w.gone:
                    self._drain(w)
                    if not _alive(w):
                        break
                    await anyio.wait_readable(fd)
        finally:
            self._close_worker(w)

    async def _watch_disconnect(self, w: _Worker) -> None:
        """Notice a dropped connection (an oversized frame makes zmq disconnect the peer).

        Only the worker's own connection counts: the first one accepted (the worker connects
        before any tool code runs; a PAIR socket refuses a second peer while it has one). A
        stranger that connects and leaves cannot get the worker killed.
        """
        monitor = w.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        own_fd: int | None = None
        fd = fd_of(monitor)
        try:
            with _scope(w):
                while not w.gone:
                    while readable(monitor):
                        frames = monitor.recv_multipart(zmq.NOBLOCK)
                        event, value = struct.unpack("=HI", frames[0][:6])
                        if event == zmq.EVENT_ACCEPTED:
                            if own_fd is None:
                                own_fd = value
                            continue
                        if value != own_fd:
                            _log.warning("worker %s: a stranger connected to its socket", w.wid)
                            continue
                        if event == zmq.EVENT_DISCONNECTED and not w.gone:
                            self._drain(w)  # take what it sent before the drop
                            w.disconnected = True
                            # Dead, dying or misbehaving (an oversized frame): never trust it
                            # again; the reaper reports when its tree is gone.
                            self._quarantine(w, None)
                    await anyio.wait_readable(fd)
        finally:
            # Disable the monitor before its reader closes (see _close_worker); if the worker's
            # socket is already closed, _close_worker disabled it first.
            try:
                if not w.sock.closed:
                    w.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)

    def _close_worker(self, w: _Worker) -> None:
        if w.peak_fd is not None:
            os.close(w.peak_fd)
            w.peak_fd = None
        if w.members_fd is not None:
            os.close(w.members_fd)
            w.members_fd = None
        if w.ledger_fd is not None and (w.gone or self._state == "closed"):
            os.close(w.ledger_fd)  # else: read once it is gone (_settle_calls_of_dead)
            w.ledger_fd = None
        if not w.sock.closed:
            # Stop the monitor before anything closes: libzmq's I/O thread blocks for good
            # on a monitor event whose reader is gone, freezing every socket of the context.
            try:
                w.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            try:
                anyio.notify_closing(fd_of(w.sock))
            except Exception:
                pass
            w.sock.close(linger=0)

    def _drain(self, w: _Worker) -> None:
        sock = w.sock
        if w.draining or w.gone:
            return  # the drain further up the stack receives until nothing is readable
        w.draining = True
        self._draining += 1
        try:
            while not sock.closed and readable(sock):
                if w.state is WorkerState.SPAWNING:  # its hello: note who really sent it
                    zframe = sock.recv(zmq.NOBLOCK, copy=False)
                    w.peer_pid = _peer_pid(zframe)
                    frames = [zframe.bytes]
                else:
                    # All parts of one message (results held back come as one): one check
                    # of the socket's events per message, not per frame (each costs zmq a
                    # look at its command mailbox, a good part of a quick call's cost).
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                for frame in frames:
                    if w.violation is not None or sock.closed:
                        break  # a quarantined violator: nothing it says counts any more
                    try:
                        msg = decode_from_worker(frame, max_len=self.max_frame)
                        self._on_message(w, msg)
                    except ProtocolViolation as exc:
                        self._violated(w, f"protocol violation: {exc}")
                    except Exception as exc:  # a decoder gap must never take the supervisor down
                        _log.exception("worker %s: unexpected error handling its message", w.wid)
                        self._violated(w, f"protocol violation: {type(exc).__name__}: {exc}")
        finally:
            w.draining = False
            self._draining -= 1
        if self._dispatch_due and not self._draining and not self._dispatching:
            self._dispatch()

    def _on_message(self, w: _Worker, msg: Any) -> None:
        if isinstance(msg, ResultMessage):
            settle = self._received(w, msg)
            call = settle.args[0]
            if not msg.extras.get("kept", False) and len(w.calls) > 1:
                # Not in its ledger: it takes up nothing more until it knows this arrived.
                self._send(w, encode(Ack(w.results)))
            leftovers = msg.leftovers
            # With a leftover it reported, the worker takes up nothing more until 'resume'.
            w.holding = leftovers > 0 and not self.allow_background
            if (
                not leftovers
                and not self.allow_background
                and w.members_file is not None
                and len(w.calls) == 1
            ):
                # The worker's count is its tool's claim; its cgroup is not: any process in it
                # but the worker (a child re-parented away with clone(CLONE_PARENT), or one a
                # tool hid by patching the worker) is left over too. Only while no other call
                # is in the worker: one taken up since could own them.
                leftovers = _other_members(w)
            if leftovers and not self.allow_background and self._reaper is not None:
                # The call left processes behind: kill them before settling, so the result
                # can say how many, and the next call never inherits them.
                w.pending = settle
                if w.state is WorkerState.BUSY:
                    w.state = WorkerState.CLEANING
                self._reaper.clean(w.wid)
                return
            settle()
            if w.calls:
                _reset_peak(w)  # the next call's peak starts about now
            self._resume(w)
        elif isinstance(msg, Started):
            call = w.call
            if call is None or call.id != msg.call_id or call._started:
                raise ProtocolViolation(f"'started' for call {msg.call_id}, which it does not run")
            call._started = True
            call._state = _CallState.RUNNING
            call._times["started"] = time.monotonic()
            if call._started_event is not None:
                call._started_event.set()
        elif isinstance(msg, CancelAck):
            # One per cancel it was sent, for its current or just-settled call: anything else
            # is a violation (a flood of acks would otherwise cost the supervisor for free).
            if msg.call_id not in w.acks_expected:
                raise ProtocolViolation(f"cancel_ack for call {msg.call_id}, which it was not sent")
            w.acks_expected.discard(msg.call_id)
            call = w.call
            if call is not None and call.id == msg.call_id:
                call._times.setdefault("cancel_delivered", time.monotonic())
        elif isinstance(msg, Withdrawn):
            # Only a queued call it was asked to give back (a cancel, a recall, a shutdown).
            call = next((c for c in w.calls if c.id == msg.call_id), None)
            if call is None or not (call._recalling or msg.call_id in w.acks_expected):
                raise ProtocolViolation(f"withdrew call {msg.call_id}, which it was not asked to")
            if call._started:
                raise ProtocolViolation(f"withdrew call {msg.call_id}, whose body it started")
            w.calls.remove(call)
            w.acks_expected.discard(call.id)
            call._times.setdefault("cancel_delivered", time.monotonic())
            if call._cause is not None:
                call._worker = None
                call._rung = Rung.CANCEL
                self._settle_unstarted(call, call._cause)
            else:
                call._times.pop("cancel_delivered", None)
                self._requeue(call)
            self._resume(w)
        elif isinstance(msg, Hello):
            if w.state is not WorkerState.SPAWNING:
                raise ProtocolViolation("a second hello")
            if not hmac.compare_digest(msg.secret, w.secret):
                raise ProtocolViolation("hello with a wrong secret")
            if msg.version != PROTOCOL_VERSION:
                w.fatal = f"protocol version {msg.version}, expected {PROTOCOL_VERSION}"
                self._start_failure(w, w.fatal)
                return
            if w.pid is not None and msg.pid != w.pid:
                raise ProtocolViolation(f"hello from pid {msg.pid}, but the worker is {w.pid}")
            if w.peer_pid is not None and w.peer_pid != msg.pid:
                # The secret alone is not enough: the process at the other end of the socket
                # must be the worker itself (a stolen secret cannot stand in for it).
                raise ProtocolViolation(
                    f"hello sent by process {w.peer_pid}, which is not the worker ({msg.pid})"
                )
            if w.pid is None and w.peer_pid == msg.pid:
                # The reaper's report of its pid can come after the hello. Until then, the pid
                # the kernel vouches for stands in (results, the cgroup's member count); the
                # report is checked against it ("spawned").
                w.pid = msg.pid
            catalog: dict[str, dict[str, Any]] = {}
            threaded: set[str] = set()
            for entry in msg.tools:
                desc = dict(entry)
                if desc.pop("runs_in_thread", False):
                    threaded.add(desc["name"])
                catalog[desc["name"]] = desc
            for name, desc in catalog.items():
                known = self._catalog.get(name)
                # Where its body runs decides whether calls may queue behind it: a worker
                # that says otherwise than the others is refused, and changes nothing.
                if known is not None and (
                    known != desc or (name in threaded) != (name in self._threaded)
                ):
                    raise ProtocolViolation(f"tool {name!r} differs from the other workers'")
            self._threaded |= threaded
            self._catalog.update(catalog)
            w.catalog = catalog
            if self._worker_layers is None:
                self._worker_layers = dict(msg.containment)
                self._warn_inactive_layers()
            w.state = WorkerState.READY
            self._start_failures = 0
            w.hello_event.set()
            if self._state in ("closing", "closed"):
                self._retire(w)
            else:
                self._ready.append(w)
                self._dispatch()
            self._notify_workers_changed()
        elif isinstance(msg, Fatal):
            if w.start_failed and hmac.compare_digest(msg.secret, w.secret):
                return  # its start already counted as failed; the details came late
            if w.state is not WorkerState.SPAWNING or not hmac.compare_digest(msg.secret, w.secret):
                raise ProtocolViolation("an unexpected 'fatal' message")
            w.fatal = msg.error
            self._start_failure(w, msg.error)
        elif isinstance(msg, Pong):
            # The supervisor sends no pings: every pong is unsolicited. Harmless alone, but a
            # flood of them would cost the supervisor CPU and delay every other worker.
            raise ProtocolViolation("a pong it was not asked for")
        else:  # pragma: no cover - decode_from_worker returns only the types above
            raise ProtocolViolation(f"unexpected message {type(msg).__name__}")

    def _received(self, w: _Worker, msg: ResultMessage) -> functools.partial[None]:
        """w's next result arrived (or was found in its ledger): check it is for the call w
        runs, and return what settles that call."""
        call = w.call
        if call is None or call.id != msg.call_id:
            raise ProtocolViolation(f"result for call {msg.call_id}, which it does not own")
        w.results += 1
        value = unpack_value(msg.value, self.max_frame) if msg.value is not None else None
        now = call._times["returned"] = time.monotonic()
        if msg.body_started:
            call._started = True
            started_at = msg.extras.get("started_at")
            if "started" not in call._times and started_at is not None:
                # The worker's monotonic clock is this one (same host); trust it only within
                # what this side saw.
                call._times["started"] = min(max(started_at, call._times["dispatched"]), now)
        output = msg.extras.get("output")
        return functools.partial(
            self._settle,
            call,
            Outcome(msg.outcome),
            value=value,
            error=msg.error,
            error_name=msg.error_name,
            body_started=msg.body_started,
            context=msg.context,
            cpu_time=msg.extras.get("cpu_time"),
            max_rss=msg.extras.get("max_rss"),
            output=None if output is None else output.decode("utf-8", "replace"),
            output_dropped=msg.extras.get("output_dropped", 0),
            tree_max_memory=_read_peak(w),
        )

    def _resume(self, w: _Worker) -> None:
        """w settled or gave back a call, or its clean-up ended: it serves on (idle if it
        holds no call); then dispatch what is queued."""
        if not w.gone:
            if w.holding and self._reaper is None:  # nobody can clean up: do not wait for it
                w.holding = False
                self._send(w, encode(Resume()))
            if w.state is WorkerState.CLEANING and w.pending is None and not w.holding:
                w.state = WorkerState.BUSY
            if w.state is WorkerState.BUSY and not w.calls:
                w.state = WorkerState.READY
                self._ready.append(w)
        self._dispatch()

    async def _await_fatal(self, w: _Worker) -> None:
        with anyio.move_on_after(2.0):
            await w.hello_event.wait()
        if not w.start_failed:
            self._start_failure(w, f"the worker exited with status {w.exit_status} at start")
        w.awaiting_fatal = False
        if w.gone_deferred:  # its tree's end came meanwhile: now it counts
            self._worker_gone(w)
        elif w.gone:  # _worker_gone (the reaper lost) left the replacement decision to us
            self._maybe_replace(w)

    def _start_failure(self, w: _Worker, reason: str) -> None:
        w.start_failed = True
        w.hello_event.set()
        self._quarantine(w, None)
        self._start_failures += 1
        if self._start_failures >= self.max_start_failures or self._state == "starting":
            self._broken = WorkerStartError(
                f"workers for {self.tools_spec!r} fail to start: {reason.strip()}"
            )
            self._fail_queue()
        self._notify_workers_changed()

    def _fail_queue(self) -> None:
        while self._queue:
            call = self._queue.popleft()
            if call._result is None:
                self._settle(
                    call,
                    Outcome.WORKER_LOST,
                    error=f"{WORKER_LOST_TEXT}: {self._broken}",
                    error_name="WorkerStartError",
                    body_started=False,
                )

    # ------------------------------------------------------------------ reaper events

    def _on_reaper_event(self, event: dict[str, Any]) -> None:
        kind = event.get("ev")
        if kind == "lost":
            if self._state not in ("closing", "closed"):
                _log.error("the pool's reaper process went away")
                self._broken = WorkerStartError("the pool's reaper process went away")
                self._fail_queue()
            # Also while closing: the teardown waits for every worker to be gone, and only
            # this can tell it now (they die with the reaper: PDEATHSIG).
            if self._tg is not None and self._state != "closed":
                self._tg.start_soon(self._settle_orphaned_workers)
            return
        w = self._workers.get(int(event.get("wid", 0)))
        if w is None:
            return
        if kind == "spawned":
            w.pid = int(event["pid"])
            if w.peer_pid is not None and w.peer_pid != w.pid and w.hello_event.is_set():
                # Its hello (handled before this report) came from another process.
                self._quarantine(w, f"hello sent by process {w.peer_pid}, not the worker")
            w.start_method = str(event.get("method", "spawn"))
            self._notify_workers_changed()
        elif kind == "fork_unavailable":
            if not self._fork_warned:
                self._fork_warned = True
                _log.warning("workers are spawned, not forked: %s", event.get("reason"))
        elif kind == "spawn_failed":
            w.fatal = str(event.get("error"))
            self._start_failure(w, w.fatal)
            self._worker_gone(w)
        elif kind == "exited":
            w.exit_status = int(event["status"])
            w.oom_kills = int(event.get("oom_kills", 0))
            if w.state is WorkerState.SPAWNING and not w.start_failed:
                self._drain(w)  # its 'fatal' may already be here
            if w.state is WorkerState.SPAWNING and not w.start_failed:
                if w.exit_status == EXIT_TOOLS_FAILED and self._tg is not None:
                    # It sent 'fatal' (with the traceback) before exiting: the message can
                    # trail the exit report by a moment. Wait for it, briefly.
                    w.awaiting_fatal = True
                    self._tg.start_soon(self._await_fatal, w)
                else:
                    self._start_failure(
                        w, f"the worker exited with status {w.exit_status} at start"
                    )
        elif kind == "gone":
            if w.awaiting_fatal:
                # Its 'fatal' can trail this report too (the socket's I/O thread lags under
                # load): gone now would close its socket unread. Its socket stays open and
                # read until _await_fatal is done.
                w.gone_deferred = True
            else:
                self._worker_gone(w)
        elif kind == "cleaned":
            pending, w.pending = w.pending, None
            if pending is not None:
                pending(leftovers_killed=int(event.get("count", 0)))
            if w.holding and not w.gone:
                w.holding = False
                if w.calls:
                    _reset_peak(w)  # the next call's peak starts now
                self._send(w, encode(Resume()))
            self._resume(w)
        elif kind == "stuck":
            _log.error("worker %s: its cgroup would not empty; still trying", w.wid)

    async def _settle_orphaned_workers(self) -> None:
        """The reaper died: workers die with it (PDEATHSIG). Wait for each, then settle.

        Without the reaper the tree below a worker cannot be verified; the pool is broken and
        says so (WorkerStartError on every new call).
        """
        for w in list(self._workers.values()):
            if w.pid is not None and not w.gone_deferred:  # (that one's tree is known gone)
                await _wait_pid_gone(w.pid)
            w.violation = w.violation or "the pool's reaper process died"
            self._worker_gone(w)

    def _worker_gone(self, w: _Worker) -> None:
        """The worker and every process it spawned are gone: settle, replace (C4.3, C4.6)."""
        if w.gone:
            return
        was_serving = w.state in (WorkerState.READY, WorkerState.BUSY, WorkerState.QUARANTINED)
        was_serving = was_serving and w.hello_event.is_set()
        if not w.sock.closed and w.hello_event.is_set() and not w.start_failed:
            # What it sent before it died counts (a result may still be unread); nothing it
            # sent is read after its calls are settled below.
            if w in self._ready:
                self._ready.remove(w)
            if w.state is not WorkerState.RETIRING:
                w.state = WorkerState.QUARANTINED  # no call is sent to it meanwhile
            self._drain(w)
        w.gone = True
        if w in self._ready:
            self._ready.remove(w)
        pending, w.pending = w.pending, None
        if pending is not None:  # its body returned; the clean-up was overtaken by its death
            pending()
        self._settle_calls_of_dead(w)
        w.state = WorkerState.EXITED
        w.gone_event.set()
        for scope in w.scopes:
            scope.cancel()
        del self._workers[w.wid]
        self._notify_workers_changed()
        if not w.awaiting_fatal:  # else: decided once the start failure is known
            self._maybe_replace(w, counts=was_serving and not w.start_failed)
        self._dispatch()  # a warm spare (or any idle worker) takes what is queued

    def _settle_calls_of_dead(self, w: _Worker) -> None:
        """Settle the calls w held when it died (its kept results are settled first).

        Only its first call can have been taken up: w takes a call only once the result of
        the one before is in the supervisor's hands or in its ledger. The calls behind it run
        elsewhere (or, cancelled, settle as never started). The ledger's marks say whether
        the first one was taken up and its body invoked; they are the worker's own word,
        believed only where they are consistent with what this side saw, and never to run a
        call again more than once.
        """
        ledger = self._read_ledger(w)
        calls = list(w.calls)
        w.calls.clear()
        if not calls:
            return
        head = calls[0]
        taken: bool
        started: bool | None = None
        if head._started:
            taken, started = True, True
        elif ledger is None or "sigterm" in head._times:
            # No ledger; or w did not answer a cancel of its first call within the grace
            # period, which an idle worker always does (it withdraws a call not taken up).
            taken = True
        elif ledger[0] == head.id + 1:
            taken, started = True, ledger[1] == head.id + 1
        elif any(ledger[0] == c.id + 1 for c in calls[1:]):
            taken = True  # names a call it cannot have begun: the marks are not to be believed
        else:
            # Not taken up, by the marks. But if it was already put back once this way, the
            # marks are suspect: it is not run a third time (a cancelled one settles below).
            taken = head._requeued and head._cause is None
        now = time.monotonic()
        requeue: list[Call] = []
        for call in calls[1:] if taken else calls:
            call._worker = None
            if call._cause is not None:  # never taken up, and cancelled meanwhile
                call._rung = Rung.CANCEL
                call._times.pop("sigterm", None)
                call._times.pop("sigkill", None)
                self._settle_unstarted(call, call._cause)
            else:
                requeue.append(call)
        if taken:
            for step, rung in (("sigterm", Rung.SIGTERM), ("sigkill", Rung.SIGKILL)):
                if step in w.signals:  # it died of them, whichever call they were sent for
                    self._raise_rung(head, rung)
                    head._times.setdefault(step, w.signals[step])
            head._times["reaped"] = now
            if w.escalated and w.violation is None:
                self._settle(
                    head,
                    Outcome.KILLED,
                    error=KILLED_TEXT,
                    error_name="Killed",
                    body_started=started,
                    exit_status=w.exit_status,
                )
            else:
                reason = w.violation or _describe_exit(
                    w.exit_status, w.disconnected, w.oom_kills, self.profile.memory
                )
                self._settle(
                    head,
                    Outcome.WORKER_LOST,
                    error=f"{WORKER_LOST_TEXT}: {reason}",
                    error_name="WorkerLost",
                    body_started=started,
                    exit_status=w.exit_status,
                )
        if requeue and requeue[0] is head:
            head._requeued = True
        for call in reversed(requeue):
            self._requeue(call)  # in order, at the front

    def _read_ledger(self, w: _Worker) -> tuple[int, int] | None:
        """Read w's ledger once it is gone: settle the calls whose results it kept there but
        that never arrived (sent just before it died, or not sent); return its marks."""
        fd, w.ledger_fd = w.ledger_fd, None
        if fd is None:
            return None
        try:
            data = os.pread(fd, LEDGER_SIZE, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        taken, invoked, kept = read_ledger(data)
        if w.violated:
            # Its messages stopped counting at the violation (C7: its call is lost), and so
            # do the results it kept: a violator could forge one there, as its last word.
            kept = []
        for seq, frame in kept:
            if seq != w.results + 1 or not w.calls:
                continue  # received already (or out of turn: not what it sent)
            try:
                msg = decode_from_worker(frame, max_len=self.max_frame)
                if not isinstance(msg, ResultMessage):
                    raise ProtocolViolation(f"a {type(msg).__name__} in its ledger")
                settle = self._received(w, msg)
            except ProtocolViolation as exc:
                _log.warning("worker %s: its ledger holds no valid result: %s", w.wid, exc)
                break
            settle()
        return taken, invoked

    def _maybe_replace(self, w: _Worker, *, counts: bool = False) -> None:
        if self._state in ("running", "starting") and self._broken is None:
            if counts:
                self._replaced += 1
            self._tg_start_replacement(delayed=w.start_failed)

    def _tg_start_replacement(self, *, delayed: bool) -> None:
        if self._tg is None:
            return
        if delayed:
            self._tg.start_soon(self._respawn_later, min(2.0, 0.05 * 2**self._start_failures))
        else:
            self._spawn()

    async def _respawn_later(self, delay: float) -> None:
        await anyio.sleep(delay)
        if self._state in ("running", "starting") and self._broken is None:
            self._spawn()

    def __repr__(self) -> str:
        return f"<toolpool.Pool {self.tools_spec!r} workers={self.size} {self._state}>"


def _read_marks(w: _Worker) -> tuple[int, int] | None:
    """The marks of w's ledger, read while it lives (protocol/_ledger.py), or None."""
    if w.ledger_fd is None:
        return None
    try:
        data = os.pread(w.ledger_fd, 16, 0)
    except OSError:
        return None
    return read_marks(data)


def _other_members(w: _Worker) -> int:
    """How many processes other than the worker its cgroup lists (1 us with the v2 file kept
    open; about 10 us opening it)."""
    try:
        if w.members_fd is not None:
            listed = os.pread(w.members_fd, 1 << 16, 0)
        elif w.members_file is not None:
            with open(w.members_file, "rb") as f:
                listed = f.read()
        else:
            return 0
    except OSError:
        return 0
    return others_listed(listed, w.pid)


def _peer_pid(frame: zmq.Frame) -> int | None:
    """The pid of the process that sent ``frame`` over ipc (libzmq reports the peer's
    credentials as ``localhost:uid:gid:pid`` where the kernel gives them), or None."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    if not isinstance(address, str):
        return None
    tail = address.rpartition(":")[2]
    return int(tail) if tail.isdigit() and address.count(":") == 3 else None


def _describe_exit(
    status: int | None, disconnected: bool = False, oom_kills: int = 0, cap: int | None = None
) -> str:
    if oom_kills and status == -signal.SIGKILL:
        limit = f" of {_human_size(cap)}" if cap is not None else ""
        return (
            f"the worker was killed by SIGKILL: out of memory (its tree reached the memory "
            f"cap{limit}; {oom_kills} OOM kill(s) in its cgroup)"
        )
    if disconnected and status == -signal.SIGKILL:
        return "its connection dropped (an oversized frame?) and it was killed"
    if status is None:
        return "the worker died"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"the worker was killed by {name}"
    return f"the worker exited with status {status}"


async def _wait_pid_gone(pid: int) -> None:
    """Wait until ``pid`` no longer names a live process (it is not our child).

    A pidfd becomes readable when the process dies; without pidfd support, poll.
    """
    import psutil

    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            await anyio.wait_readable(pidfd)
        finally:
            os.close(pidfd)
        return
    delay = 0.001
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        await anyio.sleep(delay)  # no event exists for a non-child's death without pidfd
        delay = min(delay * 2, 0.05)


def _reset_peak(w: _Worker) -> None:
    """Start w's peak memory afresh (cgroup v1: writing 0 resets it)."""
    if w.peak_fd is not None:
        try:
            os.pwrite(w.peak_fd, b"0", 0)
        except OSError:
            pass


def _read_peak(w: _Worker) -> int | None:
    if w.peak_fd is None:
        return None
    try:
        return int(os.pread(w.peak_fd, 64, 0))
    except (OSError, ValueError):
        return None


def _spawning(w: _Worker) -> bool:
    return w.state is WorkerState.SPAWNING and not w.gone


def _alive(w: _Worker) -> bool:
    return not w.gone


def _scope(w: _Worker) -> anyio.CancelScope:
    scope = anyio.CancelScope()
    w.scopes.append(scope)
    if w.gone:
        scope.cancel()
    return scope
