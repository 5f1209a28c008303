"""What the shell reports of its pool: the statistics snapshot (what ``toolpool.metrics``
reads at a scrape), and at the close what did not die of SIGKILL (unkillable trees) and the
calls they keep from settling."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType

import anyio

from ..reaper import CloseReport
from ._calls import Call
from ._results import Statistics, WorkerState
from .machine import Machine, Probe

__all__ = ("abandon_unsettled", "close_report", "snapshot", "wait_settled_or_stuck")

_log = logging.getLogger("toolpool.supervisor")


def snapshot(core: Machine, probe: Probe, now: float, provider: str | None = None) -> Statistics:
    """A frozen snapshot of the pool (``Pool.statistics``), or of one provider's part of it
    (its workers, its calls: those of its tools, all its generations): counters the core
    keeps, plus what is read now (the oldest queued call, the processes of unkillable
    trees)."""
    core.pay_owed()  # (the submits' dispatch pass, if still owed: read the records after it)
    tally = core.tally(provider)
    workers = [w for w in core.workers.values() if provider is None or w.provider.name == provider]
    calls = [
        c
        for c in core.calls.values()
        if provider is None or (c._owner is not None and c._owner.name == provider)
    ]
    states: dict[str, int] = {}
    for w in workers:
        states[w.state.value] = states.get(w.state.value, 0) + 1
    running = sum(1 for w in workers if w.calls)
    by_tool = {tool: dict(counts) for tool, counts in tally.by_tool.items()}
    oldest = min((c._times["submitted"] for c in calls if c._queued), default=None)
    unkillable: set[int] = set()
    for w in workers:
        if w.state is WorkerState.UNKILLABLE:
            unkillable.update(probe.tree_pids(w.wid, w.pid))
    return Statistics(
        workers=MappingProxyType(states),
        queued=len(calls) - running,
        in_flight=running,
        settled=MappingProxyType(dict(tally.settled)),
        escalations=MappingProxyType(dict(tally.escalations)),
        workers_started=tally.started,
        workers_replaced=tally.replaced,
        submitted=tally.submitted,
        settled_by_tool=MappingProxyType(
            {tool: MappingProxyType(counts) for tool, counts in by_tool.items()}
        ),
        oldest_queued_wait=None if oldest is None else max(0.0, now - oldest),
        unkillable=tuple(sorted(unkillable)),
        workers_unkillable=tally.unkillable,
        settle_latency=tally.settle_latency.snapshot(),
        kill_to_reaped=tally.kill_to_reaped.snapshot(),
        hung=sum(1 for w in workers if w.hung and not w.gone),
    )


async def wait_settled_or_stuck(
    core: Machine, faces: Mapping[int, Call], wait_changed: Callable[[], Awaitable[None]]
) -> None:
    """Until every call has settled, or is held by an unkillable worker (the close's wait:
    those settle only once their tree is gone, which may be never). ``faces``: the pool's
    calls by id."""
    while not core.idle_or_stuck():
        stuck = {id(c) for w in core.unkillable() for c in w.calls}
        call = faces[next(c for c in core.calls.values() if id(c) not in stuck).id]
        async with anyio.create_task_group() as tg:  # it settles, or a worker changed
            tg.start_soon(_then_cancel, call.wait, tg.cancel_scope)
            tg.start_soon(_then_cancel, wait_changed, tg.cancel_scope)


async def _then_cancel(fn: Callable[[], Awaitable[object]], scope: anyio.CancelScope) -> None:
    await fn()
    scope.cancel()


def abandon_unsettled(
    core: Machine, probe: Probe, faces: Mapping[int, Call]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """At the end of the close: the processes of unkillable trees still alive, and the calls
    they keep from settling (logged; their waiters get PoolClosedError from now on).
    ``faces``: the pool's calls by id."""
    pids: set[int] = set()
    ids: list[int] = []
    for w in core.unkillable():
        tree = probe.tree_pids(w.wid, w.pid)
        pids.update(tree)
        for record in w.calls:
            call = faces[record.id]
            ids.append(call.id)
            call._abandon(
                f"the pool closed, and call {call.id} ({call.tool}) is not settled: its "
                f"worker's tree did not die of SIGKILL (processes "
                f"{', '.join(map(str, tree)) or 'unknown'} still alive, in uninterruptible "
                f"sleep?): whether its body ran to the end is unknown"
            )
    if pids or ids:
        _log.error(
            "the pool closes leaving processes that did not die of SIGKILL: %s "
            "(calls not settled: %s)",
            ", ".join(map(str, sorted(pids))) or "unknown",
            ", ".join(map(str, ids)) or "none",
            extra={"pids": sorted(pids), "call_ids": ids},
        )
    return tuple(sorted(pids)), tuple(sorted(ids))


def close_report(
    report: CloseReport,
    unkillable: tuple[int, ...],
    unsettled: tuple[int, ...],
    cgroups_left: list[str],
) -> CloseReport:
    """The close's report, with what the supervisor saw of unkillable trees (the reaper
    names those it saw at its exit) and the cgroups they kept from being removed."""
    if not (unkillable or unsettled or cgroups_left):
        return report
    failed = [f"{path}: the cgroup still holds processes" for path in cgroups_left]
    return dataclasses.replace(
        report,
        finished=report.finished and not failed,
        failed=(*report.failed, *failed),
        unkillable=tuple(sorted(set(report.unkillable) | set(unkillable))),
        unsettled=unsettled,
    )
