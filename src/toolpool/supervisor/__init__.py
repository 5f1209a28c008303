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
from ._pool import Pool
from ._results import ContainmentReport, Layer, Result, Rung, Statistics, Timeline, WorkerState
from ._sync import SyncCall, SyncPool

__all__ = (
    "Call",
    "ContainmentReport",
    "Group",
    "Layer",
    "Pool",
    "PoolEvent",
    "ProviderAdded",
    "ProviderInfo",
    "ProviderRemoved",
    "ProviderResized",
    "Result",
    "Rung",
    "Statistics",
    "SyncCall",
    "SyncPool",
    "Timeline",
    "ToolsChanged",
    "WorkerExited",
    "WorkerStarted",
    "WorkerState",
)
