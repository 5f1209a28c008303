#!/usr/bin/env python3
"""``toolpool batch`` against the async ``pool.submit`` path, in one run (issue 18).

    python bench/batch.py                 # 100,000 no-op lines, 3 rounds (make bench)
    python bench/batch.py --smoke         # 2,000 lines, 1 round
    python bench/batch.py --lines 50000 --small 5000 --rounds 2 --out results/batch.json

Each round runs, alternately and each in a fresh interpreter with the same pool settings
(``bodies:registry``, 2 workers, the defaults otherwise):

- ``submit``: every no-op call submitted at once with ``pool.submit``, then each awaited (as
  ``parts.py`` measures throughput); calls/s from the first submit to the last result;
- ``batch``: ``toolpool batch`` over a file of as many no-op lines, ``--no-progress --json``;
  calls/s as its summary reports it (from the first line read to the last record written),
  and its end-to-end wall time beside.

Then the batch's peak RSS (its own ``ru_maxrss``, reported in its summary) over ``--small``
lines against ``--lines`` lines. Prints a table, and writes the numbers as JSON with
``--out``. The figures of merit are the ratios: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
WORKERS = 2
TOOLS = "bodies:registry"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH, path) if p)
    return env


def submit_path(n: int) -> dict[str, float]:
    """In this (fresh) interpreter: n no-op calls through ``pool.submit``."""
    import anyio

    import toolpool

    async def main() -> dict[str, float]:
        async with toolpool.Pool(TOOLS, workers=WORKERS) as pool:
            for c in [pool.submit("noop") for _ in range(100)]:
                await c  # warm
            t0, c0 = time.perf_counter(), time.process_time()
            calls = [pool.submit("noop") for _ in range(n)]
            for c in calls:
                r = await c
                if not r.ok:
                    raise RuntimeError(f"noop: {r.outcome} {r.error}")
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {
            "calls": n,
            "wall_s": wall,
            "calls_per_s": n / wall,
            "cpu_us_per_call": cpu / n * 1e6,
        }

    return anyio.run(main)


def run_submit(n: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--submit-path", str(n)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def write_input(path: str, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(f'{{"id": "line-{i:07d}", "tool": "noop", "args": {{}}}}\n')


def run_batch(inp: str, tmp: str) -> dict[str, Any]:
    out = os.path.join(tmp, f"out-{time.monotonic_ns()}.jsonl")
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolpool",
            "batch",
            TOOLS,
            inp,
            "-o",
            out,
            "--workers",
            str(WORKERS),
            "--no-progress",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"batch exited {done.returncode}: {done.stderr[-2000:]}")
    summary = json.loads(done.stdout)
    os.unlink(out)
    return {
        "calls": summary["recorded"].get("ok", 0),
        "calls_per_s": summary["calls_per_s"],
        "elapsed_s": summary["elapsed_s"],
        "cpu_us_per_call": summary["cpu_s"] / max(1, summary["recorded"].get("ok", 0)) * 1e6,
        "end_to_end_s": wall,
        "peak_rss_mib": summary["peak_rss_mib"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100_000, help="lines (and calls) per run")
    parser.add_argument("--small", type=int, default=10_000, help="lines of the small RSS run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of submit + batch")
    parser.add_argument("--smoke", action="store_true", help="2,000 lines, 1 round")
    parser.add_argument("--out", help="write the numbers here as JSON")
    parser.add_argument("--submit-path", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.submit_path:
        print(json.dumps(submit_path(args.submit_path)))
        return 0
    if args.smoke:
        args.lines, args.small, args.rounds = 2_000, 200, 1
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        big = os.path.join(tmp, "big.jsonl")
        small = os.path.join(tmp, "small.jsonl")
        write_input(big, args.lines)
        write_input(small, args.small)
        rounds = []
        for _ in range(args.rounds):
            rounds.append({"submit": run_submit(args.lines), "batch": run_batch(big, tmp)})
        small_runs = [run_batch(small, tmp) for _ in range(args.rounds)]
    submit_rate = statistics.median(r["submit"]["calls_per_s"] for r in rounds)
    batch_rate = statistics.median(r["batch"]["calls_per_s"] for r in rounds)
    ratios = [r["batch"]["calls_per_s"] / r["submit"]["calls_per_s"] for r in rounds]
    rss_small = statistics.median(r["peak_rss_mib"] for r in small_runs)
    rss_big = statistics.median(r["batch"]["peak_rss_mib"] for r in rounds)
    result = {
        "lines": args.lines,
        "small": args.small,
        "workers": WORKERS,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "rounds": rounds,
        "small_runs": small_runs,
        "submit_calls_per_s": submit_rate,
        "batch_calls_per_s": batch_rate,
        "ratio_per_round": ratios,
        "ratio_median": statistics.median(ratios),
        "peak_rss_mib_small": rss_small,
        "peak_rss_mib_big": rss_big,
        "rss_growth_mib": rss_big - rss_small,
    }
    print(f"{args.lines:,} no-op calls, {WORKERS} workers, {args.rounds} round(s)")
    print(f"  pool.submit (async)   {submit_rate:>9,.0f} calls/s  (median)")
    print(f"  toolpool batch        {batch_rate:>9,.0f} calls/s  (median)")
    shown = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"  batch / submit        {result['ratio_median']:>9.2f}x        (rounds: {shown})")
    print(
        f"  batch peak RSS        {rss_small:.1f} MiB at {args.small:,} lines, "
        f"{rss_big:.1f} MiB at {args.lines:,}: +{rss_big - rss_small:.1f} MiB"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
