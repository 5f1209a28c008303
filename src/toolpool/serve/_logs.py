"""Structured logs to stderr: one line per lifecycle fact (``--log-format json|text``).

Every record of the ``toolpool`` loggers (the pool's own, and ``toolpool.serve``'s) becomes
one line. The service's records carry an ``event`` (``listening``, ``draining``, ``stopped``...)
and fields; the pool's carry what it attached (``worker_pid``, ``call_id``...). JSON lines
are for a log collector (one object per line: ``ts``, ``level``, ``logger``, ``event``,
``message``, then the fields); text is for a terminal.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, Final, Literal, TextIO

__all__ = ("LogFormat", "configure_logging", "lifecycle")

LogFormat = Literal["text", "json"]

#: The service's own logger: lifecycle facts, each with an ``event``.
log: Final = logging.getLogger("toolpool.serve")

#: What every LogRecord has: anything else on a record is a field someone attached.
_STANDARD: Final = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
) | {"message", "asctime", "taskName"}


def lifecycle(event: str, message: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Log one lifecycle fact of the service."""
    log.log(level, message, extra={"event": event, **fields})


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


def _plain(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = _fields(record)
        out["event"] = fields.pop("event", "log")
        out["message"] = record.getMessage()
        out.update({k: _plain(v) for k, v in fields.items() if k not in out})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    """``time level event: message key=value ...`` on one line (a traceback follows)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        event = fields.pop("event", None)
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        head = f"{stamp} {record.levelname.lower():7} "
        head += f"{event}: " if event else f"{record.name}: "
        tail = "".join(f" {k}={json.dumps(_plain(v), default=str)}" for k, v in fields.items())
        text = head + record.getMessage() + tail
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _not_routine(record: logging.LogRecord) -> bool:
    """False for the MCP face's line of a call that settled ``ok`` and was answered: one a
    call, not a lifecycle fact (written at ``--log-level debug`` only). Formatting and
    writing it cost about a fifth of the service's CPU per no-op call."""
    return not (
        record.levelno == logging.INFO
        and record.name == "toolpool.mcp"
        and getattr(record, "outcome", None) == "ok"
        and getattr(record, "delivered", None) is True
    )


def configure_logging(
    fmt: LogFormat, *, level: int = logging.INFO, stream: TextIO | None = None
) -> logging.Handler:
    """Send the ``toolpool`` loggers' records to ``stream`` (stderr) in ``fmt``; returns the
    handler (to remove it again)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    if level > logging.DEBUG:
        handler.addFilter(_not_routine)
    root = logging.getLogger("toolpool")
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    return handler
