"""The supervisor's CPU per no-op call, in-process: the shell and core against an instant
fake worker socket (no worker process, no zmq I/O thread), so what is measured is only
toolpool's supervisor-side Python.

    python bench/supervisor_cost.py                  # CPU us per call, best of REPS runs
    N=2000 REPS=1 valgrind --tool=callgrind python bench/supervisor_cost.py
    N=6000 REPS=1 valgrind --tool=callgrind python bench/supervisor_cost.py
    # instructions per call: (I(6000) - I(2000)) / 4000; start-up cancels out

Run it with another checkout's ``src`` first on ``PYTHONPATH`` (and ``TESTS=<its tests>``)
for a before/after; it sets up the pool's core by its private names, which it handles for the
versions since the sans-I/O core (issue 13), since providers (issue 17) and since the
machine of parts (issue 25).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.environ.get("TESTS", os.path.join(os.path.dirname(__file__), "..", "tests")))

import anyio
import msgpack

import toolpool
from pool_support import FakeWorkerSocket
from toolpool.supervisor._results import WorkerState
from toolpool.supervisor._workerio import WorkerIO

try:  # the machine's parts (issue 25)
    from toolpool.supervisor.machine import ProviderState, WorkerRecord
except ImportError:
    from toolpool.supervisor._records import WorkerRecord  # type: ignore[no-redef]


class InstantWorker(FakeWorkerSocket):
    """Answers every call at once with an ok result it says it kept: one unpack of the call
    frame and one pack of the result per call, so that what is measured is the supervisor,
    not this fake (the frames are what a real worker sends)."""

    _pack = msgpack.Packer(use_bin_type=True).pack
    _unpack = staticmethod(functools.partial(msgpack.unpackb, raw=False))

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        call_id = self._unpack(frame)[1]
        result = ["result", call_id, "ok", b"\xc0", None, None, True, _KEPT, 0, _KEPT]
        self.inbox.append(self._pack(result))


_KEPT = {"kept": True}


async def main() -> None:
    runs = []
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
        n = int(os.environ.get("N", "20000"))
        t0 = time.process_time()
        calls = [pool.submit("noop") for _ in range(n)]
        ready.append(w)
        core.dispatch.schedule() if hasattr(core, "fleet") else core._dispatch()
        pool._pump()
        elapsed = time.process_time() - t0
        assert all(c.result().ok for c in calls)  # (read, as a caller does)
        runs.append(elapsed / n * 1e6)
    print(f"supervisor CPU per no-op call: {min(runs):.1f} us (best of {len(runs)})")


if __name__ == "__main__":
    anyio.run(main)
