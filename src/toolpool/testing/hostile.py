"""The hostile-tool kit: misbehaving tools, each with the outcome and guarantees it must produce.

``toolpool.testing.hostile:registry`` holds the tools; :data:`THREATS` says how to call each
and what must happen; :func:`run_kit` runs them against a live pool and returns a verdict per
threat (``toolpool selftest`` prints them). Every tool is bounded: without limits it still
stops (a fork bomb at a few hundred processes, a memory hog at 1 GiB), so the kit is safe to run
on a machine with no containment at all. Processes the tools start carry a marker in their
argv, so a run can check machine-wide that none survived.

Tools are meant to run in toolpool workers. Do not call them in your own process.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import psutil

from ..core import Outcome
from ..worker import Registry, ToolExecution

__all__ = ("THREATS", "Threat", "Verdict", "registry", "run_kit")

registry = Registry()


def _sleeper_argv(marker: str, seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})", marker]


def _daemonize(marker: str, seconds: float) -> None:
    """Start a grandchild that escapes with setsid and a double fork."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                os.execvp(sys.executable, _sleeper_argv(marker, seconds))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


@registry.tool
def fork_bomb(marker: str, cap: int = 400) -> int:
    """Fork until fork fails or ``cap`` processes exist, then block. Children block too."""
    made = 0
    for _ in range(cap):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            try:
                os.execvp(sys.executable, _sleeper_argv(marker, 3600))
            finally:
                os._exit(0)
        made += 1
    time.sleep(3600)
    return made


@registry.tool
def memory_hog(cap_mib: int = 1024) -> int:
    """Allocate and touch memory in 32 MiB chunks up to ``cap_mib``, then block."""
    chunks = []
    for _ in range(cap_mib // 32):
        chunks.append(b"\x01" * (32 * 1024 * 1024))  # written, so really resident
    time.sleep(3600)
    return len(chunks)


@registry.tool
def infinite_recursion() -> None:
    """Recurse without end."""

    def down(n: int) -> int:
        return down(n + 1) + 1

    down(0)


@registry.tool
async def sigterm_ignoring_loop() -> None:
    """Ignore SIGTERM and the signal; block the worker's event loop in a busy loop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        pass


@registry.tool
def daemon(marker: str) -> str:
    """Leave a setsid'd double-forked daemon behind and return."""
    _daemonize(marker, 3600)
    return "daemon started"


@registry.tool
def fd_exhaustion(cap: int = 100_000) -> int:
    """Open files until the process runs out of descriptors (EMFILE), then return the count."""
    files = []
    try:
        for _ in range(cap):
            files.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
    finally:
        for fd in files:
            os.close(fd)
    return len(files)


@registry.tool
def output_flood(mib: int = 64) -> int:
    """Write ``mib`` MiB to stdout and stderr."""
    block = b"x" * (1024 * 1024)
    for _ in range(mib):
        os.write(1, block)
        os.write(2, block)
    return mib


@registry.tool
def close_stdio() -> str:
    """Close the worker's stdin, stdout and stderr."""
    for fd in (0, 1, 2):
        try:
            os.close(fd)
        except OSError:
            pass
    return "closed"


@registry.tool
def hard_exit(code: int = 7) -> None:
    """``os._exit``: the worker vanishes mid-call."""
    os._exit(code)


@registry.tool
def segfault() -> None:
    """Read address 0 through ctypes."""
    ctypes.string_at(0)


@registry.tool
def kill_own_worker() -> None:
    """SIGKILL the worker process it runs in."""
    os.kill(os.getpid(), signal.SIGKILL)


def _try_signal(pid: int | None) -> str:
    if pid is None:
        return "none"
    try:
        os.kill(pid, signal.SIGURG)  # ignored by default: harmless if it gets through
    except PermissionError:
        return "blocked"
    except ProcessLookupError:
        return "gone"
    return "delivered"


@registry.tool
def signal_others(workers: list[int] | None = None) -> dict[str, str]:
    """Try to signal the reaper, the supervisor and a sibling worker (with harmless SIGURG)."""
    sibling = next((pid for pid in workers or [] if pid != os.getpid()), None)
    reaper = os.getppid()
    try:
        supervisor: int | None = psutil.Process(reaper).ppid()
    except psutil.Error:
        supervisor = None
    return {
        "reaper": _try_signal(reaper),
        "supervisor": _try_signal(supervisor),
        "sibling": _try_signal(sibling),
    }


@registry.tool
def reach_network(port: int = 9) -> str:
    """Connect to 127.0.0.1 (loopback only: never another address); return what happened."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(("127.0.0.1", port))
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc))
    return "connected"


@registry.tool
def leave_cgroup(marker: str, block: bool = True) -> str:
    """Try to move itself into the root cgroup, then start a daemon and block (or, with
    ``block=False``, only report whether the move worked)."""
    outcome = "no cgroup v2"
    with open("/proc/self/mountinfo") as f:
        mounts = f.read().splitlines()
    for line in mounts:
        if " - cgroup2 " in line:
            root = line.split()[4]
            try:
                with open(os.path.join(root, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
                outcome = "escaped"
            except OSError as exc:
                outcome = f"blocked ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
            break
    if not block:
        return outcome
    _daemonize(marker, 3600)
    time.sleep(3600)
    return outcome


@registry.tool
async def garbage_frames() -> None:
    """Find the worker's own zmq socket and write garbage and an oversized frame on it."""
    import zmq

    for obj in gc.get_objects():
        if isinstance(obj, zmq.Socket) and not obj.closed and obj.socket_type == zmq.PAIR:
            obj.send(b"\xc1garbage")
            obj.send(b"\x00" * (obj.getsockopt(zmq.MAXMSGSIZE) + 1))  # type: ignore[operator]
    await anyio.sleep(3600)


@registry.tool
def sleep_past_timeout(seconds: float = 3600.0) -> str:
    """Sleep, ignoring its signal, far past the call's timeout."""
    time.sleep(seconds)
    return "woke"


@registry.tool
def cooperative(seconds: float, execution: ToolExecution) -> str:
    """A well-behaved tool: the kit checks the pool still serves one after each threat."""
    if execution.signal.wait_blocking(seconds):
        execution.signal.raise_if_cancelled()
    return "fine"


# --------------------------------------------------------------------------- the kit


@dataclass(frozen=True)
class Verdict:
    """One threat's result in a kit run."""

    threat: str
    expected: str
    observed: str
    passed: bool
    caught_by: str
    leftovers: list[int]


Check = Callable[[Any, set[str]], tuple[bool, str, str]]
"""``check(result, active_layers) -> (passed, expected, caught_by)``."""


@dataclass(frozen=True)
class Threat:
    """A hostile tool, how to call it, and what must happen."""

    name: str
    tool: str
    args: dict[str, Any]
    action: str  # "call", "cancel" (after it started), or "timeout:<seconds>"
    check: Check


def _outcome(*allowed: Outcome, by: str) -> Check:
    def check(result: Any, layers: set[str]) -> tuple[bool, str, str]:
        return result.outcome in allowed, "/".join(o.value for o in allowed), by

    return check


def _fork_bomb(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    if "cgroup_memory" in layers:
        # Each child is a Python interpreter: the tree can hit the memory cap before the
        # pids cap stops the forking, and the OOM killer takes the worker (worker_lost).
        ok = result.outcome in (Outcome.KILLED, Outcome.WORKER_LOST)
        return ok, "killed, or worker_lost (OOM)", "cgroup_pids/cgroup_memory + kill barrier"
    by = "cgroup_pids + kill barrier" if "cgroup_pids" in layers else "kill loop (bounded bomb)"
    return result.outcome is Outcome.KILLED, "killed", by


def _memory(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    if "cgroup_memory" in layers:
        ok = result.outcome is Outcome.WORKER_LOST and result.exit_signal == signal.SIGKILL
        ok = ok and "out of memory" in (result.error or "")
        return ok, "worker_lost (OOM-killed)", "cgroup_memory"
    return (
        result.outcome is Outcome.KILLED,
        "killed (no memory cap: the tool stops at 1 GiB)",
        ("timeout + kill"),
    )


def _signals(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    value = result.value or {}
    pairs = (("uid", "uid"), ("landlock", "landlock (signal scope)"))
    by = [name for layer, name in pairs if layer in layers]
    if by:
        ok = result.ok and all(value.get(k) == "blocked" for k in ("reaper", "supervisor"))
        ok = ok and value.get("sibling") in ("blocked", "none")
        return ok, "all blocked", " + ".join(by)
    return result.ok, "delivered (not contained without Landlock or another uid)", "none"


def _network(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    if "netns" in layers:
        return result.ok and result.value == "ENETUNREACH", "ENETUNREACH", "netns"
    return result.ok, "reachable (network allowed)", "none"


def _cgroup_escape(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    by = " + ".join(layer for layer in ("uid", "landlock") if layer in layers)
    return result.outcome is Outcome.KILLED, "killed, tree gone", by or "subreaper kill loop"


def _segfault(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    ok = result.outcome is Outcome.WORKER_LOST and result.exit_signal == signal.SIGSEGV
    return ok, "worker_lost (SIGSEGV)", "process boundary"


def _daemon(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    ok = result.ok and result.leftovers_killed >= 1
    return ok, "ok, leftovers killed", "subreaper + leftover clean-up"


THREATS: tuple[Threat, ...] = (
    Threat("fork bomb", "fork_bomb", {}, "timeout:1.5", _fork_bomb),
    Threat("memory hog", "memory_hog", {}, "timeout:5", _memory),
    Threat(
        "infinite recursion",
        "infinite_recursion",
        {},
        "call",
        _outcome(Outcome.ERROR, by="RecursionError"),
    ),
    Threat(
        "SIGTERM-ignoring busy loop",
        "sigterm_ignoring_loop",
        {},
        "cancel",
        _outcome(Outcome.KILLED, by="SIGKILL rung"),
    ),
    Threat("setsid double-fork daemon", "daemon", {}, "call", _daemon),
    Threat("fd exhaustion", "fd_exhaustion", {}, "call", _outcome(Outcome.OK, by="RLIMIT_NOFILE")),
    Threat(
        "output flood",
        "output_flood",
        {},
        "call",
        _outcome(Outcome.OK, by="output discarded"),
    ),
    Threat("closing stdio", "close_stdio", {}, "call", _outcome(Outcome.OK, by="process boundary")),
    Threat(
        "os._exit",
        "hard_exit",
        {},
        "call",
        _outcome(Outcome.WORKER_LOST, by="process boundary"),
    ),
    Threat("segfault", "segfault", {}, "call", _segfault),
    Threat(
        "kills its own worker",
        "kill_own_worker",
        {},
        "call",
        _outcome(Outcome.WORKER_LOST, by="process boundary"),
    ),
    Threat("signals the supervisor or a sibling", "signal_others", {}, "call", _signals),
    Threat("reaches the network", "reach_network", {}, "call", _network),
    Threat("leaves its cgroup", "leave_cgroup", {}, "timeout:1.5", _cgroup_escape),
    Threat(
        "garbage and oversized frames",
        "garbage_frames",
        {},
        "call",
        _outcome(Outcome.WORKER_LOST, by="strict decoder (C7)"),
    ),
    Threat(
        "sleeps past its timeout",
        "sleep_past_timeout",
        {},
        "timeout:0.5",
        _outcome(Outcome.KILLED, by="timeout + SIGTERM"),
    ),
)


def marker_processes(marker: str) -> list[int]:
    """Pids of live processes whose argv carries ``marker`` (machine-wide)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if marker in (proc.info.get("cmdline") or []) and (
                proc.info.get("status") != psutil.STATUS_ZOMBIE
            ):
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


#: The longest value text a verdict shows; beyond it, an ellipsis ends the text.
_OBSERVED_MAX = 200


async def run_threat(pool: Any, threat: Threat, marker: str) -> Verdict:
    """Run one threat on ``pool`` and judge it; the pool must serve a call afterwards."""
    args = dict(threat.args)
    if "marker" in registry.tools[threat.tool].signature.json_schema()["properties"]:
        args["marker"] = marker
    if threat.tool == "signal_others":
        args["workers"] = list(pool.worker_pids)
    timeout = None
    if threat.action.startswith("timeout:"):
        timeout = float(threat.action.split(":", 1)[1])
    call = pool.submit(threat.tool, args, timeout=timeout)
    if threat.action == "cancel":
        await call.wait_started()
        call.cancel()
    result = await call
    leftovers = marker_processes(marker)
    active = {layer.name for layer in pool.containment().layers if layer.active}
    passed, expected, caught_by = threat.check(result, active)
    observed = result.outcome.value
    if result.ok and result.value is not None:
        shown = repr(result.value)
        if len(shown) > _OBSERVED_MAX:  # said so: never cut off silently
            shown = shown[: _OBSERVED_MAX - 1] + "\N{HORIZONTAL ELLIPSIS}"
        observed += f" {shown}"
    after = await pool.call("cooperative", {"seconds": 0.0})
    if not after.ok:
        passed = False
        observed += f"; next call {after.outcome.value}"
    if leftovers:
        passed = False
        observed += f"; {len(leftovers)} process(es) survived"
    return Verdict(threat.name, expected, observed, passed, caught_by, leftovers)


async def run_kit(pool: Any, *, only: list[str] | None = None) -> list[Verdict]:
    """Run every threat (or those named in ``only``) on ``pool``, which must serve
    ``toolpool.testing.hostile:registry``."""
    verdicts = []
    for threat in THREATS:
        if only is not None and threat.name not in only:
            continue
        marker = f"toolpool-kit-{os.getpid()}-{threat.tool}-{time.monotonic_ns()}"
        verdicts.append(await run_threat(pool, threat, marker))
    return verdicts


@registry.tool
def environment() -> dict[str, str]:
    """The worker's environment (to check the allowlist)."""
    return dict(os.environ)


@registry.tool
def identity() -> dict[str, object]:
    """Who the tool runs as: uid, gid, supplementary groups, capabilities, no-new-privs."""
    status: dict[str, str] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    return {
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "gid": os.getgid(),
        "groups": os.getgroups(),
        "cap_eff": status.get("CapEff", ""),
        "no_new_privs": status.get("NoNewPrivs", ""),
        "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0],
    }


@registry.tool
def working_directory() -> str:
    """The worker's working directory (its scratch directory when the profile has one)."""
    return os.getcwd()


@registry.tool
def allocate(mib: int) -> int:
    """Allocate and touch ``mib`` MiB, then release it and return (a well-behaved hog)."""
    block = b"\x01" * (mib * 1024 * 1024)
    return len(block) // (1024 * 1024)
