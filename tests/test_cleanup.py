"""What a tool leaves on disk can neither crash, stall nor outlive the reaper, the supervisor or
a sibling (issue 14, part 1); arguments the wire refuses are refused at submit (part 3).

The remover (``sandbox/_remove.py``) is tested on real trees, with real concurrent processes
where the tree changes under it; the reaper and the pool with real workers that litter their
scratch directories, then exit, are closed, or lose their supervisor to SIGKILL.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import toolpool
from toolpool.protocol import pack_value
from toolpool.reaper import _client
from toolpool.sandbox import Profile, _remove
from toolpool.sandbox._remove import Removal, remove_tree
from toolpool.testing.hostile import _nest, _wait_pid_exit, shared_tmp

HOSTILE = "toolpool.testing.hostile:registry"
IS_ROOT = os.geteuid() == 0
WEAKEST = Profile.default().with_limits(disable=frozenset({"cgroups"}))
PROFILES = {"untrusted": Profile.untrusted(), "weakest": WEAKEST}
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory on the machine's ordinary filesystem that any uid can reach (pytest's
    tmp_path is 0700, and so is /tmp on some machines)."""
    path = Path(tempfile.mkdtemp(prefix="toolpool-test-rm-", dir=shared_tmp()))
    try:
        yield path
    finally:
        remove_tree(str(path))


def deep(path: Path, depth: int) -> None:
    path.mkdir()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _nest(fd, depth)
    finally:
        os.close(fd)


def outside_file(base: Path) -> Path:
    (base / "outside").mkdir()
    keep = base / "outside" / "keep"
    keep.write_text("keep")
    keep.chmod(0o666)
    return keep


# ----------------------------------------------------------------------------- the remover


@pytest.mark.timeout(120)
def test_a_deep_tree_defeats_shutil_but_not_the_remover(base: Path) -> None:
    deep(base / "tree", 3000)
    if sys.version_info < (3, 12):  # the reaper's old clean-up: it recursed
        with pytest.raises(RecursionError):
            shutil.rmtree(base / "tree")
    removal = remove_tree(str(base / "tree"))
    assert removal.finished, removal.summary()
    assert removal.removed >= 3000


@pytest.mark.timeout(120)
def test_links_special_files_odd_names_and_closed_modes(base: Path) -> None:
    keep = outside_file(base)
    tree = base / "tree"
    tree.mkdir()
    os.symlink(base / "outside", tree / "to-outside")
    os.symlink("/", tree / "to-root")
    os.link(keep, tree / "hard-link")
    os.mkfifo(tree / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tree / "sock"))
    raw = os.fsencode(tree)
    os.mkdir(raw + b"/\xff\xfe")
    (Path(os.fsdecode(raw + b"/\xff\xfe")) / "\udc80").write_text("x")
    (tree / "closed" / "inner").mkdir(parents=True)
    (tree / "closed" / "inner" / "file").write_text("x")
    (tree / "closed" / "inner" / "file").chmod(0)
    (tree / "closed" / "inner").chmod(0)
    (tree / "closed").chmod(0o100)
    removal = remove_tree(str(tree))
    assert removal.finished, removal.summary()
    assert keep.read_text() == "keep"
    assert keep.stat().st_nlink == 1
    assert stat.S_IMODE(keep.stat().st_mode) == 0o666  # never chmod-ed through a link
    assert sorted(p.name for p in (base / "outside").iterdir()) == ["keep"]


@pytest.mark.timeout(120)
@needs_root
def test_a_mount_point_is_never_crossed(base: Path) -> None:
    keep = outside_file(base)
    tree = base / "tree"
    (tree / "mnt").mkdir(parents=True)
    (tree / "other").write_text("x")
    subprocess.run(["mount", "--bind", str(base / "outside"), str(tree / "mnt")], check=True)
    try:
        removal = remove_tree(str(tree))
        assert removal.done
        assert not removal.finished
        assert "a mount point: not crossed" in removal.summary()
        assert keep.read_text() == "keep"  # the same filesystem, bound in: still not entered
        assert sorted(p.name for p in tree.iterdir()) == ["mnt"]
    finally:
        subprocess.run(["umount", str(tree / "mnt")], check=True)
    assert remove_tree(str(tree)).finished


@pytest.mark.timeout(120)
@needs_root
def test_closed_modes_are_reopened_by_a_remover_that_is_not_root(base: Path) -> None:
    """Root ignores modes; an unprivileged owner must give its directories back rwx."""
    tree = base / "tree"
    for sub in ("a/b/c", "d/e"):
        (tree / sub).mkdir(parents=True)
    (tree / "a" / "b" / "c" / "f").write_text("x")
    deep(tree / "deep", 100)
    subprocess.run(["chown", "-R", "65534:65534", str(base)], check=True)
    for path, mode in (("a/b/c", 0), ("a/b", 0o300), ("a", 0o500), ("d", 0o100), ("d/e", 0)):
        (tree / path).chmod(mode)
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(_remove.__file__)!r})
        import _remove
        os.setresgid(65534, 65534, 65534)
        os.setgroups([])
        os.setresuid(65534, 65534, 65534)
        removal = _remove.remove_tree({str(tree)!r})
        print(removal.finished, removal.summary())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.startswith("True"), done.stdout + done.stderr
    assert not tree.exists()


@pytest.mark.timeout(120)
@needs_root
def test_immutable_files_are_unflagged_and_removed(base: Path) -> None:
    tree = base / "tree"
    tree.mkdir()
    (tree / "locked").write_text("x")
    fd = os.open(tree / "locked", os.O_RDONLY)
    try:
        fcntl.ioctl(fd, _remove._FS_IOC_SETFLAGS, (0x10).to_bytes(4, sys.byteorder) + bytes(4))
    except OSError:
        pytest.skip("this filesystem has no immutable flag")
    finally:
        os.close(fd)
    with pytest.raises(PermissionError):
        os.unlink(tree / "locked")
    assert remove_tree(str(tree)).finished


@pytest.mark.timeout(180)
def test_memory_stays_bounded_whatever_the_tree(base: Path) -> None:
    deep(base / "tree", 3000)
    for i in range(20):
        many = base / "tree" / f"many{i}"
        many.mkdir()
        for j in range(1000):
            (many / f"file-with-a-long-name-{j:06}").touch()
    tracemalloc.start()
    try:
        removal = Removal(str(base / "tree"))
        slices = 0
        while not removal.step(time.monotonic() + 0.02):
            slices += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert removal.finished, removal.summary()
    assert removal.removed > 23_000
    assert slices > 0  # it did work in slices
    assert peak < 512 * 1024, peak  # a few batches of names, not the tree


@pytest.mark.timeout(120)
def test_a_slice_ends_at_its_deadline_and_the_removal_resumes(base: Path) -> None:
    tree = base / "tree"
    tree.mkdir()
    for j in range(20_000):
        (tree / str(j)).touch()
    removal = Removal(str(tree))
    longest = 0.0
    while True:
        began = time.monotonic()
        finished = removal.step(began + 0.01)
        longest = max(longest, time.monotonic() - began)
        if finished:
            break
    assert removal.finished
    assert longest < 0.5, longest  # 10 ms asked; a loaded machine may add a few


CHURN = """
import os, sys, time
tree = sys.argv[1]
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < end:
    n += 1
    try:
        os.makedirs(f"{tree}/c{n % 50}/d{n}/e", exist_ok=True)
        with open(f"{tree}/c{n % 7}/f{n}", "w"):
            pass
        os.rename(f"{tree}/c{n % 50}", f"{tree}/c{(n + 1) % 50}x")
        os.rename(f"{tree}/c{(n + 1) % 50}x", f"{tree}/c{n % 50}")
    except OSError:
        pass
"""


@pytest.mark.timeout(120)
def test_a_tree_that_changes_under_the_walk(base: Path) -> None:
    """A real process keeps creating, renaming and filling directories while the remover
    walks: it ends anyway (never stalls, never raises), and once the writer is gone a second
    removal finishes."""
    tree = base / "tree"
    tree.mkdir()
    with subprocess.Popen(
        [sys.executable, "-c", CHURN, str(tree), "3"], stdout=subprocess.PIPE, text=True
    ) as churn:
        try:
            assert churn.stdout is not None
            assert churn.stdout.readline() == "ready\n"
            first = Removal(str(tree))
            while not first.step(time.monotonic() + 0.05):
                pass
            assert first.done
        finally:
            churn.kill()
    assert remove_tree(str(tree)).finished


# ----------------------------------------------------------------------------- the pool


@pytest.mark.anyio
@pytest.mark.timeout(180)
@pytest.mark.parametrize("profile", sorted(PROFILES))
async def test_a_big_tree_is_removed_in_the_background_while_the_pool_serves(
    profile: str,
) -> None:
    async with toolpool.Pool(HOSTILE, workers=2, profile=PROFILES[profile]) as pool:
        reaper = pool._reaper
        assert reaper is not None
        lost = await pool.call(
            "litter_scratch", {"depth": 3000, "files": 30_000, "leave": "exit"}, timeout=120
        )
        assert lost.outcome is toolpool.Outcome.WORKER_LOST
        # Named in the worker's gone (its directories are removed after that report), and
        # not removed yet: it is big.
        (scratch,) = [p for p in reaper.removing if os.path.basename(p).startswith("scratch-")]
        served = 0
        while scratch in reaper.removing:
            with anyio.fail_after(10):  # the reaper works in slices: it keeps serving
                assert (await pool.call("cooperative", {"seconds": 0.0})).ok
            served += 1
            if served == 3:
                break
        assert served >= 1
        with anyio.fail_after(120):
            await reaper.wait_removed(scratch)
        assert not os.path.lexists(scratch)
        # The replacement worker started meanwhile; both serve.
        pids = {(await pool.call("identity")).worker_pid for _ in range(2)}
        assert len(pool.worker_pids) == 2
        assert lost.worker_pid not in pids


@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile", sorted(PROFILES))
async def test_nothing_of_a_gone_worker_stays_in_the_pools_directory(profile: str) -> None:
    """A worker's socket directory (its socket and ledger file) goes with its tree, like its
    scratch directory: a pool whose workers die and are replaced does not pile them up until
    its close (a 10,000-call soak left hundreds, more than the close's removal budget)."""
    async with toolpool.Pool(HOSTILE, workers=1, profile=PROFILES[profile]) as pool:
        reaper = pool._reaper
        pool_dir = pool._dir
        assert reaper is not None
        assert pool_dir is not None
        directory: str = pool_dir

        def entries() -> set[str]:
            return set(os.listdir(directory))

        first = entries()
        assert {"w1", "scratch-w1"} <= first, first  # (the cgroups live elsewhere)
        gone: list[str] = []
        for n in range(4):
            if n % 2:  # killed by the pool's escalation
                call = pool.submit("cooperative", {"seconds": 3600.0})
                assert await call.wait_started()
                call.cancel(force=True)
                result = await call
                assert result.outcome is toolpool.Outcome.KILLED, result
            else:  # dead on its own
                result = await pool.call("hard_exit", {"code": 3})
                assert result.outcome is toolpool.Outcome.WORKER_LOST, result
            assert result.worker_pid is not None
            gone += [f"w{n + 1}", f"scratch-w{n + 1}"]
            # Named in the tree's gone, removed right after it: whoever the gone woke waits
            # for them (each ends with a cleanup_done).
            with anyio.fail_after(60):
                for name in gone:
                    await reaper.wait_removed(os.path.join(pool_dir, name))
            left = sorted(entries() & set(gone))
            assert left == [], (left, sorted(entries()))
        assert (await pool.call("cooperative", {"seconds": 0.0})).ok  # the fifth serves
        assert entries() == {"w5", "scratch-w5"} | (first - {"w1", "scratch-w1"}), entries()


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_what_the_close_leaves_is_removed_in_the_background_and_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_client, "EXIT_CLEANUP_BUDGET", 0.01)
    pool = toolpool.Pool(HOSTILE, workers=1, profile="untrusted" if IS_ROOT else "default")
    await pool.start()
    try:
        made = await pool.call("litter_scratch", {"depth": 3000, "files": 5000})
        assert made.ok, made
        reaper = pool.reaper_pid
        pool_dir = pool._dir
    finally:
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="toolpool"):
            report = await pool.aclose()
        took = time.monotonic() - began
    assert pool_dir is not None
    assert not report.finished
    assert report.pending == (pool_dir,)
    assert reaper is not None
    assert report.cleaner_pid == reaper
    assert "still removing" in caplog.text
    assert took < 20, took
    assert await _wait_pid_exit(reaper, 120)
    assert not os.path.lexists(pool_dir)
    assert "still being removed" in report.format()


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_without_its_reaper_the_supervisor_removes_the_tree_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reaper SIGKILLed: the close still ends, and the supervisor's own clean-up (the
    remover too: shutil.rmtree would recurse) hands what it cannot finish to a helper."""
    monkeypatch.setattr(_client, "SUPERVISOR_CLEANUP_BUDGET", 0.01)
    pool = toolpool.Pool(HOSTILE, workers=1, profile=WEAKEST)
    await pool.start()
    try:
        assert (await pool.call("litter_scratch", {"depth": 3000, "files": 5000})).ok
        pool_dir = pool._dir
        assert pool.reaper_pid is not None
        os.kill(pool.reaper_pid, signal.SIGKILL)
    finally:
        report = await pool.aclose()
    assert pool_dir is not None
    assert report.pending == (pool_dir,)
    assert report.cleaner_pid is not None
    assert await _wait_pid_exit(report.cleaner_pid, 120)
    assert not os.path.lexists(pool_dir)


SUPERVISOR = """
import json, sys, time
import anyio, toolpool
from toolpool.sandbox import Profile

async def main() -> None:
    profile = Profile.named(sys.argv[1]).with_limits(disable=frozenset(sys.argv[2:]))
    tools = "toolpool.testing.hostile:registry"
    async with toolpool.Pool(tools, workers=1, profile=profile) as pool:
        made = await pool.call("litter_scratch", {"depth": 3000, "files": 5000})
        assert made.ok, made
        print(json.dumps({"reaper": pool.reaper_pid, "dir": pool._dir}), flush=True)
        await anyio.sleep(3600)

anyio.run(main)
"""


@pytest.mark.anyio
@pytest.mark.timeout(180)
@pytest.mark.parametrize("profile", sorted(PROFILES))
async def test_a_supervisor_sigkilled_with_a_deep_tree_leaves_nothing_on_disk(
    profile: str,
) -> None:
    args = ["untrusted"] if profile == "untrusted" else ["default", "cgroups"]
    with subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, *args], stdout=subprocess.PIPE, text=True
    ) as supervisor:
        try:
            assert supervisor.stdout is not None
            line = await anyio.to_thread.run_sync(supervisor.stdout.readline)
            facts = json.loads(line)
            assert Path(facts["dir"]).is_dir()
        finally:
            supervisor.kill()
    assert await _wait_pid_exit(facts["reaper"], 120), "the reaper is still there"
    assert not os.path.lexists(facts["dir"])


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"x": {1: 2}}, "args['x'] has a key that is not a string: 1 (int)"),
        ({"x": [0, {"y": {None: 1}}]}, "args['x'][1]['y'] has a key that is not a string: None"),
        ({"x": {(1, 2): 3}}, "args['x'] has a key that is not a string: (1, 2) (tuple)"),
    ],
)
def test_a_map_key_the_wire_refuses_is_named_where_it_is(value: Any, where: str) -> None:
    with pytest.raises(TypeError, match="not serializable") as caught:
        pack_value(value, "args")
    assert where in str(caught.value)


@pytest.mark.anyio
async def test_a_non_string_key_is_refused_at_submit() -> None:
    async with toolpool.Pool(HOSTILE, workers=1) as pool:
        with pytest.raises(TypeError, match=r"args\['value'\] has a key that is not a string: 1"):
            pool.submit("echo", {"value": {1: 2}})
        assert (await pool.call("echo", {"value": {"1": 2, "b": [b"x"]}})).value == {
            "1": 2,
            "b": [b"x"],
        }


def test_arguments_a_worker_cannot_decode_say_so() -> None:
    from toolpool.protocol import ProtocolViolation
    from toolpool.worker._call import _freeze_args

    with pytest.raises(TypeError, match=r"arguments could not be decoded: .*int is not allowed"):
        _freeze_args(ProtocolViolation("undecodable frame: ValueError: int is not allowed"))  # type: ignore[arg-type]
