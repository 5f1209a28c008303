"""``toolpool mcp``: what the command does, once its options are parsed (``_cli.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

from ..supervisor import Pool
from ._server import DEFAULT_MAX_MESSAGE_BYTES, McpServer

__all__ = ("run",)


def provider_name(spec: str, taken: set[str]) -> str:
    """A provider's name for ``module:attribute``: the module's last part, made unique."""
    base = spec.partition(":")[0].rpartition(".")[2] or "tools"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    taken.add(name)
    return name


async def run(
    specs: Sequence[str],
    *,
    workers: int,
    profile: Any,
    timeout: float | None,
    cancel_grace: float,
    term_grace: float,
    http: tuple[str, int] | None,
    token_file: str | None,
    say: Callable[[str], None],
) -> int:
    """Serve ``specs`` (one provider each) over stdio, or HTTP with ``http``; 0 once
    every call settled and every process of the pool is gone."""
    if http is not None:
        from ._http import is_loopback, read_token, serve_http

        if token_file is None and not is_loopback(http[0]):
            raise ValueError(
                f"refusing to serve MCP on {http[0]}, which is not a loopback address, "
                "without a bearer token: give --token-file"
            )
        if token_file is not None:
            read_token(token_file)  # a bad token file fails before any worker starts
    async with AsyncExitStack() as stack:
        if http is None:
            from ._stdio import stdio_streams

            # The wire is claimed before the pool starts: its processes never hold it.
            read, write = await stack.enter_async_context(stdio_streams(DEFAULT_MAX_MESSAGE_BYTES))
        pool = await stack.enter_async_context(
            Pool(cancel_grace=cancel_grace, term_grace=term_grace)
        )
        taken: set[str] = set()
        for spec in specs:
            await pool.add_provider(
                provider_name(spec, taken), spec, workers=workers, profile=profile
            )
        if http is not None:
            await serve_http(
                pool,
                http[0],
                http[1],
                token_file=token_file,
                timeout=timeout,
                on_ready=lambda url: say(f"serving MCP at {url}"),
            )
        else:
            server = McpServer(pool, timeout=timeout)
            stack.callback(server.close)
            async with server:
                await server._serve_streams(read, write, True, True)
    return 0
