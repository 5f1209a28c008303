"""What the machine asks the shell to do: :meth:`Machine.flush` returns these, in order.

Plain named tuples, and one that is not: a settled call is said by its
:class:`~._records.CallRecord` itself (no object made per call: the hot path). The shell
(``supervisor/_channels.py``) performs each, the simulation (``tests/sim_world.py``)
performs them on its model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from ._records import CallRecord, ProviderRecord

__all__ = (
    "Action",
    "Changed",
    "Clean",
    "Close",
    "FirstHello",
    "Kill",
    "Orphaned",
    "Progressed",
    "ProviderDown",
    "Resized",
    "ProviderUp",
    "RestartReaper",
    "Send",
    "Spawn",
    "Started",
    "Terminate",
    "Unkillable",
    "WorkerDown",
    "WorkerUp",
)


class Send(NamedTuple):
    """Send ``frames`` to worker ``wid`` as one multipart message. ``calls`` are the calls
    whose ``call`` frames these are: if the send fails, report ``send_failed``."""

    wid: int
    frames: list[bytes]
    calls: tuple[CallRecord, ...] = ()


class Spawn(NamedTuple):
    """Start worker ``wid`` of ``provider`` (its socket, files, the reaper's spawn); its
    hello must carry ``secret``."""

    wid: int
    secret: bytes
    provider: str = "default"


class Terminate(NamedTuple):
    """SIGTERM worker ``wid``'s whole tree."""

    wid: int


class Kill(NamedTuple):
    """SIGKILL worker ``wid``'s whole tree (the reaper freezes it and loops until empty)."""

    wid: int


class Clean(NamedTuple):
    """Kill what worker ``wid``'s last call left running (never the worker); answered by
    ``cleaned``."""

    wid: int


class Close(NamedTuple):
    """Worker ``wid`` is gone: close its socket and files."""

    wid: int


class Unkillable(NamedTuple):
    """Worker ``wid``'s tree is still there ``unkillable_after`` seconds after its SIGKILL
    (``pids``: its processes then): report it (the core has logged it, taken the worker out
    of service and started its replacement; the reaper goes on reaping it)."""

    wid: int
    pids: tuple[int, ...]


class Orphaned(NamedTuple):
    """The reaper died: end worker ``wid``'s tree without it (its cgroup, where it has one),
    then report ``worker_gone`` saying whether the whole tree was verified gone."""

    wid: int


class RestartReaper(NamedTuple):
    """Every worker of the dead reaper is gone: start a new one, then report
    ``reaper_ready`` (or ``reaper_failed``)."""


class Started(NamedTuple):
    """``call``'s body started: wake whoever waits for that."""

    call: CallRecord


class Progressed(NamedTuple):
    """``call``'s body reported progress (``call._progress``): wake whoever follows it."""

    call: CallRecord


class Changed(NamedTuple):
    """The workers changed (one became ready, failed, or is gone)."""


class FirstHello(NamedTuple):
    """The first hello of a provider's worker: the containment layers it applied."""

    containment: Mapping[str, Any]
    provider: str = "default"


class ProviderUp(NamedTuple):
    """``provider`` became resolvable: every worker it started with is ready (an add, or a
    reload swapped in). ``replaced``: the generation it took over from (a reload)."""

    provider: ProviderRecord
    replaced: ProviderRecord | None = None


class ProviderDown(NamedTuple):
    """``provider`` is no longer resolvable (removed, rolled back, failed to start,
    replaced by a reload): announce its removal."""

    provider: ProviderRecord
    reason: str


class Resized(NamedTuple):
    """``provider`` was resized from ``old`` to ``new`` workers (``reason``: a ``resize``
    call, or the autoscaler's decision and why)."""

    provider: ProviderRecord
    old: int
    new: int
    reason: str


class WorkerUp(NamedTuple):
    """Worker ``wid`` (``pid``) of ``provider`` said hello: it serves."""

    wid: int
    pid: int | None
    provider: str


class WorkerDown(NamedTuple):
    """Worker ``wid`` and its tree are gone; ``why``: retired, crashed, killed, lost."""

    wid: int
    pid: int | None
    provider: str
    why: str


Action = (
    Send
    | Spawn
    | Terminate
    | Kill
    | Clean
    | Close
    | Orphaned
    | Unkillable
    | RestartReaper
    | CallRecord  # (that call settled: wake whoever waits for it)
    | Started
    | Progressed
    | Changed
    | FirstHello
    | ProviderUp
    | ProviderDown
    | Resized
    | WorkerUp
    | WorkerDown
)
