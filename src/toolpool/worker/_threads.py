"""The worker's helper threads (its control thread, its output drain) block every
asynchronous signal, so that the main thread, where tools run, receives them."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

__all__ = ("ASYNC_SIGNALS", "start_thread_blocking_signals")

#: Signals the worker's other threads block, so that the main thread receives them (all
#: but those a fault raises in the thread that faults).
_FAULTS = {"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGABRT", "SIGSYS"}
ASYNC_SIGNALS = {s for s in signal.valid_signals() if getattr(s, "name", "") not in _FAULTS}


def start_thread_blocking_signals(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread that blocks every asynchronous signal from its first instruction
    (it inherits the mask set here for the moment of its creation)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, ASYNC_SIGNALS)
    try:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return thread
