"""Data across the jail's pipes: JSON with a few tags, stdlib only.

Both sides use it: the worker (the trusted checker) and the jailed child (which loads this
file by path, see ``_child.py``). What crosses is JSON text; a value JSON cannot say is a
one-key object whose key starts with ``$``:

=========================  ====================================
``(1, 2)``                 ``{"$tuple": [1, 2]}``
``{1, 2}``                 ``{"$set": [1, 2]}``
``frozenset({1})``         ``{"$frozenset": [1]}``
``nan``, ``inf``           ``{"$float": "nan"}``, ``{"$float": "-inf"}``
``b"ab"``                  ``{"$bytes": "YWI="}`` (base64)
``1+2j``                   ``{"$complex": [1.0, 2.0]}``
``{"a": 1}``, ``{1: 2}``   ``{"$dict": [["a", 1], [1, 2]]}``
=========================  ====================================

Every dict is tagged, so that no plain object is ambiguous. :func:`decode` is the trust
boundary: it accepts nothing else (an unknown tag, a plain object, a set of unhashable
values are :class:`NotData`), so what comes out of it is plain data built here, never an
object of the sender's.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

__all__ = ("NotData", "decode", "dumps", "encode", "loads")

#: Deepest nesting either side encodes or decodes.
MAX_DEPTH = 100


class NotData(ValueError):
    """A value that is not data (of the kinds above), or too deep."""


def encode(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-ready data with tags. Raises :class:`NotData`."""
    if depth > MAX_DEPTH:
        raise NotData("nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"$tuple": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"$dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        tag = "$set" if kind is set else "$frozenset"
        return {tag: [encode(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if kind is complex:
        return {"$complex": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    raise NotData(f"a {kind.__name__} is not data")


_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def decode(data: Any, depth: int = 0) -> Any:
    """The value that :func:`encode` made ``data`` from. Raises :class:`NotData` for anything
    :func:`encode` cannot have made."""
    if depth > MAX_DEPTH:
        raise NotData("nested too deeply")
    kind = type(data)
    if data is None or kind in (bool, str, int, float):
        return data
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is not dict or len(data) != 1:
        raise NotData(f"not a tagged value: {type(data).__name__}")
    ((tag, inner),) = data.items()
    try:
        if tag == "$tuple" and type(inner) is list:
            return tuple(decode(v, depth + 1) for v in inner)
        if tag == "$dict" and type(inner) is list:
            out = {}
            for pair in inner:
                if type(pair) is not list or len(pair) != 2:
                    raise NotData("a $dict item is not a [key, value] pair")
                out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
            return out
        if tag in ("$set", "$frozenset") and type(inner) is list:
            items = [decode(v, depth + 1) for v in inner]
            return set(items) if tag == "$set" else frozenset(items)
        if tag == "$float" and inner in _FLOATS:
            return _FLOATS[inner]
        if tag == "$bytes" and type(inner) is str:
            return base64.b64decode(inner.encode("ascii"), validate=True)
        if tag == "$complex" and type(inner) is list and len(inner) == 2:
            real, imag = (decode(v, depth + 1) for v in inner)
            if type(real) is float and type(imag) is float:
                return complex(real, imag)
    except (TypeError, binascii.Error, UnicodeEncodeError):  # unhashable keys, bad base64
        raise NotData(f"a malformed {tag} value") from None
    raise NotData(f"unknown tag {tag[:40]!r}")


#: One encoder for every message (``json.dumps`` with options builds one per call).
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def dumps(message: dict[str, Any]) -> bytes:
    """One message as a line of JSON (the message's values already encoded)."""
    return (_ENCODE(message) + "\n").encode()


def loads(line: bytes) -> Any:
    """One line of JSON. Raises :class:`NotData` for a line that is not JSON (too deep, an
    integer of too many digits, not UTF-8)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise NotData(f"not JSON ({type(exc).__name__})") from None
