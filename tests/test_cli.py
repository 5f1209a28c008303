"""The command line, run as users run it: ``python -m toolpool ...`` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from toolpool._cli import _parser, _profile

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
