#!/usr/bin/env python
"""Chaos soak: real workers, real processes, random kills; every settlement checked.

    python bench/soak.py [--calls N] [--workers W] [--seed S]
                         [--profile default|untrusted|nocgroup] [--reaper-kills K]
                         [--backend asyncio|trio] [--warm-spares N] [--prefetch N]
                         [--start-method fork|spawn] [--progress] [--json]

A pool of real workers serves N calls of a mix of tools (``bench/soak_tools.py``: quick,
slow, cooperative, ignoring their signal, forking children and daemons, crashing, raising)
while a chaos task SIGKILLs random workers, random descendants of workers and, a few times a
run, the pool's reaper; calls are cancelled (with and without ``force``) and given short
timeouts at random. Everything random comes from ``--seed`` (printed).

What is checked, independently of the pool (psutil and the kernel's cgroup files):

- ``lost``: calls whose ``await`` did not return (the run stops waiting once no call has
  settled for ``--stall-timeout`` seconds);
- ``twice``: results seen twice for one call id, a call whose result changed after it was
  delivered, or the pool counting more settlements than were delivered;
- ``early``: a call that settled ``killed`` or ``worker_lost`` while a process of its
  worker's tree was alive (not a zombie): a process carrying the tag of that call or of an
  earlier call of the same worker, the worker itself, a member of its cgroups (that covers
  a copy of it forked but not yet exec'd; for a spawned worker also found by its
  ``--endpoint``). Checked at the moment ``await`` returns, before anything else runs;
- ``unverified``: results with ``tree_verified`` False (allowed only where no cgroup exists);
  the calls among them whose tree was still alive at settlement count as ``early unverified``
  instead of ``early``, and what they leave after close as ``left unverified`` instead of
  ``left`` (all three allowed only where no cgroup exists: the pool says it could not verify);
- ``left``: processes alive after the pool closed: tagged (argv or environment), workers of
  this run, the reapers or their children, or new children of this process. Killed, then
  reported. Only what is provably this run's is ever signalled: a reaper is a child of this
  process that ``pool.reaper_pid`` named (never a pid read from a command line), a worker
  names a live one of those as its parent or lives in this run's pool directory; pid 1 and
  this process's ancestors are never touched. The chaos, likewise, signals only the live
  reaper and the workers that are its children, and their descendants. One process may
  outlive ``aclose()``: the cleaner its :class:`toolpool.CloseReport` names as still removing
  the pool's files (docs/pool.md, "Settlement"), if it is a child of this process. It is
  given ``--cleanup-timeout`` seconds (60) to finish, then counts as ``left`` too;
- ``dirs left``: the pool's private directory and cgroups still there after close (and after
  the cleaner below, if any, finished or was killed);
- ``miscounted``: ``pool.statistics()`` disagrees with the results delivered;
- ``timeline``: a ``killed`` or ``worker_lost`` result of a worker whose timeline has no
  ``reaped`` step, or one after ``settled``.

Every one of those numbers must be 0 (exit status 1 otherwise); the outcome counts are what
they are. ``make soak`` runs it (``SOAK_ARGS=...`` to pass arguments).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import os
import random
import secrets
import sys
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import psutil

import toolpool

__all__ = ("Config", "Report", "main", "run_soak")

BENCH = Path(__file__).resolve().parent
TOOLS = "soak_tools:registry"
#: The environment variable carrying a tagged process's tag (``soak_tools.TAG_ENV``).
TAG_ENV = "TOOLPOOL_SOAK_TAG"
DEAD = frozenset({psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD})
DEATHS = frozenset({toolpool.Outcome.KILLED, toolpool.Outcome.WORKER_LOST})
#: The must-be-zero numbers, in the order they are printed.
CHECKS = (
    "lost",
    "twice",
    "early",
    "early_unverified",
    "unverified",
    "left",
    "left_unverified",
    "dirs_left",
    "miscounted",
    "timeline",
)
#: Those allowed where no cgroup exists (the pool then says it could not verify a tree).
UNVERIFIED = ("early_unverified", "unverified", "left_unverified")

#: The tool mix: (kind, weight).
MIX: tuple[tuple[str, float], ...] = (
    ("quick", 30),
    ("slow", 12),
    ("nap", 12),
    ("stubborn", 6),
    ("deaf", 3),
    ("fork_child", 10),
    ("daemon", 10),
    ("crash", 5),
    ("fail", 8),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """One soak run."""

    calls: int = 10_000
    workers: int = 4
    seed: int = 0
    profile: str = "default"
    """``default``, ``untrusted``, or ``nocgroup`` (``default`` without cgroups)."""
    reaper_kills: int | None = None
    """SIGKILLs of the reaper; None: ``max(2, round(calls / 2500))``."""
    cancel_grace: float = 0.25
    term_grace: float = 0.25
    outstanding: int | None = None
    """Calls submitted and not settled at most; None: 3 per worker."""
    chaos_gap: float = 0.25
    """Mean seconds between two chaos kills (exponentially distributed)."""
    timeout_rate: float = 0.10
    cancel_rate: float = 0.15
    force_rate: float = 0.4
    stall_timeout: float = 60.0
    """Stop waiting once no call settled for this long (the unsettled ones are lost)."""
    close_timeout: float = 120.0
    """If closing the pool takes longer, kill its processes (and report it)."""
    cleanup_timeout: float = 60.0
    """How long the process ``aclose()``'s :class:`toolpool.CloseReport` names as still
    removing the pool's files may take to finish; still there after that, it counts as left
    (and is killed), and what it did not remove as dirs left."""
    backend: str = "asyncio"
    warm_spares: int = 0
    prefetch: int | None = None
    start_method: Literal["fork", "spawn"] = "fork"
    verbose: bool = False
    progress: bool = False
    """Print a line to stderr every tenth of the run."""


@dataclass(slots=True, kw_only=True)
class Report:
    """What a soak run saw."""

    seed: int
    calls: int
    workers: int
    profile: str
    token: str
    backend: str
    options: str = ""
    """Pool options other than the defaults, as printed."""
    containment: list[str] = field(default_factory=list)
    submitted: int = 0
    settled: int = 0
    lost: int = 0
    twice: int = 0
    early: int = 0
    early_unverified: int = 0
    unverified: int = 0
    unverified_allowed: bool = False
    left: int = 0
    left_unverified: int = 0
    dirs_left: int = 0
    miscounted: int = 0
    timeline: int = 0
    """Death results whose timeline has no ``reaped`` step, or one after ``settled``."""
    close_hung: bool = False
    broken: str | None = None
    """Why the pool stopped taking calls, if it did (the soak then could not finish)."""
    zombies_after_close: int = 0
    pool_dir_entries: int | None = None
    """Entries in the pool's directory just before its close (a worker's socket directory
    and scratch directory each; those of gone workers are removed with their trees)."""
    close_report: str = ""
    """What ``aclose()`` returned, as printed."""
    cleaner_wait: float | None = None
    """Seconds the soak waited after ``aclose()`` for the cleaner it named to finish."""
    outcomes: dict[str, int] = field(default_factory=dict)
    rungs: dict[str, int] = field(default_factory=dict)
    by_tool: dict[str, dict[str, int]] = field(default_factory=dict)
    chaos: dict[str, int] = field(default_factory=dict)
    leftovers_killed: int = 0
    death_checks: int = 0
    death_checks_blind: int = 0
    """Death settlements of a worker the soak never saw alive: its copies and cgroups could
    not be looked for (its tags and its pid were)."""
    workers_started: int = 0
    workers_replaced: int = 0
    elapsed: float = 0.0
    calls_per_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    def numbers(self) -> dict[str, int]:
        """The numbers that must be 0 (those of :data:`UNVERIFIED` only where a cgroup
        exists)."""
        out = {name: int(getattr(self, name)) for name in CHECKS}
        if self.unverified_allowed:
            out.update(dict.fromkeys(UNVERIFIED, 0))
        out["close_hung"] = int(self.close_hung)
        out["broken"] = int(self.broken is not None)
        return out

    @property
    def failed(self) -> bool:
        return any(self.numbers().values())

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["failed"] = self.failed
        return doc

    def format(self) -> str:
        c = self.chaos
        lines = [
            f"toolpool chaos soak: seed {self.seed}, {self.calls} calls, {self.workers} "
            f"workers, profile {self.profile}, {self.backend}{self.options} "
            f"(run token {self.token})",
            f"containment: {', '.join(self.containment) or '-'}",
            f"chaos: {c.get('worker_kills', 0)} workers, {c.get('descendant_kills', 0)} "
            f"descendants, {c.get('reaper_kills', 0)} reapers SIGKILLed; "
            f"{c.get('cancels', 0)} cancels ({c.get('forced', 0)} forced), "
            f"{c.get('timeouts', 0)} short timeouts",
            "",
        ]
        allowed = " (allowed: no cgroup)" if self.unverified_allowed else ""
        rows: list[tuple[str, object]] = [
            ("submitted", self.submitted),
            ("settled", self.settled),
            ("lost", self.lost),
            ("twice", self.twice),
            ("early", self.early),
            ("unverified", f"{self.unverified}{allowed}"),
            ("left", self.left),
            ("dirs left", self.dirs_left),
            ("miscounted", self.miscounted),
            ("timeline", self.timeline),
        ]
        if self.early_unverified or self.left_unverified:
            rows[5:5] = [("early unverified", f"{self.early_unverified}{allowed}")]
            rows[8:8] = [("left unverified", f"{self.left_unverified}{allowed}")]
        if self.close_hung:
            rows.append(("close hung", "yes"))
        if self.broken:
            rows.append(("pool broke", self.broken))
        lines += [f"  {name:<17}{value!s:>8}" for name, value in rows]
        lines.append("")
        lines.append("outcomes: " + _counts(self.outcomes))
        lines.append("rungs:    " + _counts(self.rungs))
        lines.append("by tool:")
        for tool in sorted(self.by_tool):
            lines.append(f"  {tool:<11}{_counts(self.by_tool[tool])}")
        lines.append(
            f"death settlements checked: {self.death_checks} ({self.death_checks_blind} of a "
            f"worker never seen alive); leftovers killed by the pool: "
            f"{self.leftovers_killed}; workers started {self.workers_started}, replaced "
            f"{self.workers_replaced}"
        )
        if self.zombies_after_close:
            lines.append(f"zombies after close: {self.zombies_after_close}")
        entries = "-" if self.pool_dir_entries is None else self.pool_dir_entries
        lines.append(f"pool directory before close: {entries} entries; close: {self.close_report}")
        if self.cleaner_wait is not None:
            lines.append(f"the cleaner aclose() named finished after {self.cleaner_wait:.1f} s")
        lines.append(f"elapsed {self.elapsed:.1f} s, {self.calls_per_s:.1f} calls/s")
        if self.problems:
            lines.append(f"problems ({len(self.problems)}):")
            lines += [f"  - {p}" for p in self.problems]
        bad = [name for name, n in self.numbers().items() if n]
        lines.append(f"FAIL: {', '.join(bad)} (seed {self.seed})" if bad else "PASS")
        return "\n".join(lines)


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class Plan:
    """What happens to one call."""

    tool: str
    args: dict[str, Any]
    timeout: float | None
    cancel_after: float | None
    force: bool
    after_start: bool
    """Count ``cancel_after`` from the moment the body started (else from submission)."""


def make_plans(config: Config, token: str) -> list[Plan]:
    """Every call's tool, arguments and interventions, from the seed."""
    rng = random.Random(config.seed)
    kinds = [k for k, _ in MIX]
    weights = [w for _, w in MIX]
    plans = []
    for i in range(config.calls):
        tool = rng.choices(kinds, weights)[0]
        tag = tag_of(token, i)
        args: dict[str, Any] = {}
        if tool in ("slow", "nap"):
            args = {"seconds": round(rng.uniform(0.005, 0.2), 4)}
        elif tool in ("stubborn", "deaf"):
            args = {
                "seconds": round(rng.uniform(0.05, 0.5), 4),
                "tag": tag if rng.random() < 0.5 else "",
            }
        elif tool == "fork_child":
            args = {"tag": tag}
        elif tool == "daemon":
            args = {"tag": tag, "hold": round(rng.uniform(0.0, 0.15), 4)}
        timeout = round(rng.uniform(0.005, 0.3), 4) if rng.random() < config.timeout_rate else None
        cancel_after = None
        force = after_start = False
        if rng.random() < config.cancel_rate:
            force = rng.random() < config.force_rate
            after_start = rng.random() < 0.5
            # From the start: mostly while the body runs. From submission: anywhere.
            cancel_after = round(rng.uniform(0.0, 0.05 if after_start else 0.2), 4)
        plans.append(Plan(tool, args, timeout, cancel_after, force, after_start))
    return plans


def tag_of(token: str, i: int) -> str:
    return f"tpsoak-{token}-{i}"


# --------------------------------------------------------------------------- process views


def _arg_after(cmdline: list[str], flag: str) -> str | None:
    for i, part in enumerate(cmdline[:-1]):
        if part == flag:
            return cmdline[i + 1]
    return None


def _is_worker(cmdline: list[str]) -> bool:
    """A spawned worker's command line is ``python -m toolpool.worker --endpoint ...``; a
    forked one rewrites its own to ``["python -m toolpool.worker   ", "--parent-pid", R]``."""
    return "toolpool.worker" in cmdline or bool(cmdline and "-m toolpool.worker" in cmdline[0])


def _cgroup_mounts() -> dict[str, str]:
    """Cgroup hierarchy (``""`` for v2, else each v1 controller) -> its mount point."""
    mounts: dict[str, str] = {}
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 4:
                continue
            if parts[2] == "cgroup2":
                mounts.setdefault("", parts[1])
            elif parts[2] == "cgroup":
                for opt in parts[3].split(","):
                    if opt not in ("rw", "ro", "relatime", "noexec", "nosuid", "nodev"):
                        mounts.setdefault(opt, parts[1])
    return mounts


@dataclass(slots=True)
class WorkerInfo:
    """A worker as seen alive by the soak: enough to recognise its tree once it is dead."""

    pid: int
    create_time: float
    endpoint: str | None
    cgroups: list[str]


class Observer:
    """What the soak knows about the pool's processes, from psutil and /proc only."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.mounts = _cgroup_mounts()
        self.workers: dict[int, WorkerInfo] = {}
        #: The pool's reapers, by pid: their creation times. Only ever a child of this
        #: process that ``pool.reaper_pid`` named (never a pid read from a command line: a
        #: worker forked just as its reaper died names its new parent there, pid 1).
        self.reapers: dict[int, float] = {}
        self.pool_dirs: set[str] = set()
        self.cgroup_dirs: set[str] = set()
        #: pid -> numbers of the calls that settled on that worker (its latest incarnation)
        self.calls_on: dict[int, list[int]] = collections.defaultdict(list)

    def observe(self, pool: toolpool.Pool) -> None:
        reaper = pool.reaper_pid
        if reaper is not None:
            self.add_reaper(reaper)
        for pid in pool.worker_pids:
            self.observe_worker(pid)

    def add_reaper(self, pid: int) -> bool:
        """Record ``pid`` as a reaper of this run if it is a live child of this process."""
        if pid in self.reapers:
            return True
        try:
            proc = psutil.Process(pid)
            if proc.ppid() != os.getpid():
                return False
            self.reapers[pid] = proc.create_time()
        except psutil.Error:
            return False
        return True

    def is_reaper(self, pid: int) -> bool:
        """Whether ``pid`` is a live reaper of this run (the same process we recorded)."""
        created = self.reapers.get(pid)
        if created is None:
            return False
        try:
            proc = psutil.Process(pid)
            return proc.ppid() == os.getpid() and _same_process(proc, created)
        except psutil.Error:
            return False

    def live_reapers(self) -> set[int]:
        """The reapers of this run still alive (the same processes: still our children)."""
        return {pid for pid in self.reapers if self.is_reaper(pid)}

    def is_pool_worker(self, proc: psutil.Process, cmdline: list[str], reapers: set[int]) -> bool:
        """Whether ``proc`` is a worker (or an un-exec'd copy of one) of this run's pool:
        its ``--parent-pid`` is one of ``reapers`` (live ones only: a dead one's pid may
        name another pool's reaper by now), or it lives in this run's pool directory."""
        if not _is_worker(cmdline):
            return False
        if _arg_after(cmdline, "--parent-pid") in {str(r) for r in reapers}:
            return True
        endpoint = _arg_after(cmdline, "--endpoint") or ""
        if endpoint.startswith("ipc://") and _pool_dir(endpoint) in self.pool_dirs:
            return True  # spawned: its --endpoint is in the pool's directory
        try:
            cwd = proc.cwd()  # forked or spawned: its scratch directory
        except psutil.Error:
            return False
        return any(d and os.path.dirname(cwd) == d for d in self.pool_dirs)

    def observe_worker(self, pid: int) -> None:
        known = self.workers.get(pid)
        try:
            proc = psutil.Process(pid)
            created = proc.create_time()
            same = known is not None and abs(known.create_time - created) < 0.5
            if same and known is not None and known.cgroups:
                return  # (without cgroups yet: a worker joins its own early in its set-up)
            cmdline = proc.cmdline()
            if not _is_worker(cmdline) or not self.is_reaper(proc.ppid()):
                return  # not (or no longer) a worker of this run's pool
            with open(f"/proc/{pid}/cgroup") as f:
                lines = f.read().splitlines()
        except (psutil.Error, OSError):
            return
        groups = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "toolpool-" not in path:
                continue
            for controller in controllers.split(",") if controllers else [""]:
                mount = self.mounts.get(controller)
                if mount is not None:
                    groups.append(mount + path)
        endpoint = _arg_after(cmdline, "--endpoint")  # spawned workers only
        if endpoint is not None and endpoint.startswith("ipc://"):
            self.pool_dirs.add(_pool_dir(endpoint))
        try:
            cwd = proc.cwd()  # <pool dir>/scratch-w<N>, where the profile gives one
        except psutil.Error:
            cwd = ""
        if os.path.basename(cwd).startswith("scratch-w"):
            self.pool_dirs.add(os.path.dirname(cwd))
        for g in groups:
            self.cgroup_dirs.add(g)
            self.cgroup_dirs.add(os.path.dirname(g))
        if known is not None and not same:  # the pid names a new worker now
            self.calls_on.pop(pid, None)
        self.workers[pid] = WorkerInfo(pid, created, endpoint, sorted(set(groups)))

    def tree_alive(self, i: int, result: toolpool.Result) -> list[str]:
        """What of the tree of the worker that ran call ``i`` (dead, says ``result``) is
        still alive (not a zombie), by a scan of the machine and of its cgroups."""
        wpid = result.worker_pid
        info = self.workers.get(wpid) if wpid is not None else None
        tags = {tag_of(self.token, i)}
        if wpid is not None:
            tags.update(tag_of(self.token, j) for j in self.calls_on.get(wpid, ()))
        suspects: dict[int, str] = {}
        for proc in psutil.process_iter(["cmdline"]):
            cmdline: list[str] = proc.info.get("cmdline") or []
            why = None
            if cmdline and (cmdline[0] in tags or any(part in tags for part in cmdline)):
                why = f"tagged {cmdline[0]}"
            elif proc.pid == wpid and _is_worker(cmdline):
                if info is None or _same_process(proc, info.create_time):
                    why = "the worker itself"
            elif (
                info is not None
                and info.endpoint is not None
                and _is_worker(cmdline)
                and _arg_after(cmdline, "--endpoint") == info.endpoint
            ):
                why = "a forked copy of the worker"
            if why is not None:
                suspects[proc.pid] = why
        if info is not None:
            for group in info.cgroups:
                for pid in _members(group):
                    suspects.setdefault(pid, f"in its cgroup {group}")
        alive = []
        for pid, why in suspects.items():
            try:
                proc = psutil.Process(pid)
                status = proc.status()
                cmdline = proc.cmdline()
            except psutil.Error:
                continue
            if status not in DEAD:
                alive.append(f"pid {pid} ({why}; {status}; {' '.join(cmdline)[:120]})")
        return alive

    def leftovers(
        self, before: set[int], exempt: Collection[int] = ()
    ) -> tuple[list[tuple[psutil.Process, str, int | None]], int]:
        """Processes of this run alive after close: (process, description, the number of
        the call whose tag it carries, if any); and how many zombies. ``exempt``: the
        cleaner ``aclose()`` named (see :meth:`cleaner`), checked on its own."""
        found: dict[int, tuple[psutil.Process, str]] = {}
        me = os.getpid()
        reapers = self.live_reapers()
        never = _never_kill() | set(exempt)
        for proc in psutil.process_iter(["cmdline", "ppid"]):
            if proc.pid in never:
                continue
            cmdline: list[str] = proc.info.get("cmdline") or []
            ppid = proc.info.get("ppid")
            why = None
            if any(f"tpsoak-{self.token}-" in part for part in cmdline):
                why = "tagged (argv)"
            elif self.is_pool_worker(proc, cmdline, reapers):
                why = "a worker of this run"
            elif proc.pid in reapers:
                why = "a reaper of this run"
            elif ppid in reapers:
                why = "a child of a reaper of this run"
            elif ppid == me and proc.pid not in before:
                why = "a new child of the soak"
            else:
                try:
                    if self.token in proc.environ().get(TAG_ENV, ""):
                        why = "tagged (environment)"
                except psutil.Error:
                    pass
            if why is not None:
                found[proc.pid] = (proc, why)
        live: list[tuple[psutil.Process, str, int | None]] = []
        zombies = 0
        prefix = f"tpsoak-{self.token}-"
        for pid, (proc, why) in found.items():
            try:
                status = proc.status()
                cmdline = proc.cmdline()
            except psutil.Error:
                continue
            if status in DEAD:
                zombies += 1
                continue
            seq = None
            for part in cmdline:
                if part.startswith(prefix) and part[len(prefix) :].isdigit():
                    seq = int(part[len(prefix) :])
            live.append((proc, f"pid {pid} ({why}; {' '.join(cmdline)[:120]})", seq))
        return live, zombies

    def cleaner(self, pid: int | None, before: set[int]) -> psutil.Process | None:
        """The process a :class:`toolpool.CloseReport` names as still removing the pool's
        files, if it provably is this run's: a live child of this process, new since the
        run began (the pool's reaper staying on, or the remover the pool started)."""
        if pid is None or pid in before:
            return None
        try:
            proc = psutil.Process(pid)
            if proc.ppid() != os.getpid() or proc.status() in DEAD:
                return None
        except psutil.Error:
            return None
        return proc

    def pool_dir_entries(self) -> int | None:
        """Entries in the pool's directory now (None: the soak never saw it)."""
        total = None
        for d in self.pool_dirs:
            try:
                total = (total or 0) + len(os.listdir(d))
            except OSError:
                pass
        return total

    def dirs_left(self) -> list[str]:
        return sorted(d for d in self.pool_dirs | self.cgroup_dirs if os.path.isdir(d))


def _same_process(proc: psutil.Process, create_time: float) -> bool:
    try:
        return abs(proc.create_time() - create_time) < 0.5
    except psutil.Error:
        return False


def _created(proc: psutil.Process) -> float | None:
    try:
        return proc.create_time()
    except psutil.Error:
        return None


def _pool_dir(endpoint: str) -> str:
    """``ipc://<pool dir>/w<N>/sock`` -> ``<pool dir>``."""
    return os.path.dirname(os.path.dirname(endpoint[len("ipc://") :]))


def _never_kill() -> set[int]:
    """Pid 1, this process and its ancestors: never a leftover, whatever they look like."""
    out = {0, 1, os.getpid()}
    try:
        out.update(p.pid for p in psutil.Process().parents())
    except psutil.Error:
        pass
    return out


def _members(group: str) -> list[int]:
    try:
        with open(os.path.join(group, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _contents(directory: str) -> str:
    """`` (N entries: a, b, ...)`` for a directory left after close."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return ""
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return f" ({len(names)} entries: {shown})" if names else " (empty)"


async def _wait_exit(proc: psutil.Process, timeout: float) -> bool:
    """Wait until ``proc`` (a child of this process, reaped by whoever started it: the
    pool) has exited, for at most ``timeout`` seconds; True if it has. Never reaps it."""
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return True
    try:
        if not proc.is_running():  # it exited before the pidfd was opened (pid reused?)
            return True
        with anyio.move_on_after(timeout):
            await anyio.wait_readable(fd)  # a pidfd turns readable when its process exits
            return True
        return False
    finally:
        os.close(fd)


def _kill(procs: Iterable[psutil.Process]) -> None:
    never = _never_kill()
    procs = [p for p in procs if p.pid not in never]
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


# --------------------------------------------------------------------------- the run


class Soak:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.token = secrets.token_hex(5)
        self.plans = make_plans(config, self.token)
        self.chaos_rng = random.Random(f"{config.seed}-chaos")
        self.report = Report(
            seed=config.seed,
            calls=config.calls,
            workers=config.workers,
            profile=config.profile,
            token=self.token,
            backend=config.backend,
            options="".join(
                f", {name} {value}"
                for name, value, default in (
                    ("warm_spares", config.warm_spares, 0),
                    ("prefetch", config.prefetch, None),
                    ("start_method", config.start_method, "fork"),
                )
                if value != default
            ),
        )
        self.observer = Observer(self.token)
        self.calls: dict[int, toolpool.Call] = {}
        self.results: dict[int, toolpool.Result] = {}
        self.seen_ids: collections.Counter[int] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.rungs: collections.Counter[str] = collections.Counter()
        self.by_tool: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.chaos: collections.Counter[str] = collections.Counter()
        #: Why a reaper kill that was due did not happen, each time (printed if one never did).
        self.refused: collections.Counter[str] = collections.Counter()
        #: Workers that returned a result, as (pid, creation time): the chaos's victims.
        self.served: set[tuple[int, float]] = set()
        self.progress = anyio.Event()
        self.all_settled = anyio.Event()
        self.stop_chaos = anyio.Event()
        self.reaper_kill_at: list[int] = []
        self.killed_reapers: set[int] = set()
        self.unverified_workers: set[int] = set()
        #: Workers alive when a reaper was killed: the pool ends their trees without it
        #: (verified only through a cgroup; an idle one has no result to say so).
        self.orphaned_workers: set[int] = set()

    def problem(self, text: str) -> None:
        if len(self.report.problems) < 60:
            self.report.problems.append(text)

    # ------------------------------------------------------------------ calls

    async def run_one(self, pool: toolpool.Pool, i: int, call: toolpool.Call) -> None:
        plan = self.plans[i]
        async with anyio.create_task_group() as tg:
            if plan.cancel_after is not None:
                tg.start_soon(self.cancel_later, call, plan)
            result = await call
            self.settled(pool, i, call, result)  # before anything else runs
            tg.cancel_scope.cancel()

    async def cancel_later(self, call: toolpool.Call, plan: Plan) -> None:
        assert plan.cancel_after is not None
        if plan.after_start and not await call.wait_started():
            return  # it settled without its body starting
        await anyio.sleep(plan.cancel_after)  # the chaos: a random moment
        if not call.done():
            self.chaos["cancels"] += 1
            self.chaos["forced"] += plan.force
        call.cancel(force=plan.force)

    def settled(
        self, pool: toolpool.Pool, i: int, call: toolpool.Call, result: toolpool.Result
    ) -> None:
        r = self.report
        obs = self.observer
        if result.outcome in DEATHS:
            r.death_checks += 1
            if result.worker_pid not in obs.workers:
                r.death_checks_blind += 1  # only the tags and the pid could be looked for
            alive = obs.tree_alive(i, result)
            if alive:
                if result.tree_verified is False:
                    r.early_unverified += 1  # the pool says it could not verify
                else:
                    r.early += 1
                self.problem(
                    f"call {i} ({result.tool}, id {result.call_id}) settled {result.outcome} "
                    f"(tree_verified {result.tree_verified}) "
                    f"rung {result.rung} (worker {result.worker_pid}) while alive: "
                    + "; ".join(alive)
                )
            if result.worker_pid is None:
                self.problem(f"call {i} settled {result.outcome} without a worker pid")
            else:  # docs/pool.md: "settled never comes before [reaped] on killed, worker_lost"
                t = result.timeline
                if t.reaped is None or t.settled is None or t.reaped > t.settled:
                    r.timeline += 1
                    self.problem(
                        f"call {i} settled {result.outcome}: reaped {t.reaped}, settled {t.settled}"
                    )
        r.settled += 1
        if i in self.results:
            r.twice += 1
            self.problem(f"call {i}: a second result {result.outcome}")
        self.results[i] = result
        self.seen_ids[result.call_id] += 1
        if self.seen_ids[result.call_id] > 1:
            r.twice += 1
            self.problem(f"call id {result.call_id}: delivered {self.seen_ids[result.call_id]}x")
        if result.tree_verified is False:
            r.unverified += 1
            if result.worker_pid is not None:
                self.unverified_workers.add(result.worker_pid)
            self.problem(f"call {i} ({result.tool}) settled {result.outcome}: tree not verified")
        self.outcomes[result.outcome.value] += 1
        self.rungs[result.rung.value] += 1
        self.by_tool[result.tool][result.outcome.value] += 1
        r.leftovers_killed += result.leftovers_killed
        obs.observe(pool)
        if result.worker_pid is not None:
            if result.outcome not in DEATHS:
                obs.observe_worker(result.worker_pid)
                self.serving(result.worker_pid)
            obs.calls_on[result.worker_pid].append(i)
        self.progress.set()
        if self.config.progress and r.settled % max(1, self.config.calls // 10) == 0:
            print(
                f"soak: {r.settled}/{self.config.calls} settled, {r.early} early, "
                f"{r.twice} twice, chaos {dict(self.chaos)}",
                file=sys.stderr,
                flush=True,
            )
        if r.settled >= self.config.calls or (r.broken and r.settled >= r.submitted):
            self.all_settled.set()

    def serving(self, pid: int) -> None:
        """Worker ``pid`` returned a result: if the soak knows this very process (a worker of
        this run, seen alive), the chaos may kill it."""
        info = self.observer.workers.get(pid)
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            return
        if info is not None and _same_process(proc, info.create_time):
            self.served.add((pid, proc.create_time()))

    async def submit_all(self, pool: toolpool.Pool) -> None:
        limit = anyio.Semaphore(self.config.outstanding or 3 * self.config.workers)
        async with anyio.create_task_group() as tg:
            for i, plan in enumerate(self.plans):
                await limit.acquire()
                try:
                    call = pool.submit(plan.tool, plan.args, timeout=plan.timeout)
                except toolpool.ToolpoolError as exc:  # the pool stopped serving
                    self.report.broken = f"{type(exc).__name__}: {exc}"
                    self.problem(f"submit of call {i} raised {self.report.broken}")
                    limit.release()
                    if self.report.settled >= self.report.submitted:
                        self.all_settled.set()
                    return
                self.calls[i] = call
                self.report.submitted += 1
                self.chaos["timeouts"] += plan.timeout is not None
                tg.start_soon(self._run_and_release, pool, i, call, limit)

    async def _run_and_release(
        self, pool: toolpool.Pool, i: int, call: toolpool.Call, limit: anyio.Semaphore
    ) -> None:
        try:
            await self.run_one(pool, i, call)
        finally:
            limit.release()

    # ------------------------------------------------------------------ chaos

    async def chaos_loop(self, pool: toolpool.Pool) -> None:
        rng = self.chaos_rng
        while not self.stop_chaos.is_set():
            with anyio.move_on_after(rng.expovariate(1 / self.config.chaos_gap)):
                await self.stop_chaos.wait()  # (a random moment: the chaos)
            if self.stop_chaos.is_set():
                return
            self.observer.observe(pool)
            due = bool(self.reaper_kill_at) and self.report.submitted >= self.reaper_kill_at[0]
            if due and self.kill_reaper(pool):
                self.reaper_kill_at.pop(0)
                continue
            # (A reaper kill due but refused, the pool restarting its reaper, say: the other
            # kills go on meanwhile; they used to wait for it.)
            if rng.random() < 0.4:
                self.kill_worker(pool, rng)
            else:
                self.kill_descendant(pool, rng)

    def kill_reaper(self, pool: toolpool.Pool) -> bool:
        """SIGKILL the pool's reaper; False (and why, in ``refused``) if it is not one the
        soak may signal now."""
        pid = pool.reaper_pid
        why = None
        if pid is None:
            why = "no reaper (restarting)"
        elif pid in self.killed_reapers:
            why = "the killed one (not noticed yet)"
        elif not self.observer.add_reaper(pid):
            why = "not a child of this process"  # never signal it
        else:
            try:
                proc = psutil.Process(pid)
                if not _same_process(proc, self.observer.reapers[pid]):
                    why = "a reused pid"
                else:
                    proc.kill()
            except psutil.Error as exc:
                why = type(exc).__name__
        if why is not None:
            self.refused[why] += 1
            return False
        assert pid is not None
        self.killed_reapers.add(pid)
        self.orphaned_workers.update(pool.worker_pids)
        self.chaos["reaper_kills"] += 1
        return True

    def pool_workers(self, pool: toolpool.Pool) -> list[psutil.Process]:
        """The pool's live workers, each checked to be a child of its live reaper (itself a
        child of this process): the chaos never signals anything else."""
        reaper = pool.reaper_pid
        if reaper is None or reaper in self.killed_reapers:
            return []
        if not self.observer.add_reaper(reaper):
            return []
        out = []
        for pid in sorted(pool.worker_pids):
            try:
                proc = psutil.Process(pid)
                if proc.ppid() == reaper:
                    out.append(proc)
            except psutil.Error:
                pass
        return out

    def kill_worker(self, pool: toolpool.Pool, rng: random.Random) -> None:
        # Only workers that have served a call: killing starting ones counts as their start
        # failing, and max_start_failures of those in a row stop the pool on purpose
        # (docs/pool.md, "Start failures"). The very process that served, not its pid: pids
        # are reused (pid_max is often 32768), a new worker may be starting under an old pid.
        procs = [p for p in self.pool_workers(pool) if (p.pid, _created(p)) in self.served]
        if not procs:
            return
        victim = rng.choice(procs)
        try:
            victim.kill()  # psutil checks the pid still names the process it found
            self.chaos["worker_kills"] += 1
        except psutil.Error:
            pass

    def kill_descendant(self, pool: toolpool.Pool, rng: random.Random) -> None:
        found: list[psutil.Process] = []
        for worker in self.pool_workers(pool):
            try:
                found += worker.children(recursive=True)
            except psutil.Error:
                continue
        if not found:
            return
        victim = rng.choice(sorted(found, key=lambda p: p.pid))
        try:
            victim.kill()  # psutil checks the pid still names the process it found
            self.chaos["descendant_kills"] += 1
        except psutil.Error:
            pass

    # ------------------------------------------------------------------ the whole run

    async def run(self) -> Report:
        config = self.config
        r = self.report
        rng = random.Random(f"{config.seed}-reaper")
        kills = config.reaper_kills
        if kills is None:
            kills = max(2, round(config.calls / 2500))
        lo, hi = config.calls // 10, max(config.calls // 10 + 1, config.calls * 9 // 10)
        self.reaper_kill_at = sorted(rng.randrange(lo, hi) for _ in range(kills))
        before = {p.pid for p in psutil.Process().children()}
        started = time.monotonic()
        watchdog: threading.Timer | None = None
        profile: str | toolpool.Profile = config.profile
        if config.profile == "nocgroup":  # the fallback where no cgroup holds a tree
            profile = toolpool.Profile(name="nocgroup", disable=frozenset({"cgroups"}))
        pool = toolpool.Pool(
            TOOLS,
            workers=config.workers,
            cancel_grace=config.cancel_grace,
            term_grace=config.term_grace,
            profile=profile,
            warm_spares=config.warm_spares,
            prefetch=config.prefetch,
            start_method=config.start_method,
        )
        close_report: toolpool.CloseReport | None = None
        try:
            await pool.start()
            try:
                report = pool.containment()
                r.containment = [layer.name for layer in report.layers if layer.active]
                r.unverified_allowed = not any(
                    report.active(name) for name in ("cgroup_kill", "cgroup_memory", "cgroup_pids")
                )
                self.observer.observe(pool)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self.chaos_loop, pool)
                    async with anyio.create_task_group() as calls:
                        calls.start_soon(self.submit_all, pool)
                        while not self.all_settled.is_set():
                            with anyio.move_on_after(config.stall_timeout) as stall:
                                await self.progress.wait()
                            if stall.cancelled_caught:
                                break
                            self.progress = anyio.Event()
                        r.lost = r.submitted - r.settled
                        if r.lost:
                            self.problem(f"{r.lost} calls unsettled {config.stall_timeout}s")
                            self.describe_lost()
                        calls.cancel_scope.cancel()
                    self.stop_chaos.set()
                stats = pool.statistics()
                self.check_statistics(stats, closed=False)
                r.pool_dir_entries = self.observer.pool_dir_entries()
            finally:
                # (In the task that started the pool, as `async with` would.)
                watchdog = threading.Timer(config.close_timeout, self.close_hung)
                watchdog.daemon = True
                watchdog.start()
                close_report = await pool.aclose()
                watchdog.cancel()
            self.check_statistics(pool.statistics(), closed=True)
        finally:
            if watchdog is not None:
                watchdog.cancel()
            r.elapsed = time.monotonic() - started
            await self.check_after_close(before, close_report)
        stats = pool.statistics()
        r.workers_started = stats.workers_started
        r.workers_replaced = stats.workers_replaced
        for i, result in self.results.items():
            if self.calls[i].result() is not result:
                r.twice += 1
                self.problem(f"call {i}: its result changed after it was delivered")
        r.outcomes = dict(self.outcomes)
        r.rungs = dict(self.rungs)
        r.by_tool = {tool: dict(c) for tool, c in self.by_tool.items()}
        r.chaos = dict(self.chaos)
        if self.reaper_kill_at:  # planned, never done: the run is weaker than it says
            self.problem(
                f"{len(self.reaper_kill_at)} reaper kills planned were not done; the chaos's "
                f"tries were refused: {dict(self.refused)}"
            )
        r.calls_per_s = r.settled / r.elapsed if r.elapsed else math.nan
        return r

    async def check_after_close(
        self, before: set[int], close_report: toolpool.CloseReport | None
    ) -> None:
        """What the pool left once ``aclose()`` returned: every process but the cleaner that
        its report names (the pool's reaper staying on to remove files, or a helper) counts
        at once; that cleaner gets :attr:`Config.cleanup_timeout` to finish, then counts too
        if it is still there; then the directories, whatever the report said."""
        r = self.report
        cleaner = None
        if close_report is not None:
            r.close_report = close_report.format().replace("\n", "; ")
            if not close_report.finished:
                cleaner = self.observer.cleaner(close_report.cleaner_pid, before)
                if close_report.cleaner_pid is not None and cleaner is None:
                    self.problem(
                        f"aclose() named cleaner {close_report.cleaner_pid}, not a child of "
                        "this run: counted as any other process"
                    )
            for failed in close_report.failed:
                self.problem(f"aclose() reported not removed: {failed}")
        else:
            r.close_report = "none (the pool did not start, or its close raised)"
        exempt = {cleaner.pid} if cleaner is not None else set()
        live, zombies = self.observer.leftovers(before, exempt=exempt)
        r.zombies_after_close = zombies
        for _, text, seq in live:
            if self.unverified_tree(seq):
                r.left_unverified += 1
                self.problem(f"left after close (its tree was not verified): {text}")
            else:
                r.left += 1
                self.problem(f"left after close: {text}")
        _kill(proc for proc, _, _ in live)
        if cleaner is not None:
            began = time.monotonic()
            if await _wait_exit(cleaner, self.config.cleanup_timeout):
                r.cleaner_wait = time.monotonic() - began
            else:
                r.left += 1
                self.problem(
                    f"the cleaner aclose() named (pid {cleaner.pid}) was still on "
                    f"{self.config.cleanup_timeout}s later: killed"
                )
                _kill([cleaner])
        dirs = self.observer.dirs_left()
        r.dirs_left = len(dirs)
        for d in dirs:
            self.problem(f"left after close: directory {d}{_contents(d)}")

    def unverified_tree(self, seq: int | None) -> bool:
        """Whether call ``seq`` ran on a worker whose death the pool could not verify: it
        said so in a result, or (without a cgroup) the worker was orphaned by a reaper's
        death."""
        result = self.results.get(seq) if seq is not None else None
        if result is None:
            return False
        if result.tree_verified is False or result.worker_pid in self.unverified_workers:
            return True
        return self.report.unverified_allowed and result.worker_pid in self.orphaned_workers

    def check_statistics(self, stats: toolpool.Statistics, *, closed: bool) -> None:
        r = self.report
        total = sum(stats.settled.values())
        if stats.submitted != r.submitted:
            r.miscounted += 1
            self.problem(f"statistics: submitted {stats.submitted}, soak submitted {r.submitted}")
        if closed:
            if total != stats.submitted:
                r.miscounted += 1
                self.problem(f"after close: {total} settled of {stats.submitted} submitted")
            return
        if r.lost:
            return  # the pool's count cannot be compared
        if total > r.settled:
            r.twice += total - r.settled
            self.problem(f"statistics: {total} settled, {r.settled} delivered")
        elif total < r.settled:
            r.miscounted += 1
            self.problem(f"statistics: {total} settled, {r.settled} delivered")
        for outcome in set(stats.settled) | set(self.outcomes):
            if stats.settled.get(outcome, 0) != self.outcomes.get(outcome, 0):
                r.miscounted += 1
                self.problem(
                    f"statistics: {stats.settled.get(outcome, 0)} {outcome}, "
                    f"{self.outcomes.get(outcome, 0)} delivered"
                )

    def describe_lost(self) -> None:
        shown = 0
        for i, call in self.calls.items():
            if i not in self.results and shown < 10:
                shown += 1
                plan = self.plans[i]
                self.problem(
                    f"lost: call {i} {call!r} {plan.tool} {plan.args} timeout {plan.timeout} "
                    f"cancel {plan.cancel_after} force {plan.force} after start "
                    f"{plan.after_start} started {call.started}"
                )

    def close_hung(self) -> None:
        """The watchdog: closing the pool took too long; kill its processes (reported)."""
        self.report.close_hung = True
        self.problem(f"closing the pool took over {self.config.close_timeout}s: killing")
        procs = []
        for pid in self.observer.live_reapers():
            try:
                proc = psutil.Process(pid)
                procs += [proc, *proc.children(recursive=True)]
            except psutil.Error:
                pass
        _kill(procs)


@contextmanager
def _quiet_logs(verbose: bool) -> Iterator[None]:
    """The pool logs every worker death; a soak kills hundreds of them."""
    logger = logging.getLogger("toolpool")
    level = logger.level
    if not verbose:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _tools_importable() -> None:
    """The workers import ``soak_tools`` through this process's ``sys.path``."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))


def run_soak(config: Config) -> Report:
    """Run one soak (blocking: it runs its own event loop) and return what it saw."""
    _tools_importable()
    with _quiet_logs(config.verbose):
        return anyio.run(Soak(config).run, backend=config.backend)


def _parse(argv: list[str] | None) -> tuple[Config, bool]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    p.add_argument(
        "--profile",
        choices=("default", "untrusted", "nocgroup"),
        default="default",
        help="nocgroup: the default profile with cgroups disabled (the fallback)",
    )
    p.add_argument("--reaper-kills", type=int, default=None)
    p.add_argument("--cancel-grace", type=float, default=0.25)
    p.add_argument("--term-grace", type=float, default=0.25)
    p.add_argument("--chaos-gap", type=float, default=0.25)
    p.add_argument("--stall-timeout", type=float, default=60.0)
    p.add_argument("--cleanup-timeout", type=float, default=60.0)
    p.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    p.add_argument("--warm-spares", type=int, default=0)
    p.add_argument("--prefetch", type=int, default=None)
    p.add_argument("--start-method", choices=("fork", "spawn"), default="fork")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true", help="let the pool log")
    p.add_argument("--progress", action="store_true", help="a line on stderr every 10%%")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 32)
    config = Config(
        calls=a.calls,
        workers=a.workers,
        seed=seed,
        profile=a.profile,
        reaper_kills=a.reaper_kills,
        cancel_grace=a.cancel_grace,
        term_grace=a.term_grace,
        chaos_gap=a.chaos_gap,
        stall_timeout=a.stall_timeout,
        cleanup_timeout=a.cleanup_timeout,
        backend=a.backend,
        warm_spares=a.warm_spares,
        prefetch=a.prefetch,
        start_method=a.start_method,
        verbose=a.verbose,
        progress=a.progress or (not a.json and sys.stderr.isatty()),
    )
    return config, a.json


def main(argv: list[str] | None = None) -> int:
    config, as_json = _parse(argv)
    if not as_json:
        print(f"seed {config.seed}", flush=True)
    report = run_soak(config)
    if as_json:
        print(json.dumps(report.as_dict(), sort_keys=True))
    else:
        print(report.format())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
