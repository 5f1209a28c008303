"""The supervisor side: the pool, worker processes, escalation and settlement.

Never imports :mod:`toolpool.worker`: workers are started by module path.
"""

from ._pool import Call, Group, Pool
from ._results import Result, Rung, Statistics, Timeline, WorkerState

__all__ = ("Call", "Group", "Pool", "Result", "Rung", "Statistics", "Timeline", "WorkerState")
