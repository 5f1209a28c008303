"""toolpool's MCP face: a pool's tools over the Model Context Protocol (``docs/mcp.md``).

Needs the ``mcp`` extra (``pip install 'toolpool[mcp]'``): ``import toolpool`` never imports
it, and this package imports the SDK only when one of its names is first used, with a clear
error if the extra is missing.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from ._http import serve_http
    from ._server import DRAINING, McpServer, McpStatistics, serve

__all__ = ("DRAINING", "McpServer", "McpStatistics", "serve", "serve_http")

_EXPORTS: dict[str, str] = {
    "DRAINING": "_server",
    "McpServer": "_server",
    "McpStatistics": "_server",
    "serve": "_server",
    "serve_http": "_http",
}


def _import(module: str) -> _typing.Any:
    try:
        return _importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] in (
            "mcp",
            "mcp_types",
            "starlette",
            "uvicorn",
        ):
            raise ImportError(
                "toolpool.mcp needs the 'mcp' extra: pip install 'toolpool[mcp]' "
                f"({exc.name} is missing)"
            ) from exc
        raise


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .. import _reexport

    return _reexport(globals(), name, _import(module))


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
