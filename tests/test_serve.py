"""``toolpool serve``: the service's states, probes, metrics, control socket and signals,
with real processes (docs/service.md)."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_support import ServeProcess, serve_env
from toolpool import Outcome, connect
from toolpool.remote import ServerUnavailable
from toolpool.serve import (
    ProviderConfig,
    ServiceOptions,
    configure_logging,
    load_config,
    parse_tools,
)
from toolpool.testing.hostile import shared_tmp

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def control(tmp_path: Path) -> str:
    return str(tmp_path / "ctl" / "control.sock")


@pytest.fixture
def services() -> Iterator[list[ServeProcess]]:
    started: list[ServeProcess] = []
    yield started
    for s in started:
        s.close()


def start(services: list[ServeProcess], control: str, *args: str, **kw: object) -> ServeProcess:
    s = ServeProcess(["--http", "127.0.0.1:0", *args], control=control, **kw)  # type: ignore[arg-type]
    services.append(s)
    return s


def start_tools(
    services: list[ServeProcess], control: str, ledger: Path, *args: str
) -> ServeProcess:
    """A service of ``serve_tools:registry`` whose tools note their calls in ``ledger``."""
    return start(
        services,
        control,
        "serve_tools:registry",
        *args,
        env=serve_env(TOOLPOOL_TEST_LEDGER=str(ledger)),
    )


def toolpool(*args: str, control: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toolpool", *args, "--control", control],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def stop_and_check(s: ServeProcess) -> None:
    """SIGTERM; exit 0; every process it had is gone."""
    s.note_descendants()
    assert s.descendants, "the service had no processes below it"
    s.signal(signal.SIGTERM)
    assert s.wait(60) == 0, "\n".join(s.raw[-30:])
    assert s.alive_descendants() == []
    events = [line["event"] for line in s.lines]
    assert events.index("draining") < events.index("drained") < events.index("stopped")


# ---------------------------------------------------------------------------- configuration


def test_tools_arguments_name_providers() -> None:
    got = parse_tools(["a.b:registry", "ops=c:reg"], profile="untrusted", workers=3)
    assert [(p.name, p.tools, p.profile, p.workers) for p in got] == [
        ("default", "a.b:registry", "untrusted", 3),
        ("ops", "c:reg", "untrusted", 3),
    ]
    assert parse_tools(["x:r", "y.z:r"])[1].name == "y.z"
    with pytest.raises(ValueError, match="two providers named 'default'"):
        parse_tools(["x:r", "default=y:r"])
    with pytest.raises(ValueError, match="module:attribute"):
        parse_tools(["nocolon"])


def test_config_file(tmp_path: Path) -> None:
    path = tmp_path / "service.toml"
    path.write_text(
        textwrap.dedent(
            """
            [providers.sandboxed]
            tools = "mytools:registry"
            profile = "untrusted"
            autoscale = "2:8"
            timeout = 30

            [providers.local]
            tools = "ops:registry"
            workers = 2
            """
        )
    )
    got = load_config(str(path))
    assert got == (
        ProviderConfig(
            name="sandboxed",
            tools="mytools:registry",
            profile="untrusted",
            autoscale=(2, 8),
            timeout=30,
        ),
        ProviderConfig(name="local", tools="ops:registry", workers=2),
    )
    assert got[0].initial_workers == 2


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[providers.a]\ntools = "m:r"\nworkrs = 2\n', "unknown key 'workrs'"),
        ('[providers.a]\ntools = "m:r"\nworkers = 2\nautoscale = "1:2"\n', "not both"),
        ('[providers.a]\ntools = "m:r"\nautoscale = "3:2"\n', "MIN <= MAX"),
        ('[providers.a]\ntools = "m:r"\nprofile = "strict"\n', "profile must be"),
        ("[providers.a]\nprofile = 'default'\n", "tools = 'module:attribute' is required"),
        ('[service]\nport = 1\n[providers.a]\ntools = "m:r"\n', "unknown table or key"),
        ("", "no provider"),
        ("[providers", "not valid TOML"),
    ],
)
def test_config_file_errors_name_the_problem(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_config(str(path))


def test_a_non_loopback_listener_needs_a_token(tmp_path: Path) -> None:
    providers = parse_tools(["m:r"])
    with pytest.raises(ValueError, match="not a loopback address, and no token"):
        ServiceOptions(providers=providers, host="0.0.0.0")
    assert ServiceOptions(providers=providers, host="0.0.0.0", token="t").token == "t"
    assert ServiceOptions(providers=providers, host="::1").host == "::1"
    done = subprocess.run(
        [sys.executable, "-m", "toolpool", "serve", "m:r", "--http", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "refusing to listen on 0.0.0.0" in done.stderr


def test_tools_that_cannot_start_end_the_service_with_one_line(
    control: str, services: list[ServeProcess]
) -> None:
    s = start(services, control, "nosuch_module_here:registry")
    s.wait_listening()
    assert s.wait(60) == 2
    failed = s.wait_event("failed")
    # The last line is the one `toolpool tools` prints for a registry that cannot load; the
    # event names the provider whose workers failed.
    assert s.raw[-1] == "ModuleNotFoundError: No module named 'nosuch_module_here'"
    assert "workers for 'nosuch_module_here:registry' fail to start" in failed["message"]
    assert failed["level"] == "error"
    assert "Traceback" not in failed["message"]
    assert not os.path.exists(control)  # (the control socket is removed on the way out)


# ---------------------------------------------------------------------------- states


def test_health_and_readiness_from_starting_to_serving(
    tmp_path: Path, control: str, services: list[ServeProcess]
) -> None:
    gate = tmp_path / "gate"
    s = start(
        services,
        control,
        "serve_gate_tools:registry",
        "--workers",
        "2",
        env=serve_env(TOOLPOOL_TEST_GATE=str(gate)),
    )
    s.wait_listening()
    status, body = s.get("/healthz")
    assert status == 200
    assert json.loads(body)["state"] == "starting"
    status, body = s.get("/readyz")
    assert status == 503
    assert json.loads(body) == {"state": "starting", "serving_workers": 0}
    assert s.get("/nothing")[0] == 404
    gate.touch()
    s.wait_serving()
    status, body = s.get("/readyz")
    assert status == 200
    assert json.loads(body) == {"state": "serving", "serving_workers": 2}
    status, body = s.get("/healthz")
    facts = json.loads(body)
    assert status == 200
    assert facts["reaper"] == "alive"
    assert psutil.Process(facts["reaper_pid"]).ppid() == s.proc.pid
    stop_and_check(s)


def test_metrics_scraped_with_prometheus_parser(control: str, services: list[ServeProcess]) -> None:
    s = start(services, control, "serve_tools:registry", "ops=serve_tools:ops")
    s.wait_serving()
    status, body = s.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    ready = {
        s_.labels["provider"]: s_.value
        for s_ in families["toolpool_workers"].samples
        if s_.labels["state"] == "ready"
    }
    assert ready == {"default": 4.0, "ops": 4.0}
    state = {x.labels["state"]: x.value for x in families["toolpool_service_state"].samples}
    assert state == {"starting": 0.0, "serving": 1.0, "draining": 0.0, "stopped": 0.0}
    assert families["toolpool_service_busy_ratio"].samples[0].value == 0.0
    assert {x.labels["provider"] for x in families["toolpool_queue_depth"].samples} == {
        "default",
        "ops",
    }
    stop_and_check(s)


# ---------------------------------------------------------------------------- control


def test_status_scale_reload_drain_over_the_control_socket(
    control: str, services: list[ServeProcess]
) -> None:
    s = start(services, control, "serve_tools:registry", "--workers", "2")
    s.wait_serving()
    directory = os.path.dirname(control)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(control).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(control).st_mode)

    done = toolpool("status", "--json", control=control)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["state"] == "serving"
    assert status["ready"] is True
    assert status["providers"]["default"]["size"] == 2
    assert status["providers"]["default"]["workers"]["ready"] == 2
    text = toolpool("status", control=control)
    assert "state: serving  ready: yes" in text.stdout
    assert "default" in text.stdout

    done = toolpool("scale", "3", control=control)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "default: 2 -> 3 workers"
    status = json.loads(toolpool("status", "--json", control=control).stdout)
    assert status["providers"]["default"]["workers"]["ready"] == 3

    done = toolpool("scale", "2", "--provider", "nope", control=control)
    assert done.returncode == 2
    assert "no provider 'nope'; there are: default" in done.stderr

    done = toolpool("reload", control=control)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "default: reloaded (generation 2)"
    s.wait_event("reloaded", generation=2)

    s.note_descendants()
    done = toolpool("drain", "--wait", control=control)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"
    assert s.wait(30) == 0
    assert s.alive_descendants() == []
    assert not os.path.exists(control)
    done = toolpool("status", control=control)
    assert done.returncode == 2
    assert "no service at" in done.stderr


def test_control_socket_refuses_another_uid(services: list[ServeProcess]) -> None:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run a client as another uid")
    base = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    reach = subprocess.run(
        [*base, sys.executable, "-c", "import toolpool.serve"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=serve_env(),
    )
    if reach.returncode != 0:  # (a checkout under a private /tmp, say)
        pytest.skip(f"uid 65534 cannot import this checkout's toolpool: {reach.stderr[-200:]}")
    # Every directory above the service's own is open to uid 65534 (pytest's tmp_path may
    # not be: /tmp is 0700 on some machines), so what keeps it out is that 0700 directory.
    parent = tempfile.mkdtemp(prefix="toolpool-ctl-", dir=shared_tmp())
    os.chmod(parent, 0o755)
    control = os.path.join(parent, "ctl", "control.sock")
    try:
        _refuses_another_uid(services, control, base)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _refuses_another_uid(services: list[ServeProcess], control: str, base: list[str]) -> None:
    s = start(services, control, "serve_tools:registry", "--workers", "1")
    s.wait_serving()
    client = (
        "import sys, toolpool.serve as s\n"
        "try:\n"
        "    s.control(sys.argv[1], {'op': 'status'}, timeout=30)\n"
        "except s.ControlError as exc:\n"
        "    print(exc)\n"
    )
    # Without privileges, the 0700 directory keeps uid 65534 out...
    done = subprocess.run(
        [*base, sys.executable, "-c", client, control],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=serve_env(),
    )
    assert "permission denied" in done.stdout, done.stderr
    # ...and one that can pass it (CAP_DAC_OVERRIDE) is refused by its uid (SO_PEERCRED).
    caps = ["--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
    done = subprocess.run(
        [*base, *caps, sys.executable, "-c", client, control],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=serve_env(),
    )
    assert done.stdout.strip() == "uid 65534 may not control this", done.stderr
    assert s.wait_event("control_refused")["uid"] == 65534
    assert json.loads(toolpool("status", "--json", control=control).stdout)["ready"]
    stop_and_check(s)


# ---------------------------------------------------------------------------- signals


def test_sighup_reloads_every_provider(control: str, services: list[ServeProcess]) -> None:
    s = start(services, control, "serve_tools:registry", "ops=serve_tools:ops")
    s.wait_serving()
    s.signal(signal.SIGHUP)
    s.wait_event("reloaded", provider="default", generation=2)
    s.wait_event("reloaded", provider="ops", generation=2)
    status = json.loads(toolpool("status", "--json", control=control).stdout)
    assert {n: p["generation"] for n, p in status["providers"].items()} == {
        "default": 2,
        "ops": 2,
    }
    stop_and_check(s)


def _unshare() -> list[str]:
    if os.getuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (util-linux) for a PID namespace")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")
    return ["unshare", "--pid", "--fork", "--mount-proc"]


def test_as_pid_1_signals_are_handled_and_orphans_reaped(
    control: str, services: list[ServeProcess]
) -> None:
    argv = [
        *_unshare(),
        sys.executable,
        "-m",
        "toolpool",
        "serve",
        "serve_tools:registry",
        "--workers",
        "2",
        "--http",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--control",
        control,
    ]
    s = start(services, control, argv=argv)
    s.wait_serving()
    init = psutil.Process(s.proc.pid).children()[0]  # unshare's child: PID 1 inside
    service = init.children()
    assert len(service) == 1, "PID 1 forks the service and stays behind as its init"
    # An orphan in the namespace: its parent exits at once, so it is re-parented to PID 1,
    # which must reap it when it ends (else a zombie stays).
    orphan_maker = "sleep 2 >/dev/null 2>&1 & echo $!"
    spawned = subprocess.run(
        ["nsenter", "-t", str(init.pid), "-p", "-m", "sh", "-c", orphan_maker],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert spawned.stdout.strip()
    orphans = [p for p in init.children() if p.name() == "sleep"]
    assert len(orphans) == 1
    orphan = orphans[0]
    try:
        orphan.wait(30)  # (psutil: returns once the process is gone, reaped by its parent)
    except psutil.TimeoutExpired:
        pytest.fail("the orphan was not reaped by PID 1")
    assert not psutil.pid_exists(orphan.pid)
    s.note_descendants()
    init.send_signal(signal.SIGTERM)  # what a container runtime does
    assert s.wait(60) == 0, "\n".join(s.raw[-30:])
    assert s.alive_descendants() == []
    assert [line["event"] for line in s.lines][-1] == "stopped"


# ---------------------------------------------------------------------------- with calls


def _ledger(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _wait_started(path: Path, ids: set[str], timeout: float = 60.0) -> None:
    """Until the tools noted the start of every id (another process's file: polled)."""
    deadline = time.monotonic() + timeout
    while not ids <= {line[1] for line in _ledger(path) if line[0] == "start"}:
        assert time.monotonic() < deadline, f"not started: {ids}; ledger: {_ledger(path)}"
        time.sleep(0.02)


def _calls(url: str, requests: list[tuple[str, dict[str, object]]], *, during: Any = None) -> Any:
    """Send the calls (and run ``during(calls)`` in a thread while they run); the results,
    or the exception each raised."""

    async def main() -> list[Any]:
        async with connect(url) as client:
            calls = [client.submit(tool, args) for tool, args in requests]
            if during is not None:
                await anyio.to_thread.run_sync(during, calls)
            out: list[Any] = []
            for call in calls:
                try:
                    out.append(await call)
                except Exception as exc:
                    out.append(exc)
            return out

    return anyio.run(main)


def test_sigterm_drains_running_calls_per_the_graces(
    tmp_path: Path, control: str, services: list[ServeProcess]
) -> None:
    ledger = tmp_path / "ledger"
    s = start_tools(
        services,
        control,
        ledger,
        "--workers",
        "3",
        "--drain-grace",
        "3",
        "--cancel-grace",
        "1",
        "--term-grace",
        "1",
    )
    s.wait_serving()
    refused: list[Any] = []

    def during(calls: list[Any]) -> None:
        _wait_started(ledger, {"quick", "stuck"})
        s.note_descendants()
        s.signal(signal.SIGTERM)
        s.wait_event("draining")
        status, body = s.get("/readyz")
        assert status == 503
        assert json.loads(body)["state"] == "draining"
        assert s.get("/healthz")[0] == 200

        async def late() -> None:
            async with connect(s.url("/mcp")) as client:
                try:
                    await client.call("noop")
                except ServerUnavailable as exc:
                    refused.append(exc)

        anyio.run(late)

    quick, stuck = _calls(
        s.url("/mcp"),
        [("work", {"id": "quick", "seconds": 1.0}), ("stubborn", {"id": "stuck"})],
        during=during,
    )
    assert len(refused) == 1
    assert "draining" in str(refused[0])
    assert quick.outcome is Outcome.OK  # finished within the drain grace
    assert stuck.outcome is Outcome.KILLED  # ignored the disposed cancel: SIGTERM
    assert stuck.body_started is True
    assert s.wait(60) == 0
    assert s.alive_descendants() == []
    events = {line["event"]: line for line in s.lines}
    assert events["drain_grace_over"]["in_flight"] == 1
    starts = [line for line in _ledger(ledger) if line[0] == "start"]
    assert sorted(line[1] for line in starts) == ["quick", "stuck"]  # nothing ran twice


def test_a_second_sigterm_forces(
    tmp_path: Path, control: str, services: list[ServeProcess]
) -> None:
    ledger = tmp_path / "ledger"
    s = start_tools(services, control, ledger, "--workers", "1", "--drain-grace", "60")
    s.wait_serving()

    def during(calls: list[Any]) -> None:
        _wait_started(ledger, {"stuck"})
        s.note_descendants()
        s.signal(signal.SIGTERM)
        s.wait_event("draining")
        s.signal(signal.SIGTERM)
        s.wait_event("forced")

    started = time.monotonic()
    (stuck,) = _calls(s.url("/mcp"), [("stubborn", {"id": "stuck"})], during=during)
    assert stuck.outcome is Outcome.KILLED
    assert stuck.rung.value == "sigkill"
    assert time.monotonic() - started < 50  # not the 60 s drain grace
    assert s.wait(60) == 0
    assert s.alive_descendants() == []


def test_sighup_reload_under_load_loses_nothing_and_runs_nothing_twice(
    tmp_path: Path, control: str, services: list[ServeProcess]
) -> None:
    ledger = tmp_path / "ledger"
    s = start_tools(services, control, ledger, "--workers", "2")
    s.wait_serving()
    ids = [f"c{i}" for i in range(150)]

    def during(calls: list[Any]) -> None:
        _wait_started(ledger, {"c10"})
        s.signal(signal.SIGHUP)
        s.wait_event("reloaded", generation=2)

    results = _calls(
        s.url("/mcp"), [("work", {"id": i, "seconds": 0.02}) for i in ids], during=during
    )
    assert [r.outcome for r in results] == [Outcome.OK] * len(ids)
    assert [r.value for r in results] == ids
    starts = [line[1] for line in _ledger(ledger) if line[0] == "start"]
    assert sorted(starts) == sorted(ids)  # each exactly once
    pids = {line[2] for line in _ledger(ledger) if line[0] == "start"}
    assert len(pids) > 2  # both generations served
    stop_and_check(s)


def test_as_pid_1_sigterm_drains_running_calls(
    tmp_path: Path, control: str, services: list[ServeProcess]
) -> None:
    ledger = tmp_path / "ledger"
    argv = [
        *_unshare(),
        sys.executable,
        "-m",
        "toolpool",
        "serve",
        "serve_tools:registry",
        "--workers",
        "2",
        "--drain-grace",
        "2",
        "--cancel-grace",
        "1",
        "--term-grace",
        "1",
        "--http",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--control",
        control,
    ]
    s = start(services, control, argv=argv, env=serve_env(TOOLPOOL_TEST_LEDGER=str(ledger)))
    s.wait_serving()
    init = psutil.Process(s.proc.pid).children()[0]

    def during(calls: list[Any]) -> None:
        _wait_started(ledger, {"quick", "stuck"})
        s.note_descendants()
        init.send_signal(signal.SIGTERM)  # what a container runtime does to PID 1
        s.wait_event("draining")

    quick, stuck = _calls(
        s.url("/mcp"),
        [("work", {"id": "quick", "seconds": 0.5}), ("stubborn", {"id": "stuck"})],
        during=during,
    )
    assert quick.outcome is Outcome.OK
    assert stuck.outcome is Outcome.KILLED
    assert s.wait(60) == 0
    assert s.alive_descendants() == []


def test_drain_over_the_control_socket_with_a_timeout_of_its_own(
    tmp_path: Path, control: str, services: list[ServeProcess]
) -> None:
    """``toolpool drain --wait --timeout 0``: the running call gets no grace (the service's
    is 60 s), is cancelled at once and killed by the ladder; the command returns once the
    service stopped."""
    ledger = tmp_path / "ledger"
    s = start_tools(
        services,
        control,
        ledger,
        "--autoscale",
        "1:2",
        "--drain-grace",
        "60",
        "--cancel-grace",
        "1",
        "--term-grace",
        "1",
    )
    s.wait_serving()
    status = json.loads(toolpool("status", "--json", control=control).stdout)
    assert status["providers"]["default"]["autoscale"] == [1, 2]
    assert status["providers"]["default"]["size"] == 1
    drained: list[subprocess.CompletedProcess[str]] = []

    def during(calls: list[Any]) -> None:
        _wait_started(ledger, {"stuck"})
        s.note_descendants()
        drained.append(toolpool("drain", "--wait", "--timeout", "0", control=control))

    started = time.monotonic()
    (stuck,) = _calls(s.url("/mcp"), [("stubborn", {"id": "stuck"})], during=during)
    assert drained[0].returncode == 0, drained[0].stderr
    assert drained[0].stdout.strip() == "stopped"
    assert stuck.outcome is Outcome.KILLED
    assert stuck.body_started is True
    assert time.monotonic() - started < 40  # not the 60 s drain grace
    assert s.wait(30) == 0
    assert s.alive_descendants() == []
    assert s.wait_event("draining")["drain_grace_s"] == 0


# ---------------------------------------------------------------------------- remote cancel


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_remote_cancel_reports_how_the_call_ended(
    tmp_path: Path, control: str, services: list[ServeProcess]
) -> None:
    """``client.cancel(call)`` travels as ``notifications/cancelled``; the face cancels with
    cause ``user`` and answers once the call settled: a cooperative tool is ``aborted``, one
    that ignores its signal (and a child that ignores SIGTERM) is ``killed``, reported only
    once its whole tree is gone."""
    ledger = tmp_path / "ledger"
    s = start_tools(
        services, control, ledger, "--workers", "2", "--cancel-grace", "0.5", "--term-grace", "0.5"
    )
    s.wait_serving()
    gone_at_answer: list[bool] = []

    async def main() -> tuple[Any, Any]:
        async with connect(s.url("/mcp")) as client:
            co = client.submit("cooperative", {"id": "co"})
            st = client.submit("stubborn_tree", {"id": "st"})
            await anyio.to_thread.run_sync(_wait_started, ledger, {"co", "st"})
            aborted = await client.cancel(co)
            killed = await client.cancel(st)
            _, _, worker, child = next(line for line in _ledger(ledger) if line[0] == "tree")
            gone_at_answer.extend([_gone(int(worker)), _gone(int(child))])
            return aborted, killed

    aborted, killed = anyio.run(main)
    assert aborted.outcome is Outcome.ABORTED, aborted
    assert aborted.cause == {"kind": "user"}
    assert aborted.body_started is True
    assert killed.outcome is Outcome.KILLED, killed
    assert killed.cause == {"kind": "user"}
    assert killed.body_started is True
    assert killed.rung.value in ("sigterm", "sigkill")  # (the ladder, past the cancel)
    assert gone_at_answer == [True, True]  # the worker and its child, before the answer
    settled = {line["call_id"]: line for line in s.lines if "outcome" in line}
    assert sorted(line["outcome"] for line in settled.values()) == ["aborted", "killed"]
    assert all(line["delivered"] for line in settled.values())
    stop_and_check(s)


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_a_call_answered_ok_is_logged_only_at_debug(level: int) -> None:
    """The face's line of a call that settled ``ok`` and was answered is not a lifecycle
    fact: at info it is not written; other outcomes and undelivered results are."""
    stream = io.StringIO()
    root = logging.getLogger("toolpool")
    saved = root.level, root.propagate
    handler = configure_logging("json", level=level, stream=stream)
    face = logging.getLogger("toolpool.mcp")
    try:
        for outcome, delivered in [("ok", True), ("aborted", True), ("ok", False)]:
            face.log(
                logging.INFO if delivered else logging.WARNING,
                "mcp call settled %s",
                outcome,
                extra={"outcome": outcome, "delivered": delivered},
            )
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        root.propagate = saved[1]
    written = [
        (line["outcome"], line["delivered"])
        for line in map(json.loads, stream.getvalue().splitlines())
    ]
    expected = [("aborted", True), ("ok", False)]
    assert written == ([("ok", True), *expected] if level == logging.DEBUG else expected)
