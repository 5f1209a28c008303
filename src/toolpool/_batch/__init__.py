"""``toolpool batch``: a JSONL file of tool calls through a pool, resumable (docs/batch.md).

``_input`` reads the lines, ``_output`` owns the results file (records, resume, durability),
``_runner`` drives the pool, ``_progress`` draws the bar and the summary (rich).
"""

from ._input import FIELDS, SKIPPED, Job, Rejection
from ._output import FSYNC_EVERY, REJECTED, ResultsFileError, encode
from ._runner import (
    EXIT_INTERRUPTED,
    TICK,
    Batch,
    BatchOptions,
    Recorder,
    Source,
    Summary,
    Watcher,
)

__all__ = (
    "EXIT_INTERRUPTED",
    "FIELDS",
    "FSYNC_EVERY",
    "REJECTED",
    "SKIPPED",
    "TICK",
    "Batch",
    "BatchOptions",
    "Job",
    "Recorder",
    "Rejection",
    "ResultsFileError",
    "Source",
    "Summary",
    "Watcher",
    "encode",
)
