"""Wire messages between the supervisor and a worker, and their strict codec.

A leaf: stdlib and msgpack only. Every frame is one msgpack array whose first element names
the message type. Frames from a worker are untrusted (CONTRACT C7): :func:`decode_from_worker`
enforces size and shape limits and raises :class:`ProtocolViolation` on anything else.
See ``docs/protocol.md`` for the specification.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, TypeAlias

import msgpack

from ._checks import MAX_ID as _MAX_ID
from ._checks import MAX_NAME as _MAX_NAME
from ._checks import MAX_TEXT as _MAX_TEXT
from ._checks import ProtocolViolation
from ._checks import arity as _arity
from ._checks import binary as _bin
from ._checks import int_id as _int_id
from ._checks import text as _text

__all__ = (
    "DEFAULT_MAX_FRAME",
    "MAX_PARTS",
    "MAX_PROGRESS_MESSAGE",
    "PART_EXT",
    "PART_MIN",
    "PROGRESS_INTERVAL",
    "Ack",
    "OUTCOME_NAMES",
    "PROTOCOL_VERSION",
    "CallMessage",
    "Cancel",
    "CancelAck",
    "Fatal",
    "Heartbeat",
    "Hello",
    "Ping",
    "Pong",
    "ProgressMessage",
    "ProtocolViolation",
    "Recall",
    "ResultMessage",
    "Resume",
    "Shutdown",
    "StartedMessage",
    "SupervisorMessage",
    "Withdrawn",
    "WorkerMessage",
    "check_spill",
    "decode_from_supervisor",
    "decode_from_worker",
    "decode_supervisor_frames",
    "encode",
    "encode_call",
    "pack_parts",
    "pack_value",
    "unpack_value",
)

#: The wire protocol's version; separate from the package version.
PROTOCOL_VERSION: Final = 4

#: Default cap on one frame, in bytes (enforced by ZMQ_MAXMSGSIZE and again here). Decoding
#: a hostile frame can cost about 64 bytes of memory per frame byte (a frame of nested empty
#: arrays), so this bounds the worst case near 512 MiB; raise it knowingly.
DEFAULT_MAX_FRAME: Final = 8 * 1024 * 1024

#: Outcomes a worker may report (``killed`` and ``worker_lost`` are the supervisor's to say).
OUTCOME_NAMES: Final = frozenset(
    {"ok", "error", "denied", "aborted_before_dispatch", "aborted", "timeout"}
)
_CAUSE_KINDS: Final = frozenset({"user", "parent", "disposed", "timeout"})
#: The longest ``message`` a progress report carries (characters).
MAX_PROGRESS_MESSAGE: Final = 1024
#: A worker sends a call's progress at most this often (seconds; the latest report wins).
PROGRESS_INTERVAL: Final = 0.05
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


# --------------------------------------------------------------------------- messages
# Worker -> supervisor


@dataclass(frozen=True, slots=True)
class Hello:
    """First message of a worker: who it is and which tools it provides."""

    version: int
    pid: int
    secret: bytes
    tools: list[dict[str, Any]]
    containment: dict[str, Any] = field(default_factory=dict)
    """What the worker's own set-up applied: ``{layer: [active, detail]}``."""
    TYPE: ClassVar[str] = "hello"

    def fields(self) -> list[Any]:
        return [self.version, self.pid, self.secret, self.tools, self.containment]


@dataclass(frozen=True, slots=True)
class Fatal:
    """The worker could not start (e.g. the tools module failed to import)."""

    secret: bytes
    error: str
    TYPE: ClassVar[str] = "fatal"

    def fields(self) -> list[Any]:
        return [self.secret, self.error]


@dataclass(frozen=True, slots=True)
class StartedMessage:
    """The body of call ``call_id`` was invoked and has not returned yet. Sent only for a
    body still running a moment after it was invoked: a result says the rest."""

    call_id: int
    TYPE: ClassVar[str] = "started"

    def fields(self) -> list[Any]:
        return [self.call_id]


@dataclass(frozen=True, slots=True)
class CancelAck:
    """The worker received the cancel for ``call_id`` and cancelled its signal."""

    call_id: int
    TYPE: ClassVar[str] = "cancel_ack"

    def fields(self) -> list[Any]:
        return [self.call_id]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The worker is alive and its threads run: sent every heartbeat interval (the worker's
    ``--heartbeat``), whether or not a body runs. No heartbeat for several intervals: the
    worker is hung (something, such as a C extension, holds the GIL)."""

    TYPE: ClassVar[str] = "heartbeat"

    def fields(self) -> list[Any]:
        return []


@dataclass(frozen=True, slots=True)
class ProgressMessage:
    """What the body of call ``call_id`` last reported of its progress (the latest value
    wins: the worker coalesces reports, and sends at most one per its progress interval)."""

    call_id: int
    done: float
    total: float | None
    message: str | None
    TYPE: ClassVar[str] = "progress"

    def fields(self) -> list[Any]:
        return [self.call_id, self.done, self.total, self.message]


@dataclass(frozen=True, slots=True)
class Withdrawn:
    """Call ``call_id`` was still waiting in the worker's queue and was removed from it, never
    taken up: the answer to a :class:`Cancel` or :class:`Recall` of a call not yet begun."""

    call_id: int
    TYPE: ClassVar[str] = "withdrawn"

    def fields(self) -> list[Any]:
        return [self.call_id]


@dataclass(frozen=True, slots=True)
class ResultMessage:
    """The settled result of call ``call_id``. ``value`` is the msgpack-packed value (or None)."""

    call_id: int
    outcome: str
    value: bytes | None
    error: str | None
    error_name: str | None
    body_started: bool
    context: dict[str, Any] = field(default_factory=dict)
    leftovers: int = 0
    """Child processes of the worker still present when the call ended."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Facts measured around the call: ``cpu_time`` (float seconds), ``max_rss`` (int
    bytes), ``output`` (bin), ``output_dropped`` (int bytes), ``started_at`` (float, the
    worker's ``time.monotonic()`` when the body was invoked), where measured; and ``kept``
    (bool): whether a copy of this frame is in the worker's ledger."""
    TYPE: ClassVar[str] = "result"

    def fields(self) -> list[Any]:
        return [
            self.call_id,
            self.outcome,
            self.value,
            self.error,
            self.error_name,
            self.body_started,
            self.context,
            self.leftovers,
            self.extras,
        ]


@dataclass(frozen=True, slots=True)
class Pong:
    """Answer to :class:`Ping`, echoing its nonce."""

    nonce: int
    TYPE: ClassVar[str] = "pong"

    def fields(self) -> list[Any]:
        return [self.nonce]


# Supervisor -> worker


@dataclass(frozen=True, slots=True)
class CallMessage:
    """Run tool ``tool`` with ``args`` (a packed msgpack map) as call ``call_id``, after any
    call sent before it. ``acked``: how many results the supervisor has received from this
    worker so far (the worker may reuse the ledger slots that held them)."""

    call_id: int
    tool: str
    args: bytes
    acked: int = 0
    parts: int = 0
    """How many parts of the arguments follow the frame (zmq frames of the same message)."""
    data: tuple[bytes, ...] = field(default=(), repr=False, compare=False)
    """The parts themselves, as received (not a field of the frame)."""
    TYPE: ClassVar[str] = "call"

    def fields(self) -> list[Any]:
        if self.parts:
            return [self.call_id, self.tool, self.args, self.acked, self.parts]
        return [self.call_id, self.tool, self.args, self.acked]


@dataclass(frozen=True, slots=True)
class Ack:
    """The supervisor has received the worker's first ``results`` results: sent when the
    worker holds its queue because a result it sent is not kept in its ledger."""

    results: int
    TYPE: ClassVar[str] = "ack"

    def fields(self) -> list[Any]:
        return [self.results]


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel call ``call_id`` with ``cause`` (``{"kind": ...}``)."""

    call_id: int
    cause: str
    TYPE: ClassVar[str] = "cancel"

    def fields(self) -> list[Any]:
        return [self.call_id, {"kind": self.cause}]


@dataclass(frozen=True, slots=True)
class Recall:
    """Give call ``call_id`` back if it is still waiting in the queue (answer: :class:`Withdrawn`);
    if it was already taken up, nothing: its result follows as usual."""

    call_id: int
    TYPE: ClassVar[str] = "recall"

    def fields(self) -> list[Any]:
        return [self.call_id]


@dataclass(frozen=True, slots=True)
class Resume:
    """The processes the last call left behind are gone: take up the next queued call."""

    TYPE: ClassVar[str] = "resume"

    def fields(self) -> list[Any]:
        return []


@dataclass(frozen=True, slots=True)
class Ping:
    """Liveness probe; the worker answers :class:`Pong` even while a body runs."""

    nonce: int
    TYPE: ClassVar[str] = "ping"

    def fields(self) -> list[Any]:
        return [self.nonce]


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Exit once no call is running; calls still queued in the worker are withdrawn."""

    TYPE: ClassVar[str] = "shutdown"

    def fields(self) -> list[Any]:
        return []


WorkerMessage: TypeAlias = (
    Hello
    | Fatal
    | StartedMessage
    | CancelAck
    | Withdrawn
    | ResultMessage
    | Pong
    | Heartbeat
    | ProgressMessage
)
SupervisorMessage: TypeAlias = CallMessage | Cancel | Recall | Resume | Ack | Ping | Shutdown


# --------------------------------------------------------------------------- codec


#: One packer for the call frames (``packb`` makes a new one per call). Only for
#: :func:`encode_call`: it packs an int, a str, bytes and an int, which never run Python code
#: (so never let another thread in while its buffer is in use); a message carrying a map
#: from a tool (a dict subclass's ``items``) might, so :func:`encode` uses ``packb``.
_pack: Final = msgpack.Packer(use_bin_type=True).pack


def encode(message: WorkerMessage | SupervisorMessage) -> bytes:
    """Encode one message as one frame."""
    return msgpack.packb([message.TYPE, *message.fields()], use_bin_type=True)


def encode_call(call_id: int, tool: str, args: bytes, acked: int, parts: int = 0) -> bytes:
    """The frame of ``CallMessage(call_id, tool, args, acked, parts)``, byte for byte what
    :func:`encode` makes of it, in one pack: no message object, no list of its fields (the
    supervisor's hot path; ``args`` is packed already, and goes in as it is). The ``parts``
    frames of the arguments follow it in the same message."""
    if parts:
        return _pack(["call", call_id, tool, args, acked, parts])
    return _pack(["call", call_id, tool, args, acked])


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


def pack_parts(value: Any, name: str = "the value") -> tuple[bytes, list[bytes]]:
    """Pack ``value`` as :func:`pack_value` does, but with each ``bytes`` or ``bytearray`` of
    at least :data:`PART_MIN` bytes (at most :data:`MAX_PARTS` of them) taken out as a part:
    the packed msgpack refers to it by index. A ``bytes`` part is the caller's object itself,
    not a copy (it is immutable); a ``bytearray`` is copied once, so a later change of the
    caller's does not reach the other side. Returns the packed value and its parts."""
    parts: list[bytes] = []
    out = _extract(value, parts, 0)
    if not parts:
        return pack_value(value, name), parts
    if _refusable(value):  # (before packing: an ext type of the caller's is refused, too)
        raise TypeError(_refused(value, name))
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
    if isinstance(value, dict):
        changed: dict[Any, Any] | None = None
        for key, inner in value.items():
            if type(inner) in _SCALARS:
                continue
            new = _extract(inner, parts, depth + 1)
            if new is not inner:
                if changed is None:
                    changed = dict(value)
                changed[key] = new
        return value if changed is None else changed
    if isinstance(value, (list, tuple)) and not isinstance(value, msgpack.ExtType):
        items: list[Any] | None = None
        for i, inner in enumerate(value):
            if type(inner) in _SCALARS:
                continue
            new = _extract(inner, parts, depth + 1)
            if new is not inner:
                if items is None:
                    items = list(value)
                items[i] = new
        return value if items is None else items
    return value


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


def _unpacker(max_len: int) -> Callable[[bytes], Any]:
    """msgpack.unpackb with the strict limits for frames of at most ``max_len`` bytes (one
    per limit, made once: not ten keywords parsed per frame)."""
    unpack = _UNPACKERS.get(max_len)
    if unpack is None:
        if len(_UNPACKERS) > 64:
            _UNPACKERS.clear()
        unpack = _UNPACKERS[max_len] = functools.partial(
            msgpack.unpackb,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_len,
            max_bin_len=max_len,
            max_array_len=min(max_len, 1 << 20),
            max_map_len=min(max_len, 1 << 20),
            max_ext_len=0,
            ext_hook=_reject_ext,
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
        # (msgpack's FormatError has no message: say what it means.)
        why = str(exc) or "not msgpack (a byte no msgpack value starts with)"
        raise ProtocolViolation(f"undecodable frame: {type(exc).__name__}: {why}") from None


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
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_len,
            max_bin_len=max_len,
            max_array_len=min(max_len, 1 << 20),
            max_map_len=min(max_len, 1 << 20),
            max_ext_len=_INDEX.size,
            ext_hook=part,
        )
    except ProtocolViolation:
        raise
    except Exception as exc:
        why = str(exc) or "not msgpack (a byte no msgpack value starts with)"
        raise ProtocolViolation(f"undecodable frame: {type(exc).__name__}: {why}") from None


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


def _amount(value: Any, what: str) -> float:
    """A progress amount: a finite, non-negative float (an int is accepted as one)."""
    if type(value) is int and 0 <= value <= _MAX_ID:
        return float(value)
    if type(value) is not float or not (0.0 <= value < math.inf):
        raise ProtocolViolation(f"{what} must be a finite, non-negative number")
    return value


def _frame(frame: bytes, max_len: int) -> tuple[str, list[Any]]:
    data = _unpack(frame, max_len)
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ProtocolViolation("a frame is an array whose first element is the message type")
    return data[0], data[1:]


#: The documented extras of a result and their types (others are ignored).
_EXTRAS: dict[Any, type] = {
    "cpu_time": float,
    "max_rss": int,
    "output": bytes,
    "output_dropped": int,
    "started_at": float,
    "kept": bool,
    "spill": list,
}


_new = object.__new__


def _slot_maker(cls: type) -> Callable[..., Any]:
    """A maker of ``cls`` (a frozen dataclass with slots) from all its fields, slot by slot
    (its frozen __init__ sets each through object.__setattr__: three times the cost, on the
    hot path)."""
    slots = tuple(cls.__slots__)  # type: ignore[attr-defined]
    ns: dict[str, Any] = {f"_set_{n}": cls.__dict__[n].__set__ for n in slots}
    ns.update(_new=_new, cls=cls)
    exec(
        "\n".join(
            (
                "def make(" + ", ".join(slots) + "):",
                "    msg = _new(cls)",
                *(f"    _set_{n}(msg, {n})" for n in slots),
                "    return msg",
            )
        ),
        ns,
    )
    return ns["make"]  # type: ignore[no-any-return]


#: A ResultMessage of its 9 checked fields.
_result_message: Final[Callable[..., ResultMessage]] = _slot_maker(ResultMessage)
#: A CallMessage of its checked fields, its parts (the data) last.
_call_message: Final[Callable[..., CallMessage]] = _slot_maker(CallMessage)


def decode_from_worker(frame: bytes, *, max_len: int = DEFAULT_MAX_FRAME) -> WorkerMessage:
    """Decode and validate one frame a worker sent. Raises :class:`ProtocolViolation`."""
    data = _unpack(frame, max_len)
    # A result, the most frequent frame, checked inline: what the general path below checks,
    # in the same order (anything unusual goes that way, to fail there with its reason).
    if type(data) is list and len(data) == 10 and data[0] == "result":
        call_id, outcome, value, error, error_name, started, context, leftovers, extras = data[1:]
        if (
            type(extras) is dict
            and type(outcome) is str
            and outcome in OUTCOME_NAMES
            and type(started) is bool
            and type(context) is dict
            and type(call_id) is int
            and 0 <= call_id <= _MAX_ID
            and (value is None or type(value) is bytes)
            and (error is None or (type(error) is str and len(error) <= _MAX_TEXT))
            and (error_name is None or (type(error_name) is str and len(error_name) <= _MAX_NAME))
            and type(leftovers) is int
            and 0 <= leftovers <= _MAX_ID
        ):
            for k, v in extras.items():
                t = _EXTRAS.get(k)
                if t is not None and type(v) is not t:
                    break
            else:
                for k in context:
                    if type(k) is not str:
                        break
                else:
                    if "spill" in extras:
                        check_spill(extras["spill"], max_len, len(frame))
                    return _result_message(
                        call_id,
                        outcome,
                        value,
                        error,
                        error_name,
                        started,
                        context,
                        leftovers,
                        extras,
                    )
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ProtocolViolation("a frame is an array whose first element is the message type")
    kind, body = data[0], data[1:]
    if kind == "result":
        _arity(body, 9, kind)
        extras = body[8]
        if type(extras) is not dict or not all(
            type(v) is _EXTRAS.get(k, type(v)) for k, v in extras.items()
        ):
            raise ProtocolViolation("extras must be a map of the documented fields and types")
        outcome = body[1]
        if type(outcome) is not str or outcome not in OUTCOME_NAMES:
            raise ProtocolViolation(f"unknown outcome {outcome!r}")
        if type(body[5]) is not bool:
            raise ProtocolViolation("body_started must be a boolean")
        if type(body[6]) is not dict or not all(type(k) is str for k in body[6]):
            raise ProtocolViolation("context must be a map with string keys")
        if "spill" in extras:
            check_spill(extras["spill"], max_len, len(frame))
        return ResultMessage(
            _int_id(body[0], "call_id"),
            outcome,
            _bin(body[2], "value", optional=True),
            _text(body[3], "error", optional=True),
            _text(body[4], "error_name", _MAX_NAME, optional=True),
            body[5],
            body[6],
            _int_id(body[7], "leftovers"),
            extras,
        )
    if kind == "started":
        _arity(body, 1, kind)
        return StartedMessage(_int_id(body[0], "call_id"))
    if kind == "cancel_ack":
        _arity(body, 1, kind)
        return CancelAck(_int_id(body[0], "call_id"))
    if kind == "withdrawn":
        _arity(body, 1, kind)
        return Withdrawn(_int_id(body[0], "call_id"))
    if kind == "pong":
        _arity(body, 1, kind)
        return Pong(_int_id(body[0], "nonce"))
    if kind == "heartbeat":
        _arity(body, 0, kind)
        return Heartbeat()
    if kind == "progress":
        _arity(body, 4, kind)
        return ProgressMessage(
            _int_id(body[0], "call_id"),
            _amount(body[1], "done"),
            None if body[2] is None else _amount(body[2], "total"),
            _text(body[3], "message", MAX_PROGRESS_MESSAGE, optional=True),
        )
    if kind == "hello":
        _arity(body, 5, kind)
        report = body[4]
        if type(report) is not dict or not all(
            type(k) is str and type(v) is list and len(v) == 2 and type(v[0]) is bool
            for k, v in report.items()
        ):
            raise ProtocolViolation("containment must map layer names to [active, detail]")
        if type(body[3]) is not list or not all(type(t) is dict for t in body[3]):
            raise ProtocolViolation("tools must be an array of maps")
        for tool in body[3]:
            if not _text(tool.get("name"), "tool name", _MAX_NAME):
                raise ProtocolViolation("a tool name must not be empty")
            if type(tool.get("runs_in_thread", False)) is not bool:
                raise ProtocolViolation("runs_in_thread must be a boolean")
        return Hello(
            _int_id(body[0], "version"),
            _int_id(body[1], "pid"),
            _bin(body[2], "secret"),
            body[3],
            report,
        )
    if kind == "fatal":
        _arity(body, 2, kind)
        return Fatal(_bin(body[0], "secret"), _text(body[1], "error"))
    raise ProtocolViolation(f"unknown message type {kind[:64]!r}")


def decode_from_supervisor(frame: bytes, *, max_len: int = DEFAULT_MAX_FRAME) -> SupervisorMessage:
    """Decode one frame the supervisor sent (the worker validates it too)."""
    kind, body = _frame(frame, max_len)
    if kind == "call":
        if len(body) != 5:
            _arity(body, 4, kind)
            parts = 0
        else:
            parts = _int_id(body[4], "parts")
            if not 1 <= parts <= MAX_PARTS:
                raise ProtocolViolation(f"a call has 1 to {MAX_PARTS} parts, or no field for them")
        return _call_message(
            _int_id(body[0], "call_id"),
            _text(body[1], "tool", _MAX_NAME),
            _bin(body[2], "args"),
            _int_id(body[3], "acked"),
            parts,
            (),
        )
    if kind == "ack":
        _arity(body, 1, kind)
        return Ack(_int_id(body[0], "results"))
    if kind == "cancel":
        _arity(body, 2, kind)
        cause = body[1]
        if (
            type(cause) is not dict
            or list(cause) != ["kind"]
            or type(cause["kind"]) is not str
            or cause["kind"] not in _CAUSE_KINDS
        ):
            raise ProtocolViolation(f"invalid cancel cause {cause!r}")
        return Cancel(_int_id(body[0], "call_id"), cause["kind"])
    if kind == "recall":
        _arity(body, 1, kind)
        return Recall(_int_id(body[0], "call_id"))
    if kind == "resume":
        _arity(body, 0, kind)
        return Resume()
    if kind == "ping":
        _arity(body, 1, kind)
        return Ping(_int_id(body[0], "nonce"))
    if kind == "shutdown":
        _arity(body, 0, kind)
        return Shutdown()
    raise ProtocolViolation(f"unknown message type {kind[:64]!r}")


def decode_supervisor_frames(
    frames: Sequence[Any], *, max_len: int = DEFAULT_MAX_FRAME
) -> list[SupervisorMessage]:
    """Decode the frames of one message the supervisor sent (each a frame of its own, or
    the parts of the ``call`` before them). A frame is ``bytes`` or a buffer (a zmq frame
    received without a copy); a part becomes ``bytes``, its one copy. Raises
    :class:`ProtocolViolation`: also for a call whose parts are missing, or whose frame and
    parts exceed ``max_len`` in all."""
    out: list[SupervisorMessage] = []
    i, count = 0, len(frames)
    while i < count:
        frame = frames[i]
        msg = decode_from_supervisor(frame, max_len=max_len)
        i += 1
        if type(msg) is CallMessage and msg.parts:
            if count - i < msg.parts:
                raise ProtocolViolation(
                    f"call {msg.call_id} has {msg.parts} parts, and {count - i} follow it"
                )
            data = tuple(bytes(part) for part in frames[i : i + msg.parts])
            i += msg.parts
            total = len(frame) + sum(len(part) for part in data)
            if total > max_len:
                raise ProtocolViolation(
                    f"call of {total} bytes with its parts exceeds the limit of {max_len}"
                )
            msg = _call_message(msg.call_id, msg.tool, msg.args, msg.acked, msg.parts, data)
        out.append(msg)
    return out
