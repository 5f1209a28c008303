"""The supervisor's side of the reaper process (see ``_main.py``).

Launching and killing processes is split out of the pool: the pool asks, the reaper does, and
reports back events. One reaper serves one pool.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import anyio

from ..core import WorkerStartError

__all__ = ("REAPER_ENV", "SCRIPT", "ReaperClient", "reaper_env")

#: The reaper process's script, run by path (``python -P SCRIPT SUPERVISOR_PID FD``).
SCRIPT: Final = Path(__file__).with_name("_main.py")

Event = dict[str, Any]


#: What the reaper keeps of the supervisor's environment. Workers forked from it inherit its
#: initial environment block (``/proc/self/environ``, the stack), whatever ``os.environ`` they
#: are given: nothing else of the supervisor's environment may be in it.
REAPER_ENV: Final = ("PATH", "PYTHONPATH", "PYTHONHOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ")


def reaper_env() -> dict[str, str]:
    """The reaper's environment: :data:`REAPER_ENV` from the supervisor's, no more."""
    return {name: os.environ[name] for name in REAPER_ENV if name in os.environ}


class ReaperClient:
    """Starts the reaper, sends it commands and delivers its events to ``on_event``."""

    def __init__(self, on_event: Callable[[Event], None]) -> None:
        self._on_event = on_event
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self.subreaper = False
        self._bye = False
        self._pump_done: anyio.Event | None = None

    async def start(self, timeout: float) -> None:
        """Start the reaper process and wait for it to say it is ready."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # A plain, fast fork+exec (no preexec_fn: zmq threads exist); not worth a thread.
            self._proc = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-P", str(SCRIPT), str(os.getpid()), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=reaper_env(),
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        try:
            with anyio.move_on_after(timeout):
                while self._sock is not None:
                    await anyio.wait_readable(ours)
                    event = self._recv_one()
                    if event is None:
                        break
                    if event.get("ev") == "ready":
                        self.pid = int(event["pid"])
                        self.subreaper = bool(event.get("subreaper"))
                        return
        except BaseException:  # cancelled, or closed under it: leave nothing behind
            await self.aclose()
            raise
        await self.aclose()
        raise WorkerStartError("the pool's reaper process did not start")

    def _recv_one(self) -> Event | None:
        if self._sock is None:  # closed by aclose() while the pump was being woken
            return None
        try:
            data = self._sock.recv(1 << 16)
        except BlockingIOError:
            return {}
        except OSError:
            return None
        if not data:
            return None
        event: Event = json.loads(data)
        return event

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
                    event = self._recv_one()
                    if event is None:
                        self._bye = True
                        self._on_event({"ev": "lost"})
                        return
                    if not event:
                        break
                    if event.get("ev") == "bye":
                        self._bye = True
                    self._on_event(event)
        finally:
            self._pump_done.set()

    def send(self, **command: Any) -> None:
        """Send a command; a reaper that is gone is reported through the event stream."""
        if self._sock is None:
            return
        try:
            self._sock.send(json.dumps(command).encode())
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
            op="spawn",
            start=start,
            wid=wid,
            argv=argv,
            env=env,
            cwd=cwd,
            stdin=stdin.decode(),
            output=output,
            cgroup=cgroup,
            cleanup=cleanup or [],
            groups=groups or [],
        )

    def preload(self, paths: list[str]) -> None:
        """Have the reaper import the worker's modules now (the template workers are forked
        from), from ``paths`` (the workers' ``PYTHONPATH``); answered by ``preloaded``."""
        self.send(op="preload", paths=paths)

    def signal_tree(self, wid: int, sig: int) -> None:
        """Send ``sig`` to the worker and every descendant."""
        self.send(op="signal", wid=wid, sig=int(sig))

    def own(self, paths: list[str]) -> None:
        """Hand the pool's directories to the reaper: it removes them when it exits, so they
        do not outlive a supervisor that was killed."""
        self.send(op="own", paths=paths)

    def clean(self, wid: int) -> None:
        """Kill the worker's descendants (not the worker); answered by ``cleaned``."""
        self.send(op="clean", wid=wid)

    def kill_tree(self, wid: int) -> None:
        """Freeze the worker, SIGKILL its descendants until none is left, then SIGKILL it."""
        self.send(op="kill", wid=wid)

    async def aclose(self) -> None:
        """Ask the reaper to kill whatever is left and exit; wait until it has."""
        self.send(op="exit")
        proc, self._proc = self._proc, None
        try:
            # Shielded, and bounded: a cancelled caller must not leave the process or its
            # socket behind.
            with anyio.CancelScope(shield=True):
                if proc is not None:
                    with anyio.move_on_after(10):
                        await anyio.to_thread.run_sync(proc.wait, abandon_on_cancel=True)
                    if proc.poll() is None:  # it would not go: do not leave it behind
                        proc.kill()
                        await anyio.to_thread.run_sync(proc.wait)
                if self._pump_done is not None:
                    # The reaper has exited: let the pump read its last events and the end of
                    # file before the socket goes away under it.
                    with anyio.move_on_after(5):
                        await self._pump_done.wait()
        finally:
            sock, self._sock = self._sock, None
            if sock is not None:
                anyio.notify_closing(sock)
                sock.close()
