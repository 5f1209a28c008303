"""The reaper's messages (``docs/protocol.md`` §9): typed, and checked as strictly as a
worker's. With real processes: a reaper whose reports break the protocol fails the pool's
start clearly, and the pool still closes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toolpool
from pool_support import TOOLS, workers_of_reaper
from toolpool.protocol import (
    ByeReport,
    CleanCommand,
    CleanedReport,
    CleanupDoneReport,
    CleanupPendingReport,
    ExitCommand,
    ExitedReport,
    ForkUnavailableReport,
    GoneReport,
    KillCommand,
    LostReport,
    OwnCommand,
    PreloadCommand,
    PreloadedReport,
    ProtocolViolation,
    ReadyReport,
    SignalCommand,
    SpawnCommand,
    SpawnedReport,
    SpawnFailedReport,
    StuckReport,
    _reaper,
    decode_command,
    decode_report,
    encode_reaper,
)

pytestmark = pytest.mark.timeout(60)

COMMANDS: list[Any] = [
    SpawnCommand(
        3,
        (sys.executable, "-m", "toolpool.worker", "--endpoint", "ipc:///tmp/x/w3/s"),
        {"PATH": "/usr/bin", "PYTHONPATH": "/src"},
        "c2VjcmV0\n",
        "inherit",
        "/tmp/x/scratch3",
        "/sys/fs/cgroup/toolpool/w3",
        ("/sys/fs/cgroup/toolpool/w3",),
        ("/tmp/x/w3", "/tmp/x/scratch3"),
        "fork",
    ),
    SpawnCommand(0, ("/bin/true",), None, ""),
    SignalCommand(7, 15),
    KillCommand(7),
    CleanCommand(2**63 - 1),
    PreloadCommand(("/src", "")),
    OwnCommand(("/tmp/toolpool-x", "/sys/fs/cgroup/toolpool-x")),
    OwnCommand(()),
    ExitCommand(2.0, 0.5),
    ExitCommand(0.0, 0.0),
]
REPORTS: list[Any] = [
    ReadyReport(1234, True),
    SpawnedReport(1, 4321, "fork"),
    SpawnedReport(2, 4322, "spawn"),
    ForkUnavailableReport(1, "the reaper has 2 threads"),
    SpawnFailedReport(1, "FileNotFoundError: [Errno 2] No such file or directory: 'x'"),
    ExitedReport(1, 4321, -9, 1),
    ExitedReport(1, 4321, 70, 0),
    GoneReport(1),
    GoneReport(1, 4321, 0, 0),
    GoneReport(1, removing=("/tmp/toolpool-x/w1", "/tmp/toolpool-x/scratch-w1")),
    StuckReport(1, (99, 100)),
    StuckReport(1),
    CleanedReport(4, 2),
    PreloadedReport(),
    PreloadedReport("ImportError: no toolpool here"),
    CleanupPendingReport(4, "/tmp/x/scratch4", 1000),
    CleanupPendingReport(None, "/tmp/x", 0),
    CleanupDoneReport(4, "/tmp/x/scratch4", 5000, True),
    CleanupDoneReport(None, "/tmp/x", 3, False, "/tmp/x/mnt: a mount point, not removed"),
    ByeReport(),
    ByeReport(("/tmp/x",), ("/tmp/x/y: Permission denied",), (4444,)),
]


# --------------------------------------------------------------------------- the codec


def test_the_examples_cover_every_kind_and_the_checks_every_field() -> None:
    assert {type(m).TYPE for m in COMMANDS} == set(_reaper._COMMANDS)
    assert {type(m).TYPE for m in REPORTS} == set(_reaper._REPORTS)
    for kind, (cls, checks) in {**_reaper._COMMANDS, **_reaper._REPORTS}.items():
        assert kind == cls.TYPE
        assert tuple(checks) == cls.FIELDS  # (the wire's order is the constructor's)


def test_messages_are_frozen_and_compare_by_kind_and_fields() -> None:
    kill = KillCommand(3)
    with pytest.raises(AttributeError, match="frozen"):
        kill.wid = 4  # type: ignore[misc]
    with pytest.raises(AttributeError, match="frozen"):
        del kill.wid
    assert kill == KillCommand(3)
    assert hash(kill) == hash(KillCommand(3))
    assert kill != CleanCommand(3)
    assert kill != KillCommand(4)
    assert repr(GoneReport(1)) == (
        "GoneReport(wid=1, pid=None, status=None, oom_kills=None, removing=())"
    )
    assert not hasattr(kill, "__dict__")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda m: type(m).TYPE)
def test_every_command_round_trips(command: Any) -> None:
    frame = encode_reaper(command)
    assert json.loads(frame)["op"] == command.TYPE
    assert decode_command(frame) == command
    with pytest.raises(ProtocolViolation, match="names its kind in 'ev'"):
        decode_report(frame)  # (a command is no report)


@pytest.mark.parametrize("report", REPORTS, ids=lambda m: type(m).TYPE)
def test_every_report_round_trips(report: Any) -> None:
    frame = encode_reaper(report)
    assert json.loads(frame)["ev"] == report.TYPE
    assert decode_report(frame) == report
    with pytest.raises(ProtocolViolation, match="names its kind in 'op'"):
        decode_command(frame)


def test_a_gone_report_carries_its_exit_whole_or_not_at_all() -> None:
    assert GoneReport(1, 4321, -9, 0).exit == ExitedReport(1, 4321, -9, 0)
    assert GoneReport(1).exit is None
    frame = encode_reaper(GoneReport(1, 4321, None, 0))
    with pytest.raises(ProtocolViolation, match="all three or none"):
        decode_report(frame)


def test_lost_is_the_clients_own_never_on_the_wire() -> None:
    with pytest.raises(TypeError):
        encode_reaper(LostReport("why"))
    with pytest.raises(ProtocolViolation, match="unknown ev 'lost'"):
        decode_report(b'{"ev":"lost","error":null}')


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (b'{"ev":"exploded","wid":1}', "unknown ev 'exploded'"),
        (b'{"op":"reboot"}', "names its kind"),
        (b'{"ev":1}', "names its kind"),
        (b'["ev","ready"]', "a JSON object"),
        (b'{"ev":"ready","pid":5}', "missing subreaper"),
        (b'{"ev":"ready","pid":5,"subreaper":true,"extra":1}', "unknown extra"),
        (b'{"ev":"ready","pid":5.0,"subreaper":true}', "pid must be a process id"),
        (b'{"ev":"ready","pid":true,"subreaper":true}', "pid must be a process id"),
        (b'{"ev":"ready","pid":0,"subreaper":true}', "pid must be a process id"),
        (b'{"ev":"ready","pid":5,"subreaper":1}', "subreaper must be a boolean"),
        (b'{"ev":"spawned","wid":-1,"pid":5,"method":"spawn"}', "wid must be a non-negative"),
        (b'{"ev":"spawned","wid":1,"pid":5,"method":"clone"}', "method must be one of"),
        (b'{"ev":"exited","wid":1,"pid":5,"status":999,"oom_kills":0}', "exit status"),
        (b'{"ev":"stuck","wid":1,"pids":[1,"2"]}', "an item of pids"),
        (b'{"ev":"cleaned","wid":1,"count":NaN}', "NaN"),
        (
            b'{"ev":"bye","unfinished":[],"failed":[],"unkillable":{}}',
            "unkillable must be an array",
        ),
        (b"\xff\xfe", "undecodable"),
        (b"", "undecodable"),
        (b"[" * 100_000, "undecodable"),
        (b'{"ev":"ready","pid":' + b"9" * 5000 + b',"subreaper":true}', "undecodable"),
    ],
)
def test_malformed_reports_are_refused(frame: bytes, why: str) -> None:
    with pytest.raises(ProtocolViolation, match=why):
        decode_report(frame)


@pytest.mark.parametrize(
    ("command", "why"),
    [
        (
            {
                "op": "spawn",
                "wid": 1,
                "argv": [],
                "env": None,
                "stdin": "",
                "output": "discard",
                "cwd": None,
                "cgroup": None,
                "groups": [],
                "cleanup": [],
                "start": "spawn",
            },
            "argv must be an array of at least 1",
        ),
        (
            {
                "op": "spawn",
                "wid": 1,
                "argv": ["x"],
                "env": {"A": 1},
                "stdin": "",
                "output": "discard",
                "cwd": None,
                "cgroup": None,
                "groups": [],
                "cleanup": [],
                "start": "spawn",
            },
            "env must map names to strings",
        ),
        (
            {
                "op": "spawn",
                "wid": 1,
                "argv": ["x"],
                "env": None,
                "stdin": "",
                "output": "tee",
                "cwd": None,
                "cgroup": None,
                "groups": [],
                "cleanup": [],
                "start": "spawn",
            },
            "output must be one of",
        ),
        ({"op": "signal", "wid": 1, "sig": 0}, "sig must be a signal number"),
        ({"op": "kill"}, "missing wid"),
        ({"op": "kill", "wid": 1, "now": True}, "unknown now"),
        ({"op": "own", "paths": "/tmp/x"}, "paths must be an array"),
        ({"op": "exit", "cleanup_budget": -1, "kill_wait": 2.0}, "cleanup_budget must be"),
        ({"op": "exit", "cleanup_budget": 2.0}, "missing kill_wait"),
        ({"op": "preload", "paths": [None]}, "an item of paths"),
    ],
)
def test_malformed_commands_are_refused(command: dict[str, Any], why: str) -> None:
    with pytest.raises(ProtocolViolation, match=why):
        decode_command(json.dumps(command).encode())


def test_exit_accepts_whole_seconds() -> None:
    assert decode_command(b'{"op":"exit","cleanup_budget":2,"kill_wait":0}') == ExitCommand(
        2.0, 0.0
    )


# --------------------------------------------------------------------------- garbling

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_GARBLE = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


def _decoded_or_violation(decode: Any, frame: bytes, kinds: tuple[type, ...]) -> None:
    """``frame`` decodes to a message of ``kinds`` that encodes back to what it says, or it
    raises ProtocolViolation: never another exception."""
    try:
        message = decode(frame)
    except ProtocolViolation:
        return
    assert isinstance(message, kinds)
    assert decode(encode_reaper(message)) == message


_COMMAND_KINDS = tuple(cls for cls, _ in _reaper._COMMANDS.values())
_REPORT_KINDS = tuple(cls for cls, _ in _reaper._REPORTS.values())


@_GARBLE
@given(st.binary(max_size=200))
def test_random_bytes_are_refused_with_a_violation(frame: bytes) -> None:
    _decoded_or_violation(decode_command, frame, _COMMAND_KINDS)
    _decoded_or_violation(decode_report, frame, _REPORT_KINDS)


@_GARBLE
@given(st.data())
def test_a_garbled_field_is_a_violation_or_a_valid_message(data: st.DataObject) -> None:
    message = data.draw(st.sampled_from(COMMANDS + REPORTS))
    obj = json.loads(encode_reaper(message))
    action = data.draw(st.sampled_from(["replace", "drop", "add", "rekind"]))
    keys = sorted(obj)
    if action == "replace":
        obj[data.draw(st.sampled_from(keys))] = data.draw(_JSON)
    elif action == "drop":
        del obj[data.draw(st.sampled_from(keys))]
    elif action == "add":
        obj[data.draw(st.text(max_size=12))] = data.draw(_JSON)
    else:
        obj = data.draw(st.one_of(_JSON, st.lists(_JSON, max_size=3)))
    frame = json.dumps(obj).encode()
    _decoded_or_violation(decode_command, frame, _COMMAND_KINDS)
    _decoded_or_violation(decode_report, frame, _REPORT_KINDS)


@_GARBLE
@given(st.data())
def test_garbled_bytes_of_a_frame_are_a_violation_or_a_valid_message(data: st.DataObject) -> None:
    message = data.draw(st.sampled_from(COMMANDS + REPORTS))
    frame = bytearray(encode_reaper(message))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(frame) - 1))
        how = data.draw(st.sampled_from(["flip", "drop", "insert"]))
        if how == "flip":
            frame[at] = data.draw(st.integers(0, 255))
        elif how == "drop" and len(frame) > 1:
            del frame[at]
        else:
            frame.insert(at, data.draw(st.integers(0, 255)))
    _decoded_or_violation(decode_command, bytes(frame), _COMMAND_KINDS)
    _decoded_or_violation(decode_report, bytes(frame), _REPORT_KINDS)


# --------------------------------------------------------------------------- the reaper's start


def test_the_reaper_imports_neither_toolpool_nor_msgpack_nor_asyncio() -> None:
    """The reaper's start (issue 26): its script loads the reaper's messages by path, under a
    stand-in package, and nothing of toolpool's packages (the supervisor, protocol's
    ``__init__`` and its msgpack), nor asyncio. Seen in ``sys.modules`` of the real script,
    run up to its parent check (which a wrong supervisor pid fails, ending it)."""
    from toolpool.reaper import SCRIPT, reaper_env

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: sys.stdout.write(' '.join(sorted(sys.modules))))\n"
        f"sys.argv = [{str(SCRIPT)!r}, '1', '{theirs.fileno()}']\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    with ours, theirs:
        done = subprocess.run(
            [sys.executable, "-P", "-c", code],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            env=reaper_env(),
            check=False,
        )
    assert done.returncode == 1, done.stderr  # (its parent is not pid 1)
    imported = set(done.stdout.split())
    assert {"_toolpool_protocol._reaper", "_toolpool_protocol._checks"} <= imported
    heavy = ("toolpool", "asyncio", "msgpack", "anyio", "zmq", "psutil")
    assert sorted(m for m in imported if m.split(".")[0] in heavy) == []


# --------------------------------------------------------------------------- real processes


def _garbling_reaper(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mark: str,
    garbage: bytes,
    *,
    once: bool = False,
) -> None:
    """From now on the pool's reaper is the real one, but any report it sends that holds
    ``mark`` (its encoded bytes) is sent as ``garbage`` instead (``once``: the first such
    report of any of the pool's reapers, no other)."""
    from toolpool.reaper import _ahead

    script = tmp_path / "garbling_reaper.py"
    flag = tmp_path / "garbled"
    script.write_text(
        "import os, runpy, socket\n"
        "real_send = socket.socket.send\n"
        "def send(self, data, *args):\n"
        f"    if {mark.encode()!r} in data and not os.path.exists({str(flag)!r}):\n"
        f"        data = {garbage!r}\n"
        f"        if {once!r}:\n"
        f"            open({str(flag)!r}, 'w').close()\n"
        "    return real_send(self, data, *args)\n"
        "socket.socket.send = send\n"
        f"runpy.run_path({str(_ahead.SCRIPT)!r}, run_name='__main__')\n"
    )
    monkeypatch.setattr(_ahead, "SCRIPT", script)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "garbage",
    [b"\xff{not json", b'{"ev": "spawned", "wid": "1", "pid": 2, "method": "spawn"}'],
    ids=["undecodable", "mistyped"],
)
async def test_a_malformed_spawned_report_fails_the_start_and_the_pool_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, garbage: bytes
) -> None:
    """The reaper that sent it is killed (its workers die with it) and the start fails,
    saying why; closing the pool then returns (it hung: its state stayed "closing")."""
    _garbling_reaper(tmp_path, monkeypatch, '"spawned"', garbage)
    pool = toolpool.Pool(TOOLS, workers=1)
    error: BaseException | None = None
    with anyio.fail_after(30):
        try:
            await pool.start()
        except BaseException as exc:  # (checked once the pool is closed)
            error = exc
        reaper = pool.reaper_pid
        await pool.aclose()
    assert repr(pool).endswith("closed>")
    assert isinstance(error, toolpool.WorkerStartError), repr(error)
    assert "the pool's reaper process sent a malformed report" in str(error), error
    assert reaper is not None
    assert not psutil.pid_exists(reaper)
    assert workers_of_reaper(reaper) == []


@pytest.mark.anyio
async def test_a_malformed_ready_report_fails_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    garbage = b'{"ev": "ready", "pid": -1, "subreaper": 1}'
    _garbling_reaper(tmp_path, monkeypatch, '"ready"', garbage)
    pool = toolpool.Pool(TOOLS, workers=1)
    with anyio.fail_after(30):
        with pytest.raises(toolpool.WorkerStartError, match="malformed report: pid must be"):
            await pool.start()
        await pool.aclose()
    assert repr(pool).endswith("closed>")


@pytest.mark.anyio
async def test_a_malformed_report_after_the_start_replaces_the_reaper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A running pool's reaper that sends a malformed report is killed and replaced, as a
    reaper that died: the worker whose report it was is ended, and the pool serves on."""
    garbage = b'{"ev": "gone", "wid": 1, "pid": 2, "status": null, "oom_kills": 0}'
    _garbling_reaper(tmp_path, monkeypatch, '"gone"', garbage, once=True)
    async with toolpool.Pool(TOOLS, workers=1) as pool:
        first = pool.reaper_pid
        assert first is not None
        (worker,) = pool.worker_pids
        psutil.Process(worker).kill()  # its reaper reports it gone: garbled
        with anyio.fail_after(40):
            while pool.reaper_pid in (None, first) or not pool.worker_pids:
                await pool._wait_changed()
            result = await pool.call("pid")
        assert result.ok, result
        assert result.value != worker
    assert not psutil.pid_exists(first)
    assert workers_of_reaper(first) == []
    assert "the pool's reaper process sent a malformed report: 'gone'" in caplog.text


@pytest.mark.anyio
async def test_a_malformed_command_ends_the_reaper_without_a_bye() -> None:
    """The supervisor's side broke the protocol: the reaper kills its trees and exits (status
    2) without a ``bye``, keeping the pool's directories; its client reports it lost."""
    from toolpool.reaper import ReaperClient

    reports: list[Any] = []
    client = ReaperClient(reports.append)
    with anyio.fail_after(30):
        await client.start(10)
        assert client._sock is not None
        proc = client._proc
        assert proc is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run)
            client._sock.send(b'{"op":"kill","wid":"1"}')
        await client.aclose()
    assert reports == [LostReport()]
    assert proc.returncode == 2
