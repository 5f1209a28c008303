"""The worker's serving: its calls on the main thread, its socket shared with a control thread.

The worker serves one call at a time, so a tool body runs on the process's main thread, as in
an ordinary program (CONTRACT C2.5): signal handlers, ``alarm``/``setitimer``, ``faulthandler``
and main-thread-only libraries work in it. A plain sync call (``Registry._runs_plain``: no stage
but the body) runs straight through on that thread, with no event loop; any other call runs on
an asyncio loop on the same thread, its sync body invoked inline. Most plain calls run lean
(``Registry._lean_body``, ``_run_lean``: a body that takes no execution view, arguments that
bind as they are): no controller, no bind, no result object; a cancel received is kept as its
kind, read before the body is invoked and after it returns, as a signal would be.

Two threads share the one socket, never at once (``mu`` guards it, and every other piece of
state below):

- The **main thread** reads the socket whenever no call runs (blocking in ``recv`` while it has
  nothing to do), takes up the calls in the order they came, runs them, keeps each result in
  the ledger and sends it (or holds it back, below).
- The **control thread** touches the socket only while a call is taken up, once the call has
  run for ``QUICK_BODY_WAIT`` (a quick call never sees it). It then says 'started' for a sync
  body, sends the results held back, and reads every message that arrives until the call
  ends: a cancel reaches the call's signal, a queued call is withdrawn or recalled, an ack or a
  resume is noted, a ping answered, whatever the body does (a tight loop, a blocking C call, a
  sleep). To notice that a call takes time it looks every ``TICK`` while calls come, and waits
  without a timeout once the worker has been idle for ``IDLE_AFTER``. It blocks every
  asynchronous signal, so a process-directed one (SIGALRM, SIGTERM) reaches the main thread.

While more calls wait in its queue and each is quick, the worker holds back up to ``HOLD_BACK``
results (kept in the ledger) and sends them together: one wake-up of each side's zmq thread
for several calls. The worker never kills or abandons anything: a cancel message only cancels
the call's signal, or withdraws a call that is still queued.

What to do with each message and each call (the queue, withdraw and recall, cancels, shutdown,
holding until ``resume``, acks and the ledger's slots, holding back, 'started', heartbeats and
progress) the ``WorkerMachine`` of ``_machine.py`` decides, without I/O: this module is its
shell, which feeds it events (under ``mu``) and performs its actions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import resource
import select
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import zmq

from ..core import CancelCause, CancelController, cancel_with_runtime_cause
from ..protocol import (
    CallMessage,
    ProtocolViolation,
    ResultArray,
    ResultMessage,
    decode_from_supervisor,
    decode_supervisor_frames,
    pack_parts,
    pack_value,
    unpack_args,
    unpack_value,
)
from ..protocol._ledger import (
    INVOKED_WORD,
    LEDGER_SIZE,
    SLOTS,
    TAKEN_WORD,
    slot_words,
    words,
    write_parts,
)
from ..protocol._values import _SMALL, _unpackb
from ..sandbox._cgroups import others_listed
from ..sandbox._linux import child_pids, reap_zombies
from ._call import _NIL, DecodedArgs, _lean_result, _lean_value
from ._helpers import helpers
from ._machine import (
    _IDLE,
    _RUNNING,
    FireCancel,
    KeepResult,
    MarkInvoked,
    RunCall,
    SendFrames,
    SpillParts,
    WorkerAction,
    WorkerMachine,
)
from ._threads import start_thread_blocking_signals

if TYPE_CHECKING:
    import mmap

    from ._call import ToolResult
    from ._capture import OutputCapture
    from ._registry import Registry

EXIT_PROTOCOL = 72
#: A call that has run this long (seconds) is looked after by the control thread: its
#: 'started' said (a sync body), what was held back sent, messages read while it runs.
QUICK_BODY_WAIT = 0.0002
#: While calls come, the control thread looks this often (seconds) whether one takes time.
TICK = 0.002
#: After this long (seconds) without a call, the control thread stops looking.
IDLE_AFTER = 0.05

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK, _RCVMORE, _AGAIN = int(zmq.NOBLOCK), int(zmq.RCVMORE), zmq.Again
#: (The server's attributes stay fewer than 30: past that an instance's dict is its own, and
#: every attribute read on the hot path is a lookup.)
RUSAGE_SELF, RUSAGE_CHILDREN = resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN

#: What a lean call's body that returned None gives (:func:`_lean_value`'s).
_NONE_PACKED: tuple[bytes, tuple[bytes, ...]] = (_NIL, ())
_RESULT: Final = ResultMessage.TYPE
_monotonic: Final = time.monotonic
_getrusage: Final = resource.getrusage

#: This process's pid, read once and again in a child a fork makes (``os.register_at_fork``):
#: a body's fork is noticed without a ``getpid`` per call.
_pid = [os.getpid()]


def _forked() -> None:
    _pid[0] = os.getpid()


os.register_at_fork(after_in_child=_forked)


class _Server:
    """The worker's calls, one at a time, in the order they came, on the main thread; a call
    waiting behind another can be withdrawn while that one runs (see the module's doc)."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        registry: Registry,
        max_frame: int,
        capture: OutputCapture | None = None,
        ledger: mmap.mmap | None = None,
        members: int | None = None,
        heartbeat: float = 0.0,
    ) -> None:
        from .._transport import fd_of

        self.capture = capture
        self.sock = sock
        self.registry = registry
        self.specs = registry.tools
        self.max_frame = max_frame
        self.ledger = ledger
        # Its marks and slots as words, written by a store each (``protocol._ledger.words``),
        # and where each slot's sequence number, length and frame go.
        self._words: Any = None if ledger is None else words(ledger)
        self._slots = [slot_words(slot) for slot in range(SLOTS)]
        self.members = members
        self.pid = _pid[0]
        # The decisions: what each message and each call means (``_machine.py``).
        self.machine = WorkerMachine(
            max_frame=max_frame,
            ledger=ledger is not None,
            heartbeat=heartbeat,
            spill=0 if ledger is None else len(ledger) - LEDGER_SIZE,
        )
        # The call taken up, and its controller: None until the call needs one (a call that
        # runs lean never does: ``_run_lean``); a cancel received meanwhile is kept in `cause`
        # (the first one's kind), for the call to read or its controller to be cancelled with.
        self.current: tuple[int, CancelController | None] | None = None
        self.cause: str | None = None
        self.taken_at = 0.0  # when the current call was taken up
        self.started_at = 0.0  # when the current call's body was invoked
        # The end of the last call: its CPU reading (the next call's start, unless children
        # were reaped between or the worker idled a heartbeat interval), and whether the
        # worker had a child then.
        self._usage: tuple[float, float] | None = None
        self._had_children = True
        self._fire: list[tuple[CancelController, CancelCause]] = []  # cancels, outside `mu`
        # The control thread: what it shares with the main thread is under `mu`.
        self.mu = threading.RLock()
        self.watching = False  # the control thread reads the socket: the call takes time
        self.looking = False  # the control thread looks every TICK (else it waits for a wake)
        self.active_at = 0.0  # when the worker last took up or ended a call
        self.exiting = False
        self._failure: BaseException | None = None
        self._wakeup = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._fd = fd_of(sock)
        self._loop: asyncio.AbstractEventLoop | None = None  # for calls with stages, async
        # Liveness: a heartbeat every `heartbeat` seconds (0: none), sent by whichever thread
        # has the socket: the control thread while a call runs, the main thread otherwise.
        if heartbeat > 0:
            # The idle main thread's recv returns after a heartbeat interval of silence.
            sock.setsockopt(zmq.RCVTIMEO, max(1, int(heartbeat * 1000)))

        registry._sync_caller = self._call_sync  # sync bodies inline, here
        registry._progress_sink = self._report_progress

    # The main thread.

    def serve(self) -> None:
        control = start_thread_blocking_signals(self._control, "toolpool control")
        # One section under `mu` a call (a `with` costs twice an acquire and a release): what
        # the last call concluded, the messages read, the next call taken up; and one clock
        # read for them all (to the control thread, which waits for `mu`, they are one moment).
        mu = self.mu
        sock = self.sock
        machine = self.machine
        max_frame = self.max_frame
        mu.acquire()
        held = True
        try:
            now = _monotonic()
            while True:
                # (_drain, inline: once a call.) All parts of one message (the calls sent
                # together): one check of the socket's events per message, not per frame.
                while sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # (an int)
                    frame = sock.recv(_NOBLOCK)
                    if sock.getsockopt(_RCVMORE):  # (a call's parts follow it)
                        self._handle_frames([frame, *self._recv_more()])
                        continue
                    try:  # (_handle_frames, inline, for a message of one frame)
                        msg = decode_from_supervisor(frame, max_len=max_frame)
                    except ProtocolViolation:
                        traceback.print_exc()
                        os._exit(EXIT_PROTOCOL)
                    if type(msg) is CallMessage:
                        if msg.parts:  # its parts are missing:
                            self._handle_frames([frame])  # (a violation: said, and the exit)
                            continue
                        # (machine.receive's of a call, inline: once a call.)
                        if msg.acked > machine.acked:
                            machine.acked = msg.acked
                        machine.queue.append(msg)  # taken up in order
                        continue
                    out = machine.receive(msg)
                    if out:
                        self._perform(out)
                if self._failure is not None:
                    raise self._failure
                if machine.shutdown and machine.done:  # (one attribute while serving)
                    break
                if now >= machine.beat_due:  # (also in quick calls)
                    self._perform(machine.beat(now))
                # The next queued call taken up, if it may be; if not, what was held back goes.
                job = None
                if machine.phase is _IDLE and machine._may_take():
                    # (machine.next's take-up, inline: once a call; the same decision, the
                    # same move, IDLE -> RUNNING, and RunCall's fields without the action.)
                    job = machine.queue.popleft()
                    machine.phase = _RUNNING
                    machine.current = job.call_id
                    mark = machine.ledger
                else:
                    out = machine.next()  # (what was held back, as it decides)
                    if out:
                        if type(out[-1]) is RunCall:
                            job, mark = out[-1]
                        else:
                            self._perform(out)
                if job is not None:
                    call_id = job.call_id
                    if mark:  # (the marks: this call taken up, none invoked)
                        ledger = self._words
                        ledger[TAKEN_WORD] = call_id + 1
                        ledger[INVOKED_WORD] = 0
                    self.current = (call_id, None)
                    self.cause = None
                    self.started_at = 0.0
                    self.taken_at = self.active_at = now
                    if not self.looking:
                        self.looking = True
                        self._wake()
                mu.release()
                held = False
                try:
                    if self._fire:
                        self._fire_cancels()
                    if job is not None:
                        reply, parts = self._run(job)
                    else:
                        # Nothing to do until a message comes. No call runs, so the control
                        # thread keeps off the socket: wait in zmq itself (no edge of its fd
                        # to miss), at most a heartbeat interval (RCVTIMEO).
                        try:
                            frames = self._recv(0)
                        except _AGAIN:
                            # A heartbeat interval without a call: the next call's CPU is
                            # read afresh (what the worker's threads spent idle is not its).
                            self._usage = None
                            frames = []
                finally:
                    mu.acquire()
                    held = True
                now = _monotonic()
                if job is None:
                    if frames:
                        self._handle_frames(frames)
                    continue
                # The call is over. Its result is kept in the ledger and sent; or, while
                # another call is queued, held back to go with the next ones in one go (one
                # wake-up of each side's zmq thread for several), unless that call takes time
                # (the control thread sends them then).
                self.current = None
                self.active_at = now
                self._perform(machine.conclude_array(reply, parts))
                if self.watching:
                    self.watching = False
                    # It waits on the socket with no timeout once it said 'started'.
                    if machine.said_started == call_id:
                        self._wake()
        finally:
            if not held:  # (an acquire that raised)
                mu.acquire()
            self.exiting = True
            mu.release()
            self._wake()
            control.join(1.0)
            if self._loop is not None:
                self._loop.close()
            if self._words is not None:
                self._words.release()  # (the ledger may be closed now)

    def _run(self, msg: CallMessage) -> tuple[ResultArray, Sequence[bytes]]:
        """Without the lock: run the call taken up; its result (as the machine frames it:
        ``conclude_array``) and the parts of its value (the machine puts them in the
        ledger's spill).

        Most calls run lean (``Registry._lean_body``): the body called here with the arguments
        as they came, with no controller (a cancel received is read from `cause` before the
        body is invoked and after it returns, as ``_invoke_plain`` reads its signal), and no
        result object unless it did not return a value it could pack."""
        call_id = msg.call_id
        # The call's start: its CPU reading is the last call's end (one reading a call), if
        # this call came within a heartbeat interval of it, and the worker had no child then
        # (else those the supervisor killed since are reaped, and the reading is afresh).
        before = self._usage
        if self._had_children or before is None:
            reap_zombies()  # leftovers the supervisor killed between calls
            before = _usage()
        if self.capture is not None:
            self.capture.begin()
        given = msg.args
        try:
            # (Its parts, or a large one: as it comes. It lies in its frame, of at most
            # max_frame.)
            if msg.data or len(given) > _SMALL:
                args = unpack_args(given, self.max_frame, msg.data)
            else:  # (unpack_args's own path for a small one, inline: once a call)
                try:
                    args = _unpackb(given, max_ext_len=0)
                except Exception:  # (its error, as unpack_args says it)
                    args = unpack_args(given, self.max_frame, msg.data)
        except ValueError as bad:
            args = bad  # the registry turns a non-mapping into an ordinary `error`
        tool = msg.tool
        body = self.registry._lean_body(tool, args)
        result: ToolResult | None = None  # (none made for a lean call's value)
        # (What its result message says: from `result`, or, for a lean call's value, here.)
        outcome: str
        value: bytes | None
        parts: Sequence[bytes]
        error: str | None
        error_name: str | None
        started: bool
        context: dict[str, Any]
        if body is None:
            result = self._run_staged(msg, args)
        else:
            exc: BaseException | None = None
            returned: Any = None
            invoke = self.cause is None
            if invoke:
                if self._words is not None:  # (the machine's MarkInvoked, without its lock)
                    self._words[INVOKED_WORD] = call_id + 1
                self.started_at = _monotonic()
                try:
                    try:
                        returned = body(**args) if args else body()  # (no mapping to copy)
                    except StopIteration as raised:  # (as _call_sync_body has it)
                        raise RuntimeError("coroutine raised StopIteration") from raised
                    finally:
                        if _pid[0] != self.pid:
                            os._exit(0)  # (a leftover of the call: see _call_sync)
                except BaseException as caught:  # a result, like any failure of a body (C2.6)
                    exc = caught
            cause = self.cause
            packed = None
            if exc is None and cause is None:
                packed = _NONE_PACKED if returned is None else _lean_value(returned)
            if packed is not None:
                value, parts = packed
                outcome = "ok"
                error = error_name = None
                started = True
                context = {}
            else:
                result = _lean_result(
                    tool, str(call_id), cause, started=invoke, exc=exc, value=returned
                )
        # The call is over: its CPU time (the worker's threads and children reaped meanwhile,
        # since `before`), the high-water mark of resident memory (the worker's, or its
        # largest reaped child's), when its body was invoked, its captured output; the CPU
        # reading now (_usage's) is the next call's start.
        # (A struct_rusage's fields by index, 0 to 2: ru_utime, ru_stime, ru_maxrss; read by
        # name, each goes through a descriptor.)
        own = _getrusage(RUSAGE_SELF)
        kids = _getrusage(RUSAGE_CHILDREN)
        own_cpu, kids_cpu = own[0] + own[1], kids[0] + kids[1]
        self._usage = (own_cpu, kids_cpu)
        cpu_time = (own_cpu - before[0]) + (kids_cpu - before[1])
        max_rss = (own[2] if own[2] >= kids[2] else kids[2]) * 1024  # (max's, with no call)
        extras: dict[str, Any]
        if self.started_at:
            extras = {"cpu_time": cpu_time, "max_rss": max_rss, "started_at": self.started_at}
        else:
            extras = {"cpu_time": cpu_time, "max_rss": max_rss}
        if result is not None:  # (its value packed after the reading, as it always was)
            outcome, value, parts, error, error_name, started, context = _of_result(result)
        if self.capture is not None:
            extras["output"], extras["output_dropped"] = self.capture.collect(call_id)
        # Its leftovers counted (one wait call, if it has no child).
        had = self._had_children = _has_children()
        leftovers = 0
        if had or self.members is not None:
            kept = helpers()
            if had:
                leftovers = len(set(_children()) - kept)
            if not leftovers and self.members is not None:
                try:
                    listed = os.pread(self.members, 1 << 16, 0)
                    leftovers = others_listed(listed, self.pid)
                    if kept and leftovers:
                        leftovers = len({int(p) for p in listed.split()} - kept - {self.pid})
                except OSError:
                    leftovers = 0
        if parts and self.ledger is None:  # no spill: the value goes inline
            value, parts = pack_value(unpack_value(value or b"", self.max_frame, parts)), ()
        return (
            (
                _RESULT,
                call_id,
                outcome,
                value,
                error,
                error_name,
                started,
                context,
                leftovers,
                extras,
            ),
            parts,
        )

    def _run_staged(self, msg: CallMessage, args: Any) -> ToolResult:
        """A call that does not run lean: through the registry's pipeline, with a controller
        (a cancel received before it was made cancels it at once)."""
        call_id = msg.call_id
        controller = CancelController()
        with self.mu:
            self.current = (call_id, controller)
            cause = self.cause
        if cause is not None:
            cancel_with_runtime_cause(controller, CancelCause(cause))  # type: ignore[arg-type]
        # Fresh from msgpack, held by nobody else: the registry freezes them without a copy.
        if type(args) is dict:
            args = DecodedArgs(args)
        registry = self.registry
        if registry._runs_plain(msg.tool):
            return registry._execute_plain(
                msg.tool,
                args,
                controller=controller,
                call_id=str(call_id),
                on_dispatch=lambda: self._invoked(call_id, False),
            )
        spec = self.specs.get(msg.tool)
        is_async = spec is not None and spec.is_async
        return self._event_loop().run_until_complete(
            registry.execute_owned(
                msg.tool,
                args,
                controller=controller,
                call_id=str(call_id),
                on_dispatch=lambda: self._invoked(call_id, is_async),
            )
        )

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
        return self._loop

    def _call_sync(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """How the registry invokes a sync body here: inline, on this thread. Inside a call
        with stages the loop is blocked meanwhile, and the body sees none running (as in a
        script: ``asyncio.run()`` works in it)."""
        loop = asyncio._get_running_loop()
        if loop is not None:
            asyncio._set_running_loop(None)
        try:
            return fn(**kwargs)
        finally:
            if _pid[0] != self.pid:
                # The body forked and the child returned here: a leftover of the call, not
                # the worker. It must neither keep a result in the ledger nor take up the
                # calls queued here (they would run twice).
                os._exit(0)
            if loop is not None:
                asyncio._set_running_loop(loop)

    def _beat(self, now: float) -> int | None:
        """With the lock, by the thread that has the socket: send a heartbeat if one is due.
        Returns how long (ms) until the next one is (None: no heartbeats)."""
        self._perform(self.machine.beat(now))
        return self.machine.beat_wait(now)

    def _report_progress(
        self, call_id: str, done: float, total: float | None, message: str | None
    ) -> None:
        """The registry's progress sink (``execution.report_progress``), on the main thread
        (or a thread of the tool's): keep the latest report, and have the control thread
        look, unless a report already waits for it. No lock: one assignment, then a flag."""
        if self.machine.report_progress(call_id, done, total, message) and self.watching:
            self._wake()  # it may wait for a message: wake it

    def _send_progress(self, now: float, call_id: int) -> int | None:
        """With the lock, on the control thread, once call_id's body is said started: send
        its latest progress report, unless one went out less than PROGRESS_INTERVAL ago.
        Returns how long (ms) until it may (None: nothing waits)."""
        out, wait = self.machine.send_progress(now, call_id)
        if out:
            self._perform(out)
        return wait

    def _invoked(self, call_id: int, is_async: bool) -> None:
        """The body is about to be invoked: the ledger says so first. ('started' is for the
        control thread to say, once started_at is set: so set it only after the mark, or a
        'started' could go out for a body the ledger never saw invoked.) An async body is
        said 'started' at once, as it always was, under the lock (the control thread must not
        see it invoked and say it too)."""
        if not is_async:
            if self._words is not None:  # (the machine's MarkInvoked, without its lock)
                self._words[INVOKED_WORD] = call_id + 1
            self.started_at = _monotonic()
            return
        with self.mu:
            self._perform(self.machine.invoked(call_id, True))
            self.started_at = _monotonic()
            if self.watching:  # the send may have consumed the edge it waits on
                self._wake()

    # Messages, on either thread, with the lock.

    def _drain(self) -> None:
        sock = self.sock
        # (_transport.readable, inline: twice a call.) All parts of one message (the calls
        # sent together): one check of the socket's events per message, not per frame.
        while sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # (an int)
            self._handle_frames(self._recv(_NOBLOCK))

    def _recv(self, flags: int) -> list[Any]:
        """One message: its first frame as bytes, the others as zmq frames, received without
        a copy (the parts of a call's arguments are copied once, into the bytes the tool
        gets; a frame that is a message is decoded from the zmq frame itself)."""
        sock = self.sock
        frames: list[Any] = [sock.recv(flags)]
        while sock.getsockopt(_RCVMORE):
            frames.append(sock.recv(flags, copy=False))
        return frames

    def _recv_more(self) -> list[Any]:
        """The other frames of a message whose first was received: zmq frames, without a copy
        (as :meth:`_recv` receives them)."""
        sock = self.sock
        frames: list[Any] = [sock.recv(_NOBLOCK, copy=False)]
        while sock.getsockopt(_RCVMORE):
            frames.append(sock.recv(_NOBLOCK, copy=False))
        return frames

    def _handle_frames(self, frames: list[Any]) -> None:
        try:
            if len(frames) == 1:  # (most messages: one frame, no parts)
                msg = decode_from_supervisor(frames[0], max_len=self.max_frame)
                if type(msg) is not CallMessage or not msg.parts:
                    out = self.machine.receive(msg)  # (_handle, inline: once a call)
                    if out:
                        self._perform(out)
                    return
            messages = decode_supervisor_frames(frames, max_len=self.max_frame)
        except ProtocolViolation:
            traceback.print_exc()
            os._exit(EXIT_PROTOCOL)
        for msg in messages:
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        out = self.machine.receive(msg)
        if out:
            self._perform(out)

    def _fire_cancels(self) -> None:
        """Without the lock: cancel the signals the messages read asked to cancel (their
        callbacks may need the event loop of the main thread, or a lock of the tool's)."""
        if not self._fire:
            return
        with self.mu:
            fire, self._fire = self._fire, []
        for controller, cause in fire:
            cancel_with_runtime_cause(controller, cause)

    def _perform(self, actions: Sequence[WorkerAction]) -> None:
        """With the lock: do what the machine asked, in order."""
        for action in actions:
            # (By type, the kinds every call asks for first: KeepResult, SendFrames.)
            # (Fields by unpacking: a NamedTuple's attribute is read through its descriptor.)
            if type(action) is KeepResult:  # (protocol._ledger.write_slot, by its words)
                slot, seq, frame = action
                seq_word, length_word, at = self._slots[slot]
                self.ledger[at : at + len(frame)] = frame  # type: ignore[index]
                ledger = self._words
                ledger[length_word] = len(frame)
                ledger[seq_word] = seq
            elif type(action) is SendFrames:
                (frames,) = action
                if len(frames) == 1:
                    frame = frames[0]
                    self.sock.send(frame, 0, len(frame) < 65536)  # (copy, by position)
                else:  # one message, one frame a result: one wake-up of each side's zmq thread
                    self.sock.send_multipart(frames, 0, copy=True)
            elif type(action) is SpillParts:
                assert self.ledger is not None
                write_parts(self.ledger, action.at, action.parts)
            elif type(action) is MarkInvoked:
                self._words[INVOKED_WORD] = action.call_id + 1
            elif type(action) is FireCancel:
                current = self.current
                if current is not None and current[0] == action.call_id:
                    controller = current[1]
                    if controller is None:  # none made yet: the call reads it (the first)
                        if self.cause is None:
                            self.cause = action.cause
                    else:  # fired once the lock is released: its callbacks may wait on the loop
                        cause = CancelCause(action.cause)  # type: ignore[arg-type]
                        self._fire.append((controller, cause))

    # The control thread.

    def _wake(self) -> None:
        os.eventfd_write(self._wakeup, 1)

    def _control(self) -> None:
        poller = select.poll()
        poller.register(self._wakeup, select.POLLIN)
        on_socket = False
        try:
            while True:
                with self.mu:
                    if self.exiting:
                        return
                    # On the socket's fd only for a body said started (it also stirs at sends).
                    timeout, watch = self._look()
                self._fire_cancels()
                if watch != on_socket:
                    if watch:
                        poller.register(self._fd, select.POLLIN)
                    else:
                        poller.unregister(self._fd)
                    on_socket = watch
                if poller.poll(timeout):
                    with contextlib.suppress(BlockingIOError):  # (the socket's fd)
                        os.eventfd_read(self._wakeup)
        except BaseException as exc:  # a failure of the worker itself: stop, loudly
            with self.mu:
                self._failure = exc
                if self.current is None:
                    self._wake()  # (the main thread may wait in recv: it sees it later)

    def _look(self) -> tuple[int | None, bool]:
        """With the lock, on the control thread: look after a call that takes time. Returns
        how long to wait (ms) before looking again (None: until woken or a message comes),
        and whether to wait on the socket too."""
        current = self.current
        now = _monotonic()
        if current is None:
            if self.looking and now - self.active_at < IDLE_AFTER:
                return int(TICK * 1000), False
            self.looking = False
            return None, False
        call_id = current[0]
        if not self.watching:
            if now - self.taken_at < QUICK_BODY_WAIT:
                return int(TICK * 1000), False
            self.watching = True  # the socket is this thread's until the call ends
        started_at = self.started_at
        if started_at and now - started_at >= QUICK_BODY_WAIT:
            self._perform(self.machine.body_running(call_id))  # after what was held back
        elif self.machine.pending:
            self._perform(self.machine.flush())
        self._drain()
        beat = self._beat(now)
        # Until its body is said started, look again soon; then on a message, a progress
        # report, or the next heartbeat.
        if self.machine.said_started != call_id:
            return int(TICK * 1000), False
        report = self._send_progress(now, call_id)
        if report is None or beat is None:
            return (beat if report is None else report), True
        return min(beat, report), True


def _of_result(
    result: ToolResult,
) -> tuple[str, bytes | None, Sequence[bytes], str | None, str | None, bool, dict[str, Any]]:
    """What a call's result message says of its ``result``: its outcome, its packed value
    and that value's parts, its error and the error's name, whether its body started, its
    context."""
    packed = result._packed_value
    parts: Sequence[bytes] = result._packed_parts
    if packed is None and result.value is not None:
        packed, parts = pack_parts(result.value)
    return (
        result.outcome._value_,
        packed,
        parts,
        result.error,
        result.error_name,
        result.body_started,
        dict(result.context),
    )


def _children() -> list[int]:
    """This process's child processes, zombies included (cheap: /proc, no scan)."""
    return child_pids() or []


def _usage() -> tuple[float, float]:
    """CPU seconds used so far by this process and its reaped children."""
    own = _getrusage(RUSAGE_SELF)
    kids = _getrusage(RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


#: waitid(2) from libc, called with the GIL held (it does not block: WNOHANG), errno kept by
#: ctypes: what ``os.waitid`` does, without the ``ChildProcessError`` it raises when there is
#: no child, which costs twice the system call (every call asks; most have no child).
_libc = ctypes.PyDLL(None, use_errno=True)
_waitid = _libc.waitid
_OPTIONS: Final = os.WEXITED | os.WNOHANG | os.WNOWAIT
#: (Linux's waitid takes a null siginfo_t, the cheaper argument; elsewhere one to fill.)
_SIGINFO = None if sys.platform.startswith("linux") else ctypes.create_string_buffer(128)
_ANY_CHILD = (int(os.P_ALL), 0, _SIGINFO, _OPTIONS)
_get_errno, _ECHILD = ctypes.get_errno, errno.ECHILD


def _has_children() -> bool:
    """Whether this process has any child, alive or zombie: one syscall (a zombie is left
    as it is: WNOWAIT)."""
    if _waitid(*_ANY_CHILD) == 0:
        return True
    err = _get_errno()
    if err == _ECHILD:
        return False
    raise OSError(err, os.strerror(err))  # (as os.waitid would raise it)
