"""The hostile-tool kit: each threat, the tool that makes it, how its result is judged, and
which layer catches it (``toolpool selftest``, ``tests/test_containment.py``). The tools are
in :mod:`toolpool.testing.hostile`."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import psutil

from ..core import Outcome
from .hostile import CONTENT_OPS, NAME_OPS, registry


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
    action: str  # "call", "cancel" (after it started), "timeout:<seconds>", or "run"
    check: Check
    runner: Runner | None = None  # action "run": does more than one call; its Observed is judged


@dataclass
class Observed:
    """What a threat's runner saw (a threat that is more than one call)."""

    text: str
    facts: dict[str, Any] = field(default_factory=dict)


Runner = Callable[[Any, Threat, str], Awaitable[Observed]]


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


async def _wait_pid_exit(pid: int, timeout: float) -> bool:
    """Wait until process ``pid`` (not necessarily a child) has exited; False on timeout."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        with anyio.move_on_after(timeout):
            await anyio.wait_readable(fd)  # a pidfd turns readable when the process exits
            return True
        return False
    finally:
        os.close(fd)


def _alive(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _outside_file() -> tuple[str, str]:
    """A directory outside every pool and a world-writable file in it (a hard link's target)."""
    base = tempfile.mkdtemp(prefix="toolpool-kit-")
    os.chmod(base, 0o755)
    path = os.path.join(base, "keep")
    with open(path, "w") as f:
        f.write("keep")
    os.chmod(path, 0o666)
    return base, path


def _intact(path: str) -> bool:
    """The outside file is as it was, with no other name (a hard link left) and its
    directory still there."""
    with open(path) as f:
        kept = f.read() == "keep"
    return kept and os.stat(path).st_nlink == 1 and os.path.isdir(os.path.dirname(path))


def _cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _gone(path: str | None) -> bool:
    return bool(path) and not os.path.lexists(str(path))


async def _litter_then_exit(pool: Any, threat: Threat, marker: str) -> Observed:
    """A tool litters its scratch directory and ends its worker while a bystander call runs
    in another worker: the reaper must survive, remove it all, and the bystander be served."""
    reaper = pool.reaper_pid
    base, outside = _outside_file()
    try:
        bystander = pool.submit("cooperative", {"seconds": 120.0})
        await bystander.wait_started()
        busy = bystander._worker.pid if bystander._worker is not None else None
        cwds = {pid: _cwd(pid) for pid in pool.worker_pids if pid != busy}
        result = await pool.call(threat.tool, {**threat.args, "outside": outside, "leave": "exit"})
        scratch = cwds.get(result.worker_pid)
        if scratch is not None:
            with anyio.move_on_after(120):
                await pool._reaper.wait_removed(scratch)
        removed = _gone(scratch)
        bystander.cancel()
        by = await bystander
        facts = {
            "exit": result.outcome is Outcome.WORKER_LOST,
            "bystander": by.outcome in (Outcome.ABORTED, Outcome.OK),
            "reaper": pool.reaper_pid == reaper and _alive(reaper),
            "removed": removed,
            "outside": _intact(outside),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    bad = [name for name, ok in facts.items() if not ok]
    text = f"{result.outcome.value}; bystander {by.outcome.value}; scratch "
    text += "removed" if removed else "left"
    return Observed(text + (f"; FAILED: {', '.join(bad)}" if bad else ""), facts)


async def _litter_then_close(pool: Any, threat: Threat, marker: str) -> Observed:
    """A tool litters its scratch directory, then a pool of its own (same tools and profile)
    is closed: the close must end cleanly and in bounded time, and the tree be removed (in
    the background if it takes long)."""
    from ..supervisor import Pool

    base, outside = _outside_file()
    try:
        sub = Pool(pool.tools_spec, workers=1, profile=pool.profile, start_method=pool.start_method)
        await sub.start()
        error = None
        report: Any = None
        try:
            made = await sub.call(threat.tool, {**threat.args, "outside": outside})
        finally:
            began = time.monotonic()
            try:
                report = await sub.aclose()
            except Exception as exc:  # the very failure this threat looks for
                error, report = f"{type(exc).__name__}: {exc}", None
            took = time.monotonic() - began
        pool_dir = str((made.value or {}).get("cwd", "")).rpartition("/")[0]
        done = report is not None and (
            report.finished
            or (report.cleaner_pid is not None and await _wait_pid_exit(report.cleaner_pid, 120))
        )
        facts = {
            "tool": made.ok,
            "closed": error is None,
            "reaper": sub._reaper is not None and sub._reaper.said_bye,  # it did not crash
            "bounded": took < 30,
            "removed": done and _gone(pool_dir),
            "outside": _intact(outside),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    bad = [name for name, ok in facts.items() if not ok]
    if report is None:
        text = f"aclose raised {error}"
    elif report.finished:
        text = f"closed in {took:.1f}s, all removed"
    else:
        text = f"closed in {took:.1f}s, rest removed in the background"
    return Observed(text + (f"; FAILED: {', '.join(bad)}" if bad else ""), facts)


def _facts(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    ok = all(result.facts.values())
    return ok, "reaper and bystander unharmed, tree removed", "bounded remover"


def _xattrs(path: str) -> dict[str, bytes]:
    try:
        return {n: os.getxattr(path, n, follow_symlinks=False) for n in os.listxattr(path)}
    except OSError:
        return {}


def _disk_state(directory: str) -> dict[str, Any]:
    """Everything a change to ``directory`` or its entries would show in (ctime included:
    every change of metadata moves it)."""
    state: dict[str, Any] = {}
    for name in [".", *sorted(os.listdir(directory))]:
        path = os.path.join(directory, name)
        st = os.lstat(path)
        state[name] = (
            st.st_mode,
            st.st_uid,
            st.st_gid,
            st.st_size,
            st.st_mtime_ns,
            st.st_ctime_ns,
            _xattrs(path),
        )
    try:
        with open(os.path.join(directory, "file"), "rb") as f:
            state["content"] = f.read()
    except FileNotFoundError:
        state["content"] = None
    return state


def _target(base: str) -> str:
    """A world-writable directory and file (with a ``user.toolpool`` attribute) in ``base``."""
    os.chmod(base, 0o755)
    directory = os.path.join(base, "target")
    os.mkdir(directory)
    os.chmod(directory, 0o777)
    file = os.path.join(directory, "file")
    with open(file, "w") as f:
        f.write("original")
    os.chmod(file, 0o666)
    for path in (file, directory):
        try:
            os.setxattr(path, "user.toolpool", b"kit")
        except OSError:
            pass  # no user xattrs on this filesystem: the tool's attempts fail anyway
    return directory


async def _metadata_outside(pool: Any, threat: Threat, marker: str) -> Observed:
    """A tool tries to change a world-writable directory and file outside its scratch
    directory: their content, their names, their metadata. The disk is compared before and
    after, not only the tool's word."""
    base = tempfile.mkdtemp(prefix="toolpool-kit-")
    try:
        directory = _target(base)
        before = _disk_state(directory)
        result = await pool.call(threat.tool, {"directory": directory})
        after = _disk_state(directory)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = result.value if result.ok and isinstance(result.value, dict) else {}
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    through = [op for op, what in report.items() if what == "done"]
    text = "all refused" if report and not through else f"went through: {', '.join(through)}"
    if not result.ok:
        text = f"{result.outcome.value}: {result.error}"
    return Observed(
        text, {"ok": result.ok, "report": report, "through": through, "changed": changed}
    )


def _metadata(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    facts = result.facts
    if not facts["ok"]:
        return False, "a report of each attempt", "-"
    through, changed = set(facts["through"]), facts["changed"]
    if "readonly_fs" in layers:
        by = "readonly_fs" + (" + landlock" if "landlock" in layers else "")
        return not through and not changed, "every change refused (EROFS)", by
    if "landlock" in layers:
        # Landlock's rights cover content and names, not metadata.
        ok = not through & {*CONTENT_OPS, *NAME_OPS}
        ok = ok and "content" not in changed and set(changed) <= {".", "file"}
        return ok, "content and names refused; metadata not contained", "landlock"
    return True, "not contained (no read-only mounts, no Landlock)", "none"


async def _non_string_key(pool: Any, threat: Threat, marker: str) -> Observed:
    """Arguments with a map key that is not a string: refused at submit, saying where."""
    try:
        call = pool.submit(threat.tool, threat.args)
    except TypeError as exc:
        return Observed(f"TypeError at submit: {exc}"[:120], {"error": str(exc)})
    result = await call
    return Observed(f"accepted: {result.outcome.value} {result.error}"[:120], {"error": None})


def _key_error(result: Any, layers: set[str]) -> tuple[bool, str, str]:
    error = result.facts["error"] or ""
    ok = "args['value'] has a key that is not a string: 1" in error
    return ok, "TypeError at submit naming the key", "pack_value (submit)"


THREATS: tuple[Threat, ...] = (
    Threat("fork bomb", "fork_bomb", {}, "timeout:1.5", _fork_bomb),
    # (A wide timeout: on a loaded machine touching 512 MiB can take seconds before the cap
    # kills it; only the uncapped case waits it out.)
    Threat("memory hog", "memory_hog", {}, "timeout:15", _memory),
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
    Threat(
        "hostile tree in scratch, then its worker exits",
        "litter_scratch",
        {"depth": 3000, "files": 1000},
        "run",
        _facts,
        _litter_then_exit,
    ),
    Threat(
        "hostile tree in scratch at the pool's close",
        "litter_scratch",
        {"depth": 3000, "files": 1000},
        "run",
        _facts,
        _litter_then_close,
    ),
    Threat(
        "changes metadata outside its scratch directory",
        "touch_outside",
        {},
        "run",
        _metadata,
        _metadata_outside,
    ),
    Threat(
        "arguments with a non-string key",
        "echo",
        {"value": {1: 2}},
        "run",
        _key_error,
        _non_string_key,
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
    result: Any
    if threat.runner is not None:
        result = await threat.runner(pool, threat, marker)
    else:
        call = pool.submit(threat.tool, args, timeout=timeout)
        if threat.action == "cancel":
            await call.wait_started()
            call.cancel()
        result = await call
    leftovers = marker_processes(marker)
    active = {layer.name for layer in pool.containment().layers if layer.active}
    passed, expected, caught_by = threat.check(result, active)
    if isinstance(result, Observed):
        observed = result.text
    else:
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
