"""The pool's machine: its decisions, sans I/O (``docs/core.md``).

:class:`Machine` owns the parts (settlement, dispatch, the ladder, the fleet of providers,
the workers' lifecycle) and the :class:`State` they share; the shell (``supervisor/``)
turns the world into its events and performs the actions it returns.
"""

from ._actions import (
    Action,
    Changed,
    Clean,
    Close,
    FirstHello,
    Kill,
    Orphaned,
    Progressed,
    ProviderDown,
    ProviderResized,
    ProviderUp,
    RestartReaper,
    Send,
    Settled,
    Spawn,
    Started,
    Terminate,
    Unkillable,
    WorkerDown,
    WorkerUp,
)
from ._dispatch import QUEUE_BEHIND_FOR
from ._lifecycle import EXIT_TOOLS_FAILED, HUNG_AFTER_BEATS, REAPER_START_ATTEMPTS
from ._machine import Machine
from ._records import (
    KILLED_TEXT,
    TIMEOUT_TEXT,
    WORKER_LOST_TEXT,
    Autoscale,
    CallRecord,
    CallState,
    GroupRecord,
    ProviderRecord,
    ProviderSpec,
    WorkerRecord,
)
from ._state import KILL_TO_REAPED_BOUNDS, SETTLE_LATENCY_BOUNDS, CoreConfig, Probe, State, Tally

__all__ = (
    "EXIT_TOOLS_FAILED",
    "HUNG_AFTER_BEATS",
    "KILLED_TEXT",
    "KILL_TO_REAPED_BOUNDS",
    "QUEUE_BEHIND_FOR",
    "REAPER_START_ATTEMPTS",
    "SETTLE_LATENCY_BOUNDS",
    "TIMEOUT_TEXT",
    "WORKER_LOST_TEXT",
    "Action",
    "Autoscale",
    "CallRecord",
    "CallState",
    "Changed",
    "Clean",
    "Close",
    "CoreConfig",
    "FirstHello",
    "GroupRecord",
    "Kill",
    "Machine",
    "Orphaned",
    "Probe",
    "Progressed",
    "ProviderDown",
    "ProviderRecord",
    "ProviderResized",
    "ProviderSpec",
    "ProviderUp",
    "RestartReaper",
    "Send",
    "Settled",
    "Spawn",
    "Started",
    "State",
    "Tally",
    "Terminate",
    "Unkillable",
    "WorkerDown",
    "WorkerRecord",
    "WorkerUp",
)
