"""The worker's command line, parsed without argparse (issue 26, "A lean start"): what the
supervisor writes comes back as the worker's options; anything else is refused by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from toolpool.worker._main import parse_options

REQUIRED = ["--endpoint", "ipc:///x/w1.sock", "--tools", "m:r", "--parent-pid", "42"]
REQUIRED += ["--max-frame", "8388608"]


@pytest.mark.timeout(10)
def test_the_supervisors_command_line_becomes_the_options() -> None:
    more = ["--profile", '{"a": 1}', "--capture", "65536", "--cgroup-procs", "a,b"]
    more += ["--ledger", "/x/ledger", "--members", "/c/cgroup.procs", "--heartbeat", "1.0"]
    options = parse_options([*REQUIRED, *more, "--allow-background"])
    assert options == {
        "endpoint": "ipc:///x/w1.sock",
        "tools": "m:r",
        "parent_pid": 42,
        "max_frame": 8388608,
        "profile": '{"a": 1}',
        "capture": 65536,
        "cgroup_procs": "a,b",
        "ledger": "/x/ledger",
        "members": "/c/cgroup.procs",
        "heartbeat": 1.0,
        "allow_background": True,
    }


@pytest.mark.timeout(10)
def test_defaults() -> None:
    options = parse_options(REQUIRED)
    assert options["profile"] == ""
    assert options["capture"] == 0
    assert options["heartbeat"] == 0.0
    assert options["allow_background"] is False


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (REQUIRED[2:], "--endpoint is required"),
        ([*REQUIRED, "--bogus", "1"], "unknown argument '--bogus'"),
        ([*REQUIRED, "stray"], "unknown argument 'stray'"),
        ([*REQUIRED, "--capture"], "--capture needs a value"),
        ([*REQUIRED[:5], "pid", *REQUIRED[6:]], "--parent-pid: not a valid int: 'pid'"),
        ([*REQUIRED, "--heartbeat", "often"], "--heartbeat: not a valid float"),
    ],
)
def test_a_bad_command_line_is_refused_by_name(argv: list[str], error: str) -> None:
    with pytest.raises(ValueError, match="^" + error.replace("(", r"\(")):
        parse_options(argv)


@pytest.mark.timeout(30)
def test_a_worker_started_with_a_bad_command_line_exits_2_with_its_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "toolpool.worker", "--bogus"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 2
    assert "usage: python -m toolpool.worker" in done.stderr
    assert "unknown argument '--bogus'" in done.stderr
