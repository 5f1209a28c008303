"""Deterministic simulation of the pool's core (``toolpool.supervisor.machine``).

The core is driven through random schedules against a model of the world: worker processes
whose decisions are the real worker's own (each drives a ``WorkerMachine``,
``toolpool/worker/_machine.py``: the queue, cancels, recalls, shutdown, holding until resume,
acks, the ledger's slots, holding back, 'started', heartbeats, progress), with modelled bodies
that return, cooperate, ignore their signal, crash, or leave processes behind; workers that
hang (no thread runs: no heartbeat, nothing read,
as under a C extension that holds the GIL), and sometimes send garbage; a reaper whose
reports come in their own order, and whose trees may outlive a worker's pid; the reaper's own
death; and virtual time. After every step the contract's invariants are checked (``check``),
and each worker's machine checks its own (``WorkerMachine.check``), with two promises of the
worker's the supervisor's post-mortem relies on: it takes up a call only once every result it
did not keep in its ledger is in the supervisor's hands, and only once the supervisor said
``resume`` after a call that left processes behind.

A schedule is a seed plus a list of steps; steps name workers and calls by index modulo what
exists, so any sub-list of a schedule is a schedule too. Replaying (seed, steps) is exact. A
failing schedule is shrunk by deleting steps while it still fails, and printed with its seed.

Run ``make sim`` (``SIM_SCHEDULES=N make sim`` for more schedules), or
``python tests/sim_world.py --seed S`` to replay one seed; ``make test`` runs a short version
(``tests/test_sim.py``).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from core_support import FakeProbe
from toolpool.core import CancelCause, Graces, Outcome
from toolpool.protocol import (
    PROTOCOL_VERSION,
    CallMessage,
    Heartbeat,
    Hello,
    Pong,
    ProgressMessage,
    ResultMessage,
    Resume,
    Withdrawn,
    decode_from_supervisor,
    decode_from_worker,
    pack_value,
)
from toolpool.protocol._ledger import SLOT_PAYLOAD
from toolpool.supervisor._results import WorkerState
from toolpool.supervisor.machine import (
    REAPER_START_ATTEMPTS,
    Autoscale,
    CallRecord,
    Clean,
    Close,
    CoreConfig,
    GroupRecord,
    IllegalMove,
    Kill,
    Machine,
    Orphaned,
    Progressed,
    ProviderRecord,
    ProviderSpec,
    RestartReaper,
    Send,
    Spawn,
    Terminate,
    Unkillable,
)
from toolpool.supervisor.machine import Started as StartedAction
from toolpool.worker._machine import (
    FireCancel,
    IllegalPhaseMove,
    KeepResult,
    MarkInvoked,
    RunCall,
    SendFrames,
    WorkerMachine,
)

#: Tools of the model: (name, body runs in a thread).
TOOLS = {
    "quick": True,  # returns at its first step
    "slow": True,  # returns after a few steps
    "coop": True,  # runs until cancelled, then ends aborted
    "stubborn": True,  # ignores its signal and SIGTERM: only SIGKILL ends it
    "crash": True,  # its worker process dies while it runs
    "leaves": True,  # returns leaving a process behind (clean-up before settling)
    "async": False,  # a cooperative async body: calls never queue behind it
}
#: The tools of the provider "extra", added, removed, reloaded and resized by the schedule
#: ("default" has TOOLS; both may be removed and re-added).
EXTRA = {
    "x_quick": True,
    "x_coop": True,
}
PROVIDER_TOOLS = {"default": TOOLS, "extra": EXTRA}
CANCEL_GRACE = 1.0
TERM_GRACE = 0.5
START_TIMEOUT = 5.0
UNKILLABLE_AFTER = 3.0
HEARTBEAT = 0.4
HUNG_AFTER = HEARTBEAT * 3  # (the core's HUNG_AFTER_BEATS)
GARBAGE_CALL = 10**9  # the call of a result a garbage step forges


class Violation(AssertionError):
    """An invariant of the contract broke."""


# --------------------------------------------------------------------------- the model


@dataclass
class Body:
    call_id: int
    tool: str
    steps: int = 0
    cancelled: bool = False
    invoked: bool = False


@dataclass
class FakeWorker:
    wid: int
    secret: bytes
    pid: int
    alive: bool = True  # the worker process
    tree: bool = True  # any process of its tree (a lingering descendant keeps it True)
    lingers: bool = False  # its tree outlives its pid until a 'tree' step
    inbox: collections.deque[Any] = field(default_factory=collections.deque)
    outbox: collections.deque[Any] = field(default_factory=collections.deque)
    # Its decisions: the real worker's machine (its queue, acks, slots, phase...).
    machine: WorkerMachine = field(
        default_factory=lambda: WorkerMachine(max_frame=1 << 30, ledger=True, heartbeat=HEARTBEAT)
    )
    current: Body | None = None  # the body of the call its machine took up
    taken_mark: int = 0
    invoked_mark: int = 0
    ledger: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # slot -> (seq, frame)
    leftovers_of: int | None = None  # the call whose leftovers no 'resume' said were dealt with
    violated: bool = False
    exit_status: int | None = None
    # In uninterruptible sleep: it does nothing, and no signal ends it until it is thawed
    # (then the worst one it got does).
    frozen: bool = False
    pending_signal: int | None = None
    # Its reaper died: the shell ends its tree, waiting (frozen) until it is thawed.
    orphaned: bool = False
    orphan_waits: bool = False  # the shell waits for its frozen tree to end
    hung: bool = False  # no thread of it runs: it reads nothing, does nothing, sends nothing


class World:
    """The model of workers and reaper the core is run against, and the invariant checks."""

    def __init__(
        self, seed: int, *, workers: int, spares: int, prefetch: int, max_calls: int | None
    ) -> None:
        self.rng = random.Random(seed)
        self.now = 1000.0
        self.probe = FakeProbe()
        config = CoreConfig(
            graces=Graces(
                cancel=CANCEL_GRACE, term=TERM_GRACE, drain=0.5, unkillable_after=UNKILLABLE_AFTER
            ),
            start_timeout=START_TIMEOUT,
            max_start_failures=1000,
            heartbeat=HEARTBEAT,
        )
        self.secrets = iter(range(1, 1 << 30))
        self.core = Machine(config, self.probe, lambda: b"s%032d" % next(self.secrets))
        self.prefetch = prefetch
        self.max_calls = max_calls
        # Pool("sim:registry", ...): the provider "default", added before the pool starts.
        default = ProviderSpec(
            tools_spec="sim:registry",
            size=workers,
            warm_spares=spares,
            prefetch=prefetch,
            max_calls=max_calls,
        )
        self.core.add_provider("default", default, self.now)
        self.workers: dict[int, FakeWorker] = {}
        self.reports: collections.deque[tuple[Any, ...]] = collections.deque()
        self.reaper_up = True
        self.reaper_failures = 0  # new reapers that failed to start, in a row
        self.calls: list[CallRecord] = []  # every call submitted, in order
        self.groups: list[GroupRecord] = [GroupRecord() for _ in range(3)]
        self.group_cancelled_at: dict[int, float] = {}
        self.settled: dict[int, int] = collections.Counter()
        self.invoked_by: dict[int, list[int]] = collections.defaultdict(list)  # call -> wids
        # The order of each call's last sending to a worker and of its last withdrawal (and
        # by whom), and of each worker's last take-up of a call.
        self.sent_at: dict[int, int] = {}
        self.withdrawn_at: dict[int, tuple[int, int]] = {}
        self.took_at: dict[int, int] = {}
        self.events = 0
        self.sent_after_group_cancel: list[int] = []
        self.misrouted: list[str] = []  # calls sent to a worker not of their tool's provider
        self.refused = 0  # submits the shell would refuse (UnknownToolError)
        self.next_id = 1
        self.steps = 0
        self.closing = False
        self.pids = iter(range(20000, 1 << 30))
        self.unkillable_seen: set[int] = set()  # wids the core reported unkillable
        self.held_by_unkillable: set[int] = set()  # calls their unkillable worker held then
        self.awaiting_replacement: list[int] = []  # reported unkillable in this flush
        self.owed_replacement: list[int] = []  # ... whose replacement is owed
        # The core is handling a worker's message or the reaper's report of a worker: the
        # turn of the shell's loop that settles its calls and wakes their callers, where no
        # worker starts (a replacement is owed, started at a timer on a later turn).
        self.in_io_turn = False
        self.owed_across: collections.Counter[str] = collections.Counter()
        self.heard_at: dict[int, float] = {}  # wid -> when its hello or heartbeat was read
        self.progress_at_settle: dict[int, Any] = {}  # call id -> its progress then
        self.provider_of: dict[int, ProviderRecord] = {}  # wid -> whose tools it runs

    # ---- the core's side

    def flush(self) -> None:
        for _ in range(10_000):
            actions = self.core.flush(self.now)
            if not actions:
                break
            for action in actions:
                self.perform(action)
        self.in_io_turn = False
        # An unkillable worker's slot is filled at once, or owed (then checked once the
        # loop turned): its provider is back at its size (its replacement may have started
        # earlier, with another worker's).
        for wid in self.awaiting_replacement:
            p = self.core.workers[wid].provider if wid in self.core.workers else None
            if p is not None and p.replace_owed:
                self.owed_replacement.append(wid)
            else:
                self.check_replaced(wid)
        self.awaiting_replacement.clear()
        self.check()

    def check_replaced(self, wid: int) -> None:
        """Unkillable worker ``wid``'s provider is back at its size."""
        core = self.core
        p = core.workers[wid].provider if wid in core.workers else None
        if p is None or core.closing or core.broken is not None or not core.reaper_up:
            return
        if p.live and p.broken is None:
            # Its slot, not counting it: workers that serve or will, and those being
            # killed for a call (each replaced once its tree is gone).
            slots = sum(
                1
                for x in core.workers.values()
                if x.provider is p
                and not x.gone
                and not x.draining
                and x.state not in (WorkerState.UNKILLABLE, WorkerState.RETIRING)
            )
            if slots < p.spec.size + p.spec.warm_spares:
                raise Violation(f"unkillable worker {wid} not replaced ({p!r})")

    def fire_timers(self) -> None:
        """The shell's clock task: ``timer`` at every deadline due."""
        self.in_io_turn = False
        self.core.timer(self.now)

    def perform(self, action: Any) -> None:
        core = self.core
        if isinstance(action, Unkillable):
            w = self.workers[action.wid]
            if action.wid in self.unkillable_seen:
                raise Violation(f"worker {action.wid} reported unkillable twice")
            self.unkillable_seen.add(action.wid)
            cw = core.workers[action.wid]
            self.held_by_unkillable.update(c.id for c in cw.calls)
            if not cw.start_failed and not cw.awaiting_fatal:
                self.awaiting_replacement.append(action.wid)
            if w.alive and action.pids != (w.pid,):
                raise Violation(f"unkillable worker {w.wid}: pids {action.pids}, not {w.pid}")
        elif isinstance(action, Spawn):
            if self.closing:
                raise Violation(f"worker {action.wid} started after the pool's close")
            if self.in_io_turn:
                raise Violation(
                    f"worker {action.wid} started in the turn that handled a worker's message "
                    "or death, before the callers it woke run"
                )
            w = FakeWorker(action.wid, action.secret, next(self.pids))
            w.lingers = self.rng.random() < 0.2
            self.workers[action.wid] = w
            self.provider_of[action.wid] = core.workers[action.wid].provider
            self.probe.marks_of[action.wid] = (0, 0)
            listed = PROVIDER_TOOLS[action.provider]
            tools = [{"name": n, "runs_in_thread": t} for n, t in listed.items()]
            w.outbox.append(Hello(PROTOCOL_VERSION, w.pid, action.secret, tools, {}))
            self.reports.append(("spawned", action.wid, w.pid))
        elif isinstance(action, Send):
            w = self.workers[action.wid]
            if not w.alive and action.calls and self.rng.random() < 0.5:
                core.send_failed(action.wid, action.calls, self.now)
                return
            for frame in action.frames:
                msg = decode_from_supervisor(frame)
                if isinstance(msg, CallMessage):
                    self.events += 1
                    self.sent_at[msg.call_id] = self.events
                    call = self.calls[msg.call_id - 1]
                    # (A submit's dispatch is performed at the next flush: its worker may
                    # be gone from the core by then, its call back in the queue or settled.)
                    cw = core.workers.get(action.wid)
                    p = cw.provider if cw is not None else self.provider_of[action.wid]
                    if call.tool not in p.catalog or p.state != "active":
                        self.misrouted.append(f"call {call.id} ({call.tool}) to {p!r}")
                    group = call._group
                    if group is not None and id(group) in self.group_cancelled_at:
                        self.sent_after_group_cancel.append(call.id)
                if isinstance(msg, Resume):
                    w.leftovers_of = None  # the supervisor dealt with them (or cannot)
                if w.alive:
                    w.inbox.append(msg)
        elif isinstance(action, Terminate | Kill):
            w = self.workers[action.wid]
            self.check_signal(w, action)
            self.check_grace(w, action)
            if isinstance(action, Terminate):
                body = w.current
                if body is not None and body.tool == "stubborn":
                    return  # it ignores SIGTERM
                self.die(w, -15)
            else:
                self.die(w, -9)
        elif isinstance(action, Clean):
            self.reports.append(("cleaned", action.wid, 1))
        elif isinstance(action, Orphaned):
            w = self.workers[action.wid]
            if w.orphaned:
                raise Violation(f"worker {w.wid} orphaned twice")
            w.orphaned = True
            if w.frozen:
                # Uninterruptible sleep: the shell's SIGKILL waits, and so does the shell.
                w.pending_signal = -9
                w.orphan_waits = True
            else:
                # The shell kills the tree through its cgroup and waits until it is empty.
                self.orphan_gone(w)
        elif isinstance(action, RestartReaper):
            # Sometimes the new reaper dies while it starts (killed by the same hand).
            failed = self.rng.random() < 0.2
            self.reports.append(("reaper_failed",) if failed else ("reaper_ready",))
        elif isinstance(action, CallRecord):  # (the machine's Settled: that call settled)
            self.on_settled(action)
        elif isinstance(action, Progressed):
            if not self.invoked_by.get(action.call.id):
                raise Violation(f"call {action.call.id} reported progress, never invoked")
        elif isinstance(action, StartedAction):
            if not self.invoked_by.get(action.call.id):
                raise Violation(f"call {action.call.id} reported started, never invoked")
        elif isinstance(action, Close):
            pass

    def orphan_gone(self, w: FakeWorker) -> None:
        """The shell saw an orphaned tree end (verified through its cgroup, mostly)."""
        w.alive = w.tree = False
        w.orphan_waits = False
        self.reports.append(("orphan_gone", w.wid, self.rng.random() < 0.8))

    def die(self, w: FakeWorker, status: int) -> None:
        """w's process ends (its tree may linger); the reaper reports it."""
        if not w.alive:
            return
        if w.frozen:  # uninterruptible sleep: it dies of it once thawed
            if w.pending_signal is None or status == -9:
                w.pending_signal = status
            return
        w.alive = False
        w.exit_status = status
        if w.outbox and self.rng.random() < 0.3:
            # What its zmq thread had not sent yet dies with it: a tail of its messages.
            for _ in range(self.rng.randrange(1, len(w.outbox) + 1)):
                w.outbox.pop()
        w.tree = w.lingers
        if w.orphan_waits:
            self.orphan_gone(w)
        elif self.reaper_up and not w.orphaned:  # (an orphan is no child of a new reaper)
            self.reports.append(("exited", w.wid, status))
            if not w.tree:
                self.reports.append(("gone", w.wid))

    # ---- steps

    def step(self, step: tuple[Any, ...]) -> None:
        self.steps += 1
        kind = step[0]
        core = self.core
        if kind not in ("submit", "cancel", "gcancel") and core.s.owed_at is not None:
            # The loop turned: the shell's owed pump ran before any I/O, timer or other task
            # (a cancel, from the submitting task itself, may come first: the core pays the
            # owed pass inside that event).
            self.flush()
        owed = [p.name for p in core.s.providers_by_id.values() if p.replace_owed]
        if owed and kind in CALLER_STEPS:
            # The callers a death woke run before the clock task: they may submit, cancel,
            # add, remove or resize providers while the replacement is owed.
            self.owed_across[kind] += 1
        elif owed or (core.timers and core.timers[0][0] <= self.now):
            # The loop turned: the clock task ran the timers due (a replacement owed).
            self.fire_timers()
            self.flush()
            if any(p.replace_owed for p in core.s.providers_by_id.values()):
                raise Violation("a replacement still owed after the loop turned")
            for wid in self.owed_replacement:
                self.check_replaced(wid)
            self.owed_replacement.clear()
        live = [w for w in self.workers.values() if w.wid in core.workers]
        if kind == "submit":
            _, tool_i, group_i, timeout_i = step
            if self.closing or core.broken is not None:
                return
            names = [*TOOLS, *EXTRA]
            tool = names[tool_i % len(names)]
            if tool not in core.owner:
                self.refused += 1  # the shell raises UnknownToolError
                return
            group = self.groups[group_i] if group_i < len(self.groups) else None
            call = CallRecord(self.next_id, tool, pack_value({}), group, self.now)
            self.next_id += 1
            self.calls.append(call)
            timeout = (None, None, None, 0.3, 2.0)[timeout_i % 5]
            core.submit(call, timeout=timeout, now=self.now)
        elif kind == "cancel":
            _, k, force = step
            open_calls = [c for c in self.calls if c._result is None]
            if open_calls:
                call = open_calls[k % len(open_calls)]
                core.cancel(call, CancelCause("user"), force=bool(force), now=self.now)
        elif kind == "gcancel":
            group = self.groups[step[1] % len(self.groups)]
            if group._controller.cancel(None):
                self.group_cancelled_at[id(group)] = self.now
                core.cancel_group(group, CancelCause("user"), self.now)
        elif kind == "deliver" and live:
            w = live[step[1] % len(live)]
            if w.outbox:
                self.deliver(w)
        elif kind == "work" and live:
            self.work(live[step[1] % len(live)])
        elif kind == "report":
            self.report()
        elif kind == "tree" and live:
            w = live[step[1] % len(live)]
            if not w.alive and w.tree and self.reaper_up:
                w.tree = False
                self.reports.append(("gone", w.wid))
        elif kind == "crash" and live:
            self.die(live[step[1] % len(live)], -9)
        elif kind == "freeze" and live and self.reaper_up:
            # Uninterruptible sleep (a hung mount). (A reaper that dies later leaves it an
            # orphan that the shell waits for.)
            w = live[step[1] % len(live)]
            if w.alive and not w.frozen:
                w.frozen = True
                self.probe.tree_of[w.wid] = (w.pid,)
        elif kind == "thaw":
            frozen = [w for w in self.workers.values() if w.frozen]
            if frozen:
                self.thaw(frozen[step[1] % len(frozen)])
        elif kind == "garbage" and live:
            w = live[step[1] % len(live)]
            if w.alive:
                w.violated = True
                choice = step[2] % 4
                if choice == 0:
                    core.violation(w.wid, "protocol violation: garbage", self.now)
                elif choice == 1:
                    w.outbox.append(Pong(1))
                elif choice == 2:
                    w.outbox.append(
                        ResultMessage(GARBAGE_CALL, "ok", None, None, None, True, {}, 0, {})
                    )
                else:  # progress for a call it does not run (settled, perhaps): ignored
                    settled = [c.id for c in self.calls if c._result is not None] or [10**9]
                    w.outbox.append(
                        ProgressMessage(settled[step[1] % len(settled)], 1.0, None, None)
                    )
        elif kind == "hang" and live:
            # Its body enters a C call that holds the GIL (or it leaves one): no thread of
            # the worker runs. Again: the call returns, the worker goes on.
            w = live[step[1] % len(live)]
            if w.alive:
                w.hung = not w.hung  # (unhung, its heartbeat is overdue: it beats at once)
        elif kind == "reaper_lost":
            if self.reaper_up:
                self.reaper_up = False
                # Its unsent reports die with it; its workers die (PDEATHSIG), their trees
                # may not.
                self.reports = collections.deque(
                    # (the shell's own stay: a new reaper's start, an orphan's end)
                    r
                    for r in self.reports
                    if r[0] in ("reaper_ready", "reaper_failed", "orphan_gone")
                )
                for w in self.workers.values():
                    if w.alive and w.frozen:
                        w.pending_signal = -9  # PDEATHSIG, delivered once it is thawed
                    elif w.alive:
                        w.alive = False
                        w.exit_status = -9
                        w.tree = True
                core.reaper_lost(self.now)
        elif kind == "provider" and not self.closing:
            self.provider_step(step[1], step[2], step[3])
        elif kind == "tick":
            dt = (0.001, 0.006, 0.06, 0.3, 0.6, 1.1, 2.5)[step[1] % 7]
            if dt >= TERM_GRACE:
                # Messages on the wire reach a supervisor long before such a time passes (a
                # worker's messages are in flight for microseconds): read them first.
                for w in list(self.workers.values()):
                    while w.outbox and w.wid in core.workers:
                        self.deliver(w)
                self.flush()
            self.now += dt
            self.beat()
            self.fire_timers()
        if kind == "submit":
            # As the shell does: a submit's dispatch pass is owed, run by the next flush or
            # first thing in the next event (so a burst of submits is dispatched in one pass).
            self.check()
            return
        self.flush()

    def provider_step(self, op: int, which: int, size: int) -> None:
        """Add, remove, reload or resize a provider, as the shell would ask (it checks the
        name first)."""
        core = self.core
        name = ("default", "extra")[which % 2]
        known = name in core.providers or name in core.pending
        op %= 5
        if op == 0 and not known:
            spec = ProviderSpec(
                tools_spec=f"sim:{name}",
                size=1 + size % 3,
                warm_spares=0,
                prefetch=self.prefetch,
                max_calls=self.max_calls,
            )
            core.add_provider(name, spec, self.now)
        elif op == 1 and known:
            core.remove_provider(name, "removed", self.now)
        elif op == 2 and name in core.providers and name not in core.pending:
            core.reload_provider(name, self.now)
        elif op == 3 and known:
            core.resize(name, 1 + size % 3, self.now, force=size % 2 == 0)
        elif op == 4 and known:
            policy = Autoscale(minimum=1, maximum=1 + size % 3, grow_after=0.05, idle_after=0.5)
            core.autoscale(name, policy if size % 3 else None, self.now)

    def beat(self) -> None:
        """Time passed: each worker whose threads run sent its heartbeats meanwhile; they
        arrive before the core's timers run (the shell reads sockets as messages come)."""
        for w in list(self.workers.values()):
            if w.alive and not w.hung and w.wid in self.core.workers:
                self.act(w, w.machine.beat(self.now))
                while w.outbox and w.wid in self.core.workers:
                    self.deliver(w)

    def deliver(self, w: FakeWorker) -> None:
        """The core reads w's next message (the shell does so whenever it arrives)."""
        msg = w.outbox.popleft()
        self.in_io_turn = True
        if isinstance(msg, Hello | Heartbeat):
            self.heard_at[w.wid] = self.now
        self.core.message(w.wid, msg, self.now, peer_pid=w.pid)

    def report(self) -> None:
        """The reaper's next report (the shell reads w's socket first, as it does)."""
        if not self.reports:
            return
        report = self.reports.popleft()
        core, kind = self.core, report[0]
        if kind == "reaper_ready":
            self.reaper_up = True
            self.reaper_failures = 0
            core.reaper_ready(self.now)
            return
        if kind == "reaper_failed":
            self.reaper_failures += 1
            was_broken = core.broken is not None
            core.reaper_failed("killed while it started", self.now)
            if not was_broken and not core.closing:
                # Broken only once every attempt in a row failed; until then, another starts.
                broke = core.broken is not None
                if broke != (self.reaper_failures >= REAPER_START_ATTEMPTS):
                    raise Violation(
                        f"reaper start failure {self.reaper_failures} of "
                        f"{REAPER_START_ATTEMPTS} {'broke' if broke else 'did not break'} the pool"
                    )
            return
        w = self.workers[report[1]]
        self.in_io_turn = True
        if kind in ("exited", "gone", "orphan_gone"):
            while w.outbox:
                self.deliver(w)
        if kind == "spawned":
            core.spawned(w.wid, w.pid, "fork", self.now)
        elif kind == "exited":
            core.exited(w.wid, report[2], 0, self.now)
        elif kind == "gone":
            if w.tree or w.alive:
                raise Violation(f"the model reported worker {w.wid} gone while alive")
            self.probe.marks_of[w.wid] = (w.taken_mark, w.invoked_mark)
            self.probe.kept_of[w.wid] = sorted(w.ledger.values())
            core.gone(w.wid, self.now)
        elif kind == "orphan_gone":
            self.probe.marks_of[w.wid] = (w.taken_mark, w.invoked_mark)
            self.probe.kept_of[w.wid] = sorted(w.ledger.values())
            core.gone(w.wid, self.now, verified=report[2])
        elif kind == "cleaned":
            core.cleaned(w.wid, report[2], self.now)

    def thaw(self, w: FakeWorker) -> None:
        w.frozen = False
        self.probe.tree_of.pop(w.wid, None)
        if w.pending_signal is not None:
            self.die(w, w.pending_signal)

    def work(self, w: FakeWorker) -> None:
        """w does one thing, as the real worker would: read a message, or move its call on.
        What each means, its machine decides; the model runs the body."""
        if not w.alive or w.frozen or w.hung:
            return
        machine = w.machine
        if w.inbox:
            self.act(w, machine.receive(w.inbox.popleft()))
            return
        body = w.current
        if body is None:
            if machine.done:
                self.die(w, 0)
                return
            self.act(w, machine.next())
            return
        call = self.calls[body.call_id - 1]
        tool = body.tool.removeprefix("x_")  # (extra's tools behave as their namesakes)
        if not body.invoked:
            if body.cancelled:
                self.finish(w, "aborted_before_dispatch", started=False)
                return
            body.invoked = True
            self.invoked_by[call.id].append(w.wid)
            self.act(w, machine.invoked(body.call_id, tool == "async"))
            if tool in ("slow", "coop", "stubborn") and self.rng.random() < 0.7:
                # It runs past the quick wait: the control thread says 'started'.
                self.act(w, machine.body_running(body.call_id))
            return
        body.steps += 1
        if machine.said_started == body.call_id:  # (only once said started)
            if self.rng.random() < 0.3:
                machine.report_progress(str(body.call_id), float(body.steps), None, None)
            self.act(w, machine.send_progress(self.now, body.call_id)[0])
        if tool == "crash":
            self.die(w, 1)
        elif tool == "quick" or (tool == "slow" and body.steps >= 3):
            self.finish(w, "ok", started=True)
        elif tool in ("coop", "async", "slow") and body.cancelled:
            self.finish(w, "aborted", started=True)
        elif tool == "leaves":
            self.finish(w, "ok", started=True, leftovers=1)

    def act(self, w: FakeWorker, actions: Sequence[Any]) -> None:
        """Perform what w's machine asked, as the worker's shell (``_server.py``) does."""
        for action in actions:
            if isinstance(action, SendFrames):
                for frame in action.frames:
                    msg = decode_from_worker(frame)
                    if isinstance(msg, Withdrawn):
                        self.events += 1
                        self.withdrawn_at[msg.call_id] = (self.events, w.wid)
                    w.outbox.append(msg)
            elif isinstance(action, MarkInvoked):
                w.invoked_mark = action.call_id + 1
                self.probe.marks_of[w.wid] = (w.taken_mark, w.invoked_mark)
            elif isinstance(action, KeepResult):
                w.ledger[action.slot] = (action.seq, action.frame)
            elif isinstance(action, FireCancel):
                if w.current is not None and w.current.call_id == action.call_id:
                    w.current.cancelled = True
            elif isinstance(action, RunCall):
                self.events += 1
                self.took_at[w.wid] = self.events
                if action.mark:
                    w.taken_mark = action.msg.call_id + 1
                    self.probe.marks_of[w.wid] = (w.taken_mark, w.invoked_mark)
                self.check_take(w, action.msg)
                w.current = Body(action.msg.call_id, action.msg.tool)

    def check_take(self, w: FakeWorker, msg: CallMessage) -> None:
        """The worker's promises the supervisor's post-mortem relies on (``docs/protocol.md``
        6.3): it takes up a call only once each result it did not keep in its ledger is in
        the supervisor's hands, and, after a call that left processes behind, only once the
        supervisor said ``resume``."""
        for sent in w.outbox:
            if not isinstance(sent, ResultMessage) or sent.call_id == GARBAGE_CALL:
                continue  # (a garbage step's forged result is not its machine's)
            if not sent.extras.get("kept"):
                raise Violation(
                    f"worker {w.wid} took up call {msg.call_id} while its result of call "
                    f"{sent.call_id}, not kept in its ledger, was not in the supervisor's hands"
                )
        if w.leftovers_of is not None:
            raise Violation(
                f"worker {w.wid} took up call {msg.call_id} before 'resume': call "
                f"{w.leftovers_of} left processes behind"
            )

    def finish(self, w: FakeWorker, outcome: str, *, started: bool, leftovers: int = 0) -> None:
        """w's body returned: its machine concludes the call (a fifth of the results too large
        for a ledger slot: the worker waits for their ack before it takes up another)."""
        body = w.current
        assert body is not None
        w.current = None
        big = "x" * SLOT_PAYLOAD if self.rng.random() < 0.2 else ""
        error = None if outcome == "ok" else "Error: x" + big
        value = pack_value(big or body.call_id) if outcome == "ok" else None
        reply = ResultMessage(body.call_id, outcome, value, error, None, started, {}, leftovers, {})
        if leftovers:
            w.leftovers_of = body.call_id
        self.act(w, w.machine.conclude(reply))

    # ---- invariants

    def on_settled(self, call: CallRecord) -> None:
        self.settled[call.id] += 1
        if self.settled[call.id] > 1:
            raise Violation(f"call {call.id} settled twice")
        self.progress_at_settle[call.id] = call._progress
        result = call._result
        if result is None:
            raise Violation(f"call {call.id} settled without a result")
        invoked = bool(self.invoked_by.get(call.id))
        outcome = result.outcome
        if outcome is Outcome.ABORTED_BEFORE_DISPATCH and invoked:
            raise Violation(f"call {call.id} aborted_before_dispatch, but its body ran")
        if outcome in (Outcome.OK, Outcome.ABORTED) and not invoked:
            raise Violation(f"call {call.id} {outcome.value}, but its body never ran")
        if result.body_started is True and not invoked:
            raise Violation(f"call {call.id}: body_started True, never invoked")
        if result.body_started is False and invoked:
            raise Violation(f"call {call.id}: body_started False, but its body ran")
        withdrawn, by = self.withdrawn_at.get(call.id, (-1, 0))
        if (
            outcome in (Outcome.KILLED, Outcome.WORKER_LOST)
            and call._cause is not None
            and withdrawn > self.sent_at.get(call.id, -1)
            and self.took_at.get(by, -1) > withdrawn
            and not self.workers[by].violated
        ):
            # C4.6: a cancelled call the worker it was sent to last withdrew before taking
            # up another (its ledger says so, though its 'withdrawn' may be lost with it)
            # never started; that worker's death is not its.
            raise Violation(f"call {call.id} {outcome.value}, but its worker withdrew it")
        if outcome in (Outcome.KILLED, Outcome.WORKER_LOST) and result.body_started is not False:
            wids = self.invoked_by.get(call.id) or []
            for wid in wids[-1:]:
                w = self.workers[wid]
                if w.alive or w.tree:
                    raise Violation(
                        f"call {call.id} settled {outcome.value} while worker {wid}'s tree lives"
                    )

    def check_signal(self, w: FakeWorker, action: Any) -> None:
        """A signal never reaches a worker whose current call nobody escalated."""
        body = w.current
        if body is None or not w.alive:
            return
        call = self.calls[body.call_id - 1]
        core_w = self.core.workers.get(w.wid)
        misbehaved = w.violated or (core_w is not None and core_w.violation is not None)
        if call._cause is None and not misbehaved and not self.core.closing:
            raise Violation(
                f"{type(action).__name__} of worker {w.wid} while it runs call {call.id}, "
                "which nobody cancelled"
            )

    def check_grace(self, w: FakeWorker, action: Any) -> None:
        """The call a SIGTERM escalates had its whole cooperative grace (C4.1), also when its
        worker is hung: being hung shortens nothing (a forced cancel goes straight to
        SIGKILL, as for any)."""
        core_w = self.core.workers.get(w.wid)
        if not isinstance(action, Terminate) or core_w is None:
            return
        for call in core_w.calls:
            if call._times.get("sigterm") != self.now or call._forced:
                continue
            asked = call._times.get("cancel_requested")
            if asked is None or self.now - asked < CANCEL_GRACE - 1e-9:
                raise Violation(
                    f"SIGTERM of worker {w.wid} (hung: {core_w.hung}) for call {call.id} "
                    f"within its cancel grace (asked at {asked}, now {self.now})"
                )

    def check(self) -> None:
        core = self.core
        try:
            core.check()  # the machine's own invariants, at the records' fields
        except AssertionError as exc:
            raise Violation(f"the machine's invariant broke: {exc!r}") from exc
        for fake in self.workers.values():
            if not fake.alive:
                continue
            try:
                fake.machine.check()  # each worker's machine's own
            except AssertionError as exc:
                raise Violation(f"worker {fake.wid}'s machine's invariant broke: {exc!r}") from exc
        # Two-level liveness: the core says a worker is hung exactly when it has read
        # neither hello nor heartbeat from it for HUNG_AFTER; one that beats never is.
        for wid, core_w in core.workers.items():
            heard = self.heard_at.get(wid)
            if core_w.gone or core_w.violation is not None or heard is None:
                continue
            if not core_w.answered or core_w.start_failed:
                continue
            silent = self.now >= heard + HUNG_AFTER  # (the core's own arithmetic)
            if core_w.hung != silent:
                raise Violation(
                    f"worker {wid}: the core says hung={core_w.hung}, but it was last heard "
                    f"{self.now - heard:.3f} s ago (hung after {HUNG_AFTER} s)"
                )
        # max_calls_per_worker: no worker is sent more calls than it has left to serve, and
        # one that served them all takes no more.
        for wid, core_w in core.workers.items():
            limit = core_w.provider.spec.max_calls
            if limit is None or core_w.gone:
                continue
            if core_w.served + len(core_w.calls) > limit:
                raise Violation(
                    f"worker {wid} served {core_w.served} calls and holds "
                    f"{len(core_w.calls)}: more than max_calls={limit}"
                )
            if core_w.served >= limit and core_w in core_w.provider.ready:
                raise Violation(f"worker {wid} served its {limit} calls, yet is ready")
        for call_id, progress in self.progress_at_settle.items():
            if self.calls[call_id - 1]._progress is not progress:
                raise Violation(f"call {call_id}'s progress changed after it settled")
        if self.sent_after_group_cancel:
            raise Violation(
                f"calls sent after their group's cancel: {self.sent_after_group_cancel}"
            )
        if self.misrouted:
            raise Violation(f"calls sent where their provider is not: {self.misrouted}")
        for p in [*core.providers.values(), *core.draining]:
            for w in p.ready:
                if w.provider is not p:
                    raise Violation(f"{w!r} idle in the wrong provider {p!r}")
        for p in [*core.providers.values(), *core.pending.values()]:
            serving = core.fleet.serving_count(p)
            if serving > p.spec.size + p.spec.warm_spares:
                raise Violation(f"{p!r} has {serving} workers serving, sized {p.spec.size}")
            policy = p.autoscale
            if policy is not None and not policy.minimum <= p.spec.size <= policy.maximum:
                raise Violation(f"{p!r} autoscaled to {p.spec.size}, outside {policy}")
        for call_id, wids in self.invoked_by.items():
            if len(wids) > 1:
                raise Violation(f"call {call_id} ran {len(wids)} times: {wids}")
        dead = sum(1 for c in core.queue if c._result is not None)
        if dead > len(core.queue) - dead + 1:
            raise Violation(f"the core's queue holds {dead} settled calls (of {len(core.queue)})")
        held = set(core.calls)
        for w in core.workers.values():
            held.update(c.id for c in w.calls)
        for call_id in self.settled:
            if call_id in held:
                raise Violation(f"the core still holds settled call {call_id}")
        for call in self.calls:
            if call._result is None and call.id not in core.calls:
                raise Violation(f"call {call.id} is neither settled nor held")
        for cw in core.workers.values():
            # Unkillable, in time: a tree still there unkillable_after past its SIGKILL.
            w = self.workers[cw.wid]
            overdue = cw.killed_at is not None and self.now >= cw.killed_at + UNKILLABLE_AFTER
            stuck = overdue and not cw.gone and w.frozen
            if stuck and cw.state is not WorkerState.UNKILLABLE:
                raise Violation(f"worker {cw.wid} frozen past its SIGKILL, not unkillable")
            if cw.state is WorkerState.UNKILLABLE and cw in core.ready:
                raise Violation(f"unkillable worker {cw.wid} is ready for calls")
        # Nothing but a tree in flight may hold a new reaper up (an unkillable one, which may
        # never end, does not).
        waiting = not core.reaper_up and not core.restarting and not core.closing
        if (
            waiting
            and not core.broken
            and all(cw.gone or cw.state is WorkerState.UNKILLABLE for cw in core.workers.values())
        ):
            raise Violation("the reaper is down, and no new one is being started")

    # ---- the end

    def close(self) -> None:
        """Close the pool and run the world until every worker is gone; then check that
        every call settled and no worker is left."""
        core = self.core
        if any(p.replace_owed for p in core.s.providers_by_id.values()):
            self.owed_across["close"] += 1
        self.closing = True
        core.closing = True
        for group in self.groups:
            if group._controller.cancel(None):
                core.cancel_group(group, CancelCause("disposed"), self.now)
        core.close(self.now)
        self.flush()
        # (the reaper's reports in flight are read first, as the shell reads them at once)
        self.settle_down(
            lambda: core.idle_or_stuck() and core.all_gone_or_unkillable() and not self.reports
        )
        # What the close leaves: only unkillable workers, holding the only unsettled calls,
        # each really still there in the model.
        stuck = core.unkillable()
        if len(stuck) != len(core.workers):
            raise Violation(f"close left workers: {sorted(core.workers)}")
        held = {c.id for cw in stuck for c in cw.calls}
        for cw in stuck:
            w = self.workers[cw.wid]
            if not (w.alive or w.tree):
                raise Violation(f"close left worker {cw.wid} unkillable, but its tree is gone")
        unsettled = [c.id for c in self.calls if c._result is None and c.id not in held]
        if unsettled:
            raise Violation(f"close left calls unsettled: {unsettled[:10]}")
        # Reaping goes on: once their trees go (thawed), their calls settle, their workers
        # are gone.
        for w in list(self.workers.values()):
            if w.frozen:
                self.thaw(w)
        self.flush()
        self.settle_down(lambda: not core.calls and not core.workers)
        unsettled = [c.id for c in self.calls if c._result is None]
        if unsettled:
            raise Violation(f"close left calls unsettled: {unsettled[:10]}")
        if core.workers:
            raise Violation(f"close left workers: {sorted(core.workers)}")

    def settle_down(self, done: Any) -> None:
        """Run the world (closing) until ``done()``."""
        core = self.core
        started = self.now
        killed = False
        for _ in range(20_000):
            if done():
                break
            if core.calls:
                pass
            elif not killed:
                core.retire_idle(self.now)
                self.flush()
            if not killed and self.now - started > TERM_GRACE + CANCEL_GRACE + 5:
                core.kill_remaining(self.now)
                killed = True
                self.flush()
            progressed = False
            for w in list(self.workers.values()):
                busy = w.outbox or w.inbox or w.current or w.machine.queue or w.machine.shutdown
                if w.wid in core.workers and w.alive and busy:
                    if w.outbox:
                        self.deliver(w)
                    else:
                        self.work(w)
                    progressed = True
                    self.flush()
            if self.reports:
                self.report()
                self.flush()
                progressed = True
            for w in self.workers.values():
                if w.wid in core.workers and not w.alive and w.tree and self.reaper_up:
                    w.tree = False
                    self.reports.append(("gone", w.wid))
                    progressed = True
            self.now += 0.01 if progressed else 0.1  # a body that never ends: time goes on
            self.beat()
            self.fire_timers()
            self.flush()


# --------------------------------------------------------------------------- schedules

#: Steps a caller's task takes (it may run before the clock task, in the loop's next turn).
CALLER_STEPS = frozenset(("submit", "cancel", "gcancel", "provider"))

STEP_KINDS = (
    ("submit", 8),
    ("work", 36),
    ("deliver", 30),
    ("report", 14),
    ("tick", 8),
    ("cancel", 4),
    ("gcancel", 1),
    ("tree", 3),
    ("crash", 1),
    ("garbage", 1),
    ("hang", 1),
    ("reaper_lost", 0.3),
    ("provider", 0.6),
    ("freeze", 0.4),
    ("thaw", 0.4),
)


def make_schedule(seed: int, length: int) -> list[tuple[Any, ...]]:
    rng = random.Random(seed * 7919 + 1)
    kinds = [k for k, _ in STEP_KINDS]
    weights = [w for _, w in STEP_KINDS]
    steps: list[tuple[Any, ...]] = []
    for kind in rng.choices(kinds, weights, k=length):
        if kind == "submit":
            steps.append((kind, rng.randrange(7), rng.randrange(5), rng.randrange(5)))
        elif kind == "cancel":
            steps.append((kind, rng.randrange(1000), rng.random() < 0.3))
        elif kind == "garbage":
            steps.append((kind, rng.randrange(8), rng.randrange(4)))
        elif kind in ("report", "reaper_lost"):
            steps.append((kind,))
        elif kind == "provider":
            steps.append((kind, rng.randrange(5), rng.randrange(2), rng.randrange(6)))
        else:
            steps.append((kind, rng.randrange(1000)))
    return steps


def shape(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "workers": rng.choice((1, 2, 3)),
        "spares": rng.choice((0, 0, 1)),
        "prefetch": rng.choice((0, 2, 16)),
        "max_calls": rng.choice((None, None, 1, 3)),  # (a draw after the others: they stay)
    }


def run(seed: int, steps: list[tuple[Any, ...]]) -> World:
    """Replay one schedule exactly; raises :class:`Violation` where an invariant breaks (or
    a record of the machine is asked to move where its transition table forbids)."""
    try:
        return _run(seed, steps)
    except (IllegalMove, IllegalPhaseMove) as exc:
        raise Violation(str(exc)) from exc


def _run(seed: int, steps: list[tuple[Any, ...]]) -> World:
    world = World(seed, **shape(seed))
    world.core.start(world.now)
    world.flush()
    for _ in range(200):  # start-up: hellos and the reaper's reports
        default = world.core.default
        if default is None or default.state != "starting":
            break
        for w in list(world.workers.values()):
            while w.outbox:
                world.deliver(w)
        while world.reports:
            world.report()
        world.flush()
    world.core.started()
    for step in steps:
        world.step(step)
    world.close()
    return world


def shrink(seed: int, steps: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Delete steps while the schedule still fails (chunks first, then one by one)."""

    def fails(candidate: list[tuple[Any, ...]]) -> bool:
        try:
            run(seed, candidate)
        except Violation:
            return True
        return False

    chunk = max(1, len(steps) // 2)
    while chunk >= 1:
        i = 0
        while i < len(steps):
            candidate = steps[:i] + steps[i + chunk :]
            if fails(candidate):
                steps = candidate
            else:
                i += chunk
        chunk //= 2
    return steps


@dataclass
class Summary:
    schedules: int = 0
    steps: int = 0
    settled: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    unkillable: int = 0  # workers found unkillable
    held_then_settled: int = 0  # calls an unkillable worker held, settled once its tree went
    # Steps a caller took (and closes) while a replacement was owed, by kind.
    owed_across: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[tuple[int, str, list[tuple[Any, ...]]]] = field(default_factory=list)


def simulate(
    first_seed: int, schedules: int, length: int, *, stop_at_first: bool = True
) -> Summary:
    logging.getLogger("toolpool").setLevel(logging.CRITICAL)  # the core's lifecycle lines
    summary = Summary()
    for seed in range(first_seed, first_seed + schedules):
        steps = make_schedule(seed, length)
        try:
            world = run(seed, steps)
        except Violation as exc:
            shrunk = shrink(seed, steps)
            summary.failures.append((seed, str(exc), shrunk))
            if stop_at_first:
                break
            continue
        summary.schedules += 1
        summary.steps += world.steps
        summary.settled += len(world.settled)
        summary.unkillable += len(world.unkillable_seen)
        summary.owed_across.update(world.owed_across)
        summary.held_then_settled += sum(
            1 for c in world.calls if c.id in world.held_by_unkillable and c._result is not None
        )
        for call in world.calls:
            if call._result is not None:
                summary.outcomes[call._result.outcome.value] += 1
    return summary


def report(summary: Summary) -> str:
    lines = [
        f"{summary.schedules} schedules, {summary.steps} steps, {summary.settled} calls "
        f"settled, invariants checked after every step",
        "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(summary.outcomes.items())),
        f"unkillable workers {summary.unkillable}, their calls settled once their trees went "
        f"{summary.held_then_settled}",
        "steps while a replacement was owed: "
        + ", ".join(f"{k} {v}" for k, v in sorted(summary.owed_across.items())),
    ]
    for seed, error, shrunk in summary.failures:
        lines.append(f"FAILED seed {seed}: {error}")
        lines.append(f"  replay: python tests/sim_world.py --seed {seed}")
        lines.append(f"  shrunk to {len(shrunk)} steps: {shrunk}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--schedules", type=int, default=int(os.environ.get("SIM_SCHEDULES", "500"))
    )
    parser.add_argument("--steps", type=int, default=int(os.environ.get("SIM_STEPS", "300")))
    parser.add_argument("--seed", type=int, default=None, help="replay this seed only")
    parser.add_argument("--first-seed", type=int, default=int(os.environ.get("SIM_SEED", "0")))
    args = parser.parse_args()
    logging.getLogger("toolpool").setLevel(logging.CRITICAL)  # the core's lifecycle lines
    began = time.monotonic()
    if args.seed is not None:
        summary = simulate(args.seed, 1, args.steps)
    else:
        summary = simulate(args.first_seed, args.schedules, args.steps)
    print(report(summary))
    print(f"in {time.monotonic() - began:.1f} s")
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
