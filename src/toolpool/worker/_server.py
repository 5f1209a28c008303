"""The worker's serving: its calls on the main thread, its socket shared with a control thread.

The worker serves one call at a time, so a tool body runs on the process's main thread, as in
an ordinary program (CONTRACT C2.5): signal handlers, ``alarm``/``setitimer``, ``faulthandler``
and main-thread-only libraries work in it. A plain sync call (``Registry._runs_plain``: no stage
but the body) runs straight through on that thread, with no event loop; any other call runs on
an asyncio loop on the same thread, its sync body invoked inline.

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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import math
import os
import resource
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core import CancelCause, CancelController, cancel_with_runtime_cause
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
    ProtocolViolation,
    Recall,
    ResultMessage,
    Resume,
    Shutdown,
    StartedMessage,
    Withdrawn,
    decode_from_supervisor,
    encode,
    pack_value,
    unpack_value,
)
from ..protocol._ledger import SLOT_PAYLOAD, SLOTS, write_invoked, write_slot, write_taken
from ..sandbox._cgroups import others_listed
from ..sandbox._linux import child_pids, reap_zombies
from ._call import DecodedArgs
from ._helpers import helpers

if TYPE_CHECKING:
    import mmap

    import zmq

    from ._capture import OutputCapture
    from ._registry import Registry

EXIT_PROTOCOL = 72
#: A call that has run this long (seconds) is looked after by the control thread: its
#: 'started' said (a sync body), what was held back sent, messages read while it runs.
QUICK_BODY_WAIT = 0.0002
#: At most this many results are held back while the next queued calls run quickly.
HOLD_BACK = 16
#: While calls come, the control thread looks this often (seconds) whether one takes time.
TICK = 0.002
#: After this long (seconds) without a call, the control thread stops looking.
IDLE_AFTER = 0.05

#: Signals the worker's other threads block, so that the main thread receives them (all
#: but those a fault raises in the thread that faults).
_FAULTS = {"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGABRT", "SIGSYS"}
ASYNC_SIGNALS = {s for s in signal.valid_signals() if getattr(s, "name", "") not in _FAULTS}


def start_thread_blocking_signals(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread that blocks every asynchronous signal from its first instruction
    (it inherits the mask set here for the moment of its creation)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, ASYNC_SIGNALS)
    try:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return thread


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
        import zmq

        from .._transport import fd_of, readable

        self.capture = capture
        self.sock = sock
        self.registry = registry
        self.specs = registry.tools
        self.max_frame = max_frame
        self.ledger = ledger
        self.members = members
        self.pid = os.getpid()
        self.queue: collections.deque[CallMessage] = collections.deque()
        self.current: tuple[int, CancelController] | None = None
        self.taken_at = 0.0  # when the current call was taken up
        self.started_at = 0.0  # when the current call's body was invoked
        self.said_started: int | None = None  # the call whose 'started' went out
        self.hold = False  # the last call left processes behind: wait for 'resume'
        self.results = 0  # results sent so far
        self.acked = 0  # how many of them the supervisor said it received
        self.need_ack = 0  # the last result not kept in the ledger: wait until it is acked
        self.slots = [0] * SLOTS  # the result number each ledger slot keeps
        self.pending: list[bytes] = []  # results kept in the ledger, held back (HOLD_BACK)
        self.allow_background = False  # leftovers are allowed: never hold
        self.shutdown = False
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
        self._readable = readable
        self._noblock = zmq.NOBLOCK
        self._loop: asyncio.AbstractEventLoop | None = None  # for calls with stages, async
        # Liveness: a heartbeat every `heartbeat` seconds (0: none), sent by whichever thread
        # has the socket: the control thread while a call runs, the main thread otherwise.
        self.heartbeat = heartbeat
        self.beat_due = 0.0 if heartbeat > 0 else math.inf  # when the next one is due
        self._again: type[Exception] = zmq.Again
        if heartbeat > 0:
            # The idle main thread's recv returns after a heartbeat interval of silence.
            sock.setsockopt(zmq.RCVTIMEO, max(1, int(heartbeat * 1000)))
        # Progress: the body's latest report (call id, done, total, message), set on the main
        # thread without the lock; the control thread sends it (PROGRESS_INTERVAL at most).
        self.progress: tuple[str, float, float | None, str | None] | None = None
        self.progress_new = False
        self.progress_sent_at = -math.inf

        registry._sync_caller = self._call_sync  # sync bodies inline, here
        registry._progress_sink = self._report_progress

    # The main thread.

    def serve(self) -> None:
        control = start_thread_blocking_signals(self._control, "toolpool control")
        sock = self.sock
        try:
            while True:
                with self.mu:
                    self._drain()
                    if self._failure is not None:
                        raise self._failure
                    if self.shutdown and self.current is None:
                        break
                    if time.monotonic() >= self.beat_due:  # (also in a stream of quick calls)
                        self._beat(time.monotonic())
                    job = self._next()
                self._fire_cancels()
                if job is not None:
                    self._run(*job)
                    continue
                # Nothing to do until a message comes. No call runs, so the control thread
                # keeps off the socket: wait in zmq itself (no edge of its fd to miss), at
                # most a heartbeat interval (RCVTIMEO).
                try:
                    frames = sock.recv_multipart()
                except self._again:
                    continue
                with self.mu:
                    self._handle_frames(frames)
        finally:
            with self.mu:
                self.exiting = True
            self._wake()
            control.join(1.0)
            if self._loop is not None:
                self._loop.close()

    def _run(self, msg: CallMessage, controller: CancelController) -> None:
        call_id = msg.call_id
        before = self._begin()
        args = self._args(msg)
        registry = self.registry
        if registry._runs_plain(msg.tool):
            result = registry._execute_plain(
                msg.tool,
                args,
                controller=controller,
                call_id=str(call_id),
                on_dispatch=lambda: self._invoked(call_id, False),
            )
        else:
            spec = self.specs.get(msg.tool)
            is_async = spec is not None and spec.is_async
            result = self._event_loop().run_until_complete(
                registry.execute_owned(
                    msg.tool,
                    args,
                    controller=controller,
                    call_id=str(call_id),
                    on_dispatch=lambda: self._invoked(call_id, is_async),
                )
            )
        extras = self._extras(before)
        if self.capture is not None:
            extras["output"], extras["output_dropped"] = self.capture.collect(call_id)
        with self.mu:
            frame, hold_back = self._conclude(call_id, result, extras)
            if hold_back:
                # Another call is queued: send this result with the next ones, in one go (one
                # wake-up of each side's zmq thread for several), unless that call takes time
                # (the control thread sends them then). It is in the ledger meanwhile.
                self.pending.append(frame)
            else:
                self._send(frame)
            # The control thread waits on the socket with no timeout once it said 'started'.
            wake = self.watching and self.said_started == call_id
            self.watching = False
        if wake:
            self._wake()

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
            if os.getpid() != self.pid:
                # The body forked and the child returned here: a leftover of the call, not
                # the worker. It must neither keep a result in the ledger nor take up the
                # calls queued here (they would run twice).
                os._exit(0)
            if loop is not None:
                asyncio._set_running_loop(loop)

    def _beat(self, now: float) -> int | None:
        """With the lock, by the thread that has the socket: send a heartbeat if one is due.
        Returns how long (ms) until the next one is (None: no heartbeats)."""
        if self.heartbeat <= 0:
            return None
        if now >= self.beat_due:
            self._send(encode(Heartbeat()))
            self.beat_due = now + self.heartbeat
        return max(1, math.ceil((self.beat_due - now) * 1000))

    def _report_progress(
        self, call_id: str, done: float, total: float | None, message: str | None
    ) -> None:
        """The registry's progress sink (``execution.report_progress``), on the main thread
        (or a thread of the tool's): keep the latest report, and have the control thread
        look, unless a report already waits for it. No lock: one assignment, then a flag."""
        self.progress = (call_id, done, total, message)
        if not self.progress_new:
            self.progress_new = True
            if self.watching:  # it may wait for a message: wake it
                self._wake()

    def _send_progress(self, now: float, call_id: int) -> int | None:
        """With the lock, on the control thread, once call_id's body is said started: send
        its latest progress report, unless one went out less than PROGRESS_INTERVAL ago.
        Returns how long (ms) until it may (None: nothing waits)."""
        if not self.progress_new:
            return None
        wait = self.progress_sent_at + PROGRESS_INTERVAL - now
        if wait > 0:
            return max(1, math.ceil(wait * 1000))
        self.progress_new = False  # (before reading it: a report from now on sets it again)
        report = self.progress
        if report is not None and report[0] == str(call_id):  # (not a stray view's)
            self._send(encode(ProgressMessage(call_id, *report[1:])))
            self.progress_sent_at = now
        return None

    def _next(self) -> tuple[CallMessage, CancelController] | None:
        """With the lock, on the main thread: take up the next queued call, if it may be."""
        if not self._may_take():
            # A result sent is in neither the ledger nor the supervisor's hands yet, or
            # nothing is taken up now: what was held back goes at once.
            if self.pending:
                self._flush()
            return None
        msg = self.queue.popleft()
        controller = CancelController()
        self.current = (msg.call_id, controller)
        if self.ledger is not None:
            write_taken(self.ledger, msg.call_id)
        self.started_at = 0.0
        self.taken_at = self.active_at = time.monotonic()
        if not self.looking:
            self.looking = True
            self._wake()
        return msg, controller

    def _may_take(self) -> bool:  # (hostile_tools.py patches it)
        return not (self.hold or self.shutdown or not self.queue or self.acked < self.need_ack)

    def _invoked(self, call_id: int, is_async: bool) -> None:
        """The body is about to be invoked: the ledger says so first. ('started' is for the
        control thread to say, once started_at is set: so set it only after the mark, or a
        'started' could go out for a body the ledger never saw invoked.) An async body is
        said 'started' at once, as it always was, under the lock (the control thread must not
        see it invoked and say it too)."""
        if not is_async:
            if self.ledger is not None:
                write_invoked(self.ledger, call_id)
            self.started_at = time.monotonic()
            return
        with self.mu:
            if self.ledger is not None:
                write_invoked(self.ledger, call_id)
            self.started_at = time.monotonic()
            self.said_started = call_id
            self._send(encode(StartedMessage(call_id)))
            if self.watching:  # the send may have consumed the edge it waits on
                self._wake()

    # Messages, on either thread, with the lock.

    def _drain(self) -> None:
        sock = self.sock
        while self._readable(sock):
            # All parts of one message (the calls sent together): one check of the socket's
            # events per message, not per frame.
            self._handle_frames(sock.recv_multipart(self._noblock))

    def _handle_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            try:
                msg = decode_from_supervisor(frame, max_len=self.max_frame)
            except ProtocolViolation:
                traceback.print_exc()
                os._exit(EXIT_PROTOCOL)
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, CallMessage):
            self.acked = max(self.acked, msg.acked)
            self.queue.append(msg)  # taken up by the main thread, in order
        elif isinstance(msg, Ack):
            self.acked = max(self.acked, msg.results)
        elif isinstance(msg, Cancel):
            current = self.current
            if current is not None and current[0] == msg.call_id:
                self._send(encode(CancelAck(msg.call_id)))
                # Fired once the lock is released: its callbacks may wait on the loop.
                self._fire.append((current[1], CancelCause(msg.cause)))  # type: ignore[arg-type]
            else:
                self._withdraw(msg.call_id)  # still queued: it never starts
        elif isinstance(msg, Recall):
            self._withdraw(msg.call_id)
        elif isinstance(msg, Resume):
            self.hold = False
        elif isinstance(msg, Ping):
            self._send(encode(Pong(msg.nonce)))
        elif isinstance(msg, Shutdown):
            self.shutdown = True
            while self.queue:
                self._withdraw(self.queue[0].call_id)

    def _fire_cancels(self) -> None:
        """Without the lock: cancel the signals the messages read asked to cancel (their
        callbacks may need the event loop of the main thread, or a lock of the tool's)."""
        if not self._fire:
            return
        with self.mu:
            fire, self._fire = self._fire, []
        for controller, cause in fire:
            cancel_with_runtime_cause(controller, cause)

    def _withdraw(self, call_id: int) -> None:
        """Take a queued call out of the queue, never to run here, and say so."""
        for queued in self.queue:
            if queued.call_id == call_id:
                self.queue.remove(queued)
                self._send(encode(Withdrawn(call_id)))
                return

    def _send(self, frame: bytes) -> None:
        if self.pending:
            self._flush()  # in order: results held back go first
        self.sock.send(frame, 0, copy=len(frame) < 65536)

    def _flush(self) -> None:
        """Send the results held back, in order."""
        pending, self.pending = self.pending, []
        if len(pending) == 1:
            self.sock.send(pending[0], 0, copy=len(pending[0]) < 65536)
        elif pending:  # one message, one frame a result: one wake-up of each side's zmq thread
            self.sock.send_multipart(pending, 0, copy=True)

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
        now = time.monotonic()
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
        if self.said_started != call_id and started_at and now - started_at >= QUICK_BODY_WAIT:
            self.said_started = call_id
            self._send(encode(StartedMessage(call_id)))  # after what was held back
        elif self.pending:
            self._flush()
        self._drain()
        beat = self._beat(now)
        # Until its body is said started, look again soon; then on a message, a progress
        # report, or the next heartbeat.
        if self.said_started != call_id:
            return int(TICK * 1000), False
        report = self._send_progress(now, call_id)
        if report is None or beat is None:
            return (beat if report is None else report), True
        return min(beat, report), True

    # What every call does.

    def _begin(self) -> tuple[float, float]:
        reap_zombies()  # leftovers the supervisor killed between calls
        if self.capture is not None:
            self.capture.begin()
        return _usage()

    def _args(self, msg: CallMessage) -> Any:
        try:
            args = unpack_value(msg.args, self.max_frame)
        except ValueError as exc:
            return exc  # the registry turns a non-mapping into an ordinary `error`
        # Fresh from msgpack, held by nobody else: the registry freezes them without a copy.
        return DecodedArgs(args) if type(args) is dict else args

    def _extras(self, before: tuple[float, float]) -> dict[str, Any]:
        extras = _usage_since(before)
        if self.started_at:
            extras["started_at"] = self.started_at
        return extras

    def _conclude(self, call_id: int, result: Any, extras: dict[str, Any]) -> tuple[bytes, bool]:
        """With the lock: the call is over. Count its leftovers, keep its result in the
        ledger; its frame, and whether it may be held back (another call is queued)."""
        kept = helpers()
        leftovers = len(set(_children()) - kept) if _has_children() else 0
        if not leftovers and self.members is not None:
            try:
                listed = os.pread(self.members, 1 << 16, 0)
                leftovers = others_listed(listed, self.pid)
                if kept and leftovers:
                    leftovers = len({int(p) for p in listed.split()} - kept - {self.pid})
            except OSError:
                leftovers = 0
        # Left processes behind: take up nothing more until the supervisor killed them.
        self.hold = leftovers > 0 and not self.allow_background
        self.current = None
        self.progress = None  # the result says the rest: a report not sent yet is dropped
        self.progress_new = False
        self.active_at = time.monotonic()
        packed = result._packed_value
        if packed is None and result.value is not None:
            packed = pack_value(result.value)
        # A value too large for a ledger slot however it is framed is not kept (nor framed
        # twice to find out).
        slot = None if len(packed or b"") > SLOT_PAYLOAD else self._free_slot()
        reply = ResultMessage(
            call_id,
            result.outcome.value,
            packed,
            result.error,
            result.error_name,
            result.body_started,
            dict(result.context),
            leftovers,
            extras,
        )
        self.results += 1
        extras["kept"] = slot is not None
        frame = encode(reply)
        if len(frame) > self.max_frame:
            # The supervisor would drop the connection over it, and the worker with it: what
            # does not fit is left out, and said (the worker goes on serving).
            reply = _within(reply, len(frame), self.max_frame)
            frame = encode(reply)
        if slot is not None and len(frame) <= SLOT_PAYLOAD:
            assert self.ledger is not None
            write_slot(self.ledger, slot, self.results, frame)
            self.slots[slot] = self.results
        else:
            if slot is not None:  # too large to keep after all: say so
                extras["kept"] = False
                frame = encode(reply)
            self.need_ack = self.results
        hold_back = (
            extras["kept"]
            and bool(self.queue)
            and not self.hold
            and not self.shutdown
            and len(self.pending) < HOLD_BACK
        )
        return frame, hold_back

    def _free_slot(self) -> int | None:
        """A ledger slot whose result the supervisor has received, if any."""
        if self.ledger is None:
            return None
        for slot, seq in enumerate(self.slots):
            if seq <= self.acked:
                return slot
        return None


def _children() -> list[int]:
    """This process's child processes, zombies included (cheap: /proc, no scan)."""
    return child_pids() or []


def _usage() -> tuple[float, float]:
    """CPU seconds used so far by this process and its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _usage_since(before: tuple[float, float]) -> dict[str, Any]:
    """The call's CPU time (the worker's threads and children reaped meanwhile) and the
    high-water mark of resident memory (the worker's, or its largest reaped child's)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (own.ru_utime + own.ru_stime - before[0]) + (kids.ru_utime + kids.ru_stime - before[1])
    return {"cpu_time": cpu, "max_rss": max(own.ru_maxrss, kids.ru_maxrss) * 1024}


def _has_children() -> bool:
    """Whether this process has any child, alive or zombie: one syscall."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _within(reply: ResultMessage, size: int, max_frame: int) -> ResultMessage:
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
