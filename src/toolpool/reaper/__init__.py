"""The reaper: the third kind of process, between the supervisor and its workers.

The supervisor starts one reaper per pool; the reaper starts every worker (as its child, a
child subreaper), kills and reaps their trees, removes what they leave on disk, and reports
back. Its process is :file:`_main.py`, run by path as a plain script (stdlib and psutil, plus
the worker's template modules it may fork from): it never imports the supervisor. The
supervisor's side of it is :class:`ReaperClient`. The messages are in ``docs/protocol.md``.
"""

from ._client import REAPER_ENV, SCRIPT, CloseReport, ReaperClient, finish_cleanup, reaper_env

__all__ = ("REAPER_ENV", "SCRIPT", "CloseReport", "ReaperClient", "finish_cleanup", "reaper_env")
