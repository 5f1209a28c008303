"""The pool's reaper: a small trusted process between the supervisor and its workers.

Run as a script (``python -I _reaper_main.py SUPERVISOR_PID FD``), stdlib plus psutil only, so it
starts fast and never imports toolpool or any tool. It is a child subreaper: every worker is
its child, and whatever a dead worker leaves behind (children, setsid'd daemons) is re-parented
to it instead of to PID 1. It

* spawns workers on request and reports their pid, exit status, and when their tree is gone;
* kills trees on request: SIGTERM to the tree, or SIGSTOP the worker then SIGKILL every
  descendant until none is left, then SIGKILL the worker;
* kills and reaps every orphan at once (an orphan is any child that is not a live worker:
  it can only come from a worker that died);
* when the supervisor goes away (its end of the socket closes, or it is no longer the parent),
  kills every tree and exits, so nothing of the pool outlives it.

Messages are JSON objects, one per SOCK_SEQPACKET datagram. See docs/architecture.md.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
from typing import Any

import psutil

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, arg, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class Reaper:
    def __init__(self, supervisor_pid: int, sock: socket.socket) -> None:
        self.supervisor_pid = supervisor_pid
        self.sock = sock
        self.workers: dict[int, int] = {}  # pid -> wid, live (not yet reaped) workers
        self.pending_gone: list[int] = []  # wids reaped whose orphans may still live
        self.closing = False

    # ---- messages

    def send(self, **event: Any) -> None:
        try:
            self.sock.send(json.dumps(event).encode())
        except OSError:
            self.closing = True

    def handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "spawn":
            self.spawn(msg)
        elif op == "signal":
            self.signal_tree(int(msg["wid"]), int(msg["sig"]))
        elif op == "kill":
            self.kill_worker(int(msg["wid"]))
        elif op == "exit":
            self.closing = True

    # ---- spawning

    def spawn(self, msg: dict[str, Any]) -> None:
        wid = int(msg["wid"])
        output = None if msg.get("output") == "inherit" else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                msg["argv"],
                stdin=subprocess.PIPE,
                stdout=output,
                stderr=output,
                env=msg.get("env"),
                cwd=msg.get("cwd"),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            self.send(ev="spawn_failed", wid=wid, error=f"{type(exc).__name__}: {exc}")
            return
        self.workers[proc.pid] = wid
        assert proc.stdin is not None
        try:
            proc.stdin.write(msg["stdin"].encode())
            proc.stdin.close()
        except OSError:
            pass  # it died at once; the exit is reported as usual
        # Popen's own bookkeeping must not reap behind our back: we reap with waitpid(-1).
        proc.returncode = 0
        self.send(ev="spawned", wid=wid, pid=proc.pid)

    # ---- killing

    def signal_tree(self, wid: int, sig: int) -> None:
        pid = self._pid_of(wid)
        if pid is None:
            return
        for proc in _descendants(pid):
            _signal(proc, sig)
        _kill(pid, sig)

    def kill_worker(self, wid: int) -> None:
        pid = self._pid_of(wid)
        if pid is not None:
            rounds = kill_tree(pid)
            self.send(ev="killed", wid=wid, rounds=rounds)

    def _pid_of(self, wid: int) -> int | None:
        for pid, w in self.workers.items():
            if w == wid:
                return pid
        return None

    # ---- reaping

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            wid = self.workers.pop(pid, None)
            if wid is not None:
                code = os.waitstatus_to_exitcode(status)
                self.send(ev="exited", wid=wid, pid=pid, status=code)
                self.pending_gone.append(wid)
        if self.pending_gone or self.closing:
            self.kill_orphans()

    def kill_orphans(self) -> None:
        """Kill and reap every child that is not a live worker; then report trees gone."""
        while True:
            orphans = [c for c in _children(os.getpid()) if c.pid not in self.workers]
            alive = [c for c in orphans if not _is_zombie(c)]
            for orphan in alive:
                kill_tree(orphan.pid)
            if not orphans:
                break
            # Reap what we killed (and the zombies); new orphans may have arrived: loop.
            self._reap_orphans_blocking(orphans)
        gone, self.pending_gone = self.pending_gone, []
        for wid in gone:
            self.send(ev="gone", wid=wid)

    def _reap_orphans_blocking(self, orphans: list[psutil.Process]) -> None:
        for orphan in orphans:
            try:
                pid, status = os.waitpid(orphan.pid, 0)
            except ChildProcessError:
                continue
            wid = self.workers.pop(pid, None)
            if wid is not None:  # cannot happen (workers are not orphans); keep it truthful
                self.send(ev="exited", wid=wid, pid=pid, status=os.waitstatus_to_exitcode(status))
                self.pending_gone.append(wid)

    # ---- main loop

    def run(self) -> None:
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides, not a ^C
        self.send(ev="ready", pid=os.getpid(), subreaper=self.subreaper)
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(rfd, select.POLLIN)
        while not self.closing:
            events = poller.poll(1000)
            if os.getppid() != self.supervisor_pid:
                break  # the supervisor died (and we were re-parented)
            for fd, mask in events:
                if fd == rfd:
                    try:
                        os.read(rfd, 4096)
                    except BlockingIOError:
                        pass
                    self.reap()
                elif mask & (select.POLLHUP | select.POLLERR):
                    self.closing = True
                else:
                    self._read_commands()
        self.shutdown()

    def _read_commands(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                self.closing = True
                return
            if not data:
                self.closing = True
                return
            self.handle(json.loads(data))

    def _on_term(self, signum: int, frame: Any) -> None:
        self.closing = True

    def shutdown(self) -> None:
        for pid in list(self.workers):
            kill_tree(pid)
        deadline_rounds = 0
        while self.workers and deadline_rounds < 1000:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            wid = self.workers.pop(pid, None)
            if wid is not None:
                self.send(ev="exited", wid=wid, pid=pid, status=os.waitstatus_to_exitcode(status))
                self.pending_gone.append(wid)
            deadline_rounds += 1
        self.kill_orphans()
        self.send(ev="bye")

    subreaper = False


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)  # psutil checks the pid still names the same process
    except psutil.Error:
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_tree(pid: int) -> int:
    """Freeze ``pid``, SIGKILL its descendants until none is left alive, then SIGKILL it.

    ``pid`` must be a child of this process (so its pid cannot be reused before we reap it).
    Returns how many rounds the descendant loop took.
    """
    _kill(pid, signal.SIGSTOP)
    rounds = 0
    while rounds < 10_000:
        alive = [p for p in _descendants(pid) if not _is_zombie(p)]
        if not alive:
            break
        for proc in alive:
            _signal(proc, signal.SIGKILL)
        rounds += 1
    _kill(pid, signal.SIGKILL)
    return rounds


def main() -> None:
    supervisor_pid, fd = int(sys.argv[1]), int(sys.argv[2])
    sock = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)
    reaper = Reaper(supervisor_pid, sock)
    if os.getppid() != supervisor_pid:
        sys.exit(1)
    Reaper.subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        reaper.run()
    except BaseException:
        reaper.shutdown()
        raise


if __name__ == "__main__":
    main()
