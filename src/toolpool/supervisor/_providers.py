"""Providers at runtime (CONTRACT C6, seed 002): worker groups added, removed, resized and
reloaded while the pool serves.

A provider is a named group of workers running one tools module. It becomes resolvable
(its tools go into the pool's catalog and calls of them are queued for it) once every
worker it started with is ready; a tool exists only while a provider of it does. Removing
a provider takes its tools out at once: its queued calls settle ``aborted_before_dispatch``
(cause ``disposed``), its running calls get ``drain_grace`` seconds, then a cooperative
cancel (cause ``disposed``) and the ladder. A reload starts a new generation under the same
name and swaps it in, in one event, when every new worker is ready: the old generation's
queue moves over, and the old one drains as on removal.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Final

from ..core import CancelCause, ToolConflictError, WorkerStartError
from ._lifecycle import Lifecycle
from ._records import (
    Autoscale,
    Changed,
    ProviderDown,
    ProviderRecord,
    ProviderResized,
    ProviderSpec,
    ProviderUp,
)
from ._results import WorkerState

__all__ = ("Providers",)

_log = logging.getLogger("toolpool.supervisor")

_DISPOSED: Final = CancelCause("disposed")

#: How often an autoscaled provider's load is looked at (seconds): it grows or shrinks by at
#: most one worker a look, so by at most 10 workers a second.
SCALE_TICK: Final = 0.1


class Providers(Lifecycle):
    """Adding, removing, resizing and reloading providers."""

    # ------------------------------------------------------------------ events in

    def add_provider(self, name: str, spec: ProviderSpec, now: float) -> ProviderRecord:
        """Start a new provider's workers; it becomes active once they are all ready (or
        ``failed``: its ``broken`` says why). The shell checks ``name`` is free."""
        self.now = now
        if name in self.providers or name in self.pending:
            raise ValueError(f"a provider named {name!r} exists")
        p = self._new_provider(name, spec)
        self.pending[name] = p
        self._top_up(p)
        return p

    def reload_provider(self, name: str, now: float) -> ProviderRecord:
        """Start a new generation of provider ``name`` (a fresh import of its tools); it
        replaces the current one once every new worker is ready."""
        self.now = now
        old = self.providers[name]
        if name in self.pending:
            raise ValueError(f"provider {name!r} is already being reloaded")
        p = self._new_provider(name, old.spec, old.generation + 1)
        self.pending[name] = p
        self._top_up(p)
        return p

    def remove_provider(self, name: str, reason: str, now: float) -> ProviderRecord | None:
        """Take provider ``name`` out: its tools go at once, its workers drain. A reload of
        it under way is abandoned too."""
        self.now = now
        starting = self.pending.pop(name, None)
        if starting is not None:
            self._provider_failed(starting, None)
        p = self.providers.pop(name, None)
        if p is None:
            return starting
        self._unpublish(p)
        self._act(ProviderDown(p, reason))
        self._drain(p, reason)
        self._act(Changed())
        return p

    def resize(self, name: str, size: int, now: float, *, force: bool = False) -> None:
        """Grow or shrink provider ``name`` to ``size`` workers (its warm spares stay), and
        stop autoscaling it. Shrinking retires workers that are starting or idle first, then
        drains busy ones (their call finishes, then they exit); ``force``: their calls are
        cancelled now (cause ``disposed``), escalating like any cancel."""
        self.now = now
        p = self.providers.get(name) or self.pending[name]
        p.autoscale = None
        self._resize(p, size, force=force, reason="resize")

    def _resize(self, p: ProviderRecord, size: int, *, force: bool, reason: str) -> None:
        if size != p.spec.size:
            self._act(ProviderResized(p, p.spec.size, size, reason))
        p.spec = dataclasses.replace(p.spec, size=size)
        target = size + p.spec.warm_spares
        excess = self._serving_count(p) - target
        if excess <= 0:
            self._top_up(p)
            self._act(Changed())
            return
        mine = [w for w in self.workers.values() if w.provider is p and self._serves(w)]
        # Starting first, then idle, then those with the fewest calls (newest first).
        mine.sort(key=lambda w: (w.state is not WorkerState.SPAWNING, len(w.calls), -w.wid))
        for w in mine[:excess]:
            w.draining = True  # (one still starting is retired when its hello comes)
            if w.state is WorkerState.SPAWNING:
                continue
            if not w.calls:
                self._retire(w)
                continue
            self._recall_behind(w, w.calls[0])
            if force:
                self._cancel_call(w.calls[0], _DISPOSED, force=False)
        self._act(Changed())
        self._dispatch()

    def autoscale(self, name: str, policy: Autoscale | None, now: float) -> None:
        """Let the core size provider ``name`` within ``policy``'s bounds (None: stop)."""
        self.now = now
        p = self.providers.get(name) or self.pending[name]
        p.autoscale = policy
        if policy is None:
            return
        size = min(max(p.spec.size, policy.minimum), policy.maximum)
        if size != p.spec.size:
            reason = f"autoscale: within [{policy.minimum}, {policy.maximum}]"
            self._resize(p, size, force=False, reason=reason)
        if not p.scale_armed:
            p.scale_armed = True
            self._arm(now + SCALE_TICK, "scale", p.id)

    def scale_due(self, provider_id: int) -> None:
        """An autoscaled provider's look: one worker more if a call has waited for one
        ``grow_after`` seconds, one fewer if nothing waits and a worker has been idle
        ``idle_after`` seconds."""
        p = self._providers_by_id.get(provider_id)
        if p is None:
            return
        if p.autoscale is None or not p.live or self.closing:
            p.scale_armed = False
            return
        policy, now, size = p.autoscale, self.now, p.spec.size
        self._arm(now + SCALE_TICK, "scale", p.id)
        if p.state != "active":
            return
        waited = self._longest_wait(p)
        if waited is not None and waited >= policy.grow_after:
            if size < policy.maximum:
                reason = f"autoscale: a call waited {waited:.3f}s for a worker"
                self._resize(p, size + 1, force=False, reason=reason)
            return
        if size <= policy.minimum or waited is not None:
            return
        idle = [w for w in p.ready if not w.calls and now - w.head_since >= policy.idle_after]
        if idle:
            longest = now - min(w.head_since for w in idle)
            reason = f"autoscale: a worker was idle {longest:.1f}s"
            self._resize(p, size - 1, force=False, reason=reason)

    def _longest_wait(self, p: ProviderRecord) -> float | None:
        """How long the call of p that has waited longest for a worker has (None: none
        waits): the head of its queue, or one queued in a busy worker behind another."""
        submitted = [c._times["submitted"] for c in p.queue if c._queued][:1]
        for w in self.workers.values():
            if w.provider is p and len(w.calls) > 1:
                submitted.extend(c._times["submitted"] for c in list(w.calls)[1:] if not c._started)
        return self.now - min(submitted) if submitted else None

    def drain_due(self, provider_id: int) -> None:
        """A removed provider's drain_grace is over: cancel what it still runs."""
        p = self._providers_by_id.get(provider_id)
        if p is None or p.state != "draining":
            return
        for w in list(self.workers.values()):
            if w.provider is p:
                for call in list(w.calls):
                    if call._result is None:
                        self._cancel_call(call, _DISPOSED, force=False)

    # ------------------------------------------------------------------ decisions

    def _maybe_activate(self, p: ProviderRecord) -> None:
        """p is starting: once every worker it started with is ready (hello said, and the
        reaper reported how it started it), its tools become resolvable."""
        if p.state != "starting" or self.pending.get(p.name) is not p:
            return
        want = p.spec.size + p.spec.warm_spares
        ready = sum(
            1
            for w in self.workers.values()
            if w.provider is p and w.state is WorkerState.READY and w.start_method is not None
        )
        if ready < want:
            return
        old = self.providers.get(p.name)
        for tool in p.catalog:
            owner = self.owner.get(tool)
            if owner is not None and owner.name != p.name:
                self._provider_failed(
                    p,
                    ToolConflictError(
                        f"tool {tool!r} of provider {p.name!r} ({p.spec.tools_spec}) is "
                        f"already provided by {owner.name!r} ({owner.spec.tools_spec})"
                    ),
                )
                return
        del self.pending[p.name]
        p.state = "active"
        p.starting = False
        if old is not None:
            self._unpublish(old)
        self.providers[p.name] = p
        for tool, desc in p.catalog.items():
            self.owner[tool] = p
            self.catalog[tool] = {**desc, "provider": p.name}
        _log.info(
            "provider %r (%s) %s: %d workers",
            p.name,
            p.spec.tools_spec,
            "reloaded" if old is not None else "added",
            p.spec.size,
        )
        self._act(ProviderUp(p, old))
        if old is not None:
            # The swap, in this one event: what was queued for the old generation is the
            # new one's now (a tool it no longer has settles, never started).
            moved = [c for c in old.queue if c._queued]
            old.queue.clear()
            old.settled_in_queue = 0
            for call in moved:
                call._queued = False
                call._provider = None
                self._enqueue(call)
            self._drain(old, "reloaded")
        self._act(Changed())
        self._dispatch()

    def _unpublish(self, p: ProviderRecord) -> None:
        """p's tools resolve no more."""
        for tool in p.catalog:
            if self.owner.get(tool) is p:
                del self.owner[tool]
                self.catalog.pop(tool, None)

    def _provider_failed(self, p: ProviderRecord, error: Exception | None) -> None:
        """A starting provider will not become active (a start failure, a conflict, a
        removal): stop its workers; nothing of it was published."""
        if self.pending.get(p.name) is p:
            del self.pending[p.name]
        p.state = "failed"
        if error is not None and p.broken is None:
            p.broken = (
                error
                if isinstance(error, WorkerStartError)
                else WorkerStartError(f"{type(error).__name__}: {error}")
            )
        p.error = error
        p.ready.clear()
        for w in list(self.workers.values()):
            if w.provider is p and not w.gone:
                if w.state is WorkerState.READY and not w.calls:
                    self._retire(w)
                elif w.state is WorkerState.SPAWNING:
                    # Its start counts as failed with the rest: a 'fatal' it may still send
                    # (the same import error) is expected, not a violation.
                    w.start_failed = w.answered = True
                    self._quarantine(w, None)
                elif w.state is not WorkerState.RETIRING:
                    self._quarantine(w, None)
        if p.name == "default" and self.starting and self.broken is None:
            self.broken = p.broken  # the pool's own start failed
        self._fail_queue(p)
        self._act(Changed())

    def _drain(self, p: ProviderRecord, reason: str) -> None:
        """p resolves no more: what is queued for it settles, its idle workers exit, its
        busy ones finish (``drain_grace``, then a cancel with cause ``disposed``)."""
        p.state = "draining"
        p.reason = reason
        self.draining.append(p)
        queued = [c for c in p.queue if c._queued]
        p.queue.clear()
        p.settled_in_queue = 0
        for call in queued:
            call._queued = False
            call._provider = None
            self._abort_queued(call, _DISPOSED)
        p.ready.clear()
        busy = False
        for w in list(self.workers.values()):
            if w.provider is not p or w.gone:
                continue
            if w.state is WorkerState.SPAWNING:
                w.draining = True  # retired when its hello comes
            elif w.state is WorkerState.READY and not w.calls:
                self._retire(w)
            elif w.calls:
                busy = True
                self._recall_behind(w, w.calls[0])
        if busy:
            grace = self.config.drain_grace
            if grace > 0:
                p.drain_by = self.now + grace
                self._arm(p.drain_by, "drain", p.id)
            else:
                self.drain_due(p.id)
        if not any(w.provider is p for w in self.workers.values()):
            self._provider_gone(p)

    def _provider_gone(self, p: ProviderRecord) -> None:
        """Every worker of a draining (or failed) provider is gone."""
        if p.state == "draining":
            p.state = "gone"
        if p in self.draining:
            self.draining.remove(p)
        self._providers_by_id.pop(p.id, None)
        self._act(Changed())
