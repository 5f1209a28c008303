"""Small zmq helpers both sides use: the notification fd and the readable check.

zmq's ``ZMQ_FD`` is edge-triggered: after any send or receive, check :func:`readable` and
drain before waiting on the fd again, or a message can sit unnoticed.
"""

from __future__ import annotations

from typing import Any, cast

import zmq

__all__ = ("fd_of", "readable")


def fd_of(sock: zmq.Socket[Any]) -> int:
    """The socket's notification file descriptor (wait on it, then drain)."""
    return cast(int, sock.getsockopt(zmq.FD))


def readable(sock: zmq.Socket[Any]) -> bool:
    """True if a message can be received without blocking."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
