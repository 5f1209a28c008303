"""The control socket: ``toolpool status | scale | drain | reload`` talk to a running service.

A Unix stream socket, mode 0600, in a directory of mode 0700 that the service's uid owns;
every connection's peer is checked with ``SO_PEERCRED`` and served only if its uid is the
service's (the directory keeps other users out already; the check holds where a process of
another uid could reach the socket anyway: one with ``CAP_DAC_OVERRIDE``, or a descriptor
passed on). One request per connection: a JSON object on one line, answered by one line.

Requests (``op`` and its fields, nothing else):

- ``{"op": "status"}``
- ``{"op": "scale", "workers": N, "provider": P or null}``
- ``{"op": "drain", "wait": bool, "timeout": seconds or null}``
- ``{"op": "reload", "provider": P or null}``

Answers: ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import anyio
import anyio.abc

from ..core import ToolpoolError

__all__ = (
    "ControlError",
    "ControlServer",
    "default_control_path",
    "request",
    "validate_request",
)

#: The longest request line (bytes); longer is refused.
MAX_REQUEST: Final = 64 * 1024
#: The longest answer the client reads (a status of many providers fits easily).
MAX_ANSWER: Final = 16 * 1024 * 1024
_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    "status": frozenset(),
    "scale": frozenset({"workers", "provider"}),
    "drain": frozenset({"wait", "timeout"}),
    "reload": frozenset({"provider"}),
}

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(ToolpoolError):
    """The control socket could not be reached, refused the request, or answered an error."""


def default_control_path() -> str:
    """Where the service's control socket is unless ``--control`` (or ``TOOLPOOL_CONTROL``)
    says: ``$XDG_RUNTIME_DIR/toolpool/control.sock``; for root ``/run/toolpool/...``;
    else ``/tmp/toolpool-UID/control.sock``."""
    given = os.environ.get("TOOLPOOL_CONTROL")
    if given:
        return given
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "toolpool", "control.sock")
    if os.getuid() == 0:
        return "/run/toolpool/control.sock"
    return f"/tmp/toolpool-{os.getuid()}/control.sock"


def validate_request(data: object) -> dict[str, Any]:
    """``data`` as a request, or :class:`ValueError` saying what is wrong with it."""
    if not isinstance(data, dict):
        raise ValueError("a request is a JSON object")
    op = data.get("op")
    if not isinstance(op, str) or op not in _FIELDS:
        raise ValueError(f"op must be one of {sorted(_FIELDS)}, got {op!r}")
    extra = set(data) - _FIELDS[op] - {"op"}
    if extra:
        raise ValueError(f"{op}: unknown field {sorted(extra)[0]!r}")
    provider = data.get("provider")
    if provider is not None and not isinstance(provider, str):
        raise ValueError(f"{op}: provider must be a string")
    if op == "scale":
        workers = data.get("workers")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"scale: workers must be an integer of at least 1, got {workers!r}")
    if op == "drain":
        if not isinstance(data.get("wait", False), bool):
            raise ValueError("drain: wait must be true or false")
        timeout = data.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0
        ):
            raise ValueError("drain: timeout must be a number of seconds, 0 or more")
    return dict(data)


def _prepare_directory(path: str) -> None:
    """Make the socket's directory (0700) or check that the one there is ours and private;
    remove a stale socket (one nothing listens on)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise ControlError(f"{directory} is not a directory")
    if info.st_uid != os.getuid():
        raise ControlError(
            f"{directory} belongs to uid {info.st_uid}, not this process's ({os.getuid()}): "
            "the control socket needs a directory of its own owner"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, 0o700)  # ours: make it private before the socket appears
    if os.path.lexists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: a service that died
        else:
            raise ControlError(f"another service listens on {path}")
        finally:
            probe.close()


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel recorded it
    when that process connected."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class ControlServer:
    """Serves the control socket at ``path`` with ``handler`` (one request a connection)."""

    def __init__(self, path: str, handler: Handler, *, refused: Callable[[int], None]) -> None:
        self.path = path
        self._handler = handler
        self._refused = refused
        self._listener: anyio.abc.SocketListener | None = None
        self._active = 0
        self._idle = anyio.Event()
        self._idle.set()

    async def open(self) -> None:
        """Create the socket (0600 in a 0700 directory)."""
        _prepare_directory(self.path)
        self._listener = await anyio.create_unix_listener(self.path, mode=0o600)

    async def serve(self) -> None:
        """Accept connections until cancelled."""
        assert self._listener is not None
        async with anyio.create_task_group() as tg:
            while True:
                stream = await self._listener.accept()
                tg.start_soon(self._one, stream)

    async def aclose(self) -> None:
        """Close the listener and remove the socket."""
        if self._listener is not None:
            await self._listener.aclose()
            self._listener = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def answered(self) -> None:
        """Return once no request is being handled (every answer sent)."""
        await self._idle.wait()

    async def _one(self, stream: anyio.abc.SocketStream) -> None:
        self._active += 1
        self._idle = anyio.Event()
        try:
            await self._serve_one(stream)
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def _serve_one(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            uid = peer_uid(raw)
            if uid != os.getuid():
                self._refused(uid)
                # (its request is read, never used: closing with it unread would reset the
                # connection, and the refusal could be lost)
                with anyio.move_on_after(5):
                    with contextlib.suppress(Exception):
                        await _read_line(stream, MAX_REQUEST)
                await _send(stream, {"ok": False, "error": f"uid {uid} may not control this"})
                return
            try:
                line = await _read_line(stream, MAX_REQUEST)
                req = validate_request(json.loads(line))
            except (ValueError, UnicodeDecodeError) as exc:
                await _send(stream, {"ok": False, "error": f"bad request: {exc}"})
                return
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return
            try:
                answer = await self._handler(req)
            except (ToolpoolError, ValueError, KeyError) as exc:
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await _send(stream, answer)


async def _read_line(stream: anyio.abc.SocketStream, limit: int) -> bytes:
    data = b""
    while b"\n" not in data:
        chunk = await stream.receive()
        data += chunk
        if len(data) > limit:
            raise ValueError(f"longer than {limit} bytes")
    return data.partition(b"\n")[0]


async def _send(stream: anyio.abc.SocketStream, answer: Mapping[str, Any]) -> None:
    await stream.send(json.dumps(answer, default=str).encode() + b"\n")


def request(path: str, req: Mapping[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
    """Send one request to the service at ``path``; its answer (``ok`` true), else
    :class:`ControlError` with the service's error or why it could not be reached."""
    validate_request(dict(req))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise ControlError(f"no service at {path} (is toolpool serve running?)") from None
        except ConnectionRefusedError:
            raise ControlError(f"no service listens on {path}") from None
        except PermissionError:
            raise ControlError(f"{path}: permission denied (the service's uid only)") from None
        try:
            sock.sendall(json.dumps(dict(req)).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # (refused before it read the request: its answer says why, below)
        data = b""
        while not data.endswith(b"\n"):
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise ControlError(f"no answer from {path} within {timeout:g}s") from None
            except OSError as exc:
                if exc.errno != errno.ECONNRESET:
                    raise
                chunk = b""
            if not chunk:
                raise ControlError(f"the service at {path} closed the connection unanswered")
            data += chunk
            if len(data) > MAX_ANSWER:
                raise ControlError(f"the answer from {path} is too long")
    finally:
        sock.close()
    answer = json.loads(data)
    if not isinstance(answer, dict) or not answer.get("ok"):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise ControlError(str(error))
    return answer
