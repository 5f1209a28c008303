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
    N=2000 REPS=1 FAKE=base valgrind --tool=callgrind python bench/worker_cost.py
    N=6000 REPS=1 FAKE=base valgrind --tool=callgrind python bench/worker_cost.py
    # FAKE=1's loop with C stand-ins: its call sites, which a real run counts as the worker's
    # (the fake's callees alone: FAKE=1 - FAKE=base)

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

import functools
import mmap
import operator
import os
import threading
import time
from itertools import repeat

import msgpack
import zmq

from toolpool.protocol import ResultMessage, Shutdown, decode_from_worker, encode, encode_call
from toolpool.protocol._ledger import LEDGER_SIZE
from toolpool.worker import _server
from toolpool.worker._main import load_registry

NO_ARGS = b"\x80"  # msgpack: {}
_RCVMORE = zmq.RCVMORE
_RESULT = b"\x9a\xa6result"  # a result's frame begins so (an array of 10, "result")
#: In a no-op's result frame: "ok", its value (None, packed), no error, started, no context,
#: no leftovers; and at its end, kept (in a ledger slot).
_OK_NONE, _KEPT = b"\xa2ok\xc4\x01\xc0\xc0\xc0\xc3\x80\x00", b"\xa4kept\xc3"


class FakeSupervisor:
    """Stands in for the worker's PAIR socket: the next call is readable as soon as the
    previous call's result was sent; after ``n`` calls, ``shutdown``.

    It costs the measure as little as it can: every call's frame is made before the worker
    starts (byte for byte ``encode_call``'s, as the supervisor makes them; call k acknowledges
    the k - 1 results before it, so every result is kept in a ledger slot and none waits for
    an ack), ``get``, ``recv`` and ``getsockopt`` are C callables (no Python frame), and
    ``send`` only keeps the frame and makes the next call readable. The results are checked
    after the run (:meth:`check`): every frame cheaply, a sample of them strictly. (Past the
    last frame ``recv`` returns 0, which the worker rejects as a protocol violation: exit 72.)"""

    def __init__(self, n: int) -> None:
        self.n = n
        pack = msgpack.Packer(use_bin_type=True).pack
        fields = zip(repeat("call"), range(1, n + 1), repeat("noop"), repeat(NO_ARGS), range(n))
        calls = list(map(pack, fields))  # (a tuple packs as an array: no Python frame a call)
        assert not n or calls[-1] == encode_call(n, "noop", NO_ARGS, n - 1)
        calls.append(encode(Shutdown()))
        self._calls = iter(calls)
        # What the worker may read: it grows by one frame per result sent; a list iterator
        # over it reads in order, and its length hint is how many frames are unread.
        self._readable = [next(self._calls)]
        unread = iter(self._readable)
        self.recv = functools.partial(next, unread)  # recv(flags): the next frame (never past)
        self.get = functools.partial(operator.length_hint, unread)  # get(EVENTS): 1 or 0 (POLLIN)
        self.results: list[bytes] = []
        self._never_r, self._never_w = os.pipe()  # its "notification fd": never readable
        self.getsockopt = {_RCVMORE: 0, zmq.FD: self._never_r}.__getitem__  # one part a message

    def close(self) -> None:
        os.close(self._never_r)
        os.close(self._never_w)

    def check(self, *, in_order: bool = True) -> None:
        """Every result sent was ``ok`` with no value, no error, started, an empty context, no
        leftovers, and kept (counts over all the frames together); a sample of them, spread
        over the run, decodes strictly as the supervisor decodes, with the call ids in order."""
        results = self.results
        assert len(results) == self.n, (len(results), self.n)
        joined = b"".join(results)
        assert joined.count(_OK_NONE) == joined.count(_KEPT) == self.n
        for i in sorted({0, self.n - 1, *range(0, self.n, max(1, self.n // 50))}):
            msg = decode_from_worker(results[i])
            assert isinstance(msg, ResultMessage), msg
            assert msg.call_id == (i + 1 if in_order else 1), msg
            assert msg.outcome == "ok", msg
            assert msg.leftovers == 0, msg
            assert msg.extras["kept"] is True, msg
            assert msg.extras["cpu_time"] >= 0, msg

    # What the worker's server calls (besides recv, get and getsockopt above).

    def setsockopt(self, option: int, value: int) -> None:
        pass

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        if frame.startswith(_RESULT):
            self.results.append(frame)
            self._readable.append(next(self._calls))

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
    fake.check()
    ledger.close()
    fake.close()
    return elapsed


class _StandIn:
    """The calls of :func:`run_fake`'s loop answered by C builtins that do next to nothing
    (``FAKE=base``): what the loop and its call sites cost, which in a real run are the
    worker's own (its calls of the socket's methods)."""

    get = recv = getsockopt = staticmethod(abs)
    send = staticmethod(slice)  # (three positional arguments)

    def check(self, *, in_order: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def run_fake(n: int, *, base: bool = False) -> float:
    """The fake supervisor's side of ``n`` calls alone, as the worker's server asks for it
    (its calls made, its events read twice, a call received, a result sent, the results
    checked), with no worker; return the CPU seconds it took. What the measure above counts
    that is not the worker's, and a little more: the loop's own call sites (``base``: the
    same loop with C stand-ins, whose cost is those call sites, the worker's own in a real
    run)."""
    fake: FakeSupervisor | _StandIn = _StandIn() if base else FakeSupervisor(n)
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
        fake.send(frame, 0, True)  # (copy, by position: as the worker calls it)
    elapsed = time.process_time() - t0
    fake.check(in_order=False)  # (one frame sent n times: its call id is 1)
    fake.close()
    return elapsed


def main() -> None:
    if os.environ.get("FAKE") in ("1", "base"):
        n, base = int(os.environ.get("N", "20000")), os.environ.get("FAKE") == "base"
        reps = int(os.environ.get("REPS", "7"))
        runs = [run_fake(n, base=base) / n * 1e6 for _ in range(reps)]
        what = "its loop with C stand-ins" if base else "fake supervisor CPU per call, alone"
        print(f"{what}: {min(runs):.1f} us (best of {len(runs)})")
        return
    if os.environ.get("CONTROL") != "1":
        _server.start_thread_blocking_signals = _no_control  # type: ignore[assignment]
    n = int(os.environ.get("N", "20000"))
    runs = [run(n) / n * 1e6 for _ in range(int(os.environ.get("REPS", "7")))]
    assert threading.active_count() == 1 or os.environ.get("CONTROL") == "1"
    print(f"worker CPU per no-op call: {min(runs):.1f} us (best of {len(runs)})")


if __name__ == "__main__":
    main()
