"""Calling a toolpool service from another process: ``toolpool.connect(url)``.

See ``docs/service.md``, "Remote callers".
"""

from ._client import (
    PROTOCOL_VERSION,
    SERVER_LOST,
    Client,
    RemoteCall,
    RemoteError,
    ServerUnavailable,
    connect,
)

__all__ = (
    "PROTOCOL_VERSION",
    "SERVER_LOST",
    "Client",
    "RemoteCall",
    "RemoteError",
    "ServerUnavailable",
    "connect",
)
