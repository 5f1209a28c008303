"""The checks every decoder of the protocol shares, and :class:`ProtocolViolation`.

Stdlib only, imported by nothing heavy: the reaper loads this file (with ``_reaper.py``) by
path, under a stand-in package name, without importing toolpool or msgpack.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = (
    "MAX_ID",
    "MAX_NAME",
    "MAX_TEXT",
    "ProtocolViolation",
    "arity",
    "binary",
    "int_id",
    "text",
)

#: The largest id (a call's, a worker's, a pid, a count) a frame may carry.
MAX_ID: Final = 2**63 - 1
#: The longest text (an error, a reason) a frame may carry, in characters.
MAX_TEXT: Final = 64 * 1024
#: The longest name (a tool's, an error's type) a frame may carry, in characters.
MAX_NAME: Final = 256


class ProtocolViolation(ValueError):
    """A frame broke the protocol: undecodable, oversized, unknown type or wrong shape."""


def int_id(value: Any, what: str) -> int:
    """An id or a count: a non-negative integer (never a bool)."""
    if type(value) is not int or not 0 <= value <= MAX_ID:
        raise ProtocolViolation(f"{what} must be a non-negative integer")
    return value


def text(value: Any, what: str, limit: int = MAX_TEXT, *, optional: bool = False) -> Any:
    """A string of at most ``limit`` characters (or None, if ``optional``)."""
    if value is None and optional:
        return None
    if type(value) is not str or len(value) > limit:
        raise ProtocolViolation(f"{what} must be a string of at most {limit} characters")
    return value


def binary(value: Any, what: str, *, optional: bool = False) -> Any:
    """Bytes (or None, if ``optional``)."""
    if value is None and optional:
        return None
    if type(value) is not bytes:
        raise ProtocolViolation(f"{what} must be binary")
    return value


def arity(body: list[Any], n: int, name: str) -> None:
    """A message ``name`` of ``n`` fields."""
    if len(body) != n:
        raise ProtocolViolation(f"{name!r} takes {n} fields, got {len(body)}")
