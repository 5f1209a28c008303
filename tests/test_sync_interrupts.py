"""Ctrl-C in a script that uses a ``SyncPool`` (or an ``Executor``, built on it): a real
SIGINT to a real subprocess. The first says on one line what the close waits for, a second
kills the calls at once; the script ends with one KeyboardInterrupt traceback, not two, and
leaves no process behind."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

TESTS = str(Path(__file__).parent)

pytestmark = pytest.mark.timeout(120)

# Two calls that ignore SIGTERM and sleep (map_tools' "stubborn"), graces of 600 s: only the
# second Ctrl-C can end them in time. ``LEAVE`` is how the script leaves the ``with`` block.
SCRIPT = """
import sys, time, toolpool
with toolpool.SyncPool("map_tools:registry", workers=2, cancel_grace=600, term_grace=600) as pool:
    calls = [pool.submit("varied", {"kind": "stubborn"}) for _ in range(2)]
    while not all(c._call.started for c in calls):  # (a test's peek: both bodies run)
        time.sleep(0.01)
    print(*pool._pool.worker_pids, flush=True)
    if LEAVE == "waiting":
        calls[0].result()  # the first Ctrl-C lands here, in the script's own code
    print("closing", flush=True)
"""


def _popen(code: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, *sys.path])}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _start(code: str) -> tuple[subprocess.Popen[str], list[int]]:
    """Run ``code``; the worker pids its first line of output names."""
    proc = _popen(code)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(proc.communicate(timeout=30)[1])
    return proc, [int(pid) for pid in line.split()]


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=30)


def _stderr_line(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], timeout)
    assert ready, "no line on stderr in time"
    return proc.stderr.readline()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("leave", ["waiting", "closing"])
def test_a_second_ctrl_c_kills_at_once_and_one_traceback_ends_the_script(leave: str) -> None:
    """``waiting``: the first Ctrl-C interrupts the script's ``result()``, and the close
    that leaving ``with`` begins says what it waits for. ``closing``: the script left
    ``with`` normally, and the first Ctrl-C reaches the close itself."""
    proc, workers = _start(f"LEAVE = {leave!r}\n" + textwrap.dedent(SCRIPT))
    try:
        if leave == "closing":
            assert proc.stdout is not None
            assert proc.stdout.readline() == "closing\n"  # (and the close begins)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        first = _stderr_line(proc)
        assert first == (
            "toolpool: interrupted: closing the pool, waiting for 2 calls (2 running, 0 "
            "queued). Its calls are cancelled; one that does not stop within 600s gets "
            "SIGTERM, then SIGKILL 600s later. Ctrl-C again to kill them now.\n"
        ), first
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert time.monotonic() - started < 60  # far below the 600 s graces
    lines = err.strip().splitlines()
    assert lines[0] == "toolpool: interrupted again: killing 2 calls now (SIGKILL)", err
    assert lines[1] == (
        "toolpool: stopped: every call settled and every process of the pool is gone"
    )
    assert err.count("Traceback (most recent call last)") == 1, err
    assert lines.count("KeyboardInterrupt") == 1, err
    assert "During handling of the above exception" not in err
    assert lines[-1] == "KeyboardInterrupt"
    assert proc.returncode in (-signal.SIGINT, 130, 1)
    for pid in workers:
        assert _gone(pid)


def test_one_ctrl_c_lets_the_close_finish_by_the_graces() -> None:
    """Without a second Ctrl-C the calls get their graces: here short ones, SIGTERM is
    ignored, SIGKILL ends them."""
    script = SCRIPT.replace("cancel_grace=600, term_grace=600", "cancel_grace=0.2, term_grace=0.2")
    proc, workers = _start("LEAVE = 'waiting'\n" + textwrap.dedent(script))
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        _end(proc)
    lines = err.strip().splitlines()
    assert "within 0.2s gets SIGTERM, then SIGKILL 0.2s later" in lines[0]
    assert lines[1].startswith("toolpool: stopped: every call settled")
    assert err.count("Traceback (most recent call last)") == 1, err
    assert lines[-1] == "KeyboardInterrupt"
    for pid in workers:
        assert _gone(pid)


EXECUTOR_SCRIPT = """
import os, sys, time, toolpool, executor_funcs
with toolpool.Executor(2, cancel_grace=600, term_grace=600) as ex:
    paths = [os.path.join(DIR, str(i)) for i in range(2)]
    fs = [ex.submit(executor_funcs.started_then_sleep, path, 600) for path in paths]
    while not all(os.path.exists(path) for path in paths):
        time.sleep(0.01)
    print(*ex._sync._pool.worker_pids, flush=True)
    AFTER_START()
# (leaving the with block: shutdown(wait=True) waits for the calls)
"""


def test_ctrl_c_while_an_executor_waits_at_shutdown(tmp_path: Path) -> None:
    _interrupt_executor(f"DIR = {str(tmp_path)!r}\nAFTER_START = lambda: None\n", first=True)


def _interrupt_executor(prelude: str, *, first: bool) -> None:
    """Run ``EXECUTOR_SCRIPT`` after ``prelude``: Ctrl-C (``first``; else the script sends
    its own), which says what the close waits for, then Ctrl-C again, which kills."""
    proc, workers = _start(prelude + textwrap.dedent(EXECUTOR_SCRIPT))
    try:
        if first:
            proc.send_signal(signal.SIGINT)
        line = _stderr_line(proc)
        assert line.startswith(
            "toolpool: interrupted: closing the pool, waiting for 2 calls (2 running, 0 queued)."
        ), line + proc.communicate(timeout=60)[1]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        _end(proc)
    lines = err.strip().splitlines()
    assert lines[0] == "toolpool: interrupted again: killing 2 calls now (SIGKILL)", err
    assert lines[1].startswith("toolpool: stopped: every call settled"), err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert lines.count("KeyboardInterrupt") == 1, err
    assert lines[-1] == "KeyboardInterrupt", err
    assert proc.returncode in (-signal.SIGINT, 130, 1)
    for pid in workers:
        assert _gone(pid)


# Ctrl-C at the worst moment: while the main thread holds the lock of a future the loop's
# thread completes (``concurrent.futures`` takes them one by one). A KeyboardInterrupt raised
# there left it held, and the loop's thread waited on it for ever. A trace function sends the
# SIGINT at the first line the main thread runs holding one (and notes it; if none ever
# does, a thread sends the SIGINT 5 s after the with block is left, and the test fails).
HELD_LOCK_PRELUDE = """
import os, signal, sys, threading, time
sent = threading.Event()

def send() -> None:
    if not sent.is_set():
        sent.set()
        os.kill(os.getpid(), signal.SIGINT)

def tracer(frame, event, arg):
    if sent.is_set():
        sys.settrace(None)
        return None
    if any(f._condition._is_owned() for f in fs):
        with open(os.path.join(DIR, "held"), "w") as f:
            f.write(frame.f_code.co_name)
        send()
    return tracer

def fallback() -> None:
    time.sleep(5)
    send()

def AFTER_START() -> None:
    threading.Thread(target=fallback, daemon=True).start()
    sys.settrace(tracer)
"""


def test_ctrl_c_while_the_main_thread_holds_a_futures_lock(tmp_path: Path) -> None:
    _interrupt_executor(f"DIR = {str(tmp_path)!r}\n" + HELD_LOCK_PRELUDE, first=False)
    # (The premise: the SIGINT came while the main thread held a future's lock, not late.)
    assert (tmp_path / "held").exists(), "the main thread never held a future's lock"
