"""Capture of tool output (stdout and stderr, children's included) with a cap per call.

The worker's fds 1 and 2 become one pipe. A reader thread drains it all the time, keeping at
most ``limit`` bytes per call and counting the rest, so a flood never blocks a writer and
never bloats the worker. At the end of a call a unique marker is written to the pipe and the
reader hands over what came before it: the output of that call, in order.
"""

from __future__ import annotations

import os
import sys
import threading

from ._threads import start_thread_blocking_signals

__all__ = ("OutputCapture",)


class OutputCapture:
    """Redirects fds 1 and 2 to a pipe drained by a thread; one instance per worker."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        read_fd, write_fd = os.pipe()
        os.set_inheritable(read_fd, False)
        for fd in (1, 2):
            os.dup2(write_fd, fd)
        os.set_inheritable(write_fd, False)
        # Whole lines as they are printed, so the order with the children's output is kept.
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True)
        self._marker_fd = write_fd  # private: a tool may close or reuse fds 1 and 2
        self._read_fd = read_fd
        self._lock = threading.Lock()
        self._kept = bytearray()
        self._dropped = 0
        self._pending = b""
        self._marker: bytes | None = None
        self._marker_seen = threading.Event()
        # Signals are the main thread's, where the tools run (see _server).
        start_thread_blocking_signals(self._drain, "toolpool-output")

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self._read_fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            with self._lock:
                data = self._pending + chunk
                self._pending = b""
                marker = self._marker
                if marker is not None:
                    at = data.find(marker)
                    if at >= 0:
                        self._keep(data[:at])
                        self._pending = data[at + len(marker) :]
                        self._marker = None
                        self._marker_seen.set()
                        continue
                    # Keep a tail that could be the start of a split marker.
                    tail = len(marker) - 1
                    self._keep(data[:-tail] if len(data) > tail else b"")
                    self._pending = data[-tail:] if len(data) > tail else data
                    continue
                self._keep(data)

    def _keep(self, data: bytes) -> None:
        room = self.limit - len(self._kept)
        if room > 0:
            self._kept += data[:room]
        self._dropped += max(0, len(data) - max(room, 0))

    def begin(self) -> None:
        """Start a call: what was written between calls is discarded."""
        with self._lock:
            self._kept.clear()
            self._dropped = 0

    def collect(self, call_id: int, timeout: float = 1.0) -> tuple[bytes, int]:
        """End a call (blocking): the output kept, and bytes dropped."""
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        marker = f"\x00toolpool-end-of-call-{call_id}-{os.getpid()}\x00".encode()
        with self._lock:
            self._marker = marker
            self._marker_seen.clear()
        try:
            os.write(self._marker_fd, marker)
            self._marker_seen.wait(timeout)
        except OSError:
            pass
        with self._lock:
            self._marker = None
            kept, dropped = bytes(self._kept), self._dropped
            self._kept.clear()
            self._dropped = 0
        return kept, dropped
