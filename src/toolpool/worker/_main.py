"""The worker process: ``python -m toolpool.worker --endpoint ... --tools module:attr``.

Set-up happens first, single-threaded, before zmq starts its threads and before the tools
module is imported: die with the parent (PR_SET_PDEATHSIG), check the parent did not already
die, become a child subreaper (so daemons a tool starts stay in this tree), read the per-worker
secret from stdin. Then connect, import the tools, say hello, and serve one call at a time.

The worker never kills or abandons anything: a cancel message only cancels the call's signal.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

# Stdlib and msgpack only (no threads): safe before set-up. zmq is imported after it.
from ..core import CancelCause, CancelController, cancel_with_runtime_cause
from ..protocol import (
    PROTOCOL_VERSION,
    Call,
    Cancel,
    CancelAck,
    Fatal,
    Hello,
    Ping,
    Pong,
    ProtocolViolation,
    Result,
    Shutdown,
    Started,
    decode_from_supervisor,
    encode,
    pack_value,
    unpack_value,
)
from ..sandbox import Profile
from ..sandbox._apply import apply_profile
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
    return parser.parse_args(argv)


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
    for part in attr.split("."):
        obj = getattr(obj, part)
    if callable(obj) and not isinstance(obj, Registry):
        obj = obj()
    if not isinstance(obj, Registry):
        raise TypeError(f"{spec!r} is a {type(obj).__name__}, not a toolpool.Registry")
    return obj


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    procs = [p for p in args.cgroup_procs.split(",") if p]
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
        catalog = registry.catalog()
    except BaseException:
        sock.send(encode(Fatal(secret, traceback.format_exc(limit=20)[-8000:])))
        sock.close()
        ctx.term()
        os._exit(EXIT_TOOLS_FAILED)
    sock.send(encode(Hello(PROTOCOL_VERSION, os.getpid(), secret, catalog, report)))

    server = _Server(sock, registry, args.max_frame, capture)
    try:
        anyio.run(server.serve)
    finally:
        sock.close(linger=1000)
        ctx.term()


class _Server:
    """The worker's loop: reads messages while a body runs, one call at a time."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        registry: Registry,
        max_frame: int,
        capture: OutputCapture | None = None,
    ) -> None:
        self.capture = capture
        self.sock = sock
        self.registry = registry
        self.max_frame = max_frame
        self.current: tuple[int, Any] | None = None  # (call_id, CancelController)
        self.shutdown = False
        self._tg: Any = None
        self._loop: Any = None  # asyncio: each call runs as a plain task (cheaper than anyio's)
        self._task: Any = None
        self._failure: BaseException | None = None
        # zmq is imported only after set-up; keep what the hot path needs at hand.
        import zmq

        from .._transport import readable

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
        self.sock.send(frame, 0, copy=len(frame) < 65536)
        # Sending may consume the edge of zmq's notification fd: drain what arrived meanwhile.
        if self._readable(self.sock):
            self._drain()

    def _drain(self) -> None:
        sock = self.sock
        while self._readable(sock):
            frame = sock.recv(self._noblock)
            try:
                msg = decode_from_supervisor(frame, max_len=self.max_frame)
            except ProtocolViolation:
                traceback.print_exc()
                os._exit(EXIT_PROTOCOL)
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Call):
            if self.current is not None:  # the supervisor never does this
                os._exit(EXIT_PROTOCOL)
            controller = CancelController()
            self.current = (msg.call_id, controller)
            if self._loop is not None:
                self._task = self._loop.create_task(self._run(msg, controller))
                self._task.add_done_callback(self._call_done)
            else:
                self._tg.start_soon(self._run, msg, controller)
        elif isinstance(msg, Cancel):
            if self.current is not None and self.current[0] == msg.call_id:
                cancel_with_runtime_cause(self.current[1], CancelCause(msg.cause))  # type: ignore[arg-type]
                self._send(encode(CancelAck(msg.call_id)))
        elif isinstance(msg, Ping):
            self._send(encode(Pong(msg.nonce)))
        elif isinstance(msg, Shutdown):
            self.shutdown = True
            if self.current is None:
                self._tg.cancel_scope.cancel()

    def _call_done(self, task: Any) -> None:
        """A call's task ended: a failure of the worker itself stops it, loudly."""
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            self._tg.cancel_scope.cancel()

    async def _run(self, msg: Any, controller: Any) -> None:
        call_id = msg.call_id
        reap_zombies()  # leftovers the supervisor killed between calls
        if self.capture is not None:
            self.capture.begin()
        before = _usage()
        try:
            args = unpack_value(msg.args, self.max_frame)
        except ValueError as exc:
            args = exc  # the registry turns a non-mapping into an ordinary `error`

        def started() -> None:
            self._send(encode(Started(call_id)))

        result = await self.registry.execute_owned(
            msg.tool, args, controller=controller, call_id=str(call_id), on_dispatch=started
        )
        packed = result._packed_value
        if packed is None and result.value is not None:
            packed = pack_value(result.value)
        extras = _usage_since(before)
        if self.capture is not None:
            output, dropped = await anyio.to_thread.run_sync(self.capture.collect, call_id)
            extras["output"] = output
            extras["output_dropped"] = dropped
        self.current = None
        self._send(
            encode(
                Result(
                    call_id,
                    result.outcome.value,
                    packed,
                    result.error,
                    result.error_name,
                    result.body_started,
                    dict(result.context),
                    len(_children()) if _has_children() else 0,
                    extras,
                )
            )
        )
        if self.shutdown:
            self._tg.cancel_scope.cancel()


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
