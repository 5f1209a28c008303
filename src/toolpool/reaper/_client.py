"""The supervisor's side of the reaper process (see ``_main.py``).

Launching and killing processes is split out of the pool: the pool asks, the reaper does, and
reports back. One reaper serves one pool. Commands and reports are the typed messages of
``toolpool/protocol/_reaper.py``; a report that breaks the protocol ends the reaper (the client
kills it and reports it lost, saying why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import anyio

from ..core import WorkerStartError
from ..protocol._checks import ProtocolViolation
from ..protocol._reaper import (
    ByeReport,
    CleanCommand,
    CleanupDoneReport,
    CleanupPendingReport,
    ExitCommand,
    GoneReport,
    KillCommand,
    LostReport,
    OwnCommand,
    PreloadCommand,
    ReadyReport,
    ReaperCommand,
    ReaperReport,
    SignalCommand,
    SpawnCommand,
    decode_report,
    encode_reaper,
)
from ..sandbox import _remove
from ._ahead import REAPER_ENV, SCRIPT, launch, reaper_env, take_ahead

__all__ = ("REAPER_ENV", "SCRIPT", "CloseReport", "ReaperClient", "finish_cleanup", "reaper_env")

_log = logging.getLogger("toolpool")

#: Seconds of removal the reaper may spend at the pool's close before it says goodbye (and
#: goes on removing the rest after it).
EXIT_CLEANUP_BUDGET: Final = 2.0
#: Seconds the reaper waits at the pool's close for the workers it killed to die; those still
#: alive then (uninterruptible sleep) are named in the close's report (``unkillable``).
EXIT_KILL_WAIT: Final = 2.0
#: Seconds the supervisor spends removing the pool's directory itself (when the reaper could
#: not) before it leaves the rest to a background process.
SUPERVISOR_CLEANUP_BUDGET: Final = 2.0


@dataclass(frozen=True, slots=True)
class CloseReport:
    """What :meth:`toolpool.Pool.aclose` left behind on disk, if anything.

    ``finished``: everything the pool wrote (its directory, every worker's scratch directory)
    is removed. Otherwise ``pending`` names what is still being removed in the background, by
    process ``cleaner_pid`` (the pool's reaper staying on after the pool closed, or a helper),
    and ``failed`` what could not be removed, and why.

    Every process of the pool is gone, but for those named in ``unkillable``: processes of
    workers' trees that did not die of SIGKILL (uninterruptible sleep: a hung NFS or FUSE
    mount, a frozen cgroup v1...), left to die whenever the kernel lets them (init reaps
    them then). ``unsettled`` names the calls those workers held: they are not settled
    (their tree is known alive: CONTRACT C4.3), and awaiting one raises
    :class:`toolpool.PoolClosedError`. The directories and cgroups of such trees cannot be
    removed while they live (``failed``).
    """

    finished: bool = True
    pending: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    cleaner_pid: int | None = None
    unkillable: tuple[int, ...] = ()
    unsettled: tuple[int, ...] = ()

    def format(self) -> str:
        lines = []
        if self.unkillable:
            pids = ", ".join(map(str, self.unkillable))
            lines.append(f"processes that did not die of SIGKILL (still alive): {pids}")
        if self.unsettled:
            ids = ", ".join(map(str, self.unsettled))
            lines.append(f"calls not settled (their worker's tree lives): {ids}")
        if self.finished:
            return "\n".join([*lines, "every directory of the pool is removed"])
        lines += [f"still being removed by process {self.cleaner_pid}: {p}" for p in self.pending]
        lines += [f"not removed: {f}" for f in self.failed]
        return "\n".join(lines)


class ReaperClient:
    """Starts the reaper, sends it commands and delivers its reports to ``on_event`` (but the
    ``cleanup_*`` reports, its own): a :class:`LostReport` last if the reaper went away
    without a ``bye`` or broke the protocol."""

    def __init__(self, on_event: Callable[[ReaperReport], None]) -> None:
        self._on_event = on_event
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self.subreaper = False
        self._bye = False
        self._pump_done: anyio.Event | None = None
        self.said_bye = False
        self.unfinished: list[str] = []  # what the reaper goes on removing after its bye
        self.failed: list[str] = []  # what it could not remove, and why
        self.unkillable: list[int] = []  # processes alive after every kill, at its exit
        self.lingering_pid: int | None = None  # the reaper, still removing after the close
        self.removing: set[str] = set()  # workers' directories it is removing
        self._quiet: set[str] = set()  # of those, named in a gone (no line if removed at once)
        self._removed: anyio.Event | None = None

    async def start(self, timeout: float, preload: list[str] | None = None) -> None:
        """Start the reaper process (or adopt the one started ahead: ``_ahead.py``), have
        it import the worker's modules from ``preload`` (a path; None: not now), and wait for
        it to say it is ready."""
        ahead = take_ahead(preload)
        if ahead is not None:
            self._proc, ours = ahead.proc, ahead.sock
            _log.debug("the reaper started ahead (pid %s) is this pool's", ahead.proc.pid)
            if ahead.paths is not None:
                preload = None  # asked already
        else:
            self._proc, ours = launch()
        if preload is not None:  # (queued: read once it is ready)
            with contextlib.suppress(OSError):  # gone: the wait below says so
                ours.send(encode_reaper(PreloadCommand(tuple(preload))))
        ours.setblocking(False)
        self._sock = ours
        malformed: ProtocolViolation | None = None
        try:
            with anyio.move_on_after(timeout):
                while self._sock is not None:
                    await anyio.wait_readable(ours)
                    frame = self._recv_frame()
                    if frame is None:
                        break
                    if not frame:
                        continue
                    try:
                        report = decode_report(frame)
                    except ProtocolViolation as exc:
                        malformed = exc
                        break
                    if type(report) is ReadyReport:
                        self.pid = report.pid
                        self.subreaper = report.subreaper
                        return
        except BaseException:  # cancelled, or closed under it: leave nothing behind
            await self.aclose()
            raise
        if malformed is not None:
            self._kill()
            await self.aclose()
            raise WorkerStartError(_malformed(malformed))
        await self.aclose()
        raise WorkerStartError("the pool's reaper process did not start")

    def _recv_frame(self) -> bytes | None:
        """The next datagram: b"" if none is there yet, None once the socket is closed."""
        if self._sock is None:  # closed by aclose() while the pump was being woken
            return None
        try:
            data = self._sock.recv(1 << 16)
        except BlockingIOError:
            return b""
        except OSError:
            return None
        return data or None

    def _kill(self) -> None:
        """End a reaper that broke the protocol: it cannot be trusted to serve, nor to end
        well. Its workers die with it (PDEATHSIG); the pool ends what they left, as when a
        reaper dies (``docs/protocol.md`` §9)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    async def run(self) -> None:
        """Deliver events until the reaper says goodbye or goes away."""
        sock = self._sock
        assert sock is not None
        self._pump_done = anyio.Event()
        try:
            while not self._bye:
                try:
                    await anyio.wait_readable(sock)
                except (anyio.ClosedResourceError, OSError):
                    return
                while True:
                    frame = self._recv_frame()
                    if frame is None:
                        self._bye = True
                        self._on_event(LostReport())
                        return
                    if not frame:
                        break
                    try:
                        report = decode_report(frame)
                    except ProtocolViolation as exc:
                        self._bye = True
                        self._kill()
                        _log.error("%s; it was killed", _malformed(exc))
                        self._on_event(LostReport(_malformed(exc)))
                        return
                    if type(report) is ByeReport:
                        self._bye = self.said_bye = True
                        self.unfinished = list(report.unfinished)
                        self.failed = list(report.failed)
                        self.unkillable = list(report.unkillable)
                    elif type(report) is CleanupPendingReport or type(report) is CleanupDoneReport:
                        self._track(report)  # the client's own: the pool needs none of it
                        continue
                    elif type(report) is GoneReport and report.removing:
                        # Removed from now on: whoever the gone wakes finds them removing.
                        self.removing.update(report.removing)
                        self._quiet.update(report.removing)
                    self._on_event(report)
        finally:
            self._pump_done.set()
            self._wake_removed()

    def _track(self, report: CleanupPendingReport | CleanupDoneReport) -> None:
        path = report.path
        if type(report) is CleanupPendingReport:
            self._quiet.discard(path)  # (slow: its end is worth a line too)
            _log_cleanup(report)
            self.removing.add(path)
            return
        quiet = path in self._quiet  # (named in a gone and removed at once: no line for that)
        self._quiet.discard(path)
        if not (quiet and type(report) is CleanupDoneReport and report.finished):
            _log_cleanup(report)
        if path in self.removing:
            self.removing.discard(path)
            self._wake_removed()

    def _wake_removed(self) -> None:
        if self._removed is not None:
            self._removed.set()
            self._removed = None

    async def wait_removed(self, path: str) -> None:
        """Until the reaper is no longer removing ``path`` in the background (it was done
        with it before it reported the worker gone, or has reported ``cleanup_done``)."""
        while path in self.removing and not self._bye:
            if self._removed is None:
                self._removed = anyio.Event()
            await self._removed.wait()

    def send(self, command: ReaperCommand) -> None:
        """Send a command; a reaper that is gone is reported through the report stream."""
        if self._sock is None:
            return
        try:
            self._sock.send(encode_reaper(command))
        except OSError:
            pass

    def spawn(
        self,
        wid: int,
        argv: list[str],
        *,
        env: dict[str, str] | None,
        stdin: bytes,
        output: str,
        cwd: str | None = None,
        cgroup: str | None = None,
        cleanup: list[str] | None = None,
        start: str = "spawn",
        groups: list[str] | None = None,
    ) -> None:
        """Ask for a worker process; answered by ``spawned`` or ``spawn_failed``.

        ``cgroup`` is the worker's v2 cgroup (``cgroup.kill`` is its kill barrier);
        ``cleanup`` lists directories to remove once its tree is gone; ``groups`` its cgroup
        directories (whose members a clean-up kills, whose OOM count an exit reports).
        ``start="fork"`` forks the worker from the reaper's template when it can
        (``fork_unavailable`` says why not, and the worker is spawned instead).
        """
        self.send(
            SpawnCommand(
                wid,
                tuple(argv),
                env,
                stdin.decode(),
                output,
                cwd,
                cgroup,
                tuple(groups or ()),
                tuple(cleanup or ()),
                start,
            )
        )

    def signal_tree(self, wid: int, sig: int) -> None:
        """Send ``sig`` to the worker and every descendant."""
        self.send(SignalCommand(wid, int(sig)))

    def own(self, paths: list[str]) -> None:
        """Hand the pool's directories to the reaper: it removes them when it exits, so they
        do not outlive a supervisor that was killed."""
        self.send(OwnCommand(tuple(paths)))

    def clean(self, wid: int) -> None:
        """Kill the worker's descendants (not the worker); answered by ``cleaned``."""
        self.send(CleanCommand(wid))

    def kill_tree(self, wid: int) -> None:
        """Freeze the worker, SIGKILL its descendants until none is left, then SIGKILL it."""
        self.send(KillCommand(wid))

    async def aclose(self) -> None:
        """Ask the reaper to kill whatever is left and exit; wait until it has, or until it
        said goodbye with directories left to remove (it stays on to remove them: see
        :attr:`unfinished`, :attr:`lingering_pid`). What did not die of its SIGKILL within
        EXIT_KILL_WAIT is named in :attr:`unkillable`."""
        self.send(ExitCommand(EXIT_CLEANUP_BUDGET, EXIT_KILL_WAIT))
        proc, self._proc = self._proc, None
        try:
            # Shielded, and bounded: a cancelled caller must not leave the process or its
            # socket behind.
            with anyio.CancelScope(shield=True):
                if proc is not None:
                    with anyio.move_on_after(10):
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(_wait_exit, proc)
                            if self._pump_done is not None:
                                await self._pump_done.wait()  # its bye, or its end
                                if self.unfinished:  # it stays on to remove them: no wait
                                    tg.cancel_scope.cancel()
                    if self.unfinished and proc.poll() is None:
                        self.lingering_pid = proc.pid
                        _log.warning(
                            "the pool is closed, but its reaper (pid %s) is still removing %s",
                            proc.pid,
                            ", ".join(self.unfinished),
                        )
                        # Reaped when it is done; it outlives this process if need be.
                        threading.Thread(
                            target=proc.wait, name="toolpool-reaper-cleanup", daemon=True
                        ).start()
                    elif self.unfinished:  # it finished them, and exited, meanwhile
                        self.unfinished = []
                    elif proc.poll() is None:  # it would not go: do not leave it behind
                        proc.kill()
                        await anyio.to_thread.run_sync(proc.wait)
                if self._pump_done is not None:
                    with anyio.move_on_after(5):
                        await self._pump_done.wait()
        finally:
            self._close_socket()

    def _close_socket(self) -> None:
        if self._sock is not None:
            anyio.notify_closing(self._sock)
            self._sock.close()
            self._sock = None


async def _wait_exit(proc: subprocess.Popen[bytes]) -> None:
    await anyio.to_thread.run_sync(proc.wait, abandon_on_cancel=True)


def _malformed(violation: ProtocolViolation) -> str:
    return f"the pool's reaper process sent a malformed report: {violation}"


def _log_cleanup(report: CleanupPendingReport | CleanupDoneReport) -> None:
    where = f"worker {report.wid}'s" if report.wid is not None else "the pool's"
    if type(report) is CleanupPendingReport:
        _log.info(
            "%s directory %s: %s entries removed, removing the rest in the background",
            where,
            report.path,
            report.removed,
        )
    elif type(report) is CleanupDoneReport and report.finished:
        _log.info("%s directory %s is removed (%s entries)", where, report.path, report.removed)
    elif type(report) is CleanupDoneReport:
        _log.error("%s directory could not be removed: %s", where, report.error)


async def finish_cleanup(path: str | None, reaper: ReaperClient | None) -> CloseReport:
    """After the reaper closed: what is left of the pool's directory ``path``, removing it
    here if the reaper did not (it died, say). Never blocks for long: what is not removed in
    SUPERVISOR_CLEANUP_BUDGET seconds is left to a background process."""
    failed = tuple(reaper.failed) if reaper is not None else ()
    report = await _finish_cleanup(path, reaper, failed)
    if reaper is not None and reaper.unkillable:
        report = dataclasses.replace(report, unkillable=tuple(reaper.unkillable))
    return report


async def _finish_cleanup(
    path: str | None, reaper: ReaperClient | None, failed: tuple[str, ...]
) -> CloseReport:
    if reaper is not None and reaper.unfinished:
        pending = tuple(reaper.unfinished)
        return CloseReport(False, pending, failed, reaper.lingering_pid)
    if path is None or not os.path.lexists(path):  # noqa: ASYNC240 (one lstat)
        return CloseReport(not failed, (), failed)
    removal = await anyio.to_thread.run_sync(_remove.remove_tree, path, SUPERVISOR_CLEANUP_BUDGET)
    if removal.finished:
        return CloseReport(not failed, (), failed)
    if removal.done:
        _log.error("the pool's directory could not be removed: %s", removal.summary())
        return CloseReport(False, (), (*failed, removal.summary()))
    removal.close()
    helper = subprocess.Popen(  # noqa: ASYNC220 (a plain fork+exec)
        [sys.executable, "-P", _remove.__file__, path],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    threading.Thread(target=helper.wait, name="toolpool-cleanup", daemon=True).start()
    _log.warning("the pool's directory %s is still being removed, by process %s", path, helper.pid)
    return CloseReport(False, (path,), failed, helper.pid)
