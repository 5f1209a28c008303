"""``toolpool batch``: a JSONL file of tool calls through a pool, resumable (docs/batch.md).

``_input`` reads the lines, ``_output`` owns the results file (records, resume, durability),
``_runner`` drives the pool, ``_progress`` draws the bar and the summary (rich).
"""

from ._input import FIELDS, Job, Rejection
from ._output import FSYNC_EVERY, REJECTED, ResultsFileError
from ._runner import EXIT_INTERRUPTED, TICK, Batch, BatchOptions, Summary, Watcher

__all__ = (
    "EXIT_INTERRUPTED",
    "FIELDS",
    "FSYNC_EVERY",
    "REJECTED",
    "TICK",
    "Batch",
    "BatchOptions",
    "Job",
    "Rejection",
    "ResultsFileError",
    "Summary",
    "Watcher",
)
