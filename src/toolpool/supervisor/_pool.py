"""The pool's shell: the public :class:`Pool`, and the I/O its core asks for.

Every decision is the core's (``_core.py``: a state machine, events in, actions out). This
file only turns the world into events (a worker's messages and its connection, the reaper's
reports, time) and performs the actions (send frames, start workers, signal trees, wake
callers). The tasks: one reader and one connection watcher per worker socket, the reaper's
event pump, and one clock; plus, rarely, the end of an orphaned worker's tree and the start
of a new reaper after the old one died.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import signal
import tempfile
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType, TracebackType
from typing import Any, Final, Literal, cast, final

import anyio
import anyio.abc
import zmq

from .._transport import readable
from ..core import (
    CancelCause,
    ConfigurationError,
    PoolClosedError,
    UnknownToolError,
    WorkerStartError,
    cancel_with_runtime_cause,
)
from ..protocol import (
    DEFAULT_MAX_FRAME,
    pack_value,
)
from ..reaper import CloseReport, ReaperClient, finish_cleanup
from ..sandbox import Profile, parse_size
from ..sandbox._cgroups import CgroupSet
from ._calls import Call, Group, await_call
from ._channels import Channels
from ._containment import containment_report, supervisor_layers, warn_inactive_layers
from ._core import PoolCore
from ._dispatch import QUEUE_BEHIND_FOR
from ._lifecycle import EXIT_TOOLS_FAILED
from ._records import (
    KILLED_TEXT,
    TIMEOUT_TEXT,
    WORKER_LOST_TEXT,
    Action,
    Changed,
    Clean,
    Close,
    FirstHello,
    Kill,
    Orphaned,
    Progressed,
    RestartReaper,
    Send,
    Settled,
    Spawn,
    Started,
    Terminate,
)
from ._results import CallableDict, CallableList, ContainmentReport, Result, Statistics
from ._state import CoreConfig
from ._workerio import (
    KILL_WAIT,
    WorkerFiles,
    WorkerIO,
)

__all__ = (
    "EXIT_TOOLS_FAILED",
    "KILLED_TEXT",
    "QUEUE_BEHIND_FOR",
    "TIMEOUT_TEXT",
    "WORKER_LOST_TEXT",
    "Call",
    "Group",
    "Pool",
)

_log = logging.getLogger("toolpool.supervisor")

_DISPOSED: Final = CancelCause("disposed")
_PARENT: Final = CancelCause("parent")

WorkerOutput = Literal["discard", "inherit"]
StartMethod = Literal["fork", "spawn"]
#: Calls a busy worker may hold queued (``Pool(prefetch=None)``), but see there. 16 (with 16
#: results held back and 32 ledger slots of 32 KiB) took no-op throughput from 19.5k to 23k
#: calls/s against prefetch 8 (docs/performance.md, "What bought what").
DEFAULT_PREFETCH: Final = 16


@final
class Pool(Channels):
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
        heartbeat: float | None = 1.0,
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
        :param heartbeat: seconds between each worker's heartbeats, sent by a thread that
            never runs tool code. A worker that sends none for 3 intervals is *hung* (no
            thread of it runs: a C extension holding the GIL), told apart from a tool that
            ignores its signal (``Statistics.hung``, a log line; see ``docs/pool.md``,
            "Liveness"). None: no heartbeats.
        """
        if not isinstance(tools, str) or ":" not in tools:
            raise ConfigurationError(f"tools must be 'module:attribute', got {tools!r}")
        _check_count("workers", workers, minimum=1)
        _check_count("max_start_failures", max_start_failures, minimum=1)
        for name, value in (
            ("cancel_grace", cancel_grace),
            ("term_grace", term_grace),
            ("start_timeout", start_timeout),
            ("heartbeat", 1.0 if heartbeat is None else heartbeat),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ValueError(f"{name} must be a non-negative number of seconds")
        if worker_output not in ("discard", "inherit"):
            raise ValueError("worker_output must be 'discard' or 'inherit'")
        if isinstance(max_frame, bool) or not isinstance(max_frame, int) or max_frame < 1024:
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
        if heartbeat is not None and not heartbeat > 0:
            raise ValueError("heartbeat must be a positive number of seconds, or None")
        self.heartbeat = None if heartbeat is None else float(heartbeat)
        _check_count("warm_spares", warm_spares, minimum=0)
        self.warm_spares = warm_spares
        if start_method not in ("fork", "spawn"):
            raise ValueError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")
        self.start_method: StartMethod = start_method
        if prefetch is None:
            prefetch = 0 if profile.user is not None else DEFAULT_PREFETCH
        _check_count("prefetch", prefetch, minimum=0)
        self.prefetch = prefetch
        self.capture_output = parse_size(capture_output)
        if self.capture_output is not None and self.capture_output > max_frame // 2:
            raise ValueError("capture_output must be at most half of max_frame")
        self._files = WorkerFiles()
        self._core = PoolCore(
            CoreConfig(
                tools_spec=tools,
                size=workers,
                warm_spares=warm_spares,
                prefetch=prefetch,
                cancel_grace=self.cancel_grace,
                term_grace=self.term_grace,
                start_timeout=self.start_timeout,
                max_frame=max_frame,
                max_start_failures=max_start_failures,
                allow_background=self.allow_background,
                memory_cap=profile.memory,
                heartbeat=self.heartbeat,
            ),
            self._files,  # the probe: the ledger and cgroup files it holds open
            lambda: secrets.token_hex(32).encode(),
        )
        self._cgroups: CgroupSet | None = None
        self._supervisor_layers: dict[str, tuple[bool, str]] = {}
        self._state: Literal["new", "starting", "running", "closing", "closed"] = "new"
        self._tg: anyio.abc.TaskGroup | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._dir: str | None = None
        self._reaper: ReaperClient | None = None
        self._close_report = CloseReport()
        self._io = self._files.ios  # by worker id
        self._closing: set[WorkerIO] = set()  # gone, their sockets not closed yet
        self._groups: weakref.WeakSet[Group] = weakref.WeakSet()
        self._call_ids = 0
        self._pumping = False
        self._task_scopes: set[anyio.CancelScope] = set()  # the pool's own tasks
        self._clock_at = math.inf  # when the clock task next wakes
        self._clock_wake: anyio.Event | None = None
        self._closed_event: anyio.Event | None = None
        self._changed: anyio.Event | None = None
        self._fork_warned = False
        self._reaper_closing = False  # the close asked the reaper to exit

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
        core = self._core
        try:
            self._dir = tempfile.mkdtemp(prefix="toolpool-")
            # Workers running as other uids must reach their own socket file (theirs, 0600
            # once they own it) by name; nobody but the supervisor can list the directory.
            os.chmod(self._dir, 0o700 if self.profile.user is None else 0o711)
            self._ctx = zmq.Context(io_threads=1)
            await self._start_reaper()
            assert self._reaper is not None
            self._supervisor_layers, self._cgroups = supervisor_layers(
                self.profile,
                subreaper=self._reaper.subreaper,
                cgroup_name=f"toolpool-{os.getpid()}-{id(self):x}",
            )
            self._reaper.own(self._owned())
            self._start_task(self._reaper.run)
            self._start_task(self._clock)
            core.start(time.monotonic())
            self._pump()
            with anyio.fail_after(self.start_timeout + 5):
                # Ready: it said hello, and the reaper said how it started it (the two can
                # come in either order).
                while core.broken is None and core.ready_count() < self.size + self.warm_spares:
                    await self._wait_changed()
                if core.broken is not None:
                    raise core.broken
        except BaseException as exc:
            self._state = "closing"
            with anyio.CancelScope(shield=True):
                await self._teardown()
            await self._exit_task_group()
            if isinstance(exc, TimeoutError):
                raise WorkerStartError("workers did not become ready in time") from None
            raise
        core.started()
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
        core = self._core
        with anyio.CancelScope(shield=True):
            core.closing = True
            for group in list(self._groups):
                cancel_with_runtime_cause(group._controller, _DISPOSED)
            core.close(time.monotonic())
            self._pump()
            await self.wait_idle()
            await self._teardown()
        await self._exit_task_group()
        return self._close_report

    def _start_task(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run one of the pool's own tasks (a socket's reader, the clock, the reaper's pump):
        shielded, so that a cancelled scope around the pool does not stop what settling its
        calls and closing it need; they end when the pool closes."""
        assert self._tg is not None
        self._tg.start_soon(self._shielded, fn, args)

    async def _shielded(
        self, fn: Callable[..., Awaitable[object]], args: tuple[object, ...]
    ) -> None:
        with anyio.CancelScope(shield=True) as task_scope:
            self._task_scopes.add(task_scope)
            try:
                await fn(*args)
            finally:
                self._task_scopes.discard(task_scope)

    async def _exit_task_group(self) -> None:
        tg, self._tg = self._tg, None
        for task_scope in list(self._task_scopes):
            task_scope.cancel()
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        self._state = "closed"
        if self._closed_event is not None:
            self._closed_event.set()

    async def _teardown(self) -> None:
        core = self._core
        core.closing = True
        # Workers: idle ones exit on Shutdown; anything left after term_grace is killed.
        core.retire_idle(time.monotonic())
        self._pump()
        with anyio.move_on_after(self.term_grace):
            await self._wait_all_gone()
        core.kill_remaining(time.monotonic())
        self._pump()
        with anyio.move_on_after(KILL_WAIT):
            await self._wait_all_gone()
        if self._reaper is not None:
            self._reaper_closing = True  # its end is no loss now
            await self._reaper.aclose()
        for io in [*self._io.values(), *self._closing]:
            io.close()
        self._io.clear()
        self._closing.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        if self._cgroups is not None:
            self._cgroups.remove()
            self._cgroups = None
        if self._dir is not None:
            self._close_report = await finish_cleanup(self._dir, self._reaper)
            self._dir = None

    async def _wait_all_gone(self) -> None:
        while not self._core.all_gone():
            await self._wait_changed()

    async def _wait_changed(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

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
        return await await_call(self.submit(tool, args, timeout=timeout))

    def group(self) -> Group:
        """A new group (turn) with a fresh cancel signal (CONTRACT C5)."""
        self._check_open()
        group = Group(self)
        self._groups.add(group)
        return group

    @property
    def catalog(self) -> Mapping[str, Mapping[str, Any]]:
        """The tools the ready workers provide, by name: JSON-compatible descriptions."""
        return MappingProxyType(self._core.catalog)

    @property
    def reaper_pid(self) -> int | None:
        """The pid of the pool's reaper process (every worker is its child)."""
        return self._reaper.pid if self._reaper else None

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the worker processes that are alive now (a new list each time).

        A property, as ``catalog`` and ``reaper_pid`` are; calling it (``worker_pids``, its
        old spelling) still works and warns (DeprecationWarning)."""
        return CallableList(
            [w.pid for w in self._core.live_workers() if w.pid is not None], "worker_pids"
        )

    @property
    def worker_start_methods(self) -> dict[int, str]:
        """How each live worker was started, by pid: ``"fork"`` (from the reaper's template)
        or ``"spawn"`` (a new interpreter). A worker the reaper has not reported yet (a
        replacement, a moment after it started) is not listed. A property; calling it (its
        old spelling) still works and warns."""
        return CallableDict(
            {
                w.pid: w.start_method
                for w in self._core.live_workers()
                if w.pid is not None and w.start_method is not None
            },
            "worker_start_methods",
        )

    async def wait_idle(self) -> None:
        """Wait until no call is queued or running."""
        calls = self._core.calls
        while calls:
            call = next(iter(calls.values()))
            assert isinstance(call, Call)
            await call.wait()

    def statistics(self) -> Statistics:
        """A frozen snapshot of the pool."""
        core = self._core
        running = core.in_flight()
        return Statistics(
            workers=MappingProxyType(dict(core.states())),
            queued=len(core.calls) - running,
            in_flight=running,
            settled=MappingProxyType(dict(core.settled_counts)),
            escalations=MappingProxyType(dict(core.escalation_counts)),
            workers_started=core.started_count,
            workers_replaced=core.replaced,
            submitted=core.submitted,
            hung=core.hung_count(),
        )

    def containment(self) -> ContainmentReport:
        """What protects this pool's workers, layer by layer: active or not, and why.

        Worker-side layers (rlimits, network namespace) are as the first worker reported them.
        """
        return containment_report(self.profile, self._supervisor_layers, self._core.worker_layers)

    # ------------------------------------------------------------------ calls into the core

    def _check_open(self) -> None:
        if self._state in ("closing", "closed"):
            raise PoolClosedError("the pool is closed")
        if self._state == "new":
            raise PoolClosedError("the pool is not started: use 'async with Pool(...)'")
        if self._core.broken is not None:
            raise self._core.broken

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
        catalog = self._core.catalog
        if tool not in catalog:
            raise UnknownToolError(
                f"no worker provides a tool named {tool!r}; known: {sorted(catalog)}"
            )
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise TypeError(f"args must be a mapping, not {type(args).__name__}")
        packed = pack_value(dict(args), "args")
        if len(packed) > self.max_frame - 1024:
            raise ValueError(
                f"args of {len(packed)} bytes exceed the {self.max_frame - 1024} bytes a call "
                f"can carry (max_frame={self.max_frame}, less 1,024 for the call's own fields)"
            )
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        now = time.monotonic()
        self._call_ids += 1
        call = Call(self, self._call_ids, tool, packed, group, now)
        self._core.submit(call, timeout=timeout, now=now)
        self._pump()
        return call

    def _cancel(self, call: Call, cause: CancelCause, *, force: bool) -> None:
        if call._result is not None:
            return
        self._core.cancel(call, cause, force=force, now=time.monotonic())
        self._pump()

    def _group_cancelled(self, group: Group, cause: CancelCause) -> None:
        self._core.cancel_group(group, cause, time.monotonic())
        self._pump()

    # ------------------------------------------------------------------ performing actions

    def _pump(self) -> None:
        """Perform what the core asks until it asks nothing more. Sending may consume the
        edge of zmq's notification fd: what arrived meanwhile is read here, in the loop (a
        fast worker that answers at once costs a turn of this loop, never a stack frame)."""
        if self._pumping:
            return  # the loop further up performs it
        self._pumping = True
        core = self._core
        try:
            while True:
                actions = core.flush(time.monotonic())
                if not actions:
                    break
                more = False
                for io in self._perform(actions):
                    if not io.sock.closed and readable(io.sock):
                        self._read(io)
                        more = True
                if not more and not core.due():
                    break  # (nothing read, nothing new: the next flush would be empty)
        finally:
            self._pumping = False
        timers = core.timers  # (next_deadline, inline: once per call)
        if timers and timers[0][0] < self._clock_at and self._clock_wake is not None:
            self._clock_wake.set()

    def _perform(self, actions: list[Action]) -> list[WorkerIO]:
        """Perform the core's actions in order; return the workers sent to."""
        sent_to: list[WorkerIO] = []
        core = self._core
        reaper = self._reaper if core.reaper_up else None
        for action in actions:
            kind = type(action)
            if kind is Settled:
                call: Call = action[0]  # type: ignore[misc,assignment]  # wake its waiters
                if call._event is not None:
                    call._event.set()
                if call._started_event is not None:
                    call._started_event.set()
                call._wake_progress()  # (its progress updates end)
            elif kind is Send:
                send: Send = action  # type: ignore[assignment]
                io = self._io.get(send.wid)
                try:
                    if io is None or io.sock.closed:
                        raise zmq.ZMQError(zmq.ENOTSOCK)
                    if len(send.frames) == 1:
                        frame = send.frames[0]
                        io.sock.send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
                    else:
                        io.sock.send_multipart(send.frames, zmq.NOBLOCK, copy=False)
                except zmq.ZMQError:
                    if send.calls:
                        core.send_failed(send.wid, send.calls, time.monotonic())
                    continue
                if io not in sent_to:
                    sent_to.append(io)
            elif kind is Started:
                action[0]._wake_started()  # type: ignore[union-attr,misc]
            elif kind is Progressed:
                action[0]._wake_progress()  # type: ignore[union-attr,misc]
            elif kind is Changed:
                if self._changed is not None:
                    self._changed.set()
                    self._changed = None
            elif kind is Spawn:
                spawn = cast(Spawn, action)
                try:
                    self._spawn(spawn.wid, spawn.secret)
                except Exception as exc:
                    _log.exception("worker %s could not be started", spawn.wid)
                    now = time.monotonic()
                    core.spawn_failed(spawn.wid, f"{type(exc).__name__}: {exc}", now)
            elif kind is Close:
                io = self._io.pop(cast(Close, action).wid, None)
                if io is not None:
                    # Its tasks close the socket as they end (none may wait on it then);
                    # closing the pool closes what is left.
                    io.close_files()
                    self._closing.add(io)
            elif kind is Kill:
                if reaper is not None:
                    reaper.kill_tree(cast(Kill, action).wid)
            elif kind is Terminate:
                if reaper is not None:
                    reaper.signal_tree(cast(Terminate, action).wid, signal.SIGTERM)
            elif kind is Clean:
                if reaper is not None:
                    reaper.clean(cast(Clean, action).wid)
            elif kind is FirstHello:
                warn_inactive_layers(self.profile, self.containment())
            elif kind is Orphaned:
                if self._tg is not None:
                    self._start_task(self._end_orphan, cast(Orphaned, action).wid)
            elif kind is RestartReaper and self._tg is not None:
                self._start_task(self._restart_reaper)
        return sent_to

    def __repr__(self) -> str:
        return f"<toolpool.Pool {self.tools_spec!r} workers={self.size} {self._state}>"


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"{name} must be {what} integer, got {value!r}")
