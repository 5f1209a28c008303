"""Tool registries for the provider tests: two with disjoint tools, one that clashes with the
first, and one whose answer says which import of it runs (for reloads)."""

from __future__ import annotations

import os
from pathlib import Path

import anyio

from toolpool import Registry, ToolExecution

alpha = Registry()
beta = Registry()
clash = Registry()
versioned = Registry()


@alpha.tool
def a_echo(value: int) -> int:
    """Return value."""
    return value


@alpha.tool
async def a_nap(seconds: float, execution: ToolExecution) -> str:
    """Sleep, stopping early (aborted) when cancelled."""
    with anyio.move_on_after(seconds):
        await execution.signal.wait()
        execution.signal.raise_if_cancelled()
    return "slept"


@beta.tool
def b_echo(value: int) -> int:
    """Return value."""
    return value


@clash.tool(name="a_echo")
def a_echo_clash(value: int) -> int:
    """Clashes with alpha's tool of the same name."""
    return value


@clash.tool
def c_only(value: int) -> int:
    """Only clash has it."""
    return value


#: What this import of the module read: a reload imports it afresh.
VERSION = Path(os.environ.get("TP_VERSION_FILE", os.devnull)).read_text()


@versioned.tool
def version(value: int = 0) -> dict[str, object]:
    """Which import of the module serves, and the value back."""
    return {"version": VERSION, "value": value, "pid": os.getpid()}
