"""The call queues, one per provider: which worker gets the next call, calls queued in busy
workers (prefetch), taking them back (recall, stealing), and putting calls back at the front
of the queue."""

from __future__ import annotations

import itertools
from typing import Final

from ...core import CancelCause
from ...protocol import Recall, Resume, Shutdown, encode, encode_call
from .._results import Rung, WorkerState
from ._actions import Send
from ._records import CallRecord, CallState, ProviderRecord, ProviderState, WorkerRecord
from ._settlement import Settlement
from ._state import State

__all__ = ("QUEUE_BEHIND_FOR", "Dispatch")

_new_send = tuple.__new__  # a Send without its Python-level __new__ (the hot path)
_DISPOSED: Final = CancelCause("disposed")
_PARENT: Final = CancelCause("parent")

# States bound to names once: a member of an enum read through its class
# (``WorkerState.READY``) is a slow attribute lookup on Python 3.11, and dispatch reads
# them for every call.
_QUEUED, _SENT = CallState.QUEUED, CallState.SENT
_ACTIVE = ProviderState.ACTIVE
_READY, _BUSY, _CLEANING = WorkerState.READY, WorkerState.BUSY, WorkerState.CLEANING
_RETIRING, _UNKILLABLE = WorkerState.RETIRING, WorkerState.UNKILLABLE

#: A call is sent to wait behind another in a busy worker only while the call first in line
#: there has been so for less than this (seconds); calls waiting behind one that has taken
#: longer are taken back to the front of the pool's queue at the next dispatch. What this
#: bounds: prefetch 8 under this rule took no-op throughput from 9.2k to 12k calls/s, while a
#: long call holds up at most what was queued behind it in its first 5 ms (docs/performance.md).
QUEUE_BEHIND_FOR: Final = 0.005


class Dispatch:
    """Queueing and dispatch: which worker runs which call, and when a worker serves on."""

    def __init__(self, state: State, settlement: Settlement) -> None:
        self.s = state
        self.settlement = settlement

    def schedule(self) -> None:
        """Dispatch once the events read so far are handled (``flush``): the calls their
        results freed room for then go in one message per worker, not one each."""
        self.s.dispatch_due = True

    def run(self) -> None:
        """One dispatch pass, over every active provider's queue."""
        s = self.s
        if s.closing:
            return  # what is still queued settles as aborted_before_dispatch (disposed)
        for p in s.providers.values():
            if p.state is not _ACTIVE:
                continue
            if p.queue:
                self._dispatch_provider(p)
            elif p.spec.prefetch:
                self._steal(p, s.now)

    def _dispatch_provider(self, p: ProviderRecord) -> None:
        queue = p.queue
        ready = p.ready
        # The workers given calls in this pass and how many each (its last ones, in order):
        # the first one by name, the others (rare: prefetch) in a dict made only then.
        first: WorkerRecord | None = None
        taken = 0
        others: dict[WorkerRecord, int] | None = None
        s = self.s
        now = s.now
        spares = p.spec.warm_spares
        prefetch = p.spec.prefetch
        while queue:
            call = queue[0]
            if call._state is not _QUEUED:  # settled while queued
                queue.popleft()
                p.settled_in_queue = max(0, p.settled_in_queue - 1)
                continue
            group = call._group
            if group is not None and group.cancelled:  # C5.2: never dispatched after its cancel
                self.settlement.abort_queued(call, group.signal.reason or _PARENT)  # (drops it)
                continue
            # (_pick's first choice, inline: the last idle worker, where spares are no bar)
            w = ready[-1] if ready and not spares else None
            if w is None or w.state is not _READY or w.gone or w.calls:
                if not ready and not prefetch:
                    break  # (what _pick finds: no idle worker, and none may queue one)
                w = self._pick(p, now)
                if w is None:
                    break
            queue.popleft()
            call._queued = False
            call._provider = None
            held = w.calls
            if not held:
                if ready and ready[-1] is w:
                    ready.pop()
                elif w in ready:
                    ready.remove(w)
                w.head_since = now
                w.state = _BUSY  # (w.advance, inline: an idle worker, ready, may go busy)
                if s.probe.cgroups:
                    s.probe.reset_peak(w.wid)  # the call's peak starts now
            held.append(call)
            call._worker = w
            call._state = _SENT  # (call.advance, inline: it was queued, checked above)
            if w is first:
                taken += 1
            elif first is None:
                first, taken = w, 1
            else:
                if others is None:
                    others = {}
                others[w] = others.get(w, 0) + 1
        if p.settled_in_queue:
            self.settlement.compact_queue(p)  # (what went out may leave it mostly settled calls)
        if first is not None:
            # One multipart message per worker: one wake-up of zmq's I/O thread for all of
            # them (each part is one 'call' frame).
            if taken == 1 and not (call := first.calls[-1])._parts:  # (one call: the most)
                call._times["dispatched"] = now
                frame = encode_call(call.id, call.tool, call._args, first.results)
                s.out.append(_new_send(Send, (first.wid, [frame], (call,))))
            else:
                self._send_calls(first, taken, now)
            if others is not None:
                for w, n in others.items():
                    self._send_calls(w, n, now)
        if prefetch:
            self._steal(p, now)

    def _send_calls(self, w: WorkerRecord, n: int, now: float) -> None:
        """Send w the last ``n`` calls it was given (a dispatch pass's), in one message."""
        held = w.calls
        calls = tuple(itertools.islice(held, len(held) - n, None))
        acked = w.results
        frames = []
        for call in calls:
            parts = call._parts
            if parts:  # the frame, then its parts (zmq sends them without a copy)
                frames.append(encode_call(call.id, call.tool, call._args, acked, len(parts)))
                frames.extend(parts)
            else:
                frames.append(encode_call(call.id, call.tool, call._args, acked))
            call._times["dispatched"] = now
        self.s.out.append(_new_send(Send, (w.wid, frames, calls)))

    def _pick(self, p: ProviderRecord, now: float) -> WorkerRecord | None:
        """The worker of p for its next queued call: an idle one (within the warm-spare
        limit), else the busy one with the fewest calls that may queue one more
        (``prefetch``)."""
        ready = p.ready
        spec = p.spec
        spares = spec.warm_spares
        while ready and not (spares and self.serving(p) >= spec.size):
            w = ready[-1]
            if w.state is _READY and not w.gone and not w.calls:
                return w
            ready.pop()
        prefetch = spec.prefetch
        if not prefetch:
            return None
        best: WorkerRecord | None = None
        limit = prefetch + 1
        threaded = p.threaded
        for w in self.s.workers.values():
            n = len(w.calls)
            if (
                0 < n < limit
                and w.provider is p
                and w.state is _BUSY
                and not w.gone
                and not w.draining
                and (best is None or n < len(best.calls))
                # Not more than its max_calls: it retires once they are done.
                and (spec.max_calls is None or w.served + n < spec.max_calls)
                # Only behind bodies that leave the worker's loop free to withdraw it: an
                # async body can hold the loop (and the queue) for as long as it runs. (The
                # last one is enough: a call joins only a queue of such bodies.)
                and w.calls[-1].tool in threaded
                # Not behind a call being cancelled: its worker may be killed for it.
                and w.calls[0]._cause is None
                # Not behind one that already takes long (the rest would wait as long).
                and now - w.head_since < QUEUE_BEHIND_FOR
            ):
                best = w
        return best

    def _steal(self, p: ProviderRecord, now: float) -> None:
        """Take back calls waiting in p's busy workers' queues: all of those waiting behind a
        call that has been first in line for ``QUEUE_BEHIND_FOR`` or longer (they go to the
        front of p's queue); and while nothing is queued here but a worker is idle, as many
        as there are idle workers, to run on them."""
        idle = len(p.ready)
        if p.queue or (p.spec.warm_spares and self.serving(p) >= p.spec.size):
            idle = 0
        for w in list(self.s.workers.values()):
            if len(w.calls) < 2 or w.state is not _BUSY or w.provider is not p:
                continue
            stuck = now - w.head_since >= QUEUE_BEHIND_FOR
            if not stuck and idle <= 0:
                continue
            for call in list(w.calls)[:0:-1]:  # newest first, never the one it runs
                if stuck:
                    self.recall(w, call)
                elif idle <= 0:
                    break
                elif self.recall(w, call):
                    idle -= 1

    def enqueue(self, call: CallRecord, *, front: bool = False) -> None:
        """Queue call for the provider its tool resolves to now; a tool no provider has any
        more (its provider was removed) settles it, never started (cause ``disposed``)."""
        p = self.s.owner.get(call.tool)
        if p is None:
            self.settlement.abort_queued(call, _DISPOSED)
            return
        if front:
            p.queue.appendleft(call)
        else:
            p.queue.append(call)
        call._queued = True
        call._provider = p
        if p.broken is not None:  # it fails like the rest of its queue did
            self.settlement.fail_queue(p)
        self.s.dispatch_due = True  # (schedule, inline: once per call)

    def requeue(self, call: CallRecord) -> None:
        """A call its worker never took up goes back to the front of the queue."""
        call._worker = None
        call.advance(_QUEUED)
        call._recalling = False
        call._rung = Rung.NONE
        for step in ("dispatched", "sigterm", "sigkill"):
            call._times.pop(step, None)
        if self.s.closing:  # nothing is dispatched any more
            self.settlement.abort_queued(call, _DISPOSED)
            return
        self.enqueue(call, front=True)

    def serving(self, p: ProviderRecord) -> int:
        # (an unkillable worker's call holds no slot: its replacement serves in its place)
        return sum(
            1
            for w in self.s.workers.values()
            if w.calls and w.provider is p and w.state is not _UNKILLABLE
        )

    def behind(self, w: WorkerRecord, call: CallRecord) -> list[CallRecord]:
        """The calls sent to w after call, still in w."""
        calls = list(w.calls)
        return calls[calls.index(call) + 1 :] if call in calls else []

    def recall_behind(self, w: WorkerRecord, call: CallRecord) -> None:
        """Ask w to give back the calls waiting behind call (a cancelled one is withdrawn on
        its cancel)."""
        for queued in self.behind(w, call):
            self.recall(w, queued)

    def recall(self, w: WorkerRecord, call: CallRecord) -> bool:
        """Ask w to give call back, unless that is asked already or it is cancelled (then its
        cancel withdraws it), or it is no longer w's. True if asked now."""
        if call._recalling or call._cause is not None:
            return False
        if call._worker is not w or call._facts is not None:
            return False
        call._recalling = True
        self.send(w, encode(Recall(call.id)))
        return True

    def retire(self, w: WorkerRecord) -> None:
        """Tell w to exit once idle (it withdraws the calls it has not taken up)."""
        if w in w.provider.ready:
            w.provider.ready.remove(w)
        w.advance(_RETIRING)
        w.retired = True
        w.retire_reason = self._retire_reason(w)
        for call in w.calls:
            call._recalling = True
        self.send(w, encode(Shutdown()))

    def _retire_reason(self, w: WorkerRecord) -> str:
        """Why w is told to exit, in words: what the pool or its provider is doing."""
        p = w.provider
        if self.s.closing:
            return "the pool is closing"
        if p.state is ProviderState.DRAINING:
            return f"provider {p.name!r} was {p.reason or 'removed'}"
        if p.state is ProviderState.FAILED:
            why = f": {type(p.error).__name__}: {p.error}" if p.error is not None else ""
            return f"the start of provider {p.name!r} was rolled back{why}"
        if w.draining:
            return f"provider {p.name!r} was shrunk"
        if _used_up(w):
            calls = "1 call" if w.served == 1 else f"{w.served} calls"
            return f"it served {calls} (max_calls_per_worker={p.spec.max_calls})"
        return "told to exit"

    def send(self, w: WorkerRecord, frame: bytes) -> None:
        """Send a control frame to w (if it is gone, nobody reads it: nothing is lost)."""
        if not w.gone:
            self.s.act(Send(w.wid, [frame]))

    def resume(self, w: WorkerRecord) -> bool:
        """w settled or gave back a call, or its clean-up ended: it serves on (idle if it
        holds no call); then dispatch what is queued. True if w retired instead, having
        served its ``max_calls``: its provider is a worker short (the caller tops it up)."""
        used_up = False
        if not w.gone:
            if w.holding and not self.s.reaper_up:  # nobody can clean up: do not wait for it
                w.holding = False
                self.send(w, encode(Resume()))
            if w.state is _CLEANING and w.pending is None and not w.holding:
                w.advance(_BUSY)
            if w.state is _BUSY and not w.calls:
                if w.draining or w.provider.state is not _ACTIVE:
                    self.retire(w)  # (a shrink, or its provider was removed or reloaded)
                elif w.provider.spec.max_calls is not None and _used_up(w):
                    # (no call of _used_up where there is no limit: the hot path)
                    # It served its max_calls: it exits, and (the caller tops its provider
                    # up) a new worker starts in its place at once, as maxtasksperchild does.
                    self.retire(w)
                    used_up = True
                else:
                    w.state = _READY  # (w.advance, inline: busy with no call, it may go ready)
                    w.provider.ready.append(w)
        self.s.dispatch_due = True  # (_dispatch, inline: once per call)
        return used_up


def _used_up(w: WorkerRecord) -> bool:
    limit = w.provider.spec.max_calls
    return limit is not None and w.served >= limit
