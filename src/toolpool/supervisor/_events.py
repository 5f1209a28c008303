"""The pool's lifecycle events (seed 002): what consumers mirror instead of assuming a load
order, and the listeners that receive them.

A consumer (an MCP adapter, a prompt builder, a dashboard) subscribes with
``pool.subscribe(listener, replay=True)`` and rebuilds what it derives from the pool's
providers from these events alone: ``replay`` hands it the providers there are as
:class:`ProviderAdded` first, so it does not matter what started before what.

Delivery rules:

- **Add fails loudly.** A listener that raises on :class:`ProviderAdded` rolls the
  registration back: the provider's workers stop, its tools are gone again, the listeners
  that already saw it added see it removed (reason ``"rolled back"``), and
  ``pool.add_provider`` raises that listener's error.
- **Remove is isolated.** A listener that raises on any other event is logged with its
  traceback; the other listeners still get it, and what happened stays done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, final

__all__ = (
    "Listener",
    "Listeners",
    "PoolEvent",
    "ProviderAdded",
    "ProviderInfo",
    "ProviderRemoved",
    "ProviderResized",
    "ToolsChanged",
    "WorkerExited",
    "WorkerStarted",
)

_log = logging.getLogger("toolpool.events")


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ProviderInfo:
    """A provider as the pool runs it now (``pool.providers[name]``), frozen."""

    name: str
    tools_spec: str
    """``"module:attribute"`` of its :class:`toolpool.Registry`."""
    profile: str
    """The name of its containment profile."""
    workers: int
    """How many workers it is sized to (``resize`` changes it)."""
    generation: int
    """1 when added; one more with each reload."""
    tools: Mapping[str, Mapping[str, Any]]
    """Its tools by name, as in ``pool.catalog``: each names its provider and carries the
    facts of where it runs (``"runs_in"``: network, filesystem, memory cap, CPU limit,
    default timeout), derived from the containment its workers applied."""
    containment: Mapping[str, bool]
    """Each containment layer of its workers: active or not."""


@final
@dataclass(frozen=True, slots=True)
class ProviderAdded:
    """``provider`` became resolvable: its tools can be called from now on."""

    provider: ProviderInfo


@final
@dataclass(frozen=True, slots=True)
class ProviderRemoved:
    """The provider ``name`` is no longer resolvable. ``reason``: ``"removed"``,
    ``"reloaded"`` (a new generation follows as :class:`ProviderAdded`), ``"rolled back"``
    (an add listener raised), ``"closed"`` (the pool closed)."""

    name: str
    reason: str


@final
@dataclass(frozen=True, slots=True)
class ToolsChanged:
    """The pool's catalog changed (a provider came or went): every tool by name."""

    catalog: Mapping[str, Mapping[str, Any]]


@final
@dataclass(frozen=True, slots=True)
class ProviderResized:
    """Provider ``name`` was resized from ``old`` to ``new`` workers. ``reason``: ``"resize"``
    (``pool.resize``) or the autoscaler's decision, saying why (``"autoscale: ..."``)."""

    name: str
    old: int
    new: int
    reason: str


@final
@dataclass(frozen=True, slots=True)
class WorkerStarted:
    """A worker of ``provider`` said hello: it serves."""

    pid: int | None
    provider: str


WorkerExit = Literal["retired", "crashed", "killed", "lost", "unkillable"]


@final
@dataclass(frozen=True, slots=True)
class WorkerExited:
    """A worker and its whole process tree are gone. ``why``: ``retired`` (told to exit),
    ``crashed`` (it died on its own), ``killed`` (the escalation ladder), ``lost`` (its
    connection or its reaper went, or it broke the protocol), ``unkillable`` (its tree would
    not die: taken out of service)."""

    pid: int | None
    provider: str
    why: WorkerExit


PoolEvent = (
    ProviderAdded | ProviderRemoved | ProviderResized | ToolsChanged | WorkerStarted | WorkerExited
)
"""Every event a listener may receive."""

Listener = Callable[[PoolEvent], object]


class Listeners:
    """The pool's subscribers, called synchronously, in subscription order."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener, replay: list[PoolEvent]) -> Callable[[], None]:
        """Add ``listener``; hand it ``replay`` first. Returns the function that removes it
        (idempotent). A listener raising during the replay is not added, and its error
        propagates."""
        if not callable(listener):
            raise TypeError(f"a listener is a callable taking one event, not {listener!r}")
        for event in replay:
            listener(event)
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def emit(self, event: PoolEvent) -> None:
        """Deliver ``event`` to every listener; one that raises is logged, the rest still run."""
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                _log.exception("a pool listener raised on %s", type(event).__name__)

    def emit_added(self, event: ProviderAdded) -> tuple[BaseException | None, list[Listener]]:
        """Deliver an add; stop at the first listener that raises. Returns its error (None if
        none raised) and the listeners that saw the add (to tell them of the rollback)."""
        seen: list[Listener] = []
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception as exc:
                return exc, seen
            seen.append(listener)
        return None, seen

    def emit_to(self, listeners: list[Listener], event: PoolEvent) -> None:
        """Deliver ``event`` to ``listeners`` only (isolated, as :meth:`emit`)."""
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                _log.exception("a pool listener raised on %s", type(event).__name__)


def frozen_catalog(catalog: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Mapping[str, Any]]:
    return MappingProxyType({k: MappingProxyType(dict(v)) for k, v in catalog.items()})
