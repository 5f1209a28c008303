"""``serve_gate_tools:registry``: a registry whose import waits until the file named by
``TOOLPOOL_TEST_GATE`` exists, so a test sees a service in its ``starting`` state for as
long as it needs (the test creates the file when it is done looking)."""

from __future__ import annotations

import os
import time

from toolpool import Registry

_gate = os.environ.get("TOOLPOOL_TEST_GATE")
_deadline = time.monotonic() + 120
while _gate and not os.path.exists(_gate) and time.monotonic() < _deadline:
    time.sleep(0.02)  # (an import cannot await the test: polling a file is all there is)

registry = Registry()


@registry.tool
def noop() -> None:
    """Do nothing."""
