"""PID 1 in a container: a small init in front of the service.

The kernel treats PID 1 apart: a signal it has no handler for is dropped (so a SIGTERM
from the runtime would do nothing to a process that had not installed one yet), and every
orphan of the container is re-parented to it and must be reaped, or it stays a zombie. The
service runs with ``--init auto`` (the default): when it finds itself PID 1, it forks; the
child is the service, and PID 1 stays behind as an init of a few lines: it forwards the
signals a runtime sends (TERM, INT, HUP, QUIT, USR1, USR2) to the service, reaps every child
that ends, and exits with the service's status once the service is gone. (``tini`` or
``docker run --init`` do the same; this one needs nothing in the image.)
"""

from __future__ import annotations

import os
import signal
from typing import Final

__all__ = ("FORWARDED", "become_init")

#: The signals PID 1 passes on to the service.
FORWARDED: Final = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def become_init() -> int | None:
    """Called by PID 1 before anything else runs: fork. In the child (the service) return
    None: go on. In PID 1, serve as init until the service exits, then return its exit
    status (128 + N if a signal N ended it)."""
    # Block the signals across the fork, so none is lost between the fork and the
    # handlers; the child unblocks them at once.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return None

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    status = 1
    while True:
        try:
            pid, wait_status = os.wait()  # (PEP 475: retried after a forwarded signal)
        except ChildProcessError:
            break  # no child left at all
        if pid == child:
            code = os.waitstatus_to_exitcode(wait_status)
            status = code if code >= 0 else 128 - code
            break
    # Reap whatever ended meanwhile; what still runs is ended by the kernel as PID 1 exits
    # (the service let no tool tree outlive it: it exits only once every tree is gone).
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    return status
