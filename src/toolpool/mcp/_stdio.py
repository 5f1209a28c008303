"""MCP over this process's stdin and stdout: newline-delimited JSON-RPC.

Ours rather than the SDK's ``stdio_server`` for three reasons, each a promise of the face:

- a line that is not JSON, not a JSON-RPC message, or longer than ``max_message_bytes`` is
  answered with a JSON-RPC error (``id`` null when it cannot be read), never dropped silently
  and never a crash; an oversized line is skipped without being held in memory whole;
- reading and writing never keep the server from stopping: a read of stdin waiting on a
  silent client ends when serving ends (the reader polls stdin and a wake-up pipe), and
  reads nothing more: what comes next on stdin is left to the program;
- a client that went away while we write (``EPIPE``) ends the writing quietly.

While it serves, fd 0 reads ``/dev/null`` and fd 1 writes to stderr (the wire is served from
private duplicates), so nothing a handler or a child process does can corrupt the wire.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, BinaryIO

import anyio
import anyio.from_thread
import anyio.lowlevel
import mcp_types as types
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from mcp.shared.message import SessionMessage

__all__ = ("stdio_streams",)

_log = logging.getLogger("toolpool.mcp")

PARSE_ERROR = -32700
INVALID_REQUEST = -32600


def _error(code: int, message: str, request_id: Any = None) -> SessionMessage:
    if not isinstance(request_id, str | int) or isinstance(request_id, bool):
        request_id = None
    return SessionMessage(
        message=types.JSONRPCError(
            jsonrpc="2.0", id=request_id, error=types.ErrorData(code=code, message=message)
        )
    )


def parse_line(line: bytes) -> SessionMessage:
    """One line of the wire: the message, or the JSON-RPC error that answers it."""
    try:
        return SessionMessage(
            message=types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        )
    except Exception:
        pass
    try:
        data = json.loads(line)
    except ValueError:
        return _error(PARSE_ERROR, "Parse error: not JSON")
    except RecursionError:  # a few hundred kilobytes of brackets: refused, never a crash
        return _error(PARSE_ERROR, "Parse error: nested too deeply")
    request_id = data.get("id") if isinstance(data, dict) else None
    return _error(INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message", request_id)


def _claim(fd: int, replacement: int) -> tuple[int, int]:
    """Serve the wire from a private duplicate of ``fd``; point ``fd`` at ``replacement``."""
    private = os.dup(fd)
    os.set_inheritable(private, False)
    saved = os.dup(fd)
    os.set_inheritable(saved, False)
    os.dup2(replacement, fd)
    return private, saved


@asynccontextmanager
async def stdio_streams(
    max_message_bytes: int,
) -> AsyncIterator[
    tuple[ObjectReceiveStream[SessionMessage | Exception], ObjectSendStream[SessionMessage]]
]:
    """The wire as the SDK's stream pair (see the module docstring)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    in_fd, saved_in = _claim(0, devnull)
    os.close(devnull)
    out_fd, saved_out = _claim(1, 2)
    writer: BinaryIO = os.fdopen(out_fd, "wb")  # buffered: it writes each line whole
    read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](16)
    replies = write_send.clone()

    written = anyio.Event()

    async def read_lines() -> None:
        try:
            await _read_lines()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the server stopped serving first

    #: What the reader thread saw: a line, None for an oversized one, or ``b""`` at the end.
    lines_send, lines_recv = anyio.create_memory_object_stream[bytes | None](0)
    token = anyio.lowlevel.current_token()
    # Woken (a byte written) when serving ends: the reader stops reading stdin then, so a
    # program that goes on after serving (``serve()`` from Python) keeps what comes next.
    wake_r, wake_w = os.pipe()
    reader_started = False

    def read_in_thread() -> None:
        # A daemon thread of its own: a read blocked on a silent client never holds up
        # the server's exit (an anyio worker thread would: the interpreter joins those).
        limit = max_message_bytes
        pending = bytearray()
        skipping = False  # the rest of an oversized line

        def deliver(line: bytes | None) -> None:
            anyio.from_thread.run(lines_send.send, line, token=token)

        poller = select.poll()  # (not select(): any fd number)
        poller.register(in_fd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        try:
            while True:
                if any(fd == wake_r for fd, _ in poller.poll()):
                    return  # serving ended: leave the rest of stdin unread
                chunk = os.read(in_fd, 65536)
                if not chunk:  # EOF: a last line without its newline is a line too
                    if skipping:
                        deliver(None)
                    elif pending:
                        deliver(bytes(pending))
                    deliver(b"")
                    return
                pending += chunk
                while (end := pending.find(b"\n")) >= 0:
                    line = bytes(pending[: end + 1])
                    del pending[: end + 1]
                    if skipping or len(line) > limit + 1:
                        skipping = False
                        deliver(None)
                    else:
                        deliver(line)
                if len(pending) > limit:  # an oversized line: not held in memory whole
                    skipping = True
                    pending.clear()
        except OSError:  # stdin broke: as its end, the client is gone
            with contextlib.suppress(Exception):
                deliver(b"")
        except Exception:  # the server stopped serving: nothing to tell
            return
        finally:
            os.close(in_fd)
            os.close(wake_r)

    async def _read_lines() -> None:
        nonlocal reader_started
        limit = max_message_bytes
        threading.Thread(target=read_in_thread, name="toolpool-mcp-stdin", daemon=True).start()
        reader_started = True
        async with read_send, replies, lines_recv:
            async for line in lines_recv:
                if line is None:
                    _log.warning("refused a message of more than %d bytes", limit)
                    await replies.send(
                        _error(INVALID_REQUEST, f"Invalid Request: message over {limit} bytes")
                    )
                    continue
                if not line:
                    return  # EOF: the client closed stdin, or went away
                if not line.strip():
                    continue
                message = parse_line(line)
                if isinstance(message.message, types.JSONRPCError):
                    await replies.send(message)
                else:
                    await read_send.send(message)

    #: Encoded lines for the writer thread; ``None`` when there is nothing more.
    out_send, out_recv = anyio.create_memory_object_stream[bytes | None](0)

    def write_in_thread() -> None:
        # A daemon thread too: a write blocked on a client that reads nothing never holds
        # up the server's exit.
        try:
            while (data := anyio.from_thread.run(out_recv.receive, token=token)) is not None:
                try:
                    writer.write(data)
                    writer.flush()
                except OSError:  # EPIPE: the client is gone; what is left goes nowhere
                    _log.info("the client's end of stdout is closed")
                    while anyio.from_thread.run(out_recv.receive, token=token) is not None:
                        pass
                    break
        except Exception:  # the server stopped serving
            return
        finally:
            with contextlib.suppress(Exception):
                anyio.from_thread.run_sync(written.set, token=token)

    async def write_lines() -> None:
        threading.Thread(target=write_in_thread, name="toolpool-mcp-stdout", daemon=True).start()
        async with write_recv, out_send:
            async for message in write_recv:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                await out_send.send(data.encode() + b"\n")
            await out_send.send(None)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_lines)
            tg.start_soon(write_lines)
            try:
                yield read_recv, write_send
            finally:
                # What the server wrote goes out before the end (bounded: a client that
                # reads nothing cannot hold the server up).
                await write_send.aclose()
                await replies.aclose()
                with anyio.move_on_after(5, shield=True):
                    await written.wait()
                tg.cancel_scope.cancel()
    finally:
        with contextlib.suppress(OSError):  # (EPIPE: the reader already ended)
            os.write(wake_w, b"x")
        os.close(wake_w)
        if not reader_started:
            os.close(in_fd)
            os.close(wake_r)
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        os.close(saved_in)
        os.close(saved_out)
