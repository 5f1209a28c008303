"""The supervisor side: the pool, worker processes, escalation and settlement.

Never imports :mod:`toolpool.worker`: workers are started by module path.
"""

from ._calls import Call, Group
from ._pool import Pool
from ._results import (
    ContainmentReport,
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
    "ContainmentReport",
    "Group",
    "Layer",
    "Pool",
    "Progress",
    "Result",
    "Rung",
    "Statistics",
    "SyncCall",
    "SyncPool",
    "Timeline",
    "WorkerState",
)
