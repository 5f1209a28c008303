"""The hostile-tool kit: each threat, the tool that makes it, how its result is judged, and
which layer catches it (``toolpool selftest``, ``tests/test_containment.py``). The tools are
in :mod:`toolpool.testing.hostile`."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import psutil

from ..core import Outcome
from .hostile import CONTENT_OPS, NAME_OPS, registry

Status = Literal["held", "not held", "not run", "FAILED"]
"""What a kit row says about its threat:

- ``held``: the threat was stopped; ``caught_by`` names what stopped it, from what was observed;
- ``not held``: it went through, as expected under this profile (``expected`` says why);
- ``not run``: the check could not be made (``observed`` says why);
- ``FAILED``: it went through, or harmed the pool, though the profile's layers claim to stop it.
"""


@dataclass(frozen=True)
class Judgement:
    """A check's answer: the row's status, what the profile leads one to expect, and what
    stopped the threat (``"-"`` where nothing did)."""

    status: Status
    expected: str
    caught_by: str


@dataclass(frozen=True)
class Setting:
    """What a check judges a result against: the layers active in the pool's workers and
    the profile they run under."""

    layers: frozenset[str]
    profile: Any


@dataclass(frozen=True)
class Verdict:
    """One threat's result in a kit run."""

    threat: str
    expected: str
    observed: str
    status: Status
    caught_by: str
    leftovers: list[int]

    @property
    def passed(self) -> bool:
        """Not ``FAILED``: the threat was held, or went through where the profile says it
        would, or could not be run."""
        return self.status != "FAILED"


Check = Callable[[Any, Setting], Judgement]
"""``check(result, setting) -> Judgement``."""


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


def _held(ok: bool, expected: str, by: str) -> Judgement:
    """Held by ``by`` if ``ok``; else the threat went through what claims to stop it."""
    return Judgement("held" if ok else "FAILED", expected, by if ok else "-")


def _outcome(*allowed: Outcome, by: str) -> Check:
    def check(result: Any, setting: Setting) -> Judgement:
        return _held(result.outcome in allowed, "/".join(o.value for o in allowed), by)

    return check


def _fork_bomb(result: Any, setting: Setting) -> Judgement:
    if "cgroup_memory" in setting.layers:
        # Each child is a Python interpreter: the tree can hit the memory cap before the
        # pids cap stops the forking, and the OOM killer takes the worker (worker_lost).
        ok = result.outcome in (Outcome.KILLED, Outcome.WORKER_LOST)
        return _held(ok, "killed, or worker_lost (OOM)", "cgroup_pids/cgroup_memory + kill barrier")
    if "cgroup_pids" in setting.layers:
        return _held(result.outcome is Outcome.KILLED, "killed", "cgroup_pids + kill barrier")
    if result.outcome is not Outcome.KILLED:
        return Judgement("FAILED", "killed", "-")
    # Nothing capped the forking: the bomb stopped at its own bound, the kill loop reaped it.
    return Judgement("not held", "forks unchecked (no pids cap); the kill loop reaps the tree", "-")


def _memory(result: Any, setting: Setting) -> Judgement:
    if "cgroup_memory" in setting.layers:
        ok = result.outcome is Outcome.WORKER_LOST and result.exit_signal == signal.SIGKILL
        ok = ok and "out of memory" in (result.error or "")
        return _held(ok, "worker_lost (OOM-killed)", "cgroup_memory")
    if result.outcome is not Outcome.KILLED:
        return Judgement("FAILED", "killed", "-")
    return Judgement(
        "not held", "allocates unchecked (no memory cap: the tool stops at 1 GiB)", "-"
    )


def _fd_exhaustion(result: Any, setting: Setting) -> Judgement:
    """What stopped the tool is the open-file limit it reported (EMFILE at ``limit``): the
    profile's, or one the worker inherited."""
    value = result.value if result.ok and isinstance(result.value, dict) else {}
    limit, ours = value.get("limit"), setting.profile.max_open_files
    if not result.ok or not value.get("emfile"):
        if result.ok and ours is None:  # no limit below the tool's own bound of opens
            return Judgement("not held", "opens unchecked (no open-file limit)", "-")
        return Judgement("FAILED", "EMFILE, the worker serves on", "-")
    if ours is not None and isinstance(limit, int) and limit <= ours:
        # (Below the profile's where the hard limit it inherited is lower: stricter still.)
        return Judgement("held", "EMFILE, the worker serves on", f"RLIMIT_NOFILE={limit}")
    if ours is not None:  # the profile's limit is not what the worker ran under
        return Judgement("FAILED", f"EMFILE at the profile's RLIMIT_NOFILE={ours}", "-")
    return Judgement(
        "held",
        "EMFILE at the inherited limit (the profile sets none)",
        f"RLIMIT_NOFILE={limit} (inherited)",
    )


def _signal_guards(setting: Setting) -> list[str]:
    pairs = (("uid", "uid"), ("landlock", "landlock (signal scope)"))
    return [name for layer, name in pairs if layer in setting.layers]


def _signals(result: Any, setting: Setting) -> Judgement:
    """The reaper and the supervisor: signals from a tool are blocked by another uid or
    Landlock's signal scope; with neither, they are delivered (not contained)."""
    value = result.value if result.ok and isinstance(result.value, dict) else {}
    seen = [value.get(k) for k in ("reaper", "supervisor")]
    by = _signal_guards(setting)
    if by:
        return _held(seen == ["blocked", "blocked"], "both blocked", " + ".join(by))
    if result.ok and all(v in ("blocked", "delivered") for v in seen):
        return Judgement("not held", "delivered (no Landlock, no uid of its own)", "-")
    return Judgement("FAILED", "delivered or blocked, reported", "-")


def _sibling(result: Any, setting: Setting) -> Judgement:
    """A sibling worker: as :func:`_signals`; ``not run`` where no other worker was up."""
    if isinstance(result, Observed):
        if not result.facts.get("ran"):
            return Judgement("not run", "a second worker to signal", "-")
        result = result.facts["result"]
    seen = (result.value or {}).get("sibling") if result.ok else None
    if seen in ("none", "gone"):
        return Judgement("not run", "a second worker to signal", "-")
    by = _signal_guards(setting)
    if by:
        return _held(seen == "blocked", "blocked", " + ".join(by))
    if seen in ("blocked", "delivered"):
        return Judgement("not held", "delivered (no Landlock, no uid of its own)", "-")
    return Judgement("FAILED", "delivered or blocked, reported", "-")


def _network(result: Any, setting: Setting) -> Judgement:
    if "netns" in setting.layers:
        return _held(result.ok and result.value == "ENETUNREACH", "ENETUNREACH", "netns")
    if result.ok:
        return Judgement("not held", "reachable (the profile allows the network)", "-")
    return Judgement("FAILED", "reachable or not, reported", "-")


def _cgroup_escape(result: Any, setting: Setting) -> Judgement:
    by = " + ".join(layer for layer in ("uid", "landlock") if layer in setting.layers)
    return _held(result.outcome is Outcome.KILLED, "killed, tree gone", by or "subreaper kill loop")


def _segfault(result: Any, setting: Setting) -> Judgement:
    ok = result.outcome is Outcome.WORKER_LOST and result.exit_signal == signal.SIGSEGV
    return _held(ok, "worker_lost (SIGSEGV)", "process boundary")


def _daemon(result: Any, setting: Setting) -> Judgement:
    ok = result.ok and result.leftovers_killed >= 1
    return _held(ok, "ok, leftovers killed", "subreaper + leftover clean-up")


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


def _searchable_by_all(path: str) -> bool:
    """Every directory from the root to ``path`` lets any user through (others' ``x``)."""
    path = os.path.abspath(path)
    while True:
        try:
            if not os.stat(path).st_mode & 0o001:
                return False
        except OSError:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def shared_tmp() -> str:
    """A temporary directory every user can reach: the usual one, or where it is private
    (``/tmp`` is 0700 on some machines) ``/var/tmp`` or ``/dev/shm``. The kit's targets
    outside the pool live there, so that what keeps a tool from them is the layer under test,
    not a directory the tool's own uid could never enter."""
    for place in (tempfile.gettempdir(), "/var/tmp", "/dev/shm"):
        if os.path.isdir(place) and _searchable_by_all(place):
            return place
    return tempfile.gettempdir()


def _outside_file() -> tuple[str, str]:
    """A directory outside every pool and a world-writable file in it (a hard link's target)."""
    base = tempfile.mkdtemp(prefix="toolpool-kit-", dir=shared_tmp())
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
    # Every worker up first: the call must land on one whose directory is noted below, not
    # on the replacement of one an earlier threat killed, still starting (then unknown).
    await _workers_up(pool, pool.size)
    base, outside = _outside_file()
    try:
        bystander = pool.submit("cooperative", {"seconds": 120.0})
        await bystander.wait_started()
        worker = bystander._record._worker  # (the machine's record of the call)
        busy = worker.pid if worker is not None else None
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
    text += "unknown" if scratch is None else "removed" if removed else "left"
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


def _facts(result: Any, setting: Setting) -> Judgement:
    ok = all(result.facts.values())
    return _held(ok, "reaper and bystander unharmed, tree removed", "bounded remover")


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
    base = tempfile.mkdtemp(prefix="toolpool-kit-", dir=shared_tmp())
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


def _metadata(result: Any, setting: Setting) -> Judgement:
    facts, layers = result.facts, setting.layers
    if not facts["ok"]:
        return Judgement("FAILED", "a report of each attempt", "-")
    through, changed = set(facts["through"]), facts["changed"]
    if "readonly_fs" in layers:
        by = "readonly_fs" + (" + landlock" if "landlock" in layers else "")
        return _held(not through and not changed, "every change refused (EROFS)", by)
    if "landlock" in layers:
        # Landlock's rights cover content and names, not metadata.
        ok = not through & {*CONTENT_OPS, *NAME_OPS}
        ok = ok and "content" not in changed and set(changed) <= {".", "file"}
        expected = "content and names refused; metadata not contained"
        if not ok:
            return Judgement("FAILED", expected, "-")
        if through or changed:  # (metadata went through, as Landlock lets it)
            return Judgement("not held", expected, "landlock")
        return Judgement("held", expected, "landlock")
    return Judgement("not held", "changed (no read-only mounts, no Landlock)", "-")


async def _non_string_key(pool: Any, threat: Threat, marker: str) -> Observed:
    """Arguments with a map key that is not a string: refused at submit, saying where."""
    try:
        call = pool.submit(threat.tool, threat.args)
    except TypeError as exc:
        return Observed(f"TypeError at submit: {exc}", {"error": str(exc)})
    result = await call
    return Observed(f"accepted: {result.outcome.value} {result.error}", {"error": None})


def _ready_pids(pool: Any) -> list[int]:
    return [w.pid for w in pool._core.live_workers() if w.answered and w.pid is not None]


async def _workers_up(pool: Any, n: int) -> None:
    """Until ``n`` workers have said hello (an earlier threat's victim is replaced on the
    loop's next turn, then starts), or 60 s passed."""
    with anyio.move_on_after(60):
        while len(_ready_pids(pool)) < n:
            await pool._wait_changed()


async def _signal_sibling(pool: Any, threat: Threat, marker: str) -> Observed:
    """Signal a sibling worker: a second worker must be up (the one an earlier threat killed
    may still be starting), so wait for it; with none, the check is not run."""
    await _workers_up(pool, min(2, pool.size))
    pids = _ready_pids(pool)
    if len(pids) < 2:
        return Observed(f"not run: {len(pids)} worker(s) up, no sibling", {"ran": False})
    result = await pool.call(threat.tool, {"workers": pids})
    sibling = (result.value or {}).get("sibling") if result.ok else None
    if sibling in ("none", "gone"):
        text = "not run: the other worker was gone"
    elif result.ok:
        text = f"sibling: {sibling}"
    else:
        text = f"{result.outcome.value}: {result.error}"
    return Observed(text, {"ran": True, "result": result})


def _key_error(result: Any, setting: Setting) -> Judgement:
    error = result.facts["error"] or ""
    ok = "args['value'] has a key that is not a string: 1" in error
    return _held(ok, "TypeError at submit naming the key", "pack_value (submit)")


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
    Threat("fd exhaustion", "fd_exhaustion", {}, "call", _fd_exhaustion),
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
    Threat("signals the reaper or the supervisor", "signal_others", {}, "call", _signals),
    Threat("signals a sibling worker", "signal_others", {}, "run", _sibling, _signal_sibling),
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


#: The longest value text a verdict shows; beyond it, the text ends at a word and an
#: ellipsis says so.
_OBSERVED_MAX = 200


async def run_threat(pool: Any, threat: Threat, marker: str) -> Verdict:
    """Run one threat on ``pool`` and judge it; the pool must serve a call afterwards."""
    args = dict(threat.args)
    if "marker" in registry.tools[threat.tool].signature.json_schema()["properties"]:
        args["marker"] = marker
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
    active = frozenset(layer.name for layer in pool.containment().layers if layer.active)
    judged = threat.check(result, Setting(active, pool.profile))
    status, caught_by = judged.status, judged.caught_by
    if isinstance(result, Observed):
        observed = result.text
    else:
        observed = result.outcome.value
        if result.ok and result.value is not None:
            # Said so, and at a word: never cut off silently, nor mid-word.
            shown = textwrap.shorten(
                repr(result.value), _OBSERVED_MAX, placeholder=" \N{HORIZONTAL ELLIPSIS}"
            )
            observed += f" {shown}"
    after = await pool.call("cooperative", {"seconds": 0.0})
    harmed = []
    if not after.ok:
        harmed.append(f"next call {after.outcome.value}")
    if leftovers:
        harmed.append(f"{len(leftovers)} process(es) survived")
    if harmed:  # whatever the profile: the pool must serve on and leave nothing behind
        status, caught_by = "FAILED", "-"
        observed += "; " + "; ".join(harmed)
    return Verdict(threat.name, judged.expected, observed, status, caught_by, leftovers)


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
