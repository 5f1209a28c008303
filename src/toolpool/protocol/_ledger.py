"""The ledger: a small file the supervisor creates per worker and the worker maps as shared
memory, so what it writes there reaches the supervisor even if it dies the next instant (a
message it sent may still sit in its zmq queue when it is killed). See ``docs/protocol.md``.

Layout (all integers little-endian u64):

- offset 0: 1 + the id of the call the worker last took up (0: none yet);
- offset 8: 1 + the id of the call whose body it last invoked (0: none yet);
- offset :data:`SLOTS_AT` + i * :data:`SLOT_SIZE`, for i < :data:`SLOTS`: a kept result: its
  sequence number among the worker's results (1, 2, ...; 0: empty), the frame's length, then
  the frame (a ``result`` message exactly as sent);
- offset :data:`SPILL_AT` to the end of the file (:func:`spill_size` bytes): the *spill*, the
  parts of kept results' values (large byte strings), where a result's ``extras["spill"]``
  says. The worker uses it as a ring: a region is free again once its result is acknowledged.

The worker writes; the supervisor reads only once the worker is gone, and validates what it
reads like any frame from a worker: the file is the worker's to scribble on.
"""

from __future__ import annotations

import struct
import sys
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import mmap

    from _typeshed import WriteableBuffer

__all__ = (
    "LEDGER_SIZE",
    "SLOTS",
    "SLOT_PAYLOAD",
    "SPILL_AT",
    "INVOKED_WORD",
    "TAKEN_WORD",
    "read_ledger",
    "read_marks",
    "slot_words",
    "spill_size",
    "words",
    "write_invoked",
    "write_parts",
    "write_slot",
    "write_taken",
)

_U64: Final = struct.Struct("<Q")
_MARKS: Final = struct.Struct("<QQ")
SLOTS_AT: Final = 4096
SLOT_SIZE: Final = 32 * 1024  # 10 KiB results fit: no round trip for them
SLOTS: Final = 32  # HOLD_BACK results held back and a queue of them in flight
#: The largest result frame a slot keeps; a larger one is not kept.
SLOT_PAYLOAD: Final = SLOT_SIZE - 16
LEDGER_SIZE: Final = SLOTS_AT + SLOTS * SLOT_SIZE
#: Where the spill begins: after the slots (the file is LEDGER_SIZE + spill_size bytes).
SPILL_AT: Final = LEDGER_SIZE


def spill_size(max_frame: int) -> int:
    """The spill's size for frames of at most ``max_frame`` bytes: room for two of the
    largest results at once (one unacknowledged while the next is kept). The file is sparse:
    a page takes memory only once a result was written there."""
    return 2 * max_frame


def write_parts(buf: WriteableBuffer, at: int, parts: tuple[bytes, ...]) -> None:
    """Write a result's ``parts`` back to back at offset ``at`` of the spill (before its
    slot: a worker killed half-way leaves no slot that points here)."""
    view = memoryview(buf)
    at += SPILL_AT
    for part in parts:
        view[at : at + len(part)] = part
        at += len(part)


def write_taken(buf: WriteableBuffer, call_id: int) -> None:
    """The worker takes up ``call_id`` (its body is not invoked yet)."""
    _MARKS.pack_into(buf, 0, call_id + 1, 0)


def write_invoked(buf: WriteableBuffer, call_id: int) -> None:
    """The worker is about to invoke the body of ``call_id``."""
    _U64.pack_into(buf, 8, call_id + 1)


def write_slot(buf: mmap.mmap | bytearray, slot: int, seq: int, frame: bytes) -> None:
    """Keep ``frame``, the worker's result number ``seq``, in ``slot``. The sequence number
    goes last: a worker killed half-way leaves the slot's old, already received, number.
    (Into ``buf`` itself, no memoryview of it: once a call.)"""
    at = SLOTS_AT + slot * SLOT_SIZE
    buf[at + 16 : at + 16 + len(frame)] = frame
    _U64.pack_into(buf, at + 8, len(frame))
    _U64.pack_into(buf, at, seq)


#: The marks as words of :func:`words`: 1 + the id of the call taken up, of the call invoked.
TAKEN_WORD: Final = 0
INVOKED_WORD: Final = 1


class _Words:
    """:func:`words` on a big-endian machine: each word packed little-endian."""

    def __init__(self, buf: WriteableBuffer) -> None:
        self.buf = buf

    def __setitem__(self, index: int, value: int) -> None:
        _U64.pack_into(self.buf, index * 8, value)

    def release(self) -> None:
        pass


def words(buf: mmap.mmap | bytearray) -> Any:
    """The ledger ``buf`` as little-endian u64 words, for the worker's writes, once a call
    each (what :func:`write_taken`, :func:`write_invoked` and :func:`write_slot` write, the
    same bytes in the same order): a word is written by an item assignment,
    ``view[INVOKED_WORD] = call_id + 1``, a store into the mapping, without a struct call or a
    Python frame (a third of their cost). The view exports ``buf``: ``release()`` it before
    ``buf`` is closed."""
    if sys.byteorder == "little":
        return memoryview(buf).cast("Q")
    return _Words(buf)


def slot_words(slot: int) -> tuple[int, int, int]:
    """Where :func:`write_slot` writes in ``slot``, for :func:`words`: the index of its
    sequence number's word, that of its length's, and the offset of its frame. Write the
    frame, then the length, then the sequence number (last: a worker killed half-way leaves
    the slot's old, already received, number)."""
    at = SLOTS_AT + slot * SLOT_SIZE
    return at // 8, at // 8 + 1, at + 16


def read_marks(data: bytes) -> tuple[int, int] | None:
    """The two marks from the first 16 bytes of a ledger, or None if they are missing."""
    if len(data) < _MARKS.size:
        return None
    taken, invoked = _MARKS.unpack_from(data, 0)
    return taken, invoked


def read_ledger(data: bytes) -> tuple[int, int, list[tuple[int, bytes]]]:
    """Parse a ledger's bytes: (taken, invoked, [(seq, frame) of each kept result, by seq]).
    Lengths are checked; frames are not decoded."""
    marks = read_marks(data)
    if marks is None or len(data) < SLOTS_AT:
        return 0, 0, []
    taken, invoked = marks
    kept: list[tuple[int, bytes]] = []
    for slot in range(SLOTS):
        at = SLOTS_AT + slot * SLOT_SIZE
        if len(data) < at + 16:
            break
        seq, length = _MARKS.unpack_from(data, at)
        if seq and length <= SLOT_PAYLOAD and len(data) >= at + 16 + length:
            kept.append((seq, data[at + 16 : at + 16 + length]))
    kept.sort()
    return taken, invoked, kept
