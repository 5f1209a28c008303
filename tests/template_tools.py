"""Test-only tools that describe the worker process they run in (pre-forked template tests).

Loaded by real worker processes as ``template_tools:registry`` (the tests directory reaches the
workers through ``PYTHONPATH``). What the module records at import time shows the worker's
set-up was done before the tools module was imported, in the worker itself.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading

from toolpool import Registry

PR_GET_PDEATHSIG = 2


def _pdeathsig() -> int:
    import ctypes

    value = ctypes.c_int(-1)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


def _status() -> dict[str, str]:
    with open("/proc/self/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


#: Facts at import time: the process that imported the module, and its set-up then.
AT_IMPORT = {
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "pdeathsig": _pdeathsig(),
    "netns": os.readlink("/proc/self/ns/net"),
    "no_new_privs": _status().get("NoNewPrivs"),
    "threads": threading.active_count(),
    "has_zmq_context": "zmq" in sys.modules,
}

registry = Registry()


@registry.tool
def at_import() -> dict[str, object]:
    """What the module recorded when it was imported, and who runs it now."""
    return {**AT_IMPORT, "now_pid": os.getpid()}


@registry.tool
async def process_state() -> dict[str, object]:
    """What a tool can see of its process: to compare forked and spawned workers.

    Async, so it runs on the worker's main thread (PDEATHSIG is a per-thread setting)."""
    status = _status()
    cwd = os.getcwd()

    def scrub(value: str) -> str:
        return value.replace(cwd, "<cwd>")

    dispositions = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = signal.getsignal(sig)
        name = handler.name if isinstance(handler, signal.Handlers) else None
        dispositions[str(int(sig))] = name or getattr(handler, "__name__", "?")
    return {
        "environ": {k: scrub(v) for k, v in os.environ.items()},
        "path": [scrub(p) for p in sys.path],
        "argv_rest": sys.argv[1:],
        "tempdir": scrub(tempfile.gettempdir()),
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(),
        "dispositions": dispositions,
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "sig_status": {k: status[k] for k in ("SigBlk", "SigIgn", "SigCgt", "NoNewPrivs")},
        "stdio": [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)],
        "main_module": sorted(k for k in vars(sys.modules["__main__"]) if not k.startswith("__")),
        "reaper_helpers": sorted(k for k in sys.modules if k.startswith("_toolpool")),
        "pdeathsig": _pdeathsig(),
        "umask": os.umask(os.umask(0o22)),
    }
