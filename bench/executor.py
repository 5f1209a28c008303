"""toolpool.Executor beside concurrent.futures.ProcessPoolExecutor: calls per second of a
trivial function (``operator.add``), submitted one by one and through ``map``.

    .venv/bin/python bench/executor.py [--workers 2] [--smoke]

Prints a markdown table, each row with its ratio to ProcessPoolExecutor. What it measures is
the executors' own cost per call (the function does nothing), on whatever machine runs it:
quote the ratios, not the rates, and only from a quiet machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import operator
import time
from collections.abc import Callable
from typing import Any

import toolpool


def _rates(ex: concurrent.futures.Executor, n: int) -> dict[str, float]:
    ex.submit(pow, 1, 1).result()  # (workers started and warm)
    rates = {}
    started = time.perf_counter()
    futures = [ex.submit(operator.add, i, 1) for i in range(n)]
    for future in futures:
        future.result()
    rates["submit, one by one"] = n / (time.perf_counter() - started)
    started = time.perf_counter()
    list(ex.map(operator.add, range(n), range(n)))
    rates["map, chunksize=1"] = n / (time.perf_counter() - started)
    big = n * 10
    started = time.perf_counter()
    list(ex.map(operator.add, range(big), range(big), chunksize=100))
    rates["map, chunksize=100"] = big / (time.perf_counter() - started)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks it runs")
    args = parser.parse_args()
    n = 50 if args.smoke else 2000
    peers: dict[str, Callable[[], Any]] = {
        "ProcessPoolExecutor": lambda: concurrent.futures.ProcessPoolExecutor(args.workers),
        "toolpool.Executor": lambda: toolpool.Executor(args.workers),
        "toolpool.Executor, prefetch=16": lambda: toolpool.Executor(args.workers, prefetch=16),
    }
    results = {}
    for name, make in peers.items():
        with make() as ex:
            results[name] = _rates(ex, n)
    base = results["ProcessPoolExecutor"]
    print(f"| executor ({args.workers} workers) | " + " | ".join(base) + " |")
    print("| --- |" + " --- |" * len(base))
    for name, rates in results.items():
        cells = [f"{rate:,.0f}/s ({rate / base[row]:.2f}x)" for row, rate in rates.items()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
