"""Helper processes a tool keeps across calls (a warm template, say), declared as such.

After every call the worker counts the processes the call left behind; any is a leftover,
killed before the worker's next call (docs/pool.md, ``allow_background``). A tool that starts
a long-lived helper of its own on purpose (``toolpool eval``'s zygote) declares its pid here,
so that the helper is not counted. The tool remains responsible for everything the helper
starts: the worker counts only its own children and its cgroup's members.
"""

from __future__ import annotations

__all__ = ("forget_helper", "helpers", "keep_helper")

_HELPERS: set[int] = set()


def keep_helper(pid: int) -> None:
    """Do not count the child process ``pid`` as a leftover of the calls of this worker."""
    _HELPERS.add(pid)


def forget_helper(pid: int) -> None:
    """Count ``pid`` again (the helper was stopped)."""
    _HELPERS.discard(pid)


def helpers() -> frozenset[int]:
    """The pids declared with :func:`keep_helper`."""
    return frozenset(_HELPERS)
