"""What ``toolpool serve`` serves: its providers, from the command line or a config file.

Two spellings, one result (a tuple of :class:`ProviderConfig`):

- ``TOOLS`` repeated on the command line, each ``[NAME=]module:attribute``: every provider
  gets the command's ``--profile`` and ``--workers`` / ``--autoscale``. Enough for the common
  case (one registry, or a few under one profile) and nothing to write.
- ``--config FILE`` (TOML, read with the standard library's ``tomllib``): one table per
  provider, each with its own profile, size or autoscale bounds and default timeout. The
  command line cannot say "these tools untrusted with 8 workers, those trusted with 2"
  without a grammar of its own; a file can, reviewably, and it is what a ConfigMap holds.

Both are checked here, before any worker starts: an unknown key, a bad size or a duplicate
name is a :class:`ValueError` naming the provider and the key.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, final

__all__ = ("ProviderConfig", "load_config", "parse_autoscale", "parse_tools")

#: A provider's name: what metrics, logs and ``toolpool scale --provider`` call it.
_NAME: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")
_KEYS: Final = frozenset({"tools", "profile", "workers", "autoscale", "timeout"})


@final
@dataclass(frozen=True, kw_only=True)
class ProviderConfig:
    """One provider of a service: a registry, its profile, its size."""

    name: str
    """The provider's name (a label in metrics and logs)."""
    tools: str
    """``module:attribute`` naming the Registry."""
    profile: str = "default"
    """``default`` or ``untrusted``."""
    workers: int = 4
    """Workers, when not autoscaled."""
    autoscale: tuple[int, int] | None = None
    """``(min, max)`` workers: the pool sizes the provider between them."""
    timeout: float | None = None
    """The default timeout of its calls, in seconds."""

    def __post_init__(self) -> None:
        where = f"provider {self.name!r}"
        if not _NAME.match(self.name):
            raise ValueError(
                f"{where}: a name is 1-63 letters, digits, '_', '.' or '-', not starting "
                "with '.' or '-'"
            )
        module, sep, attr = self.tools.partition(":")
        if not (sep and module and attr):
            raise ValueError(f"{where}: tools must be 'module:attribute', got {self.tools!r}")
        if self.profile not in ("default", "untrusted"):
            raise ValueError(f"{where}: profile must be 'default' or 'untrusted'")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int):
            raise ValueError(f"{where}: workers must be an integer")
        if self.workers < 1:
            raise ValueError(f"{where}: workers must be at least 1, got {self.workers}")
        if self.autoscale is not None:
            low, high = self.autoscale
            if not 1 <= low <= high:
                raise ValueError(f"{where}: autoscale must be MIN:MAX with 1 <= MIN <= MAX")
        if self.timeout is not None and not (
            isinstance(self.timeout, int | float) and self.timeout > 0
        ):
            raise ValueError(f"{where}: timeout must be a positive number of seconds")

    @property
    def initial_workers(self) -> int:
        """How many workers it starts with: its size, or its autoscale minimum."""
        return self.workers if self.autoscale is None else self.autoscale[0]


def parse_autoscale(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` as two integers (checked by :class:`ProviderConfig`)."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise ValueError(f"autoscale must be MIN:MAX (two integers), got {text!r}") from None


def parse_tools(
    specs: Sequence[str],
    *,
    profile: str = "default",
    workers: int = 4,
    autoscale: tuple[int, int] | None = None,
    timeout: float | None = None,
) -> tuple[ProviderConfig, ...]:
    """Providers from ``TOOLS`` arguments, each ``[NAME=]module:attribute``. Unnamed, the
    first is ``default`` and each other is named after its module (``pkg.tools:registry``
    is ``pkg.tools``)."""
    out: list[ProviderConfig] = []
    for i, spec in enumerate(specs):
        name, sep, tools = spec.partition("=")
        if not sep:
            tools = spec
            name = "default" if i == 0 else spec.partition(":")[0]
        out.append(
            ProviderConfig(
                name=name,
                tools=tools,
                profile=profile,
                workers=workers,
                autoscale=autoscale,
                timeout=timeout,
            )
        )
    return _unique(out, "the command line")


def load_config(path: str) -> tuple[ProviderConfig, ...]:
    """Providers from a TOML file: one ``[providers.NAME]`` table each, with ``tools``
    (required), ``profile``, ``workers`` or ``autoscale = "MIN:MAX"``, ``timeout``."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    extra = set(data) - {"providers"}
    if extra:
        raise ValueError(f"{path}: unknown table or key {sorted(extra)[0]!r} (only [providers.*])")
    tables = data.get("providers")
    if not isinstance(tables, Mapping) or not tables:
        raise ValueError(f"{path}: no provider: add a [providers.NAME] table with tools = ...")
    out: list[ProviderConfig] = []
    for name, table in tables.items():
        out.append(_from_table(path, name, table))
    return _unique(out, path)


def _from_table(path: str, name: str, table: Any) -> ProviderConfig:
    where = f"{path}: provider {name!r}"
    if not isinstance(table, Mapping):
        raise ValueError(f"{where}: must be a table")
    unknown = set(table) - _KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key {sorted(unknown)[0]!r}; known: {sorted(_KEYS)}")
    if "tools" not in table or not isinstance(table["tools"], str):
        raise ValueError(f"{where}: tools = 'module:attribute' is required")
    if "workers" in table and "autoscale" in table:
        raise ValueError(f"{where}: give workers or autoscale, not both")
    scale = table.get("autoscale")
    if scale is not None and not isinstance(scale, str):
        raise ValueError(f"{where}: autoscale must be a string 'MIN:MAX'")
    try:
        return ProviderConfig(
            name=name,
            tools=table["tools"],
            profile=table.get("profile", "default"),
            workers=table.get("workers", 4),
            autoscale=None if scale is None else parse_autoscale(scale),
            timeout=table.get("timeout"),
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _unique(providers: list[ProviderConfig], where: str) -> tuple[ProviderConfig, ...]:
    seen: set[str] = set()
    for p in providers:
        if p.name in seen:
            raise ValueError(f"{where}: two providers named {p.name!r}")
        seen.add(p.name)
    return tuple(providers)
