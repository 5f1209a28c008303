"""Containment for untrusted tools: profiles, layers, and the hostile-tool kit (issue 4).

Real worker processes under the ``untrusted`` profile (every layer this machine has) and under
the weakest set-up (no cgroups: subreapers and the kill loop only). The kit's own checks say
which guarantees hold where; here every entry must pass, leave no process of its marker
anywhere on the machine, and leave a pool that still serves calls.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

import toolpool
from toolpool.sandbox import Profile, parse_duration, parse_size
from toolpool.supervisor._containment import warn_inactive_layers
from toolpool.testing.hostile import THREATS, run_threat, shared_tmp

HOSTILE = "toolpool.testing.hostile:registry"
EXAMPLES = "toolpool.testing.examples:registry"
IS_ROOT = os.geteuid() == 0

WEAKEST = Profile.default().with_limits(disable=frozenset({"cgroups"}))
PROFILES = {"untrusted": Profile.untrusted(), "weakest": WEAKEST}
#: The kit runs against workers forked from the reaper's template (the default start method)
#: under both profiles, and against spawned workers under the untrusted one.
KIT_SETUPS = {
    "untrusted": ("untrusted", "fork"),
    "weakest": ("weakest", "fork"),
    "untrusted-spawn": ("untrusted", "spawn"),
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _cgroup_dirs(pool: toolpool.Pool) -> list[str]:
    cgroups = pool._options["default"].cgroups
    return sorted(set(cgroups.base.values())) if cgroups is not None else []


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("setup", sorted(KIT_SETUPS))
@pytest.mark.parametrize("threat", THREATS, ids=[t.name for t in THREATS])
async def test_kit_entry(threat: Any, setup: str) -> None:
    profile_name, start_method = KIT_SETUPS[setup]
    profile = PROFILES[profile_name]
    me = psutil.Process()
    rss_before = me.memory_info().rss
    async with toolpool.Pool(
        HOSTILE,
        workers=2,
        cancel_grace=0.3,
        term_grace=0.3,
        profile=profile,
        start_method=start_method,  # type: ignore[arg-type]
    ) as pool:
        assert set(pool.worker_start_methods.values()) == {start_method}
        pool_dir = pool._dir
        cgroup_dirs = _cgroup_dirs(pool)
        marker = f"toolpool-test-{os.getpid()}-{threat.tool}-{setup}"
        verdict = await run_threat(pool, threat, marker)
        assert verdict.passed, verdict
        assert verdict.leftovers == []
        reaper = pool.reaper_pid
        workers = pool.worker_pids
    # Closed: nothing of the pool left, its scratch and cgroup directories removed.
    for pid in [reaper, *workers]:
        assert pid is not None
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert pool_dir is not None
    assert not Path(pool_dir).exists()
    for path in cgroup_dirs:
        assert not Path(path).exists(), path
    # The supervisor's memory is bounded whatever the tool did (a flood, a hog...).
    assert me.memory_info().rss - rss_before < 64 * 1024**2


@pytest.mark.anyio
@pytest.mark.skipif(not IS_ROOT, reason="cgroups need root here")
async def test_untrusted_profile_activates_every_layer_this_machine_has() -> None:
    async with toolpool.Pool(EXAMPLES, workers=1, profile="untrusted") as pool:
        await pool.call("noop")
        report = pool.containment()
    active = {layer.name for layer in report.layers if layer.active}
    expected = {"session", "subreaper", "pidfd", "rlimits", "netns", "scratch_dir"}
    expected |= {"env_allowlist", "landlock", "cgroup_kill", "cgroup_memory", "cgroup_pids"}
    expected |= {"uid", "ipcns", "readonly_fs"}
    assert expected <= active, report.format()
    assert report.profile == "untrusted"
    assert "layers:" in report.format()


@pytest.mark.anyio
async def test_weakest_profile_reports_its_missing_layers() -> None:
    async with toolpool.Pool(EXAMPLES, workers=1, profile=WEAKEST) as pool:
        await pool.call("noop")
        report = pool.containment()
    by_name = {layer.name: layer for layer in report.layers}
    assert not by_name["cgroup_kill"].active
    assert "disabled" in by_name["cgroup_kill"].detail
    assert not by_name["netns"].active
    assert by_name["subreaper"].active


@pytest.mark.anyio
async def test_a_required_layer_that_is_missing_is_a_start_error() -> None:
    profile = WEAKEST.with_limits(require=frozenset({"cgroup_kill"}))
    pool = toolpool.Pool(EXAMPLES, workers=1, profile=profile)
    with pytest.raises(toolpool.WorkerStartError, match="cgroup_kill"):
        await pool.start()
    await pool.aclose()


@pytest.mark.anyio
async def test_untrusted_environment_is_an_allowlist_and_cwd_a_private_scratch() -> None:
    os.environ["TOOLPOOL_TEST_SECRET"] = "must-not-leak"
    try:
        async with toolpool.Pool(HOSTILE, workers=1, profile="untrusted") as pool:
            env = (await pool.call("environment")).value
            cwd = (await pool.call("working_directory")).value
            assert Path(cwd).is_dir()
    finally:
        del os.environ["TOOLPOOL_TEST_SECRET"]
    assert "TOOLPOOL_TEST_SECRET" not in env
    allowed = {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "PYTHONPATH", "TMPDIR", "HOME"}
    assert set(env) <= allowed
    assert env["HOME"] == cwd
    assert env["TMPDIR"] == cwd
    assert not Path(cwd).exists()  # removed once the worker was gone


@pytest.mark.anyio
async def test_default_profile_inherits_the_environment() -> None:
    os.environ["TOOLPOOL_TEST_VISIBLE"] = "yes"
    try:
        async with toolpool.Pool(HOSTILE, workers=1) as pool:
            env = (await pool.call("environment")).value
    finally:
        del os.environ["TOOLPOOL_TEST_VISIBLE"]
    assert env.get("TOOLPOOL_TEST_VISIBLE") == "yes"


@pytest.mark.anyio
async def test_background_processes_survive_their_call_only_when_allowed() -> None:
    marker = f"toolpool-test-bg-{os.getpid()}"
    async with toolpool.Pool(HOSTILE, workers=1, allow_background=True) as pool:
        result = await pool.call("daemon", {"marker": marker})
        assert result.ok
        assert result.leftovers_killed == 0
        assert _marked(marker), "allowed to stay while the pool lives"
    assert _marked(marker) == [], "but not past the pool"


def _marked(marker: str) -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline", "status"])
        if p.info.get("status") != psutil.STATUS_ZOMBIE
        and any(marker in arg for arg in p.info.get("cmdline") or [])
    ]


# ----------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 1024**2),
        ("1GiB", 1024**3),
        ("2GB", 2 * 1000**3),
        ("4096", 4096),
        (4096, 4096),
        ("1.5 KiB", 1536),
        ("64k", 64_000),
    ],
)
def test_sizes_in_human_units(text: Any, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-1MiB", "0", 0, -5, True, 1.5, "MiB"])
def test_bad_sizes_are_rejected(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        parse_size(bad)


@pytest.mark.parametrize(
    ("text", "expected"), [("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), (1.5, 1.5)]
)
def test_durations_in_human_units(text: Any, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("bad", ["soon", "-1s", "0s", 0, float("inf"), True, "1d"])
def test_bad_durations_are_rejected(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        parse_duration(bad)


def test_profiles_validate_their_fields() -> None:
    assert Profile.untrusted().memory == 512 * 1024**2
    assert Profile.default().with_limits(memory="256MiB").memory == 256 * 1024**2
    with pytest.raises(ValueError, match="unknown layer"):
        Profile(require=frozenset({"magic"}))
    with pytest.raises(ValueError, match="unknown profile"):
        Profile.named("paranoid")
    with pytest.raises(TypeError):
        Profile(env_allowlist="PATH")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_processes"):
        Profile(max_processes=0)
    profile = Profile.untrusted().with_limits(require=frozenset({"netns"}))
    assert Profile.from_wire(profile.to_wire()) == profile


@pytest.mark.anyio
@pytest.mark.skipif(not IS_ROOT, reason="cgroups need root here")
async def test_an_oom_kill_is_reported_as_such_and_the_pool_serves_on() -> None:
    profile = Profile.default().with_limits(memory="128MiB")
    async with toolpool.Pool(HOSTILE, workers=1, profile=profile) as pool:
        hog = await pool.call("allocate", {"mib": 400})
        assert hog.outcome is toolpool.Outcome.WORKER_LOST
        assert hog.error is not None
        assert "out of memory" in hog.error
        assert "128 MiB" in hog.error
        after = await pool.call("allocate", {"mib": 10})
        assert after.value == 10
        assert after.worker_pid != hog.worker_pid


# ----------------------------------------------------------------------------- another uid

PER_WORKER_UID = Profile.default().with_limits(user="per-worker")
PROBES = "hostile_tools:registry"
needs_root = pytest.mark.skipif(not IS_ROOT, reason="changing uid needs root")


def _layer(pool: toolpool.Pool, name: str) -> Any:
    return {layer.name: layer for layer in pool.containment().layers}[name]


def _hidden(detail: str) -> list[str]:
    """The directories the uid layer's detail says it covered ("A, B hidden but for...").

    Which ones there are depends on where the clone lives (a private directory is covered
    too), so tests look for theirs in the list rather than for one exact text."""
    found = re.search(r"; ([^;]*) hidden but for what the worker needs", detail)
    return found.group(1).split(", ") if found else []


def test_the_hidden_list_is_read_whole() -> None:
    detail = (
        "uid 1 (gid 1), no capabilities; /root, /tmp/tmp.x hidden but for what the worker needs"
    )
    assert _hidden(detail) == ["/root", "/tmp/tmp.x"]
    assert _hidden(detail + "; not readable by it, left out of its view: /srv") == [
        "/root",
        "/tmp/tmp.x",
    ]
    assert _hidden("uid 1 (gid 1), no capabilities") == []


@pytest.mark.anyio
@needs_root
async def test_each_worker_runs_as_a_uid_of_its_own_without_privileges() -> None:
    profile = PER_WORKER_UID.with_limits(max_processes=64)
    async with toolpool.Pool(HOSTILE, workers=2, profile=profile) as pool:
        uids = {}
        for pid in pool.worker_pids:
            ids = psutil.Process(pid).uids()
            assert ids.real == ids.effective == ids.saved == 2_000_000_000 + pid
            uids[pid] = ids.real
        assert len(set(uids.values())) == 2
        result = await pool.call("identity")
        assert result.ok, result
        me = result.value
        assert me["uid"] == me["gid"] == uids[result.worker_pid]
        assert me["groups"] == []
        assert int(me["cap_eff"], 16) == 0
        assert me["no_new_privs"] == "1"
        assert me["nproc"] == 64  # RLIMIT_NPROC counts per uid: here, per worker
        layer = _layer(pool, "uid")
        assert layer.active, layer
        assert "nproc=64" in layer.detail
        # The scratch directory is the worker's own, and still removed afterwards.
        where = await pool.call("working_directory")
        cwd = where.value
        assert os.stat(cwd).st_uid == uids[where.worker_pid]
        assert os.stat(cwd).st_mode & 0o777 == 0o700
    assert not Path(cwd).exists()


@pytest.mark.anyio
@needs_root
async def test_a_named_user_runs_every_worker() -> None:
    profile = Profile.default().with_limits(user="nobody")
    async with toolpool.Pool(HOSTILE, workers=2, profile=profile) as pool:
        assert {psutil.Process(pid).uids().real for pid in pool.worker_pids} == {65534}
        result = await pool.call("identity")
        assert (result.value["uid"], result.value["gid"]) == (65534, 65534)


@pytest.mark.anyio
@needs_root
async def test_another_uid_alone_blocks_signals_and_cgroup_escape() -> None:
    """No Landlock: the uid change by itself stops a tool signalling the supervisor, the
    reaper or a sibling worker, and writing itself into the root cgroup."""
    async with toolpool.Pool(HOSTILE, workers=2, profile=PER_WORKER_UID) as pool:
        assert not _layer(pool, "landlock").active
        result = await pool.call("signal_others", {"workers": pool.worker_pids})
        assert result.value == {"reaper": "blocked", "supervisor": "blocked", "sibling": "blocked"}
        escape = await pool.call("leave_cgroup", {"marker": "unused", "block": False})
        assert escape.ok, escape
        assert escape.value in ("blocked (EACCES)", "no cgroup v2"), escape.value


@pytest.mark.anyio
@needs_root
async def test_a_worker_cannot_reach_another_workers_socket_or_files() -> None:
    async with toolpool.Pool(PROBES, workers=2, profile=PER_WORKER_UID) as pool:
        endpoints = {
            str(w.pid): pool._io[w.wid].endpoint.removeprefix("ipc://")
            for w in pool._core.live_workers()
        }
        assert len(endpoints) == 2
        probe = await pool.call("connect_unix_others", {"paths": endpoints})
        assert probe.ok, probe
        assert probe.value == {p: "EACCES" for p in endpoints if p != str(probe.worker_pid)}
        own = endpoints[str(probe.worker_pid)]
        assert os.stat(own).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(own)).st_mode & 0o777 == 0o700
        assert os.stat(os.path.dirname(own)).st_uid == 2_000_000_000 + probe.worker_pid
        dirs = {pid: os.path.dirname(path) for pid, path in endpoints.items()}
        listing = await pool.call("list_others", {"paths": dirs})
        assert listing.value == {p: "EACCES" for p in dirs if p != str(listing.worker_pid)}
        listing = await pool.call("list_directory", {"path": os.path.dirname(os.path.dirname(own))})
        assert listing.value == "EACCES"  # the pool's directory: 0711, not listable


@pytest.mark.anyio
@needs_root
async def test_directories_the_new_uid_cannot_search_are_hidden_but_for_the_interpreter() -> None:
    from toolpool.sandbox._identity import _first_blocked, needed_paths

    blocked = _first_blocked(os.path.realpath(sys.base_prefix), 65534, 65534)
    if blocked is None:
        pytest.skip("the interpreter is readable by everyone on this machine")
    directory, child = blocked
    depth = len(Path(directory).parts)
    expected = {
        Path(p).parts[depth] for p in needed_paths() if p.startswith(directory.rstrip("/") + "/")
    }
    assert child in expected
    profile = Profile.default().with_limits(user="nobody")
    async with toolpool.Pool(PROBES, workers=1, profile=profile) as pool:
        listing = await pool.call("list_directory", {"path": directory})
        assert listing.ok, listing
        assert set(listing.value) == expected
        assert directory in _hidden(_layer(pool, "uid").detail)
        assert (await pool.call("echo", {"value": "imports still work"})).ok


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
async def test_nothing_of_the_supervisors_environment_reaches_an_untrusted_worker(
    start_method: str,
) -> None:
    """Not through os.environ, nor the initial environment block (/proc/self/environ) nor
    anywhere in the worker's memory: a forked worker's memory starts as the reaper's."""
    value = os.urandom(16).hex()
    os.environ["TOOLPOOL_TEST_SUPERVISOR_ONLY"] = value
    try:
        async with toolpool.Pool(
            PROBES, workers=1, profile="untrusted", start_method=start_method
        ) as pool:
            assert set(pool.worker_start_methods.values()) == {start_method}
            found = await pool.call(
                "find_in_memory", {"pattern": "TOOLPOOL_TEST_SUPERVISOR_ONLY=[0-9a-f]{32}"}
            )
    finally:
        del os.environ["TOOLPOOL_TEST_SUPERVISOR_ONLY"]
    assert found.ok, found
    assert found.value == {"environ": 0, "memory": 0}


@pytest.mark.anyio
async def test_the_memory_probe_finds_what_is_there() -> None:
    """The probe above can fail: with the default profile the variable is inherited."""
    value = os.urandom(16).hex()
    os.environ["TOOLPOOL_TEST_SUPERVISOR_ONLY"] = value
    try:
        async with toolpool.Pool(PROBES, workers=1, start_method="spawn") as pool:
            found = await pool.call(
                "find_in_memory", {"pattern": "TOOLPOOL_TEST_SUPERVISOR_ONLY=[0-9a-f]{32}"}
            )
    finally:
        del os.environ["TOOLPOOL_TEST_SUPERVISOR_ONLY"]
    assert found.value["environ"] == 1
    assert found.value["memory"] >= 1


@pytest.mark.anyio
@needs_root
async def test_only_what_the_worker_imports_is_uncovered(tmp_path: Path) -> None:
    """A directory the new uid may not search is covered; only the sys.path entry that
    provides the tools module is put back (read-only), not its siblings."""
    private = tmp_path / "private"  # 0700, like /root
    (private / "tools").mkdir(parents=True)
    (private / "other").mkdir()
    (private / "other" / "settings.env").write_text("DB_PASSWORD=hunter2\n")
    (private / "tools" / "probe_registry_mod.py").write_text("from hostile_tools import registry\n")
    for path in (tmp_path, private / "tools", private / "other"):
        path.chmod(0o755)
    private.chmod(0o700)
    sys.path[:0] = [str(private / "tools"), str(private / "other")]
    try:
        profile = Profile.default().with_limits(user="per-worker")
        async with toolpool.Pool("probe_registry_mod:registry", workers=1, profile=profile) as pool:
            seen = await pool.call("list_directory", {"path": str(private)})
            other = await pool.call("list_directory", {"path": str(private / "other")})
            mine = await pool.call("list_directory", {"path": str(private / "tools")})
            detail = _layer(pool, "uid").detail
    finally:
        sys.path[:2] = []
    assert seen.value == ["tools"]  # covered: only the entry the tools come from
    assert other.value == "ENOENT"
    assert "probe_registry_mod.py" in mine.value
    assert str(private) in _hidden(detail)


@pytest.mark.anyio
@needs_root
async def test_keys_an_earlier_worker_of_the_uid_left_are_gone() -> None:
    """Kernel keyrings belong to the uid and outlive its processes; a per-worker uid comes
    round again with its pid. Every worker empties its uid's keyrings at set-up."""
    description = f"toolpool-test-{os.getpid()}-{os.urandom(4).hex()}"
    nobody = Profile.default().with_limits(user="nobody")  # one uid for every worker
    async with toolpool.Pool(PROBES, workers=1, profile=nobody) as pool:
        added = await pool.call("add_user_key", {"description": description, "payload": "x"})
        assert added.ok, added
        assert (await pool.call("find_user_key", {"description": description})).value == "found"
        assert "keyrings emptied" in _layer(pool, "uid").detail
    async with toolpool.Pool(PROBES, workers=1, profile=nobody) as pool:
        later = await pool.call("find_user_key", {"description": description})
    assert later.value == "ENOKEY"


@pytest.mark.anyio
@pytest.mark.skipif(not IS_ROOT, reason="cgroups need root here")
@pytest.mark.parametrize("how", ["patch", "clone_parent"])
async def test_a_leftover_the_worker_does_not_report_is_still_killed(how: str) -> None:
    """Whether a call left processes behind is not the worker's word alone: its cgroup says
    who is in its tree, and the reaper kills every member but the worker before settling."""
    marker = f"toolpool-test-{os.getpid()}-hidden-{how}"
    async with toolpool.Pool(PROBES, workers=1) as pool:
        result = await pool.call("leave_hidden_leftover", {"marker": marker, "how": how})
        assert result.ok, result
        assert result.leftovers_killed == 2  # the shell and its sleep
        assert _marked(marker) == []  # gone before the call settled
        after = await pool.call("pid")
        assert after.ok
        assert after.leftovers_killed == 0
    assert _marked(marker) == []


def _sysv_keys() -> set[int]:
    with open("/proc/sysvipc/shm") as f:
        next(f)
        return {int(line.split()[0]) for line in f}


@pytest.mark.anyio
@pytest.mark.parametrize("private", [True, False], ids=["private-ipc", "shared-ipc"])
async def test_sysv_ipc_objects_stay_in_the_workers_ipc_namespace(private: bool) -> None:
    key = 0x7A000000 + os.getpid() % 0xFFFF
    profile = Profile.default().with_limits(private_ipc=private)
    try:
        async with toolpool.Pool(PROBES, workers=1, profile=profile) as pool:
            made = await pool.call("make_sysv_shm", {"key": key})
            assert made.ok, made
            visible_here = key in _sysv_keys()
            layer = _layer(pool, "ipcns")
    finally:
        if key in _sysv_keys():  # the shared case: remove what the tool left in ours
            subprocess.run(["ipcrm", "-M", str(key)], check=False, capture_output=True)
    if private:
        assert layer.active or not IS_ROOT, layer  # root can always unshare it
        assert visible_here is not layer.active
    else:
        assert not layer.active
        assert visible_here  # the control: without the layer the segment outlives the worker


@pytest.mark.anyio
@needs_root
async def test_a_pool_directory_under_a_closed_directory_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's directory under a directory the worker's uid may not search (pytest's own
    temporary directories are 0700): its socket is reachable and its scratch writable."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    async with toolpool.Pool(PROBES, workers=1, profile=PER_WORKER_UID) as pool:
        assert pool._dir is not None
        assert pool._dir.startswith(str(tmp_path))
        written = await pool.call("write_here", {"name": "note.txt", "text": "scratch works"})
        assert written.value == "scratch works", written
        assert _layer(pool, "uid").active


def test_a_uid_change_that_fails_half_way_stops_the_worker() -> None:
    """Once begun, a failed change is fatal: the worker never runs tools half-changed."""
    script = textwrap.dedent(
        """
        import os
        from toolpool.sandbox import Profile
        from toolpool.sandbox._apply import apply_profile

        def refuse(*ids):
            raise PermissionError(1, "refused by the test")

        os.setresuid = refuse
        try:
            apply_profile(Profile(core_dumps=True, scratch_dir=False, user="nobody"), [])
        except RuntimeError as exc:
            print("fatal:", exc)
        else:
            print("went on as uid", os.geteuid())
        """
    )
    if not IS_ROOT:
        pytest.skip("changing uid needs root")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.startswith("fatal: the uid change failed half way"), done.stdout


def test_a_uid_change_without_capabilities_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from toolpool.sandbox import _identity
    from toolpool.sandbox._apply import apply_profile

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(_identity, "_capabilities", lambda: 0)  # root in a container, say
    report = apply_profile(Profile(core_dumps=True, scratch_dir=False, user="per-worker"), [])
    assert report["uid"][0] is False
    assert "CAP_SETUID" in report["uid"][1]


def test_a_requested_layer_that_is_not_active_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What the first worker reports is checked against what the profile asked for."""
    profile = Profile.default().with_limits(user="per-worker", private_ipc=True)
    pool = toolpool.Pool(HOSTILE, workers=1, profile=profile)  # never started
    pool._core.worker_layers = {
        "uid": [False, "changing uid needs root; running as uid 1000"],
        "ipcns": [True, "own IPC namespace"],
        "rlimits": [True, "core=0"],
    }
    with caplog.at_level("WARNING", logger="toolpool"):
        warn_inactive_layers(pool.profile, pool.containment())
    assert "asks for uid, which is not active: changing uid needs root" in caplog.text
    assert "ipcns" not in caplog.text
    assert "landlock" not in caplog.text  # not asked for


def test_a_uid_change_without_root_is_reported_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from toolpool.sandbox._apply import apply_profile

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    quiet = Profile(core_dumps=True, scratch_dir=False, user="per-worker")
    report = apply_profile(quiet, [])
    assert report["uid"][0] is False
    assert "needs root" in report["uid"][1]
    with pytest.raises(RuntimeError, match="uid"):
        apply_profile(quiet.with_limits(require=frozenset({"uid"})), [])


def test_the_user_field_is_validated() -> None:
    assert Profile.untrusted().user == "per-worker"
    assert Profile(user="nobody").describe()["user"] == "nobody"
    assert Profile(user=65534).user == 65534
    with pytest.raises(ValueError, match="no user named"):
        Profile(user="no-such-user-here")
    with pytest.raises(TypeError):
        Profile(user=True)
    with pytest.raises(TypeError):
        Profile(user=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uid"):
        Profile(user=-1)
    with pytest.raises(ValueError, match="root"):
        Profile(user="root")
    with pytest.raises(ValueError, match="root"):
        Profile(user=0)
    profile = Profile.untrusted()
    assert Profile.from_wire(profile.to_wire()) == profile


# ----------------------------------------------------------------------------- output, usage


@pytest.mark.anyio
async def test_output_is_captured_per_call_with_a_cap() -> None:
    async with toolpool.Pool(EXAMPLES, workers=1, capture_output="64KiB") as pool:
        first = await pool.call("say", {"text": "hello", "child": True})
        second = await pool.call("say", {"text": "again"})
    assert first.ok
    assert first.output == "hello\nhello from a child\n"
    assert first.output_dropped == 0
    assert second.output == "again\n"  # nothing of the first call leaks into the second


@pytest.mark.anyio
async def test_an_output_flood_is_capped_and_never_blocks() -> None:
    async with toolpool.Pool(HOSTILE, workers=1, capture_output=1024) as pool:
        flood = await pool.call("output_flood", {"mib": 4})
        after = await pool.call("cooperative", {"seconds": 0.0})
    assert flood.ok
    assert flood.output is not None
    assert len(flood.output) == 1024
    assert flood.output_dropped == 2 * 4 * 1024 * 1024 - 1024  # stdout and stderr
    assert after.output == ""


@pytest.mark.anyio
async def test_output_is_discarded_by_default_and_usage_is_reported() -> None:
    # It spins until its thread used 0.15 s of CPU: by wall time, a loaded machine gives it less.
    async with toolpool.Pool(PROBES, workers=1) as pool:
        result = await pool.call("burn_cpu", {"seconds": 0.15})
    assert result.ok
    assert result.output is None
    assert result.cpu_time is not None
    assert result.cpu_time >= 0.1
    assert result.max_rss is not None
    assert result.max_rss > 1024 * 1024


def test_capture_output_is_validated() -> None:
    with pytest.raises(ValueError, match="size"):
        toolpool.Pool(EXAMPLES, capture_output="lots")
    with pytest.raises(ValueError, match="half of max_frame"):
        toolpool.Pool(EXAMPLES, capture_output="1GiB")


@pytest.mark.anyio
@pytest.mark.skipif(not IS_ROOT, reason="cgroups need root here")
async def test_tree_peak_memory_is_measured_per_call_where_a_memory_cgroup_is_in_use() -> None:
    async with toolpool.Pool(HOSTILE, workers=1, profile="untrusted") as pool:
        if not pool.containment().active("cgroup_memory"):
            pytest.skip("no memory cgroup on this machine")
        big = await pool.call("allocate", {"mib": 64})
        small = await pool.call("allocate", {"mib": 1})
    assert big.ok
    assert big.tree_max_memory is not None
    assert big.tree_max_memory >= 64 * 1024 * 1024
    assert small.tree_max_memory is not None
    assert small.tree_max_memory < big.tree_max_memory  # reset at every dispatch


# ----------------------------------------------------------------------------- metadata outside

METADATA = next(t for t in THREATS if t.tool == "touch_outside")


@pytest.mark.anyio
@needs_root
async def test_landlock_alone_leaves_metadata_writable_and_says_so() -> None:
    """The hole of issue 14: without the read-only mounts, Landlock refuses content and
    names but a tool still changes times and extended attributes outside its scratch."""
    from toolpool.sandbox._mounts import METADATA_WARNING

    profile = Profile.untrusted().with_limits(readonly_fs=False)
    async with toolpool.Pool(HOSTILE, workers=1, profile=profile) as pool:
        verdict = await run_threat(pool, METADATA, "unused")
        landlock = _layer(pool, "landlock")
        readonly = _layer(pool, "readonly_fs")
    assert verdict.passed, verdict
    assert verdict.caught_by == "landlock"
    for op in ("utime file", "utime dir", "setxattr file", "removexattr dir"):
        assert op in verdict.observed
    assert landlock.active
    assert METADATA_WARNING in landlock.detail
    assert not readonly.active


@pytest.mark.anyio
@needs_root
async def test_read_only_mounts_alone_refuse_every_change_outside_the_scratch() -> None:
    profile = PER_WORKER_UID.with_limits(readonly_fs=True)
    async with toolpool.Pool(HOSTILE, workers=1, profile=profile) as pool:
        verdict = await run_threat(pool, METADATA, "unused")
        layer = _layer(pool, "readonly_fs")
        written = await pool.call("litter_scratch", {"depth": 50, "files": 50})  # scratch: rw
    assert verdict.passed, verdict
    assert verdict.caught_by == "readonly_fs"
    assert verdict.observed == "all refused"
    assert layer.active, layer
    assert "read-only but" in layer.detail
    assert written.ok, written


READONLY_PROBE = """
import json, os, sys
from toolpool.sandbox import Profile
from toolpool.sandbox import _landlock, _mounts  # (nobody could not import them later)
from toolpool.sandbox._apply import apply_profile

scratch, target, mode = sys.argv[1:4]
if mode == "no-namespace":
    def refuse():
        raise OSError("no mount namespace: unshare(CLONE_NEWNS): Operation not permitted")
    _mounts._own_namespace = refuse
elif mode == "unprivileged":
    os.setresgid(65534, 65534, 65534)
    os.setgroups([])
    os.setresuid(65534, 65534, 65534)
os.chdir(scratch)
report = apply_profile(Profile(core_dumps=True, readonly_fs=True, landlock=True), [])
outcome = {}
for name, op in (("utime", lambda: os.utime(target, None)),
                 ("setxattr", lambda: os.setxattr(target, "user.x", b"1")),
                 ("scratch", lambda: open("note", "w").close())):
    try:
        op()
        outcome[name] = "done"
    except OSError as exc:
        outcome[name] = os.strerror(exc.errno)
print(json.dumps({"report": report, "outcome": outcome}))
"""


@pytest.mark.parametrize("mode", ["no-namespace", "unprivileged"])
def test_without_privilege_the_view_comes_from_a_user_namespace_or_is_reported_missing(
    mode: str,
) -> None:
    """``no-namespace``: no mount namespace can be had; Landlock stays, and both layers say
    metadata outside the scratch is writable (and it is). ``unprivileged``: not root, the
    view is built in a user namespace where the kernel allows one."""
    from toolpool.sandbox._mounts import METADATA_WARNING

    if mode == "unprivileged" and not IS_ROOT:
        pytest.skip("the probe drops from root to nobody")
    base = Path(tempfile.mkdtemp(prefix="toolpool-test-ro-", dir=shared_tmp()))
    try:
        base.chmod(0o755)
        scratch, target = base / "scratch", base / "target"
        scratch.mkdir()
        target.write_text("x")
        target.chmod(0o666)
        if IS_ROOT:
            os.chown(scratch, 65534, 65534)
        done = subprocess.run(
            [sys.executable, "-c", READONLY_PROBE, str(scratch), str(target), mode],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
    facts = json.loads(done.stdout)
    report, outcome = facts["report"], facts["outcome"]
    assert report["landlock"][0], report
    assert outcome["scratch"] == "done"
    if report["readonly_fs"][0]:
        assert mode == "unprivileged"
        assert "user namespace" in report["readonly_fs"][1]
        assert outcome == {
            "utime": "Read-only file system",
            "setxattr": "Read-only file system",
            "scratch": "done",
        }
        assert METADATA_WARNING not in report["landlock"][1]
    else:
        assert METADATA_WARNING in report["readonly_fs"][1]
        assert METADATA_WARNING in report["landlock"][1]
        assert outcome["utime"] == "done"  # the hole, where the layer is missing


def test_the_read_only_layer_is_reported_and_its_absence_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from toolpool.sandbox._mounts import METADATA_WARNING

    pool = toolpool.Pool(HOSTILE, workers=1, profile="untrusted")  # never started
    missing = (
        f"no mount namespace: unshare(CLONE_NEWNS): Operation not permitted: {METADATA_WARNING}"
    )
    pool._core.worker_layers = {"readonly_fs": [False, missing], "landlock": [True, "ABI 7"]}
    layer = {layer.name: layer for layer in pool.containment().layers}["readonly_fs"]
    assert (layer.active, layer.detail) == (False, missing)
    with caplog.at_level("WARNING", logger="toolpool"):
        warn_inactive_layers(pool.profile, pool.containment())
    assert "asks for readonly_fs, which is not active" in caplog.text
    assert METADATA_WARNING in pool.containment().format()
    default = toolpool.Pool(HOSTILE, workers=1)
    readonly = {layer.name: layer for layer in default.containment().layers}["readonly_fs"]
    assert readonly.detail == "not requested by the profile"


# ------------------------------------------------------------------ what a kit row says


def _threat(name: str) -> Any:
    return next(t for t in THREATS if t.name == name)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_threat_that_goes_through_as_the_profile_allows_is_not_held() -> None:
    """Issue 27: under `default` a tool signals the supervisor and reaches the network. The
    rows say so ("not held", nothing named as what stopped it), never "held"; nothing
    failed, as the profile claims nothing there."""
    async with toolpool.Pool(HOSTILE, workers=2, profile=WEAKEST) as pool:
        up = await run_threat(pool, _threat("signals the reaper or the supervisor"), "m1")
        net = await run_threat(pool, _threat("reaches the network"), "m2")
        sibling = await run_threat(pool, _threat("signals a sibling worker"), "m3")
    for verdict in (up, net, sibling):
        assert (verdict.status, verdict.caught_by) == ("not held", "-"), verdict
        assert verdict.passed
    assert "'supervisor': 'delivered'" in up.observed
    assert sibling.observed == "sibling: delivered"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_sibling_check_says_not_run_without_a_second_worker() -> None:
    async with toolpool.Pool(HOSTILE, workers=1, profile=WEAKEST) as pool:
        verdict = await run_threat(pool, _threat("signals a sibling worker"), "unused")
    assert verdict.status == "not run", verdict
    assert verdict.observed == "not run: 1 worker(s) up, no sibling"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_fd_row_names_the_limit_that_applied() -> None:
    """The label is what the tool ran under: the profile's RLIMIT_NOFILE, or the one the
    worker inherited (said so) where the profile sets none."""
    fd = _threat("fd exhaustion")
    async with toolpool.Pool(HOSTILE, workers=1, profile=WEAKEST) as pool:
        inherited = await run_threat(pool, fd, "unused")
    capped = WEAKEST.with_limits(max_open_files=64)
    async with toolpool.Pool(HOSTILE, workers=1, profile=capped) as pool:
        ours = await run_threat(pool, fd, "unused")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # (the workers inherit ours)
    assert inherited.status == "held", inherited
    assert inherited.caught_by == f"RLIMIT_NOFILE={soft} (inherited)"
    assert "the profile sets none" in inherited.expected
    assert (ours.status, ours.caught_by) == ("held", "RLIMIT_NOFILE=64"), ours
    assert "'limit': 64" in ours.observed
