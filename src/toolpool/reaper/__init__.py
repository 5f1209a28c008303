"""The reaper: the third kind of process, between the supervisor and its workers.

The supervisor starts one reaper per pool; the reaper starts every worker (as its child, a
child subreaper), kills and reaps their trees, removes what they leave on disk, and reports
back. Its process is :file:`_main.py`, run by path as a plain script (stdlib and psutil, plus
the worker's template modules it may fork from): it never imports the supervisor. The
supervisor's side of it is :class:`ReaperClient`. The messages are in ``docs/protocol.md``.
"""

import typing as _typing

from .._lazy import lazy_names

if _typing.TYPE_CHECKING:
    from ._ahead import REAPER_ENV, SCRIPT, reaper_env
    from ._client import CloseReport, ReaperClient, finish_cleanup

__all__ = ("REAPER_ENV", "SCRIPT", "CloseReport", "ReaperClient", "finish_cleanup", "reaper_env")

#: Where each name lives, imported on first access: a command starting its reaper ahead
#: (``_ahead.py``) imports that module alone, not the client and what it needs.
_EXPORTS: dict[str, str] = {
    "REAPER_ENV": "_ahead",
    "SCRIPT": "_ahead",
    "reaper_env": "_ahead",
    "CloseReport": "_client",
    "ReaperClient": "_client",
    "finish_cleanup": "_client",
}


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals(), __all__)
