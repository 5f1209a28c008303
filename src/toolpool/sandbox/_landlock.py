"""Landlock, through raw syscalls (no library needed): a read-only filesystem except the
worker's scratch directory, and (ABI 6+) no signals or abstract unix sockets outside the
sandbox. Detected by trying the syscall: /sys/kernel/security need not be mounted.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from typing import Any

from ._linux import PR_SET_NO_NEW_PRIVS, prctl

__all__ = ("abi_version", "restrict", "restrict_self", "ruleset")

_SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

# Filesystem rights that change something (ABI 1..3).
_FS_WRITE_RIGHTS = {
    1: (1 << 1)
    | (1 << 4)
    | (1 << 5)
    | (1 << 6)
    | (1 << 7)
    | (1 << 8)
    | (1 << 9)
    | (1 << 10)
    | (1 << 11)
    | (1 << 12),
    2: 1 << 13,  # REFER
    3: 1 << 14,  # TRUNCATE
}
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
_SCOPE_SIGNAL = 1 << 1
# Reading rights (ABI 1): EXECUTE, READ_FILE, READ_DIR.
_FS_READ_RIGHTS = (1 << 0) | (1 << 2) | (1 << 3)
# Network rights (ABI 4): BIND_TCP, CONNECT_TCP.
_NET_TCP = (1 << 0) | (1 << 1)


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _numbers() -> tuple[int, int, int] | None:
    return _SYSCALLS.get(platform.machine())


def abi_version() -> int:
    """The kernel's Landlock ABI version, or 0 where Landlock is unavailable."""
    numbers = _numbers()
    if numbers is None:
        return 0
    version = int(_libc().syscall(numbers[0], None, 0, _CREATE_RULESET_VERSION))
    return max(version, 0)


_FILE_RIGHTS = (1 << 1) | (1 << 14)  # WRITE_FILE, TRUNCATE: what a rule on a file may grant


def restrict(
    writable: list[str],
    writable_files: tuple[str, ...] = ("/dev/null",),
    *,
    readable: list[str] | None = None,
    tcp: bool = True,
) -> str:
    """Restrict this process (and its future children) for good. Returns what was applied.

    ``readable`` None: everything may be read; a list: only what lies beneath those paths
    (and ``writable``). ``tcp`` False: no TCP bind or connect (ABI 4+; below that, TCP is not
    handled and the result says nothing of it). Raises :class:`OSError` where Landlock is
    unavailable or refuses.
    """
    fd, applied = ruleset(writable, writable_files, readable=readable, tcp=tcp)
    try:
        restrict_self(fd)
    finally:
        os.close(fd)
    return applied


def ruleset(
    writable: list[str],
    writable_files: tuple[str, ...] = ("/dev/null",),
    *,
    readable: list[str] | None = None,
    tcp: bool = True,
) -> tuple[int, str]:
    """The ruleset :func:`restrict` applies, built but not applied: its descriptor (the
    caller closes it) and what it says. :func:`restrict_self` applies it, in this process or
    in any fork of it, as often as wanted (each time a new domain: ``toolpool eval``'s zygote
    builds it once and each child applies it). Whoever holds the descriptor can add rules to
    it: close it before running code that is not trusted."""
    numbers = _numbers()
    abi = abi_version()
    if numbers is None or abi < 1:
        raise OSError("Landlock is not available on this kernel")
    create, add_rule, _ = numbers
    libc = _libc()
    write_rights = 0
    for version, rights in _FS_WRITE_RIGHTS.items():
        if abi >= version:
            write_rights |= rights
    handled = write_rights | (_FS_READ_RIGHTS if readable is not None else 0)
    net = _NET_TCP if not tcp and abi >= 4 else 0
    attr = _RulesetAttr(handled, net, 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 16
    if abi >= 6:
        attr.scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL
    ruleset = int(libc.syscall(create, ctypes.byref(attr), size, 0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        rules = [(path, handled) for path in writable]
        rules += [(path, _FS_READ_RIGHTS) for path in readable or ()]
        for path, rights in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(rights, fd)
                if libc.syscall(add_rule, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0):
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
            finally:
                os.close(fd)
        for path in writable_files:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(_FILE_RIGHTS & write_rights, fd)
                if libc.syscall(add_rule, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0):
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
            finally:
                os.close(fd)
    except BaseException:
        os.close(ruleset)
        raise
    scope = ", no signals or abstract sockets outside the sandbox" if abi >= 6 else ""
    if net:
        scope += ", no TCP"
    if readable is not None:
        return ruleset, (
            f"ABI {abi}: reads only {', '.join(readable)}; writes only {', '.join(writable)}{scope}"
        )
    return ruleset, f"ABI {abi}: read-only except {', '.join(writable)}{scope}"


def restrict_self(ruleset: int) -> None:
    """Apply the ruleset ``ruleset`` (from :func:`ruleset`) to this process for good (no new
    privileges first, as Landlock requires). Raises :class:`OSError` if it refuses."""
    if not prctl(PR_SET_NO_NEW_PRIVS, 1):
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    numbers = _numbers()
    if numbers is None or _libc().syscall(numbers[2], ruleset, 0):
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
