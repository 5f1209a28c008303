"""The supervisor side: the pool, worker processes, escalation and settlement.

Never imports :mod:`toolpool.worker`: workers are started by module path.
"""

from ._calls import Call, Group
from ._events import (
    PoolEvent,
    ProviderAdded,
    ProviderInfo,
    ProviderRemoved,
    ProviderResized,
    ToolsChanged,
    WorkerExited,
    WorkerStarted,
)
from ._executor import (
    CallFailed,
    Executor,
    ExecutorFuture,
    RemoteError,
    RemoteTraceback,
    terminate,
)
from ._map import MapIterator, SyncMapIterator
from ._pool import Pool
from ._results import (
    ContainmentReport,
    Histogram,
    Layer,
    Progress,
    Result,
    Rung,
    Statistics,
    Timeline,
    WorkerState,
)
from ._sync import SyncCall, SyncPool

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
