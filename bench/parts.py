#!/usr/bin/env python3
"""One (peer, part) of the benchmark, in a fresh interpreter.

    python bench/parts.py PEER PART [--smoke] [--json] [--out FILE]

PEER is one of ``PEERS``; PART is 1-7 or its name (``PARTS``). The result is one JSON object
(printed with ``--json``, written with ``--out``). ``run.py`` runs every (peer, part) this way
and checks, after each, that nothing the part started is left running.

Every process this part starts inherits ``BENCH_RUN_TAG`` in its environment; that is how the
part (and ``run.py``) finds whatever a pool left behind, including daemons that escaped the
process tree, without touching anyone else's processes on this shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import importlib
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import psutil

import bodies

PARTS = {
    "1": "throughput",
    "2": "latency",
    "3": "stop",
    "4": "leaks",
    "5": "cold",
    "6": "scale",
    "7": "map",
}
PEERS = (
    "toolpool",
    "cf_fork",
    "cf_spawn",
    "cf_forkserver",
    "mp_pool",
    "loky",
    "pebble",
    "billiard",
    "mpire",
    "floor",
)
FLOOR_PARTS = ("throughput", "latency", "stop", "cold")
"""The floors have nothing to say about leaks and scale."""
MAP_PEERS = ("toolpool", "mp_pool", "cf_fork", "pebble")
"""The peers of part 7 (map): each pool's own map over an iterable, as issue 18 asks."""

WORKERS = 2
TP_CANCEL_GRACE = 0.5
TP_TERM_GRACE = 0.5
"""toolpool's grace periods in this benchmark (the defaults are 5 s and 2 s)."""
BILLIARD_SOFT = 0.5
BILLIARD_HARD = 1.0
MPIRE_TIMEOUT = 0.5
NO_RESULT_AFTER = 1.0
"""Once the stopped body's worker is gone (and the next call served), wait this long for a
result before recording that none came (multiprocessing.Pool never reports one)."""
STOP_BODIES = ("coop", "busy", "ignore_term", "swallow", "c_call")
LEAK_BODIES = ("child_block", "daemon_block", "child_return")
HELPER_WORDS = ("resource_tracker", "semaphore_tracker", "forkserver")
"""Long-lived helper processes of multiprocessing and loky: not workers, not leaks of a trial
(they end with the interpreter; run.py checks that they did)."""

SIZES: dict[str, dict[str, Any]] = {
    "smoke": {
        "noop_n": 200,
        "echo_10k_n": 50,
        "echo_1m_n": 5,
        "repeats": 1,
        "lat_n": 50,
        "warm": 10,
        "stop_bodies": ("busy",),
        "stop_repeats": 1,
        "window": 2.5,
        "leak_bodies": ("daemon_block",),
        "cold_repeats": 1,
        "scale_workers": (1, 2),
        "scale_n": 200,
        "queued_n": 1000,
        "floor_n": 200,
        "kill_repeats": 2,
    },
    "full": {
        "noop_n": 20_000,
        "echo_10k_n": 2_000,
        "echo_1m_n": 100,
        "repeats": 3,
        "lat_n": 1_000,
        "warm": 100,
        "stop_bodies": STOP_BODIES,
        "stop_repeats": 3,
        "window": 5.0,
        "leak_bodies": LEAK_BODIES,
        "cold_repeats": 5,
        "scale_workers": (1, 2, 4, 8),
        "scale_n": 4_000,
        "queued_n": 100_000,
        "floor_n": 20_000,
        "kill_repeats": 10,
    },
}

MiB = 1024 * 1024
TAG_VAR = "BENCH_RUN_TAG"


# =========================================================================== process facts


def proc_alive(pid: int) -> bool:
    """True while pid runs; a zombie has exited (it cannot do anything any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    end = data.rfind(b")")
    return data[end + 2 : end + 3] not in (b"Z", b"X")


class ExitWatcher:
    """Records when watched processes exit, through pidfds polled by one thread."""

    def __init__(self) -> None:
        self.exits: dict[int, float] = {}
        self._pending: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        threading.Thread(target=self._run, name="exit-watcher", daemon=True).start()

    def watch(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.exits.setdefault(pid, time.monotonic())
            return
        with self._lock:
            self._pending.append((pid, fd))
        os.write(self._w, b"x")

    def exited_at(self, pid: int) -> float | None:
        return self.exits.get(pid)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._r, select.POLLIN)
        fds: dict[int, int] = {}
        while True:
            events = poller.poll()
            now = time.monotonic()
            for fd, _ in events:
                if fd == self._r:
                    os.read(self._r, 4096)
                    with self._lock:
                        pending, self._pending = self._pending, []
                    for pid, pfd in pending:
                        fds[pfd] = pid
                        poller.register(pfd, select.POLLIN)
                    continue
                pid = fds.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                self.exits.setdefault(pid, now)


def _tag() -> str:
    return os.environ.get(TAG_VAR, "")


def _describe_proc(p: psutil.Process) -> dict[str, Any]:
    try:
        cmd = " ".join(p.cmdline())[:160]
    except psutil.Error:
        cmd = "?"
    try:
        ppid = p.ppid()
    except psutil.Error:
        ppid = None
    return {"pid": p.pid, "ppid": ppid, "cmdline": cmd}


def _is_helper(p: psutil.Process) -> bool:
    """A helper is this process's own child (a forkserver's workers share its cmdline)."""
    return p.ppid() == os.getpid() and any(w in " ".join(p.cmdline()) for w in HELPER_WORDS)


def tagged_processes(include_helpers: bool = False) -> list[psutil.Process]:
    """Live processes started by this part (by the environment tag), except this one."""
    tag = _tag()
    me = os.getpid()
    out = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.environ().get(TAG_VAR) != tag or not proc_alive(p.pid):
                continue
            if not include_helpers and _is_helper(p):
                continue
        except (psutil.Error, OSError):
            continue
        out.append(p)
    return out


def marker_processes(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if proc_alive(p.pid) and marker in " ".join(p.cmdline()):
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def kill_all(procs: list[psutil.Process], timeout: float = 5.0) -> list[dict[str, Any]]:
    """SIGKILL each, wait until each has exited; return their descriptions."""
    described = [_describe_proc(p) for p in procs]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(proc_alive(p.pid) for p in procs):
        time.sleep(0.005)
    # reap our own children (the harness's new pools, the floors' servers)
    for p in procs:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(p.pid, os.WNOHANG)
    return described


def sweep() -> list[dict[str, Any]]:
    """Kill what this part's pools left running (not the long-lived helpers)."""
    return kill_all(tagged_processes())


def memory(pid: int) -> dict[str, float] | None:
    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return None
    return {"uss_mib": info.uss / MiB, "rss_mib": info.rss / MiB, "pss_mib": info.pss / MiB}


def wait_mark(tag: str, kind: str, timeout: float) -> tuple[int, float, str]:
    deadline = time.monotonic() + timeout
    while True:
        got = bodies.read_mark(tag, kind)
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {kind} mark for {os.path.basename(tag)} in {timeout}s")
        time.sleep(0.001)


async def a_wait_mark(tag: str, kind: str, timeout: float) -> tuple[int, float, str]:
    import anyio

    deadline = time.monotonic() + timeout
    while True:
        got = bodies.read_mark(tag, kind)
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {kind} mark for {os.path.basename(tag)} in {timeout}s")
        await anyio.sleep(0.001)


def in_thread(fn: Callable[[], Any], name: str) -> tuple[threading.Thread, dict[str, Any]]:
    """Run fn in a daemon thread; the dict gets 'done' (monotonic), 'error'."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"[:200]
        box["done"] = time.monotonic()

    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    return t, box


def with_deadline(fn: Callable[[], Any], seconds: float, name: str) -> dict[str, Any]:
    t0 = time.monotonic()
    t, box = in_thread(fn, name)
    t.join(seconds)
    out: dict[str, Any] = {"seconds": time.monotonic() - t0, "hung": t.is_alive()}
    if "error" in box:
        out["error"] = box["error"]
    return out


def describe_value(ok: bool, value: Any) -> str:
    if ok:
        return "value"
    for attr in ("exception", "exc"):  # billiard's ExceptionInfo, ExceptionWithTraceback
        inner = getattr(value, attr, None)
        if isinstance(inner, BaseException):
            value = inner
    return type(value).__name__


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# =========================================================================== peers (sync)

Callback = Callable[[bool, Any], None] | None


class Peer:
    """The common face of the peers: a pool of WORKERS processes and its own ways to stop."""

    name = "?"
    module = "?"
    stop_modes: tuple[str, ...] = ()
    primary_mode = ""
    queued_cheap = True

    def __init__(self, workers: int = WORKERS) -> None:
        self.workers = workers
        self.pool: Any = None

    def start(self) -> None:
        raise NotImplementedError

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...] = (), cb: Callback = None
    ) -> Any:
        raise NotImplementedError

    def submit_target(
        self, fn: Callable[..., Any], args: tuple[Any, ...], cb: Callback, mode: str
    ) -> Any:
        return self.submit(fn, args, cb)

    def get(self, handle: Any, timeout: float = 120.0) -> Any:
        return handle.result(timeout)

    def close(self) -> None:
        raise NotImplementedError

    def stop(self, handle: Any, pid: int, mode: str, started_at: float) -> dict[str, Any]:
        """Issue the stop; return {t_request, can_stop, how, same_pool, thread?, box?}."""
        raise NotImplementedError


def _future_cb(fut: Any, cb: Callback) -> None:
    if cb is None:
        return

    def done(f: Any) -> None:
        if f.cancelled():
            cb(False, CancelledError())
            return
        exc = f.exception()
        cb(exc is None, f.result() if exc is None else exc)

    fut.add_done_callback(done)


class _Futures(Peer):
    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...] = (), cb: Callback = None
    ) -> Any:
        fut = self.pool.submit(fn, *args)
        _future_cb(fut, cb)
        return fut


class CF(_Futures):
    module = "concurrent.futures"
    stop_modes = ("cancel", "kill")
    primary_mode = "kill"

    def __init__(self, method: str, workers: int = WORKERS) -> None:
        super().__init__(workers)
        self.method = method
        self.name = f"cf_{method}"

    def start(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context(self.method)
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def stop(self, handle: Any, pid: int, mode: str, started_at: float) -> dict[str, Any]:
        t = time.monotonic()
        if mode == "cancel":
            ok = handle.cancel()
            return {"t_request": t, "can_stop": bool(ok), "how": "future.cancel() -> False"}
        # No public way to stop a running task on 3.11 (kill_workers() arrives in 3.14):
        # SIGKILL every worker of the executor, which breaks it.
        for p in list(self.pool._processes.values()):
            with contextlib.suppress(OSError):
                p.kill()
        return {
            "t_request": t,
            "can_stop": True,
            "how": "SIGKILL all workers (via _processes; 3.14's kill_workers()) + new executor",
            "same_pool": False,
        }


class Loky(_Futures):
    name = "loky"
    module = "loky"
    stop_modes = ("cancel", "kill")
    primary_mode = "kill"

    def start(self) -> None:
        import loky

        self.pool = loky.ProcessPoolExecutor(max_workers=self.workers)

    def close(self) -> None:
        self.pool.shutdown(wait=True, kill_workers=True)

    def stop(self, handle: Any, pid: int, mode: str, started_at: float) -> dict[str, Any]:
        t = time.monotonic()
        if mode == "cancel":
            ok = handle.cancel()
            return {"t_request": t, "can_stop": bool(ok), "how": "future.cancel() -> False"}
        thread, box = in_thread(
            lambda: self.pool.shutdown(wait=True, kill_workers=True), "loky-kill"
        )
        return {
            "t_request": t,
            "can_stop": True,
            "how": "shutdown(wait=True, kill_workers=True) + new executor",
            "same_pool": False,
            "thread": thread,
            "box": box,
        }


class Pebble(_Futures):
    name = "pebble"
    module = "pebble"
    stop_modes = ("cancel",)
    primary_mode = "cancel"

    def start(self) -> None:
        import pebble

        self.pool = pebble.ProcessPool(max_workers=self.workers)

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...] = (), cb: Callback = None
    ) -> Any:
        fut = self.pool.schedule(fn, args=args)
        _future_cb(fut, cb)
        return fut

    def close(self) -> None:
        self.pool.stop()
        self.pool.join()

    def stop(self, handle: Any, pid: int, mode: str, started_at: float) -> dict[str, Any]:
        t = time.monotonic()
        ok = handle.cancel()
        return {"t_request": t, "can_stop": bool(ok), "how": "future.cancel()", "same_pool": True}


class _AsyncResultPeer(Peer):
    def get(self, handle: Any, timeout: float = 120.0) -> Any:
        return handle.get(timeout)

    @staticmethod
    def _cbs(cb: Callback) -> dict[str, Any]:
        if cb is None:
            return {}
        return {
            "callback": lambda v: cb(True, v),
            "error_callback": lambda e: cb(False, e),
        }


class MPPool(_AsyncResultPeer):
    name = "mp_pool"
    module = "multiprocessing.pool"
    stop_modes = ("terminate",)
    primary_mode = "terminate"

    def start(self) -> None:
        import multiprocessing

        self.pool = multiprocessing.get_context("fork").Pool(self.workers)

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...] = (), cb: Callback = None
    ) -> Any:
        return self.pool.apply_async(fn, args, **self._cbs(cb))

    def close(self) -> None:
        self.pool.terminate()

    def stop(self, handle: Any, pid: int, mode: str, started_at: float) -> dict[str, Any]:
        t = time.monotonic()
        thread, box = in_thread(self.pool.terminate, "mp-terminate")
        return {
            "t_request": t,
            "can_stop": True,
            "how": "Pool.terminate() (the whole pool) + new Pool",
            "same_pool": False,
            "thread": thread,
            "box": box,
        }


class Billiard(_AsyncResultPeer):
    name = "billiard"
    module = "billiard"
    stop_modes = ("terminate", "timeout")
    primary_mode = "terminate"

    def start(self) -> None:
        from billiard.pool import Pool

        self.pool = Pool(processes=self.workers, enable_timeouts=True)

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...] = (), cb: Callback = None
    ) -> Any:
        return self.pool.apply_async(fn, args, **self._cbs(cb))

    def submit_target(
        self, fn: Callable[..., Any], args: tuple[Any, ...], cb: Callback, mode: str
    ) -> Any:
        if mode == "timeout":
            return self.pool.apply_async(
                fn, args, soft_timeout=BILLIARD_SOFT, timeout=BILLIARD_HARD, **self._cbs(cb)
            )
        return self.submit(fn, args, cb)

    def close(self) -> None:
        self.pool.terminate()

    def stop(self, handle: Any, pid: int, mode: str, started_at: float) -> dict[str, Any]:
        if mode == "timeout":
            return {
                "t_request": started_at + BILLIARD_SOFT,
                "can_stop": True,
                "how": f"soft_timeout={BILLIARD_SOFT}, timeout={BILLIARD_HARD} (from body start)",
                "same_pool": True,
            }
        sig = signal.SIGTERM if mode == "terminate" else signal.SIGKILL
        t = time.monotonic()
        self.pool.terminate_job(pid, sig)
        return {
            "t_request": t,
            "can_stop": True,
            "how": f"terminate_job(pid, {sig.name}) (Celery's revoke(terminate=True))",
            "same_pool": True,
        }


class Mpire(_AsyncResultPeer):
    name = "mpire"
    module = "mpire"
    stop_modes = ("timeout",)
    primary_mode = "timeout"

    def start(self) -> None:
        from mpire import WorkerPool

        self.pool = WorkerPool(n_jobs=self.workers, start_method="fork")

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...] = (), cb: Callback = None
    ) -> Any:
        return self.pool.apply_async(fn, args=args, **self._cbs(cb))

    def submit_target(
        self, fn: Callable[..., Any], args: tuple[Any, ...], cb: Callback, mode: str
    ) -> Any:
        return self.pool.apply_async(fn, args=args, task_timeout=MPIRE_TIMEOUT, **self._cbs(cb))

    def close(self) -> None:
        self.pool.terminate()

    def stop(self, handle: Any, pid: int, mode: str, started_at: float) -> dict[str, Any]:
        return {
            "t_request": started_at + MPIRE_TIMEOUT,
            "can_stop": True,
            "how": f"task_timeout={MPIRE_TIMEOUT} (from body start)",
            "same_pool": True,
        }


def make_peer(name: str, workers: int = WORKERS) -> Peer:
    if name.startswith("cf_"):
        return CF(name[3:], workers)
    classes: dict[str, type[Peer]] = {
        "mp_pool": MPPool,
        "loky": Loky,
        "pebble": Pebble,
        "billiard": Billiard,
        "mpire": Mpire,
    }
    return classes[name](workers)


def close_peer(peer: Peer, seconds: float = 5.0) -> dict[str, Any]:
    return with_deadline(peer.close, seconds, f"{peer.name}-close")


# =========================================================================== part 1, 2, 6


def _rate_run(
    n: int, payload: int, wall: float, cpu: float, kids: float | None = None
) -> dict[str, float]:
    run = {
        "n": n,
        "wall_s": wall,
        "rate": n / wall,
        "sup_cpu_us_per_call": cpu / n * 1e6,
    }
    if kids is not None:
        run["workers_cpu_us_per_call"] = kids / n * 1e6
    if payload:
        run["mib_s"] = n * payload / wall / MiB
    return run


def descendants_cpu() -> dict[int, float]:
    """CPU seconds (user + system, all threads) of each process below this one."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
    return out


def cpu_delta(before: dict[int, float]) -> float:
    after = descendants_cpu()
    return sum(after[pid] - before[pid] for pid in after if pid in before)


def _cases(sz: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [
        ("noop", sz["noop_n"], 0),
        ("echo_10k", sz["echo_10k_n"], 10 * 1024),
        ("echo_1m", sz["echo_1m_n"], MiB),
    ]


def peer_throughput(name: str, sz: dict[str, Any]) -> dict[str, Any]:
    peer = make_peer(name)
    peer.start()
    out: dict[str, Any] = {}
    try:
        for h in [peer.submit(bodies.noop) for _ in range(sz["warm"])]:
            peer.get(h)
        for case, n, size in _cases(sz):
            runs = []
            for _ in range(sz["repeats"]):
                gc.collect()
                fn, args = (bodies.noop, ()) if not size else (bodies.echo, (os.urandom(size),))
                k0 = descendants_cpu()
                c0, t0 = time.process_time(), time.perf_counter()
                handles = [peer.submit(fn, args) for _ in range(n)]
                for h in handles:
                    peer.get(h)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                runs.append(_rate_run(n, size, wall, cpu, cpu_delta(k0)))
            out[case] = {"runs": runs}
    finally:
        out["close"] = close_peer(peer)
    return out


def peer_latency(name: str, sz: dict[str, Any]) -> dict[str, Any]:
    peer = make_peer(name)
    peer.start()
    try:
        for _ in range(sz["warm"]):
            peer.get(peer.submit(bodies.noop))
        runs = []
        for _ in range(sz["repeats"]):
            lat = []
            for _ in range(sz["lat_n"]):
                t0 = time.perf_counter()
                peer.get(peer.submit(bodies.noop))
                lat.append(time.perf_counter() - t0)
            runs.append(_lat_run(lat))
        return {"noop": {"runs": runs}}
    finally:
        close_peer(peer)


def _lat_run(lat: list[float]) -> dict[str, float]:
    return {
        "n": len(lat),
        "p50_us": pct(lat, 50) * 1e6,
        "p99_us": pct(lat, 99) * 1e6,
        "mean_us": statistics.fmean(lat) * 1e6,
    }


def peer_queued(name: str, sz: dict[str, Any], tmp: str) -> dict[str, Any]:
    """Supervisor memory with queued_n calls waiting behind two busy workers."""
    peer = make_peer(name)
    peer.start()
    try:
        tags = []
        for i in range(WORKERS):
            tag = os.path.join(tmp, f"queued-blk-{i}")
            peer.submit(bodies.block, (bodies.LONG, tag))
            tags.append(tag)
            wait_mark(tag, "start", 30)
        gc.collect()
        time.sleep(0.2)
        m0 = memory(os.getpid())
        n = sz["queued_n"]
        t0 = time.perf_counter()
        handles = [peer.submit(bodies.noop) for _ in range(n)]
        submit_s = time.perf_counter() - t0
        time.sleep(0.5)  # let feeder threads move what they will
        gc.collect()
        m1 = memory(os.getpid())
        del handles
        return _queued_result(n, submit_s, m0, m1)
    finally:
        close_peer(peer, 1.0)  # the blockers never end by themselves: the harness kills them
        sweep()


def _queued_result(
    n: int, submit_s: float, m0: dict[str, float] | None, m1: dict[str, float] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n, "submit_s": submit_s, "before": m0, "after": m1}
    if m0 and m1:
        out["rss_delta_mib"] = m1["rss_mib"] - m0["rss_mib"]
        out["uss_delta_mib"] = m1["uss_mib"] - m0["uss_mib"]
        out["bytes_per_call"] = (m1["uss_mib"] - m0["uss_mib"]) * MiB / n
    return out


def peer_scale(name: str, sz: dict[str, Any], tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if name == "mp_pool":  # cheap enough to scale as a reference
        out["throughput"] = {}
        for workers in sz["scale_workers"]:
            peer = make_peer(name, workers)
            peer.start()
            try:
                for h in [peer.submit(bodies.noop) for _ in range(sz["warm"])]:
                    peer.get(h)
                runs = []
                for _ in range(sz["repeats"]):
                    n = sz["scale_n"]
                    c0, t0 = time.process_time(), time.perf_counter()
                    for h in [peer.submit(bodies.noop) for _ in range(n)]:
                        peer.get(h)
                    runs.append(_rate_run(n, 0, time.perf_counter() - t0, time.process_time() - c0))
                out["throughput"][str(workers)] = {"runs": runs}
            finally:
                close_peer(peer)
    out["queued"] = peer_queued(name, sz, tmp)
    return out


# =========================================================================== part 3, 4 (sync)


def peer_stop_trial(
    name: str, body: str, mode: str, window: float, watcher: ExitWatcher, tmp: str, rep: int
) -> dict[str, Any]:
    tag = os.path.join(tmp, f"{name}-{body}-{mode}-{rep}")
    rec: dict[str, Any] = {"body": body, "mode": mode, "repeat": rep}
    peer = make_peer(name)
    peer.start()
    box: dict[str, Any] = {}
    pid_box: list[int] = []
    extra_peers: list[Peer] = []

    def on_target(ok: bool, value: Any) -> None:
        now = time.monotonic()
        alive = proc_alive(pid_box[0]) if pid_box else None
        box.setdefault("result", (now, alive, describe_value(ok, value)))

    def on_next(ok: bool, value: Any) -> None:
        box.setdefault("next", (time.monotonic(), describe_value(ok, value)))

    try:
        handle = peer.submit_target(getattr(bodies, body), (tag,), on_target, mode)
        pid, started_at, _ = wait_mark(tag, "start", 30)
        pid_box.append(pid)
        watcher.watch(pid)
        peer.submit(bodies.block, (bodies.LONG, tag + ".blk"))
        wait_mark(tag + ".blk", "start", 30)
        stop = peer.stop(handle, pid, mode, started_at)
        t_req = stop["t_request"]
        rec["how"] = stop["how"]
        rec["can_stop"] = stop["can_stop"]
        if not stop["can_stop"]:
            return rec
        while time.monotonic() < t_req:
            time.sleep(0.001)
        if stop.get("same_pool", True):
            peer.submit(bodies.noop, (), on_next)
        else:

            def next_on_new_pool() -> None:
                th = stop.get("thread")
                if th is not None:
                    th.join(max(0.0, t_req + window - time.monotonic()))
                    if th.is_alive():
                        return  # the stop call is still blocked: no next call
                fresh = make_peer(name)
                extra_peers.append(fresh)
                fresh.start()
                fresh.submit(bodies.noop, (), on_next)

            in_thread(next_on_new_pool, "next-call")
        deadline = t_req + window
        quiet = QuietClock()
        while time.monotonic() < deadline:
            ended = bodies.read_mark(tag, "end") is not None
            gone = watcher.exited_at(pid) is not None
            if "result" in box and "next" in box and (ended or gone):
                break
            if quiet.expired("next" in box and (ended or gone)):
                break  # stopped and serving again, but no result: it will not come
            time.sleep(0.002)
        _fill_stop_record(rec, box, t_req, pid, watcher, tag, window)
        if "box" in stop:
            th = stop["thread"]
            rec["stop_call_s"] = stop["box"]["done"] - t_req if "done" in stop["box"] else None
            rec["stop_call_hung"] = th.is_alive()
            if "error" in stop["box"]:
                rec["stop_call_error"] = stop["box"]["error"]
        return rec
    finally:
        # The harness's clean-up, not measured: give the pool's own close a moment, then
        # kill what is left (billiard's terminate() alone can take seconds).
        closes = [close_peer(p, 1.0) for p in (peer, *extra_peers)]
        rec["close_hung"] = any(c["hung"] for c in closes)
        rec["harness_killed"] = sweep()


class QuietClock:
    """Ends a wait once a condition has held for NO_RESULT_AFTER seconds."""

    def __init__(self) -> None:
        self.since: float | None = None

    def expired(self, condition: bool) -> bool:
        now = time.monotonic()
        if not condition:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since > NO_RESULT_AFTER


def _fill_stop_record(
    rec: dict[str, Any],
    box: dict[str, Any],
    t_req: float,
    pid: int,
    watcher: ExitWatcher,
    tag: str,
    window: float,
) -> None:
    rec["window_s"] = window
    rec["observed_s"] = time.monotonic() - t_req
    if "result" in box:
        t, alive, kind = box["result"]
        rec["result_s"] = t - t_req
        rec["result_kind"] = kind
        rec["worker_alive_at_result"] = alive
    else:
        rec["result_s"] = None
        rec["result_kind"] = "none within window"
    exit_t = watcher.exited_at(pid)
    rec["worker_exit_s"] = None if exit_t is None else exit_t - t_req
    end = bodies.read_mark(tag, "end")
    rec["body_end_s"] = None if end is None else end[1] - t_req
    rec["next_s"] = box["next"][0] - t_req if "next" in box else None
    rec["next_kind"] = box["next"][1] if "next" in box else None
    rec["stopped"] = exit_t is not None or end is not None
    rec["result_before_exit"] = (
        None
        if "result" not in box or (exit_t is None and end is not None)
        else bool(box["result"][1])
    )


def peer_leak_trial(
    name: str, body: str, mode: str, window: float, watcher: ExitWatcher, tmp: str
) -> dict[str, Any]:
    marker = f"bench-leak-{uuid.uuid4().hex[:12]}"
    tag = os.path.join(tmp, f"{name}-{body}")
    rec: dict[str, Any] = {"body": body, "mode": mode, "marker": marker}
    peer = make_peer(name)
    peer.start()
    box: dict[str, Any] = {}

    def on_target(ok: bool, value: Any) -> None:
        box.setdefault("result", (time.monotonic(), describe_value(ok, value)))

    closed = False
    try:
        handle = peer.submit_target(getattr(bodies, body), (tag, marker), on_target, mode)
        pid, started_at, _ = wait_mark(tag, "start", 30)
        watcher.watch(pid)
        rec["spawned"] = len(marker_processes(marker))
        if body == "child_return":
            deadline = time.monotonic() + window
            while "result" not in box and time.monotonic() < deadline:
                time.sleep(0.002)
            rec["how"] = "returned by itself"
        else:
            stop = peer.stop(handle, pid, mode, started_at)
            rec["how"] = stop["how"]
            deadline = stop["t_request"] + window
            quiet = QuietClock()
            while time.monotonic() < deadline:
                gone = watcher.exited_at(pid) is not None
                if ("result" in box and gone) or quiet.expired(gone):
                    break
                time.sleep(0.002)
            th = stop.get("thread")
            if th is not None:
                th.join(max(0.0, deadline - time.monotonic()))
        rec["result_kind"] = box["result"][1] if "result" in box else "none within window"
        time.sleep(0.2)
        rec["survivors_after_stop"] = [_describe_proc(p) for p in marker_processes(marker)]
        rec["close"] = close_peer(peer, 5.0)
        closed = True
        time.sleep(0.2)
        rec["survivors_after_close"] = [_describe_proc(p) for p in marker_processes(marker)]
        return rec
    finally:
        if not closed:
            close_peer(peer, 5.0)
        rec["harness_killed"] = kill_all(marker_processes(marker)) + sweep()
        rec["leaked"] = len(rec.get("survivors_after_close", [])) or len(rec["harness_killed"])


# =========================================================================== part 5 (sync)


def peer_cold(name: str, sz: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    peer = make_peer(name)
    importlib.import_module(peer.module)
    import_s = time.perf_counter() - t0
    runs = []
    mem: dict[str, Any] = {}
    for rep in range(sz["cold_repeats"]):
        gc.collect()
        t0 = time.perf_counter()
        peer = make_peer(name)
        peer.start()
        peer.get(peer.submit(bodies.noop))
        cold = time.perf_counter() - t0
        if rep == 0:
            handles = [peer.submit(bodies.pid_nap, (0.3,)) for _ in range(WORKERS)]
            pids = sorted({peer.get(h) for h in handles})
            time.sleep(0.5)
            mem = _idle_memory(pids)
        c0 = time.perf_counter()
        close = close_peer(peer, 10.0)
        runs.append(
            {"cold_s": cold, "close_s": time.perf_counter() - c0, "close_hung": close["hung"]}
        )
        sweep()
    return {"import_s": import_s, "runs": runs, "memory": mem}


def _idle_memory(
    worker_pids: list[int], extra_helpers: dict[int, str] | None = None
) -> dict[str, Any]:
    workers = []
    for pid in worker_pids:
        m = memory(pid)
        if m:
            workers.append({"pid": pid, **m})
    helpers = []
    for p in psutil.Process().children(recursive=True):
        if p.pid in worker_pids:
            continue
        m = memory(p.pid)
        if m:
            label = (extra_helpers or {}).get(p.pid) or _describe_proc(p)["cmdline"][:80]
            helpers.append({"pid": p.pid, "what": label, **m})
    return {"workers": workers, "helpers": helpers, "supervisor": memory(os.getpid())}


# =========================================================================== toolpool (async)


#: toolpool runs `workers` calls at once plus one warm spare process, which serves the next
#: call at once when a worker is killed (the design the issue expects for that target).
TP_WARM_SPARES = 1


def tp_pool(workers: int = WORKERS, **kwargs: Any) -> Any:
    import toolpool

    return toolpool.Pool(
        "bodies:registry",
        workers=workers,
        cancel_grace=TP_CANCEL_GRACE,
        term_grace=TP_TERM_GRACE,
        warm_spares=TP_WARM_SPARES,
        **kwargs,
    )


async def tp_rate(
    pool: Any, tool: str, args: dict[str, Any], n: int, size: int
) -> dict[str, float]:
    gc.collect()
    k0 = descendants_cpu()
    c0, t0 = time.process_time(), time.perf_counter()
    calls = [pool.submit(tool, args) for _ in range(n)]
    for c in calls:
        r = await c
        if not r.ok:
            raise RuntimeError(f"{tool}: {r.outcome} {r.error}")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return _rate_run(n, size, wall, cpu, cpu_delta(k0))


async def tp_throughput(sz: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with tp_pool() as pool:
        await tp_rate(pool, "noop", {}, sz["warm"], 0)
        for case, n, size in _cases(sz):
            args = {"value": os.urandom(size)} if size else {}
            tool = "echo" if size else "noop"
            out[case] = {
                "runs": [await tp_rate(pool, tool, args, n, size) for _ in range(sz["repeats"])]
            }
        out["statistics"] = _tp_stats(pool)
    return out


def _tp_stats(pool: Any) -> dict[str, Any]:
    s = pool.statistics()
    return {
        "workers_started": s.workers_started,
        "workers_replaced": s.workers_replaced,
        "settled": dict(s.settled),
        "escalations": dict(s.escalations),
    }


async def tp_latency(sz: dict[str, Any]) -> dict[str, Any]:
    async with tp_pool() as pool:
        for _ in range(sz["warm"]):
            await pool.call("noop")
        runs = []
        for _ in range(sz["repeats"]):
            lat = []
            for _ in range(sz["lat_n"]):
                t0 = time.perf_counter()
                await pool.call("noop")
                lat.append(time.perf_counter() - t0)
            runs.append(_lat_run(lat))
        return {"noop": {"runs": runs}}


async def tp_stop_trial(
    body: str, mode: str, window: float, watcher: ExitWatcher, tmp: str, rep: int
) -> dict[str, Any]:
    import anyio

    tag = os.path.join(tmp, f"toolpool-{body}-{mode}-{rep}")
    rec: dict[str, Any] = {"body": body, "mode": mode, "repeat": rep, "can_stop": True}
    rec["how"] = (
        "call.cancel(force=True): SIGKILL of the worker's tree"
        if mode == "force"
        else f"call.cancel(): cancel message, SIGTERM after {TP_CANCEL_GRACE}s, "
        f"SIGKILL after {TP_TERM_GRACE}s more"
    )
    box: dict[str, Any] = {}
    t_close = None
    try:
        async with tp_pool() as pool:
            target = pool.submit(body, {"tag": tag})
            pid, _, _ = await a_wait_mark(tag, "start", 30)
            watcher.watch(pid)
            pool.submit("block", {"tag": tag + ".blk"})
            await a_wait_mark(tag + ".blk", "start", 30)
            t_req = time.monotonic()
            target.cancel(force=mode == "force")
            nxt = pool.submit("noop")

            async def wait_target() -> None:
                res = await target
                box["result"] = (time.monotonic(), proc_alive(pid), res.outcome.value)
                box["tp"] = res

            async def wait_next() -> None:
                res = await nxt
                box["next"] = (time.monotonic(), res.outcome.value)

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_target)
                tg.start_soon(wait_next)
                deadline = t_req + window
                while time.monotonic() < deadline:
                    ended = bodies.read_mark(tag, "end") is not None
                    gone = watcher.exited_at(pid) is not None
                    if "result" in box and "next" in box and (ended or gone):
                        break
                    await anyio.sleep(0.002)
                tg.cancel_scope.cancel()
            _fill_stop_record(rec, box, t_req, pid, watcher, tag, window)
            if "tp" in box:
                res = box["tp"]
                rec["rung"] = res.rung.value
                rec["timeline_ms"] = {k: round(v * 1e3, 3) for k, v in res.timeline.steps()}
                tl = res.timeline
                if tl.reaped is not None:
                    rec["reaped_s"] = tl.reaped - t_req
            t_close = time.perf_counter()
        rec["close_s"] = time.perf_counter() - t_close
        return rec
    finally:
        rec["harness_killed"] = sweep()


async def tp_leak_trial(
    body: str, mode: str, window: float, watcher: ExitWatcher, tmp: str
) -> dict[str, Any]:
    import anyio

    marker = f"bench-leak-{uuid.uuid4().hex[:12]}"
    tag = os.path.join(tmp, f"toolpool-{body}-{mode}")
    rec: dict[str, Any] = {"body": body, "mode": mode, "marker": marker}
    try:
        t_close = None
        async with tp_pool() as pool:
            call = pool.submit(body, {"tag": tag, "marker": marker})
            pid, _, _ = await a_wait_mark(tag, "start", 30)
            watcher.watch(pid)
            rec["spawned"] = len(marker_processes(marker))
            if body == "child_return":
                rec["how"] = "returned by itself"
            else:
                rec["how"] = "call.cancel(force=True)" if mode == "force" else "call.cancel()"
                call.cancel(force=mode == "force")
            with anyio.move_on_after(window):
                res = await call
                rec["result_kind"] = res.outcome.value
                rec["survivors_at_result"] = [_describe_proc(p) for p in marker_processes(marker)]
            await anyio.sleep(0.2)
            rec["survivors_after_stop"] = [_describe_proc(p) for p in marker_processes(marker)]
            t_close = time.perf_counter()
        rec["close"] = {"seconds": time.perf_counter() - t_close, "hung": False}
        await anyio.sleep(0.2)
        rec["survivors_after_close"] = [_describe_proc(p) for p in marker_processes(marker)]
        return rec
    finally:
        rec["harness_killed"] = kill_all(marker_processes(marker)) + sweep()
        rec["leaked"] = len(rec.get("survivors_after_close", [])) or len(rec["harness_killed"])


async def tp_cold(sz: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    importlib.import_module("toolpool")
    import_s = time.perf_counter() - t0
    runs = []
    mem: dict[str, Any] = {}
    for rep in range(sz["cold_repeats"]):
        gc.collect()
        t0 = time.perf_counter()
        pool = tp_pool()
        await pool.start()
        t_started = time.perf_counter()
        await pool.call("noop")
        cold = time.perf_counter() - t0
        if rep == 0:
            import anyio

            await anyio.sleep(0.5)
            pids = pool.worker_pids  # (a method before 2ce10fe: --baseline runs those)
            pids = sorted(pids if isinstance(pids, list) else pids())
            mem = _idle_memory(pids, {pool.reaper_pid: "toolpool reaper"})
        c0 = time.perf_counter()
        await pool.aclose()
        runs.append(
            {
                "cold_s": cold,
                "start_s": t_started - t0,
                "close_s": time.perf_counter() - c0,
                "close_hung": False,
            }
        )
        sweep()
    out = {"import_s": import_s, "runs": runs, "memory": mem}
    for method in ("fork", "spawn"):
        out[f"add_worker_{method}"] = {"runs": await _tp_add_worker(sz, method)}
    return out


async def _tp_add_worker(sz: dict[str, Any], method: str) -> list[dict[str, Any]]:
    """One more worker in a running pool (its template, with "fork", already loaded): from the
    pool asking the reaper for it to its hello. Uses the pool's private spawn (no public API
    grows a pool); the extra workers are retired with the pool."""
    runs = []
    pool = tp_pool(start_method=method)
    await pool.start()
    try:
        for _ in range(sz["cold_repeats"]):
            gc.collect()
            t0 = time.perf_counter()
            core = pool._core
            default = getattr(core, "default", None)  # (a provider's, since issue 17)
            spawn = core.fleet.spawn if hasattr(core, "fleet") else core._spawn  # (machine/)
            w = spawn(default) if default is not None else spawn()
            pool._pump()
            while not w.answered:
                await pool._wait_changed()
            runs.append({"add_s": time.perf_counter() - t0})
        methods = sorted(set(pool.worker_start_methods.values()))
        if methods != [method]:
            raise RuntimeError(f"asked for {method} workers, got {methods}")
    finally:
        await pool.aclose()
        sweep()
    return runs


async def tp_scale(sz: dict[str, Any], tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"throughput": {}}
    for workers in sz["scale_workers"]:
        async with tp_pool(workers) as pool:
            await tp_rate(pool, "noop", {}, sz["warm"], 0)
            runs = [await tp_rate(pool, "noop", {}, sz["scale_n"], 0) for _ in range(sz["repeats"])]
            out["throughput"][str(workers)] = {"runs": runs}
    async with tp_pool() as pool:
        blockers = []
        for i in range(WORKERS):
            tag = os.path.join(tmp, f"tp-queued-blk-{i}")
            blockers.append(pool.submit("block", {"tag": tag}))
            await a_wait_mark(tag, "start", 30)
        gc.collect()
        import anyio

        await anyio.sleep(0.2)
        m0 = memory(os.getpid())
        n = sz["queued_n"]
        t0 = time.perf_counter()
        calls = [pool.submit("noop") for _ in range(n)]
        submit_s = time.perf_counter() - t0
        await anyio.sleep(0.5)
        gc.collect()
        m1 = memory(os.getpid())
        out["queued"] = _queued_result(n, submit_s, m0, m1)
        out["queued"]["queued_by_statistics"] = pool.statistics().queued
        for c in calls:
            c.cancel()
        del calls
        for b in blockers:
            b.cancel()
    return out


# =========================================================================== part 7 (map)


def _map_cases(sz: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [("noop", sz["noop_n"], 0), ("echo_10k", sz["echo_10k_n"], 10 * 1024)]


def peer_map(name: str, sz: dict[str, Any]) -> dict[str, Any]:
    """The peer's own map over n items, results consumed as they come, default chunksize
    (1): ``Pool.imap_unordered``, ``ProcessPoolExecutor.map``, pebble's ``ProcessPool.map``."""
    peer = make_peer(name)
    peer.start()
    pool = peer.pool
    how = {
        "mp_pool": "multiprocessing.Pool.imap_unordered(fn, items)",
        "cf_fork": "ProcessPoolExecutor.map(fn, items)",
        "pebble": "pebble.ProcessPool.map(fn, items).result()",
    }[name]

    def run(fn: Callable[[Any], Any], items: Any) -> Any:
        if name == "mp_pool":
            return pool.imap_unordered(fn, items)
        if name == "pebble":
            return pool.map(fn, items).result()
        return pool.map(fn, items)

    out: dict[str, Any] = {"how": how}
    try:
        for _ in run(bodies.noop_of, range(sz["warm"])):
            pass
        for case, n, size in _map_cases(sz):
            payload = os.urandom(size)
            fn = bodies.echo if size else bodies.noop_of
            runs = []
            for _ in range(sz["repeats"]):
                gc.collect()
                c0, t0 = time.process_time(), time.perf_counter()
                got = sum(1 for _ in run(fn, (payload for _ in range(n))))
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if got != n:
                    raise RuntimeError(f"{name} map gave {got} results for {n} items")
                runs.append(_rate_run(n, size, wall, cpu))
            out[case] = {"runs": runs}
    finally:
        out["close"] = close_peer(peer)
    return out


def tp_map(sz: dict[str, Any]) -> dict[str, Any]:
    """SyncPool.map (unordered and ordered) beside the async paths on the same pool and
    workers, run by run: the async ``pool.submit`` path (submit all, await each, as part 1)
    and ``Pool.map``, both run in the SyncPool's own event-loop thread."""
    import toolpool

    variants = ("sync_map", "sync_map_ordered", "async_map", "async_submit")
    out: dict[str, Any] = {}
    with toolpool.SyncPool(
        "bodies:registry",
        workers=WORKERS,
        cancel_grace=TP_CANCEL_GRACE,
        term_grace=TP_TERM_GRACE,
        warm_spares=TP_WARM_SPARES,
    ) as pool:
        portal = pool._running()  # (the async paths run in the pool's own loop)
        inner = pool._pool

        async def async_submit(tool: str, args: dict[str, Any], n: int) -> int:
            calls = [inner.submit(tool, args) for _ in range(n)]
            ok = 0
            for c in calls:
                ok += (await c).ok
            return ok

        async def async_map(tool: str, args: dict[str, Any], n: int) -> int:
            ok = 0
            async with inner.map(tool, (args for _ in range(n))) as results:
                async for r in results:
                    ok += r.ok
            return ok

        def sync_map(tool: str, args: dict[str, Any], n: int, ordered: bool = False) -> int:
            with pool.map(tool, (args for _ in range(n)), ordered=ordered) as results:
                return sum(r.ok for r in results)

        runners: dict[str, Callable[[str, dict[str, Any], int], int]] = {
            "sync_map": sync_map,
            "sync_map_ordered": lambda t, a, n: sync_map(t, a, n, ordered=True),
            "async_map": lambda t, a, n: portal.call(async_map, t, a, n),
            "async_submit": lambda t, a, n: portal.call(async_submit, t, a, n),
        }
        sync_map("noop", {}, sz["warm"])
        for case, n, size in _map_cases(sz):
            args = {"value": os.urandom(size)} if size else {}
            tool = "echo" if size else "noop"
            cell: dict[str, Any] = {v: {"runs": []} for v in variants}
            for _ in range(sz["repeats"]):  # interleaved: each repeat runs every variant
                for variant in variants:
                    gc.collect()
                    c0, t0 = time.process_time(), time.perf_counter()
                    ok = runners[variant](tool, args, n)
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    if ok != n:
                        raise RuntimeError(f"{variant} {tool}: {ok} of {n} calls ok")
                    cell[variant]["runs"].append(_rate_run(n, size, wall, cpu))
            out[case] = cell
        with pool.map("noop", []) as empty:
            out["max_in_flight"] = empty.max_in_flight
        out["statistics"] = _tp_stats(pool)
    return out


# =========================================================================== floors


def floor_throughput(sz: dict[str, Any]) -> dict[str, Any]:
    import msgpack
    import zmq

    with _zmq_server() as sock:
        n = sz["floor_n"]
        window = 1000
        runs = []
        for _ in range(sz["repeats"] + 1):  # the first is a warm-up
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            sent = received = 0
            while received < n:
                while sent < n and sent - received < window:
                    sock.send(msgpack.packb({"t": "call", "id": sent, "tool": "noop", "args": {}}))
                    sent += 1
                msgpack.unpackb(sock.recv())
                received += 1
                while received < sent and sock.poll(0, zmq.POLLIN):
                    msgpack.unpackb(sock.recv())
                    received += 1
            runs.append(_rate_run(n, 0, time.perf_counter() - t0, time.process_time() - c0))
        return {"zmq_pipelined": {"runs": runs[1:], "window": window}}


@contextlib.contextmanager
def _zmq_server() -> Any:
    import multiprocessing

    import msgpack
    import zmq

    d = tempfile.mkdtemp(prefix="bench-zmq-")
    endpoint = f"ipc://{d}/echo.sock"
    proc = multiprocessing.get_context("fork").Process(
        target=bodies.zmq_echo_server, args=(endpoint,), daemon=True
    )
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a lost reply fails the part instead of hanging
    sock.connect(endpoint)
    try:
        sock.send(msgpack.packb({"t": "call", "id": -1}))
        sock.recv()
        yield sock
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.send(msgpack.packb({"t": "stop", "id": 0}))
        proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join()
        sock.close()
        ctx.term()
        with contextlib.suppress(OSError):
            os.unlink(f"{d}/echo.sock")
        os.rmdir(d)


def floor_latency(sz: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing

    import msgpack

    n = sz["lat_n"]
    out: dict[str, Any] = {}
    with _zmq_server() as sock:
        runs = []
        for _ in range(sz["warm"]):
            sock.send(msgpack.packb({"t": "call", "id": 0, "tool": "noop", "args": {}}))
            sock.recv()
        for _ in range(sz["repeats"]):
            lat = []
            for i in range(n):
                t0 = time.perf_counter()
                sock.send(msgpack.packb({"t": "call", "id": i, "tool": "noop", "args": {}}))
                msgpack.unpackb(sock.recv())
                lat.append(time.perf_counter() - t0)
            runs.append(_lat_run(lat))
        out["zmq_pingpong"] = {"runs": runs}
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(
        target=bodies.pipe_echo_server, args=(child,), daemon=True
    )
    proc.start()
    try:
        for _ in range(sz["warm"]):
            parent.send(("noop", 0))
            parent.recv()
        runs = []
        for _ in range(sz["repeats"]):
            lat = []
            for i in range(n):
                t0 = time.perf_counter()
                parent.send(("noop", i))
                parent.recv()
                lat.append(time.perf_counter() - t0)
            runs.append(_lat_run(lat))
        out["pipe_pingpong"] = {"runs": runs}
    finally:
        parent.send(None)
        proc.join(2)
    return out


def floor_kill(sz: dict[str, Any], watcher: ExitWatcher) -> dict[str, Any]:
    """SIGKILL to exit (pidfd readable) and to reaped, for a small and a 200 MiB child."""
    out: dict[str, Any] = {}
    cases = {
        "small": "import sys, time; print('r', flush=True); time.sleep(600)",
        "touched_200m": (
            "import sys, time; b = bytearray(200 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]);"
            " print('r', flush=True); time.sleep(600)"
        ),
    }
    for case, code in cases.items():
        runs = []
        for _ in range(sz["kill_repeats"]):
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
            assert proc.stdout is not None
            proc.stdout.readline()
            watcher.watch(proc.pid)
            time.sleep(0.05)
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            reaped = time.monotonic()
            while watcher.exited_at(proc.pid) is None:
                time.sleep(0.001)
            exit_t = watcher.exited_at(proc.pid)
            assert exit_t is not None
            runs.append({"exit_s": min(exit_t, reaped) - t0, "reaped_s": reaped - t0})
            proc.stdout.close()
        out[case] = {"runs": runs}
    return out


def floor_cold(sz: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, code in (("python_pass", "pass"), ("import_zmq_msgpack", "import zmq, msgpack")):
        runs = []
        for _ in range(sz["cold_repeats"]):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            runs.append({"cold_s": time.perf_counter() - t0})
        out[case] = {"runs": runs}
    return out


# =========================================================================== driver


def run_part(peer: str, part: str, sz: dict[str, Any], tmp: str) -> dict[str, Any]:
    watcher = ExitWatcher()
    if peer == "floor":
        if part == "throughput":
            return floor_throughput(sz)
        if part == "latency":
            return floor_latency(sz)
        if part == "stop":
            return floor_kill(sz, watcher)
        if part == "cold":
            return floor_cold(sz)
        raise SystemExit(f"the floors have no part {part!r}")
    if peer == "toolpool":
        import functools

        import anyio

        # BENCH_LOOP=uvloop: the supervisor on uvloop's asyncio loop (an experiment, issue 15).
        run: Any = functools.partial(
            anyio.run, backend_options={"use_uvloop": os.environ.get("BENCH_LOOP") == "uvloop"}
        )
        if part == "throughput":
            return run(tp_throughput, sz)
        if part == "latency":
            return run(tp_latency, sz)
        if part == "stop":
            return run(_tp_stop_part, sz, watcher, tmp)
        if part == "leaks":
            return run(_tp_leak_part, sz, watcher, tmp)
        if part == "cold":
            return run(tp_cold, sz)
        if part == "scale":
            return run(tp_scale, sz, tmp)
        if part == "map":
            return tp_map(sz)
    if part == "map":
        if peer not in MAP_PEERS:
            raise SystemExit(f"{peer} has no part 'map'")
        return peer_map(peer, sz)
    if part == "throughput":
        return peer_throughput(peer, sz)
    if part == "latency":
        return peer_latency(peer, sz)
    if part == "stop":
        return _peer_stop_part(peer, sz, watcher, tmp)
    if part == "leaks":
        return _peer_leak_part(peer, sz, watcher, tmp)
    if part == "cold":
        return peer_cold(peer, sz)
    if part == "scale":
        return peer_scale(peer, sz, tmp)
    raise SystemExit(f"unknown part {part!r}")


TRIAL_LIMIT = 60.0
"""Seconds after which a peer's trial is abandoned (its thread left behind, its processes
killed) and recorded as an error, so that one hung call cannot stall the whole part."""


def guarded(trial: Callable[[], dict[str, Any]], limit: float) -> dict[str, Any]:
    """Run a trial in a thread; if it does not finish in time, record where it hung."""
    thread, box = in_thread(trial, "trial")
    thread.join(limit)
    if not thread.is_alive():
        if "error" in box:
            raise RuntimeError(box["error"])
        return dict(box["value"])
    frame = sys._current_frames().get(thread.ident or 0)
    stack = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "?"
    killed = sweep()
    return {
        "error": f"trial hung for {limit:.0f}s and was abandoned; stack: {stack}"[-1500:],
        "harness_killed": killed,
    }


def _stuck(rec: dict[str, Any]) -> bool:
    """A trial worth not repeating: nothing stopped it within the window, or the stop hung."""
    return bool(rec.get("can_stop") and (not rec.get("stopped") or rec.get("stop_call_hung")))


async def _tp_stop_part(sz: dict[str, Any], watcher: ExitWatcher, tmp: str) -> dict[str, Any]:
    trials = []
    for body in sz["stop_bodies"]:
        for mode in ("cancel", "force"):
            for rep in range(sz["stop_repeats"]):
                rec = await tp_stop_trial(body, mode, sz["window"], watcher, tmp, rep)
                trials.append(rec)
                if _stuck(rec):
                    break
    return {"config": _stop_config(sz), "modes": ["cancel", "force"], "trials": trials}


def _peer_stop_part(
    peer: str, sz: dict[str, Any], watcher: ExitWatcher, tmp: str
) -> dict[str, Any]:
    modes = make_peer(peer).stop_modes
    trials = []
    cannot: set[str] = set()
    for body in sz["stop_bodies"]:
        for mode in modes:
            if mode in cannot:
                continue  # the API cannot stop any running task: once is enough to show it
            for rep in range(sz["stop_repeats"]):
                try:
                    rec = guarded(
                        lambda b=body, m=mode, r=rep: peer_stop_trial(
                            peer, b, m, sz["window"], watcher, tmp, r
                        ),
                        TRIAL_LIMIT,
                    )
                except Exception as exc:
                    rec = {"body": body, "mode": mode, "repeat": rep, "error": repr(exc)[:300]}
                trials.append(rec)
                if rec.get("can_stop") is False:
                    cannot.add(mode)
                if _stuck(rec) or not rec.get("can_stop", True) or "error" in rec:
                    break
    return {"config": _stop_config(sz), "modes": list(modes), "trials": trials}


def _stop_config(sz: dict[str, Any]) -> dict[str, Any]:
    return {
        "window_s": sz["window"],
        "bodies": list(sz["stop_bodies"]),
        "toolpool_cancel_grace": TP_CANCEL_GRACE,
        "toolpool_term_grace": TP_TERM_GRACE,
        "billiard_soft_timeout": BILLIARD_SOFT,
        "billiard_timeout": BILLIARD_HARD,
        "mpire_task_timeout": MPIRE_TIMEOUT,
        "other_worker": "busy with a long sleep, so the next call needs the stopped worker "
        "(or its replacement)",
    }


async def _tp_leak_part(sz: dict[str, Any], watcher: ExitWatcher, tmp: str) -> dict[str, Any]:
    trials = []
    for body in sz["leak_bodies"]:
        for mode in ("returned",) if body == "child_return" else ("cancel", "force"):
            trials.append(await tp_leak_trial(body, mode, sz["window"], watcher, tmp))
    return {"trials": trials}


def _peer_leak_part(
    peer: str, sz: dict[str, Any], watcher: ExitWatcher, tmp: str
) -> dict[str, Any]:
    mode = make_peer(peer).primary_mode
    trials = []
    for body in sz["leak_bodies"]:
        how = "returned" if body == "child_return" else mode
        try:
            trials.append(
                guarded(
                    lambda b=body, h=how: peer_leak_trial(peer, b, h, sz["window"], watcher, tmp),
                    TRIAL_LIMIT,
                )
            )
        except Exception as exc:
            trials.append({"body": body, "mode": mode, "error": repr(exc)[:300]})
    return {"trials": trials}


def versions(peer: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    names = {
        "toolpool": ["toolpool", "pyzmq", "msgpack", "anyio"],
        "loky": ["loky"],
        "pebble": ["pebble"],
        "billiard": ["billiard"],
        "mpire": ["mpire"],
        "floor": ["pyzmq", "msgpack"],
    }.get(peer, [])
    out = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = "missing"
    return out


def _supervise_self(argv: list[str], env: dict[str, str]) -> int:
    """parts.py started by hand: run the part in a child, under this process as a child
    subreaper, and kill whatever it leaves behind, even if it is interrupted. (A signal
    handler in the part itself would be inherited by forked workers and change how they die.)
    """
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env)

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    code = child.wait()
    os.environ[TAG_VAR] = env[TAG_VAR]
    kill_all(tagged_processes(include_helpers=True))
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("part", help="1-7 or " + ", ".join(PARTS.values()))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    part = PARTS.get(args.part, args.part)
    if part not in PARTS.values():
        parser.error(f"unknown part {args.part!r}")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run.py asks before a kill
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("PYTHONPATH", "")
    if not _tag() or bench_dir not in path.split(os.pathsep):
        # Run again with the tag and bench/ in the environment the part is exec'd with (forked
        # workers show that one in /proc/PID/environ, not what os.environ says later).
        env = dict(os.environ)
        env.setdefault(TAG_VAR, f"parts-{uuid.uuid4().hex}")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (bench_dir, path) if p)
        return _supervise_self(sys.argv[1:] if argv is None else argv, env)
    sz = SIZES["smoke" if args.smoke else "full"]
    result: dict[str, Any] = {
        "peer": args.peer,
        "part": part,
        "size": "smoke" if args.smoke else "full",
        "versions": versions(args.peer),
        "load_before": load(),
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.peer}-{part}-") as tmp:
        try:
            result["metrics"] = run_part(args.peer, part, sz, tmp)
            result["ok"] = True
        except BaseException as exc:
            result["ok"] = False
            result["error"] = "".join(traceback.format_exception(exc))[-3000:]
        result["leftover"] = sweep()
    result["elapsed_s"] = time.perf_counter() - t0
    result["load_after"] = load()
    text = json.dumps(result, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json or not args.out:
        sys.stdout.write(text + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # Some pools join their threads at exit (and can hang there after a kill): leave now.
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
