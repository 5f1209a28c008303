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

from ...core import CancelCause, ToolConflictError, WorkerStartError
from .._results import WorkerState
from ._actions import Changed, ProviderDown, ProviderUp, Resized, Spawn
from ._dispatch import Dispatch
from ._ladder import Ladder
from ._records import Autoscale, ProviderRecord, ProviderSpec, ProviderState, WorkerRecord
from ._settlement import Settlement
from ._state import State

__all__ = ("SCALE_TICK", "Fleet")

_log = logging.getLogger("toolpool.supervisor")

_DISPOSED: Final = CancelCause("disposed")

#: How often an autoscaled provider's load is looked at (seconds): it grows or shrinks by at
#: most one worker a look, so by at most 10 workers a second.
SCALE_TICK: Final = 0.1

#: The states of a worker that will never take a call again.
_OUT_OF_SERVICE: Final = frozenset(
    (WorkerState.RETIRING, WorkerState.QUARANTINED, WorkerState.UNKILLABLE, WorkerState.EXITED)
)


class Fleet:
    """The providers and their workers' complement: starting workers, adding, removing,
    resizing, autoscaling and reloading providers; a provider's own states (``starting``,
    ``active``, ``draining``, ``gone``, ``failed``)."""

    def __init__(
        self, state: State, settlement: Settlement, dispatch: Dispatch, ladder: Ladder
    ) -> None:
        self.s = state
        self.settlement = settlement
        self.dispatch = dispatch
        self.ladder = ladder

    # ------------------------------------------------------------------ workers

    def spawn(self, p: ProviderRecord) -> WorkerRecord:
        wid = next(self.s.wids)
        w = WorkerRecord(wid, self.s.new_secret(), p)
        self.s.workers[wid] = w
        p.tally.started += 1
        self.s.arm(self.s.now + self.s.config.start_timeout, "hello", wid)
        self.s.act(Spawn(wid, w.secret, p.name))
        return w

    def serves(self, w: WorkerRecord) -> bool:
        """w serves or will: not gone, draining, retiring, quarantined or unkillable."""
        return not w.gone and not w.draining and w.state not in _OUT_OF_SERVICE

    def serving_count(self, p: ProviderRecord) -> int:
        """p's workers that serve or will."""
        return sum(1 for w in self.s.workers.values() if w.provider is p and self.serves(w))

    def top_up(self, p: ProviderRecord) -> list[WorkerRecord]:
        """Start workers until p has its size plus its warm spares; the ones started."""
        if self.s.closing or self.s.broken is not None or p.broken is not None or not p.live:
            return []
        if not self.s.reaper_up or not self.s.started:
            return []  # the new reaper (or the pool's start) starts a full complement
        missing = p.spec.size + p.spec.warm_spares - self.serving_count(p)
        return [self.spawn(p) for _ in range(missing)]

    def owe_replacement(self, p: ProviderRecord, w: WorkerRecord | None = None) -> None:
        """p is a worker short (w died, became unkillable, or retired having served its
        ``max_calls``): its replacement starts at a ``replace`` timer due now, so on a later
        turn of the shell's loop than the one that settles w's call: its caller runs first
        (a ``Spawn`` costs the shell milliseconds). What p's size is then decides: a close,
        drain, removal or resize meanwhile leaves nothing (more) to start."""
        if w is not None:
            p.replacing.append((w.wid, w.pid))
        if not p.replace_owed:
            p.replace_owed = True
            self.s.arm(self.s.now, "replace", p.id)

    def replace_due(self, provider_id: int) -> None:
        """The loop turned since p's replacement was owed: start what p lacks now."""
        p = self.s.providers_by_id.get(provider_id)
        if p is None or not p.replace_owed:
            return
        p.replace_owed = False
        replaced, p.replacing = p.replacing, []
        for (wid, pid), new in zip(replaced, self.top_up(p), strict=False):
            _log.info(
                "worker %s (pid %s) replaced by worker %s",
                wid,
                pid,
                new.wid,
                extra={"worker_pid": pid},
            )

    # ------------------------------------------------------------------ events in

    def add(self, name: str, spec: ProviderSpec) -> ProviderRecord:
        """Start a new provider's workers; it becomes active once they are all ready (or
        ``failed``: its ``broken`` says why). The shell checks ``name`` is free."""
        if name in self.s.providers or name in self.s.pending:
            raise ValueError(f"a provider named {name!r} exists")
        p = self.s.new_provider(name, spec)
        self.s.pending[name] = p
        self.top_up(p)
        return p

    def reload(self, name: str) -> ProviderRecord:
        """Start a new generation of provider ``name`` (a fresh import of its tools); it
        replaces the current one once every new worker is ready."""
        old = self.s.providers[name]
        if name in self.s.pending:
            raise ValueError(f"provider {name!r} is already being reloaded")
        p = self.s.new_provider(name, old.spec, old.generation + 1)
        self.s.pending[name] = p
        self.top_up(p)
        return p

    def remove(self, name: str, reason: str) -> ProviderRecord | None:
        """Take provider ``name`` out: its tools go at once, its workers drain. A reload of
        it under way is abandoned too."""
        starting = self.s.pending.pop(name, None)
        if starting is not None:
            self.failed(starting, None)
        p = self.s.providers.pop(name, None)
        if p is None:
            return starting
        self._unpublish(p)
        self.s.act(ProviderDown(p, reason))
        self._drain(p, reason)
        self.s.act(Changed())
        return p

    def resize(self, name: str, size: int, *, force: bool = False) -> None:
        """Grow or shrink provider ``name`` to ``size`` workers (its warm spares stay), and
        stop autoscaling it. Shrinking retires workers that are starting or idle first, then
        drains busy ones (their call finishes, then they exit); ``force``: their calls are
        cancelled now (cause ``disposed``), escalating like any cancel."""
        p = self.s.providers.get(name) or self.s.pending[name]
        p.autoscale = None
        self._resize(p, size, force=force, reason="resize")

    def _resize(self, p: ProviderRecord, size: int, *, force: bool, reason: str) -> None:
        if size != p.spec.size:
            self.s.act(Resized(p, p.spec.size, size, reason))
        p.spec = dataclasses.replace(p.spec, size=size)
        target = size + p.spec.warm_spares
        excess = self.serving_count(p) - target
        if excess <= 0:
            self.top_up(p)
            self.s.act(Changed())
            return
        mine = [w for w in self.s.workers.values() if w.provider is p and self.serves(w)]
        # Starting first, then idle, then those with the fewest calls (newest first).
        mine.sort(key=lambda w: (w.state is not WorkerState.SPAWNING, len(w.calls), -w.wid))
        for w in mine[:excess]:
            w.draining = True  # (one still starting is retired when its hello comes)
            if w.state is WorkerState.SPAWNING:
                continue
            if not w.calls:
                self.dispatch.retire(w)
                continue
            self.dispatch.recall_behind(w, w.calls[0])
            if force:
                self.ladder.cancel(w.calls[0], _DISPOSED, force=False)
        self.s.act(Changed())
        self.dispatch.schedule()

    def autoscale(self, name: str, policy: Autoscale | None) -> None:
        """Let the core size provider ``name`` within ``policy``'s bounds (None: stop)."""
        p = self.s.providers.get(name) or self.s.pending[name]
        p.autoscale = policy
        if policy is None:
            return
        size = min(max(p.spec.size, policy.minimum), policy.maximum)
        if size != p.spec.size:
            reason = f"autoscale: within [{policy.minimum}, {policy.maximum}]"
            self._resize(p, size, force=False, reason=reason)
        if not p.scale_armed:
            p.scale_armed = True
            self.s.arm(self.s.now + SCALE_TICK, "scale", p.id)

    def scale_due(self, provider_id: int) -> None:
        """An autoscaled provider's look: one worker more if a call has waited for one
        ``grow_after`` seconds, one fewer if nothing waits and a worker has been idle
        ``idle_after`` seconds."""
        p = self.s.providers_by_id.get(provider_id)
        if p is None:
            return
        if p.autoscale is None or not p.live or self.s.closing:
            p.scale_armed = False
            return
        policy, now, size = p.autoscale, self.s.now, p.spec.size
        self.s.arm(self.s.now + SCALE_TICK, "scale", p.id)
        if p.state is not ProviderState.ACTIVE:
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
        for w in self.s.workers.values():
            if w.provider is p and len(w.calls) > 1:
                submitted.extend(c._times["submitted"] for c in list(w.calls)[1:] if not c._started)
        return self.s.now - min(submitted) if submitted else None

    def drain_due(self, provider_id: int) -> None:
        """A removed provider's drain_grace is over: cancel what it still runs."""
        p = self.s.providers_by_id.get(provider_id)
        if p is None or p.state is not ProviderState.DRAINING:
            return
        for w in list(self.s.workers.values()):
            if w.provider is p:
                for call in list(w.calls):
                    if call._facts is None:
                        self.ladder.cancel(call, _DISPOSED, force=False)

    # ------------------------------------------------------------------ decisions

    def maybe_activate(self, p: ProviderRecord) -> None:
        """p is starting: once every worker it started with is ready (hello said, and the
        reaper reported how it started it), its tools become resolvable."""
        if p.state is not ProviderState.STARTING or self.s.pending.get(p.name) is not p:
            return
        want = p.spec.size + p.spec.warm_spares
        ready = sum(
            1
            for w in self.s.workers.values()
            if w.provider is p and w.state is WorkerState.READY and w.start_method is not None
        )
        if ready < want:
            return
        old = self.s.providers.get(p.name)
        for tool in p.catalog:
            owner = self.s.owner.get(tool)
            if owner is not None and owner.name != p.name:
                self.failed(
                    p,
                    ToolConflictError(
                        f"tool {tool!r} of provider {p.name!r} ({p.spec.tools_spec}) is "
                        f"already provided by {owner.name!r} ({owner.spec.tools_spec})"
                    ),
                )
                return
        del self.s.pending[p.name]
        p.advance(ProviderState.ACTIVE)
        if old is not None:
            self._unpublish(old)
        self.s.providers[p.name] = p
        for tool, desc in p.catalog.items():
            self.s.owner[tool] = p
            self.s.catalog[tool] = {**desc, "provider": p.name}
        _log.info(
            "provider %r (%s) %s: %d workers",
            p.name,
            p.spec.tools_spec,
            "reloaded" if old is not None else "added",
            p.spec.size,
        )
        self.s.act(ProviderUp(p, old))
        if old is not None:
            # The swap, in this one event: what was queued for the old generation is the
            # new one's now (a tool it no longer has settles, never started).
            moved = [c for c in old.queue if c._queued]
            old.queue.clear()
            old.settled_in_queue = 0
            for call in moved:
                call._queued = False
                call._provider = None
                self.dispatch.enqueue(call)
            self._drain(old, "reloaded")
        self.s.act(Changed())
        self.dispatch.schedule()

    def _unpublish(self, p: ProviderRecord) -> None:
        """p's tools resolve no more."""
        for tool in p.catalog:
            if self.s.owner.get(tool) is p:
                del self.s.owner[tool]
                self.s.catalog.pop(tool, None)

    def failed(self, p: ProviderRecord, error: Exception | None) -> None:
        """A starting provider will not become active (a start failure, a conflict, a
        removal): stop its workers; nothing of it was published."""
        if self.s.pending.get(p.name) is p:
            del self.s.pending[p.name]
        p.advance(ProviderState.FAILED)
        if error is not None and p.broken is None:
            p.broken = (
                error
                if isinstance(error, WorkerStartError)
                else WorkerStartError(f"{type(error).__name__}: {error}")
            )
        p.error = error
        p.ready.clear()
        for w in list(self.s.workers.values()):
            if w.provider is p and not w.gone:
                if w.state is WorkerState.READY and not w.calls:
                    self.dispatch.retire(w)
                elif w.state is WorkerState.SPAWNING:
                    # Its start counts as failed with the rest: a 'fatal' it may still send
                    # (the same import error) is expected, not a violation.
                    w.start_failed = w.answered = True
                    self.ladder.quarantine(w, None)
                elif w.state is not WorkerState.RETIRING:
                    self.ladder.quarantine(w, None)
        if p.name == "default" and self.s.starting and self.s.broken is None:
            self.s.broken = p.broken  # the pool's own start failed
        self.settlement.fail_queue(p)
        self.s.act(Changed())

    def _drain(self, p: ProviderRecord, reason: str) -> None:
        """p resolves no more: what is queued for it settles, its idle workers exit, its
        busy ones finish (``drain_grace``, then a cancel with cause ``disposed``)."""
        p.advance(ProviderState.DRAINING)
        p.reason = reason
        self.s.draining.append(p)
        queued = [c for c in p.queue if c._queued]
        p.queue.clear()
        p.settled_in_queue = 0
        for call in queued:
            call._queued = False
            call._provider = None
            self.settlement.abort_queued(call, _DISPOSED)
        p.ready.clear()
        busy = False
        for w in list(self.s.workers.values()):
            if w.provider is not p or w.gone:
                continue
            if w.state is WorkerState.SPAWNING:
                w.draining = True  # retired when its hello comes
            elif w.state is WorkerState.READY and not w.calls:
                self.dispatch.retire(w)
            elif w.calls:
                busy = True
                self.dispatch.recall_behind(w, w.calls[0])
        if busy:
            grace = self.s.config.graces.drain
            if grace > 0:
                p.drain_by = self.s.now + grace
                self.s.arm(p.drain_by, "drain", p.id)
            else:
                self.drain_due(p.id)
        if not any(w.provider is p for w in self.s.workers.values()):
            self.gone(p)

    def gone(self, p: ProviderRecord) -> None:
        """Every worker of a draining (or failed) provider is gone."""
        if p.state is ProviderState.DRAINING:
            p.advance(ProviderState.GONE)
        if p in self.s.draining:
            self.s.draining.remove(p)
        self.s.providers_by_id.pop(p.id, None)
        self.s.act(Changed())
