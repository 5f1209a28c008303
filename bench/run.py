#!/usr/bin/env python3
"""Run the benchmark: toolpool side by side with its peers, one fresh interpreter per part.

    python bench/run.py                 # the full run (make bench), under 10 minutes
    python bench/run.py --smoke         # tiny sizes (make bench-smoke, CI)
    python bench/run.py --peers toolpool,mp_pool --parts 1,2,3
    python bench/run.py --baseline /other/checkout/.venv/bin/python   # before/after, one run

With ``--baseline PYTHON`` (``make bench BASELINE=PYTHON``) every part of toolpool also runs
under that interpreter, whose environment has another toolpool installed (an older commit,
say), right before the part of this one: the two sit side by side in one run, a part apart
at most, and the report gets a before/after table. The peers are not compared with it.

Each (peer, part) runs as ``bench/parts.py PEER PART --json`` in its own interpreter, with
``bench/`` on PYTHONPATH (so spawn-based peers can import ``bodies``) and a fresh
``BENCH_RUN_TAG`` in its environment. This process is a child subreaper, so whatever a part
leaves behind, even a daemon that left its session with a double fork, is re-parented here;
after each part it finds every process carrying the part's tag, records it as a leak and
kills it. Nothing a run starts outlives it.

Writes ``results/latest.json`` (raw numbers), ``results/latest.md`` (medians with [min-max]
and toolpool/peer ratios) and, if matplotlib is installed, PNG charts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import psutil

from toolpool.sandbox._linux import PR_SET_CHILD_SUBREAPER, prctl, reap_zombies

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

from parts import FLOOR_PARTS, MAP_PEERS, PARTS, PEERS, TAG_VAR, proc_alive  # noqa: E402

PEER_MODULES = {
    "loky": "loky",
    "pebble": "pebble",
    "billiard": "billiard",
    "mpire": "mpire",
    "toolpool": "toolpool",
}
PART_TIMEOUT = {"smoke": 120.0, "full": 300.0}
#: The peer name of toolpool run under ``--baseline``'s interpreter.
BASELINE = "toolpool_base"
PEER_LABEL = {
    "toolpool": "toolpool",
    "cf_fork": "cf (fork)",
    "cf_spawn": "cf (spawn)",
    "cf_forkserver": "cf (forkserver)",
    "mp_pool": "multiprocessing.Pool",
    "loky": "loky",
    "pebble": "pebble",
    "billiard": "billiard",
    "mpire": "mpire",
    "floor": "floors",
    BASELINE: "toolpool (baseline)",
}


# =========================================================================== running


def become_subreaper() -> bool:
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def tagged(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(TAG_VAR) == tag and proc_alive(p.pid):
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def describe(p: psutil.Process) -> dict[str, Any]:
    try:
        return {"pid": p.pid, "ppid": p.ppid(), "cmdline": " ".join(p.cmdline())[:200]}
    except psutil.Error:
        return {"pid": p.pid, "ppid": None, "cmdline": "?"}


def end_leftovers(tag: str, grace: float) -> list[dict[str, Any]]:
    """Wait up to grace for the part's processes to end on their own; kill the rest."""
    deadline = time.monotonic() + grace
    left = tagged(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        reap_zombies()
        left = tagged(tag)
    found = [describe(p) for p in left]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    deadline = time.monotonic() + 5
    while any(proc_alive(p.pid) for p in left) and time.monotonic() < deadline:
        time.sleep(0.01)
        reap_zombies()
    reap_zombies()
    return found


def run_part(
    peer: str, part: str, smoke: bool, timeout: float, baseline: str | None = None
) -> dict[str, Any]:
    tag = f"run-{uuid.uuid4().hex}"
    env = dict(os.environ)
    env[TAG_VAR] = tag
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH, env.get("PYTHONPATH", "")) if p)
    env.pop("PYTHONSTARTUP", None)
    with tempfile.NamedTemporaryFile(prefix="bench-part-", suffix=".json", delete=False) as f:
        out_path = f.name
    python, as_peer = (
        (baseline, "toolpool") if peer == BASELINE and baseline else (sys.executable, peer)
    )
    argv = [python, os.path.join(BENCH, "parts.py"), as_peer, part, "--json"]
    argv += ["--out", out_path] + (["--smoke"] if smoke else [])
    t0 = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    proc = subprocess.Popen(
        argv,
        cwd=BENCH,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR1)  # parts.py dumps its threads' stacks to stderr
            time.sleep(1.0)
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    leftovers = end_leftovers(tag, grace=3.0)
    result: dict[str, Any]
    try:
        with open(out_path) as f:
            result = json.loads(f.read())
    except (OSError, ValueError):
        result = {"peer": peer, "part": part, "ok": False}
    finally:
        result["peer"] = peer
        with contextlib.suppress(OSError):
            os.unlink(out_path)
    if timed_out:
        result["ok"] = False
        result["error"] = f"timed out after {timeout:.0f}s and was killed"
    if not result.get("ok"):
        result.setdefault("error", "")
        result["stderr_tail"] = stderr.decode(errors="replace")[-2000:]
        result["exit_code"] = proc.returncode
    result["wall_s"] = wall
    result["run_load_before"] = load_before
    result["leftover_after_part"] = leftovers
    del stdout
    return result


def plan(peers: list[str], parts: list[str]) -> list[tuple[str, str]]:
    """(peer, part) in run order: part by part, each over every peer, toolpool first and the
    floors right after it. Every ratio is between runs minutes apart at most, not the length of
    a whole run: this machine's speed drifts (a shared host; and a wake-up of an idle vCPU
    costs more than one of a busy one), and the latency target is a ratio to the floor."""
    if "toolpool" in peers and "floor" in peers:
        peers = [p for p in peers if p != "floor"]
        peers.insert(peers.index("toolpool") + 1, "floor")
    if BASELINE in peers and "toolpool" in peers:
        peers = [p for p in peers if p != BASELINE]
        peers.insert(peers.index("toolpool"), BASELINE)
    out = []
    for part in parts:
        for peer in peers:
            if peer == "floor" and part not in FLOOR_PARTS:
                continue
            if part == "map" and peer not in MAP_PEERS:
                continue  # (the baseline's toolpool may have no map: it is not compared)
            out.append((peer, part))
    return out


def machine() -> dict[str, Any]:
    model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    git = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True
        ).stdout
        git["src_dirty"] = bool(status.strip())
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "git": git,
    }


# =========================================================================== numbers


def agg(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _runs(metrics: dict[str, Any] | None, *path: str) -> list[dict[str, Any]]:
    node: Any = metrics
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return []
        node = node[key]
    if isinstance(node, dict):
        return list(node.get("runs", []))
    return []


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        if r.get("ok"):
            by[(r["peer"], r["part"])] = r.get("metrics") or {}
    peers: dict[str, dict[str, Any]] = {}
    for (peer, part), m in by.items():
        s = peers.setdefault(peer, {})
        if peer == "floor":
            _summarize_floor(s, part, m)
            continue
        if part == "throughput":
            for case in ("noop", "echo_10k", "echo_1m"):
                runs = _runs(m, case)
                s[f"{case}_rate"] = agg([x["rate"] for x in runs])
                s[f"{case}_cpu_us"] = agg([x["sup_cpu_us_per_call"] for x in runs])
                s[f"{case}_workers_cpu_us"] = agg(
                    [x["workers_cpu_us_per_call"] for x in runs if "workers_cpu_us_per_call" in x]
                )
                if case != "noop":
                    s[f"{case}_mib_s"] = agg([x["mib_s"] for x in runs])
        elif part == "latency":
            runs = _runs(m, "noop")
            s["p50_us"] = agg([x["p50_us"] for x in runs])
            s["p99_us"] = agg([x["p99_us"] for x in runs])
        elif part == "cold":
            s["cold_ms"] = agg([x["cold_s"] * 1e3 for x in m.get("runs", [])])
            s["import_ms"] = agg([m["import_s"] * 1e3]) if "import_s" in m else None
            workers = (m.get("memory") or {}).get("workers", [])
            s["worker_uss_mib"] = agg([w["uss_mib"] for w in workers])
            s["worker_rss_mib"] = agg([w["rss_mib"] for w in workers])
            s["worker_pss_mib"] = agg([w["pss_mib"] for w in workers if "pss_mib" in w])
            for method in ("fork", "spawn"):
                add_runs = (m.get(f"add_worker_{method}") or {}).get("runs", [])
                s[f"add_worker_{method}_ms"] = agg([x["add_s"] * 1e3 for x in add_runs])
            helpers = (m.get("memory") or {}).get("helpers", [])
            s["helpers"] = [
                {
                    "what": h["what"],
                    "uss_mib": h["uss_mib"],
                    "pss_mib": h.get("pss_mib"),
                    "rss_mib": h["rss_mib"],
                }
                for h in helpers
            ]
        elif part == "stop":
            s["stop"] = _summarize_stop(m)
        elif part == "leaks":
            s["leaks"] = _summarize_leaks(m)
        elif part == "scale":
            s["scale"] = {
                w: agg([x["rate"] for x in v.get("runs", [])])
                for w, v in (m.get("throughput") or {}).items()
            }
            s["scale_cpu_us"] = {
                w: agg([x["sup_cpu_us_per_call"] for x in v.get("runs", [])])
                for w, v in (m.get("throughput") or {}).items()
            }
            s["queued"] = m.get("queued")
        elif part == "map":
            s["map"] = _summarize_map(m)
    return {"peers": peers, "targets": targets(peers)}


#: The rows of part 7 for toolpool, by variant.
TP_MAP_VARIANTS = {
    "sync_map": "SyncPool.map",
    "sync_map_ordered": "SyncPool.map(ordered=True)",
    "async_map": "Pool.map (async)",
    "async_submit": "pool.submit (async: submit all, await each)",
}


def _summarize_map(m: dict[str, Any]) -> dict[str, Any]:
    """{case: {variant: rate agg}}; a peer has one variant, "map"."""
    out: dict[str, Any] = {"how": m.get("how"), "max_in_flight": m.get("max_in_flight")}
    for case in ("noop", "echo_10k"):
        node = m.get(case) or {}
        if "runs" in node:
            out[case] = {"map": agg([x["rate"] for x in node["runs"]])}
        else:
            out[case] = {v: agg([x["rate"] for x in r.get("runs", [])]) for v, r in node.items()}
        if "sync_map" in out[case] and "async_submit" in node:
            pairs = zip(node["sync_map"]["runs"], node["async_submit"]["runs"], strict=True)
            out[case]["sync_map_vs_async_submit"] = agg([a["rate"] / b["rate"] for a, b in pairs])
    return out


def _summarize_floor(s: dict[str, Any], part: str, m: dict[str, Any]) -> None:
    if part == "throughput":
        s["zmq_pipelined_rate"] = agg([x["rate"] for x in _runs(m, "zmq_pipelined")])
    elif part == "latency":
        for case in ("zmq_pingpong", "pipe_pingpong"):
            runs = _runs(m, case)
            s[f"{case}_p50_us"] = agg([x["p50_us"] for x in runs])
            s[f"{case}_p99_us"] = agg([x["p99_us"] for x in runs])
    elif part == "stop":
        for case in ("small", "touched_200m"):
            runs = _runs(m, case)
            s[f"sigkill_{case}_exit_ms"] = agg([x["exit_s"] * 1e3 for x in runs])
            s[f"sigkill_{case}_reaped_ms"] = agg([x["reaped_s"] * 1e3 for x in runs])
    elif part == "cold":
        for case in ("python_pass", "import_zmq_msgpack"):
            s[f"{case}_ms"] = agg([x["cold_s"] * 1e3 for x in _runs(m, case)])


def _ms(trials: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    return agg([t[key] * 1e3 for t in trials if t.get(key) is not None])


def _summarize_stop(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in m.get("trials", []):
        out.setdefault(t.get("mode", "?"), {}).setdefault(t.get("body", "?"), []).append(t)
    summary: dict[str, Any] = {}
    for mode, per_body in out.items():
        for body, trials in per_body.items():
            ok = [t for t in trials if "error" not in t]
            measured = [t for t in ok if t.get("can_stop")]
            summary.setdefault(mode, {})[body] = {
                "trials": len(trials),
                "errors": [t["error"] for t in trials if "error" in t],
                "can_stop": bool(measured) if ok else None,
                "how": next((t.get("how") for t in ok if t.get("how")), None),
                "result_ms": _ms(measured, "result_s"),
                "exit_ms": _ms(measured, "worker_exit_s"),
                "next_ms": _ms(measured, "next_s"),
                "body_end_ms": _ms(measured, "body_end_s"),
                "result_kinds": sorted({str(t.get("result_kind")) for t in measured}),
                "stopped": sum(1 for t in measured if t.get("stopped")),
                "no_result": sum(1 for t in measured if t.get("result_s") is None),
                "no_next": sum(1 for t in measured if t.get("next_s") is None),
                "result_before_exit": sum(1 for t in measured if t.get("result_before_exit")),
                "stop_call_hung": sum(1 for t in measured if t.get("stop_call_hung")),
                "harness_killed": sum(len(t.get("harness_killed") or []) for t in trials),
                "measured": len(measured),
            }
    return summary


def _summarize_leaks(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in m.get("trials", []):
        key = f"{t.get('body')}/{t.get('mode')}"
        out[key] = {
            "body": t.get("body"),
            "mode": t.get("mode"),
            "error": t.get("error"),
            "spawned": t.get("spawned"),
            "at_result": None
            if t.get("survivors_at_result") is None
            else len(t["survivors_at_result"]),
            "after_stop": len(t.get("survivors_after_stop") or []),
            "after_close": len(t.get("survivors_after_close") or []),
            "leaked": t.get("leaked"),
            "how": t.get("how"),
        }
    return out


def _med(x: dict[str, float] | None) -> float | None:
    return None if not x else x["median"]


def targets(peers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Where toolpool stands against each target of the issue (from this run only)."""
    tp = peers.get("toolpool", {})
    floor = peers.get("floor", {})
    others = {k: v for k, v in peers.items() if k not in ("toolpool", "floor", BASELINE)}
    out: list[dict[str, Any]] = []

    def add(name: str, value: Any, goal: str, met: bool | None, note: str = "") -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": met, "note": note})

    best = max(
        ((k, _med(v.get("noop_rate"))) for k, v in others.items() if _med(v.get("noop_rate"))),
        key=lambda kv: kv[1] or 0,
        default=(None, None),
    )
    tp_rate = _med(tp.get("noop_rate"))
    if tp_rate and best[1]:
        ratio = tp_rate / best[1]
        add(
            "no-op throughput >= best peer",
            f"{tp_rate:,.0f}/s vs {best[0]} {best[1]:,.0f}/s (x{ratio:.2f})",
            ">= x1.00",
            ratio >= 1.0,
        )
    tp_p50, zmq_p50 = _med(tp.get("p50_us")), _med(floor.get("zmq_pingpong_p50_us"))
    if tp_p50 and zmq_p50:
        ratio = tp_p50 / zmq_p50
        add(
            "latency p50 <= 1.3x raw zmq ping-pong",
            f"{tp_p50:.0f} us vs {zmq_p50:.0f} us (x{ratio:.2f})",
            "<= x1.30",
            ratio <= 1.3,
        )
    stop = tp.get("stop", {})
    coop = _med((stop.get("cancel", {}).get("coop") or {}).get("result_ms"))
    if coop is not None:
        add("cooperative cancel to settled, p50", f"{coop:.1f} ms", "< 5 ms", coop < 5)
    force = stop.get("force", {})
    force_results = [t for b in force.values() for t in [b.get("result_ms")] if t]
    if force_results:
        worst = max(r["median"] for r in force_results)
        best_b = min(r["median"] for r in force_results)
        add(
            "forced kill to settled (tree gone), p50",
            f"{best_b:.1f}-{worst:.1f} ms over bodies",
            "< 20 ms",
            worst < 20,
        )
    nexts = [b.get("next_ms") for b in force.values() if b.get("next_ms")]
    if nexts:
        worst = max(r["median"] for r in nexts)
        add(
            "next call served after a kill",
            f"{min(r['median'] for r in nexts):.0f}-{worst:.0f} ms over bodies",
            "< 50 ms",
            worst < 50,
            "other worker busy, so the replacement serves it",
        )
    cold = _med(tp.get("cold_ms"))
    if cold is not None:
        add(
            "worker cold start to ready",
            f"{cold:.0f} ms (pool of 2, to first result)",
            "< 150 ms",
            cold < 150,
        )
    add_fork = _med(tp.get("add_worker_fork_ms"))
    if add_fork is not None:
        add_spawn = _med(tp.get("add_worker_spawn_ms"))
        peer_cold = [
            f"{PEER_LABEL.get(name, name)} x{add_fork / c:.2f}"
            for name, v in others.items()
            if (c := _med(v.get("cold_ms")))
        ]
        detail = f"{add_fork:.1f} ms to add one worker (spawn: {add_spawn or float('nan'):.0f} ms)"
        if peer_cold:
            detail += "; vs peers' cold start " + ", ".join(peer_cold)
        add("cold start with a pre-started template", detail, "< 20 ms", add_fork < 20)
    uss = _med(tp.get("worker_uss_mib"))
    if uss is not None:
        add("idle worker USS", f"{uss:.1f} MiB", "< 15 MiB", uss < 15)
    scale = tp.get("scale") or {}
    if scale.get("1") and scale.get("2"):
        r1, r2 = scale["1"]["median"], scale["2"]["median"]
        add(
            "throughput scales with workers (to 2 cores)",
            f"1 worker {r1:,.0f}/s, 2 workers {r2:,.0f}/s (x{r2 / r1:.2f})",
            "> x1 from 1 to 2 workers",
            r2 > r1 * 1.1,
        )
    tp_map = (tp.get("map") or {}).get("noop") or {}
    ratios = tp_map.get("sync_map_vs_async_submit")
    if ratios:
        sync_rate, async_rate = _med(tp_map.get("sync_map")), _med(tp_map.get("async_submit"))
        add(
            "SyncPool.map no-op throughput >= 0.8x the async pool.submit path",
            f"{sync_rate or 0:,.0f}/s vs {async_rate or 0:,.0f}/s "
            f"(x{ratios['median']:.2f} [{ratios['min']:.2f}-{ratios['max']:.2f}] run by run)",
            ">= x0.80",
            ratios["median"] >= 0.8,
            "same pool, interleaved runs (part 7)",
        )
    cpu = _med(tp.get("noop_cpu_us"))
    if cpu is not None:
        workers_cpu = _med(tp.get("noop_workers_cpu_us"))
        extra = "" if workers_cpu is None else f"; workers {workers_cpu:.0f} us"
        add(
            "supervisor CPU per call (reported)",
            f"{cpu:.0f} us per no-op call{extra}",
            "reported",
            None,
        )
    killed_early = sum(
        b.get("result_before_exit", 0)
        for mode in ("cancel", "force")
        for b in stop.get(mode, {}).values()
        if any(k == "killed" for k in b.get("result_kinds", []))
    )
    if stop:
        add(
            "no result before the worker exited, on killed",
            f"{killed_early} trial(s) with the result first",
            "0",
            killed_early == 0,
        )
    leaks = tp.get("leaks")
    if leaks:
        leaked = {k: v for k, v in leaks.items() if v.get("after_close") or v.get("leaked")}
        at_result = {k: v["at_result"] for k, v in leaks.items() if v.get("at_result")}
        note = ""
        if at_result:
            note = "alive when the result came: " + ", ".join(
                f"{k}: {v}" for k, v in at_result.items()
            )
        add(
            "no leaked process in part 4 (incl. the double-forked daemon)",
            f"{len(leaked)} of {len(leaks)} trials leaked",
            "0",
            not leaked,
            note,
        )
    return out


# =========================================================================== markdown


def fmt(a: dict[str, float] | None, digits: int = 0, scale: float = 1.0) -> str:
    if not a:
        return "-"
    f = f"{{:,.{digits}f}}"
    med = f.format(a["median"] * scale)
    if a["n"] == 1 or a["min"] == a["max"]:
        return med
    return f"{med} [{f.format(a['min'] * scale)}-{f.format(a['max'] * scale)}]"


def ratio(tp: dict[str, float] | None, peer: dict[str, float] | None) -> str:
    if not tp or not peer or not peer["median"]:
        return "-"
    return f"{tp['median'] / peer['median']:.2f}"


def before_after(
    base: dict[str, Any], tp: dict[str, Any], floor: dict[str, Any], python: str | None
) -> list[str]:
    """toolpool under --baseline's interpreter (before) and this one (after), from one run."""

    def stop(s: dict[str, Any], mode: str, what: str) -> dict[str, float] | None:
        bodies = (s.get("stop") or {}).get(mode) or {}
        runs = [b.get(what) for b in bodies.values() if b.get(what)]
        if not runs:
            return None
        values = [r["median"] for r in runs]  # a median per body: their median, range
        return {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "n": len(values),
        }

    rows = [
        ("no-op calls/s (2 workers)", "noop_rate", 0),
        ("10 KiB echo calls/s", "echo_10k_rate", 0),
        ("1 MiB echo MiB/s", "echo_1m_mib_s", 0),
        ("latency p50 us", "p50_us", 0),
        ("latency p99 us", "p99_us", 0),
        ("workers' CPU us per no-op call", "noop_workers_cpu_us", 0),
        ("supervisor CPU us per no-op call", "noop_cpu_us", 0),
        ("cold start ms", "cold_ms", 0),
        ("idle worker USS MiB", "worker_uss_mib", 1),
    ]
    lines = [
        "## Before and after (toolpool under --baseline, then this toolpool)",
        "",
        f"- baseline interpreter: `{python}`",
        "",
        "| figure | before | after | after / before |",
        "| --- | --- | --- | --- |",
    ]
    for label, key, digits in rows:
        lines.append(
            f"| {label} | {fmt(base.get(key), digits)} | {fmt(tp.get(key), digits)} | "
            f"{ratio(tp.get(key), base.get(key))} |"
        )
    for label, mode, what in (
        ("cooperative cancel -> settled ms (median over bodies)", "cancel", "result_ms"),
        ("forced kill -> settled ms (median over bodies)", "force", "result_ms"),
        ("next call after a kill ms (median over bodies)", "force", "next_ms"),
    ):
        b, a = stop(base, mode, what), stop(tp, mode, what)
        lines.append(f"| {label} | {fmt(b, 1)} | {fmt(a, 1)} | {ratio(a, b)} |")
    zmq = floor.get("zmq_pingpong_p50_us")
    if zmq:
        lines.append(
            f"| p50 / zmq ping-pong p50 ({fmt(zmq)} us) | {ratio(base.get('p50_us'), zmq)} | "
            f"{ratio(tp.get('p50_us'), zmq)} | |"
        )
    lines.append("")
    return lines


def markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    summary = doc["summary"]
    peers = summary["peers"]
    order = [p for p in PEERS if p in peers and p != "floor"]
    lines = [
        "# toolpool benchmark",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']['nproc']} cores, {meta['machine']['cpu_model']}, "
        f"{meta['machine']['memory_gib']} GiB; Python {meta['machine']['python']}",
        f"- git: {_git_text(meta['machine']['git'])}",
        f"- load average (1, 5, 15 min): before {meta['load_before']}, after "
        f"{meta['load_after']}; the machine is shared, so expect 20-30% run-to-run spread",
        f"- size: {meta['size']}; {meta['workers']} workers per pool; wall time "
        f"{meta['elapsed_s']:.0f} s",
        "- cells are medians over repeats with [min-max]; ratios are toolpool / peer, "
        "from this run",
        "",
    ]
    failed = [r for r in doc["results"] if not r.get("ok")]
    if failed:
        lines += [
            "**Parts that failed:** " + ", ".join(f"{r['peer']}/{r['part']}" for r in failed),
            "",
        ]
    leftovers = [r for r in doc["results"] if r.get("leftover_after_part")]
    lines += [
        "**Processes left after a part** (found by the run, then killed): "
        + (
            ", ".join(
                f"{r['peer']}/{r['part']}: {len(r['leftover_after_part'])}" for r in leftovers
            )
            if leftovers
            else "none"
        ),
        "",
    ]

    lines += [
        "## Targets",
        "",
        "| target | toolpool now | goal | met |",
        "| --- | --- | --- | --- |",
    ]
    for t in summary["targets"]:
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(f"| {t['target']} | {t['value']}{note} | {t['goal']} | {met} |")
    lines.append("")

    lines += [
        "## Per-call cost (parts 1, 2, 5)",
        "",
        "| peer | no-op calls/s | 10 KiB echo calls/s | 1 MiB echo MiB/s | supervisor CPU us/no-op "
        "| workers' CPU us/no-op | latency p50 us | p99 us | cold start ms | idle worker USS MiB "
        "| PSS MiB | RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in order:
        s = peers[p]
        lines.append(
            f"| {PEER_LABEL[p]} | {fmt(s.get('noop_rate'))} | {fmt(s.get('echo_10k_rate'))} | "
            f"{fmt(s.get('echo_1m_mib_s'))} | {fmt(s.get('noop_cpu_us'))} | "
            f"{fmt(s.get('noop_workers_cpu_us'))} | {fmt(s.get('p50_us'))} | "
            f"{fmt(s.get('p99_us'))} | {fmt(s.get('cold_ms'))} | "
            f"{fmt(s.get('worker_uss_mib'), 1)} | {fmt(s.get('worker_pss_mib'), 1)} | "
            f"{fmt(s.get('worker_rss_mib'), 1)} |"
        )
    lines.append("")
    tp = peers.get("toolpool")
    if tp:
        lines += [
            "Ratios toolpool / peer (throughput: above 1 is better; latency, cold start, memory: "
            "below 1 is better):",
            "",
            "| peer | no-op calls/s | 10 KiB | 1 MiB | p50 | p99 | cold start | worker USS "
            "| worker PSS | add one worker (template) / peer's cold start |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p in order:
            if p == "toolpool":
                continue
            s = peers[p]
            lines.append(
                f"| {PEER_LABEL[p]} | {ratio(tp.get('noop_rate'), s.get('noop_rate'))} | "
                f"{ratio(tp.get('echo_10k_rate'), s.get('echo_10k_rate'))} | "
                f"{ratio(tp.get('echo_1m_mib_s'), s.get('echo_1m_mib_s'))} | "
                f"{ratio(tp.get('p50_us'), s.get('p50_us'))} | "
                f"{ratio(tp.get('p99_us'), s.get('p99_us'))} | "
                f"{ratio(tp.get('cold_ms'), s.get('cold_ms'))} | "
                f"{ratio(tp.get('worker_uss_mib'), s.get('worker_uss_mib'))} | "
                f"{ratio(tp.get('worker_pss_mib'), s.get('worker_pss_mib'))} | "
                f"{ratio(tp.get('add_worker_fork_ms'), s.get('cold_ms'))} |"
            )
        lines.append("")
    base = peers.get(BASELINE)
    if tp and base:
        lines += before_after(base, tp, peers.get("floor") or {}, meta.get("baseline"))
    fl = peers.get("floor")
    if fl:
        lines += [
            "## Floors",
            "",
            "| floor | value |",
            "| --- | --- |",
            f"| raw pyzmq DEALER/ROUTER ipc ping-pong, msgpack, p50 / p99 us | "
            f"{fmt(fl.get('zmq_pingpong_p50_us'))} / {fmt(fl.get('zmq_pingpong_p99_us'))} |",
            f"| raw pyzmq pipelined (window 1000), msg/s | {fmt(fl.get('zmq_pipelined_rate'))} |",
            f"| multiprocessing.Pipe ping-pong p50 / p99 us | "
            f"{fmt(fl.get('pipe_pingpong_p50_us'))} / {fmt(fl.get('pipe_pingpong_p99_us'))} |",
            f"| SIGKILL to exit, small child, ms | {fmt(fl.get('sigkill_small_exit_ms'), 2)} |",
            f"| SIGKILL to exit, 200 MiB touched, ms | "
            f"{fmt(fl.get('sigkill_touched_200m_exit_ms'), 1)} |",
            f"| `python -c pass`, ms | {fmt(fl.get('python_pass_ms'))} |",
            f"| `python -c 'import zmq, msgpack'`, ms | {fmt(fl.get('import_zmq_msgpack_ms'))} |",
            "",
        ]
    lines += _stop_tables(peers, order)
    lines += _leak_table(peers, order)
    lines += _scale_tables(peers, order)
    lines += _map_table(peers, order)
    charts = doc.get("charts") or []
    if charts:
        lines += ["## Charts", ""] + [f"![{c}]({c})" for c in charts] + [""]
    elif doc.get("charts_skipped"):
        lines += [f"Charts skipped: {doc['charts_skipped']}", ""]
    return "\n".join(lines)


def _git_text(git: dict[str, Any]) -> str:
    if not git:
        return "unknown"
    dirty = " + uncommitted changes in src/" if git.get("src_dirty") else ""
    return f"commit {git.get('commit', '?')}{dirty}"


BODY_TEXT = {
    "coop": "cooperates (toolpool: waits on its cancel signal; peers: an interruptible "
    "Python sleep, the most a peer's body can do)",
    "busy": "busy-loops in Python, looking at nothing",
    "ignore_term": "ignores SIGTERM, then sleeps (only SIGKILL stops it)",
    "swallow": "catches every exception (including the pool's own) and goes on",
    "c_call": "sits in one C call holding the GIL: `sum(itertools.repeat(0, 10**12))`",
}


def _stop_tables(peers: dict[str, Any], order: list[str]) -> list[str]:
    rows = [(p, peers[p]["stop"]) for p in order if peers[p].get("stop")]
    if not rows:
        return []
    lines = [
        "## Stopping a running call (part 3)",
        "",
        "Times from the stop request, in ms: to the result reported, to the worker process "
        "exiting, to the next call served (submitted right after the stop, while the pool's "
        "other worker is busy, so the stopped worker or its replacement must serve it). "
        "'result first' counts trials whose result came while the worker was still running; "
        "'stopped' counts trials where the body ended or its worker exited within the window. "
        "'-' is never within the window.",
        "",
    ]
    bodies = []
    for _, st in rows:
        for per_body in st.values():
            for b in per_body:
                if b not in bodies:
                    bodies.append(b)
    for body in bodies:
        lines += [
            f"### `{body}`: {BODY_TEXT.get(body, body)}",
            "",
            "| peer | stop | result ms | worker exit ms | next call ms | result | result first "
            "| stopped |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p, st in rows:
            for mode, per_body in st.items():
                b = per_body.get(body)
                if not b:
                    continue
                if b.get("errors") and not b.get("measured") and b.get("can_stop") is None:
                    lines.append(f"| {PEER_LABEL[p]} | {mode} | error: {b['errors'][0][:80]} |||||")
                    continue
                if not b.get("can_stop"):
                    lines.append(
                        f"| {PEER_LABEL[p]} | {mode} | cannot stop a running task "
                        f"({b.get('how')}) | | | | | |"
                    )
                    continue
                n = b["measured"]
                hung = f", stop call hung {b['stop_call_hung']}/{n}" if b["stop_call_hung"] else ""
                lines.append(
                    f"| {PEER_LABEL[p]} | {mode} | {fmt(b['result_ms'], 1)} | "
                    f"{fmt(b['exit_ms'], 1)} | {fmt(b['next_ms'], 1)} | "
                    f"{'/'.join(b['result_kinds'])} | {b['result_before_exit']}/{n} | "
                    f"{b['stopped']}/{n}{hung} |"
                )
        lines.append("")
    hows = {}
    for p, st in rows:
        for mode, per_body in st.items():
            for b in per_body.values():
                if b.get("how"):
                    hows[(p, mode)] = b["how"]
    lines += ["How each peer was asked to stop:", ""]
    lines += [f"- {PEER_LABEL[p]} `{mode}`: {how}" for (p, mode), how in hows.items()]
    lines.append("")
    return lines


def _leak_table(peers: dict[str, Any], order: list[str]) -> list[str]:
    rows = [(p, peers[p]["leaks"]) for p in order if peers[p].get("leaks")]
    if not rows:
        return []
    lines = [
        "## Leaks (part 4)",
        "",
        "Processes the body started that are still alive: when the result came (toolpool), "
        "after the stop, and after the pool was closed (these the harness then killed).",
        "",
        "| peer | body/stop | spawned | at result | after stop | after close |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p, leaks in rows:
        for key, v in leaks.items():
            if v.get("error"):
                lines.append(f"| {PEER_LABEL[p]} | {key} | error: {v['error'][:80]} | | | |")
                continue
            at = "-" if v["at_result"] is None else v["at_result"]
            after_close = v["after_close"]
            mark = f"**{after_close}**" if after_close else "0"
            lines.append(
                f"| {PEER_LABEL[p]} | {key} | {v['spawned']} | {at} | {v['after_stop']} | {mark} |"
            )
    lines.append("")
    return lines


def _scale_tables(peers: dict[str, Any], order: list[str]) -> list[str]:
    lines: list[str] = []
    scaled = [(p, peers[p]["scale"]) for p in order if peers[p].get("scale")]
    if scaled:
        workers = sorted({w for _, s in scaled for w in s}, key=int)
        lines += [
            "## Scale (part 6)",
            "",
            "No-op calls/s by worker count (2 cores):",
            "",
            "| peer | " + " | ".join(f"{w} workers" for w in workers) + " |",
            "| --- | " + " | ".join("---" for _ in workers) + " |",
        ]
        for p, s in scaled:
            lines.append(
                f"| {PEER_LABEL[p]} | " + " | ".join(fmt(s.get(w)) for w in workers) + " |"
            )
        tp_cpu = peers.get("toolpool", {}).get("scale_cpu_us") or {}
        if tp_cpu:
            lines += [
                "",
                "toolpool supervisor CPU per call (us): "
                + ", ".join(f"{w} workers {fmt(tp_cpu.get(w))}" for w in workers),
            ]
        lines.append("")
    queued = [(p, peers[p]["queued"]) for p in order if peers[p].get("queued")]
    if queued:
        lines += [
            "Supervisor memory with calls queued behind two busy workers:",
            "",
            "| peer | queued calls | submit time s | RSS growth MiB | USS growth MiB "
            "| bytes/call |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for p, q in queued:
            lines.append(
                f"| {PEER_LABEL[p]} | {q['n']:,} | {q['submit_s']:.2f} | "
                f"{q.get('rss_delta_mib', float('nan')):.1f} | "
                f"{q.get('uss_delta_mib', float('nan')):.1f} | "
                f"{q.get('bytes_per_call', float('nan')):,.0f} |"
            )
        lines.append("")
    return lines


def _map_table(peers: dict[str, Any], order: list[str]) -> list[str]:
    rows = [(p, peers[p]["map"]) for p in order if peers[p].get("map")]
    if not rows:
        return []
    lines = [
        "## map over an iterable (part 7)",
        "",
        "Calls/s, results consumed as they come, each pool's own map with its defaults "
        "(chunksize 1). toolpool's four rows share one pool and run interleaved, repeat by "
        "repeat; the async rows run in the SyncPool's own event-loop thread.",
        "",
        "| pool | how | no-op calls/s | 10 KiB echo calls/s |",
        "| --- | --- | --- | --- |",
    ]
    for p, m in rows:
        if p == "toolpool":
            for variant, label in TP_MAP_VARIANTS.items():
                lines.append(
                    f"| toolpool | {label} | {fmt((m.get('noop') or {}).get(variant))} | "
                    f"{fmt((m.get('echo_10k') or {}).get(variant))} |"
                )
            continue
        lines.append(
            f"| {PEER_LABEL[p]} | {m.get('how') or '-'} | "
            f"{fmt((m.get('noop') or {}).get('map'))} | "
            f"{fmt((m.get('echo_10k') or {}).get('map'))} |"
        )
    tp = peers.get("toolpool", {}).get("map")
    if tp:
        noop, echo = tp.get("noop") or {}, tp.get("echo_10k") or {}
        lines += [
            "",
            "SyncPool.map / async pool.submit, run by run: no-op "
            f"{fmt(noop.get('sync_map_vs_async_submit'), 2)}, 10 KiB "
            f"{fmt(echo.get('sync_map_vs_async_submit'), 2)} "
            f"(max_in_flight {tp.get('max_in_flight')}).",
            "",
            "| SyncPool.map / peer | no-op | 10 KiB |",
            "| --- | --- | --- |",
        ]
        for p, m in rows:
            if p == "toolpool":
                continue
            lines.append(
                f"| {PEER_LABEL[p]} | "
                f"{ratio(noop.get('sync_map'), (m.get('noop') or {}).get('map'))} | "
                f"{ratio(echo.get('sync_map'), (m.get('echo_10k') or {}).get('map'))} |"
            )
    lines.append("")
    return lines


# =========================================================================== charts


def charts(doc: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = doc["summary"]["peers"]
    order = [p for p in PEERS if p in peers and p != "floor"]
    made = []

    def bars(key: str, title: str, ylabel: str, fname: str, floor_key: str | None = None) -> None:
        names, med, lo, hi = [], [], [], []
        for p in order:
            a = peers[p].get(key)
            if a:
                names.append(PEER_LABEL[p])
                med.append(a["median"])
                lo.append(a["median"] - a["min"])
                hi.append(a["max"] - a["median"])
        if not names:
            return
        fig, ax = plt.subplots(figsize=(9, 4))
        colors = ["#d62728" if n == "toolpool" else "#1f77b4" for n in names]
        ax.bar(names, med, yerr=[lo, hi], color=colors, capsize=3)
        if floor_key and peers.get("floor", {}).get(floor_key):
            v = peers["floor"][floor_key]["median"]
            ax.axhline(v, color="gray", linestyle="--", label=f"floor {v:,.0f}")
            ax.legend()
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname), dpi=90)
        plt.close(fig)
        made.append(fname)

    bars("noop_rate", "No-op throughput, 2 workers (median, min-max)", "calls/s", "throughput.png")
    bars(
        "p50_us",
        "Sequential latency p50, 2 workers",
        "microseconds",
        "latency.png",
        floor_key="zmq_pingpong_p50_us",
    )
    bars("cold_ms", "Cold start: pool created to first result", "ms", "cold_start.png")

    stops = [(p, peers[p]["stop"]) for p in order if peers[p].get("stop")]
    if stops:
        bodies = []
        for _, st in stops:
            for per_body in st.values():
                bodies += [b for b in per_body if b not in bodies]
        fig, axes = plt.subplots(1, len(bodies), figsize=(4 * len(bodies), 5), sharey=True)
        if len(bodies) == 1:
            axes = [axes]
        for ax, body in zip(axes, bodies, strict=True):
            labels, result, gone, nxt = [], [], [], []
            for p, st in stops:
                for mode, per_body in st.items():
                    b = per_body.get(body)
                    if not b or not b.get("can_stop"):
                        continue
                    labels.append(f"{PEER_LABEL[p]} {mode}")
                    result.append((b.get("result_ms") or {}).get("median", float("nan")))
                    gone.append((b.get("exit_ms") or {}).get("median", float("nan")))
                    nxt.append((b.get("next_ms") or {}).get("median", float("nan")))
            y = range(len(labels))
            ax.barh([i - 0.27 for i in y], result, height=0.27, label="to result")
            ax.barh(list(y), gone, height=0.27, label="to worker exit")
            ax.barh([i + 0.27 for i in y], nxt, height=0.27, label="to next call")
            ax.set_yticks(list(y))
            ax.set_yticklabels(labels, fontsize=7)
            ax.set_xscale("log")
            ax.set_title(body)
            ax.set_xlabel("ms after the stop request (log)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "stop.png"), dpi=90)
        plt.close(fig)
        made.append("stop.png")

    scaled = [(p, peers[p]["scale"]) for p in order if peers[p].get("scale")]
    if scaled:
        fig, ax = plt.subplots(figsize=(6, 4))
        for p, s in scaled:
            ws = sorted(s, key=int)
            ax.plot(
                [int(w) for w in ws],
                [s[w]["median"] if s[w] else float("nan") for w in ws],
                marker="o",
                label=PEER_LABEL[p],
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers (2 cores)")
        ax.set_ylabel("no-op calls/s")
        ax.set_title("Throughput by worker count")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "scale.png"), dpi=90)
        plt.close(fig)
        made.append("scale.png")
    return made


# =========================================================================== main


def parse_list(
    text: str | None, allowed: list[str], names: dict[str, str] | None = None
) -> list[str]:
    if not text:
        return list(allowed)
    out = []
    for item in text.split(","):
        item = item.strip()
        if names:
            item = names.get(item, item)
        if item not in allowed:
            raise SystemExit(f"unknown {item!r}; choose from {', '.join(allowed)}")
        out.append(item)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; well under a minute")
    parser.add_argument("--peers", help="comma-separated, from: " + ",".join(PEERS))
    parser.add_argument(
        "--parts", help="comma-separated numbers or names: 1-7 or " + ",".join(PARTS.values())
    )
    parser.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    parser.add_argument("--name", default="latest", help="base name of the output files")
    parser.add_argument("--no-charts", action="store_true")
    parser.add_argument("--part-timeout", type=float, help="seconds for one (peer, part)")
    parser.add_argument(
        "--baseline", help="a python whose toolpool runs beside this one's (before/after)"
    )
    args = parser.parse_args(argv)
    peers = parse_list(args.peers, list(PEERS))
    if args.baseline and "toolpool" in peers:
        peers.append(BASELINE)
    parts = parse_list(args.parts, list(PARTS.values()), PARTS)
    size = "smoke" if args.smoke else "full"
    timeout = args.part_timeout or PART_TIMEOUT[size]
    os.makedirs(args.out_dir, exist_ok=True)
    subreaper = become_subreaper()

    missing = {}
    for peer in peers:
        module = PEER_MODULES.get(peer)
        if module and importlib.util.find_spec(module) is None:
            missing[peer] = f"module {module!r} is not installed (make bench installs .[bench])"
    runnable = [p for p in peers if p not in missing]

    started = time.perf_counter()
    meta: dict[str, Any] = {
        "baseline": args.baseline,
        "command": " ".join(
            shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]
        ),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "size": size,
        "workers": 2,
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "subreaper": subreaper,
        "peers": peers,
        "parts": parts,
        "missing": missing,
    }
    results = []
    for peer, part in plan(runnable, parts):
        t0 = time.perf_counter()
        r = run_part(peer, part, args.smoke, timeout, args.baseline)
        status = "ok" if r.get("ok") else "FAILED"
        left = len(r.get("leftover_after_part") or [])
        print(
            f"{peer:>14} {part:<10} {status:6} {time.perf_counter() - t0:6.1f}s"
            f"  load {r['run_load_before'][0]:.2f}" + (f"  LEFTOVER {left}" if left else ""),
            flush=True,
        )
        if not r.get("ok"):
            print(
                ("    " + (r.get("error") or "").strip()[-600:]).replace("\n", "\n    "), flush=True
            )
        results.append(r)
    meta["load_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["elapsed_s"] = time.perf_counter() - started
    doc: dict[str, Any] = {"meta": meta, "summary": summarize(results), "results": results}
    if not args.no_charts:
        try:
            doc["charts"] = charts(doc, args.out_dir)
        except ImportError as exc:
            doc["charts_skipped"] = f"matplotlib is not installed ({exc})"
    json_path = os.path.join(args.out_dir, f"{args.name}.json")
    md_path = os.path.join(args.out_dir, f"{args.name}.md")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(md_path, "w") as f:
        f.write(markdown(doc) + "\n")
    wrote = f"{os.path.relpath(json_path)} and {os.path.relpath(md_path)}"
    print(f"wrote {wrote} in {meta['elapsed_s']:.0f}s")
    for t in doc["summary"]["targets"]:
        met = {True: "met", False: "SHORT", None: ""}[t["met"]]
        print(f"  {t['target']}: {t['value']} (goal {t['goal']}) {met}")
    reap_zombies()
    failed = [r for r in results if not r.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
