"""The supervisor side: the pool, worker processes, escalation and settlement.

Never imports :mod:`toolpool.worker`: workers are started by module path. Each public name
is imported on first use (``from toolpool.supervisor import Pool`` loads the pool's modules,
not the executor's or the sync face's: ``tests/test_imports.py``).
"""

from __future__ import annotations

import typing as _typing

from .._lazy import lazy_names

# isort: off
if _typing.TYPE_CHECKING:
    from ._calls import Call as Call, Group as Group
    from ._events import (
        PoolEvent as PoolEvent,
        ProviderAdded as ProviderAdded,
        ProviderInfo as ProviderInfo,
        ProviderRemoved as ProviderRemoved,
        ProviderResized as ProviderResized,
        ToolsChanged as ToolsChanged,
        WorkerExited as WorkerExited,
        WorkerStarted as WorkerStarted,
    )
    from ._executor import (
        CallFailed as CallFailed,
        Executor as Executor,
        ExecutorFuture as ExecutorFuture,
        RemoteError as RemoteError,
        RemoteTraceback as RemoteTraceback,
        terminate as terminate,
    )
    from ._map import MapIterator as MapIterator, SyncMapIterator as SyncMapIterator
    from ._pool import Pool as Pool
    from ._results import (
        ContainmentReport as ContainmentReport,
        Histogram as Histogram,
        Layer as Layer,
        Progress as Progress,
        Result as Result,
        Rung as Rung,
        Statistics as Statistics,
        Timeline as Timeline,
        WorkerState as WorkerState,
    )
    from ._sync import SyncCall as SyncCall, SyncPool as SyncPool
# isort: on

#: Where each public name lives: imported on first access by :func:`__getattr__`.
_EXPORTS: dict[str, str] = {
    "Call": "_calls",
    "CallFailed": "_executor",
    "ContainmentReport": "_results",
    "Executor": "_executor",
    "ExecutorFuture": "_executor",
    "Group": "_calls",
    "Histogram": "_results",
    "Layer": "_results",
    "MapIterator": "_map",
    "Pool": "_pool",
    "PoolEvent": "_events",
    "Progress": "_results",
    "ProviderAdded": "_events",
    "ProviderInfo": "_events",
    "ProviderRemoved": "_events",
    "ProviderResized": "_events",
    "RemoteError": "_executor",
    "RemoteTraceback": "_executor",
    "Result": "_results",
    "Rung": "_results",
    "Statistics": "_results",
    "SyncCall": "_sync",
    "SyncMapIterator": "_map",
    "SyncPool": "_sync",
    "Timeline": "_results",
    "ToolsChanged": "_events",
    "WorkerExited": "_events",
    "WorkerStarted": "_events",
    "WorkerState": "_results",
    "terminate": "_executor",
}

__all__ = (
    "Call",
    "CallFailed",
    "ContainmentReport",
    "Executor",
    "ExecutorFuture",
    "Group",
    "Histogram",
    "Layer",
    "MapIterator",
    "Pool",
    "PoolEvent",
    "Progress",
    "ProviderAdded",
    "ProviderInfo",
    "ProviderRemoved",
    "ProviderResized",
    "RemoteError",
    "RemoteTraceback",
    "Result",
    "Rung",
    "Statistics",
    "SyncCall",
    "SyncMapIterator",
    "SyncPool",
    "Timeline",
    "ToolsChanged",
    "WorkerExited",
    "WorkerStarted",
    "WorkerState",
    "terminate",
)


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals(), __all__)
