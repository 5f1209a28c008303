"""Forced kill -> settled in a steady pool: a one-worker pool serves a no-op, then a call
that sleeps ignoring its signal (``soak_tools.stubborn``), which ``cancel(force=True)``
kills 20 ms after its submission; the
time from the request to the result (as the awaiting caller sees it), over ``--trials`` kills
of one pool; the time from that result to the next no-op's, which runs on the killed
worker's replacement (the pool has one worker); and from the kill's request to that no-op's
result (what moved from the first interval to the second shows there: the replacement's
start, since issue 26 step 5 paid after the caller runs). ``--spares N``: the pool keeps N
warm spares, and the next no-op runs on one (issue 26's "next call after a kill, warm
spare"); each kill waits until the spare started after the last one is ready.

Part 3 of ``run.py`` opens a new pool for each trial; this measures the kill path alone, away
from a pool's start. Before/after: run it with each checkout's ``src`` on ``PYTHONPATH``,
alternating (``docs/performance.md``). Prints the medians, the 10th and 90th percentiles in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import toolpool


async def measure(trials: int, spares: int) -> tuple[list[float], list[float], list[float]]:
    times: list[float] = []
    nexts: list[float] = []
    totals: list[float] = []
    start = settled = 0.0
    async with toolpool.Pool("soak_tools:registry", workers=1, warm_spares=spares) as pool:
        for _ in range(trials):
            settled = time.monotonic()
            await pool.call("quick")
            if times:
                nexts.append((time.monotonic() - settled) * 1e3)
                totals.append((time.monotonic() - start) * 1e3)
            call = pool.submit("stubborn", {"seconds": 600.0})
            await anyio.sleep(0.02)  # a measurement, not a test: the body is running by then
            while spares and pool.statistics().workers.get("ready", 0) < spares:
                await anyio.sleep(0.005)  # (the spare started after the last kill: ready)
            start = time.monotonic()
            call.cancel(force=True)
            result = await call
            times.append((time.monotonic() - start) * 1e3)
            assert result.outcome is toolpool.Outcome.KILLED, result
        settled = time.monotonic()
        await pool.call("quick")
        nexts.append((time.monotonic() - settled) * 1e3)
        totals.append((time.monotonic() - start) * 1e3)
    return times, nexts, totals


def _line(what: str, values: list[float]) -> str:
    values = sorted(values)
    tenth = len(values) // 10
    return (
        f"{what}: median {statistics.median(values):.2f} ms, "
        f"p10 {values[tenth]:.2f}, p90 {values[-1 - tenth]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument(
        "--spares", type=int, default=0, help="warm spares (the next call runs on one)"
    )
    args = parser.parse_args()
    times, nexts, totals = anyio.run(measure, args.trials, args.spares)
    on = f"on a warm spare ({args.spares})" if args.spares else "on the replacement"
    print(f"{_line('forced kill -> settled, steady pool', times)} ({len(times)} kills)")
    print(_line(f"settled -> the next call's result ({on})", nexts))
    print(_line("forced kill -> the next call's result", totals))


if __name__ == "__main__":
    main()
