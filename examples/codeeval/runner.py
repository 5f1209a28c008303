"""The child side of the code-evaluation tool: it runs one completion and answers calls.

This file is never imported. The tool reads its text and starts it as
``python -I -S -c <this text> REQUEST_FD REPLY_FD`` in a child process of its own, a new
session, with stdin, stdout and stderr on /dev/null. It uses the standard library only.

What it does, in order, before any code of the completion runs:

1. reads its configuration (one JSON line from REQUEST_FD): the limits and the directory it
   may write to;
2. sets its rlimits (address space, CPU seconds, file size, open files, no core dumps);
3. drops every capability it has (it has some only where the worker runs as root);
4. restricts itself with Landlock (where the kernel has it): it may read only the interpreter's
   own library directories and the system's shared libraries, write only its directory, make
   no TCP connection, and (ABI 6+) signal no process and reach no abstract socket outside;
5. reports what it did (one JSON line on REPLY_FD); only then does the tool send the
   completion's source and the name of the function under test (a second line), which it runs.

Then it answers one request per line, ``{"n": N, "args": [...]}``, with
``{"n": N, "return": value}`` (the value as JSON), ``{"n": N, "raised": "Type", "message": ...}``,
or ``{"n": N, "unserializable": "type name"}``. EOF on REQUEST_FD ends it.

Nothing it sends is trusted: once the completion runs, it shares this process and can rewrite
all of the above (send anything at all, or nothing). The tool only ever reads JSON data from it
and decides the verdict itself; see ``docs/codeeval.md``.
"""

import ctypes
import json
import os
import resource
import sys
from collections.abc import Callable
from typing import Any

REQUEST_FD = int(sys.argv[1])
REPLY_FD = int(sys.argv[2])

# Landlock (raw syscalls; numbers shared by x86_64 and aarch64).
_LANDLOCK = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
_CAPSET = {"x86_64": 126, "aarch64": 91}
_READ = (1 << 0) | (1 << 2) | (1 << 3)  # EXECUTE, READ_FILE, READ_DIR
_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
_NET_TCP = (1 << 0) | (1 << 1)  # BIND_TCP, CONNECT_TCP
_SCOPES = (1 << 0) | (1 << 1)  # ABSTRACT_UNIX_SOCKET, SIGNAL
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

_libc = ctypes.CDLL(None, use_errno=True)


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def send(message: dict[str, Any]) -> None:
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
    while data:
        data = data[os.write(REPLY_FD, data) :]


_pending = b""


def receive() -> Any:
    """The next request line as a dict, or None at EOF."""
    global _pending
    while b"\n" not in _pending:
        chunk = os.read(REQUEST_FD, 1 << 16)
        if not chunk:
            return None
        _pending += chunk
    line, _, _pending = _pending.partition(b"\n")
    return json.loads(line)


def set_limits(config: dict[str, Any]) -> str:
    limits = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_AS, config["memory"]),
        (resource.RLIMIT_CPU, config["cpu_seconds"]),
        (resource.RLIMIT_FSIZE, config["file_size"]),
        (resource.RLIMIT_NOFILE, config["open_files"]),
    ]
    for which, value in limits:
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))
    return "rlimits"


def drop_capabilities() -> str:
    """Empty the bounding, ambient, effective, permitted and inheritable sets."""
    number = _CAPSET.get(os.uname().machine)
    if number is None:
        raise OSError("capset: unknown machine")
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last cap: fine
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    if _libc.syscall(number, ctypes.byref(header), ctypes.byref(data)) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    return "no capabilities"


def landlock(readable: list[str], writable: list[str]) -> str:
    """Restrict this process for good: read ``readable``, write ``writable``, nothing else."""
    numbers = _LANDLOCK.get(os.uname().machine)
    if numbers is None:
        raise OSError("Landlock: unknown machine")
    create, add_rule, restrict_self = numbers
    abi = int(_libc.syscall(create, None, 0, 1))
    if abi < 1:
        raise OSError("Landlock is not available on this kernel")
    fs_rights = 0
    for version, rights in _FS_RIGHTS_BY_ABI.items():
        if abi >= version:
            fs_rights = rights
    attr = _RulesetAttr(fs_rights, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = int(_libc.syscall(create, ctypes.byref(attr), size, 0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for paths, rights in ((readable, _READ), (writable, fs_rights)):
            for path in paths:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                try:
                    rule = _PathBeneath(rights & fs_rights, fd)
                    if _libc.syscall(add_rule, ruleset, 1, ctypes.byref(rule), 0):
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
                finally:
                    os.close(fd)
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
        if _libc.syscall(restrict_self, ruleset, 0):
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    parts = [f"landlock ABI {abi}: reads only the interpreter's library, writes only its directory"]
    if abi >= 4:
        parts.append("no TCP")
    if abi >= 6:
        parts.append("no signals or abstract sockets outside")
    return ", ".join(parts)


def readable_dirs() -> list[str]:
    """The interpreter's library directories (as this ``-I -S`` child sees them) and the
    system's shared libraries: what importing the standard library needs."""
    found: list[str] = []
    for path in [*sys.path, "/lib", "/lib64", "/usr/lib", "/usr/lib64"]:
        path = os.path.realpath(path) if path else ""
        if path and os.path.isdir(path) and path not in found:
            found.append(path)
    return found


def describe(exc: BaseException) -> dict[str, str]:
    return {"raised": type(exc).__name__, "message": str(exc)[:2000]}


def main() -> None:
    config = receive()
    if config is None:
        return
    jail: list[str] = []
    failures: list[str] = []
    os.chdir(config["directory"])
    readable = readable_dirs()
    steps: tuple[tuple[str, Callable[[], str]], ...] = (
        ("rlimits", lambda: set_limits(config)),
        ("capabilities", drop_capabilities),
        ("landlock", lambda: landlock(readable, [config["directory"]])),
    )
    for name, step in steps:
        try:
            jail.append(step())
        except Exception as exc:  # reported; the tool decides whether that is acceptable
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    send({"jail": jail, "jail_failures": failures, "readable": readable})
    program = receive()  # the completion comes only once the tool accepted the jail
    if program is None:
        return
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(program["source"], "<completion>", "exec"), namespace)
    except BaseException as exc:
        send({"load_error": describe(exc)})
        return
    function = namespace.get(program["entry"])
    if not callable(function):
        entry = program["entry"]
        send({"load_error": {"raised": "NameError", "message": f"no function {entry}"}})
        return
    send({"ready": True})
    while True:
        request = receive()
        if request is None:
            return
        n = request["n"]
        try:
            value = function(*request["args"])
        except BaseException as exc:
            exc.__traceback__ = None  # free the frames (and whatever memory they hold) first
            send({"n": n, **describe(exc)})
            continue
        try:
            send({"n": n, "return": value})
        except (TypeError, ValueError, RecursionError):
            send({"n": n, "unserializable": type(value).__name__})


main()
