"""The pool's reaper: a small trusted process between the supervisor and its workers.

Run as a script (``python -P reaper/_main.py SUPERVISOR_PID FD``), stdlib only (psutil where
a tree without a cgroup must be walked), so it starts fast and never imports toolpool or any
tool (but the worker's template, below). It is a child subreaper: every worker is
its child, and whatever a dead worker leaves behind (children, setsid'd daemons) is re-parented
to it instead of to PID 1. It

* spawns workers on request and reports their pid, exit status, and when their tree is gone:
  either ``python -m toolpool.worker`` (fork and exec, like ``subprocess``), or, with
  ``start_method="fork"``, by forking itself once it has imported the worker's modules (the
  pre-forked template: see ``Template`` below and ``toolpool/worker/_template.py``);
* kills trees on request: SIGTERM to the tree; or SIGKILL, through the worker's cgroup
  (``cgroup.kill``) where it has one, else by stopping the worker (SIGSTOP), SIGKILLing every
  descendant until none is left, then the worker; once per worker;
* kills and reaps every orphan at once (an orphan is any child that is not a live worker:
  it can only come from a worker that died);
* when the supervisor goes away (its end of the socket closes, or it is no longer the parent),
  kills every tree and exits, so nothing of the pool outlives it;
* removes what a worker left on disk (its scratch directory) once its tree is gone (right
  after reporting it ``gone``, which names them), and the pool's directories when it exits:
  with ``sandbox/_remove.py``, iteratively and in slices of bounded time between which it
  goes on serving, so a hostile tree (any depth, millions of entries, links, mounts) can
  neither crash nor stall it. What is not removed in the first slice is reported
  (``cleanup_pending``) and removed in the background; at exit, what is left after
  :data:`EXIT_CLEANUP_BUDGET` is named in ``bye`` and the reaper stays on until it is
  removed.

Messages are JSON objects, one per SOCK_SEQPACKET datagram: the typed commands and reports of
``toolpool/protocol/_reaper.py``, loaded by path (with the ``_checks.py`` it imports) under a
stand-in package name, so that neither toolpool's ``protocol/__init__`` (msgpack) nor the
supervisor is imported. A command that breaks the protocol ends the reaper (below, ``refused``).
See docs/pool.md and docs/protocol.md.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import os
import select
import signal
import socket
import sys
import time

# What the reaper imports is on the path of every pool's start (``docs/performance.md``,
# "A lean start"): the stdlib it needs, no more. psutil (a walk of /proc, only where no
# cgroup kills a tree), subprocess (only for spawned workers) and ctypes (a forked worker's
# command line) are imported where they are used; typing is for the type checker alone.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from toolpool.protocol._reaper import ReaperReport, SpawnCommand

#: toolpool's package directory (this file is toolpool/reaper/_main.py).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _load(name: str, package: str = "sandbox") -> Any:
    """toolpool/<package>/<name>.py, as a module of a stand-in package ``_toolpool_<package>``
    whose ``__init__`` is never run (toolpool's own imports are heavy: toolpool.protocol's
    imports msgpack), so that its relative imports of its siblings work."""
    parent = f"_toolpool_{package}"
    if parent not in sys.modules:
        spec = importlib.util.spec_from_loader(parent, None, is_package=True)
        assert spec is not None
        stand_in = importlib.util.module_from_spec(spec)
        stand_in.__path__ = [os.path.join(_PACKAGE, package)]
        sys.modules[parent] = stand_in
    return importlib.import_module(f"{parent}.{name}")


proto = _load("_reaper", "protocol")  # (with the ``_checks.py`` it imports)
linux = _load("_linux")
cgroups = _load("_cgroups")
remove = _load("_remove")
trees = _load("_trees", "reaper")

#: The worker's exit status when its set-up failed (``toolpool.worker._main.EXIT_SETUP_FAILED``).
EXIT_SETUP_FAILED = 70
#: Signals the reaper handles itself: blocked around fork, reset in the child.
_HANDLED = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
#: Seconds of removal a gone worker's directory gets at once, after its ``gone``; what is left
#: then is removed in the background (``cleanup_pending``).
FIRST_SLICE = 0.05
#: Seconds of removal between two looks at the socket and the workers.
SLICE = 0.02
#: Seconds of removal at exit before ``bye``; what is left is removed after it.
EXIT_CLEANUP_BUDGET = 2.0
#: Seconds to wait for killed orphans to die before going on without them: one that does not
#: (uninterruptible sleep) lingers, keeps its trees from being reported gone, and is reaped
#: whenever it dies.
ORPHAN_WAIT = 1.0
#: Seconds a worker's exit is held back while the rest of its tree dies, to be reported with its
#: ``gone`` (one report); past that, it is reported alone first.
EXIT_REPORT_WAIT = 0.05
#: Seconds to wait at exit for the killed workers to die; what is still alive then is named
#: in ``bye`` (``unkillable``).
EXIT_KILL_WAIT = 2.0


class Template:
    """The worker's modules, imported into the reaper once, so that workers can be forked.

    Imported lazily (on the pool's ``preload`` or first forked spawn) from the path the workers
    get (the supervisor's ``sys.path``), and only if they are the toolpool this reaper belongs
    to. Importing them starts no thread; every fork checks the reaper is still single-threaded.
    """

    def __init__(self) -> None:
        self.module: Any = None
        self.error: str | None = None
        self.base_path = list(sys.path)  # the interpreter's own path (no script dir: -P)

    def load(self, paths: list[str]) -> None:
        if self.module is not None or self.error is not None:
            return
        saved = list(sys.path)
        sys.path[:0] = [p for p in paths if p]
        try:
            module = importlib.import_module("toolpool.worker._template")
            module.preload()
            ours = _PACKAGE
            theirs = os.path.dirname(os.path.realpath(sys.modules["toolpool"].__file__ or ""))
            if ours != theirs:
                raise ImportError(f"the workers would import toolpool from {theirs}, not {ours}")
            self.module = module
        except Exception as exc:  # a template that cannot load: spawn instead, and say why
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            sys.path[:] = saved

    def unusable(self, msg: SpawnCommand) -> str | None:
        """Why the worker ``msg`` asks for cannot be forked (None: it can)."""
        if msg.argv[:3] != (sys.executable, "-m", "toolpool.worker"):
            return "not a toolpool worker of this interpreter"
        env = msg.env or {}
        self.load(env.get("PYTHONPATH", "").split(os.pathsep))
        if self.module is None:
            return f"the template did not load ({self.error})"
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:  # never fork a process with threads (and say so)
            return f"the reaper has {threads} threads"
        return None


class Reaper:
    def __init__(self, supervisor_pid: int, sock: socket.socket) -> None:
        self.supervisor_pid = supervisor_pid
        self.sock = sock
        self.workers: dict[int, int] = {}  # pid -> wid, live (not yet reaped) workers
        self.kill_dirs: dict[int, str] = {}  # wid -> its v2 cgroup (the kill barrier)
        self.cleanup: dict[int, list[str]] = {}  # wid -> directories to remove when gone
        self.groups: dict[int, list[str]] = {}  # wid -> its cgroup directories
        self.pending_gone: list[int] = []  # wids reaped whose orphans may still live
        self.stuck: set[int] = set()  # wids whose cgroup would not empty yet
        self.killing: set[int] = set()  # wids killed, not reaped yet (one kill per worker)
        # wid -> the exit of a reaped worker not reported yet (reported with its 'gone')
        self.exits: dict[int, Any] = {}  # (ExitedReport)
        # Killed orphans that did not die (uninterruptible sleep): pid -> the wids whose
        # trees they may be of (those that died when they were orphaned). Our children
        # until reaped, so their pids are not reused.
        self.lingering: dict[int, set[int]] = {}
        self.exit_kill_wait = EXIT_KILL_WAIT
        self.owned: list[str] = []  # the pool's directories, removed when the reaper exits
        self.removals: collections.deque[tuple[int | None, Any]] = collections.deque()
        self.failed: list[str] = []  # removals that ended with something left, and why
        self.exit_budget = EXIT_CLEANUP_BUDGET
        self.closing = False
        self.refused: str | None = None  # why a command broke the protocol (the end)
        self.template = Template()

    # ---- messages

    def send(self, report: ReaperReport) -> None:
        try:
            self.sock.send(proto.encode_reaper(report))
        except OSError:
            self.closing = True

    def handle(self, msg: Any) -> None:
        """Do what command ``msg`` (a ``ReaperCommand``, decoded: every field checked) asks."""
        op = msg.TYPE
        if op == "spawn":
            self.spawn(msg)
        elif op == "signal":
            self.signal_tree(msg.wid, msg.sig)
        elif op == "kill":
            self.kill_worker(msg.wid)
        elif op == "clean":
            self.clean(msg.wid)
        elif op == "preload":
            self.template.load(list(msg.paths))
            self.send(proto.PreloadedReport(self.template.error))
        elif op == "own":
            # (Sent again as providers come: each directory once, or its removal is too.)
            owned = self.owned
            owned.extend(p for p in msg.paths if p not in owned)
        elif op == "exit":
            self.closing = True
            self.exit_budget = msg.cleanup_budget
            self.exit_kill_wait = msg.kill_wait

    # ---- spawning

    def spawn(self, msg: SpawnCommand) -> None:
        wid = msg.wid
        if msg.start == "fork":
            why = self.template.unusable(msg)
            if why is None:
                self.fork(msg)
                return
            self.send(proto.ForkUnavailableReport(wid, why))
        import subprocess

        output = None if msg.output == "inherit" else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                msg.argv,
                stdin=subprocess.PIPE,
                stdout=output,
                stderr=output,
                env=msg.env,
                cwd=msg.cwd,
                start_new_session=True,
                close_fds=True,
            )
        except (OSError, ValueError) as exc:  # (ValueError: a NUL in an argument, say)
            self.send(proto.SpawnFailedReport(wid, f"{type(exc).__name__}: {exc}"))
            return
        self._record(wid, proc.pid, msg)
        assert proc.stdin is not None
        try:
            proc.stdin.write(msg.stdin.encode())
            proc.stdin.close()
        except OSError:
            pass  # it died at once; the exit is reported as usual
        # Popen's own bookkeeping must not reap behind our back: we reap with waitpid(-1).
        proc.returncode = 0
        self.send(proto.SpawnedReport(wid, proc.pid, "spawn"))

    def fork(self, msg: SpawnCommand) -> None:
        """Start the worker ``msg`` asks for as a fork of this process (the template)."""
        wid = msg.wid
        stdin_r, stdin_w = os.pipe()
        try:
            os.write(stdin_w, msg.stdin.encode())  # a line, far below the pipe's buffer
        finally:
            os.close(stdin_w)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing buffered may be written twice
        # Blocked until the child has reset the handlers: a signal meanwhile must not run the
        # reaper's handlers in the child (nor be lost).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        reaper = os.getpid()  # (the child's getppid() is 1 if this dies before it asks)
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(stdin_r)
            self.send(proto.SpawnFailedReport(wid, f"{type(exc).__name__}: {exc}"))
            return
        if pid == 0:
            self._become_worker(msg, stdin_r, reaper)  # never returns
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(stdin_r)
        self._record(wid, pid, msg)
        self.send(proto.SpawnedReport(wid, pid, "fork"))

    def _record(self, wid: int, pid: int, msg: SpawnCommand) -> None:
        """A worker started: remember it, its cgroups (ours, never a path the worker could
        write) and what to remove once its tree is gone."""
        self.workers[pid] = wid
        if msg.cgroup:
            self.kill_dirs[wid] = msg.cgroup
        self.groups[wid] = list(msg.groups)
        self.cleanup[wid] = list(msg.cleanup)

    def _become_worker(self, msg: SpawnCommand, stdin_r: int, reaper: int) -> NoReturn:
        """In the forked child: reset what ``subprocess`` would (file descriptors, signals,
        session, working directory), then run the worker; never return into the reaper."""
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            # SIGINT stays ignored: a spawned worker inherits that through exec, and Python
            # keeps an ignored SIGINT at start-up (so ^C never reaches a worker either way).
            self.sock.detach()  # closed below with every other inherited descriptor
            os.dup2(stdin_r, 0)
            if msg.output != "inherit":
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 1)
                os.dup2(null, 2)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            os.setsid()
            if msg.cwd:
                os.chdir(msg.cwd)
            set_cmdline(["python -m toolpool.worker", "--parent-pid", str(reaper)])
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            env = msg.env
            self.template.module.run(
                list(msg.argv[3:]),
                dict(os.environ) if env is None else env,
                self.template.base_path,
            )
        finally:
            os._exit(EXIT_SETUP_FAILED)

    # ---- killing

    def signal_tree(self, wid: int, sig: int) -> None:
        pid = self._pid_of(wid)
        if pid is None:
            return
        for proc in trees.descendants(pid):
            trees.signal_proc(proc, sig)
        trees.kill_pid(pid, sig)

    def kill_worker(self, wid: int) -> None:
        """Kill the worker's tree, once: a second ``kill`` while the first is under way (the
        worker not reaped yet) changes nothing (``kill_tree``), and is not done again."""
        pid = self._pid_of(wid)
        if pid is not None and wid not in self.killing:
            self.killing.add(wid)
            kill_tree(pid, self.kill_dirs.get(wid))

    def clean(self, wid: int) -> None:
        """Kill what a finished call left behind: every descendant, and every other process in
        the worker's cgroups (one a tool re-parented away from the worker with
        clone(CLONE_PARENT) is ours, not the worker's, but stays in its cgroup); never the
        worker itself."""
        import psutil

        pid = self._pid_of(wid)
        killed: set[int] = set()
        if pid is not None:
            groups = self.groups.get(wid, [])
            signalled: set[psutil.Process] = set()
            dying_until: float | None = None
            for _ in range(10_000):
                alive = [p for p in trees.descendants(pid) if not trees.is_zombie(p)]
                alive_pids = {p.pid for p in alive}
                for member in cgroups.members(groups):
                    if member != pid and member not in alive_pids:
                        try:
                            proc = psutil.Process(member)
                        except psutil.Error:
                            continue
                        if not trees.is_zombie(proc):
                            alive.append(proc)
                if not alive:
                    break
                fresh = [p for p in alive if p not in signalled]
                if not fresh:
                    # Only ones killed already: dying, or not dying at all (uninterruptible
                    # sleep), which no further signal changes. Bounded: the reaper goes on.
                    if dying_until is None:
                        dying_until = time.monotonic() + trees.KILL_TREE_WAIT
                    elif time.monotonic() >= dying_until:
                        break
                    time.sleep(0.0002)
                    self.reap()
                    continue
                for proc in fresh:
                    killed.add(proc.pid)
                    signalled.add(proc)
                    trees.signal_proc(proc, signal.SIGKILL)
                self.reap()  # ours (re-parented ones) must leave the cgroup too
        self.send(proto.CleanedReport(wid, len(killed)))

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
            self.lingering.pop(pid, None)  # a lingering orphan died at last
            wid = self.workers.pop(pid, None)
            if wid is not None:
                self._exited(wid, pid, os.waitstatus_to_exitcode(status))
        if self.pending_gone or self.closing:
            self.kill_orphans()

    def _exited(self, wid: int, pid: int, code: int) -> None:
        """Worker ``wid`` (``pid``) was reaped: what is left of its tree dies now (its cgroup
        killed at once, where it has one). Its exit is reported with its ``gone`` (one
        report), or before, should the rest of its tree take its time (``_report_exits``)."""
        killed = wid in self.killing  # (its cgroup killed already: nothing can be left in it)
        self.killing.discard(wid)
        # Read now: the cgroup is removed once the tree is gone, maybe before the supervisor
        # handles this report.
        ooms = cgroups.oom_kills(self.groups.get(wid, ())) if code == -9 else 0
        self.exits[wid] = proto.ExitedReport(wid, pid, code, ooms)
        self.pending_gone.append(wid)
        kill_dir = self.kill_dirs.get(wid)
        if kill_dir is not None and not killed:
            cgroups.cgroup_kill(kill_dir)  # (an empty cgroup: nothing to do)

    def _report_exits(self) -> None:
        """Report the exits not reported yet, without waiting for their trees' ends."""
        exits, self.exits = self.exits, {}
        for report in exits.values():
            self.send(report)

    def kill_orphans(self) -> None:
        """Kill and reap every child that is not a live worker; then report trees gone.

        An orphan that does not die within ORPHAN_WAIT (uninterruptible sleep) lingers: it
        is reaped whenever it dies, and until then the trees it may be of (the workers
        that died when it became an orphan: none later, it was ours already) are not
        reported gone (``stuck``), however long that takes."""
        deadline = time.monotonic() + ORPHAN_WAIT
        while True:
            children = linux.child_pids()
            if children is None:  # (a kernel without the file: a scan of /proc)
                children = [p.pid for p in trees.children(os.getpid())]
            orphans = [p for p in children if p not in self.workers and p not in self.lingering]
            if not orphans:
                break
            killed: set[int] | None = None  # the members of the cgroups killed already
            for pid in orphans:
                if trees.pid_is_zombie(pid):
                    continue
                if killed is None:
                    dying = [*self.pending_gone, *self.killing]
                    dirs = [self.kill_dirs[w] for w in dying if w in self.kill_dirs]
                    killed = cgroups.members(dirs)
                if pid in killed:
                    # Killed with its cgroup, which none of it can leave or fork from now:
                    # its children die with it, and what left the cgroup before comes to us
                    # once its parent is dead (we are the subreaper): the next round.
                    trees.kill_pid(pid, signal.SIGKILL)
                else:  # it left its worker's cgroup (or there is none): its whole tree
                    kill_tree(pid)
            # Reap what we killed (and the zombies); new orphans may have arrived: loop.
            for pid in self._reap_orphans(orphans, deadline):
                self.lingering[pid] = set(self.pending_gone)
        gone, self.pending_gone = self.pending_gone, []
        for wid in gone:
            report = self.exits.pop(wid, None)
            removing = self.barrier(wid)
            if removing is not None and not self._lingers(wid):
                # Exited and gone: one report (with the exit, unless that went before); its
                # directories are removed after it (a caller waits for the processes only).
                if report is None:
                    self.send(proto.GoneReport(wid, removing=removing))
                else:
                    self.send(
                        proto.GoneReport(wid, report.pid, report.status, report.oom_kills, removing)
                    )
                self.remove_dirs(wid, removing, announced=True)
            else:  # never report a tree gone that is not: retry from the main loop
                if report is not None:
                    self.send(report)
                if removing:  # (its cgroup is empty; what lingers is an orphan outside it)
                    self.remove_dirs(wid, removing, announced=False)
                self.stuck.add(wid)
                self.send(proto.StuckReport(wid, tuple(self._lingering_of(wid))))

    def _lingers(self, wid: int) -> bool:
        return any(wid in wids for wids in self.lingering.values())

    def _lingering_of(self, wid: int) -> list[int]:
        return sorted(pid for pid, wids in self.lingering.items() if wid in wids)

    def retry_stuck(self) -> None:
        for wid in list(self.stuck):
            if self._lingers(wid):
                continue
            removing = self.barrier(wid, wait=False)
            if removing is not None:
                self.stuck.discard(wid)
                self.send(proto.GoneReport(wid, removing=removing))
                self.remove_dirs(wid, removing, announced=True)

    def barrier(self, wid: int, *, wait: bool = True) -> tuple[str, ...] | None:
        """The worker is reaped and no orphan is left: empty its cgroup and remove it;
        return its directories, to remove once its ``gone`` is sent (:meth:`remove_dirs`).

        Returns None if the cgroup still holds a process after a bounded wait (none with
        ``wait=False``: a retry from the main loop must not hold it up).
        """
        kill_dir = self.kill_dirs.get(wid)
        if kill_dir is not None:
            for _ in range(10 if wait else 1):
                if not cgroups.populated(kill_dir):
                    break
                # Something of the tree is still in the cgroup (not a descendant any more?).
                cgroups.cgroup_kill(kill_dir)
                if wait:
                    cgroups.wait_empty(kill_dir, 0.2)
            else:
                if cgroups.populated(kill_dir):
                    return None
            self.kill_dirs.pop(wid, None)
        groups = set(self.groups.pop(wid, ()))
        trees = []
        for path in self.cleanup.pop(wid, []):
            if path in groups:  # a cgroup: rmdir (its files are the kernel's)
                cgroups.remove(path)
            else:  # a plain directory (its socket and ledger, its scratch): a tree
                trees.append(path)
        return tuple(trees)

    # ---- removing what workers leave on disk

    def remove_dirs(self, wid: int, paths: tuple[str, ...], *, announced: bool) -> None:
        """Remove a gone worker's directories (``announced``: named in its ``gone``, so each
        removal's end is reported, finished or not)."""
        for path in paths:
            self.start_removal(wid, path, announced=announced)

    def start_removal(self, wid: int | None, path: str, *, announced: bool = False) -> None:
        """Remove ``path``: a first slice now, the rest in the background (main loop)."""
        removal = remove.Removal(path)
        if not self.removals and removal.step(time.monotonic() + FIRST_SLICE):
            self._removal_done(wid, removal, pending=announced)
            return
        self.removals.append((wid, removal))
        self.send(proto.CleanupPendingReport(wid, path, removal.removed))

    def work_removals(self, budget: float) -> None:
        """Go on with the oldest unfinished removal for at most ``budget`` seconds."""
        deadline = time.monotonic() + budget
        while self.removals and time.monotonic() < deadline:
            wid, removal = self.removals[0]
            if removal.step(deadline):
                self.removals.popleft()
                self._removal_done(wid, removal, pending=True)

    def _removal_done(self, wid: int | None, removal: Any, *, pending: bool) -> None:
        if not removal.finished and len(self.failed) < 20:
            self.failed.append(removal.summary())
        if pending or not removal.finished:
            error = None if removal.finished else removal.summary()
            report = proto.CleanupDoneReport(
                wid, removal.path, removal.removed, removal.finished, error
            )
            self.send(report)

    def _reap_orphans(self, orphans: list[int], deadline: float) -> list[int]:
        """Reap the (killed) orphans, waiting until ``deadline`` at most (on their pidfds:
        woken as one dies); return those still alive then."""
        pending = orphans
        report_by = time.monotonic() + EXIT_REPORT_WAIT
        while True:
            alive = []
            for orphan in pending:
                try:
                    pid, status = os.waitpid(orphan, os.WNOHANG)
                except ChildProcessError:
                    continue
                if not pid:
                    alive.append(orphan)
                    continue
                wid = self.workers.pop(pid, None)
                if wid is not None:  # cannot happen (workers are not orphans): be truthful
                    self._exited(wid, pid, os.waitstatus_to_exitcode(status))
            now = time.monotonic()
            if not alive or now >= deadline:
                return alive
            if self.exits and now >= report_by:
                # A tree that takes its time: its worker's exit is not held back longer.
                self._report_exits()
            until = report_by if self.exits else deadline
            # A killed process is gone within moments (or never).
            trees.wait_any_dead(alive, min(until, deadline) - now)
            pending = alive

    # ---- main loop

    def run(self) -> None:
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides, not a ^C
        self.send(proto.ReadyReport(os.getpid(), self.subreaper))
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(rfd, select.POLLIN)
        while not self.closing:
            events = poller.poll(0 if self.removals else 1000)
            if os.getppid() != self.supervisor_pid:
                break  # the supervisor died (and we were re-parented)
            if self.stuck:
                self.retry_stuck()
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
            if self.removals and not self.closing:
                self.work_removals(SLICE)
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
            try:
                command = proto.decode_command(data)
            except proto.ProtocolViolation as exc:
                # A supervisor that breaks the protocol cannot be served: end as if it were
                # gone, but leave the pool's directories (the pool may go on with a new
                # reaper) and say no 'bye' (the client reports the reaper lost).
                self.refused = str(exc)
                self.closing = True
                return
            self.handle(command)

    def _on_term(self, signum: int, frame: Any) -> None:
        self.closing = True

    def shutdown(self) -> None:
        for pid, worker_id in list(self.workers.items()):
            kill_tree(pid, self.kill_dirs.get(worker_id))
        # Bounded: a worker in uninterruptible sleep never dies of its SIGKILL. It is named
        # in 'bye' (and re-parented to init once this process exits).
        deadline = time.monotonic() + self.exit_kill_wait
        while self.workers and time.monotonic() < deadline:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                trees.wait_any_dead(list(self.workers), deadline - time.monotonic())
                continue
            self.lingering.pop(pid, None)
            wid = self.workers.pop(pid, None)
            if wid is not None:
                self._exited(wid, pid, os.waitstatus_to_exitcode(status))
        self.kill_orphans()
        self.unkillable = self._alive_left()
        if self.refused is not None:
            print(f"toolpool's reaper: a malformed command: {self.refused}", file=sys.stderr)
            return
        # If the supervisor died, nobody else will remove the pool's directories.
        dirs = []
        for path in reversed(self.owned):
            if not os.path.lexists(path):
                continue  # removed already (an empty cgroup, say): nothing to remove or say
            if os.path.exists(os.path.join(path, "cgroup.procs")):
                cgroups.remove(path)
            else:
                dirs.append(path)
        self.finish_removals(dirs)

    def finish_removals(self, trees: list[str]) -> None:
        """At exit: remove ``trees`` and what is still being removed, for at most
        ``exit_budget`` seconds; say ``bye`` with what is left, then finish that."""
        inside = tuple(t.rstrip("/") + "/" for t in trees)
        for wid, removal in list(self.removals):
            if removal.path.startswith(inside):  # the pool's directory covers it
                self.removals.remove((wid, removal))
                removal.close()
        for path in trees:
            self.removals.append((None, remove.Removal(path)))
        self.work_removals(self.exit_budget)
        left = tuple(removal.path for _, removal in self.removals)
        self.send(proto.ByeReport(left, tuple(self.failed), tuple(self.unkillable)))
        while self.removals:  # nobody waits for us now: no slices, no budget
            _wid, removal = self.removals.popleft()
            removal.step(None)

    def _alive_left(self) -> list[int]:
        """The pool's processes still alive after every kill: workers not reaped, their
        descendants, lingering orphans (none dies of its SIGKILL: uninterruptible sleep)."""
        alive: set[int] = set()
        pids = [*self.workers, *self.lingering]
        if not pids:  # (the usual close: psutil's import alone is 10 ms of it)
            return []
        import psutil

        for pid in pids:
            procs = [pid, *(p.pid for p in trees.descendants(pid))]
            for each in procs:
                try:
                    if not trees.is_zombie(psutil.Process(each)):
                        alive.add(each)
                except psutil.Error:
                    continue
        return sorted(alive)

    subreaper = False
    unkillable: list[int] = []  # noqa: RUF012 (replaced, never changed in place)


def kill_tree(pid: int, kill_dir: str | None = None) -> None:
    """Kill ``pid`` (a child of this process) and everything below it.

    With a v2 cgroup (``kill_dir``): ``cgroup.kill``, which SIGKILLs every process in it at
    once (daemons included; none can fork meanwhile), and SIGKILL to ``pid`` itself, should it
    have left the cgroup. Nothing is frozen or looked for: what left the cgroup (a root tool
    can) is re-parented to the reaper as its parent dies, and killed then as an orphan
    (``Reaper.kill_orphans``). Without one: ``_trees.kill_below`` (freeze, walk /proc).
    """
    if kill_dir is not None and cgroups.cgroup_kill(kill_dir):
        trees.kill_pid(pid, signal.SIGKILL)
        return
    trees.kill_below(pid)


def set_cmdline(args: list[str]) -> None:
    """Show ``args`` as this process's command line (``/proc/PID/cmdline``, ``ps``).

    A forked worker would otherwise show the reaper's. Overwrites the original argument strings
    in place (they are only as long as the reaper's own command line), so the first argument is
    shortened or padded with spaces to make the others fit exactly.
    """
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
    except (OSError, ValueError, IndexError):
        return
    size = end - start
    tail = b"".join(a.encode() + b"\0" for a in args[1:])
    room = size - len(tail) - 1
    if room < 1:
        return
    data = args[0].encode()[:room].ljust(room) + b"\0" + tail
    ctypes.memmove(start, data, size)


def main() -> None:
    supervisor_pid, fd = int(sys.argv[1]), int(sys.argv[2])
    sock = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)
    reaper = Reaper(supervisor_pid, sock)
    if os.getppid() != supervisor_pid:
        sys.exit(1)
    Reaper.subreaper = linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
    try:
        reaper.run()
    except BaseException:
        reaper.shutdown()
        raise
    # All is done and said ('bye' sent, the directories removed): end without the
    # interpreter's teardown, which the pool's close waits for (about 25 ms) and which has
    # nothing left to do here (no exit handler, no thread; the output is flushed first).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2 if reaper.refused is not None else 0)


if __name__ == "__main__":
    main()
