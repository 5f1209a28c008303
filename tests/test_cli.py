"""The command line, run as users run it: ``python -m toolpool ...`` in a subprocess."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import toolpool as toolpool_package
from toolpool._cli import _parser, _profile, _table

EXAMPLES = "toolpool.testing.examples:registry"
IS_ROOT = os.geteuid() == 0


def toolpool(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toolpool", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(90)
def test_tools_lists_the_catalog_with_schemas() -> None:
    done = toolpool("tools", EXAMPLES)
    assert done.returncode == 0, done.stderr
    catalog = {tool["name"]: tool for tool in json.loads(done.stdout)}
    assert "echo" in catalog
    assert catalog["echo"]["input_schema"]["type"] == "object"


@pytest.mark.timeout(90)
def test_call_prints_the_result_and_exits_by_outcome() -> None:
    done = toolpool("call", EXAMPLES, "echo", '{"value": [1, 2]}')
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["outcome"], result["value"], result["body_started"]) == ("ok", [1, 2], True)
    failed = toolpool("call", EXAMPLES, "fail", "{}")
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["outcome"] == "error"


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("call", EXAMPLES, "echo", "not json"), "ValueError: args is not valid JSON"),
        (("call", EXAMPLES, "no_such_tool"), "UnknownToolError: no worker provides"),
        (("doctor", "--user", "no-such-user-here"), "ValueError: no user named"),
        (("doctor", "--memory", "lots"), "cannot read 'lots' as a size"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    done = toolpool(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(90)
def test_doctor_reports_layer_by_layer() -> None:
    done = toolpool("doctor", "--profile", "default", "--no-cgroups")
    assert done.returncode == 0, done.stderr
    assert "profile: default" in done.stdout
    for layer in ("session", "subreaper", "cgroup_kill", "rlimits", "ipcns", "uid", "scratch_dir"):
        assert f"  {layer} " in done.stdout
    assert "disabled by the profile" in done.stdout


def test_profile_options_map_to_the_profile() -> None:
    argv = "doctor --profile default --memory 256MiB --cpu-time 10s --max-processes 32"
    argv += " --no-network --user per-worker --no-cgroups --private-ipc"
    ns = _parser().parse_args(argv.split())
    profile = _profile(ns)
    assert profile.memory == 256 * 1024**2
    assert profile.cpu_time == 10.0
    assert profile.max_processes == 32
    assert profile.network is False
    assert profile.private_ipc is True
    assert profile.user == "per-worker"
    assert profile.disable == frozenset({"cgroups"})
    assert _profile(_parser().parse_args(["doctor", "--user", "same"])).user is None
    assert _profile(_parser().parse_args(["doctor", "--user", "65534"])).user == 65534


@pytest.mark.timeout(120)
@pytest.mark.skipif(not IS_ROOT, reason="the untrusted layers need root here")
def test_selftest_passes_the_kit_here() -> None:
    done = toolpool("selftest", timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "20 passed, 0 failed" in done.stdout
    # The table is whole: what the pool logs while the kit provokes it comes after it, and
    # no observed value is cut off.
    assert done.stderr == ""
    table = done.stdout.partition("\nthreat ")[2].partition("\n\n")[0]
    assert "stranger connected" not in table
    assert "quarantined" not in table
    assert "'sibling': 'blocked'}" in table


def test_a_table_wraps_a_long_cell_instead_of_cutting_it() -> None:
    text = _table(
        [("a", "b", "c"), ("x", "one two three four five", "end")], wrap={1: 9}
    ).splitlines()
    assert text == [
        "a  b          c",
        "-  ---------  ---",
        "x  one two    end",
        "   three",
        "   four five",
    ]


# ------------------------------------------------------------------ what a new user hits

AGENTTOOLS = '''
import os
import time

import toolpool

registry = toolpool.Registry()


@registry.tool
def hi(name: str = "you") -> str:
    """Say hello."""
    return f"hello {name}"


@registry.tool
def stubborn(fifo: str) -> int:
    """Say where it runs through a FIFO, then spin, never looking at its signal."""
    with open(fifo, "w") as f:
        f.write(f"{os.getpid()}\\n")
    n = 0
    while True:
        n += 1
'''


def _script() -> list[str]:
    """The installed ``toolpool`` command, as a user runs it: unlike ``python -m``, it does
    not put the current directory on the path by itself."""
    found = shutil.which("toolpool", path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-P", "-m", "toolpool"]


def _run_here(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_script(), *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
    )


@pytest.fixture
def agenttools(tmp_path: Path) -> Path:
    (tmp_path / "agenttools.py").write_text(AGENTTOOLS)
    return tmp_path


@pytest.mark.timeout(90)
def test_the_command_finds_a_module_in_the_current_directory(agenttools: Path) -> None:
    listed = _run_here(agenttools, "tools", "agenttools:registry")
    assert listed.returncode == 0, listed.stderr
    assert [tool["name"] for tool in json.loads(listed.stdout)] == ["hi", "stubborn"]
    called = _run_here(agenttools, "call", "agenttools:registry", "hi", '{"name": "there"}')
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout)["value"] == "hello there"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("command", ["tools", "call"])
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_here:registry", "ModuleNotFoundError: No module named"),
        ("agenttools:nothere", "ImportError: cannot find 'nothere' in 'agenttools'"),
    ],
)
def test_a_missing_module_or_attribute_is_one_clear_line(
    agenttools: Path, command: str, spec: str, message: str
) -> None:
    done = _run_here(agenttools, command, spec, *(["hi"] if command == "call" else []))
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_version() -> None:
    done = toolpool("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"toolpool {toolpool_package.__version__}"


def test_every_option_has_help_text() -> None:
    def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        found = [parser]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found += parsers(sub)
        return found

    missing = [
        f"{parser.prog} {action.dest}"
        for parser in parsers(_parser())
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._SubParsersAction)
    ]
    assert not missing
    assert len(parsers(_parser())) == 8  # toolpool and its 7 commands


@pytest.mark.timeout(90)
def test_call_prints_every_field_of_the_result_and_a_timeline_of_offsets() -> None:
    done = toolpool("call", EXAMPLES, "echo", '{"value": 1}')
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    fields = {f.name for f in dataclasses.fields(toolpool_package.Result)}
    assert set(printed) == fields | {"duration"}
    for name in ("error_name", "context", "leftovers_killed", "cpu_time", "output"):
        assert name in printed
    timeline = printed["timeline"]
    assert next(iter(timeline)) == "submitted"
    assert timeline["submitted"] == 0.0
    assert list(timeline.values()) == sorted(timeline.values())
    assert timeline["settled"] == pytest.approx(printed["duration"])
    assert 0 < printed["duration"] < 60


def _start_stubborn(cwd: Path, fifo: Path, *options: str) -> tuple[subprocess.Popen[str], int]:
    """``toolpool call`` of a tool that ignores its signal; returns once its body runs,
    with the worker's pid."""
    os.mkfifo(fifo)
    args = json.dumps({"fifo": str(fifo)})
    proc = subprocess.Popen(
        [*_script(), "call", "agenttools:registry", "stubborn", args, *options],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with concurrent.futures.ThreadPoolExecutor(1) as reader:
        try:
            pid = reader.submit(lambda: int(fifo.read_text())).result(timeout=60)
        except BaseException:
            proc.kill()
            with open(fifo, "w"):  # the reader thread must not wait for good
                pass
            proc.communicate()
            raise
    return proc, pid


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(90)
def test_ctrl_c_says_what_the_pool_does_and_ends_without_a_traceback(
    agenttools: Path,
) -> None:
    proc, worker = _start_stubborn(
        agenttools, agenttools / "fifo", "--cancel-grace", "0.2", "--term-grace", "0.2"
    )
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("toolpool: interrupted: stopping the pool.")
    assert "within 0.2s gets SIGTERM, then SIGKILL 0.2s later" in lines[0]
    assert lines[-1] == (
        "toolpool: stopped: every call settled and every process of the pool is gone"
    )
    assert len(lines) == 2, err
    assert out == ""
    assert _gone(worker)


@pytest.mark.timeout(90)
def test_a_second_ctrl_c_kills_at_once(agenttools: Path) -> None:
    proc, worker = _start_stubborn(
        agenttools, agenttools / "fifo", "--cancel-grace", "600", "--term-grace", "600"
    )
    assert proc.stderr is not None
    proc.send_signal(signal.SIGINT)
    first = proc.stderr.readline()  # the pool is stopping: it would wait 600 s
    assert first.startswith("toolpool: interrupted: stopping the pool."), first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)  # far below the 600 s grace
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert lines == [
        "toolpool: interrupted again: killing 1 call now (SIGKILL)",
        "toolpool: stopped: every call settled and every process of the pool is gone",
    ]
    assert _gone(worker)


@pytest.mark.timeout(90)
def test_ctrl_c_stops_the_demo_with_a_short_message() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolpool", "demo"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("toolpool demo:")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("toolpool: interrupted: stopping the pool."), err
    assert lines[-1] == (
        "toolpool: stopped: every call settled and every process of the pool is gone"
    )
    assert "Traceback" not in err


def _reapers_of(supervisor_pid: int) -> list[int]:
    """The reaper processes a supervisor started (``python -P .../reaper/_main.py PID FD``:
    its workers die with it)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        script = cmdline[2] if len(cmdline) >= 4 else ""
        if script.endswith("_main.py") and "reaper" in script and cmdline[3] == str(supervisor_pid):
            found.append(proc.pid)
    return found


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "args", [("tools", EXAMPLES), ("call", EXAMPLES, "echo", '{"value": [1, 2]}')]
)
def test_a_reader_gone_away_ends_the_command_quietly(args: tuple[str, ...]) -> None:
    """`toolpool call ... | head`: status 141 (128 + SIGPIPE), no traceback, and the pool
    closed: no reaper of the command's is left (its workers die with it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolpool", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before anything was written
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert err == ""
    assert _reapers_of(proc.pid) == []
