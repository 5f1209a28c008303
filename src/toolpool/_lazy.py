"""A package's names loaded on first use (PEP 562): importing the package loads none of its
modules, and a name's module is imported when the name is first read."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ("lazy_names",)


def lazy_names(
    package: str,
    where: Mapping[str, str],
    namespace: MutableMapping[str, Any],
    public: Sequence[str],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's ``__getattr__`` and ``__dir__``. ``where`` maps each name to the module
    of ``package`` that holds it; once read, a name is kept in ``namespace`` (the package's
    ``globals()``), so the next read does not come here. ``public``: its ``__all__``."""

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *public})

    return getattr_, dir_
