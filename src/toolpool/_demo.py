"""``toolpool demo``: the main job on the built-in example tools, in a few seconds.

Runs and cancels calls on tools that cooperate, ignore their signal, ignore SIGTERM, leave a
daemon grandchild behind and crash their worker; prints each call's outcome, the rung reached
and how long each step of its timeline took; then shows that no process of the pool is left.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Awaitable, Callable
from typing import TextIO

import anyio
import psutil

from .supervisor import Call, Pool, Result

EXAMPLES = "toolpool.testing.examples:registry"
_MARKER = f"toolpool-demo-daemon-{os.getpid()}"


async def _cancel_when_started(call: Call, *, force: bool = False) -> Result:
    await call.wait_started()
    call.cancel(force=force)
    return await call


def _scenarios(pool: Pool) -> list[tuple[str, Callable[[], Awaitable[Result]]]]:
    async def queued_then_cancelled() -> Result:
        blockers = [pool.submit("nap", {"seconds": 0.3}) for _ in range(pool.size)]
        queued = pool.submit("echo", {"value": "never runs"})
        queued.cancel()
        result = await queued
        for blocker in blockers:
            await blocker
        return result

    return [
        ("returns a value", lambda: pool.call("echo", {"value": "hello"})),
        ("raises", lambda: pool.call("fail", {"message": "boom"})),
        (
            "cooperates with cancel",
            lambda: _cancel_when_started(pool.submit("nap", {"seconds": 30})),
        ),
        ("cooperates with a timeout", lambda: pool.call("nap", {"seconds": 30}, timeout=0.2)),
        ("cancelled while queued", queued_then_cancelled),
        ("ignores its signal", lambda: _cancel_when_started(pool.submit("busy_loop", {}))),
        ("ignores SIGTERM", lambda: _cancel_when_started(pool.submit("ignore_sigterm", {}))),
        (
            "leaves a daemon, force-killed",
            lambda: _cancel_when_started(
                pool.submit("spawn_daemon_and_block", {"marker": _MARKER}), force=True
            ),
        ),
        ("crashes its worker", lambda: pool.call("crash", {"code": 3})),
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}ms"


def _steps(result: Result) -> str:
    steps = result.timeline.steps()
    out = []
    for (_, before), (name, at) in itertools.pairwise(steps):
        out.append(f"{name} +{_ms(at - before)}")
    return ", ".join(out)


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for n, row in enumerate(rows):
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)] + [row[-1]]
        print("  ".join(cells).rstrip(), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths) + "  " + "-" * 40, file=out)


def _pool_processes(pids: list[int]) -> list[psutil.Process]:
    alive = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    for proc in psutil.process_iter(["cmdline"]):
        if _MARKER in (proc.info.get("cmdline") or []):
            alive.append(proc)
    return alive


async def run_demo(out: TextIO) -> int:
    """Run the demo, print the report to ``out``; return a process exit code."""
    print("toolpool demo: 3 workers, cancel_grace=0.3s, term_grace=0.3s\n", file=out)
    seen: set[int] = set()
    rows = [["scenario", "tool", "outcome", "started", "rung", "total", "timeline (step +time)"]]
    async with Pool(EXAMPLES, workers=3, cancel_grace=0.3, term_grace=0.3) as pool:
        for label, scenario in _scenarios(pool):
            seen.update(pool.worker_pids())
            result = await scenario()
            started = {True: "yes", False: "no", None: "maybe"}[result.body_started]
            rows.append(
                [
                    label,
                    result.tool,
                    result.outcome.value,
                    started,
                    result.rung.value,
                    _ms(result.duration()),
                    _steps(result),
                ]
            )
        seen.update(pool.worker_pids())
        if pool.reaper_pid is not None:
            seen.add(pool.reaper_pid)
        stats = pool.statistics()
    _table(rows, out)
    print(
        f"\nworkers started {stats.workers_started}, replaced {stats.workers_replaced}; "
        f"settled {dict(stats.settled)}",
        file=out,
    )
    left = _pool_processes(sorted(seen))
    if left:
        print(f"\nLEAK: processes of the pool still alive: {[p.pid for p in left]}", file=out)
        return 1
    print(
        f"\nafter close: none of the {len(seen)} pool processes (workers, reaper) "
        "nor the escaped daemon is alive.",
        file=out,
    )
    return 0


def main(out: TextIO) -> int:
    """Entry point for ``toolpool demo``."""
    return anyio.run(run_demo, out)
