"""``toolpool batch``, run as users run it (a subprocess), with real workers and real signals.

The tools are ``tests/batch_tools.py`` and the hostile kit's ``toolpool.testing.hostile``.
Every process a test starts is ended by it: the batch exits (or is killed, and then its
pool's processes are waited for until gone).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from toolpool._batch import Batch, BatchOptions, Watcher

TESTS = Path(__file__).resolve().parent
TOOLS = "batch_tools:registry"
HOSTILE = "toolpool.testing.hostile:registry"
RECORD_KEYS = {"id", "outcome", "body_started", "attempts", "duration_s", "queued_s"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    return env


def _command(inp: Path, out: Path, *options: str, tools: str = TOOLS) -> list[str]:
    return [
        sys.executable,
        "-m",
        "toolpool",
        "batch",
        tools,
        str(inp),
        "-o",
        str(out),
        "--workers",
        "2",
        *options,
    ]


def write_lines(path: Path, lines: Iterable[Any]) -> Path:
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def batch(
    inp: Path, out: Path, *options: str, tools: str = TOOLS, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _command(inp, out, *options, tools=tools),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=_env(),
    )


def records(path: Path) -> list[dict[str, Any]]:
    """Every line of a results file: each whole (newline-ended) and valid JSON."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), data[-200:]
    return [json.loads(line) for line in data.splitlines()]


def by_id(recs: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    calls = [r for r in recs if r["outcome"] != "rejected"]
    found = {r["id"]: r for r in calls}
    assert len(found) == len(calls), "an id recorded twice"
    return found


def summary_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    summary = json.loads(done.stdout)
    assert isinstance(summary, dict)
    return summary


@contextmanager
def started(
    inp: Path, out: Path, *options: str, tools: str = TOOLS
) -> Iterator[subprocess.Popen[str]]:
    """The batch, running; on the way out it is killed if still running and its pool's
    processes are waited for until gone."""
    proc = subprocess.Popen(
        _command(inp, out, *options, tools=tools),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        yield proc
    finally:
        family: list[psutil.Process] = []
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        if proc.poll() is None:
            proc.kill()
        if proc.stdout is not None and not proc.stdout.closed:
            proc.communicate(timeout=60)
        _, alive = psutil.wait_procs(family, timeout=30)
        for p in alive:
            p.kill()
        assert not alive, f"left running: {alive}"


def wait_for(condition: Any, what: str, timeout: float = 60) -> None:
    """Poll a condition on the file system (no event to await there)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# ====================================================================== records, resume


@pytest.mark.timeout(120)
def test_one_record_per_id_with_the_fields_of_the_issue_and_resume_skips_them(
    tmp_path: Path,
) -> None:
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "a", "tool": "noop", "args": {}},
            {"id": 2, "tool": "echo", "args": {"value": {"x": [1, "é", None]}}},
            {"id": "c", "tool": "fail", "args": {"message": "nope"}, "timeout": 30},
            {"id": "d", "tool": "raw_bytes", "args": {}},
            {"id": "e", "tool": "not_a_number", "args": {}},
            "",
        ],
    )
    out = tmp_path / "out.jsonl"
    done = batch(inp, out, "--json")
    assert done.returncode == 1, done.stderr
    assert "\x1b" not in done.stdout + done.stderr  # no terminal: no control codes
    recs = by_id(records(out))
    assert set(recs) == {"a", 2, "c", "d", "e"}
    assert recs["a"] == {**recs["a"], "outcome": "ok", "value": None, "body_started": True}
    assert recs[2]["value"] == {"x": [1, "é", None]}
    assert list(recs[2]) == [
        "id",
        "outcome",
        "value",
        "body_started",
        "attempts",
        "duration_s",
        "queued_s",
    ]
    assert recs["c"]["outcome"] == "error"
    assert recs["c"]["error"] == "Error: RuntimeError: nope"
    assert list(recs["c"]) == [
        "id", "outcome", "error", "error_name", "body_started", "attempts", "duration_s",
        "queued_s",
    ]  # fmt: skip
    for unrecordable in ("d", "e"):
        assert recs[unrecordable]["outcome"] == "error"
        assert recs[unrecordable]["error_name"] == "UnrecordableValue"
        assert "cannot be recorded as JSON" in recs[unrecordable]["error"]
    for rec in recs.values():
        assert RECORD_KEYS <= set(rec) <= RECORD_KEYS | {"value", "error", "error_name"}
        assert rec["attempts"] == 1
        assert 0 <= rec["duration_s"] < 60
    summary = summary_of(done)
    assert summary["recorded"] == {"ok": 2, "error": 3}
    assert (summary["lines"], summary["skipped"], summary["exit_status"]) == (5, 0, 1)

    before = out.read_bytes()
    again = batch(inp, out, "--json")
    assert again.returncode == 1, again.stderr  # the results file still holds errors
    assert out.read_bytes() == before
    summary = summary_of(again)
    assert (summary["skipped"], summary["recorded"]) == (5, {})
    assert summary["previous"] == {"ok": 2, "error": 3}


@pytest.mark.timeout(120)
def test_all_ok_exits_0_and_the_summary_table_is_plain_text(tmp_path: Path) -> None:
    inp = write_lines(
        tmp_path / "in.jsonl", [{"id": i, "tool": "echo", "args": {"value": i}} for i in range(50)]
    )
    out = tmp_path / "out.jsonl"
    done = batch(inp, out)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout + done.stderr
    assert "ok" in done.stdout
    assert "50" in done.stdout
    assert {r["id"]: r["value"] for r in records(out)} == {i: i for i in range(50)}


BAD_LINES: list[tuple[str, str]] = [
    ('{"id": 1, "tool": "noop", "args": {}', "not valid JSON"),
    ("[1, 2]", "a line is a JSON object, not an array"),
    ('{"tool": "noop", "args": {}}', "has no 'id'"),
    ('{"id": 1.5, "tool": "noop", "args": {}}', "'id' must be a string or an integer"),
    ('{"id": true, "tool": "noop", "args": {}}', "'id' must be a string or an integer"),
    ('{"id": "", "tool": "noop", "args": {}}', "'id' is an empty string"),
    ('{"id": "ok", "tool": "noop", "args": {}}', "repeats the id 'ok' of an earlier line"),
    ('{"id": "no-tool", "args": {}}', "has no 'tool'"),
    ('{"id": "no-args", "tool": "noop"}', "has no 'args'"),
    ('{"id": "what", "tool": "no_such_tool", "args": {}}', "unknown tool 'no_such_tool'"),
    ('{"id": "t1", "tool": "noop", "args": {}, "timeout": "5"}', "'timeout' must be a positive"),
    ('{"id": "t2", "tool": "noop", "args": {}, "timeout": -1}', "'timeout' must be a positive"),
    ('{"id": "t3", "tool": "noop", "args": {}, "timeout": true}', "'timeout' must be a positive"),
    ('{"id": "ar", "tool": "noop", "args": [1]}', "'args' must be a JSON object"),
    ('{"id": "g", "tool": "noop", "args": {}, "group": 3}', "'group' must be a non-empty"),
    ('{"id": "f", "tool": "noop", "args": {}, "timout": 3}', "unknown field(s) 'timout'"),
    ('{"id": "big", "tool": "echo", "args": {"value": 18446744073709551616}}', "cannot be sent"),
]


@pytest.mark.timeout(120)
def test_every_kind_of_bad_line_gets_a_record_and_the_batch_goes_on(tmp_path: Path) -> None:
    lines = ['{"id": "ok", "tool": "noop", "args": {}}', *(line for line, _ in BAD_LINES)]
    lines.append('{"id": "after", "tool": "echo", "args": {"value": 1}}')
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    done = batch(inp, out, "--json")
    assert done.returncode == 1, done.stderr
    recs = records(out)
    assert by_id(recs).keys() == {"ok", "after"}
    assert all(r["outcome"] == "ok" for r in by_id(recs).values())
    rejected = {r["line"]: r for r in recs if r["outcome"] == "rejected"}
    assert sorted(rejected) == list(range(2, 2 + len(BAD_LINES)))
    for number, (_, why) in enumerate(BAD_LINES, start=2):
        assert rejected[number]["error"].startswith(f"line {number}: "), rejected[number]
        assert why in rejected[number]["error"], rejected[number]
    assert rejected[8]["input_id"] == "ok"  # the repeated id
    assert "input_id" not in rejected[2]
    summary = summary_of(done)
    assert (summary["rejected"], summary["recorded"]["ok"]) == (len(BAD_LINES), 2)

    # Resumed: the same lines are rejected again, but not recorded twice.
    before = out.read_bytes()
    again = batch(inp, out, "--json")
    assert again.returncode == 1
    assert out.read_bytes() == before
    # ... and counted apart: this run rejected no new line (issue 27).
    assert summary_of(again)["rejected"] == 0
    assert summary_of(again)["rejected_before"] == len(BAD_LINES)


def main_here(
    capsys: pytest.CaptureFixture[str], inp: Path, out: Path, *options: str
) -> tuple[int, str]:
    """The command in this process (for what fails before a pool starts): status, stderr."""
    from toolpool._cli import main

    path = list(sys.path)
    try:
        status = main(["batch", TOOLS, str(inp), "-o", str(out), *options])
    finally:
        sys.path[:] = path  # (main puts the current directory on it, as python -m does)
    return status, capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("hello\n", "line 1 is not a batch record"),
        ('{"outcome": "ok"}\n', "a record without an id"),
    ],
)
def test_a_results_file_that_is_not_one_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "tool": "noop", "args": {}}])
    out = tmp_path / "out.jsonl"
    out.write_text(content)
    status, err = main_here(capsys, inp, out)
    assert status == 2
    assert message in err
    assert out.read_text() == content


@pytest.mark.timeout(60)
def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "tool": "noop", "args": {}}])
    out = tmp_path / "out.jsonl"
    for options, message in (
        (("--retries", "-1"), "--retries must be 0 or more"),
        (("--timeout", "0"), "--timeout must be a positive"),
    ):
        status, err = main_here(capsys, inp, out, *options)
        assert (status, message in err) == (2, True), err
    status, err = main_here(capsys, tmp_path / "nothere.jsonl", out)
    assert (status, "cannot read" in err) == (2, True), err
    status, err = main_here(capsys, inp, inp)
    assert (status, "cannot be the input file" in err) == (2, True), err
    with open(out, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        status, err = main_here(capsys, inp, out)
    assert status == 2
    assert "being written by another toolpool batch" in err
    from toolpool._cli import main

    with pytest.raises(SystemExit) as exited:
        main(["batch", TOOLS, str(inp)])
    assert exited.value.code == 2
    assert "-o/--output" in capsys.readouterr().err
    # A tools module that cannot be loaded: one line, as users see it. (One worker: with
    # two, the pool on main since 8babd86 also logs "worker 2 ... quarantined: protocol
    # violation: an unexpected 'fatal' message", whatever command runs it: reported.)
    no_tools = batch(inp, out, "--workers", "1", tools="no_such_module_here:registry")
    assert no_tools.returncode == 2
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in no_tools.stderr
    assert len(no_tools.stderr.strip().splitlines()) == 1, no_tools.stderr


@pytest.mark.timeout(120)
def test_a_torn_last_line_is_cut_off_said_and_its_call_made_again(tmp_path: Path) -> None:
    inp = write_lines(
        tmp_path / "in.jsonl", [{"id": i, "tool": "echo", "args": {"value": i}} for i in range(4)]
    )
    out = tmp_path / "out.jsonl"
    write_lines(out, [{"id": 0, "outcome": "ok", "value": 0, "body_started": True,
                       "attempts": 1, "duration_s": 0.01}])  # fmt: skip
    with open(out, "a") as f:
        f.write('{"id": 1, "outcome": "o')  # cut short: the batch was killed mid-write
    done = batch(inp, out)
    assert done.returncode == 0, done.stderr
    assert "its last line was incomplete (" in done.stderr
    assert "removed; that call runs again" in done.stderr
    assert set(by_id(records(out))) == {0, 1, 2, 3}


def _pool_processes(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    found = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.timeout(180)
def test_sigkill_at_random_points_then_resume_loses_no_id_and_writes_none_twice(
    tmp_path: Path,
) -> None:
    n = 800
    inp = write_lines(
        tmp_path / "in.jsonl",
        [{"id": f"id-{i}", "tool": "sleep_ms", "args": {"ms": 1}} for i in range(n)],
    )
    out = tmp_path / "out.jsonl"
    rng = random.Random(18)  # seeded: the same points every run
    points = sorted(rng.sample(range(1, n - 150), 3))
    killed = 0
    for point in points:
        with started(inp, out, "--no-progress") as proc:
            wait_for(
                lambda p=point: _count_lines(out) >= p or proc.poll() is not None,
                f"{point} records",
            )
            family = _pool_processes(proc)
            if proc.poll() is None:
                proc.kill()
                killed += 1
            proc.communicate(timeout=60)
            _, alive = psutil.wait_procs(family, timeout=30)  # the reaper ends the pool
            assert not alive, alive
        recs = records(out)  # every line whole and valid JSON, after each kill
        by_id(recs)
    assert killed, "the batch ran to its end before any kill: no point was tested"
    done = batch(inp, out, "--json")
    assert done.returncode == 0, done.stderr
    recs = by_id(records(out))
    assert set(recs) == {f"id-{i}" for i in range(n)}
    assert all(r["outcome"] == "ok" for r in recs.values())
    assert summary_of(done)["skipped"] > 0


# ====================================================================== retries


@pytest.mark.timeout(120)
def test_retries_rerun_calls_whose_body_never_started_and_started_ones_only_if_idempotent(
    tmp_path: Path,
) -> None:
    def lines(tag: str) -> list[dict[str, Any]]:
        mark = str(tmp_path / tag)
        return [
            {"id": "before", "tool": "crash_before", "args": {"marker": f"{mark}-b"}},
            {"id": "after", "tool": "crash_after", "args": {"marker": f"{mark}-a"}},
            {"id": "before-always", "tool": "crash_before",
             "args": {"marker": f"{mark}-ba", "always": True}},
            {"id": "after-always", "tool": "crash_after",
             "args": {"marker": f"{mark}-aa", "always": True}},
            {"id": "fine", "tool": "noop", "args": {}},
        ]  # fmt: skip

    plain = tmp_path / "plain.jsonl"
    done = batch(write_lines(tmp_path / "in1.jsonl", lines("one")), plain, "--retries", "2")
    assert done.returncode == 1, done.stderr
    recs = by_id(records(plain))
    assert (recs["before"]["outcome"], recs["before"]["attempts"]) == ("ok", 2)
    assert recs["before"]["value"] == "ran"
    # Its body started: not retried without --idempotent.
    assert (recs["after"]["outcome"], recs["after"]["attempts"]) == ("worker_lost", 1)
    assert recs["after"]["body_started"] is True
    assert (recs["before-always"]["outcome"], recs["before-always"]["attempts"]) == (
        "worker_lost",
        3,
    )
    assert recs["before-always"]["body_started"] is False
    assert recs["after-always"]["attempts"] == 1
    assert (recs["fine"]["outcome"], recs["fine"]["attempts"]) == ("ok", 1)

    idem = tmp_path / "idem.jsonl"
    done = batch(
        write_lines(tmp_path / "in2.jsonl", lines("two")), idem, "--retries", "1", "--idempotent"
    )
    assert done.returncode == 1, done.stderr
    recs = by_id(records(idem))
    assert (recs["before"]["outcome"], recs["before"]["attempts"]) == ("ok", 2)
    assert (recs["after"]["outcome"], recs["after"]["attempts"]) == ("ok", 2)
    assert (recs["after-always"]["outcome"], recs["after-always"]["attempts"]) == (
        "worker_lost",
        2,
    )
    assert recs["before-always"]["attempts"] == 2


# ====================================================================== signals


def _hold_lines(tmp_path: Path, n: int, tool: str = "hold") -> tuple[Path, Path, Path]:
    ready = tmp_path / "ready"
    ready.mkdir()
    release = tmp_path / "release"
    lines = [
        {
            "id": i,
            "tool": tool,
            "args": {"ready": str(ready)} | ({"release": str(release)} if tool == "hold" else {}),
            "group": "even" if i % 2 == 0 else "odd",
        }
        for i in range(n)
    ]
    return write_lines(tmp_path / "in.jsonl", lines), ready, release


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_cancels_every_call_records_what_settled_and_a_resume_runs_the_rest(
    tmp_path: Path, signum: int
) -> None:
    inp, ready, release = _hold_lines(tmp_path, 6)
    out = tmp_path / "out.jsonl"
    with started(inp, out, "--json") as proc:
        wait_for(lambda: len(os.listdir(ready)) == 2, "two calls running")
        family = _pool_processes(proc)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert len(family) >= 3  # the reaper and two workers
    assert not _alive(family)
    lines = stderr.strip().splitlines()
    what = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    assert lines[0].startswith(f"toolpool: {what}: stopping. Every call is cancelled;"), stderr
    assert (
        lines[-1] == "toolpool: stopped: every call settled and every process of the pool is gone"
    )
    recs = by_id(records(out))
    # The two running calls stopped cooperatively (their body had started): recorded. The
    # four queued never started: left for the next run.
    assert len(recs) == 2, json.dumps([recs, stderr])
    assert {r["outcome"] for r in recs.values()} == {"aborted"}
    assert all(r["body_started"] is True for r in recs.values())
    summary = json.loads(stdout)
    assert (summary["interrupted"], summary["not_recorded"], summary["exit_status"]) == (
        True,
        4,
        130,
    )
    if signum == signal.SIGTERM:
        return  # (resumed once is enough)
    release.touch()
    done = batch(inp, out, "--json")
    assert done.returncode == 1, done.stderr  # two records are 'aborted'
    recs = by_id(records(out))
    assert set(recs) == set(range(6))
    assert sorted(r["outcome"] for r in recs.values()) == ["aborted"] * 2 + ["ok"] * 4
    # The two aborted calls had started: a resume never runs them again unless asked,
    # and --rerun asks for it only with --idempotent (issue 27).
    kept = out.read_bytes()
    refused = batch(inp, out, "--json", "--rerun", "aborted")
    assert refused.returncode == 2, refused.stderr
    assert "--rerun would run 2 call(s) again whose body started" in refused.stderr
    assert "--idempotent" in refused.stderr
    assert out.read_bytes() == kept
    rerun = batch(inp, out, "--json", "--rerun", "aborted", "--idempotent")
    assert rerun.returncode == 0, rerun.stderr
    summary = summary_of(rerun)
    assert (summary["rerun"], summary["skipped"], summary["recorded"]) == (2, 4, {"ok": 2})
    assert summary["previous"] == {"ok": 4}
    latest = {r["id"]: r for r in records(out)}  # (the last record of an id wins)
    assert {r["outcome"] for r in latest.values()} == {"ok"}
    assert len(records(out)) == 8


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_kills_the_calls_at_once(tmp_path: Path) -> None:
    inp, ready, _ = _hold_lines(tmp_path, 2, tool="stubborn")
    out = tmp_path / "out.jsonl"
    with started(inp, out, "--cancel-grace", "600", "--term-grace", "600") as proc:
        wait_for(lambda: len(os.listdir(ready)) == 2, "two calls running")
        family = _pool_processes(proc)
        assert proc.stderr is not None
        proc.send_signal(signal.SIGINT)
        first = proc.stderr.readline()  # it would wait 600 s for them now
        assert first.startswith("toolpool: interrupted: stopping."), first
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)  # far below the graces
    assert proc.returncode == 130, stderr
    assert "toolpool: interrupted again: killing 2 calls now (SIGKILL)" in stderr
    assert not _alive(family)
    recs = by_id(records(out))
    assert {r["outcome"] for r in recs.values()} == {"killed"}
    assert set(recs) == {0, 1}


# ====================================================================== groups, mixed


class _CancelGroupWhenRunning(Watcher):
    """Once three calls run, cancel the group "a" (as a user would cancel one turn); once
    its calls have settled, let group b's call finish."""

    def __init__(self, ready: Path, release: Path) -> None:
        self.ready = ready
        self.release = release
        self.cancelled = False

    def refresh(self, batch: Batch) -> None:
        if not self.cancelled and len(os.listdir(self.ready)) == 3:
            group = batch.group("a")
            assert group is not None
            assert batch.group("b") is not None
            group.cancel()
            self.cancelled = True
        elif self.cancelled and batch.group("a") is None and not self.release.exists():
            assert batch.group("b") is not None  # its call still runs
            self.release.touch()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_lines_of_a_group_share_one_and_cancelling_it_stops_only_its_calls(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    release = tmp_path / "release"
    hold = {"ready": str(ready), "release": str(release)}
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "a1", "tool": "hold", "args": hold, "group": "a"},
            {"id": "a2", "tool": "hold", "args": hold, "group": "a"},
            {"id": "b1", "tool": "hold", "args": hold, "group": "b"},
            {"id": "a3", "tool": "hold", "args": hold, "group": "a"},  # queued, in a
        ],
    )
    out = tmp_path / "out.jsonl"
    watcher = _CancelGroupWhenRunning(ready, release)
    sys.path.insert(0, str(TESTS))  # (the workers get this process's path)
    try:
        options = BatchOptions(tools=TOOLS, input=str(inp), output=str(out), workers=3)
        with anyio.fail_after(50):
            summary = await Batch(options, say=lambda line: None, watcher=watcher).run()
    finally:
        sys.path.remove(str(TESTS))
    assert watcher.cancelled
    recs = by_id(records(out))
    assert {k: r["outcome"] for k, r in recs.items()} == {
        "a1": "aborted",
        "a2": "aborted",
        "b1": "ok",
        "a3": "aborted_before_dispatch",  # not an interrupt: recorded
    }
    assert summary.exit_status == 1


@pytest.mark.timeout(120)
def test_a_mixed_workload_with_misbehaving_tools_settles_every_line_truthfully(
    tmp_path: Path,
) -> None:
    from pool_support import find_by_marker, new_marker

    marker = new_marker()
    lines = [
        # First, so that the two workers take them up at once: a timeout counts from the
        # submission, and one expiring while its call is queued would make it a `timeout`.
        {"id": "deaf", "tool": "sigterm_ignoring_loop", "args": {}, "timeout": 2},
        {"id": "sleeper", "tool": "sleep_past_timeout", "args": {}, "timeout": 2},
        {"id": "echo", "tool": "echo", "args": {"value": "hi"}},
        {"id": "segfault", "tool": "segfault", "args": {}},
        {"id": "exit", "tool": "hard_exit", "args": {"code": 7}},
        {"id": "self-kill", "tool": "kill_own_worker", "args": {}},
        {"id": "garbage", "tool": "garbage_frames", "args": {}},  # C7: the worker is lost
        {"id": "daemon", "tool": "daemon", "args": {"marker": marker}},
        {"id": "fine", "tool": "cooperative", "args": {"seconds": 0.01}},
        {"id": "late", "tool": "cooperative", "args": {"seconds": 60}, "timeout": 0.3},
        *({"id": f"noop-{i}", "tool": "echo", "args": {"value": i}} for i in range(20)),
    ]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    done = batch(inp, out, "--json", "--cancel-grace", "0.2", "--term-grace", "0.2", tools=HOSTILE)
    assert done.returncode == 1, done.stderr
    recs = by_id(records(out))
    assert set(recs) == {line["id"] for line in lines}
    outcomes = {k: r["outcome"] for k, r in recs.items() if not k.startswith("noop-")}
    assert outcomes == {
        "echo": "ok",
        "segfault": "worker_lost",
        "exit": "worker_lost",
        "self-kill": "worker_lost",
        "garbage": "worker_lost",
        "deaf": "killed",
        "sleeper": "killed",
        "daemon": "ok",
        "fine": "ok",
        "late": "timeout",
    }
    assert all(recs[f"noop-{i}"]["value"] == i for i in range(20))
    assert recs["deaf"]["body_started"] is recs["sleeper"]["body_started"] is True
    assert {r["attempts"] for r in recs.values()} == {1}  # no --retries: none retried
    assert not find_by_marker(marker)  # the daemon it left went with the call
    for rec in recs.values():
        assert not {"cause", "rung", "exit_signal", "worker_pid", "timeline"} & set(rec)


# ====================================================================== memory


@pytest.mark.timeout(120)
def test_memory_stays_bounded_as_the_input_grows(tmp_path: Path) -> None:
    """A generous bound; the bench measures 10k against 100k calls. Most of the lines here
    name a tool nobody has: they stream through the same reading, checking and recording as
    calls do (and their ids join the set of ids seen) without the time calls take."""
    peaks = []
    for calls, rejected in ((100, 2_000), (1_000, 20_000)):
        lines = (
            f'{{"id": "line-{i:07d}", "tool": "{"noop" if i < calls else "nothere"}", '
            '"args": {}}'
            for i in range(calls + rejected)
        )
        inp = write_lines(tmp_path / f"in{calls}.jsonl", lines)
        done = batch(inp, tmp_path / f"out{calls}.jsonl", "--json")
        assert done.returncode == 1, done.stderr
        summary = summary_of(done)
        assert summary["recorded"] == {"ok": calls, "rejected": rejected}
        peaks.append(summary["peak_rss_mib"])
    assert peaks[1] - peaks[0] < 50, peaks


# ====================================================================== progress


def _stderr_on_a_terminal(inp: Path, out: Path, *options: str) -> tuple[int, bytes]:
    """Run the batch with its stderr on a pseudo-terminal; its exit status and what the
    terminal got."""
    import pty
    import threading

    main, side = pty.openpty()
    got = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the other side is closed
                return
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        done = subprocess.run(
            _command(inp, out, *options),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=side,
            env=_env() | {"COLUMNS": "100"},
            timeout=90,
        )
    finally:
        os.close(side)
        reader.join(10)
        os.close(main)
    return done.returncode, bytes(got)


@pytest.mark.timeout(120)
def test_on_a_terminal_a_live_bar_unless_no_progress(tmp_path: Path) -> None:
    inp = write_lines(
        tmp_path / "in.jsonl",
        [{"id": i, "tool": "sleep_ms", "args": {"ms": 5}} for i in range(100)],
    )
    status, shown = _stderr_on_a_terminal(inp, tmp_path / "out1.jsonl")
    assert status == 0, shown
    text = shown.decode()
    assert "\x1b[" in text  # drawn, and redrawn
    assert "100/100" in text
    assert "calls/s" in text
    assert "ok 100 | in flight 0 · queued 0" in text
    status, shown = _stderr_on_a_terminal(inp, tmp_path / "out2.jsonl", "--no-progress")
    assert status == 0, shown
    assert shown == b""


# ------------------------------------------------------------------ issue 27


@pytest.mark.timeout(120)
def test_nothing_is_created_when_the_batch_refuses_to_run(tmp_path: Path) -> None:
    """Everything is checked before the results file is created: bad options, tools that
    cannot be loaded, a directory that is not there."""
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "tool": "noop", "args": {}}])
    out = tmp_path / "out.jsonl"
    for options, tools, message in (
        (("--workers", "0"), TOOLS, "--workers must be 1 or more"),
        (("--workers", "1"), "no_such_module_here:registry", "No module named"),
        (("--rerun", "nonsense"), TOOLS, "unknown outcome(s) 'nonsense'"),
    ):
        done = batch(inp, out, *options, tools=tools)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr
        assert not out.exists(), options
    nowhere = batch(inp, tmp_path / "no" / "out.jsonl")
    assert nowhere.returncode == 2
    assert "cannot create" in nowhere.stderr


@pytest.mark.timeout(120)
def test_calls_are_read_from_stdin_and_text_is_recorded_as_it_is(tmp_path: Path) -> None:
    """`-` reads the calls from standard input; an id or a value that is not ASCII reads
    as itself in the record (UTF-8), not as an escape; a bad JSON line's position is its
    column (the line number is the record's)."""
    lines = [
        {"id": "café", "tool": "echo", "args": {"value": "naïve ✓"}},
        {"id": 2, "tool": "noop", "args": {}},
        '{"id": 3, "tool": "noop", "args": {}',
    ]
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        _command(Path("-"), out, "--json"),
        input=text,
        capture_output=True,
        text=True,
        timeout=90,
        env=_env(),
    )
    assert done.returncode == 1, done.stderr  # (the bad line)
    summary = summary_of(done)
    assert (summary["total_lines"], summary["lines"]) == (None, 3)
    assert summary["recorded"] == {"ok": 2, "rejected": 1}
    data = out.read_bytes()
    assert '"id":"café"'.encode() in data
    assert "naïve ✓".encode() in data
    assert b"\\u" not in data
    recs = records(out)
    assert by_id(recs)["café"]["value"] == "naïve ✓"
    (rejected,) = [r for r in recs if r["outcome"] == "rejected"]
    assert rejected["error"].startswith("line 3: not valid JSON ("), rejected
    assert f"column {len(lines[2]) + 1})" in rejected["error"]  # (just after its end)
    assert "line 1" not in rejected["error"]


@pytest.mark.timeout(120)
def test_duration_excludes_queueing_which_queued_s_says(tmp_path: Path) -> None:
    """One worker, three calls of 0.4 s: the last waited for the two before it. Its
    duration_s is its own run; queued_s is the wait."""
    lines = [{"id": i, "tool": "sleep_ms", "args": {"ms": 400}} for i in range(3)]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    done = batch(inp, out, "--workers", "1")
    assert done.returncode == 0, done.stderr
    recs = by_id(records(out))
    # (The body's start is when the worker's report of it arrived: a little after it.)
    assert all(r["duration_s"] + r["queued_s"] >= 0.4 for r in recs.values()), recs
    waited = max(recs.values(), key=lambda r: r["queued_s"])
    assert waited["queued_s"] >= 0.8, recs  # (behind two calls of 0.4 s: at least that)
    assert 0 < waited["duration_s"] < waited["queued_s"], recs


def test_the_help_says_what_the_options_say(capsys: pytest.CaptureFixture[str]) -> None:
    from toolpool._cli import main

    for command in ("batch", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        if command == "batch":
            assert "RESULTS" not in text
            assert "to OUTPUT as its call" in " ".join(text.split())
            assert "--rerun OUTCOME[,OUTCOME]" in text
        else:
            assert "what was observed" in " ".join(text.split())


@pytest.mark.timeout(180)
def test_rerun_makes_recorded_calls_again_where_safe_and_refuses_otherwise(
    tmp_path: Path,
) -> None:
    """`--rerun worker_lost`: a call whose worker died before its body started runs again
    (nothing ran); one whose body started needs --idempotent, and without it nothing runs."""
    before = write_lines(
        tmp_path / "before.jsonl",
        [{"id": "b", "tool": "crash_before", "args": {"marker": str(tmp_path / "b")}}],
    )
    out = tmp_path / "before-out.jsonl"
    first = batch(before, out, "--json")
    assert first.returncode == 1, first.stderr
    assert by_id(records(out))["b"]["body_started"] is False
    again = batch(before, out, "--json", "--rerun", "worker_lost")
    assert again.returncode == 0, again.stderr  # (the last record of "b" is ok)
    summary = summary_of(again)
    assert (summary["rerun"], summary["recorded"], summary["previous"]) == (1, {"ok": 1}, {})
    assert [r["outcome"] for r in records(out)] == ["worker_lost", "ok"]

    after = write_lines(
        tmp_path / "after.jsonl",
        [{"id": "a", "tool": "crash_after", "args": {"marker": str(tmp_path / "a")}}],
    )
    out = tmp_path / "after-out.jsonl"
    assert batch(after, out).returncode == 1
    assert by_id(records(out))["a"]["body_started"] is not False
    kept = out.read_bytes()
    refused = batch(after, out, "--rerun", "killed,worker_lost")
    assert refused.returncode == 2
    assert "--rerun would run 1 call(s) again whose body started or may have (ids 'a')" in (
        refused.stderr
    )
    assert out.read_bytes() == kept
    allowed = batch(after, out, "--json", "--rerun", "worker_lost", "--idempotent")
    assert allowed.returncode == 0, allowed.stderr
    assert [r["outcome"] for r in records(out)] == ["worker_lost", "ok"]


@pytest.mark.timeout(120)
def test_a_silent_pipe_never_blocks_the_batch(tmp_path: Path) -> None:
    """Calls read from a pipe whose writer is slow, then silent: what came is run and
    recorded at once, and Ctrl-C (a real SIGINT) stops the batch while it waits for more."""
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        _command(Path("-"), out, "--json"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        assert proc.stdin is not None
        proc.stdin.write(b'{"id": 1, "tool": "noop", "args": {}}\n\n')
        proc.stdin.flush()
        wait_for(lambda: out.exists() and b'"id":1' in out.read_bytes(), "the first record")
        proc.stdin.write(b'{"id": 2, "tool": "noop", "args": {}}\n')
        proc.stdin.flush()
        wait_for(lambda: b'"id":2' in out.read_bytes(), "the second record")
        proc.send_signal(signal.SIGINT)  # (the writer is silent, the pipe still open)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    summary = json.loads(stdout)
    assert (summary["lines"], summary["recorded"], summary["interrupted"]) == (
        2,
        {"ok": 2},
        True,
    )
    assert [r["id"] for r in records(out)] == [1, 2]
