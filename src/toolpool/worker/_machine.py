"""The worker's decisions, sans I/O: the ``WorkerMachine`` takes events and returns actions.

What the worker does with the messages it reads and the calls it runs is decided here: the
queue of calls (taken up in order, one at a time), withdraw and recall of a queued call, a
cancel of the running one, shutdown, holding until ``resume`` after a call that left
processes behind, acks and the ledger's slots, holding back results (kept in the ledger)
while quick calls follow, and not taking up a call while a result that is not kept is unacked,
'started', heartbeats and progress. It reads no clock (an event that needs the time carries
``now``), touches no socket, file or process, and starts no thread
(``tests/test_core_is_sans_io.py``).

The shell, ``_server.py``, turns the socket, the ledger, the body's run and the clock into
events and performs the actions (``SendFrames``, ``RunCall``, ``MarkInvoked``, ``KeepResult``,
``FireCancel``); its locking and its two threads are its own.
The simulation (``tests/sim_world.py``) drives this same machine for its modelled workers.

The worker is in one of three phases (``PHASE_MOVES``): ``idle`` (no call taken up), ``running``
(a call taken up: its body runs, or is about to), ``held`` (the last call left processes
behind: nothing is taken up until ``resume``). It moves only through :meth:`advance`, which
raises :class:`IllegalPhaseMove` on a move the table does not have (``next`` and ``conclude``,
once a call each, make theirs inline: IDLE -> RUNNING, RUNNING -> IDLE, in the table, a test
says; the shell's loop makes ``next``'s take-up inline too, deciding by :meth:`_may_take` as
``next`` does, and calls ``next`` where it takes nothing up); :meth:`check` asserts the
invariants between its fields.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import math
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

from ..protocol import (
    PROGRESS_INTERVAL,
    Ack,
    CallMessage,
    Cancel,
    CancelAck,
    Heartbeat,
    Ping,
    Pong,
    ProgressMessage,
    Recall,
    ResultArray,
    ResultMessage,
    Resume,
    Shutdown,
    StartedMessage,
    Withdrawn,
    encode,
    new_result,
    pack_value,
    result_array_encoder,
    result_encoder,
    unpack_value,
)
from ..protocol._ledger import SLOT_PAYLOAD, SLOTS

__all__ = (
    "HOLD_BACK",
    "BrokenWorkerInvariant",
    "PHASE_MOVES",
    "FireCancel",
    "IllegalPhaseMove",
    "KeepResult",
    "MarkInvoked",
    "Phase",
    "RunCall",
    "SendFrames",
    "SpillParts",
    "WorkerAction",
    "WorkerMachine",
)

#: At most this many results are held back while the next queued calls run quickly.
HOLD_BACK: Final = 16


class Phase(enum.Enum):
    """Where the worker is, between calls or in one."""

    IDLE = "idle"
    """No call taken up: the next queued one is, as soon as it may be."""
    RUNNING = "running"
    """A call is taken up: its body runs (or is about to, or just returned)."""
    HELD = "held"
    """The last call left processes behind: nothing is taken up until ``resume``."""


#: The worker's legal moves: from each phase, where it may go (:meth:`WorkerMachine.advance`).
PHASE_MOVES: Final[dict[Phase, frozenset[Phase]]] = {
    Phase.IDLE: frozenset((Phase.RUNNING,)),
    Phase.RUNNING: frozenset((Phase.IDLE, Phase.HELD)),
    Phase.HELD: frozenset((Phase.IDLE,)),
}
# By name, as tuples: a member's hash is computed in Python (``Enum.__hash__``), and a tuple's
# ``in`` compares members by identity first (``advance`` is on every call's path).
_NEXT: Final = {old._name_: tuple(news) for old, news in PHASE_MOVES.items()}
_IDLE, _RUNNING, _HELD = Phase.IDLE, Phase.RUNNING, Phase.HELD


class IllegalPhaseMove(RuntimeError):
    """The worker was asked to move where ``PHASE_MOVES`` does not let it: a bug of the
    machine, never the supervisor's doing."""


class BrokenWorkerInvariant(AssertionError):
    """An invariant of the worker's machine broke (:meth:`WorkerMachine.check`)."""


def _require(holds: bool, *what: object) -> None:
    if not holds:
        raise BrokenWorkerInvariant(*what)


# Actions: what the machine asks the shell to do, in order.


class SendFrames(NamedTuple):
    """Send ``frames`` as one message (one frame, or several results held back)."""

    frames: list[bytes]


class MarkInvoked(NamedTuple):
    """Mark ``call_id``'s body invoked in the ledger (before it is)."""

    call_id: int


class KeepResult(NamedTuple):
    """Keep ``frame``, the worker's result number ``seq``, in ledger slot ``slot``."""

    slot: int
    seq: int
    frame: bytes


class SpillParts(NamedTuple):
    """Write a result's ``parts`` back to back at offset ``at`` of the ledger's spill (before
    its slot is written and before it is sent)."""

    at: int
    parts: tuple[bytes, ...]


class FireCancel(NamedTuple):
    """Cancel the running call's signal with ``cause`` (outside any lock of the shell's: its
    callbacks may wait on the event loop)."""

    call_id: int
    cause: str


class RunCall(NamedTuple):
    """Run ``msg``, taken up now: first, if ``mark``, mark it taken up in the ledger (before
    anything of it runs)."""

    msg: CallMessage
    mark: bool


WorkerAction = SendFrames | RunCall | MarkInvoked | KeepResult | SpillParts | FireCancel
#: No action (the most frequent answer: shared, never changed).
_NONE: Final[Sequence[WorkerAction]] = ()
#: The actions of every call (RunCall, KeepResult, SendFrames) are made as ``_new(Kind,
#: (fields...))``: a NamedTuple's own ``__new__`` is Python code, three times a call.
_new: Final = tuple.__new__


class WorkerMachine:
    """The worker's decisions (see the module's doc). Each event method returns the actions
    it asks for, in order (a shared empty tuple when none: the returned sequence is read,
    never changed)."""

    def __init__(
        self,
        *,
        max_frame: int,
        ledger: bool,
        heartbeat: float = 0.0,
        allow_background: bool = False,
        spill: int = 0,
    ) -> None:
        self.max_frame = max_frame
        self.ledger = ledger  # results can be kept (the shell has a ledger)
        # The ledger's spill (bytes): the parts of kept results' values, used as a ring; each
        # region (its result's number, start, end) is free again once that result is acked.
        self.spill = spill if ledger else 0
        self.spilled: collections.deque[tuple[int, int, int]] = collections.deque()
        self.allow_background = allow_background  # leftovers are allowed: never hold
        self.phase = _IDLE
        self.queue: collections.deque[CallMessage] = collections.deque()
        self.current: int | None = None  # the call taken up
        self.said_started: int | None = None  # the call whose 'started' went out
        self.shutdown = False
        self.results = 0  # results concluded so far (each numbered: its seq)
        self.acked = 0  # how many of them the supervisor said it received
        self.need_ack = 0  # the last result not kept in the ledger: wait until it is acked
        self.slots = [0] * SLOTS  # the result number each ledger slot keeps
        self.pending: list[bytes] = []  # results kept in the ledger, held back (HOLD_BACK)
        # Liveness: a heartbeat every `heartbeat` seconds (0: none).
        self.heartbeat = heartbeat
        self.beat_due = 0.0 if heartbeat > 0 else math.inf
        # Progress: the body's latest report (call id, done, total, message).
        self.progress: tuple[str, float, float | None, str | None] | None = None
        self.progress_new = False
        self.progress_sent_at = -math.inf
        # A result's frame (as ``encode`` makes it, in one pack, with a packer of its own:
        # the machine is used by one thread at a time).
        self._encode_result = result_encoder()
        self._encode_array = result_array_encoder()

    # The table.

    def advance(self, to: Phase) -> None:
        """Move to ``to``, if ``PHASE_MOVES`` lets it (staying is no move); else
        :class:`IllegalPhaseMove`."""
        if to is not self.phase and to not in _NEXT[self.phase._name_]:
            raise IllegalPhaseMove(f"worker: {self.phase.value} -> {to.value} is not a legal move")
        self.phase = to

    def check(self) -> None:
        """The invariants between its fields (:class:`BrokenWorkerInvariant` where one
        broke: a bug of the machine)."""
        phase = self.phase
        # A call is taken up exactly while running, and is no longer queued.
        _require((phase is _RUNNING) == (self.current is not None), phase, self.current)
        _require(all(m.call_id != self.current for m in self.queue), self.current)
        # Held only for leftovers that are not allowed.
        _require(not (phase is _HELD and self.allow_background), phase)
        # Acks count results that were sent; an unkept result is one of them.
        _require(0 <= self.need_ack <= self.results, self.need_ack, self.results)
        _require(self.acked <= self.results, self.acked, self.results)
        # Slots keep distinct results, each one concluded; held back only what is kept.
        kept = [seq for seq in self.slots if seq]
        _require(len(kept) == len(set(kept)), self.slots)
        _require(all(seq <= self.results for seq in kept), self.slots)
        _require(len(self.pending) <= HOLD_BACK, len(self.pending))
        _require(self.ledger or not self.pending, "held back a result without a ledger")
        # Spilled regions lie in the spill, in order of their results, and never overlap.
        regions = list(self.spilled)
        _require(all(0 <= a < b <= self.spill for _, a, b in regions), regions)
        _require(all(s <= self.results for s, _, _ in regions), regions)
        _require(all(x[0] < y[0] for x, y in itertools.pairwise(regions)), regions)
        spans = sorted((a, b) for _, a, b in regions)
        _require(all(x[1] <= y[0] for x, y in itertools.pairwise(spans)), regions)

    @property
    def done(self) -> bool:
        """Told to shut down, and no call runs: the worker exits."""
        return self.shutdown and self.phase is not _RUNNING

    def _may_take(self) -> bool:  # (hostile_tools.py patches it)
        # Not while a result that is in neither the ledger nor the supervisor's hands.
        return not self.shutdown and len(self.queue) > 0 and self.acked >= self.need_ack

    # Events.

    def receive(self, msg: Any) -> Sequence[WorkerAction]:
        """A message from the supervisor (decoded, checked)."""
        if type(msg) is CallMessage or isinstance(msg, CallMessage):  # (the first: cheaper)
            if msg.acked > self.acked:
                self.acked = msg.acked
            self.queue.append(msg)  # taken up in order
            return _NONE
        if isinstance(msg, Ack):
            if msg.results > self.acked:
                self.acked = msg.results
            return _NONE
        out: list[WorkerAction] = []
        if isinstance(msg, Cancel):
            if self.current == msg.call_id:
                self._send(out, encode(CancelAck(msg.call_id)))
                out.append(FireCancel(msg.call_id, msg.cause))
            else:
                self._withdraw(out, msg.call_id)  # still queued: it never starts
        elif isinstance(msg, Recall):
            self._withdraw(out, msg.call_id)
        elif isinstance(msg, Resume):
            if self.phase is _HELD:
                self.advance(_IDLE)
        elif isinstance(msg, Ping):
            self._send(out, encode(Pong(msg.nonce)))
        elif isinstance(msg, Shutdown):
            self.shutdown = True
            while self.queue:
                self._withdraw(out, self.queue[0].call_id)
        return out

    def next(self) -> Sequence[WorkerAction]:
        """No call runs: take up the next queued call, if it may be (``RunCall``); if not,
        what was held back goes now."""
        if not (self.phase is _IDLE and self._may_take()):
            # A result sent is in neither the ledger nor the supervisor's hands yet, or
            # nothing is taken up now: what was held back goes at once.
            return self.flush()
        msg = self.queue.popleft()
        self.phase = _RUNNING  # (advance's move, inline: IDLE -> RUNNING, in the table)
        self.current = msg.call_id
        return (_new(RunCall, (msg, self.ledger)),)

    def invoked(self, call_id: int, is_async: bool) -> Sequence[WorkerAction]:
        """The body is about to be invoked: the ledger says so first. An async body is said
        'started' at once; a sync one once it has run a while (:meth:`body_running`)."""
        out: list[WorkerAction] = [MarkInvoked(call_id)] if self.ledger else []
        if is_async:
            self.said_started = call_id
            self._send(out, encode(StartedMessage(call_id)))
        return out

    def body_running(self, call_id: int) -> Sequence[WorkerAction]:
        """The invoked body has run past the quick wait: say 'started' (once), after what was
        held back; else send what was held back."""
        if self.said_started != call_id and self.current == call_id:
            self.said_started = call_id
            out: list[WorkerAction] = []
            self._send(out, encode(StartedMessage(call_id)))
            return out
        return self.flush()

    def conclude(self, reply: ResultMessage, parts: Sequence[bytes] = ()) -> Sequence[WorkerAction]:
        """The running call is over with ``reply`` (its ``leftovers`` counted by the shell;
        ``extras`` changed in place): keep it in a ledger slot if one is free and it fits,
        and send it, or hold it back while another call is queued. ``parts``: those of its
        packed value (``protocol.pack_parts``), kept in the spill where there is room."""
        array: ResultArray = (
            reply.TYPE,
            reply.call_id,
            reply.outcome,
            reply.value,
            reply.error,
            reply.error_name,
            reply.body_started,
            reply.context,
            reply.leftovers,
            reply.extras,
        )
        return self.conclude_array(array, parts)

    def conclude_array(
        self, array: ResultArray, parts: Sequence[bytes] = ()
    ) -> Sequence[WorkerAction]:
        """:meth:`conclude` of ``ResultMessage(*array[1:])``, given as the array its frame
        packs to (``protocol.ResultArray``), with no message made unless a rare path needs one
        (parts, a frame too large): the shell's, once a call (a message costs as much as its
        frame's pack)."""
        _, call_id, _, value, _, _, _, _, leftovers, extras = array
        if self.current != call_id:
            raise IllegalPhaseMove(f"worker: concluded call {call_id}, not {self.current}")
        # Left processes behind: take up nothing more until the supervisor killed them.
        held = leftovers > 0 and not self.allow_background
        if held:
            self.advance(_HELD)
        else:  # (advance's move, inline: RUNNING -> IDLE, in the table; once a call)
            self.phase = _IDLE
        self.current = None
        self.progress = None  # the result says the rest: a report not sent yet is dropped
        self.progress_new = False
        # A value too large for a ledger slot however it is framed is not kept (nor framed
        # twice to find out).
        slot = None
        if self.ledger and (value is None or len(value) <= SLOT_PAYLOAD):
            # (_free_slot, inline: once a call.)
            acked = self.acked
            for i, seq in enumerate(self.slots):
                if seq <= acked:
                    slot = i
                    break
        results = self.results = self.results + 1
        spill_at = None
        reply: ResultMessage | None = None  # (made where a rare path needs it)
        if parts:
            reply = new_result(*array[1:])
            need = sum(len(p) for p in parts)
            if slot is not None and len(reply.value or b"") + need <= self.max_frame - 1024:
                spill_at = self._spill_room(need)
            if spill_at is not None:
                extras["spill"] = [spill_at, [len(p) for p in parts]]
                extras["kept"] = True
                if len(self._encode_result(reply)) + need > self.max_frame:
                    # With its output or context, the result and its parts exceed max_frame:
                    # inline, so that within() below cuts them as it always did.
                    del extras["spill"]
                    spill_at = None
            if spill_at is None:
                # No room (or too large, or no slot): the value goes inline, as without a
                # spill; a copy, on a rare path (within() below cuts what is too large).
                value = unpack_value(reply.value or b"\xc0", self.max_frame, parts)
                reply = dataclasses.replace(reply, value=pack_value(value))
                slot = None if len(reply.value or b"") > SLOT_PAYLOAD else slot
            else:
                self.spilled.append((results, spill_at, spill_at + need))
        extras["kept"] = slot is not None
        frame = self._encode_array(array) if reply is None else self._encode_result(reply)
        if len(frame) > self.max_frame:
            # The supervisor would drop the connection over it, and the worker with it: what
            # does not fit is left out, and said (the worker goes on serving).
            if reply is None:
                reply = new_result(*array[1:])
            reply = within(reply, len(frame), self.max_frame)
            frame = self._encode_result(reply)
        out: list[WorkerAction] = []
        if spill_at is not None:
            # The parts first: the supervisor reads them where the result says, whether or
            # not its frame fits the slot.
            out.append(SpillParts(spill_at, tuple(parts)))
        kept = slot is not None and len(frame) <= SLOT_PAYLOAD
        if kept:
            out.append(_new(KeepResult, (slot, results, frame)))
            self.slots[slot] = results  # type: ignore[index]  # (kept: a slot)
        else:
            if slot is not None:  # too large to keep after all: say so
                extras["kept"] = False
                frame = self._encode_array(array) if reply is None else self._encode_result(reply)
            self.need_ack = results
        if kept and self.queue and not held and not self.shutdown and len(self.pending) < HOLD_BACK:
            # Another call is queued: send this result with the next ones, in one go (one
            # wake-up of each side's zmq thread for several). It is in the ledger meanwhile.
            self.pending.append(frame)
        elif self.pending:
            self._send(out, frame)  # after what was held back
        else:
            out.append(_new(SendFrames, ([frame],)))
        return out

    def flush(self) -> Sequence[WorkerAction]:
        """Send the results held back, in order, as one message."""
        if not self.pending:
            return _NONE
        pending, self.pending = self.pending, []
        return (SendFrames(pending),)

    def beat(self, now: float) -> Sequence[WorkerAction]:
        """The time is ``now``: a heartbeat, if one is due."""
        if now < self.beat_due:
            return _NONE
        self.beat_due = now + self.heartbeat
        out: list[WorkerAction] = []
        self._send(out, encode(Heartbeat()))
        return out

    def beat_wait(self, now: float) -> int | None:
        """How long (ms) until the next heartbeat is due (None: no heartbeats)."""
        if self.heartbeat <= 0:
            return None
        return max(1, math.ceil((self.beat_due - now) * 1000))

    def report_progress(
        self, call_id: str, done: float, total: float | None, message: str | None
    ) -> bool:
        """The body reported progress: keep the latest. True if no report waited before (the
        shell wakes whoever sends it). (One assignment, then a flag: no lock needed.)"""
        self.progress = (call_id, done, total, message)
        if self.progress_new:
            return False
        self.progress_new = True
        return True

    def send_progress(self, now: float, call_id: int) -> tuple[Sequence[WorkerAction], int | None]:
        """Once call_id's body is said started: its latest progress report, unless one went
        out less than ``PROGRESS_INTERVAL`` ago; and how long (ms) until it may (None:
        nothing waits)."""
        if not self.progress_new:
            return _NONE, None
        wait = self.progress_sent_at + PROGRESS_INTERVAL - now
        if wait > 0:
            return _NONE, max(1, math.ceil(wait * 1000))
        self.progress_new = False  # (before reading it: a report from now on sets it again)
        report = self.progress
        out: list[WorkerAction] = []
        if report is not None and report[0] == str(call_id):  # (not a stray view's)
            self._send(out, encode(ProgressMessage(call_id, *report[1:])))
            self.progress_sent_at = now
        return out, None

    # Helpers.

    def _send(self, out: list[WorkerAction], frame: bytes) -> None:
        if self.pending:  # in order: results held back go first
            pending, self.pending = self.pending, []
            out.append(SendFrames(pending))
        out.append(SendFrames([frame]))

    def _withdraw(self, out: list[WorkerAction], call_id: int) -> None:
        """Take a queued call out of the queue, never to run here, and say so."""
        for queued in self.queue:
            if queued.call_id == call_id:
                self.queue.remove(queued)
                self._send(out, encode(Withdrawn(call_id)))
                return

    def _spill_room(self, need: int) -> int | None:
        """Where in the spill a result's ``need`` bytes of parts go (None: no room until
        the supervisor acknowledges more). The regions of acknowledged results are free."""
        spilled = self.spilled
        while spilled and spilled[0][0] <= self.acked:
            spilled.popleft()
        if need > self.spill:
            return None
        if not spilled:
            return 0
        first, last_start, last_end = spilled[0][1], spilled[-1][1], spilled[-1][2]
        if last_start >= first:  # in order: room after the last, or before the first
            if self.spill - last_end >= need:
                return last_end
            return 0 if first >= need else None
        return last_end if first - last_end >= need else None  # wrapped: room between

    def _free_slot(self) -> int | None:
        """A ledger slot whose result the supervisor has received, if any."""
        if not self.ledger:
            return None
        acked = self.acked
        for slot, seq in enumerate(self.slots):
            if seq <= acked:
                return slot
        return None


def within(reply: ResultMessage, size: int, max_frame: int) -> ResultMessage:
    """``reply``, whose frame of ``size`` bytes exceeds ``max_frame``, cut down until it
    fits: first the captured output goes (counted in ``output_dropped``); then the value (an
    ``ok`` becomes an ``error``, ``ResultTooLarge``, that says why); then the context. The
    outcome of a call that did not return a value is kept. (``reply.extras`` is changed in
    place: the caller goes on using it.)"""
    extras = reply.extras
    output = extras.pop("output", None)
    if output:
        extras["output_dropped"] = int(extras.get("output_dropped", 0)) + len(output)
    cut = dataclasses.replace(reply)
    if len(encode(cut)) <= max_frame:
        return cut
    if reply.outcome == "ok":
        parts = [f"the value packs to {len(reply.value or b''):,} bytes"]
        if output:
            parts.append(f"the captured output, {len(output):,} bytes, was dropped")
        cut = dataclasses.replace(
            cut,
            outcome="error",
            value=None,
            error=f"Error: the tool's result is too large to send: its message would be "
            f"{size:,} bytes ({'; '.join(parts)}), and the pool's max_frame allows "
            f"{max_frame:,}",
            error_name="ResultTooLarge",
        )
        if len(encode(cut)) <= max_frame:
            return cut
    return dataclasses.replace(cut, context={})
