"""A worker's CPU per no-op call, in-process: the worker's server loop (``worker/_server.py``)
fed by a fake supervisor socket that hands it the next call as soon as it sent a result (no
supervisor, no zmq I/O thread), so what is measured is only toolpool's worker-side Python.

    python bench/worker_cost.py                  # CPU us per call, best of REPS runs
    N=2000 REPS=1 valgrind --tool=callgrind python bench/worker_cost.py
    N=6000 REPS=1 valgrind --tool=callgrind python bench/worker_cost.py
    # instructions per call: (I(6000) - I(2000)) / 4000; start-up cancels out
    N=2000 REPS=1 FAKE=1 valgrind --tool=callgrind python bench/worker_cost.py
    N=6000 REPS=1 FAKE=1 valgrind --tool=callgrind python bench/worker_cost.py
    # the fake supervisor's own share of that (FAKE=1: its side of each call, no worker)

The calls are sequential (one in the worker at a time, as with ``prefetch=0``), to a plain
sync tool (``toolpool.testing.examples:registry``, ``noop``), with a ledger (anonymous shared
memory, as the file the pool maps) so that results are kept and never wait for an ack.

The worker's control thread is left out by default (``CONTROL=1`` runs it): while calls come
it wakes every ``TICK`` (2 ms) of wall time, which under callgrind's slowdown would be every
call or so, not the one wake-up per tens of calls of a real stream; and a body that runs past
``QUICK_BODY_WAIT`` (0.2 ms of wall time, which callgrind makes likely) would have it say
``started``, which a real no-op never does. Run it with another checkout's ``src`` first on
``PYTHONPATH`` for a before/after.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
import time

import zmq

from toolpool.protocol import CallMessage, ResultMessage, Shutdown, decode_from_worker, encode
from toolpool.protocol._ledger import LEDGER_SIZE
from toolpool.worker import _server
from toolpool.worker._main import load_registry

NO_ARGS = b"\x80"  # msgpack: {}
_RCVMORE = zmq.RCVMORE


class FakeSupervisor:
    """Stands in for the worker's PAIR socket: the next call is readable as soon as the
    previous call's result was sent; after ``n`` calls, ``shutdown``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent = 0
        self.results = 0
        self.inbox: collections.deque[bytes] = collections.deque()
        self._never_r, self._never_w = os.pipe()  # its "notification fd": never readable
        self._next()

    def _next(self) -> None:
        if self.sent < self.n:
            self.sent += 1
            self.inbox.append(encode(CallMessage(self.sent, "noop", NO_ARGS, self.results)))
        else:
            self.inbox.append(encode(Shutdown()))

    def close(self) -> None:
        os.close(self._never_r)
        os.close(self._never_w)

    # What the worker's server calls.

    def getsockopt(self, option: int) -> int:
        if option == _RCVMORE:
            return 0  # (a message of one part; as cheap as pyzmq's C getsockopt allows)
        if option == zmq.FD:
            return self._never_r
        return self.get(option)

    def get(self, option: int) -> int:
        assert option == zmq.EVENTS
        return int(zmq.POLLIN) if self.inbox else 0

    def setsockopt(self, option: int, value: int) -> None:
        pass

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.inbox:
            raise RuntimeError("the worker waits for a message that never comes")
        return [self.inbox.popleft()]

    def recv(self, flags: int = 0, copy: bool = True) -> bytes:
        """One frame (every message is of one part: ``RCVMORE`` is 0). What the worker
        calls since protocol 4 (``recv_multipart`` before), one call as it was."""
        if not self.inbox:
            raise RuntimeError("the worker waits for a message that never comes")
        return self.inbox.popleft()

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        msg = decode_from_worker(frame)
        if isinstance(msg, ResultMessage):
            assert msg.outcome == "ok", msg
            self.results += 1
            self._next()

    def send_multipart(self, frames: list[bytes], flags: int = 0, copy: bool = True) -> None:
        for frame in frames:
            self.send(frame, flags, copy)


class _NoThread:
    def join(self, timeout: float | None = None) -> None:
        pass


def _no_control(target: object, name: str) -> _NoThread:
    return _NoThread()


def run(n: int) -> float:
    """Serve ``n`` no-op calls; return the CPU seconds it took."""
    registry = load_registry("toolpool.testing.examples:registry")
    fake = FakeSupervisor(n)
    ledger = mmap.mmap(-1, LEDGER_SIZE)
    server = _server._Server(fake, registry, 8 << 20, None, ledger)  # type: ignore[arg-type]
    t0 = time.process_time()
    server.serve()
    elapsed = time.process_time() - t0
    assert fake.results == n, (fake.results, n)
    ledger.close()
    fake.close()
    return elapsed


def run_fake(n: int) -> float:
    """The fake supervisor's side of ``n`` calls alone, as the worker's server asks for it
    (its events read twice, a call received, a result sent: decoded, the next call encoded),
    with no worker; return the CPU seconds it took. What the measure above counts that is
    not the worker's."""
    fake = FakeSupervisor(n)
    frame = encode(
        ResultMessage(
            1,
            "ok",
            b"\xc0",
            None,
            None,
            True,
            {},
            0,
            {"cpu_time": 1.5e-05, "max_rss": 123_456_789, "started_at": 12345.678, "kept": True},
        )
    )
    events, more = zmq.EVENTS, zmq.RCVMORE
    t0 = time.process_time()
    for _ in range(n):
        fake.get(events)
        fake.recv(0)
        fake.getsockopt(more)
        fake.get(events)
        fake.send(frame, 0, copy=True)
    elapsed = time.process_time() - t0
    assert fake.results == n, (fake.results, n)
    fake.close()
    return elapsed


def main() -> None:
    if os.environ.get("FAKE") == "1":
        n = int(os.environ.get("N", "20000"))
        runs = [run_fake(n) / n * 1e6 for _ in range(int(os.environ.get("REPS", "7")))]
        print(f"fake supervisor CPU per call, alone: {min(runs):.1f} us (best of {len(runs)})")
        return
    if os.environ.get("CONTROL") != "1":
        _server.start_thread_blocking_signals = _no_control  # type: ignore[assignment]
    n = int(os.environ.get("N", "20000"))
    runs = [run(n) / n * 1e6 for _ in range(int(os.environ.get("REPS", "7")))]
    assert threading.active_count() == 1 or os.environ.get("CONTROL") == "1"
    print(f"worker CPU per no-op call: {min(runs):.1f} us (best of {len(runs)})")


if __name__ == "__main__":
    main()
