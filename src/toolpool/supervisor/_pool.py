"""The pool's shell: the public :class:`Pool`, and the I/O its core asks for.

Every decision is the core's (``machine/``: a state machine, events in, actions out). This
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
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal, final

import anyio
import anyio.abc
import zmq

from .._tempdir import make_temp_dir
from ..core import (
    DEFAULT_GRACES,
    CancelCause,
    PoolClosedError,
    UnknownToolError,
    WorkerStartError,
    cancel_with_runtime_cause,
)
from ..protocol import (
    DEFAULT_MAX_FRAME,
    pack_parts,
    pack_value,
)
from ..reaper import CloseReport, ReaperClient, finish_cleanup
from ..sandbox import Profile
from ._calls import Call, Group, await_call
from ._channels import OWED_SUBMITS, Channels
from ._containment import containment_report
from ._events import Listeners, ProviderRemoved, ToolsChanged, frozen_catalog
from ._hosting import (
    DEFAULT_PREFETCH,
    Hosting,
    PoolOptions,
    ProviderOptions,
    StartMethod,
    WorkerOutput,
    checked_profile,
    prepare_layers,
    provider_options,
)
from ._observe import abandon_unsettled, close_report, snapshot, wait_settled_or_stuck
from ._results import CallableDict, CallableList, ContainmentReport, Result, Statistics
from ._workerio import (
    KILL_WAIT,
    WorkerFiles,
    WorkerIO,
)
from .machine import (
    EXIT_TOOLS_FAILED,
    KILLED_TEXT,
    QUEUE_BEHIND_FOR,
    TIMEOUT_TEXT,
    WORKER_LOST_TEXT,
    CallRecord,
    CallState,
    Machine,
)

if TYPE_CHECKING:
    from ._map import MapIterator  # imported by map(): only map's callers pay for it

__all__ = (
    "EXIT_TOOLS_FAILED",
    "KILLED_TEXT",
    "QUEUE_BEHIND_FOR",
    "TIMEOUT_TEXT",
    "WORKER_LOST_TEXT",
    "Call",
    "Group",
    "Pool",
    "Port",
    "port_of",
)

_log = logging.getLogger("toolpool.supervisor")

_DISPOSED: Final = CancelCause("disposed")
_NO_ARGS: Final = pack_value({}, "args")  # (args=None: packed once)
_PARENT: Final = CancelCause("parent")


def _new_secret() -> bytes:
    """A new worker's secret, which its hello must carry."""
    return os.urandom(32).hex().encode()  # secrets.token_hex(32), without its imports


@final
class Pool(Channels, Hosting):
    """A pool of worker processes running the tools of its providers.

    ``tools`` is ``"module:attribute"`` naming a :class:`toolpool.Registry` importable in the
    workers (they see this process's ``sys.path``): the pool's provider named ``"default"``,
    with the worker options below. ``Pool()`` starts with no provider; add them with
    :meth:`add_provider` (``docs/providers.md``).

    >>> async with toolpool.Pool("mytools:registry", workers=4) as pool:  # doctest: +SKIP
    ...     result = await pool.call("nap", {"seconds": 1.5}, timeout=30)
    """

    def __init__(
        self,
        tools: str | None = None,
        *,
        workers: int | None = None,
        cancel_grace: float = DEFAULT_GRACES.cancel,
        term_grace: float = DEFAULT_GRACES.term,
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
        drain_grace: float = DEFAULT_GRACES.drain,
        unkillable_after: float = DEFAULT_GRACES.unkillable_after,
        heartbeat: float | None = 1.0,
        max_calls_per_worker: int | None = None,
    ) -> None:
        """
        :param tools: ``"module:attribute"`` naming the Registry of the ``"default"``
            provider; None: no provider until :meth:`add_provider`.
        :param workers: how many worker processes (each runs one call at a time); None
            (default): one per CPU this process may use (``os.process_cpu_count()`` on
            Python 3.13+, else the size of its affinity mask, ``os.sched_getaffinity(0)``).
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
        :param drain_grace: seconds the running calls of a removed (or reloaded) provider
            have to finish before they get a cooperative cancel with cause ``disposed``.
        :param unkillable_after: seconds after the SIGKILL of a worker's tree after which a
            process of it still there makes the worker ``unkillable`` (uninterruptible
            sleep): it is logged and counted (``statistics()``), replaced at once, and
            reaped whenever it dies; its call settles only then. ``aclose()`` waits no
            longer for it and names it in its report (``docs/pool.md``, "Unkillable
            workers"). A SIGKILLed tree is normally gone within milliseconds.
        :param heartbeat: seconds between each worker's heartbeats, sent by a thread that
            never runs tool code. A worker that sends none for 3 intervals is *hung* (no
            thread of it runs: a C extension holding the GIL), told apart from a tool that
            ignores its signal (``Statistics.hung``, a log line; see ``docs/pool.md``,
            "Liveness"). None: no heartbeats.
        :param max_calls_per_worker: a worker serves this many calls, then exits (reason
            ``retired``) and a new one starts in its place, as ``multiprocessing``'s
            ``maxtasksperchild``: a bound on what a tool leaks in its process (memory,
            state). A call counts once it settled in that worker, unless its body surely
            never started. None (default): workers serve until the pool closes.
        """
        options = PoolOptions(
            cancel_grace=cancel_grace,
            term_grace=term_grace,
            drain_grace=drain_grace,
            unkillable_after=unkillable_after,
            start_timeout=start_timeout,
            max_frame=max_frame,
            max_start_failures=max_start_failures,
            worker_output=worker_output,
            start_method=start_method,
            heartbeat=heartbeat,
        )
        options.check()
        default = None
        if tools is not None:  # the provider "default", with the options that are its own
            default = provider_options(
                "default",
                tools,
                workers=workers,
                profile=profile,
                env=env,
                allow_background=allow_background,
                capture_output=capture_output,
                warm_spares=warm_spares,
                prefetch=prefetch,
                timeout=None,
                max_frame=max_frame,
                max_calls_per_worker=max_calls_per_worker,
            )
        self._files = WorkerFiles()  # the probe: the ledger and cgroup files it holds open
        self._core = Machine(options.core_config(), self._files, _new_secret)
        self._adopt(options, default, profile, env, allow_background)
        self._options: dict[str, ProviderOptions] = {}
        if default is not None:  # entering the machine as any provider does (started by start)
            self._options["default"] = default
            self._core.add_provider("default", default.spec(), time.monotonic())
        self._init_shell()

    def _adopt(
        self,
        options: PoolOptions,
        default: ProviderOptions | None,
        profile: Profile | str,
        env: Mapping[str, str] | None,
        allow_background: bool,
    ) -> None:
        """The pool's public attributes: its own options (as its machine took them), and its
        ``"default"`` provider's (``default``: None for a pool without one)."""
        self.profile = default.profile if default is not None else checked_profile(profile)
        self.tools_spec = default.tools if default is not None else ""
        self.size = default.workers if default is not None else 0
        #: The graces of its calls' escalation, its drains, and its unkillable workers.
        self.graces = self._core.config.graces
        self.cancel_grace, self.term_grace = self.graces.cancel, self.graces.term
        self.drain_grace, self.unkillable_after = self.graces.drain, self.graces.unkillable_after
        self.start_timeout = self._core.config.start_timeout
        self.max_frame = options.max_frame
        self.max_start_failures = options.max_start_failures
        self.worker_output: WorkerOutput = options.worker_output
        self._env = dict(env) if env is not None else None
        self.allow_background = bool(allow_background)
        self.heartbeat = self._core.config.heartbeat
        self.warm_spares = default.warm_spares if default is not None else 0
        self.start_method: StartMethod = options.start_method
        self.prefetch = default.prefetch if default is not None else DEFAULT_PREFETCH
        self.capture_output = default.capture_output if default is not None else None

    def _init_shell(self) -> None:
        """The shell's own state: listeners, the reaper, sockets, calls, tasks."""
        self._listeners = Listeners()
        self._rollbacks: dict[int, tuple[BaseException, list[Any]]] = {}
        self._infos: dict[int, Any] = {}
        self._state: Literal["new", "starting", "running", "closing", "closed"] = "new"
        self._tg: anyio.abc.TaskGroup | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._dir: str | None = None
        self._reaper: ReaperClient | None = None
        self._close_report = CloseReport()
        self._io = self._files.ios  # by worker id
        self._closing: set[WorkerIO] = set()  # gone, their sockets not closed yet
        self._groups: weakref.WeakSet[Group] = weakref.WeakSet()
        self._faces: dict[int, Call] = {}  # the unsettled calls' faces, by id (_calls.py)
        self._call_ids = 0
        self._pumping = False
        self._port = Port(self)  # what its calls, groups and maps may ask of it
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
            self._dir = make_temp_dir("toolpool-")
            # Workers running as other uids must reach their own socket file (theirs, 0600
            # once they own it) by name; nobody but the supervisor can list the directory.
            os.chmod(self._dir, 0o700 if self.profile.user is None else 0o711)
            self._ctx = zmq.Context(io_threads=1)
            await self._start_reaper()
            assert self._reaper is not None
            for options in self._options.values():
                prepare_layers(options, self, subreaper=self._reaper.subreaper)
            self._reaper.own(self._owned())
            self._start_task(self._reaper.run)
            self._start_task(self._clock)
            core.start(time.monotonic())
            self._pump()
            default = core.default
            with anyio.fail_after(self.start_timeout + 5):
                # Ready: every worker said hello, and the reaper said how it started it
                # (the two can come in either order).
                while core.broken is None and default is not None and default.state == "starting":
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

        The one exception: a process that does not die of SIGKILL (uninterruptible sleep).
        Once its worker is ``unkillable`` (``unkillable_after`` seconds after the SIGKILL)
        the close waits no longer for it: the report names such processes
        (``CloseReport.unkillable``) and the calls they keep from settling
        (``CloseReport.unsettled``), and awaiting one of those raises
        :class:`toolpool.PoolClosedError`. The close then takes at most about
        ``cancel_grace + term_grace + unkillable_after`` seconds more than its calls do.

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
            if core.providers:  # consumers mirroring the pool drop what they derived
                for name in list(core.providers):
                    self._listeners.emit(ProviderRemoved(name, "closed"))
                self._listeners.emit(ToolsChanged(frozen_catalog({})))
            core.closing = True
            for group in list(self._groups):
                cancel_with_runtime_cause(group._record._controller, _DISPOSED)
            core.close(time.monotonic())
            self._pump()
            await wait_settled_or_stuck(self._core, self._faces, self._wait_changed)
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
        try:
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
        finally:
            # Closed even if a task of the pool failed (its error is raised here): a later
            # aclose() must not wait for a close that already ended.
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
        unkillable, unsettled = abandon_unsettled(self._core, self._files, self._faces)
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
        cgroups_left: list[str] = []
        for options in self._options.values():
            if options.cgroups is not None:
                cgroups_left += options.cgroups.remove()
                options.cgroups = None
        if self._dir is not None:
            self._close_report = await finish_cleanup(self._dir, self._reaper)
            self._dir = None
        self._close_report = close_report(self._close_report, unkillable, unsettled, cgroups_left)

    async def _wait_all_gone(self) -> None:
        """Until every worker is gone, or unkillable (which may never go)."""
        while not self._core.all_gone_or_unkillable():
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
        return self._submit(tool, args, timeout, None)  # (by position: cheaper)

    async def call(
        self, tool: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Result:
        """Submit a call and wait for its result.

        If the awaiting task is cancelled, the cancellation reaches it at once; the call gets a
        cooperative cancel with cause ``parent``, escalates per policy and is tracked until it
        settles (CONTRACT C4.5).
        """
        return await await_call(self.submit(tool, args, timeout=timeout))

    def map(
        self,
        tool: str,
        args_iterable: Iterable[Any],
        *,
        timeout: float | None = None,
        ordered: bool = False,
        max_in_flight: int | None = None,
    ) -> MapIterator:
        """The settled results of ``tool`` called once per item of ``args_iterable`` (a
        mapping of arguments each, as :meth:`submit` takes; for a tool with one parameter,
        its value), pulled lazily: an async iterator; see :class:`toolpool.MapIterator`.
        Bad arguments raise here, at once."""
        from ._map import MapIterator

        return MapIterator(
            self._port,
            tool,
            args_iterable,
            timeout=timeout,
            ordered=ordered,
            max_in_flight=max_in_flight,
        )

    def group(self) -> Group:
        """A new group (turn) with a fresh cancel signal (CONTRACT C5)."""
        self._check_open()
        group = Group(self._port)
        self._groups.add(group)
        return group

    @property
    def catalog(self) -> Mapping[str, Mapping[str, Any]]:
        """The tools of the active providers, by name: JSON-compatible descriptions, each
        naming its ``provider`` and where it runs (``runs_in``, see :class:`ProviderInfo`)."""
        return MappingProxyType(self._catalog_now())

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
        """Wait until no call is queued or running (a call held by an ``unkillable`` worker
        runs until its tree is gone)."""
        faces = self._faces  # (a call settled in the core, but not performed yet, is here)
        while faces:
            await next(iter(faces.values())).wait()

    def statistics(self, provider: str | None = None) -> Statistics:
        """A frozen snapshot of the pool, or (``provider``) of one provider's part of it: its
        workers, and the calls of its tools (counted under the provider that had the tool
        when the call was submitted; kept after a removal, summed over its generations)."""
        if provider is not None and provider not in self._core.tallies:
            raise LookupError(f"no provider named {provider!r}")
        return snapshot(self._core, self._files, time.monotonic(), provider)

    def provider_statistics(self) -> Mapping[str, Statistics]:
        """:meth:`statistics` of each provider the pool has or had (a removed one's counters
        stay, never going back), by name; and, under ``""``, of the calls no provider took
        (a tool gone by the time they were queued), when there are some. What
        :mod:`toolpool.metrics` reads at a scrape."""
        tallies, now = self._core.tallies, time.monotonic()
        out = {name: snapshot(self._core, self._files, now, name) for name in tallies if name}
        if tallies[""].submitted:
            out[""] = snapshot(self._core, self._files, now, "")
        return out

    def containment(self, provider: str = "default") -> ContainmentReport:
        """What protects a provider's workers (by default, the ``"default"`` provider's),
        layer by layer: active or not, and why.

        Worker-side layers (rlimits, network namespace) are as its first worker reported them.
        """
        options = self._options.get(provider)
        if options is None:
            if provider != "default" or self._options:
                raise LookupError(f"no provider named {provider!r}")
            return containment_report(self.profile, {}, None)  # (a pool with no provider)
        core = self._core
        return self._report(options, core.providers.get(provider) or core.pending.get(provider))

    def _prepare(self, options: ProviderOptions) -> None:
        assert self._reaper is not None
        if options.profile.user is not None and self._dir is not None:
            os.chmod(self._dir, 0o711)  # (as in start: its workers reach their socket by name)
        prepare_layers(options, self, subreaper=self._reaper.subreaper)
        self._reaper.own(self._owned())

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
        timeout: float | None,
        group: Group | None,
        index: int | None = None,
    ) -> Call:
        core = self._core
        if self._state != "running" or core.s.broken is not None:
            self._check_open()
        if not isinstance(tool, str):
            raise TypeError(f"a tool name is a str, not {type(tool).__name__}")
        provider = core.owner.get(tool)
        if provider is None:
            raise UnknownToolError(
                f"no worker provides a tool named {tool!r}; known: {sorted(core.catalog)}"
            )
        if provider.broken is not None:
            raise provider.broken
        parts: Sequence[bytes] = ()  # (no list made where there are none)
        if args is None:
            packed = _NO_ARGS  # (1 byte: it fits any max_frame)
        else:
            if type(args) is dict or isinstance(args, Mapping):
                # Large byte strings become parts, sent after the call's frame: a bytes is
                # not copied (immutable), a bytearray once, now (a later change of the
                # caller's does not reach the call).
                packed, parts = pack_parts(args if type(args) is dict else dict(args), "args")
            else:
                raise TypeError(f"args must be a mapping, not {type(args).__name__}")
            size = len(packed) + sum(len(p) for p in parts) if parts else len(packed)
            if size > self.max_frame - 1024:
                raise ValueError(
                    f"args of {size} bytes exceed the {self.max_frame - 1024} bytes a "
                    f"call can carry (max_frame={self.max_frame}, less 1,024 for the call's "
                    "own fields)"
                )
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if timeout is None:
            timeout = self._options[provider.name].timeout
        now = time.monotonic()
        self._call_ids += 1
        record = CallRecord(self._call_ids, tool, packed, group and group._record, now)
        if parts:
            record._parts = tuple(parts)
        record._index = index
        call = self._faces[record.id] = Call(self._port, record)
        core.submit(record, timeout, now)  # (by position: keywords cost every call more)
        if record._facts is not None:
            self._pump()  # settled at once (its group was cancelled): done on return
        elif self._pump_owed and self._owed_submits < OWED_SUBMITS - 1:
            self._owed_submits += 1  # (_owe_pump, inline: one more submit of a burst)
        else:
            self._owe_pump()  # (one pump, soon, for a burst of submits)
        return call

    def _cancel(self, call: Call, cause: CancelCause, *, force: bool) -> None:
        record = call._record
        if record._state is CallState.SETTLED:
            return
        self._core.cancel(record, cause, force=force, now=time.monotonic())
        self._pump()

    def _group_cancelled(self, group: Group, cause: CancelCause) -> None:
        self._core.cancel_group(group._record, cause, time.monotonic())
        self._pump()

    def __repr__(self) -> str:
        return f"<toolpool.Pool {self.tools_spec!r} workers={self.size} {self._state}>"


@final
class Port:
    """The pool's side of :class:`~._calls.PoolPort`: what its calls, groups and maps may
    ask of it (they hold this, never the pool's private attributes)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    @property
    def catalog(self) -> Mapping[str, Mapping[str, Any]]:
        return self._pool.catalog

    @property
    def size(self) -> int:
        return self._pool.size

    @property
    def prefetch(self) -> int:
        return self._pool.prefetch

    def check_open(self) -> None:
        self._pool._check_open()

    def submit_call(
        self,
        tool: str,
        args: Mapping[str, Any] | None,
        *,
        timeout: float | None,
        group: Group | None,
        index: int | None = None,
    ) -> Call:
        return self._pool._submit(tool, args, timeout=timeout, group=group, index=index)

    def cancel_call(self, call: Call, cause: CancelCause, *, force: bool) -> None:
        self._pool._cancel(call, cause, force=force)

    def cancel_group(self, group: Group, cause: CancelCause) -> None:
        self._pool._group_cancelled(group, cause)

    def call_of(self, call_id: int) -> Call | None:
        return self._pool._faces.get(call_id)

    def unsettled(self) -> list[Call]:
        """The faces of the calls not settled yet (a snapshot)."""
        return list(self._pool._faces.values())

    def new_group(self) -> Group:
        return self._pool.group()

    @contextmanager
    def batch(self) -> Iterator[None]:
        pool = self._pool
        pumping, pool._pumping = pool._pumping, True  # one pump for the whole batch
        try:
            yield
        finally:
            pool._pumping = pumping
            if not pumping:
                pool._pump()


def port_of(pool: Pool) -> Port:
    """``pool``'s port (for ``SyncPool.map``, whose map runs in the pool's loop)."""
    return pool._port
