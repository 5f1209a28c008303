"""The supervisor side: the pool, worker processes, escalation and settlement.

Never imports :mod:`toolpool.worker`: workers are started by module path.
"""

from ._calls import Call, Group
from ._map import MapIterator, SyncMapIterator
from ._pool import Pool
from ._results import ContainmentReport, Layer, Result, Rung, Statistics, Timeline, WorkerState
from ._sync import SyncCall, SyncPool

__all__ = (
    "Call",
    "ContainmentReport",
    "Group",
    "Layer",
    "MapIterator",
    "Pool",
    "Result",
    "Rung",
    "Statistics",
    "SyncCall",
    "SyncMapIterator",
    "SyncPool",
    "Timeline",
    "WorkerState",
)
