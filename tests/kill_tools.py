"""Tools for tests/test_kill_path.py: trees with a process that left the worker's cgroup."""

from __future__ import annotations

import os
import sys
import time

import toolpool

registry = toolpool.Registry()


def _v2_root() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if " - cgroup2 " in line:
                return line.split()[4]
    return None


@registry.tool
def escape_below(marker: str) -> None:
    """Fork a child that stays in the worker's cgroup and blocks; it forks a grandchild that
    moves itself into the root cgroup (a root tool can) and becomes a sleeper carrying
    ``marker`` on its command line. Then block."""
    if os.fork() == 0:
        try:
            if os.fork() == 0:
                root = _v2_root()
                if root is not None:
                    with open(os.path.join(root, "cgroup.procs"), "w") as f:
                        f.write(str(os.getpid()))
                argv = [sys.executable, "-c", "import time; time.sleep(3600)", marker]
                os.execv(sys.executable, argv)
            time.sleep(3600)
        finally:
            os._exit(0)
    time.sleep(3600)


@registry.tool
def noop() -> None:
    """Nothing."""
