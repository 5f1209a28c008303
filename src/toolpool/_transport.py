"""Small zmq helpers both sides use: the notification fd and the readable check.

zmq's ``ZMQ_FD`` is edge-triggered: after any send or receive, check :func:`readable` and
drain before waiting on the fd again, or a message can sit unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import zmq

__all__ = ("fd_of", "on_readable", "readable")

_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def fd_of(sock: zmq.Socket[Any]) -> int:
    """The socket's notification file descriptor (wait on it, then drain)."""
    return cast(int, sock.getsockopt(zmq.FD))


def readable(sock: zmq.Socket[Any]) -> bool:
    """True if a message can be received without blocking."""
    return bool(cast(int, sock.get(_EVENTS)) & _POLLIN)  # plain ints: no enum arithmetic


@contextlib.contextmanager
def on_readable(fd: int, callback: Callable[[], object]) -> Iterator[bool]:
    """On asyncio, run ``callback`` from the event loop whenever ``fd`` is readable: one
    persistent reader instead of registering the fd again for every wait. Yields True if it
    was installed; on other event loops yields False (then wait with ``anyio.wait_readable``).
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not on asyncio (trio)
        yield False
        return
    loop.add_reader(fd, callback)
    try:
        yield True
    finally:
        loop.remove_reader(fd)
