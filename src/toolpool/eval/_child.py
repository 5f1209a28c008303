"""The jailed side of ``toolpool eval``: the zygote and the child it forks, stdlib only.

This module is not imported by toolpool's own processes for its work; the worker starts the
zygote as ``python -I -S -c BOOT`` (see ``_zygote.py``), which loads this file, ``_wire.py``
and the sandbox's ``_landlock.py``/``_linux.py`` by path (no ``toolpool`` package, no
site-packages), imports the modules completions commonly use, and then waits for requests on
a unix socket from its worker. For each request it forks a child, which:

1. leaves the zygote's socket and session behind (``setsid``), asks for SIGKILL should the
   zygote die, and changes to its empty scratch directory;
2. confines itself for good: rlimits (address space, CPU seconds, file size, open files, no
   core dumps) and Landlock (it may read only the standard library and the system's shared
   libraries, write only its directory, make no TCP connection; ABI 6+: signal no process and
   reach no abstract socket outside). It has no capabilities and no new privileges already:
   the zygote dropped them for itself once, at its start, and every fork inherits that;
3. reports what it did on its reply pipe; only then does the worker send the source (the
   problem's prompt and the completion) and the name of the function;
4. answers one call per request line, ``{"n", "args", "kwargs"}``, with ``{"n", "value"}``,
   ``{"n", "raised", "message"}`` or ``{"n", "not_data"}`` (values tagged, see ``_wire.py``).

Nothing the child sends is trusted: once the completion runs it owns the process. The worker
reads only data from it and decides the verdict itself.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import resource
import signal
import socket
import sysconfig
from collections.abc import Callable
from typing import Any

from . import _wire

__all__ = ("PRELOAD", "readable_dirs", "zygote")

#: What the zygote imports once, so that a completion importing them costs nothing: what
#: HumanEval's prompts and solutions import most (``typing`` above all). Each module makes
#: every fork dearer (a larger address space to copy and tear down: measured, 0.5 ms of CPU
#: per child with twice as many modules, 0.2 ms with these), so the rare ones are left to an
#: import from disk.
PRELOAD = (
    "bisect",
    "collections",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "re",
    "string",
    "typing",
)
_CAPSET = {"x86_64": 126, "aarch64": 91}
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def readable_dirs() -> list[str]:
    """What the child may read: the standard library (with its extension modules) and the
    system's shared libraries. The same in every process of one interpreter, so the driver
    can check that the problems file is not among them."""
    stdlib = sysconfig.get_path("stdlib")
    found: list[str] = []
    candidates = [
        stdlib,
        sysconfig.get_path("platstdlib"),
        os.path.join(stdlib, "lib-dynload"),
        "/lib",
        "/lib64",
        "/usr/lib",
        "/usr/lib64",
    ]
    for path in candidates:
        real = os.path.realpath(path)
        if os.path.isdir(real) and not any(_beneath(real, f) for f in found):
            found = [f for f in found if not _beneath(f, real)] + [real]
    return found


def _beneath(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _landlock_module() -> Any:
    package = __name__.rsplit(".", 2)[0]  # "toolpool", or the zygote's stand-in
    return importlib.import_module(f"{package}.sandbox._landlock")


def _set_limits(config: dict[str, Any]) -> str:
    for which, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_AS, config["memory"]),
        (resource.RLIMIT_CPU, config["cpu_seconds"]),
        (resource.RLIMIT_FSIZE, config["file_size"]),
        (resource.RLIMIT_NOFILE, config["open_files"]),
    ):
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))
    return "rlimits"


def _drop_capabilities() -> str:
    number = _CAPSET.get(os.uname().machine)
    if number is None:
        raise OSError("capset: unknown machine")
    libc = _libc()
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last one: fine
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    if libc.syscall(number, ctypes.byref(header), ctypes.byref(data)) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    return "no capabilities"


def _no_new_privileges() -> str:
    if _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    return "no new privileges"


def _landlock(directory: str, readable: list[str]) -> str:
    applied: str = _landlock_module().restrict([directory], readable=readable, tcp=False)
    return f"landlock {applied}"


class _Pipe:
    """Lines of JSON in on one descriptor, out on another."""

    def __init__(self, request: int, reply: int) -> None:
        self.request, self.reply = request, reply
        self._pending = b""

    def send(self, message: dict[str, Any]) -> None:
        data = _wire.dumps(message)
        while data:
            data = data[os.write(self.reply, data) :]

    def receive(self) -> Any:
        while b"\n" not in self._pending:
            chunk = os.read(self.request, 1 << 16)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)


def _describe(exc: BaseException) -> dict[str, str]:
    try:
        message = str(exc)[:2000]
    except BaseException:
        message = "(its message could not be read)"
    return {"raised": type(exc).__name__, "message": message}


def _apply(steps: tuple[tuple[str, Callable[[], str]], ...]) -> tuple[list[str], list[str]]:
    """Run each step; what they applied, and why those that failed did."""
    jail: list[str] = []
    failures: list[str] = []
    for name, step in steps:
        try:
            jail.append(step())
        except Exception as exc:  # reported: the worker decides whether that is acceptable
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return jail, failures


def _child(pipe: _Pipe, config: dict[str, Any], readable: list[str]) -> None:
    """The forked child: jail, report, load the source, answer calls."""
    os.setsid()
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.chdir(config["directory"])
    jail, failures = _apply(
        (
            ("rlimits", lambda: _set_limits(config)),
            ("landlock", lambda: _landlock(config["directory"], readable)),
        )
    )
    pipe.send({"jail": jail, "failures": failures, "readable": readable})
    program = pipe.receive()  # only once the worker accepted the jail
    if program is None:
        return
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(program["source"], "<completion>", "exec"), namespace)
    except BaseException as exc:
        exc.__traceback__ = None
        pipe.send({"load_error": _describe(exc)})
        return
    function = namespace.get(program["entry"])
    if not callable(function):
        pipe.send({"load_error": {"raised": "NameError", "message": "no such function"}})
        return
    pipe.send({"ready": True})
    while True:
        request = pipe.receive()
        if request is None:
            return
        n = request["n"]
        try:
            args = _wire.decode(request["args"])
            kwargs = _wire.decode(request["kwargs"]) if request.get("kwargs") else {}
            value = function(*args, **kwargs)
        except BaseException as exc:
            exc.__traceback__ = None  # free the frames (and what memory they hold) first
            pipe.send({"n": n, **_describe(exc)})
            continue
        try:
            encoded = _wire.encode(value)
        except (_wire.NotData, RecursionError):
            pipe.send({"n": n, "not_data": type(value).__name__})
            continue
        try:
            pipe.send({"n": n, "value": encoded})
        except (TypeError, ValueError, RecursionError):
            pipe.send({"n": n, "not_data": type(value).__name__})


def zygote(control: int, parent: int) -> None:
    """Serve fork and reap requests on the unix socket ``control`` until it closes."""
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the worker died before the line above
        return
    for name in PRELOAD:
        importlib.import_module(name)
    readable = readable_dirs()  # (once: every child reads the same)
    _libc()
    _landlock_module().abi_version()
    gc.collect()
    gc.freeze()  # (the children's collector leaves the zygote's objects, and their pages, be)
    sock = socket.socket(fileno=control)
    # What every child would do the same way is done once, here, and inherited: no
    # capabilities (the zygote needs none: it forks and reaps) and no new privileges.
    jail, failures = _apply(
        (("capabilities", _drop_capabilities), ("no_new_privs", _no_new_privileges))
    )
    sock.send(_wire.dumps({"ready": os.getpid(), "jail": jail, "failures": failures}))
    while True:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 2)
        if not data:
            return
        request = json.loads(data)
        if "fork" in request and len(fds) == 2:
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    sock.close()
                    _child(_Pipe(fds[0], fds[1]), request["fork"], readable)
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            sock.send(_wire.dumps({"pid": pid}))
        elif "reap" in request:
            for fd in fds:
                os.close(fd)
            try:
                _, status = os.waitpid(int(request["reap"]), 0)
            except ChildProcessError:
                sock.send(_wire.dumps({"status": None}))
            else:
                sock.send(_wire.dumps({"status": status}))
        else:
            for fd in fds:
                os.close(fd)
            sock.send(_wire.dumps({"error": "unknown request"}))
