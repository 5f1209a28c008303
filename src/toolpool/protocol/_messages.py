"""Wire messages between the supervisor and a worker, and their strict codec.

A leaf: stdlib and msgpack only. Every frame is one msgpack array whose first element names
the message type. Frames from a worker are untrusted (CONTRACT C7): :func:`decode_from_worker`
enforces size and shape limits and raises :class:`ProtocolViolation` on anything else.
See ``docs/protocol.md`` for the specification.
"""

from __future__ import annotations

import math
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
from ._values import (
    _SMALL,
    _UNPACKERS,
    DEFAULT_MAX_FRAME,
    MAX_PARTS,
    PART_EXT,
    PART_MIN,
    _undecodable,
    _unpack,
    _unpackb,
    _unpacker,
    check_spill,
    pack_parts,
    pack_value,
    unpack_args,
    unpack_value,
)

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
    "ResultArray",
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
    "new_result",
    "pack_parts",
    "pack_value",
    "result_encoder",
    "result_array_encoder",
    "unpack_args",
    "unpack_value",
)

#: The wire protocol's version; separate from the package version.
PROTOCOL_VERSION: Final = 4


#: Outcomes a worker may report (``killed`` and ``worker_lost`` are the supervisor's to say).
OUTCOME_NAMES: Final = frozenset(
    {"ok", "error", "denied", "aborted_before_dispatch", "aborted", "timeout"}
)
_CAUSE_KINDS: Final = frozenset({"user", "parent", "disposed", "timeout"})
#: The longest ``message`` a progress report carries (characters).
MAX_PROGRESS_MESSAGE: Final = 1024
#: A worker sends a call's progress at most this often (seconds; the latest report wins).
PROGRESS_INTERVAL: Final = 0.05


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


def result_encoder() -> Callable[[ResultMessage], bytes]:
    """An encoder of results: the frame of a ``ResultMessage``, byte for byte what
    :func:`encode` makes of it, in one pack with a packer of its own (``packb`` makes one per
    frame), for one thread at a time (the worker's machine, under its shell's lock: a map of
    the result's may run Python code while it is packed)."""
    pack = msgpack.Packer(use_bin_type=True).pack

    def encode_result(m: ResultMessage) -> bytes:
        fields = [
            "result",
            m.call_id,
            m.outcome,
            m.value,
            m.error,
            m.error_name,
            m.body_started,
            m.context,
            m.leftovers,
            m.extras,
        ]
        return pack(fields)

    return encode_result


#: A result's frame as the array it packs to: ``ResultMessage.TYPE`` ("result"), then the
#: message's nine fields in order (call_id, outcome, value, error, error_name, body_started,
#: context, leftovers, extras).
ResultArray: TypeAlias = tuple[
    str, int, str, bytes | None, str | None, str | None, bool, dict[str, Any], int, dict[str, Any]
]


def result_array_encoder() -> Callable[[ResultArray], bytes]:
    """An encoder of a result's array (:data:`ResultArray`): the frame of
    ``ResultMessage(*array[1:])``, byte for byte what :func:`encode` makes of it, with no
    message made and no Python frame (a packer's own ``pack``, of its own: a tuple packs as
    the list ``encode`` packs), for one thread at a time. The worker's machine's, for every
    call's result: a message costs as much as its frame's pack."""
    return msgpack.Packer(use_bin_type=True).pack


def _amount(value: Any, what: str) -> float:
    """A progress amount: a finite, non-negative float (an int is accepted as one)."""
    if type(value) is int and 0 <= value <= _MAX_ID:
        return float(value)
    if type(value) is not float or not (0.0 <= value < math.inf):
        raise ProtocolViolation(f"{what} must be a finite, non-negative number")
    return value


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


def _twin_maker(cls: type) -> Callable[..., Any]:
    """A maker of ``cls`` (a frozen dataclass with slots) from all its fields, positional, at
    half the cost of :func:`_slot_maker`'s (a fourth of its own __init__'s): an instance of a
    twin class, with the same slots but not frozen (its __init__ stores each field as a plain
    attribute store does), that takes ``cls`` as its class once they are set (the same slots:
    the same layout, which is what an assignment to ``__class__`` checks). The maker is the
    twin class itself: what it makes is a ``cls``."""
    slots = tuple(cls.__slots__)  # type: ignore[attr-defined]
    ns: dict[str, Any] = {"cls": cls}
    exec(
        "\n".join(
            (
                f"class {cls.__name__}:",
                f"    __slots__ = {slots!r}",
                "    def __init__(self, " + ", ".join(slots) + "):",
                *(f"        self.{n} = {n}" for n in slots),
                "        self.__class__ = cls",
            )
        ),
        ns,
    )
    return ns[cls.__name__]  # type: ignore[no-any-return]


#: ``ResultMessage(...)`` of all its 9 fields, positional, at a fourth of the cost (the
#: worker's, for every call's result).
new_result: Final[Callable[..., ResultMessage]] = _twin_maker(ResultMessage)
#: The worker's CallMessage of its checked fields, its parts (the data) last.
_new_call: Final[Callable[..., CallMessage]] = _twin_maker(CallMessage)
#: A ResultMessage of its 9 checked fields (the supervisor's decode).
_result_message: Final[Callable[..., ResultMessage]] = new_result
#: A CallMessage of its checked fields, its parts (the data) last.
_call_message: Final[Callable[..., CallMessage]] = _slot_maker(CallMessage)


def decode_from_worker(frame: bytes, *, max_len: int = DEFAULT_MAX_FRAME) -> WorkerMessage:
    """Decode and validate one frame a worker sent. Raises :class:`ProtocolViolation`."""
    # (_unpack, inline: once per frame of the supervisor's hot path)
    if len(frame) > max_len:
        raise ProtocolViolation(f"frame of {len(frame)} bytes exceeds the limit of {max_len}")
    unpack = _UNPACKERS.get(max_len) or _unpacker(max_len)
    try:
        data = unpack(frame)
    except ProtocolViolation:
        raise
    except Exception as exc:  # msgpack raises many types: ExtraData, StackError, ValueError...
        raise _undecodable(exc) from None
    # A result, the most frequent frame, checked inline: what the general path below checks,
    # in the same order (anything unusual goes that way, to fail there with its reason).
    if type(data) is list and len(data) == 10 and data[0] == "result":
        _, call_id, outcome, value, error, error_name, started, context, leftovers, extras = data
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
    size = len(frame)  # (_unpack_small, inline: once a call)
    if size > _SMALL or size > max_len:
        data = _unpack(frame, max_len)
    else:
        try:
            data = _unpackb(frame, max_ext_len=0)
        except Exception as exc:
            raise _undecodable(exc) from None
    # A call without parts, the most frequent frame, checked inline: what the general path
    # below checks (anything unusual goes that way, to fail there with its reason).
    if type(data) is list and len(data) == 5 and data[0] == "call":
        _, call_id, tool, args, acked = data
        if (
            type(call_id) is int
            and 0 <= call_id <= _MAX_ID
            and type(tool) is str
            and len(tool) <= _MAX_NAME
            and type(args) is bytes
            and type(acked) is int
            and 0 <= acked <= _MAX_ID
        ):
            return _new_call(call_id, tool, args, acked, 0, ())
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ProtocolViolation("a frame is an array whose first element is the message type")
    kind, body = data[0], data[1:]
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
