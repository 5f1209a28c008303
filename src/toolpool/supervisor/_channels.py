"""The shell's channels: starting a worker (its socket, files, the reaper's spawn), reading
what it sends, watching its connection; the reaper's reports; the clock (the core's timers);
and, after the reaper died, ending its workers' trees without it and starting a new one.
Each turns what happens into an event of the machine (``machine/``); ``_pump`` then performs
what the core asks."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import signal
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import anyio.abc
import zmq

from .._transport import fd_of, on_readable, readable
from ..protocol import ProtocolViolation, decode_from_worker
from ..protocol._reaper import (
    CleanedReport,
    ExitedReport,
    ForkUnavailableReport,
    GoneReport,
    LostReport,
    ReaperReport,
    SpawnedReport,
    SpawnFailedReport,
    StuckReport,
)
from ..reaper import ReaperClient
from ..sandbox import Profile
from ._containment import warn_inactive_layers
from ._hosting import ProviderOptions
from ._results import ContainmentReport, WorkerState
from ._workerio import (
    KILL_WAIT,
    ORPHAN_LOOK_EVERY,
    ORPHAN_LOOK_FOR,
    WorkerFiles,
    WorkerIO,
    empty_cgroups,
    end_group,
    open_worker,
    peer_pid,
    remove_dir,
    scope,
    wait_pid_gone,
    worker_env,
)
from .machine import (
    Action,
    CallRecord,
    Changed,
    Clean,
    Close,
    FirstHello,
    Kill,
    Machine,
    Orphaned,
    Progressed,
    ProviderDown,
    ProviderUp,
    Resized,
    RestartReaper,
    Send,
    Spawn,
    Started,
    Terminate,
    Unkillable,
    WorkerDown,
    WorkerUp,
)

__all__ = ("Channels",)

if TYPE_CHECKING:
    from ._calls import Call

_log = logging.getLogger("toolpool.supervisor")
_EVENTS: Final = int(zmq.EVENTS)
_NOBLOCK: Final = int(zmq.NOBLOCK)  # (a plain int: an enum member is a slow read, twice a call)
_POLLIN: Final = int(zmq.POLLIN)
#: What the listeners hear of (``_hosting.py``). An unkillable worker is out of service: the
#: pool reaps it in the background (``docs/pool.md``, "Unkillable workers").
#: In a burst of submits (no loop turn between them), a pump every this many: one dispatch
#: pass for them all, and the workers fed while the burst lasts.
OWED_SUBMITS: Final = 16
_SPAWNING: Final = WorkerState.SPAWNING  # (bound once: read for every message)
_PROVIDER_ACTIONS: Final = (
    ProviderUp,
    ProviderDown,
    Resized,
    WorkerUp,
    WorkerDown,
    Unkillable,
)


def _loop_soon() -> Callable[[Callable[[], object]], object]:
    """The running event loop's way to run a callback soon (RuntimeError: no loop runs)."""
    try:
        return asyncio.get_running_loop().call_soon
    except RuntimeError:
        pass
    try:
        import trio  # (anyio's other backend: imported only where it runs)

        return trio.lowlevel.current_trio_token().run_sync_soon
    except (ImportError, RuntimeError):
        raise RuntimeError("no event loop runs") from None


class Channels:
    """The part of :class:`toolpool.Pool` that talks to its workers and its reaper."""

    # (the pool's, set in Pool.__init__ and Pool.start)
    max_frame: int
    start_timeout: float
    start_method: str
    profile: Profile
    heartbeat: float | None
    worker_output: str
    _env: Mapping[str, str] | None
    _options: dict[str, ProviderOptions]
    _core: Machine
    _faces: dict[int, Call]
    _io: dict[int, WorkerIO]
    _files: WorkerFiles
    _closing: set[WorkerIO]
    _ctx: zmq.Context[zmq.Socket[bytes]] | None
    _dir: str | None
    _reaper: ReaperClient | None
    _tg: anyio.abc.TaskGroup | None
    _fork_warned: bool
    _reaper_closing: bool
    _pumping: bool
    _clock_at: float
    _clock_wake: anyio.Event | None
    _changed: anyio.Event | None

    # (Pool's and Hosting's: annotations only, never stubs, which would shadow them)
    containment: Callable[..., ContainmentReport]
    _on_provider_action: Callable[[Any], None]

    def _start_task(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        raise NotImplementedError

    async def _start_reaper(self) -> ReaperClient:
        # The pool's from the start: a close meanwhile closes it too (its process included).
        reaper = self._reaper = ReaperClient(self._on_reaper_event)
        paths = None
        if self.start_method == "fork":  # the reaper imports while we set up the rest
            paths = worker_env(self._env, self.profile, None)["PYTHONPATH"].split(os.pathsep)
        await reaper.start(self.start_timeout, preload=paths)
        return reaper

    def _owned(self) -> list[str]:
        """The pool's directories, for the reaper to remove should the supervisor die."""
        assert self._dir is not None
        bases = {
            base
            for options in self._options.values()
            if options.cgroups is not None
            for base in options.cgroups.base.values()
        }
        return [self._dir, *sorted(bases)]

    # ------------------------------------------------------------------ workers

    def _spawn(self, wid: int, secret: bytes, provider: str) -> None:
        assert self._ctx is not None
        assert self._dir is not None
        assert self._reaper is not None
        assert self._tg is not None
        options = self._options[provider]
        profile = options.profile
        io = open_worker(
            self._ctx,
            self._dir,
            wid,
            max_frame=self.max_frame,
            profile=profile,
            cgroup_set=options.cgroups,
        )
        self._files.add(io)  # (into self._io)
        argv = [
            sys.executable,
            "-m",
            "toolpool.worker",
            "--endpoint",
            io.endpoint,
            "--tools",
            options.tools,
            "--parent-pid",
            str(self._reaper.pid),
            "--max-frame",
            str(self.max_frame),
            "--profile",
            json.dumps(profile.to_wire()),
            "--cgroup-procs",
            ",".join(io.procs),
            "--capture",
            str(options.capture_output or 0),
            "--ledger",
            io.ledger,
            "--members",
            io.members_file if io.members_fd is not None and io.members_file else "",
        ]
        if self.heartbeat is not None:
            argv += ["--heartbeat", repr(self.heartbeat)]
        if options.allow_background:
            argv.append("--allow-background")
        # Watched before the worker can connect: its accept is the first event.
        io.monitor = io.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._reaper.spawn(
            wid,
            argv,
            env=worker_env(options.env, profile, io.scratch),
            stdin=secret + b"\n",
            output=self.worker_output,
            cwd=io.scratch,
            cgroup=io.kill_dir,
            groups=io.groups,
            cleanup=io.cleanup,
            start=self.start_method,
        )
        self._start_task(self._serve_worker, io)
        self._start_task(self._watch_disconnect, io)

    async def _serve_worker(self, io: WorkerIO) -> None:
        """Read the worker's messages until it is gone (its ``Close`` cancels this)."""
        fd = fd_of(io.sock)
        try:
            with scope(io), on_readable(fd, functools.partial(self._on_readable, io)) as on:
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

    def _on_readable(self, io: WorkerIO) -> None:
        if not io.sock.closed:
            self._read(io)
            self._pump()

    def _read(self, io: WorkerIO) -> bool:
        """Hand the core every message readable on the worker's socket (no actions yet);
        True if there was one."""
        sock = io.sock
        core = self._core
        wid = io.wid
        max_frame = self.max_frame
        got = False
        # (readable(sock), inline: twice per call; EVENTS is an int option)
        while not sock.closed and sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]
            got = True
            w = core.workers.get(wid)
            sender: int | None = None
            if w is not None and w.state is _SPAWNING:
                # Its hello: note who really sent it.
                zframe = sock.recv(zmq.NOBLOCK, copy=False)
                sender = peer_pid(zframe)
                frames = [zframe.bytes]
            else:
                # All parts of one message (results held back come as one): one check of
                # the socket's events per message, not per frame (each costs zmq a look at
                # its command mailbox, a good part of a quick call's cost).
                frames = sock.recv_multipart(_NOBLOCK)
            now = time.monotonic()
            for frame in frames:
                try:
                    msg = decode_from_worker(frame, max_len=max_frame)
                except ProtocolViolation as exc:
                    core.violation(wid, f"protocol violation: {exc}", now)
                    continue
                try:
                    core.message(wid, msg, now, sender)  # (peer_pid: by position, cheaper)
                except Exception as exc:  # a gap in the core must never take the pool down
                    _log.exception("worker %s: unexpected error handling its message", wid)
                    core.violation(wid, f"protocol violation: {type(exc).__name__}: {exc}", now)
        return got

    async def _watch_disconnect(self, io: WorkerIO) -> None:
        """Notice a dropped connection (an oversized frame makes zmq disconnect the peer).

        Only the worker's own connection counts: the first one accepted (the worker connects
        before any tool code runs; a PAIR socket refuses a second peer while it has one). A
        stranger that connects and leaves cannot get the worker killed.
        """
        monitor, io.monitor = io.monitor, None  # (ours to close from now on)
        assert monitor is not None
        own_fd: int | None = None
        fd = fd_of(monitor)
        try:
            with scope(io):
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
            # Disable the monitor before its reader closes (see WorkerIO.close); if the
            # worker's socket is already closed, that disabled it first.
            try:
                if not io.sock.closed:
                    io.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)

    # ------------------------------------------------------------------ the reaper

    def _on_reaper_event(self, report: ReaperReport) -> None:
        """One report of the reaper (decoded and checked by its client), to the core."""
        core = self._core
        now = time.monotonic()
        kind = type(report)
        if kind is GoneReport:
            gone = cast(GoneReport, report)
            io = self._io.get(gone.wid)
            if io is not None:
                self._read(io)  # what it sent before it died counts
            if gone.status is not None:  # exited and gone: one report
                core.exited(gone.wid, gone.status, gone.oom_kills or 0, now)
            core.gone(gone.wid, now)
        elif kind is SpawnedReport:
            spawned = cast(SpawnedReport, report)
            core.spawned(spawned.wid, spawned.pid, spawned.method, now)
        elif kind is ExitedReport:
            exited = cast(ExitedReport, report)
            io = self._io.get(exited.wid)
            if io is not None:
                self._read(io)  # its 'fatal' may already be here
            core.exited(exited.wid, exited.status, exited.oom_kills, now)
        elif kind is CleanedReport:
            cleaned = cast(CleanedReport, report)
            core.cleaned(cleaned.wid, cleaned.count, now)
        elif kind is SpawnFailedReport:
            failed = cast(SpawnFailedReport, report)
            core.spawn_failed(failed.wid, failed.error, now)
        elif kind is ForkUnavailableReport:
            if not self._fork_warned:
                self._fork_warned = True
                reason = cast(ForkUnavailableReport, report).reason
                _log.warning("workers are spawned, not forked: %s", reason)
        elif kind is StuckReport:
            wid = cast(StuckReport, report).wid
            _log.error("worker %s: its cgroup would not empty; still trying", wid)
        elif kind is LostReport and not self._reaper_closing:
            core.reaper_lost(now, error=cast(LostReport, report).error)
        # (ReadyReport is the client's start; PreloadedReport and ByeReport need nothing here.)
        self._pump()

    async def _end_orphan(self, wid: int) -> None:
        """The reaper died: end worker ``wid``'s tree without it and report it gone. With a
        cgroup the tree is killed through it and verified empty; without one, only the
        worker's process group can be seen (the result says its tree was not verified). A
        process of it known alive (uninterruptible sleep) is waited for, however long: no
        call settles while it lives (C4.3); the core marks the worker unkillable meanwhile."""
        io = self._io.get(wid)
        w = self._core.workers.get(wid)
        pgid = w.pid if w is not None else None
        groups = io.groups if io is not None else []
        kill_dir = io.kill_dir if io is not None else None
        verified = False
        if pgid is not None:
            # It leads its own process group: what did not leave the group goes now, with or
            # without a cgroup (and whatever left it, only a cgroup can find).
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        if groups:
            # (Up to KILL_WAIT in its thread: a close does not wait for it.)
            verified = await anyio.to_thread.run_sync(
                empty_cgroups, kill_dir, groups, abandon_on_cancel=True
            )
        group_empty = True
        if pgid is not None:
            with anyio.move_on_after(KILL_WAIT):
                await wait_pid_gone(pgid)
            # SIGKILL is delivered, not awaited: a member of its group may still run (under
            # load, for a while) after the signal. Gone means gone: wait for each.
            group_empty = await end_group(pgid, KILL_WAIT)
        # Known alive still: look again every ORPHAN_LOOK_EVERY, however long it takes. The
        # cgroup says it all where there is one; else the group, whose id no new process can
        # take while a member of it lives (the worker's pid itself may be reused by now).
        while not (verified if groups else group_empty):
            await anyio.sleep(ORPHAN_LOOK_EVERY)
            if groups:
                verified = await anyio.to_thread.run_sync(
                    empty_cgroups, kill_dir, groups, ORPHAN_LOOK_FOR, abandon_on_cancel=True
                )
            elif pgid is not None:
                group_empty = await end_group(pgid, ORPHAN_LOOK_FOR)
        if io is not None:
            if verified:
                for path in reversed(io.cleanup):
                    remove = functools.partial(remove_dir, path, cgroup=path in io.groups)
                    await anyio.to_thread.run_sync(remove)
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
        if self._reaper_closing:
            return  # the pool closed it meanwhile
        reaper.own(self._owned())
        if self._tg is not None:
            self._start_task(reaper.run)
        self._core.reaper_ready(time.monotonic())
        self._pump()

    # ------------------------------------------------------------------ performing actions

    _pump_owed = False  # a pump is scheduled for the submits since (``_owe_pump``)
    _owed_submits = 0  # submits since the last pump, while one is owed
    _soon: Callable[[Callable[[], object]], object] | None = None  # the loop's call_soon

    def _owe_pump(self) -> None:
        """A submit was handed to the core: the first of a burst is pumped at once (its call
        goes out now: no loop turn added to a lone call's latency); the rest owe a pump,
        run soon, in the loop, once for all of them, and at once every ``OWED_SUBMITS``
        submits of a long burst (its workers are fed while it lasts). The core runs an owed
        dispatch pass before any other event it handles (``Machine``, "owed"). Outside a
        loop (never in the pool's own use), each pumps at once."""
        if self._pump_owed:
            self._owed_submits += 1
            if self._owed_submits >= OWED_SUBMITS:
                self._owed_submits = 0
                self._pump()
            return
        self._pump()
        soon = self._soon
        if soon is None:
            try:
                soon = self._soon = _loop_soon()
            except RuntimeError:
                return
        self._pump_owed = True
        self._owed_submits = 0
        soon(self._pay_pump)

    def _pay_pump(self) -> None:
        self._pump_owed = False
        try:
            self._pump()
        except Exception:  # (a callback of the loop's: never let it end the loop)
            _log.exception("performing what the core asks failed")

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
                    if self._read(io):  # (it looks whether there is something)
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
        core, faces = self._core, self._faces
        reaper = self._reaper if core.s.reaper_up else None
        for action in actions:
            kind = type(action)
            if kind is CallRecord:  # (it settled: the machine's Settled)
                face = faces.pop(action.id, None)  # type: ignore[union-attr]
                if face is not None:
                    face._settle()  # (it is done from now on: wake its waiters)
            elif kind is Send:
                send: Send = action  # type: ignore[assignment]
                io = self._io.get(send.wid)
                try:
                    if io is None or io.sock.closed:
                        raise zmq.ZMQError(zmq.ENOTSOCK)
                    if len(send.frames) == 1:
                        frame = send.frames[0]
                        io.sock.send(frame, _NOBLOCK, len(frame) < 65536)  # (copy)
                    else:
                        io.sock.send_multipart(send.frames, _NOBLOCK, copy=False)
                except zmq.ZMQError:
                    if send.calls:
                        core.send_failed(send.wid, send.calls, time.monotonic())
                    continue
                if io not in sent_to:
                    sent_to.append(io)
            elif kind is Started:
                face = faces.get(action[0].id)  # type: ignore[union-attr,misc,index]
                if face is not None:
                    face._wake_started()
            elif kind is Progressed:
                face = faces.get(action[0].id)  # type: ignore[union-attr,misc,index]
                if face is not None:
                    face._wake_progress()
            elif kind is Changed:
                if self._changed is not None:
                    self._changed.set()
                    self._changed = None
            elif kind is Spawn:
                spawn = cast(Spawn, action)
                try:
                    self._spawn(spawn.wid, spawn.secret, spawn.provider)
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
                name = cast(FirstHello, action).provider
                if name in self._options:
                    warn_inactive_layers(self._options[name].profile, self.containment(name))
            elif kind in _PROVIDER_ACTIONS:
                self._on_provider_action(action)
            elif kind is Orphaned:
                if self._tg is not None:
                    self._start_task(self._end_orphan, cast(Orphaned, action).wid)
            elif kind is RestartReaper and self._tg is not None:
                self._start_task(self._restart_reaper)
        return sent_to

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
            else:
                # Due already (a replacement owed, armed by the event that settled its dead
                # worker's calls, perhaps this task's own): whoever that event woke runs first.
                # (anyio.sleep(0) is that checkpoint; anyio.lowlevel: one module more to load)
                await anyio.sleep(0)  # noqa: ASYNC115
            now = time.monotonic()
            if now >= self._clock_at:
                core.timer(now)
                self._pump()
