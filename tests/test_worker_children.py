"""The worker's check for child processes (``_server._has_children``): libc's ``waitid``
through ctypes, its errno kept by ctypes: ECHILD is no child, another error raises as
``os.waitid`` would. Each check runs in a fresh interpreter (pytest's own process may have
children of other tests)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PRELUDE = """
import ctypes, errno, os, subprocess, sys, threading
from toolpool.worker import _server

def child():  # a child that waits for its stdin to close: no timing
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)

def on_a_thread():
    answers = []
    thread = threading.Thread(target=lambda: answers.append(_server._has_children()))
    thread.start()
    thread.join()
    return answers[0]
"""


def _check(script: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_a_child_alive_or_zombie_is_seen_and_none_after_it_is_reaped() -> None:
    _check(
        """
        assert _server._has_children() is False
        assert on_a_thread() is False
        c = child()
        assert _server._has_children() is True  # alive
        assert on_a_thread() is True
        c.stdin.close()
        os.waitid(os.P_PID, c.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert _server._has_children() is True  # a zombie is a child (WNOWAIT: left so)
        c.wait()
        assert _server._has_children() is False
        assert on_a_thread() is False
        """
    )


def test_an_error_but_echild_raises_as_os_waitid_would() -> None:
    _check(
        """
        def fails(*args):
            ctypes.set_errno(errno.EINVAL)  # (what ctypes keeps for use_errno)
            return -1

        _server._waitid = fails
        try:
            _server._has_children()
        except OSError as raised:
            assert raised.errno == errno.EINVAL
        else:
            raise AssertionError("no OSError")
        """
    )
