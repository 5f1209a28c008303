"""The pool's shell: the public :class:`Pool`, and the I/O its core asks for.

Every decision is the core's (``_core.py``: a state machine, events in, actions out). This
file only turns the world into events (a worker's messages and its connection, the reaper's
reports, time) and performs the actions (send frames, start workers, signal trees, wake
callers). The tasks: one reader and one connection watcher per worker socket, the reaper's
event pump, and one clock; plus, rarely, the end of an orphaned worker's tree and the start
of a new reaper after the old one died.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import struct
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from types import MappingProxyType, TracebackType
from typing import Any, Final, Literal, cast, final

import anyio
import anyio.abc
import zmq

from .._transport import fd_of, on_readable, readable
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
    ProtocolViolation,
    decode_from_worker,
    pack_value,
)
from ..protocol._ledger import LEDGER_SIZE, read_ledger, read_marks
from ..reaper import ReaperClient
from ..sandbox import Profile, parse_size
from ..sandbox import _cgroups as cgroups
from ..sandbox._cgroups import CgroupSet, others_listed
from ._calls import Call, Group, await_call
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
    RestartReaper,
    Send,
    Settled,
    Spawn,
    Started,
    Terminate,
)
from ._results import ContainmentReport, Result, Statistics, WorkerState
from ._state import CoreConfig

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
#: How long closing waits for a worker's tree to go after SIGKILL before it reports it.
_KILL_WAIT: Final = 30.0


class _WorkerIO:
    """What the shell holds for one worker: its socket, files and directories."""

    __slots__ = (
        "cleanup",
        "endpoint",
        "groups",
        "kill_dir",
        "ledger_fd",
        "members_fd",
        "members_file",
        "peak_fd",
        "scopes",
        "sock",
        "wid",
    )

    def __init__(self, wid: int, endpoint: str, sock: zmq.Socket[bytes], ledger_fd: int) -> None:
        self.wid = wid
        self.endpoint = endpoint
        self.sock = sock
        self.ledger_fd: int | None = ledger_fd  # its ledger file, read with pread
        self.members_file: str | None = None  # its cgroup's cgroup.procs: who is in its tree
        self.members_fd: int | None = None  # the same, kept open (v2: pread re-reads it)
        self.peak_fd: int | None = None  # its cgroup's peak memory file, kept open
        self.kill_dir: str | None = None  # its v2 cgroup
        self.groups: list[str] = []  # its cgroup directories
        self.cleanup: list[str] = []  # what to remove once its tree is gone
        self.scopes: list[anyio.CancelScope] = []

    def close_files(self) -> None:
        """Close its files and end its tasks (the reader closes the socket as it ends)."""
        for name in ("peak_fd", "members_fd", "ledger_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        for scope in self.scopes:
            scope.cancel()

    def close(self) -> None:
        self.close_files()
        if not self.sock.closed:
            # Stop the monitor before anything closes: libzmq's I/O thread blocks for good
            # on a monitor event whose reader is gone, freezing every socket of the context.
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            try:
                anyio.notify_closing(fd_of(self.sock))
            except Exception:
                pass
            self.sock.close(linger=0)


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
        _check_count("workers", workers, minimum=1)
        _check_count("max_start_failures", max_start_failures, minimum=1)
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
            ),
            self,  # the probe: the ledger and cgroup files it holds open
            lambda: secrets.token_hex(32).encode(),
        )
        self._cgroups: CgroupSet | None = None
        self._supervisor_layers: dict[str, tuple[bool, str]] = {}
        self._state: Literal["new", "starting", "running", "closing", "closed"] = "new"
        self._tg: anyio.abc.TaskGroup | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._dir: str | None = None
        self._reaper: ReaperClient | None = None
        self._io: dict[int, _WorkerIO] = {}
        self._closing: set[_WorkerIO] = set()  # gone, their sockets not closed yet
        self._groups: weakref.WeakSet[Group] = weakref.WeakSet()
        self._call_ids = 0
        self._pumping = False
        self._clock_at = math.inf  # when the clock task next wakes
        self._clock_wake: anyio.Event | None = None
        self._closed_event: anyio.Event | None = None
        self._changed: anyio.Event | None = None
        self._fork_warned = False

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
            self._reaper = await self._start_reaper()
            self._supervisor_layers, self._cgroups = supervisor_layers(
                self.profile,
                subreaper=self._reaper.subreaper,
                cgroup_name=f"toolpool-{os.getpid()}-{id(self):x}",
            )
            self._reaper.own(self._owned())
            self._tg.start_soon(self._reaper.run)
            self._tg.start_soon(self._clock)
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

    async def _start_reaper(self) -> ReaperClient:
        reaper = ReaperClient(self._on_reaper_event)
        await reaper.start(self.start_timeout)
        if self.start_method == "fork":  # the reaper imports while we set up the rest
            paths = self._worker_env(None)["PYTHONPATH"].split(os.pathsep)
            reaper.preload(paths)
        return reaper

    def _owned(self) -> list[str]:
        """The pool's directories, for the reaper to remove should the supervisor die."""
        assert self._dir is not None
        bases = sorted(set(self._cgroups.base.values())) if self._cgroups else []
        return [self._dir, *bases]

    async def aclose(self) -> None:
        """Cancel every call with cause ``disposed`` and stop every worker (CONTRACT C5.3).

        Returns only when every call has settled and every worker process, and everything
        it spawned, is gone. Idempotent.

        Call it from the task and the cancel-scope nesting that called :meth:`start` (not,
        say, inside a ``fail_after`` entered after ``start()``): the pool's anyio task group
        must be left in order. Otherwise anyio raises RuntimeError, after every call has
        settled and every process is gone. ``async with Pool(...)`` gets this right.
        """
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        if self._state == "closing":
            assert self._closed_event is not None
            await self._closed_event.wait()
            return
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

    async def _exit_task_group(self) -> None:
        tg, self._tg = self._tg, None
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
        with anyio.move_on_after(_KILL_WAIT):
            await self._wait_all_gone()
        if self._reaper is not None:
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
            shutil.rmtree(self._dir, ignore_errors=True)
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

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes that are alive now."""
        return [w.pid for w in self._core.live_workers() if w.pid is not None]

    def worker_start_methods(self) -> dict[int, str]:
        """How each live worker was started, by pid: ``"fork"`` (from the reaper's template)
        or ``"spawn"`` (a new interpreter). A worker the reaper has not reported yet (a
        replacement, a moment after it started) is not listed."""
        return {
            w.pid: w.start_method
            for w in self._core.live_workers()
            if w.pid is not None and w.start_method is not None
        }

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
        packed = pack_value(dict(args))
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
                sent_to = self._perform(actions)
                for io in sent_to:
                    if not io.sock.closed and readable(io.sock):
                        self._read(io)
        finally:
            self._pumping = False
        when = core.next_deadline()
        if when is not None and when < self._clock_at and self._clock_wake is not None:
            self._clock_wake.set()

    def _perform(self, actions: list[Action]) -> list[_WorkerIO]:
        """Perform the core's actions in order; return the workers sent to."""
        sent_to: list[_WorkerIO] = []
        core = self._core
        reaper = self._reaper if core.reaper_up else None
        for action in actions:
            kind = type(action)
            if kind is Settled:
                cast(Call, cast(Settled, action).call)._wake()
            elif kind is Send:
                send = cast(Send, action)
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
                cast(Call, cast(Started, action).call)._wake_started()
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
                    self._tg.start_soon(self._end_orphan, cast(Orphaned, action).wid)
            elif kind is RestartReaper and self._tg is not None:
                self._tg.start_soon(self._restart_reaper)
        return sent_to

    # ------------------------------------------------------------------ the probe

    def marks(self, wid: int) -> tuple[int, int] | None:
        io = self._io.get(wid)
        if io is None or io.ledger_fd is None:
            return None
        try:
            data = os.pread(io.ledger_fd, 16, 0)
        except OSError:
            return None
        return read_marks(data)

    def ledger(self, wid: int) -> tuple[tuple[int, int], list[tuple[int, bytes]]] | None:
        io = self._io.get(wid)
        if io is None or io.ledger_fd is None:
            return None
        fd, io.ledger_fd = io.ledger_fd, None
        try:
            data = os.pread(fd, LEDGER_SIZE, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        taken, invoked, kept = read_ledger(data)
        return (taken, invoked), kept

    def other_members(self, wid: int, pid: int | None) -> int | None:
        """How many processes other than the worker its cgroup lists (1 us with the v2 file
        kept open; about 10 us opening it)."""
        io = self._io.get(wid)
        if io is None:
            return None
        try:
            if io.members_fd is not None:
                listed = os.pread(io.members_fd, 1 << 16, 0)
            elif io.members_file is not None:
                with open(io.members_file, "rb") as f:
                    listed = f.read()
            else:
                return None
        except OSError:
            return 0
        return others_listed(listed, pid)

    def peak(self, wid: int) -> int | None:
        io = self._io.get(wid)
        if io is None or io.peak_fd is None:
            return None
        try:
            return int(os.pread(io.peak_fd, 64, 0))
        except (OSError, ValueError):
            return None

    def reset_peak(self, wid: int) -> None:
        """Start the tree's peak memory afresh (cgroup v1: writing 0 resets it)."""
        io = self._io.get(wid)
        if io is not None and io.peak_fd is not None:
            try:
                os.pwrite(io.peak_fd, b"0", 0)
            except OSError:
                pass

    # ------------------------------------------------------------------ workers

    def _spawn(self, wid: int, secret: bytes) -> None:
        assert self._ctx is not None
        assert self._dir is not None
        assert self._reaper is not None
        assert self._tg is not None
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
        io = _WorkerIO(wid, endpoint, sock, ledger_fd)
        self._io[wid] = io
        profile = self.profile
        io.cleanup = [sock_dir]
        procs: list[str] = []
        if self._cgroups is not None and self._cgroups.base:
            wc = self._cgroups.for_worker(
                wid, memory=profile.memory, max_processes=profile.max_processes
            )
            procs = wc.procs_files
            io.kill_dir = wc.kill_dir
            io.groups = sorted(set(wc.dirs.values()))
            if io.kill_dir is not None:  # v2 regenerates cgroup.procs on each read from 0
                io.members_file = os.path.join(io.kill_dir, "cgroup.procs")
                io.members_fd = os.open(io.members_file, os.O_RDONLY | os.O_CLOEXEC)
            elif procs:  # v1 caches the list per open file: open it each time
                io.members_file = procs[0]
            io.cleanup.extend(io.groups)
            memory_dir = wc.dirs.get("memory", "/nonexistent")
            peak = os.path.join(memory_dir, "memory.max_usage_in_bytes")
            if os.path.exists(peak):
                # Kept open: a write and a read per call cost 1 us so, 20 us opening it each
                # time. (Where writing resets the peak per open file, this is also the file.)
                # Where it cannot be reset, no peak is reported: it would not be the call's.
                try:
                    io.peak_fd = os.open(peak, os.O_RDWR | os.O_CLOEXEC)
                except OSError:
                    io.peak_fd = None
        scratch: str | None = None
        if profile.scratch_dir:
            scratch = os.path.join(self._dir, f"scratch-w{wid}")
            os.mkdir(scratch, 0o700)
            io.cleanup.append(scratch)
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
            io.members_file if io.members_fd is not None and io.members_file else "",
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
            cgroup=io.kill_dir,
            groups=io.groups,
            cleanup=io.cleanup,
            start=self.start_method,
        )
        self._tg.start_soon(self._serve_worker, io)
        self._tg.start_soon(self._watch_disconnect, io)

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

    async def _serve_worker(self, io: _WorkerIO) -> None:
        """Read the worker's messages until it is gone (its ``Close`` cancels this)."""
        fd = fd_of(io.sock)
        try:
            with _scope(io), on_readable(fd, functools.partial(self._on_readable, io)) as on:
                self._on_readable(io)
                if on:  # asyncio: messages are handled right in the reader callback
                    await anyio.sleep_forever()
                while not io.sock.closed:
                    await anyio.wait_readable(fd)
                    self._on_readable(io)
        finally:
            if io.wid not in self._io:  # gone (else: closing the pool closes it)
                io.close()
                self._closing.discard(io)

    def _on_readable(self, io: _WorkerIO) -> None:
        if not io.sock.closed:
            self._read(io)
            self._pump()

    def _read(self, io: _WorkerIO) -> None:
        """Hand the core every message readable on the worker's socket (no actions yet)."""
        sock = io.sock
        core = self._core
        wid = io.wid
        max_frame = self.max_frame
        while not sock.closed and readable(sock):
            w = core.workers.get(wid)
            peer_pid: int | None = None
            if w is not None and w.state is WorkerState.SPAWNING:
                # Its hello: note who really sent it.
                zframe = sock.recv(zmq.NOBLOCK, copy=False)
                peer_pid = _peer_pid(zframe)
                frames = [zframe.bytes]
            else:
                # All parts of one message (results held back come as one): one check of
                # the socket's events per message, not per frame (each costs zmq a look at
                # its command mailbox, a good part of a quick call's cost).
                frames = sock.recv_multipart(zmq.NOBLOCK)
            now = time.monotonic()
            for frame in frames:
                try:
                    msg = decode_from_worker(frame, max_len=max_frame)
                except ProtocolViolation as exc:
                    core.violation(wid, f"protocol violation: {exc}", now)
                    continue
                try:
                    core.message(wid, msg, now, peer_pid=peer_pid)
                except Exception as exc:  # a gap in the core must never take the pool down
                    _log.exception("worker %s: unexpected error handling its message", wid)
                    core.violation(wid, f"protocol violation: {type(exc).__name__}: {exc}", now)

    async def _watch_disconnect(self, io: _WorkerIO) -> None:
        """Notice a dropped connection (an oversized frame makes zmq disconnect the peer).

        Only the worker's own connection counts: the first one accepted (the worker connects
        before any tool code runs; a PAIR socket refuses a second peer while it has one). A
        stranger that connects and leaves cannot get the worker killed.
        """
        monitor = io.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        own_fd: int | None = None
        fd = fd_of(monitor)
        try:
            with _scope(io):
                while not io.sock.closed:
                    while readable(monitor):
                        frames = monitor.recv_multipart(zmq.NOBLOCK)
                        event, value = struct.unpack("=HI", frames[0][:6])
                        if event == zmq.EVENT_ACCEPTED:
                            if own_fd is None:
                                own_fd = value
                            continue
                        if value != own_fd:
                            _log.warning("worker %s: a stranger connected to its socket", io.wid)
                            continue
                        if event == zmq.EVENT_DISCONNECTED and not io.sock.closed:
                            self._read(io)  # take what it sent before the drop
                            self._core.disconnected(io.wid, time.monotonic())
                            self._pump()
                    await anyio.wait_readable(fd)
        finally:
            # Disable the monitor before its reader closes (see _WorkerIO.close); if the
            # worker's socket is already closed, that disabled it first.
            try:
                if not io.sock.closed:
                    io.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)

    # ------------------------------------------------------------------ the reaper

    def _on_reaper_event(self, event: dict[str, Any]) -> None:
        kind = event.get("ev")
        core = self._core
        now = time.monotonic()
        if kind == "lost":
            core.reaper_lost(now)
            self._pump()
            return
        wid = int(event.get("wid", 0))
        io = self._io.get(wid)
        if kind == "spawned":
            core.spawned(wid, int(event["pid"]), str(event.get("method", "spawn")), now)
        elif kind == "fork_unavailable":
            if not self._fork_warned:
                self._fork_warned = True
                _log.warning("workers are spawned, not forked: %s", event.get("reason"))
        elif kind == "spawn_failed":
            core.spawn_failed(wid, str(event.get("error")), now)
        elif kind == "exited":
            if io is not None:
                self._read(io)  # its 'fatal' may already be here
            core.exited(wid, int(event["status"]), int(event.get("oom_kills", 0)), now)
        elif kind == "gone":
            if io is not None:
                self._read(io)  # what it sent before it died counts
            core.gone(wid, now)
        elif kind == "cleaned":
            core.cleaned(wid, int(event.get("count", 0)), now)
        elif kind == "stuck":
            _log.error("worker %s: its cgroup would not empty; still trying", wid)
        self._pump()

    async def _end_orphan(self, wid: int) -> None:
        """The reaper died: end worker ``wid``'s tree without it and report it gone. With a
        cgroup the tree is killed through it and verified empty; without one, only the
        worker's own death can be seen (the result says its tree was not verified)."""
        io = self._io.get(wid)
        w = self._core.workers.get(wid)
        verified = False
        if io is not None and io.groups:
            verified = await anyio.to_thread.run_sync(_empty_cgroups, io.kill_dir, io.groups)
        if w is not None and w.pid is not None:
            with anyio.move_on_after(_KILL_WAIT):
                await _wait_pid_gone(w.pid)
        if io is not None:
            if verified:
                for path in reversed(io.cleanup):
                    _remove_dir(path)
            self._read(io)  # what it sent before it died counts
        self._core.gone(wid, time.monotonic(), verified=verified)
        self._pump()

    async def _restart_reaper(self) -> None:
        """Every worker of the dead reaper is gone: start a new one (its old client and
        socket are done)."""
        old, self._reaper = self._reaper, None
        if old is not None:
            await old.aclose()
        try:
            reaper = await self._start_reaper()
        except Exception as exc:
            self._core.reaper_failed(f"{type(exc).__name__}: {exc}", time.monotonic())
            self._pump()
            return
        self._reaper = reaper
        reaper.own(self._owned())
        if self._tg is not None:
            self._tg.start_soon(reaper.run)
        self._core.reaper_ready(time.monotonic())
        self._pump()

    # ------------------------------------------------------------------ the clock

    async def _clock(self) -> None:
        core = self._core
        while True:
            self._clock_wake = anyio.Event()
            when = core.next_deadline()
            self._clock_at = math.inf if when is None else when
            delay = self._clock_at - time.monotonic()
            if delay > 0:
                with anyio.move_on_after(delay):
                    await self._clock_wake.wait()
            now = time.monotonic()
            if now >= self._clock_at:
                core.timer(now)
                self._pump()

    def __repr__(self) -> str:
        return f"<toolpool.Pool {self.tools_spec!r} workers={self.size} {self._state}>"


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"{name} must be {what} integer, got {value!r}")


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


def _empty_cgroups(kill_dir: str | None, groups: list[str]) -> bool:
    """Kill every process in a worker's cgroups (v2: ``cgroup.kill``; v1: each member) until
    none is left; True once they are verified empty (blocking: run in a thread)."""
    deadline = time.monotonic() + _KILL_WAIT
    while time.monotonic() < deadline:
        if kill_dir is not None:
            cgroups.cgroup_kill(kill_dir)
            cgroups.wait_empty(kill_dir, 0.2)
        members = cgroups.members(groups)
        if not members and (kill_dir is None or not cgroups.populated(kill_dir)):
            return True
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)  # a killed process leaves its cgroup once it has exited
    return False


def _remove_dir(path: str) -> None:
    if os.path.exists(os.path.join(path, "cgroup.procs")):
        cgroups.remove(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


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


def _scope(io: _WorkerIO) -> anyio.CancelScope:
    scope = anyio.CancelScope()
    io.scopes.append(scope)
    if io.sock.closed:
        scope.cancel()
    return scope
