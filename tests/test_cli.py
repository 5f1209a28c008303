"""The command line, run as users run it: ``python -m toolpool ...`` in a subprocess."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import toolpool as toolpool_package
from toolpool._cli import _parser, _profile
from toolpool._cli_report import table as _table

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
def test_tools_leaves_the_user_modules_teardown_to_run(tmp_path: Path) -> None:
    """``toolpool tools`` imports the user's module into the command's own process: its exit
    is the interpreter's usual one, so what that module leaves to the teardown (a buffered
    file flushed as it is collected) still happens. (Other commands end with ``os._exit``.)"""
    written = tmp_path / "written.txt"
    (tmp_path / "teardown_tools.py").write_text(
        "from toolpool import Registry\n"
        f"log = open({str(written)!r}, 'w')  # never closed: flushed at the teardown\n"
        "log.write('imported\\n')\n"
        "registry = Registry()\n"
        "@registry.tool\n"
        "def noop() -> None:\n"
        "    return None\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "toolpool", "tools", "teardown_tools:registry"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["name"] == "noop"
    assert written.read_text() == "imported\n"


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
    assert "21 held, 0 not held" in done.stdout
    assert "0 not run, 0 FAILED" in done.stdout
    # The table is whole: what the pool logs while the kit provokes it comes after it, and
    # no observed value is cut off.
    assert done.stderr == ""
    table = done.stdout.partition("\nthreat ")[2].partition("\n\n")[0]
    assert "stranger connected" not in table
    assert "quarantined" not in table
    assert "sibling: blocked" in table


def _rows(stdout: str) -> dict[str, str]:
    """The selftest table's rows by threat, each row's lines joined."""
    table = stdout.partition("\nthreat ")[2].partition("\n\n")[0].splitlines()[2:]
    rows: dict[str, str] = {}
    last = ""
    for line in table:
        if line.startswith(" "):
            rows[last] += "\n" + line
        else:
            last = line[:46].strip()
            rows[last] = line
    return rows


@pytest.mark.timeout(240)
def test_selftest_never_calls_a_threat_that_went_through_a_pass() -> None:
    """Issue 27: under `default` without cgroups, what went through says "not held" and
    why, each status is counted apart, and the exit status is 0 (the profile claims none of
    it). The fd row names the limit that applied; no observed cell is cut mid-word."""
    done = toolpool("selftest", "--profile", "default", "--no-cgroups", timeout=230)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    for threat in (
        "fork bomb",
        "memory hog",
        "signals the reaper or the supervisor",
        "signals a sibling worker",
        "reaches the network",
        "changes metadata outside its scratch directory",
    ):
        assert "  not held  -" in rows[threat], rows[threat]
    assert "(no Landlock, no uid of" in rows["signals the reaper or the supervisor"]
    assert "RLIMIT_NOFILE=" in rows["fd exhaustion"]
    assert "(inherited)" in rows["fd exhaustion"]
    assert " pass " not in done.stdout
    assert "0 not run, 0 FAILED" in done.stdout
    assert "6 not held (expected under this profile" in done.stdout
    assert "map keys must be str" in done.stdout  # (whole: once cut at 120 characters)


@pytest.mark.timeout(120)
def test_selftest_exits_non_zero_when_a_claimed_layer_let_a_threat_through(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A row judged FAILED (here: a check that claims the network is cut, under a profile
    that allows it) makes the run fail, and the summary names it."""
    from toolpool._cli import main
    from toolpool.testing import hostile

    _kit = sys.modules[hostile.Threat.__module__]  # (the kit's own module: run_kit reads it)

    def claims_netns(result: object, setting: object) -> object:
        return _kit._held(getattr(result, "value", None) == "ENETUNREACH", "ENETUNREACH", "x")

    threat = _kit.Threat("reaches the network", "reach_network", {}, "call", claims_netns)  # type: ignore[arg-type]
    monkeypatch.setattr(_kit, "THREATS", (threat,))
    status = main(["selftest", "--profile", "default", "--no-cgroups"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "0 held, 0 not held (expected under this profile: see 'expected'), 0 not run" in out
    assert "1 FAILED (reaches the network)" in out


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
    long = _table([("a", "b"), ("x", "see /a/very/long/path/to/it now")], wrap={1: 9})
    assert long.splitlines()[2:] == ["x  see", "   /a/very/long/path/to/it", "   now"]


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
    assert len(parsers(_parser())) == 14  # toolpool and its 13 commands


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
    # The call settled (escalated: it ignores its cancel): what it settled as is printed
    # (issue 27: it printed nothing).
    result = json.loads(out)
    assert (result["outcome"], result["body_started"]) == ("killed", True), result
    assert result["rung"] in ("sigterm", "sigkill")
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
    out, err = proc.communicate(timeout=60)  # far below the 600 s grace
    assert proc.returncode == 130, err
    assert json.loads(out)["rung"] == "sigkill"
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


@pytest.mark.timeout(120)
def test_the_cli_logs_to_stderr_with_its_prefix_at_the_level_asked() -> None:
    """Issue 27: no bare WARNING lines from Python's fallback handler: the command's own,
    on stderr (stdout stays the result), prefixed, at ``--log-level`` (before or after the
    subcommand)."""
    done = toolpool("call", EXAMPLES, "crash", '{"code": 3}')
    assert done.returncode == 1
    assert json.loads(done.stdout)["outcome"] == "worker_lost"
    lines = done.stderr.splitlines()
    assert lines, done.stderr
    assert all(line.startswith("toolpool: ") for line in lines), lines
    assert any(
        line.startswith("toolpool: warning: worker ") and "died during a call" in line
        for line in lines
    ), lines
    quiet = toolpool("call", EXAMPLES, "crash", '{"code": 3}', "--log-level", "error")
    assert quiet.returncode == 1
    assert quiet.stderr == ""
    chatty = toolpool("--log-level", "debug", "call", EXAMPLES, "noop")
    assert chatty.returncode == 0, chatty.stderr
    assert "toolpool: debug: worker 1 (pid " in chatty.stderr
    assert "retired (the pool is closing)" in chatty.stderr


def test_importing_toolpool_adds_a_null_handler() -> None:
    handlers = logging.getLogger("toolpool").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers), handlers


# ------------------------------------------------------------------ issue 27: CLI slips

BROKEN_MODULES = {
    "raises_at_import": "import toolpool\nregistry = toolpool.Registry()\n1 / 0\n",
    "bad_syntax": "import toolpool\nregistry = toolpool.Registry(\n",
    "not_a_registry": "registry = 3\n",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", sorted(BROKEN_MODULES))
def test_tools_that_cannot_load_are_the_same_one_line_for_tools_and_call(
    tmp_path: Path, module: str
) -> None:
    (tmp_path / f"{module}.py").write_text(BROKEN_MODULES[module])
    listed = _run_here(tmp_path, "tools", f"{module}:registry")
    called = _run_here(tmp_path, "call", f"{module}:registry", "anything")
    for done in (listed, called):
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert called.stderr == listed.stderr
    expected = {
        "raises_at_import": "raised ZeroDivisionError: division by zero",
        "bad_syntax": "raised SyntaxError: '(' was never closed",
        "not_a_registry": "TypeError: 'not_a_registry:registry' is an int, not a toolpool.Registry",
    }[module]
    assert expected in listed.stderr


PROGRESS_TOOLS = '''
import time

import toolpool

registry = toolpool.Registry()


@registry.tool
def steps(n: int, execution: toolpool.ToolExecution) -> int:
    """Print a line and report progress n times."""
    for i in range(n):
        print(f"step {i}", flush=True)
        execution.report_progress(i + 1, n, f"step {i}")
        time.sleep(0.1)
    return n
'''


@pytest.mark.timeout(120)
def test_call_output_captures_what_the_tool_writes(tmp_path: Path) -> None:
    (tmp_path / "progress_tools.py").write_text(PROGRESS_TOOLS)
    shown = _run_here(tmp_path, "call", "progress_tools:registry", "steps", '{"n": 3}', "--output")
    assert shown.returncode == 0, shown.stderr
    result = json.loads(shown.stdout)
    assert result["output"] == "step 0\nstep 1\nstep 2\n"
    # Times to the microsecond, not 0.0005549999999999999.
    for value in [result["cpu_time"], result["duration"], *result["timeline"].values()]:
        assert value == round(value, 6), value
    plain = _run_here(tmp_path, "call", "progress_tools:registry", "steps", '{"n": 1}')
    assert json.loads(plain.stdout)["output"] is None
    assert "\x1b" not in plain.stderr  # not a terminal: no progress line


@pytest.mark.timeout(120)
def test_call_shows_progress_on_a_terminal(tmp_path: Path) -> None:
    """With stderr on a terminal (a pty), the tool's progress reports are shown on one
    line, cleared at the end; stdout is still the result alone."""
    (tmp_path / "progress_tools.py").write_text(PROGRESS_TOOLS)
    leader, follower = os.openpty()
    try:
        proc = subprocess.Popen(
            [*_script(), "call", "progress_tools:registry", "steps", '{"n": 10}'],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=follower,
            cwd=tmp_path,
        )
        os.close(follower)
        follower = -1
        seen = b""
        while True:  # until the command closes the terminal (it exited)
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: no process has the terminal open any more
                break
            if not chunk:
                break
            seen += chunk
        stdout, _ = proc.communicate(timeout=60)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 0
    assert json.loads(stdout)["value"] == 10
    text = seen.decode(errors="replace")
    assert "toolpool: steps: " in text, text
    assert "/10 step " in text, text
    assert text.rindex("\r\x1b[K") > text.rindex("toolpool: steps: "), text  # cleared


def test_main_leaves_the_toolpool_logger_as_it_found_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command's handler is its own while it runs: a program (a test) that runs
    ``main`` in-process keeps its logging (caplog sees the pool's records afterwards)."""
    from toolpool._cli import main

    log = logging.getLogger("toolpool")
    before = (log.level, log.propagate, list(log.handlers))
    assert main(["--log-level", "debug", "tools", EXAMPLES]) == 0
    assert (log.level, log.propagate, list(log.handlers)) == before
    assert json.loads(capsys.readouterr().out)
