"""The jailed side of ``toolpool eval``: the zygote and the child it forks, stdlib only.

This module is not imported by toolpool's own processes for its work; the worker starts the
zygote as ``python -I -S -c BOOT`` (see ``_zygote.py``), which loads this file, ``_wire.py``
and the sandbox's ``_landlock.py``/``_linux.py`` by path (no ``toolpool`` package, no
site-packages), imports the modules completions commonly use, runs one trivial sample
through the runner itself (:func:`_rehearse`), builds the Landlock ruleset of its worker's
scratch directory, and then waits for requests on a unix socket from its worker. For each
request it forks a child, which:

1. leaves the zygote's socket and session behind (``setsid``), asks for SIGKILL should the
   zygote die, and changes to the scratch directory (empty: the worker empties it between
   samples);
2. confines itself for good: rlimits (address space, CPU seconds, file size, open files, no
   core dumps) and Landlock, applying the zygote's ruleset to itself and closing it (it may
   read only the standard library and the system's shared libraries, write only its
   directory, make no TCP connection; ABI 6+: signal no process and reach no abstract socket
   outside its own domain). It has no capabilities and no new privileges already: the
   zygote dropped them for itself once, at its start, and every fork inherits that;
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
#: The child's limits (rlimits it sets on itself before the completion runs; the CPU seconds
#: come with each request: the time limit + 1).
MEMORY = 512 << 20  # address space
FILE_SIZE = 1 << 20
OPEN_FILES = 64
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


def _set_limits(cpu_seconds: int) -> str:
    for which, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_AS, MEMORY),
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_FSIZE, FILE_SIZE),
        (resource.RLIMIT_NOFILE, OPEN_FILES),
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


class _Jail:
    """What the zygote prepares once for every child: the Landlock ruleset of its worker's
    scratch directory, built (or why it could not be) but applied by each child to itself."""

    def __init__(self, directory: str, readable: list[str]) -> None:
        self.directory = directory
        self.readable = readable
        self.ruleset = -1
        self.landlock = ""
        self.why = ""
        self.restrict_self = 0
        try:
            module = _landlock_module()
            numbers = module._numbers()
            if numbers is None:
                raise OSError("Landlock is not available on this machine")
            self.restrict_self = numbers[2]
            self.ruleset, applied = module.ruleset([directory], readable=readable, tcp=False)
            self.landlock = f"landlock {applied}"
        except Exception as exc:  # each child reports it: the worker decides
            self.why = f"{type(exc).__name__}: {exc}"

    def apply_landlock(self) -> str:
        """In the child: apply the ruleset (a new Landlock domain of the child's own: it can
        signal neither the zygote nor any other child), then close it, before anything else
        runs (whoever holds it could add rules to it)."""
        if self.ruleset < 0:
            raise OSError(self.why)
        failed = _libc().syscall(self.restrict_self, self.ruleset, 0)
        os.close(self.ruleset)
        self.ruleset = -1
        if failed:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
        return self.landlock


def _child(pipe: _Pipe, cpu_seconds: int, jail_: _Jail) -> None:
    """The forked child: jail, report, load the source, answer calls."""
    os.setsid()
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.chdir(jail_.directory)
    jail, failures = _apply(
        (
            ("rlimits", lambda: _set_limits(cpu_seconds)),
            ("landlock", jail_.apply_landlock),
        )
    )
    if jail_.ruleset >= 0:  # (it failed half-way: closed all the same)
        os.close(jail_.ruleset)
    pipe.send({"jail": jail, "failures": failures, "readable": jail_.readable})
    program = pipe.receive()  # only once the worker accepted the jail
    if program is None:
        return
    _run(pipe, program)


def _run(pipe: _Pipe, program: dict[str, Any]) -> None:
    """Load the program and answer calls until the pipe closes."""
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


#: The rehearsal's program: what a sample does, so that the zygote has done it once.
_REHEARSAL = (
    {
        "source": "def f(x, *, y=0):\n"
        "    if x:\n"
        "        raise ValueError(x)\n"
        "    return [(1,), {2}, {3: b'4'}, 1.5, None]\n",
        "entry": "f",
    },
    [{"n": 0, "args": [0], "kwargs": None}, {"n": 1, "args": [1], "kwargs": {"$dict": [["y", 1]]}}],
)


def _rehearse() -> None:
    """Run one sample's code path here in the zygote (no jail, no fork, a trivial program),
    so that what a first run sets up lazily (ctypes' functions, the JSON codecs, the
    compiler's and the exceptions' paths) is set up in pages every child inherits instead
    of in each child's copy of them."""
    program, calls = _REHEARSAL
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    try:
        lines = b"".join(_wire.dumps(c) for c in calls)
        os.write(request_w, lines)
        os.close(request_w)
        request_w = -1
        _run(_Pipe(request_r, reply_w), program)
        os.close(reply_w)
        reply_w = -1
        while os.read(reply_r, 1 << 16):
            pass
        libc = _libc()
        for name in ("prctl", "syscall"):  # (ctypes resolves a function on first use)
            getattr(libc, name)
        ctypes.get_errno()
    finally:
        for fd in (request_r, request_w, reply_r, reply_w):
            if fd >= 0:
                os.close(fd)


def zygote(control: int, parent: int, directory: str) -> None:
    """Serve fork and reap requests on the unix socket ``control`` until it closes; each
    child works in ``directory`` (the worker's scratch directory, which it empties between
    samples).

    The requests and answers are short byte strings: ``f<cpu seconds>`` (with the child's
    two pipes) is answered with the child's pid, ``r<pid>`` with its wait status (``-``
    where it was not this process's child)."""
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the worker died before the line above
        return
    for name in PRELOAD:
        importlib.import_module(name)
    readable = readable_dirs()  # (once: every child reads the same)
    _rehearse()
    sock = socket.socket(fileno=control)
    # What every child would do the same way is done once, here, and inherited: no
    # capabilities (the zygote needs none: it forks and reaps) and no new privileges; and
    # the Landlock ruleset is built once, for each child to apply to itself.
    jail, failures = _apply(
        (("capabilities", _drop_capabilities), ("no_new_privs", _no_new_privileges))
    )
    prepared = _Jail(directory, readable)
    gc.collect()
    gc.freeze()  # (the children's collector leaves the zygote's objects, and their pages, be)
    sock.send(_wire.dumps({"ready": os.getpid(), "jail": jail, "failures": failures}))
    while True:
        data, fds, _flags, _addr = socket.recv_fds(sock, 64, 2)
        if not data:
            return
        kind, argument = data[:1], data[1:]
        if kind == b"f" and len(fds) == 2 and argument.isdigit():
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    sock.close()
                    _child(_Pipe(fds[0], fds[1]), int(argument), prepared)
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            sock.send(b"%d" % pid)
            continue
        for fd in fds:
            os.close(fd)
        if kind == b"r" and argument.isdigit():
            try:
                _, status = os.waitpid(int(argument), 0)
            except ChildProcessError:
                sock.send(b"-")
            else:
                sock.send(b"%d" % status)
        else:
            sock.send(b"?")
