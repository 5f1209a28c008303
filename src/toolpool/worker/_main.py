"""The worker process: ``python -m toolpool.worker --endpoint ... --tools module:attr``.

Set-up happens first, single-threaded, before zmq starts its threads and before the tools
module is imported: die with the parent (PR_SET_PDEATHSIG), check the parent did not already
die, become a child subreaper (so daemons a tool starts stay in this tree), read the per-worker
secret from stdin. Then connect, import the tools, say hello, and serve its calls one at a
time, in the order they came.

The supervisor may send a call while another runs (``Pool(prefetch=...)``): it waits in the
worker's queue. The worker writes to its *ledger* (protocol/_ledger.py), memory it shares
with the supervisor, which reaches the supervisor even if the worker is killed the next
instant: the id of a call before taking it up, again before invoking its body, and a copy of
each result before sending it. So after any death the supervisor knows which calls were
never taken up (it runs them elsewhere), whether the body of the one that was had started,
and every result sent, even one still in the dying worker's zmq queue. A result too large
for the ledger must be acknowledged before the worker takes up its next call.

While more calls wait in its queue and each is quick, the worker holds back up to
``HOLD_BACK`` results (kept in the ledger) and sends them together: one wake-up of each
side's zmq thread for several calls. A call that makes the loop turn (its body runs longer
than a moment, or a stage before it waits) sends what was held back at once.

The lane: when the registry has no stage but the bodies (``Registry._runs_plain``), the calls
of sync tools run in one thread, the lane, from take-up to result, one after the other: no
hand-off of each body to a thread and back to the loop (two thread wake-ups a call, the most
of what a quick call cost the worker). The loop keeps the socket: it reads messages while the
lane runs, as while any body runs, and sends what the lane asks it to. What both touch (the
queue, the current call, the ledger's bookkeeping, the results held back) is under ``mu``.
While the lane runs calls, the loop looks every ``LANE_TICK`` whether a body has run past
``QUICK_BODY_WAIT``, to say 'started' and send what was held back, as it would have after its
quick wait; then it stops looking until that call ends.

The worker never kills or abandons anything: a cancel message only cancels the call's signal,
or withdraws a call that is still queued.
"""

from __future__ import annotations

import argparse
import collections
import contextvars
import dataclasses
import importlib
import json
import mmap
import os
import resource
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

# Stdlib and msgpack only (no threads): safe before set-up. zmq is imported after it.
from ..core import CancelCause, CancelController, cancel_with_runtime_cause
from ..protocol import (
    PROTOCOL_VERSION,
    Ack,
    Call,
    Cancel,
    CancelAck,
    Fatal,
    Hello,
    Ping,
    Pong,
    ProtocolViolation,
    Recall,
    Result,
    Resume,
    Shutdown,
    Started,
    Withdrawn,
    decode_from_supervisor,
    encode,
    pack_value,
    unpack_value,
)
from ..protocol._ledger import (
    LEDGER_SIZE,
    SLOT_PAYLOAD,
    SLOTS,
    write_invoked,
    write_slot,
    write_taken,
)
from ..sandbox import Profile
from ..sandbox._apply import apply_profile
from ..sandbox._cgroups import others_listed
from ..sandbox._linux import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl, reap_zombies

if TYPE_CHECKING:
    import zmq

    from ._capture import OutputCapture
    from ._registry import Registry

EXIT_SETUP_FAILED = 70
EXIT_TOOLS_FAILED = 71
EXIT_PROTOCOL = 72
#: Seconds the worker's loop may block for a sync body to settle before it waits for it
#: asynchronously (a no-op body then costs no loop wake-up); a cancel, ping or shutdown that
#: arrives meanwhile is read at most this late. See worker/_threads.py.
QUICK_BODY_WAIT = 0.0002
#: At most this many results are held back while the next queued calls run quickly.
HOLD_BACK = 16
#: While the lane runs calls, the loop looks this often (seconds) whether a body takes time.
LANE_TICK = 0.001


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m toolpool.worker")
    parser.add_argument("--endpoint", required=True, help="zmq endpoint to connect to")
    parser.add_argument("--tools", required=True, help="module:attribute naming a Registry")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--max-frame", type=int, required=True)
    parser.add_argument("--profile", default=None, help="containment profile (JSON)")
    parser.add_argument(
        "--capture", type=int, default=0, help="bytes of output kept per call (0: none)"
    )
    parser.add_argument(
        "--cgroup-procs", default="", help="comma-separated cgroup.procs files to join"
    )
    parser.add_argument("--ledger", default="", help="the ledger file shared with the supervisor")
    parser.add_argument(
        "--members", default="", help="the cgroup v2 cgroup.procs listing the worker's tree"
    )
    parser.add_argument(
        "--allow-background",
        action="store_true",
        help="processes a call leaves behind are allowed: never wait for their clean-up",
    )
    return parser.parse_args(argv)


def open_ledger(path: str) -> mmap.mmap | None:
    """Map the ledger file read-write (before set-up: the mapping outlives a uid change and
    Landlock, which would forbid opening it later)."""
    if not path:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, LEDGER_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def open_members(path: str) -> int | None:
    """An fd on the worker's cgroup v2 ``cgroup.procs`` (pread re-reads it), or None."""
    if not path:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def setup(
    parent_pid: int,
    profile_json: str | None,
    procs_files: list[str],
    endpoint: str = "",
    tools_module: str | None = None,
) -> tuple[bytes, dict[str, list[Any]], str | None]:
    """Process set-up, in an order that does not undo itself.

    Returns the secret, what the containment set-up applied, and an error that must stop the
    worker (a required layer is missing), reported once connected.
    """

    error: str | None = None
    report: dict[str, list[Any]] = {}
    try:
        profile = Profile.from_wire(json.loads(profile_json)) if profile_json else None
        if profile is not None:
            path = endpoint.removeprefix("ipc://")
            own = [os.path.dirname(path), path] if endpoint.startswith("ipc:///") else []
            report = apply_profile(profile, procs_files, own, tools_module)
    except (RuntimeError, ValueError, TypeError) as exc:
        error = f"containment set-up failed: {exc}"
    if sys.platform.startswith("linux"):
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before PDEATHSIG was armed
            os._exit(EXIT_SETUP_FAILED)
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    secret = sys.stdin.buffer.readline().strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if not secret:
        os._exit(EXIT_SETUP_FAILED)
    return secret, report, error


def load_registry(spec: str) -> Registry:
    """Import ``module:attribute`` and return the Registry it names."""
    from ._registry import Registry

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"tools spec {spec!r} is not of the form 'module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for n, part in enumerate(attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            # As ``from module import name`` says it, and one line (the CLI prints it).
            where = ".".join([module_name, *attr.split(".")[:n]])
            raise ImportError(f"cannot find {part!r} in {where!r} (tools spec {spec!r})") from None
    if callable(obj) and not isinstance(obj, Registry):
        obj = obj()
    if not isinstance(obj, Registry):
        raise TypeError(f"{spec!r} is a {type(obj).__name__}, not a toolpool.Registry")
    return obj


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    procs = [p for p in args.cgroup_procs.split(",") if p]
    try:
        ledger = open_ledger(args.ledger)
    except (OSError, ValueError):
        os._exit(EXIT_SETUP_FAILED)
    members = open_members(args.members)
    secret, report, setup_error = setup(
        args.parent_pid, args.profile, procs, args.endpoint, args.tools.partition(":")[0]
    )

    capture = None
    if args.capture > 0:
        from ._capture import OutputCapture

        capture = OutputCapture(args.capture)

    import zmq

    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.MAXMSGSIZE, args.max_frame)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    sock.connect(args.endpoint)
    try:
        if setup_error is not None:
            raise RuntimeError(setup_error)
        registry = load_registry(args.tools)
        # Each entry also says whether the body runs in a thread (the worker's loop stays
        # free meanwhile, so a call queued behind it can be withdrawn): the supervisor queues
        # calls only behind such bodies. It is not part of the catalog.
        catalog = [
            {**spec.describe(), "runs_in_thread": not spec.is_async}
            for spec in registry.tools.values()
        ]
    except BaseException:
        sock.send(encode(Fatal(secret, traceback.format_exc(limit=20)[-8000:])))
        sock.close()
        ctx.term()
        os._exit(EXIT_TOOLS_FAILED)
    sock.send(encode(Hello(PROTOCOL_VERSION, os.getpid(), secret, catalog, report)))

    server = _Server(sock, registry, args.max_frame, capture, ledger, members)
    server.allow_background = args.allow_background
    try:
        anyio.run(server.serve)
    finally:
        sock.close(linger=1000)
        ctx.term()


class _Server:
    """The worker's loop: reads messages while a body runs; runs its calls one at a time, in
    the order they came; a call waiting behind another can be withdrawn."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        registry: Registry,
        max_frame: int,
        capture: OutputCapture | None = None,
        ledger: mmap.mmap | None = None,
        members: int | None = None,
    ) -> None:
        self.capture = capture
        self.sock = sock
        self.registry = registry
        self.specs = registry.tools
        self.max_frame = max_frame
        self.ledger = ledger
        self.members = members
        self.pid = os.getpid()
        self.queue: collections.deque[Call] = collections.deque()
        self.current: tuple[int, Any] | None = None  # (call_id, CancelController)
        self.started_at = 0.0  # when the current call's body was invoked
        self.hold = False  # the last call left processes behind: wait for 'resume'
        self.results = 0  # results sent so far
        self.acked = 0  # how many of them the supervisor said it received
        self.need_ack = 0  # the last result not kept in the ledger: wait until it is acked
        self.slots = [0] * SLOTS  # the result number each ledger slot keeps
        self.pending: list[bytes] = []  # results kept in the ledger, held back (HOLD_BACK)
        self.allow_background = False  # leftovers are allowed: never hold
        self.shutdown = False
        self._tg: Any = None
        self._loop: Any = None  # asyncio: each call runs as a plain task (cheaper than anyio's)
        self._task: Any = None
        self._failure: BaseException | None = None
        # The lane (see _lane) and what the loop shares with it, under `mu`: the queue,
        # current, hold, shutdown, results, acked, need_ack, slots, pending, started_at.
        self.mu = threading.RLock()
        self.lane_wake = threading.Condition(self.mu)
        self.lane: threading.Thread | None = None
        self.lane_on = False  # the lane has the queue: the loop takes nothing up
        self.said_started: int | None = None  # the lane's call the loop said 'started' for
        self._tick_handle: Any = None
        # zmq is imported only after set-up; keep what the hot path needs at hand.
        import zmq

        from .._transport import readable
        from ._registry import DecodedArgs

        self._decoded = DecodedArgs
        self._readable = readable
        self._noblock = zmq.NOBLOCK

    async def serve(self) -> None:
        from .._transport import fd_of, on_readable

        fd = fd_of(self.sock)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            with on_readable(fd, self._drain) as installed:
                if installed:  # asyncio: messages are handled right in the reader callback
                    import asyncio

                    from ._threads import set_quick_wait

                    self._loop = asyncio.get_running_loop()
                    set_quick_wait(QUICK_BODY_WAIT)  # one call at a time: see _threads
                    if self.capture is None:
                        self._start_lane()
                    self._drain()
                    await anyio.sleep_forever()  # until shutdown cancels the task group
            while not (self.shutdown and self.current is None):
                self._drain()
                if self.shutdown and self.current is None:
                    break
                await anyio.wait_readable(fd)
            tg.cancel_scope.cancel()
        if self._failure is not None:
            raise self._failure

    def _send(self, frame: bytes) -> None:
        with self.mu:
            if self.pending:
                self._flush()  # in order: results held back go first
            self.sock.send(frame, 0, copy=len(frame) < 65536)
        # Sending may consume the edge of zmq's notification fd: drain what arrived meanwhile.
        if self._readable(self.sock):
            self._drain()

    def _drain(self) -> None:
        sock = self.sock
        while self._readable(sock):
            # All parts of one message (the calls sent together): one check of the socket's
            # events per message, not per frame.
            for frame in sock.recv_multipart(self._noblock):
                try:
                    msg = decode_from_supervisor(frame, max_len=self.max_frame)
                except ProtocolViolation:
                    traceback.print_exc()
                    os._exit(EXIT_PROTOCOL)
                with self.mu:
                    self._handle(msg)
        if self.queue:
            with self.mu:
                self._next()

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Call):
            # Taken up once the messages read so far are handled (_drain): the calls of one
            # message go to the loop or the lane together.
            self.acked = max(self.acked, msg.acked)
            self.queue.append(msg)
        elif isinstance(msg, Ack):
            self.acked = max(self.acked, msg.results)
            self._next()
        elif isinstance(msg, Cancel):
            if self.current is not None and self.current[0] == msg.call_id:
                cancel_with_runtime_cause(self.current[1], CancelCause(msg.cause))  # type: ignore[arg-type]
                self._send(encode(CancelAck(msg.call_id)))
            else:
                self._withdraw(msg.call_id)  # still queued: it never starts
        elif isinstance(msg, Recall):
            self._withdraw(msg.call_id)
        elif isinstance(msg, Resume):
            self.hold = False
            self._next()
        elif isinstance(msg, Ping):
            self._send(encode(Pong(msg.nonce)))
        elif isinstance(msg, Shutdown):
            self.shutdown = True
            while self.queue:
                self._withdraw(self.queue[0].call_id)
            if self.current is None:
                self._tg.cancel_scope.cancel()

    def _withdraw(self, call_id: int) -> None:
        """Take a queued call out of the queue, never to run here, and say so."""
        for queued in self.queue:
            if queued.call_id == call_id:
                self.queue.remove(queued)
                self._send(encode(Withdrawn(call_id)))
                return

    def _flush(self) -> None:
        """Send the results held back, in order."""
        pending, self.pending = self.pending, []
        if len(pending) == 1:
            self.sock.send(pending[0], 0, copy=len(pending[0]) < 65536)
        elif pending:  # one message, one frame a result: one wake-up of each side's zmq thread
            self.sock.send_multipart(pending, 0, copy=True)

    def _send_pending(self) -> None:
        with self.mu:
            self._flush()
        if self._readable(self.sock):  # see _send
            self._drain()

    def _flush_unless_done(self, call_id: int) -> None:
        """The loop turned while ``call_id`` runs: it takes time, so what it held back goes."""
        if self.pending and self.current is not None and self.current[0] == call_id:
            self._send_pending()

    def _may_take(self) -> bool:
        return not (self.hold or self.shutdown or not self.queue or self.acked < self.need_ack)

    def _next(self) -> None:
        """Take up the next queued call, if none runs and none may not yet (on the loop)."""
        if self.current is not None or self.lane_on:
            return
        if not self._may_take():
            # A result sent is in neither the ledger nor the supervisor's hands yet, or
            # nothing is taken up now: what was held back goes at once.
            if self.pending:
                self._send_pending()
            return
        msg = self.queue[0]
        # The lane for calls that queue up; a lone call takes the loop's path, whose quick
        # wait is the shorter way through for one call (no lane to start and stop).
        if self.lane is not None and len(self.queue) > 1 and self.registry._runs_plain(msg.tool):
            self.lane_on = True  # the lane takes it up, and what follows it (see _lane)
            self.lane_wake.notify()
            self._arm_tick()
            return
        msg, controller = self._take()
        if self._loop is not None:
            self._task = self._loop.create_task(self._run(msg, controller))
            self._task.add_done_callback(self._call_done)
            # Runs after the task's first step: only if the call did not finish in it.
            self._loop.call_soon(self._flush_unless_done, msg.call_id)
        else:
            self._tg.start_soon(self._run, msg, controller)

    def _take(self) -> tuple[Any, CancelController]:
        """With the lock: take up the first queued call (the ledger says so first)."""
        msg = self.queue.popleft()
        controller = CancelController()
        self.current = (msg.call_id, controller)
        self.started_at = 0.0  # (_tick reads it: not the call before's)
        if self.ledger is not None:
            write_taken(self.ledger, msg.call_id)
        return msg, controller

    def _call_done(self, task: Any) -> None:
        """A call's task ended: a failure of the worker itself stops it, loudly. (The task
        ends after it took up the next call, whose task it may have just stored: keep that
        one's reference, the only strong one the loop does not hold.)"""
        if self._task is task:
            self._task = None
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc
        self._tg.cancel_scope.cancel()

    def _invoked(self, call_id: int, in_thread: bool) -> None:
        """The registry is about to invoke the body: write the ledger. For a body that runs
        in a thread, say 'started' only if it still runs once the loop turns (a quick body's
        result says it); an async body could hold the loop for good: say it now."""
        self._record_invoked(call_id)
        if in_thread and self._loop is not None:
            self._loop.call_soon(self._still_running, call_id)
        else:
            self._send(encode(Started(call_id)))

    def _still_running(self, call_id: int) -> None:
        if self.current is not None and self.current[0] == call_id:
            self._send(encode(Started(call_id)))

    async def _run(self, msg: Any, controller: Any) -> None:
        call_id = msg.call_id
        before = self._begin()
        spec = self.specs.get(msg.tool)
        in_thread = spec is not None and not spec.is_async
        result = await self.registry.execute_owned(
            msg.tool,
            self._args(msg),
            controller=controller,
            call_id=str(call_id),
            on_dispatch=lambda: self._invoked(call_id, in_thread),
        )
        extras = self._extras(before)
        if self.capture is not None:
            output, dropped = await anyio.to_thread.run_sync(self.capture.collect, call_id)
            extras["output"] = output
            extras["output_dropped"] = dropped
        with self.mu:
            frame, hold_back = self._conclude(call_id, result, extras)
            if hold_back and self._loop is not None:
                # Another call is queued: send this result with the next ones, in one go (one
                # wake-up of each side's zmq thread for several), unless that call takes time
                # (_flush_unless_done). It is in the ledger meanwhile.
                self.pending.append(frame)
            else:
                self._send(frame)
            if self.shutdown:
                self._tg.cancel_scope.cancel()
            else:
                self._next()

    # The lane: plain sync calls (Registry._runs_plain) run one after the other in one thread,
    # from take-up to result, without a hand-off to the loop and back per call. The loop reads
    # messages meanwhile, as while any sync body runs; it sends what the lane asks it to.

    def _start_lane(self) -> None:
        from ._threads import body_thread_context

        self.lane = threading.Thread(
            target=self._lane,
            args=body_thread_context(self._loop),
            name="toolpool lane",
            daemon=True,
        )
        self.lane.start()

    def _lane(self, token: Any, base: contextvars.Context) -> None:
        from ._threads import enter_body_thread

        enter_body_thread(token)
        loop = self._loop

        def call_soon(fn: Any, *args: Any) -> None:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: the worker is exiting
                pass

        try:
            with self.mu:
                while True:
                    while not self.lane_on:
                        self.lane_wake.wait()
                    if self.current is not None or not (
                        self._may_take() and self.registry._runs_plain(self.queue[0].tool)
                    ):
                        self.lane_on = False  # back to the loop: it sends, or takes up
                        call_soon(self._lane_stopped)
                        continue
                    msg, controller = self._take()
                    self.mu.release()
                    try:
                        result, extras = base.copy().run(self._lane_call, msg, controller)
                    finally:
                        if os.getpid() != self.pid:
                            # The body forked and the child returned here: a leftover of
                            # the call, not the worker. It must neither keep a result in the
                            # ledger nor take up the calls queued here (they would run twice).
                            os._exit(0)
                        self.mu.acquire()
                    frame, hold_back = self._conclude(msg.call_id, result, extras)
                    self.pending.append(frame)
                    if not hold_back:
                        call_soon(self._send_pending)
                    if self._tick_handle is None:  # it stopped while that call ran
                        call_soon(self._arm_tick)
        except BaseException as exc:  # a failure of the worker itself: stop, loudly
            call_soon(self._fail, exc)

    def _lane_call(self, msg: Any, controller: Any) -> tuple[Any, dict[str, Any]]:
        call_id = msg.call_id
        before = self._begin()
        result = self.registry._execute_plain(
            msg.tool,
            self._args(msg),
            controller=controller,
            call_id=str(call_id),
            on_dispatch=lambda: self._record_invoked(call_id),
        )
        return result, self._extras(before)

    def _record_invoked(self, call_id: int) -> None:
        """The body is about to be invoked: the ledger says so first. (In the lane, that is
        all: 'started' is for the loop to say, _tick, once started_at is set: so set it only
        after the mark, or a 'started' could go out for a body the ledger never saw invoked.)"""
        if self.ledger is not None:
            write_invoked(self.ledger, call_id)
        self.started_at = time.monotonic()

    def _tick(self) -> None:
        """On the loop, while the lane runs: a body that takes time gets its 'started' said,
        and what was held back goes (as _still_running and _flush_unless_done do). Then,
        while that body runs, the loop has nothing to say: it stops looking until the lane
        ends the call (_arm_tick)."""
        with self.mu:
            self._tick_handle = None
            if not self.lane_on:
                return
            current = self.current
            if (
                current is not None
                and self.started_at
                and time.monotonic() - self.started_at >= QUICK_BODY_WAIT
            ):
                if self.said_started != current[0]:
                    self.said_started = current[0]
                    self._send(encode(Started(current[0])))  # after what was held back
                elif self.pending:
                    self._send_pending()
                return  # said: nothing more while it runs (the lane re-arms the tick)
            self._arm_tick()

    def _arm_tick(self) -> None:
        with self.mu:
            if self.lane_on and self._tick_handle is None:
                self._tick_handle = self._loop.call_later(LANE_TICK, self._tick)

    def _lane_stopped(self) -> None:
        """On the loop: the lane gave back (nothing it may take up): send what it held back,
        then go on as after any call."""
        with self.mu:
            if self.lane_on:
                return  # taken up again meanwhile
            if self._tick_handle is not None:
                self._tick_handle.cancel()
                self._tick_handle = None
            if self.pending:
                self._send_pending()
            if self.shutdown:
                if self.current is None:
                    self._tg.cancel_scope.cancel()
            else:
                self._next()

    # What every call does, on the loop or in the lane.

    def _begin(self) -> tuple[float, float]:
        reap_zombies()  # leftovers the supervisor killed between calls
        if self.capture is not None:
            self.capture.begin()
        return _usage()

    def _args(self, msg: Any) -> Any:
        try:
            args = unpack_value(msg.args, self.max_frame)
        except ValueError as exc:
            return exc  # the registry turns a non-mapping into an ordinary `error`
        # Fresh from msgpack, held by nobody else: the registry freezes them without a copy.
        return self._decoded(args) if type(args) is dict else args

    def _extras(self, before: tuple[float, float]) -> dict[str, Any]:
        extras = _usage_since(before)
        if self.started_at:
            extras["started_at"] = self.started_at
        return extras

    def _conclude(self, call_id: int, result: Any, extras: dict[str, Any]) -> tuple[bytes, bool]:
        """With the lock: the call is over. Count its leftovers, keep its result in the
        ledger; its frame, and whether it may be held back (another call is queued)."""
        leftovers = len(_children()) if _has_children() else 0
        if not leftovers and self.members is not None:
            try:
                leftovers = others_listed(os.pread(self.members, 1 << 16, 0), self.pid)
            except OSError:
                leftovers = 0
        # Left processes behind: take up nothing more until the supervisor killed them.
        self.hold = leftovers > 0 and not self.allow_background
        self.current = None
        packed = result._packed_value
        if packed is None and result.value is not None:
            packed = pack_value(result.value)
        # A value too large for a ledger slot however it is framed is not kept (nor framed
        # twice to find out).
        slot = None if len(packed or b"") > SLOT_PAYLOAD else self._free_slot()
        reply = Result(
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


def _within(reply: Result, size: int, max_frame: int) -> Result:
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


def _children() -> list[int]:
    """This process's child processes, zombies included (cheap: /proc, no scan)."""
    pids: list[int] = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
        except OSError:
            pass
    return pids


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
