"""Forced kill -> settled in a steady pool: a one-worker pool serves a no-op, then a call
that sleeps ignoring its signal (``soak_tools.stubborn``), which ``cancel(force=True)``
kills 20 ms after its submission; the
time from the request to the result, over ``--trials`` kills of one pool.

Part 3 of ``run.py`` opens a new pool for each trial; this measures the kill path alone, away
from a pool's start. Before/after: run it with each checkout's ``src`` on ``PYTHONPATH``,
alternating (``docs/performance.md``). Prints the median, the 10th and 90th percentiles in ms.
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


async def measure(trials: int) -> list[float]:
    times = []
    async with toolpool.Pool("soak_tools:registry", workers=1) as pool:
        for _ in range(trials):
            await pool.call("quick")
            call = pool.submit("stubborn", {"seconds": 600.0})
            await anyio.sleep(0.02)  # a measurement, not a test: the body is running by then
            start = time.monotonic()
            call.cancel(force=True)
            result = await call
            times.append((time.monotonic() - start) * 1e3)
            assert result.outcome is toolpool.Outcome.KILLED, result
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=60)
    times = sorted(anyio.run(measure, parser.parse_args().trials))
    tenth = len(times) // 10
    print(
        f"forced kill -> settled, steady pool: median {statistics.median(times):.2f} ms, "
        f"p10 {times[tenth]:.2f}, p90 {times[-1 - tenth]:.2f} ({len(times)} kills)"
    )


if __name__ == "__main__":
    main()
