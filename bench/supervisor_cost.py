"""The supervisor's CPU per no-op call, in-process: the shell and core against an instant
fake worker socket (no worker process, no zmq I/O thread), so what is measured is only
toolpool's supervisor-side Python.

    python bench/supervisor_cost.py                  # CPU us per call, best of REPS runs
    N=2000 REPS=1 valgrind --tool=callgrind python bench/supervisor_cost.py
    N=6000 REPS=1 valgrind --tool=callgrind python bench/supervisor_cost.py
    # instructions per call: (I(6000) - I(2000)) / 4000; start-up cancels out
    N=2000 REPS=1 FAKE=1 valgrind --tool=callgrind python bench/supervisor_cost.py
    N=6000 REPS=1 FAKE=1 valgrind --tool=callgrind python bench/supervisor_cost.py
    # the fake worker's own share of that (FAKE=1: its side of each call, no supervisor)

The fake worker answers with a real worker's no-op result, its frame made of the call
frame's id bytes between two constant pieces (no unpack, no pack): its share, with its own
loop, about 6,200 instructions a call (most of it the Python of its four socket methods).
Compile the ``.pyc`` files before the pair (``python -m compileall -q src bench tests``): a
module compiled in one run of the pair and not in the other moves the difference.

The garbage collector: the timed run starts from a collected heap, and its full (oldest
generation) collections are left out (``GC=full``: the interpreter's thresholds as they are,
the measure before 2026-12-06). A full collection walks the whole process's heap and comes
once the objects that outlived younger collections grow by a quarter of it: whether the
6,000-call run meets one and the 2,000-call run none depends on the heap the bench started
with, not on the supervisor, and one such collection moved the difference by several thousand
instructions a call. The young collections stay in (they follow the supervisor's own
allocations). ``KEPT=1`` prints what a call leaves to the oldest generation: the
collector-tracked objects that outlive it (the bench keeps every call), per call (counting
them walks the heap: not in a run whose instructions are read).

Run it with another checkout's ``src`` first on ``PYTHONPATH`` (and ``TESTS=<its tests>``)
for a before/after; it sets up the pool's core by its private names, which it handles for the
versions since the sans-I/O core (issue 13), since providers (issue 17) and since the
machine of parts (issue 25).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.environ.get("TESTS", os.path.join(os.path.dirname(__file__), "..", "tests")))

import anyio
import msgpack
import zmq

import toolpool
from pool_support import FakeWorkerSocket
from toolpool.supervisor._results import WorkerState
from toolpool.supervisor._workerio import WorkerIO

try:  # the machine's parts (issue 25)
    from toolpool.supervisor.machine import ProviderState, WorkerRecord
except ImportError:
    from toolpool.supervisor._records import WorkerRecord  # type: ignore[no-redef]


class InstantWorker(FakeWorkerSocket):
    """Answers every call at once with an ok result it says it kept, with the fields a real
    worker's no-op result has (an empty context; its CPU time, peak RSS and body's start in
    the extras), made of the call frame's id bytes between two constant pieces (no unpack, no
    pack, nothing built per call ahead of the run, which callgrind would count), so that what
    is measured is the supervisor, not this fake."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = self.inbox.append

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        # ["call", id, ...]: the id's bytes follow the array's header and "call" (6 bytes).
        self.answer(_HEAD + frame[6 : 6 + _ID_LEN.get(frame[6], 1)] + _TAIL)


#: What a worker says of a no-op call besides its result (``worker/_server.py``, ``_extras``).
_EXTRAS = {"cpu_time": 2.1e-05, "max_rss": 21_000_000, "started_at": 1.0, "kept": True}
_HEAD, _TAIL = (
    msgpack.packb(["result"] * 10)[:8],
    msgpack.packb(["ok", b"\xc0", None, None, True, {}, 0, _EXTRAS])[1:],
)
#: The bytes of an id by its first: a positive fixint (1), uint8 (2), uint16 (3), uint32 (5).
_ID_LEN = {0xCC: 2, 0xCD: 3, 0xCE: 5}


def fake_only(n: int) -> None:
    """The fake's side of n calls (FAKE=1), as the pool meets it: per call one send, one
    readable check that finds the result, one receive and one check that finds nothing (the
    call frames are four, of ids of each length, made once)."""
    from toolpool.protocol import encode_call

    sock = InstantWorker()
    frames = [encode_call(i, "noop", b"\x80", 0) for i in (100, 200, 60000, 70000)]
    events = zmq.EVENTS
    for i in range(n):
        sock.send(frames[i & 3], 1, True)
        sock.get(events)
        sock.recv_multipart(1)
        sock.get(events)
    print(f"the fake worker alone: {n} calls")


async def main() -> None:
    runs = []
    n = int(os.environ.get("N", "20000"))
    full_gc = os.environ.get("GC") == "full"
    kept = 0.0
    for _ in range(int(os.environ.get("REPS", "7"))):
        pool = toolpool.Pool("toolpool.testing.examples:registry", workers=1, prefetch=0)
        pool._io[1] = WorkerIO(1, "ipc://fake", InstantWorker(), None)  # type: ignore[arg-type]
        core: Any = pool._core
        if hasattr(core, "owner"):  # providers (issue 17)
            p = core.pending.pop("default")
            if hasattr(p, "advance"):  # a transition table (issue 25)
                p.advance(ProviderState.ACTIVE)
            else:
                p.state, p.starting = "active", False
            core.providers["default"] = p
            p.catalog["noop"] = {"name": "noop"}
            core.owner["noop"] = p
            core.catalog["noop"] = {"name": "noop"}
            w = WorkerRecord(1, b"s", p)
            ready = p.ready
        else:
            w = WorkerRecord(1, b"s")  # type: ignore[call-arg]
            core.catalog["noop"] = {"name": "noop"}
            ready = core.ready
        w.state = WorkerState.READY
        w.answered = True
        core.workers[1] = w
        core.starting = False
        pool._state = "running"
        gc.collect()
        thresholds = gc.get_threshold()
        if not full_gc:
            gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)  # (no full collection)
        count_kept = os.environ.get("KEPT") == "1"
        tracked = len(gc.get_objects()) if count_kept else 0
        t0 = time.process_time()
        calls = [pool.submit("noop") for _ in range(n)]
        ready.append(w)
        core.dispatch.schedule() if hasattr(core, "fleet") else core._dispatch()
        pool._pump()
        elapsed = time.process_time() - t0
        assert all(c.result().ok for c in calls)  # (read, as a caller does)
        if count_kept:
            gc.collect(1)
            kept = (len(gc.get_objects()) - tracked) / n
        gc.set_threshold(*thresholds)
        runs.append(elapsed / n * 1e6)
        del calls
    print(f"supervisor CPU per no-op call: {min(runs):.1f} us (best of {len(runs)})")
    if kept:
        print(f"collector-tracked objects kept per call: {kept:.2f}")


if __name__ == "__main__":
    if os.environ.get("FAKE") == "1":
        fake_only(int(os.environ.get("N", "20000")))
    else:
        anyio.run(main)
