#!/usr/bin/env python3
"""``toolpool serve`` beside the in-process pool: what the network hop and a load balancer
cost, what a node's death and a drain take (issue 24).

    python bench/serve.py                  # 2,000 calls a configuration, 32 callers
    python bench/serve.py --smoke          # 200 calls
    python bench/serve.py --out bench/results/serve.json

Configurations, each with the tools of ``tests/serve_tools.py`` and 4 workers a pool:

- ``in-process``: ``toolpool.Pool`` in this process, ``pool.call`` from the callers;
- ``one serve``: one ``toolpool serve`` on loopback, ``toolpool.connect`` from the callers;
- ``three + haproxy``: three ``toolpool serve`` behind haproxy (when installed), the same.

For a no-op tool and a 10 ms tool (``work``): calls/s over the run, and the median latency a
caller saw (submit to result). Then, on one service: **node SIGKILL -> calls settled at the
client** (8 calls running, the node's process group SIGKILLed: seconds until every one of them
settled ``worker_lost`` at the client), and **drain time** (4 calls with 1 s left each, then
SIGTERM: seconds until the process exited, every tree gone; the calls' own second included).
The figures of merit are ratios: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import toolpool  # noqa: E402
from serve_support import HAPROXY, ServeProcess, haproxy, serve_env  # noqa: E402

WORKERS = 4
TOOLS = "serve_tools:registry"
CASES = {"no-op": ("noop", {}), "10 ms": ("work", {"id": "b", "seconds": 0.01})}


async def _drive(call: Any, n: int, callers: int) -> dict[str, float]:
    """``n`` calls from ``callers`` concurrent callers, each awaiting its call's result."""
    latencies: list[float] = []
    left = n

    async def caller() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            result = await call()
            latencies.append(time.perf_counter() - t0)
            if not result.ok:
                raise RuntimeError(f"a call failed: {result.outcome} {result.error}")

    for _ in range(min(50, n)):  # warm
        await call()
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(callers):
            tg.start_soon(caller)
    elapsed = time.perf_counter() - t0
    return {
        "calls_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
    }


def in_process(n: int, callers: int) -> dict[str, dict[str, float]]:
    async def main() -> dict[str, dict[str, float]]:
        sys.path.insert(0, str(HERE.parent / "tests"))
        out = {}
        async with toolpool.Pool(TOOLS, workers=WORKERS) as pool:
            for case, (tool, args) in CASES.items():
                out[case] = await _drive(lambda t=tool, a=args: pool.call(t, a), n, callers)
        return out

    return anyio.run(main)


def remote(url: str, n: int, callers: int) -> dict[str, dict[str, float]]:
    async def main() -> dict[str, dict[str, float]]:
        out = {}
        async with toolpool.connect(url, max_connections=callers) as client:
            for case, (tool, args) in CASES.items():
                out[case] = await _drive(lambda t=tool, a=args: client.call(t, a), n, callers)
        return out

    return anyio.run(main)


def start_nodes(
    tmp: Path, count: int, *extra: str, ledger: Path | None = None
) -> list[ServeProcess]:
    env = serve_env(**({"TOOLPOOL_TEST_LEDGER": str(ledger)} if ledger else {}))
    nodes = []
    for i in range(count):
        nodes.append(
            ServeProcess(
                [TOOLS, "--workers", str(WORKERS), "--http", "127.0.0.1:0", *extra],
                control=str(tmp / f"ctl{len(os.listdir(tmp))}-{i}" / "c.sock"),
                env=env,
            )
        )
    for node in nodes:
        node.wait_serving()
    return nodes


def _started(ledger: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while not ledger.exists() or ledger.read_text().count("start ") < count:
        if time.monotonic() > deadline:
            raise RuntimeError("the calls did not start")
        time.sleep(0.005)


def node_kill(tmp: Path) -> float:
    """Seconds from the SIGKILL of a node's process group to the last of its 8 running
    calls settled at the client."""
    ledger = tmp / "kill.ledger"
    (node,) = start_nodes(tmp, 1, "--workers", "8", ledger=ledger)
    try:

        async def main() -> float:
            async with toolpool.connect(node.url("/mcp")) as client:
                calls = [client.submit("work", {"id": f"k{i}", "seconds": 60}) for i in range(8)]
                await anyio.to_thread.run_sync(_started, ledger, 8)
                t0 = time.perf_counter()
                os.killpg(node.proc.pid, signal.SIGKILL)
                results = [await c for c in calls]
                elapsed = time.perf_counter() - t0
            assert all(r.outcome is toolpool.Outcome.WORKER_LOST for r in results)
            return elapsed

        return anyio.run(main)
    finally:
        node.close()


def drain(tmp: Path) -> tuple[float, float]:
    """A service with 4 calls that had 1 s left gets SIGTERM: seconds until it logged
    ``drained`` (every call settled, every tree gone), and until its process exited."""
    ledger = tmp / "drain.ledger"
    (node,) = start_nodes(tmp, 1, ledger=ledger)
    try:

        async def main() -> tuple[float, float]:
            async with toolpool.connect(node.url("/mcp")) as client:
                calls = [client.submit("work", {"id": f"d{i}", "seconds": 1.0}) for i in range(4)]
                await anyio.to_thread.run_sync(_started, ledger, 4)
                t0 = time.perf_counter()
                node.signal(signal.SIGTERM)
                results = [await c for c in calls]
                await anyio.to_thread.run_sync(node.wait, 60)
                elapsed = time.perf_counter() - t0
            assert all(r.ok for r in results), results
            stamps = {line["event"]: line["ts"] for line in node.lines}
            drained = _seconds(stamps["drained"]) - _seconds(stamps["draining"])
            return drained, elapsed

        return anyio.run(main)
    finally:
        node.close()


def _seconds(stamp: str) -> float:
    """A log line's ``ts`` (``...T16:27:26.852Z``) as seconds of its day."""
    clock = stamp.partition("T")[2].rstrip("Z")
    h, m, sec = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(sec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per configuration")
    parser.add_argument("--callers", type=int, default=32, help="concurrent callers")
    parser.add_argument("--smoke", action="store_true", help="200 calls")
    parser.add_argument("--out", help="write the numbers here as JSON")
    ns = parser.parse_args(argv)
    n = 200 if ns.smoke else ns.calls
    load = os.getloadavg()[0]
    out: dict[str, Any] = {"calls": n, "callers": ns.callers, "load_at_start": round(load, 2)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out["in-process"] = in_process(n, ns.callers)
        nodes = start_nodes(tmp, 1)
        try:
            out["one serve"] = remote(nodes[0].url("/mcp"), n, ns.callers)
        finally:
            for node in nodes:
                node.close()
        if HAPROXY is not None:
            nodes = start_nodes(tmp, 3)
            try:
                with haproxy(tmp, [node.port or 0 for node in nodes]) as port:
                    out["three + haproxy"] = remote(f"http://127.0.0.1:{port}/mcp", n, ns.callers)
            finally:
                for node in nodes:
                    node.close()
        out["node_kill_to_settled_s"] = round(node_kill(tmp), 3)
        drained, exited = drain(tmp)
        out["drain_to_drained_s"] = round(drained, 3)
        out["drain_to_exit_s"] = round(exited, 3)
    out["load_at_end"] = round(os.getloadavg()[0], 2)
    base = out["in-process"]
    print(f"{n} calls a configuration, {ns.callers} callers, load {load:.1f}")
    print(f"{'configuration':18} {'tool':6} {'calls/s':>9} {'p50 ms':>8} {'x calls/s':>10}")
    for config in ("in-process", "one serve", "three + haproxy"):
        for case in CASES:
            if config in out:
                r = out[config][case]
                ratio = r["calls_per_s"] / base[case]["calls_per_s"]
                print(f"{config:18} {case:6} {r['calls_per_s']:>9} {r['p50_ms']:>8} {ratio:>10.2f}")
    print(f"node SIGKILL -> its 8 calls settled at the client: {out['node_kill_to_settled_s']} s")
    print(
        f"drain with 4 calls 1 s from done: SIGTERM -> drained {out['drain_to_drained_s']} s, "
        f"-> process exit {out['drain_to_exit_s']} s"
    )
    if ns.out:
        Path(ns.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
