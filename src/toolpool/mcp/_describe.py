"""What the MCP face tells a model: a tool's MCP description from a pool catalog entry, and a
call's MCP result from a pool :class:`~toolpool.Result`. Plain data in, plain JSON out: no
SDK import here, so it is cheap to test and read.

Everything said about where a tool runs comes from the ``runs_in`` facts of its catalog
entry, which the pool derives from the containment layers its provider's workers applied
(CONTRACT C6.5, C8.4), never from a provider's name or what a profile merely asked for.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..core import Outcome

if TYPE_CHECKING:
    from ..supervisor import Result

__all__ = (
    "OUTPUT_SCHEMA",
    "call_result",
    "containment_facts",
    "describe_tool",
    "jsonable",
)

#: The ``outputSchema`` of every tool: the ``structuredContent`` of its results.
OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "outcome": {
            "type": "string",
            "enum": [outcome.value for outcome in Outcome],
            "description": "what happened to the tool body",
        },
        "body_started": {
            "type": ["boolean", "null"],
            "description": "whether the tool body ran (null: unknown)",
        },
        "value": {"description": "the tool's value, for outcome ok"},
        "error": {"type": "string", "description": "the model-visible error text"},
        "error_name": {"type": "string"},
        "rung": {
            "type": "string",
            "enum": ["none", "cancel", "sigterm", "sigkill"],
            "description": "how far the escalation ladder went",
        },
        "cause": {
            "type": ["string", "null"],
            "enum": ["user", "parent", "disposed", "timeout", None],
            "description": "why the call was cancelled, if it was",
        },
    },
    "required": ["outcome", "body_started"],
}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def _seconds(s: float) -> str:
    return f"{s:g} s"


def containment_facts(runs_in: Mapping[str, Any], timeout: float | None) -> list[str]:
    """The facts of where a tool runs, as short phrases for a model: network, filesystem,
    memory, CPU, and when it is stopped (``timeout``: the deadline its calls get here)."""
    facts = ["runs in an isolated worker process"]
    facts.append(
        "runs without network access"
        if runs_in.get("network") == "none"
        else "has the host's network access"
    )
    fs = str(runs_in.get("filesystem", "read-write"))
    if fs.startswith("read-only"):
        facts.append(
            "filesystem read-only except a private scratch directory"
            if "scratch" in fs
            else "filesystem read-only"
        )
    elif "scratch" in fs:
        facts.append("filesystem read-write; its working directory is a private scratch directory")
    else:
        facts.append("filesystem read-write")
    memory = runs_in.get("memory_cap")
    if isinstance(memory, int) and memory > 0:
        facts.append(f"memory capped at {_size(memory)}")
    cpu = runs_in.get("cpu_limit_s")
    if isinstance(cpu, int | float) and cpu > 0:
        facts.append(f"CPU time capped at {_seconds(cpu)}")
    if timeout is not None:
        facts.append(f"stopped after {_seconds(timeout)}")
    return facts


def describe_tool(entry: Mapping[str, Any], timeout: float | None) -> dict[str, Any]:
    """The MCP ``Tool`` (wire form) for one pool catalog entry. ``timeout`` is the deadline
    its calls get here (the provider's, else the server's), None for none."""
    runs_in: Mapping[str, Any] = entry.get("runs_in") or {}
    own = str(entry.get("description") or "").strip()
    facts = "; ".join(containment_facts(runs_in, timeout))
    where = f"Where it runs: {facts}."
    tool: dict[str, Any] = {
        "name": entry["name"],
        "description": f"{own}\n\n{where}" if own else where,
        "inputSchema": dict(entry.get("input_schema") or {"type": "object"}),
        "outputSchema": OUTPUT_SCHEMA,
        "execution": {"taskSupport": "optional"},
    }
    # Annotations only where the containment enforces them (C8.4): with no network
    # namespace the tool cannot reach the outside world, whatever it claims.
    annotations: dict[str, Any] = dict(entry.get("annotations") or {})
    if runs_in.get("network") == "none":
        annotations["openWorldHint"] = False
    if annotations:
        tool["annotations"] = annotations
    return tool


def jsonable(value: Any) -> Any:
    """A pool value as JSON: bytes become ``{"base64": ...}``, tuples lists."""
    if isinstance(value, bytes | bytearray):
        return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Mapping):
        return {
            str(k) if not isinstance(k, bytes) else k.decode(): jsonable(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def call_result(result: Result) -> dict[str, Any]:
    """The MCP ``CallToolResult`` (wire form) of a settled call: ``ok`` is the value as text
    plus ``structuredContent``; every other outcome is ``isError`` with the model-visible
    text of the outcome (CONTRACT C3) and the facts (outcome, body started, rung, cause)."""
    structured: dict[str, Any] = {
        "outcome": result.outcome.value,
        "body_started": result.body_started,
    }
    if result.ok:
        value = jsonable(result.value)
        structured["value"] = value
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return {
            "content": [{"type": "text", "text": text}],
            "structuredContent": structured,
            "isError": False,
        }
    error = result.error or f"Error: {result.outcome.value}"
    structured.update(
        error=error,
        error_name=result.error_name or "",
        rung=result.rung.value,
        cause=result.cause["kind"] if result.cause is not None else None,
    )
    return {
        "content": [{"type": "text", "text": error}],
        "structuredContent": structured,
        "isError": True,
    }
