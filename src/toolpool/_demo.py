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

from .core import Graces
from .supervisor import Call, Pool, Result
from .supervisor._interrupts import Interrupts

EXAMPLES = "toolpool.testing.examples:registry"
CANCEL_GRACE = 0.3
TERM_GRACE = 0.3
#: The demo's graces: short, so that its kill shows at once.
GRACES = Graces(cancel=CANCEL_GRACE, term=TERM_GRACE)
_MARKER = f"toolpool-demo-daemon-{os.getpid()}"


def _scenarios(
    pool: Pool, interrupts: Interrupts
) -> list[tuple[str, Callable[[], Awaitable[Result]]]]:
    _settled = interrupts.wait

    def submit(tool: str, args: dict[str, object], timeout: float | None = None) -> Call:
        return interrupts.track(pool.submit(tool, args, timeout=timeout))

    def call(tool: str, args: dict[str, object], timeout: float | None = None) -> Awaitable[Result]:
        return _settled(submit(tool, args, timeout))

    async def cancel_when_started(
        tool: str, args: dict[str, object], force: bool = False
    ) -> Result:
        started = submit(tool, args)
        await started.wait_started()
        started.cancel(force=force)
        return await _settled(started)

    async def queued_then_cancelled() -> Result:
        blockers = [submit("nap", {"seconds": 0.3}) for _ in range(pool.size)]
        queued = submit("echo", {"value": "never runs"})
        queued.cancel()
        result = await _settled(queued)
        for blocker in blockers:
            await _settled(blocker)
        return result

    return [
        ("returns a value", lambda: call("echo", {"value": "hello"})),
        ("raises", lambda: call("fail", {"message": "boom"})),
        ("cooperates with cancel", lambda: cancel_when_started("nap", {"seconds": 30})),
        ("cooperates with a timeout", lambda: call("nap", {"seconds": 30}, timeout=0.2)),
        ("cancelled while queued", queued_then_cancelled),
        ("ignores its signal", lambda: cancel_when_started("busy_loop", {})),
        ("ignores SIGTERM", lambda: cancel_when_started("ignore_sigterm", {})),
        (
            "leaves a daemon, force-killed",
            lambda: cancel_when_started("spawn_daemon_and_block", {"marker": _MARKER}, force=True),
        ),
        ("crashes its worker", lambda: call("crash", {"code": 3})),
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


async def run_demo(out: TextIO, *, interrupts: Interrupts | None = None) -> int:
    """Run the demo, print the report to ``out``; return a process exit code.

    With ``interrupts`` (the command line's), Ctrl-C stops the scenarios (see
    ``toolpool.supervisor._interrupts``)."""
    stop = interrupts or Interrupts(GRACES)
    print(
        f"toolpool demo: 3 workers, cancel_grace={CANCEL_GRACE}s, term_grace={TERM_GRACE}s\n",
        file=out,
        flush=True,
    )
    seen: set[int] = set()
    rows = [["scenario", "tool", "outcome", "started", "rung", "total", "timeline (step +time)"]]
    async with Pool(EXAMPLES, workers=3, cancel_grace=CANCEL_GRACE, term_grace=TERM_GRACE) as pool:
        for label, scenario in _scenarios(pool, stop):
            seen.update(pool.worker_pids)
            with stop.cancellable():
                result = await scenario()
            if stop.count:
                break
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
        seen.update(pool.worker_pids)
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
    """Run the demo (without the command line's Ctrl-C handling)."""
    return anyio.run(run_demo, out)
