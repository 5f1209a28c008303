"""Values on the wire: a call's arguments and a result's value packed as msgpack, their
large byte strings out of band as *parts*, and the strict decoder every untrusted frame and
value goes through (``docs/protocol.md`` §3, §7). The messages are in ``_messages.py``."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack

from ._checks import ProtocolViolation
from ._checks import int_id as _int_id

__all__ = (
    "DEFAULT_MAX_FRAME",
    "MAX_PARTS",
    "PART_EXT",
    "PART_MIN",
    "check_spill",
    "extract_parts",
    "pack_parts",
    "pack_value",
    "unpack_args",
    "unpack_value",
)

#: Default cap on one frame, in bytes (enforced by ZMQ_MAXMSGSIZE and again here). Decoding
#: a hostile frame can cost about 64 bytes of memory per frame byte (a frame of nested empty
#: arrays), so this bounds the worst case near 512 MiB; raise it knowingly.
DEFAULT_MAX_FRAME: Final = 8 * 1024 * 1024
#: A ``bytes`` or ``bytearray`` of at least this many bytes inside a packed payload (a call's
#: arguments, a result's value) travels out of band, as a *part*: a zmq frame of its own after
#: the ``call`` frame, or a region of the worker's spill for a result. The msgpack refers to it
#: by an ext of type :data:`PART_EXT` whose 4 bytes are the part's index (u32, big-endian).
#: Smaller ones stay inline: copying them costs less than a part's bookkeeping.
PART_MIN: Final = 16 * 1024
#: The msgpack ext type of a reference to a part; the only ext type the wire knows.
PART_EXT: Final = 1
#: At most this many parts per payload (the rest of a payload's large byte strings stay inline).
MAX_PARTS: Final = 64
_INDEX: Final = struct.Struct(">I")


def pack_value(value: Any, name: str = "the value") -> bytes:
    """Pack a value (arguments, a result value) as msgpack; raises TypeError if it cannot, or
    if the other side would refuse it (a map key that is not a string, an ext type), saying
    where in ``value`` (called ``name`` in the message)."""
    try:
        packed: bytes = msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"not serializable with msgpack: {exc}") from None
    if _refusable(value):  # what the other side's strict decoder (_unpack) would refuse
        raise TypeError(_refused(value, name))
    return packed


_LEAVES: Final = frozenset({str, bytes, int, float, bool, type(None)})
_SCALARS: Final = frozenset({str, int, float, bool, type(None)})


def extract_parts(value: Any, name: str = "the value") -> tuple[Any, list[bytes]]:
    """``value`` with each ``bytes`` or ``bytearray`` of at least :data:`PART_MIN` bytes (at
    most :data:`MAX_PARTS` of them) replaced by a reference to a part, and those parts: a
    ``bytes`` part is the caller's object itself, not a copy (it is immutable); a
    ``bytearray`` is copied once, so a later change of the caller's does not reach the other
    side. No parts: ``value`` itself and ``[]`` (pack it whole). With parts, raises
    TypeError if the other side would refuse ``value`` (an ext type of the caller's would
    pass for a part)."""
    parts: list[bytes] = []
    if type(value) in _SCALARS:  # (None, a number, a str: no part in it)
        return value, parts
    out = _extract(value, parts, 0)
    if parts and _refusable(value):
        raise TypeError(_refused(value, name))
    return out, parts


def pack_parts(value: Any, name: str = "the value") -> tuple[bytes, list[bytes]]:
    """Pack ``value`` as :func:`pack_value` does, its large byte strings taken out as parts
    (:func:`extract_parts`): the packed msgpack refers to them by index. Returns the packed
    value and its parts."""
    out, parts = extract_parts(value, name)
    if not parts:
        return pack_value(value, name), parts
    try:
        packed: bytes = msgpack.packb(out, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"not serializable with msgpack: {exc}") from None
    return packed, parts


def _extract(value: Any, parts: list[bytes], depth: int) -> Any:
    """``value`` with its large byte strings replaced by references to ``parts`` (appended);
    ``value`` itself where none is (no container is copied then)."""
    kind = type(value)
    if kind is bytes or kind is bytearray:
        if len(value) < PART_MIN or len(parts) >= MAX_PARTS:
            return value
        parts.append(value if kind is bytes else bytes(value))
        return msgpack.ExtType(PART_EXT, _INDEX.pack(len(parts) - 1))
    if kind in _SCALARS or depth > 256:  # (deeper than msgpack packs anyway: left as is)
        return value
    items: Any
    copy: Callable[[Any], Any]
    if isinstance(value, dict):
        items, copy = value.items(), dict
    elif isinstance(value, (list, tuple)) and not isinstance(value, msgpack.ExtType):
        items, copy = enumerate(value), list
    else:
        return value
    changed: Any = None  # (a copy of the container, made at its first change)
    for key, inner in items:
        if type(inner) in _SCALARS:
            continue
        new = _extract(inner, parts, depth + 1)
        if new is not inner:
            if changed is None:
                changed = copy(value)
            changed[key] = new
    return value if changed is None else changed


def _refusable(value: Any) -> bool:
    """Whether ``value`` (which msgpack packed) holds a map key that is not a string or an
    ext type (a ``Timestamp`` included). Visits containers only, without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, (str, bytes)):
                    return True
                if type(inner) not in _LEAVES:
                    stack.append(inner)
        elif isinstance(item, (msgpack.ExtType, msgpack.Timestamp)):  # (ExtType is a tuple)
            return True
        elif isinstance(item, (list, tuple)):
            stack.extend(inner for inner in item if type(inner) not in _LEAVES)
    return False


def _refused(value: Any, name: str) -> str:
    """Why the decoder refuses ``value``: the first map key that is not a string, and where."""
    stack: list[tuple[str, Any]] = [(name, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, (str, bytes)):
                    return (
                        f"not serializable for the wire: {where} has a key that is not a "
                        f"string: {key!r} ({type(key).__name__}); map keys must be str"
                    )
            stack.extend((f"{where}[{k!r}]", v) for k, v in reversed(item.items()))
        elif isinstance(item, (msgpack.ExtType, msgpack.Timestamp)):
            return f"not serializable for the wire: {where} is a msgpack ext type"
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return "not serializable for the wire"


def _limits(max_len: int) -> dict[str, Any]:
    """msgpack's strict limits for frames of at most ``max_len`` bytes."""
    return {
        "raw": False,
        "strict_map_key": True,
        "use_list": True,
        "max_str_len": max_len,
        "max_bin_len": max_len,
        "max_array_len": min(max_len, 1 << 20),
        "max_map_len": min(max_len, 1 << 20),
    }


def _unpacker(max_len: int) -> Callable[[bytes], Any]:
    """msgpack.unpackb with the strict limits for frames of at most ``max_len`` bytes (one
    per limit, made once)."""
    unpack = _UNPACKERS.get(max_len)
    if unpack is None:
        if len(_UNPACKERS) > 64:
            _UNPACKERS.clear()
        unpack = _UNPACKERS[max_len] = _strict_unpackb(max_len)
    return unpack


def _strict_unpackb(max_len: int) -> Callable[[bytes], Any]:
    # _limits's keywords, written out in the call: a partial's keywords are merged into a new
    # dict for every call (1,600 instructions a frame more, under callgrind). Only those that
    # differ from msgpack's own (each keyword costs the call about 120 instructions): raw,
    # strict_map_key and use_list are msgpack's defaults (since 1.0); a string or binary is
    # at most the frame's length by default, and every caller checked that it is at most
    # max_len first. The arrays' and maps' lengths are bounded as well (by default, the
    # frame's length: more than 1 << 20 in a frame larger than that).
    unpackb, items = msgpack.unpackb, min(max_len, 1 << 20)

    def unpack(frame: bytes) -> Any:
        return unpackb(
            frame, max_array_len=items, max_map_len=items, max_ext_len=0, ext_hook=_reject_ext
        )

    return unpack


_UNPACKERS: dict[int, Callable[[bytes], Any]] = {}


def _unpack(frame: bytes, max_len: int) -> Any:
    if len(frame) > max_len:
        raise ProtocolViolation(f"frame of {len(frame)} bytes exceeds the limit of {max_len}")
    try:
        return _unpacker(max_len)(frame)
    except ProtocolViolation:
        raise
    except Exception as exc:  # msgpack raises many types: ExtraData, StackError, ValueError...
        raise _undecodable(exc) from None


#: A frame (or a packed value) of at most this many bytes may be decoded by :func:`_unpack_small`.
_SMALL: Final = 1 << 20
_unpackb: Final = msgpack.unpackb


def _unpack_small(frame: bytes, max_len: int) -> Any:
    """:func:`_unpack`, for the worker's calls and their arguments, at half the cost where the
    frame has at most 1 MiB: with msgpack's own limits, which are the frame's length (no
    valid value exceeds them: the same frames pass as with :func:`_limits`'s; a length that
    lies fails as incomplete input instead), and one keyword, not ten (no ext at all, a
    timestamp's included, as there)."""
    size = len(frame)
    if size > _SMALL or size > max_len:
        return _unpack(frame, max_len)
    try:
        return _unpackb(frame, max_ext_len=0)
    except Exception as exc:
        raise _undecodable(exc) from None


def _undecodable(exc: Exception) -> ProtocolViolation:
    # (msgpack's FormatError has no message: say what it means.)
    why = str(exc) or "not msgpack (a byte no msgpack value starts with)"
    return ProtocolViolation(f"undecodable frame: {type(exc).__name__}: {why}")


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolViolation(f"msgpack ext type {code} is not allowed")


def unpack_value(data: bytes, max_len: int = DEFAULT_MAX_FRAME, parts: Sequence[bytes] = ()) -> Any:
    """Unpack a packed value from an untrusted peer, with the same limits as a frame; its
    references to parts resolve to ``parts`` (the objects themselves: no copy). A reference
    to a part that does not exist, or an ext of another type, is a violation."""
    if not parts:
        return _unpack(data, max_len)
    if len(data) > max_len:
        raise ProtocolViolation(f"frame of {len(data)} bytes exceeds the limit of {max_len}")
    count = len(parts)

    def part(code: int, ref: bytes) -> Any:
        if code != PART_EXT or len(ref) != _INDEX.size:
            raise ProtocolViolation(f"msgpack ext type {code} is not allowed")
        (index,) = _INDEX.unpack(ref)
        if index >= count:
            raise ProtocolViolation(f"a reference to part {index}, which does not exist")
        return parts[index]

    try:
        return msgpack.unpackb(data, **_limits(max_len), max_ext_len=_INDEX.size, ext_hook=part)
    except ProtocolViolation:
        raise
    except Exception as exc:
        raise _undecodable(exc) from None


def unpack_args(data: bytes, max_len: int, parts: Sequence[bytes] = ()) -> Any:
    """A call's arguments, as the worker unpacks them: :func:`unpack_value`'s, at half the cost
    for small ones without parts (:func:`_unpack_small`)."""
    if parts:
        return unpack_value(data, max_len, parts)
    size = len(data)  # (_unpack_small, inline: once a call)
    if size > _SMALL or size > max_len:
        return _unpack(data, max_len)
    try:
        return _unpackb(data, max_ext_len=0)
    except Exception as exc:
        raise _undecodable(exc) from None


def check_spill(spill: Any, max_len: int, frame_len: int = 0) -> tuple[int, list[int]]:
    """A result's ``extras["spill"]``, ``[offset, [length, ...]]``: where in the worker's
    spill its value's parts lie, back to back. Checked: ids, 1 to :data:`MAX_PARTS` parts,
    each at least 1 byte, and with the result's frame (``frame_len`` bytes) at most
    ``max_len`` bytes in all (the limit of one frame, as if the parts were in it)."""
    if (
        type(spill) is not list
        or len(spill) != 2
        or type(spill[1]) is not list
        or not 1 <= len(spill[1]) <= MAX_PARTS
    ):
        raise ProtocolViolation("spill must be [offset, [length, ...]] of 1 to 64 parts")
    offset = _int_id(spill[0], "spill offset")
    lengths = spill[1]
    for n in lengths:
        if type(n) is not int or not 1 <= n <= max_len:
            raise ProtocolViolation("a part's length must be a positive integer")
    if sum(lengths) + frame_len > max_len:
        raise ProtocolViolation(
            f"parts of {sum(lengths)} bytes in all, with the frame's {frame_len}, exceed the "
            f"limit of {max_len}"
        )
    return offset, lengths
