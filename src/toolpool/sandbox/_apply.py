"""Worker-side set-up of a containment profile: runs first thing in the worker process,
single-threaded, before zmq starts its threads and before the tools module is imported.

Order (it must not undo itself): join cgroups, resource limits, network namespace, the uid
change (its mount namespace must come before Landlock, which forbids mounting), the
read-only mounts (as root, just before the uid change drops the right to mount), Landlock; the
caller then arms PDEATHSIG (a uid change clears it), checks the parent, and becomes a
subreaper. Each step reports whether it
is active and, if not, why; nothing fails because a layer is missing unless it is required.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
from typing import Any

from ._cgroups import join
from ._profile import Profile

__all__ = ("apply_profile",)

CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _set_limit(which: int, value: int) -> None:
    _soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _unshare_network(allow_userns: bool = True) -> str:
    libc = _libc()
    if libc.unshare(CLONE_NEWNET) == 0:
        return "own empty network namespace"
    first = os.strerror(ctypes.get_errno())
    if not allow_userns:
        raise OSError(f"unshare(CLONE_NEWNET): {first}")
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        raise OSError(
            f"unshare(CLONE_NEWNET): {first}; with a user namespace: "
            f"{os.strerror(ctypes.get_errno())}"
        )
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    return "own empty network namespace (in a user namespace)"


def _unshare_ipc(report: dict[str, list[Any]]) -> bool:
    if _libc().unshare(CLONE_NEWIPC) == 0:
        report["ipcns"] = [True, "own IPC namespace: System V IPC and message queues die with it"]
        return True
    report["ipcns"] = [False, f"unshare(CLONE_NEWIPC): {os.strerror(ctypes.get_errno())}"]
    return False


def apply_profile(
    profile: Profile,
    procs_files: list[str],
    own: list[str] | None = None,
    tools_module: str | None = None,
) -> dict[str, list[Any]]:
    """Apply ``profile`` to this process. Returns ``{layer: [active, detail]}``.

    ``own`` names files the worker keeps using after a uid change (its socket file); they and
    the scratch directory (the working directory) are handed to the new uid, which must also
    be able to import ``tools_module``. A uid change that fails once begun raises
    :class:`RuntimeError`: the worker must not run tools half-changed.

    Raises :class:`RuntimeError` if a layer in ``profile.require`` could not be applied.
    """
    report: dict[str, list[Any]] = {}

    if procs_files:
        errors = join(procs_files)
        report["cgroups_joined"] = [not errors, "; ".join(errors) or f"{len(procs_files)} joined"]

    limits = []
    try:
        if not profile.core_dumps:
            _set_limit(resource.RLIMIT_CORE, 0)
            limits.append("core=0")
        if profile.max_open_files is not None:
            _set_limit(resource.RLIMIT_NOFILE, profile.max_open_files)
            limits.append(f"nofile={profile.max_open_files}")
        if profile.max_file_size is not None:
            _set_limit(resource.RLIMIT_FSIZE, profile.max_file_size)
            # A write past the cap fails with EFBIG instead of killing the writer.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            limits.append(f"fsize={profile.max_file_size}")
        if profile.cpu_time is not None:
            seconds = max(1, int(profile.cpu_time))
            _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
            cap = seconds + 5 if hard == resource.RLIM_INFINITY else min(seconds + 5, hard)
            resource.setrlimit(resource.RLIMIT_CPU, (min(seconds, cap), cap))
            limits.append(f"cpu={seconds}s")
        report["rlimits"] = [True, ", ".join(limits) or "none requested"]
    except (OSError, ValueError) as exc:
        report["rlimits"] = [False, f"setrlimit failed: {exc}"]

    # Before a uid change, only a plain network namespace: one inside a user namespace would
    # map only the current uid, and the change to another would then fail.
    netns_later = False
    if not profile.network:
        try:
            report["netns"] = [True, _unshare_network(allow_userns=profile.user is None)]
        except OSError as exc:
            report["netns"] = [False, str(exc)]
            netns_later = profile.user is not None

    ipc_later = profile.private_ipc and not _unshare_ipc(report)

    def readonly() -> None:
        from ._mounts import METADATA_WARNING, readonly_view

        writable = [os.getcwd()] if profile.scratch_dir else []
        # The user namespace a network namespace then needs is set up through /proc.
        keep = ("/proc",) if netns_later else ()
        try:
            report["readonly_fs"] = [True, readonly_view(writable, keep)]
        except OSError as exc:
            report["readonly_fs"] = [False, f"{exc}: {METADATA_WARNING}"]

    if profile.user is not None:
        from ._identity import LayerUnavailable, drop_privileges

        owned = [*(own or ()), *([os.getcwd()] if profile.scratch_dir else [])]
        try:
            before_drop = readonly if profile.readonly_fs else None
            detail = drop_privileges(profile.user, owned, tools_module, before_drop)
        except LayerUnavailable as exc:
            report["uid"] = [False, str(exc)]
        else:
            if profile.max_processes is not None:
                # Enforced for a non-root uid, per uid: with a uid per worker, per worker.
                _set_limit(resource.RLIMIT_NPROC, profile.max_processes)
                detail += f", nproc={profile.max_processes}"
            report["uid"] = [True, detail]

    if netns_later:
        try:
            report["netns"] = [True, _unshare_network()]
        except OSError as exc:
            report["netns"] = [False, str(exc)]
    if ipc_later:  # inside the user namespace the network fallback made, if it did
        _unshare_ipc(report)

    if profile.readonly_fs and "readonly_fs" not in report:  # (no uid change: here)
        readonly()

    if profile.landlock:
        from ._landlock import restrict

        try:
            writable = [os.getcwd()] if profile.scratch_dir else []
            report["landlock"] = [True, restrict(writable)]
        except OSError as exc:
            report["landlock"] = [False, str(exc)]
        if report["landlock"][0] and not report.get("readonly_fs", [False])[0]:
            from ._mounts import METADATA_WARNING

            # Landlock's rights cover content and names, not metadata: say what is open.
            report["landlock"][1] += f"; {METADATA_WARNING} (no read-only mounts)"

    missing = [layer for layer in profile.require if layer in report and not report[layer][0]]
    if missing:
        details = "; ".join(f"{m}: {report[m][1]}" for m in missing)
        raise RuntimeError(f"required containment layers are not available: {details}")
    return report
