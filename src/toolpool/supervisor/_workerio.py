"""What the shell holds for each worker: its socket, its ledger and cgroup files, its
directories; the core's :class:`~._state.Probe` over them; and ending a worker's tree without
the reaper (after the reaper died)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from typing import Final

import anyio
import zmq

from .._transport import fd_of
from ..protocol._ledger import (
    LEDGER_SIZE,
    SLOT_SIZE,
    SLOTS,
    SLOTS_AT,
    SPILL_AT,
    read_ledger,
    read_marks,
    spill_size,
)
from ..reaper._ahead import pythonpath
from ..sandbox import Profile, _remove
from ..sandbox import _cgroups as cgroups
from ..sandbox._cgroups import CgroupSet, others_listed

__all__ = (
    "KILL_WAIT",
    "WorkerFiles",
    "WorkerIO",
    "empty_cgroups",
    "end_group",
    "open_worker",
    "peer_pid",
    "remove_dir",
    "scope",
    "wait_pid_gone",
    "worker_env",
)

#: How long to wait for a worker's tree to go after SIGKILL before giving up on it (seconds).
KILL_WAIT: Final = 30.0
#: How often (seconds) a process group is scanned again when none of its members could be
#: waited on (no pidfd, another uid's process).
GROUP_POLL: Final = 0.01
#: How often (seconds) the tree of an orphaned worker that outlived its SIGKILL is looked at
#: again (its reaper is dead: nothing announces its end), and for how long each time.
ORPHAN_LOOK_EVERY: Final = 1.0
ORPHAN_LOOK_FOR: Final = 0.2
#: How long to spend removing a dead reaper's worker's directory (seconds; the rest later).
ORPHAN_CLEANUP_BUDGET: Final = 2.0
#: A page of zeros, and where the ledger's marks and each slot's head lie (written at once).
_PAGE: Final = bytes(4096)
_LEDGER_HEADS: Final = (0, *range(SLOTS_AT, SLOTS_AT + SLOTS * SLOT_SIZE, SLOT_SIZE))


class WorkerIO:
    """One worker's socket, files and directories."""

    __slots__ = (
        "cleanup",
        "endpoint",
        "groups",
        "kill_dir",
        "ledger",
        "ledger_fd",
        "members_fd",
        "members_file",
        "monitor",
        "peak_fd",
        "procs",
        "scopes",
        "scratch",
        "sock",
        "spill_fd",
        "spill_size",
        "wid",
    )

    def __init__(
        self, wid: int, endpoint: str, sock: zmq.Socket[bytes], ledger_fd: int | None
    ) -> None:
        self.wid = wid
        self.endpoint = endpoint
        self.sock = sock
        self.ledger = ""  # its ledger file's path
        self.ledger_fd: int | None = ledger_fd  # its ledger file, read with pread
        # The same file once its ledger was read (the worker is gone): its spill is read
        # through it still, for the results recovered from the ledger.
        self.spill_fd: int | None = None
        self.spill_size = 0  # the spill's size, after the marks and slots
        self.members_file: str | None = None  # its cgroup's cgroup.procs: who is in its tree
        self.members_fd: int | None = None  # the same, kept open (v2: pread re-reads it)
        self.peak_fd: int | None = None  # its cgroup's peak memory file, kept open
        self.kill_dir: str | None = None  # its v2 cgroup
        self.groups: list[str] = []  # its cgroup directories
        self.procs: list[str] = []  # the cgroup.procs files it joins first thing
        self.scratch: str | None = None  # its working directory
        self.cleanup: list[str] = []  # what to remove once its tree is gone
        self.scopes: list[anyio.CancelScope] = []
        # Its socket's connection events, watched from before the worker starts (an accept
        # missed would make its own connection look like a stranger's); the watch takes it
        # (and closes it), so it is left here only if the watch never ran.
        self.monitor: zmq.Socket[bytes] | None = None

    def close_files(self) -> None:
        """Close its cgroup files and end its tasks: the reader, as it ends, calls
        :meth:`close` (the ledger and the socket)."""
        self._close_fds(("peak_fd", "members_fd"))
        for s in self.scopes:
            s.cancel()

    def close(self) -> None:
        """Close everything. The ledger is closed here, not in :meth:`close_files` (the
        worker's end, as its last call settles): its file is unlinked by then, and the last
        close frees it, 0.1-0.8 ms of the kernel's (the sparse spill on ext4), which is
        better paid after that call's caller woke."""
        self.close_files()
        self._close_fds(("ledger_fd", "spill_fd"))
        if not self.sock.closed:
            # Stop the monitor before anything closes: libzmq's I/O thread blocks for good
            # on a monitor event whose reader is gone, freezing every socket of the context.
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            for sock in (self.monitor, self.sock):
                if sock is None or sock.closed:
                    continue
                try:
                    anyio.notify_closing(fd_of(sock))
                except Exception:
                    pass
                sock.close(linger=0)
            self.monitor = None

    def _close_fds(self, names: tuple[str, ...]) -> None:
        for name in names:
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)


def open_worker(
    ctx: zmq.Context[zmq.Socket[bytes]],
    pool_dir: str,
    wid: int,
    *,
    max_frame: int,
    profile: Profile,
    cgroup_set: CgroupSet | None,
) -> WorkerIO:
    """Make a new worker's directory, socket, ledger, cgroups and scratch directory."""
    # Its own directory (0700, root's until the worker takes it for its uid): no other
    # worker can reach the socket, whatever the umask, even before this one connects.
    sock_dir = os.path.join(pool_dir, f"w{wid}")
    os.mkdir(sock_dir, 0o700)
    endpoint = f"ipc://{sock_dir}/sock"
    ledger = os.path.join(sock_dir, "ledger")
    ledger_fd = os.open(ledger, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.ftruncate(ledger_fd, LEDGER_SIZE + spill_size(max_frame))  # (sparse)
    # The pages a call's marks and a kept result write, written now (zeros, as they read): a
    # worker's first write through its mapping into a hole of the file costs it 0.3-2 ms on
    # ext4 (its first call's; a warm spare's too).
    for at in _LEDGER_HEADS:
        os.pwrite(ledger_fd, _PAGE, at)
    sock: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.bind(endpoint)
    io = WorkerIO(wid, endpoint, sock, ledger_fd)
    io.ledger = ledger
    io.spill_size = spill_size(max_frame)
    io.cleanup = [sock_dir]
    if cgroup_set is not None and cgroup_set.base:
        wc = cgroup_set.for_worker(wid, memory=profile.memory, max_processes=profile.max_processes)
        io.procs = wc.procs_files
        io.kill_dir = wc.kill_dir
        io.groups = sorted(set(wc.dirs.values()))
        if io.kill_dir is not None:  # v2 regenerates cgroup.procs on each read from 0
            io.members_file = os.path.join(io.kill_dir, "cgroup.procs")
            io.members_fd = os.open(io.members_file, os.O_RDONLY | os.O_CLOEXEC)
        elif io.procs:  # v1 caches the list per open file: open it each time
            io.members_file = io.procs[0]
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
    if profile.scratch_dir:
        io.scratch = os.path.join(pool_dir, f"scratch-w{wid}")
        os.mkdir(io.scratch, 0o700)
        io.cleanup.append(io.scratch)
    return io


def worker_env(
    env: Mapping[str, str] | None, profile: Profile, scratch: str | None
) -> dict[str, str]:
    """A worker's environment: ``env`` (default: this process's) through the profile's
    allowlist, with this process's ``sys.path`` as ``PYTHONPATH``."""
    out = dict(os.environ) if env is None else dict(env)
    allow = profile.env_allowlist
    path = pythonpath(out, allow)
    if allow is not None:
        out = {k: out[k] for k in allow if k in out}
    out["PYTHONPATH"] = path
    if scratch is not None:
        out["TMPDIR"] = scratch
        if allow is not None:
            out["HOME"] = scratch
    return out


class WorkerFiles:
    """The core's probe: what it reads of live workers, from the files kept open for them."""

    def __init__(self) -> None:
        self.ios: dict[int, WorkerIO] = {}
        # Whether a worker was given cgroup files (its members, its peak memory): until one
        # is, the core need not ask for them (``Probe.cgroups``). Never set back.
        self.cgroups = False

    def add(self, io: WorkerIO) -> None:
        """A new worker's files."""
        self.ios[io.wid] = io
        if io.members_file is not None or io.peak_fd is not None:
            self.cgroups = True

    def marks(self, wid: int) -> tuple[int, int] | None:
        io = self.ios.get(wid)
        if io is None or io.ledger_fd is None:
            return None
        try:
            data = os.pread(io.ledger_fd, 16, 0)
        except OSError:
            return None
        return read_marks(data)

    def ledger(self, wid: int) -> tuple[tuple[int, int], list[tuple[int, bytes]]] | None:
        io = self.ios.get(wid)
        if io is None or io.ledger_fd is None:
            return None
        fd, io.ledger_fd = io.ledger_fd, None
        io.spill_fd = fd  # (closed with the worker's files)
        try:
            data = os.pread(fd, LEDGER_SIZE, 0)
        except OSError:
            return None
        taken, invoked, kept = read_ledger(data)
        return (taken, invoked), kept

    def spill(self, wid: int, offset: int, lengths: list[int]) -> list[bytes] | None:
        """The parts a result names in w's spill: one ``pread`` each, straight into the
        ``bytes`` that the result's value holds (its one copy on this side)."""
        io = self.ios.get(wid)
        if io is None:
            return None
        fd = io.ledger_fd if io.ledger_fd is not None else io.spill_fd
        if fd is None or offset + sum(lengths) > io.spill_size:
            return None
        parts = []
        at = SPILL_AT + offset
        try:
            for n in lengths:
                part = os.pread(fd, n, at)
                if len(part) != n:
                    return None
                parts.append(part)
                at += n
        except OSError:
            return None
        return parts

    def other_members(self, wid: int, pid: int | None) -> int | None:
        """How many processes other than the worker its cgroup lists (1 us with the v2 file
        kept open; about 10 us opening it)."""
        io = self.ios.get(wid)
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

    def tree_pids(self, wid: int, pid: int | None) -> tuple[int, ...]:
        """The live processes of the worker's tree: its cgroups' members, the worker and
        its descendants (a rare path: an unkillable worker, a scrape)."""
        import psutil

        io = self.ios.get(wid)
        found = cgroups.members(io.groups) if io is not None and io.groups else set()
        if pid is not None:
            try:
                proc = psutil.Process(pid)  # the reaper's child, not reaped: not reused
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.add(pid)
                found.update(c.pid for c in proc.children(recursive=True))
            except psutil.Error:
                pass
        return tuple(sorted(found))

    def peak(self, wid: int) -> int | None:
        io = self.ios.get(wid)
        if io is None or io.peak_fd is None:
            return None
        try:
            return int(os.pread(io.peak_fd, 64, 0))
        except (OSError, ValueError):
            return None

    def reset_peak(self, wid: int) -> None:
        """Start the tree's peak memory afresh (cgroup v1: writing 0 resets it)."""
        io = self.ios.get(wid)
        if io is not None and io.peak_fd is not None:
            try:
                os.pwrite(io.peak_fd, b"0", 0)
            except OSError:
                pass


def peer_pid(frame: zmq.Frame) -> int | None:
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


def empty_cgroups(kill_dir: str | None, groups: list[str], wait: float = KILL_WAIT) -> bool:
    """Kill every process in a worker's cgroups (v2: ``cgroup.kill``; v1: each member) until
    none is left, for ``wait`` seconds at most; True once they are verified empty (blocking:
    run it in a thread)."""
    deadline = time.monotonic() + wait
    while True:
        if kill_dir is not None:
            cgroups.cgroup_kill(kill_dir)
            cgroups.wait_empty(kill_dir, min(0.2, wait))
        members = cgroups.members(groups)
        if not members and (kill_dir is None or not cgroups.populated(kill_dir)):
            return True
        if time.monotonic() >= deadline:
            return False
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)  # a killed process leaves its cgroup once it has exited


def remove_dir(path: str, *, cgroup: bool) -> None:
    """Remove one of a worker's directories: a cgroup (rmdir), or a plain one, for at most
    ORPHAN_CLEANUP_BUDGET seconds (blocking: run it in a thread). What is left of a huge
    tree the pool's close removes, with the rest of the pool's directory. Which it is, the
    caller says (it made it): a name in a directory the worker could write says nothing."""
    if cgroup:
        cgroups.remove(path)
    else:
        _remove.remove_tree(path, ORPHAN_CLEANUP_BUDGET).close()


def _live_group(pid: int) -> int | None:
    """The process group of process ``pid`` if it is alive (not a zombie), else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``: a scan of ``/proc`` (blocking: run it
    in a thread)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _live_group(int(e)) == pgid]


async def end_group(pgid: int, timeout: float) -> bool:
    """SIGKILL every process of process group ``pgid`` (a dead worker's: it leads its own)
    and wait until none is left alive; False if some still live after ``timeout`` seconds.

    Each member is signalled and awaited through a pidfd, checked to be in the group once
    opened: a pidfd names one process whatever becomes of its pid number."""
    with anyio.move_on_after(timeout):
        while True:
            members = await anyio.to_thread.run_sync(_group_members, pgid)
            if not members:
                return True
            waited = False
            for pid in members:
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue  # gone meanwhile (or no pidfds here, or none left to open)
                try:
                    if _live_group(pid) == pgid:  # (still the process the scan saw)
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                        await anyio.wait_readable(fd)  # readable once it has exited
                        waited = True
                except OSError:
                    pass  # (not ours to signal: another uid's)
                finally:
                    os.close(fd)
            if not waited:  # nothing to wait on: scan again soon, not at once
                await anyio.sleep(GROUP_POLL)
    return False


async def wait_pid_gone(pid: int) -> None:
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


def scope(io: WorkerIO) -> anyio.CancelScope:
    """A cancel scope that ends with the worker (``close_files``)."""
    s = anyio.CancelScope()
    io.scopes.append(s)
    if io.sock.closed:
        s.cancel()
    return s
