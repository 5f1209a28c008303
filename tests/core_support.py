"""Helpers for white-box tests of the pool's core (``toolpool.supervisor.machine``): a probe
that answers from plain dicts, and a core with workers already said hello."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from toolpool.supervisor._results import WorkerState
from toolpool.supervisor.machine import (
    CoreConfig,
    Machine,
    ProviderRecord,
    ProviderSpec,
    ProviderState,
    Send,
    WorkerRecord,
)

__all__ = ("FakeProbe", "core_with_workers", "sent")


class FakeProbe:
    """Ledger marks, kept results and cgroup members as the test sets them."""

    cgroups = True  # (members as the test sets them, at any time: always asked)

    def __init__(self) -> None:
        self.marks_of: dict[int, tuple[int, int]] = {}
        self.kept_of: dict[int, list[tuple[int, bytes]]] = {}
        self.members_of: dict[int, int] = {}
        self.tree_of: dict[int, tuple[int, ...]] = {}
        self.spill_of: dict[int, bytes] = {}

    def marks(self, wid: int) -> tuple[int, int] | None:
        return self.marks_of.get(wid)

    def ledger(self, wid: int) -> tuple[tuple[int, int], list[tuple[int, bytes]]] | None:
        if wid not in self.marks_of:
            return None
        return self.marks_of.pop(wid), self.kept_of.pop(wid, [])

    def spill(self, wid: int, offset: int, lengths: list[int]) -> list[bytes] | None:
        data = self.spill_of.get(wid, b"")
        if offset + sum(lengths) > len(data):
            return None
        out = []
        for n in lengths:
            out.append(data[offset : offset + n])
            offset += n
        return out

    def other_members(self, wid: int, pid: int | None) -> int | None:
        return self.members_of.get(wid)

    def peak(self, wid: int) -> int | None:
        return None

    def reset_peak(self, wid: int) -> None:
        pass

    def tree_pids(self, wid: int, pid: int | None) -> tuple[int, ...]:
        return self.tree_of.get(wid, ())


def core_with_workers(
    n: int, *, ready: bool = True, **config: Any
) -> tuple[Machine, list[WorkerRecord], FakeProbe]:
    """A running core with ``n`` workers that said hello (READY, in the ready list if
    ``ready``), serving the tool ``noop`` (its body in a thread: calls may queue behind it)."""
    probe = FakeProbe()
    core = Machine(CoreConfig(**config), probe, lambda: b"secret")
    core.add_provider("default", ProviderSpec(tools_spec="fake:registry", size=n, prefetch=16), 0.0)
    core.starting = False
    p = serve(core, ["noop"], threaded=["noop"])
    core.start(0.0)  # (its provider is active already: this starts no worker)
    workers = []
    for wid in range(1, n + 1):
        w = WorkerRecord(wid, b"secret", p)
        w.state = WorkerState.READY
        w.answered = True
        w.pid = 1000 + wid
        w.start_method = "fork"
        core.workers[wid] = w
        if ready:
            p.ready.append(w)
        workers.append(w)
    return core, workers, probe


def serve(core: Machine, tools: Iterable[str], *, threaded: Iterable[str] = ()) -> ProviderRecord:
    """Make the core's default provider active with ``tools``, as if its workers had said
    hello (they are the test's to add)."""
    p = core.pending.pop("default")
    p.advance(ProviderState.ACTIVE)
    core.providers["default"] = p
    for tool in tools:
        p.catalog[tool] = {"name": tool}
        core.owner[tool] = p
        core.catalog[tool] = {"name": tool, "provider": "default"}
    p.threaded |= set(threaded)
    return p


def sent(actions: list[Any], wid: int) -> list[bytes]:
    """The frames the actions send to worker ``wid``."""
    return [f for a in actions if isinstance(a, Send) and a.wid == wid for f in a.frames]
